"""Plans under change: a shard writes only the answers the plan on disk still wants from it, and a
plan is made from one snapshot."""

import pyarrow as pa
import pyarrow.parquet as pq

from engine.plan.plan_table import PlanFile, PlannedShard, answer_identity
from engine.table.prompt_snapshot import CONTENT_KEY, KEY_TYPE

STAMP = {b"batchllm.model": b"m1", b"batchllm.snapshot": b"s1", b"batchllm.settings": b"x1"}


def plan(path, rows, stamp=STAMP):
    """A plan file with the columns ``superseded`` reads: (id, content key, max_tokens, format, key)."""
    ids, keys, max_tokens, formats, partitions = zip(*rows)
    table = pa.table(
        {
            "id": list(ids),
            CONTENT_KEY: pa.array([k.to_bytes(16, "big") for k in keys], KEY_TYPE),
            "max_tokens": list(max_tokens),
            "response_format": pa.array(list(formats), pa.string()),
            "partition_key": list(partitions),
        }
    )
    pq.write_table(table.replace_schema_metadata({**stamp, b"batchllm.plan_run": b"run-1"}), path)
    return pq.read_table(path, filters=[("partition_key", "=", "K")])


def superseded(path, key, ran):
    """What the plan at ``path`` supersedes of shard ``key`` as it ran (``ran``: its answer identity)."""
    return PlanFile.open(path, for_writing=True).superseded(PlannedShard(key, 0, None, ran))


def test_answers_a_newer_plan_wants_from_elsewhere_are_superseded(tmp_path):
    path = tmp_path / "plan.parquet"
    first = [("a", 1, 8, None, "K"), ("b", 2, 8, '{"choice": ["x", "y"]}', "K"), ("c", 3, 8, None, "K"),
             ("d", 4, 8, None, "K"), ("e", 5, 8, None, "K"), ("z", 9, 8, None, "L")]
    ran = answer_identity(plan(path, first))
    assert superseded(path, "K", ran).to_pylist() == []  # the same plan: everything is still wanted
    # The newer plan: b's format and c's max_tokens unchanged, d edited (new content), e moved to
    # another shard, a deleted; f is new in K (not this run's business).
    plan(path, [("b", 2, 8, '{"choice": ["x", "y"]}', "K"), ("c", 3, 8, None, "K"), ("d", 7, 8, None, "K"),
                ("e", 5, 8, None, "M"), ("f", 6, 8, None, "K")])
    assert sorted(superseded(path, "K", ran).to_pylist()) == ["a", "d", "e"]
    plan(path, [(i, k, 16 if i == "c" else m, f, p) for i, k, m, f, p in first])  # c's max_tokens changed
    assert superseded(path, "K", ran).to_pylist() == ["c"]
    plan(path, first, stamp={**STAMP, b"batchllm.snapshot": b"s2"})  # another row of the table changed: not these
    assert superseded(path, "K", ran).to_pylist() == []
    plan(path, first, stamp={**STAMP, b"batchllm.model": b"m2"})  # another model: no old answer is wanted
    assert sorted(superseded(path, "K", ran).to_pylist()) == ["a", "b", "c", "d", "e"]


def parquet_job(tmp_path, tiny_model, name: str, rows: list[dict]):
    """A job over a Parquet file of ``rows``: its config, its prompts and prefix_groups assets, its completions."""
    import dagster as dg

    from assets import build_batch_defs
    from batchllm_dagster import BatchJobConfig, DatasetSpec, EngineSettings

    source = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(rows), source)
    config = BatchJobConfig(
        name=name,
        dataset=DatasetSpec(parquet=str(source)),
        llm=EngineSettings(model_path=tiny_model),
        output_database=str(tmp_path / "o.duckdb"),
        storage_dir=str(tmp_path / "jobs"),
    )
    graph = build_batch_defs(config).resolve_asset_graph()
    prompts, groups, completions = (graph.assets_def_for_key(dg.AssetKey([name, n]))
                                    for n in ("prompts", "prefix_groups", "completions"))
    return config, source, [prompts, groups], completions


