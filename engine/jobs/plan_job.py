"""A job's plan step, the same way wherever it runs (the ``prefix_groups`` asset; ``ShardJob``'s
counterpart): the prompt snapshot's rows through the token cache, the plan over the whole batch made
on disk (``engine.plan.plan_database``), its shards and their keys, and the plan file, with one
summary that the asset's metadata, ``batchllm plan`` and the bench all print (``plan_summary``).

The caller keeps what is its own: its lock, the guards that refuse a night, how many shards and
what they are called, partitions, removals and pruning, and how a plan is reported.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pyarrow as pa

from ..atomic import Staged
from ..damaged import read_by_row_group, readable_or_set_aside
from ..plan.answer_lengths import AnswerLengths
from ..plan.duplicates import count_duplicates
from ..plan.plan_database import Chained, Checked, PlanDatabase, Sharded
from ..plan.plan_stamp import job_stamp, stale_reasons
from ..plan.plan_table import (
    PlanRows,
    StalePlan,
    format_texts,
    plan_content_keys,
    plan_file_metadata,
    previous_plan,
    read_previous_plan,
    shard_table,
    write_plan,
)
from ..plan.prepared import PlannedBatch, check_rows
from ..plan.sorted_shards import ShardTotals
from ..plan.token_cache import CachedRows, TokenCache
from ..plan.tokenize_workers import TokenizeWorkers
from ..plan.tokenizing import LazyTokenizer, tokenizer_fingerprint
from ..settings import EngineSettings, SamplingSettings, SchedulerSettings
from ..table.dataset import Columns, DatasetError
from ..table.prompt_snapshot import columns_without_text, read_snapshot

log = logging.getLogger(__name__)


def plan_summary(planned: PlannedBatch) -> dict:
    """What a plan is, in numbers: the one summary the asset's metadata, ``batchllm plan`` and the
    bench print."""
    plan = planned.plan
    return summary_of(plan.num_rows, len(planned.errors), count_duplicates(planned.duplicate_set), plan.num_groups,
                      int((plan.group_prefix_tokens > 0).sum()), plan.prompt_tokens, plan.unique_tokens,
                      planned.tokenize_s, planned.plan_s)


def summary_of(rows: int, error_rows: int, duplicate_rows: int, groups: int, shared_groups: int, prompt_tokens: int,
               unique_tokens: int, tokenize_s: float, plan_s: float) -> dict:
    """``plan_summary`` from its counts (a batch's plan read back, or a job's in its database)."""
    shared = prompt_tokens - unique_tokens  # prompt tokens the prefix tree shares
    return {
        "rows": rows,
        "error_rows": error_rows,
        "duplicate_rows": duplicate_rows,  # identical to another row: computed once
        "groups": groups,
        "shared_groups": shared_groups,
        "prompt_tokens": prompt_tokens,
        "unique_tokens": unique_tokens,
        "shared_prompt_tokens": shared,
        "shared_fraction": round(shared / prompt_tokens if prompt_tokens else 0.0, 4),
        "tokenize_s": round(tokenize_s, 3),
        "plan_s": round(plan_s, 4),
    }


class ShardNaming(Protocol):
    """How a job's shards are counted, numbered and named (``batchllm_dagster.partitions.JobShards``)."""

    def count(self, rows: int) -> int:
        """The shards of a plan whose ``rows`` are all cut afresh (a first night)."""

    def gathered(self, rows_to_run: int, total_rows: int, kept: set[int]) -> list[int]:
        """The numbers of the shards a night's ``rows_to_run`` go to, apart from the ``kept`` ones."""

    def key(self, shard: int, ids: list) -> str:
        """A new shard's partition key."""

    def keeps(self, shard: int, key: str) -> bool:
        """Whether a previous shard's partition can stay as it is (its key still names its hardware)."""

    def hardware(self, shard: int) -> str:
        """The hardware partition a shard runs on."""


@dataclass(frozen=True)
class StoredAnswers:
    """What the job's answer store holds, for the plan to know which rows are answered: ``export``
    writes its ``id, answer_key, status, partition_key`` to a Parquet file (False: nothing stored
    yet); ``settings_fps``: the settings fingerprints tonight's answers would be made with (one per
    platform the job's hardware runs on)."""

    export: Callable[[Path], bool]
    settings_fps: list[str]


