"""The prefix tree, the planner's test oracle (``tests/oracle/prefix_tree.py``): its levels, its
depth-first order and what a planner out of core relies on, checked by brute force."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.plan.block_hashes import RowBlocks, rows_by_depth
from engine.plan.duplicates import NO_SET, lowest_row_of_set

from .oracle.prefix_tree import (
    PrefixTree,
    _depth_count,
    _depth_first_order,
    _Level,
    build_plan,
    plan_blocks,
    unique_tokens_per_row,
)
from .test_plan import brute_force_paid, brute_force_unique_tokens, flat


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


@pytest.mark.parametrize("shards", [1, 3, 40])  # 40 shards: more (node, shard) pairs than rows
def test_each_shard_pays_for_the_prefixes_it_reaches_first(shards):
    rng = np.random.default_rng(shards)
    stems = [rng.integers(0, 50, 12).tolist() for _ in range(4)]
    rows = [stems[rng.integers(4)][: rng.integers(4, 13)] + rng.integers(0, 50, rng.integers(0, 9)).tolist()
            for _ in range(40)]
    plan = build_plan(*flat(rows), np.full(len(rows), 10), 4)
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
    assert build_plan(*flat(rows), np.full(len(rows), 10), 2).unique_tokens == brute_force_unique_tokens(rows, 2)