def test_prompts_wait_for_a_plan_being_made_and_a_plan_is_made_from_one_snapshot(tmp_path, tiny_model, monkeypatch):
    """A ``prompts`` run that starts while a plan is being made waits for it (the job's plan lock,
    in an instance without limits); and a snapshot replaced under a plan by anything else (no
    lock) is caught: the plan is not written."""
    import threading
    import time

    import dagster as dg

    from engine.locks import locked

    rows = [{"id": i, "prompt": f"a shared start, then {w}"} for i, w in ((1, "one"), (2, "two"), (3, "three"))]
    config, source, (prompts, groups), _ = parquet_job(tmp_path, tiny_model, "race", rows)
    # No compute-log capture: a run materialized on a thread tees its output through `tail -F`
    # subprocesses, whose clean-up once hung past 30 s on a loaded machine (the test is about locks).
    no_log_capture = {"compute_logs": {"module": "dagster._core.storage.noop_compute_log_manager",
                                       "class": "NoOpComputeLogManager"}}
    with dg.instance_for_test(overrides=no_log_capture) as instance:
        assert dg.materialize([prompts], instance=instance).success
        before = config.files.prompts_path.stat().st_mtime_ns
        pq.write_table(pa.table({"id": [1, 2, 3], "prompt": ["edited", "a shared start, then two", "x"]}), source)
        landed = []
        with locked(config.files.lock_path("plan")):  # a plan is being made
            again = threading.Thread(target=lambda: landed.append(dg.materialize([prompts], instance=instance).success))
            again.start()
            time.sleep(2)
            # waiting, nothing written
            assert again.is_alive() and config.files.prompts_path.stat().st_mtime_ns == before
        again.join(60)
        assert landed == [True] and config.files.prompts_path.stat().st_mtime_ns != before

        import engine.jobs.plan_job as plan_job_module

        check_rows = plan_job_module.check_rows
        old_snapshot = tmp_path / "old.parquet"
        old_snapshot.write_bytes(config.files.prompts_path.read_bytes())
        pq.write_table(pa.table({"id": [1, 2, 3], "prompt": ["again", "b", "c"]}), source)
        assert dg.materialize([prompts], instance=instance).success

        def replaced_meanwhile(*args, **kwargs):  # by something that takes no lock (a hand-made copy)
            config.files.prompts_path.write_bytes(old_snapshot.read_bytes())
            return check_rows(*args, **kwargs)

        monkeypatch.setattr(plan_job_module, "check_rows", replaced_meanwhile)
        result = dg.materialize([groups], instance=instance, raise_on_error=False)
        assert not result.success
        failure = result.get_step_failure_events()[0].step_failure_data.error.message
        assert "the prompt snapshot changed while this plan was being made" in failure
        assert not config.files.plan_path.exists()
        monkeypatch.setattr(plan_job_module, "check_rows", check_rows)
        assert dg.materialize([groups], instance=instance).success and config.files.plan_path.exists()


def test_one_run_per_partition_key_whatever_launches_it_and_in_an_instance_without_limits(tmp_path, tiny_model):
    """The instance here has no dagster.yaml (no run-tag or pool limits): a second run of a partition
    that is running refuses at once, naming the holder, and touches nothing."""
    import os

    import dagster as dg

    from engine.locks import held_alone

    rows = [{"id": 1, "prompt": "one shared start"}, {"id": 2, "prompt": "one shared start too"}]
    config, _, upstream, completions = parquet_job(tmp_path, tiny_model, "once", rows)
    with dg.instance_for_test() as instance:
        assert not (instance.get_settings("run_queue") or {}).get("tag_concurrency_limits")
        assert dg.materialize(upstream, instance=instance).success
        key = instance.get_dynamic_partitions(config.names.partitions_name)[0]
        with held_alone(config.files.lock_path(f"partition-{key}"), f"run first-run, pid {os.getpid()}",
                        "the first run"):
            second = dg.materialize([completions], partition_key=key, instance=instance, raise_on_error=False)
        assert not second.success
        message = second.get_step_failure_events()[0].step_failure_data.error.message
        assert f"partition {key} of once is already running (run first-run, pid {os.getpid()})" in message
        assert not config.files.checkpoints.of(key).exists()
        assert not config.files.completions_parquet_path(key).exists()


