"""Decide what enters the engine and when, in the manner of vLLM V1's scheduler interface
(``Scheduler``: ``schedule``, ``after_step``, ``finish``, ``done``, ``stats``).

``Planned`` (the engine's) asks ``admission.choose_admission`` who admits a batch: vLLM itself, in
plan order (``InOrderScheduler`` with a window), where group-wise admission cannot gain; else
``GroupScheduler``, BatchLLM's policy on an unmodified vLLM:

* groups enter in plan order, as many per step as the KV budget allows (vLLM's own batch limits
  cap a step); a group's prefix is computed once, by its first row (vLLM caches a block when it
  allocates it, so rows scheduled after it find the prefix), or by a prefix request of its own
  (``prefix_requests``) while later groups go on;
* rows are admitted while the KV blocks in flight stay under a share of the engine's capacity,
  counted as vLLM holds them: a prefix block by the chained hash of its tokens, once however many
  groups share it, held from the group's first row until its last finishes (explicit retention);
  each row by what it holds plus its reserved output (all of it with ``ReserveOutput.FULL``: no
  preemption; else the next ``lookahead_tokens``, vLLM growing output blocks lazily). All of it is
  the row's ``max_tokens``, or the length its job's answers were learned to take
  (``plan.answer_lengths``): a row outgrowing that is counted a block more every ``block_size``
  steps, as vLLM allocates them, up to its ``max_tokens``. The count is
  the tree's identity, not vLLM's KV gauge, which lags a step and counts a finished group's cached
  prefix as free; the gauge is still reported (``mean_kv_usage``).

``InOrder`` is a baseline's: every row at once in a given order, as ``LLM.generate`` does.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..plan.block_hashes import RowBlocks
from ..plan.common_prefix import common_tokens
from ..plan.prepared import PreparedBatch
from ..plan.tokenizing import TokenizedBatch
from ..settings import Admission, ReserveOutput, SchedulerSettings
from .admission import AdmissionChoice, EngineLimits, choose_admission
from .kv_budget import KVBudget, KVGroups
from .requests import Finished, RequestKey, RequestKind, Submission


@dataclass
class PlannedGroup:
    """A group of rows, in run order, that share their first ``prefix_tokens`` tokens (whole blocks)."""

    prefix_tokens: int
    rows: list[int]


def groups_in_run_order(
    rows: Iterable[int], group_of_row: np.ndarray, prefix_tokens_of_row: np.ndarray
) -> list[PlannedGroup]:
    """Split rows (already in run order) where the group changes."""
    groups: list[PlannedGroup] = []
    last = None
    for row in rows:
        group = int(group_of_row[row])
        if group != last:
            groups.append(PlannedGroup(prefix_tokens=int(prefix_tokens_of_row[row]), rows=[]))
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
    max_reserved_blocks: int = 0  # the most blocks admission counted at once (``blocks_in_flight``)
    admission: str = "vllm"  # who admitted the rows (settings.Admission), and why
    admission_reason: str = "a baseline: vLLM admits every row"


def group_prefix_keys(batch: TokenizedBatch, groups: list[PlannedGroup], block_size: int) -> RowBlocks:
    """The chained hashes of each group's whole prefix blocks (row ``i`` of the result is group
    ``i``'s prefix), hashed as the planner hashes rows: equal keys mean equal tokens from the start
    of the prompt up to the end of that block."""
    prefixes = [batch.tokens_of(g.rows[0])[: g.prefix_tokens - g.prefix_tokens % block_size] if g.rows else
                np.zeros(0, np.int32) for g in groups]
    offsets = np.concatenate([[0], np.cumsum([p.size for p in prefixes])]).astype(np.int64)
    tokens = np.concatenate(prefixes) if prefixes else np.zeros(0, np.int32)
    return RowBlocks.of_tokens(tokens, offsets, block_size)


class Scheduler(Protocol):
    """What the drive loop asks of a scheduler, as vLLM's ``SchedulerInterface`` is asked by its engine core."""

    stats: SchedulerStats

    @property
    def done(self) -> bool:
        """Every row submitted (or rejected) and finished."""
        ...

    def schedule(self) -> Decision:
        """What to submit before the next engine step, and the rows that can never run."""
        ...

    def after_step(self, started: list[RequestKey], queued_steps: int = 0) -> None:
        """An engine step ran; ``started``: the requests that got their first output token in it;
        ``queued_steps``: steps the engine ran beyond it whose reports are still to be read."""
        ...

    def finish(self, finished: Finished) -> None:
        """The engine finished a request."""
        ...

    @property
    def blocks_in_flight(self) -> int | None:
        """The KV blocks it counts in flight (the progress line shows them); None: it counts none."""
        ...


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
    prefix_ids: list[int] | None = None  # its prefix's token ids, while its rows are being admitted

    @property
    def all_admitted(self) -> bool:
        return self.next_row == len(self.planned.rows)


