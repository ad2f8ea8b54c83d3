"""The prefix plan on hand-made token sequences, checked against brute force."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.plan.block_hashes import RowBlocks, rows_by_depth
from engine.plan.duplicates import NO_SET, lowest_row_of_set
from engine.plan.prefix_tree import (
    PrefixTree,
    _depth_count,
    _depth_first_order,
    _Level,
    build_plan,
    plan_blocks,
    unique_tokens_per_row,
)

from .conftest import group_rows


def flat(rows):
    offsets = np.cumsum([0] + [len(r) for r in rows])
    tokens = np.concatenate([np.asarray(r, dtype=np.int32) for r in rows]) if rows else np.zeros(0, np.int32)
    return tokens, offsets


def plan_of(rows, block=4, decode=None):
    tokens, offsets = flat(rows)
    decode = np.full(len(rows), 10) if decode is None else np.asarray(decode)
    return build_plan(tokens, offsets, decode, block)


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


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=40))
def test_the_depth_first_order_is_the_rows_sorted_by_their_block_hashes(rows):
    """Siblings by hash, a row that ends above a depth before the rows that reach it, then by index:
    each subtree ordered on its own, so a sort of hash chains (out of core too) makes this order."""
    blocks = RowBlocks.of_tokens(*flat(rows), 2)
    tree = PrefixTree.of(blocks)
    depths = _depth_count(tree.levels)

    def key(row):
        chain = blocks.chain(row)
        return tuple(chain[d] if d < len(chain) else -1 for d in range(depths)) + (row,)

    assert _depth_first_order(tree.levels, len(rows)).tolist() == sorted(range(len(rows)), key=key)


def _identical_rows(rows) -> np.ndarray:
    first = {}
    return np.array([first.setdefault(tuple(r), i) if rows.count(r) > 1 else NO_SET for i, r in enumerate(rows)])


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 2), max_size=10), min_size=1, max_size=40), data=st.data())
def test_buckets_of_whole_subtrees_planned_apart_make_the_plan_of_the_whole(rows, data):
    """What a planner out of core relies on: rows cut by the hash of their first block into ranges
    (rows without a whole block first) and each range planned on its own give the whole batch's
    plan: the ranges' orders one after the other, groups numbered on, the same prefixes and tokens."""
    blocks = RowBlocks.of_tokens(*flat(rows), 2)
    n = len(rows)
    decode = np.array(data.draw(st.lists(st.integers(1, 50), min_size=n, max_size=n)))
    same = _identical_rows(rows)
    whole = plan_blocks(blocks, decode, duplicate_set=same)

    first_hash = {r: blocks.chain(r)[0] for r in range(n) if blocks.blocks[r]}
    cuts = sorted(data.draw(st.sets(st.sampled_from(sorted(set(first_hash.values())) or [0]))))
    bucket = np.array([0 if r not in first_hash else 1 + sum(first_hash[r] >= c for c in cuts) for r in range(n)])
    order, groups_before = [], 0
    for b in range(len(cuts) + 2):
        members = np.flatnonzero(bucket == b)
        if not members.size:
            continue
        part = plan_blocks(RowBlocks.of_tokens(*flat([rows[r] for r in members]), 2), decode[members],
                           duplicate_set=_identical_rows([rows[r] for r in members]))
        order += members[part.order].tolist()
        assert whole.group_of_row[members].tolist() == (part.group_of_row + groups_before).tolist()
        assert (whole.group_prefix_tokens[whole.group_of_row[members]].tolist()
                == part.group_prefix_tokens[part.group_of_row].tolist())
        assert whole.row_unique_tokens[members].tolist() == part.row_unique_tokens.tolist()
        groups_before += part.num_groups
    assert order == whole.order.tolist() and groups_before == whole.num_groups


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
        build_plan(tokens, offsets, np.array([1, 2]), 4)


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


@pytest.mark.parametrize("shards", [1, 3, 40])  # 40 shards: more (node, shard) pairs than rows
def test_each_shard_pays_for_the_prefixes_it_reaches_first(shards):
    rng = np.random.default_rng(shards)
    stems = [rng.integers(0, 50, 12).tolist() for _ in range(4)]
    rows = [stems[rng.integers(4)][: rng.integers(4, 13)] + rng.integers(0, 50, rng.integers(0, 9)).tolist()
            for _ in range(40)]
    plan = plan_of(rows, block=4)
    order = rng.permutation(len(rows))
    part = rng.integers(0, shards, len(rows))
    assert unique_tokens_per_row(plan, order, part).tolist() == brute_force_paid(rows, 4, order, part)
    assert unique_tokens_per_row(plan, order).tolist() == brute_force_paid(rows, 4, order, np.zeros(len(rows), int))