@dataclass(frozen=True)
class JobPlan:
    """A plan made, not yet published: its database (``Sharded``, open while ``PlanJob.plan``'s
    block runs: every row's id, key and place in the plan), the columns of the plan file it does
    not hold, its shards' totals and keys, and what it was made from (``stamp``)."""

    database: Sharded
    rows: PlanRows
    counts: dict  # the summary (``summary``), less the shards'
    stamp: dict[str, str]  # the model's content, the snapshot's digest, the settings (``plan_stamp``)
    keys: list[str]  # each shard's partition key
    rows_by_shard: list[int]  # each shard's rows
    kept: dict[int, str] = field(default_factory=dict)  # shards whose rows are all answered: never run
    settled_with: list[str] = field(default_factory=list)  # the settings fingerprints they were judged by

    @property
    def used_keys(self) -> list[str]:
        """The keys of the shards that have rows (fewer groups than shards leave some empty)."""
        return [key for key, rows in zip(self.keys, self.rows_by_shard) if rows]

    @property
    def keys_to_run(self) -> list[str]:
        """The used keys whose rows need a run: every one but the kept shards'."""
        kept = set(self.kept.values())
        return [key for key in self.used_keys if key not in kept]

    @property
    def shards(self) -> ShardTotals:
        return self.database.totals

    def summary(self) -> dict:
        return {**self.counts, "shards": len(self.used_keys), "shards_to_run": len(self.keys_to_run),
                "split_groups": self.shards.split_groups}

    def groups_table(self, naming: ShardNaming) -> pa.Table:
        """One row per group: its shard, prefix length, rows and estimated tokens."""
        groups = self.database.groups()
        shard = groups.column("shard").to_pylist()
        return pa.table({
            "group": groups.column("group"),
            "shard": groups.column("shard"),
            "partition_key": [self.keys[s] for s in shard],
            "hardware": [naming.hardware(int(s)) for s in shard],
            **{name: groups.column(name) for name in ("rows", "prefix_tokens", "prompt_tokens",
                                                      "estimated_prefill_tokens", "estimated_decode_tokens")},
            "first_id": groups.column("first_id").cast(pa.string()),
        })

    def plan_tables(self, metadata: dict[str, str]):
        """The plan file's tables, a shard (or part of one) at a time, in shard order (``write_plan``)."""
        for shard, rows in self.database.shard_rows("row"):
            if rows.num_rows or shard == 0:  # an empty plan is one empty table: the file's schema
                column = {name: rows.column(name).to_numpy() for name in
                          ("row", "position", "grp", "prefix_tokens", "max_tokens", "duplicate_set")}
                yield shard_table(self.rows, column["row"], rows.column("id"), rows.column("key"), column["position"],
                                  column["grp"], column["prefix_tokens"], column["max_tokens"],
                                  column["duplicate_set"], shard, self.keys[shard] if rows.num_rows else "", metadata)


