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
import pyarrow.compute as pc

from ..digests import row_key
from ..settings import SamplingSettings

NO_SET = -1


def answers_are_shared(sampling: SamplingSettings) -> bool:
    """Whether identical rows may share one answer under ``sampling`` (see the module doc)."""
    return sampling.temperature == 0 or sampling.seed is not None


def token_keys(tokens: np.ndarray, offsets: np.ndarray) -> pa.Array:
    """A 128-bit digest of each row's token ids: the identity of rows tokenized here."""
    return pa.array([row_key(tokens[offsets[i] : offsets[i + 1]].tobytes())
                     for i in range(offsets.size - 1)], pa.binary(16))


def duplicate_sets(keys: pa.Array, max_tokens: np.ndarray, response_formats: list[str | None],
                   runnable: np.ndarray) -> np.ndarray:
    """Each row's set of identical rows (numbered from 0; ``NO_SET`` for a row no other runnable row
    equals). ``keys`` is each row's content identity, ``response_formats`` its own format as text
    (None: the job's), ``runnable`` which rows run at all (error rows never join a set)."""
    n = len(keys)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    table = pa.table({"key": keys, "max_tokens": pa.array(max_tokens, pa.int64()),
                      "format": pa.array(response_formats, pa.string()), "row": pa.array(np.arange(n))})
    table = table.filter(pa.array(runnable))
    sets = table.group_by(["key", "max_tokens", "format"], use_threads=False).aggregate([("row", "list")])
    members = sets.column("row_list")
    members = members.filter(pc.greater(pc.list_value_length(members), 1)).combine_chunks()
    out = np.full(n, NO_SET, dtype=np.int64)
    if len(members):
        rows = members.flatten().to_numpy()
        out[rows] = np.repeat(np.arange(len(members)), np.diff(members.offsets.to_numpy()))
    return out


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
