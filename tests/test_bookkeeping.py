"""Fast unit tests of the run's bookkeeping: checkpoints, progress lines, merged stats, partitions."""

import contextlib
import re

import numpy as np
import pyarrow as pa
import pytest

from engine.plan.plan_table import prepared_batch, rows_table
from engine.plan.prefix_tree import reusable_tokens
from engine.plan.prepared import PreparedBatch
from engine.plan.tokenizing import TokenizedBatch
from engine.run.checkpoint import Checkpoint
from engine.run.progress import Progress, format_eta
from engine.run.results import RowResult, RunStats, merge_stats
from engine.settings import fingerprint


def result(i, fingerprint="fp", status="ok"):
    return RowResult(id=f"r{i}", status=status, text=f"answer {i}", output_tokens=3, row_fingerprint=fingerprint)


def test_checkpoint_writes_parts_and_reuses_only_matching_ok_rows(tmp_path):
    checkpoint = Checkpoint(tmp_path / "ckpt", pa.string(), every_rows=2, every_s=3600)
    for i in range(5):
        checkpoint.add(result(i, status="error" if i == 4 else "ok"))
    assert len(list((tmp_path / "ckpt").glob("part-*.parquet"))) == 2  # 4 rows flushed, 1 pending
    checkpoint.flush()
    assert checkpoint.written == 5 and not list((tmp_path / "ckpt").glob("*.partial"))
    expected = {"r0": "fp", "r1": "other", "r2": "fp", "r3": "fp", "r4": "fp"}
    reused = Checkpoint(tmp_path / "ckpt", pa.string()).load(expected)
    assert sorted(reused) == ["r0", "r2", "r3"]  # r1: changed fingerprint; r4: an error is retried
    assert reused["r2"].text == "answer 2"


def test_reuse_reads_ids_and_fingerprints_first_and_the_text_of_reused_rows_only(tmp_path, monkeypatch):
    """Other shards' checkpoints (after a night of failed writes, the whole job) are read by id and
    fingerprint; a file's answers only where some of its rows are reused, and the output table's
    rows (another id type: DuckDB's) count the same."""
    import pyarrow.parquet as pq

    from engine.run import checkpoint as checkpoint_module

    for shard in range(3):
        other = Checkpoint(tmp_path / f"shard-{shard}", pa.string(), every_rows=10)
        for i in range(shard * 10, shard * 10 + 10):
            other.add(result(i, status="error" if i == 11 else "ok"))
    parts = sorted(tmp_path.glob("shard-*/part-*.parquet"))
    read, read_table = [], pq.read_table

    def recording(path, columns=None, **kw):
        read.append((path.parent.name, columns))
        return read_table(path, columns=columns, **kw)

    monkeypatch.setattr(checkpoint_module.pq, "read_table", recording)
    table = pa.table({"id": pa.array(["r25"], pa.large_string()), "status": ["ok"], "text": ["from the table"],
                      "row_fingerprint": ["fp"], "settings_fingerprint": [None]})
    expected = {"r11": "fp", "r12": "fp", "r13": "other", "r25": "fp", "r99": "fp"}
    loaded = Checkpoint(tmp_path / "mine", pa.string())
    reused = loaded.load(expected, also=[table, *parts], settings_fp=None)
    assert sorted(reused) == ["r12", "r25"] and reused["r12"].text == "answer 12"
    assert reused["r25"].text == "answer 25"  # a checkpoint read after the table: the later source
    whole = [shard for shard, columns in read if columns is None]
    assert sorted(whole) == ["shard-1", "shard-2"]  # shard-0 holds none of these ids: its text is never read
    assert dict(loaded.not_reused) == {"an error before": 1, "prompt, max_tokens or response format changed": 1,
                                       "new row": 1}


