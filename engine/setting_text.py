"""How a setting's text is read and its mistakes said: a named choice whose text is what YAML and
the CLI take (``Policy``), and pydantic's validation errors as one line a user reads (the CLI prints
no tracebacks)."""

from __future__ import annotations

import enum

from pydantic import ValidationError


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


def one_line(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) + ': ' if e['loc'] else ''}{e['msg'].removeprefix('Value error, ')}"
        for e in exc.errors()
    )
