"""Tonight's forecast, known when the plan is made (``batchllm_dagster/forecast.py``): its numbers from
a known throughput; a budget that refuses a night before anything is written; the night's lines as
they come (``batchllm-dagster run``)."""

import types

import numpy as np
import pytest

from batchllm_dagster import BatchJobConfig, DatasetSpec, EngineSettings
from batchllm_dagster.config import HardwarePartition
from batchllm_dagster.forecast import forecast_night
from batchllm_dagster.shard_sizing import Measured, measured_by_hardware
from engine.plan.answer_lengths import AnswerLengths


def _config(tmp_path, **kw) -> BatchJobConfig:
    kw.setdefault("llm", EngineSettings(model_path="tiny"))
    kw.setdefault("dataset", DatasetSpec(parquet=str(tmp_path / "p.parquet")))
    return BatchJobConfig(name="night", output_database=str(tmp_path / "o.duckdb"), storage_dir=str(tmp_path / "jobs"),
                          **kw)


def _made(rows_by_shard, prefill, decode, to_run, settled=0):
    keys = [f"k{s}" for s in range(len(rows_by_shard))]
    return types.SimpleNamespace(keys=keys, keys_to_run=[keys[s] for s in to_run], rows_by_shard=rows_by_shard,
                                 shards=types.SimpleNamespace(prefill_tokens=np.array(prefill),
                                                              decode_tokens=np.array(decode)),
                                 counts={"settled_rows": settled})


def test_the_forecast_is_the_planned_work_at_the_measured_throughput(tmp_path):
    """Shards 0 and 2 on cpu-a, 1 and 3 on cpu-b; shard 3 is answered already. cpu-a measured 1 ms a
    unit of work (a prefilled token, or 2 per output token), 10 s for a run's vLLM start and stop and 1 s
    of a partition's own; cpu-b nothing yet; the job's answers took 4 output tokens on average (the output
    table's: every hardware partition's). One run per hardware partition."""
    config = _config(tmp_path, hardware=[HardwarePartition(name="cpu-a", price_per_hour=3.0), "cpu-b"])
    made = _made([100, 50, 200, 70], [10_000, 5_000, 20_000, 7_000], [6_400, 3_200, 12_800, 4_480], [0, 1, 2],
                 settled=70)
    measured = {"cpu-a": Measured(rows_per_s=10.0, overhead_s=10.0, partitions=3, seconds_per_work=0.001,
                                  run_overhead_s=10.0, partition_overhead_s=1.0)}
    assert forecast_night(made, config, measured).parts[0].output_tokens == 12_800 + 6_400  # nothing learned: budgets
    lengths = AnswerLengths(tokens=9, mean=4.0, rows=500)
    forecast = forecast_night(made, config, measured, lengths)
    a, b = forecast.parts
    assert (a.rows, a.shards, a.prefill_tokens, a.output_tokens, a.output_measured) == (300, 2, 30_000, 1_200, True)
    assert a.wall_s == pytest.approx(0.001 * (30_000 + 2 * 1_200) + 10.0 + 2 * 1.0)  # 44.4 s
    capped = forecast_night(made, config.model_copy(update={"partitions_per_run": 1}), measured, lengths).parts[0]
    assert capped.wall_s == pytest.approx(a.wall_s + 10.0)  # a run, and a vLLM start, per shard
    assert a.device_hours == pytest.approx(a.wall_s / 3600) and a.cost == pytest.approx(3.0 * a.wall_s / 3600)
    # Nothing measured on cpu-b: its answers as long as the job's, and no time.
    assert (b.rows, b.output_tokens, b.output_measured, b.wall_s) == (50, 200, True, None)
    assert "no measurement yet on this hardware" in b.line()
    metadata = forecast.metadata()
    assert metadata["forecast_rows_to_compute"] == 350 and metadata["forecast_rows_reused"] == 70
    assert metadata["forecast_prefill_tokens"] == 35_000 and metadata["forecast_output_tokens"] == 1_400
    assert "forecast_wall_s" not in metadata and "forecast_gpu_hours" not in metadata  # not every hardware measured
    both = forecast_night(made, config, {**measured, "cpu-b": measured["cpu-a"]}, lengths)
    assert both.wall_s == pytest.approx(a.wall_s)  # side by side: the longest
    assert both.metadata()["forecast_gpu_hours"] == pytest.approx(round(both.device_hours, 4))
    assert "forecast_cost" not in both.metadata()  # cpu-b has no price


def test_a_gpu_partitions_device_hours_count_its_gpus(tmp_path):
    config = _config(tmp_path, llm=EngineSettings(model_path="tiny", tensor_parallel_size=4),
                     hardware=[HardwarePartition(name="h100", platform="cuda")])
    forecast = forecast_night(_made([10], [1_000], [100], [0]), config,
                              {"h100": Measured(1.0, 0.0, 1, seconds_per_work=0.0036)}, AnswerLengths(12, 10.0, 200))
    assert forecast.wall_s == pytest.approx(0.0036 * (1_000 + 2 * 100))
    assert forecast.device_hours == pytest.approx(4 * forecast.wall_s / 3600)


