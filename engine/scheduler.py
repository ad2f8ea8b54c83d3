"""Feed a planned batch into vLLM: group-wise admission sized to the real KV capacity.

BatchLLM's scheduling on top of an unmodified vLLM engine:

* groups enter in plan order; a group's shared prefix is computed once, by a prefix request
  (the prefix alone, one output token), before any of its rows enter, so no two rows of the group
  prefill the same prefix in the same step;
* rows are admitted while the KV working set of everything in flight (each group's prefix once,
  each row's own blocks so far plus the output it is reserved: all of it with
  ``reserve_output="full"``, the next ``lookahead_tokens`` otherwise) stays under a share of the
  engine's KV capacity read after start-up, so a prefix stays cached until its last row and rows
  are not preempted ("full"), or only rarely (the lookahead);
* the next group's prefix request runs while the current group's rows decode (pipelining);
* results stream out as rows finish.

``run_in_order`` is the plain baseline: every row submitted at once in the given order, which is
what ``LLM.generate`` does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from .plan import PrefixPlan
from .results import RunStats
from .settings import SamplingSettings, SchedulerSettings
from .tokenizing import TokenizedBatch
from .vllm_engine import Finished, VLLMEngine

log = logging.getLogger(__name__)

_PREFIX_ID = "prefix:"
_ROW_ID = "row:"


@dataclass
class _Group:
    prefix_tokens: int
    rows: list[int]
    next_row: int = 0
    outstanding: int = 0
    prefix_state: str = "pending"  # pending -> running -> done


class Progress:
    """Logs a progress line at most every ``every_s`` seconds."""

    def __init__(self, total_rows: int, stats: RunStats, every_s: float, sink: Callable[[str], None] | None = None):
        self.total, self.stats, self.every_s = total_rows, stats, every_s
        self.sink = sink or log.info
        self.started = self.last = time.perf_counter()

    def maybe_log(self, in_flight: int = 0, kv_blocks: int = 0, kv_usage: float = 0.0, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < self.every_s:
            return
        self.last = now
        done, elapsed = self.stats.rows, now - self.started
        rate = done / elapsed if elapsed else 0.0
        eta = (self.total - done) / rate if rate else float("nan")
        self.sink(
            f"{done}/{self.total} rows ({100 * done / max(self.total, 1):.0f}%), {rate:.1f} rows/s, "
            f"{(self.stats.prompt_tokens + self.stats.output_tokens) / max(elapsed, 1e-9):.0f} tok/s, "
            f"cached {self.stats.cached_tokens} tok, in flight {in_flight} rows / {kv_blocks} KV blocks "
            f"(vLLM KV {100 * kv_usage:.0f}% used), "
            f"preemptions {self.stats.preemptions}, eta {eta:.0f}s"
        )


def _count(stats: RunStats, finished: Finished, engine: VLLMEngine) -> None:
    stats.rows += 1
    stats.ok_rows += 1
    stats.prompt_tokens += finished.prompt_tokens
    stats.cached_tokens += finished.cached_tokens
    stats.output_tokens += len(finished.token_ids)
    stats.preemptions = engine.preemptions


def run_in_order(
    engine: VLLMEngine,
    batch: TokenizedBatch,
    rows: list[int],
    max_tokens: np.ndarray,
    sampling: SamplingSettings,
    stats: RunStats,
    progress: Progress | None = None,
) -> Iterator[tuple[int, Finished]]:
    """Baseline: submit every row at once, in the given order, and let vLLM schedule."""
    for row in rows:
        engine.submit(f"{_ROW_ID}{row}", batch.row(row), engine.sampling_params(sampling, int(max_tokens[row])))
    while engine.has_unfinished():
        for finished in engine.step():
            _count(stats, finished, engine)
            yield int(finished.request_id[len(_ROW_ID) :]), finished
        if progress:
            progress.maybe_log(in_flight=len(rows) - stats.rows, kv_usage=engine.counters.kv_usage)


def _groups_in_order(plan: PrefixPlan, rows: list[int]) -> list[_Group]:
    """Split rows (already in plan order) where the group changes."""
    groups: list[_Group] = []
    last = None
    for row in rows:
        group = int(plan.group_of_row[row])
        if group != last:
            groups.append(_Group(prefix_tokens=int(plan.group_prefix_tokens[group]), rows=[]))
            last = group
        groups[-1].rows.append(row)
    return groups


def run_grouped(
    engine: VLLMEngine,
    batch: TokenizedBatch,
    plan: PrefixPlan,
    rows: list[int],
    max_tokens: np.ndarray,
    sampling: SamplingSettings,
    settings: SchedulerSettings,
    stats: RunStats,
    progress: Progress | None = None,
) -> Iterator[tuple[int, Finished]]:
    """BatchLLM: groups in plan order, prefix first, rows admitted under a KV budget."""
    block = engine.settings.block_size
    budget = max(1, int(engine.kv_capacity_blocks * settings.kv_budget_fraction))
    lookahead_blocks = None if settings.reserve_output == "full" else -(-settings.lookahead_tokens // block)
    groups = _groups_in_order(plan, rows)
    lengths = batch.lengths
    running: dict[int, _Group] = {}  # admitted rows not yet finished
    pinned = 0  # prefix blocks held for groups with rows still to run, plus running prefix requests

    def blocks_beyond_prefix(row: int, group: _Group, tokens: int) -> int:
        return max(1, -(-tokens // block) - group.prefix_tokens // block)

    def demand(row: int, group: _Group) -> int:
        """KV blocks the row holds now plus what is reserved for its coming output."""
        generated = engine.generated.get(f"{_ROW_ID}{row}", 0)
        held = blocks_beyond_prefix(row, group, int(lengths[row]) + generated)
        final = blocks_beyond_prefix(row, group, int(lengths[row]) + int(max_tokens[row]))
        growth = final - held
        return held + (growth if lookahead_blocks is None else min(growth, lookahead_blocks))

    def uses_prefix_request(group: _Group) -> bool:
        return settings.prefix_requests and group.prefix_tokens >= block and len(group.rows) >= settings.min_group_rows

    head = 0  # first group with rows still to admit

    def admit() -> int:
        nonlocal pinned, head
        in_use = pinned + sum(demand(row, group) for row, group in running.items())
        while head < len(groups):
            group = groups[head]
            if group.prefix_state == "pending":
                need = group.prefix_tokens // block + 1 + demand(group.rows[0], group)
                if in_use + need > budget and in_use > 0:
                    break
                pinned += group.prefix_tokens // block
                in_use += group.prefix_tokens // block
                if uses_prefix_request(group):
                    prefix = batch.row(group.rows[0])[: group.prefix_tokens]
                    engine.submit(f"{_PREFIX_ID}{head}", prefix, engine.sampling_params(sampling, 1))
                    pinned += 1  # the prefix request's own output block
                    in_use += 1
                    group.prefix_state = "running"
                    stats.prefix_requests += 1
                else:
                    group.prefix_state = "done"
            if group.prefix_state == "running":
                break  # rows wait for their prefix; later groups wait for their turn
            while group.next_row < len(group.rows):
                row = group.rows[group.next_row]
                cost = demand(row, group)
                if in_use + cost > budget and running:
                    return in_use
                engine.submit(f"{_ROW_ID}{row}", batch.row(row), engine.sampling_params(sampling, int(max_tokens[row])))
                running[row] = group
                in_use += cost
                group.outstanding += 1
                group.next_row += 1
            head += 1
        return in_use

    while True:
        in_use = admit()
        if not engine.has_unfinished():
            if head < len(groups):  # admit() always admits into an idle engine
                raise RuntimeError(f"scheduler stalled at group {head} of {len(groups)}")
            break
        for finished in engine.step():
            if finished.request_id.startswith(_PREFIX_ID):
                group = groups[int(finished.request_id[len(_PREFIX_ID) :])]
                group.prefix_state = "done"
                pinned -= 1
                stats.prefix_prompt_tokens += finished.prompt_tokens
                stats.prefix_cached_tokens += finished.cached_tokens
                continue
            row = int(finished.request_id[len(_ROW_ID) :])
            group = running.pop(row)
            group.outstanding -= 1
            if group.outstanding == 0 and group.next_row == len(group.rows):
                pinned -= group.prefix_tokens // block  # the prefix may now be evicted
            _count(stats, finished, engine)
            yield row, finished
        if progress:
            progress.maybe_log(in_flight=len(running), kv_blocks=in_use, kv_usage=engine.counters.kv_usage)
