"""The prompt snapshot: the job's rows as ``prompts`` read them, in one Parquet file that the plan,
the token cache and the table check read. This module owns it: how it is written (each row with
its content key, the file with its digest), and every way it is read.

A row's content key is a 128-bit hash of what decides its tokens: its chat messages (JSON) when it
has them, else its prompt text; the token cache is keyed by it. The digest covers everything but
the text (ids, content keys, row settings), so it names the rows without reading the text back.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..digests import digest as new_digest
from ..digests import row_key
from ..sql import quote_identifier
from .dataset import bounded_memory

CONTENT_KEY = "_content_key"  # the snapshot column holding each row's content key
KEY_TYPE = pa.binary(16)
SNAPSHOT_DIGEST = "batchllm.snapshot_digest"  # Parquet metadata: the digest the writer computed


def content_keys(prompts: pa.Array | None, messages: pa.Array | None, n: int) -> pa.Array:
    """One key per row: chat rows (messages not NULL) hash their messages, the others their prompt."""
    prompts = prompts.to_pylist() if prompts is not None else [None] * n
    messages = messages.to_pylist() if messages is not None else [None] * n
    keys = []
    for prompt, chat in zip(prompts, messages):
        text = (
            b"m\0" + chat.encode() if chat is not None else (b"p\0" + prompt.encode() if prompt is not None else b"n")
        )
        keys.append(row_key(text))
    return pa.array(keys, KEY_TYPE)


class SnapshotWriter:
    """Writes a snapshot batch by batch (the table's text is never in memory at once): each batch
    gets its rows' content keys; the digest goes into the file's metadata on ``close``."""

    def __init__(self, path: Path, prompt_column: str, messages_column: str):
        self.path, self.prompt_column, self.messages_column = path, prompt_column, messages_column
        self._writer: pq.ParquetWriter | None = None
        self._digest = new_digest()
        self.rows = 0

    def write(self, table: pa.Table) -> pa.Table:
        """Append ``table``'s rows; returns them as written (with their content keys)."""
        table = table.append_column(CONTENT_KEY, content_keys(
            self._optional(table, self.prompt_column), self._optional(table, self.messages_column), table.num_rows))
        self._writer = self._writer or pq.ParquetWriter(self.path, table.schema)
        self._writer.write_table(table)
        text = [c for c in (self.prompt_column, self.messages_column) if c in table.column_names]
        self._digest.update(_ipc_bytes(table.drop_columns(text)))
        self.rows += table.num_rows
        return table

    def close(self, empty_schema: pa.Schema) -> None:
        """Finish the file (``empty_schema``: the columns of a snapshot with no rows)."""
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, empty_schema.append(pa.field(CONTENT_KEY, KEY_TYPE)))
        self._writer.add_key_value_metadata({SNAPSHOT_DIGEST: self._digest.hexdigest()})
        self._writer.close()

    @staticmethod
    def _optional(table: pa.Table, name: str):
        return table.column(name).combine_chunks() if name in table.column_names else None


def _ipc_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as stream:
        stream.write_table(table)
    return sink.getvalue().to_pybytes()


# -- reading -------------------------------------------------------------------------------------
def snapshot_digest(path: Path) -> str:
    """What identifies a snapshot's rows: the digest its writer recorded (reading a big snapshot
    whole in every partition would cost seconds), else the file's."""
    recorded = (pq.ParquetFile(path).metadata.metadata or {}).get(SNAPSHOT_DIGEST.encode())
    return recorded.decode() if recorded else file_digest(path)


def file_digest(path: Path) -> str:
    digest = new_digest()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_snapshot(
    path: Path, what: str = "prompt snapshot", filters=None, columns: list[str] | None = None
) -> pa.Table:
    if not path.exists():
        raise FileNotFoundError(f"{what} not found at {path}: materialize the upstream asset first")
    return pq.read_table(path, filters=filters, columns=columns)


def columns_without_text(path: Path, prompt_column: str, messages_column: str) -> list[str] | None:
    """The snapshot's columns a plan needs: all but the prompt text (None: the file is missing)."""
    if not path.exists():
        return None
    return [name for name in pq.ParquetFile(path).schema_arrow.names if name not in {prompt_column, messages_column}]


def require_content_keys(path: Path) -> None:
    """Refuse a snapshot without content keys (written by an older version)."""
    if CONTENT_KEY not in pq.ParquetFile(path).schema_arrow.names:
        raise ValueError(f"the prompt snapshot {path} has no {CONTENT_KEY} column (written by an older "
                         "version): materialize prompts again")


def snapshot_keys(path: Path) -> pa.Array:
    """Every row's content key, in the snapshot's order."""
    require_content_keys(path)
    return pq.read_table(path, columns=[CONTENT_KEY]).column(CONTENT_KEY).combine_chunks()


def snapshot_key_batches(path: Path, batch_rows: int = 1 << 18) -> Iterator[pa.Array]:
    """Every row's content key, in the snapshot's order, ``batch_rows`` at a time (never all at
    once: 16 bytes a row)."""
    require_content_keys(path)
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows, columns=[CONTENT_KEY]):
        yield batch.column(0)


def texts_at(path: Path, rows: pa.Array, prompt_column: str, messages_column: str,
             batch_rows: int) -> Iterator[pa.RecordBatch]:
    """The key and text columns of the snapshot's rows numbered ``rows`` (from 0, in its order), a
    batch at a time, in no set order. DuckDB reads them (a semi-join on the row number, both cores:
    a quarter of the time of scanning the snapshot's text in Python)."""
    import duckdb

    names = set(pq.ParquetFile(path).schema_arrow.names)
    columns = [CONTENT_KEY] + [c for c in (prompt_column, messages_column) if c in names]
    with duckdb.connect() as con:
        bounded_memory(con, path.parent)
        con.register("wanted_rows", pa.table({"row": rows.cast(pa.int64())}))
        selected = ", ".join(quote_identifier(c) for c in columns)
        yield from con.sql(f"SELECT {selected} FROM read_parquet($path, file_row_number = true) "
                           "WHERE file_row_number IN (SELECT row FROM wanted_rows)",
                           params={"path": str(path)}).to_arrow_reader(batch_rows)


def ids_sql(id_column: str) -> str:
    """SQL of the snapshot's ids as text (``id``), its path the one parameter: the table check's."""
    return f"SELECT {quote_identifier(id_column)}::VARCHAR AS id FROM read_parquet(?)"
