"""``batchllm doctor``: the first command to run on a node, before a job runs there.

It says what this machine is and what a job would get here, starts vLLM the way a job does, runs
16 rows, and ends with a verdict; each problem it finds comes with its fix, and the exit status is
non-zero when there is one. Nothing here needs a GPU to run: on a CPU it checks the CPU path.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

from ..settings import EngineSettings, Platform
from ..vllm.vllm_env import REQUIRED_ON_CUDA, SOCKET_PATH_LIMIT, socket_paths_fit


@dataclass
class Report:
    facts: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # each: what is wrong, then the fix
    advice: list[str] = field(default_factory=list)  # what would make a job faster here: not a problem

    def problem(self, text: str) -> None:
        self.problems.append(text)


def environment_problems(platform: Platform, env: dict[str, str]) -> list[str]:
    """What in the environment would break or slow a job on this platform, each with its fix."""
    problems = []
    if "VLLMCACHE_ROOT" in env:
        problems.append("VLLMCACHE_ROOT is set but vLLM reads VLLM_CACHE_ROOT: rename the variable")
    rpc = env.get("VLLM_RPC_BASE_PATH")
    if rpc and not socket_paths_fit(rpc):
        problems.append(f"VLLM_RPC_BASE_PATH ({len(rpc)} bytes) makes vLLM's socket paths longer than the Unix "
                        f"limit of {SOCKET_PATH_LIMIT} bytes: unset it (batchllm picks a short path) or point it at a "
                        "short folder")
    if platform is Platform.CUDA:
        for name, (value, why) in REQUIRED_ON_CUDA.items():
            if env.get(name, value) != value:
                problems.append(f"{name}={env[name]} on a GPU {why}: unset it (batchllm sets {value})")
    return problems


def idle_gpus_advice(gpus: int, tensor_parallel_size: int) -> list[str]:
    """How to use every GPU of a node where one engine uses some: a hardware partition runs one engine
    at a time, and engines side by side each claim GPUs of their own (``gpu_claims``)."""
    engines = gpus // max(tensor_parallel_size, 1)
    if engines < 2:
        return []
    slots = ", ".join(f"{{name: gpu{i}, platform: cuda}}" for i in range(min(engines, 2)))
    return [f"this process may use {gpus} GPUs and one engine uses {tensor_parallel_size}: a hardware partition runs "
            f"one engine at a time, so declare {engines} hardware partitions (hardware: [{slots}, ...]), whose runs go "
            f"side by side, each on GPUs it claims; or backend: ray with ray_replicas: {engines}"]


def check(settings: EngineSettings, rows: int = 16) -> Report:
    from ..gpus import gpus, visible_gpus
    from ..machine import current_platform, platform_detection, vllm_version
    from ..vllm.vllm_env import VLLM_SERIES, check_vllm_version, engine_args, process_env

    report = Report()
    platform = current_platform()
    version = vllm_version()
    report.facts.update(
        platform=platform.value,
        detected_by=platform_detection(),
        vllm=version,
        vllm_pinned=f"{VLLM_SERIES}.x",
        gpus=[{"index": g.index, "name": g.name, "memory_gib": round(g.memory_gib, 1)} for g in visible_gpus()],
        gpus_on_node=len(gpus()),
    )
    try:
        check_vllm_version(version.split(" ")[-1])
    except RuntimeError as exc:
        report.problem(str(exc))
    if platform is Platform.CUDA and settings.tensor_parallel_size > len(visible_gpus()):
        report.problem(
            f"tensor_parallel_size {settings.tensor_parallel_size} needs {settings.tensor_parallel_size} "
            f"GPUs; this process may use {len(visible_gpus())} of the node's {len(gpus())} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): lower it or give it more"
        )
    report.advice.extend(idle_gpus_advice(len(visible_gpus()) if platform is Platform.CUDA else 0,
                                          settings.tensor_parallel_size))
    from ..node_checks import problems as node_problems
    from ..node_checks import read_node

    for problem in node_problems(read_node(), settings.tensor_parallel_size, settings.gpu_memory_utilization):
        report.problem(problem)
    env = {**process_env(settings, platform), **os.environ}  # what the engine will see: the user's values win
    for problem in environment_problems(platform, env):
        report.problem(problem)
    if platform is Platform.CPU:
        from ..node_checks import cpu_preload_advice, cpu_preload_libraries

        report.advice.extend(cpu_preload_advice(os.environ.get("LD_PRELOAD", ""), cpu_preload_libraries()))
    context = settings.context(platform)
    report.facts["context"] = {"tokens": context.tokens, "from": context.source}
    if context.assumed and platform is Platform.CUDA:
        report.problem(f"a row may hold {context.tokens:,} tokens: {context.source}")
    report.facts["engine_args"] = engine_args(settings, platform)
    report.facts["environment"] = {k: env[k] for k in sorted(process_env(settings, platform))}
    from ..model_support import unsupported_reason

    unsupported = unsupported_reason(settings.model_path)
    if unsupported:  # said without the start it would fail after
        report.problem(unsupported)
        return report
    _start_and_answer(settings, rows, report)
    return report


def _start_and_answer(settings: EngineSettings, rows: int, report: Report) -> None:
    """Start vLLM as a job does, run ``rows`` rows sharing a prefix, check every answer."""
    import pyarrow as pa

    from ..plan.prepared import prepare_batch
    from ..plan.tokenizing import load_tokenizer
    from ..run.batch_run import BatchRun
    from ..settings import SamplingSettings
    from ..vllm.vllm_engine import EngineStartError, open_engine

    shared = "You are a careful assistant. Answer in one short sentence. " * 4
    table = pa.table({"id": [f"doctor-{i}" for i in range(rows)],
                      "prompt": [f"{shared}Question {i}: what is {i} plus {i}?" for i in range(rows)]})
    sampling = SamplingSettings(max_tokens=8)
    prepared = prepare_batch(table, load_tokenizer(settings.model_path), settings, sampling)
    started = time.perf_counter()
    try:
        engine = open_engine(settings)
    except EngineStartError as exc:
        report.problem(f"vLLM did not start: {exc}")
        return
    try:
        from ..machine import current_platform

        resolved = engine.vllm_config
        report.facts["engine"] = {
            "start_s": round(time.perf_counter() - started, 2), "kv_capacity_blocks": engine.kv_capacity_blocks,
            "block_size": resolved.cache_config.block_size, "max_num_seqs": engine.max_num_seqs,
            "max_num_batched_tokens": engine.max_num_batched_tokens, "dtype": str(resolved.model_config.dtype),
            "kv_cache_tokens": getattr(resolved.cache_config, "kv_cache_size_tokens", None),
            "kv_cache_groups": engine.kv_groups.describe(),
            "max_model_len": resolved.model_config.max_model_len,
            # decode batches above the largest run without CUDA graphs (none: eager, the CPU's)
            "cuda_graph_capture_sizes": _capture_sizes(resolved.compilation_config),
            "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1",
            # what the worker chose; None where it cannot be asked: then vLLM's own line in the log file
            "attention_backends": engine.attention_backends() or "not asked (worker processes): see the log file",
            "platform": current_platform().value}
        run_started = time.perf_counter()
        results = list(BatchRun(prepared, engine, sampling))
        report.facts["answers"] = {"rows": len(results), "ok": sum(r.status == "ok" for r in results),
                                   "run_s": round(time.perf_counter() - run_started, 2),
                                   "example": results[0].text if results else None}
    finally:
        engine.close()
    bad = [r for r in results if r.status != "ok" or not r.text]
    if len(results) != rows or {r.id for r in results} != set(table.column("id").to_pylist()):
        report.problem(f"{rows} rows went in and {len(results)} answers came back: please report it")
    elif bad:
        report.problem(f"{len(bad)} of {rows} rows got no answer ({bad[0].error or 'empty text'}): check the model")


def _capture_sizes(compilation) -> str:
    sizes = sorted(compilation.cudagraph_capture_sizes or [])
    if not sizes:
        return "none (eager)"
    return f"{len(sizes)} sizes, {sizes[0]} to {sizes[-1]} rows"


def cmd_doctor(args) -> int:
    from ..jobs.job_options import DEFAULT_MODEL, engine_settings_from
    from ..models import resolve_model

    if args.job and args.model:
        raise ValueError("give --model or --job, not both (a job's YAML names its model)")
    if args.job:
        from ..jobs.job_file import JobFile

        job = JobFile.read(args.job).llm()
        settings = job.model_copy(update={"model_path": resolve_model(job.model_path)})
    else:
        settings = engine_settings_from(args, resolve_model(args.model or DEFAULT_MODEL))
    report = check(settings)
    verdict = "ready" if not report.problems else f"{len(report.problems)} problem(s): fix them before a job runs here"
    if args.json:
        print(json.dumps({**report.facts, "problems": report.problems, "advice": report.advice, "verdict": verdict},
                         indent=2, default=str))
    else:
        for key, value in report.facts.items():
            print(f"{key:>16}: {json.dumps(value, default=str) if isinstance(value, (dict, list)) else value}")
        for problem in report.problems:
            print(f"  problem: {problem}", file=sys.stderr)
        for advice in report.advice:
            print(f"  advice: {advice}", file=sys.stderr)
        print(f"verdict: {verdict}")
    return 0 if not report.problems else 1


def add_doctor_parser(sub) -> None:
    from ..jobs.job_options import add_engine_options

    doctor = sub.add_parser("doctor", help="check this node: platform, vLLM, GPUs, a real start and 16 answers")
    doctor.add_argument("--job", metavar="YAML", help="take the engine settings of this job's YAML (its llm: block)")
    doctor.add_argument("--json", action="store_true")
    add_engine_options(doctor)
    doctor.set_defaults(func=cmd_doctor)