def test_a_damaged_checkpoint_part_is_recomputed_not_trusted(tmp_path):
    checkpoint = Checkpoint(tmp_path / "ckpt", pa.string(), every_rows=1)
    checkpoint.add(result(0))
    (tmp_path / "ckpt" / "part-99999999999999999999.parquet").write_bytes(b"not parquet")
    assert sorted(Checkpoint(tmp_path / "ckpt", pa.string()).load({"r0": "fp"})) == ["r0"]


def test_progress_never_prints_nan(monkeypatch):
    lines = []
    progress = Progress(total_rows=100, every_s=0, sink=lines.append)
    progress.update(0, 0, 0, in_flight=5, kv_usage=0.5, preemptions=0)
    progress.started -= 10
    progress.update(50, 5000, 100, in_flight=5, kv_usage=0.9, preemptions=1)
    assert "nan" not in " ".join(lines).lower()
    assert "eta ?" in lines[0]
    assert re.search(r"50/100 rows \(50%\), 5\.0 rows/s, \d+ tok/s", lines[1]) and "eta 10s" in lines[1]
    assert format_eta(125) == "2m05s" and format_eta(float("nan")) == "?"


def test_merge_stats_adds_counts_takes_the_longest_time_and_weights_gauges_by_steps():
    a = RunStats(rows=3, ok_rows=3, prompt_tokens=30, cached_tokens=10, reused_rows=1, engine_steps=10,
                 mean_kv_usage=0.5, rows_per_step=2.0, wall_s=4.0, startup_s=1.0)
    b = RunStats(rows=2, ok_rows=1, error_rows=1, prompt_tokens=20, cached_tokens=20, reused_rows=2, engine_steps=30,
                 mean_kv_usage=0.9, rows_per_step=4.0, wall_s=6.0, startup_s=2.0)
    merged = merge_stats([a, b])
    assert (merged.rows, merged.ok_rows, merged.error_rows, merged.reused_rows) == (5, 4, 1, 3)
    assert (merged.prompt_tokens, merged.cached_tokens, merged.engine_steps) == (50, 30, 40)
    assert (merged.wall_s, merged.startup_s) == (6.0, 2.0)
    assert merged.mean_kv_usage == pytest.approx((0.5 * 10 + 0.9 * 30) / 40)
    assert merged.rows_per_step == pytest.approx((2 * 10 + 4 * 30) / 40)


def prepared_of(rows: list[list[int]], order, groups, prefix) -> PreparedBatch:
    batch = TokenizedBatch.from_rows(rows)
    return PreparedBatch(ids=[f"r{i}" for i in range(len(rows))], id_type=pa.string(), batch=batch,
                         max_tokens=np.full(len(rows), 4), errors={1: "bad"}, order=np.asarray(order),
                         group_of_row=np.asarray(groups), prefix_tokens_of_row=np.asarray(prefix), block_size=2)


def test_a_plan_table_round_trips_and_a_subset_keeps_the_plan_order():
    prepared = prepared_of([[1, 2, 3, 4, 9], [], [1, 2, 3, 4, 8], [5, 6, 7]], order=[2, 0, 3, 1], groups=[0, 2, 0, 1],
                           prefix=[4, 0, 4, 0])
    back = prepared_batch(rows_table(prepared), prepared.batch)
    assert back.ids == prepared.ids and back.errors == prepared.errors and back.block_size == 2
    assert list(back.order) == [2, 0, 3, 1] and back.batch.row(2) == [1, 2, 3, 4, 8]
    part = prepared.subset([3, 0, 2])
    assert part.ids == ["r0", "r2", "r3"] and [part.ids[i] for i in part.order] == ["r2", "r0", "r3"]
    assert part.batch.row(1) == [1, 2, 3, 4, 8] and part.errors == {}
    # r2 then r0 share two whole blocks; r3 shares nothing.
    assert reusable_tokens(prepared.batch, [2, 0, 3], block_size=2) == 4


