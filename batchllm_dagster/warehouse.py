"""The output DuckDB database: connections, transactions, tables registered for a query (values
always bound, never spliced). The job's answers are ``output_table.OutputTable``'s.

DuckDB allows one writer per database file: a connection is opened only to write (dagster-duckdb's
resource retries while another process holds the lock) and never while the model runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pyarrow as pa
from dagster_duckdb import DuckDBResource


def table_exists(con, table: str) -> bool:
    return (
        con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [table]).fetchall()[0][0] > 0
    )


def _local_file(warehouse: DuckDBResource) -> Path | None:
    if warehouse.database and warehouse.database != ":memory:" and "://" not in warehouse.database:
        return Path(warehouse.database)
    return None


@contextmanager
def connection(warehouse: DuckDBResource, on_wait: Callable[[str], None] | None = None):
    """A connection to the output database (DuckDB creates the file, not the folders above it).
    ``on_wait``: told when another process holds the file (one DuckDB writer per file: a long read
    of the source in the same database, as in the demo), whom DuckDB names, and how long it took
    (dagster-duckdb retries its connection for up to ~100 s)."""
    path = _local_file(warehouse)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    holder = _held_by_another_process(path) if on_wait is not None and path is not None else None
    if holder:
        on_wait(f"waiting for the output database {path}: another process holds it ({holder})")
    started = time.monotonic()
    with warehouse.get_connection() as con:
        if holder:
            on_wait(f"got the output database {path} after waiting {time.monotonic() - started:.1f} s")
        yield con


def _held_by_another_process(path: Path) -> str | None:
    """DuckDB's reason when another process holds the database file (None: free, or no file yet)."""
    if not path.exists():
        return None
    try:
        duckdb.connect(str(path)).close()
    except duckdb.IOException as exc:
        return " ".join(str(exc).split())
    return None


@contextmanager
def transaction(con):
    """One DuckDB transaction: committed when the block ends, rolled back if it raises."""
    con.execute("BEGIN TRANSACTION")
    try:
        yield
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


@contextmanager
def registered(con, **tables: pa.Table):
    """Arrow tables readable by name in ``con``'s queries for the block (values bound, never spliced)."""
    for name, table in tables.items():
        con.register(name, table)
    try:
        yield
    finally:
        for name in tables:
            con.unregister(name)

