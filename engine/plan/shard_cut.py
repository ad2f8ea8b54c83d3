"""The shard cut every plan's shards share: contiguous runs of a run order balanced by estimated cost
(a row's tokens computed plus ``DECODE_COST`` per expected output token), a group cut only when it
alone costs more than its shard's share. ``sorted_shards`` makes a plan's shards by queries with the
same rule; ``split_prepared`` cuts a shard's prepared batch into its replicas' parts in memory."""

from __future__ import annotations

import numpy as np

# What an output token costs in prefill tokens, in a shard's cost and in a night's forecast: a decode
# step computes one token per row but reads the row's whole KV cache.
DECODE_COST = 2.0


def shard_weights(weights: list[float] | None, parts: int) -> np.ndarray:
    """Each shard's weight (equal when omitted), checked: at least one shard, one positive weight each."""
    if parts < 1:
        raise ValueError("the number of shards must be at least 1")
    array = np.ones(parts) if weights is None else np.asarray(weights, dtype=float)
    if array.size != parts or (array <= 0).any():
        raise ValueError(f"need {parts} positive shard weights, got {weights}")
    return array


def cut_in_order(row_cost: np.ndarray, group_starts: np.ndarray, weights: list[float] | None, parts: int):
    """Shard of each position of the run order: contiguous, balanced by cost, groups kept whole
    unless a group alone costs more than its shard's share. Returns (shard per position, too_big
    per group)."""
    weights_arr = shard_weights(weights, parts)
    cum_end = np.cumsum(row_cost)
    total = float(cum_end[-1]) if cum_end.size else 0.0
    bounds = np.cumsum(weights_arr)[:-1] / weights_arr.sum() * total
    shares = weights_arr / weights_arr.sum() * total
    if not row_cost.size:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    group_of_position = np.repeat(np.arange(group_starts.size - 1), np.diff(group_starts))
    group_cost = np.add.reduceat(row_cost, group_starts[:-1])
    group_mid = cum_end[group_starts[1:] - 1] - group_cost / 2
    shard_of_group = np.searchsorted(bounds, group_mid, side="right")
    shard_in_order = shard_of_group[group_of_position]
    # A group that alone is larger than its shard's share is cut at the row level.
    too_big = group_cost > shares[shard_of_group]
    if too_big.any():
        by_row = np.searchsorted(bounds, cum_end - row_cost / 2, side="right")
        shard_in_order = np.where(too_big[group_of_position], by_row, shard_in_order)
    return shard_in_order, too_big


def split_prepared(prepared, parts: int, weights: list[float] | None = None,
                   decode_cost: float = DECODE_COST) -> np.ndarray:
    """Shard per row of a prepared batch (no planner needed: its run order and groups are enough).
    A row's cost is its tokens beyond its group's prefix, plus the prefix once per group."""
    order = prepared.order
    shard_of_row = np.zeros(prepared.num_rows, dtype=np.int64)
    if not order.size:
        return shard_of_row
    starts = np.concatenate([[0], np.flatnonzero(np.diff(prepared.group_of_row[order])) + 1, [order.size]])
    prefix = prepared.prefix_tokens_of_row[order]
    row_cost = (prepared.batch.lengths[order] - prefix + decode_cost * prepared.max_tokens[order]).astype(float)
    row_cost[starts[:-1]] += prefix[starts[:-1]]  # each group computes its prefix once
    shard_in_order, _ = cut_in_order(row_cost, starts, weights, parts)
    shard_of_row[order] = shard_in_order
    return shard_of_row
