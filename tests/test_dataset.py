"""Loading prompt tables: each bad input gets a clear message naming the problem."""

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.table import dataset
from engine.table.dataset import DatasetError, load_prompts, read_sql


@pytest.fixture
def database(tmp_path):
    path = tmp_path / "prompts.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE p AS SELECT * FROM (VALUES (1, 'hello'), (2, 'world')) t(id, prompt)")
    con.close()
    return str(path)


def test_sql_file_table_and_parquet_sources(tmp_path, database):
    sql = tmp_path / "q.sql"
    sql.write_text("SELECT id, prompt FROM p WHERE id > 1")
    assert load_prompts(str(sql), database).column("id").to_pylist() == [2]
    assert load_prompts("p", database).num_rows == 2
    pq.write_table(pa.table({"id": ["a"], "prompt": ["x"]}), tmp_path / "x.parquet")
    assert load_prompts(str(tmp_path / "*.parquet")).num_rows == 1


@pytest.mark.parametrize("with_database", [True, False])
@pytest.mark.parametrize(
    "sql, rule",
    [
        ("CREATE TABLE evil AS SELECT 1", "must be a query"),
        ("COPY (SELECT 42) TO '{out}/stolen.csv'", "must be a query"),
        ("ATTACH '{out}/other.duckdb' AS other (READ_WRITE); CREATE TABLE other.t AS SELECT 1", "exactly one query"),
        ("INSTALL httpfs", "must be a query"),
        ("SELECT 1 AS id, 'a' AS prompt; SELECT 2 AS id, 'b' AS prompt", "exactly one query"),
        ("SELECT * FROM read_csv('/etc/passwd')", "may only read the job's own data"),
        ("SELECT 1 AS id, content AS prompt FROM read_text('/etc/hostname')", "may only read the job's own data"),
        ("SELECT * FROM read_parquet('{out}/elsewhere.parquet')", "may only read the job's own data"),
        ("WITH x AS (SELECT * FROM read_csv('/etc/passwd')) SELECT * FROM x", "may only read the job's own data"),
    ],
)
def test_dataset_sql_is_sandboxed_and_writes_nothing(tmp_path, database, sql, rule, with_database):
    out = tmp_path.parent / f"{tmp_path.name}-elsewhere"  # outside the database's folder
    out.mkdir()
    pq.write_table(pa.table({"id": [1], "prompt": ["secret"]}), out / "elsewhere.parquet")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(DatasetError, match=rule):
        read_sql(sql.format(out=out), database if with_database else None)
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written, nothing attached


def test_dataset_sql_may_read_the_declared_folders_and_end_with_a_semicolon_or_comment(tmp_path, database):
    pq.write_table(pa.table({"id": [7], "prompt": ["x"]}), tmp_path / "extra.parquet")
    sql = f"SELECT * FROM read_parquet('{tmp_path}/extra.parquet'); -- the extra rows"
    assert read_sql(sql, None, [str(tmp_path)]).column("id").to_pylist() == [7]
    assert read_sql("SELECT id FROM p ORDER BY id; -- comment", database).column("id").to_pylist() == [1, 2]


@pytest.mark.parametrize(
    "table, message",
    [
        (pa.table({"key": [1], "prompt": ["a"]}), "no id column 'id'"),
        (pa.table({"id": [1], "text": ["a"]}), "needs a prompt column"),
        (pa.table({"id": [1, None], "prompt": ["a", "b"]}), "NULL"),
        (pa.table({"id": [1, 1, 2], "prompt": ["a", "b", "c"]}), "duplicated id"),
        (pa.table({"id": [1.5], "prompt": ["a"]}), "must be integer or text"),
        (pa.table({"id": [1], "prompt": [3]}), "must be text"),
        (pa.table({"id": [1], "prompt": ["a"], "max_tokens": ["many"]}), "must be an integer"),
    ],
)
def test_bad_tables_are_rejected_with_the_reason(tmp_path, table, message):
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path)
    with pytest.raises(DatasetError, match=message):
        load_prompts(str(path))


def test_missing_and_broken_sources(tmp_path, database):
    with pytest.raises(DatasetError, match="no Parquet file"):
        load_prompts(str(tmp_path / "missing.parquet"))
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match="dataset SQL failed"):
        load_prompts(str(corrupt))
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts(str(tmp_path / "nope.sql"), database)
    bad_sql = tmp_path / "bad.sql"
    bad_sql.write_text("SELEC id FROM p")
    with pytest.raises(DatasetError, match="dataset SQL failed"):
        load_prompts(str(bad_sql), database)
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts("p", str(tmp_path / "other.duckdb"))


def _hold_write_lock(database: str, seconds: float, ready) -> None:
    import time

    con = duckdb.connect(database)
    ready.set()
    time.sleep(seconds)
    con.close()


def test_reading_waits_while_another_process_writes(database):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    writer = ctx.Process(target=_hold_write_lock, args=(database, 1.5, ready))
    writer.start()
    assert ready.wait(60)
    assert read_sql("SELECT count(*) AS n FROM p", database).column("n").to_pylist() == [2]
    writer.join(30)


def test_single_query_drops_a_trailing_semicolon_and_comments_but_not_inside_strings():
    from engine.table.dataset import single_query

    assert single_query("SELECT id, '--x;' AS p FROM t; -- the whole batch") == "SELECT id, '--x;' AS p FROM t"
    assert single_query("WITH a AS (SELECT 1) SELECT * FROM a /* note */ ;\n") == "WITH a AS (SELECT 1) SELECT * FROM a"


def test_a_job_scan_works_in_bounded_memory_and_spills_into_the_job_folder(tmp_path, database, monkeypatch):
    """DuckDB's default is 80% of the machine, its buffer pool keeping what a scan read (3.1 GB
    streaming 10M prompts): a job's stream is bounded, and a sort larger than the bound spills into
    the folder the job names."""
    monkeypatch.setattr(dataset, "DUCKDB_MEMORY_MIB", 100)
    monkeypatch.setattr(dataset, "DUCKDB_MEMORY_PER_THREAD_MIB", 1)
    job = tmp_path / "job"  # a job's folder exists before its scans
    job.mkdir()
    spill = job / ".duckdb_spill"
    sql = "SELECT i, repeat('x', 200) || i::VARCHAR AS s FROM range(1000000) t(i) ORDER BY s DESC"
    seen_spilled, rows, last = False, 0, None
    with dataset.stream_sql(sql, database, job_dir=job) as (_, batches):
        for batch in batches:
            seen_spilled = seen_spilled or (spill.exists() and any(spill.iterdir()))
            rows += batch.num_rows
            last = batch.column("s")[-1].as_py()
    assert rows == 1_000_000 and last == "x" * 200 + "0" and seen_spilled
    with dataset.stream_sql("SELECT current_setting('memory_limit') AS m", database, job_dir=job) as (_, batches):
        assert next(batches).column("m")[0].as_py() == "100.0 MiB"


def test_the_bound_grows_with_duckdbs_threads(tmp_path):
    """Spilling needs memory per thread: a sort of 3M prompts failed at 64 threads in 1 GB."""
    with duckdb.connect() as con:
        con.execute("SET threads = 64")
        dataset.bounded_memory(con, tmp_path)
        assert con.execute("SELECT current_setting('memory_limit')").fetchone()[0] == "4.0 GiB"  # 64 x 64 MiB
        con.execute("SET threads = 2")
        dataset.bounded_memory(con, tmp_path)
        assert con.execute("SELECT current_setting('memory_limit')").fetchone()[0] == "1.0 GiB"
