"""Choice answers scored, not decoded: each choice's probability from one forward pass of the prompt.

A row constrained to a list of choices is answered by reading, after its prompt, the model's
probability of each choice's tokens (the tokenizer's own spelling of the choice: the answer is the
exact string, as under vLLM's grammar) instead of decoding one token at a time under a grammar. The
choices' tokens form a tree; only where it branches is the model asked, once per branch point, for
the log probabilities of the tokens that continue there (the end of the answer among them where one
choice ends and a longer one goes on). Where every choice starts with its own token, that is the
prompt alone: one request of one output token, no decode step.

A choice's probability is the product, along its path, of each branch's probability among the
branches there: the probability that decoding restricted to the choices' own spellings yields that
choice. The answer is the most probable choice. vLLM's own ``generative_scoring`` reads label
probabilities the same way (``max_tokens=1``, ``logprob_token_ids``, a softmax over the labels).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SCORED_ANSWER_TOKENS = 1  # a scoring request's output: one token, sampled and thrown away

# vLLM 0.32's bound on ``SamplingParams.logprob_token_ids`` (``MAX_LOGPROB_TOKEN_IDS``): the most
# tokens one branch point may ask for (tests/test_gpu_path.py checks it against vLLM's).
MAX_BRANCHES = 128


@dataclass(frozen=True)
class BranchPoint:
    """Where the choices' token paths part: after ``prefix`` (tokens following the prompt), the
    next token is one of ``tokens``."""

    prefix: tuple[int, ...]
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class ChoiceTree:
    """The choices of a row as token paths, and the branch points at which the model is asked."""

    choices: tuple[str, ...]
    branch_points: tuple[BranchPoint, ...]
    # Each choice's path: (branch point, the index of its token there) at every branch it passes.
    paths: tuple[tuple[tuple[int, int], ...], ...]

    @classmethod
    def build(cls, choices: Sequence[str], encode: Callable[[str], list[int]],
              eos_token_id: int | None) -> "ChoiceTree":
        """Raises ValueError where the choices cannot be scored (a choice of no tokens, two choices
        spelled alike, one choice the start of another and no end-of-sequence token, a branch point
        of more than ``MAX_BRANCHES`` tokens: what one request reads)."""
        choices = tuple(dict.fromkeys(choices))  # a choice listed twice is one choice
        spelled = [tuple(encode(c)) for c in choices]
        if any(not tokens for tokens in spelled):
            raise ValueError("a choice has no tokens")
        if len(set(spelled)) != len(spelled):
            raise ValueError("two choices are spelled with the same tokens")
        ends_here = [(*tokens, None) for tokens in spelled]  # None: the answer ends (EOS)
        if eos_token_id is None and any(a != b and b[:len(a)] == a for a in spelled for b in spelled):
            raise ValueError("one choice is the start of another and the tokenizer has no end-of-sequence token")
        points: list[BranchPoint] = []
        paths: list[list[tuple[int, int]]] = [[] for _ in choices]

        def split(members: list[int], depth: int) -> None:
            by_next: dict[int | None, list[int]] = {}
            for m in members:
                by_next.setdefault(ends_here[m][depth], []).append(m)
            if len(by_next) > 1:
                if len(by_next) > MAX_BRANCHES:
                    raise ValueError(f"{len(by_next)} choices part at one token, and one vLLM request reads at most "
                                     f"{MAX_BRANCHES}: decode them (score_choices: false)")
                tokens = tuple(eos_token_id if t is None else t for t in by_next)
                points.append(BranchPoint(spelled[members[0]][:depth], tokens))
                for index, group in enumerate(by_next.values()):
                    for m in group:
                        paths[m].append((len(points) - 1, index))
            for token, group in by_next.items():
                if token is not None and len(group) > 1:  # one choice alone has nothing left to part
                    split(group, depth + 1)

        if len(choices) > 1:
            split(list(range(len(choices))), 0)
        return cls(choices, tuple(points), tuple(tuple(p) for p in paths))

    def probabilities(self, logprobs: Sequence[Sequence[float]]) -> dict[str, float]:
        """Each choice's probability, from the log probabilities the model gave each branch point's
        tokens (``logprobs[i][j]``: point i, token j)."""
        shares = [_softmax(values) for values in logprobs]
        return {choice: math.prod(shares[point][index] for point, index in path)
                for choice, path in zip(self.choices, self.paths)}


def _softmax(logprobs: Sequence[float]) -> list[float]:
    top = max(logprobs)
    if top == -math.inf:  # the model gives none of them any probability: all alike
        return [1 / len(logprobs)] * len(logprobs)
    weights = [math.exp(v - top) for v in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


@dataclass(frozen=True)
class ScoredAnswer:
    """The most probable choice, its probability and every choice's."""

    text: str
    probability: float
    probabilities: dict[str, float]

    @classmethod
    def of(cls, probabilities: dict[str, float]) -> "ScoredAnswer":
        best = max(probabilities, key=probabilities.__getitem__)  # the first listed of equals
        return cls(best, probabilities[best], probabilities)

    def probabilities_json(self) -> str:
        return json.dumps({c: round(p, 6) for c, p in self.probabilities.items()})


def needs_review(probability: float | None, review_below: float | None) -> bool | None:
    """Whether a scored answer is marked for review: its probability under ``review_below``. None
    where nothing is to be judged (no threshold, or an answer that was not scored)."""
    if review_below is None or probability is None:
        return None
    return probability < review_below
