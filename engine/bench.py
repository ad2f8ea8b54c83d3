"""``batchllm bench``: this engine against plain vLLM, one run after the other on one machine.

Runs, each in a fresh vLLM engine with the same KV cache (sized below the batch's prefix working
set, as in a real offline job with thousands of documents):

* ``vllm_nocache``     - vLLM, prefix caching off, rows in input order (shuffled, like a table);
* ``vllm_apc``         - vLLM with its automatic prefix cache, input order;
* ``vllm_apc_sorted``  - vLLM with prefix caching on ``sorted()`` rows;
* ``batchllm``         - this engine: global plan, prefix-first groups, KV-budgeted admission.

All four get the same token ids and greedy sampling with ``ignore_eos`` (fixed output lengths).
``--shape`` picks the synthetic table:

* ``groups``    - groups x rows: a system prompt shared by all, a prefix per group, a suffix per row;
* ``nested``    - one long instruction block shared by every row, documents each asked 2-6
  questions, a question per row, outputs of 16-96 tokens;
* ``templates`` - a dozen few-shot blocks each shared by many rows, unique row text, 15% of the
  rows sharing nothing, outputs of 8-48 tokens.

``batchllm bench PROMPTS`` runs the same four on a sample of the user's own table instead (whole
prefix groups, so the sample shares what the table shares), each row with its own ``max_tokens``.

``--analysis`` times the plan alone on synthetic token ids (no model); ``--scheduler-only`` our
own cost per engine step at GPU batch sizes (``engine/bench_scheduler.py``, no model).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass

import numpy as np

from .cli_options import (
    DEFAULT_MODEL,
    add_engine_options,
    add_response_format_options,
    at_least_one,
    engine_settings_from,
    response_format_from,
)
from .plan import build_plan
from .results import RunStats
from .settings import EngineSettings, ReserveOutput, SamplingSettings, SchedulerSettings
from .tokenizing import TokenizedBatch
from .vllm_env import current_platform

log = logging.getLogger(__name__)

def input_order(prepared) -> list[int]:
    """The rows as the table has them: what plain vLLM gets."""
    return list(range(prepared.num_rows))


def sorted_order(prepared) -> list[int]:
    """The ``sorted()`` baseline: rows in lexicographic order of their token ids."""
    return sorted(range(prepared.num_rows), key=prepared.batch.row)


# Each run: the order a baseline feeds vLLM its rows in (None: this engine's scheduler), and
# whether vLLM's prefix caching is on.
RUNS = {
    "vllm_nocache": (input_order, False),
    "vllm_apc": (input_order, True),
    "vllm_apc_sorted": (sorted_order, True),
    "batchllm": (None, True),
}
SHAPES = ("groups", "nested", "templates")


@dataclass
class Workload:
    groups: int = 16
    rows_per_group: int = 12
    system_tokens: int = 64  # shared by every row (nesting level 1)
    prefix_tokens: int = 320  # shared by a group's rows (level 2)
    suffix_tokens: int = 32  # each row's own tokens
    output_tokens: int = 32
    # Output lengths: "fixed" (every row output_tokens), "rows" (each row between output/4 and
    # 2*output), "tasks" (each group is a short task, output/8, or a long one, 3*output: a table
    # mixing classification and generation prompts).
    output_mix: str = "fixed"
    seed: int = 0

    @property
    def rows(self) -> int:
        return self.groups * self.rows_per_group


def synthetic_tokens(workload: Workload, vocab: tuple[int, int]):
    """Token ids and per-row output lengths of the workload, rows in a shuffled (table) order."""
    rng = np.random.default_rng(workload.seed)
    lo, hi = vocab
    system = rng.integers(lo, hi, workload.system_tokens, dtype=np.int32)
    prefixes = rng.integers(lo, hi, (workload.groups, workload.prefix_tokens), dtype=np.int32)
    group = np.repeat(np.arange(workload.groups), workload.rows_per_group)
    rng.shuffle(group)
    suffixes = rng.integers(lo, hi, (workload.rows, workload.suffix_tokens), dtype=np.int32)
    rows = np.concatenate([np.broadcast_to(system, (workload.rows, system.size)), prefixes[group], suffixes], axis=1)
    length = rows.shape[1]
    offsets = np.arange(workload.rows + 1, dtype=np.int64) * length
    if workload.output_mix == "rows":
        max_tokens = rng.integers(max(1, workload.output_tokens // 4), 2 * workload.output_tokens + 1, workload.rows)
    elif workload.output_mix == "tasks":
        long_task = rng.permutation(workload.groups) < workload.groups // 2
        max_tokens = np.where(long_task[group], 3 * workload.output_tokens, max(1, workload.output_tokens // 8))
    else:
        max_tokens = np.full(workload.rows, workload.output_tokens)
    return TokenizedBatch(tokens=rows.ravel(), offsets=offsets), max_tokens.astype(np.int64)


def nested_tokens(vocab: tuple[int, int], seed: int = 0, documents: int = 45, instruction_tokens: int = 384):
    """One instruction block above every row, documents of 160-320 tokens each asked 2-6
    questions of 12-40 tokens, outputs of 16-96 tokens; rows in a shuffled (table) order."""
    rng = np.random.default_rng(seed)
    lo, hi = vocab
    instruction = rng.integers(lo, hi, instruction_tokens)
    rows, max_tokens = [], []
    for _ in range(documents):
        document = rng.integers(lo, hi, rng.integers(160, 321))
        for _ in range(rng.integers(2, 7)):
            rows.append(np.concatenate([instruction, document, rng.integers(lo, hi, rng.integers(12, 41))]))
            max_tokens.append(rng.integers(16, 97))
    order = rng.permutation(len(rows))
    return TokenizedBatch.from_rows([rows[i] for i in order]), np.asarray(max_tokens, dtype=np.int64)[order]


def templates_tokens(vocab: tuple[int, int], seed: int = 0, rows: int = 200, templates: int = 12):
    """A dozen few-shot blocks of 256-448 tokens, each shared by many rows with 24-96 tokens of
    their own; 15% of the rows share nothing (128-384 tokens); outputs of 8-48 tokens."""
    rng = np.random.default_rng(seed)
    lo, hi = vocab
    blocks = [rng.integers(lo, hi, rng.integers(256, 449)) for _ in range(templates)]
    out = []
    for _ in range(rows):
        if rng.random() < 0.15:
            out.append(rng.integers(lo, hi, rng.integers(128, 385)))
        else:
            out.append(np.concatenate([blocks[rng.integers(templates)], rng.integers(lo, hi, rng.integers(24, 97))]))
    return TokenizedBatch.from_rows(out), rng.integers(8, 49, rows).astype(np.int64)


def _prepared(batch, max_tokens, block_size: int, ids: list | None = None, response_formats: dict | None = None):
    from .prepared import PreparedBatch

    started = time.perf_counter()
    plan = build_plan(batch.tokens, batch.offsets, max_tokens, block_size)
    ids = ids or [f"row-{i:06d}" for i in range(max_tokens.size)]
    return PreparedBatch.from_plan(ids, None, batch, max_tokens, {}, plan, response_formats=response_formats or {},
                                   plan_s=time.perf_counter() - started)


def table_sample(args, tokenizer, model_path: str):
    """Whole prefix groups of the user's table, picked at random until ``--sample`` rows, in the
    table's own order (what plain vLLM would be handed); rows that cannot run are left out."""
    from .dataset import load_prompts
    from .prepared import prepare_batch

    table = load_prompts(args.prompts, args.database)
    whole = prepare_batch(table, tokenizer, engine_settings_from(args, model_path),
                          SamplingSettings(max_tokens=args.max_tokens))
    ok = np.asarray([r not in whole.errors for r in range(whole.num_rows)])
    groups = np.unique(whole.group_of_row[ok])
    rng = np.random.default_rng(args.seed)
    picked, rows = set(), 0
    sizes = np.bincount(whole.group_of_row[ok])
    for group in rng.permutation(groups):
        if rows >= args.sample:
            break
        picked.add(int(group))
        rows += int(sizes[group])
    chosen = [r for r in range(whole.num_rows) if ok[r] and int(whole.group_of_row[r]) in picked]
    sample = whole.subset(chosen)
    described = {"shape": "table", "source": args.prompts, "table_rows": whole.num_rows,
                 "error_rows_left_out": len(whole.errors), "sampled_groups": len(picked), "seed": args.seed}
    return sample, described


