"""Shard partitions: one dynamic partition per shard of the plan, with keys that stay stable.

A key names the hardware partition the shard is bound to, the shard's index and a hash of the
shard's row ids when it was made: the same groups give the same keys, and a changed shard gets a new
key. A shard whose rows are all answered as planned keeps its key on the nights after, whatever rows
left it (edited rows go to a night's new shards, deleted rows go): it is not run again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import dagster as dg

from engine.digests import short_digest
from engine.locks import Busy, held_alone

from .config import BatchJobConfig, HardwarePartition

# The plan's metadata entry listing the partitions whose rows need a run (the others are answered as planned).
SHARDS_TO_RUN = "partitions_to_run"
# Dagster's run tags for a partition range (what a backfill under a backfill policy sets too).
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"


def shard_partitions(name: str) -> dg.DynamicPartitionsDefinition:
    return dg.DynamicPartitionsDefinition(name=name)


def shard_key(hardware: HardwarePartition, shard: int, ids: list) -> str:
    digest = short_digest("\x1f".join(sorted(map(str, ids))))
    return f"{hardware.key_prefix}-{shard:02d}-{digest}"


@dataclass(frozen=True)
class JobShards:
    """How a job's plan counts, numbers and names its shards (``engine.jobs.plan_job.ShardNaming``):
    ``rows_per_shard`` the size the last nights measured (None: the job's, or the first night's)."""

    config: BatchJobConfig
    rows_per_shard: int | None = None

    def count(self, rows: int) -> int:
        return self.config.shard_count(rows, *([self.rows_per_shard] if self.rows_per_shard else []))

    def gathered(self, rows_to_run: int, total_rows: int, kept: set[int]) -> list[int]:
        """As few shards as ``rows_to_run`` need at the job's shard size (the size its whole table's
        shards have: each new shard starts vLLM on its hardware), numbered apart from ``kept`` so that
        they cycle over the hardware partitions as a first night's do."""
        slots = len(self.config.hardware)
        per_shard = -(-total_rows // self.count(total_rows))
        wanted = -(-rows_to_run // per_shard)
        numbers, taken = [], set(kept)
        for i in range(wanted):
            number = i % slots
            while number in taken:
                number += slots
            taken.add(number)
            numbers.append(number)
        return numbers

    def key(self, shard: int, ids: list) -> str:
        return shard_key(self.config.hardware_of_shard(shard), shard, ids)

    def keeps(self, shard: int, key: str) -> bool:
        return key.startswith(self.config.hardware_of_shard(shard).key_prefix + "-")

    def hardware(self, shard: int) -> str:
        return self.config.hardware_of_shard(shard).name


def hardware_of_key(config: BatchJobConfig, key: str) -> HardwarePartition:
    """The hardware partition of a shard key (``<hardware>-<shard>-<digest>``)."""
    hardware = config.hardware_of_shard(int(key.rsplit("-", 2)[1]))
    if not key.startswith(hardware.key_prefix + "-"):
        raise ValueError(f"partition key {key!r} is not a shard of hardware {hardware.name!r}: plan the job again")
    return hardware


def run_keys(tags: dict, keys: list[str]) -> list[str]:
    """The partitions a run answers, in order: its partition, or its range's (of ``keys``, in order)."""
    if "dagster/partition" in tags:
        return [tags["dagster/partition"]]
    position = {key: i for i, key in enumerate(keys)}
    if tags.get(RANGE_START) in position and tags.get(RANGE_END) in position:
        return keys[position[tags[RANGE_START]]:position[tags[RANGE_END]] + 1]
    return []


def by_hardware(config: BatchJobConfig, keys: list[str]) -> list[str]:
    """``keys`` with each hardware partition's shards neighbours (shards cycle over the hardware), in
    shard order within one: added in this order, a run of ``partitions_per_run`` can take a range."""
    rank = {hardware.name: i for i, hardware in enumerate(config.hardware)}
    return sorted(keys, key=lambda key: rank[hardware_of_key(config, key).name])


def shard_runs(config: BatchJobConfig, keys: list[str], wanted: set[str] | None = None,
               alone: set[str] = frozenset()) -> list[list[str]]:
    """``keys`` (in the instance's partition order) cut into runs: neighbours bound to the same
    hardware partition, all of them ``wanted`` (None: every key), at most ``partitions_per_run`` each
    (unset: as many as there are); a key in ``alone`` (one a failed run stopped at) is a run of its
    own. A run of several is a partition range, so its keys must be neighbours in that order: a key
    not wanted ends a run. A night's shards to run are added after the kept ones, each hardware
    partition's together (``by_hardware``): one run, one vLLM start, each."""
    runs: list[list[str]] = []
    cap = config.partitions_per_run or len(keys)
    open_run: list[str] | None = None
    for key in keys:
        if wanted is not None and key not in wanted:
            open_run = None
            continue
        if open_run and key not in alone and len(open_run) < cap \
                and hardware_of_key(config, open_run[0]) == hardware_of_key(config, key):
            open_run.append(key)
            continue
        runs.append([key])
        open_run = None if key in alone else runs[-1]
    return runs


def sync_partitions(instance: dg.DagsterInstance, name: str, keys: list[str]) -> tuple[list[str], list[str]]:
    """Make ``keys`` the partitions of ``name``; returns (added, removed)."""
    existing = set(instance.get_dynamic_partitions(name))
    added = [k for k in keys if k not in existing]
    removed = sorted(existing - set(keys))
    if added:
        instance.add_dynamic_partitions(name, added)
    for key in removed:
        instance.delete_dynamic_partition(name, key)
    return added, removed


def held_partitions(config: BatchJobConfig, keys: list[str], holder: str) -> contextlib.ExitStack:
    """Each key's partition lock, held until the returned stack closes: one run per partition key at a
    time, whatever launched it (a backfill, the sensor, the UI, two hardware partitions' jobs), in any
    instance. A key another run holds fails this run before it reads the checkpoint that run writes."""
    held = contextlib.ExitStack()
    try:
        for key in keys:
            held.enter_context(held_alone(config.files.lock_path(f"partition-{key}"), holder,
                                          f"partition {key} of {config.name}"))
    except Busy as busy:
        held.close()
        raise dg.Failure(f"{busy}: this run stops without touching its checkpoint or output") from None
    return held
