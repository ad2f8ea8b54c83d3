"""What refuses a night before it lands anything: a new prompt snapshot that would cost answers.

Both guards run on the night's snapshot while it is still staged (``prompts``) and again before a
plan is made from it (``prefix_groups``): a refused night leaves the snapshot, the kept field order,
the plan, the partitions, the answers and the checkpoints as they were, and the next night on the
whole source reuses every answer.
"""

from __future__ import annotations

import math
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq

from .config import BatchJobConfig
from .output_table import OutputTable


def refuse_mass_removal(config: BatchJobConfig, warehouse, ids: pa.ChunkedArray | pa.Array) -> None:
    """Refuse a night whose rows would drop the answers of more than ``max_removed_share`` of the
    answered rows: a source that came back empty or truncated must not delete what GPU hours
    computed. With ``keep_deleted_answers`` no answer is removed (the table keeps deleted rows' as
    history), so nothing is refused."""
    if config.keep_deleted_answers:
        return
    live = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    gone, answered = OutputTable.of_job(warehouse, config).answers_not_in(live)
    if gone and gone > config.max_removed_share * answered:
        raise dg.Failure(
            f"{config.name}: refused to plan: the source has {len(ids):,} rows, and a plan of them would remove the "
            f"answers of {gone:,} of the {answered:,} answered rows ({gone / answered:.0%}), more than "
            f"max_removed_share ({config.max_removed_share:.0%}) allows. Nothing was removed: the prompt snapshot, "
            "plan, partitions and answers are as they were. If the source is right (those rows were deleted on "
            f"purpose), set max_removed_share to at least {math.ceil(gone / answered * 100) / 100:.2f} (1.0 allows "
            "removing every answer) and plan again.",
            allow_retries=False,
            metadata={"source_rows": len(ids), "answered_rows": answered, "answers_to_remove": gone,
                      "max_removed_share": config.max_removed_share})


def id_kind(type_name: str) -> str:
    """'integer' or 'text' for an Arrow type's or a DuckDB type's name: ids of one kind compare with
    each other (INTEGER with BIGINT), never across."""
    name = type_name.upper()
    return "integer" if "INT" in name else "text"


def refuse_id_type_change(config: BatchJobConfig, warehouse, id_type: pa.DataType) -> None:
    """Refuse a night whose id column changed kind (INTEGER to VARCHAR, say) since the answers or the
    last snapshot were made: every id would compare unequal, or fail to compare at all."""
    column = config.dataset.id_column
    earlier = [(what, found) for what, found in (
        (f"the output table {config.output_table!r}", OutputTable.of_job(warehouse, config).id_type()),
        ("the last prompt snapshot", _snapshot_id_type(config.files.prompts_path, column)),
    ) if found is not None and id_kind(found) != id_kind(str(id_type))]
    if earlier:
        what, found = earlier[0]
        raise dg.Failure(
            f"{config.name}: refused to plan: the id column {column!r} is {id_type} now, and {found} in {what}: "
            f"rows could not find their answers. Either cast it back in the dataset SQL (SELECT CAST({column} AS "
            f"{found}) AS {column}, ...), or start the job over (drop table {config.output_table!r} from "
            f"{config.output_database} and remove {config.files.job_dir}: every row is answered again). Nothing "
            "was changed: the prompt snapshot, plan and answers are as they were.",
            allow_retries=False)


def _snapshot_id_type(path: Path, column: str) -> str | None:
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException):  # none yet, or damaged (the next snapshot replaces it)
        return None
    return str(schema.field(column).type) if column in schema.names else None


def refuse_a_costly_night(config: BatchJobConfig, warehouse, ids: pa.ChunkedArray) -> None:
    """Both guards on the night's ids (the id type first: a mismatched one cannot be compared)."""
    refuse_id_type_change(config, warehouse, ids.type)
    refuse_mass_removal(config, warehouse, ids)
