"""The plan table: the one file planning hands to running, and the one module that knows its shape.

One row per prompt row, the rows of each shard together in row groups of their own (a shard reads
its rows, not the file: ``PlanFile``):

    id, position (run order), group, prefix_tokens (the group's shared prefix, whole blocks),
    max_tokens, error, response_format, duplicate_set (rows identical to each other: one runs,
    all get its answer; -1 for most), content_key (names the row's token ids in the token
    cache), shard, partition_key

and in the schema's metadata: the block size, the token cache folder the content keys point
into, the stamp (``plan_stamp``: what the plan was made from) and the run that made it. Token ids
are not in the file (2 GB per million rows every night would cost more than planning):
``PlanFile.shards`` maps them back from the token cache. A shard runs exactly its rows as written,
and refuses a plan whose stamp no longer holds.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..atomic import Staged
from ..damaged import read_by_row_group
from ..response_format import ResponseFormat
from ..table.prompt_snapshot import CONTENT_KEY
from .answer_lengths import AnswerLengths
from .duplicates import NO_SET
from .plan_stamp import ANSWER_STAMP_KEYS, stale_reasons
from .prepared import PreparedBatch
from .token_cache import TokenCache
from .tokenizing import TokenizedBatch

BLOCK_SIZE = "batchllm.block_size"
MAX_MODEL_LEN = "batchllm.max_model_len"  # the context length the plan checked rows against
TOKEN_CACHE = "batchllm.token_cache"  # the token cache folder the content keys point into
PLAN_RUN = "batchllm.plan_run"  # the run (a Dagster run id) that made the plan
COUNTED_FOR = "batchllm.counted_for"  # the platform ('cuda', 'cpu') whose defaults the plan counted in
ANSWER_LENGTHS = "batchllm.answer_lengths"  # what the job's answers were learned to take (``AnswerLengths``)
# The settings fingerprints the plan judged stored answers by (``answer_keys``): the rows it kept run nowhere tonight.
SETTLED_WITH = "batchllm.settled_with"



class PlanError(RuntimeError):
    """The plan on disk cannot run this shard; the message says why."""


class NotInPlan(PlanError):
    def __init__(self, key: str, planned_by: str | None):
        self.key, self.planned_by = key, planned_by
        super().__init__(f"partition {key!r} is not in the current plan (made by run {planned_by})")


class StalePlan(PlanError):
    def __init__(self, reasons: list[str]):
        self.reasons = reasons
        super().__init__(f"the plan is stale: {', '.join(reasons)} changed since it was made")


# -- writing -----------------------------------------------------------------------------------
def _sparse_strings(values: dict[int, str], rows: np.ndarray) -> pa.Array:
    """A string column of ``rows``, NULL except where ``values`` has one (usually none of a million)."""
    if not values:
        return pa.nulls(rows.size, pa.string())
    return pa.array([values.get(int(r)) for r in rows], pa.string())


def format_texts(formats: dict[int, ResponseFormat]) -> dict[int, str]:
    """Rows' own response formats as the plan table holds them."""
    return {i: f.to_text() for i, f in formats.items()}


def rows_columns(ids: pa.Array | pa.ChunkedArray, rows: np.ndarray, position: np.ndarray, group: np.ndarray,
                  prefix_tokens: np.ndarray, max_tokens: np.ndarray, errors: dict[int, str],
                  format_texts: dict[int, str], duplicate_set: np.ndarray | None) -> dict:
    """The run-side columns of ``rows`` (row indices): ``ids``, ``position`` (each one's place in
    run order), ``group``, ``prefix_tokens``, ``max_tokens`` and ``duplicate_set`` (None: no
    identical rows) are theirs already; ``errors`` and ``format_texts`` (``format_texts``) the
    rows' that have one, by row index."""
    return {
        "id": ids,
        "position": np.asarray(position, dtype=np.int64),
        "group": np.asarray(group, dtype=np.int64),
        "prefix_tokens": np.asarray(prefix_tokens, dtype=np.int64),
        "max_tokens": np.asarray(max_tokens, dtype=np.int64),
        "error": _sparse_strings(errors, rows),
        "response_format": _sparse_strings(format_texts, rows),
        "duplicate_set": (np.full(rows.size, NO_SET, dtype=np.int64) if duplicate_set is None
                          else np.asarray(duplicate_set, dtype=np.int64)),
    }