def _levels(tree):
    return [(level.rows.tolist(), level.node.tolist(), level.counts.tolist(), level.depths) for level in tree.levels]


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=40), data=st.data())
def test_a_tree_without_some_rows_is_the_tree_built_from_the_others_alone(rows, data):
    """The plan step builds the tree of every row (the token cache's rows, a depth at a time) and
    then leaves out the rows that cannot run and all but the first of identical rows: the same
    levels (rows, nodes, counts, depth) as a tree built from the rows left alone."""
    n = len(rows)
    blocks = RowBlocks.of_tokens(np.array([t for r in rows for t in r], np.int32),
                                 np.concatenate([[0], np.cumsum([len(r) for r in rows])]), 2)
    dropped = np.array(sorted(data.draw(st.sets(st.integers(0, n - 1)))), dtype=np.int64)
    sets = data.draw(st.lists(st.integers(-1, 4), min_size=n, max_size=n))
    duplicate_set = np.array([NO_SET if s < 0 or i in set(dropped.tolist()) else s for i, s in enumerate(sets)])
    got = PrefixTree.of(blocks).planned(dropped, duplicate_set)
    copies = lowest_row_of_set(duplicate_set, n) != np.arange(n)
    alone = PrefixTree.of(blocks.without(np.flatnonzero(copies).tolist() + dropped.tolist()))
    assert _levels(got) == _levels(alone)
    assert got.lengths[dropped].sum() == 0 and np.array_equal(got.copies, copies)
    assert np.array_equal(PrefixTree.of(blocks, duplicate_set).copies, copies)


def _one_level_per_depth(tree: PrefixTree, blocks: RowBlocks) -> PrefixTree:
    """The same tree with a level at every depth, each node numbered by its hash at that depth (the
    levels before stretches of the same nodes became one level)."""
    _, reaching = rows_by_depth(blocks.blocks)
    levels = []
    for depth in range(_depth_count(tree.levels)):
        rows = tree.deepest_first[: reaching[depth + 1]]
        hashes = np.array([blocks.chain(int(r))[depth] for r in rows], dtype=np.uint64)
        _, node, counts = np.unique(hashes, return_inverse=True, return_counts=True)
        levels.append(_Level(rows, node.astype(np.int32), counts.astype(np.int32)))
    return PrefixTree(tree.block_size, tree.lengths, levels, tree.deepest_first, tree.source, tree.copies)


@settings(max_examples=200, deadline=None)
@given(shared=st.lists(st.integers(0, 1), max_size=10),
       rows=st.lists(st.lists(st.integers(0, 1), max_size=10), min_size=1, max_size=30), data=st.data())
def test_a_stretch_of_the_same_nodes_is_one_level_and_plans_as_a_level_per_depth(shared, rows, data):
    """Where no row ends and no node splits (a system prompt, a document) the tree keeps one level:
    the plan (groups, order, prefixes, tokens each row and each shard computes) is the one of a
    level per depth."""
    rows = [shared + r if data.draw(st.booleans()) else r for r in rows]
    blocks = RowBlocks.of_tokens(*flat(rows), 2)
    tree = PrefixTree.of(blocks)
    per_depth = _one_level_per_depth(tree, blocks)
    assert _depth_count(tree.levels) == len(per_depth.levels)
    decode = np.array(data.draw(st.lists(st.integers(0, 9), min_size=len(rows), max_size=len(rows))))
    got, expected = tree.plan(decode), per_depth.plan(decode)
    for name in ("order", "group_of_row", "group_prefix_tokens", "group_sizes", "row_unique_tokens"):
        assert np.array_equal(getattr(got, name), getattr(expected, name)), name
    part = np.array(data.draw(st.lists(st.integers(0, 2), min_size=len(rows), max_size=len(rows))))
    assert np.array_equal(unique_tokens_per_row(got, got.order, part), unique_tokens_per_row(expected, got.order, part))


def test_a_long_shared_prompt_is_one_level():
    """40 rows behind 30 blocks of one system prompt, 4 documents of 10 blocks each asked 10
    questions: three levels (the prompt, the documents, the questions), not one per block."""
    system = list(range(1000, 1060))
    rows = [system + [d] * 20 + [100 + q, 200 + d] for d in range(4) for q in range(10)]
    tree = PrefixTree.of(RowBlocks.of_tokens(*flat(rows), 2))
    assert [(level.depths, level.counts.size) for level in tree.levels] == [(30, 1), (10, 4), (1, 40)]
    assert plan_of(rows, block=2).unique_tokens == brute_force_unique_tokens(rows, 2)
