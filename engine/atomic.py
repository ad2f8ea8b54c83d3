"""Publishing a file or folder whole: write it under a staging name next to its target, then rename.

Readers (another process, a rerun, the Dagster UI) see the old version or the new one, never half of
one; a crash leaves at most a hidden ``.NAME.PID.partial`` beside the target, which no reader
lists. The process id keeps two writers of the same target (two runs of one job) off each
other's staging file. This is the one place the project does this.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


class Staged:
    """``with Staged(target) as staged:`` write ``staged.path``; leaving the block without an
    error publishes it over ``target`` (unless ``discard()`` was called), an error removes it."""

    def __init__(self, target: Path | str):
        self.target = Path(target)
        self.path = self.target.with_name(f".{self.target.name}.{os.getpid()}.partial")
        self._done = False

    def __enter__(self) -> "Staged":
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self._remove(self.path)  # a leftover of a crashed run of this process id
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


def write_parquet(table: pa.Table, path: Path | str) -> None:
    """Write ``table`` to ``path`` whole (staged, then renamed)."""
    with Staged(path) as staged:
        pq.write_table(table, staged.path)


def write_text(text: str, path: Path | str) -> None:
    with Staged(path) as staged:
        staged.path.write_text(text)
