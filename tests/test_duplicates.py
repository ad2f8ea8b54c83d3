"""Identical rows computed once: which rows are identical, the plan that records it, and a run
on the block-accounting fake engine that submits each content once and answers every id."""

import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.plan import plan_database
from engine.plan.block_hashes import RowBlocks
from engine.plan.duplicates import (
    NO_SET,
    answer_sources,
    count_duplicates,
    duplicate_sets,
    lowest_row_of_set,
    token_keys,
)
from engine.plan.plan_database import PlanDatabase
from engine.plan.plan_table import prepared_batch
from engine.plan.prepared import plan_tokenized
from engine.plan.tokenizing import TokenizedBatch
from engine.run.batch_run import BatchRun
from engine.run.requests import RequestKind
from engine.run.scheduler import InOrder
from engine.run.stand_in import BlockAccountingEngine
from engine.settings import EngineSettings, SamplingSettings, SchedulerSettings
from engine.table.prompt_snapshot import CONTENT_KEY

from .plan_rows import rows_table

BLOCK = 8
SETTINGS = EngineSettings(model_path="unused", block_size=BLOCK, max_model_len=512)
SHARED = list(range(100, 124))  # three blocks every row starts with


def batch_of(suffixes: list[list[int]]) -> TokenizedBatch:
    return TokenizedBatch.from_rows([np.asarray(SHARED + s, dtype=np.int32) for s in suffixes])


def planned(suffixes, max_tokens=None, formats=None, sampling=SamplingSettings(max_tokens=4)):
    n = len(suffixes)
    table = pa.table({"id": [f"r{i}" for i in range(n)], "max_tokens": pa.array(max_tokens or [4] * n, pa.int64()),
                      "response_format": pa.array(formats or [None] * n, pa.string())})
    return plan_tokenized(table, batch_of(suffixes), SETTINGS, sampling)


def runnable(suffixes, **kw):
    return planned(suffixes, **kw).runnable(batch_of(suffixes))


def row_submissions(engine: BlockAccountingEngine) -> list[int]:
    return [s.row for _, s in engine.submitted if s.kind is RequestKind.ROW]


def test_rows_are_identical_only_when_tokens_max_tokens_and_format_all_are():
    suffixes = [[1, 2], [1, 2], [1, 2], [1, 2], [3], [1, 2]]
    prepared = planned(
        suffixes, max_tokens=[4, 4, 5, 4, 4, 4], formats=[None, None, None, '{"choice": ["a", "b"]}', None, None]
    )
    same = prepared.duplicate_set
    assert same[0] == same[1] == same[5] != NO_SET
    assert same[2] == NO_SET  # another max_tokens
    assert same[3] == NO_SET  # its own response format
    assert same[4] == NO_SET  # other tokens
    assert count_duplicates(same) == 2


def test_error_rows_never_join_a_set():
    keys = token_keys(np.array([5, 6, 5, 6], dtype=np.int32), np.array([0, 2, 4]))
    assert keys[0] == keys[1]
    assert duplicate_sets(keys, np.array([4, 4]), [None, None], np.array([True, False])).tolist() == [NO_SET, NO_SET]
    assert duplicate_sets(keys, np.array([4, 4]), [None, None], np.array([True, True])).tolist() == [0, 0]


def _sets_by_dict(keys: list[bytes], max_tokens, formats, runnable) -> list[int]:
    """The sets spelled out: rows with equal (key, max_tokens, format), numbered by their first row."""
    members: dict = {}
    for row, identity in enumerate(zip(keys, max_tokens, formats)):
        if runnable[row]:
            members.setdefault(identity, []).append(row)
    out = [NO_SET] * len(keys)
    for number, rows in enumerate(sorted((rows for rows in members.values() if len(rows) > 1), key=min)):
        for row in rows:
            out[row] = number
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 2), st.sampled_from([None, "a", "b"]), st.booleans()),
                max_size=40))
def test_duplicate_sets_are_the_rows_equal_in_key_max_tokens_and_format(rows):
    keys = [bytes([k]) * 16 for k, *_ in rows]
    max_tokens = np.array([m for _, m, _, _ in rows], dtype=np.int64)
    formats = [f for *_, f, _ in rows]
    ok = np.array([r for *_, r in rows], dtype=bool)
    got = duplicate_sets(pa.array(keys, pa.binary(16)), max_tokens, formats, ok)
    assert got.tolist() == _sets_by_dict(keys, max_tokens.tolist(), formats, ok)
    sliced = pa.array([b"x" * 16] + keys, pa.binary(16)).slice(1)  # read from the buffer at the slice's offset
    assert duplicate_sets(sliced, max_tokens, formats, ok).tolist() == got.tolist()
    as_column = pa.chunked_array([pa.array(formats[:3], pa.string()), pa.array(formats[3:], pa.string())])
    assert duplicate_sets(sliced, max_tokens, as_column, ok).tolist() == got.tolist()  # a snapshot's column


class _NoBlocks:
    """Rows too short for a block, as the token cache's rows give their chains (``row_batches``)."""

    def __init__(self, rows: int):
        self.blocks = RowBlocks(BLOCK, np.zeros(rows, dtype=np.int64), np.zeros(0, np.uint64))
        self.lengths = self.blocks.lengths

    def row_batches(self, batch_rows: int):
        for lo in range(0, self.lengths.size, batch_rows):
            rows = np.arange(lo, min(lo + batch_rows, self.lengths.size))
            yield pa.record_batch([pa.array(rows), pa.array(self.lengths[rows]),
                                   pa.array([[]] * rows.size, pa.large_list(pa.uint64()))],
                                  names=["row", "length", "hashes"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 2), st.sampled_from([None, "a", "b"]), st.booleans()),
                max_size=40), st.integers(1, 7))
