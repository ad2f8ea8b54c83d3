"""Writes to the output DuckDB database: short transactions, values always bound, never spliced.

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
import pyarrow.parquet as pq
from dagster_duckdb import DuckDBResource

from engine.sql import quote_identifier, quote_literal


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


def replace_table(warehouse: DuckDBResource, table: str, data: pa.Table) -> None:
    with connection(warehouse) as con:
        con.register("incoming", data)
        con.execute(f"CREATE OR REPLACE TABLE {quote_identifier(table)} AS SELECT * FROM incoming")
        con.unregister("incoming")


def replace_partition(warehouse: DuckDBResource, table: str, partition_key: str, rows: pa.Table,
                      whole_partition: bool = True, on_wait: Callable[[str], None] | None = None) -> int:
    """Make ``rows`` the partition's rows: one row per id, whatever ran before (idempotent). With
    ``whole_partition=False`` only these ids' rows are replaced (a shard that a newer plan
    superseded in part: the partition's other rows may be that plan's fresh answers). ``on_wait``:
    see ``connection``."""
    target = quote_identifier(table)
    with connection(warehouse, on_wait) as con:
        con.register("incoming", rows)
        try:
            con.execute("BEGIN TRANSACTION")
            con.execute(f"CREATE TABLE IF NOT EXISTS {target} AS SELECT * FROM incoming WITH NO DATA")
            _add_new_columns(con, target)
            # An id that moved to another shard since its last run must not stay twice.
            con.execute(
                f"DELETE FROM {target} WHERE (? AND partition_key = ?) OR id IN (SELECT id FROM incoming)",
                [whole_partition, partition_key])
            con.execute(f"INSERT INTO {target} BY NAME SELECT * FROM incoming")
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise
        finally:
            con.unregister("incoming")
        return con.execute(f"SELECT count(*) FROM {target} WHERE partition_key = ?", [partition_key]).fetchall()[0][0]


def _add_new_columns(con, target: str) -> None:
    """A table made by an older version lacks the columns a newer one writes: they are added (its
    old rows NULL there) instead of failing the insert. A column only the table has stays NULL."""
    have = {row[0] for row in con.execute(f"DESCRIBE {target}").fetchall()}
    for name, type_, *_ in con.execute("DESCRIBE incoming").fetchall():
        if name not in have:
            con.execute(f"ALTER TABLE {target} ADD COLUMN {quote_identifier(name)} {type_}")


def replace_prompts_view(warehouse: DuckDBResource, table: str, snapshot: Path, columns) -> str:
    """The view ``<table>_with_prompts``: every answer with its row's prompt (and chat messages) from
    the job's prompt snapshot, and ``prompt_current``: whether that is the prompt the answer is of
    (false for a row edited at the source since it was answered, until its shard runs again; NULL
    for an answer kept of a deleted row or one written before answers recorded their prompt).
    Returns the view's name."""
    from engine.table.prompt_snapshot import CONTENT_KEY

    view = f"{table}_with_prompts"
    present = set(pq.read_schema(snapshot).names) if snapshot.exists() else set()
    texts = "".join(f", p.{quote_identifier(c)}" for c in (columns.prompt, columns.messages) if c in present)
    with connection(warehouse) as con:
        con.execute(
            f"CREATE OR REPLACE VIEW {quote_identifier(view)} AS SELECT a.*{texts}, "
            f"a.content_key = lower(hex(p.{quote_identifier(CONTENT_KEY)})) AS prompt_current "
            f"FROM {quote_identifier(table)} a LEFT JOIN read_parquet({quote_literal(str(snapshot.resolve()))}) p "
            f"ON a.id::VARCHAR = p.{quote_identifier(columns.id)}::VARCHAR")
    return view


def existing_rows(warehouse: DuckDBResource, table: str, ids: pa.Array):
    """The output table's rows for these ids (None if the table does not exist yet)."""
    with connection(warehouse) as con:
        if not table_exists(con, table):
            return None
        con.register("wanted", pa.table({"id": ids}))
        rows = con.sql(f"SELECT * FROM {quote_identifier(table)} WHERE id IN (SELECT id FROM wanted)").to_arrow_table()
        con.unregister("wanted")
        return rows


def answered_ids(warehouse: DuckDBResource, table: str, ids: pa.Array, keys: set[str]) -> set:
    """Of ``ids``, those the output table holds under one of ``keys``."""
    with connection(warehouse) as con:
        if not table_exists(con, table):
            return set()
        con.register("wanted", pa.table({"id": ids}))
        con.register("live_keys", pa.table({"key": pa.array(sorted(keys), pa.string())}))
        found = con.execute(f"SELECT DISTINCT id FROM {quote_identifier(table)} WHERE id IN (SELECT id FROM wanted) "
                            "AND partition_key IN (SELECT key FROM live_keys)").fetchall()
        con.unregister("wanted")
        con.unregister("live_keys")
    return {row[0] for row in found}


def answers_not_in(warehouse: DuckDBResource, table: str, live_ids: pa.Array) -> tuple[int, int]:
    """How many of the output table's answers are of ids not in ``live_ids``, and how many it
    holds: what ``remove_answers_not_in`` would delete, counted before anything is."""
    with connection(warehouse) as con:
        if not table_exists(con, table):
            return 0, 0
        con.register("live", pa.table({"id": live_ids}))
        try:
            gone, answered = con.execute(
                f"SELECT count(*) FILTER (WHERE id NOT IN (SELECT id FROM live)), count(*) "
                f"FROM {quote_identifier(table)}").fetchall()[0]
        finally:
            con.unregister("live")
    return int(gone), int(answered)


def remove_answers_not_in(warehouse: DuckDBResource, table: str, live_ids: pa.Array) -> int:
    """Delete the answers of ids that are no longer prompt rows (deleted at the source); returns
    how many. One transaction: readers see the table before or after, never half of it."""
    target = quote_identifier(table)
    with connection(warehouse) as con:
        if not table_exists(con, table):
            return 0
        con.register("live", pa.table({"id": live_ids}))
        try:
            con.execute("BEGIN TRANSACTION")
            removed = con.execute(f"DELETE FROM {target} WHERE id NOT IN (SELECT id FROM live)").fetchall()[0][0]
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise
        finally:
            con.unregister("live")
        return int(removed)

