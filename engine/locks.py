"""Advisory file locks (``flock``), the kernel's: released when the holding process dies, so a killed
run never leaves anything locked, and held by this package whatever launched the run (no guarantee
rests on an instance's configuration)."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path


class Busy(RuntimeError):
    """Another process holds the lock; the message names it."""


@contextlib.contextmanager
def locked(path: Path, shared: bool = False):
    """Wait for the lock at ``path``: shared for readers, exclusive for a writer."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def held_alone(path: Path, holder: str, what: str):
    """Take the lock at ``path`` exclusively or raise ``Busy`` at once, naming who holds it (the
    ``holder`` text the holder wrote, e.g. its run id and process)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise Busy(f"{what} is already running ({handle.read().strip() or 'holder unknown'})") from None
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(holder)
            handle.flush()
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            fcntl.flock(handle, fcntl.LOCK_UN)
