"""``prefix_groups``: the global prefix plan of the batch, cut into shards (the partitions)."""

import dagster as dg
import numpy as np
import pyarrow as pa

from batchllm_dagster.answer_store import OutputTableStore
from batchllm_dagster.asset_specs import asset_args
from batchllm_dagster.asset_specs import warehouse as job_warehouse
from batchllm_dagster.config import BatchJobConfig
from batchllm_dagster.instance_limits import warn_if_unlimited
from batchllm_dagster.layout import this_run
from batchllm_dagster.metadata import plan_metadata
from batchllm_dagster.night_guards import refuse_a_costly_night
from batchllm_dagster.partitions import by_hardware, shard_key, sync_partitions
from batchllm_dagster.shard_sizing import ShardSize, last_partitions_metadata, measured_by_hardware, shard_size
from engine.damaged import readable_or_set_aside
from engine.models import preparation_notice
from engine.plan.duplicates import count_duplicates
from engine.plan.plan_stamp import stale_reasons
from engine.plan.plan_table import plan_content_keys, plan_table, previous_shards, read_previous_plan, write_plan
from engine.plan.prepared import plan_tokenized
from engine.plan.shards import assign_shards
from engine.plan.token_cache import TokenCache
from engine.plan.tokenizing import LazyTokenizer, tokenizer_fingerprint
from engine.settings import fingerprint
from engine.table.prompt_snapshot import CONTENT_KEY, columns_without_text, read_snapshot


def groups_table(prepared, shards, keys: list[str], config: BatchJobConfig) -> pa.Table:
    """One row per group: its shard, prefix length, rows and estimated tokens."""
    plan = prepared.plan
    starts = plan.group_starts()
    first_rows = plan.order[starts[:-1]]
    shard = shards.shard_of_row[first_rows]
    prompt = np.bincount(plan.group_of_row, weights=plan.lengths, minlength=plan.num_groups)
    prefill = np.bincount(plan.group_of_row, weights=plan.row_unique_tokens, minlength=plan.num_groups)
    decode = np.bincount(plan.group_of_row, weights=plan.decode_tokens, minlength=plan.num_groups)
    return pa.table({
        "group": np.arange(plan.num_groups),
        "shard": shard,
        "partition_key": [keys[s] for s in shard],
        "hardware": [config.hardware_of_shard(int(s)).name for s in shard],
        "rows": plan.group_sizes,
        "prefix_tokens": plan.group_prefix_tokens,
        "prompt_tokens": prompt.astype(np.int64),
        "estimated_prefill_tokens": prefill.astype(np.int64),
        "estimated_decode_tokens": decode.astype(np.int64),
        "first_id": pa.array([prepared.ids[r] for r in first_rows]).cast(pa.string()),
    })


def _ids_by_shard(prepared, shard_of_row: np.ndarray, shard_count: int) -> list[list]:
    """Each shard's row ids in run order."""
    in_order = shard_of_row[prepared.order]
    by_shard = np.argsort(in_order, kind="stable")
    bounds = np.searchsorted(in_order[by_shard], np.arange(shard_count + 1))
    by_shard = prepared.order[by_shard]
    ids = prepared.ids
    return [[ids[r] for r in by_shard[bounds[s]:bounds[s + 1]].tolist()] for s in range(shard_count)]


def remove_deleted_answers(config: BatchJobConfig, warehouse, ids: pa.ChunkedArray, keys: list[str]) -> int:
    """The output keeps only rows the plan has: answers of deleted ids leave the DuckDB table, and a
    removed partition's Parquet file goes (a kept partition key has the same ids, so its file holds
    no deleted id; the live rows of a removed one stay in DuckDB for their new shard to reuse).
    Returns the answers removed from the table."""
    removed = config.output(warehouse).remove_answers_not_in(ids.combine_chunks())
    live = set(keys)
    for path in config.files.completions_dir.glob("*.parquet"):
        if path.stem not in live:
            path.unlink(missing_ok=True)
    return removed


def measured_shard_size(instance: dg.DagsterInstance, config: BatchJobConfig) -> ShardSize | None:
    """The shard size the last nights' partitions measured (``shard_sizing``), unless the job sets one."""
    if config.shards is not None or config.rows_per_shard is not None:
        return None
    return shard_size(measured_by_hardware(last_partitions_metadata(instance, config.names.asset_key("completions"))))


