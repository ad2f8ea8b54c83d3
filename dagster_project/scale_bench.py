"""``batchllm bench --scale ROWS``: a nightly job at scale, through Dagster, on this machine.

In one run: generate a DuckDB table of ROWS prompts with realistic sharing (instruction blocks each
shared by a few thousand rows, then text of each row's own), materialize ``prompts`` +
``prefix_groups`` (the first night), change a share of the rows and materialize both again (the
next night: the token cache tokenizes only what changed), then run one ``completions`` partition
(about ``--partition-rows`` rows; ``--partitions-per-run N``: the first N in one run, one vLLM start)
on the tiny model and split its wall time into vLLM's start-up,
the engine's run, and everything else (Dagster, reading the plan, writing DuckDB and Parquet,
checks). Each phase runs in its own process, so each peak RSS is its own. Prints one JSON line.

    python -m dagster_project.scale_bench --rows 1000000 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _config(work: Path, model: str, partition_rows: int, partitions_per_run: int | None = 1,
            tokenize_workers: int = 1):
    from batchllm_dagster import BatchJobConfig, DatasetSpec, EngineSettings, SamplingSettings

    return BatchJobConfig(
        name="scale", dataset=DatasetSpec(table="prompts", database=str(work / "prompts.duckdb")),
        llm=EngineSettings(model_path=model, max_model_len=4096), sampling=SamplingSettings(max_tokens=16),
        rows_per_shard=partition_rows, partitions_per_run=partitions_per_run, hardware=["cpu"], output_table="answers",
        output_database=str(work / "answers.duckdb"), storage_dir=str(work / "jobs"), schedule=None,
        tokenize_workers=tokenize_workers,
    )


def generate(work: Path, rows: int, tokens_per_row: int, model: str, seed: int = 0) -> dict:
    """The prompt table: ``rows // 5000`` (at least 20) instruction blocks of ~80% of a row's tokens,
    each row one block plus ~20% words of its own."""
    import duckdb

    from engine.models import resolve_model
    from engine.plan.tokenizing import load_tokenizer

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    sample = " ".join(rng.choice(words) for _ in range(2000))
    tokens_per_word = len(load_tokenizer(resolve_model(model))(sample)["input_ids"]) / 2000
    block_words = max(1, int(0.8 * tokens_per_row / tokens_per_word))
    own_words = max(1, int(0.2 * tokens_per_row / tokens_per_word))
    templates = max(20, rows // 5000)
    blocks = [" ".join(rng.choice(words) for _ in range(block_words)) for _ in range(templates)]
    database = work / "prompts.duckdb"
    database.unlink(missing_ok=True)
    with duckdb.connect(str(database)) as con:
        con.execute("CREATE TABLE words AS SELECT unnest(?) AS w", [words])
        con.execute(
            "CREATE TABLE blocks AS SELECT generate_subscripts(?, 1) - 1 AS b, unnest(?) AS text", [blocks, blocks]
        )
        con.execute(f"""
            CREATE TABLE prompts AS
            SELECT i AS id,
                   blocks.text || ' Task ' || i || ': ' || array_to_string(list_transform(range({own_words}),
                       lambda x: ws[1 + (hash(i * 1000003 + x) % len(ws))::BIGINT]), ' ') AS prompt
            FROM range({rows}) r(i)
            JOIN blocks ON blocks.b = i % {templates}
            CROSS JOIN (SELECT list(w) AS ws FROM words)
            ORDER BY hash(i)
        """)
    return {"instruction_blocks": templates, "words_per_row": block_words + own_words}


def change_rows(work: Path, fraction: float) -> int:
    import duckdb

    step = max(1, round(1 / fraction))
    with duckdb.connect(str(work / "prompts.duckdb")) as con:
        con.execute(f"UPDATE prompts SET prompt = prompt || ' (edited)' WHERE id % {step} = 0")
        return con.execute(f"SELECT count(*) FROM prompts WHERE id % {step} = 0").fetchone()[0]


def _instance(work: Path):
    import dagster as dg

    home = work / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ROOT / "dagster_project" / "dagster.yaml", home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    return dg.DagsterInstance.get()


def _reset_peak_rss() -> None:
    """Start the process's peak resident memory (VmHWM) again from now (Linux: ``clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss() -> int:
    """The process's peak resident memory: since it started or since ``_reset_peak_rss`` (Linux's
    VmHWM). Not ``ru_maxrss``: a child's counts the parent's memory at fork (this bench's parent
    holds the generated table: 2.28 GB at 3M rows, where the plan step's own peak was 1.44)."""
    try:
        status = Path("/proc/self/status").read_text().splitlines()
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def phase_plan(work: Path, model: str, partition_rows: int, tokenize_workers: int = 1) -> dict:
    """prompts, then prefix_groups, in this process (its Ray workers, if any, in their own)."""
    import dagster as dg

    from assets import build_batch_defs

    config = _config(work, model, partition_rows, tokenize_workers=tokenize_workers)
    graph = build_batch_defs(config).resolve_asset_graph()
    instance = _instance(work)
    timings = {"peak_rss_bytes": _peak_rss()}  # the process's, its start up to here
    for name in ("prompts", "prefix_groups"):
        _reset_peak_rss()
        started = time.perf_counter()
        result = dg.materialize([graph.assets_def_for_key(dg.AssetKey(["scale", name]))], instance=instance)
        assert result.success, name
        timings[f"{name}_s"] = round(time.perf_counter() - started, 2)
        timings[f"{name}_peak_rss_bytes"] = _peak_rss()
        timings["peak_rss_bytes"] = max(timings["peak_rss_bytes"], timings[f"{name}_peak_rss_bytes"])
    meta = result.asset_materializations_for_node("scale__prefix_groups")[0].metadata
    return {
        **timings,
        "tokenized_rows": meta["tokenized_rows"].value,
        "token_cache_rows": meta["token_cache_rows"].value,
        "prompt_tokens": meta["prompt_tokens"].value,
        "groups": meta["groups"].value,
        "shards": meta["shards"].value,
        "tokenize_s": meta["tokenize_s"].value,
        "plan_s": meta["plan_s"].value,
    }


