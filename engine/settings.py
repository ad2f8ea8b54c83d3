"""Configuration of one batch run: which model, how vLLM is set up, how rows are sampled."""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import asdict, dataclass, field

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Policy(str, enum.Enum):
    """A named choice. ``parse`` is the one place a text becomes a policy; a typo lists the choices."""

    @classmethod
    def parse(cls, value: "str | Policy") -> "Policy":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"{cls.__name__} must be one of {choices}, not {value!r}") from None

    def __str__(self) -> str:
        return self.value


class ReserveOutput(Policy):
    """How much of a row's future output KV is reserved when it is admitted."""

    FULL = "full"  # all of max_tokens: no preemption ever, fewer rows in flight
    LOOKAHEAD = "lookahead"  # the next lookahead_tokens (vLLM allocates output blocks lazily)


class RunMode(Policy):
    """How the rows of a run enter the engine."""

    BATCHLLM = "batchllm"  # plan order, group-wise admission under a KV budget
    IN_ORDER = "in_order"  # every row at once, in the given order (plain vLLM)
    SORTED = "sorted"  # every row at once, sorted by token ids (plain vLLM on sorted() rows)


# Default KV block size (tokens) everywhere a block size is not given; vLLM accepts these.
DEFAULT_BLOCK_SIZE = 32
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class EngineSettings:
    """How vLLM is started. ``kv_cache_blocks`` caps the KV cache (None: what memory allows)."""

    model_path: str
    dtype: str = "float32"
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_blocks: int | None = None
    kv_cache_gib: int = 2
    max_model_len: int = 2048
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {BLOCK_SIZES} (what vLLM supports), not {self.block_size}")
        if self.max_model_len < 1 or (self.kv_cache_blocks is not None and self.kv_cache_blocks < 2):
            raise ValueError("max_model_len must be >= 1 and kv_cache_blocks (when given) >= 2")

    @property
    def context_len(self) -> int:
        """Longest prompt + output a row may have: the model's limit, or a capped KV cache's
        (vLLM keeps one block in reserve)."""
        if self.kv_cache_blocks is None:
            return self.max_model_len
        return max(self.block_size, min(self.max_model_len, (self.kv_cache_blocks - 1) * self.block_size))


@dataclass(frozen=True)
class SamplingSettings:
    """Default sampling for every row; a row's own ``max_tokens`` overrides the default."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False
    seed: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, not {self.max_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1] (got {self.temperature}, {self.top_p})")


class SchedulerSettings(BaseModel):
    """BatchLLM scheduling knobs (see engine/scheduler.py); the same model is a job's YAML ``scheduler:``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kv_budget_fraction: float = Field(
        0.97, description="share of the engine's KV capacity the blocks in flight may use, in (0, 1]")
    reserve_output: ReserveOutput = Field(
        ReserveOutput.LOOKAHEAD, description="output KV reserved at admission: 'full' (never preempt) or "
        "'lookahead' (the next lookahead_tokens; more rows in flight)")
    lookahead_tokens: int = Field(16, description="output tokens reserved per running row with 'lookahead' (>= 0)")
    prefix_requests: bool = Field(True, description="compute each group's prefix once, before its rows enter")
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
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
