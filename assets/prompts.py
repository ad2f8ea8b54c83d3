"""``prompts``: the prompt rows, read from DuckDB (read-only) or Parquet and snapshotted."""

from pathlib import Path

import dagster as dg

from batchllm_dagster.config import BatchJobConfig
from batchllm_dagster.metadata import table_preview
from engine.dataset import read_sql, single_query, source_sql, validate

from .snapshots import write_parquet


def dataset_sql(config: BatchJobConfig) -> tuple[str, str | None, list[str]]:
    """The dataset as one SQL query, the database it runs on and the folders it may read."""
    spec = config.dataset
    if spec.sql:
        sql, database, allowed = spec.sql, spec.database, []
    else:
        sql, database, allowed = source_sql(str(spec.sql_file or spec.table or spec.parquet), spec.database)
    return sql, database, [*allowed, *spec.allowed_paths]


def load_dataset(config: BatchJobConfig):
    return validate(read_sql(*dataset_sql(config)), config.dataset.columns)


def source_version(config: BatchJobConfig) -> str:
    """A fingerprint of the dataset's content (row count and a hash of every row), read-only and
    sandboxed like ``prompts``. Content, not file times: the output table may live in the same
    database file."""
    sql, database, allowed = dataset_sql(config)
    query = single_query(sql)  # the same rules as prompts; a trailing ``;`` or comment is fine
    table = read_sql(f"SELECT count(*) AS n, sum(hash(t))::VARCHAR AS h FROM (\n{query}\n) t", database, allowed)
    return f"{query.strip()}|{table['n'][0].as_py()}|{table['h'][0].as_py()}"


def build_prompts(config: BatchJobConfig) -> dg.AssetsDefinition:
    @dg.asset(
        key=[config.name, "prompts"],
        group_name=config.name,
        description=f"Prompt rows of batch job {config.name!r} ({config.dataset.describe()}), snapshotted to Parquet.",
        kinds={"duckdb", "parquet"},
    )
    def prompts(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        table = load_dataset(config)
        path = config.prompts_path
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
