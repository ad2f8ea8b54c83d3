"""The engine's front door: prepare a prompt table (tokenize, check, plan) and run it on vLLM.

    prepared = prepare_batch(table, tokenizer, engine_settings, sampling)
    run = BatchRun(prepared, engine, sampling)          # all rows, BatchLLM scheduling
    for result in run: ...                               # RowResult, keyed by id, as rows finish
    run.stats                                            # RunStats

A ``PreparedBatch`` is everything a run needs and nothing it must recompute: token ids, output
budgets, errors, and the plan (run order, group and group prefix of each row). It is built once,
by ``prepare_batch`` (tokenizer + planner), and can be stored and restored without either
(``batchllm_dagster`` persists it as the ``prefix_groups`` plan and runs shards from it).

Rows that cannot run (empty prompt, bad chat messages, too long for the model, bad max_tokens)
come back as results with ``status="error"`` and a reason; the rest of the batch goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from .dataset import Columns
from .drive import Rejected, StepTotals, drive
from .plan import PrefixPlan, plan_blocks, reusable_tokens
from .progress import Display, Progress
from .results import EngineInfo, RowResult, RunStats
from .scheduler import GroupScheduler, InOrderScheduler, groups_in_run_order
from .response_format import ResponseFormat, cut_off_reason
from .settings import EngineSettings, RunMode, SamplingSettings, SchedulerSettings
from .token_cache import CachedRows
from .tokenizing import TokenizedBatch, tokenize_rows
from .vllm_engine import VLLMEngine

log = logging.getLogger(__name__)


@dataclass
class PreparedBatch:
    ids: list  # row ids in input order
    id_type: pa.DataType
    batch: TokenizedBatch | None  # rows with an error have no tokens; None where the ids stay in the token cache
    max_tokens: np.ndarray
    errors: dict[int, str]
    order: np.ndarray  # row indices in run order; each group's rows are contiguous
    group_of_row: np.ndarray  # group id per row
    prefix_len_of_row: np.ndarray  # tokens of the row's group prefix (whole blocks; 0 = none)
    block_size: int
    response_formats: dict[int, ResponseFormat] = field(default_factory=dict)  # rows with their own constraint
    plan: PrefixPlan | None = None  # the whole plan, where this batch was planned (not restored)
    tokenize_s: float = 0.0
    plan_s: float = 0.0

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    @classmethod
    def from_plan(cls, ids, id_type, batch, max_tokens, errors, plan: PrefixPlan, **kw) -> "PreparedBatch":
        return cls(ids=ids, id_type=id_type, batch=batch, max_tokens=max_tokens, errors=errors, order=plan.order,
                   group_of_row=plan.group_of_row, prefix_len_of_row=plan.group_prefix_tokens[plan.group_of_row],
                   block_size=plan.block_size, plan=plan, **kw)

    def subset(self, rows) -> "PreparedBatch":
        """The same batch restricted to ``rows`` (kept in input order, plan order preserved)."""
        rows = np.sort(np.asarray(rows, dtype=np.int64))
        new_index = np.full(self.num_rows, -1, dtype=np.int64)
        new_index[rows] = np.arange(rows.size)
        in_subset = new_index[self.order] >= 0
        batch = TokenizedBatch.from_rows([self.batch.tokens_of(int(r)) for r in rows])
        return PreparedBatch(
            ids=[self.ids[r] for r in rows], id_type=self.id_type, batch=batch, max_tokens=self.max_tokens[rows],
            errors={int(new_index[r]): e for r, e in self.errors.items() if new_index[r] >= 0},
            order=new_index[self.order[in_subset]], group_of_row=self.group_of_row[rows],
            prefix_len_of_row=self.prefix_len_of_row[rows], block_size=self.block_size,
            response_formats={int(new_index[r]): f for r, f in self.response_formats.items() if new_index[r] >= 0},
        )

    def to_table(self) -> pa.Table:
        """The batch as a plan table, one row per prompt row in input order: everything a run needs
        without the tokenizer or the planner (``from_table`` reads it back)."""
        position = np.empty(self.num_rows, dtype=np.int64)
        position[self.order] = np.arange(self.order.size)
        columns = {
            "id": pa.array(self.ids, self.id_type),
            "position": position,
            "group": self.group_of_row.astype(np.int64),
            "prefix_tokens": self.prefix_len_of_row.astype(np.int64),
            "max_tokens": self.max_tokens.astype(np.int64),
            "error": _sparse_strings(self.errors, self.num_rows),
            "response_format": _sparse_strings({i: f.to_text() for i, f in self.response_formats.items()},
                                               self.num_rows),
        }
        if self.batch is not None:  # 64-bit offsets: a big batch holds more than 2^31 tokens
            columns["token_ids"] = pa.LargeListArray.from_arrays(pa.array(self.batch.offsets.astype(np.int64)),
                                                                 pa.array(self.batch.tokens, pa.int32()))
        return pa.table(columns, metadata={"batchllm.block_size": str(self.block_size)})

    @classmethod
    def from_table(cls, table: pa.Table) -> "PreparedBatch":
        """A batch from (a filtered part of) a plan table written by ``to_table``."""
        token_ids = table.column("token_ids").combine_chunks()
        offsets = token_ids.offsets.to_numpy().astype(np.int64)
        offsets -= offsets[0]
        errors = {i: e for i, e in enumerate(table.column("error").to_pylist()) if e is not None}
        formats = {i: ResponseFormat.from_text(text) for i, text in enumerate(_column(table, "response_format") or [])
                   if text is not None}
        block_size = int((table.schema.metadata or {}).get(b"batchllm.block_size", b"0"))
        if block_size < 1:
            raise ValueError("not a plan table: it has no batchllm.block_size")
        return cls(
            ids=table.column("id").to_pylist(), id_type=table.schema.field("id").type,
            batch=TokenizedBatch(token_ids.values.to_numpy(zero_copy_only=False).astype(np.int32), offsets),
            max_tokens=table.column("max_tokens").to_numpy(), errors=errors,
            order=np.argsort(table.column("position").to_numpy(), kind="stable"),
            group_of_row=table.column("group").to_numpy(), prefix_len_of_row=table.column("prefix_tokens").to_numpy(),
            block_size=block_size, response_formats=formats,
        )


def _sparse_strings(values: dict[int, str], n: int) -> pa.Array:
    """A string column of ``n`` rows, NULL except at ``values``' rows (usually none of a million)."""
    if not values:
        return pa.nulls(n, pa.string())
    return pa.array([values.get(i) for i in range(n)], pa.string())


