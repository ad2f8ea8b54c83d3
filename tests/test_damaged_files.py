"""A file the package can rebuild, damaged outside it, never stops a night: the plan step names it in
one warning, sets it aside and rebuilds it (the plan on real DuckDB and the tiny model's tokenizer;
``test_bad_config_nights`` runs the whole night on real vLLM)."""

import dagster as dg
import pyarrow.parquet as pq
import pytest

from assets import build_batch_defs
from batchllm_dagster import BatchJobConfig, DatasetSpec, EngineSettings, SamplingSettings
from dagster_project.demo import QUIET

from .conftest import make_prompt_table


@pytest.fixture
def planned(tmp_path, tiny_model):
    source = tmp_path / "prompts.parquet"
    pq.write_table(make_prompt_table(), source)
    config = BatchJobConfig(name="nightly", dataset=DatasetSpec(parquet=str(source)),
                            llm=EngineSettings(model_path=tiny_model), sampling=SamplingSettings(max_tokens=4),
                            shards=2, output_database=str(tmp_path / "out.duckdb"),
                            storage_dir=str(tmp_path / "jobs"))
    defs, instance = build_batch_defs(config), dg.DagsterInstance.ephemeral()
    assert plan(defs, instance).success
    return config, defs, instance


def plan(defs, instance, job="nightly_plan"):
    return defs.resolve_job_def(job).execute_in_process(instance=instance, run_config=QUIET, raise_on_error=False)


def warnings_of(instance, result) -> list[str]:
    return [entry.user_message for entry in instance.all_logs(result.run_id)
            if entry.dagster_event is None and entry.level >= 30]


def partitions(config, instance) -> list[str]:
    return sorted(instance.get_dynamic_partitions(config.names.partitions_name))


def test_a_damaged_plan_is_set_aside_and_the_next_plan_has_the_same_shards(planned):
    config, defs, instance = planned
    keys, plan_rows = partitions(config, instance), pq.read_table(config.files.plan_path).num_rows
    config.files.plan_path.write_bytes(config.files.plan_path.read_bytes()[:300])
    again = plan(defs, instance)
    assert again.success
    (line,) = [w for w in warnings_of(instance, again) if "damaged" in w]
    assert line.startswith(f"the previous plan {config.files.plan_path} is damaged (") and "\n" not in line
    assert partitions(config, instance) == keys and pq.read_table(config.files.plan_path).num_rows == plan_rows
    assert len(list(config.files.job_dir.glob("plan.parquet.damaged-*"))) == 1


def test_a_damaged_snapshot_is_taken_again_by_the_night_and_named_when_the_plan_runs_alone(planned):
    config, defs, instance = planned
    snapshot = config.files.prompts_path
    good = pq.read_table(snapshot)
    snapshot.write_bytes(snapshot.read_bytes()[:300])
    prefix_groups = defs.resolve_asset_graph().assets_def_for_key(config.names.asset_key("prefix_groups"))
    alone = dg.materialize([prefix_groups], instance=instance, run_config=QUIET, raise_on_error=False)
    assert not alone.success
    failure = next(e for e in alone.all_events if e.event_type_value == "STEP_FAILURE").event_specific_data.error
    assert ("nightly: the prompt snapshot was damaged (set aside): materialize prompts, then prefix_groups"
            in failure.message)
    assert plan(defs, instance).success  # the night: prompts takes it again, then the plan
    assert pq.read_table(snapshot).equals(good)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_plan_damaged_after_the_plan_is_named_at_the_shard_in_one_line(planned, damage):
    """A shard whose plan file was damaged after the plan step (a full disk, a copy over it) fails
    once, naming the file and the fix, not with pyarrow's message alone and not on every retry."""
    config, defs, instance = planned
    [key, *_] = partitions(config, instance)
    body = config.files.plan_path.read_bytes()
    config.files.plan_path.write_bytes(body[:300] if damage == "truncated" else b"PAR1" + bytes(range(256)) * 4)
    completions = defs.resolve_asset_graph().assets_def_for_key(config.names.asset_key("completions"))
    run = dg.materialize([completions], partition_key=key, instance=instance,
                         run_config=QUIET, raise_on_error=False)
    [failure] = [e for e in run.all_events if e.is_step_failure]
    message = failure.event_specific_data.error.message
    assert f"the plan file {config.files.plan_path} of 'nightly' is damaged (" in message
    assert "materialize nightly/prefix_groups again" in message and "\n" not in message.strip()
    assert len([e for e in run.all_events if e.event_type_value == "STEP_START"]) == 1  # no retry
