"""A night costs what changed, through Dagster on real vLLM (CPU, tiny model): a first night answers
every shard in one run (one vLLM start); a night with nothing changed runs nothing and leaves every
output row and file byte for byte; a night with rows edited, added and deleted runs one new shard of
exactly those rows, writes only them, deletes the deleted one, and its answers equal a night from
scratch."""

import dagster as dg
import duckdb
import pyarrow.parquet as pq
import pytest

from assets import build_batch_defs
from batchllm_dagster import BatchJobConfig, DatasetSpec, EngineSettings, SamplingSettings
from batchllm_dagster.cli import run_planned_shards
from dagster_project.demo import QUIET

from .conftest import make_prompt_table

pytestmark = pytest.mark.slow  # real vLLM, dg, Ray or a browser


def _config(tmp_path, tiny_model, name: str) -> BatchJobConfig:
    return BatchJobConfig(
        name=name, dataset=DatasetSpec(sql="SELECT id, prompt, messages FROM prompt_rows",
                                       database=str(tmp_path / "warehouse.duckdb")),
        llm=EngineSettings(model_path=tiny_model, kv_cache_blocks=64), sampling=SamplingSettings(max_tokens=6),
        rows_per_shard=10, output_database=str(tmp_path / f"{name}.duckdb"), output_table="answers",
        storage_dir=str(tmp_path / name))


def _night(config: BatchJobConfig, instance) -> tuple[dict, list]:
    defs = build_batch_defs(config)
    planned = defs.resolve_job_def(config.names.plan_job_name).execute_in_process(instance=instance,
                                                                                  run_config=QUIET)
    assert planned.success
    runs = run_planned_shards(instance, defs, config.name, run_config=QUIET)
    return planned.asset_materializations_for_node(f"{config.name}__prefix_groups")[0].metadata, runs


def _table(config: BatchJobConfig) -> dict:
    with duckdb.connect(config.output_database, read_only=True) as con:
        return dict(con.execute("SELECT id, CAST(answers AS VARCHAR) FROM answers").fetchall())


def _files(config: BatchJobConfig) -> dict:
    return {path.name: path.read_bytes() for path in config.files.completions_dir.glob("*.parquet")}


def test_a_night_runs_and_writes_only_what_changed(tmp_path, tiny_model):
    database = tmp_path / "warehouse.duckdb"
    with duckdb.connect(str(database)) as con:
        con.register("incoming", make_prompt_table())
        con.execute("CREATE TABLE prompt_rows AS SELECT * FROM incoming")
    config = _config(tmp_path, tiny_model, "nightly")
    with dg.instance_for_test() as instance:
        plan, runs = _night(config, instance)
        keys = plan["partition_keys"].value
        assert len(keys) == 3 and len(runs) == 1  # every shard in one run: one vLLM start
        landed = [m.metadata for m in runs[0].asset_materializations_for_node("nightly__completions")]
        assert len(landed) == 3 and sum(m["engine_start_s"].value > 0 for m in landed) == 1
        first_table, first_files = _table(config), _files(config)
        assert len(first_table) == 30

        plan, runs = _night(config, instance)  # nothing changed
        assert runs == [] and plan["rows_to_run"].value == 0 and plan["partitions_to_run"].value == []
        assert plan["partition_keys"].value == keys
        assert _table(config) == first_table and _files(config) == first_files  # byte for byte

        with duckdb.connect(str(database)) as con:
            con.execute("UPDATE prompt_rows SET prompt = prompt || ' Briefly.' WHERE id = 'doc1-q2'")
            con.execute("DELETE FROM prompt_rows WHERE id = 'doc3-q0'")
            con.execute("INSERT INTO prompt_rows SELECT 'doc1-q9', prompt || ' Again.', messages FROM prompt_rows "
                        "WHERE id = 'doc1-q1'")
        plan, runs = _night(config, instance)
        assert plan["rows_to_run"].value == 2 and len(plan["partitions_to_run"].value) == 1 and len(runs) == 1
        (landed,) = [m.metadata for m in runs[0].asset_materializations_for_node("nightly__completions")]
        assert landed["computed_rows"].value == 2 and landed["written_rows"].value == 2
        now = _table(config)
        changed = {i for i in now if now[i] != first_table.get(i)} | (set(first_table) - set(now))
        assert changed == {"doc1-q2", "doc3-q0", "doc1-q9"}  # the rest byte for byte
        (new_key,) = plan["partition_keys"].value.keys() - keys.keys()
        with duckdb.connect(config.output_database, read_only=True) as con:
            partition_of = dict(con.execute("SELECT id, partition_key FROM answers").fetchall())
        for key in keys:  # a kept file holds its partition's rows as the table does
            held = pq.read_table(config.files.completions_parquet_path(key))
            assert sorted(held["id"].to_pylist()) == sorted(i for i, k in partition_of.items() if k == key)
            assert not {"doc1-q2", "doc3-q0"} & set(held["id"].to_pylist())
        assert set(pq.read_table(config.files.completions_parquet_path(new_key))["id"].to_pylist()) == {
            "doc1-q2", "doc1-q9"}
        # Dagster agrees: no partition of the plan is stale or missing, the kept ones included.
        from dagster._core.definitions.data_version import StaleStatus
        from dagster._utils.test.data_versions import get_stale_status_resolver

        status = get_stale_status_resolver(instance, list(build_batch_defs(config).resolve_asset_graph().assets_defs))
        completions = dg.AssetKey(["nightly", "completions"])
        assert {k: status.get_status(completions, k) for k in plan["partition_keys"].value} == {
            k: StaleStatus.FRESH for k in plan["partition_keys"].value}

    scratch = _config(tmp_path, tiny_model, "scratch")  # the same rows answered from nothing
    with dg.instance_for_test() as instance:
        _night(scratch, instance)
    with duckdb.connect(config.output_database, read_only=True) as con:
        answers = dict(con.execute("SELECT id, text FROM answers").fetchall())
    with duckdb.connect(scratch.output_database, read_only=True) as con:
        assert answers == dict(con.execute("SELECT id, text FROM answers").fetchall())


