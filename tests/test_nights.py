"""Seven unattended nights on real vLLM (tiny model) and Dagster, two hardware partitions: rows
inserted, edited and deleted at the source, the model's weights replaced in place, the schedule and
the source sensor firing at once, a plan landing while a shard runs, a shard killed part-way whose
key then changes. After every night: one answer per live id, each the current model's answer to the
current prompt (equal to a run from scratch), no answer of a deleted id, the Parquet files holding
the same rows once, every check green."""

import contextlib
import shutil

import dagster as dg
import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from assets import build_batch_defs
from batchllm_dagster import BatchJobConfig
from batchllm_dagster.job_settings import JobSettings
from dagster_project.demo import QUIET, run_planned_shards
from engine.models import build_tiny_model
from engine.run.checkpoint import NEW_ROW, ROW_CHANGED, SETTINGS_CHANGED, Checkpoint

pytestmark = pytest.mark.slow  # real vLLM


def from_scratch(config: BatchJobConfig) -> dict:
    """Every live row answered by a fresh engine: what each answer in the table must equal."""
    from engine.plan.prepared import prepare_batch
    from engine.plan.tokenizing import load_tokenizer
    from engine.run.batch_run import BatchRun
    from engine.vllm.vllm_engine import open_engine

    with duckdb.connect(config.dataset.database, read_only=True) as con:
        table = con.sql("SELECT id, prompt, messages FROM prompt_rows").to_arrow_table()
    settings = JobSettings(config).engine()
    prepared = prepare_batch(table, load_tokenizer(settings.model_path), settings, config.sampling)
    engine = open_engine(settings)
    try:
        return {r.id: r.text for r in BatchRun(prepared, engine, config.sampling)}
    finally:
        engine.close()


def night(defs, config, instance, sensor_cursor):
    """The schedule and the source sensor fire at once; their plan runs queue one behind the other
    (the plan job's tag, limited to one run in dagster.yaml) and run here in that order; then the
    shard sensor's runs. Returns the runs and the source sensor's cursor."""
    schedule = defs.resolve_schedule_def("nightly_nightly")
    sensor = defs.resolve_sensor_def("nightly_source_changed")
    scheduled = schedule.evaluate_tick(dg.build_schedule_context(instance=instance)).run_requests
    changed = sensor.evaluate_tick(dg.build_sensor_context(instance=instance, cursor=sensor_cursor))
    plan_job = defs.resolve_job_def("nightly_plan")
    assert plan_job.tags["batchllm/plan"] == "nightly"
    plans = [plan_job.execute_in_process(instance=instance, tags=request.tags)
             for request in [*scheduled, *changed.run_requests]]
    assert plans and all(p.success for p in plans)
    shards = run_planned_shards(instance, defs, "nightly")  # asserts every shard run succeeded
    return plans, shards, changed.cursor or sensor_cursor


def check_the_night(config, plans, shards, expected: dict) -> dict:
    with duckdb.connect(config.output_database, read_only=True) as con:
        answers = con.execute("SELECT id, text, status FROM answers").fetchall()
    ids = [a[0] for a in answers]
    assert len(ids) == len(set(ids)), "one row per id"
    assert set(ids) == set(expected), "every live id answered, no deleted id"
    assert all(status == "ok" for _, _, status in answers)
    assert {row_id: text for row_id, text, _ in answers} == expected, "the current model's answer to the current prompt"
    files = [pq.read_table(p, columns=["id"]) for p in sorted(config.files.completions_dir.glob("*.parquet"))]
    parquet_ids = pa.concat_tables(files).column("id").to_pylist()
    assert sorted(parquet_ids) == sorted(expected), "the shard Parquet files hold the same rows"
    evaluations = [e for run in [*plans, *shards] for e in run.get_asset_check_evaluations()]
    assert evaluations and all(e.passed for e in evaluations), [e for e in evaluations if not e.passed]
    table_checks = [e for e in evaluations if e.check_name == "all_prompts_answered"]
    assert table_checks[-1].metadata["outstanding_rows"].value == 0  # the last shard's run checked every row
    reasons: dict = {}
    for run in shards:
        (materialization,) = run.asset_materializations_for_node("nightly__completions")
        for reason, n in materialization.metadata["not_reused_rows"].value.items():
            reasons[reason] = reasons.get(reason, 0) + n
    return reasons


