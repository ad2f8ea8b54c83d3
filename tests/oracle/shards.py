"""Cut a plan into shards balanced by estimated cost that never split a prefix group.

Shards are contiguous runs of the plan order, so a shard also keeps the higher levels of the tree
(a system prompt shared by many groups) together. A group is split only when it alone costs more
than its shard's share; each part then pays the prefix once, and the estimate counts that.

Given the previous night's shards, a group whose rows were all in one shard stays there, and only
new or moved groups go to the least loaded shard: shards whose rows did not change keep their
rows (and so their partition keys). When that would leave the shards unbalanced by more than
``max_imbalance``, the plan is cut afresh.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.plan.shard_cut import DECODE_COST, cut_in_order, shard_weights

from .prefix_tree import TreePlan, unique_tokens_per_row


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

    def rows(self, plan: TreePlan, shard: int) -> list[int]:
        """The shard's rows in plan order."""
        return [int(r) for r in plan.order if self.shard_of_row[r] == shard]


def _keep_previous(row_cost: np.ndarray, starts: np.ndarray, previous_in_order: np.ndarray,
                   weights: list[float] | None, parts: int, max_imbalance: float) -> np.ndarray | None:
    """Shard per position with each group kept on its previous shard when all its rows were there;
    the other groups go, in plan order, to the shard least loaded for its weight. None when the
    result is unbalanced."""
    weights_arr = shard_weights(weights, parts)
    group_cost = np.add.reduceat(row_cost, starts[:-1])
    low = np.minimum.reduceat(previous_in_order, starts[:-1])
    high = np.maximum.reduceat(previous_in_order, starts[:-1])
    kept = (low == high) & (low >= 0) & (low < parts)
    shard_of_group = np.where(kept, low, -1)
    load = np.bincount(shard_of_group[kept], weights=group_cost[kept], minlength=parts).astype(float)
    for group in np.flatnonzero(~kept):
        shard = int(np.argmin(load / weights_arr))
        shard_of_group[group] = shard
        load[shard] += group_cost[group]
    relative = load / weights_arr
    if relative.max() > max_imbalance * relative.mean():
        return None
    return np.repeat(shard_of_group, np.diff(starts))


def assign_shards(
    plan: TreePlan, num_shards: int, weights: list[float] | None = None, decode_cost: float = DECODE_COST,
    previous: np.ndarray | None = None, max_imbalance: float = 1.25,
) -> ShardPlan:
    """``weights`` (one per shard) give faster hardware a larger share; equal when omitted.
    ``previous``: each row's shard in the last plan (-1: a new row), to keep unchanged shards."""
    order = plan.order
    row_cost = plan.row_unique_tokens[order] + decode_cost * plan.decode_tokens[order]
    starts = plan.group_starts()
    kept = None
    if previous is not None and order.size and (previous >= 0).any():
        kept = _keep_previous(row_cost, starts, np.asarray(previous)[order], weights, num_shards, max_imbalance)
    if kept is not None:
        shard_in_order, too_big = kept, np.zeros(starts.size - 1, dtype=bool)
    else:
        shard_in_order, too_big = cut_in_order(row_cost, starts, weights, num_shards)

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
