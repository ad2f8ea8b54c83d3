"""A named choice of a setting (an enum whose text is what YAML and the CLI take)."""

from __future__ import annotations

import enum


class Policy(str, enum.Enum):
    """A named choice. ``parse`` is the one place a text becomes a policy; a typo lists the choices."""

    @classmethod
    def parse(cls, value: "str | Policy") -> "Policy":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"{cls.__name__} must be one of {choices}, not {value!r}") from None

    def __str__(self) -> str:
        return self.value