def build_prefix_groups(config: BatchJobConfig, partitions: dg.DynamicPartitionsDefinition) -> dg.AssetsDefinition:
    """The prefix_groups asset. Over 60 lines because its step is a closure over ``config`` inside
    it (Dagster's decorator); ``make_plan`` is that step's one sequence under the plan lock."""
    @dg.asset(**asset_args(config, "prefix_groups"))  # its pool: one plan step of this job at a time
    def prefix_groups(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        # One plan of this job at a time in any instance (the plan pool needs an instance's limits):
        # a second waits, then plans from the snapshot as it is then.
        warn_if_unlimited(context)
        with config.plan_lock(f"a plan being made ({this_run(context)})"):
            return make_plan(context)

    def make_plan(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        """Snapshot, refusal of a mass removal, tokens, plan, shards, the plan file, partitions,
        removals: one sequence, in this order, under the plan lock (over 60 lines: each step is a
        call, and the order is the point)."""
        columns, warehouse = config.dataset.columns, job_warehouse(config, context)
        notice = preparation_notice(config.llm.model_path)
        if notice:
            context.log.info(notice)
        settings = config.plan_settings()  # counted as the shards' hardware runs, not this machine
        # Lengths and block hashes come from the cache; only new or changed rows are tokenized. The
        # rows' text is not read here otherwise: the plan needs hashes, max_tokens and formats.
        tokenizer = LazyTokenizer(settings.model_path)
        cache = TokenCache(config.files.token_cache_dir, tokenizer_fingerprint(settings.model_path),
                           on_damaged=context.log.warning)
        snapshot = config.files.prompts_path
        readable_or_set_aside(config.files.plan_path, read_previous_plan, "the previous plan",
                              "this plan is cut without it (answers are reused by id and prompt)", context.log.warning)
        without_text = lambda path: read_snapshot(  # noqa: E731 (what the plan reads of it)
            path, columns=columns_without_text(path, columns.prompt, columns.messages))
        if not readable_or_set_aside(snapshot, without_text, "the prompt snapshot",
                                     "materialize prompts to take it again", context.log.warning):
            raise dg.Failure(f"{config.name}: the prompt snapshot was damaged (set aside): materialize "
                             f"{config.name}/prompts, then prefix_groups (the plan job does both)", allow_retries=False)
        # What the plan is made from, read before the rows and checked again before the plan is
        # written: a prompts materialization landing meanwhile (from the UI, say) would otherwise
        # give a plan of old rows under the new snapshot's stamp.
        stamp = config.plan_stamp(settings)
        meta = read_snapshot(snapshot, columns=columns_without_text(snapshot, columns.prompt, columns.messages))
        refuse_a_costly_night(config, warehouse, meta.column(columns.id))
        rows = cache.rows_for(snapshot, tokenizer, columns.prompt, columns.messages, settings.block_size,
                              progress=context.log.info, still_needed=lambda: plan_content_keys(config.files.plan_path))
        prepared = plan_tokenized(meta, rows, settings, config.sampling, columns, config.scheduler)
        plan = prepared.plan
        size = measured_shard_size(context.instance, config)
        if size is not None:
            context.log.info(f"shard size: {size.why}")
        shard_count = config.shard_count(plan.num_rows, *([size.rows_per_shard] if size else []))
        previous = previous_shards(config.files.plan_path, meta.column(columns.id))
        shards = assign_shards(plan, shard_count, previous=previous)
        ids_by_shard = _ids_by_shard(prepared, shards.shard_of_row, shard_count)
        keys = [shard_key(config.hardware_of_shard(s), s, ids) for s, ids in enumerate(ids_by_shard)]
        used = [k for k, ids in zip(keys, ids_by_shard) if ids]  # fewer groups than shards: no empty partitions

        # The plan is the contract: every row with its group, shard, run position and content key
        # (its token ids are in the content-addressed token cache the plan names), stamped with what
        # it was made from. completions runs it as written.
        changed = stale_reasons({k.encode(): v.encode() for k, v in stamp.items()}, config.plan_stamp(settings))
        if changed:
            raise dg.Failure(f"{config.name}: {', '.join(changed)} changed while this plan was being made (prompts "
                             "materialized meanwhile?): no plan written; materialize prefix_groups again")
        plan_bytes = write_plan(plan_table(prepared, meta.column(CONTENT_KEY), cache, shards.shard_of_row, keys, stamp,
                                           context.run.run_id, settings.max_model_len), config.files.plan_path)
        groups = groups_table(prepared, shards, keys, config)
        config.output(warehouse).replace_groups(groups)
        added, removed = sync_partitions(context.instance, config.names.partitions_name, by_hardware(config, used))
        removed_answers = 0 if config.keep_deleted_answers else remove_deleted_answers(
            config, warehouse, meta.column(columns.id), used)
        # A removed key's checkpoint stays while it holds answers the new plan's shards can reuse.
        config.files.checkpoints.prune(OutputTableStore(config, warehouse, context.log), set(used),
                                       meta.column(columns.id).combine_chunks())
        context.log.info(
            f"{plan.num_groups} groups in {len(used)} shards; partitions added {added}, removed {removed}; "
            f"plan {plan_bytes} bytes ({plan_bytes / max(plan.prompt_tokens, 1):.2f} per prompt token)"
        )
        shard_rows = {keys[s]: len(ids) for s, ids in enumerate(ids_by_shard) if ids}
        # The plan's data version is what it was made from (model, snapshot, settings) and its shards.
        return dg.MaterializeResult(data_version=dg.DataVersion(fingerprint(stamp, sorted(used))), metadata={
            **plan_metadata(plan, len(prepared.errors), count_duplicates(prepared.duplicate_set), prepared.tokenize_s),
            "token_cache_rows": rows.cached_rows,  # rows whose token ids were cached
            "tokenized_rows": rows.tokenized_rows,  # distinct new or changed contents tokenized now
            "plan_s": float(round(prepared.plan_s, 4)),
            "removed_answers": removed_answers,  # answers of rows deleted at the source, removed now
            "plan_bytes": plan_bytes,
            "plan_bytes_per_prompt_token": float(round(plan_bytes / max(plan.prompt_tokens, 1), 3)),
            "shards": len(used),
            **({"rows_per_shard": size.rows_per_shard, "rows_per_shard_why": size.why} if size else {}),
            "split_groups": shards.split_groups,
            "partition_keys": dg.MetadataValue.json(shard_rows),
            "estimated_prefill_tokens_per_shard": dg.MetadataValue.json(
                {keys[s]: int(shards.prefill_tokens[s]) for s in range(shard_count) if ids_by_shard[s]}),
            "dagster/row_count": plan.num_groups,
        })

    return prefix_groups