@dataclass(frozen=True)
class PlanRows:
    """Every row's columns of a plan table that the plan's database does not hold (errors, own
    formats as text: the rows that have one), for ``shard_table``."""

    errors: dict[int, str]
    format_texts: dict[int, str]


def plan_file_metadata(block_size: int, token_cache: TokenCache, max_model_len: int, stamp: dict[str, str],
                       plan_run: str, settled_with: list[str] = (), counted_for: str | None = None,
                       answer_lengths: AnswerLengths | None = None) -> dict[str, str]:
    """A plan file's schema metadata: what it counts in (and for which platform), where its content
    keys point, its stamp, its run, the settings fingerprints it kept answered rows by, and the
    answer lengths its shards' admission counts rows at."""
    return {BLOCK_SIZE: str(block_size), TOKEN_CACHE: str(token_cache.folder), MAX_MODEL_LEN: str(max_model_len),
            **stamp, PLAN_RUN: plan_run, **({SETTLED_WITH: ",".join(settled_with)} if settled_with else {}),
            **({COUNTED_FOR: counted_for} if counted_for else {}),
            **({ANSWER_LENGTHS: answer_lengths.to_text()} if answer_lengths else {})}


def shard_table(rows: PlanRows, shard_rows: np.ndarray, ids: pa.Array | pa.ChunkedArray,
                content_keys: pa.Array | pa.ChunkedArray, position: np.ndarray, group: np.ndarray,
                prefix_tokens: np.ndarray, max_tokens: np.ndarray, duplicate_set: np.ndarray, shard: int,
                partition_key: str, metadata: dict[str, str]) -> pa.Table:
    """Part of one shard's plan table: its rows ``shard_rows`` (in input order) with their ids,
    content keys, run position, group, group prefix, budget and duplicate set, as ``write_plan``
    writes them."""
    columns = {**rows_columns(ids, shard_rows, position, group, prefix_tokens, max_tokens, rows.errors,
                               rows.format_texts, duplicate_set),
               CONTENT_KEY: content_keys,
               "shard": np.full(shard_rows.size, shard, dtype=np.int64),
               "partition_key": pa.array([partition_key] * shard_rows.size, pa.string())}
    return pa.table(columns, metadata=metadata)


# A shard's rows are split into row groups of at most this many (a row group is read whole).
PLAN_ROW_GROUP_ROWS = 1 << 20


def write_plan(table: pa.Table | Iterable[pa.Table], path: Path) -> int:
    """Publish the plan whole (readers see the old plan or the new one), each shard's rows in row
    groups of their own, in shard order (Parquet's statistics then name each row group's one
    partition key: ``PlanFile`` reads a shard's rows alone); returns its bytes. ``table``: the whole
    plan table, or its shards' tables in shard order (``JobPlan.plan_tables``)."""
    shards = _by_shard(table) if isinstance(table, pa.Table) else iter(table)
    first = next(shards)
    with Staged(path) as staged, pq.ParquetWriter(staged.path, first.schema) as writer:
        for shard in itertools.chain([first], shards):
            writer.write_table(shard, row_group_size=PLAN_ROW_GROUP_ROWS)
    return path.stat().st_size


def _by_shard(table: pa.Table) -> Iterator[pa.Table]:
    """A whole plan table's shards, in shard order, each its rows in input order (one copied at a time)."""
    shards = table.column("shard").to_numpy()
    order = np.argsort(shards, kind="stable")
    starts = np.flatnonzero(np.diff(shards[order], prepend=-1)) if shards.size else np.zeros(0, np.int64)
    for start, stop in zip(starts, [*starts[1:], shards.size]):
        yield table.take(order[start:stop])
    if not shards.size:
        yield table


# -- reading -----------------------------------------------------------------------------------
def _read(path: Path, filters=None, columns: list[str] | None = None) -> pa.Table:
    if not path.exists():
        raise FileNotFoundError(f"plan not found at {path}: materialize prefix_groups first")
    return pq.read_table(path, filters=filters, columns=columns)


def _plan_run(metadata: dict[bytes, bytes] | None) -> str | None:
    value = (metadata or {}).get(PLAN_RUN.encode())
    return value.decode() if value else None


