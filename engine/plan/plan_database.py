"""A job's plan made on disk: its rows' chains from the token cache into a DuckDB database, the plan
(``sorted_plan``) and its shards (``sorted_shards``) made there by sorts that spill, and read back a
shard at a time (its keys, the plan file) or a group a row (the groups table).

The database's stages each return the next, so the order is the types' to say, not the caller's:

    database = PlanDatabase(folder, block_size)
    loaded = database.load_chains(rows.chains).load_ids(snapshot, id_column)         # Chained, Loaded
    checked = loaded.checked(check_rows(..., find_duplicates=loaded.duplicate_sets))  # Checked
    checked.settle(...)                          # a night after: the rows answered as tonight plans them
    sharded = checked.plan(min_group_rows).shard(count, previous)                    # Planned, Sharded
    sharded.shard_rows("position"), sharded.groups(), sharded.numbers()             # read back

Every row's id and content key are read from the snapshot into the database (``load_ids``) and
come back with their shard's rows. The row checks run in memory on a few numbers a row (lengths,
budgets, errors, formats: ``prepared.check_rows``, the one code for a batch's plan and a job's),
the duplicate sets by a query here (``duplicate_sets``); then the rows' lengths, budgets and sets
are loaded here (``checked``) and the step lets go of them before the plan is made. Never in
memory: the ids and keys, the order, the groups, the shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..sql import quote_identifier
from ..table.dataset import DatasetError
from ..table.prompt_snapshot import CONTENT_KEY, KEY_TYPE, require_content_keys
from .answer_keys import key_sql
from .duplicates import NO_SET, FormatTexts
from .plan_table import PlanRows
from .prepared import CheckedRows
from .row_checks import format_codes
from .sorted_plan import PLAN_MEMORY_MIB, SortedPlan, open_plan_database, plan_rows
from .sorted_shards import ShardTotals, assign_gathered_shards, assign_shards_by_sort

ROW_CHAINS = pa.schema([("row", pa.int64()), ("length", pa.int64()), ("hashes", pa.large_list(pa.uint64()))])
_IDENTITY = pa.schema([("row", pa.int64()), ("max_tokens", pa.int64()), ("format", pa.int32()),
                       ("runnable", pa.bool_())])
_ROW_PLAN = pa.schema([("row", pa.int64()), ("length", pa.int64()), ("max_tokens", pa.int64())])
_BATCH_ROWS = 65_536  # rows read back at a time
_DISK_PER_MILLION_ROWS_GB = 0.5  # the plan's scratch folder at its peak (docs/scale.md: 4.5 GB at 10M rows)


class PlanResourcesError(RuntimeError):
    """The plan's database ran out of disk or memory; the message says where and what it needs."""


