"""``completions``: one partition per shard; runs the shard's rows of the materialized plan on vLLM.

A partition never tokenizes or plans: it reads its rows from the plan ``prefix_groups`` wrote
(token ids, groups, run order) and runs exactly those, after checking that the model, the prompt
snapshot and the settings that shaped the plan have not changed since.
"""

import contextlib
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from dagster_duckdb import DuckDBResource

from batchllm_dagster.checks import merged_check_results, partition_check_results, partition_check_specs
from batchllm_dagster.config import Backend, BatchJobConfig
from batchllm_dagster.instance_limits import warn_if_unlimited
from batchllm_dagster.layout import OUTPUT_TABLE_TAG, PLAN_RUN_TAG
from batchllm_dagster.metadata import run_metadata
from batchllm_dagster.output_table import answers_table, review_metadata
from batchllm_dagster.resources import VLLMResource
from batchllm_dagster.shard_sizing import TimeLimit, last_partitions_metadata, measured_by_hardware, shard_time_limit
from engine.atomic import Staged
from engine.jobs.resume import RunOutcome, run_resumable
from engine.jobs.shared_engine import SharedEngine
from engine.locks import Busy, held_alone
from engine.machine import Platform
from engine.plan.plan_table import NotInPlan, StalePlan, load_shard, planned_counts, planned_keys, superseded
from engine.plan.prepared import PreparedBatch
from engine.run.console import ProgressBar
from engine.settings import EngineSettings, SamplingSettings
from engine.table.field_order_state import recorded_choice
from engine.table.prompt_snapshot import CONTENT_KEY
from engine.vllm.library_output import LOG_DIR, library_output_routed

from .checkpoints import other_checkpoints, prune_checkpoints
from .plan_stamp import plan_stamp_of


def load_planned_shard(config: BatchJobConfig, key: str, settings: EngineSettings, queued_for: str | None):
    """The shard's planned rows with their token ids and its shard number, refused (a Dagster
    failure that says what to do) if the plan no longer has it or no longer holds.
    ``queued_for``: the plan run whose shards this run was queued for (the shard sensor's tag)."""
    try:
        return load_shard(config.files.plan_path, key, plan_stamp_of(config, settings), config.files.token_cache_dir)
    except NotInPlan as missing:
        if queued_for and missing.planned_by != queued_for:
            raise dg.Failure(
                f"the plan changed since this run was queued: partition {key!r} is not in the "
                f"current plan of {config.name!r} (made by run {missing.planned_by}); the new plan's shards are "
                f"queued by the {config.names.run_shards_sensor_name} sensor") from None
        raise dg.Failure(f"partition {key!r} is not in the current plan of {config.name!r}: "
                         "rematerialize prefix_groups and run the partitions it lists") from None
    except StalePlan as stale:
        raise dg.Failure(
            f"the plan of {config.name!r} is stale: {', '.join(stale.reasons)} changed since prefix_groups was "
            f"materialized; rematerialize {config.name}/prefix_groups, then run its partitions") from None
    except FileNotFoundError as exc:
        raise dg.Failure(str(exc)) from None


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


def reuse_sources(config: BatchJobConfig, key: str, prepared: PreparedBatch, warehouse) -> list:
    """What a shard reuses by row fingerprint, besides its own checkpoint, locally and on Ray alike:
    its rows already in the output table (a nightly rerun of unchanged rows), and the answers other
    shards of this job finished and did not write (a shard killed before a new plan gave its rows
    other keys)."""
    previous = config.output(warehouse).rows_of(pa.array(prepared.ids, prepared.id_type))
    reuse = [previous] if previous is not None and previous.num_rows else []
    return reuse + other_checkpoints(config, key)


def run_shard_locally(
    config, key, prepared, settings, sampling, checkpoint, engine_opener, reuse, log, started_at
) -> RunOutcome:
    """The shard on one vLLM engine in this process, resuming from its checkpoint; a progress bar
    when the step's stderr is a terminal (the demo), progress lines in the run's log always."""
    bar = ProgressBar.on_terminal(f"{config.name} {key}")
    try:
        return run_resumable(prepared, settings, sampling, checkpoint, config.scheduler, reuse_from=reuse,
                             progress_sink=log, engine_opener=engine_opener, started_at=started_at, display=bar)
    finally:
        if bar:
            bar.close()


