"""``batchllm bench --scale ROWS --nights``: what each night of a nightly job costs, through Dagster.

Three nights of one job on the tiny model (``scale_bench``'s table: instruction blocks shared by
thousands of rows, each row's own words after), each night in a fresh process doing what the
schedule and the shard sensor do (``batchllm-dagster run JOB``): the plan job, then every run the
sensor asks for. The first night answers every row; the second changes nothing; the third edits 1%
of the rows across the table, adds 0.5% and deletes 0.5%. Per night: wall, plan step, shard runs,
vLLM starts, rows computed, the output table's rows written (new or changed, counted by comparing
the whole table before and after the night, every column) and deleted, and the plan's forecast of the
shard runs against their measured wall. Prints one JSON line.

    python -m dagster_project.nights_bench --rows 100000 --partition-rows 10000 --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from dagster_project.scale_bench import _config, _instance, generate


def night(work: Path, model: str, partition_rows: int) -> dict:
    """One night in this process: the plan job, then the shard runs the sensor asks for."""
    from assets import build_batch_defs
    from batchllm_dagster.cli import run_planned_shards

    config = _config(work, model, partition_rows, partitions_per_run=None)
    defs = build_batch_defs(config)
    instance = _instance(work)
    started = time.perf_counter()
    planned = defs.resolve_job_def(config.names.plan_job_name).execute_in_process(instance=instance)
    plan_s = time.perf_counter() - started
    plan_meta = planned.asset_materializations_for_node("scale__prefix_groups")[0].metadata
    runs_started = time.perf_counter()
    runs = run_planned_shards(instance, defs, config.name)
    wall_s = time.perf_counter() - started
    runs_s = time.perf_counter() - runs_started
    shards = [m.metadata for r in runs for m in r.asset_materializations_for_node("scale__completions")]
    value = lambda meta, name: meta[name].value if name in meta else 0  # noqa: E731
    return {"wall_s": round(wall_s, 2), "plan_step_s": round(plan_s, 2), "shard_runs": len(runs),
            "partitions_landed": len(shards), "shards_in_plan": value(plan_meta, "shards"),
            "rows_to_run": value(plan_meta, "rows_to_run"),
            "vllm_starts": sum(value(m, "engine_start_s") > 0 for m in shards),
            "rows_computed": sum(value(m, "computed_rows") for m in shards),
            "rows_reused": sum(value(m, "reused_rows") for m in shards),
            "rows_written_by_shards": sum(value(m, "written_rows") for m in shards),
            "rows_deleted_by_plan": value(plan_meta, "removed_answers"),
            # the plan's forecast of the shard runs (from the nights before) against their measured wall
            "forecast_wall_s": value(plan_meta, "forecast_wall_s") or None, "shard_runs_s": round(runs_s, 2),
            "forecast_vs_measured": (round(value(plan_meta, "forecast_wall_s") / runs_s, 3)
                                     if value(plan_meta, "forecast_wall_s") and runs_s > 0 else None)}


def table_rows(work: Path) -> dict:
    """Every row of the output table, by id: its whole row as text (what a byte-identical row keeps)."""
    import duckdb

    database = work / "answers.duckdb"
    if not database.exists():
        return {}
    with duckdb.connect(str(database), read_only=True) as con:
        return dict(con.execute("SELECT id, CAST(answers AS VARCHAR) FROM answers").fetchall())


def change_night(work: Path, edit: float = 0.01, add: float = 0.005, delete: float = 0.005) -> dict:
    """``edit`` of the rows edited across the table, ``add`` new, ``delete`` deleted (by id, spread)."""
    import duckdb

    with duckdb.connect(str(work / "prompts.duckdb")) as con:
        rows = con.execute("SELECT count(*), max(id) FROM prompts").fetchone()
        total, top = rows
        edited = con.execute(f"UPDATE prompts SET prompt = prompt || ' (edited)' WHERE id % {round(1 / edit)} = 0"
                             ).fetchone()[0]
        deleted = con.execute(f"DELETE FROM prompts WHERE id % {round(1 / delete)} = 1").fetchone()[0]
        added = round(total * add)
        con.execute(f"INSERT INTO prompts SELECT {top} + 1 + row_number() OVER () AS id, prompt || ' (a new row)' "
                    f"FROM (SELECT prompt FROM prompts USING SAMPLE {added} ROWS (reservoir, 7))")
    return {"edited": edited, "added": added, "deleted": deleted}


def _child(args) -> dict:
    done = subprocess.run([sys.executable, "-m", "dagster_project.nights_bench", "--night", "--work", str(args.work),
                           "--model", args.model, "--partition-rows", str(args.partition_rows)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"a night failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measured(args, label: str, change: dict | None = None) -> dict:
    before = table_rows(args.work)
    result = {"night": label, **(change or {}), **_child(args)}
    after = table_rows(args.work)
    result["output_rows_written"] = sum(1 for i, row in after.items() if before.get(i) != row)
    result["output_rows_deleted"] = sum(1 for i in before if i not in after)
    result["output_rows"] = len(after)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--tokens-per-row", type=int, default=100)
    parser.add_argument("--partition-rows", type=int, default=10_000, help="rows per shard (rows_per_shard)")
    parser.add_argument("--edit-share", type=float, default=0.01, help="share of rows the third night edits")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--work", type=Path, help="working folder (default .cache/nights/ROWS)")
    parser.add_argument("--json", action="store_true", help="one JSON line on stdout (always)")
    parser.add_argument("--night", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import shutil

    from engine.machine import CACHE_ROOT
    from engine.models import resolve_model

    args.work = (args.work or CACHE_ROOT / "nights" / str(args.rows)).resolve()
    if args.night:  # a child process
        print(json.dumps(night(args.work, resolve_model(args.model), args.partition_rows)))
        return 0
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    shape = generate(args.work, args.rows, args.tokens_per_row, args.model)
    nights = [_measured(args, "first"), _measured(args, "no change")]
    nights.append(_measured(args, f"{args.edit_share:.0%} edited, 0.5% new, 0.5% deleted",
                            change_night(args.work, edit=args.edit_share)))
    first = nights[0]["wall_s"]
    for result in nights:
        result["wall_vs_first"] = round(result["wall_s"] / first, 3)
    print(json.dumps({"rows": args.rows, "rows_per_shard": args.partition_rows, **shape, "nights": nights}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