class PlanDatabase:
    """One plan's database in ``folder`` (the caller removes the folder after ``close``); its first
    stage is ``load_chains`` (see the module doc). Its queries are the stages' to call."""

    def __init__(self, folder: Path, block_size: int):
        self.folder = Path(folder)
        self.plan = SortedPlan(open_plan_database(folder), block_size)
        self.con = self.plan.connection
        self.count = 0  # shards (``shard``)
        self.id_type: pa.DataType | None = None  # the snapshot's id column's (``load_ids``)

    @contextlib.contextmanager
    def _resources(self):
        """DuckDB out of disk or memory, said with where and what a plan needs (not a bare IO error)."""
        import duckdb

        try:
            yield
        except (duckdb.IOException, duckdb.OutOfMemoryException) as exc:
            what = "memory" if isinstance(exc, duckdb.OutOfMemoryException) else "disk (or could not write)"
            raise PlanResourcesError(
                f"the plan's database in {self.folder.parent} ran out of {what}: {str(exc).splitlines()[0]} "
                f"(a plan needs ~{_DISK_PER_MILLION_ROWS_GB} GB of free disk per million rows there while it is "
                f"made, and DuckDB {PLAN_MEMORY_MIB} MiB of memory: engine.plan.sorted_plan.PLAN_MEMORY_MIB)"
            ) from exc

    @property
    def block_size(self) -> int:
        return self.plan.block_size

    def load_chains(self, chains) -> "Chained":
        """Every row's chain (``CachedRows.chains``, read inside ``TokenCache.writing``'s block) into
        the table ``row_chains``."""
        with self._resources():
            self.con.register("chains", pa.RecordBatchReader.from_batches(ROW_CHAINS,
                                                                          chains.row_batches(_BATCH_ROWS)))
            self.con.execute("CREATE TABLE row_chains AS SELECT * FROM chains")
            self.con.unregister("chains")
        return Chained(self, chains.lengths)

    def _load_ids(self, snapshot: Path, id_column: str) -> int:
        require_content_keys(snapshot)
        self.id_type = pq.read_schema(snapshot).field(id_column).type
        with self._resources():
            id_, key = quote_identifier(id_column), quote_identifier(CONTENT_KEY)
            self.con.execute(f"""CREATE TABLE row_ids AS
                SELECT file_row_number AS row, {id_} AS id, {key} AS key
                FROM read_parquet($path, file_row_number = true)""", {"path": str(snapshot)})
            rows, no_key = self.con.execute("SELECT count(*), count(*) FILTER (WHERE key IS NULL) FROM row_ids"
                                            ).fetchall()[0]
        if no_key:
            raise ValueError(f"{no_key} rows of {snapshot} have no content key")
        return int(rows)

    def _duplicate_sets(self, max_tokens: np.ndarray, response_formats: FormatTexts,
                        runnable: np.ndarray) -> np.ndarray:
        max_tokens, runnable = np.asarray(max_tokens, dtype=np.int64), np.asarray(runnable, dtype=bool)
        n = max_tokens.size
        formats = format_codes(response_formats, n)[1]

        def batches() -> Iterator[pa.RecordBatch]:
            for lo in range(0, n, _BATCH_ROWS):
                hi = min(n, lo + _BATCH_ROWS)
                yield pa.record_batch([pa.array(np.arange(lo, hi, dtype=np.int64)), pa.array(max_tokens[lo:hi]),
                                       pa.array(formats[lo:hi]), pa.array(runnable[lo:hi])], schema=_IDENTITY)

        with self._resources():
            self.con.register("identities", pa.RecordBatchReader.from_batches(_IDENTITY, batches()))
            self.con.execute("""CREATE TABLE runnable_identities AS
                SELECT i.row, r.key, i.max_tokens, i.format FROM identities i JOIN row_ids r ON r.row = i.row
                WHERE i.runnable""")
            self.con.unregister("identities")
            self.con.execute("""CREATE TABLE duplicate_rows AS
                WITH sets AS (SELECT key, max_tokens, format, min(row) AS source FROM runnable_identities
                              GROUP BY ALL HAVING count(*) > 1),
                     numbered AS (SELECT *, (row_number() OVER (ORDER BY source) - 1)::BIGINT AS set FROM sets)
                SELECT i.row, n.set, n.source FROM runnable_identities i JOIN numbered n USING (key, max_tokens, format)
            """)
            self.con.execute("DROP TABLE runnable_identities")
            out = np.full(n, NO_SET, dtype=np.int64)
            for batch in self.con.sql("SELECT row, set FROM duplicate_rows").to_arrow_reader(_BATCH_ROWS):
                out[batch.column(0).to_numpy()] = batch.column(1).to_numpy()
        return out

    def _load_rows(self, lengths: np.ndarray, checked: CheckedRows) -> None:
        dropped = np.zeros(lengths.size, dtype=bool)
        dropped[checked.dropped] = True

        def batches() -> Iterator[pa.RecordBatch]:
            for lo in range(0, lengths.size, _BATCH_ROWS):
                hi = min(lengths.size, lo + _BATCH_ROWS)
                yield pa.record_batch([pa.array(np.arange(lo, hi, dtype=np.int64)),
                                       pa.array(np.where(dropped[lo:hi], 0, lengths[lo:hi]).astype(np.int64)),
                                       pa.array(np.asarray(checked.max_tokens[lo:hi], dtype=np.int64))],
                                      schema=_ROW_PLAN)

        with self._resources():
            self.con.register("row_plan", pa.RecordBatchReader.from_batches(_ROW_PLAN, batches()))
            self.con.execute("CREATE TABLE row_budgets AS SELECT * FROM row_plan")
            self.con.unregister("row_plan")
            self.con.execute("""CREATE TABLE rows_in AS
                SELECT r.row, r.length, CASE WHEN r.length > 0 THEN c.hashes ELSE []::UBIGINT[] END AS hashes,
                       coalesce(d.source, r.row) AS source,
                       CASE WHEN r.length > 0 THEN r.max_tokens ELSE 0 END AS decode
                FROM row_budgets r JOIN row_chains c ON c.row = r.row LEFT JOIN duplicate_rows d ON d.row = r.row""")
            self.con.execute("DROP TABLE row_chains")

    def _make(self, min_group_rows: int) -> None:
        with self._resources():
            plan_rows(self.con, self.plan.block_size, min_group_rows)
            self.con.execute("DROP TABLE rows_in")

    def _settle(self, previous_plan: Path, answers: Path, settings_fps: list[str], rows: PlanRows) -> int:
        extras = pa.table({"row": pa.array(sorted(set(rows.errors) | set(rows.format_texts)), pa.int64())})
        extras = extras.append_column("error", pa.array([rows.errors.get(r) for r in extras["row"].to_pylist()],
                                                        pa.string()))
        extras = extras.append_column("response_format", pa.array(  # noqa: F841 (read by the query below)
            [rows.format_texts.get(r) for r in extras["row"].to_pylist()], pa.string()))
        keys = [key_sql(fp, "i.key", "b.max_tokens", "x.response_format", "x.error") for fp in settings_fps]
        with self._resources():
            self.con.register("row_extras", extras)
            self.con.execute(f"""CREATE TABLE settled AS
                WITH previous AS (SELECT id, arg_min(shard, file_row_number) AS shard,
                                         arg_min(partition_key, file_row_number) AS partition_key
                                  FROM read_parquet($plan, file_row_number = true) GROUP BY id),
                     answered AS (SELECT id, any_value(answer_key) AS answer_key, any_value(status) AS status,
                                         any_value(partition_key) AS partition_key
                                  FROM read_parquet($answers) GROUP BY id HAVING count(*) = 1)
                SELECT i.row, p.shard, p.partition_key
                FROM row_ids i JOIN row_budgets b ON b.row = i.row LEFT JOIN row_extras x ON x.row = i.row
                     JOIN previous p ON p.id = i.id
                     JOIN answered a ON a.id = i.id AND a.partition_key = p.partition_key
                WHERE a.answer_key IN ({", ".join(keys) or "NULL"})
                  AND (a.status = 'ok' OR (a.status = 'error' AND x.error IS NOT NULL))""",
                             {"plan": str(previous_plan), "answers": str(answers)})
            self.con.unregister("row_extras")
            return self._settled_rows()

    def _unsettle(self, shards: list[int]) -> None:
        if shards:
            self.con.execute("DELETE FROM settled WHERE shard IN (SELECT unnest($s::BIGINT[]))", {"s": shards})

    def _kept_keys(self) -> dict[int, str]:
        if not self._has("settled"):
            return {}
        return dict(self.con.execute("SELECT DISTINCT shard, partition_key FROM settled").fetchall())

    def _settled_rows(self) -> int:
        return int(self.con.execute("SELECT count(*) FROM settled").fetchall()[0][0]) if self._has("settled") else 0

    def _has(self, table: str) -> bool:
        return bool(self.con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = ?", [table]
                                     ).fetchall()[0][0])

    def _shard(self, count: int, previous_plan: Path | None, gathered: Callable[[int], list[int]] | None = None
               ) -> ShardTotals:
        with self._resources():
            settled = self._kept_keys()
            if settled and gathered is not None:
                unsettled = self.con.execute("SELECT count(*) FROM plan WHERE row NOT IN (SELECT row FROM settled)"
                                             ).fetchall()[0][0]
                numbers = gathered(int(unsettled)) if unsettled else []
                totals = assign_gathered_shards(self.plan, numbers)
                self.count = int(totals.prefill_tokens.size)
            else:
                if previous_plan is not None:  # its ids are unique: the first row of an id, as a lookup finds it
                    self.con.execute("""CREATE TABLE previous_shards AS
                        SELECT r.row, p.shard FROM row_ids r JOIN (
                            SELECT id, arg_min(shard, file_row_number) AS shard
                            FROM read_parquet($path, file_row_number = true) GROUP BY id) p ON p.id = r.id""",
                                     {"path": str(previous_plan)})
                if self._has("settled"):
                    self.con.execute("DELETE FROM settled")  # nothing kept apart: every shard is cut as before
                totals = assign_shards_by_sort(self.plan, count, previous=previous_plan is not None)
                self.count = count
            self.con.execute(f"""CREATE TABLE planned AS
                SELECT s.shard, p.row, p.position, p.grp, p.prefix_tokens, b.max_tokens,
                       coalesce(d.set, {NO_SET}) AS duplicate_set, i.id, i.key
                FROM plan p JOIN shards s ON s.row = p.row JOIN row_budgets b ON b.row = p.row
                     JOIN row_ids i ON i.row = p.row LEFT JOIN duplicate_rows d ON d.row = p.row
                ORDER BY s.shard""")
            return totals

    def _shard_rows(self, order_by: str) -> Iterator[tuple[int, pa.Table]]:
        for shard in range(self.count):
            with self._resources():
                rows = self.con.sql(
                    "SELECT row, position, grp, prefix_tokens, max_tokens, duplicate_set, id, key FROM planned "
                    f"WHERE shard = $shard ORDER BY {order_by}", params={"shard": shard}).to_arrow_table()
            yield shard, rows.set_column(6, "id", rows.column("id").cast(self.id_type)).set_column(
                7, "key", rows.column("key").cast(KEY_TYPE))

    def _groups(self) -> pa.Table:
        with self._resources():
            groups = self.con.sql("""
                WITH g AS (
                    SELECT p.grp AS "group", arg_min(s.shard, p.position) AS shard, count(*) AS rows,
                           any_value(p.prefix_tokens) AS prefix_tokens, sum(p.length)::BIGINT AS prompt_tokens,
                           sum(p.unique_tokens)::BIGINT AS estimated_prefill_tokens,
                           sum(p.decode)::BIGINT AS estimated_decode_tokens, arg_min(p.row, p.position) AS first_row
                    FROM plan p JOIN shards s ON s.row = p.row GROUP BY p.grp)
                SELECT g.* EXCLUDE (first_row), i.id AS first_id FROM g JOIN row_ids i ON i.row = g.first_row
                ORDER BY 1""").to_arrow_table()
        return groups.set_column(groups.num_columns - 1, "first_id", groups.column("first_id").cast(self.id_type))

    def _numbers(self) -> dict[str, int]:
        with self._resources():
            groups, shared, prompt, unique = self.con.execute("""
                SELECT count(DISTINCT grp), count(DISTINCT grp) FILTER (WHERE prefix_tokens > 0),
                       coalesce(sum(length), 0)::BIGINT, coalesce(sum(unique_tokens), 0)::BIGINT
                FROM plan""").fetchall()[0]
            copies = self.con.execute("SELECT count(*) - count(DISTINCT set) FROM duplicate_rows").fetchall()[0][0]
            return {"groups": groups, "shared_groups": shared, "prompt_tokens": prompt, "unique_tokens": unique,
                    "duplicate_rows": copies}

    def close(self) -> None:
        self.plan.close()


