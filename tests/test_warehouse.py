"""Writes to the output database: idempotent per partition, safe when partitions finish together."""

import multiprocessing

import duckdb
import pyarrow as pa
import pytest
from dagster_duckdb import DuckDBResource

from batchllm_dagster.output_table import OutputTable
from engine.sql import quote_identifier


def rows(key: str, ids: list[str], text: str) -> pa.Table:
    return pa.table({"id": ids, "text": [text] * len(ids), "partition_key": [key] * len(ids)})


def writer(database: str, key: str, rounds: int) -> None:
    ids = [f"{key}-{i}" for i in range(50)]
    for r in range(rounds):
        table = OutputTable(DuckDBResource(database=database), "answers", "job")
        table.replace_partition(key, rows(key, ids, f"round {r}"))


def test_rerun_replaces_a_partition_and_a_moved_id_is_not_kept_twice(tmp_path):
    db = DuckDBResource(database=str(tmp_path / "w.duckdb"))
    OutputTable(db, "answers", "job").replace_partition("a", rows("a", ["1", "2"], "old"))
    OutputTable(db, "answers", "job").replace_partition("b", rows("b", ["3"], "old"))
    OutputTable(db, "answers", "job").replace_partition("a", rows("a", ["1"], "new"))  # row 2 left shard a
    OutputTable(db, "answers", "job").replace_partition("b", rows("b", ["2", "3"], "new"))  # ... and joined shard b
    with db.get_connection() as con:
        got = sorted(con.execute("SELECT id, partition_key, text FROM answers").fetchall())
    assert got == [("1", "a", "new"), ("2", "b", "new"), ("3", "b", "new")]


@pytest.mark.slow  # three spawned processes: ~4.6 s here, at the fast suite's limit
def test_two_partitions_writing_at_once_lose_nothing(tmp_path):
    database = str(tmp_path / "w.duckdb")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=writer, args=(database, key, 15)) for key in ("s0", "s1", "s2")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with duckdb.connect(database, read_only=True) as con:
        got = con.execute(
            "SELECT partition_key, count(*), count(DISTINCT id), max(text) FROM answers GROUP BY 1 ORDER BY 1"
        ).fetchall()
    assert got == [(k, 50, 50, "round 14") for k in ("s0", "s1", "s2")]


def test_a_table_name_with_quotes_is_a_name_not_sql(tmp_path):
    db = DuckDBResource(database=str(tmp_path / "w.duckdb"))
    name = 'answers "v2"; DROP TABLE x'
    OutputTable(db, name, "job").replace_partition("a", rows("a", ["1", "2"], "t"))
    OutputTable(db, name, "job").replace_partition("a", rows("a", ["1"], "u"))
    with db.get_connection() as con:
        assert con.execute("SELECT table_name FROM information_schema.tables").fetchall() == [(name,)]
        assert con.execute(f"SELECT id, text FROM {quote_identifier(name)}").fetchall() == [("1", "u")]


def test_a_table_an_older_version_made_gains_the_columns_a_newer_one_writes(tmp_path):
    """The output table made by an older version (without ``completed_at`` and ``model``, say) is
    written by a newer one: the new columns are added, the old rows keep their values and get NULL
    there, instead of the insert failing."""
    import datetime as dt

    from batchllm_dagster.output_table import PARTITION_COLUMNS, answers_table
    from engine.run.results import RowResult

    db = DuckDBResource(database=str(tmp_path / "w.duckdb"))
    keys = pa.table({"id": ["1", "2"], "key": [b"\x01" * 16, b"\x02" * 16]})
    old = answers_table([RowResult(id="1", status="ok", text="old")], pa.string(), "a", "cpu", "m", keys, {})
    OutputTable(db, "answers", "job").replace_partition("a", old.drop_columns(["model", "completed_at"]))
    new = answers_table([RowResult(id="2", status="ok", text="new")], pa.string(), "b", "cpu", "m", keys, {})
    assert new.column_names[-len(PARTITION_COLUMNS):] == [name for name, _ in PARTITION_COLUMNS]
    OutputTable(db, "answers", "job").replace_partition("b", new)
    with db.get_connection() as con:
        got = dict((r[0], r[1:]) for r in con.execute("SELECT id, text, model, completed_at FROM answers").fetchall())
    assert got["1"] == ("old", None, None)
    assert got["2"][:2] == ("new", "m") and isinstance(got["2"][2], dt.datetime)


