"""Host time per engine step of vLLM's stat loggers, as the engine starts them (``gauge_stat_logger``:
the only metrics logger, a Prometheus one by class) against the way it started them before (a
per-engine logger, beside which vLLM adds its own Prometheus logger), at ROWS requests decoding.

    python benchmarks/stat_logger_cost.py [--rows 256 1024] [--steps 2000] [--model tiny]

vLLM's own ``StatLoggerManager`` records each step's ``IterationStats`` (one inter-token latency per
decoding request, as vLLM's output processor fills it) and ``SchedulerStats``; the rows' outputs
themselves are not part of it. Prints one JSON line per row count: microseconds per step, median of
five repetitions, and the range."""

import argparse
import json
import statistics
import time

from engine.models import resolve_model
from engine.run.requests import EngineGauges
from engine.vllm.vllm_engine import gauge_stat_logger


def a_step(rows: int):
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats

    stats = IterationStats()
    stats.num_generation_tokens = rows
    stats.inter_token_latencies_iter = [0.02] * rows
    return SchedulerStats(num_running_reqs=rows, kv_cache_usage=0.5), stats


def per_step_us(manager, rows: int, steps: int) -> float:
    scheduler_stats, iteration_stats = a_step(rows)
    started = time.perf_counter()
    for _ in range(steps):
        manager.record(scheduler_stats, iteration_stats)
    return (time.perf_counter() - started) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    import logging

    from vllm import EngineArgs
    from vllm.v1.metrics.loggers import StatLoggerBase, StatLoggerManager

    logging.getLogger("vllm").setLevel(logging.INFO)  # vLLM adds its logging logger at INFO, as in a run
    config = EngineArgs(model=resolve_model(args.model)).create_engine_config()
    gauges = EngineGauges()

    class PerEngine(StatLoggerBase):  # the engine's logger before: the same work, a per-engine factory
        def __init__(self, vllm_config, engine_index=0):
            self.ours = gauge_stat_logger(gauges)(vllm_config)

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            self.ours.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self):
            pass

    before = StatLoggerManager(config, custom_stat_loggers=[lambda c, i=0: PerEngine(c, i)])
    after = StatLoggerManager(config, custom_stat_loggers=[gauge_stat_logger(gauges)])
    for rows in args.rows:
        runs = {name: [] for name in ("before", "after")}
        for _ in range(5):
            for name, manager in (("before", before), ("after", after)):
                runs[name].append(per_step_us(manager, rows, args.steps))
        print(json.dumps({"rows": rows, **{f"{name}_us_per_step": round(statistics.median(values), 1)
                                           for name, values in runs.items()},
                          **{f"{name}_range": [round(min(v), 1), round(max(v), 1)] for name, v in runs.items()},
                          "loggers_before": [type(x).__name__ for x in before.stat_loggers],
                          "loggers_after": [type(x).__name__ for x in after.stat_loggers]}))


if __name__ == "__main__":
    main()
