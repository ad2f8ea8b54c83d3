"""Files an asset hands to the next: the prompt snapshot and the plan, written atomically."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchllm_dagster.config import BatchJobConfig


def prompts_path(config: BatchJobConfig) -> Path:
    return config.job_dir / "prompts.parquet"


def plan_path(config: BatchJobConfig) -> Path:
    return config.job_dir / "plan.parquet"


def checkpoint_path(config: BatchJobConfig, partition_key: str) -> Path:
    return config.job_dir / "checkpoints" / partition_key


def completions_parquet_path(config: BatchJobConfig, partition_key: str) -> Path:
    return config.job_dir / "completions" / f"{partition_key}.parquet"


def write_parquet(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".partial")
    pq.write_table(table, staging)
    staging.replace(path)  # readers see the old file or the new one, never half of one


def read_parquet(path: Path, what: str) -> pa.Table:
    if not path.exists():
        raise FileNotFoundError(f"{what} not found at {path}: materialize the upstream asset first")
    return pq.read_table(path)