def new_weights(config: BatchJobConfig, folder, seed: int) -> None:
    """The model's weights re-exported to the same folder (a nightly fine-tune): every row runs again."""
    other = build_tiny_model(folder / f"weights-{seed}", seed=seed)
    shutil.copyfile(other / "model.safetensors", f"{config.llm.model_path}/model.safetensors")


def plan_now(defs, instance):
    plan = defs.resolve_job_def("nightly_plan").execute_in_process(instance=instance, run_config=QUIET)
    assert plan.success
    return plan


def shard_requests(defs, instance) -> list:
    """What the shard sensor asks for after the latest plan: one run per shard."""
    sensor = defs.resolve_sensor_def("nightly_run_shards")
    with dg.partition_loading_context(dynamic_partitions_store=instance):
        return sensor.evaluate_tick(dg.build_sensor_context(instance=instance, definitions=defs)).run_requests


def run_shard(defs, instance, request):
    return defs.resolve_job_def(request.job_name).execute_in_process(
        partition_key=request.partition_key, instance=instance, run_config=QUIET, tags=request.tags,
        raise_on_error=False)


def queue_run(defs, instance, request):
    """A shard run created as the daemon queues it: it starts later, from what it was queued with."""
    job = defs.resolve_job_def(request.job_name)
    return instance.create_run_for_job(
        job,
        tags={**job.tags, **request.tags, "dagster/partition": request.partition_key},
        run_config={**QUIET, "execution": {"config": {"in_process": {}}}},
    )


def start_queued(defs, instance, request, queued):
    from dagster._core.definitions.job_base import InMemoryJob
    from dagster._core.execution.api import execute_run

    return execute_run(
        InMemoryJob(defs.resolve_job_def(request.job_name)), instance.get_run_by_id(queued.run_id), instance
    )


def shard_ids(config: BatchJobConfig, key: str) -> list:
    plan = pq.read_table(config.files.plan_path, columns=["id", "partition_key"]).to_pylist()
    return [row["id"] for row in plan if row["partition_key"] == key]


@contextlib.contextmanager
def once_a_shard_finished(key: str, rows: int, then):
    """Call ``then(finished ids)`` inside the run of shard ``key``, right after its ``rows``-th
    finished row went to its checkpoint (the run goes on afterwards unless ``then`` raises)."""
    add, finished = Checkpoint.add, []

    def add_and_maybe_interrupt(self, result):
        add(self, result)
        if self.folder.name == key:
            finished.append(result.id)
            if len(finished) == rows:
                then(list(finished))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Checkpoint, "add", add_and_maybe_interrupt)
        yield finished


def completions_metadata(run) -> dict:
    (materialization,) = run.asset_materializations_for_node("nightly__completions")
    return {name: value.value for name, value in materialization.metadata.items()}


