"""Host time of one engine step as a GPU's would be, minus the GPU: the engine's handle stepping a real
``LLMEngine`` (vLLM's output processor, detokenizing every running request's new token, its
iteration stats and its stat loggers), over a stand-in engine core that returns one new token per
running request per step. The stat loggers as the engine starts them now (its own, a Prometheus one
by class, vLLM adding none) and as before (a per-engine logger, beside which vLLM added its
Prometheus one), at ROWS requests decoding; and the loggers alone (vLLM's ``StatLoggerManager``
recording one such step's stats).

    python benchmarks/step_host_cost.py [--rows 256 1024] [--steps 200] [--model tiny]

Prints one JSON line per row count: microseconds per step, whole and loggers alone, median of five
repetitions alternating before and after, and the range."""

import argparse
import json
import statistics
import time

import numpy as np


class StandInCore:
    """What ``LLMEngine`` asks of its engine core, with no model: every request added runs forever,
    one new token per step."""

    def __init__(self, supported_tasks):
        self.running: list[str] = []
        self.supported_tasks = supported_tasks

    def get_supported_tasks(self):
        return self.supported_tasks

    def add_request(self, request):
        self.running.append(request.request_id)

    def get_output(self):
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
        from vllm.v1.metrics.stats import SchedulerStats

        return EngineCoreOutputs(outputs=[EngineCoreOutput(r, [42]) for r in self.running],
                                 scheduler_stats=SchedulerStats(num_running_reqs=len(self.running),
                                                                kv_cache_usage=0.5),
                                 timestamp=time.monotonic())

    def abort_requests(self, request_ids):
        pass

    def shutdown(self):
        pass


def _record_us(manager, rows: int, steps: int) -> float:
    """The loggers alone: one step's stats of ``rows`` decoding requests (an inter-token latency
    each, as vLLM's output processor fills them) recorded ``steps`` times."""
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats

    iteration = IterationStats()
    iteration.num_generation_tokens, iteration.inter_token_latencies_iter = rows, [0.02] * rows
    scheduler = SchedulerStats(num_running_reqs=rows, kv_cache_usage=0.5)
    started = time.perf_counter()
    for _ in range(steps):
        manager.record(scheduler, iteration)
    return (time.perf_counter() - started) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()

    from vllm.v1.metrics.loggers import StatLoggerBase, StatLoggerManager

    from engine.models import resolve_model
    from engine.run.requests import RequestKind, Submission
    from engine.settings import EngineSettings, SamplingSettings
    from engine.vllm.vllm_engine import gauge_stat_logger, open_engine

    handle = open_engine(EngineSettings(model_path=resolve_model(args.model), kv_cache_blocks=64))
    llm = handle._engine
    real_core, now = llm.engine_core, llm.logger_manager
    config = handle.vllm_config

    class PerEngine(StatLoggerBase):  # the engine's logger before: the same work, a per-engine factory
        def __init__(self, vllm_config, engine_index=0):
            self.ours = gauge_stat_logger(handle._gauges)(vllm_config)

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            self.ours.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self):
            pass

    before = StatLoggerManager(config, custom_stat_loggers=[lambda c, i=0: PerEngine(c, i)])
    sampling = SamplingSettings(max_tokens=100_000, ignore_eos=True)
    try:
        for rows in args.rows:
            times = {"before": [], "after": []}
            for _ in range(5):
                for name, manager in (("before", before), ("after", now)):
                    core = StandInCore(real_core.get_supported_tasks())
                    llm.engine_core, llm.logger_manager = core, manager
                    for row in range(rows):
                        handle.submit(Submission(RequestKind.ROW, row, np.arange(16, dtype=np.int32) + row, 100_000),
                                      sampling)
                    handle.step()  # first tokens: each request's first output
                    started = time.perf_counter()
                    for _ in range(args.steps):
                        handle.step()
                    times[name].append((time.perf_counter() - started) / args.steps * 1e6)
                    for request_id in list(llm.output_processor.request_states):
                        llm.output_processor.request_states.pop(request_id, None)
                    handle._in_flight.clear()
            loggers = {"before": [], "after": []}
            for _ in range(5):
                for name, manager in (("before", before), ("after", now)):
                    loggers[name].append(_record_us(manager, rows, args.steps * 10))
            medians = {f"{n}_us_per_step": round(statistics.median(v)) for n, v in times.items()}
            ranges = {f"{n}_range": [round(min(v)), round(max(v))] for n, v in times.items()}
            alone = {f"loggers_{n}_us_per_step": round(statistics.median(v), 1) for n, v in loggers.items()}
            print(json.dumps({"rows": rows, **medians, **ranges, **alone}))
    finally:
        llm.engine_core, llm.logger_manager = real_core, now
        handle.close()


if __name__ == "__main__":
    main()
