"""Cut a plan into shards balanced by estimated cost that never split a prefix group.

Shards are contiguous runs of the plan order, so a shard also keeps the higher levels of the tree
(a system prompt shared by many groups) together. A group is split only when it alone costs more
than its shard's share; each part then pays the prefix once, and the estimate counts that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .plan import PrefixPlan, unique_tokens_per_row


@dataclass
class ShardPlan:
    shard_of_row: np.ndarray  # shard per row (input row index)
    prefill_tokens: np.ndarray  # per shard: prompt tokens it computes with a perfect cache
    decode_tokens: np.ndarray  # per shard: estimated output tokens
    estimated_cost: np.ndarray  # per shard: prefill + decode_cost * decode
    split_groups: int  # groups cut over more than one shard

    @property
    def num_shards(self) -> int:
        return int(self.estimated_cost.size)

    def rows(self, plan: PrefixPlan, shard: int) -> list[int]:
        """The shard's rows in plan order."""
        return [int(r) for r in plan.order if self.shard_of_row[r] == shard]


def assign_shards(
    plan: PrefixPlan, num_shards: int, weights: list[float] | None = None, decode_cost: float = 2.0
) -> ShardPlan:
    """``weights`` (one per shard) give faster hardware a larger share; equal when omitted."""
    if num_shards < 1:
        raise ValueError("num_shards must be at least 1")
    weights_arr = np.ones(num_shards) if weights is None else np.asarray(weights, dtype=float)
    if weights_arr.size != num_shards or (weights_arr <= 0).any():
        raise ValueError(f"need {num_shards} positive shard weights, got {weights}")
    order = plan.order
    row_cost = plan.row_unique_tokens[order] + decode_cost * plan.decode_tokens[order]
    cum_end = np.cumsum(row_cost)
    total = float(cum_end[-1]) if cum_end.size else 0.0
    bounds = np.cumsum(weights_arr)[:-1] / weights_arr.sum() * total
    shares = weights_arr / weights_arr.sum() * total

    groups_in_order = plan.group_of_row[order]
    starts = plan.group_starts()
    group_cost = np.add.reduceat(row_cost, starts[:-1]) if order.size else np.zeros(0)
    group_mid = cum_end[starts[1:] - 1] - group_cost / 2 if order.size else np.zeros(0)
    shard_of_group = np.searchsorted(bounds, group_mid, side="right")
    shard_in_order = shard_of_group[groups_in_order]
    # A group that alone is larger than its shard's share is cut at the row level.
    too_big = group_cost > shares[shard_of_group]
    if too_big.any():
        by_row = np.searchsorted(bounds, cum_end - row_cost / 2, side="right")
        cut = too_big[groups_in_order]
        shard_in_order = np.where(cut, by_row, shard_in_order)

    shard_of_row = np.empty(order.size, dtype=np.int64)
    shard_of_row[order] = shard_in_order
    prefill = unique_tokens_per_row(plan, order, part=shard_of_row) if order.size else np.zeros(0, dtype=np.int64)
    prefill_per_shard = np.bincount(shard_of_row, weights=prefill, minlength=num_shards).astype(np.int64)
    decode_per_shard = np.bincount(shard_of_row, weights=plan.decode_tokens, minlength=num_shards).astype(np.int64)
    split = sum(
        1 for g in np.flatnonzero(too_big) if np.unique(shard_in_order[starts[g] : starts[g + 1]]).size > 1
    )
    return ShardPlan(
        shard_of_row=shard_of_row,
        prefill_tokens=prefill_per_shard,
        decode_tokens=decode_per_shard,
        estimated_cost=prefill_per_shard + decode_cost * decode_per_shard,
        split_groups=split,
    )
