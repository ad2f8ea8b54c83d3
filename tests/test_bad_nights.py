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
            "files": sorted(p.name for p in config.completions_dir.glob("*.parquet")),
            "partitions": sorted(instance.get_dynamic_partitions(config.partitions_name)),
            "checkpoints": sorted(p.name for p in config.checkpoints_dir.glob("*")),
            "plan": config.plan_path.read_bytes()}


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

    import assets.completions as completions

    config = nightly
    instance = dg.DagsterInstance.ephemeral()
    defs = build_batch_defs(config)
    assert plan(defs, instance).success
    checked, after_check = completions.superseded, []

    def check_then_try_to_plan(path, key, ran):
        stale = checked(path, key, ran)
        with open(config.lock_path("plan"), "a+b") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                after_check.append("a plan waits")
            else:
                fcntl.flock(handle, fcntl.LOCK_UN)
                after_check.append("a plan could land here")
        return stale

    monkeypatch.setattr(completions, "superseded", check_then_try_to_plan)
    run_planned_shards(instance, defs, "nightly")
    assert after_check == ["a plan waits", "a plan waits"]
