"""A run that survives being killed: results go to a checkpoint as rows finish, and a rerun
reuses every row an earlier run (or the output table) already answered with the same fingerprint."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from ..machine import current_platform, vllm_version
from ..plan.prepared import PreparedBatch
from ..plan.row_checks import choice_rows
from ..run.batch_run import BatchRun
from ..run.checkpoint import Checkpoint, row_fingerprints, settings_fingerprints
from ..run.progress import Display
from ..run.results import EngineInfo, RowResult, RunStats
from ..settings import EngineSettings, SamplingSettings, SchedulerSettings
from ..vllm.vllm_engine import VLLMEngine, open_engine

log = logging.getLogger(__name__)


@dataclass
class RunOutcome:
    """What a resumable run returns: one result per row, the run's stats, the engine it used."""

    results: list[RowResult]
    stats: RunStats
    engine: EngineInfo | None  # None when every row was reused or invalid: vLLM never started
    not_reused: dict[str, int] = field(default_factory=dict)  # rows run again, by why they were not reused


def answer_fingerprints(prepared: PreparedBatch, engine_settings: EngineSettings, sampling: SamplingSettings):
    """The settings fingerprint of this engine (its build, the settings as this platform resolves
    them) and each row's, today's and the legacy one (``settings_fingerprints``)."""
    settings_fp, legacy_fp = settings_fingerprints(engine_settings.for_platform(current_platform()), sampling,
                                                   vllm_version())
    return settings_fp, row_fingerprints(prepared, settings_fp), legacy_fp, row_fingerprints(prepared, legacy_fp)


def scores_choices(prepared: PreparedBatch, sampling: SamplingSettings, rows: list[int]) -> bool:
    """Whether any of ``rows`` is a choice row answered by scoring (``score_choices``)."""
    if not sampling.score_choices:
        return False
    return bool(choice_rows(prepared.num_rows, prepared.response_formats, sampling.response_format)[rows].any())


def _started(engine, scores_choices_: bool, sink) -> None:
    """An engine just opened: its choice reads warmed where rows are scored (a start's cost), and
    what vLLM's start spent its time on said once, by the first shard that ran on it."""
    if scores_choices_:
        engine.warm_choice_reads()
    said = engine.startup.first_line() if getattr(engine, "startup", None) is not None else None
    if said:
        sink(said)


def run_resumable(
    prepared: PreparedBatch,
    engine_settings: EngineSettings,
    sampling: SamplingSettings,
    checkpoint_dir: str | Path,
    scheduler_settings: SchedulerSettings = SchedulerSettings(),
    rows: list[int] | None = None,
    reuse_from: list[Path | pa.Table] = (),
    progress_sink: Callable[[str], None] | None = None,
    checkpoint_every_rows: int = 256,
    checkpoint_every_s: float = 10.0,
    engine_opener: Callable[[EngineSettings], ContextManager[VLLMEngine]] = open_engine,
    started_at: float | None = None,
    display: Display | None = None,
) -> RunOutcome:
    """Run the rows, writing results to a checkpoint as they finish; rows a previous (killed) run
    already wrote with the same fingerprint are reused, not recomputed. vLLM starts only if some row
    still needs it: ``engine_opener(settings)`` gives a context manager (a ``VLLMEngine``, or a
    resource's ``engine()``) whose owner closes the engine when the run leaves it."""
    started_at = time.perf_counter() if started_at is None else started_at
    rows = [int(r) for r in prepared.order] if rows is None else list(rows)
    settings_fp, fingerprints, legacy_settings_fp, legacy = answer_fingerprints(prepared, engine_settings, sampling)
    checkpoint = Checkpoint(checkpoint_dir, prepared.id_type, every_rows=checkpoint_every_rows,
                            every_s=checkpoint_every_s)
    reused = checkpoint.load({prepared.ids[r]: fingerprints[r] for r in rows}, also=list(reuse_from),
                             settings_fp=settings_fp, legacy={prepared.ids[r]: legacy[r] for r in rows},
                             legacy_settings_fp=legacy_settings_fp)
    todo = [r for r in rows if prepared.ids[r] not in reused]
    why = "; ".join(f"{n} {reason}" for reason, n in checkpoint.not_reused.most_common())
    (progress_sink or log.info)(
        f"reusing {len(reused)} of {len(rows)} rows ({checkpoint.describe_reuse()}); {len(todo)} to run"
        + (f" ({why})" if why else ""))
    results = list(reused.values())
    needs_engine = any(r not in prepared.errors for r in todo)
    with contextlib.ExitStack() as opened:
        starting = time.perf_counter()
        engine = opened.enter_context(engine_opener(engine_settings)) if needs_engine else None
        if engine is not None:
            _started(engine, scores_choices(prepared, sampling, todo), progress_sink or log.info)
        engine_start_s = time.perf_counter() - starting
        info = engine.info if engine is not None else None
        checkpoint.restart_timer()  # a kill early in the run keeps what finished after start-up
        try:
            run = BatchRun(prepared, engine, sampling, scheduler_settings, rows=todo, progress_sink=progress_sink,
                           row_fingerprints=fingerprints, started_at=started_at, display=display,
                           settings_fingerprint=settings_fp, after_step=checkpoint.flush_if_due)
            for result in run:
                checkpoint.add(result)
                results.append(result)
        finally:
            # Whatever ended the run (done, a vLLM error, a stall, a terminate): what finished is kept.
            checkpoint.flush()
            stopping = time.perf_counter()
            opened.close()  # leaves the engine's context: its owner shuts it down
            engine_stop_s = time.perf_counter() - stopping
    stats = run.finished_stats(reused_rows=len(reused), engine_start_s=engine_start_s if engine is not None else 0.0,
                               engine_stop_s=engine_stop_s)
    return RunOutcome(results, stats, info, dict(checkpoint.not_reused))
