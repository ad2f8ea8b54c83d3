"""The job's output table, its one owner: each row is the engine's result for one id (the columns
of ``engine.run.results``) and then the columns of the partition that answered it. ``OutputTable``
is the only code that reads or writes it in SQL (the assets, checks and pruning call its methods):
its transactions, the names of its columns, and the columns a newer version adds to a table an
older one made (its old rows get NULL there). The README's queries read it by these names.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from dagster_duckdb import DuckDBResource

from engine.choice_scoring import needs_review
from engine.plan.answer_keys import ANSWER_KEY
from engine.plan.answer_lengths import PERCENTILE
from engine.run.results import RowResult, results_to_table
from engine.sql import quote_identifier, quote_literal

from .ownership import claim, refuse_foreign_objects, renamed_from
from .warehouse import connection, registered, table_exists, transaction

# After the result columns (``computed_at`` among them: when the engine answered the row, kept when
# a later night reuses the answer): the partition each row was last written in.
PARTITION_COLUMNS = [
    ("partition_key", pa.string()),  # the shard's partition key
    ("hardware", pa.string()),  # the job's hardware partition the shard is bound to (not the device)
    ("model", pa.string()),  # the job's model setting (a path or a built-in name)
    ("completed_at", pa.timestamp("us", tz="UTC")),  # when the partition last wrote it (the answer confirmed)
]
CONTENT_KEY_COLUMN = "content_key"  # the prompt the answer is of: its row's snapshot content key, in hex
# A scored choice answer whose probability is under the job's ``review_below`` (NULL: not judged).
NEEDS_REVIEW_COLUMN = "needs_review"


def answers_table(results: list[RowResult], id_type: pa.DataType, partition_key: str, hardware_partition: str,
                  model: str, content_keys: pa.Table, answer_keys: dict, review_below: float | None = None) -> pa.Table:
    """The rows a partition writes to the output table and its Parquet file. ``content_keys``:
    each row's id and the content key of the prompt it ran (the plan's ``_content_key``);
    ``answer_keys``: each id's answer key (``engine.plan.answer_keys``: what the next plan compares)."""
    table = results_to_table(results, id_type)
    table = table.append_column(NEEDS_REVIEW_COLUMN, pa.array(
        [needs_review(r.choice_probability, review_below) for r in results], pa.bool_()))
    keys = dict(zip(content_keys.column(0).to_pylist(), content_keys.column(1).to_pylist()))
    hexed = [key.hex() if (key := keys.get(i)) is not None else None for i in table.column("id").to_pylist()]
    table = table.append_column(CONTENT_KEY_COLUMN, pa.array(hexed, pa.string()))
    table = table.append_column(ANSWER_KEY, pa.array([answer_keys.get(i) for i in table.column("id").to_pylist()],
                                                     pa.string()))
    values = [partition_key, hardware_partition, model, dt.datetime.now(dt.timezone.utc)]
    for (name, type_), value in zip(PARTITION_COLUMNS, values):
        table = table.append_column(name, pa.array([value] * table.num_rows, type_))
    return table


# A stored row is the incoming one when these are: the same answer (its text or error, fingerprint,
# when it was computed, its answer key), status and review flag, in the same partition.
_SAME_ANSWER = ["partition_key", "status", "text", "error", "row_fingerprint", "computed_at", ANSWER_KEY,
                NEEDS_REVIEW_COLUMN]


@dataclass(frozen=True)
class PartitionWrite:
    """What a partition's write left: its rows in the table now (what its Parquet file holds) and
    how many rows it wrote (inserted or replaced; rows already as they were are not)."""

    rows: pa.Table
    written: int


@dataclass(frozen=True)
class PartitionCounts:
    """What the output table holds of one partition, as its checks read it."""

    missing: int  # rows the shard wrote that the partition does not hold
    unexpected: int  # ids the partition holds that the shard did not write (superseded ones apart)
    duplicated: int  # ids of the shard held more than once
    silent: int  # ok rows without text, error rows without a reason
    errors: int
    rows: int


