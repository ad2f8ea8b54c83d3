"""Publishing a file or folder whole: write it under a staging name next to its target, then rename.

Readers (another process, a rerun, the Dagster UI) see the old version or the new one, never half of
one; a crash leaves at most a hidden ``.NAME.PID.partial`` beside the target, which no reader
lists, and the next writer of that target removes it. The process id keeps two writers of the same
target (two runs of one job) off each other's staging file. This is the one place the project does this.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


class Staged:
    """``with Staged(target) as staged:`` write ``staged.path``; leaving the block without an
    error publishes it over ``target`` (unless ``discard()`` was called), an error removes it.
    ``sole_writer``: the caller holds a lock every writer of ``target`` holds, so any other staging
    file of it is a dead writer's, whatever its age (a killed plan's scratch database, say)."""

    def __init__(self, target: Path | str, sole_writer: bool = False):
        self.target = Path(target)
        self.path = self.target.with_name(f".{self.target.name}.{os.getpid()}.partial")
        self.sole_writer = sole_writer
        self._done = False

    def __enter__(self) -> "Staged":
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self._remove(self.path)  # a leftover of a crashed run of this process id
        for leftover in self.target.parent.glob(f".{self.target.name}.*.partial"):
            if self.sole_writer or _left_by_a_dead_writer(leftover):
                self._remove(leftover)
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.publish()
        else:
            self.discard()

    def publish(self) -> None:
        if self._done:
            return
        self._done = True
        if self.path.is_dir():  # a folder cannot replace another in one rename: the old one goes first
            self._remove(self.target)
        self.path.replace(self.target)

    def discard(self) -> None:
        self._done = True
        self._remove(self.path)

    @staticmethod
    def _remove(path: Path) -> None:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


# A staging file this old whose writer is not a live process here is a crash's leftover. Not younger
# ones: a process of the same id in another container writing to a shared volume may still own it.
LEFTOVER_AGE_S = 3600


def _left_by_a_dead_writer(path: Path) -> bool:
    try:
        pid = int(path.name.rsplit(".", 2)[-2])
        age = time.time() - path.lstat().st_mtime
    except (ValueError, OSError):
        return False
    if age < LEFTOVER_AGE_S or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def write_parquet(table: pa.Table, path: Path | str) -> None:
    """Write ``table`` to ``path`` whole (staged, then renamed)."""
    with Staged(path) as staged:
        pq.write_table(table, staged.path)


def write_text(text: str, path: Path | str) -> None:
    with Staged(path) as staged:
        staged.path.write_text(text)
