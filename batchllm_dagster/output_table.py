"""The job's output table, its one owner: each row is the engine's result for one id (the columns
of ``engine.run.results``) and then the columns of the partition that answered it. The checks and
the README's queries read it by these names; ``warehouse.replace_partition`` adds a column a newer
version writes to a table an older one made (its old rows get NULL there).
"""

from __future__ import annotations

import datetime as dt

import pyarrow as pa

from engine.run.results import RowResult, results_to_table

# After the result columns: the partition each row was answered in.
PARTITION_COLUMNS = [
    ("partition_key", pa.string()),  # the shard's partition key
    ("hardware", pa.string()),  # the job's hardware partition the shard is bound to (not the device)
    ("model", pa.string()),  # the job's model setting (a path or a built-in name)
    ("completed_at", pa.timestamp("us", tz="UTC")),  # when the partition was written
]


def answers_table(results: list[RowResult], id_type: pa.DataType, partition_key: str, hardware_partition: str,
                  model: str) -> pa.Table:
    """The rows a partition writes to the output table and its Parquet file."""
    table = results_to_table(results, id_type)
    values = [partition_key, hardware_partition, model, dt.datetime.now(dt.timezone.utc)]
    for (name, type_), value in zip(PARTITION_COLUMNS, values):
        table = table.append_column(name, pa.array([value] * table.num_rows, type_))
    return table
