"""The prefix plan (``engine.plan.batch_plan``: the queries every plan is made by) on hand-made
token sequences, checked against brute force. The prefix tree they were first written as is the test
oracle (``tests/oracle/prefix_tree.py``, its own tests in ``test_prefix_tree_oracle.py``)."""

import numpy as np
import pytest

from engine.plan.batch_plan import plan_token_ids

from .conftest import group_rows


def flat(rows):
    offsets = np.cumsum([0] + [len(r) for r in rows])
    tokens = np.concatenate([np.asarray(r, dtype=np.int32) for r in rows]) if rows else np.zeros(0, np.int32)
    return tokens, offsets


def plan_of(rows, block=4, decode=None, shards=1):
    tokens, offsets = flat(rows)
    decode = np.full(len(rows), 10) if decode is None else np.asarray(decode)
    return plan_token_ids(tokens, offsets, decode, block, shards=shards)


def brute_force_unique_tokens(rows, block):
    """Distinct block-aligned prefixes (the tree's nodes) times block size, plus every row's tail."""
    nodes = set()
    tails = 0
    for row in rows:
        full = len(row) // block
        for k in range(1, full + 1):
            nodes.add(tuple(row[: k * block]))
        tails += len(row) - full * block
    return len(nodes) * block + tails


def groups(plan):
    return [sorted(group_rows(plan, g).tolist()) for g in range(plan.num_groups)]


SYSTEM = list(range(100, 108))  # two blocks shared by every row


def test_rows_sharing_a_prefix_form_one_group_and_unrelated_rows_stay_alone():
    rows = [SYSTEM + [1, 2, 3], list(range(500, 510)), SYSTEM + [4, 5], SYSTEM + [6]]
    plan = plan_of(rows)
    assert sorted(groups(plan)) == [[0, 2, 3], [1]]
    shared = plan.group_of_row[0]
    assert plan.group_prefix_tokens[shared] == 8
    assert plan.group_prefix_tokens[plan.group_of_row[1]] == 0


def test_maximize_reuse_splits_a_subtree_only_when_it_pays():
    document = list(range(200, 216))  # four blocks shared by four questions
    rows = [SYSTEM + document + [q, q + 1] for q in range(4)]  # (4-1)*4 - 2 > 0: own group
    rows += [SYSTEM + [300 + i] * 4 + [1] for i in range(3)]  # share only the system prompt
    small = [SYSTEM + [400] * 4 + [q] for q in range(2)]  # (2-1)*1 - 2 < 0: stays in the root group
    plan = plan_of(rows + small)
    by_prefix = {tuple(g): plan.group_prefix_tokens[plan.group_of_row[g[0]]] for g in groups(plan)}
    assert by_prefix[(0, 1, 2, 3)] == 24
    assert by_prefix[(4, 5, 6, 7, 8)] == 8


@pytest.mark.parametrize("seed", range(5))
def test_shared_tokens_equal_brute_force_tree_on_random_nested_batches(seed):
    rng = np.random.default_rng(seed)
    block = 4
    systems = [rng.integers(0, 50, rng.integers(0, 12)).tolist() for _ in range(2)]
    docs = [rng.integers(0, 50, rng.integers(1, 14)).tolist() for _ in range(5)]
    rows = [systems[rng.integers(2)] + docs[rng.integers(5)] + rng.integers(0, 50, rng.integers(0, 7)).tolist()
            for _ in range(60)]
    rows = [r if r else [1] for r in rows]
    plan = plan_of(rows, block=block)
    assert plan.unique_tokens == brute_force_unique_tokens(rows, block)
    assert plan.prompt_tokens == sum(map(len, rows))
    assert plan.shared_prompt_tokens == plan.prompt_tokens - plan.unique_tokens
    assert plan.row_unique_tokens.sum() == plan.unique_tokens


