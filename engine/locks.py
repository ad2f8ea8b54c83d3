"""Advisory file locks (``flock``), the kernel's: released when the holding process dies, so a killed
run never leaves anything locked, and held by this package whatever launched the run (no guarantee
rests on an instance's configuration)."""

from __future__ import annotations

import contextlib
import fcntl
import time
from pathlib import Path


class Busy(RuntimeError):
    """Another process holds the lock; the message names it."""


@contextlib.contextmanager
def locked(path: Path, shared: bool = False, holder: str | None = None, timeout_s: float | None = None,
           what: str | None = None):
    """Wait for the lock at ``path``: shared for readers, exclusive for a writer. An exclusive
    ``holder`` writes its name into the file, for whoever waits; with ``timeout_s`` the wait ends
    in ``Busy`` naming ``what`` and its holder, instead of lasting forever."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    with open(path, "a+") as handle:
        if timeout_s is None:
            fcntl.flock(handle, mode)
        else:
            _wait(handle, mode, timeout_s, what or str(path))
        names = holder is not None and not shared
        try:
            if names:
                _write_holder(handle, holder)
            yield
        finally:
            if names:
                _write_holder(handle, "")
            fcntl.flock(handle, fcntl.LOCK_UN)


def _wait(handle, mode: int, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(handle, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise Busy(f"waited {timeout_s:g} s for {what}, held by {_holder_of(handle)}") from None
            time.sleep(min(0.2, timeout_s))


def _holder_of(handle) -> str:
    handle.seek(0)
    return handle.read().strip() or "a holder that did not name itself"


def _write_holder(handle, holder: str) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(holder)
    handle.flush()


@contextlib.contextmanager
def held_alone(path: Path, holder: str, what: str):
    """Take the lock at ``path`` exclusively or raise ``Busy`` at once, naming who holds it (the
    ``holder`` text the holder wrote, e.g. its run id and process)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(f"{what} is already running ({_holder_of(handle)})") from None
        try:
            _write_holder(handle, holder)
            yield
        finally:
            _write_holder(handle, "")
            fcntl.flock(handle, fcntl.LOCK_UN)
