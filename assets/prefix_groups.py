"""``prefix_groups``: the global prefix plan of the batch, cut into shards (the partitions)."""

import dagster as dg
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchllm_dagster.answer_store import OutputTableStore
from batchllm_dagster.asset_specs import asset_args
from batchllm_dagster.asset_specs import warehouse as job_warehouse
from batchllm_dagster.config import BatchJobConfig
from batchllm_dagster.forecast import NightForecast, forecast_night, learned_answer_lengths
from batchllm_dagster.instance_limits import warn_if_unlimited
from batchllm_dagster.job_settings import JobSettings
from batchllm_dagster.layout import JobFiles, this_run
from batchllm_dagster.metadata import plan_metadata
from batchllm_dagster.night_guards import refuse_a_costly_night
from batchllm_dagster.night_log import say
from batchllm_dagster.output_table import OutputTable
from batchllm_dagster.partitions import JobShards, by_hardware, sync_partitions
from batchllm_dagster.shard_sizing import Measured, last_partitions_metadata, measured_by_hardware, shard_size
from engine.atomic import Staged
from engine.jobs.plan_job import PlanJob, StoredAnswers
from engine.models import preparation_notice
from engine.plan.answer_lengths import AnswerLengths
from engine.plan.plan_stamp import ANSWER_STAMP_KEYS
from engine.plan.plan_table import PlanFile, StalePlan
from engine.plan.tokenize_workers import TokenizeWorkers
from engine.ray_address import RayUnreachable
from engine.run.checkpoint import current_settings_fingerprint
from engine.settings import fingerprint
from engine.table.dataset import DatasetError


def remove_deleted_answers(output: OutputTable, files: JobFiles, keys: list[str]) -> int:
    """The output keeps only rows the plan has: answers of ids not in the plan just written leave
    the DuckDB table, and a removed partition's Parquet file goes (a kept partition key has the same
    ids, so its file holds no deleted id; the live rows of a removed one stay in DuckDB for their new
    shard to reuse). Returns the answers removed from the table."""
    removed = output.remove_answers_not_in(PlanFile.open(files.plan_path).ids())
    live = set(keys)
    for path in files.completions_dir.glob("*.parquet"):
        if path.stem not in live:
            path.unlink(missing_ok=True)
    return removed


def trim_kept_files(files: JobFiles, keep_deleted_answers: bool, kept: dict[int, str], rows_by_shard: list[int]) -> int:
    """Each kept partition's Parquet file without the rows that left it (an edited row, answered
    again in a shard of its own tonight; a deleted one, unless ``keep_deleted_answers``): a file
    never holds an answer the table no longer has there. Only files holding more rows than their
    shard now has are read; returns how many were rewritten."""
    plan, trimmed = PlanFile.open(files.plan_path), 0
    for shard, key in kept.items():
        path = files.completions_parquet_path(key)
        if not path.exists() or pq.ParquetFile(path).metadata.num_rows <= rows_by_shard[shard]:
            continue
        held = pq.read_table(path)
        keep = pc.is_in(held.column("id"), value_set=plan.ids_of(key))
        if keep_deleted_answers:  # answers of deleted rows stay: those of rows planned elsewhere go
            keep = pc.or_(keep, pc.invert(pc.is_in(held.column("id"), value_set=plan.ids_among(held.column("id")
                                                                                               .combine_chunks()))))
        with Staged(path) as staged:
            pq.write_table(held.filter(keep), staged.path)
        trimmed += 1
    return trimmed


def stored_answers(config: BatchJobConfig, output: OutputTable, settings) -> StoredAnswers:
    """What the plan compares to know which rows are answered: the output table's answer keys, and
    the settings fingerprint a shard of each hardware partition's platform would record (on the
    settings the plan file gives its shards: ``JobSettings.plan``'s block size and context length)."""
    resolved = JobSettings(config)
    runs_with = resolved.engine({"block_size": settings.with_block_size().block_size,
                                 "max_model_len": settings.max_model_len})
    platforms = {h.platform or resolved.counts_for for h in config.hardware}
    return StoredAnswers(output.export_answers,
                         sorted({current_settings_fingerprint(runs_with, config.sampling, p) for p in platforms}))


def refuse_an_unreachable_ray(job: str, workers: TokenizeWorkers) -> None:
    """The job's tokenize workers' Ray address, reached first (``ray_address``): a failure in seconds."""
    try:
        workers.check_reachable()
    except RayUnreachable as exc:
        raise dg.Failure(f"{job}: {exc}", allow_retries=False) from None


def what_runs(made, trimmed: int) -> str:
    """The plan's rows and shards that need a run tonight, and those answered as planned."""
    counts, to_run = made.counts, made.keys_to_run
    return (f"{counts['rows_to_run']:,} of {counts['rows']:,} rows need a run, in {len(to_run)} shards; "
            f"{counts['settled_rows']:,} are answered as planned, in {len(made.used_keys) - len(to_run)} shards that "
            f"do not run ({trimmed} of their files trimmed)")


def answers_version(stamp: dict[str, str]) -> dg.DataVersion:
    """The plan's data version: what decides its answers (the model, the settings: ``ANSWER_STAMP_KEYS``),
    not the snapshot. A night's rows to run are new partitions (missing until they land), and a kept
    partition, whose answers still hold, must not show stale because other rows changed."""
    return dg.DataVersion(fingerprint({key: value for key, value in stamp.items()
                                       if key.encode() in ANSWER_STAMP_KEYS}))


