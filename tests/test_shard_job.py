"""``ShardJob``: one shard end to end on an engine it is given, through an answer store; unit tests
on the block-accounting stand-in (real vLLM end to end: the Dagster and CLI tests)."""

import contextlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from engine.jobs.shard_job import JobCheckpoints, ShardJob, ShardWrite
from engine.plan.plan_table import PlannedShard
from engine.plan.prepared import PreparedBatch
from engine.plan.tokenizing import TokenizedBatch
from engine.run.results import results_to_table
from engine.run.stand_in import BlockAccountingEngine
from engine.settings import EngineSettings, SamplingSettings, SchedulerSettings
from engine.table.prompt_snapshot import CONTENT_KEY, KEY_TYPE

STAMP = {b"batchllm.model": b"m1", b"batchllm.settings": b"x1"}
IDS = ["a", "b", "c", "d"]


class MemoryStore:
    """An answer store in memory: answers by id, with the key that wrote them."""

    def __init__(self):
        self.answers: dict[str, tuple[str, dict]] = {}
        self.writes: list[tuple[str, list, bool]] = []

    def stored(self, ids: pa.Array) -> list:
        rows = [row for i in ids.to_pylist() if (held := self.answers.get(i)) for row in [held[1]]]
        return [pa.Table.from_pylist(rows)] if rows else []

    def write(self, shard, results, whole, answer_keys):
        table = results_to_table(results, shard.prepared.id_type)
        for row in table.to_pylist():
            self.answers[row["id"]] = (shard.key, row)
        self.writes.append((shard.key, sorted(table.column("id").to_pylist()), whole))
        return ShardWrite(table, sum(key == shard.key for key, _ in self.answers.values()), table.num_rows)

    def answered_ids(self, ids, keys):
        return {i for i in ids.to_pylist() if i in self.answers and self.answers[i][0] in keys}


def shard(key="K") -> PlannedShard:
    rows = [[1, 2, 3, 4, 5, 6, 7, 10 + i] for i in range(len(IDS))]
    prepared = PreparedBatch(ids=list(IDS), id_type=pa.string(), batch=TokenizedBatch.from_rows(rows),
                             max_tokens=np.full(len(rows), 4), errors={}, order=np.arange(len(rows)),
                             group_of_row=np.zeros(len(rows), dtype=np.int64),
                             prefix_tokens_of_row=np.full(len(rows), 6), block_size=2)
    identity = pa.table({"id": IDS, CONTENT_KEY: pa.array([i.to_bytes(16, "big") for i in range(4)], KEY_TYPE),
                         "max_tokens": [4] * 4, "response_format": pa.nulls(4, pa.string())})
    return PlannedShard(key, 0, prepared, identity.replace_schema_metadata(STAMP))


def plan_on_disk(path, identity: pa.Table, keys: list[str]):
    """The plan file as a write reads it: the rows' answer identity and partition keys, stamped."""
    pq.write_table(identity.append_column("partition_key", pa.array(keys)).replace_schema_metadata(STAMP), path)


def job(tmp_path, store, engines: list) -> ShardJob:
    @contextlib.contextmanager
    def opener(settings):
        engines.append(BlockAccountingEngine(num_blocks=64, block_size=2))
        yield engines[-1]

    checkpoints = JobCheckpoints(tmp_path / "checkpoints")
    planned = shard()
    made = ShardJob(planned, EngineSettings(model_path="unused", block_size=8), SamplingSettings(max_tokens=4),
                    SchedulerSettings(), store, checkpoints, plan_path=tmp_path / "plan.parquet")
    made.opener = opener
    return made


def test_a_shard_runs_writes_whole_and_a_rerun_reuses_every_answer_from_the_store(tmp_path):
    store, engines = MemoryStore(), []
    first = job(tmp_path, store, engines)
    plan_on_disk(tmp_path / "plan.parquet", first.shard.identity, ["K"] * 4)
    outcome = first.run(engine_opener=first.opener)
    assert sorted(r.id for r in outcome.results) == IDS and outcome.stats.rows == 4
    written = first.write(outcome.results)
    assert store.writes == [("K", IDS, True)] and written.rows_now == 4 and not len(written.superseded)
    assert {row["shard"] for _, row in store.answers.values()} == {0}  # the plan's shard number
    assert not first.checkpoint.exists()  # the store holds every row: the checkpoint is gone
    again = job(tmp_path, store, engines)
    rerun = again.run(engine_opener=again.opener)
    assert rerun.stats.reused_rows == 4 and rerun.engine is None and len(engines) == 1  # vLLM never started


