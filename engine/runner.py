"""The engine's front door: prepare a prompt table (tokenize, check, plan) and run it on vLLM.

    prepared = prepare_batch(table, tokenizer, engine_settings, sampling)
    run = BatchRun(prepared, engine, sampling)          # all rows, BatchLLM scheduling
    for result in run: ...                               # RowResult, keyed by id, as rows finish
    run.stats                                            # RunStats

Rows that cannot run (empty prompt, bad chat messages, too long for the model, bad max_tokens)
come back as results with ``status="error"`` and a reason; the rest of the batch goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from .dataset import Columns
from .plan import PrefixPlan, build_plan, unique_tokens_per_row
from .results import RowResult, RunStats
from .scheduler import Progress, run_grouped, run_in_order
from .settings import EngineSettings, SamplingSettings, SchedulerSettings
from .tokenizing import TokenizedBatch, tokenize_rows
from .vllm_engine import VLLMEngine

log = logging.getLogger(__name__)

MODES = ("batchllm", "in_order", "sorted")


@dataclass
class PreparedBatch:
    ids: list  # row ids in input order
    id_type: pa.DataType
    batch: TokenizedBatch  # rows with an error have no tokens
    max_tokens: np.ndarray
    errors: dict[int, str]
    plan: PrefixPlan
    tokenize_s: float
    plan_s: float

    @property
    def num_rows(self) -> int:
        return len(self.ids)


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
    ids = table.column(columns.id).to_pylist()
    n = len(ids)
    prompts = _column(table, columns.prompt) or [None] * n
    batch = tokenize_rows(tokenizer, prompts, _column(table, columns.messages))
    errors = dict(batch.errors)

    row_max = _column(table, columns.max_tokens)
    max_tokens = np.full(n, sampling.max_tokens, dtype=np.int64)
    if row_max is not None:
        for i, value in enumerate(row_max):
            if value is None:
                continue
            if value < 1:
                errors.setdefault(i, f"invalid max_tokens {value}: must be at least 1")
            else:
                max_tokens[i] = value
    lengths = batch.lengths
    limit = engine_settings.context_len
    for i in np.flatnonzero(lengths + max_tokens > limit):
        errors.setdefault(
            int(i),
            f"prompt of {lengths[i]} tokens + max_tokens {max_tokens[i]} exceeds the model's context of {limit} "
            f"tokens (max_model_len={engine_settings.max_model_len}, KV cache {engine_settings.kv_cache_blocks} blocks)",
        )
    batch = _without_rows(batch, set(errors) - set(batch.errors))
    decode = np.where(batch.lengths > 0, max_tokens, 0)
    started = time.perf_counter()
    plan = build_plan(batch.tokens, batch.offsets, decode, engine_settings.block_size, scheduler.min_group_rows)
    plan_s = time.perf_counter() - started
    log.info(
        "planned %d rows: %d groups, %d prompt tokens, ideal saving %.1f%% (tokenize %.2fs, plan %.2fs)",
        n, plan.num_groups, plan.prompt_tokens, 100 * plan.ideal_saving, batch.seconds, plan_s,
    )
    return PreparedBatch(
        ids=ids,
        id_type=table.schema.field(columns.id).type,
        batch=batch,
        max_tokens=max_tokens,
        errors=errors,
        plan=plan,
        tokenize_s=batch.seconds,
        plan_s=plan_s,
    )


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
        mode: str = "batchllm",
        progress_sink: Callable[[str], None] | None = None,
        row_fingerprints: list[str] | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.prepared, self.engine, self.sampling, self.scheduler = prepared, engine, sampling, scheduler
        self.rows = [int(r) for r in prepared.plan.order] if rows is None else list(rows)
        self.mode = mode
        self.progress_sink = progress_sink
        self.fingerprints = row_fingerprints or [None] * prepared.num_rows
        self.stats = RunStats()

    def __iter__(self) -> Iterator[RowResult]:
        prepared, stats = self.prepared, self.stats
        ok_rows = [r for r in self.rows if r not in prepared.errors]
        plan = prepared.plan
        stats.ideal_cached_tokens = ideal_cached_tokens(plan, ok_rows)
        started = time.perf_counter()
        for row in self.rows:
            if row in prepared.errors:
                stats.rows += 1
                stats.error_rows += 1
                yield RowResult(id=prepared.ids[row], status="error", error=prepared.errors[row],
                                group=int(plan.group_of_row[row]), row_fingerprint=self.fingerprints[row])
        if not ok_rows:
            return
        progress = Progress(len(self.rows), stats, self.scheduler.log_every_s, self.progress_sink)
        if self.mode == "batchllm":
            position = np.empty(plan.num_rows, dtype=np.int64)
            position[plan.order] = np.arange(plan.num_rows)
            in_plan_order = sorted(ok_rows, key=position.__getitem__)  # whatever order the caller gave
            stream = run_grouped(
                self.engine, prepared.batch, plan, in_plan_order, prepared.max_tokens, self.sampling, self.scheduler,
                stats, progress,
            )
        else:
            order = ok_rows if self.mode == "in_order" else sorted_rows(prepared, ok_rows)
            stream = run_in_order(self.engine, prepared.batch, order, prepared.max_tokens, self.sampling, stats, progress)
        for row, finished in stream:
            stats.wall_s = time.perf_counter() - started
            yield RowResult(
                id=prepared.ids[row],
                status="ok",
                text=finished.text,
                prompt_tokens=finished.prompt_tokens,
                cached_tokens=finished.cached_tokens,
                output_tokens=len(finished.token_ids),
                finish_reason=finished.finish_reason,
                group=int(plan.group_of_row[row]),
                row_fingerprint=self.fingerprints[row],
            )
        stats.wall_s = time.perf_counter() - started
        progress.maybe_log(force=True)


def ideal_cached_tokens(plan: PrefixPlan, rows: list[int]) -> int:
    """Prompt tokens these rows, run alone on one engine, need not compute with a perfect cache."""
    part = np.ones(plan.num_rows, dtype=np.int64)
    part[rows] = 0
    unique = unique_tokens_per_row(plan, plan.order, part=part)
    return int(plan.lengths[rows].sum() - unique[rows].sum()) if rows else 0


def open_engine(
    engine_settings: EngineSettings, prepared: PreparedBatch | None = None, enable_prefix_caching: bool = True
) -> VLLMEngine:
    """Start vLLM with ``max_num_seqs`` sized so that the KV budget, not a fixed count, limits admission."""
    max_num_seqs = engine_settings.max_num_seqs
    if max_num_seqs is None and prepared is not None and engine_settings.kv_cache_blocks:
        ok = prepared.batch.lengths > 0
        if ok.any():
            per_row = np.median(
                np.ceil((prepared.batch.lengths[ok] + prepared.max_tokens[ok]) / engine_settings.block_size)
                - prepared.plan.group_prefix_tokens[prepared.plan.group_of_row[ok]] // engine_settings.block_size
            )
            max_num_seqs = int(np.clip(engine_settings.kv_cache_blocks / max(per_row, 1), 16, 512))
    return VLLMEngine(engine_settings, enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs)


def run_resumable(
    prepared: PreparedBatch,
    engine_settings: EngineSettings,
    sampling: SamplingSettings,
    checkpoint_dir: str | Path,
    scheduler: SchedulerSettings = SchedulerSettings(),
    rows: list[int] | None = None,
    reuse_from: list[Path] = (),
    progress_sink: Callable[[str], None] | None = None,
    checkpoint_every_rows: int = 256,
    start_engine: Callable[..., VLLMEngine] = None,
) -> tuple[list[RowResult], RunStats]:
    """Run the rows, writing results to a checkpoint as they finish; rows a previous (killed)
    run already wrote with the same fingerprint are reused, not recomputed. vLLM starts only
    if some row still needs it. ``stats.extra['reused_rows']`` counts the reused rows."""
    from .checkpoint import Checkpoint, row_fingerprints, settings_fingerprint

    start_engine = start_engine or open_engine
    rows = [int(r) for r in prepared.plan.order] if rows is None else list(rows)
    fingerprints = row_fingerprints(prepared, settings_fingerprint(engine_settings, sampling))
    checkpoint = Checkpoint(checkpoint_dir, prepared.id_type, every_rows=checkpoint_every_rows)
    reused = checkpoint.load({prepared.ids[r]: fingerprints[r] for r in rows}, also=list(reuse_from))
    todo = [r for r in rows if prepared.ids[r] not in reused]
    (progress_sink or log.info)(f"reusing {len(reused)} of {len(rows)} rows from {checkpoint_dir}; {len(todo)} to run")
    results = list(reused.values())
    needs_engine = any(r not in prepared.errors for r in todo)
    engine = start_engine(engine_settings, prepared) if needs_engine else None
    try:
        run = BatchRun(prepared, engine, sampling, scheduler, rows=todo, progress_sink=progress_sink,
                       row_fingerprints=fingerprints)
        for result in run:
            checkpoint.add(result)
            results.append(result)
        checkpoint.flush()
    finally:
        if engine is not None:
            engine.close()
    run.stats.extra["reused_rows"] = len(reused)
    return results, run.stats
