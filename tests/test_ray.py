"""Shards on a local Ray cluster: two vLLM replicas (tiny model, CPU), groups kept on one replica."""

import os
import threading
import time

import pytest

# In CI a broken ``ray`` extra must fail the run, not skip it.
ray = __import__("ray") if os.environ.get("CI") == "true" else pytest.importorskip("ray")

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from engine.jobs.distributed import run_on_ray  # noqa: E402
from engine.plan.prepared import prepare_batch  # noqa: E402
from engine.plan.shard_cut import split_prepared  # noqa: E402
from engine.plan.tokenizing import load_tokenizer  # noqa: E402
from engine.run.batch_run import BatchRun  # noqa: E402
from engine.settings import EngineSettings, SamplingSettings  # noqa: E402
from engine.vllm.vllm_engine import open_engine  # noqa: E402

from .conftest import make_prompt_table  # noqa: E402
from .fault_job import completions_and_plan  # noqa: E402

pytestmark = pytest.mark.slow  # real vLLM, dg, Ray or a browser

SAMPLING = SamplingSettings(max_tokens=24)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def local_answers(model: str, table, sampling=SAMPLING) -> dict:
    settings = EngineSettings(model_path=model, kv_cache_blocks=256)
    prepared = prepare_batch(table, load_tokenizer(model), settings, sampling)
    with open_engine(settings) as engine:
        return {r.id: r.text for r in BatchRun(prepared, engine, sampling)}


def prepared_batch(model: str, table, sampling=SAMPLING):
    settings = EngineSettings(model_path=model, kv_cache_blocks=256)
    return prepare_batch(table, load_tokenizer(model), settings, sampling)


def groups_by_id(prepared) -> dict:
    return {prepared.ids[i]: int(g) for i, g in enumerate(prepared.group_of_row)}


def sub_shard_of(result, prepared) -> dict:
    """Each row id's sub-shard (the slice of the batch one replica ran)."""
    return {row_id: int(result.sub_shard_of_row[i]) for i, row_id in enumerate(prepared.ids)}


def assert_groups_on_one_replica(result, prepared) -> None:
    group_of, sub_shard = groups_by_id(prepared), sub_shard_of(result, prepared)
    replica_of_group: dict[int, set] = {}
    for r in result.results:
        replica_of_group.setdefault(group_of[r.id], set()).add(result.replica_of_sub_shard[sub_shard[r.id]])
    assert all(len(replicas) == 1 for replicas in replica_of_group.values()), replica_of_group
    assert len({next(iter(v)) for v in replica_of_group.values()}) == 2, "both replicas did work"


def test_two_replicas_run_each_group_once_and_answer_like_a_local_run(cluster, tiny_model, tmp_path):
    table = make_prompt_table(seed=5, documents=10, questions=4, singles=8)
    settings = EngineSettings(model_path=tiny_model, kv_cache_blocks=256)
    prepared = prepared_batch(tiny_model, table)
    result = run_on_ray(prepared, settings, SAMPLING, tmp_path / "ckpt", replicas=2, bind_cpu_cores=True)
    ids = [r.id for r in result.results]
    assert sorted(ids) == sorted(table.column("id").to_pylist())  # every row exactly once
    assert_groups_on_one_replica(result, prepared)
    assert {r.id: r.text for r in result.results} == local_answers(tiny_model, table)

    # Whole groups per replica compute each prefix once; rows dealt round-robin recompute it.
    spread = run_on_ray(prepared, settings, SAMPLING, tmp_path / "rr", replicas=2, placement="round_robin",
                        bind_cpu_cores=True)
    assert result.prefill_tokens < spread.prefill_tokens


def test_a_replica_killed_midway_has_its_shard_rerun_elsewhere(cluster, tiny_model, tmp_path):
    table = make_prompt_table(seed=6, documents=40, questions=10, singles=20)
    settings = EngineSettings(model_path=tiny_model, kv_cache_blocks=256)
    checkpoints = tmp_path / "ckpt"

    prepared = prepared_batch(tiny_model, table, SamplingSettings(max_tokens=40))
    first_sub_shard = {prepared.ids[i] for i in np.flatnonzero(split_prepared(prepared, 2) == 0)}

    def kill_replica_once_it_checkpoints():
        """Sub-shards checkpoint to the shard's one folder: kill replica 0 once a row of its own is there."""
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            ids = {i for part in checkpoints.glob("part-*.parquet") for i in pq.read_table(part)["id"].to_pylist()}
            if ids & first_sub_shard:
                break
            time.sleep(0.02)
        ray.kill(ray.get_actor("victim-0"), no_restart=True)

    killer = threading.Thread(target=kill_replica_once_it_checkpoints)
    killer.start()
    result = run_on_ray(prepared, settings, SamplingSettings(max_tokens=40), checkpoints, replicas=2,
                        bind_cpu_cores=True, actor_prefix="victim")
    killer.join()
    assert result.reassigned_sub_shards == [0]
    assert result.replica_of_sub_shard[0] == 1
    ids = [r.id for r in result.results]
    assert len(ids) == len(set(ids)) == table.num_rows
    assert result.stats_of_sub_shard[0].reused_rows > 0  # resumed from the dead replica's checkpoint
    group_of, sub_shard = groups_by_id(prepared), sub_shard_of(result, prepared)
    shards_of_group: dict[int, set] = {}
    for r in result.results:
        shards_of_group.setdefault(group_of[r.id], set()).add(sub_shard[r.id])
    assert all(len(s) == 1 for s in shards_of_group.values())
    assert {r.id: r.text for r in result.results} == local_answers(tiny_model, table, SamplingSettings(max_tokens=40))