def test_an_instance_without_the_queueing_limits_is_named_with_the_lines_to_add():
    from pathlib import Path
    from types import SimpleNamespace

    import dagster as dg
    import yaml

    from batchllm_dagster.instance_limits import DAGSTER_YAML, missing_limits, warn_if_unlimited

    with dg.instance_for_test() as bare:
        assert len(missing_limits(bare)) == 3
        said = []
        warn_if_unlimited(SimpleNamespace(instance=bare, log=SimpleNamespace(warning=said.append)))
    assert said[0].startswith("this Dagster instance lacks a run-tag limit of 1 per value of batchllm/pool and a "
                              "run-tag limit of 1 per value of batchllm/plan and a default op pool limit of 1:")
    demo = yaml.safe_load((Path(__file__).parents[1] / "dagster_project" / "dagster.yaml").read_text())
    for settings in (yaml.safe_load(DAGSTER_YAML), demo):  # the lines the warning gives, and the demo's file
        with dg.instance_for_test(overrides=settings) as configured:
            assert missing_limits(configured) == []


def test_a_killed_shard_whose_key_changed_gives_its_finished_answers_to_the_new_shard(tmp_path, tiny_model,
                                                                                       monkeypatch):
    """A shard dies at 90%; a row is inserted, so the next plan gives the shard's rows a new key. The
    new key's run reuses every answer the dead run finished (from its checkpoint, by row
    fingerprint), computes only the rest, and the dead key's checkpoint goes once it is useless."""
    import contextlib

    import dagster as dg

    import batchllm_dagster.resources as resources_module
    from engine.run.stand_in import BlockAccountingEngine

    class DiesAfter(BlockAccountingEngine):
        finished = 0

        def step(self):
            if self.finished >= 18:
                raise RuntimeError("the node went away")
            report = super().step()
            self.finished += len(report.finished)
            return report

    engines = []

    def fake_engine(settings):  # the resource's engine: a block-accounting stand-in, no vLLM
        engines.append(DiesAfter(num_blocks=512, block_size=32) if not engines else
                       BlockAccountingEngine(num_blocks=512, block_size=32))
        return contextlib.nullcontext(engines[-1])

    monkeypatch.setattr(resources_module, "open_engine", fake_engine)
    prompt = "Answer the question about the shared document below in one short sentence. " * 4
    rows = [{"id": i, "prompt": f"{prompt}Question {i}?", "max_tokens": i + 1} for i in range(20)]  # one done per step
    config, source, upstream, completions = parquet_job(tmp_path, tiny_model, "kill", rows)
    with dg.instance_for_test() as instance:
        assert dg.materialize(upstream, instance=instance).success
        [first_key] = instance.get_dynamic_partitions(config.names.partitions_name)
        died = dg.materialize([completions], partition_key=first_key, instance=instance, raise_on_error=False)
        assert not died.success and len(list(config.files.checkpoints.of(first_key).glob("part-*.parquet"))) >= 1
        pq.write_table(
            pa.Table.from_pylist(rows + [{"id": 20, "prompt": f"{prompt}Question 20?", "max_tokens": 4}]), source
        )
        assert dg.materialize(upstream, instance=instance).success
        [new_key] = instance.get_dynamic_partitions(config.names.partitions_name)
        assert new_key != first_key and config.files.checkpoints.of(first_key).exists()  # kept: it holds answers
        rerun = dg.materialize([completions], partition_key=new_key, instance=instance)
        meta = rerun.asset_materializations_for_node("kill__completions")[0].metadata
        assert meta["reused_rows"].value == 18 and meta["computed_rows"].value == 3  # 2 unfinished + the new row
        assert not config.files.checkpoints.of(first_key).exists()  # its answers are in the table now