def test_a_write_that_waits_for_another_process_on_the_database_says_why_and_how_long(tmp_path):
    """Source and output in one database (the demo's): a long read of the source holds the file;
    the shard's write waits for it, and its log says for whom and for how long."""
    import subprocess
    import sys
    import time

    database = str(tmp_path / "w.duckdb")
    db = DuckDBResource(database=database)
    OutputTable(db, "answers", "job").replace_partition("a", rows("a", ["1"], "old"))
    holder = subprocess.Popen([sys.executable, "-c", f"import duckdb, time; con = duckdb.connect({database!r}); "
                               "print('held', flush=True); time.sleep(2)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    lines = []
    started = time.monotonic()
    OutputTable(db, "answers", "job").replace_partition("a", rows("a", ["1"], "new"), on_wait=lines.append)
    holder.wait()
    assert time.monotonic() - started > 0.5
    assert len(lines) == 2
    assert "another process holds it" in lines[0] and f"PID {holder.pid}" in lines[0]
    assert "after waiting" in lines[1]
    quiet = []
    OutputTable(db, "answers", "job").replace_partition("a", rows("a", ["1"], "newer"), on_wait=quiet.append)
    assert quiet == []  # nobody held it: nothing to say


def test_a_partition_written_again_with_the_same_answers_writes_nothing_and_keeps_every_value(tmp_path):
    """A night that reuses an answer leaves its row byte for byte (``completed_at`` included, which a
    downstream incremental load keys on); a changed answer and a new row are the only rows written,
    and a row that left the partition goes."""
    import datetime as dt

    from batchllm_dagster.output_table import answers_table
    from engine.run.results import RowResult

    db = DuckDBResource(database=str(tmp_path / "w.duckdb"))
    keys = pa.table({"id": ["1", "2", "3"], "key": [b"\x01" * 16, b"\x02" * 16, b"\x03" * 16]})
    then = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)

    def results(texts: dict) -> list:
        return [RowResult(id=i, status="ok", text=t, row_fingerprint=f"fp-{t}", computed_at=then)
                for i, t in texts.items()]

    table = OutputTable(db, "answers", "job")
    first = table.replace_partition("a", answers_table(results({"1": "x", "2": "y", "3": "z"}), pa.string(), "a",
                                                       "cpu", "m", keys, {"1": "k1", "2": "k2", "3": "k3"}))
    assert first.written == 3
    with db.get_connection() as con:
        before = dict(con.execute("SELECT id, CAST(answers AS VARCHAR) FROM answers").fetchall())
    again = table.replace_partition("a", answers_table(results({"1": "x", "2": "y", "3": "z"}), pa.string(), "a",
                                                       "cpu", "m", keys, {"1": "k1", "2": "k2", "3": "k3"}))
    with db.get_connection() as con:
        assert dict(con.execute("SELECT id, CAST(answers AS VARCHAR) FROM answers").fetchall()) == before
    assert again.written == 0 and again.rows.num_rows == 3
    changed = table.replace_partition("a", answers_table(results({"1": "x", "2": "new"}), pa.string(), "a", "cpu",
                                                         "m", keys, {"1": "k1", "2": "k2b"}))
    with db.get_connection() as con:
        after = dict(con.execute("SELECT id, CAST(answers AS VARCHAR) FROM answers").fetchall())
    assert changed.written == 1 and after["1"] == before["1"] and after["2"] != before["2"] and "3" not in after
