"""A bad night loses nothing: a source that comes back empty or truncated is refused before the
plan removes a single answer (real vLLM, tiny model, through Dagster)."""

import dagster as dg
import duckdb
import pytest

from assets import build_batch_defs
from dagster_project.demo import QUIET, run_planned_shards

from .conftest import make_prompt_table

pytestmark = pytest.mark.slow  # real vLLM


def what_a_night_left(config, instance) -> dict:
    """Everything a plan could remove: answers, shard files, partitions, checkpoints, the plan."""
    with duckdb.connect(config.output_database, read_only=True) as con:
        answers = sorted(con.execute("SELECT id, text FROM answers").fetchall())
    return {"answers": answers,
            "files": sorted(p.name for p in config.files.completions_dir.glob("*.parquet")),
            "partitions": sorted(instance.get_dynamic_partitions(config.names.partitions_name)),
            "checkpoints": sorted(p.name for p in config.files.checkpoints_dir.glob("*")),
            "plan": config.files.plan_path.read_bytes()}


def first_night(config):
    instance = dg.DagsterInstance.ephemeral()
    defs = build_batch_defs(config)
    assert defs.resolve_job_def("nightly_plan").execute_in_process(instance=instance, run_config=QUIET).success
    run_planned_shards(instance, defs, "nightly")
    return defs, instance


def delete_source_rows(config, where: str) -> None:
    with duckdb.connect(config.dataset.database) as con:
        con.execute(f"DELETE FROM prompt_rows WHERE {where}")


def plan(defs, instance):
    return defs.resolve_job_def("nightly_plan").execute_in_process(instance=instance, run_config=QUIET,
                                                                  raise_on_error=False)


def test_an_empty_source_is_refused_and_every_answer_kept_then_a_small_deletion_goes_through(nightly):
    config = nightly
    defs, instance = first_night(config)
    before = what_a_night_left(config, instance)
    assert len(before["answers"]) > 20 and len(before["partitions"]) == 2 and len(before["files"]) == 2

    delete_source_rows(config, "true")  # an upstream table truncated
    refused = plan(defs, instance)
    assert not refused.success
    failure = next(e for e in refused.all_events if e.event_type_value == "STEP_FAILURE")
    message = failure.event_specific_data.error.message
    assert "max_removed_share" in message and f"{len(before['answers'])} of the {len(before['answers'])}" in message
    assert what_a_night_left(config, instance) == before, "a refused plan removes nothing"

    # The source comes back with two rows fewer: a small deletion, under the default share.
    with duckdb.connect(config.dataset.database) as con:
        con.register("incoming", make_prompt_table())
        con.execute("INSERT INTO prompt_rows SELECT * FROM incoming")
    ids = [row_id for row_id, _ in before["answers"]]
    delete_source_rows(config, f"id IN ('{ids[0]}', '{ids[1]}')")
    planned = plan(defs, instance)
    assert planned.success
    (materialization,) = planned.asset_materializations_for_node("nightly__prefix_groups")
    assert materialization.metadata["removed_answers"].value == 2
    with duckdb.connect(config.output_database, read_only=True) as con:
        assert con.execute("SELECT count(*) FROM answers").fetchall()[0][0] == len(ids) - 2


def test_a_job_that_keeps_deleted_answers_is_never_refused_for_them(nightly):
    """With ``keep_deleted_answers`` no plan removes an answer: the table's history of deleted rows
    must not count as answers a plan would remove (it would refuse every plan once history grew)."""
    config = nightly.model_copy(update={"keep_deleted_answers": True})
    defs, instance = first_night(config)
    answered = len(what_a_night_left(config, instance)["answers"])
    delete_source_rows(config, "true")
    assert plan(defs, instance).success
    assert len(what_a_night_left(config, instance)["answers"]) == answered  # history kept


def test_removing_every_answer_goes_through_where_the_job_allows_it(nightly):
    config = nightly.model_copy(update={"max_removed_share": 1.0})
    defs, instance = first_night(config)
    delete_source_rows(config, "true")
    planned = plan(defs, instance)
    assert planned.success
    (materialization,) = planned.asset_materializations_for_node("nightly__prefix_groups")
    assert materialization.metadata["removed_answers"].value > 20
    left = what_a_night_left(config, instance)
    assert left["answers"] == [] and left["files"] == [] and left["partitions"] == []


def test_no_plan_lands_between_a_shards_check_against_the_plan_and_its_write(nightly, monkeypatch):
    """A shard checks which of its answers the plan on disk still wants, then writes them: a plan
    landing in between (it deletes and moves answers under the plan lock) could have the old shard
    delete a newer shard's answers or bring deleted ids back. Right after the check, a plan cannot
    take its lock: the check and the write are one step."""
    import fcntl

    from engine.plan.plan_table import PlanFile

    config = nightly
    instance = dg.DagsterInstance.ephemeral()
    defs = build_batch_defs(config)
    assert plan(defs, instance).success
    checked, after_check = PlanFile.superseded, []

    def check_then_try_to_plan(plan, shard):
        stale = checked(plan, shard)
        with open(config.files.lock_path("plan"), "a+b") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                after_check.append("a plan waits")
            else:
                fcntl.flock(handle, fcntl.LOCK_UN)
                after_check.append("a plan could land here")
        return stale

    monkeypatch.setattr(PlanFile, "superseded", check_then_try_to_plan)
    run_planned_shards(instance, defs, "nightly")
    assert after_check == ["a plan waits", "a plan waits"]


