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
# Progress lines (INFO) on the console, not every Dagster event (DEBUG); all of it is in the UI.
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
    """The runs the job's ``run_shards`` sensor asks for after a new plan, run here and now: one per
    shard, each on its hardware partition's job, so each carries that hardware's tags."""
    import dagster as dg

    sensor = defs.resolve_sensor_def(f"{name}_run_shards")
    with dg.partition_loading_context(dynamic_partitions_store=instance):  # the shard keys live in the instance
        requests = sensor.evaluate_tick(dg.build_sensor_context(instance=instance, definitions=defs)).run_requests
    results = []
    for request in requests:
        result = defs.resolve_job_def(request.job_name).execute_in_process(
            partition_key=request.partition_key, instance=instance, run_config=QUIET, tags=request.tags)
        assert result.success, f"{name}: partition {request.partition_key} failed"
        results.append(result)
    return results


def materialize_job(instance, defs, name: str, completions) -> list[str]:
    """prompts + prefix_groups, then every shard partition of completions, then the table check."""
    import dagster as dg

    graph = defs.resolve_asset_graph()
    upstream = [graph.assets_def_for_key(dg.AssetKey([name, n])) for n in ("prompts", "prefix_groups")]
    # Assets from the resolved graph come with their resources bound.
    assert dg.materialize(upstream, instance=instance, run_config=QUIET).success, f"{name}: planning failed"
    partitions = [result.dagster_run.tags["dagster/partition"] for result in run_planned_shards(instance, defs, name)]
    checks = [c for c in graph.assets_defs  # checks of the resolved graph, their resources bound
              if c.check_keys and not c.keys and any(k.asset_key.path[0] == name for k in c.check_keys)]
    dg.materialize([completions, *checks], selection=dg.AssetSelection.checks(*checks), instance=instance,
                   run_config=QUIET)
    return partitions


def materialize_all() -> None:
    import dagster as dg
    import duckdb

    from .definitions import DATABASE, defs

    instance = dg.DagsterInstance.get()
    code_location = defs()
    tables = {}
    for name, completions in batch_jobs(code_location):
        partitions = materialize_job(instance, code_location, name, completions)
        tables[name] = completions.op.tags.get("batchllm/output_table")
        print(f"{name}: shards {partitions}")

    with duckdb.connect(str(DATABASE), read_only=True) as con:
        print()
        for name, table in tables.items():
            total, ok, errors = con.execute(
                f'SELECT count(*), count(*) FILTER (WHERE status = \'ok\'), count(*) FILTER (WHERE status = \'error\') '
                f'FROM "{table}"').fetchall()[0]
            row_id, text = con.execute(f'SELECT id, text FROM "{table}" ORDER BY id LIMIT 1').fetchall()[0]
            print(f"{name}: {total} completions ({ok} ok, {errors} errors) in table {table}")
            print(f"    {row_id}: {text.strip()[:100]!r}")
    print(f"\nAll in {DATABASE}. Query them:\n  .venv/bin/python -c \"import duckdb; "
          f"print(duckdb.connect('{DATABASE}', read_only=True).sql('SELECT id, status, text FROM {table} LIMIT 5'))\"")
    print("See the runs and their metadata: make ui  (http://127.0.0.1:3000)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prepare-only", action="store_true", help="build the data and model, materialize nothing")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the engine's own progress lines are enough here
    prepare_instance()
    prepare_data()
    if not args.prepare_only:
        materialize_all()


if __name__ == "__main__":
    main()
