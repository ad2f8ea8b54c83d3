"""Configuration of one batch run: which model, how vLLM is set up, how rows are sampled."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class EngineSettings:
    """How vLLM is started. ``kv_cache_blocks`` caps the KV cache (None: what memory allows)."""

    model_path: str
    dtype: str = "float32"
    block_size: int = 32
    kv_cache_blocks: int | None = None
    kv_cache_gib: int = 2
    max_model_len: int = 2048
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = True
    seed: int = 0

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


@dataclass(frozen=True)
class SchedulerSettings:
    """BatchLLM scheduling knobs (see engine/scheduler.py)."""

    kv_budget_fraction: float = 0.97  # share of the real KV capacity the in-flight working set may use
    # How much of a row's future output KV is reserved when it is admitted: "full" reserves all of
    # max_tokens (no preemption ever, fewer rows in flight); "lookahead" reserves only the next
    # ``lookahead_tokens`` of every running row and counts what rows really hold (vLLM allocates
    # output blocks lazily, so this keeps more rows in flight; a rare preemption is the price).
    reserve_output: str = "lookahead"
    lookahead_tokens: int = 32
    prefix_requests: bool = True  # compute each group's prefix once before its rows enter
    min_group_rows: int = 2
    log_every_s: float = 5.0


def fingerprint(*parts: object) -> str:
    """A short stable hash of settings objects (dataclasses or plain JSON values)."""
    payload = json.dumps([asdict(p) if hasattr(p, "__dataclass_fields__") else p for p in parts], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