def test_completions_partition_runs_on_ray_when_configured(cluster, tiny_model, tmp_path):
    import dagster as dg
    import duckdb
    import pyarrow.parquet as pq

    from assets import build_batch_defs
    from batchllm_dagster import BatchJobConfig, DatasetSpec, EngineSettings, SamplingSettings

    table = make_prompt_table(seed=7)
    pq.write_table(table, tmp_path / "prompts.parquet")
    config = BatchJobConfig(
        name="on_ray",
        dataset=DatasetSpec(parquet=str(tmp_path / "prompts.parquet")),
        llm=EngineSettings(model_path=tiny_model, kv_cache_blocks=256),
        sampling=SamplingSettings(max_tokens=24),
        shards=1,
        output_database=str(tmp_path / "out.duckdb"),
        output_table="answers",
        storage_dir=str(tmp_path / "jobs"),
        backend="ray",
        ray_replicas=2,
    )
    defs = build_batch_defs(config)
    graph = defs.resolve_asset_graph()
    assets = [graph.assets_def_for_key(dg.AssetKey(["on_ray", n])) for n in ("prompts", "prefix_groups", "completions")]
    with dg.instance_for_test() as instance:
        assert dg.materialize(assets[:2], instance=instance).success
        (partition,) = instance.get_dynamic_partitions(config.names.partitions_name)
        result = dg.materialize([assets[2]], partition_key=partition, instance=instance)
    assert result.success
    meta = result.asset_materializations_for_node("on_ray__completions")[0].metadata
    assert meta["engine"].value["backend"] == "ray"
    assert set(meta["engine"].value["replica_of_sub_shard"].values()) == {0, 1}
    with duckdb.connect(config.output_database, read_only=True) as con:
        answers = dict(con.execute("SELECT id, text FROM answers").fetchall())
    assert answers == local_answers(tiny_model, table)


def test_replicas_that_cannot_start_time_out_with_what_they_asked_for(cluster, tiny_model, tmp_path):
    prepared = prepared_batch(tiny_model, make_prompt_table(documents=2, questions=2, singles=0))
    settings = EngineSettings(model_path=tiny_model, kv_cache_blocks=256)
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"2 replicas asking for \{'resources': \{'h200': 1\}\} each did not start "
                                           r"within 3s"):
        run_on_ray(prepared, settings, SAMPLING, tmp_path / "ckpt", replicas=2,
                   resources_per_replica={"resources": {"h200": 1}}, start_timeout_s=3)
    assert time.perf_counter() - started < 60


def test_a_rerun_on_ray_reuses_what_the_shard_and_the_output_table_hold_and_checkpoints_where_reuse_looks(
        cluster, tiny_model, tmp_path):
    """Ray's sub-shards write the shard's own checkpoint folder (parts straight in it, as a local
    run's: where reuse and pruning look) and reuse what they are given: a rerun computes nothing."""
    import pyarrow as pa

    from engine.run.results import results_to_table

    table = make_prompt_table(seed=8, documents=6, questions=3, singles=4)
    settings = EngineSettings(model_path=tiny_model, kv_cache_blocks=256)
    prepared = prepared_batch(tiny_model, table)
    first = run_on_ray(prepared, settings, SAMPLING, tmp_path / "ckpt", replicas=2, bind_cpu_cores=True)
    assert list((tmp_path / "ckpt").glob("part-*.parquet")) and not list((tmp_path / "ckpt").glob("*/"))
    output_table = results_to_table(first.results, pa.string())  # as the output table would hold them
    again = run_on_ray(prepared, settings, SAMPLING, tmp_path / "elsewhere", replicas=2, bind_cpu_cores=True,
                       reuse_from=[output_table])
    assert sum(s.reused_rows for s in again.stats_of_sub_shard.values()) == table.num_rows
    assert {r.id: r.text for r in again.results} == {r.id: r.text for r in first.results}


