"""Load a prompt table from Parquet or from SQL run by DuckDB, and check it is usable.

A prompt table has an id column (unique, non-NULL) and a prompt column (text) and/or a messages
column (a JSON list of ``{"role", "content"}`` chat messages); an optional integer column gives a
row its own ``max_tokens``. Dataset SQL runs in DuckDB's sandbox (see ``read_sql``): one query,
read-only, reading only the job's own files.
"""

from __future__ import annotations

import glob
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from ..sql import quote_identifier, quote_literal, quote_qualified


class DatasetError(ValueError):
    """The prompt table cannot be used as it is; the message says what to fix."""


@dataclass(frozen=True)
class Columns:
    id: str = "id"
    prompt: str = "prompt"
    messages: str = "messages"
    max_tokens: str = "max_tokens"
    response_format: str = "response_format"  # JSON text per row (see response_format.py); NULL: the job's


def single_query(sql: str) -> str:
    """The one query the dataset SQL holds (without a trailing ``;``); anything else is refused."""
    import duckdb

    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise DatasetError(f"dataset SQL failed: {' '.join(str(exc).split())}") from exc
    if len(statements) != 1:
        raise DatasetError(f"dataset SQL must be exactly one query; it has {len(statements)} statements")
    if statements[0].type != duckdb.StatementType.SELECT:
        raise DatasetError(f"dataset SQL must be a query (SELECT ...), not a {statements[0].type.name} statement")
    query = statements[0].query
    # Drop trailing ``;`` and comments (found by DuckDB's tokenizer, not by string search), so the
    # query can be wrapped in another one.
    end = len(query)
    for position, kind in reversed(duckdb.tokenize(query)):
        if kind == duckdb.token_type.comment or query[position:end].strip() == ";":
            end = position
        else:
            break
    return query[:end].rstrip()


def read_sql(sql: str, database: str | None = None, allowed_paths: list[str] = ()) -> pa.Table:
    """Run dataset SQL in DuckDB's sandbox (see ``stream_sql``) and return the whole result."""
    with stream_sql(sql, database, allowed_paths) as (schema, batches):
        return pa.Table.from_batches(list(batches), schema)


# DuckDB's own limit is 80% of the machine's memory, and its buffer pool keeps every block a scan
# read until that fills: streaming a table of 10M prompts (2.5 GB) held 3.1 GB. A job's scans work
# in this much instead, and what does not fit (a large sort or join in dataset SQL) spills to disk.
# Spilling needs memory per thread (a sort of 3M prompts failed at 64 threads in 1 GB, ran in 2):
# on a machine of many cores the bound grows with DuckDB's threads.
DUCKDB_MEMORY_MIB = 1024
DUCKDB_MEMORY_PER_THREAD_MIB = 64
_SPILL = ".duckdb_spill"  # DuckDB's spill files, in the job's folder


def bounded_memory(con, job_dir: Path, memory_mib: int | None = None) -> None:
    """Hold a DuckDB connection to ``memory_mib`` (default ``DUCKDB_MEMORY_MIB``; or
    ``DUCKDB_MEMORY_PER_THREAD_MIB`` a thread, if more), spilling into the job's folder ``job_dir``
    (never beside a user's database, nor the working directory, DuckDB's defaults)."""
    threads = int(con.execute("SELECT current_setting('threads')").fetchone()[0])
    memory_mib = DUCKDB_MEMORY_MIB if memory_mib is None else memory_mib
    con.execute(f"SET memory_limit = '{max(memory_mib, DUCKDB_MEMORY_PER_THREAD_MIB * threads)}MiB'")
    con.execute("SET temp_directory = ?", [str(Path(job_dir) / _SPILL)])