def test_a_plan_on_disk_finds_the_same_sets_and_plans_each_from_its_first_row(rows, batch_rows):
    keys = pa.array([bytes([k]) * 16 for k, *_ in rows], pa.binary(16))
    max_tokens = np.array([m for _, m, _, _ in rows], dtype=np.int64)
    formats = pa.array([f for *_, f, _ in rows], pa.string())
    ok = np.array([r for *_, r in rows], dtype=bool)
    expected = duplicate_sets(keys, max_tokens, formats, ok)
    with tempfile.TemporaryDirectory() as folder, mock.patch.object(plan_database, "_BATCH_ROWS", batch_rows):
        snapshot = Path(folder) / "prompts.parquet"  # the keys in row groups of batch_rows, as a snapshot's
        pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(rows))], CONTENT_KEY: keys}), snapshot,
                       row_group_size=batch_rows)
        database = PlanDatabase(Path(folder) / "plan", BLOCK)
        try:
            loaded = database.load_chains(_NoBlocks(len(rows))).load_ids(snapshot, "id")
            assert loaded.rows == len(rows)
            assert loaded.duplicate_sets(max_tokens, formats, ok).tolist() == expected.tolist()
            sources = dict(database.con.execute("SELECT row, source FROM duplicate_rows").fetchall())
        finally:
            database.close()
    n = len(rows)
    assert sources == {r: s for r, s in enumerate(lowest_row_of_set(expected, n)) if expected[r] != NO_SET}


def test_a_set_runs_its_first_row_present_so_a_shard_without_the_first_still_runs_one():
    same = np.array([0, 0, NO_SET, 0, 1, 1])
    assert answer_sources(same, [0, 1, 2, 3, 4, 5]) == {0: [1, 3], 4: [5]}
    assert answer_sources(same, [3, 1, 2, 5]) == {3: [1]}  # row 0 (and 4) answered already or elsewhere
    assert answer_sources(None, [0, 1]) == {}


def test_the_engine_computes_each_content_once_and_every_id_gets_the_answer():
    suffixes = [[1, 2], [7], [1, 2], [1, 2], [9, 9, 9], [7]]
    prepared = runnable(suffixes)
    engine = BlockAccountingEngine(num_blocks=64, block_size=BLOCK)
    run = BatchRun(prepared, engine, SamplingSettings(max_tokens=4), SchedulerSettings(log_every_s=60))
    results = {r.id: r for r in run}

    submitted = row_submissions(engine)
    assert len(submitted) == len(set(submitted)) == 3  # {0, 2, 3} once, {1, 5} once, row 4
    assert sorted(results) == [f"r{i}" for i in range(6)]
    assert all(r.status == "ok" for r in results.values())
    for a, b in (("r0", "r2"), ("r0", "r3"), ("r1", "r5")):
        assert results[a].text == results[b].text and results[a].output_tokens == results[b].output_tokens
    assert results["r0"].text != results["r1"].text
    stats = run.finished_stats()
    assert (stats.rows, stats.ok_rows, stats.duplicate_rows) == (6, 6, 3)
    copies = [results[i] for i in ("r0", "r2", "r3", "r1", "r5") if int(i[1:]) not in submitted]
    assert len(copies) == 3 and all(r.cached_tokens == r.prompt_tokens for r in copies)  # nothing computed
    assert stats.prefill_tokens == engine.prefill_tokens  # the run counts what the engine computed, no more
    # A copy reuses its whole prompt, and the ideal says so: the run saves no more than a perfect cache.
    assert stats.reusable_tokens >= sum(r.prompt_tokens for r in copies)
    assert stats.saved_tokens <= stats.reusable_tokens and 0 < stats.saving_vs_ideal <= 1


def test_a_baseline_runs_every_row_as_vllm_would():
    prepared = runnable([[1, 2], [1, 2], [1, 2]])
    engine = BlockAccountingEngine(num_blocks=64, block_size=BLOCK)
    run = BatchRun(prepared, engine, SamplingSettings(max_tokens=4), SchedulerSettings(log_every_s=60),
                   scheduling=InOrder([0, 1, 2]))
    assert len(list(run)) == 3
    assert sorted(row_submissions(engine)) == [0, 1, 2] and run.finished_stats().duplicate_rows == 0


def test_the_plan_table_keeps_the_sets_and_a_shard_reads_them_back():
    prepared = runnable([[1, 2], [3], [1, 2]])
    restored = prepared_batch(rows_table(prepared), prepared.batch)
    assert restored.duplicate_set.tolist() == prepared.duplicate_set.tolist()
    assert restored.duplicate_set[0] == restored.duplicate_set[2] != NO_SET
    assert prepared.subset([1, 2]).duplicate_set.tolist() == [NO_SET, prepared.duplicate_set[2]]


def test_the_plan_puts_each_copy_right_after_its_first_row_in_its_group_and_charges_it_nothing():
    suffixes = [[1, 2], [7] * 9, [1, 2], [3] * 9, [1, 2], [7] * 9]
    prepared = planned(suffixes)
    plan, order = prepared.plan, prepared.order.tolist()
    for source, copy in ((0, 2), (0, 4), (1, 5)):
        assert prepared.group_of_row[copy] == prepared.group_of_row[source]
        assert order.index(copy) > order.index(source)
        assert plan.row_unique_tokens[copy] == 0 and plan.decode_tokens[copy] == 0
    assert order.index(2) == order.index(0) + 1 and order.index(4) == order.index(0) + 2
    distinct = planned([suffixes[i] for i in (0, 1, 3)]).plan
    assert plan.unique_tokens == distinct.unique_tokens  # the minimum counts each content once
    assert plan.prompt_tokens == sum(len(SHARED) + len(s) for s in suffixes)  # every row's prompt is still there
