"""``batchllm plan`` and ``batchllm run`` as a user calls them."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from .conftest import make_prompt_table


def batchllm(*args, check=True):
    return subprocess.run([sys.executable, "-m", "engine.cli.main", *args], capture_output=True, text=True, check=check)


def test_plan_prints_groups_and_the_shared_fraction(prompt_parquet, tiny_model):
    out = batchllm("plan", str(prompt_parquet), "--model", tiny_model, "--shards", "2", "--json").stdout
    summary = json.loads(out)
    assert summary["rows"] == make_prompt_table().num_rows
    assert summary["shared_groups"] >= 1
    assert 0 < summary["shared_fraction"] < 1
    assert sum(s["rows"] for s in summary["shards"]) == summary["rows"]
    text = batchllm("plan", str(prompt_parquet), "--model", tiny_model).stdout
    assert "shared " in text and "unique " in text


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


# -- what a careful or hostile user tries: each ends in one line, an exit code, and nothing written --


def refused(done, code: int, *words: str) -> None:
    assert done.returncode == code, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr
    assert all(w in done.stderr for w in words), done.stderr[-2000:]


def test_an_output_that_is_the_input_is_refused(prompt_parquet):
    before = prompt_parquet.read_bytes()
    refused(batchllm("run", str(prompt_parquet), "--model", "tiny", "--output", str(prompt_parquet), check=False),
            2, "one of the inputs")
    assert prompt_parquet.read_bytes() == before


def test_an_unrelated_existing_output_needs_overwrite(prompt_parquet, tmp_path):
    other = tmp_path / "precious.parquet"
    pq.write_table(make_prompt_table(seed=3), other)
    before = other.read_bytes()
    refused(batchllm("run", str(prompt_parquet), "--model", "tiny", "--output", str(other), check=False),
            2, "not a batchllm result", "--overwrite")
    assert other.read_bytes() == before


@pytest.mark.parametrize("where", ["directory", "under_a_file"])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(prompt_parquet, tmp_path, where):
    output = tmp_path if where == "directory" else prompt_parquet / "answers.parquet"
    refused(batchllm("run", str(prompt_parquet), "--model", "tiny", "--output", str(output), check=False),
            2, "--output")
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob("*.checkpoint"))


@pytest.mark.slow
def test_a_second_run_into_the_same_output_is_refused_and_named(prompt_parquet, tmp_path):
    import os

    from engine.locks import held_alone

    output = tmp_path / "answers.parquet"
    with held_alone(tmp_path / "answers.parquet.lock", f"pid {os.getpid()} on this host", "a run"):  # a run writing it
        refused(batchllm("run", str(prompt_parquet), "--model", "tiny", "--output", str(output), check=False),
                2, f"pid {os.getpid()} on this host")
    (tmp_path / "answers.parquet.lock").write_text("pid 1 on a host, a process killed with SIGKILL")  # no flock held
    assert batchllm("run", str(prompt_parquet), "--model", "tiny", "--output", str(output), check=False).returncode == 0


@pytest.mark.parametrize("flag, value", [("--max-tokens", "0"), ("--shards", "0"), ("--block-size", "0"),
                                         ("--block-size", "12")])
def test_bad_numbers_are_refused_where_they_enter(prompt_parquet, flag, value):
    refused(batchllm("plan", str(prompt_parquet), "--model", "tiny", flag, value, check=False), 2, flag)


def test_a_progress_interval_of_zero_is_refused_where_it_enters(prompt_parquet, tmp_path):
    refused(batchllm("run", str(prompt_parquet), "--model", "tiny", "--output", str(tmp_path / "o.parquet"),
                     "--progress-every-s", "0", check=False), 2, "--progress-every-s")


def test_bad_rows_become_error_rows_in_the_plan_not_negative_numbers(tmp_path):
    import pyarrow as pa

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({
        "id": [1, 2, 3, 4],
        "prompt": ["fine", "fine too", None, None],
        "messages": [None, None, '[{"content": "no role"}]', '["just", "strings"]'],
        "max_tokens": [4, 2**63 - 1, None, None],
    }), path)
    summary = json.loads(batchllm("plan", str(path), "--model", "tiny", "--json").stdout)
    assert summary["error_rows"] == 3
    # The shard holds every row; only the one that runs counts: its 4 output tokens, no error row's
    # budget (a max_tokens of 2**63 - 1 summed would overflow to a negative number).
    [shard] = summary["shards"]
    assert (shard["rows"], shard["decode_tokens"]) == (4, 4) and shard["prefill_tokens"] > 0


def test_a_directory_that_is_not_a_model_is_one_line(prompt_parquet, tmp_path):
    (tmp_path / "not-a-model").mkdir()
    refused(batchllm("plan", str(prompt_parquet), "--model", str(tmp_path / "not-a-model"), check=False),
            3, "is not a model checkpoint")


def test_dataset_sql_that_writes_is_refused_and_writes_nothing(tmp_path):
    sql = tmp_path / "evil.sql"
    sql.write_text(f"COPY (SELECT 1 AS id, 'x' AS prompt) TO '{tmp_path}/stolen.csv'")
    refused(batchllm("plan", str(sql), "--model", "tiny", check=False), 2, "must be a query")
    assert not (tmp_path / "stolen.csv").exists()


@pytest.mark.parametrize("flags, reason", [
    (["--choice", "a", "--regex", "b"], "exactly one of"),
    (["--regex", "[a"], "invalid regex"),
    (["--json-schema", "SCHEMA"], "invalid JSON schema"),
    (["--json-schema", "missing.json"], "--json-schema missing.json"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    (["--choice", "economy,family,performance"],
     "give each its own --choice (--choice economy --choice family --choice performance)"),
    (["--choice", "budget"], "needs at least two answers"),
    (["--choice", "a", "--choice", "b", "--choice", "a"], "repeats 'a'"),
])
def test_a_bad_constraint_or_engine_setting_is_refused_before_any_work(prompt_parquet, tmp_path, flags, reason):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "nonsense"}')
    flags = [str(schema) if f == "SCHEMA" else f for f in flags]
    output = tmp_path / "answers.parquet"
    refused(batchllm("run", str(prompt_parquet), "--model", "tiny", "--output", str(output), *flags, check=False),
            2, reason)
    assert not output.exists()


@pytest.mark.slow
def test_run_with_choices_answers_only_those(prompt_parquet, tiny_model, tmp_path):
    output = tmp_path / "labels.parquet"
    batchllm("run", str(prompt_parquet), "--model", tiny_model, "--output", str(output), "--max-tokens", "6",
             "--kv-cache-blocks", "64", "--choice", "yes", "--choice", "no")
    assert set(pq.read_table(output).column("text").to_pylist()) <= {"yes", "no"}


def reviews_parquet(tmp_path):
    import pyarrow as pa

    description = ["A long description of product one, " * 12, "Product two is described at length here, " * 12]
    rows = [
        {
            "id": i,
            "review": f"review number {i} says {'good' if i % 2 else 'bad'}",
            "description": description[i % 2],
            "category": f"category {i % 2}",
        }
        for i in range(12)
    ]
    path = tmp_path / "reviews.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.slow
def test_plan_with_fields_shows_both_orders_and_where_each_field_went(tmp_path, tiny_model):
    path = reviews_parquet(tmp_path)
    fields = ["--fields", "review,description,category", "--instruction", "Rate the review.", "--question", "Rating:"]
    declared = json.loads(batchllm("plan", str(path), "--model", tiny_model, *fields, "--json").stdout)["fields"]
    assert declared["field_order"] == "as_declared" and declared["unique_tokens_ratio"] == 1
    summary = json.loads(batchllm("plan", str(path), "--model", tiny_model, *fields, "--field-order", "optimize",
                                  "--json").stdout)
    chosen = summary["fields"]
    assert chosen["chosen"]["prompt_tokens"] == chosen["declared"]["prompt_tokens"]  # the same text, reordered
    assert chosen["chosen"]["unique_tokens"] < 0.6 * chosen["declared"]["unique_tokens"]
    assert chosen["positions"]["description"] == [12, 0, 0] and chosen["positions"]["review"] == [0, 0, 12]
    text = batchllm("plan", str(path), "--model", tiny_model, *fields, "--field-order", "optimize").stdout
    assert "in the declared field order" in text and "field description: rows per position [12, 0, 0]" in text
    missing = batchllm("plan", str(path), "--model", tiny_model, "--fields", "review,nope", check=False)
    assert missing.returncode != 0 and "['nope'] are not columns" in missing.stderr


@pytest.mark.slow
def test_bench_on_a_table_with_fields_reports_both_orders_and_their_agreement(tmp_path, tiny_model):
    path = reviews_parquet(tmp_path)
    done = subprocess.run([sys.executable, "-m", "engine.cli.main", "bench", str(path), "--model", tiny_model,
                           "--fields", "review,description,category", "--instruction", "Rate.", "--field-order",
                           "optimize", "--runs",
                           "vllm_apc_sorted,vllm_hand_order,vllm_hand_order_defaults,batchllm,batchllm_field_order",
                           "--repeat", "2", "--max-tokens", "3", "--each-step", "--json"],
                          capture_output=True, text=True, check=True)
    report = json.loads(done.stdout)
    runs = ["vllm_apc_sorted", "vllm_hand_order", "vllm_hand_order_defaults", "batchllm", "batchllm_field_order"]
    assert report["repeat"] == 2 and report["run_order"] == [runs, runs[1:] + runs[:1]]
    assert len(set(report["runs"]["batchllm_field_order"]["pids"])) == 2  # every run in a process of its own
    assert report["workload"]["batchllm_unique_tokens"] < report["workload"]["unique_tokens"]
    # The engine on the baselines' own prompts computes what sorting does; with its field order, less.
    assert report["prefill_ratios"]["batchllm"]["vs_vllm_apc_sorted"] == 1
    assert report["prefill_ratios"]["batchllm_field_order"]["vs_vllm_apc_sorted"] < 0.6
    # The hand order (fields by ascending distinct values: category, description, review) shares the description too.
    assert report["prompt_set_prefill"]["hand"] < 0.6 * report["prompt_set_prefill"]["declared"]
    # At the CPU's own block size (32, unset here) and at a GPU's and vLLM's CPU default: finer blocks share more.
    assert report["workload"]["block_size"] == 32
    for name, by_size in report["prompt_set_prefill_by_block_size"].items():
        assert by_size["32"] == report["prompt_set_prefill"][name]
        assert by_size["16"] <= by_size["32"] <= by_size["128"]
    assert 0 <= report["field_order_agreement"] <= 1
    # The engine on the declared prompts is held against the run of those prompts only; its field order against all.
    assert set(report["ratios"]["batchllm"]) == {"vs_vllm_apc_sorted"}
    assert set(report["ratios"]["batchllm_field_order"]) == {f"vs_{name}" for name in runs[:3]}
    assert "vs_vllm_hand_order" in report["ratios"]["batchllm_field_order"]
    assert "field order gave the same answer" in report["verdict"] and "by hand" in report["verdict"]
    # The by-hand recipe as a user runs it: vLLM's own block size on this platform (128 on CPU), the same KV memory.
    assert report["workload"]["vllm_defaults_block_size"] == 128
    assert report["runs"]["vllm_hand_order_defaults"]["kv_capacity_blocks"] == \
        report["workload"]["vllm_defaults_kv_cache_blocks"] == report["workload"]["kv_cache_blocks"] // 4
    assert "vLLM's own block size" in report["verdict"]
    profiles = report["runs"]["batchllm"]["per_step"]
    assert len(profiles) == 2 and all(p["steps"] > 0 and p["outside_steps_s"] >= 0 for p in profiles)
    # --each-step: every step's seconds, prompt tokens, output tokens, rows and groups, summing to the profile
    for p in profiles:
        assert len(p["each"]) == p["steps"] and all(len(step) == 5 for step in p["each"])
        assert sum(step[1] for step in p["each"]) == p["prefill_steps"]["prefill_tokens"]


@pytest.mark.slow
def test_a_rerun_of_a_grown_table_keeps_the_field_order_and_reuses_every_old_answer(tmp_path, tiny_model):
    import pyarrow as pa

    from .test_fields import reviews

    path, output = tmp_path / "reviews.parquet", tmp_path / "answers.parquet"
    table = reviews(products=5, per_product=9, seed=2)
    pq.write_table(table.slice(0, 40), path)
    fields = ["--fields", "review,description,category,stars", "--instruction", "Rate.", "--field-order", "optimize"]
    args = ["run", str(path), "--model", tiny_model, "--output", str(output), "--max-tokens", "3",
            "--kv-cache-blocks", "64", *fields, "--json"]
    first = json.loads(batchllm(*args).stdout.splitlines()[-1])
    assert first["computed_rows"] == 40 and (tmp_path / "answers.parquet.field_order.parquet").exists()
    pq.write_table(pa.concat_tables([table.slice(0, 40), table.slice(40)]), path)  # 5 new rows
    second = batchllm(*args)
    summary = json.loads(second.stdout.splitlines()[-1])
    assert summary["reused_rows"] == 40 and summary["computed_rows"] == 5
    assert "field order kept" in second.stderr and "40 rows kept their order, 5 new rows placed" in second.stderr
    again = batchllm(*args[:-1], "--choose-field-order-again", "--json")
    assert "field order chosen (asked)" in again.stderr


@pytest.mark.slow
def test_a_row_whose_format_vllm_refuses_is_an_error_row_and_the_shard_finishes(tiny_model, tmp_path):
    """Python's ``re`` takes a backreference; vLLM's grammar backends refuse it. That row alone is
    an error row with vLLM's reason, checked once for its format before the run; the rest answer."""
    import pyarrow as pa

    from engine.response_format import ResponseFormat

    source, output = tmp_path / "rows.parquet", tmp_path / "answers.parquet"
    formats = [ResponseFormat(regex=r"(a)\1" if i == 5 else r"[a-z]{3}").to_text() for i in range(12)]
    pq.write_table(pa.table({"id": list(range(12)), "prompt": [f"question {i} about things" for i in range(12)],
                             "response_format": formats}), source)
    done = batchllm("run", str(source), "--model", tiny_model, "--output", str(output), "--max-tokens", "6",
                    "--kv-cache-blocks", "64", "--json", check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["id"]: r for r in pq.read_table(output).to_pylist()}
    assert len(rows) == 12
    assert [i for i, r in rows.items() if r["status"] == "error"] == [5]
    assert "vLLM refused" in rows[5]["error"] and "backreference" in rows[5]["error"]
    assert "\n" not in rows[5]["error"]
    assert all(len(r["text"]) == 3 for i, r in rows.items() if i != 5)


@pytest.mark.slow  # two fresh processes
def test_prepare_model_to_a_folder_gives_weights_to_carry_and_never_writes_into_a_full_one(tmp_path, tiny_model):
    carried = tmp_path / "carry"
    done = batchllm("prepare-model", "tiny", "--to", str(carried))
    assert done.stdout.strip() == str(carried.resolve())
    assert sorted(p.name for p in carried.iterdir()) == sorted(p.name for p in Path(tiny_model).iterdir())
    again = batchllm("prepare-model", "tiny", "--to", str(carried), check=False)
    assert again.returncode != 0 and "is not empty" in again.stderr
