"""``batchllm bench``: this engine against plain vLLM, one run after the other on one machine.

Each run is a fresh Python process and vLLM engine with the same KV cache, token ids and greedy
sampling (``ignore_eos``): ``vllm_nocache`` and ``vllm_apc`` (input order, prefix caching off and
on), ``vllm_apc_sorted`` (prefix caching on sorted rows, our engine loop), ``vllm_generate_sorted``
(vLLM's own ``LLM.generate`` on sorted rows: the line a user would write instead), ``batchllm``, and
with prompts from fields ``vllm_hand_order`` (the hand recipe's field order, sorted, ``LLM.generate``)
and ``batchllm_field_order`` (the order ``field_order: optimize`` chooses). ``--repeat N`` rotates
the order each time and reports every ratio's median and range; the verdict names the strongest
baseline. README, "Benchmark", says how to run and read it; ``--shape`` picks a synthetic table
(``engine/bench/shapes.py``), ``PROMPTS`` a sample of the user's own (whole prefix groups).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..jobs.job_options import (
    DEFAULT_MODEL,
    add_engine_options,
    add_prompt_fields_options,
    add_response_format_options,
    at_least_one,
    engine_settings_from,
    response_format_from,
)
from ..jobs.plan_job import plan_summary
from ..machine import current_platform
from ..plan.batch_plan import plan_token_ids
from ..settings import BLOCK_SIZES, Admission, EngineSettings, ReserveOutput, SamplingSettings, SchedulerSettings
from ..vllm.vllm_env import VLLM_DEFAULT_BLOCK_SIZE
from .fresh_process import in_fresh_process
from .prompt_sets import bench_prompt_sets, prefill_by_block_size
from .runs import ASKED_ONLY, FIELD_RUNS, RUNS
from .shapes import SHAPES, Workload, synthetic_analysis_tokens
from .verdict import median_run, prefill_ratios, ratios_over_repetitions, rotated, verdict

log = logging.getLogger(__name__)


def _run_names(runs: str | None, prompt_sets: dict) -> list[str]:
    """The runs asked for (``--runs``), else every run these prompt sets allow; refused with the reason."""
    names = runs.split(",") if runs else [n for n, run in RUNS.items()
                                          if run.prompts in prompt_sets and n not in ASKED_ONLY]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise ValueError(f"unknown run(s) {unknown}: choose from {', '.join(RUNS)}")
    lacking = [n for n in names if RUNS[n].prompts not in prompt_sets]
    if lacking:
        raise ValueError(f"run(s) {lacking} need prompts from fields (--fields, or the fields and short shapes)"
                         + ("; batchllm_field_order needs --field-order optimize"
                            if "batchllm_field_order" in lacking else ""))
    return names


def _repeat_runs(job: tuple, names: list[str], repeat: int, log_file) -> tuple[list[dict], dict, str | None]:
    """Every run ``repeat`` times, each in a fresh process, the order rotated: each repetition's
    results by run, each run's answers per repetition, and the answer lengths a night before learned
    (where a run uses them). ``job``: (prompt sets, settings, sampling, scheduler), the batch as
    planned (without the plan's tree): what every run gets."""
    repetitions, outputs, learned = [], {}, None
    with tempfile.TemporaryDirectory(prefix="batchllm-bench-") as folder:
        path = Path(folder) / "job.pickle"
        with open(path, "wb") as f:
            pickle.dump(job, f)
        if any(RUNS[name].learned for name in names):
            learned = _learn_answer_lengths(path, log_file)
        for repetition in range(repeat):
            runs = {}
            for name in rotated(names, repetition):
                log.info("bench: %s (repetition %d of %d)", name, repetition + 1, repeat)
                runs[name], answers = in_fresh_process(path, name, log_file)
                outputs.setdefault(name, []).append(answers)
                log.info("bench: %s -> %s", name, runs[name])
            repetitions.append(runs)
    return repetitions, outputs, learned


def _learn_answer_lengths(path: Path, log_file) -> str | None:
    """A night before: the engine on the same rows, untimed, and the answer lengths its answers give
    (``plan.answer_lengths``) into the job every later run reads (``batchllm_learned`` uses them)."""
    log.info("bench: a night before (batchllm, untimed), to learn the answers' lengths")
    report, _ = in_fresh_process(path, "batchllm", log_file)
    with open(path, "rb") as f:
        prompt_sets, settings, sampling, scheduler = pickle.load(f)
    settings = {**settings, "answer_lengths": report["answer_lengths"]}
    log.info("bench: learned %s", report["answer_lengths"] or "nothing (the answers end at their max_tokens)")
    with open(path, "wb") as f:
        pickle.dump((prompt_sets, settings, sampling, scheduler), f)
    return report["answer_lengths"]


def _answer_agreement(outputs: dict) -> tuple[list, float, float | None]:
    """The rows whose answer differed between runs of the same prompts, the share that agreed, and
    with reordered fields the share of rows whose answer is the same in both orders (answers of
    another prompt are compared apart: a different prompt may change an answer)."""
    same_prompts = {n: runs for n, runs in outputs.items() if RUNS[n].prompts == "declared"} or outputs
    reference = (same_prompts.get("vllm_apc") or next(iter(same_prompts.values())))[0]
    every = [answers for runs in same_prompts.values() for answers in runs]
    mismatched = [i for i in reference if any(answers.get(i) != reference[i] for answers in every)]
    field_order_agreement = None
    if "batchllm_field_order" in outputs and len(same_prompts) < len(outputs):
        ours = outputs["batchllm_field_order"][0]
        field_order_agreement = round(sum(ours.get(i) == reference[i] for i in reference) / max(len(reference), 1), 4)
    return mismatched, 1 - len(mismatched) / max(len(reference), 1), field_order_agreement


@dataclass(frozen=True)
class BenchEngines:
    """The engine settings of the bench's runs: this engine's, and the baselines' at another block size."""

    engine: EngineSettings
    baseline: EngineSettings  # --baseline-block-size (the same KV memory)
    vllm_defaults: EngineSettings  # vLLM's own default block size on this platform (the same KV memory)
    working_set: int  # blocks of the plan's unique tokens

    @classmethod
    def of(cls, args, engine_settings: EngineSettings, plan) -> "BenchEngines":
        block_size = engine_settings.block_size
        working_set = int(plan.unique_tokens // block_size)
        kv_blocks = args.kv_cache_blocks or max(64, working_set // 3)

        def at(block: int) -> EngineSettings:  # the same KV memory in blocks of another size
            return engine_settings.model_copy(update={"block_size": block,
                                                      "kv_cache_blocks": max(2, kv_blocks * block_size // block)})

        # The baselines at another block size (vLLM's own default, say: 128 on CPU, 16 on a GPU): what a
        # user who leaves vLLM's block size alone gets, against this engine's.
        return cls(engine_settings.model_copy(update={"kv_cache_blocks": kv_blocks}),
                   at(args.baseline_block_size or block_size), at(VLLM_DEFAULT_BLOCK_SIZE[current_platform()]),
                   working_set)

    def described(self, names) -> dict:
        engine, baseline, defaults = self.engine, self.baseline, self.vllm_defaults
        return {
            "dtype": engine.for_platform(current_platform()).dtype,
            "block_size": engine.block_size,
            "kv_cache_blocks": engine.kv_cache_blocks,
            **({"vllm_defaults_block_size": defaults.block_size, "vllm_defaults_kv_cache_blocks":
                defaults.kv_cache_blocks} if "vllm_hand_order_defaults" in names else {}),
            **({"baseline_block_size": baseline.block_size, "baseline_kv_cache_blocks": baseline.kv_cache_blocks}
               if baseline.block_size != engine.block_size else {}),
            "prefix_working_set_blocks": self.working_set,
        }


def _sampling_and_scheduler(args, workload) -> tuple[SamplingSettings, SchedulerSettings]:
    """Fixed output lengths (ignore_eos) make the runs' token counts equal; a constrained answer ends
    where its format does, in every run alike."""
    response_format = response_format_from(args)
    constrained = response_format is not None or bool(workload.response_formats)
    sampling = SamplingSettings(max_tokens=int(workload.max_tokens.max()), ignore_eos=not constrained,
                                response_format=response_format)
    scheduler = SchedulerSettings(
        kv_budget_fraction=args.kv_budget_fraction, prefix_requests=args.prefix_requests, admission=args.admission,
        reserve_output=args.reserve_output, lookahead_tokens=args.lookahead_tokens,
    )
    return sampling, scheduler


def run_bench(args) -> dict:
    """The bench (see the module doc): its settings, its runs (fresh processes, rotated), its report."""
    from ..models import resolve_model
    from ..plan.tokenizing import load_tokenizer

    model_path = resolve_model(args.model or DEFAULT_MODEL)
    engine_settings = engine_settings_from(args, model_path)  # the block size set: this platform's unless given
    workload = bench_prompt_sets(args, load_tokenizer(model_path), model_path, engine_settings.block_size)
    prepared, reordered = workload.planned["declared"], workload.planned.get("chosen")
    engines = BenchEngines.of(args, engine_settings, prepared.plan)
    sampling, scheduler = _sampling_and_scheduler(args, workload)
    names = _run_names(args.runs, workload.prepared)
    settings = {"engine": engines.engine, "baseline": engines.baseline, "vllm_defaults": engines.vllm_defaults,
                "each_step": args.each_step}
    repetitions, outputs, learned = _repeat_runs((workload.prepared, settings, sampling, scheduler), names, args.repeat,
                                        args.log_file)
    # Charged to each engine run: the plan of the prompts it ran, and choosing their field order.
    planning_s = {"batchllm": prepared.plan_s, "batchllm_learned": prepared.plan_s,
                  "batchllm_field_order": (reordered.plan_s + workload.field_order_s) if reordered else 0.0}
    workload_report = {
        **workload.described,
        "rows": prepared.num_rows,
        "model": args.model or DEFAULT_MODEL,
        **engines.described(names),
        **plan_summary(prepared),  # the same numbers as `batchllm plan` and a plan's materialization
        # batchllm's own prompts where it reorders their fields (the baselines keep the declared order)
        **({"batchllm_prompt_tokens": reordered.plan.prompt_tokens,
            "batchllm_unique_tokens": reordered.plan.unique_tokens,
            "field_order_s": round(workload.field_order_s, 4)} if reordered else {}),
        "planning_s_charged": {name: round(s, 4) for name, s in planning_s.items() if name in names},
        **({"answer_lengths_learned": json.loads(learned) if learned else None}
           if any(RUNS[n].learned for n in names) else {}),
    }
    return {"workload": workload_report, "repeat": args.repeat,
            **_runs_report(repetitions, outputs, names, planning_s, workload, prepared.num_rows)}


def _runs_report(repetitions, outputs, names, planning_s, workload, rows: int) -> dict:
    """What the runs measured, their answers' agreement and the verdict."""
    mismatched, agreement, field_order_agreement = _answer_agreement(outputs)
    ratios, with_planning = ratios_over_repetitions(repetitions, planning_s)
    return {
        "run_order": [list(runs) for runs in repetitions],  # each repetition's order (rotated)
        "runs": {name: median_run([runs[name] for runs in repetitions]) for name in names},
        # batchllm's tokens/s over each baseline's, per repetition: median and range
        "ratios": ratios,
        # the same with batchllm charged its planning time (the baselines need none)
        "ratios_with_planning": with_planning,
        # batchllm's prefill tokens over each baseline's: under 1 is fewer tokens computed
        "prefill_ratios": prefill_ratios(repetitions),
        # prompt tokens each prompt set computes at least (sorted, at this block size; see Run)
        "prompt_set_prefill": {name: int(p.plan.unique_tokens) for name, p in workload.planned.items()},
        # ... and at a GPU's default block size (16), the CPU's (32) and vLLM's CPU default (128)
        "prompt_set_prefill_by_block_size": {
            name: prefill_by_block_size(p) for name, p in workload.prepared.items()},
        "outputs_equal": not mismatched,
        # With reordered fields: the share of rows whose answer is the same in both orders.
        "field_order_agreement": field_order_agreement,
        "rows_with_different_outputs": len(mismatched),
        # Share of rows whose greedy answer was the same in every run. Equal by construction on CPU
        # (fp32); on a GPU, bf16 kernels depend on the batch's composition unless vLLM runs
        # batch-invariant (--batch-invariant: VLLM_BATCH_INVARIANT=1), so an order can change an answer.
        "answer_agreement": round(agreement, 4),
        "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT") == "1",
        "verdict": verdict(with_planning, agreement, rows, workload.described, field_order_agreement),  # charged
    }


def run_analysis(args) -> dict:
    tokens, offsets = synthetic_analysis_tokens(args.rows, args.tokens_per_row, args.rows_per_group, args.seed)
    decode = np.full(args.rows, args.output_tokens, dtype=np.int64)
    gc.collect()
    started = time.perf_counter()
    block_size = EngineSettings(block_size=args.block_size).with_block_size().block_size  # this platform's default
    plan = plan_token_ids(tokens, offsets, decode, block_size)
    plan_s = time.perf_counter() - started
    return {
        "rows": args.rows,
        "tokens": int(tokens.size),
        "token_array_bytes": int(tokens.nbytes),
        "plan_s": round(plan_s, 3),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "groups": plan.num_groups,
        "shared_fraction": round(plan.shared_fraction, 4),
    }


def cmd_bench(args) -> int:
    if args.scale and args.nights:  # a program of the code location too (each night in a fresh process)
        return subprocess.call([sys.executable, "-m", "dagster_project.nights_bench", "--rows", str(args.scale),
                                "--model", args.model or "tiny", "--partition-rows", str(args.partition_rows)])
    if args.scale:
        # The scale benchmark runs the Dagster assets, which the engine does not import: it is a
        # program of the code location, run as its own process (its phases each in a fresh one).
        command = [sys.executable, "-m", "dagster_project.scale_bench", "--rows", str(args.scale),
                   "--model", args.model or "tiny", "--partition-rows", str(args.partition_rows),
                   "--partitions-per-run", str(args.partitions_per_run)]
        if args.plan_only:  # the first night's plan step alone, on rows of --tokens-per-row tokens
            command += ["--plan-only", "--tokens-per-row", str(args.tokens_per_row), "--tokenize-workers",
                        str(args.tokenize_workers)]
        return subprocess.call(command)
    if getattr(args, "batch_invariant", False):
        if current_platform() != "cuda":  # vLLM's batch-invariant kernels are Triton kernels for GPUs
            raise SystemExit(f"batchllm bench: --batch-invariant needs a CUDA GPU (vLLM's Triton kernels); "
                             f"this platform is {current_platform()}, where fp32 answers do not depend on "
                             f"the batch: leave the option out")
        from ..vllm.vllm_env import run_batch_invariant

        run_batch_invariant()  # read by vLLM when its engines start
    if args.scheduler_only:
        from .bench_scheduler import measure_fill, run_scheduler_only

        if args.shape == "short":  # how full the batch runs at a GPU's settings
            result = measure_fill()
        else:
            result = run_scheduler_only([int(n) for n in args.rows_in_flight.split(",")])
    else:
        result = run_analysis(args) if args.analysis else run_bench(args)
    if "verdict" in result:
        log.info("bench: %s", result["verdict"])
    print(json.dumps(result, indent=2))
    return 0


def add_bench_parser(sub) -> None:
    """``batchllm bench``'s options (over 60 lines: a list of them)."""
    bench = sub.add_parser("bench", help="compare this engine with plain vLLM in one run")
    bench.add_argument("prompts", nargs="?", help="a prompt table (Parquet, .sql, or a table of --database): bench a "
                       "sample of its rows instead of a synthetic --shape")
    bench.add_argument("--database", help="DuckDB database PROMPTS refers to (opened read-only)")
    bench.add_argument("--sample", type=at_least_one, default=500,
                       help="rows of PROMPTS to bench, as whole prefix groups (default 500)")
    bench.add_argument(
        "--max-tokens", type=at_least_one, default=64, help="output tokens of a PROMPTS row without its own"
    )
    bench.add_argument("--json", action="store_true", help="JSON on stdout (always; logs go to stderr)")
    bench.add_argument("--runs", help="comma-separated subset of " + ",".join(RUNS) + " (default: every run the "
                       "prompts allow; " + ", ".join(FIELD_RUNS) + " need prompts from fields)")
    bench.add_argument("--repeat", type=at_least_one, default=1,
                       help="run every run N times, the order rotated each time; ratios get a median and a range")
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
    bench.add_argument("--baseline-block-size", type=int, choices=BLOCK_SIZES,
                       help="run the vLLM baselines at this KV block size (vLLM's own default: 128 on CPU, 16 on a "
                       "GPU), with the same KV memory; batchllm keeps --block-size (default: the same)")
    bench.add_argument("--kv-budget-fraction", type=float, default=SchedulerSettings().kv_budget_fraction)
    bench.add_argument("--admission", choices=[a.value for a in Admission], default=SchedulerSettings().admission.value,
                       help="who admits batchllm's rows: decided per batch (auto), group_wise, or vllm in plan order")
    bench.add_argument("--prefix-requests", action="store_true",
                       help="compute a group's prefix by a request of its own where its rows cannot all enter at once")
    bench.add_argument("--reserve-output", choices=[r.value for r in ReserveOutput],
                       default=SchedulerSettings().reserve_output.value)
    bench.add_argument("--lookahead-tokens", type=int, default=SchedulerSettings().lookahead_tokens)
    bench.add_argument("--batch-invariant", action="store_true",
                       help="run vLLM batch-invariant (VLLM_BATCH_INVARIANT=1): on a GPU, answers then do not "
                       "depend on which rows share a step, so the runs' answers can be compared exactly")
    bench.add_argument("--each-step", action="store_true",
                       help="add every engine step of each run to its per_step profile (each: seconds, prompt "
                       "tokens, output tokens, rows, groups): two runs' schedules compared step by step")
    bench.add_argument("--analysis", action="store_true", help="time the plan alone on synthetic token ids")
    bench.add_argument("--scheduler-only", action="store_true",
                       help="our own cost per engine step (scheduler + drive loop) on a stand-in engine, no vLLM; "
                       "with --shape short, how full the batch runs at an H200's settings on the block-accounting "
                       "stand-in, against vLLM alone on sorted rows")
    bench.add_argument("--rows-in-flight", default="256,1024,16384", help="sizes for --scheduler-only")
    bench.add_argument("--scale", type=at_least_one, metavar="ROWS",
                       help="a ROWS-row nightly job through Dagster: first plan, a rerun with 1%% of the rows "
                       "changed, one completions partition or --partitions-per-run of them (see "
                       "dagster_project/scale_bench.py)")
    bench.add_argument("--partition-rows", type=at_least_one, default=10_000, help="rows per shard for --scale")
    bench.add_argument("--partitions-per-run", type=at_least_one, default=1,
                       help="--scale: run the first N partitions in one run, on one vLLM start")
    bench.add_argument("--plan-only", action="store_true",
                       help="--scale: the first night's plan step alone (tokenize, plan, write): its time, tokens "
                       "per second and peak memory")
    bench.add_argument("--nights", action="store_true",
                       help="--scale: three nights of the job (first, nothing changed, 1%% edited + 0.5%% new + "
                       "0.5%% deleted), each a fresh process: wall, plan step, shard runs, vLLM starts, rows computed "
                       "and written (see dagster_project/nights_bench.py)")
    bench.add_argument("--tokenize-workers", type=at_least_one, default=1,
                       help="--scale --plan-only: the job's tokenize_workers (Ray tasks tokenizing its rows)")
    bench.add_argument("--rows", type=int, default=1_000_000, help="rows for --analysis")
    bench.add_argument("--tokens-per-row", type=int, default=500, help="tokens per row for --analysis and "
                       "--scale --plan-only")
    add_engine_options(bench)  # --kv-cache-blocks defaults to a third of the prefix working set here
    add_response_format_options(bench)
    add_prompt_fields_options(bench)
    bench.set_defaults(func=cmd_bench)
