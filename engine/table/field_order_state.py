"""A chosen field order kept from night to night, so unchanged rows keep their prompts (and answers).

``field_order: optimize`` chooses among candidate orders over the whole table (``engine.table.fields``).
Chosen again every night, one new row can change the choice, or the distinct counts a global order
is sorted by, and with it the prompt of every old row: each would be answered again, and possibly
differently. So the order is chosen once per job and kept beside the job's state
(``field_order.parquet``: each row id's order, the fields, the candidate chosen and what each
candidate computed when it was chosen):

* a row whose id was there keeps its order (its prompt changes only if its values do);
* a new row gets the global order where one was chosen; with the per-row (greedy) order, the order
  of the first kept row that shares the value of that row's first field (it then joins that
  group), else the order most kept rows have;
* the order is chosen again only when asked (``prompt.choose_order_again``, ``--choose-field-order-again``),
  or when the declared fields change; the run says which, and how many rows kept their order and
  how many new rows were placed into it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..atomic import write_parquet
from .dataset import DatasetError
from .fields import FieldOrder, FieldOrderChoice, PrefillCounter, PromptFields, choose_field_orders, field_text

STATE_KEY = b"batchllm.field_order"


@dataclass
class KeptOrders:
    """The orders of this table's rows, and what happened to them since the last choice."""

    choice: FieldOrderChoice
    reason: str  # why chosen now ("first choice", "asked", "fields changed", "none kept"), or "kept"
    kept_rows: int = 0  # rows that kept their order
    new_rows: int = 0  # rows placed into the kept order
    ids: pa.Array | pa.ChunkedArray | None = None  # the rows the orders are of, in the table's order
    spec: PromptFields | None = None

    def record(self, path: Path | str) -> None:
        """Keep these orders for the next night: called once the prompts they made have landed (a
        refused night records nothing). An empty table records nothing either: the kept order
        survives a night whose source came back empty, and its rows find their old prompts again."""
        if self.ids is None or self.spec is None or len(self.ids) == 0:
            return
        save(path, self.ids, self.spec, self)

    def describe(self) -> str:
        if self.reason != "kept":
            return (f"field order chosen ({self.reason}): {self.choice.chosen}, prompt tokens to compute per "
                    f"candidate {self.choice.candidates}")
        return (f"field order kept ({self.choice.chosen}, chosen on an earlier night): {self.kept_rows} rows kept "
                f"their order, {self.new_rows} new rows placed into it")


def _read(path: Path) -> tuple[dict, pa.Table] | None:
    """The kept orders. Unlike the token cache or the plan, they cannot be made again as they were
    (a new choice may change old rows' prompts): a damaged file stops the night, named, with both ways out."""
    if not path.exists():
        return None
    try:
        table = pq.read_table(path)
        return json.loads(table.schema.metadata[STATE_KEY]), table
    except (pa.ArrowException, OSError, KeyError, TypeError, ValueError) as exc:
        raise DatasetError(
            f"the kept field order {path} is damaged ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}): "
            "restore it from a backup, or remove it to choose the order "
            "again, which answers again every row whose prompt it changes") from None


def save(path: Path | str, ids: pa.Array | pa.ChunkedArray, spec: PromptFields, kept: KeptOrders) -> None:
    """Record each id's order and the choice (whole: staged, then renamed)."""
    state = {"fields": spec.fields, "chosen": kept.choice.chosen, "candidates": kept.choice.candidates}
    table = pa.table({"id": ids, "order": pa.array(kept.choice.orders.tolist(), pa.list_(pa.int16()))})
    write_parquet(table.replace_schema_metadata({STATE_KEY: json.dumps(state)}), path)


def recorded_choice(path: Path | str) -> dict | None:
    """The kept choice as recorded (``fields``, ``chosen``, each candidate's prompt tokens to compute
    over the whole table when it was chosen), without the rows' orders; None where none is kept."""
    path = Path(path)
    try:
        return json.loads(pq.read_schema(path).metadata[STATE_KEY]) if path.exists() else None
    except (pa.ArrowException, OSError, KeyError, TypeError, ValueError):
        return None  # damaged: what it says is metadata only here (the prompts step names it)


def kept_field_orders(table: pa.Table, spec: PromptFields, id_column: str, state_path: Path | str,
                      prefill_tokens: PrefillCounter | None) -> KeptOrders:
    """Each row's field order: the kept one (see the module doc), or a new choice; the caller
    records it (``KeptOrders.record``) once the prompts it made have landed."""
    if spec.field_order is FieldOrder.as_declared:
        return KeptOrders(choose_field_orders(table, spec, prefill_tokens), "declared")
    previous = _read(Path(state_path))
    if previous is not None and previous[0]["fields"] != spec.fields:
        reason = "fields changed"
    elif spec.choose_order_again and previous is not None:
        reason = "asked"
    elif previous is None:
        reason = "first choice"
    elif previous[1].num_rows == 0:  # an empty order an earlier version kept: nothing to keep
        reason = "none kept"
    else:
        kept = _placed(table, spec, id_column, *previous)
        kept.ids, kept.spec = table.column(id_column), spec
        return kept
    return KeptOrders(choose_field_orders(table, spec, prefill_tokens), reason, ids=table.column(id_column),
                      spec=spec)


def _placed(table: pa.Table, spec: PromptFields, id_column: str, state: dict, stored: pa.Table) -> KeptOrders:
    n, k = table.num_rows, len(spec.fields)
    stored_order = {
        key: order for key, order in zip(stored.column("id").to_pylist(), stored.column("order").to_pylist())
    }
    orders = np.empty((n, k), dtype=np.int16)
    ids = table.column(id_column).to_pylist()
    new = [i for i, key in enumerate(ids) if key not in stored_order]
    for i, key in enumerate(ids):
        if key in stored_order:
            orders[i] = stored_order[key]
    if new:
        kept_rows = [i for i in range(n) if ids[i] in stored_order]
        orders[new] = _orders_for_new_rows(table, spec, orders, kept_rows, new, list(stored_order.values()))
    choice = FieldOrderChoice(orders, state["chosen"], state["candidates"])
    return KeptOrders(choice, "kept", kept_rows=n - len(new), new_rows=len(new))


def _orders_for_new_rows(table: pa.Table, spec: PromptFields, orders: np.ndarray, kept_rows: list[int],
                         new_rows: list[int], stored: list[list[int]]) -> np.ndarray:
    """A global order for every new row; else each new row follows a kept row with its first
    field's value, or takes the order most rows had."""
    distinct = Counter(tuple(o) for o in stored)
    most = np.array(distinct.most_common(1)[0][0], dtype=np.int16)
    if len(distinct) == 1:  # a global order
        return np.broadcast_to(most, (len(new_rows), most.size))
    text = [field_text(table.column(f), f).to_pylist() for f in spec.fields]
    leader: dict[tuple[int, str], int] = {}  # (first field, its value) -> a kept row that leads with it
    for row in kept_rows:
        leader.setdefault((int(orders[row, 0]), text[orders[row, 0]][row]), row)
    firsts = sorted({first for first, _ in leader})
    out = np.empty((len(new_rows), most.size), dtype=np.int16)
    for j, row in enumerate(new_rows):
        match = next((leader[(f, text[f][row])] for f in firsts if (f, text[f][row]) in leader), None)
        out[j] = most if match is None else orders[match]
    return out
