"""How far vLLM's engine core runs ahead of the engine's handle when the core is in its own process
(a GPU's default; ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` runs the same code path on a CPU): the
core's busy loop steps whenever it has work, never waiting for the client, and each client
``step()`` takes one step's outputs from its queue, so what is queued after a client step is how
many steps the core ran that the scheduler has not counted yet (``steps_ahead`` counts one).

    python benchmarks/core_ahead.py [--rows 256] [--kv-cache-blocks 64] [--max-tokens 64]

Runs the same rows with the core in its own process and in this one; prints one JSON line each:
engine steps, preemptions, and how often each queue depth was seen after a client step."""

import argparse
import collections
import json
import os
import subprocess
import sys


def run(rows: int, kv_cache_blocks: int, max_tokens: int) -> dict:
    import pyarrow as pa

    from engine.models import resolve_model
    from engine.plan.prepared import prepare_batch
    from engine.plan.tokenizing import load_tokenizer
    from engine.run.batch_run import BatchRun
    from engine.settings import EngineSettings, SamplingSettings, SchedulerSettings
    from engine.vllm.vllm_engine import open_engine

    model = resolve_model("tiny")
    table = pa.table({"id": [f"r{i}" for i in range(rows)],
                      "prompt": ["Shared system prompt. " * 8 + f"Question {i}: what?" for i in range(rows)]})
    settings = EngineSettings(model_path=model, kv_cache_blocks=kv_cache_blocks)
    sampling = SamplingSettings(max_tokens=max_tokens, ignore_eos=True)
    prepared = prepare_batch(table, load_tokenizer(model), settings, sampling)
    depths = collections.Counter()
    with open_engine(settings) as engine:
        core = engine._engine.engine_core
        queue = getattr(core, "outputs_queue", None)  # the client's queue of the core's step outputs

        def after_step() -> None:
            depths[queue.qsize() if queue is not None else 0] += 1

        run = BatchRun(prepared, engine, sampling, SchedulerSettings(log_every_s=600), after_step=after_step)
        answered = len(list(run))
        stats = run.finished_stats()
    return {"core": type(core).__name__, "rows": answered, "engine_steps": stats.engine_steps,
            "preemptions": stats.preemptions, "admission": stats.admission,
            "queued_after_a_step": dict(sorted(depths.items()))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--kv-cache-blocks", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--child", choices=["0", "1"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:  # the run itself, in a fresh process with the core where it was asked
        print(json.dumps(run(args.rows, args.kv_cache_blocks, args.max_tokens)))
        return
    for own_process in ("1", "0"):
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": own_process, "VLLM_LOGGING_LEVEL": "WARNING"}
        done = subprocess.run([sys.executable, __file__, "--child", own_process, "--rows", str(args.rows),
                               "--kv-cache-blocks", str(args.kv_cache_blocks), "--max-tokens", str(args.max_tokens)],
                              env=env, capture_output=True, text=True, check=True)
        print(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
