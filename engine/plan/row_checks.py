"""Which rows can run: each row's output budget and its own answer format, checked against the
model's context. A row that cannot run gets a reason (it becomes an error row); the batch goes on."""

from __future__ import annotations

import numpy as np

from ..choice_scoring import SCORED_ANSWER_TOKENS
from ..response_format import ResponseFormat
from ..settings import EngineSettings


def output_budgets(row_max_tokens: list | None, default: int, lengths: np.ndarray, settings: EngineSettings,
                   errors: dict[int, str], formats: dict[int, ResponseFormat] | None = None,
                   job_format: ResponseFormat | None = None, score_choices: bool = False) -> np.ndarray:
    """Each row's ``max_tokens`` (its own, else ``default``), raised where its answer format (its own
    in ``formats``, else ``job_format``) bounds an answer above it (``answer_floors``); with
    ``score_choices``, a choice row's is the one token a scoring request generates (and throws away:
    engine/choice_scoring.py). Rows whose budget is invalid or does not fit the context beside their
    prompt get a reason in ``errors``."""
    limit = settings.context_len
    max_tokens = np.full(lengths.size, default, dtype=np.int64)
    for i, value in enumerate(row_max_tokens or []):
        if value is None:
            continue
        if not 1 <= value <= limit:  # checked as Python ints: no int64 overflow
            errors.setdefault(i, f"invalid max_tokens {value}: must be between 1 and the context of {limit} tokens")
        else:
            max_tokens[i] = value
    max_tokens = np.maximum(max_tokens, answer_floors(lengths.size, formats or {}, job_format))
    if score_choices:
        max_tokens[choice_rows(lengths.size, formats or {}, job_format)] = SCORED_ANSWER_TOKENS
    for i in np.flatnonzero(max_tokens > limit - lengths):
        errors.setdefault(
            int(i),
            f"prompt of {lengths[i]} tokens + max_tokens {max_tokens[i]} exceeds the model's context of {limit} "
            f"tokens (max_model_len={settings.max_model_len or 'the default'}, "
            f"KV cache {settings.kv_cache_blocks} blocks)",
        )
    return max_tokens


def answer_floors(n: int, formats: dict[int, ResponseFormat], job_format: ResponseFormat | None) -> np.ndarray:
    """The budget below which a row's valid answer could be cut off, where its format bounds the
    answer (a choice: ``ResponseFormat.most_answer_tokens``), else 0. Raising a choice row's budget
    to it costs nothing: the grammar ends the answer at the choice, whatever the budget; below it the
    model may be cut off mid-choice (``accoun``), which a budget counted in the tokenizer's own
    tokens of each choice allowed."""
    floors = np.full(n, (job_format.most_answer_tokens() or 0) if job_format else 0, dtype=np.int64)
    of_format: dict[int, int] = {}  # rows share a few parsed formats (``row_response_formats``): each counted once
    for row, own in formats.items():
        floor = of_format.get(id(own))
        if floor is None:
            floor = of_format[id(own)] = own.most_answer_tokens() or 0
        floors[row] = floor
    return floors


def choice_rows(n: int, formats: dict[int, ResponseFormat], job_format: ResponseFormat | None) -> np.ndarray:
    """Whether each row's answer is a choice (its own format, else the job's)."""
    rows = np.full(n, job_format is not None and job_format.choice is not None)
    for row, own in formats.items():
        rows[row] = own.choice is not None
    return rows


def row_response_formats(texts: list[str | None] | None, errors: dict[int, str]) -> dict[int, ResponseFormat]:
    """Each row's own constraint; an invalid one makes the row an error row (the batch goes on).
    Rows usually share a few formats: each distinct text is parsed once."""
    parsed: dict[str, ResponseFormat | str] = {}
    formats = {}
    for i, text in enumerate(texts or []):
        if text is None:
            continue
        if text not in parsed:
            try:
                parsed[text] = ResponseFormat.from_text(text)
            except ValueError as exc:
                parsed[text] = f"invalid response_format: {exc}"
        if isinstance(parsed[text], str):
            errors.setdefault(i, parsed[text])
        else:
            formats[i] = parsed[text]
    return formats