def test_the_measured_throughput_is_engine_seconds_per_unit_of_work():
    first = {"computed_rows": 100, "wall_s": 10.0, "startup_s": 8.0, "engine_start_s": 7.0, "engine_stop_s": 0.0,
             "write_s": 0.5, "prefill_tokens": 3_000, "output_tokens": 1_000, "hardware_partition": "cpu"}
    last = {**first, "wall_s": 30.0, "startup_s": 1.0, "engine_start_s": 0.0, "engine_stop_s": 2.0}
    measured = measured_by_hardware([first, {**last, "wall_s": 20.0, "engine_stop_s": 0.0}, last])["cpu"]  # one run
    assert measured.seconds_per_work == pytest.approx(20.0 / 5_000)
    assert measured.run_overhead_s == 9.0 and measured.partition_overhead_s == pytest.approx(1.5)


def _project(tmp_path, monkeypatch, name: str, **kw) -> BatchJobConfig:
    """A definitions module ``name`` of the job (as a user's project holds one), run from its folder."""
    from batchllm_dagster import SamplingSettings
    from engine.settings import SchedulerSettings

    kw.setdefault("sampling", SamplingSettings(max_tokens=6))
    kw.setdefault("rows_per_shard", 20)
    config = _config(tmp_path, dataset=DatasetSpec(sql="SELECT id, prompt FROM prompt_rows",
                                                   database=str(tmp_path / "warehouse.duckdb")),
                     llm=EngineSettings(model_path=kw.pop("model"), kv_cache_blocks=64),
                     scheduler=SchedulerSettings(log_every_s=0.05), **kw)
    (tmp_path / f"{name}.json").write_text(config.model_dump_json())
    (tmp_path / f"{name}.py").write_text(
        "import pathlib\nfrom assets import build_batch_defs\nfrom batchllm_dagster import BatchJobConfig\n"
        f"defs = build_batch_defs(BatchJobConfig.model_validate_json(pathlib.Path(__file__).with_name('{name}.json')"
        ".read_text()))\n")
    monkeypatch.chdir(tmp_path)
    return config


def _rows(tmp_path, start: int, count: int, documents: int = 4) -> None:
    import duckdb
    import pyarrow as pa

    from .conftest import make_prompt_table

    table = make_prompt_table(documents=documents, questions=5).slice(0, count)
    table = table.set_column(0, "id", pa.array([f"row-{start + i}" for i in range(table.num_rows)]))
    with duckdb.connect(str(tmp_path / "warehouse.duckdb")) as con:
        con.register("incoming", table.select(["id", "prompt"]))
        con.execute("CREATE TABLE IF NOT EXISTS prompt_rows AS SELECT * FROM incoming LIMIT 0")
        con.execute("INSERT INTO prompt_rows SELECT * FROM incoming")


@pytest.mark.slow  # real vLLM through Dagster, three nights
def test_a_night_is_forecast_said_as_it_runs_and_held_to_its_budget(tmp_path, monkeypatch, capsys, tiny_model):
    import duckdb

    from batchllm_dagster.cli import main
    from engine.plan.plan_table import PlanFile

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    config = _project(tmp_path, monkeypatch, "night_one", model=tiny_model)
    _rows(tmp_path, 0, 20)
    assert main(["run", "night", "--definitions", "night_one"]) == 0
    lines = capsys.readouterr().out.splitlines()
    said = [line.split(" ", 1)[1] for line in lines if line[:2].isdigit()]  # "HH:MM:SS line"
    assert said[0].startswith("forecast: 20 rows to compute, 0 reused; no wall time until")
    start = next(i for i, line in enumerate(said) if line.endswith("starting"))
    done = next(i for i, line in enumerate(said) if ": done, 20 rows computed" in line)
    assert start < done and any(" rows (" in line and "eta" in line for line in said[start + 1:done])

    _rows(tmp_path, 100, 20)  # a second night: 20 new rows, forecast from the first night's throughput
    assert main(["run", "night", "--definitions", "night_one", "--dry-run"]) == 0
    forecast = capsys.readouterr().out
    assert "forecast: 20 rows to compute, 20 reused; about" in forecast and "starting" not in forecast

    _rows(tmp_path, 200, 5)  # a third night over a budget of a few milliseconds: refused, nothing written
    _project(tmp_path, monkeypatch, "night_budget", model=tiny_model, max_gpu_hours=1e-6)
    plan_before = config.files.plan_path.read_bytes()
    with duckdb.connect(config.output_database, read_only=True) as con:
        answers_before = con.execute("SELECT * FROM completions ORDER BY id").fetchall()
    assert main(["run", "night", "--definitions", "night_budget"]) == 1
    refused = capsys.readouterr().err
    assert "refused tonight's plan: its forecast is" in refused and "over max_gpu_hours 1e-06" in refused
    assert config.files.plan_path.read_bytes() == plan_before and PlanFile.open(config.files.plan_path)
    with duckdb.connect(config.output_database, read_only=True) as con:
        assert con.execute("SELECT * FROM completions ORDER BY id").fetchall() == answers_before