def test_partition_sync_adds_new_keys_and_removes_stale_ones():
    import dagster as dg

    from batchllm_dagster.config import HardwarePartition
    from batchllm_dagster.partitions import shard_key, sync_partitions

    with dg.instance_for_test() as instance:
        assert sync_partitions(instance, "jobs", ["a", "b"]) == (["a", "b"], [])
        assert sync_partitions(instance, "jobs", ["b", "c"]) == (["c"], ["a"])
        assert sorted(instance.get_dynamic_partitions("jobs")) == ["b", "c"]
    a100 = HardwarePartition(name="GPU.A100-")
    assert shard_key(a100, 3, ["x", "y"]) == shard_key(a100, 3, ["y", "x"])  # same rows, same key
    assert shard_key(a100, 3, ["x"]).startswith("gpu.a100-03-")  # keys keep '.', Dagster's names do not
    assert a100.slug == "gpu_a100"


def test_a_resumable_run_on_a_fake_engine_checkpoints_from_the_first_row_not_from_start_up(tmp_path, monkeypatch):
    """run_resumable end to end without vLLM: the checkpoint's timer starts when rows start running,
    so a slow engine start-up does not make the first part hold a single row; a rerun reuses all.
    The checkpoint's clock is a fake one that only start-up moves: a slow machine cannot split the parts."""
    import time

    import engine.run.checkpoint as checkpoint_module
    from engine.jobs.resume import run_resumable
    from engine.run.stand_in import BlockAccountingEngine
    from engine.settings import EngineSettings, SamplingSettings

    rows = [[1, 2, 3, 4, 5, 6, 7, i] for i in range(12)]
    prepared = prepared_of(rows, order=list(range(12)), groups=[0] * 12, prefix=[6] * 12)
    prepared.errors.clear()

    opened = []

    clock = [0.0]
    monkeypatch.setattr(checkpoint_module.time, "monotonic", lambda: clock[0])

    @contextlib.contextmanager
    def slow_starting_engine(settings):  # the owner of the engine: opens it, and closes it
        time.sleep(0.6)  # the run's start-up time (measured on the wall clock)
        clock[0] += 0.6  # longer than the checkpoint interval
        engine = BlockAccountingEngine(num_blocks=64, block_size=2)
        opened.append(engine)
        yield engine
        engine.closed_by_owner = True

    lines = []
    outcome = run_resumable(prepared, EngineSettings(model_path="unused", block_size=8), SamplingSettings(max_tokens=4),
                            tmp_path / "ckpt", checkpoint_every_s=0.5, engine_opener=slow_starting_engine,
                            progress_sink=lines.append)
    assert sorted(r.id for r in outcome.results) == sorted(prepared.ids)
    assert outcome.stats.ok_rows == 12 and outcome.stats.startup_s >= 0.6
    assert outcome.stats.wall_s < 0.6  # the rows' run alone: the engine's start is startup_s's (shard sizing reads it)
    assert len(opened) == 1 and opened[0].closed_by_owner  # the run left the engine's context; its owner closed it
    parts = sorted((tmp_path / "ckpt").glob("part-*.parquet"))
    assert len(parts) == 1  # all rows finished within the first interval after start-up
    again = run_resumable(prepared, EngineSettings(model_path="unused", block_size=8), SamplingSettings(max_tokens=4),
                          tmp_path / "ckpt", engine_opener=slow_starting_engine, progress_sink=lines.append)
    assert again.stats.reused_rows == 12 and again.engine is None and len(opened) == 1  # nothing to run: no engine
    assert "reusing 12 of 12 rows (12 from the checkpoint" in lines[-1]


