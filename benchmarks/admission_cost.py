"""What deciding who admits a shard's rows costs at a GPU's sizes, before the shard's first request:
``choose_admission`` on 20,000 rows (40 documents of 500 tokens, each row a question of 100 of its
own), 64 output tokens each, on an H200's engine limits (20,000 KV blocks of 16, 1,024 sequences,
16,384 tokens a step, async scheduling). Prints the median of ``--repeat`` timings and the decision.

    python benchmarks/admission_cost.py --repeat 3
"""

import argparse
import json
import statistics
import time

import numpy as np

from engine.plan.tokenizing import TokenizedBatch
from engine.run.admission import EngineLimits, choose_admission


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--kv-blocks", type=int, default=20_000, help="fewer: a cache that binds (preemptions)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    documents = [rng.integers(10, 30000, 500) for _ in range(40)]
    rows = [np.concatenate([documents[i % 40], rng.integers(10, 30000, 100)]) for i in range(args.rows)]
    order = sorted(range(len(rows)), key=lambda i: i % 40)  # the plan's order: a document's rows together
    batch, max_tokens = TokenizedBatch.from_rows(rows), np.full(len(rows), 64)
    limits = EngineLimits(block_size=16, capacity_blocks=args.kv_blocks, max_num_seqs=1024,
                          max_num_batched_tokens=16_384, steps_ahead=1)
    seconds = []
    for _ in range(args.repeat):
        started = time.perf_counter()
        choice = choose_admission(batch, max_tokens, order, limits)
        seconds.append(time.perf_counter() - started)
    print(json.dumps({"seconds_median": round(statistics.median(seconds), 3),
                      "seconds": [round(s, 3) for s in seconds], "admission": str(choice.admission),
                      "reason": choice.reason}))


if __name__ == "__main__":
    main()
