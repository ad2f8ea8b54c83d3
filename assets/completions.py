"""``completions``: one partition per shard; runs the shard's rows of the materialized plan on vLLM.

A partition never tokenizes or plans: it reads its rows from the plan ``prefix_groups`` wrote
(token ids, groups, run order) and runs exactly those, after checking that the model, the prompt
snapshot and the settings that shaped the plan have not changed since. The shard's work is
``engine.jobs.shard_job.ShardJob``'s (reuse, run, the write against the plan on disk, pruning); the
asset keeps the locks, the Dagster failures, the metadata and the checks.
"""

import functools
import time
import warnings
from dataclasses import asdict, dataclass, replace

import dagster as dg
import pyarrow as pa

from batchllm_dagster.answer_store import OutputTableStore
from batchllm_dagster.asset_specs import asset_args
from batchllm_dagster.asset_specs import warehouse as job_warehouse
from batchllm_dagster.checks import merged_check_results, partition_check_results, partition_check_specs
from batchllm_dagster.config import Backend, BatchJobConfig
from batchllm_dagster.instance_limits import warn_if_unlimited
from batchllm_dagster.job_settings import JobSettings
from batchllm_dagster.layout import OUTPUT_TABLE_TAG, PLAN_RUN_TAG, this_run
from batchllm_dagster.metadata import field_order_metadata, review_metadata, run_metadata
from batchllm_dagster.night_log import say
from batchllm_dagster.partitions import held_partitions
from batchllm_dagster.shard_sizing import ray_time_limit
from engine.jobs.shard_job import ShardJob
from engine.plan.plan_table import NotInPlan, PlanFile, StalePlan
from engine.run.checkpoint import current_settings_fingerprint


def shard_jobs(config: BatchJobConfig, keys: list[str], context: dg.AssetExecutionContext) -> list[ShardJob]:
    """Each key's shard of the plan on disk, opened once for all of them, as a job on the job's
    settings and answer store (its output table); refused (a Dagster failure that says what to do)
    if the plan no longer has a key or no longer holds."""
    store = OutputTableStore(config, job_warehouse(config, context), context.log)
    queued_for = context.run.tags.get(PLAN_RUN_TAG)  # the plan run whose shards this run was queued for
    try:
        with PlanFile.opened_for_running(config.files.plan_path, config.files.token_cache_dir) as plan:
            refuse_a_plan_of_another_platform(config, plan)
            resolved = JobSettings(config)
            settings = resolved.engine(plan.counts)  # the job's, else what the plan counts in
            stamp = resolved.stamp(settings)
            shards = plan.shards(keys, stamp)
            warn_if_settled_elsewhere(plan, settings, config, context)
    except NotInPlan as missing:
        if queued_for and missing.planned_by != queued_for:
            raise dg.Failure(
                f"the plan changed since this run was queued: partition {missing.key!r} is not in the "
                f"current plan of {config.name!r} (made by run {missing.planned_by}); the new plan's shards are "
                f"queued by the {config.names.run_shards_sensor_name} sensor") from None
        raise dg.Failure(f"partition {missing.key!r} is not in the current plan of {config.name!r}: "
                         "rematerialize prefix_groups and run the partitions it lists") from None
    except StalePlan as stale:
        raise dg.Failure(
            f"the plan of {config.name!r} is stale: {', '.join(stale.reasons)} changed since prefix_groups was "
            f"materialized; rematerialize {config.name}/prefix_groups, then run its partitions") from None
    except FileNotFoundError as exc:
        raise dg.Failure(str(exc)) from None
    except (pa.ArrowException, OSError) as exc:  # a truncated or overwritten file: each attempt reads it the same
        raise dg.Failure(
            f"the plan file {config.files.plan_path} of {config.name!r} is damaged ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}): materialize {config.name}/prefix_groups again, which "
            "sets it aside and cuts the shards anew (answers written are kept)", allow_retries=False) from None
    return [ShardJob(shard, settings, config.sampling, config.scheduler, store, config.files.checkpoints,
                     plan_path=config.files.plan_path, plan_lock=functools.partial(
                         config.files.plan_lock, f"partition {shard.key} writing ({this_run(context)})", shared=True))
            for shard in shards]


def refuse_a_plan_of_another_platform(config: BatchJobConfig, plan: PlanFile) -> None:
    """No retry: the plan, not the node, is wrong for this shard (``JobSettings.check_plan_runs_here``)."""
    try:
        JobSettings(config).check_plan_runs_here(plan.counted_for)
    except ValueError as exc:
        raise dg.Failure(str(exc), allow_retries=False) from None