def test_a_shard_that_fails_its_run_is_asked_again_alone_and_the_shards_after_it_still_run(tmp_path, tiny_model,
                                                                                          monkeypatch):
    """One run answers a night's three shards in order; the second fails (its engine dies, say): the
    first has landed, and the shard sensor asks for the second alone and for the third in a run of
    its own, so one failing shard never holds back the rest; the second lands on its retry."""
    from assets.shard_sensor import shard_requests
    from batchllm_dagster.layout import SHARDS_TAG
    from engine.jobs.shard_job import ShardJob

    database = tmp_path / "warehouse.duckdb"
    with duckdb.connect(str(database)) as con:
        con.register("incoming", make_prompt_table())
        con.execute("CREATE TABLE prompt_rows AS SELECT * FROM incoming")
    config = _config(tmp_path, tiny_model, "nightly")
    defs = build_batch_defs(config)
    jobs = {"cpu": config.names.shards_job_name("cpu")}
    with dg.instance_for_test() as instance:
        assert defs.resolve_job_def(config.names.plan_job_name).execute_in_process(instance=instance,
                                                                                   run_config=QUIET).success
        keys = instance.get_dynamic_partitions(config.names.partitions_name)
        run = ShardJob.run
        failing = {keys[1]}

        def dies_once(self, *args, **kwargs):
            if self.shard.key in failing:
                failing.discard(self.shard.key)
                raise RuntimeError("the engine went away")
            return run(self, *args, **kwargs)

        monkeypatch.setattr(ShardJob, "run", dies_once)
        (first,) = shard_requests(instance, config, jobs)
        assert first.tags[SHARDS_TAG] == f"{keys[0]}..{keys[2]}"
        assert not run_planned_shards(instance, defs, config.name, run_config=QUIET, check=False)[0].success
        again = shard_requests(instance, config, jobs)
        assert [r.tags[SHARDS_TAG] for r in again] == [keys[1], keys[2]]
        assert all(r.success for r in run_planned_shards(instance, defs, config.name, run_config=QUIET))
        assert shard_requests(instance, config, jobs) == []
    assert len(_table(config)) == 30


def test_the_nights_bench_reports_what_each_night_cost(tmp_path):
    """``batchllm bench --scale ROWS --nights`` on a small table: the first night one run and one
    vLLM start; nothing changed, nothing run or written; the 1% night computes and writes exactly
    the new and edited rows and deletes the deleted ones."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "dagster_project.nights_bench", "--rows", "400", "--partition-rows",
                          "100", "--tokens-per-row", "40", "--work", str(tmp_path / "nights")],
                         check=True, capture_output=True, text=True)
    first, same, changed = json.loads(out.stdout.strip().splitlines()[-1])["nights"]
    assert (first["shard_runs"], first["vllm_starts"], first["partitions_landed"]) == (1, 1, 4)
    assert first["rows_computed"] == first["output_rows_written"] == 400
    assert (same["shard_runs"], same["vllm_starts"], same["output_rows_written"]) == (0, 0, 0)
    assert changed["edited"] == 4 and changed["added"] == 2 and changed["deleted"] == 2
    assert changed["rows_computed"] == changed["output_rows_written"] == 6
    assert changed["output_rows_deleted"] == 2 and changed["vllm_starts"] == 1
