"""What passes between a scheduler and an engine: typed submissions, step reports, the protocol.

The scheduler decides what enters the engine and when; the engine (real vLLM in
``vllm_engine.VLLMEngine``, a block-accounting fake in the unit tests) runs what it was given
and reports, after each step, what finished and how far the others got.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..choice_scoring import ScoredAnswer
from ..settings import SamplingSettings


class RequestKind(enum.Enum):
    PREFIX = "prefix"  # a group's shared prefix alone, one output token: fills the prefix cache
    ROW = "row"  # a row of the batch


RequestKey = tuple[RequestKind, int]

ENGINE_FAILURES = ("error", "abort")  # vLLM's finish reasons of a request it did not answer


@dataclass(frozen=True, eq=False)
class Submission:
    """One request for the engine: a row of the batch, or a group's prefix (read ``row`` or
    ``group_position``, which say which one they are)."""

    kind: RequestKind
    subject: int  # the row (ROW) or the group's position in the plan (PREFIX)
    token_ids: np.ndarray
    max_tokens: int
    # The first tokens of ``token_ids`` as Python ints, one list shared by the rows of a group (its
    # prefix): converting a prompt to the list vLLM takes is a Python int per token, the largest
    # host cost of a submission (README, On GPUs); a group's rows convert only what follows it.
    shared_ids: list[int] | None = field(default=None, repr=False)

    def prompt_ids(self) -> list[int]:
        """The prompt as a new list of Python ints (the engine's own: never the shared one)."""
        if self.shared_ids is None:
            return self.token_ids.tolist()
        return self.shared_ids + self.token_ids[len(self.shared_ids):].tolist()

    @property
    def row(self) -> int:
        if self.kind is not RequestKind.ROW:
            raise AttributeError(f"a {self.kind.value} request has no row")
        return self.subject

    @property
    def group_position(self) -> int:
        if self.kind is not RequestKind.PREFIX:
            raise AttributeError(f"a {self.kind.value} request has no group position")
        return self.subject

    @property
    def key(self) -> RequestKey:
        return (self.kind, self.subject)

    @property
    def request_id(self) -> str:
        return f"{self.kind.value}-{self.subject}"


@dataclass
class Finished:
    """A request the engine finished."""

    submission: Submission
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop string that ended it (vLLM's; None: end of sequence)
    error: str | None = None  # why the engine refused it (see ``Engine.submit``)
    scored: ScoredAnswer | None = None  # a choice row scored, not decoded (engine/choice_scoring.py)
    reasoning: str | None = None  # a reasoning model's reasoning, apart from its answer (engine/reasoning.py)

    @property
    def failure(self) -> str | None:
        """Why this is no answer whatever its text (None: it may be one): the engine refused the
        request, or ended it itself (vLLM's ``error``: a grammar that rejected the model's tokens;
        ``abort``). Such a row is an error row, never reused by a later run."""
        if self.error:
            return self.error
        if self.finish_reason in ENGINE_FAILURES:
            return f"vLLM ended the request with finish_reason {self.finish_reason!r}"
        return None


@dataclass
class EngineGauges:
    """What the engine itself reported of a step: its KV usage in 0..1, requests running,
    preemptions, the prompt tokens it computed for requests whose prefill ended in the step, the
    output tokens it generated, and the tokens it computed again for requests it had preempted
    (their prompt and output so far, less what it found cached: what a preemption cost)."""

    kv_usage: float = 0.0
    running: int = 0
    preempted: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    recomputed_tokens: int = 0


@dataclass
class StepReport(EngineGauges):
    """What one engine step did: finished requests, requests that started, the engine's gauges,
    and the step's wall time (set by drive, for a per-step profile). Not the output tokens so far
    of each running request: vLLM emits a request's first output and its last only (see
    ``vllm_engine.STREAM_INTERVAL``), and the scheduler bounds the rest by the steps."""

    finished: list[Finished] = field(default_factory=list)
    started: list[RequestKey] = field(default_factory=list)  # unfinished requests that got their first token now
    seconds: float = 0.0
    # Steps the engine has run beyond this one, their outputs not read yet (vLLM's core in its own
    # process steps without waiting for the reader): rows hold that many tokens more than reported.
    queued_steps: int = 0

    @property
    def idle(self) -> bool:
        """The engine ran nothing in this step (vLLM holds back requests whose grammar is still being
        compiled on its thread pool): not a step of the run's work."""
        return (not self.finished and not self.started and self.running == 0 and self.prefill_tokens == 0
                and self.decode_tokens == 0)


class Engine(Protocol):
    """What a scheduler needs of an engine."""

    block_size: int
    kv_capacity_blocks: int  # vLLM's KV blocks, its null block included (``KVBudget``), known after start-up
    steps_ahead: int  # steps it may run beyond the last report read (vLLM's async scheduling: 1)

    def refusal(self, sampling: SamplingSettings) -> str | None:
        """Why this engine refuses every request with ``sampling`` (a response format its grammar
        backend cannot compile), None where it takes them: asked once per format before a run."""
        ...

    def submit(self, submission: Submission, sampling: SamplingSettings) -> None:
        """Hand a request to the engine. A request it refuses is not raised: it comes back finished,
        with its ``error``, from the next ``step``."""
        ...

    def step(self) -> StepReport: ...

    def has_unfinished(self) -> bool: ...
