"""A job's YAML read without Dagster (``engine/jobs/job_file.py``): ``batchllm plan --job`` plans what
the job declares, its paths resolved as the Component resolves them, and a key the job would refuse
is refused here too."""

import argparse
import json

import pydantic
import pytest

from engine.jobs.job_file import JobFile

from .test_cli import batchllm, reviews_parquet

JOB = """type: assets.BatchJobComponent
attributes:
  name: ratings
  dataset:
    sql_file: ratings.sql          # relative to this folder
    database: shop.duckdb          # relative to the project's data folder
    prompt:
      instruction: "Rate the review."
      fields: [review, description, category]
      question: "Rating:"
      field_order: optimize
  llm: {model_path: MODEL, kv_cache_blocks: 64}  # the block size this machine's, as the flags' default
  sampling:
    max_tokens: 3
    response_format: {choice: [good, bad, a very long answer indeed]}
  shards: 2
  hardware: [cpu]
  output_table: ratings_answers
"""


def _project(tmp_path, model: str, job: str = JOB):
    """A dg project (pyproject.toml with [tool.dg.project]), its data folder holding the database, and
    the job's defs.yaml and SQL file in a folder of its own."""
    import duckdb

    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "pyproject.toml").write_text('[tool.dg.project]\nroot_module = "shop"\n')
    (tmp_path / "data").mkdir()
    with duckdb.connect(str(tmp_path / "data" / "shop.duckdb")) as con:
        con.execute(f"CREATE TABLE reviews AS SELECT * FROM read_parquet('{reviews_parquet(tmp_path)}')")
    folder = tmp_path / "shop" / "defs" / "ratings"
    folder.mkdir(parents=True)
    (folder / "ratings.sql").write_text("SELECT * FROM reviews\n")
    (folder / "defs.yaml").write_text(job.replace("MODEL", model))
    return folder / "defs.yaml"


def test_a_jobs_declaration_is_read_with_its_paths_where_the_component_puts_them(tmp_path, tiny_model):
    job = JobFile.read(_project(tmp_path, tiny_model))
    dataset = job.dataset()
    assert job.name == "ratings" and dataset.sql_file == str(tmp_path / "shop" / "defs" / "ratings" / "ratings.sql")
    assert dataset.database == str(tmp_path / "data" / "shop.duckdb") and dataset.prompt.fields[0] == "review"
    assert (job.llm().kv_cache_blocks, job.sampling().max_tokens, job.shards_for(12)) == (64, 3, 2)
    assert JobFile(job.path, {"rows_per_shard": 5}).shards_for(12) == 3
    from engine.cli.main import _source

    with pytest.raises(ValueError, match="give PROMPTS or --job, not both"):
        _source(argparse.Namespace(job=str(job.path), prompts="reviews.parquet"))
    misspelled = JobFile.read(_project(tmp_path / "b", tiny_model, JOB.replace("max_tokens", "max_token")))
    with pytest.raises(pydantic.ValidationError, match="max_token"):
        misspelled.sampling()


@pytest.mark.slow  # four seconds: the command line twice
def test_plan_of_a_jobs_yaml_is_the_plan_of_its_settings_typed_as_flags(tmp_path, tiny_model):
    """``batchllm plan --job`` plans the job's rows with its fields, choices (each row's
    budget raised to its longest choice) and shards, as the same settings typed as flags do, and says
    its work tonight."""
    path = _project(tmp_path, tiny_model)
    from_job = json.loads(batchllm("plan", "--job", str(path), "--json").stdout)
    typed = json.loads(batchllm(
        "plan", str(tmp_path / "reviews.parquet"), "--model", tiny_model, "--max-tokens", "3",
        "--choice", "good", "--choice", "bad", "--choice", "a very long answer indeed",
        "--fields", "review,description,category",
        "--instruction", "Rate the review.", "--question", "Rating:", "--field-order", "optimize", "--shards", "2",
        "--json").stdout)
    for key in ("rows", "groups", "prompt_tokens", "unique_tokens", "shards", "fields"):
        assert from_job[key] == typed[key], key
    work = from_job["job"]
    assert work["shards"] == 2 and work["rows_to_compute"] == 12
    assert work["output_tokens_at_most"] == sum(s["decode_tokens"] for s in typed["shards"]) > 12 * 3  # choices
    assert "batchllm-dagster run ratings --dry-run" in work["line"]  # where its time and cost are
