"""The plan step made on disk (``PlanJob``: DuckDB sorts, rows from the token cache, duplicates by a
query) writes the plan the prefix tree (the test oracle) makes of the same rows' token ids: every
row's run position, group, prefix, budget, error, format, duplicate set, shard and partition key,
the same groups table and summary, on a first night and on a night after edits that keeps the
previous night's shards."""

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from engine.jobs.plan_job import PlanJob, StoredAnswers, plan_summary
from engine.plan.answer_keys import answer_key
from engine.plan.tokenizing import load_tokenizer, tokenize_rows
from engine.settings import EngineSettings, SamplingSettings, SchedulerSettings
from engine.table.dataset import Columns
from engine.table.prompt_snapshot import CONTENT_KEY, content_keys

from .oracle.planned import planned_by_tree
from .oracle.shards import assign_shards
from .test_plan_from_token_cache import table_of


def _key(shard: int, ids: list) -> str:
    """A partition key that depends on the shard's ids in run order, as a job's does."""
    return f"s{shard}-" + hashlib.sha256("\n".join(map(str, ids)).encode()).hexdigest()[:8]


class Naming:
    """A job's shard naming (``ShardNaming``) with a fixed count and ``_key``'s keys."""

    def __init__(self, count: int):
        self.shards = count

    def count(self, rows: int) -> int:
        return self.shards

    def gathered(self, rows_to_run: int, total_rows: int, kept: set[int]) -> list[int]:
        free = (n for n in range(len(kept) + rows_to_run + 1) if n not in kept)
        return [next(free) for _ in range(-(-rows_to_run // -(-total_rows // self.shards)))]  # as few as they need

    def key(self, shard: int, ids: list) -> str:
        return _key(shard, ids)

    def keeps(self, shard: int, key: str) -> bool:
        return True

    def hardware(self, shard: int) -> str:
        return "cpu"


def _night(seed: int, n: int) -> pa.Table:
    """``table_of``'s rows, some that cannot run besides its empty ones: a budget of 0, a prompt
    longer than the context."""
    table = table_of(seed, n)
    prompts, budgets = table["prompt"].to_pylist(), table["max_tokens"].to_pylist()
    for i in range(0, n, 37):
        budgets[i] = 0
    for i in range(5, n, 53):
        prompts[i] = "far too long " * 200
    table = table.set_column(table.schema.get_field_index("prompt"), "prompt", pa.array(prompts, pa.string()))
    table = table.set_column(table.schema.get_field_index("max_tokens"), "max_tokens", pa.array(budgets, pa.int64()))
    return table.set_column(table.schema.get_field_index(CONTENT_KEY), CONTENT_KEY,
                            content_keys(table["prompt"].combine_chunks(), table["messages"].combine_chunks(), n))


def _previous_shards(path, ids: pa.ChunkedArray) -> np.ndarray | None:
    """Each of ``ids``' shard in the plan on disk (-1 where it has no such id): what a night keeps
    (the step finds them by a join in its database)."""
    if not path.exists():
        return None
    last = pq.read_table(path, columns=["id", "shard"])
    if last.schema.field("id").type != ids.type:
        return None
    position = pc.index_in(ids, value_set=last.column("id"))
    return pc.fill_null(pc.take(last.column("shard"), position), -1).to_numpy()


def _expected(job: PlanJob, meta: pa.Table, previous: np.ndarray | None,
              shards_count: int) -> tuple[dict, pa.Table, dict, bool]:
    """The plan file's rows by id, the groups table and the summary, by the prefix tree, and whether
    its shards differ from a fresh cut (the previous night's kept)."""
    snapshot = pq.read_table(job.snapshot, columns=["prompt", "messages"])
    rows = tokenize_rows(load_tokenizer(job.settings.model_path), snapshot["prompt"].to_pylist(),
                         snapshot["messages"].to_pylist())
    planned = planned_by_tree(meta, rows, job.settings, job.sampling, job.columns, job.scheduler)
    plan = planned.plan
    shards = assign_shards(plan, shards_count, previous=previous)
    ids = meta.column("id").to_pylist()
    in_order = [int(r) for r in plan.order]
    keys = [_key(s, [ids[r] for r in in_order if shards.shard_of_row[r] == s]) for s in range(shards_count)]
    position = np.empty(len(ids), dtype=np.int64)
    position[plan.order] = np.arange(len(ids))
    formats = {i: f.to_text() for i, f in planned.response_formats.items()}
    by_id = {ids[r]: {"position": int(position[r]), "group": int(plan.group_of_row[r]),
                      "prefix_tokens": int(plan.group_prefix_tokens[plan.group_of_row[r]]),
                      "max_tokens": int(planned.max_tokens[r]), "error": planned.errors.get(r),
                      "response_format": formats.get(r), "duplicate_set": int(planned.duplicate_set[r]),
                      "shard": int(shards.shard_of_row[r]), "partition_key": keys[shards.shard_of_row[r]]}
             for r in range(len(ids))}
    first_rows = plan.order[plan.group_starts()[:-1]]
    shard = shards.shard_of_row[first_rows]
    groups = pa.table({
        "group": np.arange(plan.num_groups), "shard": shard, "partition_key": [keys[s] for s in shard],
        "hardware": ["cpu"] * plan.num_groups, "rows": plan.group_sizes, "prefix_tokens": plan.group_prefix_tokens,
        **{name: np.bincount(plan.group_of_row, weights=values, minlength=plan.num_groups).astype(np.int64)
           for name, values in (("prompt_tokens", plan.lengths), ("estimated_prefill_tokens", plan.row_unique_tokens),
                                ("estimated_decode_tokens", plan.decode_tokens))},
        "first_id": [str(ids[r]) for r in first_rows]})
    summary = {**plan_summary(planned),
               "shards": sum(1 for s in range(shards_count) if (shards.shard_of_row == s).any()),
               "split_groups": shards.split_groups}
    cut_afresh = not np.array_equal(shards.shard_of_row, assign_shards(plan, shards_count).shard_of_row)
    return by_id, groups, summary, cut_afresh


# 16: groups larger than a shard's share, cut; integer ids besides text ones (the ids come back from DuckDB)
@pytest.mark.parametrize(("seed", "shards", "int_ids"), [(0, 5, False), (1, 16, False), (2, 5, True)])
def test_the_plan_on_disk_is_the_plan_in_memory_on_a_first_night_and_after_edits(tmp_path, tiny_model, seed, shards,
                                                                                 int_ids):
    settings = EngineSettings(model_path=tiny_model, block_size=8, max_model_len=256)
    job = PlanJob(tmp_path / "prompts.parquet", tmp_path / "plan.parquet", tmp_path / "cache", settings,
                  SamplingSettings(max_tokens=5), SchedulerSettings(min_group_rows=2), Columns(), print)
    first = _night(seed, 300)
    new = _night(seed + 10, 20)
    new = new.set_column(0, "id", pa.array([f"new{i}" for i in range(20)]))
    if int_ids:
        first = first.set_column(0, "id", pa.array(range(300), pa.int64()))
        new = new.set_column(0, "id", pa.array(range(1000, 1020), pa.int64()))
    edited = pa.concat_tables([first.slice(10), new])  # rows gone, rows new: shards kept
    for night, table in enumerate([first, edited]):
        pq.write_table(table, job.snapshot)
        meta = pq.read_table(job.snapshot).drop_columns(["prompt", "messages"])
        previous = _previous_shards(job.plan_path, meta.column("id"))
        with job.plan(Naming(shards), print) as made:
            job.write(made, f"run-{night}")
            groups = made.groups_table(Naming(shards))
            summary = made.summary()
        assert not list(tmp_path.glob(".plan_work*"))  # the plan's database is gone with the block
        by_id, expected_groups, expected_summary, kept = _expected(job, meta, previous, shards)

        written = pq.read_table(job.plan_path)
        assert written.schema.field("id").type == meta.schema.field("id").type
        got = {row.pop("id"): row for row in written.drop_columns([CONTENT_KEY]).to_pylist()}
        assert got == by_id
        assert written.column(CONTENT_KEY).to_pylist() == [
            meta.column(CONTENT_KEY)[meta.column("id").to_pylist().index(i)].as_py() for i in written["id"].to_pylist()]
        assert groups.to_pylist() == expected_groups.to_pylist()
        assert {k: v for k, v in summary.items() if not k.endswith("_s")} == {
            k: v for k, v in expected_summary.items() if not k.endswith("_s")} | {
            "token_cache_rows": summary["token_cache_rows"], "tokenized_rows": summary["tokenized_rows"],
            "settled_rows": 0, "rows_to_run": len(meta), "shards_to_run": expected_summary["shards"]}
        assert summary["error_rows"] > 10 and summary["duplicate_rows"] > 0 and summary["shared_groups"] > 3
        assert (summary["split_groups"] > 0) == (shards == 16)  # 16 shards: cut afresh each night, groups split
    # 5 shards: the second night's are the first night's where groups stayed whole, not a fresh cut.
    assert kept == (shards == 5)


def test_a_plan_out_of_memory_says_where_and_what_it_needs_and_leaves_the_last_plan(tmp_path, tiny_model,
                                                                                  monkeypatch):
    """DuckDB out of its memory (or of disk: the same words) ends the step with where the plan's
    database was and what a plan needs there, not a bare DuckDB error; the plan on disk is untouched
    and no scratch folder is left."""
    import engine.plan.plan_database as plan_database
    import engine.plan.sorted_plan as sorted_plan
    import engine.table.dataset as dataset

    settings = EngineSettings(model_path=tiny_model, block_size=8, max_model_len=256)
    job = PlanJob(tmp_path / "prompts.parquet", tmp_path / "plan.parquet", tmp_path / "cache", settings,
                  SamplingSettings(max_tokens=5), SchedulerSettings(min_group_rows=2), Columns(), print)
    pq.write_table(_night(0, 300), job.snapshot)
    with job.plan(Naming(2), print) as made:
        job.write(made, "run-0")
    before = job.plan_path.read_bytes()
    monkeypatch.setattr(sorted_plan, "PLAN_MEMORY_MIB", 1)
    monkeypatch.setattr(dataset, "DUCKDB_MEMORY_PER_THREAD_MIB", 0)
    with pytest.raises(plan_database.PlanResourcesError, match=r"ran out of memory: .*free disk per million rows"):
        with job.plan(Naming(2), print) as made:
            job.write(made, "run-1")
    assert job.plan_path.read_bytes() == before and not list(tmp_path.glob(".plan_work*"))


def test_a_snapshot_replaced_while_the_plan_reads_it_stops_the_plan_loudly(tmp_path, tiny_model, monkeypatch):
    """The step reads the snapshot more than once (its keys for the lookup, its ids into the plan's
    database): one replaced between the reads is refused by name, not planned from two snapshots."""
    import engine.plan.plan_database as plan_database
    from engine.table.dataset import DatasetError

    settings = EngineSettings(model_path=tiny_model, block_size=8, max_model_len=256)
    job = PlanJob(tmp_path / "prompts.parquet", tmp_path / "plan.parquet", tmp_path / "cache", settings,
                  SamplingSettings(max_tokens=5), SchedulerSettings(min_group_rows=2), Columns(), print)
    night = _night(0, 60)
    pq.write_table(night, job.snapshot)
    load_chains = plan_database.PlanDatabase.load_chains

    def replaced_meanwhile(self, chains):
        pq.write_table(night.slice(5), job.snapshot)  # the next night's, 5 rows fewer
        return load_chains(self, chains)

    monkeypatch.setattr(plan_database.PlanDatabase, "load_chains", replaced_meanwhile)
    with pytest.raises(DatasetError, match="changed while it was read: plan again"):
        with job.plan(Naming(2), print):
            pass
    assert not job.plan_path.exists() and not list(tmp_path.glob(".plan_work*"))


def _answered_as_planned(plan_path, settings_fp: str) -> pa.Table:
    """The answers the shards of the plan on disk write: each row's id, answer key (under
    ``settings_fp``), status (an error where the plan gives one) and partition."""
    plan = pq.read_table(plan_path)
    keys = [answer_key(settings_fp, key, budget, fmt, error) for key, budget, fmt, error in zip(
        *(plan[c].to_pylist() for c in (CONTENT_KEY, "max_tokens", "response_format", "error")))]
    return pa.table({"id": plan["id"], "answer_key": keys,
                     "status": ["error" if e else "ok" for e in plan["error"].to_pylist()],
                     "partition_key": plan["partition_key"]})


def test_a_night_after_keeps_answered_shards_and_gathers_the_rows_to_run_into_few(tmp_path, tiny_model):
    """With the answers stored: a night with nothing changed has no shard to run and the same keys;
    a night with rows edited, new and deleted runs one new shard of exactly those rows (the edited
    and the new), every other row keeping its shard and partition key; answers under other settings
    settle nothing."""
    settings = EngineSettings(model_path=tiny_model, block_size=8, max_model_len=256)
    job = PlanJob(tmp_path / "prompts.parquet", tmp_path / "plan.parquet", tmp_path / "cache", settings,
                  SamplingSettings(max_tokens=5), SchedulerSettings(min_group_rows=2), Columns(), print)
    stored: list[pa.Table] = []

    def export(path) -> bool:
        pq.write_table(stored[-1], path)
        return True

    def night(table: pa.Table, fps=("ab12",)):
        pq.write_table(table, job.snapshot)
        with job.plan(Naming(5), print, StoredAnswers(export, list(fps))) as made:
            job.write(made, f"run-{len(stored)}")
            return made.keys_to_run, made.summary(), dict(zip(*(pq.read_table(job.plan_path)[c].to_pylist()
                                                                for c in ("id", "partition_key"))))

    first = _night(0, 300)
    stored.append(pa.table({"id": pa.array([], pa.string()), "answer_key": pa.array([], pa.string()),
                            "status": pa.array([], pa.string()), "partition_key": pa.array([], pa.string())}))
    to_run, summary, keys = night(first)
    assert len(to_run) == 5 and summary["rows_to_run"] == 300 and summary["settled_rows"] == 0
    stored.append(_answered_as_planned(job.plan_path, "ab12"))

    again, summary, keys_again = night(first)
    assert again == [] and summary["settled_rows"] == 300 and keys_again == keys
    from engine.plan.plan_table import PlanFile

    assert PlanFile.open(job.plan_path).settled_with == ["ab12"]  # what a shard's node checks its own against

    prompts = first["prompt"].to_pylist()
    edited_ids = [first["id"][i].as_py() for i in (1, 2, 100, 250)]
    for i in (1, 2, 100, 250):
        prompts[i] = prompts[i] + " (edited)"
    edited = first.set_column(first.schema.get_field_index("prompt"), "prompt", pa.array(prompts, pa.string()))
    edited = edited.set_column(edited.schema.get_field_index(CONTENT_KEY), CONTENT_KEY, content_keys(
        edited["prompt"].combine_chunks(), edited["messages"].combine_chunks(), edited.num_rows))
    new = _night(7, 3).set_column(0, "id", pa.array(["new0", "new1", "new2"]))
    changed = pa.concat_tables([edited.slice(0, 290), new])  # 10 deleted, 4 edited, 3 new
    to_run, summary, keys_after = night(changed)
    assert len(to_run) == 1 and summary["rows_to_run"] == 7 and summary["settled_rows"] == 286
    assert sorted(i for i, k in keys_after.items() if k == to_run[0]) == sorted(edited_ids + ["new0", "new1", "new2"])
    assert all(keys_after[i] == keys[i] for i in keys_after if keys_after[i] != to_run[0])

    stored.append(_answered_as_planned(job.plan_path, "ab12"))
    to_run, summary, _ = night(changed, fps=("cd34",))  # another model or settings: every row runs again
    assert summary["settled_rows"] == 0 and summary["rows_to_run"] == 293 and len(to_run) == 5


def test_a_killed_plans_scratch_database_goes_with_the_next_plan_however_young(tmp_path, tiny_model):
    """A plan killed (SIGKILL, out of memory) leaves its scratch database; the next plan, holding the
    job's plan lock as the asset does, removes it at once: no live plan can own it (~0.5 GB per
    million rows that would otherwise stay for an hour and could fill the disk of the rerun)."""
    import os

    settings = EngineSettings(model_path=tiny_model, block_size=8, max_model_len=256)
    job = PlanJob(tmp_path / "prompts.parquet", tmp_path / "plan.parquet", tmp_path / "cache", settings,
                  SamplingSettings(max_tokens=5), SchedulerSettings(min_group_rows=2), Columns(), print)
    pq.write_table(_night(0, 30), job.snapshot)
    killed = tmp_path / f".plan_work.{os.getppid()}.partial"  # a live process id, written just now
    killed.mkdir()
    (killed / "plan.duckdb").write_bytes(b"\0" * 1024)
    with job.plan(Naming(2), print) as made:
        assert not killed.exists()
        job.write(made, "run-0")
    assert not list(tmp_path.glob(".plan_work*"))


def test_the_settle_benchmark_runs_and_settles_all_but_the_edited_rows(tmp_path):
    """``benchmarks/settle_scale.py`` on a small table: it breaks loudly when the names it uses go."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "settle_scale.py"), "--rows", "2000", "--shards",
                          "4"], check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    assert json.loads(out.stdout.strip().splitlines()[-1])["settled"] == 1980
