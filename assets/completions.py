"""``completions``: one partition per shard; runs the engine on the shard's rows on real vLLM."""

import datetime as dt
import shutil
from dataclasses import asdict

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc

from batchllm_dagster.checks import partition_check_results, partition_check_specs
from batchllm_dagster.config import BatchJobConfig
from batchllm_dagster.metadata import run_metadata
from batchllm_dagster.resources import VLLMResource
from batchllm_dagster.warehouse import existing_rows, replace_partition
from engine.models import resolve_model
from engine.results import merge_stats, results_to_table
from engine.runner import prepare_batch, run_resumable
from engine.settings import fingerprint
from engine.tokenizing import load_tokenizer

from .snapshots import checkpoint_path, completions_parquet_path, plan_path, prompts_path, read_parquet, write_parquet


def shard_rows(config: BatchJobConfig, partition_key: str) -> tuple[pa.Table, pa.Table]:
    """The shard's prompt rows and their plan rows."""
    plan = read_parquet(plan_path(config), "plan")
    mine = plan.filter(pc.equal(plan["partition_key"], partition_key))
    if mine.num_rows == 0:
        raise dg.Failure(
            f"partition {partition_key!r} is not in the current plan of {config.name!r}: "
            "rematerialize prefix_groups and run the partitions it lists"
        )
    prompts = read_parquet(prompts_path(config), "prompt snapshot")
    rows = prompts.filter(pc.is_in(prompts[config.dataset.id_column], value_set=mine["id"]))
    return rows, mine


def run_shard_locally(config, plan_rows, prepared, settings, sampling, scheduler, checkpoint, llm, log):
    """The shard on one vLLM engine in this process, resuming from its checkpoint."""
    # Rows already in the table with the same fingerprint (a nightly rerun of unchanged rows)
    # are reused like checkpointed ones.
    previous = existing_rows(config.warehouse(), config.output_table, plan_rows["id"])
    reuse = []
    if previous is not None and previous.num_rows:
        reuse = [checkpoint / "previous.parquet"]
        write_parquet(previous, reuse[0])
    return run_resumable(prepared, settings, sampling, checkpoint, scheduler, reuse_from=reuse, progress_sink=log,
                         start_engine=llm.open)


def run_shard_on_ray(config, key, rows, settings, sampling, scheduler, checkpoint):
    """The shard spread over ``ray_replicas`` vLLM replicas on the Ray cluster, whole groups each."""
    from engine.distributed import run_on_ray

    outcome = run_on_ray(rows, settings, sampling, checkpoint, replicas=config.ray_replicas, address=config.ray_address,
                         columns=config.dataset.columns, scheduler=scheduler, actor_prefix=f"batchllm-{key}")
    stats = merge_stats(list(outcome.stats_of_shard.values()))
    info = {"vllm": "on Ray replicas", "replica_of_sub_shard": {str(s): r for s, r in outcome.replica_of_shard.items()},
            "reassigned_sub_shards": outcome.reassigned_shards}
    return outcome.results, stats, info


def build_completions(config: BatchJobConfig, partitions: dg.DynamicPartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(
        key=[config.name, "completions"],
        deps=[dg.AssetKey([config.name, "prefix_groups"])],
        partitions_def=partitions,
        group_name=config.name,
        pool=config.inference_pool,
        description=(
            f"One answer per prompt row, in DuckDB table {config.output_table!r} (and one Parquet file per shard "
            "under the job's completions/ folder); a partition per shard."
        ),
        kinds={"vllm", "duckdb"},
        check_specs=partition_check_specs(config),
        op_tags={"batchllm/output_table": config.output_table},
    )
    def completions(context: dg.AssetExecutionContext, llm: VLLMResource) -> dg.MaterializeResult:
        key = context.partition_key
        rows, plan_rows = shard_rows(config, key)
        hardware_partition = config.hardware[int(plan_rows["shard"][0].as_py()) % len(config.hardware)]
        model_path = resolve_model(config.llm.path)
        settings = config.engine_settings(model_path, llm.kv_cache_gib)
        sampling, scheduler = config.sampling_settings(), config.scheduler_settings()
        checkpoint = checkpoint_path(config, key)
        if config.backend == "ray":  # the replicas tokenize and plan their own rows
            context.log.info(f"shard {key}: {rows.num_rows} rows on {config.ray_replicas} Ray replica(s)")
            results, stats, info = run_shard_on_ray(config, key, rows, settings, sampling, scheduler, checkpoint)
        else:
            tokenizer = load_tokenizer(model_path)
            prepared = prepare_batch(rows, tokenizer, settings, sampling, config.dataset.columns, scheduler)
            context.log.info(
                f"shard {key}: {prepared.num_rows} rows, {prepared.plan.num_groups} groups, "
                f"ideal saving {100 * prepared.plan.ideal_saving:.1f}% on {llm.hardware()} ({hardware_partition})"
            )
            results, stats = run_shard_locally(config, plan_rows, prepared, settings, sampling, scheduler,
                                               checkpoint, llm, context.log.info)
            info = dict(llm.engine_info)
        info.update(settings=asdict(settings), sampling=asdict(sampling), backend=config.backend)

        group_of = dict(zip(plan_rows["id"].to_pylist(), plan_rows["group"].to_pylist()))
        for result in results:
            result.group = group_of[result.id]
            result.shard = int(plan_rows["shard"][0].as_py())
        table = results_to_table(results, rows.schema.field(config.dataset.id_column).type)
        n = table.num_rows
        table = (
            table.append_column("partition_key", pa.array([key] * n, pa.string()))
            .append_column("hardware", pa.array([hardware_partition] * n, pa.string()))
            .append_column("model", pa.array([config.llm.path] * n, pa.string()))
            .append_column("settings_fingerprint", pa.array([fingerprint(settings, sampling)] * n, pa.string()))
            .append_column("completed_at", pa.array([dt.datetime.now(dt.timezone.utc)] * n, pa.timestamp("us", tz="UTC")))
        )
        write_parquet(table, completions_parquet_path(config, key))
        written = replace_partition(config.warehouse(), config.output_table, key, table)
        shutil.rmtree(checkpoint, ignore_errors=True)  # the table now holds every row of the shard
        context.log.info(f"wrote {written} rows of partition {key} to {config.output_table}")
        return dg.MaterializeResult(
            metadata={
                **run_metadata(stats, llm.hardware(), hardware_partition, info),
                "reused_rows": stats.extra["reused_rows"],
                "dagster/row_count": written,
            },
            check_results=partition_check_results(config, key, plan_rows["id"].to_pylist(), stats),
        )

    return completions
