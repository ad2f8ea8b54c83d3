"""Where a plan step's memory goes: ``prefix_groups`` on a scale bench's table, its resident memory
sampled every 20 ms (and its anonymous part), the peak of each stage (the token cache's rows, their
chains into the plan's database, the row checks, the plan, the shards, the plan file, the groups
table) and of the whole step, in this process, and each stage's seconds (a stage's time includes
the stages it calls).

    batchllm bench --scale 3000000 --plan-only --tokens-per-row 300   # the table and its token cache
    PYTHONPATH=. python benchmarks/plan_memory.py --work .cache/scale/3000000

The plan on disk is removed first, so the step plans afresh (a first night's planning) from the
token cache the bench's first night filled: the tokenizing is not in it (``--scale`` measures that),
unless ``--first-night``: the token cache is set aside, so the step tokenizes every row again.
``--night-after``: the plan on disk is kept, so the step keeps its shards where it can (the nights
after the first: each row's shard of the last plan looked up by id).
``--prompts``: the prompts step instead (streaming the table into the snapshot).
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import shutil
import threading
import time
from pathlib import Path


class _Sampler:
    """Resident memory sampled in a thread: the peak while each stage ran."""

    def __init__(self):
        self.stage, self.peaks, self.anon_peaks, self.seconds = "the rest", {}, {}, {}
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def rss() -> tuple[int, int]:
        """Resident memory, and its anonymous part (the rest is mapped files' pages: the token
        cache's parts, which the kernel can take back)."""
        with open("/proc/self/status") as status:
            kib = {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmRSS", "RssAnon"))}
        return kib["VmRSS"] * 1024, kib["RssAnon"] * 1024

    def _run(self) -> None:
        while True:
            rss, anon = self.rss()
            self.peaks[self.stage] = max(self.peaks.get(self.stage, 0), rss)
            self.anon_peaks[self.stage] = max(self.anon_peaks.get(self.stage, 0), anon)
            time.sleep(0.02)

    def watch_disk(self, folder: Path) -> None:
        """Also sample the bytes of the plan's scratch folders (``.plan_work*``) in ``folder``."""
        self.disk_peak = 0

        def run():
            while True:
                try:
                    size = sum(f.stat().st_size for work in folder.glob(".plan_work*") for f in work.rglob("*")
                               if f.is_file())
                except OSError:  # a file removed while counted
                    size = 0
                self.disk_peak = max(self.disk_peak, size)
                time.sleep(0.25)

        threading.Thread(target=run, daemon=True).start()

    def around(self, owner, name: str, stage: str) -> None:
        """Count the peak while ``owner.name`` runs under ``stage`` (then the stage it ran from); a
        name the checkout lacks fails here (``tests/test_benchmarks.py`` checks every one)."""
        function = getattr(owner, name)

        @functools.wraps(function)
        def staged(*args, **kwargs):
            before, self.stage, started = self.stage, stage, time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.stage = before
                self.seconds[stage] = round(self.seconds.get(stage, 0.0) + time.perf_counter() - started, 2)

        setattr(owner, name, staged)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="a `batchllm bench --scale` working folder")
    parser.add_argument("--first-night", action="store_true",
                        help="tokenize too: the token cache is set aside for the step (and put back after)")
    parser.add_argument("--night-after", action="store_true", help="keep the plan on disk (run once without first)")
    parser.add_argument("--prompts", action="store_true", help="the prompts step instead (the snapshot taken again)")
    args = parser.parse_args()
    sampler = _Sampler()
    if args.prompts:
        print(json.dumps(_prompts_step(args.work.resolve(), sampler)))
        return

    for owner, name, stage in plan_stages():
        sampler.around(owner, name, stage)
    work = args.work.resolve()
    if not args.night_after:
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


def plan_stages() -> list[tuple[object, str, str]]:
    """The plan step's stages the peak is counted under: (owner, name, stage)."""
    import engine.jobs.plan_job as plan_job
    import engine.plan.plan_database as plan_database
    import engine.plan.token_cache as token_cache

    disk = plan_database.PlanDatabase
    return [
        (plan_job.PlanJob, "_plan", "plan step, between stages"),
        (plan_job.PlanJob, "read_ids", "snapshot ids"), (disk, "_load_ids", "ids into the plan's database"),
        (token_cache.CacheWriter, "look_up", "token cache lookup"),
        (token_cache.CacheWriter, "rows", "token cache rows"), (token_cache.CacheWriter, "compact", "compaction"),
        (disk, "load_chains", "chains into the plan's database"), (plan_job, "check_rows", "row checks"),
        (disk, "_duplicate_sets", "identical rows"), (disk, "_load_rows", "rows into the plan's database"),
        (disk, "_make", "plan"), (disk, "_shard", "shards"),
        (plan_job, "write_plan", "plan file"),
        (plan_job.JobPlan, "groups_table", "groups table"),
        (token_cache.TokenCache, "_tokenize", "tokenizing"), (token_cache, "tokenize_rows", "tokenizer"),
    ]


def prompts_stages() -> list[tuple[object, str, str]]:
    """The prompts step's stages."""
    import assets.prompts as prompts

    return [(prompts, "snapshot_dataset", "streaming the table"), (prompts.SnapshotWriter, "write", "writing a batch"),
            (prompts, "check_unique_ids", "unique ids")]


def _prompts_step(work: Path, sampler: _Sampler) -> dict:
    for owner, name, stage in prompts_stages():
        sampler.around(owner, name, stage)
    started = time.perf_counter()
    meta = _materialize(work, "prompts")
    return {"rows": meta["dagster/row_count"].value, "step_s": round(time.perf_counter() - started, 1),
            "stage_peak_rss_bytes": sampler.peaks, "stage_peak_anon_bytes": sampler.anon_peaks}


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
    sampler.watch_disk(work / "jobs" / "scale")
    started = time.perf_counter()
    meta = _materialize(work, "prefix_groups")
    return {"rows": meta["rows"].value, "tokenized_rows": meta["tokenized_rows"].value,
            "groups": meta["groups"].value, "shards": meta["shards"].value,
            "step_s": round(time.perf_counter() - started, 1),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "stage_peak_rss_bytes": sampler.peaks, "stage_peak_anon_bytes": sampler.anon_peaks,
            "stage_s": sampler.seconds,
            "peak_plan_work_bytes": sampler.disk_peak}


if __name__ == "__main__":
    main()
