"""Which rows can run: each row's output budget and its own answer format, checked against the
model's context. A row that cannot run gets a reason (it becomes an error row); the batch goes on."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..choice_scoring import SCORED_ANSWER_TOKENS
from ..response_format import ResponseFormat
from ..settings import EngineSettings

Column = pa.Array | pa.ChunkedArray | None  # a table's column, or None where it has none


def output_budgets(row_max_tokens: Column, default: int, lengths: np.ndarray, settings: EngineSettings,
                   errors: dict[int, str], formats: dict[int, ResponseFormat] | None = None,
                   job_format: ResponseFormat | None = None, score_choices: bool = False) -> np.ndarray:
    """Each row's ``max_tokens`` (its own, an integer column, else ``default``), raised where its
    answer format (its own in ``formats``, else ``job_format``) bounds an answer above it
    (``answer_floors``); with ``score_choices``, a choice row's is the one token a scoring request
    generates (and throws away: engine/choice_scoring.py). Rows whose budget is invalid or does not
    fit the context beside their prompt get a reason in ``errors``."""
    limit = settings.context_len
    max_tokens = np.full(lengths.size, default, dtype=np.int64)
    if row_max_tokens is not None:
        column = _whole(row_max_tokens)
        # Compared as floats: exact up to 2**53, and any larger value (or any uint64) is out of range
        # anyway, where a cast to int64 could overflow. A null compares as NaN: the default stays.
        values = column.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
        fits = (values >= 1) & (values <= limit)
        max_tokens[fits] = values[fits].astype(np.int64)
        for i in np.flatnonzero(~fits & pc.is_valid(column).to_numpy(zero_copy_only=False)):
            errors.setdefault(int(i), f"invalid max_tokens {column[int(i)].as_py()}: must be between 1 and the "
                                      f"context of {limit} tokens")
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


def row_response_formats(texts: Column, errors: dict[int, str]) -> dict[int, ResponseFormat]:
    """Each row's own constraint (``texts``: a string column, null for the job's); an invalid one
    makes the row an error row (the batch goes on). Rows usually share a few formats: each distinct
    text is parsed once, and only the rows that have one are visited."""
    if texts is None:
        return {}
    distinct, codes = format_codes(texts, len(texts))
    parsed: list[ResponseFormat | str] = []
    for text in distinct:
        try:
            parsed.append(ResponseFormat.from_text(text))
        except ValueError as exc:
            parsed.append(f"invalid response_format: {exc}")
    formats = {}
    for i in np.flatnonzero(codes >= 0):
        own = parsed[codes[i]]
        if isinstance(own, str):
            errors.setdefault(int(i), own)
        else:
            formats[int(i)] = own
    return formats


def format_codes(texts: Column | list, n: int) -> tuple[list[str], np.ndarray]:
    """Each of ``n`` rows' own format text as a number (equal texts, equal numbers; -1 for none, the
    job's) and the distinct texts by number: how the checks parse each text once and identical rows
    compare formats (``duplicates``)."""
    if texts is None:
        return [], np.full(n, -1, dtype=np.int32)
    column = pa.array(texts, pa.string()) if isinstance(texts, list) else _whole(texts).cast(pa.string())
    encoded = column.dictionary_encode()
    return encoded.dictionary.to_pylist(), encoded.indices.fill_null(-1).to_numpy()


def _whole(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
