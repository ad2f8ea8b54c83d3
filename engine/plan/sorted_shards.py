"""Shards of a plan (``sorted_plan``), cut by queries (``shard_cut``'s rule; the same shards as the
test oracle's ``tests/oracle/shards.py`` gives the tree's plan): contiguous runs of the run order
balanced by cost (a row's tokens computed plus ``decode_cost`` per expected output token), a group
cut only when it alone costs more than its shard's share; with the previous night's shard of each
row, a group whose rows were all in one shard stays there and the others go, in plan order, to the
shard least loaded for its weight, unless that leaves the shards unbalanced by more than
``max_imbalance`` (then the cut is made afresh). Costs are sums of whole tokens times
``decode_cost``: exact in doubles in any order of summing while ``decode_cost`` is a whole number
(the default 2), so the window sums here and numpy's running sums agree to the token.

Only the groups left to place (new or moved) pass through Python, a batch at a time, as in memory
they pass through a loop; every other step is a query over the plan's tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .shard_cut import DECODE_COST, shard_weights
from .sorted_plan import SortedPlan

_GROUP_BATCH = 65_536  # groups placed at a time when they move


@dataclass
class ShardTotals:
    """Per shard, what ``ShardPlan`` holds besides each row's shard (that is the table ``shards``
    of ``(row, shard)`` in the plan's database)."""

    prefill_tokens: np.ndarray
    decode_tokens: np.ndarray
    estimated_cost: np.ndarray
    split_groups: int


def assign_shards_by_sort(plan: SortedPlan, num_shards: int, weights: list[float] | None = None,
                          decode_cost: float = DECODE_COST, previous: bool = False,
                          max_imbalance: float = 1.25) -> ShardTotals:
    """Each row's shard into the table ``shards``; the totals per shard. ``previous``: the plan's
    database holds ``previous_shards(row, shard)`` (-1 or no entry: a row new tonight)."""
    con, weight = plan.connection, shard_weights(weights, num_shards)
    _costed(con, decode_cost)
    too_big = None
    previous = previous and con.execute("SELECT count(*) FROM previous_shards WHERE shard >= 0").fetchall()[0][0] > 0
    if not (previous and _kept_previous(con, weight, num_shards, max_imbalance)):
        too_big = _cut(con, weight)
    con.execute("DROP TABLE costed")
    con.execute("DROP TABLE group_cost")
    return _totals(plan, num_shards, decode_cost, too_big)


def assign_gathered_shards(plan: SortedPlan, numbers: list[int], decode_cost: float = DECODE_COST) -> ShardTotals:
    """A night after: the rows the plan's database holds as ``settled`` stay in their shards, the
    others (in plan order, their groups as the whole batch's plan made them) are cut afresh into
    the shards ``numbers``, as many as they need and numbered apart from the kept ones. Returns the
    totals of every shard number up to the highest."""
    con = plan.connection
    _costed(con, decode_cost, "WHERE row NOT IN (SELECT row FROM settled)")
    too_big = None
    if numbers:
        too_big = _cut(con, shard_weights(None, len(numbers)))
        con.execute("UPDATE shards SET shard = ($numbers::BIGINT[])[shard + 1]", {"numbers": numbers})
    else:
        con.execute("CREATE OR REPLACE TABLE shards (row BIGINT, shard BIGINT)")
    con.execute("INSERT INTO shards SELECT row, shard FROM settled")
    con.execute("DROP TABLE costed")
    con.execute("DROP TABLE group_cost")
    parts = int(con.execute("SELECT coalesce(max(shard), -1) + 1 FROM shards").fetchall()[0][0])
    return _totals(plan, parts, decode_cost, too_big)


def _costed(con, decode_cost: float, rows: str = "") -> None:
    """The tables ``costed`` (each row's cost and the running sum in plan order) and ``group_cost``,
    of the plan's rows (``rows``: a WHERE clause choosing some)."""
    con.execute(f"""CREATE OR REPLACE TABLE costed AS
        SELECT row, position, grp, cost, sum(cost) OVER (ORDER BY position ROWS UNBOUNDED PRECEDING) AS cum_end
        FROM (SELECT row, position, grp, unique_tokens + {float(decode_cost)!r}::DOUBLE * decode AS cost FROM plan
              {rows})""")
    con.execute("""CREATE OR REPLACE TABLE group_cost AS
        SELECT grp, sum(cost) AS cost, max(cum_end) AS cum_end FROM costed GROUP BY grp""")


