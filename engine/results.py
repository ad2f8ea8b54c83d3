"""What a run returns: one result per row, keyed by the row's id, and the run's statistics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import pyarrow as pa


@dataclass
class RowResult:
    id: object
    status: str  # "ok" or "error"
    text: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    shard: int | None = None
    group: int | None = None
    row_fingerprint: str | None = None  # model + settings + prompt: what a rerun may reuse


RESULT_SCHEMA_FIELDS = [
    ("status", pa.string()),
    ("text", pa.string()),
    ("error", pa.string()),
    ("prompt_tokens", pa.int64()),
    ("cached_tokens", pa.int64()),
    ("output_tokens", pa.int64()),
    ("finish_reason", pa.string()),
    ("shard", pa.int64()),
    ("group", pa.int64()),
    ("row_fingerprint", pa.string()),
]


def results_to_table(results: list[RowResult], id_type: pa.DataType = pa.string()) -> pa.Table:
    """Results as an Arrow table whose id column keeps the prompt table's id type."""
    fields = [pa.field("id", id_type)] + [pa.field(name, t) for name, t in RESULT_SCHEMA_FIELDS]
    columns = {name: [getattr(r, name) for r in results] for name in ["id"] + [n for n, _ in RESULT_SCHEMA_FIELDS]}
    return pa.table(columns, schema=pa.schema(fields))


@dataclass
class RunStats:
    """Counters of one run. ``prefill_tokens`` counts every prompt token the engine computed,
    the prefix requests' included, so it can be held against the plan's minimum."""

    rows: int = 0
    ok_rows: int = 0
    error_rows: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    prefix_requests: int = 0
    prefix_prompt_tokens: int = 0
    prefix_cached_tokens: int = 0
    ideal_cached_tokens: int = 0
    preemptions: int = 0
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tokens(self) -> int:
        return (self.prompt_tokens - self.cached_tokens) + (self.prefix_prompt_tokens - self.prefix_cached_tokens)

    @property
    def saved_tokens(self) -> int:
        return self.prompt_tokens - self.prefill_tokens

    @property
    def saving_vs_ideal(self) -> float:
        return self.saved_tokens / self.ideal_cached_tokens if self.ideal_cached_tokens else 1.0

    @property
    def tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out.update(
            prefill_tokens=self.prefill_tokens,
            saved_tokens=self.saved_tokens,
            saving_vs_ideal=round(self.saving_vs_ideal, 4),
            tokens_per_s=round(self.tokens_per_s, 2),
            output_tokens_per_s=round(self.output_tokens_per_s, 2),
            wall_s=round(self.wall_s, 3),
        )
        out.update(self.extra)
        return out


def merge_stats(parts: list[dict]) -> RunStats:
    """One RunStats from the ``to_dict()`` of runs that ran side by side (wall time: the longest)."""
    merged = RunStats()
    counters = [f.name for f in fields(RunStats) if isinstance(getattr(merged, f.name), int)]
    for name in counters:
        setattr(merged, name, sum(int(p.get(name, 0)) for p in parts))
    merged.wall_s = max((float(p.get("wall_s", 0.0)) for p in parts), default=0.0)
    merged.extra["reused_rows"] = sum(int(p.get("reused_rows", 0)) for p in parts)
    return merged