def test_a_changed_chat_template_or_snapshot_makes_the_plan_stale(tmp_path, tiny_model):
    import json
    import shutil

    import pyarrow.parquet as pq

    from batchllm_dagster.config import BatchJobConfig, DatasetSpec
    from engine.plan.plan_stamp import stale_reasons
    from engine.settings import EngineSettings

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = BatchJobConfig(name="j", dataset=DatasetSpec(parquet=str(tmp_path / "p.parquet")),
                            llm=EngineSettings(model_path=str(model)), output_database=str(tmp_path / "o.duckdb"),
                            storage_dir=str(tmp_path / "jobs"))
    config.files.prompts_path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"id": [1], "prompt": ["a"]}), config.files.prompts_path)
    stamp = config.plan_stamp(config.engine_settings())
    recorded = {k.encode(): v.encode() for k, v in stamp.items()}
    assert stale_reasons(recorded, config.plan_stamp(config.engine_settings())) == []

    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{{ messages[0]['content'] }}"
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    assert stale_reasons(recorded, config.plan_stamp(config.engine_settings())) == [
        "the model, tokenizer or chat template"
    ]

    pq.write_table(pa.table({"id": [1], "prompt": ["b"]}), config.files.prompts_path)
    assert "the prompt snapshot" in stale_reasons(recorded, config.plan_stamp(config.engine_settings()))
    assert stale_reasons(None, stamp)  # a plan without a stamp is stale too


def test_a_model_rewritten_in_place_reruns_every_row_and_says_why(tmp_path):
    """The answer fingerprint holds the model's content, not its path: weights re-exported to the
    same folder (a nightly fine-tune) make every row run again, and the run says why."""
    from engine.jobs.resume import run_resumable
    from engine.run.checkpoint import NEW_ROW, ROW_CHANGED, SETTINGS_CHANGED
    from engine.run.stand_in import BlockAccountingEngine
    from engine.settings import EngineSettings, SamplingSettings

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"weights of night 1")

    rows = [[1, 2, 3, 4, 5, 6, 7, i] for i in range(12)]
    settings, sampling = EngineSettings(model_path=str(model), block_size=8), SamplingSettings(max_tokens=4)

    def run(prepared):
        lines = []
        outcome = run_resumable(
            prepared,
            settings,
            sampling,
            tmp_path / "ckpt",
            engine_opener=lambda *a: BlockAccountingEngine(num_blocks=64, block_size=2),
            progress_sink=lines.append,
        )
        return outcome, lines[0]

    prepared = prepared_of(rows, order=list(range(12)), groups=[0] * 12, prefix=[6] * 12)
    prepared.errors.clear()
    first, _ = run(prepared)
    assert first.not_reused == {NEW_ROW: 12}
    again, line = run(prepared)
    assert again.stats.reused_rows == 12 and again.not_reused == {}

    (model / "model.safetensors").write_bytes(b"weights of night 2")  # same path, new weights
    changed, line = run(prepared)
    assert changed.stats.reused_rows == 0 and changed.stats.ok_rows == 12
    assert changed.not_reused == {SETTINGS_CHANGED: 12}
    assert f"12 {SETTINGS_CHANGED}" in line

    edited = prepared_of(
        rows[:11] + [[1, 2, 3, 4, 5, 6, 7, 99]], order=list(range(12)), groups=[0] * 12, prefix=[6] * 12
    )
    edited.errors.clear()
    outcome, _ = run(edited)
    assert outcome.stats.reused_rows == 11 and outcome.not_reused == {ROW_CHANGED: 1}
    assert {r.settings_fingerprint for r in outcome.results} == {changed.results[0].settings_fingerprint}


def _twelve_rows():
    rows = [[1, 2, 3, 4, 5, 6, 7, i] for i in range(12)]
    prepared = prepared_of(rows, order=list(range(12)), groups=[0] * 12, prefix=[6] * 12)
    prepared.errors.clear()
    return prepared