def test_rows_a_newer_plan_took_are_not_written_and_the_checkpoint_stays_for_it(tmp_path):
    store, engines = MemoryStore(), []
    ran = job(tmp_path, store, engines)
    outcome = ran.run(engine_opener=ran.opener)
    # Meanwhile a newer plan: b moved to key L, c edited (another content key), d deleted.
    identity = ran.shard.identity.to_pylist()
    identity[2][CONTENT_KEY] = (99).to_bytes(16, "big")
    newer = pa.Table.from_pylist(identity[:3], schema=ran.shard.identity.schema)
    plan_on_disk(tmp_path / "plan.parquet", newer, ["K", "L", "K"])
    written = ran.write(outcome.results)
    assert sorted(written.superseded.to_pylist()) == ["b", "c", "d"]
    assert store.writes == [("K", ["a"], False)]  # only a, by id: the partition's other rows may be fresh
    assert ran.checkpoint.exists()  # the newer plan's shards reuse b's answer from here


def test_a_removed_keys_checkpoint_goes_once_its_answers_are_stored_under_a_live_key(tmp_path):
    store, engines = MemoryStore(), []
    ran = job(tmp_path, store, engines)
    outcome = ran.run(engine_opener=ran.opener)
    old = JobCheckpoints(tmp_path / "checkpoints").of("OLD")
    old.mkdir(parents=True)
    pq.write_table(results_to_table(outcome.results[:1], pa.string()), old / "part-0.parquet")
    assert old / "part-0.parquet" in ran.job_checkpoints.others("K")  # reused by row fingerprint
    plan_on_disk(tmp_path / "plan.parquet", ran.shard.identity, ["K"] * 4)
    ran.write(outcome.results)  # stores every row under K, a live key: OLD serves nothing now
    assert not old.exists()


def test_without_a_plan_on_disk_at_write_time_nothing_is_written(tmp_path):
    store, engines = MemoryStore(), []
    ran = job(tmp_path, store, engines)
    outcome = ran.run(engine_opener=ran.opener)
    written = ran.write(outcome.results)  # no plan.parquet: it was removed while the shard ran
    assert sorted(written.superseded.to_pylist()) == IDS and store.writes == [("K", [], False)]


def test_a_runs_shards_name_a_key_the_plan_lacks_before_a_stale_stamp_checked_once_per_plan(tmp_path):
    """``PlanFile.shards``: a key the plan does not hold is refused first (the run was queued for an
    older plan: the more useful message), then a stamp that no longer holds, whatever the keys."""
    import pytest

    from engine.plan.plan_stamp import MODEL, SETTINGS
    from engine.plan.plan_table import NotInPlan, PlanFile, StalePlan

    plan_on_disk(tmp_path / "plan.parquet", shard().identity, ["K"] * 4)
    plan = PlanFile.open(tmp_path / "plan.parquet")
    now = {MODEL: "m2", SETTINGS: "x1"}  # another model since the plan was made
    with pytest.raises(NotInPlan) as missing:
        plan.shards(["K", "gone"], now)
    assert missing.value.key == "gone"
    with pytest.raises(StalePlan) as stale:
        plan.shards(["K"], now)
    assert stale.value.reasons == ["the model, tokenizer or chat template"]


def test_a_shard_job_has_one_checkpoint_folder_its_jobs_for_its_key_or_its_own(tmp_path):
    import pytest

    checkpoints = JobCheckpoints(tmp_path / "checkpoints")
    settings, sampling = EngineSettings(model_path="unused", block_size=8), SamplingSettings(max_tokens=4)
    made = ShardJob(shard("K"), settings, sampling, SchedulerSettings(), MemoryStore(), checkpoints)
    assert made.checkpoint == checkpoints.of("K")
    alone = ShardJob(shard("K"), settings, sampling, SchedulerSettings(), MemoryStore(), checkpoint=tmp_path / "own")
    assert alone.checkpoint == tmp_path / "own" and alone.job_checkpoints is None
    for neither_or_both in ({}, {"job_checkpoints": checkpoints, "checkpoint": tmp_path / "own"}):
        with pytest.raises(ValueError, match="either its job's checkpoints or a checkpoint folder"):
            ShardJob(shard("K"), settings, sampling, SchedulerSettings(), MemoryStore(), **neither_or_both)
