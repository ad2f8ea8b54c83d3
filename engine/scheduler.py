"""Decide what enters the engine and when: BatchLLM's group-wise admission under a KV budget.

A scheduler has four verbs, in the manner of vLLM V1's scheduler interface:

* it is built from the **planned groups** (rows in run order, each group's shared prefix);
* ``schedule(generated)``: given how many tokens each unfinished request has generated so far
  (what the engine reported after its last step), what to submit next, and which rows can never
  run (a row that needs more KV than the whole cache is rejected, never a stall);
* ``finish(finished)``: account a request the engine finished;
* ``stats``: what it did (prefix requests, the budget, the most blocks it planned to use).

``GroupScheduler`` is BatchLLM's policy on an unmodified vLLM:

* groups enter in plan order; a group's shared prefix is computed once, by a prefix request (the
  prefix alone, one output token), before any of its rows enter, so no two rows of the group
  prefill the same prefix in the same step;
* the next group's prefix request runs while the current group's rows decode (pipelining);
* rows are admitted while the KV blocks of everything in flight stay under a share of the
  engine's capacity (read after start-up), counted **as vLLM holds them**: a prefix block is
  identified by the chained hash of its tokens, as vLLM's prefix cache identifies it, so a block
  that several groups share (a system prompt above every document) counts once, however many
  groups are in flight. A group holds its prefix blocks from its prefix request until its last
  row finishes (explicit retention: a prefix is not evicted while rows still need it). Each row
  adds its own blocks beyond its group's prefix: what it holds now, plus what it is reserved for
  its coming output (all of it with ``ReserveOutput.FULL``: no preemption ever; the next
  ``lookahead_tokens`` with ``ReserveOutput.LOOKAHEAD``: vLLM allocates output blocks lazily, so
  more rows fit, and a rare preemption is the price).

  Why the tree's identity and not vLLM's own KV gauge: the gauge lags a step, counts rows waiting
  in vLLM's queue as holding nothing, and counts a finished group's cached prefix as free; the
  block identity is exact for what is retained and known before a row is submitted. vLLM's gauge
  is still read every step and reported (``mean_kv_usage``) to show how full the cache really ran.
  A row that shares more than its group's prefix with the row before it (a document asked two
  questions inside a larger group) counts those blocks once while both are in flight: vLLM caches
  a block when it allocates it, so rows admitted in the same step share it too.

``InOrderScheduler`` is the plain baseline: every row submitted at once in the given order, which
is what ``LLM.generate`` does.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .requests import Finished, RequestKey, RequestKind, Submission
from .settings import ReserveOutput, SchedulerSettings
from .tokenizing import TokenizedBatch


@dataclass
class PlannedGroup:
    """A group of rows, in run order, that share their first ``prefix_len`` tokens (whole blocks)."""

    prefix_len: int
    rows: list[int]


def groups_in_run_order(rows: Iterable[int], group_of_row: np.ndarray, prefix_len_of_row: np.ndarray) -> list[PlannedGroup]:
    """Split rows (already in run order) where the group changes."""
    groups: list[PlannedGroup] = []
    last = None
    for row in rows:
        group = int(group_of_row[row])
        if group != last:
            groups.append(PlannedGroup(prefix_len=int(prefix_len_of_row[row]), rows=[]))
            last = group
        groups[-1].rows.append(int(row))
    return groups


@dataclass
class Decision:
    """What ``schedule`` decided: requests to submit, and rows rejected with the reason."""

    submit: list[Submission] = field(default_factory=list)
    reject: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class SchedulerStats:
    prefix_requests: int = 0
    prefix_prompt_tokens: int = 0
    prefix_cached_tokens: int = 0
    budget_blocks: int = 0
    max_planned_blocks: int = 0  # the most blocks the scheduler counted in flight at once


def prefix_block_keys(token_ids: np.ndarray, prefix_len: int, block_size: int) -> list[int]:
    """One key per whole block of the prefix, chained like vLLM's block hashes: equal keys mean
    equal tokens from the start of the prompt up to the end of that block."""
    keys, previous = [], 0
    for start in range(0, prefix_len - prefix_len % block_size, block_size):
        previous = hash((previous, token_ids[start : start + block_size].tobytes()))
        keys.append(previous)
    return keys


def _common_blocks(a: np.ndarray, b: np.ndarray, block_size: int) -> int:
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return (int(differ[0]) if differ.size else n) // block_size


class _PrefixState(enum.Enum):
    PENDING = "pending"  # not admitted yet
    RUNNING = "running"  # its prefix request is in the engine
    READY = "ready"  # cached (or needs no prefix request): its rows may enter


@dataclass
class _GroupState:
    position: int
    planned: PlannedGroup
    block_keys: list[int]
    state: _PrefixState = _PrefixState.PENDING
    next_row: int = 0
    outstanding: int = 0
    holding: bool = False  # counted in the scheduler's prefix blocks

    @property
    def all_admitted(self) -> bool:
        return self.next_row == len(self.planned.rows)


class GroupScheduler:
    """BatchLLM admission: groups in plan order, prefix first, rows under a KV budget (see module doc)."""

    def __init__(
        self,
        batch: TokenizedBatch,
        max_tokens: np.ndarray,
        groups: list[PlannedGroup],
        settings: SchedulerSettings,
        block_size: int,
        capacity_blocks: int,
    ):
        self._batch, self._max_tokens, self._settings, self._block = batch, max_tokens, settings, block_size
        self._lengths = batch.lengths
        self._capacity = max(1, capacity_blocks - 1)  # vLLM keeps one block as its null block
        self._budget = max(1, int(self._capacity * settings.kv_budget_fraction))
        self._lookahead = settings.lookahead_tokens if settings.reserve_output is ReserveOutput.LOOKAHEAD else None
        self._queue = deque(
            _GroupState(position, g, prefix_block_keys(batch.tokens_of(g.rows[0]), g.prefix_len, block_size))
            for position, g in enumerate(groups)
            if g.rows
        )
        # Rows sharing more than their group's prefix with the row before them (a document asked
        # two questions inside a larger group): row -> (that row, whole-block tokens they share).
        self._shares_deeper: dict[int, tuple[int, int]] = {}
        for g in groups:
            for previous, row in zip(g.rows, g.rows[1:]):
                common = _common_blocks(batch.tokens_of(previous), batch.tokens_of(row), block_size) * block_size
                if common > g.prefix_len:
                    self._shares_deeper[row] = (previous, common)
        self._holders: Counter[int] = Counter()  # prefix block key -> groups holding it
        self._rows: dict[int, _GroupState] = {}  # rows in the engine
        self._prefixes: dict[int, _GroupState] = {}  # prefix requests in the engine, by group position
        self.stats = SchedulerStats(budget_blocks=self._budget)

    @property
    def done(self) -> bool:
        """Every row submitted (or rejected) and finished."""
        return not self._queue and not self._rows and not self._prefixes

    # -- block accounting -------------------------------------------------------------------
    def _own_blocks(self, tokens: int, shared: int) -> int:
        """Blocks of ``tokens`` beyond the first ``shared`` (whole blocks), at least one."""
        return max(1, -(-tokens // self._block) - shared // self._block)

    def _cache_hit(self, row: int, shared: int) -> int:
        """Of ``shared`` leading tokens in the cache, those vLLM reuses for the row: a hit is capped at
        the prompt's length - 1 (``KVCacheManager.get_computed_blocks``), so a prompt that is wholly
        a cached, block-aligned prefix (a duplicate row) recomputes its last block in a block of its own."""
        return max(0, min(shared, (int(self._lengths[row]) - 1) // self._block * self._block))

    def _shared_len(self, row: int, group: _GroupState) -> int:
        """Leading tokens of the row that vLLM finds in flight: its group's prefix, or more while
        the row before it, with which it shares more, is in the engine too."""
        previous, common = self._shares_deeper.get(row, (None, 0))
        return self._cache_hit(row, common if previous in self._rows else group.planned.prefix_len)

    def _row_demand(self, row: int, group: _GroupState, generated: int) -> int:
        """Blocks the row holds beyond what it shares, plus what is reserved for its output: all
        of it, or the blocks its next ``lookahead_tokens`` tokens will need."""
        length, shared = int(self._lengths[row]), self._shared_len(row, group)
        remaining = int(self._max_tokens[row]) - generated
        ahead = remaining if self._lookahead is None else min(remaining, self._lookahead)
        return self._own_blocks(length + generated + ahead, shared)

    def planned_blocks(self, generated: Mapping[RequestKey, int]) -> int:
        """Blocks of everything in flight, shared prefix blocks once."""
        rows = sum(
            self._row_demand(row, group, generated.get((RequestKind.ROW, row), 0)) for row, group in self._rows.items()
        )
        return len(self._holders) + len(self._prefixes) + rows

    def _hold(self, group: _GroupState) -> int:
        """The group now holds its prefix blocks; returns how many were not held before."""
        new = sum(1 for key in group.block_keys if key not in self._holders)
        self._holders.update(group.block_keys)
        group.holding = True
        return new

    def _release(self, group: _GroupState) -> None:
        if not group.holding:
            return
        group.holding = False
        self._holders.subtract(group.block_keys)
        for key in group.block_keys:
            if self._holders[key] <= 0:
                del self._holders[key]

    # -- the verbs --------------------------------------------------------------------------
    def schedule(self, generated: Mapping[RequestKey, int]) -> Decision:
        decision = Decision()
        in_use = self.planned_blocks(generated)

        def busy() -> bool:  # into an idle engine something is always admitted: no stall
            return bool(self._rows or self._prefixes)

        while self._queue:
            group = self._queue[0]
            planned = group.planned
            if group.state is _PrefixState.PENDING:
                new_blocks = sum(1 for key in group.block_keys if key not in self._holders)
                need = new_blocks + 1 + self._row_demand(planned.rows[0], group, 0)
                if busy() and in_use + need > self._budget:
                    break
                in_use += self._hold(group)
                if self._uses_prefix_request(group):
                    prefix = self._batch.tokens_of(planned.rows[0])[: planned.prefix_len]
                    decision.submit.append(Submission(RequestKind.PREFIX, group.position, prefix, 1))
                    self._prefixes[group.position] = group
                    self.stats.prefix_requests += 1
                    in_use += 1  # the prefix request's own output block
                    group.state = _PrefixState.RUNNING
                else:
                    group.state = _PrefixState.READY
            if group.state is _PrefixState.RUNNING:
                break  # its rows wait for the prefix; later groups wait for their turn
            while not group.all_admitted:
                row = planned.rows[group.next_row]
                alone = planned.prefix_len // self._block + self._own_blocks(
                    int(self._lengths[row]) + int(self._max_tokens[row]), self._cache_hit(row, planned.prefix_len))
                if alone > self._capacity:
                    decision.reject.append((row, f"needs {alone} KV blocks with its output; the KV cache has "
                                                 f"{self._capacity} (block size {self._block})"))
                    group.next_row += 1
                    continue
                cost = self._row_demand(row, group, 0)
                if busy() and in_use + cost > self._budget:
                    self.stats.max_planned_blocks = max(self.stats.max_planned_blocks, in_use)
                    return decision
                decision.submit.append(Submission(RequestKind.ROW, row, self._batch.tokens_of(row), int(self._max_tokens[row])))
                self._rows[row] = group
                group.outstanding += 1
                group.next_row += 1
                in_use += cost
            if not group.all_admitted:
                break
            self._queue.popleft()
            if group.outstanding == 0:  # every row was rejected
                self._release(group)
        self.stats.max_planned_blocks = max(self.stats.max_planned_blocks, in_use)
        return decision

    def finish(self, finished: Finished) -> None:
        submission = finished.submission
        if submission.kind is RequestKind.PREFIX:
            group = self._prefixes.pop(submission.index)
            group.state = _PrefixState.READY
            self.stats.prefix_prompt_tokens += finished.prompt_tokens
            self.stats.prefix_cached_tokens += finished.cached_tokens
            return
        group = self._rows.pop(submission.index)
        group.outstanding -= 1
        if group.outstanding == 0 and group.all_admitted:
            self._release(group)  # the prefix may now be evicted

    def _uses_prefix_request(self, group: _GroupState) -> bool:
        planned = group.planned
        return (
            self._settings.prefix_requests
            and planned.prefix_len >= self._block
            and len(planned.rows) >= self._settings.min_group_rows
            and planned.prefix_len // self._block + 1 <= self._capacity
        )


class InOrderScheduler:
    """The plain baseline: every row at once, in the given order; vLLM schedules the rest."""

    def __init__(self, batch: TokenizedBatch, max_tokens: np.ndarray, rows: list[int]):
        self._pending = [Submission(RequestKind.ROW, r, batch.tokens_of(r), int(max_tokens[r])) for r in rows]
        self._unfinished = len(self._pending)
        self.stats = SchedulerStats()

    @property
    def done(self) -> bool:
        return self._unfinished == 0

    def schedule(self, generated: Mapping[RequestKey, int]) -> Decision:
        decision, self._pending = Decision(submit=self._pending), []
        return decision

    def finish(self, finished: Finished) -> None:
        self._unfinished -= 1
