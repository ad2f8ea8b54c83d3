"""``prompts``: the prompt rows, read from DuckDB (read-only) or Parquet and snapshotted."""

from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq

from batchllm_dagster.asset_specs import asset_args
from batchllm_dagster.asset_specs import warehouse as job_warehouse
from batchllm_dagster.config import BatchJobConfig
from batchllm_dagster.job_settings import JobSettings
from batchllm_dagster.layout import this_run
from batchllm_dagster.metadata import table_preview
from batchllm_dagster.night_guards import refuse_a_costly_night
from engine.atomic import Staged
from engine.table.dataset import (
    DatasetError,
    check_unique_ids,
    read_sql,
    schema_of,
    single_query,
    stream_sql,
    validate,
)
from engine.table.field_order_state import KeptOrders
from engine.table.fields import FieldOrder, PrefillCounter, with_prompt_column
from engine.table.prompt_rendering import rendered_batches
from engine.table.prompt_snapshot import SnapshotWriter, snapshot_digest


def refuse_dataset_mistakes_at_load(config: BatchJobConfig) -> None:
    """What can be known of the dataset when the definitions load, so ``dg check defs`` says it in
    one line: SQL that does not parse, a column or field the table (as it is now) lacks. A database,
    table or file not made yet is the night's to name (it may be made before then)."""
    try:
        sql, database, allowed = config.dataset.query()
    except DatasetError:
        return  # a SQL file or Parquet source not there yet (a missing SQL file is named by the component)
    try:
        schema = schema_of(sql, database, allowed)
        if schema is not None:
            empty, spec, columns = schema.empty_table(), config.dataset, config.dataset.columns
            if spec.prompt is not None:
                with_prompt_column(empty, spec.prompt.declared(), columns.prompt, messages_column=columns.messages)
                empty = empty.append_column(columns.prompt, pa.array([], pa.string()))
            validate(empty, columns)
    except DatasetError as exc:
        raise DatasetError(f"job {config.name!r}: {config.dataset.describe()}: {exc}") from None


def snapshot_dataset(config: BatchJobConfig, path: Path, log=None, before_landing=None
                     ) -> tuple[int, pa.Table, KeptOrders | None]:
    """Stream the dataset from DuckDB to a Parquet snapshot in record batches (the prompt text of
    the whole table is never in memory at once), each row with its content key (what the token
    cache looks rows up by). ``before_landing(ids)`` may refuse the snapshot while it is staged:
    then nothing lands, the kept field order included. Returns the row count, the first rows (a
    preview) and, for a prompt from fields with an optimized order, the orders (kept from an
    earlier night, or chosen; recorded for the next night once the snapshot landed)."""
    columns, fields = config.dataset.columns, config.dataset.prompt
    preview, choice = None, None
    with Staged(path) as staged:
        with stream_sql(*config.dataset.query(), job_dir=config.files.job_dir) as (schema, batches):
            if fields is not None:
                batches, schema, choice = rendered_batches(batches, schema, fields, columns,
                                                           _prefill_counter(config, log), config.files.field_order_path)
            writer = SnapshotWriter(staged.path, columns.prompt, columns.messages)
            for batch in batches:
                written = writer.write(
                    validate(pa.Table.from_batches([batch], schema), columns)
                )  # types, NULLs, duplicates within
                preview = preview if preview is not None else written.slice(0, 10)
            empty = validate(schema.empty_table(), columns)  # no rows: still a snapshot with the dataset's columns
            writer.close(empty.schema)
        check_unique_ids(staged.path, columns.id)  # duplicates across batches
        # The source's read-only connection is closed first: the output database may be the same file.
        if before_landing is not None:
            before_landing(pq.read_table(staged.path, columns=[columns.id]).column(0))
    if choice is not None:
        choice.record(config.files.field_order_path)
    return writer.rows, preview if preview is not None else empty, choice


def _prefill_counter(config: BatchJobConfig, log=None) -> PrefillCounter | None:
    """What an optimized field order is chosen by: the job's tokenizer and KV block size (the model
    prepared first where it is a built-in not yet prepared: ``log`` says so)."""
    if config.dataset.prompt is None or config.dataset.prompt.field_order is FieldOrder.as_declared:
        return None
    from engine.models import preparation_notice
    from engine.plan.prepared import sorted_prefill_counter
    from engine.plan.tokenizing import load_tokenizer

    notice = preparation_notice(config.llm.model_path)
    if notice and log:
        log(notice)
    settings = JobSettings(config).plan()
    return sorted_prefill_counter(load_tokenizer(settings.model_path), settings.block_size)


def source_version(config: BatchJobConfig) -> str:
    """A fingerprint of the dataset's content (row count and a hash of every row), read-only and
    sandboxed like ``prompts``. Content, not file times: the output table may live in the same
    database file."""
    sql, database, allowed = config.dataset.query()
    query = single_query(sql)  # the same rules as prompts; a trailing ``;`` or comment is fine
    table = read_sql(f"SELECT count(*) AS n, sum(hash(t))::VARCHAR AS h FROM (\n{query}\n) t", database, allowed)
    return f"{query.strip()}|{table['n'][0].as_py()}|{table['h'][0].as_py()}"


def build_prompts(config: BatchJobConfig) -> dg.AssetsDefinition:
    @dg.asset(**asset_args(config, "prompts", config.prompts_code_version()))
    def prompts(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        path, spec = config.files.prompts_path, config.dataset
        # The job's plan lock: a snapshot never lands while a plan is being made from the last one
        # (that plan finishes first; this run then waits), in any instance, whatever launched it.
        warehouse = job_warehouse(config, context)  # a night that would cost answers is refused
        with config.files.plan_lock(f"a prompt snapshot being taken ({this_run(context)})"):
            try:
                rows, preview, choice = snapshot_dataset(
                    config, path, context.log.info, lambda ids: refuse_a_costly_night(config, warehouse, ids))
            except DatasetError as exc:  # what to fix in the job or its data: one line, no traceback
                raise dg.Failure(f"{config.name}: {exc}", allow_retries=False) from None
        context.log.info(f"{rows} prompt rows from {spec.describe()} -> {path}")
        order = {}
        if choice is not None:
            context.log.info(choice.describe())
            order = {"field_order": choice.choice.chosen, "field_order_chosen": choice.reason,
                     "field_order_kept_rows": choice.kept_rows, "field_order_new_rows": choice.new_rows,
                     **{f"prompt_tokens_{name}_order": tokens for name, tokens in choice.choice.candidates.items()}}
        return dg.MaterializeResult(
            data_version=dg.DataVersion(snapshot_digest(path)),  # the rows, not the run: unchanged rows keep it
            metadata={
                "dagster/row_count": rows,
                "source": spec.describe(),
                "snapshot": dg.MetadataValue.path(str(Path(path).resolve())),
                "preview": table_preview(preview, [spec.id_column, spec.prompt_column, spec.messages_column]),
                **order,
            }
        )

    return prompts
