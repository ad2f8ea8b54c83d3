"""A job's plan step, the same way wherever it runs (the ``prefix_groups`` asset; ``ShardJob``'s
counterpart): the prompt snapshot's rows through the token cache, the plan over the whole batch, its
shards and their keys, and the plan file, with one summary that the asset's metadata, ``batchllm
plan`` and the bench all print (``plan_summary``).

The caller keeps what is its own: its lock, the guards that refuse a night, how many shards and
what they are called, partitions, removals and pruning, and how a plan is reported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..damaged import readable_or_set_aside
from ..plan.duplicates import count_duplicates
from ..plan.plan_table import plan_content_keys, plan_tables, previous_shards, read_previous_plan, write_plan
from ..plan.prepared import PlannedBatch, plan_tokenized
from ..plan.shards import ShardPlan, assign_shards
from ..plan.token_cache import CachedRows, TokenCache
from ..plan.tokenize_workers import TokenizeWorkers
from ..plan.tokenizing import LazyTokenizer, tokenizer_fingerprint
from ..settings import EngineSettings, SamplingSettings, SchedulerSettings
from ..table.dataset import Columns, DatasetError
from ..table.prompt_snapshot import CONTENT_KEY, columns_without_text, read_snapshot


def plan_summary(planned: PlannedBatch) -> dict:
    """What a plan is, in numbers: the one summary the asset's metadata, ``batchllm plan`` and the
    bench print."""
    plan = planned.plan
    return {
        "rows": plan.num_rows,
        "error_rows": len(planned.errors),
        "duplicate_rows": count_duplicates(planned.duplicate_set),  # identical to another row: computed once
        "groups": plan.num_groups,
        "shared_groups": int((plan.group_prefix_tokens > 0).sum()),
        "prompt_tokens": plan.prompt_tokens,
        "unique_tokens": plan.unique_tokens,
        "shared_prompt_tokens": plan.shared_prompt_tokens,
        "shared_fraction": round(float(plan.shared_fraction), 4),
        "tokenize_s": round(planned.tokenize_s, 3),
        "plan_s": round(planned.plan_s, 4),
    }


@dataclass(frozen=True)
class JobPlan:
    """A plan made, not yet written: the planned batch, its rows' metadata, its shards and keys."""

    planned: PlannedBatch
    meta: pa.Table  # the snapshot's rows without their text (id, content key, max_tokens, formats)
    rows: CachedRows  # what the token cache gave (cached and tokenized rows)
    shards: ShardPlan
    keys: list[str]  # each shard's partition key
    rows_by_shard: list[int]  # each shard's rows

    @property
    def used_keys(self) -> list[str]:
        """The keys of the shards that have rows (fewer groups than shards leave some empty)."""
        return [key for key, rows in zip(self.keys, self.rows_by_shard) if rows]

    def summary(self) -> dict:
        return {**plan_summary(self.planned), "token_cache_rows": self.rows.cached_rows,
                "tokenized_rows": self.rows.tokenized_rows, "shards": len(self.used_keys),
                "split_groups": self.shards.split_groups}

    def groups_table(self, hardware_of_shard: Callable[[int], str]) -> pa.Table:
        """One row per group: its shard, prefix length, rows and estimated tokens."""
        plan = self.planned.plan
        first_rows = plan.order[plan.group_starts()[:-1]]
        shard = self.shards.shard_of_row[first_rows]
        weights = {name: np.bincount(plan.group_of_row, weights=values, minlength=plan.num_groups).astype(np.int64)
                   for name, values in (("prompt", plan.lengths), ("prefill", plan.row_unique_tokens),
                                        ("decode", plan.decode_tokens))}
        return pa.table({
            "group": np.arange(plan.num_groups),
            "shard": shard,
            "partition_key": [self.keys[s] for s in shard],
            "hardware": [hardware_of_shard(int(s)) for s in shard],
            "rows": plan.group_sizes,
            "prefix_tokens": plan.group_prefix_tokens,
            "prompt_tokens": weights["prompt"],
            "estimated_prefill_tokens": weights["prefill"],
            "estimated_decode_tokens": weights["decode"],
            "first_id": self.planned.ids.take(pa.array(first_rows, pa.int64())).cast(pa.string()),
        })


