"""A prepared batch as a plan file's rows (no shards, no token ids): what ``plan_table.prepared_batch``
reads back, for tests of that round trip."""

import numpy as np
import pyarrow as pa

from engine.plan.plan_table import BLOCK_SIZE, format_texts, rows_columns
from engine.plan.prepared import PreparedBatch


def rows_table(prepared: PreparedBatch) -> pa.Table:
    rows = np.arange(prepared.num_rows)
    position = np.empty(prepared.num_rows, dtype=np.int64)
    position[prepared.order] = np.arange(prepared.order.size)
    ids = pa.array(prepared.ids, prepared.id_type)
    columns = rows_columns(ids, rows, position, prepared.group_of_row, prepared.prefix_tokens_at(rows),
                           prepared.max_tokens, prepared.errors, format_texts(prepared.response_formats),
                           prepared.duplicate_set)
    return pa.table(columns, metadata={BLOCK_SIZE: str(prepared.block_size)})