def _column(table: pa.Table, name: str) -> list | None:
    return table.column(name).to_pylist() if name in table.column_names else None


def _without_rows(batch: TokenizedBatch, drop: set[int]) -> TokenizedBatch:
    """The same batch with the tokens of ``drop`` rows removed (their length becomes 0)."""
    if not drop:
        return batch
    keep = np.ones(batch.tokens.size, dtype=bool)
    lengths = batch.lengths.copy()
    for row in drop:
        keep[batch.offsets[row] : batch.offsets[row + 1]] = False
        lengths[row] = 0
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return TokenizedBatch(batch.tokens[keep], offsets, batch.errors, batch.seconds)


def prepare_batch(
    table: pa.Table,
    tokenizer,
    engine_settings: EngineSettings,
    sampling: SamplingSettings,
    columns: Columns = Columns(),
    scheduler: SchedulerSettings = SchedulerSettings(),
) -> PreparedBatch:
    n = table.num_rows
    batch = tokenize_rows(tokenizer, _column(table, columns.prompt) or [None] * n, _column(table, columns.messages))
    return plan_tokenized(table, batch, engine_settings, sampling, columns, scheduler)


def plan_tokenized(
    table: pa.Table,
    rows: TokenizedBatch | CachedRows,
    engine_settings: EngineSettings,
    sampling: SamplingSettings,
    columns: Columns = Columns(),
    scheduler: SchedulerSettings = SchedulerSettings(),
) -> PreparedBatch:
    """Plan rows already tokenized, in ``table``'s order: their token ids (``TokenizedBatch``), or
    just their lengths and block hashes from the token cache (``CachedRows``: the batch then keeps
    no ids). ``table`` needs only the id, ``max_tokens`` and ``response_format`` columns."""
    ids = table.column(columns.id).to_pylist()
    n = len(ids)
    errors = dict(rows.errors)

    started = time.perf_counter()
    blocks = rows.row_blocks(engine_settings.block_size)
    hash_s = time.perf_counter() - started
    lengths = blocks.lengths
    limit = engine_settings.context_len
    row_max = _column(table, columns.max_tokens)
    max_tokens = np.full(n, sampling.max_tokens, dtype=np.int64)
    if row_max is not None:
        for i, value in enumerate(row_max):
            if value is None:
                continue
            if not 1 <= value <= limit:  # checked as Python ints: no int64 overflow
                errors.setdefault(i, f"invalid max_tokens {value}: must be between 1 and the context of {limit} tokens")
            else:
                max_tokens[i] = value
    for i in np.flatnonzero(max_tokens > limit - lengths):
        errors.setdefault(
            int(i),
            f"prompt of {lengths[i]} tokens + max_tokens {max_tokens[i]} exceeds the model's context of {limit} "
            f"tokens (max_model_len={engine_settings.max_model_len}, KV cache {engine_settings.kv_cache_blocks} blocks)",
        )
    formats = _row_response_formats(_column(table, columns.response_format), errors)
    dropped = set(errors) - set(rows.errors)  # rows that tokenized but cannot run: planned as empty
    batch = _without_rows(rows, dropped) if isinstance(rows, TokenizedBatch) else None
    blocks = blocks.without(dropped)
    decode = np.where(blocks.lengths > 0, max_tokens, 0)
    started = time.perf_counter()
    plan = plan_blocks(blocks, decode, scheduler.min_group_rows)
    plan_s = hash_s + time.perf_counter() - started
    log.info(
        "planned %d rows: %d groups, %d prompt tokens, ideal saving %.1f%% (tokenize %.2fs, plan %.2fs)",
        n, plan.num_groups, plan.prompt_tokens, 100 * plan.shared_fraction, rows.seconds, plan_s,
    )
    return PreparedBatch.from_plan(ids, table.schema.field(columns.id).type, batch, max_tokens, errors, plan,
                                   response_formats=formats, tokenize_s=rows.seconds, plan_s=plan_s)


