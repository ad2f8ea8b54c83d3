"""A run's engine steps, one by one, summed up to say where its time went (``batchllm bench``).

Two runs of the same rows can take the same number of steps and compute the same tokens yet take
different times: what differs is what shares a step. Each step records its wall time, the prompt
tokens vLLM computed (counted in the step where a request's prefill ended), the output tokens,
the rows running and how many distinct prefix groups (of the plan) those rows belong to.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .requests import RequestKind, StepReport


@dataclass
class StepProfile:
    group_of_row: np.ndarray
    steps: list[tuple[float, int, int, int, int]]  # seconds, prefill tokens, decode tokens, rows, groups

    @classmethod
    def of(cls, group_of_row: np.ndarray) -> "StepProfile":
        return cls(group_of_row, [])

    def record(self, report: StepReport) -> None:
        rows = [subject for kind, subject in report.generated if kind is RequestKind.ROW]
        groups = np.unique(self.group_of_row[rows]).size if rows else 0
        self.steps.append((report.seconds, report.prefill_tokens, report.decode_tokens, len(rows), groups))

    def summary(self) -> dict:
        """Steps with a prefill and decode-only steps apart: their count, time, tokens, rows and groups."""
        if not self.steps:
            return {}
        seconds, prefill, decode, rows, groups = (np.asarray(c, dtype=float) for c in zip(*self.steps))
        out = {"steps": len(self.steps), "step_s": round(float(seconds.sum()), 3)}
        for name, mask in (("prefill_steps", prefill > 0), ("decode_steps", prefill == 0)):
            if not mask.any():
                out[name] = {"count": 0}
                continue
            out[name] = {
                "count": int(mask.sum()), "seconds": round(float(seconds[mask].sum()), 3),
                "ms_per_step": round(1000 * float(seconds[mask].mean()), 2),
                "prefill_tokens": int(prefill[mask].sum()), "decode_tokens": int(decode[mask].sum()),
                "rows_per_step": round(float(rows[mask].mean()), 2), "groups_per_step": round(float(groups[mask].mean()), 2),
                "ms_per_decode_token": round(1000 * float(seconds[mask].sum() / max(decode[mask].sum(), 1)), 3),
            }
        return out