def test_a_failed_run_on_ray_kills_its_actors(cluster, tiny_model, tmp_path):
    """However a run ends, its actors go: a retry finds their names (and GPUs) free."""
    prepared = prepared_batch(tiny_model, make_prompt_table(documents=2, questions=2, singles=0))
    broken = EngineSettings(model_path=str(tmp_path / "no-model"), kv_cache_blocks=256)
    with pytest.raises(Exception, match="does not exist"):
        run_on_ray(prepared, broken, SAMPLING, tmp_path / "ckpt", replicas=2, actor_prefix="doomed")

    def doomed_alive() -> bool:
        return any(a["name"].startswith("doomed-") for a in ray.util.list_named_actors(all_namespaces=True))

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and doomed_alive():
        time.sleep(0.2)
    assert not doomed_alive()


def test_a_job_for_gpu_hardware_never_runs_its_replicas_on_cpu_actors(cluster, tiny_model, tmp_path):
    """Whether replicas need GPUs is the job's hardware partition's to say (``platform: cuda``), not
    the driver's: on this CPU cluster such a shard waits for a GPU node, then refuses."""
    import dagster as dg
    import pyarrow.parquet as pq

    from batchllm_dagster import BatchJobConfig, DatasetSpec
    from batchllm_dagster.config import HardwarePartition

    pq.write_table(make_prompt_table(seed=9, documents=2, questions=2, singles=1), tmp_path / "prompts.parquet")
    config = BatchJobConfig(
        name="gpu_ray", dataset=DatasetSpec(parquet=str(tmp_path / "prompts.parquet")),
        llm=EngineSettings(model_path=tiny_model, kv_cache_blocks=256, block_size=32), sampling=SAMPLING, shards=1,
        hardware=[HardwarePartition(name="h200", platform="cuda")], output_database=str(tmp_path / "out.duckdb"),
        storage_dir=str(tmp_path / "jobs"), backend="ray", ray_replicas=1, ray_gpu_wait_s=1)
    assets = completions_and_plan(config)  # prompts, prefix_groups, completions
    with dg.instance_for_test() as instance:
        assert dg.materialize(assets[:2], instance=instance).success
        (partition,) = instance.get_dynamic_partitions(config.names.partitions_name)
        result = dg.materialize([assets[2]], partition_key=partition, instance=instance, raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "no GPU node joined the Ray cluster within 1s" in str(failure.event_specific_data.error)


def test_a_night_on_ray_with_a_replica_killed_loses_nothing(cluster, tiny_model, tmp_path):
    """A Dagster shard on two Ray replicas; one replica is killed once it has checkpointed a row of
    its own. Its sub-shard reruns on the other, from the shard's checkpoint; every id is then once in
    DuckDB and once in the shard's Parquet file, each equal to a local run's answer."""
    import dagster as dg
    import duckdb

    from batchllm_dagster import BatchJobConfig, DatasetSpec

    sampling = SamplingSettings(max_tokens=40)
    table = make_prompt_table(seed=10, documents=40, questions=10, singles=20)
    pq.write_table(table, tmp_path / "prompts.parquet")
    config = BatchJobConfig(
        name="ray_night", dataset=DatasetSpec(parquet=str(tmp_path / "prompts.parquet")),
        llm=EngineSettings(model_path=tiny_model, kv_cache_blocks=256), sampling=sampling, shards=1,
        output_database=str(tmp_path / "out.duckdb"), output_table="answers", storage_dir=str(tmp_path / "jobs"),
        backend="ray", ray_replicas=2)
    assets = completions_and_plan(config)  # prompts, prefix_groups, completions
    with dg.instance_for_test() as instance:
        assert dg.materialize(assets[:2], instance=instance).success
        (key,) = instance.get_dynamic_partitions(config.names.partitions_name)
        planned = prepared_batch(tiny_model, table, sampling)
        first_sub_shard = {planned.ids[i] for i in np.flatnonzero(split_prepared(planned, 2) == 0)}
        folder = config.files.checkpoints.of(key)
        killed = []

        def kill_replica_once_it_checkpoints():
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                ids = {i for part in folder.glob("part-*.parquet") for i in pq.read_table(part)["id"].to_pylist()}
                if ids & first_sub_shard:
                    ray.kill(ray.get_actor(f"batchllm-{key}-0"), no_restart=True)
                    killed.append(len(ids))
                    return
                time.sleep(0.02)

        killer = threading.Thread(target=kill_replica_once_it_checkpoints)
        killer.start()
        result = dg.materialize([assets[2]], partition_key=key, instance=instance)
        killer.join()
    assert result.success and killed
    meta = result.asset_materializations_for_node("ray_night__completions")[0].metadata
    assert meta["engine"].value["reassigned_sub_shards"] == [0]
    with duckdb.connect(config.output_database, read_only=True) as con:
        rows = con.execute("SELECT id, text FROM answers").fetchall()
    expected = local_answers(tiny_model, table, sampling)
    assert len(rows) == len(expected) and dict(rows) == expected
    in_parquet = pq.read_table(config.files.completions_parquet_path(key), columns=["id", "text"]).to_pylist()
    assert len(in_parquet) == len(expected) and {r["id"]: r["text"] for r in in_parquet} == expected
