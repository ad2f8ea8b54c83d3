"""A progress line for long runs: rows, throughput, cache hits, what is in flight, time left."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def format_eta(seconds: float | None) -> str:
    """``?`` until there is a rate to extrapolate from, never ``nan``."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """Logs a progress line at most every ``every_s`` seconds."""

    def __init__(self, total_rows: int, every_s: float, sink: Callable[[str], None] | None = None):
        self.total, self.every_s = total_rows, every_s
        self.sink = sink or log.info
        self.started = self.last = time.perf_counter()

    def line(self, done: int, tokens: int, cached: int, in_flight: int, kv_usage: float, preemptions: int,
             planned_blocks: int | None = None, now: float | None = None) -> str:
        elapsed = (now or time.perf_counter()) - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else None
        return (
            f"{done}/{self.total} rows ({100 * done / max(self.total, 1):.0f}%), {rate:.1f} rows/s, "
            f"{tokens / elapsed if elapsed > 0 else 0.0:.0f} tok/s, cached {cached} tok, in flight {in_flight} rows"
            + (f" / {planned_blocks} planned KV blocks" if planned_blocks is not None else "")
            + f" (vLLM KV {100 * kv_usage:.0f}% used), preemptions {preemptions}, eta {format_eta(eta)}"
        )

    def due(self) -> bool:
        return time.perf_counter() - self.last >= self.every_s

    def maybe_log(self, *args, force: bool = False, **kwargs) -> None:
        if not (force or self.due()):
            return
        self.last = now = time.perf_counter()
        self.sink(self.line(*args, now=now, **kwargs))
