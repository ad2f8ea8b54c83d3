"""One run of a bench in a fresh Python process and vLLM engine: the parent pickles the prompt sets
and settings, ``python -m engine.bench.fresh_process JOB NAME OUT LOG`` runs NAME and writes its
report and answers by id."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ..machine import current_platform
from ..plan.answer_lengths import AnswerLengths, measured_lengths
from ..plan.common_prefix import reusable_tokens
from ..run.results import RunStats
from ..run.step_profile import StepProfile
from ..settings import EngineSettings, SamplingSettings, SchedulerSettings
from ..vllm.library_output import route_library_output
from .runs import RUNS, input_order, sorted_order


def _one_run(name: str, prepared, engine_settings: EngineSettings, sampling: SamplingSettings,
             scheduler: SchedulerSettings, each_step: bool = False,
             answer_lengths: str | None = None) -> tuple[dict, dict]:
    """One run in this process: its report and each row's answer by id (``each_step``: with every
    step's record in its profile; ``answer_lengths``: what a night before learned, for a ``learned`` run)."""
    from ..run.batch_run import BatchRun
    from ..run.scheduler import InOrder, Planned
    from ..vllm.vllm_engine import open_engine

    spec = RUNS[name]
    if spec.generate:
        return _generate_sorted(prepared, engine_settings, sampling)
    if spec.learned:
        prepared = dataclasses.replace(prepared, answer_lengths=AnswerLengths.of_text(answer_lengths))
    with open_engine(engine_settings, enable_prefix_caching=spec.caching) as engine:
        profile = StepProfile.of(prepared.group_of_row)
        scheduling = InOrder(spec.order(prepared)) if spec.order else Planned()
        run = BatchRun(prepared, engine, sampling, scheduler, rows=input_order(prepared), scheduling=scheduling,
                       step_profile=profile)
        results = list(run)
        outputs = {r.id: r.text for r in results}
        info = engine.info
    stats = run.finished_stats()
    report = _report(stats, info.max_num_seqs, info.kv_capacity_blocks)
    ok = [r for r in results if r.status == "ok"]
    learned = measured_lengths(np.array([r.output_tokens for r in ok]), sum(r.finish_reason == "length" for r in ok))
    report["answer_lengths"] = learned.to_text() if learned else None  # what a night after would learn
    report["per_step"] = profile.summary()
    if report["per_step"]:  # the run's time outside vLLM's steps: our scheduler, submissions, results
        report["per_step"]["outside_steps_s"] = round(stats.wall_s - report["per_step"]["step_s"], 3)
        if each_step:  # seconds, prompt tokens, output tokens, rows, groups
            report["per_step"]["each"] = [[round(step[0], 4), *step[1:]] for step in profile.steps]
    return report, outputs


def _generate_sorted(prepared, engine_settings: EngineSettings, sampling: SamplingSettings) -> tuple[dict, dict]:
    """vLLM's ``LLM.generate`` on the rows sorted by prompt, vLLM's own batch sizes (no
    ``max_num_seqs`` from our plan), the same KV blocks and sampling as every run."""
    from ..run.drive import row_sampling
    from ..vllm.vllm_engine import sampling_params
    from ..vllm.vllm_env import configure, engine_args

    platform = current_platform()
    configure(engine_settings, platform)
    from vllm import LLM

    llm = LLM(**engine_args(engine_settings, platform, enable_prefix_caching=True))
    order = [r for r in sorted_order(prepared) if r not in prepared.errors]  # vLLM refuses an empty prompt
    config = llm.llm_engine.vllm_config
    started = time.perf_counter()
    done = llm.generate([{"prompt_token_ids": prepared.batch.row(r)} for r in order],
                        [sampling_params(row_sampling(sampling, prepared.response_formats.get(r)),
                                         int(prepared.max_tokens[r])) for r in order], use_tqdm=False)
    wall_s = time.perf_counter() - started
    stats = RunStats(rows=len(order), ok_rows=len(order), wall_s=wall_s,
                     reusable_tokens=reusable_tokens(prepared.batch, [int(r) for r in prepared.order],
                                                     prepared.block_size),
                     prompt_tokens=sum(len(out.prompt_token_ids) for out in done),
                     cached_tokens=sum(int(out.num_cached_tokens or 0) for out in done),
                     output_tokens=sum(len(out.outputs[0].token_ids) for out in done))
    outputs = {prepared.ids[row]: out.outputs[0].text for row, out in zip(order, done)}
    report = _report(stats, config.scheduler_config.max_num_seqs, config.cache_config.num_gpu_blocks)
    # LLM.generate does not say these
    for unknown in ("preemptions", "recomputed_tokens", "engine_steps", "rows_per_step", "mean_kv_usage"):
        report[unknown] = None
    return report, outputs


def _report(stats: RunStats, max_num_seqs: int, kv_capacity_blocks: int) -> dict:
    out = {**stats.to_dict(), "max_num_seqs": max_num_seqs, "kv_capacity_blocks": kv_capacity_blocks}
    keep = ["tokens_per_s", "output_tokens_per_s", "wall_s", "prompt_tokens", "cached_tokens", "reusable_tokens",
            "prefill_tokens", "saving_vs_ideal", "output_tokens", "preemptions", "recomputed_tokens",
            "prefix_requests", "max_num_seqs", "kv_capacity_blocks", "engine_steps", "rows_per_step", "mean_kv_usage",
            "admission"]
    return {k: out[k] for k in keep}


def in_fresh_process(job: Path, name: str, log_file: Path) -> tuple[dict, dict]:
    """One run in a new Python process (no warm caches, no allocator state, no threads left over
    from an earlier run): its report, with the process id, and its answers."""
    out = job.with_name(f"{name}-{time.time_ns()}.json")
    subprocess.run(
        [sys.executable, "-m", "engine.bench.fresh_process", str(job), name, str(out), str(log_file)], check=True
    )
    result = json.loads(out.read_text())
    out.unlink()
    return result["report"], result["outputs"]


def _child(job: str, name: str, out: str, log_file: str) -> None:
    """``python -m engine.bench.fresh_process JOB NAME OUT LOG``: run NAME on the pickled batch and settings in JOB."""
    route_library_output(Path(log_file))  # vLLM's log lines to the bench's log file, as in the parent
    with open(job, "rb") as f:
        prompt_sets, settings, sampling, scheduler = pickle.load(f)
    run = RUNS[name]
    # a baseline has an order; the by-hand recipe as a user runs it has vLLM's own block size
    engine_settings = settings["vllm_defaults" if run.vllm_defaults else "baseline" if run.order is not None
                               else "engine"]
    report, outputs = _one_run(name, prompt_sets[run.prompts], engine_settings, sampling, scheduler,
                               settings["each_step"], settings.get("answer_lengths"))
    report["pid"] = os.getpid()
    Path(out).write_text(json.dumps({"report": report, "outputs": outputs}))


if __name__ == "__main__":  # one run of a bench, in its own process (see in_fresh_process)
    _child(*sys.argv[1:])
