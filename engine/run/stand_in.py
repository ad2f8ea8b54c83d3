"""A stand-in for vLLM with its KV block accounting in miniature: for the scheduler's unit tests,
``batchllm bench --scheduler-only`` (how full a GPU's batch runs) and the admission decision
(``run.admission``: would vLLM alone compute tokens twice). Never an end-to-end engine.

What it models, as vLLM's ``KVCacheManager`` does: a pool of ``num_blocks`` blocks (one kept as
the null block); full prompt blocks cached by the chained hash of their tokens and shared by
reference count; a new request reuses the cached blocks of its longest cached prefix and
allocates the rest; blocks are cached when they are allocated (``allocate_slots`` caches the
tokens it schedules), so a request admitted later in the same step shares them too;
output blocks allocated lazily, one when a decode crosses a block boundary; freed blocks stay
cached (evictable, least recently freed first); when a running request cannot get a block, the
most recently admitted one is preempted (its blocks freed, recomputed later). The KV usage it
reports is vLLM's: 1 - free / total, cached-but-unreferenced blocks counting as free.

Several KV cache groups (``KVGroups``: a model mixing full and sliding-window attention) allocate
from the one pool: a cached block stands for one block in each full-attention group, and each
sliding-window group holds a request's blocks up to its cap (what vLLM reserves for it), never shared;
once the request has its first token, up to its decoding hold: vLLM frees what the window has left
at the request's next allocation, before it admits anyone (freed here as the step ends: nothing is
allocated in between).

With ``max_num_batched_tokens`` a step computes at most that many tokens, as vLLM V1 schedules
them: running requests first (a prefill continues in chunks, a decode takes one token), then
waiting ones while tokens are left, the last of them possibly a partial (chunked) prefill; a
request gets its next token in a step that completes its prompt or decodes it. Without it, every
admitted prompt is computed in the step it enters.

It does no arithmetic on tokens: a request's answer is a function of its prompt alone, as greedy
decoding is; it runs to ``max_tokens`` unless ``answer_ends`` gives a row's answer an end before it
(its EOS, finish reason ``stop``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from engine.plan.block_hashes import RowBlocks
from engine.run.kv_budget import KVBudget, KVGroups
from engine.run.requests import Finished, RequestKind, StepReport, Submission


@dataclass(eq=False)
class _Block:
    hash: int | None = None
    refs: int = 0


@dataclass(eq=False)
class _Request:
    submission: Submission
    arrived: int
    generated: int = 0
    blocks: list[_Block] = field(default_factory=list)
    cached_tokens: int | None = None
    computed: int = 0  # prompt tokens in the KV cache (hits and computed chunks)
    prefilled: bool = False
    prompt_hashes: list[int] | None = None  # its whole prompt blocks' chained hashes, computed once
    window_blocks: int = 0  # what it holds in the sliding-window groups, all of them together

    @property
    def tokens(self) -> int:
        return len(self.submission.token_ids) + self.generated


class BlockAccountingEngine:
    """vLLM's scheduler and KV cache manager in blocks, no model: what the admission decision simulates
    in production (``admission.choose_admission``), and the engine of the scheduler's unit tests and
    the bench's ``--scheduler-only``."""

    def __init__(self, num_blocks: int, block_size: int = 4, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, steps_ahead: int = 0,
                 kv_groups: KVGroups = KVGroups(), says_queued: bool = False,
                 answer_ends: dict[int, int] | None = None):
        """``steps_ahead``: how many steps it runs beyond the report it returns (vLLM's async
        scheduling: 1), so requests submitted after reading step s enter at step s + 1 + steps_ahead.
        ``says_queued``: each report says how many (``queued_steps``), as vLLM's core in its own
        process shows them (its outputs queued for the client); async scheduling does not.
        ``answer_ends``: row -> the output tokens after which its answer ends (EOS), where before its limit."""
        self.block_size, self.kv_capacity_blocks, self.max_num_seqs = block_size, num_blocks, max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._budget = 0  # tokens left in the step being scheduled
        self.kv_groups = kv_groups
        self._kv = KVBudget(num_blocks, block_size, kv_groups)
        self._full = kv_groups.full  # pool blocks a cached block stands for
        self._fresh = self._kv.usable  # never-used free blocks (vLLM's null block is not one)
        self._evictable: OrderedDict[int, _Block] = OrderedDict()  # cached, unreferenced, by id
        self._cache: dict[int, _Block] = {}  # block hash -> cached block
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._arrivals = 0
        self.step_count = 0
        self.submitted: list[tuple[int, Submission]] = []  # (step, submission) in submission order
        self.sampling_of: dict = {}  # the sampling each request was submitted with
        self.finished_at: dict[tuple, int] = {}  # request key -> step it finished
        self.admitted_at: dict[tuple, int] = {}  # request key -> step it first left the waiting queue
        self.peak_referenced = 0
        self.preemptions = 0
        self.prefill_tokens = 0
        self.steps_ahead, self._says_queued = steps_ahead, says_queued
        self._unread: deque[StepReport] = deque()  # steps run, their reports not yet returned
        self.refuses: dict[str, str] = {}  # a response format's text -> why it is refused (a test sets it)
        self.asked: list[str] = []  # the formats asked about, in order
        self._answer_ends = answer_ends or {}

    # -- the engine protocol --------------------------------------------------------------------
    def refusal(self, sampling) -> str | None:
        fmt = sampling.response_format
        if fmt is None:
            return None
        self.asked.append(fmt.to_text())
        return self.refuses.get(fmt.to_text())

    def submit(self, submission: Submission, sampling, prompt_hashes: list[int] | None = None) -> None:
        """``prompt_hashes``: the prompt's chained block hashes if the caller has them (else computed here)."""
        self.submitted.append((self.step_count, submission))
        self.sampling_of[submission.key] = sampling
        self._waiting.append(_Request(submission, self._arrivals, prompt_hashes=prompt_hashes))
        self._arrivals += 1

    @property
    def generated(self) -> dict[tuple, int]:
        """Request key -> output tokens so far, while unfinished: exact counts, which vLLM's handle
        does not report (the tests check the scheduler's bound on them)."""
        return {r.submission.key: r.generated for r in self._running + self._waiting if r.generated}

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._unread)

    # A context manager like VLLMEngine: whoever opens it closes it.
    closed_by_owner = False
    info = None  # a real engine describes itself here (EngineInfo)

    def __enter__(self) -> "BlockAccountingEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.closed_by_owner = True

    def close(self) -> None:
        raise AssertionError("only the engine's owner closes it, by leaving its context")

    def step(self) -> StepReport:
        """Run one step (and, at the start, the ``steps_ahead`` before it); return the report of
        the step ``steps_ahead`` behind the last one run."""
        while (self._waiting or self._running) and len(self._unread) <= self.steps_ahead:
            self._unread.append(self._run_step())
        report = self._unread.popleft() if self._unread else StepReport()
        report.queued_steps = len(self._unread) if self._says_queued else 0
        return report

    def _run_step(self) -> StepReport:
        self.step_count += 1
        self._budget = self.max_num_batched_tokens or float("inf")
        preempted = self._grow_running()
        report = StepReport()
        scheduled = [request for request in self._running if self._schedule(request, report)]
        self._admit_waiting(scheduled, report)
        for request in scheduled:
            if request.computed < len(request.submission.token_ids):
                continue  # a chunk of its prompt: no token yet
            request.generated += 1
            submission = request.submission
            eos = submission.kind is RequestKind.ROW and request.generated >= self._answer_ends.get(
                submission.subject, submission.max_tokens)
            if eos or request.generated >= submission.max_tokens:
                self._running.remove(request)
                self._free(request)
                self.finished_at[request.submission.key] = self.step_count
                report.finished.append(Finished(
                    submission=request.submission, text=f"answer-{hash(request.submission.token_ids.tobytes())}",
                    token_ids=[0] * request.generated, prompt_tokens=len(request.submission.token_ids),
                    cached_tokens=request.cached_tokens or 0,
                    finish_reason="length" if request.generated >= submission.max_tokens else "stop"))
            else:
                self._free_what_windows_left(request)
                if request.generated == 1:
                    report.started.append(request.submission.key)
        self.peak_referenced = max(self.peak_referenced, self.referenced_blocks)
        report.kv_usage = 1 - self.free_blocks / self.kv_capacity_blocks
        report.running = len(self._running) + len(report.finished)
        report.preempted = preempted
        self.preemptions += preempted
        return report

    # -- block accounting ---------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return self._fresh + self._full * len(self._evictable)

    @property
    def referenced_blocks(self) -> int:
        return self._kv.usable - self.free_blocks

    def _reclaim(self, units: int) -> None:
        """Evict cached, unreferenced blocks (least recently freed first) until ``units`` are fresh."""
        while self._fresh < units and self._evictable:
            _, block = self._evictable.popitem(last=False)
            if self._cache.get(block.hash) is block:
                del self._cache[block.hash]
            self._fresh += self._full

    def _take(self) -> _Block:
        self._reclaim(self._full)
        self._fresh -= self._full
        return _Block(refs=1)

    def _take_window_blocks(self, request: _Request, blocks: int) -> None:
        self._reclaim(blocks)
        self._fresh -= blocks
        request.window_blocks += blocks

    def _free(self, request: _Request) -> None:
        for block in reversed(request.blocks):  # vLLM frees tail blocks first
            block.refs -= 1
            if block.refs == 0:
                if block.hash is None:
                    self._fresh += self._full
                else:
                    self._evictable[id(block)] = block
        request.blocks = []
        self._fresh += request.window_blocks
        request.window_blocks = 0

    def _blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _window_blocks_needed(self, tokens: int, decoding: bool = False) -> int:
        return int(self._kv.window_blocks(tokens, decoding))

    @staticmethod
    def _decoding(request: _Request) -> bool:
        return request.generated > 0 and request.computed >= len(request.submission.token_ids)

    def _missing(self, request: _Request) -> tuple[int, int]:
        """Cached-kind blocks and sliding-window blocks the request lacks for its next token."""
        return (self._blocks_needed(request.tokens) - len(request.blocks),
                self._window_blocks_needed(request.tokens, self._decoding(request)) - request.window_blocks)

    def _free_what_windows_left(self, request: _Request) -> None:
        """A decoding request's window blocks beyond its decoding hold go back to the pool."""
        if not request.window_blocks or not self.kv_groups.window_holds:  # every step of every row: no numpy
            return
        excess = request.window_blocks - self._window_blocks_needed(request.tokens, decoding=True)
        if excess > 0:
            request.window_blocks -= excess
            self._fresh += excess

    def _grow_running(self) -> int:
        """Each running request needs room for its next token; preempt the newest when full."""
        preempted = 0
        gone: set[int] = set()  # ids of the requests preempted here (a set: the batch holds ~1,000 at a GPU's sizes)
        for request in list(self._running):
            if id(request) in gone:
                continue
            blocks, window = self._missing(request)
            while blocks > 0 or window > 0:
                if self.free_blocks < self._full * max(blocks, 0) + max(window, 0):
                    victim = max(self._running, key=lambda r: r.arrived)
                    self._running.remove(victim)
                    gone.add(id(victim))
                    self._free(victim)
                    victim.prefilled = False
                    self._waiting.insert(0, victim)
                    preempted += 1
                    if victim is request:
                        break
                    continue
                request.blocks.extend(self._take() for _ in range(max(blocks, 0)))
                self._take_window_blocks(request, max(window, 0))
                blocks, window = self._missing(request)
        return preempted

    def _prompt_hashes(self, request: _Request) -> list[int]:
        if request.prompt_hashes is None:  # hashed as the planner and the scheduler hash a row
            tokens = request.submission.token_ids
            request.prompt_hashes = RowBlocks.of_tokens(tokens, np.array([0, len(tokens)]), self.block_size).chain(0)
        return request.prompt_hashes

    def _schedule(self, request: _Request, report: StepReport) -> bool:
        """A running request's tokens this step, from what is left of the step's budget."""
        prompt = len(request.submission.token_ids)
        if request.computed < prompt:  # its prefill goes on, in a chunk as large as the budget allows
            chunk = min(prompt - request.computed, self._budget)
            request.computed += chunk
            report.prefill_tokens += chunk
        elif self._budget >= 1:
            chunk = 1
            report.decode_tokens += 1
        else:
            return False
        self._budget -= chunk
        return chunk > 0

    def _admit_waiting(self, scheduled: list[_Request], report: StepReport) -> None:
        while self._waiting and len(self._running) < self.max_num_seqs and self._budget >= 1:
            request = self._waiting[0]
            hits = []
            for h in self._prompt_hashes(request):
                block = self._cache.get(h)
                if block is None:
                    break
                hits.append(block)
            if len(hits) * self.block_size >= len(request.submission.token_ids):
                hits = hits[:-1]  # vLLM recomputes the last token of a fully cached prompt
            need = self._blocks_needed(request.tokens) - len(hits)
            window = self._window_blocks_needed(request.tokens)
            evictable_hits = sum(1 for b in hits if b.refs == 0)
            if self._full * need + window > self.free_blocks - self._full * evictable_hits:
                if not self._running:
                    raise RuntimeError(f"{request.submission.request_id} can never fit the KV cache")
                break
            self._waiting.pop(0)
            self.admitted_at.setdefault(request.submission.key, self.step_count)
            for block in hits:
                if block.refs == 0:
                    del self._evictable[id(block)]
                block.refs += 1
            request.blocks = hits + [self._take() for _ in range(need)]
            self._take_window_blocks(request, window)
            if request.cached_tokens is None:
                request.cached_tokens = len(hits) * self.block_size
            self.prefill_tokens += request.tokens - len(hits) * self.block_size
            request.prefilled = True
            request.computed = len(hits) * self.block_size
            self._running.append(request)
            self._cache_prompt_blocks(request)
            # a preempted request recomputes its prompt and what it generated before the next token
            self._schedule(request, report)
            scheduled.append(request)

    def _cache_prompt_blocks(self, request: _Request) -> None:
        for block, h in zip(request.blocks, self._prompt_hashes(request)):
            if block.hash is None and h not in self._cache:
                block.hash = h
                self._cache[h] = block
