"""``make demo``: build the sample database and the model, materialize the whole asset graph.

Runs are recorded in ``$DAGSTER_HOME`` (default ``./.dagster_home``), so ``make ui`` shows them.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# On a terminal a progress bar per shard shows the progress and Dagster's console says only what
# went wrong; in a log (CI) its progress lines (INFO) stay. Every event is in the UI either way.
QUIET = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}


def prepare_instance() -> Path:
    """A persistent Dagster instance with the project's dagster.yaml (telemetry off, pools)."""
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(ROOT / ".dagster_home")))
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).parent / "dagster.yaml", home / "dagster.yaml")
    return home


def prepare_data() -> None:
    from engine.models import resolve_model

    from .definitions import DATABASE
    from .sample_data import build_sample_database

    print(f"sample database: {build_sample_database(DATABASE)}")
    print(f"model: {resolve_model('smollm2')}")


def batch_jobs(defs) -> list[tuple[str, object]]:
    """(job name, completions asset) of every batch job in the code location."""
    graph = defs.resolve_asset_graph()
    return [(key.path[0], graph.assets_def_for_key(key)) for key in sorted(graph.get_all_asset_keys())
            if key.path[-1] == "completions"]


def run_planned_shards(instance, defs, name: str) -> list:
    """The runs the job's ``run_shards`` sensor asks for after a new plan, run here and now
    (``batchllm_dagster.cli``: ``batchllm-dagster run``'s), each one's success asserted."""
    from batchllm_dagster.cli import run_planned_shards as run_shards

    return run_shards(instance, defs, name, run_config=QUIET)


def materialize_job(instance, defs, name: str) -> dict:
    """prompts + prefix_groups, then every shard partition of completions; the whole-table check
    evaluates in the run of the last shard. Returns what the summary shows: partitions, their
    throughput metadata, the checks' outcomes."""
    import dagster as dg

    graph = defs.resolve_asset_graph()
    upstream = [graph.assets_def_for_key(dg.AssetKey([name, n])) for n in ("prompts", "prefix_groups")]
    # Assets from the resolved graph come with their resources bound.
    planned = dg.materialize(upstream, instance=instance, run_config=QUIET)
    assert planned.success, f"{name}: planning failed"
    prompts = planned.asset_materializations_for_node(f"{name}__prompts")[0].metadata
    shard_runs = run_planned_shards(instance, defs, name)
    evaluations = [e for run in shard_runs for e in run.get_asset_check_evaluations()]
    # A demo run again answers nothing twice: with every row answered as planned, no shard runs.
    assert not shard_runs or any(e.check_name == "all_prompts_answered" for e in evaluations), \
        f"{name}: the table check did not run"
    materialized = [m for run in shard_runs for m in run.asset_materializations_for_node(f"{name}__completions")]
    # a shard whose rows were all reused ran nothing
    metadata = [m.metadata for m in materialized if "tokens_per_s" in m.metadata]
    return {
        "partitions": [m.partition for m in materialized],
        "runs": len(shard_runs),  # fewer than partitions where the job runs several per run (partitions_per_run)
        "computed_shards": len(metadata),
        "tokens_per_s": sum(m["tokens_per_s"].value for m in metadata) / max(len(metadata), 1),
        "saving_vs_ideal": min((m["saving_vs_ideal"].value for m in metadata), default=1.0),
        "failed_checks": sorted({e.check_name for e in evaluations if not e.passed}),
        "checks": len(evaluations),
        # prompts from fields with an optimized order: the order and the prompt tokens it saves
        "field_order": prompts["field_order"].value if "field_order" in prompts else None,
        "field_order_saved_tokens": (prompts["prompt_tokens_declared_order"].value
                                     - prompts[f"prompt_tokens_{prompts['field_order'].value}_order"].value
                                     if "field_order" in prompts else None),
    }


def materialize_all() -> None:
    import dagster as dg

    from batchllm_dagster.layout import OUTPUT_TABLE_TAG, JobNames
    from batchllm_dagster.output_table import OutputTable
    from engine.run.console import summary_table

    from .definitions import defs

    instance = dg.DagsterInstance.get()
    code_location = defs()
    tables, outcomes = {}, {}
    for name, completions in batch_jobs(code_location):
        print(f"{name}: planning, then its shards")
        outcomes[name] = materialize_job(instance, code_location, name)
        tables[name] = completions.op.tags.get(OUTPUT_TABLE_TAG)

    rows, examples, databases = [], [], {}
    for name, table in tables.items():
        warehouse = code_location.resources[JobNames(name).warehouse_key]  # the job's output database
        databases.setdefault(warehouse.database, table)
        total, ok, errors = OutputTable(warehouse, table, name).status_counts()
        row_id, text = OutputTable(warehouse, table, name).first_answer()
        done = outcomes[name]
        checks = (f"{done['checks']} checks passed" if not done["failed_checks"]
                  else f"FAILED checks: {', '.join(done['failed_checks'])}")
        ran = (f"{done['tokens_per_s']:,.0f} tok/s, cache {100 * done['saving_vs_ideal']:.0f}% of the ideal"
               if done["computed_shards"] else "every row answered by an earlier run: nothing ran")
        order = (f"; field order {done['field_order']}: {done['field_order_saved_tokens']:,} prompt tokens fewer "
                 f"than as declared" if done["field_order"] else "")
        rows.append(
            (
                name,
                f"{total} rows ({ok} ok, {errors} errors) in {table}; {len(done['partitions'])} shard(s) in "
                f"{done['runs']} run(s), {ran}; {checks}{order}",
            )
        )
        examples.append((row_id, repr(text.strip()[:90])))
    print("\nSummary\n" + summary_table(rows) + "\n\nFirst answers\n" + summary_table(examples))
    for database, table in databases.items():
        print(f"\nAnswers in {database}. Query them:\n  .venv/bin/python -c \"import duckdb; "
              f"print(duckdb.connect('{database}', read_only=True)"
              f".sql('SELECT id, status, text FROM {table} LIMIT 5'))\"")
    print("See the runs and their metadata: make ui  (http://127.0.0.1:3000)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prepare-only", action="store_true", help="build the data and model, materialize nothing")
    args = parser.parse_args()
    from engine.run.console import is_terminal
    from engine.vllm.library_output import LOG_DIR, route_library_output

    log_file = route_library_output(LOG_DIR / "demo.log")  # before vLLM is imported
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if is_terminal():  # the bars show progress; Dagster's console keeps to warnings and errors
        QUIET["loggers"]["console"]["config"]["log_level"] = "WARNING"
    print(f"libraries' warnings and logs: {log_file}")
    prepare_instance()
    prepare_data()
    if not args.prepare_only:
        materialize_all()


if __name__ == "__main__":
    main()
