"""One path from a table's rows to their prompts, for the ``prompts`` asset, ``batchllm run`` and the
bench alike: the prompt rendered from the row's fields (``engine.table.fields``) in the declared
order, or in an optimized one that is kept from night to night where the job keeps state
(``engine.table.field_order_state``) and chosen afresh where it does not.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa

from .dataset import Columns
from .field_order_state import KeptOrders, kept_field_orders
from .fields import FieldOrder, PrefillCounter, PromptFields, choose_field_orders, with_prompt_column


def rendered_batches(batches: Iterable[pa.RecordBatch], schema: pa.Schema, fields: PromptFields, columns: Columns,
                     prefill_tokens: PrefillCounter | None = None, field_order_path: Path | None = None,
                     ) -> tuple[Iterator[pa.RecordBatch], pa.Schema, KeptOrders | None]:
    """The batches with their prompt rendered from ``fields``, their schema, and the field orders
    (None in the declared order). An optimized order is kept in ``field_order_path`` (chosen there
    the first time) or, without one, chosen afresh; it is chosen over the whole table (by
    ``prefill_tokens``), so its rows are read at once; in the declared order, batch by batch."""
    def render(table: pa.Table, orders=None) -> list[pa.RecordBatch]:
        return with_prompt_column(table, fields, columns.prompt, orders, columns.messages).to_batches(65_536)

    def each_batch():
        for batch in batches:
            yield from render(pa.Table.from_batches([batch], schema))

    with_prompt_column(schema.empty_table(), fields.declared(), columns.prompt)  # a missing field or a prompt
    out_schema = schema.append(pa.field(columns.prompt, pa.string()))         # column of its own: refused at once
    if fields.field_order is FieldOrder.optimize:
        table = pa.Table.from_batches(list(batches), schema)
        if field_order_path is None:
            kept = KeptOrders(choose_field_orders(table, fields, prefill_tokens), "no kept state")
        else:
            kept = kept_field_orders(table, fields, columns.id, field_order_path, prefill_tokens)
        return iter(render(table, kept.choice.orders)), out_schema, kept
    return each_batch(), out_schema, None


def rendered_table(
    table: pa.Table,
    fields: PromptFields,
    columns: Columns,
    prefill_tokens: PrefillCounter | None = None,
    field_order_path: Path | None = None,
) -> tuple[pa.Table, KeptOrders | None]:
    """``rendered_batches`` of a table held in memory."""
    batches, schema, kept = rendered_batches(table.to_batches(), table.schema, fields, columns, prefill_tokens,
                                             field_order_path)
    return pa.Table.from_batches(list(batches), schema), kept
