"""``prompts``: the prompt rows, read from DuckDB (read-only) or Parquet and snapshotted."""


from pathlib import Path

import dagster as dg

from batchllm_dagster.config import BatchJobConfig
from batchllm_dagster.metadata import table_preview
from engine.dataset import load_prompts, read_sql, validate

from .snapshots import prompts_path, write_parquet


def load_dataset(config: BatchJobConfig):
    spec = config.dataset
    if spec.sql:
        return validate(read_sql(spec.sql, spec.database), spec.columns)
    source = spec.sql_file or spec.table or spec.parquet
    return load_prompts(str(source), spec.database, spec.columns)


def build_prompts(config: BatchJobConfig) -> dg.AssetsDefinition:
    @dg.asset(
        key=[config.name, "prompts"],
        group_name=config.name,
        description=f"Prompt rows of batch job {config.name!r} ({config.dataset.describe()}), snapshotted to Parquet.",
        kinds={"duckdb", "parquet"},
    )
    def prompts(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        table = load_dataset(config)
        path = prompts_path(config)
        write_parquet(table, path)
        spec = config.dataset
        context.log.info(f"{table.num_rows} prompt rows from {spec.describe()} -> {path}")
        return dg.MaterializeResult(
            metadata={
                "dagster/row_count": table.num_rows,
                "source": spec.describe(),
                "snapshot": dg.MetadataValue.path(str(Path(path).resolve())),
                "preview": table_preview(table, [spec.id_column, spec.prompt_column, spec.messages_column]),
            }
        )

    return prompts
