"""A configuration a user writes in one line never costs data: an output table that is the source, a
table of the user's, another job's table, a choice list that cannot be meant, a misspelled nested
key: each refused when the definitions load (what ``dg check defs`` runs), named in one line, the
user's tables byte for byte as they were. Real DuckDB; no model runs here (``test_bad_config_nights``
runs the nights)."""

import hashlib

import duckdb
import pyarrow as pa
import pytest
from dagster_duckdb import DuckDBResource

from assets import build_batch_defs
from assets.component import BatchJobComponent
from batchllm_dagster import BatchJobConfig, DatasetSpec
from batchllm_dagster.output_table import OutputTable
from batchllm_dagster.ownership import NotOwned

from .test_warehouse import rows


def shop(path) -> str:
    """The user's own database: a table of reviews and a table of theirs named ``results``."""
    with duckdb.connect(str(path)) as con:
        con.execute("CREATE TABLE reviews AS SELECT i AS id, 'review ' || i AS prompt FROM range(5) t(i)")
        con.execute("CREATE TABLE results AS SELECT i AS id, 'note ' || i AS note FROM range(3) t(i)")
    return str(path)


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def contents(path) -> dict:
    with duckdb.connect(str(path), read_only=True) as con:
        names = [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() ORDER BY 1").fetchall()]
        return {name: con.execute(f'SELECT * FROM "{name}" ORDER BY ALL').fetchall() for name in names}


def component(yaml_text: str, data, component_dir):
    return BatchJobComponent.resolve_from_yaml(yaml_text).to_config(component_dir)


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHLLM_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "data").mkdir()
    shop(tmp_path / "data" / "shop.duckdb")
    return tmp_path / "data"


@pytest.mark.parametrize("dataset, output_table", [
    ("{table: reviews, database: shop.duckdb}", "reviews"),
    ("{table: main.Reviews, database: shop.duckdb}", "reviews"),  # qualified, another case: the same table
    ("{sql: 'SELECT r.id, r.prompt FROM reviews r WHERE r.id NOT IN (SELECT id FROM done)', database: shop.duckdb}",
     "done"),
    ("{sql: 'SELECT id, prompt FROM reviews_prefix_groups', database: shop.duckdb}", "reviews"),
])
def test_an_output_table_the_dataset_reads_in_its_own_database_is_refused_at_load(data, tmp_path, dataset,
                                                                                  output_table):
    before = digest(data / "shop.duckdb")
    with pytest.raises(ValueError, match=r"job 'j': its .* is a table its dataset reads in .*shop\.duckdb: answers "
                                         r"written there would replace the prompts; set output_table") as refused:
        component(f"name: j\ndataset: {dataset}\noutput_table: {output_table}\noutput_database: shop.duckdb\n",
                  data, tmp_path)
    assert "output_database" in str(refused.value)
    assert digest(data / "shop.duckdb") == before


def test_by_default_answers_go_to_a_database_of_the_packages_own_not_the_users(data, tmp_path):
    before = contents(data / "shop.duckdb")
    config = component("name: j\ndataset: {table: reviews, database: shop.duckdb}\noutput_table: reviews\n",
                       data, tmp_path)  # the same name as the source: another database, no clash
    assert config.output_database == str(data / "jobs" / "answers.duckdb")
    build_batch_defs(config)
    output = OutputTable.of_job(DuckDBResource(database=config.output_database), config)
    output.replace_partition("k", rows("k", ["1"], "x"))
    assert contents(data / "shop.duckdb") == before