def warn_if_settled_elsewhere(plan: PlanFile, settings, config: BatchJobConfig, context) -> None:
    """Loud where the plan kept rows by another settings fingerprint than this node's (its vLLM build
    upgraded after the plan step's, say): those rows' answers are of that build, and stay so until a
    plan step of this build (they are not rerun tonight)."""
    here = current_settings_fingerprint(settings, config.sampling)
    if plan.settled_with and here not in plan.settled_with:
        context.log.warning(
            f"this node's settings fingerprint {here} (vLLM's build, the model, the answer settings) is not the one "
            f"the plan kept answered rows by ({', '.join(plan.settled_with)}): those answers were made under it and "
            "are not run again tonight; make the plan step run the shards' vLLM build (the same image)")


def partition_keys_of(context: dg.AssetExecutionContext) -> list[str]:
    """The run's partition, or its range's. A key that left the plan since the run was queued is
    refused when its shard is loaded (saying so); a range whose end left it cannot be listed at all."""
    if context.has_partition_key:
        return [context.partition_key]
    try:
        return list(context.partition_keys)
    except dg.DagsterInvalidInvocationError:
        keys = context.partition_key_range
        raise dg.Failure(f"the plan changed since this run was queued: partitions {keys.start}..{keys.end} are no "
                         "longer all in the current plan; the new plan's shards are queued by the run_shards sensor "
                         "(or rematerialize prefix_groups and run the partitions it lists)") from None


@dataclass
class PartitionDone:
    """One partition of a run, written and checked; its metadata is made once vLLM has stopped
    (a range's partitions share one engine, whose stop comes after the last of them)."""

    key: str
    outcome: object  # the shard's RunOutcome
    engine: dict  # what ran it: vLLM's info and the settings
    hardware_partition: str
    checks: list[dg.AssetCheckResult]
    written: dict  # what writing it measured and wrote
    planned_rows: int  # its rows in the plan

    def metadata(self, device: str, engine_stop_s: float | None) -> dict:
        """``engine_stop_s``: the shared engine's stop, for the partition that ran last on it."""
        stats = self.outcome.stats
        if engine_stop_s is not None:
            stats = replace(stats, engine_stop_s=engine_stop_s)
        return {**run_metadata(stats, device, self.hardware_partition, self.engine, self.planned_rows), **self.written}


def run_partition(config: BatchJobConfig, context: dg.AssetExecutionContext, job: ShardJob, engine_opener,
                  started_at: float) -> PartitionDone:
    """One shard of a run on the run's engine (or on Ray), written and checked against the plan on disk."""
    key, prepared = job.shard.key, job.shard.prepared
    hardware = config.hardware_of_shard(job.shard.number)
    say(context.log, f"shard {key}: {prepared.num_rows:,} planned rows on {hardware.name}, starting")
    if config.backend is Backend.RAY:
        outcome, info = run_on_ray(config, context, job, hardware)
    else:
        outcome = job.run(progress_sink=lambda line: say(context.log, f"shard {key}: {line}"),
                          engine_opener=engine_opener, started_at=started_at, display_label=f"{config.name} {key}")
        info = (asdict(outcome.engine) if outcome.engine
                else {"build": "not started: every row was reused or invalid"})
    info.update(settings=job.engine_settings.model_dump(mode="json"),
                sampling=config.sampling.model_dump(mode="json"),
                scheduler=config.scheduler.model_dump(mode="json"), backend=str(config.backend))

    writing = time.perf_counter()  # from here: writing and checks, the partition's time after its rows
    written = job.write(outcome.results)  # checked against the plan on disk, under its lock
    stale = written.superseded.to_pylist()
    if stale:
        context.log.warning(f"{len(stale)} of this shard's rows were superseded by a newer plan while it ran "
                            "(moved to another shard, edited, deleted, or another model): their answers are not "
                            "written; the newer plan's shards answer them")
    context.log.info(f"wrote {written.written} rows of partition {key} to {config.output_table}, "
                     f"{written.table.num_rows - written.written} already there as they are ({written.rows_now} "
                     "in it now)")
    stats = outcome.stats
    say(context.log, f"shard {key}: done, {stats.rows:,} rows computed ({stats.error_rows:,} errors), "
                     f"{stats.reused_rows:,} reused, {written.written:,} written, engine {stats.wall_s:.1f} s")
    warehouse = job_warehouse(config, context)
    checks = partition_check_results(config, warehouse, key, written.table.column("id").to_pylist(),
                                     outcome.stats, prepared, outcome.results, stale)
    return PartitionDone(key, outcome, info, hardware.name, checks, {
        "not_reused_rows": dg.MetadataValue.json(outcome.not_reused),  # why rows ran again
        "superseded_rows": len(stale),  # answers a newer plan wanted from elsewhere: not written
        "written_rows": written.written,  # rows new or changed in the output table (the rest left as they were)
        **review_metadata(written.table, config.review_below),
        "write_s": float(round(time.perf_counter() - writing, 3)),  # writing and checks (shard sizing reads it)
        "dagster/row_count": written.rows_now,
    }, prepared.num_rows)

