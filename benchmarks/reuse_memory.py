"""Peak memory of a shard's reuse: a shard of ROWS rows reads the checkpoints of OTHERS other shards
(a night of failed writes left every shard's answers there), each of ROWS rows with answers of
TEXT_BYTES bytes, of which REUSED rows are its own (moved to it by a new plan).

    python benchmarks/reuse_memory.py [--rows 10000] [--others 100] [--text-bytes 1000] [--reused 100]

Prints one JSON line: peak RSS of the process (ru_maxrss) before and after the load, and the
rows reused. Run it in a fresh process per measurement."""

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from engine.run.checkpoint import Checkpoint
from engine.run.results import RowResult, results_to_table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--others", type=int, default=100)
    parser.add_argument("--text-bytes", type=int, default=1000)
    parser.add_argument("--reused", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        text = "x" * args.text_bytes
        for shard in range(args.others):
            results = [RowResult(id=f"s{shard}-{i}", status="ok", text=text, row_fingerprint=f"fp-s{shard}-{i}",
                                 settings_fingerprint="s") for i in range(args.rows)]
            (root / f"key-{shard}").mkdir()
            pq.write_table(results_to_table(results, pa.string()), root / f"key-{shard}" / "part-0.parquet")
        parts = sorted(root.glob("key-*/part-*.parquet"))
        # This shard's rows: REUSED of them moved here from shard 0, the rest new.
        expected = {f"s0-{i}": f"fp-s0-{i}" for i in range(args.reused)}
        expected.update({f"new-{i}": f"fp-new-{i}" for i in range(args.rows - args.reused)})
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.perf_counter()
        reused = Checkpoint(root / "mine", pa.string()).load(expected, also=parts, settings_fp="s")
        seconds = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rows": args.rows, "other_shards": args.others, "text_bytes": args.text_bytes,
                      "reused": len(reused), "peak_rss_mib_before_load": round(before / 1024, 1),
                      "peak_rss_mib_after_load": round(after / 1024, 1),
                      "load_peak_mib": round((after - before) / 1024, 1), "load_s": round(seconds, 2)}))


if __name__ == "__main__":
    main()