def _row_response_formats(texts: list[str | None] | None, errors: dict[int, str]) -> dict[int, ResponseFormat]:
    """Each row's own constraint; an invalid one makes the row an error row (the batch goes on).
    Rows usually share a few formats: each distinct text is parsed once."""
    parsed: dict[str, ResponseFormat | str] = {}
    formats = {}
    for i, text in enumerate(texts or []):
        if text is None:
            continue
        if text not in parsed:
            try:
                parsed[text] = ResponseFormat.from_text(text)
            except ValueError as exc:
                parsed[text] = f"invalid response_format: {exc}"
        if isinstance(parsed[text], str):
            errors.setdefault(i, parsed[text])
        else:
            formats[i] = parsed[text]
    return formats


def sorted_rows(prepared: PreparedBatch, rows: list[int]) -> list[int]:
    """The ``sorted()`` baseline: rows in lexicographic order of their token ids."""
    return sorted(rows, key=prepared.batch.row)


class BatchRun:
    """Iterate to run the rows on the engine; results come out as rows finish."""

    def __init__(
        self,
        prepared: PreparedBatch,
        engine: VLLMEngine,
        sampling: SamplingSettings,
        scheduler: SchedulerSettings = SchedulerSettings(),
        rows: list[int] | None = None,
        mode: RunMode | str = RunMode.BATCHLLM,
        progress_sink: Callable[[str], None] | None = None,
        row_fingerprints: list[str] | None = None,
        started_at: float | None = None,
        display: Display | None = None,
        settings_fingerprint: str | None = None,
    ):
        self.prepared, self.engine, self.sampling, self.scheduler = prepared, engine, sampling, scheduler
        self.rows = [int(r) for r in prepared.order] if rows is None else list(rows)
        self.mode = RunMode.parse(mode)
        self.progress_sink = progress_sink
        self.fingerprints = row_fingerprints or [None] * prepared.num_rows
        self.settings_fingerprint = settings_fingerprint
        self.started_at = started_at
        self.display = display  # a live view (a progress bar) besides the progress lines
        self.stats = RunStats()

    def _result(self, row: int, **fields) -> RowResult:
        return RowResult(id=self.prepared.ids[row], group=int(self.prepared.group_of_row[row]),
                         row_fingerprint=self.fingerprints[row], settings_fingerprint=self.settings_fingerprint,
                         **fields)

    def _error(self, row: int, reason: str) -> RowResult:
        self.stats.rows += 1
        self.stats.error_rows += 1
        return self._result(row, status="error", error=reason)

    def _scheduler(self, in_plan_order: list[int]):
        prepared = self.prepared
        if self.mode is RunMode.BATCHLLM:
            groups = groups_in_run_order(in_plan_order, prepared.group_of_row, prepared.prefix_len_of_row)
            return GroupScheduler(prepared.batch, prepared.max_tokens, groups, self.scheduler,
                                  self.engine.block_size, self.engine.kv_capacity_blocks)
        ok_rows = [r for r in self.rows if r not in self.prepared.errors]
        order = ok_rows if self.mode is RunMode.IN_ORDER else sorted_rows(prepared, ok_rows)
        return InOrderScheduler(prepared.batch, prepared.max_tokens, order)

    def __iter__(self) -> Iterator[RowResult]:
        prepared, stats = self.prepared, self.stats
        started = time.perf_counter()
        for row in self.rows:
            if row in prepared.errors:
                yield self._error(row, prepared.errors[row])
        ok_rows = [r for r in self.rows if r not in prepared.errors]
        if not ok_rows:
            return
        position = np.empty(prepared.num_rows, dtype=np.int64)
        position[prepared.order] = np.arange(prepared.order.size)
        in_plan_order = sorted(ok_rows, key=position.__getitem__)  # whatever order the caller gave
        scheduler = self._scheduler(in_plan_order)
        # The minimum, whatever order the rows run in: the plan's order shares every prefix it can.
        stats.reusable_tokens = reusable_tokens(prepared.batch, in_plan_order, prepared.block_size)
        totals = StepTotals()
        progress = Progress(len(self.rows), self.scheduler.log_every_s, self.progress_sink, self.display,
                            reusable=stats.reusable_tokens)

        planned = getattr(scheduler, "planned_blocks", None)

        def saved() -> int:  # prompt tokens not computed: the rows' cache hits less what prefix requests computed
            return stats.cached_tokens - (scheduler.stats.prefix_prompt_tokens - scheduler.stats.prefix_cached_tokens)

        def on_step(report) -> None:
            progress.update(stats.rows, stats.prompt_tokens + stats.output_tokens, saved(),
                            report.running, report.kv_usage, totals.preemptions,
                            planned_blocks=(lambda: planned(report.generated)) if planned else None)

        for item in drive(scheduler, self.engine, self.sampling, totals, on_step, prepared.response_formats):
            if isinstance(item, Rejected):
                yield self._error(item.row, item.reason)
                continue
            row = item.submission.index
            stats.rows += 1
            stats.prompt_tokens += item.prompt_tokens
            stats.cached_tokens += item.cached_tokens
            stats.output_tokens += len(item.token_ids)
            stats.wall_s = time.perf_counter() - started
            # A constrained answer that ran out of max_tokens with its format still open is not an
            # answer: stored as an error row (its text kept to look at), never as ok.
            cut = cut_off_reason(prepared.response_formats.get(row, self.sampling.response_format), item.text,
                                 item.finish_reason, int(prepared.max_tokens[row]))
            if cut:
                stats.error_rows += 1
            else:
                stats.ok_rows += 1
            yield self._result(
                row, status="error" if cut else "ok", text=item.text, error=cut, prompt_tokens=item.prompt_tokens,
                cached_tokens=item.cached_tokens, output_tokens=len(item.token_ids),
                finish_reason=item.finish_reason,
            )
        stats.wall_s = time.perf_counter() - started
        stats.startup_s = (totals.first_submit_at or started) - (self.started_at or started)
        stats.preemptions, stats.engine_steps = totals.preemptions, totals.steps
        stats.mean_kv_usage, stats.rows_per_step = totals.mean_kv_usage, totals.rows_per_step
        scheduled = scheduler.stats
        stats.prefix_requests = scheduled.prefix_requests
        stats.prefix_prompt_tokens, stats.prefix_cached_tokens = scheduled.prefix_prompt_tokens, scheduled.prefix_cached_tokens
        progress.update(stats.rows, stats.prompt_tokens + stats.output_tokens, stats.saved_tokens, 0,
                        stats.mean_kv_usage, stats.preemptions, force=True)