def plan_content_keys(path: Path) -> pa.Array | None:
    """The content keys the plan on disk names in the token cache (its partitions may be running)."""
    if not path.exists() or CONTENT_KEY not in pq.ParquetFile(path).schema_arrow.names:
        return None
    return _read(path, columns=[CONTENT_KEY]).column(CONTENT_KEY).combine_chunks()


def read_previous_plan(path: Path) -> None:
    """Read what a plan step reads of the plan on disk (ids, shards, content keys), a row group at a
    time: raises where it is damaged (``engine.damaged``: the plan step then sets it aside and plans
    without it)."""
    names = pq.ParquetFile(path).schema_arrow.names
    read_by_row_group(path, [c for c in ("id", "shard", CONTENT_KEY) if c in names], validate=True)


def previous_plan(path: Path, id_type: pa.DataType) -> Path | None:
    """The plan on disk whose shards tonight's rows keep by id (``plan_database.Planned.shard``), so unchanged
    shards keep their rows and partition keys; None without one, or where its ids are of another
    type than ``id_type`` (tonight's: they would not compare)."""
    if not path.exists():
        return None
    return path if pq.read_schema(path).field("id").type == id_type else None


def _counts(metadata: dict[bytes, bytes] | None) -> dict[str, int]:
    """What a plan counts in: its KV ``block_size`` and the ``max_model_len`` it checked rows against.
    Its shards run at them where the job sets none, on whatever machine: a plan made for a GPU on a
    CPU pod (16, the model's own length) runs so on the GPU, and one counted in a CPU's 32 and 2,048
    runs at those on a GPU too."""
    metadata = metadata or {}
    counts = {"block_size": _block_size_of(metadata), "max_model_len": int(metadata.get(MAX_MODEL_LEN.encode(), 0))}
    return {name: value for name, value in counts.items() if value}


def _block_size_of(metadata: dict[bytes, bytes] | None) -> int:
    """The block size a plan table's metadata records (0: none, not a plan table)."""
    return int((metadata or {}).get(BLOCK_SIZE.encode(), b"0"))


def prepared_batch(rows: pa.Table, batch: TokenizedBatch) -> PreparedBatch:
    """A batch from (a filtered part of) a plan table and its rows' token ids."""
    errors = {i: e for i, e in enumerate(rows.column("error").to_pylist()) if e is not None}
    formats = {i: ResponseFormat.from_text(text) for i, text in enumerate(rows.column("response_format").to_pylist())
               if text is not None}
    block_size = _block_size_of(rows.schema.metadata)
    if block_size < 1:
        raise ValueError(f"not a plan table: it has no {BLOCK_SIZE}")
    return PreparedBatch(
        ids=rows.column("id").to_pylist(), id_type=rows.schema.field("id").type, batch=batch,
        max_tokens=rows.column("max_tokens").to_numpy(), errors=errors,
        order=np.argsort(rows.column("position").to_numpy(), kind="stable"),
        group_of_row=rows.column("group").to_numpy(), prefix_tokens_of_row=rows.column("prefix_tokens").to_numpy(),
        block_size=block_size, response_formats=formats,
        duplicate_set=rows.column("duplicate_set").to_numpy() if "duplicate_set" in rows.column_names else None,
        answer_lengths=AnswerLengths.of_text((rows.schema.metadata or {}).get(ANSWER_LENGTHS.encode())),
    )


def _token_ids(rows: pa.Table) -> TokenizedBatch:
    """The rows' token ids from the cache their plan names (error rows have none)."""
    folder = (rows.schema.metadata or {}).get(TOKEN_CACHE.encode())
    if folder is None:
        raise ValueError("not a plan written by prefix_groups: it names no token cache")
    tokens, offsets, _ = TokenCache.at(folder.decode()).lookup(rows.column(CONTENT_KEY).combine_chunks())
    lengths = np.diff(offsets)
    lengths[~pc.is_null(rows.column("error")).to_numpy(zero_copy_only=False)] = 0  # error rows run nothing
    keep = np.repeat(lengths > 0, np.diff(offsets))
    return TokenizedBatch(
        np.asarray(tokens, dtype=np.int32)[keep], np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    )


