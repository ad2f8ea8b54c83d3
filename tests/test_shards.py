"""Shards (``sorted_shards``, in the plan's database): balanced by estimated cost, never splitting a
group that fits in a shard, kept from the previous night where they can be."""

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from engine.plan.batch_plan import PrefixPlan, plan_arrays
from engine.plan.block_hashes import RowBlocks
from engine.plan.sorted_plan import plan_by_sort, rows_of_blocks
from engine.plan.sorted_shards import assign_shards_by_sort

from .conftest import group_rows
from .test_plan import flat


@dataclass
class Batch:
    blocks: RowBlocks
    plan: PrefixPlan

    @property
    def num_rows(self) -> int:
        return self.plan.num_rows


def grouped_batch(groups=12, rows_per_group=5, prefix=16, seed=0) -> Batch:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(groups):
        shared = rng.integers(0, 1000, prefix).tolist()
        rows += [shared + rng.integers(0, 1000, rng.integers(1, 6)).tolist() for _ in range(rows_per_group)]
    blocks = RowBlocks.of_tokens(*flat(rows), 4)
    return Batch(blocks, cut(blocks, 1))


def cut(blocks: RowBlocks, shards: int, weights=None, previous: np.ndarray | None = None) -> PrefixPlan:
    """The plan of ``blocks`` (8 output tokens a row) cut into ``shards``, with each row's shard of a
    previous night where given (-1: a new row)."""
    with tempfile.TemporaryDirectory() as folder:
        plan = plan_by_sort(rows_of_blocks(blocks, np.full(blocks.num_rows, 8)), blocks.block_size, Path(folder))
        try:
            if previous is not None:
                plan.connection.register("previous_rows", pa.table({"row": np.arange(previous.size),
                                                                     "shard": previous}))
                plan.connection.execute("CREATE TABLE previous_shards AS SELECT * FROM previous_rows")
            return plan_arrays(plan, assign_shards_by_sort(plan, shards, weights, previous=previous is not None))
        finally:
            plan.close()


def assign_shards(batch: Batch, shards: int, weights=None, previous=None):
    """The shards' totals, with ``shard_of_row`` beside them."""
    made = cut(batch.blocks, shards, weights, previous)
    made.shards.shard_of_row = made.shard_of_row
    return made.shards


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_groups_are_never_split_and_shards_are_balanced(shards):
    batch = grouped_batch()
    plan, result = batch.plan, assign_shards(batch, shards)
    for g in range(plan.num_groups):
        assert np.unique(result.shard_of_row[group_rows(plan, g)]).size == 1
    assert result.split_groups == 0
    assert set(np.unique(result.shard_of_row)) == set(range(shards))
    costs = result.estimated_cost
    assert costs.max() <= costs.mean() * 1.5
    # Each group pays its prefix once in its own shard: the shards add up to the plan's minimum.
    assert result.prefill_tokens.sum() == plan.unique_tokens


def test_a_group_larger_than_a_shard_is_split_and_each_part_pays_its_prefix():
    batch = grouped_batch(groups=1, rows_per_group=20)
    plan, result = batch.plan, assign_shards(batch, 2)
    assert result.split_groups == 1
    assert np.unique(result.shard_of_row).size == 2
    assert result.prefill_tokens.sum() == plan.unique_tokens + 16  # the 16-token prefix computed twice


def test_weights_give_faster_hardware_more_work():
    plan = grouped_batch(groups=40)
    result = assign_shards(plan, 2, weights=[3.0, 1.0])
    assert result.estimated_cost[0] > 2 * result.estimated_cost[1]


def test_bad_arguments():
    plan = grouped_batch()
    with pytest.raises(ValueError, match="number of shards must be at least 1"):
        assign_shards(plan, 0)
    with pytest.raises(ValueError, match=r"need 2 positive shard weights, got \[1.0\]"):
        assign_shards(plan, 2, weights=[1.0])
    with pytest.raises(ValueError, match="need 2 positive shard weights"):
        assign_shards(plan, 2, weights=[1.0, 0.0])


def test_the_next_plan_keeps_each_unchanged_group_on_its_shard():
    batch = grouped_batch(groups=12, rows_per_group=5, seed=1)
    first = assign_shards(batch, 3)
    # The same rows with other lengths (rows edited): a fresh cut could move groups; the sticky one keeps them.
    again = assign_shards(batch, 3, previous=first.shard_of_row)
    assert np.array_equal(again.shard_of_row, first.shard_of_row)
    # Two new groups join: they go to the least loaded shards, the old rows stay where they were.
    bigger = grouped_batch(groups=14, rows_per_group=5, seed=1)  # the same first 12 groups, 2 more
    previous = np.full(bigger.num_rows, -1)
    previous[: batch.num_rows] = first.shard_of_row
    grown = assign_shards(bigger, 3, previous=previous)
    assert np.array_equal(grown.shard_of_row[: batch.num_rows], first.shard_of_row)
    assert grown.estimated_cost.max() <= 1.25 * grown.estimated_cost.mean()


def test_an_unbalanced_previous_assignment_is_cut_afresh():
    batch = grouped_batch(groups=12)
    lopsided = np.zeros(batch.num_rows, dtype=np.int64)  # everything was on shard 0
    result = assign_shards(batch, 3, previous=lopsided)
    assert np.array_equal(result.shard_of_row, assign_shards(batch, 3).shard_of_row)