def test_rows_finished_before_an_engine_error_are_in_the_checkpoint(tmp_path):
    """Nothing finished is lost: the last part is written whatever ends the run (a vLLM error, a stall,
    a terminate), not only when it ends well."""
    from engine.jobs.resume import run_resumable
    from engine.run.stand_in import BlockAccountingEngine
    from engine.settings import EngineSettings, SamplingSettings

    class FailingEngine(BlockAccountingEngine):  # vLLM dies after some rows finished
        finished = 0

        def step(self):
            if self.finished >= 5:
                raise RuntimeError("engine core died")
            report = super().step()
            self.finished += len(report.finished)
            return report

    prepared = _twelve_rows()
    prepared.max_tokens[:] = np.arange(1, 13)  # one row finishes per step
    with pytest.raises(RuntimeError, match="engine core died"):
        run_resumable(prepared, EngineSettings(model_path="unused", block_size=8), SamplingSettings(max_tokens=12),
                      tmp_path / "ckpt", checkpoint_every_rows=1000, checkpoint_every_s=3600,
                      engine_opener=lambda *a: contextlib.nullcontext(FailingEngine(num_blocks=64, block_size=2)),
                      progress_sink=lambda line: None)
    import pyarrow.parquet as pq

    kept = pa.concat_tables([pq.read_table(p) for p in (tmp_path / "ckpt").glob("part-*.parquet")])
    assert sorted(kept.column("id").to_pylist()) == sorted(prepared.ids[:5])


def test_a_finished_row_is_written_on_time_while_no_other_row_finishes(tmp_path, monkeypatch):
    """The checkpoint's timed write runs after every engine step, not only when a row finishes: one
    row done and the next minutes later is on disk meanwhile (an engine step here takes a minute of
    a fake clock)."""
    import engine.run.checkpoint as checkpoint_module
    from engine.jobs.resume import run_resumable
    from engine.run.stand_in import BlockAccountingEngine
    from engine.settings import EngineSettings, SamplingSettings

    clock = [0.0]
    monkeypatch.setattr(checkpoint_module.time, "monotonic", lambda: clock[0])
    parts_seen = []
    folder = tmp_path / "ckpt"

    class SlowSteps(BlockAccountingEngine):
        def step(self):
            parts_seen.append(len(list(folder.glob("part-*.parquet"))))
            clock[0] += 60
            return super().step()

    prepared = _twelve_rows()
    prepared.max_tokens[:] = 40
    prepared.max_tokens[0] = 1  # done in the first step; the others run 40 steps (40 minutes)
    run_resumable(prepared, EngineSettings(model_path="unused", block_size=8), SamplingSettings(max_tokens=40),
                  folder, checkpoint_every_rows=1000, checkpoint_every_s=300,
                  engine_opener=lambda *a: contextlib.nullcontext(SlowSteps(num_blocks=256, block_size=2)),
                  progress_sink=lambda line: None)
    assert parts_seen[:2] == [0, 0] and parts_seen[10] == 1  # row 0 written within 5 minutes, long before the rest


