"""The job's shard checkpoints: finished answers not yet in the output table, kept by row
fingerprint for the whole job, not only for their partition key.

A shard killed part-way leaves its finished answers in ``checkpoints/<key>/``. If a new plan then
gives its rows other keys (one row inserted into a shard changes its key), the shards of the new
keys reuse them from there (``other_checkpoints``: by row fingerprint, like their own). A folder
is removed once no plan can use it (``prune_checkpoints``): its key is not in the plan on disk and
each of its answers is of a deleted row or already in the output table under a key of that plan
(from where a rerun reuses it). A shard removes its own folder once all its rows are written; one
whose rows a newer plan superseded while it ran keeps it, for the newer plan's shards to reuse.
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchllm_dagster.config import BatchJobConfig
from engine.run.checkpoint import checkpoint_parts


def other_checkpoints(config: BatchJobConfig, key: str) -> list[Path]:
    """The part files of the job's other shards' checkpoints."""
    return sorted(part for folder in config.files.checkpoints_dir.glob("*") if folder.name != key
                  for part in checkpoint_parts(folder))


def _ids_in(folder: Path) -> pa.Array:
    ids = []
    for part in checkpoint_parts(folder):
        try:
            ids.append(pq.read_table(part, columns=["id"]).column("id").combine_chunks())
        except Exception:  # unreadable: it gives nothing to reuse either
            continue
    return pa.concat_arrays(ids) if ids else pa.array([], pa.null())


def prune_checkpoints(config: BatchJobConfig, warehouse, live_keys: set[str], live_ids: pa.Array) -> int:
    """Remove the checkpoint folders no plan can use (see the module doc); returns how many."""
    import shutil

    removed = 0
    for folder in config.files.checkpoints_dir.glob("*"):
        if folder.name in live_keys:
            continue
        ids = _ids_in(folder)
        if len(ids):
            ids = ids.cast(live_ids.type)
            wanted = pc.filter(ids, pc.is_in(ids, value_set=live_ids))
            if len(wanted) and len(config.output(warehouse).answered_ids(wanted, live_keys)) < len(
                    pc.unique(wanted)):
                continue  # a row of the plan whose answer is only here
        shutil.rmtree(folder, ignore_errors=True)
        removed += 1
    return removed