@pytest.mark.parametrize("seed", range(5))
def test_order_keeps_groups_and_every_shared_prefix_within_a_group_contiguous(seed):
    rng = np.random.default_rng(seed)
    block = 4
    docs = [rng.integers(0, 9, 8).tolist() for _ in range(6)]
    rows = [SYSTEM + docs[rng.integers(6)] + rng.integers(0, 9, rng.integers(1, 9)).tolist() for _ in range(50)]
    rows += [rng.integers(0, 9, 9).tolist() for _ in range(5)]
    plan = plan_of(rows, block=block, decode=rng.integers(1, 50, len(rows)))
    order = plan.order.tolist()
    assert sorted(order) == list(range(len(rows)))
    group_sequence = [plan.group_of_row[r] for r in order]
    assert group_sequence == sorted(group_sequence), "groups are numbered in run order and contiguous"
    for g in range(plan.num_groups):
        members = group_rows(plan, g).tolist()
        for depth in range(1, 6):
            prefixes = [tuple(rows[r][: depth * block]) for r in members if len(rows[r]) >= depth * block]
            seen, last = set(), None
            for p in prefixes:
                assert p == last or p not in seen, f"prefix of depth {depth} is split inside group {g}"
                seen.add(p)
                last = p


def test_the_order_and_groups_do_not_depend_on_the_expected_answer_lengths():
    rows = [[g + 1] * 8 + [i] for g in range(4) for i in range(3)] + [[9] * 3]
    short, long_ = plan_of(rows, decode=[5] * 13), plan_of(rows, decode=list(range(1, 400, 31)))
    assert short.order.tolist() == long_.order.tolist()
    assert short.group_of_row.tolist() == long_.group_of_row.tolist()


def test_empty_and_zero_length_rows():
    plan = plan_of([])
    assert plan.num_rows == 0 and plan.unique_tokens == 0
    plan = plan_of([[], [1, 2, 3, 4, 5]])
    assert plan.unique_tokens == 5 and plan.num_groups == 2


def test_decode_estimate_must_match_rows():
    tokens, offsets = flat([[1, 2]])
    with pytest.raises(ValueError, match="decode_tokens"):
        plan_token_ids(tokens, offsets, np.array([1, 2]), 4)


def brute_force_paid(rows, block, order, part):
    """Tokens each row computes on its shard's engine with a perfect cache, rows run in ``order``."""
    seen, paid = set(), {}
    for row in order:
        tokens = rows[row]
        full = len(tokens) // block
        new = [k for k in range(1, full + 1) if (part[row], tuple(tokens[: k * block])) not in seen]
        seen.update((part[row], tuple(tokens[: k * block])) for k in range(1, full + 1))
        paid[row] = len(new) * block + len(tokens) - full * block
    return [paid[r] for r in range(len(rows))]


@pytest.mark.parametrize("shards", [1, 3, 40])  # 40 shards: more shards than groups
def test_each_shard_pays_for_the_prefixes_it_reaches_first(shards):
    """A shard's prefill is what its own engine computes with a perfect cache, its rows run in plan
    order: a prefix two shards reach is paid by each."""
    rng = np.random.default_rng(shards)
    stems = [rng.integers(0, 50, 12).tolist() for _ in range(4)]
    rows = [stems[rng.integers(4)][: rng.integers(4, 13)] + rng.integers(0, 50, rng.integers(0, 9)).tolist()
            for _ in range(40)]
    plan = plan_of(rows, block=4, decode=rng.integers(1, 30, len(rows)), shards=shards)
    paid = np.array(brute_force_paid(rows, 4, plan.order, plan.shard_of_row))
    assert plan.num_shards == shards
    assert plan.shards.prefill_tokens.tolist() == np.bincount(plan.shard_of_row, weights=paid,
                                                              minlength=shards).astype(int).tolist()
    assert plan.row_unique_tokens.tolist() == brute_force_paid(rows, 4, plan.order, np.zeros(len(rows), int))
