"""The code location: the demo batch job over the embedded DuckDB database.

Paths come from ``BATCHLLM_DATA_DIR`` (default ``./data``); ``make demo`` creates the database.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from batchllm_dagster import BatchJobConfig, DatasetSpec, ModelSpec, SamplingSpec, build_batch_defs
from batchllm_dagster.config import default_data_dir

HERE = Path(__file__).parent
DATA_DIR = default_data_dir()
DATABASE = DATA_DIR / "batchllm.duckdb"

DEMO = BatchJobConfig(
    name="demo",
    dataset=DatasetSpec(sql_file=str(HERE / "datasets" / "all_prompts.sql"), database=str(DATABASE)),
    llm=ModelSpec(path="smollm2"),
    sampling=SamplingSpec(max_tokens=48),
    shards=2,
    hardware=["cpu"],
    output_database=str(DATABASE),  # answers live next to the prompts
    output_table="demo_completions",
    storage_dir=str(DATA_DIR / "jobs"),
)

defs = dg.Definitions.merge(build_batch_defs(DEMO))