@dataclass(frozen=True)
class Chained:
    """The rows' chains loaded; next, their ids and keys (``load_ids``)."""

    database: PlanDatabase
    lengths: np.ndarray  # each row's prompt tokens

    def load_ids(self, snapshot: Path, id_column: str) -> "Loaded":
        """Every row's id and content key, read by DuckDB from the prompt snapshot into the table
        ``row_ids(row, id, key)`` (``row``: its number in the snapshot's order), so neither is in the
        step's memory (24 bytes a row of integer ids). Refused where the snapshot has other rows
        than the chains (replaced meanwhile)."""
        rows = self.database._load_ids(snapshot, id_column)
        if rows != self.lengths.size:  # replaced meanwhile (the stamp would refuse the plan too)
            raise DatasetError(f"the prompt snapshot {snapshot} changed while it was read: plan again")
        return Loaded(self.database, self.lengths)


@dataclass(frozen=True)
class Loaded:
    """Every row's chain, id and key loaded: the row checks run on ``lengths`` (and
    ``duplicate_sets``), then ``checked`` takes what they found."""

    database: PlanDatabase
    lengths: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.lengths.size)

    def duplicate_sets(self, max_tokens: np.ndarray, response_formats: FormatTexts,
                       runnable: np.ndarray) -> np.ndarray:
        """``duplicates.duplicate_sets`` of the loaded rows (its other arguments, its answer) found by
        a query: the sets, and each member's set and source (its set's first row) kept in the table
        ``duplicate_rows`` (for ``checked`` and the plan file). Nothing a row held in memory but the
        answer (the sort in memory held ~100 bytes a row)."""
        return self.database._duplicate_sets(max_tokens, response_formats, runnable)

    def checked(self, checked: CheckedRows) -> "Checked":
        """The rows as the plan takes them (``rows_in``): those that cannot run (``checked.dropped``)
        emptied, each duplicate set planned once (from its first row: ``duplicate_sets``, which the
        row checks ran here), a row's decode estimate its budget; and each row's budget kept for the
        plan file (``row_budgets``). The caller may let go of ``checked`` after: nothing of every row
        stays in memory while the plan is made."""
        self.database._load_rows(self.lengths, checked)
        return Checked(self.database, self.rows)