def _one_run(name: str, prepared, engine_settings: EngineSettings, sampling: SamplingSettings, scheduler: SchedulerSettings):
    from .batch_run import BatchRun
    from .vllm_engine import open_engine

    baseline, caching = RUNS[name]
    try:
        with open_engine(engine_settings, prepared, enable_prefix_caching=caching) as engine:
            run = BatchRun(prepared, engine, sampling, scheduler, rows=input_order(prepared),
                           baseline_order=baseline(prepared) if baseline else None)
            outputs = {r.id: r.text for r in run}
            info = engine.info
    finally:
        gc.collect()
    return run.stats, info, outputs


def _report(stats: RunStats, info) -> dict:
    out = {**stats.to_dict(), "max_num_seqs": info.max_num_seqs, "kv_capacity_blocks": info.kv_capacity_blocks}
    keep = ["tokens_per_s", "output_tokens_per_s", "wall_s", "prompt_tokens", "cached_tokens", "reusable_tokens",
            "prefill_tokens", "saving_vs_ideal", "output_tokens", "preemptions", "prefix_requests", "max_num_seqs",
            "kv_capacity_blocks", "engine_steps", "rows_per_step", "mean_kv_usage"]
    return {k: out[k] for k in keep}


def run_bench(args) -> dict:
    from .models import resolve_model
    from .tokenizing import load_tokenizer

    model_path = resolve_model(args.model or DEFAULT_MODEL)
    tokenizer = load_tokenizer(model_path)
    special = max(tokenizer.all_special_ids or [0])
    vocab = (special + 1, min(len(tokenizer), 32000))
    response_formats, ids = {}, None
    if args.prompts:
        sample, described = table_sample(args, tokenizer, model_path)
        batch, max_tokens, ids, response_formats = sample.batch, sample.max_tokens, sample.ids, sample.response_formats
    elif args.shape == "nested":
        batch, max_tokens = nested_tokens(vocab, args.seed)
        described = {"shape": "nested", "seed": args.seed}
    elif args.shape == "templates":
        batch, max_tokens = templates_tokens(vocab, args.seed)
        described = {"shape": "templates", "seed": args.seed}
    else:
        workload = Workload(
            groups=args.groups, rows_per_group=args.rows_per_group, system_tokens=args.system_tokens,
            prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens, output_tokens=args.output_tokens,
            output_mix=args.output_mix, seed=args.seed,
        )
        batch, max_tokens = synthetic_tokens(workload, vocab)
        described = {"shape": "groups", **asdict(workload)}
    prepared = _prepared(batch, max_tokens, args.block_size, ids, response_formats)
    plan = prepared.plan
    working_set = int(plan.unique_tokens // args.block_size)
    kv_blocks = args.kv_cache_blocks or max(64, working_set // 3)
    engine_settings = engine_settings_from(args, model_path).model_copy(update={"kv_cache_blocks": kv_blocks})
    # Fixed output lengths (ignore_eos) make the runs' token counts equal; a constrained answer ends
    # where its format does, in every run alike.
    response_format = response_format_from(args)
    constrained = response_format is not None or bool(response_formats)
    sampling = SamplingSettings(max_tokens=int(max_tokens.max()), ignore_eos=not constrained,
                                response_format=response_format)
    scheduler = SchedulerSettings(
        kv_budget_fraction=args.kv_budget_fraction, prefix_requests=not args.no_prefix_requests,
        reserve_output=args.reserve_output, lookahead_tokens=args.lookahead_tokens,
    )
    runs, outputs = {}, {}
    for name in args.runs.split(","):
        log.info("bench: %s", name)
        stats, info, outputs[name] = _one_run(name, prepared, engine_settings, sampling, scheduler)
        runs[name] = _report(stats, info)
        log.info("bench: %s -> %s", name, runs[name])

    def ratio(a: str, b: str):
        if a in runs and b in runs and runs[b]["tokens_per_s"]:
            return round(runs[a]["tokens_per_s"] / runs[b]["tokens_per_s"], 3)
        return None

    reference = "vllm_apc" if "vllm_apc" in outputs else next(iter(outputs))
    mismatched = [i for i in outputs[reference] if any(outputs[n].get(i) != outputs[reference][i] for n in outputs)]
    agreement = 1 - len(mismatched) / max(len(outputs[reference]), 1)
    ratios = {"vs_vllm_nocache": ratio("batchllm", "vllm_nocache"), "vs_vllm_apc": ratio("batchllm", "vllm_apc"),
              "vs_vllm_apc_sorted": ratio("batchllm", "vllm_apc_sorted")}
    return {
        "workload": {**described, "rows": prepared.num_rows, "model": args.model or DEFAULT_MODEL, "dtype": engine_settings.for_platform(current_platform()).dtype,
                     "block_size": args.block_size, "kv_cache_blocks": kv_blocks,
                     "prefix_working_set_blocks": working_set, "prompt_tokens": plan.prompt_tokens,
                     "unique_tokens": plan.unique_tokens, "shared_prompt_tokens": plan.shared_prompt_tokens,
                     "plan_s": round(prepared.plan_s, 4)},
        "runs": runs,
        "ratios": ratios,
        "outputs_equal": not mismatched,
        "rows_with_different_outputs": len(mismatched),
        # Share of rows whose greedy answer was the same in every run. Equal by construction on CPU
        # (fp32); on a GPU, bf16 kernels depend on the batch's composition unless vLLM runs
        # batch-invariant (--batch-invariant: VLLM_BATCH_INVARIANT=1), so an order can change an answer.
        "answer_agreement": round(agreement, 4),
        "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT") == "1",
        "verdict": verdict(ratios, agreement, prepared.num_rows, described),
    }


def verdict(ratios: dict, agreement: float, rows: int, described: dict) -> str:
    """One line a team can act on: how this engine compared with plain vLLM on this batch."""
    what = f"{rows} rows of {described['source']}" if described["shape"] == "table" else f"the {described['shape']} shape"
    parts = [f"{ratios[key]:.2f}x {label}" for key, label in (
        ("vs_vllm_apc_sorted", "vLLM on sorted rows"), ("vs_vllm_apc", "vLLM with prefix caching"),
        ("vs_vllm_nocache", "vLLM without it")) if ratios.get(key)]
    if not parts:
        return f"on {what}: run batchllm and a vLLM run to compare"
    # Judged against the strongest baseline that ran: the one batchllm leads by least.
    vs_strongest = min(ratios[key] for key in ("vs_vllm_apc_sorted", "vs_vllm_apc", "vs_vllm_nocache") if ratios.get(key))
    call = ("worth it" if vs_strongest >= 1.1 else "on par with the strongest baseline" if vs_strongest >= 0.95
            else "slower than the strongest baseline here: please report it")
    equal = "outputs equal" if agreement == 1 else f"OUTPUTS DIFFER in {100 * (1 - agreement):.1f}% of rows"
    return f"on {what}: batchllm ran {', '.join(parts)} ({equal}); {call}"


def synthetic_analysis_tokens(rows: int, tokens_per_row: int, rows_per_group: int, seed: int = 0):
    """A million-row batch: groups share most of each row, the rest is unique."""
    rng = np.random.default_rng(seed)
    shared = tokens_per_row * 4 // 5
    groups = max(1, rows // rows_per_group)
    prefixes = rng.integers(10, 50000, (groups, shared), dtype=np.int32)
    out = np.empty((rows, tokens_per_row), dtype=np.int32)
    group = rng.integers(0, groups, rows)
    for lo in range(0, rows, 1 << 17):  # in chunks: no second full-size temporary
        hi = min(rows, lo + (1 << 17))
        out[lo:hi, :shared] = prefixes[group[lo:hi]]
        out[lo:hi, shared:] = rng.integers(10, 50000, (hi - lo, tokens_per_row - shared), dtype=np.int32)
    del prefixes
    return out.reshape(-1), np.arange(rows + 1, dtype=np.int64) * tokens_per_row


def run_analysis(args) -> dict:
    tokens, offsets = synthetic_analysis_tokens(args.rows, args.tokens_per_row, args.rows_per_group, args.seed)
    decode = np.full(args.rows, args.output_tokens, dtype=np.int64)
    gc.collect()
    tracemalloc.start()
    started = time.perf_counter()
    plan = build_plan(tokens, offsets, decode, args.block_size)
    plan_s = time.perf_counter() - started
    _, peak_alloc = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "rows": args.rows,
        "tokens": int(tokens.size),
        "token_array_bytes": int(tokens.nbytes),
        "plan_s": round(plan_s, 3),
        "plan_peak_alloc_bytes": int(peak_alloc),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "groups": plan.num_groups,
        "shared_fraction": round(plan.shared_fraction, 4),
    }


def cmd_bench(args) -> int:
    if args.scale:
        # The scale benchmark runs the Dagster assets, which the engine does not import: it is a
        # program of the code location, run as its own process (its phases each in a fresh one).
        command = [sys.executable, "-m", "dagster_project.scale_bench", "--rows", str(args.scale),
                   "--model", args.model or "tiny", "--partition-rows", str(args.partition_rows)]
        return subprocess.call(command)
    if getattr(args, "batch_invariant", False):
        if current_platform() != "cuda":  # vLLM's batch-invariant kernels are Triton kernels for GPUs
            raise SystemExit(f"batchllm bench: --batch-invariant needs a CUDA GPU (vLLM's Triton kernels); "
                             f"this platform is {current_platform()}, where fp32 answers do not depend on "
                             f"the batch: leave the option out")
        os.environ["VLLM_BATCH_INVARIANT"] = "1"  # read by vLLM when its engines start
    if args.scheduler_only:
        from .bench_scheduler import run_scheduler_only

        result = run_scheduler_only([int(n) for n in args.rows_in_flight.split(",")])
    else:
        result = run_analysis(args) if args.analysis else run_bench(args)
    if "verdict" in result:
        log.info("bench: %s", result["verdict"])
    print(json.dumps(result, indent=2))
    return 0


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="compare this engine with plain vLLM in one run")
    bench.add_argument("prompts", nargs="?", help="a prompt table (Parquet, .sql, or a table of --database): bench a "
                       "sample of its rows instead of a synthetic --shape")
    bench.add_argument("--database", help="DuckDB database PROMPTS refers to (opened read-only)")
    bench.add_argument("--sample", type=at_least_one, default=500,
                       help="rows of PROMPTS to bench, as whole prefix groups (default 500)")
    bench.add_argument("--max-tokens", type=at_least_one, default=64, help="output tokens of a PROMPTS row without its own")
    bench.add_argument("--json", action="store_true", help="JSON on stdout (always; logs go to stderr)")
    bench.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ",".join(RUNS))
    bench.add_argument("--shape", choices=SHAPES, default="groups", help="the synthetic table (see the module doc)")
    bench.add_argument("--groups", type=int, default=Workload.groups)
    bench.add_argument("--rows-per-group", type=int, default=Workload.rows_per_group)
    bench.add_argument("--system-tokens", type=int, default=Workload.system_tokens)
    bench.add_argument("--prefix-tokens", type=int, default=Workload.prefix_tokens)
    bench.add_argument("--suffix-tokens", type=int, default=Workload.suffix_tokens)
    bench.add_argument("--output-tokens", type=int, default=Workload.output_tokens)
    bench.add_argument("--output-mix", choices=["fixed", "rows", "tasks"], default=Workload.output_mix,
                       help="fixed lengths, random per row, or a short or long task per group")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--kv-budget-fraction", type=float, default=SchedulerSettings().kv_budget_fraction)
    bench.add_argument("--no-prefix-requests", action="store_true", help="let the first rows compute their prefix")
    bench.add_argument("--reserve-output", choices=[r.value for r in ReserveOutput],
                       default=SchedulerSettings().reserve_output.value)
    bench.add_argument("--lookahead-tokens", type=int, default=SchedulerSettings().lookahead_tokens)
    bench.add_argument("--batch-invariant", action="store_true",
                       help="run vLLM batch-invariant (VLLM_BATCH_INVARIANT=1): on a GPU, answers then do not "
                       "depend on which rows share a step, so the runs' answers can be compared exactly")
    bench.add_argument("--analysis", action="store_true", help="time the plan alone on synthetic token ids")
    bench.add_argument("--scheduler-only", action="store_true",
                       help="our own cost per engine step (scheduler + drive loop) on a stand-in engine, no vLLM")
    bench.add_argument("--rows-in-flight", default="1024,4096,16384", help="sizes for --scheduler-only")
    bench.add_argument("--scale", type=at_least_one, metavar="ROWS",
                       help="a ROWS-row nightly job through Dagster: first plan, a rerun with 1%% of the rows "
                       "changed, one completions partition (see dagster_project/scale_bench.py)")
    bench.add_argument("--partition-rows", type=at_least_one, default=10_000, help="rows per shard for --scale")
    bench.add_argument("--rows", type=int, default=1_000_000, help="rows for --analysis")
    bench.add_argument("--tokens-per-row", type=int, default=500, help="tokens per row for --analysis")
    add_engine_options(bench)  # --kv-cache-blocks defaults to a third of the prefix working set here
    add_response_format_options(bench)
    bench.set_defaults(func=cmd_bench)