@pytest.mark.slow  # a plan and a shard run through Dagster (no vLLM: the shard stops at its lock)
def test_a_run_whose_shard_another_run_holds_waits_for_it_and_exits_0_when_it_landed(tmp_path, monkeypatch, capsys,
                                                                                       tiny_model):
    """A cron and a person run one night at once: the run that finds its shard held by the other says
    so, waits for it to land and exits 0, instead of "1 failed" (the other run stands in here: it
    holds the shard's lock, then records its materialization)."""
    import threading

    import dagster as dg

    from batchllm_dagster.cli import main
    from engine.locks import held_alone

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    config = _project(tmp_path, monkeypatch, "held", model=tiny_model)
    _rows(tmp_path, 0, 10)
    assert main(["run", "night", "--definitions", "held", "--dry-run"]) == 0
    [key] = dg.DagsterInstance.get().get_dynamic_partitions(config.names.partitions_name)
    capsys.readouterr()

    def other_run(holding):
        with holding:
            threading.Event().wait(1.5)
            dg.DagsterInstance.get().report_runless_asset_event(
                dg.AssetMaterialization(asset_key=config.names.asset_key("completions"), partition=key))

    holding = held_alone(config.files.lock_path(f"partition-{key}"), "the cron's run", f"partition {key}")
    holding.__enter__()  # taken here, so the run below finds it held
    other = threading.Thread(target=lambda: other_run(_Entered(holding)))
    other.start()
    assert main(["run", "night", "--definitions", "held", "--shards-only"]) == 0
    other.join()
    out = capsys.readouterr()
    assert f"shards ['{key}'] landed, answered by another run" in out.out
    assert "is already running (the cron's run)" in out.err


class _Entered:
    """A context manager already entered elsewhere: leaving it here releases it."""

    def __init__(self, manager):
        self.manager = manager

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.manager.__exit__(*exc)


@pytest.mark.slow  # real vLLM through Dagster, two nights
def test_the_night_after_counts_rows_at_the_answers_learned_length_and_forecasts_their_mean(tmp_path, monkeypatch,
                                                                                             tiny_model):
    """A job with a generous max_tokens (16) whose answers end at a choice's end: its first night
    learns nothing (no answers yet); the next plan reads the first night's 110 answers from the output
    table, carries their 95th percentile in the plan file to its shards (whose admission counts rows
    so) and forecasts their mean; the answers stay their own length."""
    import duckdb

    from batchllm_dagster import SamplingSettings
    from batchllm_dagster.cli import main
    from engine.plan.answer_lengths import AnswerLengths, measured_lengths
    from engine.plan.plan_table import ANSWER_LENGTHS, PlanFile

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    sampling = SamplingSettings(max_tokens=16, response_format={"choice": ["yes", "no", "not sure at all"]})
    config = _project(tmp_path, monkeypatch, "lengths", model=tiny_model, sampling=sampling, rows_per_shard=200)
    _rows(tmp_path, 0, 110, documents=22)
    assert main(["run", "night", "--definitions", "lengths"]) == 0
    assert PlanFile.open(config.files.plan_path).metadata.get(ANSWER_LENGTHS.encode()) is None
    with duckdb.connect(config.output_database, read_only=True) as con:
        tokens, stopped = zip(*con.execute("SELECT output_tokens, finish_reason = 'length' FROM completions "
                                           "WHERE status = 'ok'").fetchall())
    expected = measured_lengths(np.array(tokens), sum(stopped))
    assert len(tokens) >= 100 and expected is not None and expected.tokens < 16  # a few rows too long: errors

    with duckdb.connect(str(tmp_path / "warehouse.duckdb")) as con:  # the next night: 20 new rows, each its own
        con.execute("INSERT INTO prompt_rows SELECT 'new-' || i, 'Question ' || i || ': yes or no?' "
                    "FROM range(20) t(i)")
    assert main(["run", "night", "--definitions", "lengths"]) == 0
    plan = PlanFile.open(config.files.plan_path)
    assert AnswerLengths.of_text(plan.metadata[ANSWER_LENGTHS.encode()].decode()) == expected
    import dagster as dg

    instance = dg.DagsterInstance.get()
    [planned] = instance.fetch_materializations(config.names.asset_key("prefix_groups"), limit=1).records
    metadata = planned.event_log_entry.asset_materialization.metadata
    assert metadata["learned_answer_tokens"].value == expected.tokens
    assert metadata["forecast_output_tokens"].value == min(20 * 16, round(20 * expected.mean))
    [shard] = instance.fetch_materializations(config.names.asset_key("completions"), limit=1).records
    reason = shard.event_log_entry.asset_materialization.metadata["admission_reason"].value
    assert f"each row's output counted as {expected.tokens} output tokens" in reason

