"""Where ``batchllm run`` writes its answers: checked before any work, locked while in use.

An output is refused when it is one of the inputs, a directory, or not writable, and when it is
an existing file that is not a previous result of the same job (same prompts source) unless the
user asks to overwrite it. One run at a time holds a lock file next to it that names the holder;
a lock left by a process that no longer runs is taken over.
"""

from __future__ import annotations

import glob
import json
import os
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .atomic import write_parquet

RESULT_MARK = b"batchllm.result_of"  # Parquet metadata key: the prompts source the file answers


class OutputError(ValueError):
    """The output cannot be used as asked; the message says why."""


def check_output(output: Path, source: str, overwrite: bool) -> None:
    """Refuse an output that would destroy an input or another file, before any work is done."""
    target = output.resolve()
    inputs = {Path(p).resolve() for p in glob.glob(source)} | {Path(source).resolve()}
    if target in inputs:
        raise OutputError(f"--output {output} is one of the inputs; write the answers to another file")
    if target.is_dir():
        raise OutputError(f"--output {output} is a directory; give a file name such as {output / 'answers.parquet'}")
    folder = target.parent
    existing = next((p for p in [folder, *folder.parents] if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise OutputError(f"--output {output} is not writable")
    if target.exists() and not overwrite:
        previous = _result_of(target)
        if previous != str(Path(source).resolve()):
            what = "a result of another prompts source" if previous else "not a batchllm result"
            raise OutputError(f"--output {output} exists and is {what}; pass --overwrite to replace it")


def _result_of(path: Path) -> str | None:
    try:
        metadata = pq.read_schema(path).metadata or {}
    except Exception:
        return None
    value = metadata.get(RESULT_MARK)
    return value.decode() if value else None


def write_result(table: pa.Table, output: Path, source: str) -> None:
    """Write atomically (staging file, then rename), marked as this source's result."""
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), RESULT_MARK: str(Path(source).resolve())})
    write_parquet(table, output)


class OutputLock:
    """``OUT.lock``: one run per output at a time; names its holder; taken over when stale."""

    def __init__(self, output: Path):
        self.path = output.with_name(output.name + ".lock")
        self.held = False

    def __enter__(self) -> "OutputLock":
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                holder = self._holder()
                if holder and (holder.get("host") != me["host"] or _alive(holder.get("pid"))):
                    raise OutputError(f"another run (pid {holder.get('pid')} on {holder.get('host')}) is writing "
                                      f"{self.path.name[:-5]}; wait for it or remove {self.path} if it is gone") from None
                self.path.unlink(missing_ok=True)  # left by a process that died
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise OutputError(f"could not take the lock {self.path}")

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def __exit__(self, *exc) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