def sensor_requests(defs, instance) -> list:
    sensor = defs.resolve_sensor_def("nightly_run_shards")
    with dg.partition_loading_context(dynamic_partitions_store=instance):
        result = sensor.evaluate_tick(dg.build_sensor_context(instance=instance, definitions=defs))
    return result.run_requests


def queue(defs, instance, request):
    """A run created as the daemon creates a sensor's: it starts later, from what it was queued with."""
    job = defs.resolve_job_def(request.job_name)
    return instance.create_run_for_job(
        job, tags={**job.tags, **request.tags, "dagster/partition": request.partition_key},
        run_config={**QUIET, "execution": {"config": {"in_process": {}}}})


def start(defs, instance, queued):
    from dagster._core.definitions.job_base import InMemoryJob
    from dagster._core.execution.api import execute_run

    job = defs.resolve_job_def(queued.job_name)
    return execute_run(InMemoryJob(job), instance.get_run_by_id(queued.run_id), instance)


def insert_row(config, n: int) -> None:
    with duckdb.connect(config.dataset.database) as con:
        con.execute("INSERT INTO prompt_rows (id, prompt) VALUES (?, ?)", [f"late-{n}", f"a row inserted late, {n}"])


def test_with_rows_arriving_while_shards_wait_every_shard_lands_and_a_refused_run_is_asked_again(nightly):
    """No run-retry setting, no dagster.yaml: inserts land every few minutes, each a new plan that
    changes a shard's key while its run waits to start (a long vLLM start), and a run is refused
    because another run holds its key. The shard sensor asks again for what has not landed, until
    every partition of the last plan has, with one answer per live id."""
    from engine.locks import held_alone

    config = nightly
    defs = build_batch_defs(config)
    with dg.instance_for_test() as instance:
        queued = []
        for night in range(3):  # a plan, its shards queued, then rows arrive before they start
            assert plan(defs, instance).success
            queued += [queue(defs, instance, r) for r in sensor_requests(defs, instance)]
            insert_row(config, night)
        assert plan(defs, instance).success
        # The queued runs start late: those whose key the later plans replaced fail, saying so.
        outcomes = [start(defs, instance, q).success for q in queued]
        assert not all(outcomes)
        # Another run holds a key of the current plan: its run is refused (not queued behind it).
        keys = instance.get_dynamic_partitions(config.names.partitions_name)
        retried = 0
        for tick in range(6):
            requests = sensor_requests(defs, instance)
            if not requests:
                break
            for request in requests:
                run = queue(defs, instance, request)
                if tick == 0:
                    with held_alone(config.files.lock_path(f"partition-{request.partition_key}"), "another run", "x"):
                        assert not start(defs, instance, run).success
                else:
                    retried += ":attempt-" in request.run_key
                    assert start(defs, instance, run).success
        assert retried and not sensor_requests(defs, instance)
        landed = {r.partition_key for r in instance.fetch_materializations(
            dg.AssetKey(["nightly", "completions"]), limit=100).records}
        assert set(keys) <= landed
    with duckdb.connect(config.output_database, read_only=True) as con:
        answers = con.execute("SELECT id, status FROM answers").fetchall()
        live = {row[0] for row in con.execute("SELECT id FROM prompt_rows").fetchall()}
    assert sorted(a[0] for a in answers) == sorted(live) and all(status == "ok" for _, status in answers)


def test_each_answer_says_when_it_was_computed_and_its_prompt_is_one_query_away(nightly):
    """``computed_at`` is when the engine answered a row, kept when a later night reuses the answer
    (``completed_at`` is when its partition last wrote it); the view ``answers_with_prompts`` gives
    each answer its prompt, and whether the source still has that prompt."""
    import time

    config = nightly
    defs, instance = first_night(config)
    with duckdb.connect(config.output_database, read_only=True) as con:
        first = {r[0]: r[1:] for r in con.execute(
            "SELECT id, computed_at, completed_at, prompt, prompt_current FROM answers_with_prompts").fetchall()}
        source = dict(con.execute("SELECT id, prompt FROM prompt_rows").fetchall())
    assert {i: r[2] for i, r in first.items()} == source and all(r[3] for r in first.values())
    assert all(r[0] is not None and r[0] <= r[1] for r in first.values())
    edited = next(i for i, p in source.items() if p)
    with duckdb.connect(config.dataset.database) as con:
        con.execute("UPDATE prompt_rows SET prompt = prompt || ' (edited)' WHERE id = ?", [edited])
    time.sleep(0.01)
    assert plan(defs, instance).success
    with duckdb.connect(config.output_database, read_only=True) as con:
        current = dict(con.execute("SELECT id, prompt_current FROM answers_with_prompts").fetchall())
    assert [i for i, c in current.items() if not c] == [edited]  # its answer is of the old prompt, until it runs
    run_planned_shards(instance, defs, "nightly")
    with duckdb.connect(config.output_database, read_only=True) as con:
        second = {r[0]: r[1:] for r in con.execute(
            "SELECT id, computed_at, completed_at, prompt, prompt_current FROM answers_with_prompts").fetchall()}
    assert all(r[3] for r in second.values()) and second[edited][2].endswith("(edited)")
    assert second[edited][0] > first[edited][0]  # computed again
    reused = [i for i in second if i != edited]
    assert all(second[i][0] == first[i][0] for i in reused)  # reused answers keep when they were computed
    assert all(second[i][1] >= first[i][1] for i in reused)
