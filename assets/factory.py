"""Build a batch job's Dagster definitions from its config (used from Python and by the Component)."""

import dagster as dg
from dagster_duckdb import DuckDBResource

from batchllm_dagster.checks import build_table_checks
from batchllm_dagster.config import PLAN_TAG, BatchJobConfig
from batchllm_dagster.partitions import RANGE_END, RANGE_START, hardware_of_key, shard_partitions, shard_runs
from batchllm_dagster.resources import DEFAULT_LLM
from engine.digests import text_fingerprint

from .completions import build_completions
from .snapshots import PLAN_RUN_TAG
from .prefix_groups import build_prefix_groups
from .prompts import build_prompts, source_version


def build_batch_defs(config: BatchJobConfig) -> dg.Definitions:
    partitions = shard_partitions(config.partitions_name)
    prompts = build_prompts(config)
    prefix_groups = build_prefix_groups(config, partitions)
    completions = build_completions(config, partitions)

    # One plan at a time per job: the schedule, the source sensor and a hand-launched run all queue
    # behind this tag (dagster.yaml limits each of its values to one run; prefix_groups' op pool
    # covers a UI materialization outside the job).
    plan_job = dg.define_asset_job(
        f"{config.name}_plan",
        selection=dg.AssetSelection.assets(prompts, prefix_groups),
        description="Snapshot the prompts and plan the shards; the shard sensor then runs every shard.",
        tags={PLAN_TAG: config.name},
    )
    # One job per hardware partition: its runs carry the hardware's tags (placement, run pool), in
    # the sensor's runs and in a backfill of that job from the UI alike. A shard's run checks its
    # shard; the whole-table check evaluates in the run of the shard that lands last.
    table_checks = build_table_checks(config)
    shards_jobs = {
        hardware.name: dg.define_asset_job(
            config.shards_job_name(hardware), selection=dg.AssetSelection.assets(completions), tags=hardware.tags(),
            description=f"Run shards bound to hardware partition {hardware.name!r} (backfill its partitions here).")
        for hardware in config.hardware
    }

    @dg.asset_sensor(
        asset_key=prefix_groups.key,
        jobs=list(shards_jobs.values()),
        name=f"{config.name}_run_shards",
        default_status=dg.DefaultSensorStatus.STOPPED,
        description="After a new plan, run each of its shards once (one run per shard partition, or per "
        "partitions_per_run neighbouring ones, on its hardware's job).",
    )
    def run_shards(context: dg.SensorEvaluationContext, asset_event: dg.EventLogEntry):
        requests = []
        for run in shard_runs(config, context.instance.get_dynamic_partitions(config.partitions_name)):
            tags = {PLAN_RUN_TAG: asset_event.run_id}  # a superseded plan's run says so
            keys = run[0]
            if len(run) > 1:  # a range of neighbouring partitions, one vLLM start (partitions_per_run)
                tags.update({RANGE_START: run[0], RANGE_END: run[-1]})
                keys = f"{run[0]}..{run[-1]}"
            requests.append(dg.RunRequest(run_key=f"{asset_event.run_id}:{keys}",
                                          partition_key=run[0] if len(run) == 1 else None,
                                          job_name=shards_jobs[hardware_of_key(config, run[0]).name].name, tags=tags))
        return requests

    @dg.sensor(
        job=plan_job,
        name=f"{config.name}_source_changed",
        minimum_interval_seconds=300,
        default_status=dg.DefaultSensorStatus.STOPPED,
        description="Plan the batch again when the rows of the prompt dataset change.",
    )
    def source_changed(context: dg.SensorEvaluationContext):
        version = text_fingerprint(source_version(config))
        if version == context.cursor:
            return dg.SkipReason("the prompt dataset has not changed")
        context.update_cursor(version)
        return dg.RunRequest(run_key=f"source-{version}")

    schedules = []
    if config.schedule:
        schedules.append(dg.ScheduleDefinition(
            name=f"{config.name}_nightly", job=plan_job, cron_schedule=config.schedule,
            default_status=dg.DefaultScheduleStatus.STOPPED,
        ))
    return dg.Definitions(
        assets=[prompts, prefix_groups, completions],
        asset_checks=table_checks,
        jobs=[plan_job, *shards_jobs.values()],
        sensors=[run_shards, source_changed],
        schedules=schedules,
        # The output database is a resource: a deployment binds another one to <name>_warehouse.
        resources={"llm": DEFAULT_LLM, config.warehouse_key: DuckDBResource(database=config.output_database)},
    )
