"""Token ids cached by row content, so a nightly rerun tokenizes only the rows that changed.

A row's key is a 128-bit hash of what decides its tokens: its chat messages (JSON) when it has
them, else its prompt text. The cache lives in one folder per tokenizer fingerprint (the tokenizer
and chat-template files), as append-only parts of ``(key, token_ids, error)``: a rerun maps the
parts into memory, tokenizes the rows whose key is missing and appends one small part; when half
the entries no longer belong to the table the parts are compacted into one. Parts are Arrow IPC
files, uncompressed, so they map into memory without being decoded (Parquet took 10 s per 2 GB of
token ids to read back): a shard's partition reads just its rows' ids from them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .tokenizing import TokenizedBatch, tokenize_rows

log = logging.getLogger(__name__)

CONTENT_KEY = "_content_key"  # the snapshot column holding each row's key
KEY_TYPE = pa.binary(16)
_SCHEMA = pa.schema([("key", KEY_TYPE), ("token_ids", pa.large_list(pa.int32())), ("error", pa.string())])
_TEXT_BATCH = 16_384  # rows read and tokenized at a time


def content_keys(prompts: pa.Array | None, messages: pa.Array | None, n: int) -> pa.Array:
    """One key per row: chat rows (messages not NULL) hash their messages, the others their prompt."""
    prompts = prompts.to_pylist() if prompts is not None else [None] * n
    messages = messages.to_pylist() if messages is not None else [None] * n
    keys = []
    for prompt, chat in zip(prompts, messages):
        text = b"m\0" + chat.encode() if chat is not None else (b"p\0" + prompt.encode() if prompt is not None else b"n")
        keys.append(hashlib.blake2b(text, digest_size=16).digest())
    return pa.array(keys, KEY_TYPE)


def _gather(token_ids: pa.ChunkedArray, position: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The id lists at ``position`` (global entry numbers) as one int32 array and its offsets.
    Copied as runs of consecutive entries: a rerun's rows mostly come in the cache's order, so a
    million rows are a few thousand slice copies out of the memory-mapped parts (Arrow's take on
    the chunked lists took 13 s at 1M rows x 500 ids)."""
    chunks = token_ids.chunks
    starts = np.cumsum([0] + [len(c) for c in chunks])
    part = np.searchsorted(starts, position, side="right") - 1
    local = position - starts[part]
    chunk_offsets = [c.offsets.to_numpy() for c in chunks]
    values = [c.values.to_numpy(zero_copy_only=False) for c in chunks]
    all_lengths = np.concatenate([np.diff(o) for o in chunk_offsets]) if chunks else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(all_lengths[position])]).astype(np.int64)
    tokens = np.empty(int(offsets[-1]), dtype=np.int32)
    if position.size:
        breaks = np.flatnonzero((part[1:] != part[:-1]) | (local[1:] != local[:-1] + 1)) + 1
        for first, end in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [position.size]])):
            source = chunk_offsets[part[first]]
            tokens[offsets[first]:offsets[end]] = values[part[first]][source[local[first]]:source[local[end - 1] + 1]]
    return tokens, offsets


