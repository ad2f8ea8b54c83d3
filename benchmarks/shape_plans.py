"""Digests of every bench shape's plan (run order, groups, prefixes, unique tokens per row, identical
rows, budgets, errors, ids), to show two versions of the planner make the same plans:

    python benchmarks/shape_plans.py CHECKOUT > plans.json      # once per checkout, then diff them

CHECKOUT is the repository folder whose ``engine`` is imported (this one: ``.``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

SHAPES = ["groups", "nested", "templates", "duplicates", "kv_bound", "fields", "short", "long_budget"]


def _digest(values) -> str:
    import numpy as np

    return hashlib.sha1(np.ascontiguousarray(values).astype(np.int64).tobytes()).hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout")
    sys.path.insert(0, parser.parse_args().checkout)
    import numpy as np

    from engine.bench.compare import add_bench_parser, engine_settings_from
    from engine.bench.prompt_sets import bench_prompt_sets
    from engine.models import resolve_model
    from engine.plan.tokenizing import load_tokenizer

    bench = argparse.ArgumentParser()
    add_bench_parser(bench.add_subparsers(dest="command"))
    plans = {}
    for shape in SHAPES:
        args = bench.parse_args(["bench", "--shape", shape])
        model = resolve_model(args.model or "smollm2")
        sets = bench_prompt_sets(args, load_tokenizer(model), model, engine_settings_from(args, model).block_size)
        for name, planned in sets.planned.items():
            plan = planned.plan
            same = planned.duplicate_set if planned.duplicate_set is not None else np.zeros(0)
            plans[f"{shape}/{name}"] = {
                "order": _digest(plan.order), "group": _digest(plan.group_of_row),
                "prefix": _digest(plan.group_prefix_tokens), "unique": _digest(plan.row_unique_tokens),
                "identical_rows": _digest(same), "groups": plan.num_groups, "unique_tokens": plan.unique_tokens,
                "max_tokens": _digest(planned.max_tokens),
                "errors": hashlib.sha1(json.dumps(sorted(planned.errors.items())).encode()).hexdigest()[:12],
                "ids": hashlib.sha1(json.dumps(sets.prepared[name].ids).encode()).hexdigest()[:12]}
    print(json.dumps(plans, indent=1))


if __name__ == "__main__":
    main()
