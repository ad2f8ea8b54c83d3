"""What a user does by habit is refused at once, naming the fix, before a lock or a night is spent
(issue 66): a Ray address nobody answers, Ray asked for where it is not installed, a setting kept
whose partner was removed."""

import socket
import time

import pytest

from batchllm_dagster import BatchJobConfig, DatasetSpec
from engine.plan.tokenize_workers import TokenizeWorkers
from engine.ray_address import RayUnreachable, check_reachable, host_and_port
from engine.response_format import ResponseFormat
from engine.settings import EngineSettings, SamplingSettings


def job(tmp_path, **kw) -> BatchJobConfig:
    return BatchJobConfig(name="habits", dataset=DatasetSpec(parquet=str(tmp_path / "p.parquet")),
                          llm=EngineSettings(model_path="tiny"), output_database=str(tmp_path / "o.duckdb"),
                          storage_dir=str(tmp_path / "jobs"), **kw)


def test_a_ray_address_nobody_answers_fails_at_once_naming_it():
    started = time.monotonic()
    with pytest.raises(RayUnreachable, match=r"tokenize_workers: 2: nothing answers at ray_address '127.0.0.1:1'"):
        TokenizeWorkers(2, "127.0.0.1:1").check_reachable()
    assert time.monotonic() - started < 5  # Ray's own init retried for minutes
    TokenizeWorkers(1, "127.0.0.1:1").check_reachable()  # no workers: no Ray to reach
    TokenizeWorkers(2, None).check_reachable()  # a local Ray: nothing to reach
    with socket.socket() as listening:  # an address something answers at passes
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        check_reachable(f"127.0.0.1:{listening.getsockname()[1]}", "backend: ray")
    assert host_and_port("ray://head.ray.svc:10001") == ("head.ray.svc", 10001)
    assert host_and_port("ray://head") == ("head", 10001) and host_and_port("auto") is None


def test_the_plan_step_refuses_an_unreachable_ray_before_taking_the_plan_lock(tmp_path):
    """The step fails naming the address, and the job's plan lock was never taken (a shard's write
    takes it at once)."""
    import dagster as dg

    from assets import build_batch_defs
    from batchllm_dagster.config import Backend

    config = job(tmp_path, tokenize_workers=2, ray_address="127.0.0.1:1", backend=Backend.LOCAL)
    defs = build_batch_defs(config)
    prefix_groups = defs.resolve_asset_graph().assets_def_for_key(dg.AssetKey(["habits", "prefix_groups"]))
    with dg.instance_for_test() as instance:
        result = dg.materialize([prefix_groups], instance=instance, raise_on_error=False)
    assert not result.success
    [failure] = [e for e in result.all_events if e.is_step_failure]
    assert "nothing answers at ray_address '127.0.0.1:1'" in failure.event_specific_data.error.message
    assert not config.files.lock_path("plan").exists()  # never taken


def test_ray_asked_for_where_it_is_not_installed_is_refused_at_load(tmp_path, monkeypatch):
    import importlib.util

    from assets import build_batch_defs

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"tokenize_workers: 4.*pip install 'batchllm-dagster\[ray\]'"):
        build_batch_defs(job(tmp_path, tokenize_workers=4))
    build_batch_defs(job(tmp_path / "one"))  # no Ray asked for: loads


def test_review_below_without_scored_choices_is_refused_naming_both_lines(tmp_path):
    with pytest.raises(ValueError, match="review_below: 0.6 marks scored answers.*set sampling.score_choices"):
        job(tmp_path, review_below=0.6)
    scored = SamplingSettings(score_choices=True, response_format=ResponseFormat(choice=["yes", "no"]))
    assert job(tmp_path, review_below=0.6, sampling=scored).review_below == 0.6


def test_a_command_from_a_subfolder_finds_the_projects_files_not_a_second_copy(tmp_path, monkeypatch):
    """`dg launch` or `batchllm-dagster run` from the project's `my_batches/` subfolder: the job's data,
    state and models resolve against the project root, not against that folder."""
    from assets.component import BatchJobComponent
    from batchllm_dagster.cli import project_root
    from batchllm_dagster.config import default_data_dir

    (tmp_path / "pyproject.toml").write_text('[tool.dg.project]\nroot_module = "my_project"\n')
    sub = tmp_path / "my_batches" / "deeper"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    monkeypatch.delenv("BATCHLLM_DATA_DIR", raising=False)
    assert project_root() == (tmp_path, {"root_module": "my_project"})
    assert default_data_dir(tmp_path) == tmp_path / "data"
    component = BatchJobComponent.resolve_from_yaml(
        "name: reviews\ndataset: {parquet: reviews.parquet}\nllm: {model_path: tiny}\n")
    config = component.to_config(sub, tmp_path)
    assert config.storage_dir == str(tmp_path / "data" / "jobs")
    assert config.dataset.parquet == str(tmp_path / "data" / "reviews.parquet")
    monkeypatch.setenv("BATCHLLM_DATA_DIR", "shared")  # a relative one: against the project too
    assert default_data_dir(tmp_path) == tmp_path / "shared"


def test_a_renamed_output_table_carries_its_answers_and_the_old_one_is_released(tmp_path):
    """Renaming output_table used to recompute every answer and leave the old table behind, still the
    job's. The plan step carries them: the table renamed, the derived objects of the old name dropped."""
    import duckdb
    import pyarrow as pa
    from dagster_duckdb import DuckDBResource

    from batchllm_dagster.output_table import OutputTable

    db = DuckDBResource(database=str(tmp_path / "answers.duckdb"))
    answers = pa.table({"id": ["1", "2"], "status": ["ok", "ok"], "text": ["a", "b"], "partition_key": ["k", "k"]})
    OutputTable(db, "reviews_old", "reviews").replace_partition("k", answers)
    OutputTable(db, "other_jobs", "other").replace_partition("k", answers)  # another job's: never touched
    assert OutputTable(db, "reviews_new", "reviews").carry_renamed().startswith(
        "output_table renamed from 'reviews_old' to 'reviews_new': its 2 answers carried over")
    with duckdb.connect(db.database, read_only=True) as con:
        tables = {row[0]: row[1] for row in con.execute("SELECT table_name, comment FROM duckdb_tables()").fetchall()}
        assert con.execute("SELECT id, text FROM reviews_new ORDER BY id").fetchall() == [("1", "a"), ("2", "b")]
    assert "reviews_old" not in tables and tables["reviews_new"] == "batchllm-dagster job reviews"
    assert tables["other_jobs"] == "batchllm-dagster job other"
    assert OutputTable(db, "reviews_new", "reviews").carry_renamed() is None  # once
    # Renamed back after the new table has answers: the old one is named, not merged.
    OutputTable(db, "reviews_old", "reviews").replace_partition("k", answers)
    said = OutputTable(db, "reviews_new", "reviews").carry_renamed()
    assert "its answers were not carried" in said and "DROP TABLE reviews_old" in said
