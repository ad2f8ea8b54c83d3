"""The plan file by shard: ``write_plan`` keeps each shard's rows in row groups of their own, and
``PlanFile`` reads a shard's row groups, never the whole file, with the rows filtering the whole
table gives (a plan written otherwise, its keys mixed in one row group, reads the same)."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engine.plan import plan_table
from engine.plan.common_prefix import reusable_tokens
from engine.plan.plan_table import PlanFile, prepared_batch, write_plan
from engine.table.prompt_snapshot import CONTENT_KEY, KEY_TYPE

from .conftest import prepared_of
from .plan_rows import rows_table


def a_plan(rows=600, shards=7, seed=0) -> pa.Table:
    rng = np.random.default_rng(seed)
    shard = rng.integers(0, shards, rows)
    return pa.table({
        "id": [f"r{i}" for i in range(rows)],
        "position": rng.permutation(rows),
        CONTENT_KEY: pa.array([rng.bytes(16) for _ in range(rows)], KEY_TYPE),
        "max_tokens": rng.integers(1, 64, rows),
        "response_format": pa.nulls(rows, pa.string()),
        "shard": shard,
        "partition_key": [f"cpu|{s}" for s in shard],
    }, metadata={"batchllm.block_size": "32", "batchllm.plan_run": "run-1"})


def test_each_shard_is_read_alone_with_the_rows_the_whole_table_has(tmp_path, monkeypatch):
    table = a_plan()
    path = tmp_path / "plan.parquet"
    write_plan(table, path)
    parquet = pq.ParquetFile(path)
    keys = sorted(set(table.column("partition_key").to_pylist()))
    assert parquet.num_row_groups == len(keys)  # one row group per shard at this size
    read = []
    original = pq.ParquetFile.read_row_groups
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups",
                        lambda self, groups, **kw: read.append(list(groups)) or original(self, groups, **kw))
    plan = PlanFile.open(path)
    assert plan.live_keys() == set(keys) and plan.plan_run == "run-1"
    for key in keys:
        read.clear()
        rows = plan._of_key(key)
        assert read == [[keys.index(key)]]  # its own row group, nothing else
        expected = table.filter(pc.equal(table.column("partition_key"), key))
        assert sorted(rows.column("id").to_pylist()) == sorted(expected.column("id").to_pylist())
        # Within a shard, the input order (what the planner wrote) is kept.
        assert rows.column("id").to_pylist() == expected.column("id").to_pylist()
        assert rows.schema.metadata[b"batchllm.block_size"] == b"32"


def test_a_plan_with_its_keys_mixed_in_one_row_group_reads_the_same(tmp_path):
    table = a_plan()
    by_shard, mixed = tmp_path / "by_shard.parquet", tmp_path / "mixed.parquet"
    write_plan(table, by_shard)
    pq.write_table(table, mixed)  # one row group of every key: a plan written before
    assert pq.ParquetFile(mixed).num_row_groups == 1
    ours, old = PlanFile.open(by_shard), PlanFile.open(mixed)
    assert ours.live_keys() == old.live_keys()
    for key in ours.live_keys():
        assert ours._of_key(key).sort_by("id").equals(old._of_key(key).sort_by("id"))
    assert PlanFile.open(tmp_path / "by_shard.parquet", for_writing=True)._of_key("cpu|0").column_names == \
        ["id", CONTENT_KEY, "max_tokens", "response_format", "partition_key"]


def test_which_ids_the_plan_holds_is_read_a_row_group_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_table, "PLAN_ROW_GROUP_ROWS", 16)  # many row groups per shard
    table = a_plan(rows=300, shards=3)
    path = tmp_path / "plan.parquet"
    write_plan(table, path)
    plan = PlanFile.open(path)
    assert pq.ParquetFile(path).num_row_groups > 3 * 5
    asked = pa.array(["r0", "r299", "gone", "r150", "also gone"])
    assert plan.ids_among(asked).to_pylist() == ["r0", "r299", "r150"]
    assert plan.live_keys() == {"cpu|0", "cpu|1", "cpu|2"}
    assert sum(plan._of_key(k).num_rows for k in plan.live_keys()) == 300


def test_an_empty_plan_is_written_and_read(tmp_path):
    path = tmp_path / "plan.parquet"
    write_plan(a_plan().slice(0, 0), path)
    plan = PlanFile.open(path)
    assert plan.live_keys() == set() and plan._of_key("cpu|0").num_rows == 0


def test_a_plan_table_round_trips_and_a_subset_keeps_the_plan_order():
    prepared = prepared_of([[1, 2, 3, 4, 9], [], [1, 2, 3, 4, 8], [5, 6, 7]], order=[2, 0, 3, 1], groups=[0, 2, 0, 1],
                           prefix=[4, 0, 4, 0])
    back = prepared_batch(rows_table(prepared), prepared.batch)
    assert back.ids == prepared.ids and back.errors == prepared.errors and back.block_size == 2
    assert list(back.order) == [2, 0, 3, 1] and back.batch.row(2) == [1, 2, 3, 4, 8]
    part = prepared.subset([3, 0, 2])
    assert part.ids == ["r0", "r2", "r3"] and [part.ids[i] for i in part.order] == ["r2", "r0", "r3"]
    assert part.batch.row(1) == [1, 2, 3, 4, 8] and part.errors == {}
    # r2 then r0 share two whole blocks; r3 shares nothing.
    assert reusable_tokens(prepared.batch, [2, 0, 3], block_size=2) == 4