def run_shard_on_ray(config, key, prepared, settings, sampling, checkpoint, reuse, hardware, time_limit,
                     log) -> tuple[RunOutcome, dict]:
    """The shard spread over ``ray_replicas`` vLLM replicas on the Ray cluster, whole groups each,
    with the same reuse and checkpoint as a local run. GPUs are wanted where the hardware partition
    is a GPU's (never because this driver has one); ``time_limit``: the job's, else one from what
    the hardware partition measured (``shard_time_limit``)."""
    from engine.jobs.distributed import run_on_ray

    if time_limit is not None:
        log(f"shard {key} on Ray: time limit {time_limit.why}")
    outcome = run_on_ray(
        prepared,
        settings,
        sampling,
        checkpoint,
        replicas=config.ray_replicas,
        reuse_from=reuse,
        wants_gpus=hardware.platform is Platform.CUDA,
        address=config.ray_address,
        scheduler_settings=config.scheduler,
        actor_prefix=f"batchllm-{key}",
        run_timeout_s=time_limit.seconds if time_limit else None,
        gpu_wait_s=config.ray_gpu_wait_s,
    )
    info = {
        "build": "on Ray replicas",
        "replica_of_sub_shard": {str(s): r for s, r in outcome.replica_of_sub_shard.items()},
        "reassigned_sub_shards": outcome.reassigned_sub_shards,
    }
    return outcome.merged(), info


@dataclass
class PartitionDone:
    """One partition of a run, written and checked; its metadata is made once vLLM has stopped
    (a range's partitions share one engine, whose stop comes after the last of them)."""

    key: str
    outcome: RunOutcome
    engine: dict  # what ran it: vLLM's info and the settings
    hardware_partition: str
    checks: list[dg.AssetCheckResult]
    written: dict  # what writing it measured and wrote

    def metadata(self, device: str) -> dict:
        return {**run_metadata(self.outcome.stats, device, self.hardware_partition, self.engine), **self.written}