@dataclass(frozen=True)
class AnswerCounts:
    """The table against the job's prompt snapshot (``all_prompts_answered``)."""

    missing: int  # prompt rows of landed shards with no answer
    duplicated: int  # ids answered more than once
    orphaned: int  # answers of ids the snapshot no longer has
    outstanding: int  # prompt rows of shards still to land


class OutputTable:
    """``OutputTable(warehouse, name, job)``: job ``job``'s answers in its output database (see the
    module doc). Every connection it opens first refuses objects the job does not own (``ownership``)."""

    def __init__(self, warehouse: DuckDBResource, name: str, job: str):
        self.warehouse, self.name, self.job = warehouse, name, job
        self._sql_name = quote_identifier(name)

    @classmethod
    def of_job(cls, warehouse: DuckDBResource, job) -> "OutputTable":
        """The output table a job declares (a ``BatchJobConfig``'s ``output_table``) in ``warehouse``,
        its output database (its ``names.warehouse_key``'s resource)."""
        return cls(warehouse, job.output_table, job.name)

    @contextmanager
    def _connection(self, on_wait: Callable[[str], None] | None = None):
        """A connection to the output database, once the job's objects there are known to be its own."""
        with connection(self.warehouse, on_wait) as con:
            refuse_foreign_objects(con, self.job, self.name, self.warehouse.database)
            yield con

    def carry_renamed(self) -> str | None:
        """Where the job's ``output_table`` was renamed, its answers carried to the new name: the old
        table renamed (not one answer computed again), its groups table and view, which the night makes
        anew, dropped. Returns what was done, or why not (the new table holds answers already: the old
        one is named to drop by hand), for the log; None where nothing was renamed."""
        with self._connection() as con, transaction(con):
            old = renamed_from(con, self.job, self.name)
            if old is None:
                return None
            if table_exists(con, self.name):
                return (f"output table {old!r}, which job {self.job!r} wrote before its output_table became "
                        f"{self.name!r}, is still in {self.warehouse.database}: its answers were not carried, as "
                        f"{self.name!r} holds answers already; DROP TABLE {old} when it is not needed")
            rows = con.execute(f"SELECT count(*) FROM {quote_identifier(old)}").fetchall()[0][0]
            con.execute(f"DROP VIEW IF EXISTS {quote_identifier(old + '_with_prompts')}")
            con.execute(f"DROP TABLE IF EXISTS {quote_identifier(old + '_prefix_groups')}")
            con.execute(f"ALTER TABLE {quote_identifier(old)} RENAME TO {self._sql_name}")
            claim(con, self.job, self.name)
        return (f"output_table renamed from {old!r} to {self.name!r}: its {rows:,} answers carried over (the table "
                "renamed, nothing computed again)")

    def replace_partition(self, partition_key: str, rows: pa.Table, whole_partition: bool = True,
                          on_wait: Callable[[str], None] | None = None) -> PartitionWrite:
        """Make ``rows`` the partition's rows: one row per id, whatever ran before (idempotent). A row
        the table already holds as it is (``_SAME_ANSWER``: the same answer of the same prompt, in the
        same partition) is not written again: its ``completed_at`` and every other value stay, so a
        night that reuses an answer leaves its row byte for byte. With ``whole_partition=False`` only
        these ids' rows are replaced (a shard that a newer plan superseded in part: the partition's
        other rows may be that plan's fresh answers). ``on_wait``: see ``warehouse.connection``."""
        target = self._sql_name
        with self._connection(on_wait) as con, registered(con, incoming=rows):
            with transaction(con):
                con.execute(f"CREATE TABLE IF NOT EXISTS {target} AS SELECT * FROM incoming WITH NO DATA")
                claim(con, self.job, self.name)
                self._add_new_columns(con)
                incoming = {row[0] for row in con.execute("DESCRIBE incoming").fetchall()}
                same = " AND ".join(f"t.{c} IS NOT DISTINCT FROM i.{c}" for c in _SAME_ANSWER if c in incoming)
                con.execute(f"""CREATE OR REPLACE TEMP TABLE changed AS SELECT i.* FROM incoming i
                    WHERE NOT EXISTS (SELECT 1 FROM {target} t WHERE t.id = i.id AND {same})
                       OR i.id IN (SELECT id FROM {target} GROUP BY id HAVING count(*) > 1)""")
                # An id that moved to another shard since its last run must not stay twice.
                con.execute(
                    f"DELETE FROM {target} WHERE (? AND partition_key = ? AND id NOT IN (SELECT id FROM incoming)) "
                    "OR id IN (SELECT id FROM changed)", [whole_partition, partition_key])
                written = con.execute(f"INSERT INTO {target} BY NAME SELECT * FROM changed").fetchall()[0][0]
                con.execute("DROP TABLE changed")
            held = con.sql(f"SELECT * FROM {target} WHERE partition_key = ? ORDER BY id",
                           params=[partition_key]).to_arrow_table()
        return PartitionWrite(held, int(written))

    def _add_new_columns(self, con) -> None:
        """A table made by an older version lacks the columns a newer one writes: they are added (its
        old rows NULL there) instead of failing the insert. A column only the table has stays NULL."""
        have = {row[0] for row in con.execute(f"DESCRIBE {self._sql_name}").fetchall()}
        for name, type_, *_ in con.execute("DESCRIBE incoming").fetchall():
            if name not in have:
                con.execute(f"ALTER TABLE {self._sql_name} ADD COLUMN {quote_identifier(name)} {type_}")

    def replace_prompts_view(self, snapshot: Path, columns) -> str:
        """The view ``<table>_with_prompts``: every answer with its row's prompt (and chat messages) from
        the job's prompt snapshot, and ``prompt_current``: whether that is the prompt the answer is of
        (false for a row edited at the source since it was answered, until its shard runs again; NULL
        for an answer kept of a deleted row or one written before answers recorded their prompt).
        Returns the view's name."""
        from engine.table.prompt_snapshot import CONTENT_KEY

        view = f"{self.name}_with_prompts"
        present = set(pq.read_schema(snapshot).names) if snapshot.exists() else set()
        texts = "".join(f", p.{quote_identifier(c)}" for c in (columns.prompt, columns.messages) if c in present)
        with self._connection() as con, transaction(con):
            con.execute(
                f"CREATE OR REPLACE VIEW {quote_identifier(view)} AS SELECT a.*{texts}, "
                f"a.{CONTENT_KEY_COLUMN} = lower(hex(p.{quote_identifier(CONTENT_KEY)})) AS prompt_current "
                f"FROM {self._sql_name} a LEFT JOIN read_parquet({quote_literal(str(snapshot.resolve()))}) p "
                f"ON a.id::VARCHAR = p.{quote_identifier(columns.id)}::VARCHAR")
            claim(con, self.job, view, view=True)
        return view

    def replace_groups(self, groups: pa.Table) -> str:
        """The table ``<table>_prefix_groups``: the plan's groups (``prefix_groups.groups_table``).
        Returns its name."""
        name = f"{self.name}_prefix_groups"
        with self._connection() as con, registered(con, incoming=groups), transaction(con):
            con.execute(f"CREATE OR REPLACE TABLE {quote_identifier(name)} AS SELECT * FROM incoming")
            claim(con, self.job, name)
        return name

    def id_type(self) -> str | None:
        """The DuckDB type of the table's id column (None: no table yet)."""
        with self._connection() as con:
            if not table_exists(con, self.name):
                return None
            found = con.execute("SELECT data_type FROM duckdb_columns() WHERE table_name = ? AND column_name = 'id' "
                                "AND schema_name = current_schema() AND database_name = current_database()",
                                [self.name]).fetchall()
        return found[0][0] if found else None

    def rows_of(self, ids: pa.Array) -> pa.Table | None:
        """The table's rows for these ids (None if the table does not exist yet)."""
        with self._connection() as con:
            if not table_exists(con, self.name):
                return None
            with registered(con, wanted=pa.table({"id": ids})):
                return con.sql(f"SELECT * FROM {self._sql_name} WHERE id IN (SELECT id FROM wanted)").to_arrow_table()

    def answered_ids(self, ids: pa.Array, keys: set[str]) -> set:
        """Of ``ids``, those the table holds under one of the partition ``keys``."""
        with self._connection() as con:
            if not table_exists(con, self.name):
                return set()
            live = pa.table({"key": pa.array(sorted(keys), pa.string())})
            with registered(con, wanted=pa.table({"id": ids}), live_keys=live):
                found = con.execute(f"SELECT DISTINCT id FROM {self._sql_name} WHERE id IN (SELECT id FROM wanted) "
                                    "AND partition_key IN (SELECT key FROM live_keys)").fetchall()
        return {row[0] for row in found}

    def export_answers(self, path: Path) -> bool:
        """Each answer's ``id, answer_key, status, partition_key`` into the Parquet file ``path``, by
        DuckDB (nothing of every row in Python): what the plan compares to know which rows are answered.
        False: no table yet. An answer written before answers had keys has none (its row runs once more)."""
        with self._connection() as con:
            if not table_exists(con, self.name):
                return False
            have = {row[0] for row in con.execute(f"DESCRIBE {self._sql_name}").fetchall()}
            key = ANSWER_KEY if ANSWER_KEY in have else f"NULL::VARCHAR AS {ANSWER_KEY}"
            con.execute(f"COPY (SELECT id, {key}, status, partition_key FROM {self._sql_name}) TO "
                        f"{quote_literal(str(path))} (FORMAT parquet)")
        return True

    def answer_lengths(self) -> tuple[int, float | None, float | None, int]:
        """Of the ok answers the table holds: how many, their output tokens' ``PERCENTILE``-th and
        mean, and how many finished by length (what ``learned_lengths`` decides from); 0s: no table."""
        with self._connection() as con:
            if not table_exists(con, self.name):
                return 0, None, None, 0
            rows, percentile, mean, at_limit = con.execute(
                f"SELECT count(*), quantile_disc(output_tokens, {PERCENTILE}), avg(output_tokens), "
                f"count(*) FILTER (WHERE finish_reason = 'length') FROM {self._sql_name} WHERE status = 'ok'"
            ).fetchall()[0]
        return int(rows), percentile, mean, int(at_limit)

    def answers_not_in(self, live_ids: pa.Array) -> tuple[int, int]:
        """How many of the table's answers are of ids not in ``live_ids``, and how many it holds: what
        ``remove_answers_not_in`` would delete, counted before anything is."""
        with self._connection() as con:
            if not table_exists(con, self.name):
                return 0, 0
            with registered(con, live=pa.table({"id": live_ids})):
                gone, answered = con.execute(
                    f"SELECT count(*) FILTER (WHERE id NOT IN (SELECT id FROM live)), count(*) "
                    f"FROM {self._sql_name}").fetchall()[0]
        return int(gone), int(answered)

    def remove_answers_not_in(self, live_ids: pa.Array) -> int:
        """Delete the answers of ids that are no longer prompt rows (deleted at the source); returns
        how many. One transaction: readers see the table before or after, never half of it."""
        with self._connection() as con:
            if not table_exists(con, self.name):
                return 0
            with registered(con, live=pa.table({"id": live_ids})), transaction(con):
                removed = con.execute(
                    f"DELETE FROM {self._sql_name} WHERE id NOT IN (SELECT id FROM live)").fetchall()[0][0]
        return int(removed)

    def status_counts(self) -> tuple[int, int, int]:
        """Rows, ok rows and error rows the table holds."""
        with self._connection() as con:
            rows, ok, errors = con.execute(
                f"SELECT count(*), count(*) FILTER (WHERE status = 'ok'), count(*) FILTER (WHERE status = 'error') "
                f"FROM {self._sql_name}").fetchall()[0]
        return int(rows), int(ok), int(errors)

    def first_answer(self) -> tuple[object, str | None]:
        """The id and text of the table's first row by id (an example to show)."""
        with self._connection() as con:
            return con.execute(f"SELECT id, text FROM {self._sql_name} ORDER BY id LIMIT 1").fetchall()[0]

    def partition_counts(self, partition_key: str, shard_ids: list, superseded_ids: list = ()) -> PartitionCounts:
        """``shard_ids``: the rows a shard's run wrote; ``superseded_ids``: rows a newer plan took over
        while it ran, not written (an older answer of theirs in this partition is that plan's)."""
        table = self._sql_name
        with self._connection() as con, registered(con, expected=pa.table({"id": list(shard_ids)}),
                                                           superseded=pa.table({"id": list(superseded_ids)})):
            missing, unexpected = con.execute(
                f"""
                WITH mine AS (SELECT DISTINCT id FROM {table} WHERE partition_key = ?
                              AND id NOT IN (SELECT id FROM superseded))
                SELECT (SELECT count(*) FROM expected WHERE id NOT IN (SELECT id FROM mine)),
                       (SELECT count(*) FROM mine WHERE id NOT IN (SELECT id FROM expected))
                """, [partition_key]).fetchall()[0]
            duplicated = con.execute(
                f"SELECT count(*) FROM (SELECT id FROM {table} WHERE id IN (SELECT id FROM expected) "
                "GROUP BY id HAVING count(*) > 1)").fetchall()[0][0]
            silent, errors, rows = con.execute(
                f"""SELECT count(*) FILTER (WHERE (status = 'ok' AND coalesce(text, '') = '')
                                           OR (status = 'error' AND coalesce(error, '') = '')),
                           count(*) FILTER (WHERE status = 'error'), count(*)
                    FROM {table} WHERE partition_key = ?""", [partition_key]).fetchall()[0]
        return PartitionCounts(int(missing), int(unexpected or 0), int(duplicated), int(silent), int(errors), int(rows))

    def answer_counts(self, prompt_ids_sql: str, snapshot: Path, plan: Path, outstanding_keys: list[str]
                      ) -> AnswerCounts | None:
        """The table against the prompt snapshot's ids (``prompt_ids_sql``: a query of them, reading
        the snapshot as its parameter); the rows of the plan's ``outstanding_keys`` (shards still to
        land) are not missing yet. None: no table yet."""
        with self._connection() as con:
            if not table_exists(con, self.name):
                return None
            waiting, parameters = "SELECT NULL::VARCHAR AS id WHERE false", [str(snapshot)]
            if outstanding_keys:
                waiting = ("SELECT id::VARCHAR AS id FROM read_parquet(?) "
                           "WHERE partition_key IN (SELECT unnest(?::VARCHAR[]))")
                parameters += [str(plan), outstanding_keys]
            missing, duplicated, orphaned, outstanding = con.execute(
                f"""
                WITH prompts AS ({prompt_ids_sql}),
                     waiting AS ({waiting}),
                     answers AS (SELECT id::VARCHAR AS id, count(*) AS n FROM {self._sql_name} GROUP BY 1)
                SELECT (SELECT count(*) FROM prompts LEFT JOIN answers USING (id)
                        WHERE answers.n IS NULL AND prompts.id NOT IN (SELECT id FROM waiting)),
                       (SELECT count(*) FROM answers WHERE n > 1),
                       (SELECT count(*) FROM answers WHERE id NOT IN (SELECT id FROM prompts)),
                       (SELECT count(*) FROM waiting)
                """, parameters).fetchall()[0]
        return AnswerCounts(int(missing), int(duplicated), int(orphaned), int(outstanding))
