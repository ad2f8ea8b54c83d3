"""Answer lengths learned from the last nights (``engine/plan/answer_lengths.py``): what admission counts
a row's output at instead of its ``max_tokens``, never the row's own limit; the output table's reading
of them; the plan file that carries them to its shards."""

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.plan.answer_lengths import MIN_ROWS, AnswerLengths, learned_lengths, measured_lengths
from engine.plan.tokenizing import TokenizedBatch
from engine.run.batch_run import BatchRun
from engine.run.kv_budget import KVGroups
from engine.run.scheduler import GroupScheduler
from engine.run.stand_in import BlockAccountingEngine
from engine.settings import Admission, ReserveOutput, SamplingSettings, SchedulerSettings

from .test_admission import BLOCK, VOCAB, prepared_of
from .test_scheduler import KV_LAYOUTS, Watched, random_plans


def test_lengths_are_learned_only_from_enough_answers_that_ended_before_their_limits():
    assert learned_lengths(MIN_ROWS - 1, 12.0, 8.0, 0) is None  # too few measured
    assert learned_lengths(1_000, 64.0, 60.0, 51) is None  # over 5% stopped at max_tokens: a limit, not a length
    learned = learned_lengths(1_000, 11.2, 8.5, 50)
    assert learned == AnswerLengths(tokens=12, mean=8.5, rows=1_000)
    assert learned.reserved(np.array([4, 12, 200])).tolist() == [4, 12, 12]  # never above a row's own limit
    assert AnswerLengths.of_text(learned.to_text()) == learned and AnswerLengths.of_text(None) is None
    tokens = np.arange(1, 201)
    assert measured_lengths(tokens, at_limit=0) == AnswerLengths(190, float(tokens.mean()), 200)


def test_the_output_tables_lengths_are_those_a_run_measures(tmp_path):
    """The plan reads them in DuckDB (``quantile_disc``), a bench's run in memory: the same numbers;
    error rows are not answers."""
    from dagster_duckdb import DuckDBResource

    from batchllm_dagster.output_table import OutputTable

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 40, 300)
    finish = np.where(rng.random(300) < 0.02, "length", "stop")
    answers = pa.table({"id": [str(i) for i in range(310)], "status": ["ok"] * 300 + ["error"] * 10,
                        "text": ["a"] * 310, "output_tokens": np.concatenate([tokens, np.full(10, 500)]),
                        "finish_reason": np.concatenate([finish, ["length"] * 10]), "partition_key": ["k"] * 310})
    table = OutputTable(DuckDBResource(database=str(tmp_path / "answers.duckdb")), "answers", "job")
    assert learned_lengths(*table.answer_lengths()) is None  # no table yet: nothing learned
    table.replace_partition("k", answers)
    assert learned_lengths(*table.answer_lengths()) == measured_lengths(tokens, int((finish == "length").sum()))


def _watched(batch, groups, max_tokens, counted, num_blocks, kv_groups=KVGroups(), ends=None, **scheduler):
    from engine.run.drive import StepTotals, drive

    engine = BlockAccountingEngine(num_blocks, 4, kv_groups=kv_groups, answer_ends=ends)
    scheduler = GroupScheduler(batch, np.asarray(max_tokens), groups, SchedulerSettings(**scheduler), 4, num_blocks,
                               kv_groups=kv_groups, counted_output=counted)
    watch = Watched(engine, scheduler)
    out = list(drive(scheduler, engine, SamplingSettings(), StepTotals(), on_step=watch))
    return engine, scheduler, out, watch


@settings(max_examples=150, deadline=None)
@given(plan=random_plans(), num_blocks=st.integers(4, 80), reserve=st.sampled_from(["full", "lookahead"]),
       kv_groups=st.sampled_from(KV_LAYOUTS), seed=st.integers(0, 2**16))
def test_a_row_outgrowing_its_learned_length_is_counted_as_vllm_holds_it(plan, num_blocks, reserve, kv_groups, seed):
    """Rows counted at a learned length shorter than their answers (every one of them outgrows it
    here): the count never falls below what the engine holds, and every answer runs to its limit."""
    batch, groups, max_tokens = plan
    counted = np.maximum(1, np.random.default_rng(seed).integers(0, max_tokens + 1))
    engine, scheduler, out, watch = _watched(batch, groups, max_tokens, counted, num_blocks, kv_groups,
                                             reserve_output=reserve)
    assert watch.undercounts == [] and watch.below_exact == []
    assert scheduler.done and scheduler.blocks_in_flight == 0  # every block counted was given back
    finished = {o.submission.row: len(o.token_ids) for o in out if hasattr(o, "submission")}
    assert all(finished[row] == max_tokens[row] for row in finished)  # never cut at the learned length


@settings(max_examples=100, deadline=None)
@given(plan=random_plans(), num_blocks=st.integers(4, 80), kv_groups=st.sampled_from(KV_LAYOUTS),
       seed=st.integers(0, 2**16))