def _cut(con, weight: np.ndarray) -> str:
    """A fresh cut (``shard_cut.cut_in_order``'s) into ``shards``; returns the table of groups it may split."""
    total = con.execute("SELECT coalesce(max(cum_end), 0) FROM group_cost").fetchall()[0][0]
    bounds = (np.cumsum(weight)[:-1] / weight.sum() * total).tolist()
    shares = (weight / weight.sum() * total).tolist()
    # A shard is the number of bounds at or below a point (numpy's searchsorted, side="right").
    con.execute("""CREATE OR REPLACE TABLE group_shard AS
        SELECT grp, shard, cost > ($shares::DOUBLE[])[shard + 1] AS too_big
        FROM (SELECT grp, cost, len(list_filter($bounds::DOUBLE[], lambda b: b <= cum_end - cost / 2)) AS shard
              FROM group_cost)""", {"bounds": bounds, "shares": shares})
    con.execute("""CREATE OR REPLACE TABLE shards AS
        SELECT c.row, CASE WHEN g.too_big  -- a group larger than its share: cut at the rows
                           THEN len(list_filter($bounds::DOUBLE[], lambda b: b <= c.cum_end - c.cost / 2))
                           ELSE g.shard END AS shard
        FROM costed c JOIN group_shard g ON g.grp = c.grp""", {"bounds": bounds})
    return "group_shard"


def _kept_previous(con, weight: np.ndarray, parts: int, max_imbalance: float) -> bool:
    """Each group kept on its previous shard where all its rows were, the others in plan order to
    the least loaded shard, into ``shards``: False (nothing written) when it is unbalanced."""
    con.execute("""CREATE OR REPLACE TABLE group_previous AS
        SELECT c.grp, min(coalesce(p.shard, -1)) AS low, max(coalesce(p.shard, -1)) AS high
        FROM costed c LEFT JOIN previous_shards p ON p.row = c.row GROUP BY c.grp""")
    kept_where = f"low = high AND low >= 0 AND low < {int(parts)}"
    load = np.zeros(parts)
    for shard, cost in con.execute(f"""SELECT low, sum(g.cost) FROM group_previous p JOIN group_cost g USING (grp)
                                       WHERE {kept_where} GROUP BY low""").fetchall():
        load[shard] = cost
    placed = con.cursor().sql(f"""SELECT g.grp, g.cost FROM group_cost g JOIN group_previous p USING (grp)
                                  WHERE NOT ({kept_where}) ORDER BY g.grp""").to_arrow_reader(_GROUP_BATCH)
    con.execute("CREATE OR REPLACE TABLE group_moved (grp BIGINT, shard BIGINT)")
    for batch in placed:  # the groups that move, in plan order, each to the least loaded shard
        groups, costs = batch.column("grp").to_numpy(), batch.column("cost").to_numpy()
        shards = np.empty(groups.size, dtype=np.int64)
        for i, cost in enumerate(costs):
            shards[i] = int(np.argmin(load / weight))
            load[shards[i]] += cost
        moved = pa.table({"grp": groups, "shard": shards})  # noqa: F841 (read by the query below)
        con.execute("INSERT INTO group_moved SELECT * FROM moved")
    relative = load / weight
    balanced = bool(relative.max() <= max_imbalance * relative.mean())
    if balanced:  # a kept group's shard is its previous one (``low``), a moved group's where it went
        con.execute("""CREATE OR REPLACE TABLE shards AS
            SELECT c.row, coalesce(m.shard, p.low) AS shard
            FROM costed c JOIN group_previous p ON p.grp = c.grp LEFT JOIN group_moved m ON m.grp = c.grp""")
    con.execute("DROP TABLE group_previous")
    con.execute("DROP TABLE group_moved")
    return balanced


def _totals(plan: SortedPlan, parts: int, decode_cost: float, too_big: str | None) -> ShardTotals:
    """Per shard: the tokens it computes (each shard pays its own first reach of a node, as separate
    engines would), its decode estimate, its cost; the groups cut over several shards."""
    con, block = plan.connection, plan.block_size
    prefill, decode = np.zeros(parts, dtype=np.int64), np.zeros(parts, dtype=np.int64)
    for shard, tokens in con.execute(f"""
            SELECT shard, count(*) * {int(block)} FROM (
                SELECT s.shard, b.hash FROM blocks b JOIN shards s ON s.row = b.row GROUP BY s.shard, b.hash)
            GROUP BY shard""").fetchall():
        prefill[shard] += tokens
    for shard, tails, tokens in con.execute(f"""
            SELECT s.shard, sum(CASE WHEN p.row = p.source THEN p.length % {int(block)} ELSE 0 END), sum(p.decode)
            FROM plan p JOIN shards s ON s.row = p.row GROUP BY s.shard""").fetchall():
        prefill[shard] += tails
        decode[shard] = tokens
    split = 0
    if too_big is not None:
        split = con.execute(f"""SELECT count(*) FROM (
            SELECT p.grp FROM plan p JOIN shards s ON s.row = p.row JOIN {too_big} g ON g.grp = p.grp
            WHERE g.too_big GROUP BY p.grp HAVING count(DISTINCT s.shard) > 1)""").fetchall()[0][0]
        con.execute(f"DROP TABLE {too_big}")
    return ShardTotals(prefill, decode, prefill + decode_cost * decode, int(split))