class TokenCache:
    def __init__(self, folder: str | Path, tokenizer_fingerprint: str):
        self.folder = Path(folder) / tokenizer_fingerprint

    @classmethod
    def at(cls, folder: str | Path) -> "TokenCache":
        """The cache in ``folder`` (a ``TokenCache.folder``: root and fingerprint)."""
        folder = Path(folder)
        return cls(folder.parent, folder.name)

    def _parts(self) -> list[Path]:
        return sorted(self.folder.glob("part-*.arrow"))

    def load(self) -> pa.Table:
        """Every entry, memory-mapped (nothing is read until used)."""
        parts = self._parts()
        if not parts:
            return _SCHEMA.empty_table()
        return pa.concat_tables([pa.ipc.open_file(pa.memory_map(str(p))).read_all() for p in parts])

    def lookup(self, keys: pa.Array, cache: pa.Table | None = None) -> tuple[np.ndarray, np.ndarray, pa.Array]:
        """Token ids (flat int32), offsets and errors of ``keys``, in their order; every key must
        be in the cache."""
        cache = self.load() if cache is None else cache
        position = pc.index_in(keys, value_set=cache.column("key"))
        if position.null_count:
            raise KeyError(f"{position.null_count} rows are not in the token cache {self.folder}: plan again")
        position = position.to_numpy()
        tokens, offsets = _gather(cache.column("token_ids"), position)
        return tokens, offsets, cache.column("error").take(position)

    def _write(self, table: pa.Table, name: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        staging = self.folder / f".{name}.{os.getpid()}.partial"
        with pa.OSFile(str(staging), "wb") as sink, pa.ipc.new_file(sink, _SCHEMA) as writer:
            writer.write_table(table)
        staging.replace(self.folder / name)

    def tokens_for(self, snapshot: Path, tokenizer, prompt_column: str, messages_column: str) -> tuple[TokenizedBatch, dict]:
        """Token ids of every row of a prompt snapshot (written with a ``CONTENT_KEY`` column), in
        its order: cached rows are looked up, the others tokenized (and cached)."""
        started = time.perf_counter()
        if CONTENT_KEY not in pq.ParquetFile(snapshot).schema_arrow.names:
            raise ValueError(f"the prompt snapshot {snapshot} has no {CONTENT_KEY} column (written by an older "
                             "version): materialize prompts again")
        keys = pq.read_table(snapshot, columns=[CONTENT_KEY]).column(CONTENT_KEY).combine_chunks()
        cache = self.load()
        found = pc.index_in(keys, value_set=cache.column("key"))
        cached_rows = len(keys) - found.null_count
        missing = pc.unique(pc.filter(keys, pc.is_null(found)))
        new = self._tokenize(snapshot, missing, tokenizer, prompt_column, messages_column) if len(missing) else None
        if new is not None:
            self._write(new, f"part-{time.time_ns():020d}.arrow")
            cache = pa.concat_tables([cache, new])
        if new is not None and new.num_rows == len(keys) and new.column("key").combine_chunks().equals(keys):
            tokens, offsets = _gather(new.column("token_ids"), np.arange(new.num_rows))  # the first night: in order
            error_column = new.column("error")
        else:
            tokens, offsets, error_column = self.lookup(keys, cache)
        errors = {} if error_column.null_count == len(error_column) else {
            i: e for i, e in enumerate(error_column.to_pylist()) if e is not None}
        batch = TokenizedBatch(tokens, offsets, errors, seconds=time.perf_counter() - started)
        stale = cache.num_rows - len(pc.unique(keys))
        if len(self._parts()) > 1 and 2 * stale >= cache.num_rows:  # half of it rows the table no longer has
            self._compact(cache, keys)
        return batch, {"cached_rows": cached_rows, "tokenized_rows": new.num_rows if new is not None else 0}

    def _tokenize(self, snapshot: Path, missing: pa.Array, tokenizer, prompt_column: str, messages_column: str) -> pa.Table:
        """The missing keys' rows, read from the snapshot in batches (never the whole text at once)."""
        file = pq.ParquetFile(snapshot)
        names = set(file.schema_arrow.names)
        columns = [CONTENT_KEY] + [c for c in (prompt_column, messages_column) if c in names]
        parts, seen = [], set()
        for batch in file.iter_batches(batch_size=_TEXT_BATCH, columns=columns):
            todo = batch.filter(pc.is_in(batch.column(CONTENT_KEY), value_set=missing))
            if not todo.num_rows:
                continue
            key_list = todo.column(CONTENT_KEY).to_pylist()
            keep = [i for i, k in enumerate(key_list) if not (k in seen or seen.add(k))]  # same content once
            todo = todo.take(keep)
            prompts = todo.column(prompt_column).to_pylist() if prompt_column in names else [None] * todo.num_rows
            messages = todo.column(messages_column).to_pylist() if messages_column in names else None
            tokenized = tokenize_rows(tokenizer, prompts, messages)
            token_ids = pa.LargeListArray.from_arrays(pa.array(tokenized.offsets, pa.int64()),
                                                      pa.array(tokenized.tokens, pa.int32()))
            errors = pa.array([tokenized.errors.get(i) for i in range(todo.num_rows)], pa.string())
            parts.append(pa.table([todo.column(CONTENT_KEY), token_ids, errors], schema=_SCHEMA))
        return pa.concat_tables(parts) if parts else _SCHEMA.empty_table()

    def _compact(self, cache: pa.Table, keys: pa.Array) -> None:
        old = self._parts()
        self._write(cache.filter(pc.is_in(cache.column("key"), value_set=keys)), f"part-{time.time_ns():020d}.arrow")
        for path in old:
            path.unlink(missing_ok=True)
