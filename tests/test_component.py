"""The YAML Component and the project's code location, as `dg` sees them."""

import os
import subprocess
from pathlib import Path

import dagster as dg
import duckdb
import pytest
import yaml

from assets import BatchJobComponent
from assets.component import BatchJobScaffolder

from .conftest import ROOT

DG = str(ROOT / ".venv" / "bin" / "dg")


def dg_cli(*args, env=None) -> str:
    env = {**os.environ, "VIRTUAL_ENV": str(ROOT / ".venv"), "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}",
           **(env or {})}
    done = subprocess.run([DG, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_component_is_registered_and_the_project_validates(tmp_path):
    assert "assets.BatchJobComponent" in dg_cli("list", "components")
    # The job model's own descriptions reach dg's component schema, the nested scheduler's included.
    schema = dg_cli("utils", "inspect-component", "assets.BatchJobComponent")
    assert "partitions of completions (>= 1)" in schema and "share of the engine's KV capacity" in schema
    out = dg_cli("check", "defs", env={"DAGSTER_HOME": str(tmp_path), "BATCHLLM_DATA_DIR": str(tmp_path / "data")})
    assert "All definitions loaded successfully" in out


@pytest.mark.slow
def test_project_declares_yaml_and_python_jobs(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHLLM_DATA_DIR", str(tmp_path))
    from dagster_project.definitions import defs

    keys = {k.to_user_string() for k in defs().resolve_asset_graph().get_all_asset_keys()}
    for job in ("reviews", "documents", "support"):  # two from YAML, one from Python
        assert {f"{job}/prompts", f"{job}/prefix_groups", f"{job}/completions"} <= keys


def test_scaffolded_job_resolves_to_a_config(tmp_path, monkeypatch):
    target = tmp_path / "nightly_reviews"
    target.mkdir()
    request = dg.ScaffoldRequest(type_name="assets.BatchJobComponent", target_path=target,
                                 scaffold_format="yaml", project_root=tmp_path, params=None)
    BatchJobScaffolder().scaffold(request)
    written = yaml.safe_load((target / "defs.yaml").read_text())
    assert written["type"] == "assets.BatchJobComponent"
    assert (target / "prompts.sql").exists()
    component = BatchJobComponent.resolve_from_yaml(yaml.safe_dump(written["attributes"]))
    # A database that is not there is named when the definitions load, with the way out for one made later.
    data = tmp_path / "data"
    monkeypatch.setenv("BATCHLLM_DATA_DIR", str(data))
    with pytest.raises(ValueError, match="database 'my_warehouse.duckdb' does not exist in .*database_built_later"):
        component.to_config(target)
    built_later = component.dataset.model_copy(update={"database_built_later": True})
    later = component.model_copy(update={"dataset": built_later})
    assert later.to_config(target).dataset.database == str(data / "my_warehouse.duckdb")
    data.mkdir()
    duckdb.connect(str(data / "my_warehouse.duckdb")).close()
    config = component.to_config(target)
    assert later.to_config(target).prompts_code_version() == config.prompts_code_version()  # no prompt changes
    assert config.name == "nightly_reviews"
    assert Path(config.dataset.sql_file) == target / "prompts.sql"
    assert config.output_database == str(data / "jobs" / "answers.duckdb")  # the package's own, not the user's
    # The template says what to fill in, and points at no demo database or table.
    text = (target / "defs.yaml").read_text() + (target / "prompts.sql").read_text()
    assert "FILL IN" in text and "batchllm.duckdb" not in text and "review_labels" not in text
    # A SQL file that is not there is named when the definitions load (`dg check defs`), not at night.
    (target / "prompts.sql").unlink()
    with pytest.raises(ValueError, match="dataset.sql_file 'prompts.sql' does not exist"):
        component.to_config(target)


def test_a_mistyped_key_is_named_never_ignored():
    from batchllm_dagster import BatchJobConfig, DatasetSpec

    with pytest.raises(Exception, match="choices"):  # YAML: dg's model names it
        BatchJobComponent.resolve_from_yaml("name: x\ndataset: {sql: select 1, database: d.duckdb}\nchoices: [a]\n")
    with pytest.raises(Exception, match="choices"):  # Python: the job model forbids it too
        BatchJobConfig(name="x", dataset=DatasetSpec(parquet="p.parquet"), output_database="o.duckdb",
                       storage_dir="s", choices=["a"])
    with pytest.raises(Exception, match="'as_declared' or 'optimize'"):
        BatchJobComponent.resolve_from_yaml(
            "name: x\ndataset: {sql: select 1, database: d.duckdb, prompt: {instruction: i, fields: [a], "
            "field_order: optimise}}\n")


def test_bad_yaml_is_rejected_with_the_reason():
    with pytest.raises(Exception, match="exactly one of sql, sql_file, table, parquet"):
        BatchJobComponent.resolve_from_yaml("name: x\ndataset:\n  sql: select 1\n  table: t\n  database: d.duckdb\n")


@pytest.mark.slow
def test_inference_steps_share_one_pool_per_hardware_partition(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHLLM_DATA_DIR", str(tmp_path))
    from dagster_project.definitions import defs

    graph = defs().resolve_asset_graph()
    pools = {graph.assets_def_for_key(dg.AssetKey([job, "completions"])).op.pool for job in ("reviews", "support")}
    assert pools == {"inference_cpu"}
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text((ROOT / "dagster_project" / "dagster.yaml").read_text())
    with dg.instance_for_test(
        temp_dir=str(home), overrides=yaml.safe_load((home / "dagster.yaml").read_text())
    ) as instance:
        concurrency = instance.get_concurrency_config()
    assert concurrency.pool_config.default_pool_limit == 1
    # Runs of a hardware partition's shards queue one at a time per batchllm/pool value, plan runs
    # one at a time per job.
    limits = concurrency.run_queue_config.tag_concurrency_limits
    assert limits == [{"key": "batchllm/pool", "value": {"applyLimitPerUniqueValue": True}, "limit": 1},
                      {"key": "batchllm/plan", "value": {"applyLimitPerUniqueValue": True}, "limit": 1}]

    # The schedule's and the source sensor's runs of a plan job: the second waits for the first
    # (Dagster's own counter of the run queue), a plan of another job does not.
    from dagster._utils.tags import TagConcurrencyLimitsCounter

    all_defs = defs()
    reviews, support = (all_defs.resolve_job_def(f"{job}_plan") for job in ("reviews", "support"))
    assert all_defs.resolve_schedule_def("reviews_nightly").job_name == "reviews_plan"
    assert all_defs.resolve_sensor_def("reviews_source_changed").job_name == "reviews_plan"
    scheduled = dg.DagsterRun(job_name=reviews.name, tags=dict(reviews.tags))
    counter = TagConcurrencyLimitsCounter(limits, [scheduled])
    assert counter.is_blocked(dg.DagsterRun(job_name=reviews.name, tags=dict(reviews.tags)))
    assert not counter.is_blocked(dg.DagsterRun(job_name=support.name, tags=dict(support.tags)))
    # A UI materialization of prefix_groups outside the job queues on its op pool instead.
    assert graph.assets_def_for_key(dg.AssetKey(["reviews", "prefix_groups"])).op.pool == "batchllm_plan_reviews"


@pytest.mark.parametrize("yaml_text, message", [
    ("shards: 0", r"shards must be in 1\.\.100,000"),
    ("sampling: {max_tokens: 0}", "max_tokens must be at least 1"),
    ("llm: {block_size: 12}", "block_size must be one of"),
    ("scheduler: {reserve_output: ful}", "'full' or 'lookahead'"),
    ("backend: rai", "'local' or 'ray'"),
])
def test_yaml_numbers_and_policies_are_checked_with_the_choices(yaml_text, message):
    with pytest.raises(Exception, match=message):
        BatchJobComponent.resolve_from_yaml(f"name: x\ndataset: {{sql: select 1, database: d.duckdb}}\n{yaml_text}\n")


def test_the_component_and_the_python_factory_take_one_job_model(tmp_path):
    from batchllm_dagster.config import BatchJobConfig, JobSpec

    component = BatchJobComponent.resolve_from_yaml(
        "name: x\ndataset: {sql: select 1, database: d.duckdb, database_built_later: true}\n"
        "scheduler: {reserve_output: full, lookahead_tokens: 8}\n"
    )
    config = component.to_config(tmp_path)
    assert set(JobSpec.model_fields) <= set(BatchJobComponent.model_fields) & set(BatchJobConfig.model_fields)
    assert config.scheduler.reserve_output.value == "full" and config.scheduler.lookahead_tokens == 8


def test_a_job_builds_definitions_with_its_warehouse_resource_bound(tmp_path):
    from assets import build_batch_defs
    from batchllm_dagster import BatchJobConfig, DatasetSpec

    config = BatchJobConfig(
        name="nightly",
        dataset=DatasetSpec(parquet=str(tmp_path / "p.parquet")),
        output_database=str(tmp_path / "out" / "answers.duckdb"),
        storage_dir=str(tmp_path / "jobs"),
    )
    graph = build_batch_defs(config).resolve_asset_graph()
    writers = [assets_def for assets_def in graph.assets_defs
               if assets_def.keys and assets_def.key.path[-1] in ("prefix_groups", "completions")]
    assert len(writers) == 2  # both assets that write answers or groups, each checked below
    for assets_def in writers:
        resource = assets_def.resource_defs["nightly_warehouse"]
        assert resource.configurable_resource_cls.__name__ == "DuckDBResource"
        assert resource.config_schema.default_value["database"] == config.output_database


@pytest.mark.parametrize("dataset, message", [
    ({"table": "carz"}, 'Table with name carz does not exist!\nDid you mean "cars"?'),  # may be made by then
    ({"table": "cars", "database": "nope.duckdb"}, "nope.duckdb' does not exist"),
])
def test_a_job_whose_table_does_not_exist_yet_fails_its_plan_in_a_line_that_names_it(tmp_path, dataset, message):
    import duckdb

    from assets import build_batch_defs
    from batchllm_dagster import BatchJobConfig, DatasetSpec

    with duckdb.connect(str(tmp_path / "w.duckdb")) as con:
        con.execute("CREATE TABLE cars AS SELECT i AS id, 'car ' || i AS name FROM range(3) t(i)")
    spec = DatasetSpec(**{"database": str(tmp_path / "w.duckdb"), **dataset,
                          **({"database": str(tmp_path / dataset["database"])} if "database" in dataset else {})})
    config = BatchJobConfig(name="j", dataset=spec, output_database=str(tmp_path / "o.duckdb"),
                            storage_dir=str(tmp_path / "jobs"))
    result = build_batch_defs(config).resolve_job_def("j_plan").execute_in_process(raise_on_error=False)
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE").event_specific_data.error
    assert failure.cls_name == "Failure" and message in failure.message
    assert failure.message.startswith("dagster._core.definitions.events.Failure: j: ")


@pytest.mark.parametrize("dataset, message", [
    ({"table": "cars", "prompt": {"instruction": "x", "fields": ["nmae"]}},
     "the prompt's fields ['nmae'] are not columns of the table (it has id, name)"),
    ({"sql": "SELECT id, nmae AS prompt FROM cars"}, 'Referenced column "nmae" not found'),
    ({"sql": "SELECT id, name FROM cars"}, "prompt table needs a prompt column 'prompt'"),
    ({"sql": "SELEC id FROM cars"}, "syntax error"),
])
def test_a_dataset_mistake_known_at_load_is_refused_at_load_in_a_line_that_names_it(tmp_path, dataset, message):
    """A column or field a table that exists lacks, or SQL that does not parse: known before any
    night, so the definitions do not load (``dg check defs`` says it); nothing is planned."""
    import duckdb

    from assets import build_batch_defs
    from batchllm_dagster import BatchJobConfig, DatasetSpec

    with duckdb.connect(str(tmp_path / "w.duckdb")) as con:
        con.execute("CREATE TABLE cars AS SELECT i AS id, 'car ' || i AS name FROM range(3) t(i)")
    config = BatchJobConfig(name="j", dataset=DatasetSpec(database=str(tmp_path / "w.duckdb"), **dataset),
                            output_database=str(tmp_path / "o.duckdb"), storage_dir=str(tmp_path / "jobs"))
    with pytest.raises(ValueError, match="^job 'j': ") as refused:
        build_batch_defs(config)
    assert message in str(refused.value) and "\n" not in str(refused.value).strip()
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "o.duckdb").exists()