@dataclass
class PlanJob:
    """The plan step of one job's files (``snapshot``, ``plan_path``, the token cache under
    ``token_cache_dir``) on its settings (``settings``: the model resolved, counted in the block
    size and context length its shards run at). ``warn``: told of a damaged file set aside."""

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
        if not readable_or_set_aside(self.snapshot, self._rows_of, "the prompt snapshot",
                                     "materialize prompts to take it again", self.warn):
            raise DatasetError("the prompt snapshot was damaged (set aside): materialize prompts, then prefix_groups "
                               "(the plan job does both)")

    def read_rows(self) -> pa.Table:
        """The snapshot's rows without their text: the plan needs ids, hashes, max_tokens and formats."""
        return self._rows_of(self.snapshot)

    def _rows_of(self, path: Path) -> pa.Table:
        return read_snapshot(path, columns=columns_without_text(path, self.columns.prompt, self.columns.messages))

    def plan(self, meta: pa.Table, shard_count: Callable[[int], int], key_of: Callable[[int, list], str],
             progress: Callable[[str], None]) -> JobPlan:
        """Tokens (only new or changed rows tokenized), the plan, ``shard_count(rows)`` shards that
        keep what the plan on disk had where they can, and each shard's key (``key_of(shard, ids)``)."""
        tokenizer = LazyTokenizer(self.settings.model_path)  # loaded only if a row is new or changed
        pa.default_memory_pool().release_unused()  # what reading the snapshot's rows left in Arrow's pool
        rows = self.cache.rows_for(self.snapshot, tokenizer, self.columns.prompt, self.columns.messages,
                              self.settings.block_size, progress=progress,
                              still_needed=lambda: plan_content_keys(self.plan_path), workers=self.tokenize_workers)
        pa.default_memory_pool().release_unused()  # Arrow keeps what the lookup freed: the planner's peak follows
        planned = plan_tokenized(meta, rows, self.settings, self.sampling, self.columns, self.scheduler)
        count = shard_count(planned.plan.num_rows)
        shards = assign_shards(planned.plan, count,
                               previous=previous_shards(self.plan_path, meta.column(self.columns.id)))
        keys, rows_by_shard = [], []
        for shard, ids in enumerate(_ids_by_shard(planned, shards.shard_of_row, count)):  # a shard's ids at a time
            keys.append(key_of(shard, ids))
            rows_by_shard.append(len(ids))
        return JobPlan(planned, meta, rows, shards, keys, rows_by_shard)

    def write(self, made: JobPlan, stamp: dict[str, str], plan_run: str) -> int:
        """Publish the plan whole: every row with its group, shard, run position and content key (its
        token ids are in the token cache the plan names), stamped with what it was made from. Returns
        its bytes."""
        return write_plan(plan_tables(made.planned, made.meta.column(CONTENT_KEY), self.cache,
                                      made.shards.shard_of_row, made.keys, stamp, plan_run,
                                      self.settings.max_model_len), self.plan_path)


def _ids_by_shard(planned: PlannedBatch, shard_of_row: np.ndarray, shard_count: int) -> Iterator[list]:
    """Each shard's row ids in run order, one shard at a time."""
    in_order = shard_of_row[planned.order]
    by_shard = np.argsort(in_order, kind="stable")
    bounds = np.searchsorted(in_order[by_shard], np.arange(shard_count + 1))
    by_shard = planned.order[by_shard]
    for s in range(shard_count):
        yield planned.ids.take(pa.array(by_shard[bounds[s]:bounds[s + 1]], pa.int64())).to_pylist()
