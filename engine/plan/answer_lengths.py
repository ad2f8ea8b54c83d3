"""How long a job's answers are, learned from the answers its last nights wrote: what admission
counts a row's output at instead of its ``max_tokens``, and what a night's forecast expects.

A generous ``max_tokens`` (256 for a label of three tokens) is a limit, not a length: counted as the
row's output it makes admission's model of vLLM (``run.admission``) see preemptions that never come,
and ``reserve_output: full`` hold blocks no answer writes. Learned, the job's answers' high percentile
(``PERCENTILE`` of the ok rows the output table holds, at least ``MIN_ROWS`` of them) takes its place
there, never in the row's own limit: vLLM still lets an answer run to ``max_tokens``, and admission
counts a row that outgrows its reservation as vLLM holds it, a block more every ``block_size`` tokens.

Nothing is learned where answers reach their limits (more than ``1 - PERCENTILE`` of the measured
rows finished by length): the percentile would be the old limit, not a length.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

PERCENTILE = 0.95
MIN_ROWS = 100


@dataclass(frozen=True)
class AnswerLengths:
    """The output tokens of a job's answers: the ``PERCENTILE``-th (``tokens``) and the mean, of ``rows``."""

    tokens: int
    mean: float
    rows: int

    def reserved(self, max_tokens: np.ndarray) -> np.ndarray:
        """Each row's output as admission counts it: the learned length, never above the row's limit."""
        return np.minimum(np.asarray(max_tokens, dtype=np.int64), max(1, self.tokens))

    def describe(self) -> str:
        return (f"{self.tokens} output tokens, the {PERCENTILE:.0%} percentile of the {self.rows:,} answers the last "
                f"nights wrote (mean {self.mean:.1f})")

    def to_text(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def of_text(cls, text: str | None) -> "AnswerLengths | None":
        return cls(**json.loads(text)) if text else None


def learned_lengths(rows: int, percentile_tokens: float | None, mean: float | None,
                    at_limit: int) -> AnswerLengths | None:
    """From the ok answers the output table holds: how many (``rows``), their output tokens'
    ``PERCENTILE``-th and mean, and how many finished by length (``at_limit``). None where too few
    were measured or answers reach their limits (see the module doc)."""
    if rows < MIN_ROWS or percentile_tokens is None or at_limit > (1 - PERCENTILE) * rows:
        return None
    return AnswerLengths(int(np.ceil(percentile_tokens)), float(mean), int(rows))


def measured_lengths(output_tokens: np.ndarray, at_limit: int) -> AnswerLengths | None:
    """``learned_lengths`` of ok answers' output tokens in memory (a run's results), the percentile
    as the output table's ``quantile_disc`` takes it."""
    tokens = np.asarray(output_tokens, dtype=np.int64)
    if tokens.size == 0:
        return None
    return learned_lengths(tokens.size, float(np.quantile(tokens, PERCENTILE, method="inverted_cdf")),
                           float(tokens.mean()), at_limit)


def why_not_learned(rows: int, at_limit: int) -> str:
    """Why ``learned_lengths`` gave none (for the plan's log)."""
    if rows < MIN_ROWS:
        return f"{rows:,} answers measured, fewer than {MIN_ROWS}: rows are counted at their max_tokens"
    return (f"{at_limit:,} of {rows:,} answers ended at their max_tokens: their lengths are limits, so rows are "
            "counted at their max_tokens")
