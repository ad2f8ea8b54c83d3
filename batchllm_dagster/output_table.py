"""The job's output table, its one owner: each row is the engine's result for one id (the columns
of ``engine.run.results``) and then the columns of the partition that answered it. The checks and
the README's queries read it by these names; ``warehouse.replace_partition`` adds a column a newer
version writes to a table an older one made (its old rows get NULL there).
"""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pyarrow.compute as pc

from engine.choice_scoring import needs_review
from engine.run.results import RowResult, results_to_table

# After the result columns (``computed_at`` among them: when the engine answered the row, kept when
# a later night reuses the answer): the partition each row was last written in.
PARTITION_COLUMNS = [
    ("partition_key", pa.string()),  # the shard's partition key
    ("hardware", pa.string()),  # the job's hardware partition the shard is bound to (not the device)
    ("model", pa.string()),  # the job's model setting (a path or a built-in name)
    ("completed_at", pa.timestamp("us", tz="UTC")),  # when the partition last wrote it (the answer confirmed)
]
CONTENT_KEY_COLUMN = "content_key"  # the prompt the answer is of: its row's snapshot content key, in hex
# A scored choice answer whose probability is under the job's ``review_below`` (NULL: not judged).
NEEDS_REVIEW_COLUMN = "needs_review"


def answers_table(results: list[RowResult], id_type: pa.DataType, partition_key: str, hardware_partition: str,
                  model: str, content_keys: pa.Table, review_below: float | None = None) -> pa.Table:
    """The rows a partition writes to the output table and its Parquet file. ``content_keys``:
    each row's id and the content key of the prompt it ran (the plan's ``_content_key``)."""
    table = results_to_table(results, id_type)
    table = table.append_column(NEEDS_REVIEW_COLUMN, pa.array(
        [needs_review(r.choice_probability, review_below) for r in results], pa.bool_()))
    keys = dict(zip(content_keys.column(0).to_pylist(), content_keys.column(1).to_pylist()))
    hexed = [key.hex() if (key := keys.get(i)) is not None else None for i in table.column("id").to_pylist()]
    table = table.append_column(CONTENT_KEY_COLUMN, pa.array(hexed, pa.string()))
    values = [partition_key, hardware_partition, model, dt.datetime.now(dt.timezone.utc)]
    for (name, type_), value in zip(PARTITION_COLUMNS, values):
        table = table.append_column(name, pa.array([value] * table.num_rows, type_))
    return table


def review_metadata(table: pa.Table, review_below: float | None) -> dict:
    """What a partition says of its scored choice answers: how many were scored, and how many are
    marked for review under ``review_below``."""
    scored = table.num_rows - table.column("choice_probability").null_count
    if not scored:
        return {}
    marked = {"review_below": review_below, "rows_for_review": pc.sum(table.column(NEEDS_REVIEW_COLUMN)).as_py() or 0}
    return {"scored_rows": scored, **(marked if review_below is not None else {})}
