"""Several partitions in one run (``partitions_per_run``), without vLLM: which shards share a run,
one engine started once for them, and their checks reported once with each partition's outcome."""

import contextlib
import time

import dagster as dg
import pytest

from batchllm_dagster import BatchJobConfig, DatasetSpec
from batchllm_dagster.checks import merged_check_results
from batchllm_dagster.partitions import by_hardware, shard_key, shard_runs
from engine.jobs.shared_engine import SharedEngine
from engine.settings import EngineSettings


def config(hardware, per_run):
    return BatchJobConfig(name="runs", dataset=DatasetSpec(parquet="p.parquet"), hardware=hardware,
                          partitions_per_run=per_run, output_database="o.duckdb", storage_dir="j")


def keys_of(job, shards):
    return [shard_key(job.hardware_of_shard(s), s, [s]) for s in range(shards)]


def test_each_hardware_partitions_shards_are_neighbours_and_runs_never_mix_hardware():
    job = config(["big", "cpu"], 3)
    keys = by_hardware(job, keys_of(job, 7))  # shards cycle: big 0, 2, 4, 6; cpu 1, 3, 5
    assert [k.split("-")[:2] for k in keys] == [["big", "00"], ["big", "02"], ["big", "04"], ["big", "06"],
                                                ["cpu", "01"], ["cpu", "03"], ["cpu", "05"]]
    runs = shard_runs(job, keys)
    assert [len(r) for r in runs] == [3, 1, 3]
    assert all(len({k.split("-")[0] for k in run}) == 1 for run in runs)
    # Keys of an older plan kept in place can split a hardware's neighbours: a run is never a range
    # that would take the other hardware's partition between them.
    mixed = [keys[0], keys[4], keys[1], keys[2]]
    assert shard_runs(job, mixed) == [[keys[0]], [keys[4]], [keys[1], keys[2]]]
    assert shard_runs(config(["big", "cpu"], 1), keys) == [[k] for k in keys]


def test_partitions_per_run_below_one_is_refused():
    with pytest.raises(ValueError, match="partitions_per_run at least 1"):
        config(["cpu"], 0)


def test_a_shared_engine_starts_once_for_every_shard_and_stops_once_at_the_end():
    opened, closed = [], []

    @contextlib.contextmanager
    def opener(settings):
        opened.append(settings)
        yield object()
        time.sleep(0.05)  # vLLM's shutdown takes time, and the shared engine reports it
        closed.append(settings)

    settings = EngineSettings(model_path="m")
    with SharedEngine(opener) as shared:
        engines = []
        for _ in range(3):  # three shards, each entering and leaving the engine as run_resumable does
            with shared.open(settings) as engine:
                engines.append(engine)
        assert len(opened) == 1 and not closed and len({id(e) for e in engines}) == 1
        with pytest.raises(ValueError, match="other settings"), shared.open(EngineSettings(model_path="other")):
            pass
    assert closed == [settings] and 0.05 <= shared.stop_s < 5
    with SharedEngine(opener) as unused:  # every row reused: vLLM never starts, nothing to stop
        pass
    assert len(opened) == 1 and unused.stop_s == 0.0


def test_a_runs_checks_fail_where_any_partition_failed_and_say_which():
    key = dg.AssetKey(["runs", "completions"])

    def results(rows_ok: bool, missing: int):
        return [dg.AssetCheckResult(check_name="one_completion_per_row", asset_key=key, passed=rows_ok,
                                    metadata={"missing": missing}),
                dg.AssetCheckResult(check_name="prefix_saving", asset_key=key, passed=True,
                                    severity=dg.AssetCheckSeverity.WARN, metadata={"saving_vs_ideal": 0.95})]

    merged = merged_check_results({"cpu-00-a": results(True, 0), "cpu-01-b": results(False, 2)})
    rows, saving = merged
    assert rows.check_name == "one_completion_per_row" and not rows.passed
    assert rows.metadata["failed_partitions"].value == ["cpu-01-b"]
    assert rows.metadata["by_partition"].value == {"cpu-00-a": {"missing": 0}, "cpu-01-b": {"missing": 2}}
    assert saving.passed and saving.severity == dg.AssetCheckSeverity.WARN and saving.metadata["partitions"].value == 2


@pytest.mark.parametrize("per_run", [1, 4])
def test_a_backfill_of_completions_takes_partitions_per_run_partitions_a_run(per_run):
    from assets import build_batch_defs

    graph = build_batch_defs(config(["cpu"], per_run)).resolve_asset_graph()
    policy = graph.assets_def_for_key(dg.AssetKey(["runs", "completions"])).backfill_policy
    if per_run == 1:  # Dagster's default: a run per partition
        assert policy is None
    else:
        assert policy.max_partitions_per_run == per_run


