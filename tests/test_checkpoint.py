"""The checkpoint: finished rows kept as they finish, reused only where their fingerprint holds."""

import contextlib

import numpy as np
import pyarrow as pa
import pytest

from engine.run.checkpoint import Checkpoint
from engine.run.results import RowResult

from .conftest import prepared_of


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
