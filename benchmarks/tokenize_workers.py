"""Tokens per second of a night's tokenizing: in the step's process (``tokenize_workers: 1``, the
tokenizer's own threads) and on N Ray workers of one thread each, over the same rows of a scale
bench's snapshot, each into an empty token cache; with the CPU the calling process used (Ray's
workers are processes of their own).

    batchllm bench --scale 300000 --plan-only --tokens-per-row 300     # the snapshot
    PYTHONPATH=. python benchmarks/tokenize_workers.py --work .cache/scale/300000 --workers 1,2

"process" is the default path; "ray N" runs N Ray tasks at a time (``TokenizeWorkers.map``, as a
job with ``tokenize_workers: N`` does; with N = 1 only here: a job with one worker tokenizes in its
process). Each is one run in a fresh process, its tokenizer loaded first; Ray's start is counted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ONE = """
import json, resource, sys, time
from pathlib import Path
import pyarrow as pa, pyarrow.compute as pc
from engine.models import resolve_model
from engine.plan.token_cache import _WORKER_BATCH, TokenCache, _new_contents, written_by_worker
from engine.plan.tokenize_workers import TokenizeWorkers
from engine.plan.tokenizing import LazyTokenizer
from engine.table.prompt_snapshot import snapshot_keys

snapshot, folder, how = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
model = resolve_model("tiny")
tokenizer = LazyTokenizer(model)
tokenizer("warm up")
cache = TokenCache(folder, "fp")
rows = pa.array(range(len(snapshot_keys(snapshot))), pa.int64())  # the scale table's contents are distinct
started, cpu = time.perf_counter(), time.process_time()
if how == "process":  # a job with tokenize_workers: 1
    cache._tokenize(snapshot, rows, tokenizer, "prompt", "messages", 32, lambda line: None, TokenizeWorkers())
else:  # the worker path of a job with tokenize_workers: N (a job runs it from N = 2)
    workers = TokenizeWorkers(count=int(how.split()[-1]))
    batches = _new_contents(snapshot, rows, "prompt", "messages", _WORKER_BATCH)
    for _ in workers.map(batches, model, written_by_worker, str(cache.folder), "prompt", "messages", 32):
        pass
seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
tokens = pc.sum(pc.list_value_length(cache.load(32).column("token_ids"))).as_py()
print(json.dumps({"how": how, "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds),
                  "cpu_of_this_process": round(cpu / seconds, 2)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="a `batchllm bench --scale` working folder")
    parser.add_argument("--workers", default="1,2", help="Ray worker counts to run besides the process")
    args = parser.parse_args()
    snapshot = (args.work / "jobs" / "scale" / "prompts.parquet").resolve()
    results = []
    for how in ["process"] + [f"ray {n}" for n in args.workers.split(",")]:
        folder = Path(tempfile.mkdtemp(prefix="tokenize-"))
        try:
            done = subprocess.run([sys.executable, "-c", ONE, str(snapshot), str(folder), how],
                                  capture_output=True, text=True, check=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    base = results[0]["tokens_per_s"]
    for result in results:
        result["vs_process"] = round(result["tokens_per_s"] / base, 2)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
