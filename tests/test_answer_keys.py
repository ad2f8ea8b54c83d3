"""A row's answer key is one text hashed alike where a shard writes it (Python) and where the plan
compares it (DuckDB): any difference would settle nothing, or worse, the wrong rows."""

import duckdb
import pyarrow as pa
import pytest

from engine.plan.answer_keys import answer_key, key_sql, keys_of
from engine.table.prompt_snapshot import CONTENT_KEY, KEY_TYPE


def test_python_and_duckdb_give_every_row_the_same_key_and_each_part_changes_it():
    rows = pa.table({
        CONTENT_KEY: pa.array([b"\x00" * 16, b"\xff" * 16, bytes(range(16)), bytes(range(16))], KEY_TYPE),
        "max_tokens": pa.array([1, 48, 4096, 4096], pa.int64()),
        "response_format": pa.array([None, '{"choice": ["ja", "nein"]}', None, "{\"regex\": \"é+\"}"]),
        "error": pa.array([None, None, "prompt too long: 9000 tokens (ü)", None]),
    })
    fp = "0123456789abcdef"
    con = duckdb.connect()
    con.register("rows", rows)
    in_duckdb = [r[0] for r in con.execute(
        f"SELECT {key_sql(fp, CONTENT_KEY, 'max_tokens', 'response_format', 'error')} FROM rows").fetchall()]
    in_python = keys_of(fp, rows.select([CONTENT_KEY, "max_tokens", "response_format"]),
                        {i: e for i, e in enumerate(rows["error"].to_pylist()) if e is not None})
    assert in_python == in_duckdb and len(set(in_python)) == 4
    base = answer_key(fp, b"\x01" * 16, 8, None, None)
    assert len({base, answer_key("fedcba9876543210", b"\x01" * 16, 8, None, None),
                answer_key(fp, b"\x02" * 16, 8, None, None), answer_key(fp, b"\x01" * 16, 9, None, None),
                answer_key(fp, b"\x01" * 16, 8, "{}", None), answer_key(fp, b"\x01" * 16, 8, None, "x")}) == 6


def test_a_settings_fingerprint_that_is_not_hex_is_refused_before_it_reaches_sql():
    with pytest.raises(ValueError, match="not a settings fingerprint"):
        key_sql("ab'; DROP TABLE x; --", "k", "m", "f", "e")