def test_rows_counted_at_a_learned_length_give_back_every_block_whether_they_end_before_or_after_it(
        plan, num_blocks, kv_groups, seed):
    """A full reservation of learned lengths, answers ending at EOS before or after them (the stand-in's
    ``answer_ends``): never below what the engine holds, and nothing left counted when all are done."""
    batch, groups, max_tokens = plan
    rng = np.random.default_rng(seed)
    counted = np.maximum(1, rng.integers(0, max_tokens + 1))
    ends = {row: int(rng.integers(1, max_tokens[row] + 1)) for row in range(len(max_tokens))}
    engine, scheduler, out, watch = _watched(batch, groups, max_tokens, counted, num_blocks, kv_groups, ends,
                                             reserve_output="full")
    assert watch.undercounts == [] and watch.below_exact == []
    assert scheduler.done and scheduler.blocks_in_flight == 0
    finished = {o.submission.row: len(o.token_ids) for o in out if hasattr(o, "submission")}
    assert all(finished[row] == ends[row] for row in finished)


def _short_answers(rows: int = 120, seed: int = 0):
    """Rows with a budget of 64 tokens whose answers end after 3-8 (one after 60)."""
    rng = np.random.default_rng(seed)
    batch = TokenizedBatch.from_rows([np.concatenate([[10 + i], rng.integers(*VOCAB, rng.integers(40, 90))])
                                      for i in range(rows)])
    ends = {row: int(rng.integers(3, 9)) for row in range(rows)}
    ends[7] = 60
    return batch, np.full(rows, 64, dtype=np.int64), ends


def _run_short_answers(learned: bool, kv_blocks: int = 160, **scheduler):
    batch, max_tokens, ends = _short_answers()
    prepared = prepared_of(batch, max_tokens)
    lengths = measured_lengths(np.array([ends[r] for r in range(len(ends))]), at_limit=0)
    assert lengths.tokens == 8
    prepared.answer_lengths = lengths if learned else None
    engine = BlockAccountingEngine(kv_blocks, BLOCK, max_num_seqs=64, max_num_batched_tokens=2048, answer_ends=ends)
    run = BatchRun(prepared, engine, SamplingSettings(max_tokens=64), SchedulerSettings(**scheduler))
    results = {r.id: (r.text, r.output_tokens) for r in run}
    assert results[prepared.ids[7]][1] == 60  # the one long answer runs to its end, past the learned 8
    return engine, run.finished_stats(), results


def test_a_full_reservation_of_learned_lengths_runs_fuller_batches_with_the_same_answers():
    """A generous max_tokens and short answers on a KV cache a third of the batch's needs, every output
    reserved: counted at their learned length (the 95th percentile, 8) rows run in fuller steps, each
    answer as long as before."""
    settings = {"admission": Admission.GROUP_WISE, "reserve_output": ReserveOutput.FULL}
    before_engine, before, answers = _run_short_answers(False, **settings)
    _, after, learned_answers = _run_short_answers(True, **settings)
    assert learned_answers == answers
    assert after.engine_steps < before.engine_steps and after.rows_per_step > before.rows_per_step
    assert before_engine.preemptions == 0
    assert "the 95% percentile of the 120 answers" in after.admission_reason


def test_learned_lengths_tell_admission_what_vllm_alone_would_do():
    """By default (the next token reserved) admission is chosen on a model of vLLM alone: at their
    64-token budgets vLLM alone would preempt rows and compute their prompts again, so group-wise
    admission ran them; at their learned length it computes them once, and vLLM admits, with the same answers."""
    _, before, answers = _run_short_answers(False, kv_blocks=250)
    _, after, learned_answers = _run_short_answers(True, kv_blocks=250)
    assert learned_answers == answers
    assert (before.admission, after.admission) == ("group_wise", "vllm")
    assert "nothing for group-wise admission to gain (each row's output counted as 8" in after.admission_reason


def test_a_plan_file_carries_the_learned_lengths_to_its_shards():
    from engine.plan.plan_table import ANSWER_LENGTHS, prepared_batch

    learned = AnswerLengths(tokens=12, mean=8.5, rows=1_000)
    rows = pa.table({"id": ["a"], "max_tokens": [64], "error": pa.nulls(1, pa.string()),
                     "response_format": pa.nulls(1, pa.string()), "position": [0], "group": [0],
                     "prefix_tokens": [0]}, metadata={"batchllm.block_size": "32", ANSWER_LENGTHS: learned.to_text()})
    prepared = prepared_batch(rows, TokenizedBatch.from_rows([np.arange(10, 50)]))
    assert prepared.answer_lengths == learned and prepared.counted_output.tolist() == [12]
    assert prepared.subset([0]).answer_lengths == learned
    plain = prepared_batch(rows.replace_schema_metadata({"batchllm.block_size": "32"}),
                           TokenizedBatch.from_rows([np.arange(10, 50)]))
    assert plain.answer_lengths is None and plain.counted_output.tolist() == [64]


def test_the_bench_says_a_learned_run_against_the_engine_without_it_and_against_the_baselines():
    from engine.bench.verdict import ratio_summary, verdict

    ratios = {"batchllm_learned": {"vs_vllm_apc_sorted": ratio_summary([1.10, 1.12]),
                                   "vs_batchllm": ratio_summary([1.05, 1.07])}}
    text = verdict(ratios, 1.0, 582, {"shape": "long_budget"})
    assert "batchllm with the answer lengths a night before learned against without: 1.06x (range 1.05-1.07)" in text
    assert "is faster than the strongest baseline, vLLM on sorted rows: 1.11x" in text