def run_on_ray(config: BatchJobConfig, context: dg.AssetExecutionContext, job: ShardJob, hardware) -> tuple:
    """The shard spread over ``ray_replicas`` vLLM replicas on the Ray cluster, whole groups each,
    with the same reuse and checkpoint as a local run. GPUs are wanted where the hardware partition
    is a GPU's (never because this driver has one)."""
    time_limit = ray_time_limit(config, context.instance, hardware.name, job.shard.prepared.num_rows)
    if time_limit is not None:
        context.log.info(f"shard {job.shard.key} on Ray: time limit {time_limit.why}")
    ran = job.run_on_ray(replicas=config.ray_replicas, wants_gpus=hardware.is_gpu, address=config.ray_address,
                         actor_prefix=f"batchllm-{job.shard.key}",
                         run_timeout_s=time_limit.seconds if time_limit else None, gpu_wait_s=config.ray_gpu_wait_s)
    info = {"build": "on Ray replicas",
            "replica_of_sub_shard": {str(s): r for s, r in ran.replica_of_sub_shard.items()},
            "reassigned_sub_shards": ran.reassigned_sub_shards}
    return ran.merged(), info


def build_completions(config: BatchJobConfig, partitions: dg.DynamicPartitionsDefinition) -> dg.AssetsDefinition:
    """The completions asset: its step is a closure over ``config`` (Dagster's decorator), a run of
    partitions, each one ``run_partition``."""
    # A backfill's runs take up to partitions_per_run partitions each (unset: all in one), one vLLM start
    # per run. (Dagster 1.13 marks backfill_policy beta; it is its one way to run partition ranges.)
    per_run = config.partitions_per_run
    backfill_policy = (dg.BackfillPolicy.single_run() if per_run is None
                       else dg.BackfillPolicy.multi_run(per_run) if per_run > 1 else None)
    check_specs = partition_check_specs(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)
        asset = dg.asset(**asset_args(config, "completions", config.completions_code_version()),
                         partitions_def=partitions, backfill_policy=backfill_policy, check_specs=check_specs,
                         op_tags={OUTPUT_TABLE_TAG: config.output_table})

    @asset
    def completions(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        keys = partition_keys_of(context)  # one, or a range (partitions_per_run: the sensor's, a backfill's)
        warn_if_unlimited(context)
        # One run per partition key at a time: the second refuses before it reads the checkpoint the first writes.
        with held_partitions(config, keys, this_run(context)):
            with context.resources.llm.library_output_routed(f"{config.name}-{context.run.run_id}") as log_file:
                context.log.info(f"vLLM's and the other libraries' own lines: {log_file}")
                return run_partitions(context, keys)

    def run_partitions(context: dg.AssetExecutionContext, keys: list[str]) -> dg.MaterializeResult:
        """The partitions one after another on one vLLM engine, each written and checked on its own."""
        started_at = time.perf_counter()
        llm = context.resources.llm
        # Every shard is read and held against the plan before vLLM starts: a stale plan refuses the run whole.
        jobs = shard_jobs(config, keys, context)
        done: list[PartitionDone] = []
        with llm.shared_engine() as shared:
            try:
                for job in jobs:
                    done.append(run_partition(config, context, job, shared.open, started_at))
                    started_at = time.perf_counter()  # the next partition's time starts here
            except BaseException:
                if done:  # they landed: recorded as such, so that only the failed shard and those after run again
                    context.log.error(f"partitions {[d.key for d in done]} were written before this failure and "
                                      f"are recorded as materialized; {jobs[len(done)].shard.key} failed")
                    for d in done:
                        context.log_event(dg.AssetMaterialization(
                            asset_key=context.asset_key, partition=d.key,
                            metadata={**d.metadata(llm.device(), None), "partitions_in_run": len(done)}))
                raise
        # vLLM stops once, after the last partition: its stop is that partition's (the last that ran on it).
        on_engine = [d for d in done if d.outcome.engine is not None]
        stopped_it = on_engine[-1] if on_engine else None
        order = field_order_metadata(config)
        metadata = {d.key: {**d.metadata(llm.device(), shared.stop_s if d is stopped_it else None), **order,
                            "partitions_in_run": len(done)} for d in done}
        if len(done) == 1:
            return dg.MaterializeResult(metadata=metadata[done[0].key], check_results=done[0].checks)
        for key, values in metadata.items():  # each partition's materialization gets its own numbers
            context.add_asset_metadata(values, partition_key=key)
        return dg.MaterializeResult(check_results=merged_check_results({d.key: d.checks for d in done}))

    return completions