def phase_partition(work: Path, model: str, partition_rows: int, partitions_per_run: int = 1) -> dict:
    """The plan's first ``partitions_per_run`` completions partitions in one run (one vLLM start),
    through Dagster; their time split as a sum over them."""
    import dagster as dg

    from assets import build_batch_defs
    from batchllm_dagster.partitions import RANGE_END, RANGE_START
    from batchllm_dagster.shard_sizing import OVERHEAD_SHARE

    config = _config(work, model, partition_rows, partitions_per_run)
    graph = build_batch_defs(config).resolve_asset_graph()
    instance = _instance(work)
    keys = instance.get_dynamic_partitions(config.names.partitions_name)[:partitions_per_run]  # a range: neighbours
    started = time.perf_counter()
    result = dg.materialize([graph.assets_def_for_key(dg.AssetKey(["scale", "completions"]))], instance=instance,
                            tags={RANGE_START: keys[0], RANGE_END: keys[-1]})
    run_s = time.perf_counter() - started
    assert result.success
    metas = [m.metadata for m in result.asset_materializations_for_node("scale__completions")]
    total = {k: sum(m[k].value for m in metas) for k in ("startup_s", "engine_start_s", "run_setup_s", "wall_s",
                                                         "engine_stop_s", "write_s", "ok_rows", "error_rows")}
    # The run's time, split: vLLM's start, the plans read and checked and the answers to reuse found
    # before each partition's run, the rows' runs (of which the scheduler's set-up before the first
    # request), vLLM's stop, writing DuckDB and Parquet and the checks, and Dagster's own (the rest).
    breakdown = {"engine_start_s": total["engine_start_s"],
                 "plan_read_s": round(total["startup_s"] - total["engine_start_s"], 3),
                 "engine_run_s": total["wall_s"], "engine_stop_s": total["engine_stop_s"],
                 "write_and_checks_s": total["write_s"]}
    breakdown["dagster_s"] = round(run_s - sum(breakdown.values()), 3)
    outside = run_s - total["wall_s"]
    start_stop = total["engine_start_s"] + total["engine_stop_s"]
    return {"partitions_in_run": len(metas), "vllm_starts": sum(m["engine_start_s"].value > 0 for m in metas),
            "partition_rows": round((total["ok_rows"] + total["error_rows"]) / len(metas)),
            "run_s": round(run_s, 2), **{k: round(v, 3) for k, v in breakdown.items()},
            "run_setup_s": round(total["run_setup_s"], 3),  # of engine_run_s
            # start-up and orchestration against the run's time (shard sizing holds it at 5%)
            "overhead_fraction": round(outside / run_s, 4), "overhead_target": OVERHEAD_SHARE,
            # the same without vLLM's start and stop (what a faster GPU does not shrink)
            "orchestration_fraction": round((outside - start_stop) / max(run_s - start_stop, 1e-9), 4)}