def forecast_within_budget(config: BatchJobConfig, made, measured: dict[str, Measured], lengths: AnswerLengths | None,
                           log) -> NightForecast:
    """Tonight's forecast (``forecast``), said in the plan step's log; a night over ``max_gpu_hours``
    is refused here, before the plan is written: no shard runs, nothing is written."""
    forecast = forecast_night(made, config, measured, lengths)
    for line in forecast.lines():
        say(log, line)
    budget = config.max_gpu_hours
    if budget is not None and forecast.device_hours is None:
        log.warning(f"max_gpu_hours {budget:g} is not checked tonight: nothing measured yet on "
                    f"{', '.join(p.hardware for p in forecast.parts if p.wall_s is None)}")
    elif budget is not None and forecast.device_hours > budget:
        raise dg.Failure(f"{config.name}: refused tonight's plan: its forecast is {forecast.device_hours:,.2f} "
                         f"device-hours ({forecast.rows:,} rows to compute, about {forecast.wall_s / 3600:,.2f} h), "
                         f"over max_gpu_hours {budget:g}; nothing was written and no shard runs. To run it, raise "
                         "max_gpu_hours (or unset it) and materialize prefix_groups again", allow_retries=False)
    return forecast


def publish(name: str, job: PlanJob, made, plan_run: str, counted_for: str, lengths: AnswerLengths | None) -> int:
    """The plan file written (``PlanJob.write``); its bytes. A plan made while the prompts it was made
    from changed is not written: the step fails saying so (a retry plans from the new snapshot)."""
    try:
        return job.write(made, plan_run, counted_for, lengths)
    except StalePlan as stale:
        raise dg.Failure(f"{name}: {', '.join(stale.reasons)} changed while this plan was being made "
                         "(prompts materialized meanwhile?): no plan written; materialize prefix_groups again"
                         ) from None


def said_row_context(settings: JobSettings, log):
    """The context the rows are checked against, and where it came from, said in the log: a warning
    where vLLM's fallback stands in for a length the model's config does not name."""
    row_context = settings.plan_context()
    (log.warning if row_context.assumed else log.info)(
        f"a row may hold {row_context.tokens:,} tokens, prompt and answer: {row_context.source}")
    return row_context


def build_prefix_groups(config: BatchJobConfig, partitions: dg.DynamicPartitionsDefinition) -> dg.AssetsDefinition:
    """The prefix_groups asset: its step is a closure over ``config`` (Dagster's decorator);
    ``make_plan`` is that step's one sequence under the plan lock."""
    name, files, workers = config.name, config.files, TokenizeWorkers(config.tokenize_workers, config.ray_address)

    @dg.asset(**asset_args(config, "prefix_groups", config.plan_code_version()))
    def prefix_groups(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        # One plan of this job at a time in any instance (the plan pool needs an instance's limits):
        # a second waits, then plans from the snapshot as it is then.
        warn_if_unlimited(context)
        refuse_an_unreachable_ray(name, workers)  # before any lock: the wait would hold every shard's write
        with files.plan_lock(f"a plan being made ({this_run(context)})"):
            return make_plan(context)

    def make_plan(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        """Files checked, the guards, the plan (``PlanJob``), the plan file, partitions, removals:
        one sequence, in this order, under the plan lock."""
        output = OutputTable.of_job(warehouse := job_warehouse(config, context), config)
        if carried := output.carry_renamed():  # a renamed table's answers, before anything reads them
            context.log.warning(carried)
        if notice := preparation_notice(config.llm.model_path):  # said before the step spends a minute on it
            context.log.info(notice)
        resolved = JobSettings(config)
        row_context = said_row_context(resolved, context.log)
        job = PlanJob(files.prompts_path, files.plan_path, files.token_cache_dir,
                      resolved.plan(),  # counted as the shards' hardware runs, not this machine
                      config.sampling, config.scheduler, config.dataset.columns, context.log.warning, workers)
        try:
            job.check_files()
        except DatasetError as exc:
            raise dg.Failure(f"{name}: {exc}", allow_retries=False) from None
        stamp = job.stamp()  # before any row is read: a snapshot landing from here on is caught at the write
        refuse_a_costly_night(config, warehouse, job.read_ids())  # the ids let go after: the plan reads its own
        measured = measured_by_hardware(last_partitions_metadata(context.instance,
                                                                 config.names.asset_key("completions")))
        lengths = learned_answer_lengths(output, context.log)
        size = None if config.sets_shard_size else shard_size(measured)  # the size the last nights measured
        naming = JobShards(config, size.rows_per_shard if size else None)
        with job.plan(naming, context.log.info, stored_answers(config, output, job.settings), stamp) as made:
            forecast = forecast_within_budget(config, made, measured, lengths, context.log)  # refused: nothing written
            plan_bytes = publish(name, job, made, context.run.run_id, resolved.counts_for.value, lengths)
            output.replace_groups(made.groups_table(naming))
        used = made.used_keys
        added, removed = sync_partitions(context.instance, config.names.partitions_name, by_hardware(config, used))
        removed_answers = 0 if config.keep_deleted_answers else remove_deleted_answers(output, files, used)
        trimmed = trim_kept_files(files, config.keep_deleted_answers, made.kept, made.rows_by_shard)
        # A removed key's checkpoint stays while it holds answers the new plan's shards can reuse.
        files.checkpoints.prune(OutputTableStore(config, warehouse, context.log), PlanFile.open(files.plan_path))
        context.log.info(f"{made.counts['groups']} groups in {len(used)} shards; partitions added {added}, "
                         f"removed {removed}; plan {plan_bytes} bytes; shard size: "
                         f"{size.why if size else 'set by the job'}")
        context.log.info(what_runs(made, trimmed))
        return dg.MaterializeResult(data_version=answers_version(made.stamp), metadata={
            **plan_metadata(made, plan_bytes, removed_answers, size),
            "context_len": row_context.tokens, "context_source": row_context.source, **forecast.metadata()})

    return prefix_groups
