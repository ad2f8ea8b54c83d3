"""What rows share from their first token, counted from their token ids alone (no plan): what a
cache hit gives a row, and what a perfect cache reuses over rows in their run order."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .tokenizing import TokenizedBatch


def common_tokens(a: np.ndarray, b: np.ndarray) -> int:
    """Tokens two rows share from their first."""
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def common_whole_blocks(a: np.ndarray, b: np.ndarray, block_size: int) -> int:
    """Whole KV blocks two rows share from their first token: the cache hit one gives the other."""
    return common_tokens(a, b) // block_size


def reusable_tokens(batch: TokenizedBatch, rows_in_plan_order: list[int], block_size: int) -> int:
    """Prompt tokens of these rows that a perfect cache on their own engine reuses: each row's whole
    blocks shared with the row before it. In plan order (depth first in the prefix tree) that is
    their prompt tokens less the unique tokens of their own tree, computed from token ids alone,
    so a partition gets it without the planner. Less than the plan's ``shared_prompt_tokens`` for
    their rows when another shard also holds their prefix."""
    reused, previous = 0, None
    for row in rows_in_plan_order:
        tokens = batch.tokens_of(row)
        if previous is not None:
            reused += common_whole_blocks(tokens, previous, block_size) * block_size
        previous = tokens
    return reused