def plan_only_report(rows: int, shape: dict, generate_s: float, first: dict, workers: int) -> dict:
    """The first night's plan step on its own: ``prompts`` (the snapshot) and ``prefix_groups``
    (tokenize, plan, write the plan and the groups table), its tokens per second and peak memory."""
    token_array_bytes = 4 * first["prompt_tokens"]  # the batch's token ids as int32
    return {
        "rows": rows, **shape, "prompt_tokens": first["prompt_tokens"], "generate_s": round(generate_s, 1),
        "first_prompts_s": first["prompts_s"],
        "first_plan_s": first["prefix_groups_s"],  # the plan step: tokenize + plan + write, in Dagster
        "first_tokenize_s": first["tokenize_s"], "first_planning_s": first["plan_s"],
        "tokenize_tokens_per_s": round(first["prompt_tokens"] / max(first["tokenize_s"], 1e-9)),
        "workers": workers,  # tokenize_workers (1: the step's process, with the tokenizer's own threads)
        "first_peak_rss_bytes": first["peak_rss_bytes"],  # the process: prompts, then the plan step
        "first_prompts_peak_rss_bytes": first["prompts_peak_rss_bytes"],  # each step's own peak, from its start
        "first_plan_step_peak_rss_bytes": first["prefix_groups_peak_rss_bytes"],
        "token_array_bytes": token_array_bytes,
        "first_peak_rss_vs_token_array": round(first["peak_rss_bytes"] / token_array_bytes, 2),
        "groups": first["groups"], "shards": first["shards"],
    }


def _child(phase: str, args) -> dict:
    """Run a phase in a fresh process; its result with the process's own peak RSS."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dagster_project.scale_bench",
            "--phase",
            phase,
            "--work",
            str(args.work),
            "--model",
            args.model,
            "--partition-rows",
            str(args.partition_rows),
            "--partitions-per-run",
            str(args.partitions_per_run),
            "--tokenize-workers",
            str(args.tokenize_workers),
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"phase {phase} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Options, then the phases in their own processes (over 60 lines: a list of options)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--tokens-per-row", type=int, default=500)
    parser.add_argument("--change-fraction", type=float, default=0.01, help="share of rows changed before the rerun")
    parser.add_argument("--partition-rows", type=int, default=10_000, help="rows per shard (rows_per_shard)")
    parser.add_argument("--partitions-per-run", type=int, default=1,
                        help="completions partitions run together, on one vLLM start (partitions_per_run)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--work", type=Path, help="working folder (default .cache/scale/ROWS)")
    parser.add_argument("--json", action="store_true", help="one JSON line on stdout (always)")
    parser.add_argument("--plan-only", action="store_true", help="the first night's plan step alone")
    parser.add_argument("--tokenize-workers", type=int, default=1, help="the job's tokenize_workers")
    parser.add_argument("--phase", choices=["plan", "partition"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from engine.machine import CACHE_ROOT
    from engine.models import resolve_model

    args.work = (args.work or CACHE_ROOT / "scale" / str(args.rows)).resolve()
    if args.phase:  # a child process
        if args.phase == "plan":
            result = phase_plan(args.work, resolve_model(args.model), args.partition_rows, args.tokenize_workers)
        else:
            result = phase_partition(args.work, resolve_model(args.model), args.partition_rows,
                                     args.partitions_per_run)
        result.setdefault("peak_rss_bytes", _peak_rss())  # the process's (the plan phase's: over its steps)
        print(json.dumps(result))
        return 0

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    started = time.perf_counter()
    shape = generate(args.work, args.rows, args.tokens_per_row, args.model)
    generate_s = time.perf_counter() - started
    first = _child("plan", args)
    if args.plan_only:
        print(json.dumps(plan_only_report(args.rows, shape, generate_s, first, args.tokenize_workers)))
        return 0
    changed = change_rows(args.work, args.change_fraction)
    rerun = _child("plan", args)
    partition = _child("partition", args)
    token_array_bytes = 4 * first["prompt_tokens"]  # the batch's token ids as int32
    print(
        json.dumps(
            {
                "rows": args.rows,
                **shape,
                "prompt_tokens": first["prompt_tokens"],
                "generate_s": round(generate_s, 1),
                "first_prompts_s": first["prompts_s"],
                "first_prefix_groups_s": first["prefix_groups_s"],
                "first_tokenize_s": first["tokenize_s"],
                "first_plan_s": first["plan_s"],
                "first_peak_rss_bytes": first["peak_rss_bytes"],
                "token_array_bytes": token_array_bytes,
                "first_peak_rss_vs_token_array": round(first["peak_rss_bytes"] / token_array_bytes, 2),
                "changed_rows": changed,
                "rerun_prompts_s": rerun["prompts_s"],
                "rerun_prefix_groups_s": rerun["prefix_groups_s"],
                "rerun_tokenized_rows": rerun["tokenized_rows"],
                "rerun_peak_rss_bytes": rerun["peak_rss_bytes"],
                "groups": first["groups"],
                "shards": first["shards"],
                "partition_peak_rss_bytes": partition.pop("peak_rss_bytes"),
                **partition,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