def test_every_setting_that_shapes_a_plan_makes_it_stale_and_changes_the_plan_asset_code_version():
    """One list of the settings that shape a plan (``PlanShaping``): each of them, changed, changes
    the stamp a plan records and the plan asset's code version; a sampling setting that does not
    shape the plan changes neither. The stamp's value is pinned: a changed formula would make every
    plan on disk stale at once."""
    from batchllm_dagster.config import BatchJobConfig, DatasetSpec
    from engine.plan.plan_stamp import PlanShaping
    from engine.settings import EngineSettings, SamplingSettings, SchedulerSettings
    from engine.table.dataset import Columns

    llm = EngineSettings(model_path="/m", max_model_len=512)
    base = PlanShaping.of(llm, SamplingSettings(max_tokens=8), SchedulerSettings(), Columns())
    assert base.fingerprint() == fingerprint(32, 512, 8, 2, Columns())  # the formula plans on disk were stamped with
    changed = {
        "block_size": PlanShaping.of(llm.model_copy(update={"block_size": 16}), SamplingSettings(max_tokens=8),
                                     SchedulerSettings(), Columns()),
        "context_len": PlanShaping.of(llm.model_copy(update={"max_model_len": 256}), SamplingSettings(max_tokens=8),
                                      SchedulerSettings(), Columns()),
        "max_tokens": PlanShaping.of(llm, SamplingSettings(max_tokens=9), SchedulerSettings(), Columns()),
        "min_group_rows": PlanShaping.of(llm, SamplingSettings(max_tokens=8), SchedulerSettings(min_group_rows=3),
                                         Columns()),
        "columns": PlanShaping.of(llm, SamplingSettings(max_tokens=8), SchedulerSettings(), Columns(prompt="text")),
        "response_format": PlanShaping.of(llm, SamplingSettings(max_tokens=8, response_format={"choice": ["a", "b"]}),
                                          SchedulerSettings(), Columns()),
        "score_choices": PlanShaping.of(llm, SamplingSettings(max_tokens=8, score_choices=True), SchedulerSettings(),
                                        Columns()),
    }
    assert set(changed) == {f for f in PlanShaping.__dataclass_fields__}
    assert all(s.fingerprint() != base.fingerprint() for s in changed.values())

    def job(**update):
        fields = {"name": "j", "dataset": DatasetSpec(parquet="p.parquet"), "llm": llm, "output_database": "o.duckdb",
                  "storage_dir": "jobs", "sampling": SamplingSettings(max_tokens=8), **update}
        return BatchJobConfig(**fields)

    version = job().plan_code_version()
    assert job(scheduler=SchedulerSettings(min_group_rows=3)).plan_code_version() != version
    assert job(sampling=SamplingSettings(max_tokens=9)).plan_code_version() != version
    assert job(dataset=DatasetSpec(parquet="p.parquet", prompt_column="text")).plan_code_version() != version
    assert job(sampling=SamplingSettings(max_tokens=8, temperature=0.7)).plan_code_version() == version
    choice = SamplingSettings(max_tokens=8, response_format={"choice": ["a", "b"]})
    assert job(sampling=choice).plan_code_version() != version
    scored = SamplingSettings(max_tokens=8, response_format={"choice": ["a", "b"]}, score_choices=True)
    assert job(sampling=scored).plan_code_version() != job(sampling=choice).plan_code_version()


def test_a_lock_wait_past_its_timeout_fails_naming_the_holder(tmp_path):
    import threading

    from engine.locks import Busy, locked

    path = tmp_path / "plan.lock"
    with locked(path, holder="a plan being made (run abc, pid 7)"):
        with pytest.raises(Busy, match=r"waited 0.3 s for the plan lock, held by a plan being made \(run abc, pid 7\)"):
            with locked(path, shared=True, timeout_s=0.3, what="the plan lock"):
                pass
    with locked(path, shared=True, timeout_s=0.3):  # released: taken at once, and shared by readers
        with locked(path, shared=True, timeout_s=0.3):
            pass
    # A waiter gets the lock as soon as the holder lets go.
    got = threading.Event()

    def wait_for_it():
        with locked(path, timeout_s=5):
            got.set()

    with locked(path, holder="holder"):
        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        assert not got.wait(0.3)
    waiter.join(5)
    assert got.is_set()


def test_a_staging_file_a_crash_left_is_removed_by_the_next_writer_of_its_target(tmp_path):
    """An hour-old ``.NAME.PID.partial`` of a process that is gone is a crash's leftover; a fresh one,
    or one of a live process, may still be written (another container on a shared volume): kept."""
    import os
    import time

    from engine.atomic import LEFTOVER_AGE_S, write_text

    target = tmp_path / "plan.parquet"
    dead = subprocess_pid_that_has_exited()
    old, fresh, alive = (tmp_path / f".plan.parquet.{pid}.partial" for pid in (dead, dead + 1, os.getppid()))
    for path in (old, fresh, alive):
        path.write_text("half a file")
    long_ago = time.time() - LEFTOVER_AGE_S - 60
    os.utime(old, (long_ago, long_ago))
    os.utime(alive, (long_ago, long_ago))
    other_target = tmp_path / ".other.parquet.1.partial"
    other_target.write_text("x")
    write_text("whole", target)
    assert target.read_text() == "whole"
    assert not old.exists() and fresh.exists() and alive.exists() and other_target.exists()


