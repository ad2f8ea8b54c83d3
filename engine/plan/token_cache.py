"""Token ids and block hashes cached by row content, so a nightly rerun tokenizes only the rows that changed.

A row's key is its content key (``prompt_snapshot.content_keys``). The cache lives in one folder per
tokenizer fingerprint (the tokenizer and chat-template files), as append-only parts of ``(key,
token_ids, block_hashes, error)``: a rerun maps the parts into memory, tokenizes the rows whose key
is missing and appends a small part; when half the entries no longer belong to the table the parts
are compacted into one. Each entry keeps its row's chained block hashes (``RowBlocks``; a part
records their block size and hash version), so the plan of a million rows reads 8 bytes per block
instead of 4 per token, and hashes only what changed. Parts are Arrow IPC files, uncompressed, so
they map into memory without being decoded (Parquet's decoding was the cost of a read back): a
shard's partition reads just its rows' ids from them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..atomic import Staged
from ..damaged import DAMAGE, set_aside
from ..locks import locked
from ..table.dataset import Columns, DatasetError
from ..table.prompt_snapshot import CONTENT_KEY, KEY_TYPE, snapshot_key_batches, snapshot_keys, texts_at
from .block_hashes import HASH_VERSION, RowBlocks
from .key_index import KeyIndex, first_positions_among
from .tokenize_workers import TokenizeWorkers
from .tokenizing import tokenize_rows

log = logging.getLogger(__name__)

_HASHED_AS = b"batchllm.block_hashes"  # a part's metadata: how its hashes were made (_hashed_as)
_SCHEMA = pa.schema([("key", KEY_TYPE), ("token_ids", pa.large_list(pa.int32())),
                     ("block_hashes", pa.large_list(pa.uint64())), ("error", pa.string())])
_TEXT_BATCH = 16_384  # rows read and tokenized at a time
_WORKER_BATCH = 65_536  # rows a worker tokenizes and writes as one part (~10 s of its work)
_ID_COLUMNS = ["key", "token_ids", "error"]  # what a partition's lookup reads (any part version has them)
_PART_ROWS = 262_144  # new entries per published part: what a crash can lose
_REPORT_S = 10.0  # seconds between progress lines while tokenizing


def _hashed_as(block_size: int) -> bytes:
    """The hash function's version and the block size: parts made otherwise are hashed again."""
    return f"v{HASH_VERSION} blocks of {block_size}".encode()


def _lengths_at(lists: pa.ChunkedArray, position: np.ndarray) -> np.ndarray:
    """The lengths of the lists at ``position`` (global entry numbers), from the offsets alone (no
    values read, and no length of every entry held)."""
    starts = np.cumsum([0] + [len(c) for c in lists.chunks])
    part = np.searchsorted(starts, position, side="right") - 1
    lengths = np.empty(position.size, dtype=np.int64)
    for number in np.unique(part):
        here = np.flatnonzero(part == number)
        local, offsets = position[here] - starts[number], lists.chunks[number].offsets.to_numpy()
        lengths[here] = offsets[local + 1] - offsets[local]
    return lengths


