"""Fault injection: SIGKILL a real vLLM run part-way, rerun it, and lose or duplicate nothing."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import duckdb
import pyarrow.parquet as pq
import pytest

from batchllm_dagster import BatchJobConfig, DatasetSpec, EngineSettings, SamplingSettings

from .conftest import ROOT, make_prompt_table
from .fault_job import completions_and_plan

pytestmark = pytest.mark.slow  # real vLLM, dg, Ray or a browser

ROWS = dict(documents=60, questions=12, singles=30)
MAX_TOKENS = "40"


def rows_in_parts(folder: Path) -> int:
    return sum(pq.read_metadata(p).num_rows for p in folder.glob("part-*.parquet"))


def kill_when_checkpointed(process: subprocess.Popen, folder: Path, parts: int = 2, timeout: float = 240) -> None:
    """SIGKILL the process once ``parts`` checkpoint parts exist (it must still be running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if folder.exists() and len(list(folder.glob("part-*.parquet"))) >= parts:
            break
        assert process.poll() is None, f"run ended before it could be killed:\n{process.stdout.read()}"
        time.sleep(0.05)
    else:
        pytest.fail("no checkpoint appeared in time")
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "engine.cli.main", *args]


def start_fault_job(config_file, home) -> subprocess.Popen:
    """``tests/fault_job.py`` materializing the job's one partition, in its own process, its output piped."""
    return subprocess.Popen([sys.executable, "-m", "tests.fault_job", str(config_file)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "DAGSTER_HOME": str(home)})