def subprocess_pid_that_has_exited() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_max_tokens_that_changes_no_rows_budget_reruns_nothing_and_older_answers_are_reused(tmp_path, tiny_model):
    """Lowering ``max_tokens`` below a choice's length leaves every choice row's budget where its
    longest choice puts it: no answer can change, and none is computed again (it reran every row:
    "model or answer settings changed"). Answers written under the fingerprint before this change
    (typed ``max_tokens`` in the settings) are reused too, never recomputed for it."""
    from engine.jobs.resume import run_resumable
    from engine.machine import current_platform, vllm_version
    from engine.plan.prepared import prepare_batch
    from engine.plan.tokenizing import load_tokenizer
    from engine.response_format import ResponseFormat
    from engine.run.checkpoint import row_fingerprints, settings_fingerprints
    from engine.run.stand_in import BlockAccountingEngine
    from engine.settings import EngineSettings, SamplingSettings

    table = pa.table({"id": [f"r{i}" for i in range(6)], "prompt": [f"Review {i}: fine" for i in range(6)]})
    settings = EngineSettings(model_path=tiny_model, block_size=8)
    labels = ResponseFormat(choice=["positive", "negative"])

    class Labels(BlockAccountingEngine):  # answers a valid label, ended by the model (as vLLM's grammar ends it)
        def step(self):
            report = super().step()
            for finished in report.finished:
                finished.text, finished.finish_reason = "positive", "stop"
            return report

    def run(max_tokens, folder):
        sampling = SamplingSettings(max_tokens=max_tokens, response_format=labels)
        prepared = prepare_batch(table, load_tokenizer(tiny_model), settings, sampling)
        outcome = run_resumable(prepared, settings, sampling, tmp_path / folder,
                                engine_opener=lambda *a: Labels(num_blocks=64, block_size=8))
        return prepared, sampling, outcome

    prepared, sampling, first = run(4, "ckpt")  # below the longest choice: every budget is raised to 9
    assert first.stats.reused_rows == 0
    _, _, lower = run(2, "ckpt")  # lower still: the same budgets, the same answers
    assert lower.stats.reused_rows == 6 and lower.not_reused == {}
    _, _, higher = run(16, "ckpt")  # a budget that does change: every row again
    assert higher.stats.reused_rows == 0

    # An answer written before: its row fingerprint made of the settings with the typed max_tokens.
    old = row_fingerprints(prepared, settings_fingerprints(settings.for_platform(current_platform()), sampling,
                                                           vllm_version())[1])
    import pyarrow.parquet as pq

    written = pq.read_table(sorted((tmp_path / "ckpt").glob("part-*.parquet"))[0])
    written = written.set_column(written.schema.get_field_index("row_fingerprint"), "row_fingerprint",
                                 pa.array([old[prepared.ids.index(i)] for i in written["id"].to_pylist()]))
    (tmp_path / "old").mkdir()
    pq.write_table(written, tmp_path / "old" / "part-0.parquet")
    _, _, upgraded = run(4, "old")
    assert upgraded.stats.reused_rows == written.num_rows


def test_a_built_in_model_prepared_on_first_use_is_announced_with_where_it_goes(tmp_path, monkeypatch):
    from engine import models

    monkeypatch.setenv("BATCHLLM_CACHE_DIR", str(tmp_path))
    notice = models.preparation_notice("smollm2")
    assert f"into {tmp_path / 'models' / 'smollm2'}" in notice and "about 0.5 GB" in notice
    assert "batchllm prepare-model" in notice
    (tmp_path / "models" / "smollm2").mkdir(parents=True)
    models._mark_prepared(tmp_path / "models" / "smollm2", name="x")
    assert models.preparation_notice("smollm2") is None  # prepared: nothing to say
    assert models.preparation_notice(str(tmp_path)) is None  # a checkpoint of one's own: nothing to prepare