@dataclass(frozen=True)
class Checked:
    """The rows checked and loaded as the plan takes them: a night after, ``settle`` the rows
    answered as tonight plans them; then ``plan``."""

    database: PlanDatabase
    rows: int

    @property
    def id_type(self) -> pa.DataType:
        return self.database.id_type

    def settle(self, previous_plan: Path, answers: Path, settings_fps: list[str], rows: PlanRows) -> int:
        """The rows answered as tonight plans them, into the table ``settled(row, shard, partition_key)``:
        each keeps the shard and partition of the previous plan, where its one stored answer (in
        ``answers``, a Parquet file of the output table's ``id, answer_key, status, partition_key``)
        is under that partition with tonight's answer key (``answer_keys``: under one of
        ``settings_fps``, the row's content key, budget, own format and plan error) and is an answer
        (an error only where the plan itself gives the row that error). ``rows``: the rows' errors and
        own formats. Returns how many rows settled (the rest need a run)."""
        return self.database._settle(previous_plan, answers, settings_fps, rows)

    def unsettle(self, shards: list[int]) -> None:
        """The rows of these previous shards need a run after all (their partition cannot be kept)."""
        self.database._unsettle(shards)

    def kept_keys(self) -> dict[int, str]:
        """The previous shards whose settled rows stay, each with its partition key (none before ``settle``)."""
        return self.database._kept_keys()

    def settled_rows(self) -> int:
        """The rows ``settle`` kept (less those ``unsettle`` gave back)."""
        return self.database._settled_rows()

    def plan(self, min_group_rows: int) -> "Planned":
        """The plan of the checked rows (``sorted_plan``)."""
        self.database._make(min_group_rows)
        return Planned(self.database, self.rows)


