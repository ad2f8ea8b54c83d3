"""The plan made by sorts on disk (DuckDB), the one planner, is the prefix tree's plan (the test
oracle, ``tests/oracle/``), row for row; its shards are the oracle's shards."""

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.plan.batch_plan import PrefixPlan, plan_arrays
from engine.plan.block_hashes import RowBlocks
from engine.plan.duplicates import NO_SET
from engine.plan.sorted_plan import plan_by_sort, rows_of_blocks
from engine.plan.sorted_shards import assign_shards_by_sort

from .oracle.prefix_tree import PrefixTree
from .oracle.shards import assign_shards
from .test_plan import flat

_PLAN_ARRAYS = ["order", "group_of_row", "group_prefix_tokens", "group_sizes", "row_unique_tokens", "decode_tokens"]


def _sets_of_identical(rows, chosen) -> np.ndarray:
    """Duplicate sets of the ``chosen`` rows that have an identical chosen row (what ``duplicate_sets``
    makes of rows with one key, budget and format)."""
    first, out = {}, np.full(len(rows), NO_SET)
    for i in chosen:
        first.setdefault(tuple(rows[i]), []).append(i)
    for number, members in enumerate(m for m in first.values() if len(m) > 1):
        out[members] = number
    return out


def plan_in_a_temporary_folder(rows: pa.Table, block_size: int, min_group_rows: int = 2) -> PrefixPlan:
    """``plan_by_sort``'s plan as arrays, its files removed after."""
    with tempfile.TemporaryDirectory(prefix="batchllm-sorted-plan-") as folder:
        plan = plan_by_sort(rows, block_size, Path(folder), min_group_rows)
        try:
            return plan_arrays(plan)
        finally:
            plan.close()


BATCHES = {"rows": st.lists(st.lists(st.integers(0, 2), max_size=12), max_size=40), "data": st.data()}


# The two planners held equal in the fast suite on a few random batches (a database file an
# example: ~60 ms each), and on many in the full one.
@settings(max_examples=8, deadline=None)
@given(**BATCHES, block=st.integers(1, 3), min_group_rows=st.integers(2, 3))
def test_the_plan_by_sort_is_the_prefix_trees_plan(rows, block, min_group_rows, data):
    _plan_by_sort_is_the_trees(rows, block, min_group_rows, data)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(**BATCHES, block=st.integers(1, 3), min_group_rows=st.integers(2, 3))
def test_the_plan_by_sort_is_the_prefix_trees_plan_on_many_batches(rows, block, min_group_rows, data):
    _plan_by_sort_is_the_trees(rows, block, min_group_rows, data)


def _plan_by_sort_is_the_trees(rows, block, min_group_rows, data):
    """Order, groups, group prefixes, tokens per row and decode estimates equal ``PrefixTree``'s, with
    identical rows planned once (copies) and rows that cannot run emptied (dropped)."""
    n = len(rows)
    some_rows = st.sets(st.integers(0, n - 1)) if n else st.just(set())
    dropped = np.array(sorted(data.draw(some_rows))[:3], dtype=np.int64)
    sharing = [i for i in data.draw(some_rows) if i not in set(dropped.tolist())]
    same = _sets_of_identical(rows, sorted(sharing))
    blocks = RowBlocks.of_tokens(*flat(rows), block)
    tree = PrefixTree.of(blocks).planned(dropped, same)
    decode = np.where(tree.lengths > 0, np.array(data.draw(st.lists(st.integers(1, 50), min_size=n, max_size=n)),
                                                 dtype=np.int64), 0)
    expected = tree.plan(decode, min_group_rows)

    got = plan_in_a_temporary_folder(rows_of_blocks(blocks, decode, same, dropped), block, min_group_rows)

    for name in _PLAN_ARRAYS:
        assert getattr(got, name).tolist() == getattr(expected, name).tolist(), name


def test_a_batch_with_groups_nested_prefixes_and_copies_plans_as_the_tree(tmp_path):
    """A hand-made batch with every kind of row: a system prompt all share, documents some share
    (a group each), a copy, a row too short for a block and one dropped."""
    system, docs = [7] * 8, [[1] * 8, [2] * 8]
    rows = [system + docs[i % 2] + [i] * 3 for i in range(6)] + [system + [5] * 4, [3], system + docs[0] + [0] * 3,
                                                                [9] * 12]
    same, dropped = _sets_of_identical(rows, [0, 8]), np.array([9])
    blocks = RowBlocks.of_tokens(*flat(rows), 4)
    tree = PrefixTree.of(blocks).planned(dropped, same)
    expected = tree.plan(np.where(tree.lengths > 0, 5, 0))
    assert expected.num_groups >= 3 and expected.copies is not None  # the batch is what it says

    plan = plan_by_sort(rows_of_blocks(blocks, expected.decode_tokens, same, dropped), 4, tmp_path / "plan")
    try:
        got = plan_arrays(plan)
    finally:
        plan.close()
    for name in _PLAN_ARRAYS:
        assert getattr(got, name).tolist() == getattr(expected, name).tolist(), name
    assert (tmp_path / "plan" / "plan.duckdb").exists()