def build_completions(config: BatchJobConfig, partitions: dg.DynamicPartitionsDefinition) -> dg.AssetsDefinition:
    """The completions asset. Over 60 lines because its step functions are closures over ``config``
    inside it (Dagster's decorator), each short: a run of partitions, one partition, its write."""
    # A backfill's runs take up to partitions_per_run partitions each, one vLLM start per run.
    # (Dagster 1.13 marks backfill_policy beta; it is its one way to run partition ranges.)
    backfill_policy = dg.BackfillPolicy.multi_run(config.partitions_per_run) if config.partitions_per_run > 1 else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)
        asset = dg.asset(
            key=config.names.asset_key("completions"),
            deps=[config.names.asset_key("prefix_groups")],
            partitions_def=partitions,
            backfill_policy=backfill_policy,
            group_name=config.name,
            pool=config.inference_pool,
            description=(
                f"One answer per prompt row, in DuckDB table {config.output_table!r} (and one Parquet file per "
                "shard under the job's completions/ folder); a partition per shard."
            ),
            kinds={"vllm", "duckdb"},
            code_version=config.completions_code_version(),
            check_specs=partition_check_specs(config),
            op_tags={OUTPUT_TABLE_TAG: config.output_table},
            required_resource_keys={"llm", config.names.warehouse_key},
        )

    @asset
    def completions(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        # One run per partition key at a time, whatever launched it (a backfill, the sensor, the UI,
        # two hardware partitions' jobs), in any instance: the second refuses before it reads the
        # checkpoint the first is writing.
        keys = partition_keys_of(context)  # one, or a range (partitions_per_run: the sensor's, a backfill's)
        warn_if_unlimited(context)
        with contextlib.ExitStack() as held:
            for key in keys:
                try:
                    held.enter_context(
                        held_alone(
                            config.files.lock_path(f"partition-{key}"),
                            f"run {context.run.run_id}, pid {os.getpid()}",
                            f"partition {key} of {config.name}",
                        )
                    )
                except Busy as busy:
                    raise dg.Failure(f"{busy}: this run stops without touching its checkpoint or output") from None
            # vLLM's, torch's and the other libraries' own lines (a missing Triton, NUMA binding, vLLM's
            # start-up report) go to a log file of the run's, not into the run's log: as on the CLI.
            with library_output_routed(LOG_DIR / f"{config.name}-{context.run.run_id}.log") as log_file:
                context.log.info(f"vLLM's and the other libraries' own lines: {log_file}")
                return run_partitions(context, keys)

    def run_partitions(context: dg.AssetExecutionContext, keys: list[str]) -> dg.MaterializeResult:
        """The partitions one after another on one vLLM engine, each written and checked on its own."""
        started_at = time.perf_counter()
        llm: VLLMResource = context.resources.llm
        settings = config.engine_settings(planned_counts(config.files.plan_path))  # the stamp holds them too
        queued_for = context.run.tags.get(PLAN_RUN_TAG)
        # Every shard is read and held against the plan before vLLM starts: a stale plan refuses the run whole.
        shards = [(key, *load_planned_shard(config, key, settings, queued_for)) for key in keys]
        done: list[PartitionDone] = []
        with SharedEngine(llm.engine) as shared:
            try:
                for key, prepared, shard, planned in shards:
                    done.append(run_partition(context, key, prepared, shard, planned, settings, shared.open,
                                              started_at))
                    started_at = time.perf_counter()  # the next partition's time starts here
            except BaseException:
                if done:
                    context.log.error(f"partitions {[d.key for d in done]} were written before this failure: "
                                      "a rerun of the range reuses their answers from the output table")
                raise
        # vLLM stops once, after the last partition: its stop is that partition's (the last that ran on it).
        on_engine = [d for d in done if d.outcome.engine is not None]
        if on_engine:
            on_engine[-1].outcome.stats.engine_stop_s = shared.stop_s
        order = field_order_metadata(config)
        metadata = {d.key: {**d.metadata(llm.device()), **order, "partitions_in_run": len(done)} for d in done}
        if len(done) == 1:
            return dg.MaterializeResult(metadata=metadata[done[0].key], check_results=done[0].checks)
        for key, values in metadata.items():  # each partition's materialization gets its own numbers
            context.add_asset_metadata(values, partition_key=key)
        return dg.MaterializeResult(check_results=merged_check_results({d.key: d.checks for d in done}))

    def ray_time_limit(instance: dg.DagsterInstance, hardware_partition: str, rows: int) -> TimeLimit | None:
        if config.ray_shard_timeout_s is not None:
            return TimeLimit(config.ray_shard_timeout_s, f"{config.ray_shard_timeout_s:g} s (ray_shard_timeout_s)")
        measured = measured_by_hardware(last_partitions_metadata(instance, config.names.asset_key("completions")))
        return shard_time_limit(measured.get(hardware_partition), rows)

    def run_partition(context: dg.AssetExecutionContext, key: str, prepared: PreparedBatch, shard: int, planned,
                      settings: EngineSettings, engine_opener, started_at: float) -> PartitionDone:
        warehouse: DuckDBResource = getattr(context.resources, config.names.warehouse_key)
        hardware = config.hardware_of_shard(shard)
        hardware_partition = hardware.name
        sampling = config.sampling
        checkpoint = config.files.checkpoint_path(key)
        context.log.info(f"shard {key}: {prepared.num_rows} planned rows ({hardware_partition})")
        reuse = reuse_sources(config, key, prepared, warehouse)
        if config.backend is Backend.RAY:
            outcome, info = run_shard_on_ray(config, key, prepared, settings, sampling, checkpoint, reuse, hardware,
                                             ray_time_limit(context.instance, hardware_partition, prepared.num_rows),
                                             context.log.info)
        else:
            outcome = run_shard_locally(config, key, prepared, settings, sampling, checkpoint, engine_opener,
                                        reuse, context.log.info, started_at)
            info = (
                asdict(outcome.engine) if outcome.engine else {"build": "not started: every row was reused or invalid"}
            )
        info.update(
            settings=settings.model_dump(mode="json"),
            sampling=sampling.model_dump(mode="json"),
            scheduler=config.scheduler.model_dump(mode="json"),
            backend=str(config.backend),
        )

        writing = time.perf_counter()  # from here: writing and checks, the partition's time after its rows
        for result in outcome.results:
            result.shard = shard
        table = answers_table(outcome.results, prepared.id_type, key, hardware_partition, config.llm.model_path,
                              planned.select(["id", CONTENT_KEY]), config.review_below)
        # The check against the plan on disk and the write are one step: no plan lands between them
        # (a plan holds this lock exclusively from reading the snapshot to its last delete), else
        # this shard could delete a newer shard's answers, bring back deleted ids or a removed key's file.
        with config.plan_lock(f"partition {key} writing (run {context.run.run_id})", shared=True):
            table, written, stale = write_partition(warehouse, key, table, planned, checkpoint, context.log)
        context.log.info(
            f"wrote {table.num_rows} rows of partition {key} to {config.output_table} ({written} in it now)"
        )
        checks = partition_check_results(config, warehouse, key, table.column("id").to_pylist(), outcome.stats,
                                         constrained_answers(prepared, outcome.results, sampling), stale.to_pylist())
        return PartitionDone(key, outcome, info, hardware_partition, checks, {
            "not_reused_rows": dg.MetadataValue.json(outcome.not_reused),  # why rows ran again
            "superseded_rows": len(stale),  # answers a newer plan wanted from elsewhere: not written
            **review_metadata(table, config.review_below),
            "write_s": float(round(time.perf_counter() - writing, 3)),  # writing and checks (shard sizing reads it)
            "dagster/row_count": written,
        })

    def write_partition(warehouse: DuckDBResource, key: str, table: pa.Table, planned: pa.Table, checkpoint, log):
        """The shard's answers written as the plan on disk still wants them; returns the rows
        written, how many the partition holds now and the ids a newer plan superseded. A plan made
        while this shard ran may want some of its answers from elsewhere (rows moved, edited or
        deleted, another model): those are not written, the newer plan's shards answer them. Then
        only the rest is written, by id, and no Parquet file: the newer plan's run of this key (if it
        has one) writes its file whole, and a key it dropped never comes back."""
        stale = superseded(config.files.plan_path, key, planned)
        if len(stale):
            log.warning(f"{len(stale)} of this shard's rows were superseded by a newer plan while it ran "
                                "(moved to another shard, edited, deleted, or another model): their answers are not "
                                "written; the newer plan's shards answer them")
            table = table.filter(pc.invert(pc.is_in(table.column("id"), value_set=stale)))
            written = config.output(warehouse).replace_partition(key, table, whole_partition=False,
                                                                 on_wait=log.info)
        else:
            # Parquet staged, DuckDB committed, then Parquet renamed into place: a failure at any point
            # (a DuckDB lock timeout, say) leaves both as they were and keeps the checkpoint for the rerun.
            with Staged(config.files.completions_parquet_path(key)) as staged:  # published once DuckDB has committed
                pq.write_table(table, staged.path)
                written = config.output(warehouse).replace_partition(key, table, on_wait=log.info)
        try:  # a convenience beside the answers: a database that cannot read the snapshot fails no shard
            config.output(warehouse).replace_prompts_view(config.files.prompts_path, config.dataset.columns)
        except Exception as exc:
            log.warning(f"the view {config.output_table}_with_prompts was not made: {exc}")
        if not len(stale):
            shutil.rmtree(checkpoint, ignore_errors=True)  # the table now holds every row of the shard
        # else kept: the newer plan's shards reuse its still-valid answers by row fingerprint (a row
        # that only moved to another key), and prune_checkpoints removes it once none is wanted.
        live = planned_keys(config.files.plan_path)  # other shards' checkpoints this write made useless
        prune_checkpoints(config, warehouse, set(live.column("partition_key").to_pylist()),
                          live.column("id").combine_chunks())
        return table, written, stale

    return completions


def field_order_metadata(config: BatchJobConfig) -> dict:
    """With ``field_order: optimize``: the order the rows' prompts were built in and the prompt tokens
    it saves against the declared order, over the whole table when it was chosen (sorted, at the
    job's block size: the minimum prefill), as the job keeps it."""
    choice = recorded_choice(config.files.field_order_path) if config.dataset.prompt is not None else None
    if choice is None or "declared" not in choice["candidates"]:
        return {}
    candidates = choice["candidates"]
    return {"field_order": choice["chosen"],
            "field_order_saved_prompt_tokens": candidates["declared"] - candidates[choice["chosen"]]}


def constrained_answers(prepared: PreparedBatch, results: list, sampling: SamplingSettings) -> list[tuple]:
    """(id, answer, format) of each ok row with a response format: its own, else the job's."""
    row_of = {row_id: i for i, row_id in enumerate(prepared.ids)}
    return [(r.id, r.text, fmt) for r in results if r.status == "ok"
            and (fmt := prepared.response_formats.get(row_of[r.id], sampling.response_format)) is not None]