def test_cli_run_terminated_writes_what_finished_and_shuts_down(big_prompts, tmp_path, tiny_model):
    """SIGTERM (a scheduler's or a container's stop) is not SIGKILL: the run writes every finished
    row, including those since the last part, and exits; the rerun reuses all of them."""
    output = tmp_path / "answers.parquet"
    checkpoint = Path(f"{output}.checkpoint")
    args = ("run", str(big_prompts), "--model", tiny_model, "--output", str(output), "--max-tokens", MAX_TOKENS,
            "--kv-cache-blocks", "256", "--checkpoint-every-rows", "1000", "--json")
    # Progress every 0.2 s: the run (a few seconds on a fast machine) is signalled early in it.
    run = subprocess.Popen(cli(*args, "--progress-every-s", "0.2"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, cwd=ROOT)
    lines = []
    for line in run.stdout:  # until a progress line says rows have finished
        lines.append(line)
        done = re.search(r"(\d+)/(\d+) rows \(", line)
        if done and 0 < int(done.group(1)) < int(done.group(2)):
            break
    assert run.poll() is None, "run ended before it could be terminated:\n" + "".join(lines)
    assert rows_in_parts(checkpoint) == 0  # 1,000 rows per part: nothing written on its own yet
    run.send_signal(signal.SIGTERM)
    run.wait(timeout=120)
    assert run.returncode == 128 + signal.SIGTERM  # ended by the handler, its finally blocks run
    written = rows_in_parts(checkpoint)
    total = make_prompt_table(seed=3, **ROWS).num_rows
    assert 0 < written < total and not output.exists()
    rerun = json.loads(
        subprocess.run(cli(*args), capture_output=True, text=True, check=True, cwd=ROOT).stdout.splitlines()[-1]
    )
    assert rerun["reused_rows"] == written and rerun["computed_rows"] == total - written


@pytest.fixture
def big_prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.parquet"
    pq.write_table(make_prompt_table(seed=3, **ROWS), path)
    return path


def test_cli_run_killed_midway_resumes_without_recomputing_or_duplicating(big_prompts, tmp_path, tiny_model):
    output = tmp_path / "answers.parquet"
    checkpoint = Path(f"{output}.checkpoint")
    args = ("run", str(big_prompts), "--model", tiny_model, "--output", str(output), "--max-tokens", MAX_TOKENS,
            "--kv-cache-blocks", "256", "--checkpoint-every-rows", "40", "--json")
    first = subprocess.Popen(cli(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    kill_when_checkpointed(first, checkpoint)
    done_before_kill = rows_in_parts(checkpoint)
    assert not output.exists()

    rerun = subprocess.run(cli(*args), capture_output=True, text=True, check=True, cwd=ROOT)
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    total = make_prompt_table(seed=3, **ROWS).num_rows
    assert 0 < done_before_kill < total
    assert summary["reused_rows"] == done_before_kill
    assert summary["computed_rows"] == total - done_before_kill
    assert f"reusing {done_before_kill} of {total} rows" in rerun.stderr

    answers = pq.read_table(output).to_pylist()
    ids = [a["id"] for a in answers]
    assert len(ids) == len(set(ids)) == total
    assert not checkpoint.exists()

    reference = tmp_path / "reference.parquet"
    subprocess.run(cli(*args[:5], str(reference), *args[6:]), capture_output=True, check=True, cwd=ROOT)
    expected = {a["id"]: a["text"] for a in pq.read_table(reference).to_pylist()}
    assert {a["id"]: a["text"] for a in answers} == expected

    # Rerunning into the same output reuses every row and still writes one row per id.
    again = json.loads(
        subprocess.run(cli(*args), capture_output=True, text=True, check=True, cwd=ROOT).stdout.splitlines()[-1]
    )
    assert again["reused_rows"] == total and again["computed_rows"] == 0
    assert pq.read_table(output).num_rows == total


def test_dagster_run_terminated_keeps_every_finished_row(big_prompts, tmp_path, tiny_model, monkeypatch):
    """Terminating a Dagster run (the UI's Terminate, a run launcher's or a container's stop) reaches
    the run worker as SIGTERM: Dagster raises it inside the step as an interrupt, and the partition
    writes every row finished so far, including those since its last checkpoint part; the rerun
    reuses all of them."""
    from engine.settings import SchedulerSettings

    home = tmp_path / "dagster_home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    config = BatchJobConfig(name="stopped", dataset=DatasetSpec(parquet=str(big_prompts)),
                            llm=EngineSettings(model_path=tiny_model, kv_cache_blocks=256),
                            sampling=SamplingSettings(max_tokens=int(MAX_TOKENS)), shards=1,
                            scheduler=SchedulerSettings(log_every_s=0.2), output_database=str(tmp_path / "out.duckdb"),
                            output_table="answers", storage_dir=str(tmp_path / "jobs"))
    config_file = tmp_path / "job.json"
    config_file.write_text(config.model_dump_json())
    child = start_fault_job(config_file, home)
    lines, written_before = [], None
    for line in child.stdout:  # until rows have finished that no checkpoint part holds yet
        lines.append(line)
        done = re.search(r"(\d+)/(\d+) rows \(", line)
        if done and 0 < int(done.group(1)) < int(done.group(2)):
            folders = list((config.files.job_dir / "checkpoints").glob("*"))
            written_before = rows_in_parts(folders[0]) if folders else 0
            if written_before < int(done.group(1)):
                break
    assert child.poll() is None and written_before is not None, "run ended before it could be terminated:\n" + "".join(
        lines
    )
    child.send_signal(signal.SIGTERM)
    rest, _ = child.communicate(timeout=120)
    assert child.returncode != 0, rest
    (folder,) = list((config.files.job_dir / "checkpoints").glob("*"))
    written = rows_in_parts(folder)
    total = make_prompt_table(seed=3, **ROWS).num_rows
    assert written_before < int(done.group(1)) <= written < total  # the rows in memory at the signal too
    instance = dg.DagsterInstance.get()
    (stopped,) = [r for r in instance.get_runs() if r.tags.get("dagster/partition") == folder.name]
    assert stopped.status == dg.DagsterRunStatus.FAILURE and "DagsterExecutionInterruptedError" in rest

    rerun = dg.materialize([completions_and_plan(config)[2]], partition_key=folder.name, instance=instance)
    meta = rerun.asset_materializations_for_node("stopped__completions")[0].metadata
    assert meta["reused_rows"].value == written and meta["computed_rows"].value == total - written


def test_dagster_partition_killed_midway_resumes(big_prompts, tmp_path, tiny_model, monkeypatch):
    """The night's kill for real: the partition's run, in a child process, is SIGKILLed by the OS
    mid-shard (no ``finally``, no flush); the rerun reuses what its checkpoint holds, and every id
    is then once in DuckDB and once in the shard's Parquet file, each equal to a fresh run's answer."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    config = BatchJobConfig(
        name="faulty",
        dataset=DatasetSpec(parquet=str(big_prompts)),
        llm=EngineSettings(model_path=tiny_model, kv_cache_blocks=256),
        sampling=SamplingSettings(max_tokens=int(MAX_TOKENS)),
        shards=1,
        output_database=str(tmp_path / "out.duckdb"),
        output_table="answers",
        storage_dir=str(tmp_path / "jobs"),
    )
    config_file = tmp_path / "job.json"
    config_file.write_text(config.model_dump_json())
    child = start_fault_job(config_file, home)
    checkpoints = config.files.job_dir / "checkpoints"
    deadline = time.monotonic() + 240
    while not (checkpoints.exists() and any(checkpoints.iterdir())) and time.monotonic() < deadline:
        assert child.poll() is None, child.stdout.read()
        time.sleep(0.05)
    (folder,) = list(checkpoints.iterdir())
    kill_when_checkpointed(child, folder)
    done_before_kill = rows_in_parts(folder)

    assets = completions_and_plan(config)
    instance = dg.DagsterInstance.get()
    result = dg.materialize([assets[2]], partition_key=folder.name, instance=instance)
    assert result.success
    meta = result.asset_materializations_for_node("faulty__completions")[0].metadata
    total = make_prompt_table(seed=3, **ROWS).num_rows
    assert meta["reused_rows"].value == done_before_kill
    assert meta["computed_rows"].value == total - done_before_kill  # computed in this run
    with duckdb.connect(config.output_database, read_only=True) as con:
        counts = con.execute("SELECT count(*), count(DISTINCT id) FROM answers").fetchall()[0]
        answers = dict(con.execute("SELECT id, text FROM answers").fetchall())
    assert counts == (total, total)

    reference = tmp_path / "reference.parquet"
    subprocess.run(cli("run", str(big_prompts), "--model", tiny_model, "--output", str(reference), "--max-tokens",
                       MAX_TOKENS, "--kv-cache-blocks", "256"), capture_output=True, check=True, cwd=ROOT)
    assert answers == {a["id"]: a["text"] for a in pq.read_table(reference).to_pylist()}
    # The shard's Parquet file holds the same rows, each once: the killed run left nothing half there.
    (published,) = list(config.files.completions_dir.glob("*.parquet"))
    in_parquet = pq.read_table(published, columns=["id", "text"]).to_pylist()
    assert len(in_parquet) == total and {a["id"]: a["text"] for a in in_parquet} == answers