def _gather(lists: pa.ChunkedArray, position: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The lists at ``position`` (global entry numbers) as one flat array and its offsets.
    Copied as runs of consecutive entries: a rerun's rows mostly come in the cache's order, so a
    million rows are a few thousand slice copies out of the memory-mapped parts (Arrow's take on
    the chunked lists was slower: docs/benchmark-history.md)."""
    chunks = lists.chunks
    starts = np.cumsum([0] + [len(c) for c in chunks])
    part = np.searchsorted(starts, position, side="right") - 1
    local = position - starts[part]
    chunk_offsets = [c.offsets.to_numpy() for c in chunks]
    values = [c.values.to_numpy(zero_copy_only=False) for c in chunks]
    offsets = np.concatenate([[0], np.cumsum(_lengths_at(lists, position))]).astype(np.int64)
    flat = np.empty(int(offsets[-1]), dtype=lists.type.value_type.to_pandas_dtype())
    if position.size:
        breaks = np.flatnonzero((part[1:] != part[:-1]) | (local[1:] != local[:-1] + 1)) + 1
        for first, end in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [position.size]])):
            source = chunk_offsets[part[first]]
            flat[offsets[first]:offsets[end]] = values[part[first]][source[local[first]]:source[local[end - 1] + 1]]
    return flat, offsets


def _errors_at(errors: pa.ChunkedArray, position: np.ndarray) -> dict[int, str]:
    """``{i: error}`` of the entries at ``position`` that have one (few: only those become Python)."""
    if errors.null_count == len(errors):
        return {}
    with_error = np.flatnonzero(pc.is_valid(errors).to_numpy(zero_copy_only=False))
    rows = np.flatnonzero(np.isin(position, with_error))
    return dict(zip(rows.tolist(), errors.take(pa.array(position[rows])).to_pylist()))


def _concat(parts: list[tuple[Path, pa.Table]], block_size: int | None) -> pa.Table:
    """The parts' entries as one table (``load``)."""
    if not parts:
        empty = _SCHEMA.empty_table()
        return empty if block_size is not None else empty.select(_ID_COLUMNS)
    return pa.concat_tables([table for _, table in parts])


def _items_at(lists: pa.ChunkedArray, entries: np.ndarray, index: int) -> np.ndarray:
    """Item ``index`` of the lists at ``entries`` (entry numbers over the chunks), no list copied."""
    starts = np.cumsum([0] + [len(c) for c in lists.chunks])
    chunk_of = np.searchsorted(starts, entries, side="right") - 1
    out = np.empty(entries.size, dtype=lists.type.value_type.to_pandas_dtype())
    for number, chunk in enumerate(lists.chunks):
        here = chunk_of == number
        if here.any():
            out[here] = chunk.values.to_numpy()[chunk.offsets.to_numpy()[entries[here] - starts[number]] + index]
    return out


@dataclass
class _PartChains:
    """Rows' block hashes where they lie, in the cache's parts (``RowBlocks`` holds them in memory):
    a plan loads them a part at a time (``row_batches``), each part mapped on its own and let go
    before the next. Read under the writer lock: no compaction deletes a part meanwhile."""

    block_size: int
    lengths: np.ndarray
    paths: list[Path]
    part: np.ndarray  # each row's part (index into ``paths``), int32
    entry: np.ndarray  # each row's entry in its part, int32 (a compacted part holds every entry: far below 2**31)

    @classmethod
    def of(cls, parts: list[tuple[Path, int]], position: np.ndarray, lengths: np.ndarray,
           block_size: int) -> "_PartChains":
        """The rows at ``position`` (entry numbers over ``parts``, each a path and its entries, in
        their order)."""
        starts = np.cumsum([0] + [entries for _, entries in parts])
        part = (np.searchsorted(starts, position, side="right") - 1).astype(np.int32)
        return cls(block_size, lengths, [path for path, _ in parts], part, (position - starts[part]).astype(np.int32))

    def row_batches(self, batch_rows: int = _WORKER_BATCH) -> Iterator[pa.RecordBatch]:
        """Every row's ``(row, length, hashes)``, a part's rows at a time (each part mapped while its
        rows are read, then let go), in batches of at most ``batch_rows``: a plan made on disk
        (``sorted_plan``) loads them so."""
        for number, path in enumerate(self.paths):
            rows = np.flatnonzero(self.part == number)  # a pass a part: no order of every row held
            if not rows.size:
                continue
            with pa.memory_map(str(path)) as source:
                hashes = pa.ipc.open_file(source).read_all().column("block_hashes")
                for lo in range(0, rows.size, batch_rows):
                    some = rows[lo:lo + batch_rows]
                    flat, offsets = _gather(hashes, self.entry[some])
                    yield pa.record_batch([pa.array(some, pa.int64()), pa.array(self.lengths[some], pa.int64()),
                                           pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()),
                                                                         pa.array(flat, pa.uint64()))],
                                          names=["row", "length", "hashes"])
                del hashes

def _entries(
    keys: pa.Array, tokens: np.ndarray, offsets: np.ndarray, errors: pa.Array, block_size: int
) -> pa.RecordBatch:
    """Cache entries of rows ``tokens[offsets[i]:offsets[i + 1]]``, with their block hashes
    (computed here, once per content)."""
    blocks = RowBlocks.of_tokens(tokens, offsets, block_size)
    token_ids = pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(tokens, pa.int32()))
    hashes = pa.LargeListArray.from_arrays(pa.array(blocks.offsets), pa.array(blocks.hashes, pa.uint64()))
    return pa.record_batch([keys, token_ids, hashes, errors], schema=_SCHEMA)


