"""A damaged file the package can rebuild never stops a night: it is named in one warning line, set
aside (renamed beside itself, kept for a post-mortem, never read again) and rebuilt.

What counts as rebuildable: a token cache part (its rows are tokenized again), the previous plan
(the next plan is cut without it; answers are reused by id and prompt either way) and the prompt
snapshot (the prompts step writes it anew every night). A file that holds what cannot be made
again (answers, checkpoints, the kept field order) is never set aside here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

# What reading a damaged Arrow or Parquet file raises (a truncated footer, a bad page, garbage).
DAMAGE = (pa.ArrowException, OSError, ValueError, KeyError, IndexError)


def set_aside(path: Path, error: BaseException, what: str, rebuilt: str, warn: Callable[[str], None]) -> Path:
    """Rename a damaged ``path`` to ``<name>.damaged-<time>`` and say so in one line; returns the new path."""
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 10**9:09d}")
    try:
        path.replace(aside)
    except FileNotFoundError:  # another reader set it aside first
        return aside
    reason = " ".join(str(error).split())[:200]
    warn(f"{what} {path} is damaged ({type(error).__name__}: {reason}): set aside as {aside.name}; {rebuilt}")
    return aside


def read_by_row_group(path: Path, columns: list[str] | None = None, validate: bool = False) -> None:
    """Read ``columns`` of the Parquet file at ``path`` a row group at a time (``validate``: each
    checked whole), raising what a damaged one raises: a file of millions of rows proven readable
    without holding it (Arrow's pool keeps what a whole read took, beside the step that follows)."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    for group in range(parquet.num_row_groups):
        table = parquet.read_row_group(group, columns=columns)
        if validate:
            table.validate(full=True)


def readable_or_set_aside(path: Path, read: Callable[[Path], object], what: str, rebuilt: str,
                          warn: Callable[[str], None]) -> bool:
    """Whether ``path`` is absent or ``read`` reads it; a damaged one is set aside (False)."""
    if not path.exists():
        return True
    try:
        read(path)
    except DAMAGE as exc:
        set_aside(path, exc, what, rebuilt, warn)
        return False
    return True
