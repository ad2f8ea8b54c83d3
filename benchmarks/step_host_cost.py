"""Host time of one engine step as a GPU's would be, minus the GPU: the engine's handle stepping a real
``LLMEngine`` (vLLM's output processor, detokenizing every running request's new token, its
iteration stats and its stat loggers), over a stand-in engine core that returns one new token per
running request per step, at ROWS requests decoding. Three ways the stats are kept:

- ``vllm_logging``: the engine's stat logger beside vLLM's ``LoggingStatLogger``, which vLLM adds
  whenever its logger takes INFO lines (as a routed run's log file does) and which the engine now
  keeps out;
- ``engine``: as the engine starts vLLM now (its own logger alone);
- ``no_stats``: vLLM with no stats at all (``log_stats`` off: no ``IterationStats``, no latency per
  request per step): what the rest of vLLM's per-request stats work costs, the most dropping it
  could gain (the engine's gauges need the scheduler's stats, which come only with it).

    python benchmarks/step_host_cost.py [--rows 256 1024] [--steps 200] [--model tiny]

Prints one JSON line per row count: microseconds per step, median of five repetitions rotated, and
the range."""

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()

    from vllm.v1.metrics.loggers import LoggingStatLogger, StatLoggerManager

    from engine.models import resolve_model
    from engine.run.requests import RequestKind, Submission
    from engine.settings import EngineSettings, SamplingSettings
    from engine.vllm.vllm_engine import gauge_stat_logger, open_engine

    handle = open_engine(EngineSettings(model_path=resolve_model(args.model), kv_cache_blocks=64))
    llm = handle._engine
    real_core, engine_manager = llm.engine_core, llm.logger_manager
    assert [type(logger).__name__ for logger in engine_manager.stat_loggers] == ["GaugeStatLogger"]
    with_logging = StatLoggerManager(handle.vllm_config, custom_stat_loggers=[
        gauge_stat_logger(handle._gauges), LoggingStatLogger])
    configs = {"vllm_logging": (with_logging, True), "engine": (engine_manager, True), "no_stats": (None, False)}
    sampling = SamplingSettings(max_tokens=100_000, ignore_eos=True)
    try:
        for rows in args.rows:
            times = {name: [] for name in configs}
            for repetition in range(5):
                names = list(configs)[repetition % 3:] + list(configs)[:repetition % 3]  # rotated
                for name in names:
                    manager, stats = configs[name]
                    llm.engine_core, llm.logger_manager = StandInCore(real_core.get_supported_tasks()), manager
                    llm.log_stats = llm.output_processor.log_stats = stats
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
            medians = {f"{n}_us_per_step": round(statistics.median(v)) for n, v in times.items()}
            ranges = {f"{n}_range": [round(min(v)), round(max(v))] for n, v in times.items()}
            print(json.dumps({"rows": rows, **medians, **ranges}))
    finally:
        llm.engine_core, llm.logger_manager = real_core, engine_manager
        llm.log_stats = llm.output_processor.log_stats = True
        handle.close()


if __name__ == "__main__":
    main()
