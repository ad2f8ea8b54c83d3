"""One shard answered end to end, the same way wherever it runs (a Dagster partition, ``batchllm
run``, Ray's replicas): reuse what is already answered, run the rest on an engine it is given,
check the plan on disk again at write time, write through an ``AnswerStore``, prune checkpoints.

The caller keeps what is its own: its locks, how a refusal is reported, metadata and checks. The
write holds the job's plan lock (shared) while it reads the plan on disk again and stores the
answers, so that no plan lands between the check and the write (``ShardJob.write``).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..plan.answer_keys import keys_of
from ..plan.plan_table import PlanFile, PlannedShard
from ..run.checkpoint import checkpoint_parts, current_settings_fingerprint
from ..run.console import ProgressBar
from ..run.results import RowResult
from ..settings import EngineSettings, SamplingSettings, SchedulerSettings
from .resume import RunOutcome, run_resumable


class AnswerStore(Protocol):
    """Where a job's answers are kept: the DuckDB output table (``batchllm_dagster``), a Parquet
    file (``batchllm run``)."""

    def stored(self, ids: pa.Array) -> list[Path | pa.Table]:
        """What it holds of these ids, for reuse by row fingerprint (a nightly rerun of unchanged rows)."""

    def write(self, shard: PlannedShard, results: list[RowResult], whole: bool, answer_keys: dict) -> ShardWrite:
        """Make ``results`` the shard's answers (``whole``: its only ones; else only these ids'
        rows are replaced), each with its id's answer key (``answer_keys``); a row stored as it is
        stays untouched."""

    def answered_ids(self, ids: pa.Array, keys: set[str]) -> set:
        """Of ``ids``, those it holds under one of the partition ``keys``."""


@dataclass(frozen=True)
class JobCheckpoints:
    """A job's shard checkpoints, one folder per partition key under ``root``: finished answers not
    yet stored, kept by row fingerprint for the whole job, not only for their key.

    A shard killed part-way leaves its finished answers in ``root/<key>/``. If a new plan then gives
    its rows other keys (one row inserted into a shard changes its key), the shards of the new keys
    reuse them from there (``others``). A folder is removed once no plan can use it (``prune``): its
    key is not in the plan on disk and each of its answers is of a deleted row or already stored
    under a key of that plan (from where a rerun reuses it)."""

    root: Path

    def of(self, key: str) -> Path:
        return self.root / key

    def others(self, key: str) -> list[Path]:
        """The part files of the job's other shards' checkpoints."""
        return sorted(part for folder in self.root.glob("*") if folder.name != key
                      for part in checkpoint_parts(folder))

    def prune(self, store: AnswerStore, plan: PlanFile) -> int:
        """Remove the folders no plan can use (see the class doc); returns how many."""
        removed, live_keys = 0, plan.live_keys()
        for folder in self.root.glob("*"):
            if folder.name in live_keys:
                continue
            ids = _ids_in(folder)
            if len(ids):
                try:
                    ids = ids.cast(plan.id_type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    continue  # ids of another type (the id column changed type): not judged, kept
                wanted = plan.ids_among(ids)
                if len(wanted) and len(store.answered_ids(wanted, live_keys)) < len(pc.unique(wanted)):
                    continue  # a row of the plan whose answer is only here
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
        return removed


def _ids_in(folder: Path) -> pa.Array:
    ids = []
    for part in checkpoint_parts(folder):
        try:
            ids.append(pq.read_table(part, columns=["id"]).column("id").combine_chunks())
        except Exception:  # unreadable: it gives nothing to reuse either
            continue
    return pa.concat_arrays(ids) if ids else pa.array([], pa.null())


@dataclass(frozen=True)
class ShardWrite:
    """What an ``AnswerStore`` did with a shard's answers."""

    table: pa.Table  # the shard's answers, as results
    rows_now: int  # the rows its key holds now
    written: int  # rows it wrote (new or changed: a row already stored as it is is not written again)


@dataclass(frozen=True)
class ShardWritten:
    """What a shard's write did."""

    table: pa.Table  # the shard's answers
    rows_now: int  # the rows its key holds now
    superseded: pa.Array  # its ids a newer plan wants from elsewhere: not written
    written: int  # rows the store wrote: those new or changed


