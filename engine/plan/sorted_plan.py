"""The prefix plan made by sorts and aggregates that spill to disk (DuckDB): memory flat in the rows.

The plan of a prefix tree (groups by MaximizeReuse, the rows sorted by their chained block
hashes, each group gathered where its first row falls, the tokens each row computes), made from a
table instead of arrays held in memory: one row per prompt row, ``(row, length, hashes, source,
decode)``, where ``hashes`` is the row's chained block hashes, ``source`` the lowest row of its
duplicate set (itself for most) and a row that cannot run has length 0 and no hashes. Each step is
a query over tables in a database file of its own, under ``bounded_memory``: DuckDB sorts, joins
and aggregates beyond its memory limit by spilling, so the plan of 3M rows takes what 1M do.

Why each query is a step of the tree's plan (the tree is never built; it is the test oracle,
``tests/oracle/prefix_tree.py``):
- a node is a hash (chained hashes: equal at depth ``k`` means the same first ``k`` blocks), its
  rows the rows with that hash; node counts only fall with depth along a row's path;
- so a row's deepest node of at least ``min_group_rows`` rows is its deepest depth whose count
  qualifies, its root child's count is that of its first hash, and the deepest node holding every
  row of its root child is its deepest depth of that count (MaximizeReuse then picks one of the two);
- depth first, siblings by hash, is ``ORDER BY hashes``: DuckDB compares lists item by item, a
  list before the longer ones it starts (a row that ends above a depth first); identical chains by
  source row, a copy right after its source;
- the row that computes a node's block is the node's row first in run order (``arg_min``); beyond the
  shared depths every node has one row, which computes it: the same count as the tree's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..table.dataset import bounded_memory
from .block_hashes import RowBlocks
from .duplicates import lowest_row_of_set

# DuckDB's memory for a plan (more on many threads: ``bounded_memory``). It spills the rest, no
# slower than in 1 GiB; less ran out of memory (docs/benchmark-history.md, "Measurements behind
# code choices").
PLAN_MEMORY_MIB = 256

ROWS_SCHEMA = pa.schema([("row", pa.int64()), ("length", pa.int64()), ("hashes", pa.large_list(pa.uint64())),
                         ("source", pa.int64()), ("decode", pa.int64())])

# Each statement one step; {m} is min_group_rows, {b} the block size. ``rows_in`` is the input.
_STEPS = [
    # Every block of every row the tree holds (copies follow their source and hold none).
    """CREATE TABLE blocks AS
       SELECT row, unnest(generate_series(1, len(hashes))) AS depth, unnest(hashes) AS hash
       FROM rows_in WHERE row = source AND len(hashes) > 0""",
    # The nodes of at least min_group_rows rows: the only ones a group can be (most nodes are one row's).
    "CREATE TABLE nodes AS SELECT hash, count(*)::BIGINT AS rows FROM blocks GROUP BY hash HAVING count(*) >= {m}",
    # MaximizeReuse per row over its shared nodes (a row with none is in no group): its root child's
    # edge, or its deepest shared node where worth a group. Counts fall with depth, so the root
    # child (depth 1) has the row's largest count, its edge the deepest depth of that count (the
    # largest (rows, depth) pair), and the deepest shared node the smallest count.
    """CREATE TABLE group_depth AS
       SELECT row, CASE WHEN (shared_count - 1) * (shared_depth - root.depth) - root.depth > 0
                        THEN shared_depth ELSE root.depth END AS depth
       FROM (SELECT b.row, max(b.depth) AS shared_depth, min(n.rows) AS shared_count,
                    max({{'rows': n.rows, 'depth': b.depth}}) AS root
             FROM blocks b JOIN nodes n ON n.hash = b.hash GROUP BY b.row)""",
    # The depth-first position, and each row's group: its node's hash, or the row itself (its source).
    """CREATE TABLE depth_first AS
       SELECT i.row, i.source, i.length, i.decode, coalesce(g.depth, 0) AS depth,
              CASE WHEN g.depth > 0 THEN i.hashes[g.depth] END AS node,
              CASE WHEN coalesce(g.depth, 0) = 0 THEN i.source END AS alone,
              row_number() OVER (ORDER BY i.hashes, i.source, i.row) AS dfs
       FROM rows_in i LEFT JOIN group_depth g ON g.row = i.source""",
    # Groups in the order their first row comes depth first; a group's rows together from there.
    """CREATE TABLE ordered AS
       SELECT *, row_number() OVER (ORDER BY first, dfs) - 1 AS position,
              dense_rank() OVER (ORDER BY first) - 1 AS grp
       FROM (SELECT *, min(dfs) OVER (PARTITION BY node, alone) AS first FROM depth_first)""",
    # The row that computes each node: its first in run order.
    """CREATE TABLE paid AS
       SELECT payer AS row, count(*) AS blocks
       FROM (SELECT arg_min(b.row, o.position) AS payer FROM blocks b JOIN ordered o ON o.row = b.row
             GROUP BY b.hash)
       GROUP BY payer""",
    """CREATE TABLE plan AS
       SELECT o.row, o.source, o.length, o.position, o.grp, o.depth * {b} AS prefix_tokens,
              CASE WHEN o.row = o.source THEN coalesce(p.blocks, 0) * {b} + o.length % {b} ELSE 0 END AS unique_tokens,
              CASE WHEN o.row = o.source THEN o.decode ELSE 0 END AS decode
       FROM ordered o LEFT JOIN paid p ON p.row = o.row""",
]
_SCRATCH = ["nodes", "group_depth", "depth_first", "ordered", "paid"]  # ``blocks`` stays: shards count from it


@dataclass
class SortedPlan:
    """A plan in a DuckDB database file: the table ``plan`` of ``(row, source, length, position,
    grp, prefix_tokens, unique_tokens, decode)``, one entry per input row, and ``blocks`` (each block of
    the rows the tree holds: ``row, depth, hash``), which a shard's first reach of a node is counted
    from. ``connection`` is open on it."""

    connection: object  # duckdb.DuckDBPyConnection
    block_size: int

    def close(self) -> None:
        self.connection.close()


def open_plan_database(folder: Path):
    """A DuckDB database file in ``folder`` for a plan, held to ``bounded_memory`` and spilling there."""
    import duckdb

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(str(folder / "plan.duckdb"),
                         config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    bounded_memory(con, folder, PLAN_MEMORY_MIB)
    con.execute("SET preserve_insertion_order = false")  # no step needs it; keeping it costs memory
    return con


def plan_rows(con, block_size: int, min_group_rows: int = 2) -> SortedPlan:
    """Plan the relation ``rows_in`` (``ROWS_SCHEMA``'s columns: a table, a view or registered Arrow)
    of ``con`` into its table ``plan``."""
    if min_group_rows < 2:
        raise ValueError(f"min_group_rows must be >= 2, not {min_group_rows}")  # node counts of 1 are not the tree's
    for step in _STEPS:
        con.execute(step.format(m=int(min_group_rows), b=int(block_size)))
    for table in _SCRATCH:
        con.execute(f"DROP TABLE {table}")
    return SortedPlan(con, block_size)


def plan_by_sort(rows: pa.Table | pa.RecordBatchReader, block_size: int, folder: Path,
                 min_group_rows: int = 2) -> SortedPlan:
    """Plan ``rows`` (``ROWS_SCHEMA``) in a database file under ``folder``. The caller closes the
    plan (and removes ``folder``)."""
    con = open_plan_database(folder)
    con.register("rows_in", rows)
    try:
        return plan_rows(con, block_size, min_group_rows)
    finally:
        con.unregister("rows_in")


def rows_of_blocks(blocks: RowBlocks, decode_tokens: np.ndarray, duplicate_set: np.ndarray | None = None,
                   dropped: np.ndarray | None = None) -> pa.Table:
    """``plan_by_sort``'s input from rows in memory, as ``batch_plan.plan_blocks`` takes them: ``dropped`` rows
    (they cannot run) emptied, each ``duplicate_set`` planned once."""
    n = blocks.num_rows
    if dropped is not None and len(dropped):
        blocks = blocks.without(dropped)
    offsets = blocks.offsets
    hashes = pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(blocks.hashes, pa.uint64()))
    source = lowest_row_of_set(duplicate_set, n) if duplicate_set is not None else np.arange(n)
    return pa.table([pa.array(np.arange(n)), pa.array(blocks.lengths), hashes, pa.array(source),
                     pa.array(np.asarray(decode_tokens, dtype=np.int64))], schema=ROWS_SCHEMA)