def test_min_group_rows_below_two_is_refused(tmp_path):
    with pytest.raises(ValueError, match="min_group_rows"):
        plan_by_sort(rows_of_blocks(RowBlocks.of_tokens(*flat([[1, 2]]), 1), np.array([1])), 1, tmp_path, 1)


@settings(max_examples=6, deadline=None)
@given(**BATCHES, shards=st.integers(1, 5))
def test_the_shards_by_sort_are_assign_shards_cut_fresh_or_kept_from_the_previous_night(rows, shards, data):
    _shards_by_sort_are_assign_shards(rows, shards, data)


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(**BATCHES, shards=st.integers(1, 5))
def test_the_shards_by_sort_are_assign_shards_on_many_batches(rows, shards, data):
    _shards_by_sort_are_assign_shards(rows, shards, data)


def _shards_by_sort_are_assign_shards(rows, shards, data):
    """Each row's shard, each shard's tokens computed, decode estimate and cost, and the groups
    split equal ``assign_shards``'s on the tree's plan: a fresh cut (weighted or not), and with a
    previous night's shards (some rows new, some shards gone), kept or cut afresh when unbalanced."""
    n = len(rows)
    blocks = RowBlocks.of_tokens(*flat(rows), 2)
    decode = np.array(data.draw(st.lists(st.integers(1, 30), min_size=n, max_size=n)), dtype=np.int64)
    same = _sets_of_identical(rows, range(n))
    expected_plan = PrefixTree.of(blocks).planned(np.zeros(0, np.int64), same).plan(decode)
    weights = data.draw(st.none() | st.lists(st.floats(0.5, 4), min_size=shards, max_size=shards))
    previous = data.draw(st.none() | st.lists(st.integers(-1, shards), min_size=n, max_size=n))
    previous = None if previous is None else np.array(previous, dtype=np.int64)
    expected = assign_shards(expected_plan, shards, weights, previous=previous)

    with tempfile.TemporaryDirectory() as folder:
        plan = plan_by_sort(rows_of_blocks(blocks, decode, same), 2, Path(folder))
        try:
            if previous is not None:
                plan.connection.register("previous_rows", pa.table({"row": np.arange(n), "shard": previous}))
                plan.connection.execute("CREATE TABLE previous_shards AS SELECT * FROM previous_rows")
            got = assign_shards_by_sort(plan, shards, weights, previous=previous is not None)
            shard_of_row = plan.connection.sql("SELECT shard FROM shards ORDER BY row").to_arrow_table()
        finally:
            plan.close()
    assert shard_of_row.column("shard").to_pylist() == expected.shard_of_row.tolist()
    assert got.prefill_tokens.tolist() == expected.prefill_tokens.tolist()
    assert got.decode_tokens.tolist() == expected.decode_tokens.tolist()
    assert got.estimated_cost.tolist() == expected.estimated_cost.tolist()
    assert got.split_groups == expected.split_groups


def test_a_group_centred_on_a_shard_bound_goes_to_the_later_shard_in_both(tmp_path):
    """Three rows sharing nothing, of equal cost, two shards: the middle row's centre is the bound
    (numpy's searchsorted, side right: the later shard). The tie the random batches rarely draw."""
    rows = [[1] * 4, [2] * 4, [3] * 4]
    blocks, decode = RowBlocks.of_tokens(*flat(rows), 2), np.array([3, 3, 3])
    tree_plan = PrefixTree.of(blocks).plan(decode)
    expected = assign_shards(tree_plan, 2)
    plan = plan_by_sort(rows_of_blocks(blocks, decode), 2, tmp_path)
    try:
        assign_shards_by_sort(plan, 2)
        got = plan.connection.sql("SELECT shard FROM shards ORDER BY row").to_arrow_table().column("shard").to_pylist()
    finally:
        plan.close()
    middle = int(tree_plan.order[1])
    assert expected.shard_of_row[middle] == 1  # centred on the bound
    assert got == expected.shard_of_row.tolist()


def test_a_plans_database_holds_duckdb_to_the_plans_memory_and_spills_in_its_folder(tmp_path):
    """The plan's DuckDB memory is ``PLAN_MEMORY_MIB`` (more only on many threads), spilling into the
    plan's own folder, not a job's scan bound of 1 GiB."""
    from engine.plan.sorted_plan import PLAN_MEMORY_MIB, open_plan_database
    from engine.table.dataset import DUCKDB_MEMORY_PER_THREAD_MIB

    con = open_plan_database(tmp_path / "plan")
    try:
        threads = int(con.execute("SELECT current_setting('threads')").fetchall()[0][0])
        limit = con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
        spill = con.execute("SELECT current_setting('temp_directory')").fetchall()[0][0]
    finally:
        con.close()
    number, unit = limit.split()
    assert float(number) * {"MiB": 1, "GiB": 1024}[unit] == max(PLAN_MEMORY_MIB, DUCKDB_MEMORY_PER_THREAD_MIB * threads)
    assert spill.startswith(str(tmp_path / "plan"))