def open_engine(
    engine_settings: EngineSettings, prepared: PreparedBatch | None = None, enable_prefix_caching: bool = True
) -> VLLMEngine:
    """Start vLLM with ``max_num_seqs`` sized so that the KV budget, not a fixed count, limits admission."""
    max_num_seqs = engine_settings.max_num_seqs
    if max_num_seqs is None and prepared is not None and engine_settings.kv_cache_blocks:
        ok = prepared.batch.lengths > 0
        if ok.any():
            own = (np.ceil((prepared.batch.lengths[ok] + prepared.max_tokens[ok]) / engine_settings.block_size)
                   - prepared.prefix_len_of_row[ok] // engine_settings.block_size)
            max_num_seqs = int(np.clip(engine_settings.kv_cache_blocks / max(float(np.median(own)), 1), 16, 512))
    return VLLMEngine(engine_settings, enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs)


@dataclass
class RunOutcome:
    """What a resumable run returns: one result per row, the run's stats, the engine it used."""

    results: list[RowResult]
    stats: RunStats
    engine: EngineInfo | None  # None when every row was reused or invalid: vLLM never started
    not_reused: dict[str, int] = field(default_factory=dict)  # rows run again, by why they were not reused


def run_resumable(
    prepared: PreparedBatch,
    engine_settings: EngineSettings,
    sampling: SamplingSettings,
    checkpoint_dir: str | Path,
    scheduler: SchedulerSettings = SchedulerSettings(),
    rows: list[int] | None = None,
    reuse_from: list[Path | pa.Table] = (),
    progress_sink: Callable[[str], None] | None = None,
    checkpoint_every_rows: int = 256,
    checkpoint_every_s: float = 10.0,
    start_engine: Callable[..., VLLMEngine] = None,
    started_at: float | None = None,
    display: Display | None = None,
) -> RunOutcome:
    """Run the rows, writing results to a checkpoint as they finish; rows a previous (killed)
    run already wrote with the same fingerprint are reused, not recomputed. vLLM starts only
    if some row still needs it."""
    from .checkpoint import Checkpoint, row_fingerprints, settings_fingerprint
    from .vllm_env import current_platform

    started_at = time.perf_counter() if started_at is None else started_at
    start_engine = start_engine or open_engine
    rows = [int(r) for r in prepared.order] if rows is None else list(rows)
    settings_fp = settings_fingerprint(engine_settings.for_platform(current_platform()), sampling)
    fingerprints = row_fingerprints(prepared, settings_fp)
    checkpoint = Checkpoint(checkpoint_dir, prepared.id_type, every_rows=checkpoint_every_rows, every_s=checkpoint_every_s)
    reused = checkpoint.load({prepared.ids[r]: fingerprints[r] for r in rows}, also=list(reuse_from),
                             settings_fp=settings_fp)
    todo = [r for r in rows if prepared.ids[r] not in reused]
    why = "; ".join(f"{n} {reason}" for reason, n in checkpoint.not_reused.most_common())
    (progress_sink or log.info)(
        f"reusing {len(reused)} of {len(rows)} rows ({checkpoint.describe_reuse()}); {len(todo)} to run"
        + (f" ({why})" if why else ""))
    results = list(reused.values())
    needs_engine = any(r not in prepared.errors for r in todo)
    starting = time.perf_counter()
    engine = start_engine(engine_settings, prepared) if needs_engine else None
    engine_start_s = time.perf_counter() - starting
    info = engine.info if engine is not None else None
    checkpoint.restart_timer()  # a kill early in the run keeps what finished after start-up
    try:
        run = BatchRun(prepared, engine, sampling, scheduler, rows=todo, progress_sink=progress_sink,
                       row_fingerprints=fingerprints, started_at=started_at, display=display,
                       settings_fingerprint=settings_fp)
        for result in run:
            checkpoint.add(result)
            results.append(result)
        checkpoint.flush()
    finally:
        stopping = time.perf_counter()
        if engine is not None:
            engine.close()
        engine_stop_s = time.perf_counter() - stopping
    run.stats.reused_rows = len(reused)
    run.stats.engine_start_s = engine_start_s if engine is not None else 0.0
    run.stats.engine_stop_s = engine_stop_s
    return RunOutcome(results, run.stats, info, dict(checkpoint.not_reused))
