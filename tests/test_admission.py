"""Who admits a batch's rows (engine/run/admission.py): vLLM itself in plan order where group-wise
admission cannot gain, the engine's scheduler where vLLM alone would compute tokens twice. On the
stand-in for vLLM's scheduler; real vLLM runs either path in the end-to-end tests."""

import numpy as np
import pytest

from engine.bench.prompt_sets import planned_prompt_set
from engine.bench.runs import sorted_order
from engine.bench.shapes import Workload, nested_tokens, synthetic_tokens
from engine.plan.tokenizing import TokenizedBatch
from engine.run.admission import EngineLimits, choose_admission
from engine.run.batch_run import BatchRun
from engine.run.console import run_summary
from engine.run.scheduler import InOrder, Planned
from engine.run.stand_in import BlockAccountingEngine
from engine.settings import Admission, SamplingSettings, SchedulerSettings

BLOCK = 32
VOCAB = (10, 30000)


def prepared_of(batch: TokenizedBatch, max_tokens: np.ndarray):
    return planned_prompt_set(batch, max_tokens, BLOCK)[1]


def run_on_stand_in(prepared, kv_blocks: int, scheduling=Planned(), steps_ahead: int = 0, **scheduler):
    engine = BlockAccountingEngine(kv_blocks, BLOCK, max_num_seqs=64, max_num_batched_tokens=2048,
                                   steps_ahead=steps_ahead)
    sampling = SamplingSettings(max_tokens=int(prepared.max_tokens.max()), ignore_eos=True)
    run = BatchRun(prepared, engine, sampling, SchedulerSettings(**scheduler), scheduling=scheduling)
    answers = {r.id: r.text for r in run}
    return engine, run.finished_stats(), answers


def shares_nothing(rows: int = 150, seed: int = 0):
    rng = np.random.default_rng(seed)
    batch = TokenizedBatch.from_rows([np.concatenate([[10 + i], rng.integers(*VOCAB, rng.integers(40, 120))])
                                      for i in range(rows)])  # every row's first token its own
    return batch, np.full(rows, 6, dtype=np.int64)


@pytest.mark.parametrize("steps_ahead", [0, 1])  # 1: vLLM's async scheduling (a GPU's)
def test_a_batch_that_shares_nothing_runs_step_for_step_as_vllm_alone_runs_it_in_the_same_order(steps_ahead):
    prepared = prepared_of(*shares_nothing(rows=400))
    kv_blocks = 120  # ~40 of the rows at once: KV binds
    engine, stats, answers = run_on_stand_in(prepared, kv_blocks, steps_ahead=steps_ahead)
    assert stats.admission == "vllm" and "nothing for group-wise admission to gain" in stats.admission_reason
    alone, alone_stats, alone_answers = run_on_stand_in(prepared, kv_blocks, InOrder([int(r) for r in prepared.order]),
                                                        steps_ahead=steps_ahead)
    # vLLM's schedule: every row admitted and finished at the same step, though the engine keeps only a
    # window of rows in vLLM's queue (twice max_num_seqs) where vLLM alone is given all at once.
    assert engine.admitted_at == alone.admitted_at and engine.finished_at == alone.finished_at
    assert engine.step_count == alone.step_count
    assert max(step for step, _ in engine.submitted) > 0 == max(step for step, _ in alone.submitted)
    assert answers == alone_answers and stats.engine_steps == alone_stats.engine_steps
    assert ("admission", f"vllm: {stats.admission_reason}") in run_summary(stats.to_dict())


def test_a_batch_that_fits_the_cache_is_left_to_vllm_without_a_simulation():
    batch, max_tokens = shares_nothing(rows=20)
    prepared = prepared_of(batch, max_tokens)
    choice = choose_admission(batch, max_tokens, [int(r) for r in prepared.order], EngineLimits(BLOCK, 400, 64, 2048))
    assert choice.admission is Admission.VLLM and choice.reason.startswith("the whole batch fits the KV cache")


