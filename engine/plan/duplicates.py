"""Identical rows, computed once.

Two rows are identical when everything that decides their answer is: the same token ids (or, for
rows from the token cache, the same content key: one content tokenizes one way under the cache's
tokenizer), the same ``max_tokens`` and the same response format. The plan records each row's
``duplicate_set`` (-1: no other row is identical); a run gives every set's first row in run order
to the engine and the answer to all of them, each under its own id.

Sharing is valid only where the engine would give identical rows identical answers anyway:
greedy sampling, or sampling with a seed (every request of a job gets the job's seed, so vLLM
draws the same samples for the same prompt). ``answers_are_shared`` is that test.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..digests import row_key
from ..settings import SamplingSettings
from .row_checks import Column, format_codes

NO_SET = -1
FormatTexts = Column | list  # each row's own response format as text, or no column (None)


def answers_are_shared(sampling: SamplingSettings) -> bool:
    """Whether identical rows may share one answer under ``sampling`` (see the module doc)."""
    return sampling.temperature == 0 or sampling.seed is not None


def token_keys(tokens: np.ndarray, offsets: np.ndarray) -> pa.Array:
    """A 128-bit digest of each row's token ids: the identity of rows tokenized here."""
    return pa.array([row_key(tokens[offsets[i] : offsets[i + 1]].tobytes())
                     for i in range(offsets.size - 1)], pa.binary(16))


def duplicate_sets(keys: pa.Array, max_tokens: np.ndarray, response_formats: FormatTexts,
                   runnable: np.ndarray) -> np.ndarray:
    """Each row's set of identical rows (numbered from 0 by their first row; ``NO_SET`` for a row no
    other runnable row equals). ``keys`` is each row's content identity (16 bytes), ``response_formats``
    its own format as text (None: the job's; no column: every row's is the job's), ``runnable``
    which rows run at all (error rows never join a set). One sort of fixed-width columns: 40 bytes a
    row, where a hash grouping of the keys held ~190 (docs/benchmark-history.md). A plan made on
    disk finds the same sets by a query (``plan_database.Loaded.duplicate_sets``)."""
    n = len(keys)
    out = np.full(n, NO_SET, dtype=np.int64)
    rows = np.flatnonzero(np.asarray(runnable, dtype=bool))
    if rows.size < 2:
        return out
    words = key_words(keys)
    formats = format_codes(response_formats, n)[1]
    columns = (formats[rows], np.asarray(max_tokens, dtype=np.int64)[rows], words[rows, 1], words[rows, 0])
    in_order = rows[np.lexsort(columns)]  # stable: a set's rows ascending, its first row first
    del columns
    same = np.ones(in_order.size - 1, dtype=bool)
    for column in (formats, max_tokens, words[:, 1], words[:, 0]):
        values = column[in_order]
        same &= values[1:] == values[:-1]
    starts = np.flatnonzero(np.concatenate([[True], ~same]))
    sizes = np.diff(np.append(starts, in_order.size))
    sets = np.flatnonzero(sizes > 1)
    numbered = np.argsort(in_order[starts[sets]], kind="stable")  # by each set's first row
    number = np.empty(sets.size, dtype=np.int64)
    number[numbered] = np.arange(sets.size)
    members = np.repeat(np.arange(starts.size), sizes)  # each sorted row's run
    is_member = sizes[members] > 1
    run_number = np.full(starts.size, NO_SET, dtype=np.int64)
    run_number[sets] = number
    out[in_order[is_member]] = run_number[members[is_member]]
    return out


def key_words(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """16-byte keys as two 64-bit words each (``(n, 2)``), read from the key column's buffer."""
    keys = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
    if keys.null_count:
        raise ValueError(f"{keys.null_count} rows have no content key")
    keys = keys.cast(pa.binary(16))
    words = np.frombuffer(keys.buffers()[1], dtype=np.uint64).reshape(-1, 2)
    return words[keys.offset : keys.offset + len(keys)]


def lowest_row_of_set(duplicate_set: np.ndarray | None, n: int) -> np.ndarray:
    """Each row's source in the plan: the lowest row of its duplicate set (itself when it has none).
    The planner puts the set's other rows right after it, so it is also the first in run order."""
    source = np.arange(n)
    if duplicate_set is None:
        return source
    in_set = np.flatnonzero(duplicate_set >= 0)
    first = np.full(int(duplicate_set.max(initial=-1)) + 1, n, dtype=np.int64)
    np.minimum.at(first, duplicate_set[in_set], in_set)
    source[in_set] = first[duplicate_set[in_set]]
    return source


def answer_sources(duplicate_set: np.ndarray | None, rows_in_run_order: list[int]) -> dict[int, list[int]]:
    """Among ``rows_in_run_order``, the first row of each duplicate set mapped to the other rows of
    its set that take its answer; rows alone in their set are not in it. A set's first row is its
    first here, so a shard (or a resumed run) that lacks a set's earlier rows still runs one."""
    copies: dict[int, list[int]] = {}
    if duplicate_set is None:
        return copies
    source_of_set: dict[int, int] = {}
    for row in rows_in_run_order:
        s = int(duplicate_set[row])
        if s == NO_SET:
            continue
        source = source_of_set.setdefault(s, row)
        if source != row:
            copies.setdefault(source, []).append(row)
    return copies


def count_duplicates(duplicate_set: np.ndarray | None) -> int:
    """Rows that take another row's answer: each set's rows but one."""
    if duplicate_set is None:
        return 0
    in_sets = duplicate_set[duplicate_set != NO_SET]
    return int(in_sets.size - np.unique(in_sets).size)
