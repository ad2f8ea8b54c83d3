"""Asset checks on a batch job's completions.

Per partition (evaluated by the completions step itself, so backfills run them too):
* ``one_completion_per_row``: every row of the shard has exactly one row in the output table;
* ``no_silent_empties``: an ok row has text, an error row has a reason;
* ``prefix_saving``: saved prompt tokens / the plan's ideal is above a floor (a warning);
* ``answers_follow_response_format``: every ok answer of a constrained row (the job's
  ``sampling.response_format`` or the row's own) parses and follows it (JSON schema, choice, regex);
* ``error_rows_within_bound``: the partition's error rows (rows that cannot run, rows vLLM refused
  or ended, answers cut off) are at most ``max_error_share`` of its rows: its ok rows are written
  either way, the check makes a bad night visible.
A run of several partitions (``partitions_per_run``) evaluates each check on each of them and
reports it once, failed if it failed on any (``merged_check_results``).
For the whole table: ``all_prompts_answered`` (missing, duplicated and orphaned ids), evaluated
with every shard on the rows of the shards landed so far, on every row once all have landed.
"""

from __future__ import annotations

import dagster as dg
from dagster_duckdb import DuckDBResource

from engine.response_format import ResponseFormat
from engine.run.results import RunStats
from engine.table.prompt_snapshot import ids_sql

from .asset_specs import warehouse as job_warehouse
from .config import BatchJobConfig
from .output_table import OutputTable
from .partitions import RANGE_START, SHARDS_TO_RUN


def partition_check_specs(config: BatchJobConfig) -> list[dg.AssetCheckSpec]:
    key = config.names.asset_key("completions")
    return [
        dg.AssetCheckSpec(
            "one_completion_per_row", asset=key, description="Each row of the shard has exactly one completion."
        ),
        dg.AssetCheckSpec("no_silent_empties", asset=key, description="Ok rows have text; error rows say why."),
        dg.AssetCheckSpec(
            "prefix_saving",
            asset=key,
            description=f"Prompt tokens saved / ideal saving >= {config.min_saving_vs_ideal} (warning).",
        ),
        dg.AssetCheckSpec(
            "answers_follow_response_format",
            asset=key,
            description="Answers of constrained rows parse and follow their JSON schema, choices or regex.",
        ),
        dg.AssetCheckSpec(
            "error_rows_within_bound", asset=key,
            description=f"Error rows are at most {config.max_error_share:.0%} of the partition's rows.",
        ),
    ]


def _constrained_answers(prepared, results: list, sampling) -> list[tuple]:
    """(id, answer, format) of each ok row of ``prepared`` (a ``PreparedBatch``) with a response
    format: its own, else the job's (``sampling.response_format``)."""
    row_of = {row_id: i for i, row_id in enumerate(prepared.ids)}
    return [(r.id, r.text, fmt) for r in results if r.status == "ok"
            and (fmt := prepared.response_formats.get(row_of[r.id], sampling.response_format)) is not None]


def partition_check_results(config: BatchJobConfig, warehouse: DuckDBResource, partition_key: str, shard_ids: list,
                            stats: RunStats, prepared, results: list,
                            superseded_ids: list = ()) -> list[dg.AssetCheckResult]:
    """``shard_ids``: the rows this run wrote; ``prepared`` and ``results``: the shard's rows and
    their results (the format check reads the ok rows that have a response format);
    ``superseded_ids``: rows a newer plan took over while it ran, not written (an older answer of
    theirs in this partition is that plan's to replace)."""
    constrained = _constrained_answers(prepared, results, config.sampling)
    held = OutputTable.of_job(warehouse, config).partition_counts(partition_key, shard_ids, superseded_ids)
    errors, rows = held.errors, held.rows
    saving = stats.saving_vs_ideal
    return [
        dg.AssetCheckResult(
            check_name="one_completion_per_row", asset_key=config.names.asset_key("completions"),
            passed=held.missing == 0 and held.duplicated == 0 and held.unexpected == 0,
            metadata={"missing": held.missing, "duplicated": held.duplicated, "unexpected": held.unexpected},
        ),
        dg.AssetCheckResult(
            check_name="no_silent_empties", asset_key=config.names.asset_key("completions"),
            passed=held.silent == 0, metadata={"silent_empty_rows": held.silent, "error_rows": errors},
        ),
        dg.AssetCheckResult(
            check_name="prefix_saving", asset_key=config.names.asset_key("completions"),
            passed=saving >= config.min_saving_vs_ideal, severity=dg.AssetCheckSeverity.WARN,
            metadata={"saving_vs_ideal": float(round(saving, 4)), "floor": config.min_saving_vs_ideal},
        ),
        _format_check(config, constrained),
        dg.AssetCheckResult(
            check_name="error_rows_within_bound", asset_key=config.names.asset_key("completions"),
            passed=errors <= config.max_error_share * rows,
            metadata={"error_rows": errors, "rows": rows,
                      "error_share": float(round(errors / rows, 4)) if rows else 0.0,
                      "max_error_share": config.max_error_share},
        ),
    ]


