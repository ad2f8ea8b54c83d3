"""A plan of a batch held in memory (``batchllm plan`` and ``run``, doctor, the bench's prompt sets,
the field orders' prefill counter), made the one way every plan is made: ``sorted_plan``'s queries
and ``sorted_shards``' cut, in a plan database of its own (a temporary folder, gone after), read back
as arrays. A job's plan (``engine.jobs.plan_job``) runs the same queries on a database loaded from
its prompt snapshot and token cache, and reads its rows back a shard at a time instead.

(The prefix tree these queries were first written as, ``tests/oracle/prefix_tree.py``, is the test
oracle they are held equal to: ``tests/test_sorted_plan.py``.)
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .block_hashes import RowBlocks
from .sorted_plan import SortedPlan, plan_by_sort, rows_of_blocks
from .sorted_shards import ShardTotals, assign_shards_by_sort


@dataclass
class PrefixPlan:
    """The plan of one batch, and its shards. Row indices refer to the input order; ``order`` is the
    run order."""

    block_size: int
    lengths: np.ndarray  # prompt tokens per row (0: a row that cannot run)
    decode_tokens: np.ndarray  # estimated output tokens per row (0: a copy of another row, or no run)
    order: np.ndarray  # row indices in run order; each group's rows are contiguous
    group_of_row: np.ndarray  # group index per row; groups are numbered in run order
    group_prefix_tokens: np.ndarray  # shared prefix of each group (whole blocks; 0 = no sharing)
    group_sizes: np.ndarray  # rows per group
    row_unique_tokens: np.ndarray  # prompt tokens a row computes if the batch runs in plan order
    unique_tokens: int  # tokens of the block-aligned prefix tree plus unshared tails: the minimum prefill
    shard_of_row: np.ndarray | None = None  # shard per row
    shards: ShardTotals | None = None  # per shard: tokens, decode estimate, cost

    @property
    def num_rows(self) -> int:
        return int(self.lengths.size)

    @property
    def num_groups(self) -> int:
        return int(self.group_sizes.size)

    @property
    def num_shards(self) -> int:
        return 0 if self.shards is None else int(self.shards.prefill_tokens.size)

    @property
    def prompt_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def shared_prompt_tokens(self) -> int:
        """Prompt tokens the batch's prefix tree shares: what one engine with a perfect cache never computes."""
        return self.prompt_tokens - self.unique_tokens

    @property
    def shared_fraction(self) -> float:
        return self.shared_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def group_starts(self) -> np.ndarray:
        """Offsets into ``order`` where each group begins (plus the end)."""
        return np.concatenate([[0], np.cumsum(self.group_sizes)])


def plan_blocks(blocks: RowBlocks, decode_tokens: np.ndarray, min_group_rows: int = 2,
                duplicate_set: np.ndarray | None = None, dropped: np.ndarray | None = None,
                shards: int = 1) -> PrefixPlan:
    """Plan rows from their lengths and block hashes, cut into ``shards``: ``dropped`` rows (they
    cannot run) emptied, and each ``duplicate_set`` (``engine.plan.duplicates``) planned once, its
    other rows following its first and computing nothing."""
    if len(decode_tokens) != blocks.num_rows:
        raise ValueError(f"decode_tokens has {len(decode_tokens)} entries for {blocks.num_rows} rows")
    with tempfile.TemporaryDirectory(prefix="batchllm-plan-") as folder:
        plan = plan_by_sort(rows_of_blocks(blocks, decode_tokens, duplicate_set, dropped), blocks.block_size,
                            Path(folder), min_group_rows)
        try:
            totals = assign_shards_by_sort(plan, shards)
            return plan_arrays(plan, totals)
        finally:
            plan.close()


def plan_token_ids(tokens: np.ndarray, offsets: np.ndarray, decode_tokens: np.ndarray, block_size: int,
                   min_group_rows: int = 2, shards: int = 1) -> PrefixPlan:
    """Plan a batch from its token ids (``tokens[offsets[i]:offsets[i+1]]`` is row ``i``)."""
    return plan_blocks(RowBlocks.of_tokens(tokens, offsets, block_size), decode_tokens, min_group_rows,
                       shards=shards)


def plan_arrays(plan: SortedPlan, totals: ShardTotals | None = None) -> PrefixPlan:
    """The plan in ``plan``'s database as arrays, with its shards where they were cut (``totals``)."""
    shard = "s.shard" if totals is not None else "NULL::BIGINT AS shard"
    joined = "JOIN shards s ON s.row = p.row" if totals is not None else ""
    table = plan.connection.sql(f"SELECT p.*, {shard} FROM plan p {joined} ORDER BY p.row").to_arrow_table()
    position, grp = table["position"].to_numpy(), table["grp"].to_numpy().astype(np.int64)
    order = np.empty(position.size, dtype=np.int64)
    order[position] = np.arange(position.size)
    groups = int(grp.max(initial=-1)) + 1
    prefix = np.zeros(groups, dtype=np.int64)
    prefix[grp] = table["prefix_tokens"].to_numpy()
    unique = table["unique_tokens"].to_numpy().astype(np.int64)
    return PrefixPlan(block_size=plan.block_size, lengths=table["length"].to_numpy().astype(np.int64),
                      decode_tokens=table["decode"].to_numpy().astype(np.int64), order=order, group_of_row=grp,
                      group_prefix_tokens=prefix, group_sizes=np.bincount(grp, minlength=groups),
                      row_unique_tokens=unique, unique_tokens=int(unique.sum()),
                      shard_of_row=None if totals is None else table["shard"].to_numpy().astype(np.int64),
                      shards=totals)
