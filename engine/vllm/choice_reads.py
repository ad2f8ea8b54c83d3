"""The vLLM requests that score a choice row (engine/choice_scoring.py): one per branch point of its
choices' tokens, each of one output token that reads the log probabilities of the tokens that
continue there (``logprob_token_ids``, as vLLM's ``generative_scoring`` reads labels). Every request
of a row starts with the row's prompt, so vLLM's prefix cache computes it once; where every choice
starts with its own token the row is one request of its prompt alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..choice_scoring import SCORED_ANSWER_TOKENS, ChoiceTree, ScoredAnswer
from ..response_format import ResponseFormat
from ..run.requests import ENGINE_FAILURES, Finished, Submission

SCORED = "scored"  # a scored row's finish reason: answered from its choices' probabilities, not decoded


@dataclass(eq=False)
class ScoredRow:
    """A row being scored: the log probabilities read so far, one list per branch point."""

    submission: Submission
    tree: ChoiceTree
    logprobs: list[list[float] | None]
    sampled: list[int] = field(default_factory=list)  # each request's one output token (thrown away)
    cached_tokens: int | None = None  # of the row's prompt, as its first request found them
    error: str | None = None
    pending: int = 0  # its requests in vLLM: finished when none is left

    def finished(self) -> Finished:
        prompt = len(self.submission.token_ids)
        common = dict(submission=self.submission, token_ids=self.sampled, prompt_tokens=prompt,
                      cached_tokens=min(self.cached_tokens or 0, prompt))
        if self.error is not None:
            return Finished(text="", finish_reason="error", error=self.error, **common)
        answer = ScoredAnswer.of(self.tree.probabilities(self.logprobs))
        return Finished(text=answer.text, finish_reason=SCORED, scored=answer, **common)


@dataclass(slots=True, eq=False)
class ScoreRead:
    """One request of a scored row: the read at its ``point``-th branch point."""

    row: ScoredRow
    point: int

    def take(self, completion, cached_tokens: int) -> None:
        """The request's finished output (vLLM's ``CompletionOutput``)."""
        row, wanted = self.row, self.row.tree.branch_points[self.point].tokens
        row.pending -= 1
        row.sampled += completion.token_ids
        if self.point == 0:
            row.cached_tokens = cached_tokens
        if completion.finish_reason in ENGINE_FAILURES:
            row.error = f"vLLM ended a scoring request with finish_reason {completion.finish_reason!r}"
            return
        read = completion.logprobs[0] if completion.logprobs else {}
        missing = [t for t in wanted if t not in read]
        if missing:
            row.error = f"vLLM gave no log probability of the choice tokens {missing}"
            return
        row.logprobs[self.point] = [read[t].logprob for t in wanted]


class ChoiceReads:
    """Turns scored rows into vLLM requests; each distinct list of choices is tokenized once."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._trees: dict[tuple[str, ...], ChoiceTree | str] = {}  # choices -> tree, or why not scorable
        self._params: dict[tuple[int, ...], object] = {}  # the tokens read -> SamplingParams

    def refusal(self, response_format: ResponseFormat) -> str | None:
        tree = self._tree(response_format)
        return tree if isinstance(tree, str) else None

    def _tree(self, response_format: ResponseFormat) -> ChoiceTree | str:
        key = tuple(response_format.choice)
        if key not in self._trees:
            try:
                self._trees[key] = ChoiceTree.build(
                    key, lambda text: self._tokenizer.encode(text, add_special_tokens=False),
                    self._tokenizer.eos_token_id)
            except ValueError as exc:
                self._trees[key] = f"cannot score the choices: {exc}"
        return self._trees[key]

    def requests(self, submission: Submission, response_format: ResponseFormat):
        """The row's requests as (request id, prompt token ids, SamplingParams, ScoreRead), and the
        row (finished at once where there is nothing to read: a single choice)."""
        tree = self._tree(response_format)
        if isinstance(tree, str):
            raise ValueError(tree)
        row = ScoredRow(submission, tree, [None] * len(tree.branch_points))
        prompt = submission.prompt_ids()
        reads = [(f"{submission.request_id}/{k}", prompt + list(point.prefix), self._read_params(point.tokens),
                  ScoreRead(row, k)) for k, point in enumerate(tree.branch_points)]
        return reads, row

    def warm_params(self):
        """A read of token 0: what a scored row's request asks of vLLM, on any prompt."""
        return self._read_params((0,))

    def _read_params(self, tokens: tuple[int, ...]):
        params = self._params.get(tokens)
        if params is None:
            from vllm import SamplingParams
            from vllm.sampling_params import RequestOutputKind

            # ``logprobs`` unset: vLLM then returns these tokens' log probabilities alone
            # (``SamplingParams.num_logprobs``), bounded by MAX_LOGPROB_TOKEN_IDS, not max_logprobs.
            params = self._params[tokens] = SamplingParams(
                max_tokens=SCORED_ANSWER_TOKENS, temperature=0.0, logprob_token_ids=list(tokens),
                output_kind=RequestOutputKind.FINAL_ONLY)
        return params
