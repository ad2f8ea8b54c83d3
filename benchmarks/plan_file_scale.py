"""A plan file at scale: written by ``write_plan`` with each shard's rows apart, then read by a shard
as a shard reads it (``PlanFile``: its rows for running, its answer columns at write time, the
pruning check of some ids), each read in a fresh process, its time and peak RSS against reading the
whole file; or the same reads on a plan a plan step wrote (``--plan``).

    PYTHONPATH=. python benchmarks/plan_file_scale.py --rows 10000000 --shards 100 [--dir DIR]
    PYTHONPATH=. python benchmarks/plan_file_scale.py --plan .cache/scale/10000000/jobs/scale/plan.parquet

The table has a plan's columns and types (string ids, a 16-byte content key, the integer columns,
sparse error and format columns, the shard and its partition key); token ids are not in a plan.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

READERS = {
    # Loading a shard for running (token ids aside: they come from the token cache).
    "shard_rows": "plan = PlanFile.open(path); rows = plan._of_key(key); n = rows.num_rows",
    # What a shard's write reads: its rows' answer columns, the live keys, which of 1,000 ids are planned.
    "shard_write": ("plan = PlanFile.open(path, for_writing=True); rows = plan._of_key(key); keys = plan.live_keys(); "
                    "some = range(0, 10**7, 10**4); ids = pa.array(list(some) if pa.types.is_integer(plan.id_type) "
                    "else [f'row-{i}' for i in some], plan.id_type); n = len(plan.ids_among(ids))"),
    # What the plan did before: the whole file read at open.
    "whole_file": "import pyarrow.parquet as pq; rows = pq.read_table(path); n = rows.num_rows",
}


def plan_like_table(rows: int, shards: int) -> pa.Table:
    from engine.table.prompt_snapshot import CONTENT_KEY, KEY_TYPE

    rng = np.random.default_rng(0)
    shard = rng.integers(0, shards, rows)
    return pa.table({
        "id": pa.array([f"row-{i}" for i in range(rows)], pa.string()),
        "position": rng.permutation(rows).astype(np.int64),
        "group": (np.arange(rows) // 40).astype(np.int64),
        "prefix_tokens": rng.integers(0, 600, rows).astype(np.int64),
        "max_tokens": np.full(rows, 256, np.int64),
        "error": pa.nulls(rows, pa.string()),
        "response_format": pa.nulls(rows, pa.string()),
        "duplicate_set": np.full(rows, -1, np.int64),
        CONTENT_KEY: pa.FixedSizeBinaryArray.from_buffers(KEY_TYPE, rows, [None, pa.py_buffer(rng.bytes(16 * rows))]),
        "shard": shard.astype(np.int64),
        "partition_key": pa.array([f"h200|{s:05d}" for s in range(shards)], pa.string()).take(pa.array(shard)),
    }, metadata={"batchllm.block_size": "16", "batchllm.plan_run": "bench"})


def read_in_fresh_process(path: Path, key: str, reader: str) -> dict:
    """One reader's time and peak RSS in a fresh process (VmHWM: getrusage's maximum survives exec,
    so a child of a large parent would report the parent's)."""
    code = (
        "import time, json\nimport pyarrow as pa\nfrom pathlib import Path\n"
        "from engine.plan.plan_table import PlanFile\n"
        f"path, key = Path({str(path)!r}), {key!r}\nstarted = time.perf_counter()\n{READERS[reader]}\n"
        "hwm = next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM'))\n"
        "print(json.dumps({'seconds': round(time.perf_counter() - started, 3), 'rows': n,"
        " 'peak_rss_bytes': hwm * 1024}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--plan", type=Path, help="read this plan file (a real plan step's) instead of writing one")
    args = parser.parse_args()
    if args.plan:
        _read_only(args.plan)
        return
    from engine.plan.plan_table import write_plan

    folder = args.dir or Path(tempfile.mkdtemp(prefix="plan-scale-"))
    path = folder / "plan.parquet"
    started = time.perf_counter()
    table = plan_like_table(args.rows, args.shards)
    made_s = time.perf_counter() - started
    started = time.perf_counter()
    size = write_plan(table, path)
    report = {"rows": args.rows, "shards": args.shards, "table_bytes": table.nbytes, "file_bytes": size,
              "make_s": round(made_s, 1), "write_s": round(time.perf_counter() - started, 1),
              "writer_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    del table
    key = f"h200|{args.shards // 2:05d}"
    report["reads"] = {reader: read_in_fresh_process(path, key, reader) for reader in READERS}
    print(json.dumps(report, indent=2))


def _read_only(path: Path) -> None:
    """Each reader on a plan file a plan step wrote, a shard from its middle."""
    import pyarrow.parquet as pq

    from engine.plan.plan_table import PlanFile

    keys = sorted(PlanFile.open(path).live_keys())
    key = keys[len(keys) // 2]
    report = {"rows": pq.ParquetFile(path).metadata.num_rows, "shards": len(keys), "file_bytes": path.stat().st_size,
              "key": key, "reads": {reader: read_in_fresh_process(path, key, reader) for reader in READERS}}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