def test_where_vllm_alone_computes_prefixes_twice_group_wise_admission_keeps_its_gain():
    """The bench's groups and nested shapes at the bench's KV size (a third of the working set):
    vLLM alone in plan order preempts rows whose first output finds no block and computes them again."""
    for batch, max_tokens in (synthetic_tokens(Workload(), VOCAB), nested_tokens(VOCAB)):
        planned, prepared = planned_prompt_set(batch, max_tokens, BLOCK)
        kv_blocks = max(64, int(planned.plan.unique_tokens // BLOCK) // 3)
        engine, stats, answers = run_on_stand_in(prepared, kv_blocks)
        assert stats.admission == "group_wise" and "over the minimum" in stats.admission_reason
        alone, _, alone_answers = run_on_stand_in(prepared, kv_blocks, InOrder(sorted_order(prepared)))
        assert answers == alone_answers
        assert engine.prefill_tokens < alone.prefill_tokens and engine.preemptions < alone.preemptions


def test_a_model_with_sliding_window_groups_is_admitted_as_any_other_where_decoding_holds_are_known():
    """The groups shape, where group-wise admission gains on one full-attention group: with a
    sliding-window group beside it whose decoding hold the started engine read (``window_holds``),
    the choice is the simulation's, as for any model: group-wise where vLLM alone computes tokens
    twice, vLLM where the blocks its decoding rows' windows free leave it room. Without the hold (a
    row counted at its prefill's cap all along), vLLM admits, saying why."""
    from engine.run.kv_budget import KVGroups

    batch, max_tokens = synthetic_tokens(Workload(), VOCAB)
    planned, prepared = planned_prompt_set(batch, max_tokens, BLOCK)
    rows = [int(r) for r in prepared.order]
    kv_blocks = max(64, int(planned.plan.unique_tokens // BLOCK) // 3)
    one_group = choose_admission(batch, max_tokens, rows, EngineLimits(BLOCK, kv_blocks, 64, 2048))
    assert one_group.admission is Admission.GROUP_WISE
    hybrid = EngineLimits(BLOCK, 2 * kv_blocks, 64, 2048, kv_groups=KVGroups(1, (1000,)))
    choice = choose_admission(batch, max_tokens, rows, hybrid)
    assert choice.admission is Admission.VLLM and "decoding hold is not known" in choice.reason
    # A window that frees nothing as rows decode (hold = cap): vLLM preempts and computes again, as
    # with one group; one that frees a block a row gives vLLM's decoding rows their next blocks.
    keeps = choose_admission(batch, max_tokens, rows, EngineLimits(BLOCK, kv_blocks, 64, 2048,
                                                                   kv_groups=KVGroups(1, (4,), (4,))))
    assert keeps.admission is Admission.GROUP_WISE and "over the minimum" in keeps.reason
    frees = choose_admission(batch, max_tokens, rows, EngineLimits(BLOCK, kv_blocks, 64, 2048,
                                                                   kv_groups=KVGroups(1, (4,), (3,))))
    assert frees.admission is Admission.VLLM and "0 preemptions" in frees.reason


def test_the_admission_can_be_set_and_prefix_requests_need_the_group_wise_scheduler():
    prepared = prepared_of(*shares_nothing())
    _, forced, _ = run_on_stand_in(prepared, 120, admission="group_wise")
    assert forced.admission == "group_wise" and forced.admission_reason == "scheduler.admission: group_wise"
    batch, max_tokens = synthetic_tokens(Workload(), VOCAB)
    rows = [int(r) for r in prepared_of(batch, max_tokens).order]
    choice = choose_admission(batch, max_tokens, rows, EngineLimits(BLOCK, 100, 64, 2048), prefix_requests=True)
    assert choice.admission is Admission.GROUP_WISE and "prefix requests" in choice.reason


def test_under_vllms_admission_a_row_larger_than_the_cache_is_an_error_row_and_the_others_run():
    batch, max_tokens = shares_nothing(rows=30)
    rows = [batch.row(i) for i in range(30)]
    rows[7] = np.arange(1000, 1000 + 40 * BLOCK)  # 40 blocks, the cache has 39
    prepared = prepared_of(TokenizedBatch.from_rows(rows), max_tokens)
    _, stats, answers = run_on_stand_in(prepared, 40, admission="vllm")
    assert stats.admission == "vllm" and stats.error_rows == 1 and stats.ok_rows == 29
    assert answers[prepared.ids[7]] is None


def test_answers_too_long_to_simulate_two_caches_worth_are_admitted_group_wise():
    """A large cache and long answers: the simulation's cost cap stops before the cache fills twice,
    which tells nothing of preemptions; such a batch runs group-wise, as BatchLLM runs it."""
    rng = np.random.default_rng(1)
    batch = TokenizedBatch.from_rows([rng.integers(*VOCAB, 100) for _ in range(300)])
    max_tokens = np.full(300, 2000)
    rows = list(range(300))
    choice = choose_admission(batch, max_tokens, rows, EngineLimits(16, 15_001, 1024, 16384))
    assert choice.admission is Admission.GROUP_WISE and "too long to simulate" in choice.reason
    short = choose_admission(batch, np.full(300, 8), rows, EngineLimits(16, 1_001, 1024, 16384))
    assert short.admission is Admission.VLLM  # short answers on a small cache: simulated, nothing to gain


def test_the_simulation_hashes_the_rows_in_one_pass_as_the_stand_in_hashes_each_row():
    """The admission's simulation gives the stand-in every row's block hashes, made for all rows at
    once: the same prefill and preemptions as the stand-in hashing each row itself."""
    from engine.run.admission import simulate_vllm_admission
    from engine.run.requests import RequestKind, Submission

    batch, max_tokens = nested_tokens(VOCAB)
    planned, prepared = planned_prompt_set(batch, max_tokens, BLOCK)
    rows = [int(r) for r in prepared.order]
    limits = EngineLimits(BLOCK, max(64, int(planned.plan.unique_tokens // BLOCK) // 3), 64, 2048)
    engine = BlockAccountingEngine(limits.capacity_blocks, BLOCK, limits.max_num_seqs, limits.max_num_batched_tokens)
    for row in rows:
        engine.submit(Submission(RequestKind.ROW, row, batch.tokens_of(row), int(max_tokens[row])), None)
    while engine.has_unfinished():
        engine.step()
    assert engine.preemptions > 0  # KV binds: the hashes decide what is found again
    assert simulate_vllm_admission(batch, max_tokens, rows, limits) == (engine.prefill_tokens, engine.preemptions)
