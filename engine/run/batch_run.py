"""Running a prepared batch on an engine: the rows go in as the scheduler admits them, results
come out keyed by row id as rows finish.

    run = BatchRun(prepared, engine, sampling)          # all rows, BatchLLM scheduling (Planned)
    for result in run: ...                               # RowResult, keyed by id, as rows finish
    run.finished_stats()                                 # RunStats, built once the run has ended
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..model_support import scoring_refused
from ..plan.common_prefix import reusable_tokens
from ..plan.duplicates import answer_sources, answers_are_shared
from ..plan.prepared import PreparedBatch
from ..response_format import cut_off_reason
from ..settings import SamplingSettings, SchedulerSettings
from .admission import EngineLimits
from .drive import Rejected, StepTotals, drive, row_sampling
from .progress import Display, Progress
from .requests import Engine
from .results import RowResult, RunStats
from .scheduler import Planned, Scheduling
from .step_profile import StepProfile


@dataclass
class RunCounts:
    """What a run has done so far, counted as rows finish (its ``RunStats`` is built from it once,
    when the run has ended)."""

    rows: int = 0
    ok_rows: int = 0
    error_rows: int = 0
    duplicate_rows: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


class BatchRun:
    """Iterate to run the rows on the engine; results come out as rows finish."""

    def __init__(
        self,
        prepared: PreparedBatch,
        engine: Engine,
        sampling: SamplingSettings,
        scheduler_settings: SchedulerSettings = SchedulerSettings(),
        rows: list[int] | None = None,
        scheduling: Scheduling = Planned(),
        progress_sink: Callable[[str], None] | None = None,
        row_fingerprints: list[str] | None = None,
        started_at: float | None = None,
        display: Display | None = None,
        settings_fingerprint: str | None = None,
        step_profile: StepProfile | None = None,
        after_step: Callable[[], None] | None = None,
    ):
        self.prepared, self.engine, self.sampling = prepared, engine, sampling
        parser = getattr(engine, "reasoning_parser", None)
        if parser and sampling.scores_choice:
            raise ValueError(scoring_refused("the engine's model", parser))
        self.scheduler_settings = scheduler_settings
        self.rows = [int(r) for r in prepared.order] if rows is None else list(rows)
        self.scheduling = scheduling  # BatchLLM's, or a baseline's (the bench's): vLLM alone in an order
        self.progress_sink = progress_sink
        self.fingerprints = row_fingerprints or [None] * prepared.num_rows
        self.settings_fingerprint = settings_fingerprint
        self.started_at = started_at
        self.display = display  # a live view (a progress bar) besides the progress lines
        self.step_profile = step_profile  # each engine step recorded (the bench's per-step timing)
        self.after_step = after_step  # called after every engine step (a checkpoint's timed write)
        self.counts = RunCounts()
        self._ended: dict = {}  # the run's times, the engine's gauges, what the scheduler did: set once, at its end

    def _result(self, row: int, **fields) -> RowResult:
        return RowResult(id=self.prepared.ids[row], group=int(self.prepared.group_of_row[row]),
                         row_fingerprint=self.fingerprints[row], settings_fingerprint=self.settings_fingerprint,
                         computed_at=dt.datetime.now(dt.timezone.utc), **fields)

    def _answer(self, row: int, item, cut: str | None, cached_tokens: int) -> RowResult:
        """Row ``row`` answered by the finished request ``item`` (its own, or an identical row's)."""
        counts = self.counts
        counts.rows += 1
        counts.prompt_tokens += item.prompt_tokens
        counts.cached_tokens += cached_tokens
        counts.output_tokens += len(item.token_ids)
        if cut:
            counts.error_rows += 1
        else:
            counts.ok_rows += 1
        scored = item.scored
        return self._result(row, status="error" if cut else "ok", text=item.text, error=cut,
                            prompt_tokens=item.prompt_tokens, cached_tokens=cached_tokens,
                            output_tokens=len(item.token_ids), finish_reason=item.finish_reason,
                            choice_probability=None if scored is None else scored.probability,
                            choice_probabilities=None if scored is None else scored.probabilities_json(),
                            reasoning=item.reasoning if self.sampling.keep_reasoning else None)

    def _error(self, row: int, reason: str) -> RowResult:
        self.counts.rows += 1
        self.counts.error_rows += 1
        return self._result(row, status="error", error=reason)

    def _refused_by_engine(self, rows: list[int]) -> dict[int, str]:
        """The rows whose response format the engine refuses, with its reason: each distinct
        format asked once, before any row runs (one such row must not fail the shard)."""
        formats, job_format = self.prepared.response_formats, self.sampling.response_format
        asked: dict[int, str | None] = {}  # id of a format -> the engine's refusal
        refused = {}
        for row in rows:
            own = formats.get(row)
            if own is None and job_format is None:
                continue
            key = id(own if own is not None else job_format)
            if key not in asked:
                asked[key] = self.engine.refusal(row_sampling(self.sampling, own))
            if asked[key]:
                refused[row] = asked[key]
        return refused

    def _record_end(self, started: float, totals: StepTotals, scheduled, reusable: int) -> None:
        """The run's times, the engine's gauges over its steps, and what the scheduler did."""
        self._ended = dict(
            reusable_tokens=reusable,
            wall_s=time.perf_counter() - started,
            startup_s=started - (self.started_at or started),  # before the run: none of wall_s
            run_setup_s=(totals.first_submit_at or started) - started,  # of wall_s
            preemptions=totals.preemptions, engine_steps=totals.steps, idle_steps=totals.idle_steps,
            max_queued_steps=totals.max_queued_steps,
            recomputed_tokens=totals.recomputed_tokens,
            mean_kv_usage=totals.mean_kv_usage, rows_per_step=totals.rows_per_step,
            prefix_requests=scheduled.prefix_requests,
            admission=scheduled.admission, admission_reason=scheduled.admission_reason,
            prefix_prompt_tokens=scheduled.prefix_prompt_tokens, prefix_cached_tokens=scheduled.prefix_cached_tokens)

    def finished_stats(self, reused_rows: int = 0, engine_start_s: float = 0.0, engine_stop_s: float = 0.0) -> RunStats:
        """The run's stats, once it has ended; what only its caller measured (rows reused from
        earlier runs, vLLM's start and stop around it) is given here."""
        return RunStats(**vars(self.counts), **self._ended, reused_rows=reused_rows, engine_start_s=engine_start_s,
                        engine_stop_s=engine_stop_s)

    def __iter__(self) -> Iterator[RowResult]:
        prepared, counts = self.prepared, self.counts
        started = time.perf_counter()
        refused = self._refused_by_engine([r for r in self.rows if r not in prepared.errors])
        for row in self.rows:
            if row in prepared.errors or row in refused:
                yield self._error(row, prepared.errors.get(row) or refused[row])
        ok_rows = [r for r in self.rows if r not in prepared.errors and r not in refused]
        if not ok_rows:
            return
        position = np.empty(prepared.num_rows, dtype=np.int64)
        position[prepared.order] = np.arange(prepared.order.size)
        in_plan_order = sorted(ok_rows, key=position.__getitem__)  # whatever order the caller gave
        # Identical rows run once; the others take its answer (a baseline runs every row, as vLLM would).
        copies = (answer_sources(prepared.duplicate_set, in_plan_order)
                  if self.scheduling.shares_answers and answers_are_shared(self.sampling) else {})
        copied = {row for rows in copies.values() for row in rows}
        scheduler = self.scheduling.scheduler(prepared, [r for r in in_plan_order if r not in copied],
                                              self.scheduler_settings, EngineLimits.of(self.engine))
        # The minimum, whatever order the rows run in: the plan's order shares every prefix it can; a
        # row that takes an identical row's answer reuses its whole prompt.
        reusable = (reusable_tokens(prepared.batch, [r for r in in_plan_order if r not in copied], prepared.block_size)
                    + sum(prepared.batch.tokens_of(r).size for r in copied))
        totals = StepTotals()
        progress = Progress(len(self.rows), self.scheduler_settings.log_every_s, self.progress_sink, self.display,
                            reusable=reusable)


        def saved() -> int:  # prompt tokens not computed: the rows' cache hits less what prefix requests computed
            return counts.cached_tokens - (scheduler.stats.prefix_prompt_tokens - scheduler.stats.prefix_cached_tokens)

        def on_step(report) -> None:
            if self.step_profile is not None:
                self.step_profile.record(report)
            if self.after_step is not None:
                self.after_step()
            progress.update(counts.rows, counts.prompt_tokens + counts.output_tokens, saved(),
                            report.running, report.kv_usage, totals.preemptions,
                            reserved_blocks=lambda: scheduler.blocks_in_flight)

        for item in drive(scheduler, self.engine, self.sampling, totals, on_step, prepared.response_formats):
            if isinstance(item, Rejected):
                for row in [item.row, *copies.get(item.row, [])]:
                    yield self._error(row, item.reason)
                continue
            row = item.submission.row
            # A constrained answer that ended at max_tokens or a stop string, not proved complete,
            # is not an answer: stored as an error row (its text kept to look at), never as ok.
            cut = item.failure or cut_off_reason(prepared.response_formats.get(row, self.sampling.response_format),
                                                 item.text, item.finish_reason, int(prepared.max_tokens[row]),
                                                 item.stop_reason)
            yield self._answer(row, item, cut, item.cached_tokens)
            for copy in copies.get(row, []):  # its identical rows: the same answer, their own ids, nothing computed
                counts.duplicate_rows += 1
                yield self._answer(copy, item, cut, item.prompt_tokens)
        self._record_end(started, totals, scheduler.stats, reusable)
        progress.update(counts.rows, counts.prompt_tokens + counts.output_tokens, saved(), 0,
                        totals.mean_kv_usage, totals.preemptions, force=True)