def entries_of(batch: pa.Table, tokenizer, prompt_column: str, messages_column: str,
               block_size: int) -> pa.RecordBatch:
    """Cache entries of a batch of rows (their content key and text columns): tokenized, hashed."""
    names = batch.schema.names
    prompts = batch.column(prompt_column).to_pylist() if prompt_column in names else [None] * batch.num_rows
    messages = batch.column(messages_column).to_pylist() if messages_column in names else None
    tokenized = tokenize_rows(tokenizer, prompts, messages)
    errors = pa.array([tokenized.errors.get(i) for i in range(batch.num_rows)], pa.string())
    return _entries(batch.column(CONTENT_KEY).cast(KEY_TYPE), tokenized.tokens, tokenized.offsets, errors, block_size)


def write_part(folder: Path, name: str, batches, block_size: int, max_rows: int | None = None) -> int:
    """Write record batches from an iterator as one part of the cache in ``folder``, up to about
    ``max_rows`` rows (the rest stay in the iterator), published whole (staged, then renamed);
    returns the rows written (0: no part was written)."""
    schema = _SCHEMA.with_metadata({_HASHED_AS: _hashed_as(block_size)})
    rows = 0
    with Staged(folder / name) as staged:
        with pa.OSFile(str(staged.path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for batch in batches:
                writer.write_batch(batch.replace_schema_metadata(schema.metadata))
                rows += batch.num_rows
                if max_rows is not None and rows >= max_rows:
                    break
        if not rows:
            staged.discard()
    return rows


def _part_name() -> str:
    """A new part's name: parts sort by when they were written (a worker's pid keeps two apart)."""
    return f"part-{time.time_ns():020d}-{os.getpid()}.arrow"


def _token_count(entries: pa.RecordBatch) -> int:
    return pc.sum(pc.list_value_length(entries.column("token_ids"))).as_py() or 0


def written_by_worker(batch: pa.Table, tokenizer, folder: str, prompt_column: str, messages_column: str,
                      block_size: int) -> tuple[int, int]:
    """A worker's task (``TokenizeWorkers.map``): the batch's entries written as a part of the cache
    in ``folder`` by the worker itself, so only two numbers travel back: its rows and tokens."""
    entries = entries_of(batch, tokenizer, prompt_column, messages_column, block_size)
    write_part(Path(folder), _part_name(), [entries], block_size)
    return entries.num_rows, _token_count(entries)


@dataclass
class CachedRows:
    """A snapshot's rows as the planner reads them from the cache (``CacheWriter.rows``), no token
    ids: where each row's chain of block hashes lies (``chains``, read a part at a time while the
    ``with`` block of ``TokenCache.writing`` holds the cache), and why rows have none."""

    chains: "_PartChains"
    errors: dict[int, str]  # row index -> why it has no tokens
    seconds: float  # looking up and tokenizing
    cached_rows: int  # rows whose content was in the cache
    tokenized_rows: int  # distinct contents tokenized now
    stale_entries: int  # entries of the cache no row of the snapshot names
    entries: int  # entries of the cache

    @property
    def lengths(self) -> np.ndarray:
        return self.chains.lengths

    @property
    def worth_compacting(self) -> bool:
        """Whether half the cache's entries, in more than one part, are contents the snapshot no
        longer has (``CacheWriter.compact``)."""
        return len(self.chains.paths) > 1 and 2 * self.stale_entries >= self.entries


class TokenCache:
    """Safe for concurrent readers and writers: one writer at a time (``writing`` holds the
    root's writer lock), and parts are deleted (compaction) only under the root's exclusive
    reader lock, which ``reading()`` holds shared: a partition that has read its plan and maps its
    entries under ``reading()`` never sees them disappear, and entries the plan on disk names are
    kept by compaction."""

    def __init__(self, folder: str | Path, tokenizer_fingerprint: str,
                 on_damaged: Callable[[str], None] = log.warning):
        self.root = Path(folder)
        self.folder = self.root / tokenizer_fingerprint
        self.on_damaged = on_damaged  # told, in one line, of a damaged part set aside (``engine.damaged``)

    @staticmethod
    def reading(root: str | Path):
        """Hold while reading a plan and mapping the entries it names in the cache under ``root``
        (any tokenizer's): no part is deleted meanwhile."""
        return locked(Path(root) / ".readers.lock", shared=True)

    @classmethod
    def at(cls, folder: str | Path) -> "TokenCache":
        """The cache in ``folder`` (a ``TokenCache.folder``: root and fingerprint)."""
        folder = Path(folder)
        return cls(folder.parent, folder.name)

    def _parts(self) -> list[Path]:
        return sorted(self.folder.glob("part-*.arrow"))

    def load(self, block_size: int | None = None) -> pa.Table:
        """Every entry, memory-mapped (nothing is read until used). With ``block_size``, a part
        hashed in other blocks (or by an older version, without hashes) is hashed again first."""
        return _concat(self._mapped(block_size), block_size)

    def _mapped(self, block_size: int | None) -> list[tuple[Path, pa.Table]]:
        """Each readable part with its entries, memory-mapped (``load``)."""
        tables = []
        for path in self._parts():
            try:
                table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
                table.validate()
            except DAMAGE as exc:  # its rows are missing now: a plan tokenizes them again
                set_aside(path, exc, "the token cache part", "its rows are tokenized again", self.on_damaged)
                continue
            if block_size is not None and (table.schema.metadata or {}).get(_HASHED_AS) != _hashed_as(block_size):
                log.info("hashing the token cache part %s in blocks of %d", path.name, block_size)
                tokens, offsets = _gather(table.column("token_ids"), np.arange(table.num_rows))
                entries = _entries(table.column("key").combine_chunks(), tokens, offsets,
                                   table.column("error").combine_chunks(), block_size)
                self._write([entries], path.name, block_size)
                table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
            tables.append((path, table if block_size is not None else table.select(_ID_COLUMNS)))
        return tables

    def lookup(self, keys: pa.Array) -> tuple[np.ndarray, np.ndarray, pa.Array]:
        """Token ids (flat int32), offsets and errors of ``keys``, in their order; every key must
        be in the cache."""
        cache = self.load()
        position = self._positions(keys, cache)
        tokens, offsets = _gather(cache.column("token_ids"), position)
        return tokens, offsets, cache.column("error").take(position)

    def _positions(self, keys: pa.Array, cache: pa.Table) -> np.ndarray:
        """Each key's entry in ``cache``, for far fewer keys than entries (a shard's lookup): the
        keys are indexed and the entries scanned (a ``KeyIndex`` of every entry would hold 20 bytes
        an entry for a shard's few keys)."""
        return self._all_found(first_positions_among(keys, cache.column("key")))

    def _all_found(self, position: np.ndarray) -> np.ndarray:
        if (position < 0).any():
            raise KeyError(f"{np.count_nonzero(position < 0)} rows are not in the token cache {self.folder}: "
                           "plan again")
        return position

    def _write(self, batches, name: str, block_size: int, max_rows: int | None = None) -> int:
        return write_part(self.folder, name, batches, block_size, max_rows)

    @contextlib.contextmanager
    def writing(self, snapshot: Path, block_size: int) -> Iterator["CacheWriter"]:
        """``with cache.writing(snapshot, block_size) as writer:`` the cache's one writer (its writer
        lock held through the block), for a prompt snapshot written with a ``CONTENT_KEY`` column.
        Its stages each take what the one before returns: ``look_up`` -> ``tokenize`` -> ``rows``
        (their chains readable until the block ends or ``compact``)."""
        with locked(self.root / ".writer.lock", shared=False):
            yield CacheWriter(self, snapshot, block_size)

    def _tokenize(self, snapshot: Path, missing: pa.Array, tokenizer, prompt_column: str, messages_column: str,
                  block_size: int, progress: Callable[[str], None], workers: TokenizeWorkers) -> int:
        """The ``missing`` rows (a content's first row, once) tokenized into new parts, a batch at a
        time (never the whole text at once); returns the rows written. Here, parts of up to
        ``_PART_ROWS``; on ``workers``, each writes its batch's part itself (only counts come back:
        no token ids through the driver)."""
        columns = (prompt_column, messages_column, block_size)
        used = workers.used_for(len(missing))
        report = _Progress(len(missing), used, progress)
        if used > 1:
            model = getattr(tokenizer, "model_path", None) or tokenizer.name_or_path
            contents = _new_contents(snapshot, missing, prompt_column, messages_column, _WORKER_BATCH)
            for rows, tokens in workers.map(contents, model, written_by_worker, str(self.folder), *columns):
                report(rows, tokens)
            return report.rows

        def entries() -> Iterator[pa.RecordBatch]:
            for batch in _new_contents(snapshot, missing, prompt_column, messages_column, _TEXT_BATCH):
                out = entries_of(batch, tokenizer, *columns)
                report(out.num_rows, _token_count(out))
                yield out

        batches, written = entries(), 0
        while rows := self._write(batches, _part_name(), block_size, _PART_ROWS):
            written += rows
        return written

    def _compact(self, parts: list[Path], keys: pa.Array, keep: pa.Array | None, block_size: int) -> None:
        """Rewrite ``parts`` (those a writer read: never one another writer added since) as one,
        keeping the entries of ``keys`` and ``keep``."""
        with locked(self.root / ".readers.lock", shared=False):
            if keep is not None and len(keep):
                chunks = keys.chunks if isinstance(keys, pa.ChunkedArray) else [keys]
                keys = pa.chunked_array([*chunks, keep.cast(KEY_TYPE)], KEY_TYPE)
            cache = pa.concat_tables([pa.ipc.open_file(pa.memory_map(str(path))).read_all() for path in parts])
            kept = cache.filter(KeyIndex(keys).first_positions(cache.column("key")) >= 0)
            self._write(kept.to_batches(), _part_name(), block_size)
            for path in parts:
                path.unlink(missing_ok=True)


@dataclass
class Lookup:
    """Each row of a snapshot's entry in the cache (``found``, -1: its content is not there)."""

    found: np.ndarray
    cached_rows: int  # rows whose content was in the cache before tokenizing
    tokenized_rows: int  # distinct contents tokenized into it since
    started: float  # when the lookup began (``perf_counter``)


class CacheWriter:
    """The stages of one writer of the cache for one snapshot (``TokenCache.writing``): look the
    rows up, tokenize those missing, read where each row's chain lies, compact where half the
    entries are stale. Each is a call of its own, so the caller decides what it holds between
    them (a plan lets go of the lookup before loading the chains, and reads the keys to keep only
    where it compacts)."""

    def __init__(self, cache: TokenCache, snapshot: Path, block_size: int):
        self.cache, self.snapshot, self.block_size = cache, snapshot, block_size

    def look_up(self) -> Lookup:
        """Each row's entry in the cache as it is (a part hashed in other blocks is hashed again)."""
        started = time.perf_counter()
        found = _snapshot_in(_concat(self.cache._mapped(self.block_size), self.block_size), self.snapshot)
        return Lookup(found, int(np.count_nonzero(found >= 0)), 0, started)

    def tokenize(self, lookup: Lookup, tokenizer, columns: Columns, progress: Callable[[str], None] = log.info,
                 workers: TokenizeWorkers = TokenizeWorkers()) -> Lookup:
        """The lookup once the rows it misses are tokenized into the cache (a content's first row,
        once; ``progress`` hears how far it got; on ``workers`` where there are many)."""
        missing = _first_rows_missing(self.snapshot, lookup.found)
        pa.default_memory_pool().release_unused()  # the missing rows' keys: Arrow would keep their pages
        if not len(missing):
            return lookup
        # Streamed into new parts batch by batch: the first night never holds the table's token
        # ids in memory, and parts are published as they are written, so a crash loses at most one
        # part's tokenizing.
        tokenized = self.cache._tokenize(self.snapshot, missing, tokenizer, columns.prompt, columns.messages,
                                         self.block_size, progress, workers)
        del missing
        found = _snapshot_in(_concat(self.cache._mapped(self.block_size), self.block_size), self.snapshot)
        return Lookup(found, lookup.cached_rows, tokenized, lookup.started)

    def rows(self, lookup: Lookup) -> CachedRows:
        """Every row's length and where its chain of block hashes lies (no token ids), and why rows
        have none; every row must have been found (``tokenize``)."""
        parts = self.cache._mapped(self.block_size)
        cache = _concat(parts, self.block_size)
        position = self.cache._all_found(lookup.found)
        lengths = _lengths_at(cache.column("token_ids"), position)
        errors = _errors_at(cache.column("error"), position)
        sizes = [(path, table.num_rows) for path, table in parts]
        # The parts mapped here let go: the pages read (keys, offsets: 24 bytes an entry) would stay
        # in the process's memory while the chains are read.
        del cache, parts
        entries = sum(size for _, size in sizes)
        chains = _PartChains.of(sizes, position, lengths, self.block_size)
        return CachedRows(chains, errors, time.perf_counter() - lookup.started, lookup.cached_rows,
                          lookup.tokenized_rows, entries - _distinct(position, entries), entries)

    def compact(self, rows: CachedRows, keep: pa.Array | None = None) -> None:
        """The parts ``rows`` were read from rewritten as one, keeping the snapshot's entries and
        ``keep``'s (the keys of a previous plan whose partitions may still run): where
        ``rows.worth_compacting``. ``rows``' chains are gone with the parts it replaces."""
        self.cache._compact(rows.chains.paths, snapshot_keys(self.snapshot), keep, self.block_size)


def _distinct(position: np.ndarray, entries: int) -> int:
    """How many of ``entries`` the rows at ``position`` name: the table's distinct contents (a byte
    an entry, where hashing every row's key again would build a table of them all)."""
    named = np.zeros(entries, dtype=bool)
    named[position] = True
    return int(np.count_nonzero(named))


def _snapshot_in(cache: pa.Table, snapshot: Path) -> np.ndarray:
    """Each snapshot row's entry in ``cache`` (-1: its content is not there), the snapshot's keys
    read a batch at a time: what is held is the cache's index and the answer."""
    index = KeyIndex(cache.column("key"))
    found = np.empty(pq.ParquetFile(snapshot).metadata.num_rows, dtype=np.int64)
    start = 0
    for keys in snapshot_key_batches(snapshot):
        found[start:start + len(keys)] = index.first_positions(keys)
        start += len(keys)
    if start != found.size:  # replaced meanwhile: the plan would be of two snapshots
        raise DatasetError(f"the prompt snapshot {snapshot} changed while it was read: plan again")
    return found


def _first_rows_missing(snapshot: Path, found: np.ndarray) -> pa.Array:
    """The snapshot's rows whose content the cache lacks (``found`` -1), each content's first row
    alone (int64 row numbers)."""
    missing = np.flatnonzero(found < 0)
    if not missing.size:  # every row's content is cached
        return pa.array([], pa.int64())
    pieces, start = [], 0
    for keys in snapshot_key_batches(snapshot):  # the missing rows' keys alone
        here = missing[np.searchsorted(missing, start):np.searchsorted(missing, start + len(keys))] - start
        pieces.append(keys.take(pa.array(here)))
        start += len(keys)
    keys = pa.concat_arrays(pieces)
    first = KeyIndex(keys).first_positions(keys)  # each missing content's first row among them
    return pa.array(missing[first == np.arange(missing.size)])


def _new_contents(snapshot: Path, rows: pa.Array, prompt_column: str, messages_column: str,
                  batch_rows: int) -> Iterator[pa.RecordBatch]:
    """The snapshot's ``rows`` (each a content the cache lacks, once) in batches of up to ``batch_rows``."""
    for batch in texts_at(snapshot, rows, prompt_column, messages_column, batch_rows):
        if batch.num_rows:
            yield batch


class _Progress:
    """Progress lines while tokenizing: rows and tokens so far, the rate and what is left."""

    def __init__(self, total: int, workers: int, say: Callable[[str], None]):
        self.total, self.workers, self.say = total, workers, say
        self.rows = self.tokens = 0
        self.started = self.last = time.perf_counter()

    def __call__(self, rows: int, tokens: int) -> None:
        self.rows, self.tokens = self.rows + rows, self.tokens + tokens
        now = time.perf_counter()
        if now - self.last >= _REPORT_S or self.rows == self.total:
            self.last, elapsed = now, now - self.started
            eta = (self.total - self.rows) * elapsed / max(self.rows, 1)
            on = f" on {self.workers} workers" if self.workers > 1 else ""
            self.say(f"tokenized {self.rows:,} of {self.total:,} new contents ({self.tokens:,} tokens, "
                     f"{self.tokens / max(elapsed, 1e-9):,.0f} tokens/s{on}, eta {eta:.0f}s)")