@dataclass
class PlanJob:
    """The plan step of one job's files (``snapshot``, ``plan_path``, the token cache under
    ``token_cache_dir``) on its settings (``settings``: the model resolved, counted in the block
    size and context length its shards run at). ``warn``: told of a damaged file set aside. What
    it is made from, its stamp (``stamp``), is read when a plan begins and again before it is
    written: a prompts snapshot landing meanwhile must not publish a plan of old rows under the new
    snapshot's stamp."""

    snapshot: Path
    plan_path: Path
    token_cache_dir: Path
    settings: EngineSettings
    sampling: SamplingSettings
    scheduler: SchedulerSettings
    columns: Columns
    warn: Callable[[str], None]
    tokenize_workers: TokenizeWorkers = TokenizeWorkers()  # where a night's new rows are tokenized
    cache: TokenCache = field(init=False)

    def __post_init__(self) -> None:
        self.cache = TokenCache(self.token_cache_dir, tokenizer_fingerprint(self.settings.model_path),
                                on_damaged=self.warn)

    def check_files(self) -> None:
        """Before anything is read: a damaged previous plan is set aside (the next is cut without
        it), a damaged snapshot set aside and refused (the prompts step takes it again)."""
        readable_or_set_aside(self.plan_path, read_previous_plan, "the previous plan",
                              "this plan is cut without it (answers are reused by id and prompt)", self.warn)
        if not readable_or_set_aside(self.snapshot, self._read_snapshot, "the prompt snapshot",
                                     "materialize prompts to take it again", self.warn):
            raise DatasetError("the prompt snapshot was damaged (set aside): materialize prompts, then prefix_groups "
                               "(the plan job does both)")

    def stamp(self) -> dict[str, str]:
        """What a plan of the job is made from, as it is now (``plan_stamp.job_stamp``)."""
        return job_stamp(self.snapshot, self.settings, self.sampling, self.scheduler, self.columns)

    def read_ids(self) -> pa.ChunkedArray:
        """The snapshot's ids (what the guards before a plan compare with the answers)."""
        return read_snapshot(self.snapshot, columns=[self.columns.id]).column(self.columns.id)

    def _check_columns(self) -> pa.Table:
        """The snapshot's columns the row checks read, those it has of ``max_tokens`` and
        ``response_format`` (none: no column at all, so nothing of every row)."""
        names = columns_without_text(self.snapshot, self.columns.prompt, self.columns.messages) or []
        return read_snapshot(self.snapshot, columns=[c for c in (self.columns.max_tokens,
                                                                 self.columns.response_format) if c in names])

    def _read_snapshot(self, path: Path) -> None:
        """Read what a plan reads of the snapshot (all but the text), a row group at a time."""
        read_by_row_group(path, columns_without_text(path, self.columns.prompt, self.columns.messages))

    @contextlib.contextmanager
    def plan(self, naming: ShardNaming, progress: Callable[[str], None], answers: StoredAnswers | None = None,
             stamp: dict[str, str] | None = None) -> Iterator[JobPlan]:
        """The snapshot's rows: tokens (only new or changed rows tokenized), the plan, its shards
        (``naming``: how many, their numbers and keys) and each shard's key: ``with job.plan(...) as
        made:``, its database in a staging folder beside the plan, removed when the block ends (a
        killed plan's by the next, at once: the caller holds the job's plan lock). With ``answers``,
        the rows already answered as planned tonight keep their shards, which are not run again, and
        only the rest are cut into new shards (``Checked.settle``); without, every shard is cut,
        kept from the plan on disk where it can be. ``stamp``: what the plan is made from, read by
        the caller before it read any of the rows (its guards' ids: ``read_ids``); default, now,
        before the rows are read. ``write`` compares it with the stamp then."""
        stamp = stamp or self.stamp()
        settings = self.settings.with_block_size()  # a plan counts in whole KV blocks
        # The caller holds the job's plan lock (the asset does): a scratch database beside it is a
        # killed plan's, however young, and goes now (~0.5 GB per million rows).
        with Staged(self.plan_path.with_name("plan_work"), sole_writer=True) as work:
            database = PlanDatabase(work.path, settings.block_size)
            try:
                yield self._plan(database, settings, stamp, naming, progress, answers)
            finally:
                database.close()
                work.discard()

    def _plan(self, database: PlanDatabase, settings: EngineSettings, stamp: dict[str, str], naming: ShardNaming,
              progress: Callable[[str], None], answers: StoredAnswers | None) -> JobPlan:
        rows, chained, chains_s = self._chains(database, settings.block_size, progress)
        loaded = chained.load_ids(self.snapshot, self.columns.id)  # ids and keys in the database, not here
        del chained
        found = check_rows(self._check_columns(), loaded.lengths, rows.errors, settings, self.sampling, self.columns,
                           find_duplicates=loaded.duplicate_sets)
        started = time.perf_counter()
        checked = loaded.checked(found)  # budgets and duplicate sets now in the database: let go of the arrays
        plan_rows = PlanRows(found.errors, format_texts(found.formats))
        del loaded, found
        previous = previous_plan(self.plan_path, checked.id_type)
        settled = self._settle(checked, previous, answers, plan_rows, naming) if previous is not None else 0
        planned = checked.plan(self.scheduler.min_group_rows)
        plan_s = chains_s + time.perf_counter() - started
        kept, count_rows = planned.kept_keys(), checked.rows
        sharded = planned.shard(naming.count(count_rows), previous,
                                gathered=lambda to_run: naming.gathered(to_run, count_rows, set(kept)))
        kept = sharded.kept_keys()  # none where nothing settled: then every shard is cut as before
        partition_keys, rows_by_shard = [], []
        for shard, in_order in sharded.shard_rows("position"):  # a shard's ids at a time
            key = kept.get(shard) or naming.key(shard, in_order.column("id").to_pylist())
            partition_keys.append(key)
            rows_by_shard.append(in_order.num_rows)
        numbers = sharded.numbers()
        counts = {**summary_of(count_rows, len(plan_rows.errors), numbers["duplicate_rows"],
                               numbers["groups"], numbers["shared_groups"], numbers["prompt_tokens"],
                               numbers["unique_tokens"], rows.seconds, plan_s),
                  "token_cache_rows": rows.cached_rows, "tokenized_rows": rows.tokenized_rows,
                  "settled_rows": settled, "rows_to_run": count_rows - settled}
        log.info("planned %d rows: %d groups, %d prompt tokens, shared %.1f%%, %d identical to another row "
                 "(tokenize %.2fs, plan %.2fs)", counts["rows"], counts["groups"], counts["prompt_tokens"],
                 100 * counts["shared_fraction"], counts["duplicate_rows"], rows.seconds, plan_s)
        return JobPlan(sharded, plan_rows, counts, stamp, partition_keys, rows_by_shard, kept,
                       answers.settings_fps if kept and answers else [])

    def _chains(self, database: PlanDatabase, block_size: int,
                progress: Callable[[str], None]) -> tuple[CachedRows, Chained, float]:
        """The snapshot's rows from the token cache (only new or changed rows tokenized) and their
        chains loaded into the plan's database; then the cache compacted where it is worth it,
        keeping what the plan on disk names (its partitions may still run; read then, after the
        lookup let go of its memory).
        Returns the rows, the chained stage and the seconds loading the chains took."""
        tokenizer = LazyTokenizer(self.settings.model_path)  # loaded only if a row is new or changed
        pa.default_memory_pool().release_unused()  # what reading the snapshot's ids (the guards) left in Arrow's pool
        with self.cache.writing(self.snapshot, block_size) as cache:
            rows = cache.rows(cache.tokenize(cache.look_up(), tokenizer, self.columns, progress,
                                             self.tokenize_workers))
            started = time.perf_counter()
            chained = database.load_chains(rows.chains)  # while the cache's parts are sure to be there
            chains_s = time.perf_counter() - started
            if rows.worth_compacting:  # the plan on disk's keys read only then (~16 bytes a row)
                cache.compact(rows, keep=plan_content_keys(self.plan_path))
        pa.default_memory_pool().release_unused()  # Arrow keeps what the lookup freed: the planner's peak follows
        return rows, chained, chains_s

    def _settle(self, checked: Checked, previous: Path, answers: StoredAnswers | None, rows: PlanRows,
                naming: ShardNaming) -> int:
        """The rows the answer store holds as tonight plans them (``Checked.settle``), less those
        of a previous shard whose partition cannot stay; returns how many settled."""
        if answers is None or not answers.settings_fps:
            return 0
        stored = checked.database.folder / "answers.parquet"
        if not answers.export(stored):
            return 0
        checked.settle(previous, stored, answers.settings_fps, rows)
        stored.unlink()
        checked.unsettle([shard for shard, key in checked.kept_keys().items() if not naming.keeps(shard, key)])
        return checked.settled_rows()

    def write(self, made: JobPlan, plan_run: str, counted_for: str | None = None,
              answer_lengths: AnswerLengths | None = None) -> int:
        """Publish the plan whole: every row with its group, shard, run position and content key (its
        token ids are in the token cache the plan names), stamped with what it was made from
        (``made.stamp``). ``counted_for``: the platform whose defaults it counts in;
        ``answer_lengths``: what its shards' admission counts a row's output at (learned from the job's
        answers). Returns its bytes. Raises ``StalePlan`` where what it was made from changed
        meanwhile (its stamp now is another)."""
        changed = stale_reasons({k.encode(): v.encode() for k, v in made.stamp.items()}, self.stamp())
        if changed:
            raise StalePlan(changed)
        metadata = plan_file_metadata(made.database.block_size, self.cache, self.settings.max_model_len, made.stamp,
                                      plan_run, made.settled_with, counted_for, answer_lengths)
        return write_plan(made.plan_tables(metadata), self.plan_path)