@dataclass
class ShardJob:
    """Shard ``shard`` of a job: its rows as planned, the settings they run with and where answers
    are stored. ``job_checkpoints``: the job's shards' checkpoint folders, its own (``of`` its key)
    and the others, reused and pruned; ``checkpoint``: its folder where there are none (a job of
    one shard, ``batchllm run``); ``plan_path``: the plan on disk a write is checked against (None:
    planned in this process); ``plan_lock``: the job's plan lock, held shared from that check to the
    last write (a plan holds it exclusively from reading the snapshot to its last delete)."""

    shard: PlannedShard
    engine_settings: EngineSettings
    sampling: SamplingSettings
    scheduler: SchedulerSettings
    store: AnswerStore
    job_checkpoints: JobCheckpoints | None = None
    checkpoint: Path | None = None
    plan_path: Path | None = None
    plan_lock: Callable[[], ContextManager] | None = None

    def __post_init__(self):
        if (self.checkpoint is None) == (self.job_checkpoints is None):
            raise ValueError("a shard job needs either its job's checkpoints or a checkpoint folder of its own")
        if self.checkpoint is None:
            self.checkpoint = self.job_checkpoints.of(self.shard.key)

    def reuse_sources(self) -> list[Path | pa.Table]:
        """What the shard reuses by row fingerprint besides its own checkpoint: its rows already
        stored, and the answers other shards of this job finished and did not store (a shard killed
        before a new plan gave its rows other keys)."""
        prepared = self.shard.prepared
        stored = self.store.stored(pa.array(prepared.ids, prepared.id_type))
        return stored + (self.job_checkpoints.others(self.shard.key) if self.job_checkpoints else [])

    def run(self, display_label: str | None = None, **options) -> RunOutcome:
        """The shard on one engine in this process, resuming from its checkpoint (``options``:
        ``run_resumable``'s: the engine opener, progress, display). ``display_label``: a progress
        bar so named when stderr is a terminal (the demo)."""
        bar = ProgressBar.on_terminal(display_label) if display_label else None
        try:
            return run_resumable(self.shard.prepared, self.engine_settings, self.sampling, self.checkpoint,
                                 self.scheduler, reuse_from=self.reuse_sources(), **options,
                                 **({"display": bar} if bar else {}))
        finally:
            if bar:
                bar.close()

    def run_on_ray(self, **options):
        """The shard over Ray replicas, whole groups each, with the same reuse and checkpoint
        (``options``: ``run_on_ray``'s); its ``RayRunResult``."""
        from .distributed import run_on_ray

        return run_on_ray(self.shard.prepared, self.engine_settings, self.sampling, self.checkpoint,
                          reuse_from=self.reuse_sources(), scheduler_settings=self.scheduler, **options)

    def write(self, results: list[RowResult]) -> ShardWritten:
        """The shard's answers stored as the plan on disk still wants them, under the plan lock: no
        plan lands between the check and the write, else this shard could delete a newer shard's
        answers, bring back deleted ids or a removed key's file. A plan made while this shard ran
        may want some of its answers from elsewhere (rows moved, edited or deleted, another model):
        those are not written, the newer plan's shards answer them; the rest is written by id only,
        and the checkpoint kept for the newer plan's shards to reuse its still-valid answers (a row
        that only moved to another key). Then the checkpoints this write made useless are removed."""
        with self.plan_lock() if self.plan_lock else contextlib.nullcontext():
            return self._write(results)

    def _write(self, results: list[RowResult]) -> ShardWritten:
        plan = PlanFile.at_write(self.plan_path) if self.plan_path is not None else None
        stale = self._superseded(plan)
        for result in results:
            result.shard = self.shard.number
        if len(stale):
            wanted = set(stale.to_pylist())
            results = [r for r in results if r.id not in wanted]
        done = self.store.write(self.shard, results, whole=not len(stale), answer_keys=self.answer_keys())
        if not len(stale):
            shutil.rmtree(self.checkpoint, ignore_errors=True)  # the store now holds every row of the shard
        if self.job_checkpoints is not None and plan is not None:
            self.job_checkpoints.prune(self.store, plan)
        return ShardWritten(done.table, done.rows_now, stale, done.written)

    def answer_keys(self) -> dict:
        """Each row's answer key under this engine's settings fingerprint (``answer_keys``): what the
        next plan compares to know the row answered."""
        prepared = self.shard.prepared
        if self.plan_path is None:  # planned in this process (``batchllm run``): no next plan compares them
            return {}
        settings_fp = current_settings_fingerprint(self.engine_settings, self.sampling)
        return dict(zip(prepared.ids, keys_of(settings_fp, self.shard.identity, prepared.errors)))

    def _superseded(self, plan: PlanFile | None) -> pa.Array:
        """The shard's ids the plan on disk no longer wants from it: none when it was planned in this
        process (no plan file), all when its plan file was removed while it ran."""
        if self.plan_path is None:
            return pa.array([], self.shard.prepared.id_type)
        return (self.shard.identity.column("id") if plan is None else plan.superseded(self.shard)).combine_chunks()
