"""Shard partitions: one dynamic partition per shard of the plan, with keys that stay stable.

A key names the hardware partition the shard is bound to, the shard's index and a hash of the
shard's row ids: the same groups give the same keys, and a changed shard gets a new key.
"""

from __future__ import annotations

import contextlib

import dagster as dg

from engine.digests import short_digest
from engine.locks import Busy, held_alone

from .config import BatchJobConfig, HardwarePartition

# Dagster's run tags for a partition range (what a backfill under a backfill policy sets too).
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"


def shard_partitions(name: str) -> dg.DynamicPartitionsDefinition:
    return dg.DynamicPartitionsDefinition(name=name)


def shard_key(hardware: HardwarePartition, shard: int, ids: list) -> str:
    digest = short_digest("\x1f".join(sorted(map(str, ids))))
    return f"{hardware.key_prefix}-{shard:02d}-{digest}"


def hardware_of_key(config: BatchJobConfig, key: str) -> HardwarePartition:
    """The hardware partition of a shard key (``<hardware>-<shard>-<digest>``)."""
    hardware = config.hardware_of_shard(int(key.rsplit("-", 2)[1]))
    if not key.startswith(hardware.key_prefix + "-"):
        raise ValueError(f"partition key {key!r} is not a shard of hardware {hardware.name!r}: plan the job again")
    return hardware


def by_hardware(config: BatchJobConfig, keys: list[str]) -> list[str]:
    """``keys`` with each hardware partition's shards neighbours (shards cycle over the hardware), in
    shard order within one: added in this order, a run of ``partitions_per_run`` can take a range."""
    rank = {hardware.name: i for i, hardware in enumerate(config.hardware)}
    return sorted(keys, key=lambda key: rank[hardware_of_key(config, key).name])


def shard_runs(config: BatchJobConfig, keys: list[str]) -> list[list[str]]:
    """``keys`` (in the instance's partition order) cut into runs: neighbours bound to the same
    hardware partition, at most ``partitions_per_run`` each. A run of several is a partition range,
    so its keys must be neighbours in that order."""
    runs: list[list[str]] = []
    for key in keys:
        run = runs[-1] if runs else None
        if run and len(run) < config.partitions_per_run and hardware_of_key(config, run[0]) == hardware_of_key(
                config, key):
            run.append(key)
        else:
            runs.append([key])
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
