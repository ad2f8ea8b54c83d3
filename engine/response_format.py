"""Constrained answers: a JSON schema, a list of choices or a regular expression that every answer of
a job (or of one row) must follow, enforced while decoding by vLLM's structured outputs.

Checked when the job is declared or the row is planned, never first discovered by the engine."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .setting_text import one_line


class ResponseFormat(BaseModel):
    """Exactly one of ``json_schema``, ``choice``, ``regex``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    json_schema: dict[str, Any] | None = Field(None, description="answers are JSON values valid against this schema")
    choice: list[str] | None = Field(None, description="answers are exactly one of these strings")
    regex: str | None = Field(None, description="answers match this regular expression")

    @model_validator(mode="after")
    def _one_valid_constraint(self) -> "ResponseFormat":
        given = [name for name in ("json_schema", "choice", "regex") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"a response_format needs exactly one of json_schema, choice, regex (got {given or 'none'})"
            )
        if self.json_schema is not None:
            import jsonschema

            try:
                jsonschema.validators.validator_for(self.json_schema).check_schema(self.json_schema)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"invalid JSON schema: {exc.message}") from None
        if self.choice is not None:
            _check_choices(self.choice)
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"invalid regex {self.regex!r}: {exc}") from None
        return self

    @classmethod
    def from_text(cls, text: str) -> "ResponseFormat":
        """A row's ``response_format`` column: JSON such as ``{"choice": ["yes", "no"]}``."""
        try:
            return cls.model_validate(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ValueError(f"response_format is not JSON: {exc}") from None
        except ValidationError as exc:
            raise ValueError(one_line(exc)) from None

    def to_text(self) -> str:
        return json.dumps(self.model_dump(exclude_none=True), sort_keys=True)

    def vllm_params(self):
        """The constraint as vLLM's ``StructuredOutputsParams``."""
        from vllm.sampling_params import StructuredOutputsParams

        return StructuredOutputsParams(json=self.json_schema, choice=self.choice, regex=self.regex)

    def violation(self, answer: str) -> str | None:
        """Why ``answer`` does not follow the format (None: it does). A row cut off by ``max_tokens``
        fails here: a constraint shapes the answer, it does not make it fit."""
        if self.choice is not None:
            return None if answer in self.choice else f"{answer[:40]!r} is not one of the choices"
        if self.regex is not None:
            return None if re.fullmatch(self.regex, answer) else f"{answer[:40]!r} does not match the regex"
        import jsonschema

        try:
            value = json.loads(answer)
        except json.JSONDecodeError as exc:
            return f"not JSON: {exc.msg}"
        error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(self.json_schema)(
            self.json_schema).iter_errors(value))
        return None if error is None else f"not valid against the schema: {error.message}"

    def most_answer_tokens(self) -> int | None:
        """The most output tokens a valid answer can take, where the format bounds it: a choice,
        spelled a byte per token (vLLM's grammar lets the model spell it in any tokens, not just the
        tokenizer's own: a random or unsure model does), then the end of the answer. None for a
        schema or a regex (unbounded: a cut-off answer becomes an error row)."""
        if self.choice is None:
            return None
        return max(len(c.encode("utf-8")) for c in self.choice) + 1


CUT_OFF = "cut off at max_tokens"
STOPPED = "ended by the stop string"


def proved_complete(response_format: ResponseFormat, text: str) -> str | None:
    """Why ``text``, an answer that ended before its format let it end (cut at ``max_tokens``, or
    at a stop string), is not proved complete (None: it is). Proved complete: a choice that no
    other choice extends (``no`` is not, beside ``not sure``), or a closed JSON value (an object,
    array, string, true, false or null) valid against the schema: text after it could not be
    JSON. A number could still grow (``12`` of ``123``), and a regex match could too (``[0-9]+``
    cut at ``12``): never proved."""
    why = response_format.violation(text)
    if why is not None:
        return why
    if response_format.choice is not None:
        longer = [c for c in response_format.choice if c != text and c.startswith(text)]
        return f"{text!r} may be the start of {longer[0]!r}" if longer else None
    if response_format.regex is not None:
        return f"{text[:40]!r} matches the regex, but a longer answer might too"
    closed = text.rstrip()[-1:] in ("}", "]", '"') or text.strip() in ("true", "false", "null")
    return None if closed else f"{text[:40]!r} is a JSON number, which a longer answer might extend"


def cut_off_reason(response_format: ResponseFormat | None, text: str, finish_reason: str | None,
                   max_tokens: int, stop_reason: int | str | None = None) -> str | None:
    """Why a constrained answer is not an answer (None: it is, or it is unconstrained). An answer
    that ended by itself (the model's end of sequence, which vLLM's grammar allows only where the
    format is complete) is one; one that ended at ``max_tokens`` or at a stop string is one only
    where ``proved_complete`` proves it."""
    if response_format is None:
        return None
    if finish_reason == "length":
        ended = f"{CUT_OFF} ({max_tokens})"
    elif finish_reason == "stop" and isinstance(stop_reason, str):
        ended = f"{STOPPED} {stop_reason!r}"
    else:
        return None
    why = proved_complete(response_format, text or "")
    return None if why is None else f"{ended} before the answer was complete: {why}"


def _check_choices(choices: list[str]) -> None:
    """A choice list a job can mean: two or more distinct non-empty strings. One choice answers every
    row with it (at probability 1.0 when scored, checks green); a repeated one is a typo."""
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"choice {choices} must hold non-empty strings")
    repeated = sorted({c for c in choices if choices.count(c) > 1})
    if repeated:
        raise ValueError(f"choice {choices} repeats {', '.join(map(repr, repeated))}: list each answer once")
    if len(choices) < 2:
        raise ValueError(f"choice {choices} needs at least two answers: with one, every row gets it")
