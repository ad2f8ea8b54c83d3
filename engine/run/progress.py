"""Progress of a long run: rows, throughput, cache hits against the ideal, what is in flight, time left.

``Progress`` takes a snapshot after every engine step; a log line goes to ``sink`` every ``every_s``
seconds, and a live display (``console.ProgressBar`` on a terminal) sees every snapshot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)


def format_eta(seconds: float | None) -> str:
    """``?`` until there is a rate to extrapolate from, never ``nan``."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


@dataclass
class Snapshot:
    done: int
    total: int
    tokens: int  # prompt + output tokens of the finished rows
    saved: int  # prompt tokens not computed so far (cache hits, less what the prefix requests computed)
    reusable: int  # prompt tokens a perfect cache reuses over the whole run
    in_flight: int
    kv_usage: float
    preemptions: int
    elapsed: float
    reserved_blocks: int | None = None

    @property
    def rows_per_s(self) -> float:
        return self.done / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        return (self.total - self.done) / self.rows_per_s if self.rows_per_s > 0 else None

    def line(self) -> str:
        return (
            f"{self.done}/{self.total} rows ({100 * self.done / max(self.total, 1):.0f}%), "
            f"{self.rows_per_s:.1f} rows/s, "
            f"{self.tokens_per_s:.0f} tok/s, saved {self.saved} prompt tok (a perfect cache: {self.reusable}; "
            "identical rows save more), "
            f"in flight {self.in_flight} rows"
            + (f" / {self.reserved_blocks} KV blocks reserved" if self.reserved_blocks is not None else "")
            + f" (vLLM KV {100 * self.kv_usage:.0f}% used), preemptions {self.preemptions}, "
            f"eta {format_eta(self.eta_s)}"
        )


class Display(Protocol):
    """A live view of the run (a progress bar); sees every snapshot."""

    def show(self, snapshot: Snapshot) -> None: ...

    def close(self) -> None: ...


class Progress:
    def __init__(self, total_rows: int, every_s: float, sink: Callable[[str], None] | None = None,
                 display: Display | None = None, reusable: int = 0):
        self.total, self.every_s, self.reusable = total_rows, every_s, reusable
        self.sink = sink or log.info
        self.display = display
        self.started = self.last = time.perf_counter()

    def snapshot(self, done: int, tokens: int, saved: int, in_flight: int, kv_usage: float, preemptions: int,
                 reserved_blocks: int | None = None, now: float | None = None) -> Snapshot:
        return Snapshot(done, self.total, tokens, saved, self.reusable, in_flight, kv_usage, preemptions,
                        (now or time.perf_counter()) - self.started, reserved_blocks)

    def update(self, done: int, tokens: int, saved: int, in_flight: int, kv_usage: float, preemptions: int,
               reserved_blocks: Callable[[], int | None] | None = None, force: bool = False) -> None:
        """After a step: the display always, a line when one is due (``reserved_blocks`` is only
        counted then)."""
        now = time.perf_counter()
        due = force or now - self.last >= self.every_s
        if not due and self.display is None:  # every engine step comes here: nothing to build
            return
        snap = self.snapshot(done, tokens, saved, in_flight, kv_usage, preemptions,
                             reserved_blocks() if due and reserved_blocks else None, now=now)
        if self.display is not None:
            self.display.show(snap)
        if due:
            self.last = now
            self.sink(snap.line())
