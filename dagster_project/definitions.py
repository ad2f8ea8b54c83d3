"""The code location: the demo's batch jobs over the embedded DuckDB database.

* the jobs under ``defs/`` are declared in YAML (``defs/*/defs.yaml``, BatchJobComponent);
* ``support`` is declared from Python with the same factory.

Paths come from ``BATCHLLM_DATA_DIR`` (default: the project's ``data`` folder, whatever folder a
command runs from); ``make demo`` creates the database.
"""

from pathlib import Path

import dagster as dg

from assets import build_batch_defs
from batchllm_dagster import BatchJobConfig, DatasetSpec, EngineSettings, SamplingSettings
from batchllm_dagster.config import default_data_dir

HERE = Path(__file__).parent
DATA_DIR = default_data_dir(HERE.parent)  # the project's root: where its pyproject.toml is
DATABASE = DATA_DIR / "batchllm.duckdb"

SUPPORT = BatchJobConfig(
    name="support",
    dataset=DatasetSpec(sql_file=str(HERE / "datasets" / "support_replies.sql"), database=str(DATABASE)),
    llm=EngineSettings(model_path="smollm2"),
    sampling=SamplingSettings(max_tokens=48),
    shards=2,
    hardware=["cpu"],
    output_database=str(DATA_DIR / "jobs" / "answers.duckdb"),  # the YAML jobs' default: the package's own
    output_table="support_replies_completions",
    storage_dir=str(DATA_DIR / "jobs"),
)


@dg.definitions
def defs() -> dg.Definitions:
    return dg.Definitions.merge(build_batch_defs(SUPPORT), dg.load_from_defs_folder(path_within_project=HERE))