def test_answers_an_older_default_put_in_the_source_database_stay_there_with_a_warning(data, tmp_path):
    legacy = OutputTable(DuckDBResource(database=str(data / "shop.duckdb")), "reviews_answers", "j")
    legacy.replace_partition("k", rows("k", ["1"], "x"))
    with pytest.warns(UserWarning, match="its answers are in the dataset's database .*shop.duckdb .* set "
                                         "output_database: shop.duckdb to say so"):
        config = component("name: j\ndataset: {table: reviews, database: shop.duckdb}\n"
                           "output_table: reviews_answers\n", data, tmp_path)
    assert config.output_database == str(data / "shop.duckdb")  # nothing answered twice
    # Held by another writer at load, nobody can tell where the answers are: refused, never guessed.
    with duckdb.connect(str(data / "shop.duckdb")):
        with pytest.raises(ValueError, match="cannot tell whether its answers are in the dataset's database .* "
                                             "another process holds it. Set output_database: shop.duckdb"):
            component("name: j\ndataset: {table: reviews, database: shop.duckdb}\noutput_table: reviews_answers\n",
                      data, tmp_path)


def job(tmp_path, name: str, output_table: str, database) -> BatchJobConfig:
    return BatchJobConfig(name=name, dataset=DatasetSpec(table="reviews", database=str(database)),
                          output_database=str(database), output_table=output_table,
                          storage_dir=str(tmp_path / "jobs"))


def test_a_table_of_the_users_is_never_written_refused_at_load_and_at_every_write(data, tmp_path):
    database = data / "shop.duckdb"
    with pytest.raises(NotOwned, match=r"job 'j': its output table would be table 'results' of .*shop\.duckdb, "
                                       r"which this job did not make \(a table of yours\? it lacks the columns "
                                       r"partition_key, status, text\)"):
        build_batch_defs(job(tmp_path, "j", "results", database))
    # Made after the definitions loaded: every write of the job still refuses it.
    config = job(tmp_path, "k", "late", database)
    build_batch_defs(config)
    with duckdb.connect(str(database)) as con:
        con.execute("CREATE TABLE late AS SELECT 1 AS id")
        con.execute("CREATE TABLE late_prefix_groups AS SELECT 1 AS x")
    before = contents(database)
    table = OutputTable.of_job(DuckDBResource(database=str(database)), config)
    for write in (lambda: table.replace_partition("k", rows("k", ["1"], "x")),
                  lambda: table.remove_answers_not_in(pa.array([], pa.string())),
                  lambda: table.replace_groups(pa.table({"group": [0]}))):
        with pytest.raises(NotOwned, match="table 'late' of"):
            write()
    assert contents(database) == before


def test_a_view_or_groups_table_of_the_users_is_never_replaced(data, tmp_path):
    database = data / "shop.duckdb"
    with duckdb.connect(str(database)) as con:
        con.execute("CREATE VIEW mine_with_prompts AS SELECT 1 AS x")
    with pytest.raises(NotOwned, match="its view would be view 'mine_with_prompts' .* it does not read this job's"):
        build_batch_defs(job(tmp_path, "j", "mine", database))


def test_two_jobs_never_share_an_output_table(data, tmp_path):
    database = data / "out.duckdb"
    # In one code location: the second job to load is refused, naming both.
    build_batch_defs(job(tmp_path, "first", "answers", database).model_copy(
        update={"dataset": DatasetSpec(table="reviews", database=str(data / "shop.duckdb"))}))
    with pytest.raises(NotOwned, match="jobs 'first' and 'second' both name output table 'answers'"):
        build_batch_defs(job(tmp_path, "second", "answers", database).model_copy(
            update={"dataset": DatasetSpec(table="reviews", database=str(data / "shop.duckdb"))}))
    # In another code location (another process): the table records its owner when first written.
    OutputTable(DuckDBResource(database=str(database)), "shared", "first").replace_partition(
        "k", rows("k", ["1", "2"], "first's"))
    before = contents(database)
    from batchllm_dagster.ownership import check_existing_objects

    with pytest.raises(NotOwned, match="table 'shared' of .*, which job 'first' owns: two jobs in one table"):
        check_existing_objects("second", "shared", str(database))
    with pytest.raises(NotOwned, match="which job 'first' owns"):
        OutputTable(DuckDBResource(database=str(database)), "shared", "second").replace_partition(
            "k", rows("k", ["1"], "second's"))
    assert contents(database) == before