# What decides a row's answer in a plan: the model and the settings of the stamp, the row's token
# ids (content key), its max_tokens and its response format. The same in the plan on disk when a
# shard writes as in the plan it ran, or the row's answer is superseded. Not the snapshot digest:
# it changes with any row of the table, and an edit of another row must not discard this one.
_ANSWER_COLUMNS = ["id", CONTENT_KEY, "max_tokens", "response_format"]


def answer_identity(rows: pa.Table) -> pa.Table:
    """The rows' answer-deciding columns, with the plan's stamp (see ``PlanFile.superseded``)."""
    stamp = {k: v for k, v in (rows.schema.metadata or {}).items() if k in ANSWER_STAMP_KEYS}
    return rows.select(_ANSWER_COLUMNS).replace_schema_metadata(stamp)


@dataclass(frozen=True)
class PlannedShard:
    """One shard of a plan, as it runs: its rows with their token ids, and what decides their answers."""

    key: str  # its partition key
    number: int | None  # its shard number in the plan (None: a batch planned in process, one shard)
    prepared: PreparedBatch  # its rows, token ids, groups and run order
    identity: pa.Table  # ``answer_identity`` of its rows when loaded (``superseded`` at write time)

    @classmethod
    def whole(cls, prepared: PreparedBatch) -> "PlannedShard":
        """A batch planned in this process, run as one shard (``batchllm run``): no plan file to check."""
        return cls("all", None, prepared, pa.table({"id": pa.array(prepared.ids, prepared.id_type)}))


