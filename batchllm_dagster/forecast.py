"""What tonight will cost, known when the plan is made, before any shard runs.

Per hardware partition and in total: the rows to compute and those reused (answer reuse is settled by
then), the prompt tokens to prefill after the prefix plan (its estimate: each shard computes a shared
block once), the output tokens expected (the mean of the answers the job's output table holds,
``plan.answer_lengths``, never above the rows' budgets; the budgets where too few were measured), and
the wall time and device-hours the throughput those nights measured on that hardware gives
(``shard_sizing.Measured``: engine seconds per token of work, a prefilled token or ``DECODE_COST`` per
output token; a vLLM start and stop per run, one run per hardware partition and night unless
``partitions_per_run`` cuts more; each partition's reading, writing and checks). Device-hours are the
hardware's devices held: ``tensor_parallel_size`` GPUs per engine (times ``ray_replicas`` on Ray) on a
GPU partition, one machine on a CPU one. Hardware partitions run side by side: the night's wall is the
longest of theirs. A cost where the hardware has a ``price_per_hour``. The answer lengths it expects
are learned here too (``learned_answer_lengths``), once a plan, for the forecast and the plan file.
"""

from __future__ import annotations

from dataclasses import dataclass

import dagster as dg

from engine.plan.answer_lengths import AnswerLengths, learned_lengths, why_not_learned
from engine.plan.shard_cut import DECODE_COST

from .output_table import OutputTable
from .shard_sizing import Measured


@dataclass(frozen=True)
class HardwareForecast:
    hardware: str
    shards: int  # to run
    rows: int  # to compute
    prefill_tokens: int  # the plan's estimate after prefix sharing
    output_tokens: int
    output_measured: bool  # from the last nights' answers; else the rows' budgets (an upper bound)
    wall_s: float | None  # None: nothing measured on this hardware yet
    device_hours: float | None
    cost: float | None  # None: no measurement, or no price_per_hour

    def line(self) -> str:
        output = f"{self.output_tokens:,} output tokens " + (
            "expected (the last nights' answers)" if self.output_measured else "at most (the rows' budgets)")
        time = (f"about {_duration(self.wall_s)}, {self.device_hours:,.2f} device-hours"
                + (f", {self.cost:,.2f} at its price" if self.cost is not None else "")
                if self.wall_s is not None else "no measurement yet on this hardware: tokens only")
        return (f"{self.hardware}: {self.rows:,} rows to compute in {self.shards} shards, "
                f"{self.prefill_tokens:,} prompt tokens to prefill, {output}; {time}")


@dataclass(frozen=True)
class NightForecast:
    parts: list[HardwareForecast]
    rows_reused: int
    lengths: AnswerLengths | None = None  # the answers' lengths learned (admission counts rows at them)

    @property
    def measured(self) -> bool:
        return all(p.wall_s is not None for p in self.parts)

    @property
    def wall_s(self) -> float | None:
        return max((p.wall_s for p in self.parts), default=0.0) if self.measured else None

    @property
    def device_hours(self) -> float | None:
        return sum(p.device_hours for p in self.parts) if self.measured else None

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    def metadata(self) -> dict:
        """The plan's ``forecast_*`` metadata (a value not known yet is left out)."""
        metadata = {"forecast_rows_to_compute": self.rows, "forecast_rows_reused": self.rows_reused,
                    "forecast_prefill_tokens": sum(p.prefill_tokens for p in self.parts),
                    "forecast_output_tokens": sum(p.output_tokens for p in self.parts),
                    "forecast_by_hardware": dg.MetadataValue.json({p.hardware: p.line() for p in self.parts})}
        if self.lengths is not None:
            metadata["learned_answer_tokens"] = self.lengths.tokens
        if self.measured:
            metadata.update(forecast_wall_s=float(round(self.wall_s, 1)),
                            forecast_gpu_hours=float(round(self.device_hours, 4)))
        costs = [p.cost for p in self.parts]
        if self.parts and all(c is not None for c in costs):
            metadata["forecast_cost"] = float(round(sum(costs), 2))
        return metadata

    def lines(self) -> list[str]:
        total = (f"forecast: {self.rows:,} rows to compute, {self.rows_reused:,} reused"
                 + (f"; about {_duration(self.wall_s)} and {self.device_hours:,.2f} device-hours"
                    if self.measured else "; no wall time until every hardware partition has a night measured"))
        return [total, *(f"  {p.line()}" for p in self.parts)]


def learned_answer_lengths(output: OutputTable, log) -> AnswerLengths | None:
    """What the job's answers took on the last nights (``answer_lengths``): the output admission counts
    its rows at and the forecast expects, said in the plan step's log."""
    rows, percentile, mean, at_limit = output.answer_lengths()
    lengths = learned_lengths(rows, percentile, mean, at_limit)
    log.info(f"answer lengths: {lengths.describe()}: admission counts a row's output so, never above its max_tokens"
             if lengths else f"answer lengths: {why_not_learned(rows, at_limit)}")
    return lengths


def forecast_night(made, config, measured: dict[str, Measured], lengths: AnswerLengths | None = None) -> NightForecast:
    """The forecast of the plan ``made`` (a ``PlanJob``'s ``JobPlan``) for ``config``'s hardware, its
    answers of ``lengths`` (learned from the output table; None: the rows' budgets)."""
    to_run = set(made.keys_to_run)
    parts = []
    for hardware in config.hardware:
        shards = [s for s, key in enumerate(made.keys) if key in to_run and config.hardware_of_shard(s) is hardware]
        rows = sum(made.rows_by_shard[s] for s in shards)
        prefill = int(sum(made.shards.prefill_tokens[s] for s in shards))
        budget = int(sum(made.shards.decode_tokens[s] for s in shards))
        seen = measured.get(hardware.name)
        output = min(budget, round(rows * lengths.mean)) if lengths is not None else budget
        wall = hours = cost = None
        if seen and seen.seconds_per_work:
            runs = config.runs_for(len(shards))
            wall = (seen.seconds_per_work * (prefill + DECODE_COST * output) + seen.run_overhead_s * runs
                    + seen.partition_overhead_s * len(shards))
            hours = wall * config.devices_per_engine(hardware) / 3600
            cost = hours * hardware.price_per_hour if hardware.price_per_hour is not None else None
        parts.append(HardwareForecast(hardware.name, len(shards), rows, prefill, output, lengths is not None, wall,
                                      hours, cost))
    return NightForecast(parts, int(made.counts.get("settled_rows", 0)), lengths)


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"