@contextmanager
def stream_sql(sql: str, database: str | None = None, allowed_paths: list[str] = (),
               batch_rows: int = 65_536, job_dir: Path | None = None
               ) -> Iterator[tuple[pa.Schema, Iterator[pa.RecordBatch]]]:
    """Run dataset SQL in DuckDB's sandbox and stream its rows as Arrow record batches (the schema,
    and the batches while the connection is open): exactly one query; the database (if any)
    read-only; no file outside ``allowed_paths`` (and the database's folder) readable; no extension
    installed or loaded; the configuration locked so the SQL cannot undo any of it. With the
    job's folder ``job_dir``, in bounded memory (``bounded_memory``): a stream's reader never holds the table."""
    import duckdb

    query = single_query(sql)
    if database and not Path(database).exists():
        raise DatasetError(f"DuckDB database {database!r} does not exist")
    con = _connect_read_only(database) if database else duckdb.connect(config=_NO_EXTENSIONS)
    if job_dir is not None:
        bounded_memory(con, job_dir)

    def translated(call):
        try:
            return call()
        except duckdb.PermissionException as exc:
            raise DatasetError(f"dataset SQL may only read the job's own data "
                               f"({', '.join(allowed_paths) or 'its database'}): {exc}") from exc
        except duckdb.Error as exc:
            raise DatasetError(f"dataset SQL failed: {exc}") from exc

    def batches(reader) -> Iterator[pa.RecordBatch]:
        while True:
            try:
                batch = translated(reader.read_next_batch)
            except StopIteration:
                return
            yield batch

    try:
        _sandbox(con, [*allowed_paths, *([str(Path(database).parent)] if database else [])])
        reader = translated(lambda: con.sql(query).to_arrow_reader(batch_rows))
        yield reader.schema, batches(reader)
    finally:
        con.close()


_NO_EXTENSIONS = {"autoinstall_known_extensions": False, "autoload_known_extensions": False}


def _sandbox(con, allowed_paths: list[str]) -> None:
    folders = sorted({str(Path(p).resolve()) + "/" for p in allowed_paths})
    con.execute("SET allowed_directories = ?", [folders])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def schema_of(sql: str, database: str | None = None, allowed_paths: list[str] = ()) -> pa.Schema | None:
    """The columns the dataset SQL gives, bound in the sandbox without reading its rows: a mistake
    known before any night (SQL that does not parse, a column a table that exists lacks) raises
    ``DatasetError``. None where the answer must wait for the night: the database, a table or a
    Parquet file not made yet, or the database held by a writer now."""
    import duckdb

    query = single_query(sql)  # a parse error is known now
    if database and not Path(database).exists():
        return None
    try:
        con = _connect_read_only(database, wait_s=0) if database else duckdb.connect(config=_NO_EXTENSIONS)
    except DatasetError:
        return None
    try:
        _sandbox(con, [*allowed_paths, *([str(Path(database).parent)] if database else [])])
        return con.sql(query).limit(0).to_arrow_table().schema
    except (duckdb.CatalogException, duckdb.IOException):  # not made yet (or no file matches): the night says
        return None
    except duckdb.PermissionException as exc:
        raise DatasetError(f"dataset SQL may only read the job's own data "
                           f"({', '.join(allowed_paths) or 'its database'}): {exc}") from exc
    except duckdb.Error as exc:
        raise DatasetError(f"dataset SQL failed: {' '.join(str(exc).split())}") from exc
    finally:
        con.close()


def _connect_read_only(database: str, wait_s: float = 60.0):
    """Open read-only, waiting while another process writes (DuckDB locks the file for a writer)."""
    import duckdb

    deadline = time.monotonic() + wait_s
    delay = 0.05
    while True:
        try:
            return duckdb.connect(database, read_only=True, config=_NO_EXTENSIONS)
        except duckdb.IOException as exc:
            if "lock" not in str(exc).lower() or time.monotonic() > deadline:
                raise DatasetError(f"cannot open DuckDB database {database!r}: {exc}") from exc
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        except duckdb.Error as exc:
            raise DatasetError(f"cannot open DuckDB database {database!r}: {exc}") from exc