class PlanFile:
    """The plan on disk, opened once: its counts, the run that made it, a shard's rows, the rows a
    newer plan superseded, the live keys, which of some ids it holds. It reads from the file as it
    was when opened (a plan published since, by a rename, is another file, seen by the next
    ``open``), and never the whole file: its footer at ``open``, then a shard's row groups (``write_plan``
    keeps each shard's rows apart; a plan written otherwise, its rows of any key in one row group,
    is read by row group and filtered), or one column a row group at a time."""

    def __init__(self, path: Path, for_writing: bool = False):
        if not path.exists():
            raise FileNotFoundError(f"plan not found at {path}: materialize prefix_groups first")
        self.path, self._file = path, pq.ParquetFile(path)  # holds the file open: the plan as opened
        self.metadata = self._file.schema_arrow.metadata or {}
        self._columns = _ANSWER_COLUMNS + ["partition_key"] if for_writing else None
        self._row_groups_of, self._mixed = _row_groups_by_key(self._file)

    @classmethod
    def open(cls, path: Path, for_writing: bool = False) -> "PlanFile":
        """The plan at ``path`` (``FileNotFoundError`` saying what to do if there is none);
        ``for_writing``: only what a shard's write checks (``superseded``, ``live_keys``)."""
        return cls(path, for_writing)

    @classmethod
    def at_write(cls, path: Path) -> "PlanFile | None":
        """The plan on disk as a shard writes (None: there is none any more, nothing of the shard is wanted)."""
        return cls.open(path, for_writing=True) if path.exists() else None

    @classmethod
    @contextlib.contextmanager
    def opened_for_running(cls, path: Path, token_cache_root: Path):
        """The plan, held for loading shards: it is read and its entries mapped under the token cache's
        reader lock, so a plan made meanwhile never compacts them away under this run."""
        with TokenCache.reading(token_cache_root):
            yield cls.open(path)

    @property
    def counts(self) -> dict[str, int]:
        """What the plan counts in (``_counts``)."""
        return _counts(self.metadata)

    @property
    def settled_with(self) -> list[str]:
        """The settings fingerprints the plan kept answered rows by (none: it kept none)."""
        value = self.metadata.get(SETTLED_WITH.encode())
        return value.decode().split(",") if value else []

    @property
    def counted_for(self) -> str | None:
        """The platform whose defaults the plan counted in where the job set none (None: not recorded)."""
        value = self.metadata.get(COUNTED_FOR.encode())
        return value.decode() if value else None

    @property
    def plan_run(self) -> str | None:
        return _plan_run(self.metadata)

    def _of_key(self, key: str) -> pa.Table:
        groups = sorted(self._row_groups_of.get(key, []) + self._mixed)
        rows = self._file.read_row_groups(groups, columns=self._columns) if groups else \
            self._file.schema_arrow.empty_table().select(self._columns or self._file.schema_arrow.names)
        rows = rows.filter(pc.equal(rows.column("partition_key"), key)) if self._mixed else rows
        return rows.replace_schema_metadata(self.metadata)

    def shards(self, keys: list[str], stamp: dict[str, str]) -> list[PlannedShard]:
        """The shards of ``keys`` with their rows' token ids (call inside ``opened_for_running``).
        Raises ``NotInPlan`` for the first key the plan has no partition of, then ``StalePlan`` when
        its stamp no longer equals ``stamp`` (checked once: it is the plan's, not a shard's)."""
        rows = {key: self._of_key(key) for key in keys}
        missing = next((key for key, of_key in rows.items() if of_key.num_rows == 0), None)
        if missing is not None:
            raise NotInPlan(missing, self.plan_run)
        stale = stale_reasons(self.metadata, stamp)
        if stale:
            raise StalePlan(stale)
        return [PlannedShard(key, int(of_key["shard"][0].as_py()), prepared_batch(of_key, _token_ids(of_key)),
                             answer_identity(of_key)) for key, of_key in rows.items()]

    def superseded(self, shard: PlannedShard) -> pa.ChunkedArray:
        """The ids of ``shard`` (as it was loaded, from this plan or an older one) whose answers this
        plan no longer wants from it: it moved them to another shard, deleted them, changed their
        prompt, max_tokens or format, or was made from another model or other settings. A newer
        plan has queued its own shards for them; writing the old answers would overwrite fresh ones."""
        ran = shard.identity
        now = answer_identity(self._of_key(shard.key))
        if (now.schema.metadata or {}) != (ran.schema.metadata or {}):
            return ran.column("id")
        at = pc.index_in(ran.column("id"), value_set=now.column("id"))
        kept = pc.is_valid(at)
        for name in _ANSWER_COLUMNS[1:]:  # NULL (no response format) equals NULL here
            theirs = pc.take(now.column(name), at)
            equal = pc.equal(ran.column(name), theirs)
            both_null = pc.and_(pc.is_null(ran.column(name)), pc.is_null(theirs))
            kept = pc.and_(kept, pc.fill_null(pc.or_kleene(equal, both_null), False))
        return pc.filter(ran.column("id"), pc.invert(kept))

    def live_keys(self) -> set[str]:
        """The plan's partition keys: what the job's checkpoints may still serve (from the footer)."""
        keys = set(self._row_groups_of)
        for group in self._mixed:
            keys.update(pc.unique(self._file.read_row_group(group, columns=["partition_key"])
                                  .column("partition_key")).to_pylist())
        keys.discard(None)
        return keys

    @property
    def id_type(self) -> pa.DataType:
        return self._file.schema_arrow.field("id").type

    def ids(self) -> pa.Array:
        """Every id the plan holds (what the answers' table keeps: ``remove_deleted_answers``)."""
        return self._file.read(columns=["id"]).column("id").combine_chunks()

    def ids_of(self, key: str) -> pa.Array:
        """The ids of partition ``key`` (its row groups alone)."""
        return self._of_key(key).column("id").combine_chunks()

    def ids_among(self, ids: pa.Array) -> pa.Array:
        """Those of ``ids`` (of the plan's ``id_type``) the plan holds, read one row group's ids at a
        time: never all of a plan's ids at once."""
        found = np.zeros(len(ids), dtype=bool)
        for group in range(self._file.num_row_groups):
            planned = self._file.read_row_group(group, columns=["id"]).column("id")
            found |= pc.is_in(ids, value_set=planned).to_numpy(zero_copy_only=False)
        return pc.filter(ids, pa.array(found))


def _row_groups_by_key(parquet: pq.ParquetFile) -> tuple[dict[str, list[int]], list[int]]:
    """From the footer: the row groups of each partition key that holds a row group alone (its
    statistics' minimum equals its maximum), and the row groups of several keys or no statistics."""
    column = parquet.schema_arrow.get_field_index("partition_key")
    alone: dict[str, list[int]] = {}
    mixed: list[int] = []
    for group in range(parquet.num_row_groups):
        stats = parquet.metadata.row_group(group).column(column).statistics if column >= 0 else None
        if stats is not None and stats.has_min_max and stats.min == stats.max and stats.null_count == 0:
            alone.setdefault(stats.min, []).append(group)
        elif parquet.metadata.row_group(group).num_rows:
            mixed.append(group)
    return alone, mixed
