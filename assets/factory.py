"""Build a batch job's Dagster definitions from its config (used from Python and by the Component)."""

import dagster as dg
from dagster_duckdb import DuckDBResource

from batchllm_dagster.checks import build_table_checks
from batchllm_dagster.config import Backend, BatchJobConfig
from batchllm_dagster.layout import PLAN_TAG
from batchllm_dagster.ownership import refuse_at_load
from batchllm_dagster.partitions import shard_partitions
from batchllm_dagster.resources import DEFAULT_LLM
from engine.digests import text_fingerprint
from engine.model_support import refuse_unsupported

from .completions import build_completions
from .prefix_groups import build_prefix_groups
from .prompts import build_prompts, refuse_dataset_mistakes_at_load, source_version
from .shard_sensor import build_run_shards_sensor


def _refuse_at_load(config: BatchJobConfig) -> None:
    """What can be known when the definitions load, ``dg check defs`` says: an output table the job
    does not own, the dataset's mistakes, a model the engine cannot schedule (where its checkpoint
    is on this machine)."""
    refuse_at_load(config.name, config.output_table, config.output_database)
    refuse_dataset_mistakes_at_load(config)
    refuse_unsupported(config.llm.model_path, config.sampling.scores_choice)
    refuse_missing_ray(config)


def refuse_missing_ray(config: BatchJobConfig) -> None:
    """Ray where the job asks for it and the install has none (the README's ``[cpu]`` install): refused
    now, not on the first night with enough new rows to start tokenize workers."""
    import importlib.util

    uses = [what for what, used in (("tokenize_workers: " + str(config.tokenize_workers), config.tokenize_workers > 1),
                                    ("backend: ray", config.backend is Backend.RAY)) if used]
    if uses and importlib.util.find_spec("ray") is None:
        raise ModuleNotFoundError(f"job {config.name!r} sets {' and '.join(uses)}, which runs on Ray, and Ray is not "
                                  "installed here: pip install 'batchllm-dagster[ray]' (or remove the setting)")


def build_batch_defs(config: BatchJobConfig) -> dg.Definitions:
    _refuse_at_load(config)
    partitions = shard_partitions(config.names.partitions_name)
    prompts = build_prompts(config)
    prefix_groups = build_prefix_groups(config, partitions)
    completions = build_completions(config, partitions)

    # One plan at a time per job: the schedule, the source sensor and a hand-launched run all queue
    # behind this tag (dagster.yaml limits each of its values to one run; prefix_groups' op pool
    # covers a UI materialization outside the job).
    plan_job = dg.define_asset_job(
        config.names.plan_job_name,
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
            config.names.shards_job_name(hardware.slug), selection=dg.AssetSelection.assets(completions),
            tags=hardware.tags(),
            description=f"Run shards bound to hardware partition {hardware.name!r} (backfill its partitions here).")
        for hardware in config.hardware
    }

    run_shards = build_run_shards_sensor(config, shards_jobs)

    @dg.sensor(
        job=plan_job,
        name=config.names.source_sensor_name,
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
            name=config.names.schedule_name, job=plan_job, cron_schedule=config.schedule,
            default_status=dg.DefaultScheduleStatus.STOPPED,
        ))
    return dg.Definitions(
        assets=[prompts, prefix_groups, completions],
        asset_checks=table_checks,
        jobs=[plan_job, *shards_jobs.values()],
        sensors=[run_shards, source_changed],
        schedules=schedules,
        # The output database is a resource: a deployment binds another one to <name>_warehouse.
        resources={"llm": DEFAULT_LLM, config.names.warehouse_key: DuckDBResource(database=config.output_database)},
    )
