"""The prefix tree: the test oracle of the planner (``engine.plan.sorted_plan``'s queries are held
equal to it, ``tests/test_sorted_plan.py``). It was the planner in memory until every plan was made
by the queries (one planner to keep right); what follows is how it plans.

Global prefix plan: find the prefixes the rows of a whole batch share, form groups, order rows.

The batch is each row's length and chained block hashes (``RowBlocks``: computed from the token
ids, or read from the token cache). We build the prefix tree at the granularity vLLM caches, whole
KV blocks: the node of a row at depth ``k`` is its ``k``-th chained hash, so two rows share a node
exactly when they share those tokens (up to hash collisions, ~n^2 / 2^64). Everything is vectorized
per depth (numpy sort/unique), never a Python object per token, so a million rows plan in seconds.

Groups follow BatchLLM's MaximizeReuse: a row belongs to the root child ``c`` it starts with (the
longest prefix all rows of that first block share), unless the deepest node ``g`` it shares with
other rows is worth a group of its own: ``(rows(g) - 1) * (len(g) - len(c)) - len(c) > 0``.

Order is depth first (nested prefixes, a system prompt shared by all rows and a document shared by
a few, stay contiguous and every level can be reused), siblings by hash: the rows sorted by their
chained block hashes, as sorting rows by text puts sharers together, and each subtree ordered on
its own. No order by expected output: BatchLLM runs the rows that decode longest first (more steps
than this order on the bench's stand-in) and an earlier version of this planner interleaved them
with rows that mostly prefill (BlendServe's point, arXiv 2411.16102), which on real vLLM ran no
faster on any bench shape and 3-6% slower where vLLM admits (docs/benchmark.md, "The plan order by
hash"). An order of its own per subtree is also what lets a plan be made out of core.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from engine.plan.batch_plan import PrefixPlan
from engine.plan.block_hashes import RowBlocks, rows_by_depth
from engine.plan.duplicates import lowest_row_of_set


@dataclass
class _Level:
    """The tree's nodes at one depth, or at ``depths`` consecutive depths with the same rows and the
    same nodes (a stretch where no row ends and no node splits: a system prompt, a document): which
    rows reach them and which node each row is in. One level for such a stretch is a radix tree's
    compressed edge: the levels hold 4 bytes a row per depth where the tree branches, not per
    shared block (a 1,000-token system prompt is 31 blocks of 32 and one level). Node numbers and
    counts are int32."""

    rows: np.ndarray  # row indices with a full block at these depths (a view of one array for every level)
    node: np.ndarray  # node index (0..n_nodes-1) of each of those rows
    counts: np.ndarray  # rows per node
    depths: int = 1  # consecutive depths this level stands for


def _depth_count(levels: list[_Level]) -> int:
    return sum(level.depths for level in levels)


def _appended(levels: list[_Level], level: _Level) -> None:
    """``level`` (the next depth) added to ``levels``, as one more depth of the last level where it
    has the same rows and nodes. The nodes of a depth refine the ones above (chained hashes: rows in
    one node share every block above it), so the same rows in as many nodes are the same nodes."""
    last = levels[-1] if levels else None
    if last is not None and last.rows.size == level.rows.size and last.counts.size == level.counts.size:
        last.depths += level.depths
    else:
        levels.append(level)


@dataclass
class TreePlan(PrefixPlan):
    """A plan with the tree it was made from (what ``unique_tokens_per_row`` counts a part's tokens from)."""

    levels: list[_Level] = field(default_factory=list, repr=False)
    copies: np.ndarray | None = None  # rows identical to an earlier row: they follow it and compute nothing


def _hashes_by_depth(blocks: RowBlocks, deepest_first: np.ndarray, reaching: np.ndarray) -> Iterator[np.ndarray]:
    """Depth by depth (``rows_by_depth``), the hashes at that depth of the rows reaching it:
    ``deepest_first[:reaching[k + 1]]`` at depth ``k`` (what the tree is built from)."""
    first = blocks.offsets
    for depth in range(reaching.size - 1):
        yield blocks.hashes[first[deepest_first[: reaching[depth + 1]]] + depth]


def _build_levels(chains: RowBlocks) -> tuple[np.ndarray, list[_Level]]:
    """Tree levels from the root down, stopping once no node is shared (deeper ones cannot be), and
    the rows deepest first (each level's rows are a prefix of it)."""
    deepest_first, reaching = rows_by_depth(chains.lengths // chains.block_size)
    levels: list[_Level] = []
    for depth, hashes in enumerate(_hashes_by_depth(chains, deepest_first, reaching)):
        _, node, counts = np.unique(hashes, return_inverse=True, return_counts=True)
        del hashes
        _appended(levels, _Level(rows=deepest_first[: reaching[depth + 1]], node=node.astype(np.int32),
                                 counts=counts.astype(np.int32)))
        if counts.max() < 2:
            break
    return deepest_first, levels


def _levels_without(levels: list[_Level], deepest_first: np.ndarray,
                    removed: np.ndarray) -> tuple[np.ndarray, list[_Level]]:
    """The levels of the tree of the rows not ``removed`` (a mask over rows): what ``_build_levels``
    makes of them alone. A level's rows keep their order (a prefix of one array, as built), its
    nodes keep theirs (numbered by hash), those no row reaches now dropped; levels that became the
    same nodes are one; it stops where the tree of fewer rows stops (a depth no node of which two
    rows share now)."""
    deepest_first = deepest_first[~removed[deepest_first]]
    out: list[_Level] = []
    for level in levels:
        kept = ~removed[level.rows]
        if not kept.any():
            break
        counts = np.bincount(level.node[kept], minlength=level.counts.size)
        renumbered = (np.cumsum(counts > 0) - 1).astype(np.int32)
        counts = counts[counts > 0].astype(np.int32)
        shared = counts.max() >= 2  # else the tree stops at the first of these depths
        _appended(out, _Level(rows=deepest_first[: int(kept.sum())], node=renumbered[level.node[kept]],
                              counts=counts, depths=level.depths if shared else 1))
        if not shared:
            break
    return deepest_first, out


def _group_depths(levels: list[_Level], n: int, min_group_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """MaximizeReuse: each row's group depth (in blocks; 0 = no group) and node at that depth."""
    # Depths and counts of rows fit int32 (n < 2^31): half the memory of int64 per-row arrays.
    shared_depth = np.zeros(n, dtype=np.int32)  # deepest depth shared with min_group_rows - 1 others
    shared_count = np.zeros(n, dtype=np.int32)
    root_depth = np.zeros(n, dtype=np.int32)  # depth of the root child's compressed edge
    root_count = np.zeros(n, dtype=np.int32)
    end = 0  # the deepest depth of this level (its last, counted from 1)
    for k, level in enumerate(levels):
        end += level.depths
        count = level.counts[level.node]
        if k == 0:
            root_count[level.rows] = count
        shared = count >= min_group_rows
        shared_depth[level.rows[shared]] = end
        shared_count[level.rows[shared]] = count[shared]
        same_as_root = shared & (count == root_count[level.rows])
        root_depth[level.rows[same_as_root]] = end
    worth_own_group = (shared_count - 1).astype(np.int64) * (shared_depth - root_depth) - root_depth > 0
    depth = np.where(worth_own_group, shared_depth, root_depth)
    del shared_count, worth_own_group

    node_at_depth = np.full(n, -1, dtype=np.int64)
    node_base, end = 0, 0  # global node ids: levels numbered one after the other
    for level in levels:
        end += level.depths  # a group's depth is a level's deepest (a node's rows share all of its depths)
        here = depth[level.rows] == end
        node_at_depth[level.rows[here]] = node_base + level.node[here]
        node_base += level.counts.size
    return depth, node_at_depth


def _depth_first_order(levels: list[_Level], n: int) -> np.ndarray:
    """Depth-first order of the tree: rows by their chain of nodes (siblings by hash, rows that end
    above a depth before those that reach it), then by index: the rows sorted by their block
    hashes. Each subtree's order is its own, so the order is a sort a planner out of core can make.

    A stable sort per depth from the deepest up (LSD radix style) keeps memory at O(rows). A level
    of several depths is sorted by once: rows equal at its first depth are in one node at each of
    its depths, so its deeper depths break no tie.
    """
    order = np.arange(n)
    for level in reversed(levels):
        # Rows ending above this depth come first (-1). Few nodes: 16-bit keys, which numpy's
        # stable sort orders by radix, far faster than a comparison sort on a million rows.
        key = np.full(n, -1, dtype=np.int16 if level.counts.size < 2**15 else np.int32)
        key[level.rows] = level.node
        order = order[np.argsort(key[order], kind="stable")]
    return order


def unique_tokens_per_row(plan: TreePlan, order: np.ndarray, part: np.ndarray | None = None) -> np.ndarray:
    """Prompt tokens each row computes when rows run in ``order`` with a perfect prefix cache.

    The first row (in order) to reach a tree node pays its block; with ``part`` (a shard per row)
    each shard pays for its own first occurrence, as separate engines would.
    """
    lengths, block_size = plan.lengths, plan.block_size
    n = lengths.size
    positions = np.int32 if n < 2**31 else np.int64  # half the bytes a row of int64 while the levels are read
    position = np.empty(n, dtype=positions)
    position[order] = np.arange(n, dtype=positions)
    paid = lengths // block_size - _depth_count(plan.levels)  # in place: one array of every row at a time
    np.maximum(paid, 0, out=paid)
    paid *= block_size
    paid += lengths % block_size  # unshared depths and tails
    shards = 1 if part is None else int(part.max(initial=0)) + 1
    for level in plan.levels:
        rows, key, size = level.rows, level.node, level.counts.size
        if part is not None:
            # Key each row by (node, shard); node ids are dense, so the pairs index an array directly
            # unless nodes x shards is large (the deepest levels), where the pairs present are
            # numbered, after the rows alone in their node (most there) pay, wherever they run.
            if size * shards > 4 * n:
                alone = level.counts[key] == 1
                paid[rows[alone]] += block_size * level.depths
                rows, key = rows[~alone], key[~alone]
                del alone
            key, size = key.astype(np.int64), size * shards
            key *= shards
            key += part[rows]
            if size > 4 * n:
                _, key = np.unique(key, return_inverse=True)
                size = int(key.max(initial=-1)) + 1
        at = position[rows]
        first = np.full(size, n, dtype=positions)
        np.minimum.at(first, key, at)
        paid[rows[at == first[key]]] += block_size * level.depths  # the same first row at each depth
        del at, first, key
    if plan.copies is not None:
        paid[plan.copies] = 0  # identical to the row before them: its answer, nothing computed
    return paid


def build_plan(
    tokens: np.ndarray,
    offsets: np.ndarray,
    decode_tokens: np.ndarray,
    block_size: int,
    min_group_rows: int = 2,
    duplicate_set: np.ndarray | None = None,
) -> TreePlan:
    """Plan a batch from its token ids (``tokens[offsets[i]:offsets[i+1]]`` is row ``i``)."""
    return plan_blocks(RowBlocks.of_tokens(tokens, offsets, block_size), decode_tokens, min_group_rows, duplicate_set)


def plan_blocks(blocks: RowBlocks, decode_tokens: np.ndarray, min_group_rows: int = 2,
                duplicate_set: np.ndarray | None = None) -> TreePlan:
    """Plan a batch from its rows' lengths and block hashes (no token ids needed). Rows of one
    ``duplicate_set`` (engine.plan.duplicates) are planned once: the others follow the first in its group."""
    return PrefixTree.of(blocks, duplicate_set).plan(decode_tokens, min_group_rows)


@dataclass
class PrefixTree:
    """A batch's prefix tree (its levels) with its rows' lengths: what a plan is made of, without
    the block hashes it was built from (read a depth at a time: 8 bytes a block, never all held at
    once by the token cache's rows)."""

    block_size: int
    lengths: np.ndarray  # prompt tokens per row
    levels: list[_Level]
    deepest_first: np.ndarray  # the rows by whole blocks, most first: each level's rows are a prefix
    source: np.ndarray  # each row's source: itself, or the lowest row of its duplicate set
    copies: np.ndarray  # rows identical to an earlier row (their source)

    @classmethod
    def of(cls, chains: RowBlocks, duplicate_set: np.ndarray | None = None) -> "PrefixTree":
        """The tree of the distinct rows: a row of a ``duplicate_set`` other than its first is left out."""
        n = chains.lengths.size
        deepest_first, levels = _build_levels(chains) if n else (np.zeros(0, np.int64), [])
        tree = cls(chains.block_size, np.asarray(chains.lengths, dtype=np.int64), levels, deepest_first,
                   np.arange(n), np.zeros(n, dtype=bool))
        return tree.planned(np.zeros(0, np.int64), duplicate_set) if duplicate_set is not None else tree

    def planned(self, dropped: np.ndarray, duplicate_set: np.ndarray | None) -> "PrefixTree":
        """The tree the plan runs: ``dropped`` rows (they cannot run) emptied, and of each
        ``duplicate_set`` only its first row in the tree, the others its copies. The same tree as
        one built from those rows alone (``tests/test_prefix_tree.py``), made from this one's levels
        without reading a hash again."""
        n = self.lengths.size
        source = lowest_row_of_set(duplicate_set, n)
        copies = source != np.arange(n)
        removed = copies | self.copies
        removed[dropped] = True
        lengths = self.lengths.copy()
        lengths[dropped] = 0
        deepest_first, levels = (_levels_without(self.levels, self.deepest_first, removed) if removed.any()
                                 else (self.deepest_first, self.levels))
        return PrefixTree(self.block_size, lengths, levels, deepest_first, source, copies)

    def plan(self, decode_tokens: np.ndarray, min_group_rows: int = 2) -> TreePlan:
        """Groups (MaximizeReuse) and the run order (see the module doc)."""
        return _plan_tree(self, decode_tokens, min_group_rows)


def _plan_tree(tree: PrefixTree, decode_tokens: np.ndarray, min_group_rows: int) -> TreePlan:
    lengths, block_size, levels, source, copies = tree.lengths, tree.block_size, tree.levels, tree.source, tree.copies
    n = lengths.size
    decode_tokens = np.asarray(decode_tokens, dtype=np.int64)
    if decode_tokens.size != n:
        raise ValueError(f"decode_tokens has {decode_tokens.size} entries for {n} rows")
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return TreePlan(block_size, lengths, decode_tokens, empty, empty, empty, empty, empty, 0)

    if copies.any():  # a copy decodes nothing
        decode_tokens = np.where(copies, 0, decode_tokens)
    depth, group_node = _group_depths(levels, n, min_group_rows)
    if copies.any():  # a copy is in its source's group
        depth, group_node = depth[source], group_node[source]
    dfs = _depth_first_order(levels, n)
    if copies.any():  # each copy right after its source
        position = np.empty(n, dtype=np.int64)
        position[dfs] = 2 * np.arange(n)
        dfs = np.argsort(np.where(copies, position[source] + 1, position), kind="stable")
        del position

    # Rows without a group get a key of their own; groups are numbered by first appearance in dfs.
    group_key = np.where(group_node >= 0, group_node, -1 - source)
    del group_node  # each array of every row let go once used: what planning holds at once is its memory
    _, first_pos, key_of_row = np.unique(group_key[dfs], return_index=True, return_inverse=True)
    del group_key
    group_rank = np.empty(first_pos.size, dtype=np.int64)
    group_rank[np.argsort(first_pos, kind="stable")] = np.arange(first_pos.size)
    group_in_dfs = group_rank[key_of_row]
    del key_of_row, group_rank
    group_of_row = np.empty(n, dtype=np.int64)
    group_of_row[dfs] = group_in_dfs
    group_sizes = np.bincount(group_of_row, minlength=first_pos.size)
    group_prefix_tokens = np.zeros(first_pos.size, dtype=np.int64)
    group_prefix_tokens[group_of_row] = depth * block_size
    del depth
    order = dfs[np.argsort(group_in_dfs, kind="stable")]
    del dfs, group_in_dfs

    plan = TreePlan(
        block_size=block_size,
        lengths=lengths,
        decode_tokens=decode_tokens,
        order=order,
        group_of_row=group_of_row,
        group_prefix_tokens=group_prefix_tokens,
        group_sizes=group_sizes,
        row_unique_tokens=np.zeros(0, dtype=np.int64),  # counted next, from the plan's order and levels
        unique_tokens=0,
        levels=levels,
        copies=copies if copies.any() else None,
    )
    plan.row_unique_tokens = unique_tokens_per_row(plan, order)
    plan.unique_tokens = int(plan.row_unique_tokens.sum())
    return plan
