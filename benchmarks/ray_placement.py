"""Prefix saving on Ray: whole groups per replica vs rows dealt round-robin, same rows and replicas.

    .venv/bin/python benchmarks/ray_placement.py dagster_project/datasets/all_prompts.sql data/batchllm.duckdb

Prints one JSON line per placement (prompt tokens, prompt tokens computed, saving, wall seconds).
"""

import json
import sys
import time

import ray

from engine.jobs.distributed import run_on_ray
from engine.models import resolve_model
from engine.plan.prepared import prepare_batch
from engine.plan.tokenizing import load_tokenizer
from engine.settings import EngineSettings, SamplingSettings
from engine.table.dataset import load_prompts


def main(source: str, database: str | None, replicas: int = 2) -> None:
    ray.init(num_cpus=replicas, include_dashboard=False, log_to_driver=False)
    table = load_prompts(source, database)
    settings = EngineSettings(model_path=resolve_model("smollm2"), kv_cache_blocks=256)
    sampling = SamplingSettings(max_tokens=16)
    prepared = prepare_batch(table, load_tokenizer(settings.model_path), settings, sampling)
    for placement in ("groups", "round_robin"):
        started = time.perf_counter()
        result = run_on_ray(prepared, settings, sampling, f".cache/ray_placement/{placement}-{time.time_ns()}",
                            replicas=replicas, placement=placement, bind_cpu_cores=True)
        prompt = sum(s.prompt_tokens for s in result.stats_of_shard.values())
        print(json.dumps({
            "placement": placement, "rows": len(result.results), "prompt_tokens": prompt,
            "prefill_tokens": result.prefill_tokens, "saving": round(1 - result.prefill_tokens / prompt, 4),
            "wall_s": round(time.perf_counter() - started, 1),
        }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