def test_a_table_an_older_version_made_is_adopted_and_then_owned(tmp_path):
    database = str(tmp_path / "out.duckdb")
    with duckdb.connect(database) as con:  # answers of a version that recorded no owner
        old = rows("k", ["1"], "old")
        con.register("incoming", old.append_column("status", pa.array(["ok"])))
        con.execute("CREATE TABLE answers AS SELECT * FROM incoming")
    OutputTable(DuckDBResource(database=database), "answers", "j").replace_partition("k", rows("k", ["1"], "new"))
    with duckdb.connect(database, read_only=True) as con:
        assert con.execute("SELECT comment FROM duckdb_tables() WHERE table_name = 'answers'").fetchall() == [
            ("batchllm-dagster job j",)]


@pytest.mark.parametrize("sampling, message", [
    ("{response_format: {choice: [budget]}}", r"choice \['budget'\] needs at least two answers"),
    ("{response_format: {choice: [budget, mid, budget, premium]}}", "repeats 'budget': list each answer once"),
])
def test_a_choice_list_that_cannot_be_meant_is_refused_naming_it(sampling, message):
    with pytest.raises(Exception, match=message):
        BatchJobComponent.resolve_from_yaml(f"name: x\ndataset: {{sql: select 1, database: d.duckdb}}\n"
                                            f"sampling: {sampling}\n")


@pytest.mark.parametrize("yaml_text, path, key", [
    ("sampling: {max_tokens: 4, score_choice: true}", ["sampling"], "score_choice"),
    ("dataset: {sql: select 1, database: d.duckdb, prompt: {instruction: i, fields: [a], field_ordr: optimize}}",
     ["dataset", "prompt"], "field_ordr"),
    ("sampling: {response_format: {choices: [a, b]}}", ["sampling", "response_format"], "choices"),
    ("llm: {model_pth: x}", ["llm"], "model_pth"),
])
def test_a_misspelled_nested_key_is_named_by_the_schema_dg_check_defs_validates(yaml_text, path, key):
    """``dg check defs`` prints each JSON-schema error's own message: it names the key."""
    import yaml
    from jsonschema import Draft202012Validator

    attributes = {"name": "x", "dataset": {"sql": "select 1", "database": "d.duckdb"}, **yaml.safe_load(yaml_text)}
    schema = BatchJobComponent.get_model_cls().model_json_schema()
    errors = list(Draft202012Validator(schema).iter_errors(attributes))
    assert [(list(e.absolute_path), e.message) for e in errors] == [
        (path, f"Additional properties are not allowed ('{key}' was unexpected)")]
    # What is valid stays valid: a hardware name or block, an enum, a null block.
    fine = {"name": "x", "dataset": {"sql": "select 1", "database": "d.duckdb", "prompt": None},
            "hardware": ["cpu", {"name": "h100", "platform": "cuda"}], "backend": "ray",
            "sampling": {"max_tokens": 4, "response_format": {"choice": ["a", "b"]}}}
    assert list(Draft202012Validator(schema).iter_errors(fine)) == []


def test_batchllm_dagster_run_says_a_failed_step_in_one_line(tmp_path):
    """Dagster's console prints a failure's trace twice; the command prints one line per failed step
    and per warning (``batchllm_dagster.cli._said``), the trace staying in the run's log."""
    import dagster as dg

    from batchllm_dagster.cli import _said

    database = shop(tmp_path / "shop.duckdb")
    config = BatchJobConfig(name="j", dataset=DatasetSpec(table="carz", database=database),  # made later, maybe
                            output_database=str(tmp_path / "o.duckdb"), storage_dir=str(tmp_path / "jobs"))
    instance = dg.DagsterInstance.ephemeral()
    result = build_batch_defs(config).resolve_job_def("j_plan").execute_in_process(
        instance=instance, raise_on_error=False)
    (line,) = _said(instance, result.run_id)
    assert line.startswith("error in j__prompts: j: dataset SQL failed: Catalog Error: Table with name carz does not "
                           "exist!") and "Traceback" not in line