def test_unset_a_nights_shards_of_a_hardware_partition_are_one_run_and_a_key_not_to_run_ends_a_range():
    job = config(["big", "cpu"], None)
    keys = by_hardware(job, keys_of(job, 7))
    assert [len(r) for r in shard_runs(job, keys)] == [4, 3]  # one run, one vLLM start, per hardware partition
    # Only the keys to run tonight: a kept key between two of them is never inside a range.
    wanted = {keys[0], keys[1], keys[3], keys[5]}
    assert shard_runs(job, keys, wanted) == [[keys[0], keys[1]], [keys[3]], [keys[5]]]


def test_a_nights_new_shards_are_as_few_as_their_rows_need_numbered_apart_from_the_kept_cycling_over_hardware():
    from batchllm_dagster.partitions import JobShards

    one, two = config(["cpu"], None), config(["big", "cpu"], None)
    # 100,000 rows in 10 shards: 1,500 rows to run need one shard of the job's size (10,000 rows)
    sized = JobShards(one.model_copy(update={"rows_per_shard": 10_000}))
    assert sized.gathered(1_500, 100_000, kept=set(range(10))) == [10]
    assert sized.gathered(25_000, 100_000, kept={0, 2}) == [1, 3, 4]
    # a fixed shard count: the shard size is its share of the whole table
    fixed = JobShards(one.model_copy(update={"shards": 4}))
    assert fixed.gathered(30, 400, kept={0, 1, 2, 3}) == [4]
    # two hardware partitions: the new shards cycle over them, each on its own hardware
    both = JobShards(two.model_copy(update={"rows_per_shard": 10_000}))
    numbers = both.gathered(15_000, 100_000, kept={0, 1, 2, 3})
    assert numbers == [4, 5] and [two.hardware_of_shard(n).name for n in numbers] == ["big", "cpu"]
    assert both.gathered(50, 100_000, kept={0, 1, 3}) == [2]  # a few rows: one shard, one vLLM start
    assert both.keeps(3, both.key(3, ["a"])) and not both.keeps(2, both.key(3, ["a"]))


def test_a_shard_a_failed_run_stopped_at_runs_alone_and_the_rest_of_its_range_after_it():
    job = config(["cpu"], None)
    keys = keys_of(job, 5)
    assert shard_runs(job, keys, set(keys[2:]), alone={keys[2]}) == [[keys[2]], [keys[3], keys[4]]]
    assert shard_runs(job, keys, alone={keys[4]}) == [keys[:4], [keys[4]]]


def test_a_node_whose_fingerprint_is_not_the_one_the_plan_kept_rows_by_says_so(monkeypatch):
    """A GPU node upgraded after the plan step (another vLLM build): the rows the plan kept were
    answered under the plan step's build and do not run tonight; the shard's run says so, loudly."""
    from types import SimpleNamespace

    import assets.completions as completions

    job = config(["cpu"], None)
    said = []
    context = SimpleNamespace(log=SimpleNamespace(warning=said.append))
    monkeypatch.setattr(completions, "current_settings_fingerprint", lambda settings, sampling: "ab12")
    completions.warn_if_settled_elsewhere(SimpleNamespace(settled_with=["ab12"]), None, job, context)
    completions.warn_if_settled_elsewhere(SimpleNamespace(settled_with=[]), None, job, context)
    assert said == []
    completions.warn_if_settled_elsewhere(SimpleNamespace(settled_with=["cd34"]), None, job, context)
    assert len(said) == 1 and "is not the one the plan kept answered rows by (cd34)" in said[0]


def test_partition_sync_adds_new_keys_and_removes_stale_ones():
    import dagster as dg

    from batchllm_dagster.config import HardwarePartition
    from batchllm_dagster.partitions import shard_key, sync_partitions

    with dg.instance_for_test() as instance:
        assert sync_partitions(instance, "jobs", ["a", "b"]) == (["a", "b"], [])
        assert sync_partitions(instance, "jobs", ["b", "c"]) == (["c"], ["a"])
        assert sorted(instance.get_dynamic_partitions("jobs")) == ["b", "c"]
    a100 = HardwarePartition(name="GPU.A100-")
    assert shard_key(a100, 3, ["x", "y"]) == shard_key(a100, 3, ["y", "x"])  # same rows, same key
    assert shard_key(a100, 3, ["x"]).startswith("gpu.a100-03-")  # keys keep '.', Dagster's names do not
    assert a100.slug == "gpu_a100"