@dataclass
class _RowAccount:
    """How a row in the engine is counted: its blocks before any output (``base``), its cache hit
    in blocks, and, once it decodes, the steps after which its count grows by one block (every
    block_size steps from ``first_growth``, ``growths`` times)."""

    base: int
    hit_blocks: int  # whole blocks of its prompt it finds cached (its group's, or its neighbour's)
    weight: int = 1  # pool blocks its count grows by per block of tokens (every group it does not cap)
    first_growth: int | None = None
    growths: int = 0
    growing: bool = False  # counted in its phase's growing rows


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
        steps_ahead: int = 0,
        kv_groups: KVGroups = KVGroups(),
        counted_output: np.ndarray | None = None,
    ):
        """``steps_ahead``: steps the engine may run beyond the last report read (vLLM's async
        scheduling plans step s + 1 before step s's outputs are read): each row may hold that many
        tokens more than the reports show, so it is counted with as many more of its output. The count
        is in the pool's blocks, which ``kv_groups`` (the model's KV cache groups) share.
        ``counted_output``: each row's output as a full reservation counts it (default its ``max_tokens``;
        the learned answer length, ``PreparedBatch.counted_output``)."""
        self._batch, self._settings, self._block = batch, settings, block_size
        # Python ints: read once per admission, a numpy scalar costs more than the arithmetic.
        self._lengths, self._max_tokens = batch.lengths.tolist(), [int(m) for m in max_tokens]
        # A row's reserved end after g output tokens is L + min(max_tokens, max(floor, g + lookahead)):
        # a full reservation's floor is its counted output (grown past only by a row that outgrows a
        # learned length), a lookahead's is 0 (the next tokens only).
        full = settings.reserve_output is ReserveOutput.FULL
        self._floor = ([int(m) for m in (max_tokens if counted_output is None else counted_output)] if full
                       else [0] * len(self._max_tokens))
        self._lookahead = steps_ahead + (0 if full else settings.lookahead_tokens)
        self._kv = KVBudget(capacity_blocks, block_size, kv_groups)
        # Pool blocks per shared prefix block; what the prefix requests in the engine hold beyond those.
        self._per_shared, self._prefix_blocks = self._kv.per_shared_block, 0
        self._capacity, self._budget = self._kv.usable, self._kv.share(settings.kv_budget_fraction)
        self._entry_blocks, self._prefix_hit_blocks, self._too_large = self._row_constants(groups)
        keys = group_prefix_keys(batch, groups, block_size)
        self._queue = deque(
            _GroupState(position, g, keys.chain(position)) for position, g in enumerate(groups) if g.rows
        )
        self._open: list[_GroupState] = []  # admitted groups with rows left to admit, in plan order
        self._shares_deeper, self._prefix_shared = self._compare_neighbours(groups)
        self._next_sharer = {previous: row for row, (previous, _) in self._shares_deeper.items()}
        self._holders: Counter[int] = Counter()  # prefix block key -> groups holding it
        self._rows: dict[int, _GroupState] = {}  # rows in the engine
        self._prefixes: dict[int, _GroupState] = {}  # prefix requests in the engine, by group position
        # What the rows in the engine hold and are reserved for, kept up to date by events instead of
        # recounted every step (a GPU runs thousands of rows at once): each row's blocks are a
        # function of how many tokens it has generated, bounded above by the engine steps since its
        # first token (one token per step at most: vLLM without speculative decoding), so a row's
        # count grows by one block every block_size steps while its lookahead window still grows.
        self._steps = 0  # engine steps run so far: those read, and those the engine ran ahead of them
        self._reports = 0  # engine steps whose reports were read
        self._row_blocks = 0  # blocks of the rows in the engine
        self._accounts: dict[int, _RowAccount] = {}  # row -> how its blocks are counted
        self._growing = [0] * block_size  # rows whose count grows after steps of this phase (step % block_size)
        self._growth_ends: dict[int, list[int]] = {}  # step -> rows whose count grows for the last time then
        # step -> rows whose first growth is a phase round after it (past a learned length, more than
        # block_size steps after their first token): counted in their phase from then on
        self._growth_starts: dict[int, list[int]] = {}
        self.stats = SchedulerStats(budget_blocks=self._budget)

    def _compare_neighbours(self, groups: list[PlannedGroup]) -> tuple[dict[int, tuple[int, int]], set[int]]:
        """Each row against the row before it in its group: the rows sharing more than their group's
        prefix with it (a document asked two questions inside a larger group), row -> (that row,
        whole-block tokens they share); and the groups whose rows all begin with their prefix's tokens
        (every one the planner makes), whose rows' prompts are built on one list of the prefix's ids
        (``Submission.shared_ids``), which is only ever done where the tokens were compared here."""
        shares_deeper: dict[int, tuple[int, int]] = {}
        prefix_shared: set[int] = set()
        for position, g in enumerate(groups):
            shared = len(g.rows) > 1 and g.prefix_tokens > 0
            for previous, row in zip(g.rows, g.rows[1:]):
                same = common_tokens(self._batch.tokens_of(previous), self._batch.tokens_of(row))
                shared = shared and same >= g.prefix_tokens
                common = same - same % self._block
                if common > g.prefix_tokens:
                    shares_deeper[row] = (previous, common)
            if shared:
                prefix_shared.add(position)
        return shares_deeper, prefix_shared

    def _row_constants(self, groups: list[PlannedGroup]) -> tuple[list[int], list[int], dict[int, int]]:
        """What admitting a row reads, computed for every row at once: the blocks its prompt and its
        reserved output end in at admission (``_blocks_at`` with nothing generated, before its cache
        hit), the whole blocks of its group's prefix it finds cached (``_cache_hit``), and the rows
        that need more blocks than the whole cache even alone, with what they need (rejected when
        their turn comes). Each row's sliding-window counts (``KVBudget.window_weights``) are kept too."""
        block, lengths = self._block, np.asarray(self._lengths, dtype=np.int64)
        max_tokens = np.asarray(self._max_tokens, dtype=np.int64)
        prefix = np.zeros(lengths.size, dtype=np.int64)
        for g in groups:
            prefix[g.rows] = g.prefix_tokens
        ahead = np.minimum(max_tokens, np.maximum(np.asarray(self._floor, dtype=np.int64), self._lookahead))
        hit_blocks = np.maximum(0, np.minimum(prefix, (lengths - 1) // block * block)) // block
        # Alone, a row holds its whole prompt and output; a copy of a cached prefix (hit capped at
        # length - 1) one block more in each full-attention group.
        alone = self._kv.alone_blocks(lengths + max_tokens) + self._kv.groups.full * (prefix // block - hit_blocks)
        growing, constant = self._kv.window_weights(lengths + max_tokens)  # sliding-window groups, per row
        self._window_growing, self._constant = growing.tolist(), constant.tolist()
        decoding = self._kv.window_weights(lengths + max_tokens, decoding=True)  # once it decodes
        self._decode_growing, self._decode_constant = decoding[0].tolist(), decoding[1].tolist()
        self._weight = (growing + self._kv.groups.full).tolist()
        entry_blocks = -(-(lengths + ahead) // block)
        too_large = np.flatnonzero(alone > self._capacity)
        return entry_blocks.tolist(), hit_blocks.tolist(), dict(zip(too_large.tolist(), alone[too_large].tolist()))

    @property
    def done(self) -> bool:
        """Every row submitted (or rejected) and finished."""
        return not self._queue and not self._open and not self._rows and not self._prefixes

    # -- block accounting -------------------------------------------------------------------
    def _cache_hit(self, row: int, shared: int) -> int:
        """Of ``shared`` leading tokens in the cache, those vLLM reuses for the row: a hit is capped at
        the prompt's length - 1 (``KVCacheManager.get_computed_blocks``), so a prompt that is wholly
        a cached, block-aligned prefix (a duplicate row) recomputes its last block in a block of its own."""
        return max(0, min(shared, (self._lengths[row] - 1) // self._block * self._block))

    def _shared_len(self, row: int, group: _GroupState) -> int:
        """Leading tokens of the row that vLLM finds in flight: its group's prefix, or more while
        the row before it, with which it shares more, is in the engine too."""
        previous, common = self._shares_deeper.get(row, (None, 0))
        if previous not in self._rows:
            return self._cache_hit(row, group.planned.prefix_tokens)
        # Only what the row before holds as the blocks a lookup finds: a prompt that is wholly the
        # common part recomputed its last block (its hit is capped at length - 1), and where that
        # content was cached already its copy is not what vLLM's lookup returns (the first cached
        # block of a hash): the row would reference the other block, one more than shared.
        return self._cache_hit(row, self._cache_hit(previous, common))

    def _row_demand(self, row: int, group: _GroupState, generated: int) -> int:
        """The row's blocks by its exact generated tokens (``blocks_held``)."""
        return self._blocks_at(row, generated, self._shared_len(row, group) // self._block)

    @property
    def blocks_in_flight(self) -> int:
        """What admission counts now, in pool blocks: prefix blocks once, each prefix request's output
        block, and each row's blocks by the upper bound on its generated tokens (never fewer than it holds)."""
        return self._per_shared * len(self._holders) + self._prefix_blocks + self._row_blocks

    def _blocks_at(self, row: int, generated: int, hit_blocks: int) -> int:
        """A row's blocks beyond its cache hit when it has generated ``generated`` tokens: what it
        holds plus what it is reserved (all its output, or the next ``lookahead_tokens``)."""
        end = self._lengths[row] + min(self._max_tokens[row], max(self._floor[row], generated + self._lookahead))
        return self._pool_blocks(row, -(-end // self._block), hit_blocks, generated > 0)

    def _pool_blocks(self, row: int, blocks: int, hit_blocks: int, decoding: bool = False) -> int:
        """A row's count when its tokens and reservation end in its ``blocks``-th block: each full-attention
        group's blocks beyond its cache hit, and the sliding-window groups' blocks, none shared (a
        decoding row's: what its windows hold once vLLM freed what they left)."""
        full = self._kv.groups.full * max(1, blocks - hit_blocks)
        if decoding:
            return full + self._decode_growing[row] * blocks + self._decode_constant[row]
        return full + self._window_growing[row] * blocks + self._constant[row]

    def after_step(self, started, queued_steps: int = 0) -> None:
        """An engine step's report was read; ``started``: the requests that got their first output
        token in it; ``queued_steps``: steps the engine ran beyond it, not read yet (vLLM's core in
        its own process steps without waiting). A row that got its first token in step f has
        generated at most s - f + 1 tokens after step s (one token per step at most: vLLM without
        speculative decoding), s counting the steps run, read or queued, so its reserved end
        L + g + lookahead crosses into a new block at g = g1, g1 + B, ... until it reaches
        L + max_tokens: its count grows by one block every B steps, kept per phase (step % B) so
        that a step costs O(1) plus the rows that start or stop growing. A full reservation grows only
        past a learned length (its floor), then as a lookahead does."""
        self._reports += 1
        first_token_step = self._reports  # never behind the count: ``_steps >= first_token_step - 1``
        for kind, row in started:
            account = self._accounts.get(row) if kind is RequestKind.ROW else None
            if account is not None and account.first_growth is None:
                self._now_decoding(row, account)
                self._start_growing(row, account, first_token_step)
        while self._steps < first_token_step + queued_steps:
            self._advance()

    def _advance(self) -> None:
        """One more engine step on the count: the rows of its phase grow, some for the last time; rows
        whose first growth is a round of phases away join theirs."""
        self._steps += 1
        self._row_blocks += self._growing[self._steps % self._block]
        for row in self._growth_ends.pop(self._steps, ()):
            account = self._accounts.get(row)
            if account is not None and account.growing:
                account.growing = False
                self._growing[account.first_growth % self._block] -= account.weight
        for row in self._growth_starts.pop(self._steps, ()):
            account = self._accounts.get(row)
            if account is not None:  # still in the engine: its first growth is the next step of its phase
                account.growing = True
                self._growing[account.first_growth % self._block] += account.weight

    def _now_decoding(self, row: int, account: _RowAccount) -> None:
        """The row got its first token: from its next step vLLM frees what its sliding windows have left
        (before it admits another row), so its count there becomes a decoding row's, before any growth."""
        if not self._kv.groups.window_holds:
            return
        blocks = self._entry_blocks[row]  # where its tokens and reservation end before any output
        prefill = self._window_growing[row] * blocks + self._constant[row]
        change = self._decode_growing[row] * blocks + self._decode_constant[row] - prefill
        account.base += change
        account.weight = self._kv.groups.full + self._decode_growing[row]
        self._row_blocks += change

    def _start_growing(self, row: int, account: _RowAccount, first_token_step: int) -> None:
        """The row got its first token in ``first_token_step``: its growths from then on, those the
        engine's steps run ahead already reached counted now."""
        length, max_tokens = self._lengths[row], self._max_tokens[row]
        reach = length + min(max_tokens, max(self._floor[row], self._lookahead))  # its reserved end at g = 0
        growths = -(-(length + max_tokens) // self._block) - -(-reach // self._block)
        if growths <= 0:
            return
        # the first g whose end L + g + lookahead is in a block beyond reach's
        g1 = -(-reach // self._block) * self._block - (length + self._lookahead) + 1
        account.first_growth = first_token_step - 1 + g1  # the step after which the row has g1 tokens
        account.growths = growths
        grown = self._blocks_of(account) - account.base  # reached already (the engine ran ahead)
        self._row_blocks += grown
        last = account.first_growth + (growths - 1) * self._block
        if last > self._steps:
            # Counted in its phase only from the round before its first growth: a phase's rows grow at
            # every step of that phase (a learned length puts a first growth rounds away).
            joins = account.first_growth - self._block
            if joins > self._steps:
                self._growth_starts.setdefault(joins, []).append(row)
            else:
                account.growing = True
                self._growing[account.first_growth % self._block] += account.weight
            self._growth_ends.setdefault(last, []).append(row)

    def _blocks_of(self, account: _RowAccount) -> int:
        """The account's blocks now: its base and the growths applied up to this step."""
        if account.first_growth is None or self._steps < account.first_growth:
            return account.base
        grown = min(account.growths, (self._steps - account.first_growth) // self._block + 1)
        return account.base + account.weight * grown

    def _release_row(self, row: int) -> None:
        """The row left the engine: its blocks are free, and the row that shared more than its
        group's prefix with it (a document's next question) now holds those blocks itself."""
        account = self._accounts.pop(row)
        self._row_blocks -= self._blocks_of(account)
        if account.growing:
            self._growing[account.first_growth % self._block] -= account.weight
        sharer = self._next_sharer.get(row)
        neighbour = self._accounts.get(sharer) if sharer is not None else None
        if neighbour is not None:
            own_hit = self._cache_hit(sharer, self._rows[sharer].planned.prefix_tokens) // self._block
            more = self._kv.groups.full * (neighbour.hit_blocks - own_hit)
            self._row_blocks += more
            neighbour.base += more
            neighbour.hit_blocks = own_hit

    def blocks_held(self, generated: Mapping[RequestKey, int]) -> int:
        """Blocks everything in flight holds by the rows' exact generated tokens (an engine that knows
        them: the block-accounting one's), shared prefix blocks once: what admission reserves
        (``blocks_in_flight``) is never less."""
        rows = sum(
            self._row_demand(row, group, generated.get((RequestKind.ROW, row), 0)) for row, group in self._rows.items()
        )
        return self._per_shared * len(self._holders) + self._prefix_blocks + rows

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
    def schedule(self) -> Decision:
        """What to submit before the next engine step, in plan order, until the budget is spent:
        first the rows of groups already admitted whose prefix is ready, then new groups. A group
        whose prefix request is still running holds back only its own rows: later groups go on
        (many small groups per step, as vLLM alone would batch them). Its cost grows with what it
        admits, not with the rows in flight: the count is kept by events (``blocks_in_flight``,
        see ``after_step``)."""
        decision = Decision()
        for group in list(self._open):
            if group.state is _PrefixState.RUNNING:
                continue  # its rows wait for the prefix; later groups do not
            if not self._admit_rows(group, decision):
                return self._scheduled(decision)
            self._open.remove(group)
        while self._queue:
            group = self._queue[0]
            if not self._admit_group(group, decision):
                break
            self._queue.popleft()
            if group.state is _PrefixState.RUNNING:
                self._open.append(group)
                continue
            if not self._admit_rows(group, decision):
                self._open.append(group)
                break
        return self._scheduled(decision)

    def _scheduled(self, decision: Decision) -> Decision:
        self.stats.max_reserved_blocks = max(self.stats.max_reserved_blocks, self.blocks_in_flight)
        return decision

    def _busy(self) -> bool:
        """Something is in the engine: into an idle engine something is always admitted (no stall)."""
        return bool(self._rows or self._prefixes)

    def _admit_group(self, group: _GroupState, decision: Decision) -> bool:
        """Hold the group's prefix blocks if its first row fits the budget with them. Its prefix is
        computed by a prefix request only when some of its blocks are not held yet and its rows
        cannot all enter now: rows that enter in the same step share the prefix anyway (vLLM caches
        a block when it allocates it, so the first row's prefix blocks are cache hits for the rows
        scheduled after it), and a prefix request would hold them back a step."""
        planned = group.planned
        new_blocks = sum(1 for key in group.block_keys if key not in self._holders)
        first = planned.rows[0]
        need = (self._per_shared * new_blocks + self._prefix_request_blocks(group)
                + self._entry_cost(first, self._prefix_hit_blocks[first]))
        if self._busy() and self.blocks_in_flight + need > self._budget:
            return False
        # A prefix request computes the prefix before the rows need it: not when every block of it is
        # already held (a shared system prompt cached by the groups in flight), nor when all its rows
        # enter now and share it in this step anyway.
        needs_computing = (new_blocks > 0 and self.blocks_in_flight + self._per_shared * new_blocks
                           + self._rows_cost(group) > self._budget)
        self._hold(group)
        if self._uses_prefix_request(group) and needs_computing:
            prefix = self._batch.tokens_of(first)[: planned.prefix_tokens]
            decision.submit.append(Submission(RequestKind.PREFIX, group.position, prefix, 1, self._prefix_ids(group)))
            self._prefixes[group.position] = group
            self._prefix_blocks += self._prefix_request_blocks(group)
            self.stats.prefix_requests += 1
            group.state = _PrefixState.RUNNING
        else:
            group.state = _PrefixState.READY
        return True

    def _rows_cost(self, group: _GroupState) -> int:
        """The blocks the group's rows take at admission beyond its prefix, all of them entering at
        once (each row's deeper sharing with the row before it counted once)."""
        total = 0
        for row in group.planned.rows:
            previous, common = self._shares_deeper.get(row, (None, 0))  # as _shared_len counts it
            hit_blocks = (self._cache_hit(row, self._cache_hit(previous, common)) // self._block
                          if previous is not None else self._prefix_hit_blocks[row])
            total += self._entry_cost(row, hit_blocks)
        return total

    def _entry_cost(self, row: int, hit_blocks: int) -> int:
        """The row's blocks at admission beyond its cache hit: ``_blocks_at(row, 0, hit_blocks)``."""
        return self._pool_blocks(row, self._entry_blocks[row], hit_blocks)

    def _admit_rows(self, group: _GroupState, decision: Decision) -> bool:
        """Submit the group's next rows while they fit the budget; False when one did not."""
        planned = group.planned
        busy, left = self._busy(), self._budget - self.blocks_in_flight
        while not group.all_admitted:
            row = planned.rows[group.next_row]
            alone = self._too_large.get(row)
            if alone is not None:
                decision.reject.append((row, self._kv.too_large_reason(alone)))
                group.next_row += 1
                continue
            hit_blocks = (self._shared_len(row, group) // self._block if row in self._shares_deeper
                          else self._prefix_hit_blocks[row])
            cost = self._entry_cost(row, hit_blocks)
            if busy and cost > left:
                return False
            busy, left = True, left - cost
            decision.submit.append(Submission(RequestKind.ROW, row, self._batch.tokens_of(row), self._max_tokens[row],
                                              self._prefix_ids(group)))
            self._rows[row] = group
            self._accounts[row] = _RowAccount(cost, hit_blocks, self._weight[row])
            self._row_blocks += cost
            group.outstanding += 1
            group.next_row += 1
        group.prefix_ids = None  # every row has its prompt
        if group.outstanding == 0:  # every row was rejected
            self._release(group)
        return True

    def _prefix_ids(self, group: _GroupState) -> list[int] | None:
        """The group's prefix as Python ints, converted once for all its rows (see ``__init__``)."""
        if group.prefix_ids is None and group.position in self._prefix_shared:
            group.prefix_ids = self._batch.tokens_of(group.planned.rows[0])[: group.planned.prefix_tokens].tolist()
        return group.prefix_ids

    def finish(self, finished: Finished) -> None:
        submission = finished.submission
        if submission.kind is RequestKind.PREFIX:
            group = self._prefixes.pop(submission.group_position)
            self._prefix_blocks -= self._prefix_request_blocks(group)
            group.state = _PrefixState.READY
            self.stats.prefix_prompt_tokens += finished.prompt_tokens
            self.stats.prefix_cached_tokens += finished.cached_tokens
            return
        group = self._rows.pop(submission.row)
        self._release_row(submission.row)
        group.outstanding -= 1
        if group.outstanding == 0 and group.all_admitted:
            self._release(group)  # the prefix may now be evicted

    def _uses_prefix_request(self, group: _GroupState) -> bool:
        planned = group.planned
        return (
            self._settings.prefix_requests
            and planned.prefix_tokens >= self._block
            and len(planned.rows) >= self._settings.min_group_rows
            and self._per_shared * (planned.prefix_tokens // self._block) + self._prefix_request_blocks(group)
            <= self._capacity
        )

    def _prefix_request_blocks(self, group: _GroupState) -> int:
        """A prefix request's blocks beyond the group's shared prefix: its output block in each
        full-attention group, and its prompt and output in the sliding-window groups."""
        return self._per_shared + int(self._kv.window_blocks(group.planned.prefix_tokens + 1))




class InOrderScheduler:
    """The rows in the given order; vLLM admits them (the baselines', and the engine's where group-wise
    admission cannot gain). ``rejected``: rows that can never run, with the reason.

    ``window``: at most this many rows submitted and unfinished at once (None: every row at once, as
    ``LLM.generate``). vLLM admits from the head of its waiting queue, at most ``max_num_seqs`` running,
    so a window that keeps that many waiting beyond the running ones, for every step it may plan ahead,
    gives vLLM's schedule of all rows at once (``window_for``) without a shard's every prompt in its queue."""

    def __init__(self, batch: TokenizedBatch, max_tokens: np.ndarray, rows: list[int],
                 rejected: dict[int, str] | None = None, window: int | None = None):
        self._batch, self._max_tokens = batch, max_tokens
        self._rejected = dict(rejected or {})
        self._pending = deque(r for r in rows if r not in self._rejected)
        self._unfinished = len(self._pending)
        self._in_flight = 0
        self._window = window or len(self._pending)
        self.stats = SchedulerStats()

    @staticmethod
    def window_for(limits: EngineLimits) -> int:
        return (2 + limits.steps_ahead) * limits.max_num_seqs

    @property
    def done(self) -> bool:
        return self._unfinished == 0

    def schedule(self) -> Decision:
        decision = Decision(reject=list(self._rejected.items()))
        self._rejected = {}
        while self._pending and self._in_flight < self._window:
            row = self._pending.popleft()
            decision.submit.append(Submission(RequestKind.ROW, row, self._batch.tokens_of(row),
                                              int(self._max_tokens[row])))
            self._in_flight += 1
        return decision

    def after_step(self, started, queued_steps: int = 0) -> None:
        pass

    def finish(self, finished: Finished) -> None:
        self._unfinished -= 1
        self._in_flight -= 1

    @property
    def blocks_in_flight(self) -> None:
        return None  # vLLM admits: only vLLM counts


def rows_too_large(batch: TokenizedBatch, max_tokens: np.ndarray, rows: list[int],
                   limits: EngineLimits) -> dict[int, str]:
    """Rows that need more KV blocks than the whole cache even alone, with the reason."""
    kv = KVBudget(limits.capacity_blocks, limits.block_size, limits.kv_groups)
    blocks = kv.alone_blocks(batch.lengths[rows].astype(np.int64) + np.asarray(max_tokens)[rows])
    return {int(rows[i]): kv.too_large_reason(int(blocks[i])) for i in np.flatnonzero(blocks > kv.usable)}


# -- how a run schedules its rows: injected into ``BatchRun`` -----------------------------------
class Scheduling(Protocol):
    """How a run schedules its rows: it builds the run's scheduler (``Planned``, or a baseline's ``InOrder``)."""

    shares_answers: bool  # rows identical to another run once and take its answer

    def scheduler(self, prepared: PreparedBatch, rows_in_plan_order: list[int], settings: SchedulerSettings,
                  limits: EngineLimits) -> Scheduler: ...


@dataclass(frozen=True)
class Planned:
    """BatchLLM: the plan's groups in run order, admitted group-wise under the KV budget where that
    can gain, else by vLLM in plan order (``admission``); rows identical to another run once and
    share its answer (where sampling makes answers shareable)."""

    shares_answers = True

    def scheduler(self, prepared: PreparedBatch, rows_in_plan_order: list[int], settings: SchedulerSettings,
                  limits: EngineLimits) -> Scheduler:
        batch, max_tokens, counted = prepared.batch, prepared.max_tokens, prepared.counted_output
        too_large = rows_too_large(batch, max_tokens, rows_in_plan_order, limits)  # a row may still run to its limit
        if settings.admission is Admission.AUTO:
            choice = choose_admission(batch, counted, [r for r in rows_in_plan_order if r not in too_large],
                                      limits, settings.prefix_requests)
        else:
            choice = AdmissionChoice(settings.admission, f"scheduler.admission: {settings.admission.value}")
        if choice.admission is Admission.VLLM:
            scheduler = InOrderScheduler(batch, max_tokens, rows_in_plan_order, too_large,
                                         InOrderScheduler.window_for(limits))
        else:
            groups = groups_in_run_order(rows_in_plan_order, prepared.group_of_row, prepared.prefix_tokens_of_row)
            scheduler = GroupScheduler(batch, max_tokens, groups, settings, limits.block_size,
                                       limits.capacity_blocks, limits.steps_ahead, limits.kv_groups, counted)
        learned = prepared.answer_lengths
        scheduler.stats.admission, scheduler.stats.admission_reason = choice.admission.value, choice.reason + (
            f" (each row's output counted as {learned.describe()}, never above its max_tokens)" if learned else "")
        return scheduler


@dataclass(frozen=True)
class InOrder:
    """A baseline (the bench's): every row, identical ones too, submitted at once in ``order``,
    admitted by vLLM alone, as ``LLM.generate`` would."""

    order: list[int]
    shares_answers = False

    def scheduler(self, prepared: PreparedBatch, rows_in_plan_order: list[int], settings: SchedulerSettings,
                  limits: EngineLimits) -> Scheduler:
        return InOrderScheduler(
            prepared.batch, prepared.max_tokens, [r for r in self.order if r not in prepared.errors]
        )
