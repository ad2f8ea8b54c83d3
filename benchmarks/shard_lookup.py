"""A shard's token lookup at scale: the token ids of ``--rows`` of a plan's rows from the token cache
the plan names (``TokenCache.lookup``, what each shard partition does before it runs), its time and
its peak anonymous memory (the cache's pages it maps are the page cache's, shared and reclaimable,
so RSS would count them too):

    PYTHONPATH=. python benchmarks/shard_lookup.py --plan .cache/scale/10000000/jobs/scale/plan.parquet
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path


def _anonymous_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--row-group", type=int, default=5, help="the plan's row group the rows come from")
    args = parser.parse_args()

    import pyarrow.parquet as pq

    from engine.plan.plan_table import TOKEN_CACHE
    from engine.plan.token_cache import TokenCache

    plan = pq.ParquetFile(args.plan)
    folder = plan.schema_arrow.metadata[TOKEN_CACHE.encode()].decode()
    keys = plan.read_row_group(args.row_group, columns=["_content_key"]).column(0).combine_chunks()[: args.rows]
    peak, done = [_anonymous_kb()], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _anonymous_kb())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    tokens, _, _ = TokenCache.at(folder).lookup(keys)
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    print(json.dumps({"rows": len(keys), "tokens": int(tokens.size), "lookup_s": round(seconds, 2),
                      "peak_anonymous_bytes": peak[0] * 1024}))


if __name__ == "__main__":
    main()