def test_seven_nights_never_a_stale_answer_an_orphan_or_a_red_check(nightly, tmp_path):
    config = nightly
    source = config.dataset.database
    defs = build_batch_defs(config)
    counts = []
    with dg.instance_for_test() as instance:
        cursor = None
        for n in range(1, 6):
            with duckdb.connect(source) as con:
                if n == 2:  # inserts, edits, deletes
                    con.execute("INSERT INTO prompt_rows SELECT 'new-' || id, prompt || ' Again?', messages "
                                "FROM prompt_rows WHERE id LIKE 'doc1-%'")
                    con.execute(
                        "UPDATE prompt_rows SET prompt = prompt || ' (edited)' WHERE id IN ('doc0-q0', 'doc2-q1')"
                    )
                    con.execute("DELETE FROM prompt_rows WHERE id IN ('doc3-q0', 'doc3-q1', 'chat2')")
                if n == 4:  # a whole document goes, one more edit
                    con.execute("DELETE FROM prompt_rows WHERE id LIKE 'doc4-%'")
                    con.execute("UPDATE prompt_rows SET prompt = prompt || ' (again)' WHERE id = 'new-doc1-q2'")
            if n in (3, 5):
                new_weights(config, tmp_path, n)
            plans, shards, cursor = night(defs, config, instance, cursor)
            reasons = check_the_night(config, plans, shards, from_scratch(config))
            with duckdb.connect(source, read_only=True) as con:
                live = con.execute("SELECT count(*) FROM prompt_rows").fetchall()[0][0]
            counts.append((n, live, len(plans), len(shards), reasons))
            if n == 1:
                assert reasons == {NEW_ROW: live}
            if n == 2:  # the 4 inserted rows and the 2 edited ones ran, nothing else
                assert reasons == {NEW_ROW: 4, ROW_CHANGED: 2}
            if n in (3, 5):  # every row ran again on the new weights
                assert reasons == {SETTINGS_CHANGED: live}
            if n == 4:
                assert reasons == {ROW_CHANGED: 1}

        # Night 6: a plan lands while a shard runs. New weights, so every row runs; while shard A
        # runs, a row of A is edited and a row of the other shard B deleted, and the plan job runs
        # again (B gets a new key, A keeps its key). A writes all its answers but the edited row's
        # (superseded: the newer plan wants it again); B's run queued for the old plan refuses; the
        # newer plan's shards answer the rest.
        new_weights(config, tmp_path, 6)
        old_plan = plan_now(defs, instance)
        first, second = shard_requests(defs, instance)
        a_rows, b_rows = shard_ids(config, first.partition_key), shard_ids(config, second.partition_key)
        edited, deleted = a_rows[-1], b_rows[0]

        def edit_and_plan(_finished):
            with duckdb.connect(source) as con:
                con.execute("UPDATE prompt_rows SET prompt = prompt || ' (during)' WHERE id = ?", [edited])
                con.execute("DELETE FROM prompt_rows WHERE id = ?", [deleted])
            plan_now(defs, instance)

        queued_b = queue_run(defs, instance, second)  # the sensor queues both; B waits for its GPU
        with once_a_shard_finished(first.partition_key, 1, edit_and_plan):
            a = run_shard(defs, instance, first)
        assert a.success
        meta = completions_metadata(a)
        assert meta["superseded_rows"] == 1 and meta["computed_rows"] == len(a_rows)  # all ran, one not written
        b = start_queued(defs, instance, second, queued_b)
        assert not b.success  # queued for the old plan: its key is gone
        assert "the plan changed since this run was queued" in "\n".join(
            str(e.event_specific_data.error) for e in b.all_events if e.is_failure)
        assert second.partition_key not in instance.get_dynamic_partitions(config.names.partitions_name)
        shards = run_planned_shards(instance, defs, "nightly")
        reasons = check_the_night(config, [old_plan], [a, *shards], from_scratch(config))
        # A's rows once on the new weights, the edited row again (its checkpointed answer was of the
        # old prompt), B's rows but the deleted one: nothing else ran twice.
        assert reasons == {SETTINGS_CHANGED: len(a_rows) + len(b_rows) - 1, ROW_CHANGED: 1}
        counts.append((6, len(a_rows) + len(b_rows) - 1, 2, 2 + len(shards), reasons))

        # Night 7: a shard killed at 90% whose key then changes. New weights; shard A dies once 90%
        # of its rows are checkpointed; before the rerun a row of A that had not finished is deleted,
        # so A's rows get a new key. The new key's run reuses every answer the dead run finished.
        new_weights(config, tmp_path, 7)
        plan_now(defs, instance)
        first, second = shard_requests(defs, instance)
        a_rows = shard_ids(config, first.partition_key)

        def die(_finished):
            raise RuntimeError("the node went away")

        with once_a_shard_finished(first.partition_key, len(a_rows) * 9 // 10, die) as finished:
            assert not run_shard(defs, instance, first).success
        assert run_shard(defs, instance, second).success
        unfinished = sorted(set(a_rows) - set(finished))
        with duckdb.connect(source) as con:
            con.execute("DELETE FROM prompt_rows WHERE id = ?", [unfinished[0]])
        plans, shards, cursor = night(defs, config, instance, cursor)
        assert first.partition_key not in instance.get_dynamic_partitions(config.names.partitions_name)
        reasons = check_the_night(config, plans, shards, from_scratch(config))
        rerun_of_a = [
            completions_metadata(run)
            for run in shards
            if set(shard_ids(config, run.dagster_run.tags["dagster/partition"])) == set(a_rows) - {unfinished[0]}
        ]
        assert [m["reused_rows"] for m in rerun_of_a] == [len(finished)]
        assert reasons == {SETTINGS_CHANGED: len(unfinished) - 1}  # only what the dead run had not finished
        assert not config.files.checkpoints.of(first.partition_key).exists()  # its answers are in the table now
        counts.append(
            (
                7,
                len(a_rows) + len(shard_ids(config, second.partition_key)) - 1,
                1 + len(plans),
                2 + len(shards),
                reasons,
            )
        )
    print("seven nights (night, live rows, plan runs, shard runs, rows run again by reason):", counts)


def test_a_shard_run_queued_for_a_superseded_plan_says_so(nightly):
    """The shard sensor queued runs for last night's plan; a new plan (rows deleted) replaced a
    shard before its run started: that run fails with what happened, never with a KeyError."""
    config = nightly
    defs = build_batch_defs(config)
    with dg.instance_for_test() as instance:
        assert defs.resolve_job_def("nightly_plan").execute_in_process(instance=instance).success
        sensor = defs.resolve_sensor_def("nightly_run_shards")
        with dg.partition_loading_context(dynamic_partitions_store=instance):
            (stale, _) = sensor.evaluate_tick(dg.build_sensor_context(instance=instance, definitions=defs)).run_requests
        shard_job = defs.resolve_job_def(stale.job_name)
        queued = instance.create_run_for_job(  # created now, as the daemon queues it; it starts later
            shard_job, tags={**shard_job.tags, **stale.tags, "dagster/partition": stale.partition_key},
            run_config={"execution": {"config": {"in_process": {}}}})
        with duckdb.connect(config.dataset.database) as con:
            con.execute("DELETE FROM prompt_rows WHERE id LIKE 'doc%-q0'")  # every shard changes
        assert defs.resolve_job_def("nightly_plan").execute_in_process(instance=instance).success
        assert stale.partition_key not in instance.get_dynamic_partitions(config.names.partitions_name)
        from dagster._core.definitions.job_base import InMemoryJob
        from dagster._core.execution.api import execute_run

        result = execute_run(InMemoryJob(shard_job), instance.get_run_by_id(queued.run_id), instance)
    assert not result.success
    message = "\n".join(str(e.event_specific_data.error) for e in result.all_events if e.is_failure)
    assert "the plan changed since this run was queued" in message and "KeyError" not in message
    assert "the new plan's shards are queued by the nightly_run_shards sensor" in message


def test_dagster_marks_the_plan_and_the_shards_stale_when_the_source_changes(nightly):
    """prompts and prefix_groups report data versions (snapshot digest, plan stamp) and every asset
    a code version: Dagster's own staleness resolver (what the UI shows) sees a changed source."""
    from dagster._core.definitions.data_version import StaleStatus
    from dagster._utils.test.data_versions import get_stale_status_resolver

    config = nightly
    defs = build_batch_defs(config)
    graph = defs.resolve_asset_graph()
    key = lambda name: dg.AssetKey(["nightly", name])  # noqa: E731
    assert all(graph.get(key(n)).code_version for n in ("prompts", "prefix_groups", "completions"))
    with dg.instance_for_test() as instance:
        plan = defs.resolve_job_def("nightly_plan").execute_in_process(instance=instance)
        def data_versions(run):
            return {n: run.asset_materializations_for_node(f"nightly__{n}")[0].tags["dagster/data_version"]
                    for n in ("prompts", "prefix_groups")}

        versions = data_versions(plan)
        status = get_stale_status_resolver(instance, list(graph.assets_defs))
        assert status.get_status(key("prefix_groups")) is StaleStatus.FRESH
        again = defs.resolve_job_def("nightly_plan").execute_in_process(instance=instance)
        assert data_versions(again) == versions  # the same rows and plan: the same versions
        with duckdb.connect(config.dataset.database) as con:
            con.execute("UPDATE prompt_rows SET prompt = prompt || ' (edited)' WHERE id = 'doc0-q0'")
        assert dg.materialize([graph.assets_def_for_key(key("prompts"))], instance=instance).success
        status = get_stale_status_resolver(instance, list(graph.assets_defs))
        assert status.get_status(key("prefix_groups")) is StaleStatus.STALE

