"""``batchllm plan`` and ``batchllm run`` as a user calls them."""

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from .conftest import make_prompt_table


def batchllm(*args, check=True):
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, check=check)


def test_plan_prints_groups_and_the_ideal_saving(prompt_parquet, tiny_model):
    out = batchllm("plan", str(prompt_parquet), "--model", tiny_model, "--shards", "2", "--json").stdout
    summary = json.loads(out)
    assert summary["rows"] == make_prompt_table().num_rows
    assert summary["shared_groups"] >= 1
    assert 0 < summary["ideal_saving"] < 1
    assert sum(s["rows"] for s in summary["shards"]) == summary["rows"]
    text = batchllm("plan", str(prompt_parquet), "--model", tiny_model).stdout
    assert "ideal saving" in text


@pytest.mark.slow
def test_run_writes_one_answer_per_id(prompt_parquet, tiny_model, tmp_path):
    output = tmp_path / "out" / "answers.parquet"
    done = batchllm("run", str(prompt_parquet), "--model", tiny_model, "--output", str(output),
                    "--max-tokens", "6", "--kv-cache-blocks", "64", "--json")
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    answers = pq.read_table(output)
    ids = make_prompt_table().column("id").to_pylist()
    assert sorted(answers.column("id").to_pylist()) == sorted(ids)
    assert all(answers.column("text").to_pylist())
    assert stats["ok_rows"] == len(ids) and stats["cached_tokens"] > 0


def test_a_bad_table_exits_with_the_reason(tmp_path):
    path = tmp_path / "bad.parquet"
    import pyarrow as pa

    pq.write_table(pa.table({"id": [1, 1], "prompt": ["a", "b"]}), path)
    done = batchllm("plan", str(path), "--model", "tiny", check=False)
    assert done.returncode == 2
    assert "duplicated id" in done.stderr


def test_a_missing_model_exits_with_the_reason(prompt_parquet, tmp_path):
    done = batchllm("run", str(prompt_parquet), "--model", str(tmp_path / "no-such-model"), "--output",
                    str(tmp_path / "out.parquet"), check=False)
    assert done.returncode == 3
    assert "does not exist" in done.stderr and "no-such-model" in done.stderr
