"""The prompt snapshot ``prompts`` hands to ``prefix_groups``: reading it, its digest, and the
job's plan stamp made from it (the plan table itself is ``engine.plan_table``'s)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchllm_dagster.config import BatchJobConfig
from engine.plan_table import plan_stamp
from engine.settings import EngineSettings

PLAN_RUN_TAG = "batchllm/plan_run"  # tag of a shard's run: the plan run whose shards it was queued for


def read_parquet(path: Path, what: str, filters=None, columns: list[str] | None = None) -> pa.Table:
    if not path.exists():
        raise FileNotFoundError(f"{what} not found at {path}: materialize the upstream asset first")
    return pq.read_table(path, filters=filters, columns=columns)


def snapshot_columns(path: Path, columns) -> list[str] | None:
    """The snapshot's columns a plan needs: all but the prompt text (None: the file is missing)."""
    if not path.exists():
        return None
    text = {columns.prompt, columns.messages}
    return [name for name in pq.ParquetFile(path).schema_arrow.names if name not in text]


SNAPSHOT_DIGEST = "batchllm.snapshot_digest"  # Parquet metadata of a prompt snapshot, written by prompts


def snapshot_digest(path: Path) -> str:
    """What identifies a prompt snapshot's rows: the digest ``prompts`` wrote into it (reading a
    big snapshot whole in every partition would cost seconds), else the file's."""
    recorded = (pq.ParquetFile(path).metadata.metadata or {}).get(SNAPSHOT_DIGEST.encode())
    return recorded.decode() if recorded else file_digest(path)


def file_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=12)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def plan_stamp_of(config: BatchJobConfig, settings: EngineSettings) -> dict[str, str]:
    """The job's plan stamp as it is now (``settings``: the job's, model resolved): the model's
    content, the prompt snapshot, and the settings that shape a plan."""
    return plan_stamp(settings.model_path, snapshot_digest(config.prompts_path), settings.block_size,
                      settings.context_len, config.sampling.max_tokens, config.scheduler.min_group_rows,
                      config.dataset.columns)
