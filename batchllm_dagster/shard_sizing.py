"""How many rows a shard gets when the job sets neither ``shards`` nor ``rows_per_shard``: sized from
what the job's last partitions measured on each hardware partition, so that a partition's start-up
and orchestration (the step's start, reading the plan, vLLM's start and stop, writing, checks) stay
at most ``OVERHEAD_SHARE`` of its time there. A partition of R rows at r rows/s with o seconds of
overhead takes o + R / r; o <= share x (o + R / r) needs R >= o x r x (1 / share - 1). A faster GPU
needs bigger shards, so the fastest hardware partition's need decides. The size is rounded up to a
power of two, so a night's noise does not move every shard's rows. A first night, with nothing
measured, takes ``FIRST_NIGHT_ROWS_PER_SHARD``. Runs of several partitions (``partitions_per_run``)
share one vLLM start, so their partitions measure less overhead each and may be smaller.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import dagster as dg

from engine.plan.shard_cut import DECODE_COST

FIRST_NIGHT_ROWS_PER_SHARD = 10_000
OVERHEAD_SHARE = 0.05
PARTITIONS_READ = 50  # the latest materializations of completions the size is taken from
TIMEOUT_FACTOR = 4  # a shard's default time limit on Ray: this many times what it measured
MIN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Measured:
    """One hardware partition's medians over its last partitions that computed rows."""

    rows_per_s: float  # rows per second of engine time (median)
    overhead_s: float  # a partition's seconds outside the rows' engine time (mean: see measured_by_hardware)
    partitions: int
    # seconds of engine time per unit of work, a token prefilled or DECODE_COST per output token (median):
    # what a night's forecast multiplies its planned tokens by (0: not measured)
    seconds_per_work: float = 0.0
    run_overhead_s: float = 0.0  # a run's vLLM start and stop (medians of the partitions that paid them)
    partition_overhead_s: float = 0.0  # a partition's own: reading its plan, writing, checks (mean)


@dataclass(frozen=True)
class ShardSize:
    rows_per_shard: int
    why: str


def measured_by_hardware(metadata: list[dict]) -> dict[str, Measured]:
    """Per hardware partition, from completions metadata (``run_metadata`` and ``write_s``): the median
    rows per second, and the mean overhead. A run of several partitions (``partitions_per_run``)
    starts vLLM once, in its first partition's ``startup_s``, and stops it once, in its last's
    ``engine_stop_s``: only the mean spreads that over the partitions that shared it (a median
    would drop it)."""
    samples: dict[str, list[tuple[float, float]]] = {}
    work: dict[str, list[float]] = {}
    starts: dict[str, tuple[list[float], list[float], list[float]]] = {}  # engine starts, stops, partitions' own
    for m in metadata:
        computed = m.get("computed_rows", m.get("rows"))  # ``rows`` before it was named for what it counts
        if not computed or "wall_s" not in m:  # every row reused: nothing ran, nothing measured
            continue
        # ``wall_s`` is the rows' run on the started engine alone (``RunStats``): vLLM's start is in
        # ``startup_s`` and its stop in ``engine_stop_s``, both outside it.
        engine_s = m["wall_s"]
        if engine_s <= 0:
            continue
        overhead_s = m["startup_s"] + m["engine_stop_s"] + m.get("write_s", 0.0)
        hardware = m["hardware_partition"]
        samples.setdefault(hardware, []).append((computed / engine_s, overhead_s))
        start, stop, own = starts.setdefault(hardware, ([], [], []))
        start += [m["engine_start_s"]] if m.get("engine_start_s") else []
        stop += [m["engine_stop_s"]] if m["engine_stop_s"] else []
        own.append(m["startup_s"] - m.get("engine_start_s", 0.0) + m.get("write_s", 0.0))
        units = m.get("prefill_tokens", 0) + DECODE_COST * m.get("output_tokens", 0)
        if units > 0:
            work.setdefault(hardware, []).append(engine_s / units)
    median = lambda values: statistics.median(values) if values else 0.0  # noqa: E731
    return {
        hardware: Measured(statistics.median(r for r, _ in pairs), statistics.fmean(o for _, o in pairs), len(pairs),
                           median(work.get(hardware)), median(starts[hardware][0]) + median(starts[hardware][1]),
                           statistics.fmean(starts[hardware][2]))
        for hardware, pairs in samples.items()
    }


def shard_size(measured: dict[str, Measured], share: float = OVERHEAD_SHARE) -> ShardSize:
    if not measured:
        return ShardSize(
            FIRST_NIGHT_ROWS_PER_SHARD, f"first night: nothing measured yet, {FIRST_NIGHT_ROWS_PER_SHARD:,} rows"
        )
    needs = {hardware: m.overhead_s * m.rows_per_s * (1 / share - 1) for hardware, m in measured.items()}
    hardware = max(needs, key=needs.get)
    rows = 1 << max(0, int(needs[hardware]) - 1).bit_length()  # rounded up to a power of two
    m = measured[hardware]
    return ShardSize(rows, f"{rows:,} rows: on {hardware}, {m.rows_per_s:,.1f} rows/s and {m.overhead_s:.1f} s of "
                           f"start-up and orchestration per partition (median and mean of {m.partitions}) keep that at "
                           f"most {share:.0%} of a partition")


@dataclass(frozen=True)
class TimeLimit:
    seconds: float
    why: str


def shard_time_limit(measured: Measured | None, rows: int) -> TimeLimit | None:
    """A shard's time limit where the job sets none (``ray_shard_timeout_s``): ``TIMEOUT_FACTOR``
    times what its hardware partition's last partitions measured for as many rows (their rows per
    second, their overhead), at least ``MIN_TIMEOUT_S``; None before anything was measured there."""
    if measured is None:
        return None
    expected = rows / measured.rows_per_s + measured.overhead_s
    seconds = max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * expected)
    return TimeLimit(seconds, f"{seconds:,.0f} s: {TIMEOUT_FACTOR} x the {expected:,.0f} s that {rows:,} rows took "
                                   f"at the {measured.rows_per_s:,.1f} rows/s and {measured.overhead_s:.1f} s of "
                                   f"overhead measured here (at least {MIN_TIMEOUT_S:,.0f} s)")


def last_partitions_metadata(instance: dg.DagsterInstance, completions: dg.AssetKey) -> list[dict]:
    """The metadata of the latest materializations of ``completions``, values unwrapped."""
    records = instance.fetch_materializations(completions, limit=PARTITIONS_READ).records
    return [{name: value.value for name, value in r.asset_materialization.metadata.items()}
            for r in records if r.asset_materialization is not None]


def ray_time_limit(config, instance: dg.DagsterInstance, hardware_partition: str, rows: int) -> TimeLimit | None:
    """A shard's time limit on Ray: the job's ``ray_shard_timeout_s``, else one from what the hardware
    partition measured (``shard_time_limit``)."""
    if config.ray_shard_timeout_s is not None:
        return TimeLimit(config.ray_shard_timeout_s, f"{config.ray_shard_timeout_s:g} s (ray_shard_timeout_s)")
    measured = measured_by_hardware(last_partitions_metadata(instance, config.names.asset_key("completions")))
    return shard_time_limit(measured.get(hardware_partition), rows)
