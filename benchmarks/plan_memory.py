"""Where a plan step's memory goes: ``prefix_groups`` on a scale bench's table, its resident memory
sampled every 20 ms, the peak of each stage (the token cache's rows, the tree, the plan, the shards,
the plan file, the groups table) and of the whole step, in this process.

    batchllm bench --scale 3000000 --plan-only --tokens-per-row 300   # the table and its token cache
    PYTHONPATH=. python benchmarks/plan_memory.py --work .cache/scale/3000000

The plan on disk is removed first, so the step plans afresh (a first night's planning) from the
token cache the bench's first night filled: the tokenizing is not in it (``--scale`` measures that),
unless ``--first-night``: the token cache is set aside, so the step tokenizes every row again.
``--prompts``: the prompts step instead (streaming the table into the snapshot). ``--sorted``: the
plan made on disk (``engine.plan.sorted_plan``) from the snapshot and the token cache, compared row by
row with the plan the step wrote last (run without ``--sorted`` first).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import resource
import shutil
import threading
import time
from pathlib import Path


class _Sampler:
    """Resident memory sampled in a thread: the peak while each stage ran."""

    def __init__(self):
        self.stage, self.peaks = "the rest", {}
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))

    def _run(self) -> None:
        while True:
            self.peaks[self.stage] = max(self.peaks.get(self.stage, 0), self.rss())
            time.sleep(0.02)

    def around(self, owner, name: str, stage: str) -> None:
        """Count the peak while ``owner.name`` runs under ``stage`` (then the stage it ran from)."""
        function = getattr(owner, name)

        @functools.wraps(function)
        def staged(*args, **kwargs):
            before, self.stage = self.stage, stage
            try:
                return function(*args, **kwargs)
            finally:
                self.stage = before

        setattr(owner, name, staged)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="a `batchllm bench --scale` working folder")
    parser.add_argument("--first-night", action="store_true",
                        help="tokenize too: the token cache is set aside for the step (and put back after)")
    parser.add_argument("--prompts", action="store_true", help="the prompts step instead (the snapshot taken again)")
    parser.add_argument("--sorted", action="store_true", help="the plan made on disk, compared with the step's")
    args = parser.parse_args()
    sampler = _Sampler()
    if args.prompts:
        print(json.dumps(_prompts_step(args.work.resolve(), sampler)))
        return
    if args.sorted:
        print(json.dumps(_sorted_plan(args.work.resolve(), sampler)))
        return

    import engine.jobs.plan_job as plan_job
    import engine.plan.prefix_tree as prefix_tree
    import engine.plan.prepared as prepared
    import engine.plan.token_cache as token_cache

    for owner, name, stage in [
        (plan_job.PlanJob, "plan", "plan step, between stages"),
        (plan_job, "plan_tokenized", "planning, between stages"),
        (plan_job.PlanJob, "read_rows", "snapshot rows"), (plan_job.TokenCache, "rows_for", "token cache rows"),
        (prepared, "duplicate_sets", "identical rows"), (prefix_tree.PrefixTree, "of", "tree"),
        (prefix_tree.PrefixTree, "planned", "tree without copies"), (prefix_tree.PrefixTree, "plan", "plan"),
        (plan_job, "assign_shards", "shards"), (plan_job, "write_plan", "plan file"),
        (plan_job.JobPlan, "groups_table", "groups table"),
        (plan_job.TokenCache, "_tokenize", "tokenizing"), (token_cache, "tokenize_rows", "tokenizer"),
    ]:
        sampler.around(owner, name, stage)
    work = args.work.resolve()
    (work / "jobs" / "scale" / "plan.parquet").unlink(missing_ok=True)
    cache, aside = work / "jobs" / "scale" / "token_cache", work / "jobs" / "scale" / "token_cache.aside"
    if args.first_night:
        cache.rename(aside)
    try:
        report = _plan_step(work, sampler)
    finally:
        if args.first_night:
            shutil.rmtree(cache, ignore_errors=True)
            aside.rename(cache)
    print(json.dumps(report))


def _prompts_step(work: Path, sampler: _Sampler) -> dict:
    import assets.prompts as prompts

    for owner, name, stage in [(prompts, "snapshot_dataset", "streaming the table"),
                               (prompts.SnapshotWriter, "write", "writing a batch"),
                               (prompts, "check_unique_ids", "unique ids")]:
        sampler.around(owner, name, stage)
    started = time.perf_counter()
    meta = _materialize(work, "prompts")
    return {"rows": meta["dagster/row_count"].value, "step_s": round(time.perf_counter() - started, 1),
            "stage_peak_rss_bytes": sampler.peaks}


def _sorted_plan(work: Path, sampler: _Sampler) -> dict:
    """The plan by sorts on disk from the snapshot's content keys and the token cache's entries,
    each row's source its content's first row (the scale table: one budget, no format, no error)."""
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    from dagster_project import scale_bench
    from engine.models import resolve_model
    from engine.plan.sorted_plan import open_plan_database, plan_rows
    from engine.plan.token_cache import TokenCache

    job = work / "jobs" / "scale"
    snapshot, step_plan = job / "prompts.parquet", job / "plan.parquet"
    stamp = pq.read_schema(step_plan).metadata
    block_size, cache = int(stamp[b"batchllm.block_size"]), TokenCache.at(stamp[b"batchllm.token_cache"].decode())
    max_tokens = scale_bench._config(work, resolve_model("tiny"), 10_000).sampling.max_tokens
    with tempfile.TemporaryDirectory(dir=job, prefix="sorted-plan-") as folder:
        started = time.perf_counter()
        con = open_plan_database(Path(folder))
        sampler.stage = "token cache entries"
        entries = cache.entry_blocks(block_size)
        first = next(entries)
        con.register("entries", pa.RecordBatchReader.from_batches(first.schema, itertools.chain([first], entries)))
        con.execute("CREATE TABLE cache AS SELECT key, length, block_hashes FROM entries")
        con.unregister("entries")
        sampler.stage = "rows"
        con.execute(f"""CREATE TABLE rows_in AS
            SELECT s.file_row_number AS row, c.length, c.block_hashes AS hashes,
                   min(s.file_row_number) OVER (PARTITION BY s._content_key) AS source, {max_tokens} AS decode
            FROM read_parquet('{snapshot}', file_row_number = true) s JOIN cache c ON c.key = s._content_key""")
        con.execute("DROP TABLE cache")
        sampler.stage = "planning"
        plan_rows(con, block_size)
        plan_s = time.perf_counter() - started
        sampler.stage = "comparing"
        rows, groups, unique, differ = con.execute(f"""
            SELECT count(*), max(p.grp) + 1, sum(p.unique_tokens),
                   count(*) FILTER (WHERE p.position != q.position OR p.grp != q."group"
                                    OR p.prefix_tokens != q.prefix_tokens)
            FROM plan p JOIN read_parquet('{snapshot}', file_row_number = true) s ON s.file_row_number = p.row
                 JOIN read_parquet('{step_plan}') q ON q.id = s.id""").fetchone()
        memory_limit = con.execute("SELECT current_setting('memory_limit')").fetchone()[0]
        con.close()
    return {"rows": rows, "groups": groups, "unique_tokens": int(unique), "rows_unlike_the_steps_plan": differ,
            "plan_s": round(plan_s, 1), "duckdb_memory_limit": memory_limit,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "stage_peak_rss_bytes": sampler.peaks}


def _materialize(work: Path, asset: str):
    """The scale bench's ``asset`` materialized in this process; its metadata."""
    import dagster as dg

    from assets import build_batch_defs
    from dagster_project import scale_bench
    from engine.models import resolve_model

    config = scale_bench._config(work, resolve_model("tiny"), 10_000)
    graph = build_batch_defs(config).resolve_asset_graph()
    result = dg.materialize([graph.assets_def_for_key(dg.AssetKey(["scale", asset]))],
                            instance=scale_bench._instance(work))
    return result.asset_materializations_for_node(f"scale__{asset}")[0].metadata


def _plan_step(work: Path, sampler: _Sampler) -> dict:
    started = time.perf_counter()
    meta = _materialize(work, "prefix_groups")
    return {"rows": meta["rows"].value, "tokenized_rows": meta["tokenized_rows"].value,
            "groups": meta["groups"].value, "shards": meta["shards"].value,
            "step_s": round(time.perf_counter() - started, 1),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "stage_peak_rss_bytes": sampler.peaks}


if __name__ == "__main__":
    main()
