"""The scheduler without vLLM: admission, budgets, retention and pipelining on a block-accounting fake."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.plan.tokenizing import TokenizedBatch
from engine.run.drive import Rejected, StepTotals, drive
from engine.run.kv_budget import KVGroups
from engine.run.requests import RequestKind
from engine.run.scheduler import GroupScheduler, InOrderScheduler, PlannedGroup, groups_in_run_order
from engine.run.stand_in import BlockAccountingEngine
from engine.settings import ReserveOutput, SamplingSettings, SchedulerSettings

BLOCK = 4
SAMPLING = SamplingSettings()


def make_batch(rows: list[np.ndarray]) -> TokenizedBatch:
    return TokenizedBatch.from_rows(rows)


def nested_batch(documents=6, rows_per_document=4, system_blocks=6, document_blocks=2, own_tokens=3, seed=0):
    """A system prompt above every document, a document above each of its rows."""
    rng = np.random.default_rng(seed)
    system = rng.integers(100, 1000, system_blocks * BLOCK)
    rows, groups = [], []
    for _ in range(documents):
        document = rng.integers(1000, 2000, document_blocks * BLOCK)
        members = []
        for _ in range(rows_per_document):
            members.append(len(rows))
            rows.append(np.concatenate([system, document, rng.integers(2000, 3000, own_tokens)]))
        groups.append(PlannedGroup(prefix_tokens=(system_blocks + document_blocks) * BLOCK, rows=members))
    return make_batch(rows), groups


class Watched:
    """Checks, after every step, that the scheduler never counts fewer blocks than the engine holds,
    and that the count admission keeps by events never falls below the exact recount."""

    def __init__(self, engine: BlockAccountingEngine, scheduler: GroupScheduler):
        self.engine, self.scheduler, self.undercounts, self.below_exact = engine, scheduler, [], []

    def __call__(self, report):
        held = self.scheduler.blocks_held(self.engine.generated)
        if self.engine.referenced_blocks > held:
            self.undercounts.append((self.engine.step_count, self.engine.referenced_blocks, held))
        if self.scheduler.blocks_in_flight < held:
            self.below_exact.append((self.engine.step_count, self.scheduler.blocks_in_flight, held))


def run(batch, groups, max_tokens, num_blocks, kv_groups=KVGroups(), **scheduler_kw):
    engine = BlockAccountingEngine(num_blocks, BLOCK, kv_groups=kv_groups)
    scheduler = GroupScheduler(
        batch, np.asarray(max_tokens), groups, SchedulerSettings(**scheduler_kw), BLOCK, num_blocks,
        kv_groups=kv_groups,
    )
    watch = Watched(engine, scheduler)
    totals = StepTotals()
    out = list(drive(scheduler, engine, SAMPLING, totals, on_step=watch))
    return engine, scheduler, out, watch, totals


def test_the_budget_is_never_exceeded_and_never_undercounts_what_the_engine_holds():
    batch, groups = nested_batch()
    max_tokens = np.full(len(batch.lengths), 9)
    engine, scheduler, out, watch, _ = run(batch, groups, max_tokens, num_blocks=40,
                                           reserve_output=ReserveOutput.FULL)
    assert scheduler.stats.max_reserved_blocks <= scheduler.stats.budget_blocks
    assert engine.peak_referenced <= scheduler.stats.budget_blocks
    assert watch.undercounts == []
    assert engine.preemptions == 0
    assert sorted(f.submission.row for f in out) == list(range(len(batch.lengths)))


@pytest.mark.parametrize("prefix_requests", [False, True])
def test_a_group_prefix_stays_cached_until_its_last_row(prefix_requests):
    batch, groups = nested_batch(documents=8, rows_per_document=5)
    # Output reserved in full: no preemption, whose recompute would blur what the prefix cost.
    engine, _, out, _, _ = run(batch, groups, np.full(len(batch.lengths), 6), num_blocks=48,
                               prefix_requests=prefix_requests, reserve_output=ReserveOutput.FULL)
    prefix_tokens = groups[0].prefix_tokens
    # Every row but its group's first found the whole group prefix in the cache: computed once,
    # by the prefix request or by the first row when the rows entered together.
    first = {g.rows[0] for g in groups}
    assert all(f.cached_tokens >= prefix_tokens for f in out if f.submission.row not in first)
    assert engine.prefill_tokens == sum(int(batch.lengths[r]) - prefix_tokens for g in groups for r in g.rows) + \
        (6 * BLOCK) + len(groups) * 2 * BLOCK  # rows' own tokens + system prompt once + each document once


def test_nested_prefix_blocks_shared_by_groups_count_once():
    # 10 system blocks under every document; a group's 2 rows hold 2 blocks each beyond its prefix.
    # Counting the system prompt once per group, a group in flight would cost 10 + 1 + 4 blocks and
    # no more than 57 // 15 = 3 groups would fit the budget; counted once, more do.
    batch, groups = nested_batch(documents=12, rows_per_document=2, system_blocks=10, document_blocks=1, own_tokens=2)
    engine, scheduler, out, watch, totals = run(batch, groups, np.full(len(batch.lengths), 4), num_blocks=60,
                                                reserve_output="full")
    group_of = {r: g for g, group in enumerate(groups) for r in group.rows}
    most_groups_in_flight = max(
        len({group_of[sub.row] for s, sub in engine.submitted if s <= step and sub.kind is RequestKind.ROW
             and engine.finished_at[sub.key] > step})
        for step in range(engine.step_count + 1)
    )
    assert scheduler.stats.budget_blocks // (10 + 1 + 2 * 2) == 3
    assert most_groups_in_flight > 3, most_groups_in_flight
    assert watch.undercounts == []
    assert engine.preemptions == 0


def test_rows_sharing_more_than_their_group_prefix_count_the_shared_blocks_once():
    # One group (a system prompt); inside it, pairs of rows share a 3-block document.
    rng = np.random.default_rng(1)
    system = rng.integers(100, 200, 2 * BLOCK)
    rows = []
    for _ in range(6):
        document = rng.integers(200, 300, 3 * BLOCK)
        rows += [np.concatenate([system, document, rng.integers(300, 400, 2)]) for _ in range(2)]
    batch = make_batch(rows)
    groups = [PlannedGroup(prefix_tokens=2 * BLOCK, rows=list(range(12)))]
    engine, scheduler, out, watch, _ = run(batch, groups, np.full(12, 3), num_blocks=200, reserve_output="full")
    assert watch.undercounts == []
    # All 12 rows in flight at once: 2 system + 6 x 3 document blocks, each counted once, + 12 rows
    # x 2 own blocks (2 own prompt tokens + 3 reserved output tokens, past the 20 shared tokens).
    assert scheduler.stats.max_reserved_blocks == 2 + 6 * 3 + 12 * 2
    assert engine.prefill_tokens == 2 * BLOCK + 6 * 3 * BLOCK + 12 * 2


def test_mixed_output_lengths_full_reservation_never_preempts():
    batch, groups = nested_batch(documents=8, rows_per_document=4, system_blocks=2, document_blocks=2)
    rng = np.random.default_rng(3)
    max_tokens = rng.integers(1, 30, len(batch.lengths))
    engine, scheduler, out, watch, _ = run(batch, groups, max_tokens, num_blocks=30, reserve_output="full")
    assert engine.preemptions == 0
    assert watch.undercounts == []
    assert len(out) == len(batch.lengths)


def test_lookahead_keeps_more_rows_in_flight_than_full_reservation():
    batch, groups = nested_batch(documents=8, rows_per_document=6, system_blocks=2, document_blocks=2)
    max_tokens = np.full(len(batch.lengths), 24)
    _, _, _, _, full = run(batch, groups, max_tokens, num_blocks=40, reserve_output="full")
    _, _, _, _, lookahead = run(
        batch, groups, max_tokens, num_blocks=40, reserve_output="lookahead", lookahead_tokens=4
    )
    assert lookahead.rows_per_step > full.rows_per_step


def test_the_next_group_enters_while_the_previous_group_decodes():
    batch, groups = nested_batch(documents=4, rows_per_document=3)
    engine, scheduler, _, _, _ = run(batch, groups, np.full(len(batch.lengths), 12), num_blocks=200)
    submitted_at = {sub.key: step for step, sub in engine.submitted}
    for position in range(1, len(groups)):
        last_row_before = max(engine.finished_at[(RequestKind.ROW, r)] for r in groups[position - 1].rows)
        assert submitted_at[(RequestKind.ROW, groups[position].rows[0])] < last_row_before
    # Every group's rows fit at once: they share their prefix in the step they enter, no prefix request.
    assert scheduler.stats.prefix_requests == 0


def test_a_prefix_request_only_for_a_group_whose_rows_cannot_all_enter_and_it_holds_back_no_later_group():
    # Group 0 is larger than the budget; groups 1.. are small and fit while group 0's prefix is computed.
    rng = np.random.default_rng(3)
    big_prefix = rng.integers(100, 1000, 6 * BLOCK)
    rows, groups = [], []
    members = []
    for _ in range(12):
        members.append(len(rows))
        rows.append(np.concatenate([big_prefix, rng.integers(2000, 3000, 2 * BLOCK)]))
    groups.append(PlannedGroup(prefix_tokens=6 * BLOCK, rows=members))
    for _ in range(4):
        prefix = rng.integers(1000, 2000, 2 * BLOCK)
        members = []
        for _ in range(2):
            members.append(len(rows))
            rows.append(np.concatenate([prefix, rng.integers(2000, 3000, 3)]))
        groups.append(PlannedGroup(prefix_tokens=2 * BLOCK, rows=members))
    batch = make_batch(rows)
    engine, scheduler, out, watch, _ = run(batch, groups, np.full(len(rows), 3), num_blocks=40,
                                           reserve_output=ReserveOutput.FULL, prefix_requests=True)
    assert scheduler.stats.prefix_requests == 1  # group 0 only
    first_step = [sub.key for step, sub in engine.submitted if step == 0]
    assert first_step[0] == (RequestKind.PREFIX, 0)
    # The small groups entered in the first step, beside group 0's prefix request, not after it.
    assert {(RequestKind.ROW, r) for g in groups[1:] for r in g.rows} <= set(first_step)
    assert watch.undercounts == [] and engine.preemptions == 0
    assert sorted(f.submission.row for f in out) == list(range(len(rows)))


def test_a_groups_rows_build_their_prompts_on_one_list_of_its_prefix_only_where_they_begin_with_it():
    batch, groups = nested_batch(documents=3, rows_per_document=3)
    # A wrong plan: group 2 claims a prefix its rows do not share (one more block than they do).
    groups[2] = PlannedGroup(prefix_tokens=groups[2].prefix_tokens + BLOCK, rows=groups[2].rows)
    engine, _, out, _, _ = run(batch, groups, np.full(len(batch.lengths), 3), num_blocks=200)
    by_row = {sub.row: sub for _, sub in engine.submitted if sub.kind is RequestKind.ROW}
    for position, group in enumerate(groups):
        shared = [by_row[row].shared_ids for row in group.rows]
        if position < 2:  # one list, converted once, for every row of the group
            assert all(ids is shared[0] for ids in shared) and len(shared[0]) == group.prefix_tokens
        else:
            assert shared == [None] * len(group.rows)
        for row in group.rows:
            prompt = by_row[row].prompt_ids()
            assert prompt == batch.tokens_of(row).tolist() and prompt is not by_row[row].shared_ids
    assert len(out) == len(batch.lengths)


def test_a_row_larger_than_the_whole_cache_is_rejected_not_a_stall():
    batch, groups = nested_batch(documents=2, rows_per_document=3)
    max_tokens = np.full(len(batch.lengths), 4)
    max_tokens[groups[1].rows[1]] = 500  # alone it needs more than 30 blocks
    engine, scheduler, out, _, _ = run(batch, groups, max_tokens, num_blocks=30)
    rejected = [o for o in out if isinstance(o, Rejected)]
    assert [r.row for r in rejected] == [groups[1].rows[1]]
    assert "KV blocks" in rejected[0].reason
    assert len(out) == len(batch.lengths) and scheduler.done


def test_in_order_scheduler_submits_everything_at_once():
    batch, _ = nested_batch(documents=2, rows_per_document=2)
    engine = BlockAccountingEngine(200, BLOCK)
    scheduler = InOrderScheduler(batch, np.full(4, 3), [3, 1, 0, 2])
    out = list(drive(scheduler, engine, SAMPLING, StepTotals()))
    assert [sub.row for step, sub in engine.submitted] == [3, 1, 0, 2]
    assert all(step == 0 for step, _ in engine.submitted)
    assert sorted(f.submission.row for f in out) == [0, 1, 2, 3]


def test_groups_in_run_order_splits_where_the_group_changes():
    groups = groups_in_run_order([4, 2, 0, 1, 3], np.array([1, 2, 0, 2, 0]), np.array([8, 0, 4, 0, 8]))
    assert [(g.prefix_tokens, g.rows) for g in groups] == [(8, [4, 2]), (8, [0]), (0, [1, 3])]


def test_policies_are_enums_and_a_typo_lists_the_choices():
    assert SchedulerSettings(reserve_output="full").reserve_output is ReserveOutput.FULL
    with pytest.raises(ValueError, match="'full' or 'lookahead'"):
        SchedulerSettings(reserve_output="ful")


@st.composite
def random_plans(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    system = rng.integers(1, 50, draw(st.integers(0, 3)) * BLOCK)
    rows, groups, max_tokens = [], [], []
    for _ in range(draw(st.integers(1, 8))):
        prefix = np.concatenate([system, rng.integers(50, 99, draw(st.integers(0, 4)) * BLOCK)])
        members, middle = [], np.zeros(0, dtype=np.int64)
        duplicates = prefix.size > 0 and draw(st.integers(0, 3)) == 0  # every row is the prefix (n answers)
        for _ in range(draw(st.integers(1, 6))):
            members.append(len(rows))
            max_tokens.append(draw(st.integers(1, 40)))
            if rows and members[:-1] and draw(st.integers(0, 4)) == 0:  # a duplicate of the row before
                rows.append(rows[-1].copy())
                continue
            if duplicates or (
                prefix.size and draw(st.integers(0, 3)) == 0
            ):  # the group's prefix alone: block-aligned, wholly cached
                rows.append(prefix.copy())
                continue
            if not draw(st.booleans()):  # else: shares a middle part (a document) with the row before
                middle = rng.integers(200, 300, draw(st.integers(0, 3)) * BLOCK)
            # 0 own tokens: the row ends on a block boundary of what it shares (vLLM recomputes
            # the last block of a prompt it finds whole in its cache).
            rows.append(np.concatenate([prefix, middle, rng.integers(300, 400, draw(st.integers(0, 9)))]))
        groups.append(PlannedGroup(prefix_tokens=prefix.size, rows=members))
    return make_batch(rows), groups, np.array(max_tokens)


# A model's KV cache groups (``KVGroups``): one full-attention group (most models); a sliding-window
# group beside it whose cap long rows reach (Gemma 3's kind, in miniature); two full and two windows;
# windows alone (Mistral's kind); and each with decoding holds under their caps.
KV_LAYOUTS = [KVGroups(), KVGroups(1, (3,)), KVGroups(2, (2, 6)), KVGroups(0, (4,)),
              # a decoding row holds fewer window blocks than a prefilling one (vLLM frees what the window left)
              KVGroups(1, (6,), (3,)), KVGroups(2, (4, 8), (2, 3)), KVGroups(0, (5,), (2,))]


@settings(max_examples=200, deadline=None)
@given(plan=random_plans(), num_blocks=st.integers(4, 80), reserve=st.sampled_from(["full", "lookahead"]),
       prefix_requests=st.booleans(), kv_groups=st.sampled_from(KV_LAYOUTS))
def test_every_row_is_submitted_exactly_once_or_rejected(plan, num_blocks, reserve, prefix_requests, kv_groups):
    batch, groups, max_tokens = plan
    engine, scheduler, out, watch, _ = run(batch, groups, max_tokens, num_blocks, kv_groups, reserve_output=reserve,
                                           prefix_requests=prefix_requests)
    submitted_rows = [sub.row for _, sub in engine.submitted if sub.kind is RequestKind.ROW]
    rejected = [o.row for o in out if isinstance(o, Rejected)]
    assert len(submitted_rows) == len(set(submitted_rows))
    assert sorted(submitted_rows + rejected) == list(range(len(batch.lengths)))
    for g in groups:  # admission's per-row constants are the block counts, computed once for all rows
        for row in g.rows:
            hit = scheduler._cache_hit(row, g.prefix_tokens) // BLOCK
            assert scheduler._prefix_hit_blocks[row] == hit
            assert scheduler._entry_cost(row, hit) == scheduler._blocks_at(row, 0, hit)
    for _, sub in engine.submitted:  # the prompt vLLM gets is the row's, shared prefix list or not
        expected = batch.tokens_of(sub.row) if sub.kind is RequestKind.ROW else sub.token_ids
        assert sub.prompt_ids() == expected.tolist()
    assert scheduler.done and scheduler.blocks_in_flight == 0  # every block counted was given back
    assert watch.undercounts == [] and watch.below_exact == []
    if reserve == "full":
        assert engine.preemptions == 0


@pytest.mark.parametrize(("max_tokens", "num_blocks"), [([1, 1, 1, 3, 2], 6), ([1, 1, 1, 2, 2], 5)])
def test_a_row_after_a_recomputed_copy_of_a_cached_block_counts_the_block_it_finds(max_tokens, num_blocks):
    """Found by the property test below: four rows that are exactly two blocks (a document and its
    prefix, no text of their own), then a row that adds one token. Each of the four recomputes its
    last block (a hit is capped at the prompt's length - 1): the first copy is cached, the others
    are copies vLLM's lookup never returns. The fifth row shares both blocks with the fourth, but its
    lookup finds the first copy, not the fourth row's: it references one block more than "shared
    with the row before" counted (an undercount, then a preemption with output reserved in full)."""
    block = np.array([91, 81, 75, 63, 230, 204, 207, 201])
    batch = make_batch([block, block, block, block, np.concatenate([block, [317]])])
    engine, _, out, watch, _ = run(batch, [PlannedGroup(prefix_tokens=4, rows=[0, 1, 2, 3, 4])], max_tokens,
                                   num_blocks, reserve_output=ReserveOutput.FULL, prefix_requests=False)
    assert watch.undercounts == [] and watch.below_exact == []
    assert engine.preemptions == 0 and sorted(f.submission.row for f in out) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("reserve", ["full", "lookahead"])
def test_rows_that_are_wholly_a_cached_prefix_count_the_block_vllm_recomputes(reserve):
    # Duplicate rows whose prompt is exactly their group's block-aligned prefix (n answers per
    # prompt, a repeated question): vLLM caps a prefix hit at the prompt's length - 1, so each row
    # recomputes its last prompt block into a block of its own, which the scheduler must count.
    rng = np.random.default_rng(4)
    prompt = rng.integers(1, 99, 3 * BLOCK)
    batch = make_batch([prompt.copy() for _ in range(8)])
    groups = [PlannedGroup(prefix_tokens=3 * BLOCK, rows=list(range(8)))]
    engine, scheduler, out, watch, _ = run(batch, groups, np.full(8, 2 * BLOCK), num_blocks=16,
                                           reserve_output=reserve, lookahead_tokens=2 * BLOCK)
    assert watch.undercounts == []
    assert engine.preemptions == 0
    assert len(out) == 8


@pytest.mark.parametrize("reserve", [ReserveOutput.LOOKAHEAD, ReserveOutput.FULL])
def test_an_engine_that_runs_a_step_ahead_of_its_reports_preempts_no_more(reserve):
    """vLLM's async scheduling (a GPU's default) plans step s + 1 before the scheduler reads step s:
    rows hold a token more than the reports show. Counted (``steps_ahead``), the engine preempts no
    more than one that reports every step as it runs; not counted, it does."""
    batch, groups = nested_batch(documents=8, rows_per_document=6, system_blocks=2, document_blocks=2, own_tokens=4)
    max_tokens = np.full(len(batch.lengths), 9)  # prompts end a token short of a block: decodes cross blocks

    def preemptions(steps_ahead: int, counted: bool) -> int:
        engine = BlockAccountingEngine(40, BLOCK, steps_ahead=steps_ahead)
        scheduler = GroupScheduler(batch, max_tokens, groups, SchedulerSettings(reserve_output=reserve), BLOCK, 40,
                                   steps_ahead if counted else 0)
        out = list(drive(scheduler, engine, SAMPLING, StepTotals()))
        assert sorted(f.submission.row for f in out) == list(range(len(batch.lengths)))
        return engine.preemptions

    in_step = preemptions(0, counted=True)
    assert preemptions(1, counted=True) <= in_step
    if reserve is ReserveOutput.LOOKAHEAD:
        assert preemptions(1, counted=False) > in_step  # what counting one step behind cost


@pytest.mark.parametrize("ahead", [1, 3])
def test_steps_the_engine_ran_ahead_of_the_reports_read_are_counted_from_its_queue(ahead):
    """vLLM's core in its own process steps without waiting for the reader: when the reader takes a
    step's outputs, later steps' may be queued (``queued_steps``), rows holding tokens the reports do
    not show yet. Counted from the queue, a scheduler that was not told of them at its start
    (``steps_ahead`` 0) preempts no more than one whose engine never runs ahead; ignored, it does."""
    from engine.run.requests import StepReport

    batch, groups = nested_batch(documents=8, rows_per_document=6, system_blocks=2, document_blocks=2, own_tokens=4)
    max_tokens = np.full(len(batch.lengths), 9)

    class Unsaid(BlockAccountingEngine):
        def step(self) -> StepReport:
            report = super().step()
            report.queued_steps = 0  # the queue not read
            return report

    def preemptions(engine: BlockAccountingEngine) -> int:
        scheduler = GroupScheduler(batch, max_tokens, groups, SchedulerSettings(), BLOCK, 40)
        watch = Watched(engine, scheduler)
        out = list(drive(scheduler, engine, SAMPLING, StepTotals(), on_step=watch))
        assert sorted(f.submission.row for f in out) == list(range(len(batch.lengths)))
        assert (watch.below_exact == []) == (type(engine) is BlockAccountingEngine)
        return engine.preemptions

    in_step = preemptions(BlockAccountingEngine(40, BLOCK))
    assert preemptions(BlockAccountingEngine(40, BLOCK, steps_ahead=ahead, says_queued=True)) <= in_step
    assert preemptions(Unsaid(40, BLOCK, steps_ahead=ahead, says_queued=True)) > in_step


def test_steps_in_which_the_engine_ran_nothing_are_counted_apart():
    """vLLM holds back a constrained request while its grammar compiles, and a step then runs
    nothing: 4 choice rows took 326 such steps (engine_steps 326, rows_per_step 0.02). Those are
    ``idle_steps``; the run's steps and rows per step are those that ran rows (5 and 1.6 there)."""
    from engine.run.requests import StepReport

    totals = StepTotals()
    for _ in range(3):
        totals.add(StepReport())  # nothing ran
    totals.add(StepReport(running=4, prefill_tokens=40))
    totals.add(StepReport(running=2, decode_tokens=2))
    assert (totals.steps, totals.idle_steps, totals.rows_per_step) == (2, 3, 3.0)
