"""Where ``batchllm run`` writes its answers: checked before any work, locked while in use.

An output is refused when it is one of the inputs, a directory, or not writable, and when it is
an existing file that is not a previous result of the same job (same prompts source) unless the
user asks to overwrite it. One run at a time holds a lock next to it (``OUT.lock``) that names the
holder.
"""

from __future__ import annotations

import contextlib
import glob
import os
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..atomic import write_parquet
from ..locks import Busy, held_alone

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
    if (
        existing is None
        or not existing.is_dir()
        or not os.access(existing, os.W_OK)
        or (target.exists() and not os.access(target, os.W_OK))
    ):
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


@contextlib.contextmanager
def output_lock(output: Path):
    """``OUT.lock``: one run per output at a time, the kernel's ``flock`` (``engine.locks``: released
    when the holder dies, so a killed run leaves nothing to take over); a second run is refused,
    naming the holder."""
    held = contextlib.ExitStack()
    try:
        held.enter_context(held_alone(output.with_name(output.name + ".lock"),
                                      f"pid {os.getpid()} on {socket.gethostname()}", f"a run writing {output.name}"))
    except Busy as busy:
        raise OutputError(f"{busy}: wait for it to finish") from None
    with held:
        yield
    return True
