"""Metadata recorded on materializations. Numbers stay numbers so the UI plots them."""

from __future__ import annotations

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc

from engine.run.results import RunStats

from .partitions import SHARDS_TO_RUN


def table_preview(table: pa.Table, columns: list[str], rows: int = 5, width: int = 80) -> dg.MetadataValue:
    shown = [c for c in columns if c in table.column_names]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    for record in table.select(shown).slice(0, rows).to_pylist():
        cells = [str(record[c]).replace("\n", " ").replace("|", "/")[:width] for c in shown]
        lines.append("| " + " | ".join(cells) + " |")
    return dg.MetadataValue.md("\n".join(lines))


def plan_metadata(made, plan_bytes: int, removed_answers: int, size) -> dict:
    """A plan's materialization (``made``: a ``PlanJob``'s ``JobPlan``): its summary, what the plan
    step did besides, and each shard's rows and estimated prefill."""
    summary, keys, rows_by_shard = made.summary(), made.keys, made.rows_by_shard
    return {
        **summary,
        "removed_answers": removed_answers,  # answers of rows deleted at the source, removed now
        "plan_bytes": plan_bytes,
        "plan_bytes_per_prompt_token": float(round(plan_bytes / max(summary["prompt_tokens"], 1), 3)),
        **({"rows_per_shard": size.rows_per_shard, "rows_per_shard_why": size.why} if size else {}),
        "partition_keys": dg.MetadataValue.json({keys[s]: rows for s, rows in enumerate(rows_by_shard) if rows}),
        # the partitions whose rows need a run (the shard sensor's and batchllm-dagster run's list); the
        # others' rows are answered as planned: they are not run again
        SHARDS_TO_RUN: dg.MetadataValue.json(made.keys_to_run),
        "estimated_prefill_tokens_per_shard": dg.MetadataValue.json(
            {keys[s]: int(made.shards.prefill_tokens[s]) for s, rows in enumerate(rows_by_shard) if rows}),
        "dagster/row_count": summary["groups"],
    }


def run_metadata(stats: RunStats, device: str, hardware_partition: str, engine_info: dict,
                 planned_rows: int) -> dict:
    metadata = {
        "planned_rows": planned_rows,  # the partition's rows in the plan: computed + reused + errors before any run
        "computed_rows": stats.rows,  # given to the engine in this run (reused rows are not)
        "reused_rows": stats.reused_rows,
        "duplicate_rows": stats.duplicate_rows,  # took the answer of an identical row of this run
        "ok_rows": stats.ok_rows,
        "error_rows": stats.error_rows,
        "prompt_tokens": stats.prompt_tokens,
        "cached_prompt_tokens": stats.cached_tokens,
        "reusable_tokens": stats.reusable_tokens,
        "prefill_tokens": stats.prefill_tokens,
        "output_tokens": stats.output_tokens,
        "preemptions": stats.preemptions,
        "recomputed_tokens": stats.recomputed_tokens,  # computed again after vLLM preempted their rows
        "engine_steps": stats.engine_steps,  # steps that ran rows
        "idle_steps": stats.idle_steps,  # steps vLLM ran nothing (requests waiting for a grammar compile)
        # who admitted the rows into vLLM (group-wise, or vLLM itself in plan order) and why
        **({"admission": stats.admission, "admission_reason": stats.admission_reason} if stats.admission else {}),
        "device": device,  # the GPU or CPU model it ran on
        "hardware_partition": hardware_partition,  # the job's hardware partition (the output's ``hardware`` column)
        "engine": dg.MetadataValue.json(engine_info),
    }
    if stats.prompt_tokens:  # a rerun that reused every row has no throughput to plot
        rounded = stats.to_dict()  # rounded once, where the stats are
        metadata.update({name: float(rounded[name]) for name in (
            "saving_vs_ideal",
            "startup_s",  # from the step's start until the rows' run began
            "run_setup_s",  # of wall_s: scheduling before the first request
            "engine_start_s",  # of which vLLM's own start-up
            "engine_stop_s",  # shutting vLLM down after the rows
            "wall_s", "mean_kv_usage", "rows_per_step", "tokens_per_s", "output_tokens_per_s")})
    return metadata


def review_metadata(table: pa.Table, review_below: float | None) -> dict:
    """What a partition says of its scored choice answers (``table``: the rows it wrote): how many
    were scored, and how many are marked for review under ``review_below``."""
    from .output_table import NEEDS_REVIEW_COLUMN

    scored = table.num_rows - table.column("choice_probability").null_count
    if not scored:
        return {}
    marked = {"review_below": review_below, "rows_for_review": pc.sum(table.column(NEEDS_REVIEW_COLUMN)).as_py() or 0}
    return {"scored_rows": scored, **(marked if review_below is not None else {})}


def field_order_metadata(config) -> dict:
    """With ``field_order: optimize``: the order the rows' prompts were built in and the prompt tokens
    it saves against the declared order, over the whole table when it was chosen (sorted, at the
    job's block size: the minimum prefill), as the job keeps it."""
    from engine.table.field_order_state import recorded_choice

    choice = recorded_choice(config.files.field_order_path) if config.dataset.prompt is not None else None
    if choice is None or "declared" not in choice["candidates"]:
        return {}
    candidates = choice["candidates"]
    return {"field_order": choice["chosen"],
            "field_order_saved_prompt_tokens": candidates["declared"] - candidates[choice["chosen"]]}
