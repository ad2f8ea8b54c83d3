"""Choice rows scored (``score_choices``, engine/choice_scoring.py) against the same rows decoded under
vLLM's grammar, on the same prompts: the bench's choice rows (the ``short`` shape's constrained rows)
and the demo's two choice jobs (``reviews``, ``tickets``: read from their defs.yaml and the demo's
database, so run ``make demo`` first). Each variant is a fresh ``batchllm run`` process; the
variants' order alternates each round. ``--scale N``: the same generators, N times the rows (the
demo's tables from dagster_project/sample_data.py in a scratch database, the short shape with N times
the customers): vLLM compiles an operator of its own the first time a step reads log
probabilities (``batched_count_greater_than``), once per process, which a few dozen rows do not repay.

    python benchmarks/choice_scoring.py [--repeat 3] [--scale 1] [--workloads bench,reviews,tickets]

Prints one JSON object: per workload, each variant's rows per second over the rows' run (vLLM's
start and stop apart, and the one-time compile a scored job does at start: ``startup_s``; median
and range), the ratio scored / decoded (the median of the rounds' ratios, and their range), the
same over start-up and run together (``with_startup``: what a process spends), and how many
scored answers equal greedy constrained decoding's; where they differ, why: the grammar lets the
model spell a choice in tokens other than the tokenizer's own (SmolLM2's ``account``, one token of
its own, in five), and a scored answer reads the tokenizer's own spelling only.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEMO_DATABASE = ROOT / "data" / "batchllm.duckdb"


def scaled_demo_database(folder: Path, scale: int) -> Path:
    """The demo's database (``scale`` 1), or its choice jobs' tables with ``scale`` times the rows."""
    if scale == 1:
        return DEMO_DATABASE
    import random

    import duckdb

    from dagster_project.sample_data import SEED, customers_and_tickets, review_labels

    path = folder / f"demo_x{scale}.duckdb"
    rng = random.Random(SEED)
    tables = {"review_labels": review_labels(rng, rows=120 * scale)}
    tables["customers"], tables["support_tickets"] = customers_and_tickets(rng, customers=24 * scale)
    with duckdb.connect(str(path)) as con:
        for name, table in tables.items():
            con.register("incoming", table)
            con.execute(f"CREATE TABLE {name} AS SELECT * FROM incoming")
    return path


def demo_job(folder: str, database: Path) -> tuple[list[str], list[str]]:
    """A demo job's `batchllm run` arguments (its SQL on ``database``, prompt fields, choices,
    max_tokens), from its defs.yaml, and its choices."""
    defs = ROOT / "dagster_project" / "defs" / folder
    job = yaml.safe_load((defs / "defs.yaml").read_text())["attributes"]
    dataset, sampling = job["dataset"], job["sampling"]
    choices = sampling["response_format"]["choice"]
    args = [str(defs / dataset["sql_file"]), "--database", str(database), "--max-tokens",
            str(sampling["max_tokens"])]
    fields = dataset.get("prompt")
    if fields:
        args += ["--instruction", fields["instruction"], "--fields", ",".join(fields["fields"]),
                 "--question", fields["question"], "--field-order", fields.get("field_order", "as_declared")]
    return args, choices


def bench_choice_rows(folder: Path, scale: int) -> tuple[list[str], list[str]]:
    """The short shape's constrained rows, as a Parquet file with the shape's prompt fields."""
    from engine.bench.shapes import SHORT_CHOICES, SHORT_SHAPE, short_table

    table, _, choices = short_table(0, customers=100 * scale)
    path = folder / "bench_choice_rows.parquet"
    pq.write_table(table.take(sorted(choices)), path)
    return [str(path), "--instruction", SHORT_SHAPE.instruction, "--fields", ",".join(SHORT_SHAPE.fields),
            "--question", SHORT_SHAPE.question, "--field-order", SHORT_SHAPE.field_order.value,
            "--max-tokens", "8"], SHORT_CHOICES


def run(args: list[str], choices: list[str], output: Path, scored: bool) -> dict:
    command = [sys.executable, "-m", "engine.cli", "run", *args, "--output", str(output), "--json", "--overwrite",
               *[f"--choice={c}" for c in choices], *(["--score-choices"] if scored else [])]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def review_sentiments(database: Path) -> dict[str, str]:
    """The sentiment each demo review was written with: the phrase list its last review's phrase is
    from (dagster_project/sample_data.py), what a right label is."""
    import duckdb

    from dagster_project.sample_data import _BAD, _GOOD, _MEH

    lists = {"positive": _GOOD, "negative": _BAD, "neutral": _MEH}
    with duckdb.connect(str(database), read_only=True) as con:
        rows = con.execute("SELECT id, prompt FROM review_labels").fetchall()
    out = {}
    for row_id, prompt in rows:
        last = prompt.rsplit("Review: ", 1)[1]
        out[row_id] = next(label for label, phrases in lists.items() if any(p in last for p in phrases))
    return out


def agreement(scored: Path, decoded: Path, choices: list[str], truth: dict[str, str] | None = None) -> dict:
    """How many scored answers equal the decoded ones, and of the others how many the grammar spelled
    in other tokens than the tokenizer's own (its output tokens, less the end of the answer, more
    than the choice's own); with ``truth`` (each row's right answer), how many each got right."""
    from engine.models import resolve_model
    from engine.plan.tokenizing import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("smollm2"))
    own = {c: len(tokenizer.encode(c, add_special_tokens=False)) for c in choices}
    a = {r["id"]: r for r in pq.read_table(scored).to_pylist()}
    b = {r["id"]: r for r in pq.read_table(decoded).to_pylist()}
    differ = [i for i in a if a[i]["text"] != b[i]["text"]]
    respelled = [i for i in differ if b[i]["text"] in own and b[i]["output_tokens"] - 1 > own[b[i]["text"]]]
    return {"rows": len(a), "equal": len(a) - len(differ), "differ": len(differ),
            "differ_decoded_in_other_tokens": len(respelled),
            "first_tokens_distinct": len({tuple(tokenizer.encode(c, add_special_tokens=False)[:1]) for c in choices})
            == len(choices),
            **({"right_scored": sum(a[i]["text"] == truth[i] for i in a),
                "right_decoded": sum(b[i]["text"] == truth[i] for i in b)} if truth else {}),
            "examples": [{"id": i, "scored": a[i]["text"], "probability": round(a[i]["choice_probability"], 3),
                          "decoded": b[i]["text"], "decoded_tokens": b[i]["output_tokens"]} for i in differ[:3]]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--workloads", default="bench,reviews,tickets")
    options = parser.parse_args()
    report = {"repeat": options.repeat, "scale": options.scale, "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="choice-scoring-") as tmp:
        folder = Path(tmp)
        database = scaled_demo_database(folder, options.scale) if options.workloads != "bench" else None
        makers = {"bench": lambda: bench_choice_rows(folder, options.scale),
                  "reviews": lambda: demo_job("review_labels", database),
                  "tickets": lambda: demo_job("ticket_teams", database)}
        for name in options.workloads.split(","):
            args, choices = makers[name]()
            seen = {"scored": [], "decoded": []}
            for round_ in range(options.repeat):
                for variant in (["scored", "decoded"] if round_ % 2 == 0 else ["decoded", "scored"]):
                    # A new output each time: `batchllm run` reuses the answers an output already holds.
                    output = folder / f"{name}-{variant}-{round_}.parquet"
                    stats = run(args, choices, output, variant == "scored")
                    seen[variant].append(stats)
                    print(f"{name} round {round_ + 1} {variant}: {stats['rows'] / stats['wall_s']:.1f} rows/s, "
                          f"{stats['engine_steps']} steps", file=sys.stderr)
            rates = {v: [s["rows"] / s["wall_s"] for s in runs] for v, runs in seen.items()}
            ratios = [s / d for s, d in zip(rates["scored"], rates["decoded"])]
            # The whole of each process's engine time: a scored job compiles vLLM's log-probability
            # operator at start; a decoded one builds its grammar machinery in its first rows' time.
            totals = {v: [s["startup_s"] + s["wall_s"] for s in runs] for v, runs in seen.items()}
            total_ratios = [d / s for s, d in zip(totals["scored"], totals["decoded"])]
            report["workloads"][name] = {
                **{v: {"rows_per_s": round(statistics.median(r), 2), "range": [round(min(r), 2), round(max(r), 2)],
                       # before the rows: vLLM's start, the formats' checks and a scored job's compile
                       "startup_s": round(statistics.median(s["startup_s"] for s in seen[v]), 2),
                       "engine_steps": seen[v][-1]["engine_steps"], "output_tokens": seen[v][-1]["output_tokens"],
                       "prompt_tokens": seen[v][-1]["prompt_tokens"], "prefill_tokens": seen[v][-1]["prefill_tokens"]}
                   for v, r in rates.items()},
                "scored_vs_decoded": round(statistics.median(ratios), 3),
                "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
                "with_startup": round(statistics.median(total_ratios), 3),
                "with_startup_range": [round(min(total_ratios), 3), round(max(total_ratios), 3)],
                "agreement": agreement(folder / f"{name}-scored-0.parquet", folder / f"{name}-decoded-0.parquet",
                                       choices, review_sentiments(database) if name == "reviews" else None),
            }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