@dataclass(frozen=True)
class Planned:
    """The plan made; next, its shards (``shard``)."""

    database: PlanDatabase
    rows: int

    def kept_keys(self) -> dict[int, str]:
        return self.database._kept_keys()

    def shard(self, count: int, previous_plan: Path | None, gathered: Callable[[int], list[int]] | None = None
              ) -> "Sharded":
        """``count`` shards, kept from ``previous_plan`` (the plan file on disk: each row keeps the
        shard its id had there, ``plan_table.previous_plan``) where they can be: the table
        ``planned``, each row's shard, run position, group, group prefix, budget, duplicate set, id
        and key, stored by shard (a shard's rows are then a few of its row groups: ``shard_rows``).
        Where rows settled (``Checked.settle``), they stay in their shards and only the rest are cut,
        into the shards ``gathered(rows_to_run)`` numbers: a night after pays for what changed."""
        return Sharded(self.database, self.database._shard(count, previous_plan, gathered))


@dataclass(frozen=True)
class Sharded:
    """The plan and its shards, read back a shard or a group at a time."""

    database: PlanDatabase
    totals: ShardTotals  # per shard: tokens computed, decode estimate, cost; the groups split

    @property
    def block_size(self) -> int:
        return self.database.block_size

    def kept_keys(self) -> dict[int, str]:
        """The previous shards whose rows all stay (none where nothing settled: every shard was cut)."""
        return self.database._kept_keys()

    def shard_rows(self, order_by: str) -> Iterator[tuple[int, pa.Table]]:
        """Each shard's rows (``row, position, grp, prefix_tokens, max_tokens, duplicate_set, id,
        key``: the id and key of the snapshot's types) by ``order_by`` (``position``: run order;
        ``row``: input order), one shard at a time, every shard (empty ones too)."""
        return self.database._shard_rows(order_by)

    def groups(self) -> pa.Table:
        """One row per group, in run order: its shard (its first row's), rows, prefix, tokens and
        first row's id (the snapshot's type)."""
        return self.database._groups()

    def numbers(self) -> dict[str, int]:
        """The plan's groups, groups with a shared prefix, prompt tokens, tokens it computes, and rows
        that take another row's answer (``duplicates.count_duplicates``)."""
        return self.database._numbers()
