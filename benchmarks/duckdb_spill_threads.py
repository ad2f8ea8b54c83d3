"""Whether DuckDB spills a large sort within a memory bound at a given thread count: the measurement
behind ``DUCKDB_MEMORY_PER_THREAD_MIB`` (engine/table/dataset.py). Sorts a scale bench table's
prompts by their text (larger than the bound) and streams the result, as a job's dataset SQL would.

    PYTHONPATH=. python benchmarks/duckdb_spill_threads.py --database .cache/scale/3000000/prompts.duckdb \\
        --threads 64 --memory 1GB
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def main() -> None:
    import duckdb

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database", required=True, help="a `batchllm bench --scale` prompts.duckdb")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--memory", required=True, help="DuckDB's memory_limit, e.g. 1GB")
    args = parser.parse_args()
    con = duckdb.connect(args.database, read_only=True)
    con.execute(f"SET threads = {args.threads}")
    con.execute(f"SET memory_limit = '{args.memory}'")
    con.execute("SET temp_directory = ?", [tempfile.mkdtemp(prefix="duckdb-spill-")])
    started = time.perf_counter()
    try:
        reader = con.sql("SELECT id, prompt FROM prompts ORDER BY prompt DESC").to_arrow_reader(65_536)
        result = {"rows": sum(batch.num_rows for batch in reader)}
    except duckdb.OutOfMemoryException as exc:
        result = {"failed": str(exc).splitlines()[0]}
    print(json.dumps({"threads": args.threads, "memory": args.memory, **result,
                      "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