def _format_check(config: BatchJobConfig, constrained: list[tuple[object, str, ResponseFormat]]) -> dg.AssetCheckResult:
    violations = [(row_id, why) for row_id, text, fmt in constrained if (why := fmt.violation(text or ""))]
    return dg.AssetCheckResult(
        check_name="answers_follow_response_format", asset_key=config.names.asset_key("completions"),
        passed=not violations,
        metadata={"rows_checked": len(constrained), "violations": len(violations),
                  "examples": dg.MetadataValue.json([{"id": str(i), "why": w} for i, w in violations[:5]])},
    )


def merged_check_results(by_partition: dict[str, list[dg.AssetCheckResult]]) -> list[dg.AssetCheckResult]:
    """A run of several partitions reports each check once (Dagster 1.13 records a check per step,
    not per partition of a range): it passes only if it passed on every partition, and its metadata
    names the partitions it failed on and each partition's own numbers."""
    firsts = next(iter(by_partition.values()))
    merged = []
    for first in firsts:
        results = {key: next(r for r in checks if r.check_name == first.check_name)
                   for key, checks in by_partition.items()}
        failed = [key for key, r in results.items() if not r.passed]
        merged.append(dg.AssetCheckResult(
            check_name=first.check_name, asset_key=first.asset_key, passed=not failed, severity=first.severity,
            metadata={"partitions": len(results), "failed_partitions": dg.MetadataValue.json(failed),
                      "by_partition": dg.MetadataValue.json({key: {name: getattr(value, "value", value)
                                                                   for name, value in r.metadata.items()}
                                                             for key, r in results.items()})}))
    return merged


def shards_outstanding(instance: dg.DagsterInstance, config: BatchJobConfig) -> list[str]:
    """Partitions of the current plan whose rows need a run (the plan's ``partitions_to_run``: the
    others are answered as planned) not landed since the plan was made: no materialization since,
    or only ones that left rows to the plan (a run of an earlier plan that finished after it and did
    not write the rows it superseded: the key's run for this plan still has to answer them)."""
    plan = instance.fetch_materializations(config.names.asset_key("prefix_groups"), limit=1).records
    current = instance.get_dynamic_partitions(config.names.partitions_name)
    if not plan:
        return list(current)
    to_run = plan[0].asset_materialization.metadata.get(SHARDS_TO_RUN) if plan[0].asset_materialization else None
    if to_run is not None:  # a plan made before it listed them: every partition
        wanted = set(to_run.value)
        current = [key for key in current if key in wanted]
    landed, cursor = set(), None
    while True:
        page = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=config.names.asset_key("completions"),
                                  after_storage_id=plan[0].storage_id), limit=1000, cursor=cursor)
        landed.update(r.partition_key for r in page.records if _wrote_every_row(r.asset_materialization))
        if not page.has_more:
            break
        cursor = page.cursor
    return [key for key in current if key not in landed]


def _wrote_every_row(materialization) -> bool:
    superseded = materialization.metadata.get("superseded_rows") if materialization is not None else None
    return superseded is None or superseded.value == 0


def build_table_checks(config: BatchJobConfig) -> list[dg.AssetChecksDefinition]:
    """``all_prompts_answered`` runs with every run that materializes a shard (a sensor's, a
    backfill's, one launched from the UI or ``dg launch``) and evaluates what is decided by then:
    every row of the shards landed for the current plan answered once, no answer twice, none of an
    id the snapshot no longer has; the rows of shards still outstanding are counted apart
    (``outstanding_rows``), so a healthy night has no red check, and the run of the shard that lands
    last checks every row. Selected alone, it checks every row whatever the shards."""
    key = config.names.asset_key("completions")

    @dg.multi_asset_check(
        specs=[dg.AssetCheckSpec("all_prompts_answered", asset=key, blocking=False,
                                 description="Every prompt row of the snapshot whose shard has landed has exactly one "
                                 "completion (every row once every shard of the current plan has landed); no "
                                 "completion is orphaned.")],
        can_subset=True, name=config.names.table_checks_name,
        required_resource_keys={config.names.warehouse_key})
    def all_prompts_answered(context):
        # A run with a partition materializes a shard (the check itself has none): the rows of the
        # shards still to land are not missing yet.
        outstanding = []
        if {"dagster/partition", RANGE_START} & set(context.run.tags):
            outstanding = shards_outstanding(context.instance, config)
        counts = OutputTable.of_job(job_warehouse(config, context), config).answer_counts(
            ids_sql(config.dataset.id_column), config.files.prompts_path, config.files.plan_path, outstanding)
        if counts is None:
            yield dg.AssetCheckResult(check_name="all_prompts_answered", asset_key=key, passed=False,
                                      metadata={"reason": "no completions table yet"})
            return
        # With keep_deleted_answers the answers of deleted rows are history, kept on purpose.
        yield dg.AssetCheckResult(
            check_name="all_prompts_answered", asset_key=key,
            passed=counts.missing == 0 and counts.duplicated == 0 and (
                counts.orphaned == 0 or config.keep_deleted_answers),
            metadata={"missing": counts.missing, "duplicated": counts.duplicated, "orphaned": counts.orphaned,
                      "outstanding_shards": len(outstanding), "outstanding_rows": counts.outstanding},
        )

    return [all_prompts_answered]
