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


def prepare_instance() -> Path:
    """A persistent Dagster instance with the project's dagster.yaml (telemetry off, pools)."""
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(ROOT / ".dagster_home")))
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).parent / "dagster.yaml", home / "dagster.yaml")
    return home


def prepare_data() -> None:
    from engine.models import resolve_model

    from .definitions import DATABASE, DEMO
    from .sample_data import build_sample_database

    print(f"sample database: {build_sample_database(DATABASE)}")
    print(f"model: {resolve_model(DEMO.llm.path)}")


def materialize_all() -> None:
    import dagster as dg
    import duckdb

    from .definitions import DATABASE, DEMO, defs

    instance = dg.DagsterInstance.get()
    graph = defs.resolve_asset_graph()
    key = lambda name: dg.AssetKey([DEMO.name, name])  # noqa: E731
    assets = [graph.assets_def_for_key(key(n)) for n in ("prompts", "prefix_groups", "completions")]
    # Assets from the resolved graph come with their resources bound.
    result = dg.materialize(assets[:2], instance=instance)
    assert result.success
    partition_keys = instance.get_dynamic_partitions(DEMO.partitions_name)
    print(f"shards: {partition_keys}")
    for partition in partition_keys:
        result = dg.materialize(assets, selection=[key("completions")], partition_key=partition, instance=instance)
        assert result.success, f"partition {partition} failed"
    checks = list(defs.asset_checks or [])
    dg.materialize([assets[2], *checks], selection=dg.AssetSelection.checks(*checks), instance=instance)

    with duckdb.connect(str(DATABASE), read_only=True) as con:
        total, ok, errors = con.execute(
            f"SELECT count(*), count(*) FILTER (WHERE status = 'ok'), count(*) FILTER (WHERE status = 'error') "
            f"FROM {DEMO.output_table}").fetchall()[0]
        sample = con.execute(
            f"SELECT id, text FROM {DEMO.output_table} WHERE id IN ('review-0000', 'doc-00-q0', 'ticket-0000') ORDER BY id"
        ).fetchall()
    print(f"\n{total} completions ({ok} ok, {errors} errors) in table {DEMO.output_table} of {DATABASE}")
    for row_id, text in sample:
        print(f"  {row_id}: {text.strip()[:100]!r}")
    print(f"\nQuery them:  .venv/bin/python -c \"import duckdb; print(duckdb.connect('{DATABASE}', read_only=True)"
          f".sql('SELECT id, status, text FROM {DEMO.output_table} LIMIT 5'))\"")
    print("See the runs: make ui  (http://127.0.0.1:3000)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prepare-only", action="store_true", help="build the data and model, materialize nothing")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    prepare_instance()
    prepare_data()
    if not args.prepare_only:
        materialize_all()


if __name__ == "__main__":
    main()
