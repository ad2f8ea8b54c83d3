"""A run's engine steps, one by one, summed up to say where its time went (``batchllm bench``).

Two runs of the same rows can take the same number of steps and compute the same tokens yet take
different times: what differs is what shares a step. Each step records its wall time, the prompt
tokens vLLM computed (counted in the step where a request's prefill ended), the output tokens,
the rows running and how many distinct prefix groups (of the plan) those rows belong to.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .requests import RequestKind, StepReport


@dataclass
class StepProfile:
    group_of_row: np.ndarray
    steps: list[tuple[float, int, int, int, int]]  # seconds, prefill tokens, decode tokens, rows, groups
    in_flight: set = field(default_factory=set)  # rows that have their first token and are not done
    rows_of_group: Counter = field(default_factory=Counter)  # of those, per group

    @classmethod
    def of(cls, group_of_row: np.ndarray) -> "StepProfile":
        return cls(group_of_row, [])

    def record(self, report: StepReport) -> None:
        """One step, at a cost that follows the rows that started and finished in it, not the rows running."""
        for kind, row in report.started:
            if kind is RequestKind.ROW:
                self.in_flight.add(row)
                self.rows_of_group[int(self.group_of_row[row])] += 1
        for finished in report.finished:
            row = finished.submission.row
            if finished.submission.kind is RequestKind.ROW and row in self.in_flight:
                self.in_flight.discard(row)
                group = int(self.group_of_row[row])
                self.rows_of_group[group] -= 1
                if not self.rows_of_group[group]:
                    del self.rows_of_group[group]
        self.steps.append((report.seconds, report.prefill_tokens, report.decode_tokens, len(self.in_flight),
                           len(self.rows_of_group)))

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
                "count": int(mask.sum()),
                "seconds": round(float(seconds[mask].sum()), 3),
                "ms_per_step": round(1000 * float(seconds[mask].mean()), 2),
                "prefill_tokens": int(prefill[mask].sum()),
                "decode_tokens": int(decode[mask].sum()),
                "rows_per_step": round(float(rows[mask].mean()), 2),
                "groups_per_step": round(float(groups[mask].mean()), 2),
                "ms_per_decode_token": round(1000 * float(seconds[mask].sum() / max(decode[mask].sum(), 1)), 3),
            }
        return out