def source_sql(source: str, database: str | None = None) -> tuple[str, str | None, list[str]]:
    """A ``.sql`` file, a Parquet file or glob, or a DuckDB table name (with ``database``) as one
    query, the database it runs on, and the folders it may read."""
    path = Path(source)
    if source.endswith(".sql"):
        if not path.exists():
            raise DatasetError(f"SQL file {source!r} does not exist")
        return path.read_text(), database, []
    if source.endswith(".parquet") or any(ch in source for ch in "*?["):
        if not glob.glob(source):
            raise DatasetError(f"no Parquet file matches {source!r}")
        return f"SELECT * FROM read_parquet({quote_literal(source)})", None, [parquet_folder(source)]
    if database:
        return f"SELECT * FROM {quote_qualified(source)}", database, []
    raise DatasetError(f"{source!r} is neither a .sql file, a Parquet file nor a table of a --database")


def parquet_folder(source: str) -> str:
    """The folder a Parquet file or glob reads from (the part before the first wildcard)."""
    fixed = source.split("*")[0].split("?")[0].split("[")[0]
    return str(Path(fixed).parent if not fixed.endswith("/") else Path(fixed))


def read_source(source: str, database: str | None = None) -> pa.Table:
    return read_sql(*source_sql(source, database))


def validate(table: pa.Table, columns: Columns = Columns()) -> pa.Table:
    """Check the table and return it with only the columns the engine uses."""
    names = set(table.column_names)
    if columns.id not in names:
        raise DatasetError(f"prompt table has no id column {columns.id!r} (columns: {sorted(names)})")
    if columns.prompt not in names and columns.messages not in names:
        raise DatasetError(
            f"prompt table needs a prompt column {columns.prompt!r} or a messages column "
            f"{columns.messages!r} (columns: {sorted(names)})"
        )
    ids = table.column(columns.id)
    if ids.null_count:
        raise DatasetError(f"id column {columns.id!r} has {ids.null_count} NULL value(s)")
    if not (pa.types.is_integer(ids.type) or pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)):
        raise DatasetError(f"id column {columns.id!r} must be integer or text, not {ids.type}")
    counts = pa.TableGroupBy(pa.table({"id": ids}), "id").aggregate([("id", "count")])
    duplicated = counts.filter(pa.compute.greater(counts["id_count"], 1))
    if duplicated.num_rows:
        sample = duplicated["id"].to_pylist()[:5]
        raise DatasetError(f"id column {columns.id!r} has {duplicated.num_rows} duplicated id(s), e.g. {sample}")
    for name in (columns.prompt, columns.messages):
        if name in names and not _is_text(table.column(name).type):
            raise DatasetError(f"column {name!r} must be text, not {table.column(name).type}")
    if columns.max_tokens in names and not pa.types.is_integer(table.column(columns.max_tokens).type):
        raise DatasetError(
            f"column {columns.max_tokens!r} must be an integer, not {table.column(columns.max_tokens).type}"
        )
    if columns.response_format in names and not _is_text(table.column(columns.response_format).type):
        raise DatasetError(
            f"column {columns.response_format!r} must be JSON text, not {table.column(columns.response_format).type}"
        )
    keep = [c for c in (columns.id, columns.prompt, columns.messages, columns.max_tokens, columns.response_format)
            if c in names]
    return table.select(keep)


def check_unique_ids(parquet: str | Path, id_column: str) -> None:
    """No id twice in a (streamed, so batch-wise checked) Parquet snapshot; DuckDB counts out of
    core, spilling into the snapshot's (the job's) folder."""
    import duckdb

    with duckdb.connect(config=_NO_EXTENSIONS) as con:
        bounded_memory(con, Path(parquet).parent)
        column = quote_identifier(id_column)
        duplicated = con.execute(
            f"SELECT {column} FROM read_parquet(?) GROUP BY {column} HAVING count(*) > 1 LIMIT 5", [str(parquet)]
        ).fetchall()
    if duplicated:
        raise DatasetError(f"id column {id_column!r} has duplicated id(s), e.g. {[d[0] for d in duplicated]}")


def _is_text(arrow_type: pa.DataType) -> bool:
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_null(arrow_type)


def load_prompts(source: str, database: str | None = None, columns: Columns = Columns()) -> pa.Table:
    return validate(read_source(source, database), columns)
