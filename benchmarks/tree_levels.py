"""What the prefix tree and a plan of it hold for long shared prompts: rows of a system prompt,
a document asked several questions, and the question (each row's tokens made up, not tokenized),
planned in this process with tracemalloc counting numpy's allocations:

    python benchmarks/tree_levels.py CHECKOUT [--rows 100000 --system-tokens 1000 --document-tokens 900]

CHECKOUT is the repository folder whose ``engine`` is imported (this one: ``.``), so two versions of
the planner can be measured on the same rows; ``plan_digest`` is equal when their plans are
(run order, groups, prefixes, tokens each row computes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import tracemalloc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--system-tokens", type=int, default=1_000)
    parser.add_argument("--document-tokens", type=int, default=900)
    parser.add_argument("--questions", type=int, default=5, help="rows per document")
    parser.add_argument("--question-tokens", type=int, default=100)
    parser.add_argument("--block-size", type=int, default=32)
    args = parser.parse_args()
    sys.path.insert(0, args.checkout)
    import numpy as np

    from engine.plan.block_hashes import RowBlocks
    from engine.plan.prefix_tree import PrefixTree

    rng = np.random.default_rng(0)
    documents = -(-args.rows // args.questions)
    system = np.arange(args.system_tokens, dtype=np.int32)
    lengths = rng.integers(args.question_tokens // 2, args.question_tokens * 3 // 2, args.rows)
    offsets = np.concatenate([[0], np.cumsum(args.system_tokens + args.document_tokens + lengths)])
    tokens = np.empty(int(offsets[-1]), dtype=np.int32)
    for row in range(args.rows):  # the document's tokens from its number: rows of one document share them
        start = offsets[row] + args.system_tokens
        tokens[offsets[row]:start] = system
        doc = np.random.default_rng(row % documents).integers(0, 50_000, args.document_tokens, dtype=np.int32)
        tokens[start:start + args.document_tokens] = doc
        tokens[start + args.document_tokens:offsets[row + 1]] = rng.integers(0, 50_000, lengths[row])
    blocks = RowBlocks.of_tokens(tokens, offsets, args.block_size)
    del tokens
    decode = rng.integers(1, 200, args.rows)

    tracemalloc.start()
    started = time.perf_counter()
    tree = PrefixTree.of(blocks)
    tree_s, (tree_bytes, tree_peak) = time.perf_counter() - started, tracemalloc.get_traced_memory()
    del blocks
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    started = time.perf_counter()
    plan = tree.plan(decode)
    plan_s, plan_peak = time.perf_counter() - started, tracemalloc.get_traced_memory()[1] - base
    digest = hashlib.sha1()
    for values in (plan.order, plan.group_of_row, plan.group_prefix_tokens, plan.row_unique_tokens):
        digest.update(np.ascontiguousarray(values).astype(np.int64).tobytes())
    print(json.dumps({
        "rows": args.rows, "prompt_tokens": int(plan.prompt_tokens), "groups": plan.num_groups,
        "depths": sum(getattr(level, "depths", 1) for level in tree.levels), "levels": len(tree.levels),
        "level_bytes": sum(level.node.nbytes + level.counts.nbytes for level in tree.levels),
        "tree_bytes": tree_bytes, "tree_peak_bytes": tree_peak, "tree_s": round(tree_s, 2),
        "plan_peak_bytes": plan_peak, "plan_s": round(plan_s, 2), "plan_digest": digest.hexdigest()[:12],
    }))


if __name__ == "__main__":
    main()
