"""Constrained answers: a JSON schema, a list of choices or a regular expression that every answer of
a job (or of one row) must follow, enforced while decoding by vLLM's structured outputs.

Checked when the job is declared or the row is planned, never first discovered by the engine."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .validation import one_line


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
            raise ValueError(f"a response_format needs exactly one of json_schema, choice, regex (got {given or 'none'})")
        if self.json_schema is not None:
            import jsonschema

            try:
                jsonschema.validators.validator_for(self.json_schema).check_schema(self.json_schema)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"invalid JSON schema: {exc.message}") from None
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("choice needs at least one non-empty string")
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
