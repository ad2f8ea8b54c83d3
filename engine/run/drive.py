"""The loop that joins a scheduler to an engine: ask what to submit, step, report what finished."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..response_format import ResponseFormat
from ..settings import SamplingSettings
from .requests import Engine, Finished, RequestKind, StepReport, Submission
from .scheduler import Scheduler


@dataclass
class Rejected:
    """A row the scheduler found can never run on this engine."""

    row: int
    reason: str


@dataclass
class StepTotals:
    """The engine's own gauges summed over the steps of a run."""

    steps: int = 0
    idle_steps: int = 0  # steps in which the engine ran nothing (not in ``steps``): see ``StepReport.idle``
    kv_usage_sum: float = 0.0
    running_sum: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0  # computed again after a preemption (see EngineGauges)
    max_queued_steps: int = 0  # the most steps the engine ran ahead of a report read (``StepReport.queued_steps``)
    first_submit_at: float | None = None  # perf_counter() when the first request entered the engine

    def add(self, report: StepReport) -> None:
        self.max_queued_steps = max(self.max_queued_steps, report.queued_steps)
        if report.idle:
            self.idle_steps += 1
            return
        self.steps += 1
        self.kv_usage_sum += report.kv_usage
        self.running_sum += report.running
        self.preemptions += report.preempted
        self.recomputed_tokens += report.recomputed_tokens

    @property
    def mean_kv_usage(self) -> float:
        return self.kv_usage_sum / self.steps if self.steps else 0.0

    @property
    def rows_per_step(self) -> float:
        return self.running_sum / self.steps if self.steps else 0.0


def request_sampling(submission: Submission, sampling: SamplingSettings,
                     row_formats: dict[int, ResponseFormat]) -> SamplingSettings:
    """A prefix request only fills the cache (its one token is thrown away): no constraint to compile."""
    if submission.kind is RequestKind.PREFIX:
        return sampling.model_copy(update={"response_format": None}) if sampling.response_format else sampling
    return row_sampling(sampling, row_formats.get(submission.row))


def row_sampling(sampling: SamplingSettings, own_format: ResponseFormat | None) -> SamplingSettings:
    """A row's sampling: the job's, with the row's own constraint where it has one."""
    return sampling if own_format is None else sampling.model_copy(update={"response_format": own_format})


def drive(
    scheduler: Scheduler,
    engine: Engine,
    sampling: SamplingSettings,
    totals: StepTotals,
    on_step: Callable[[StepReport], None] | None = None,
    row_formats: dict[int, ResponseFormat] | None = None,
) -> Iterator[Finished | Rejected]:
    """Run until the scheduler has nothing left; yields finished rows and rejected rows.
    ``row_formats``: rows whose answers follow their own constraint instead of ``sampling``'s."""
    formats = row_formats or {}
    while True:
        decision = scheduler.schedule()
        for row, reason in decision.reject:
            yield Rejected(row, reason)
        for submission in decision.submit:
            engine.submit(submission, request_sampling(submission, sampling, formats))
        if decision.submit and totals.first_submit_at is None:
            totals.first_submit_at = time.perf_counter()
        if not engine.has_unfinished():
            if not scheduler.done:  # schedule() always admits into an idle engine
                raise RuntimeError("scheduler stalled: nothing in the engine and rows left to run")
            return
        started = time.perf_counter()
        report = engine.step()
        report.seconds = time.perf_counter() - started
        totals.add(report)
        scheduler.after_step(report.started, report.queued_steps)
        for finished in report.finished:
            scheduler.finish(finished)
            if finished.submission.kind is RequestKind.ROW:
                yield finished
        if on_step:
            on_step(report)
