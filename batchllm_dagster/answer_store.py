"""A Dagster job's answer store: its DuckDB output table (``OutputTable``) and one Parquet file per
shard beside it, as ``engine.jobs.shard_job.ShardJob`` writes and reuses answers."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from engine.atomic import Staged
from engine.jobs.shard_job import ShardWrite
from engine.plan.plan_table import PlannedShard
from engine.run.results import RowResult
from engine.table.prompt_snapshot import CONTENT_KEY

from .config import BatchJobConfig
from .output_table import OutputTable, answers_table


class OutputTableStore:
    """The job's answers in ``warehouse`` (its output database) and its completions folder.
    ``log``: where a wait for DuckDB's lock and a view not made are said (a run's log: ``info``, ``warning``)."""

    def __init__(self, config: BatchJobConfig, warehouse, log):
        self.config, self.log = config, log
        self.table = OutputTable.of_job(warehouse, config)

    def stored(self, ids: pa.Array) -> list[Path | pa.Table]:
        previous = self.table.rows_of(ids)
        return [previous] if previous is not None and previous.num_rows else []

    def write(self, shard: PlannedShard, results: list[RowResult], whole: bool, answer_keys: dict) -> ShardWrite:
        """The shard's answers as rows of the output table (``answers_table``), only those that changed
        written (``OutputTable.replace_partition``). ``whole``: DuckDB committed, then the partition's
        rows as the table holds them published as its Parquet file (staged, then renamed: a failure
        before leaves the old file, and the partition not landed, so its rerun writes it). Else (a
        newer plan superseded some of its rows) only these ids' rows, and no Parquet file: the newer
        plan's run of this key (if it has one) writes its file whole, and a key it dropped never comes back."""
        config = self.config
        table = answers_table(results, shard.prepared.id_type, shard.key, config.hardware_of_shard(shard.number).name,
                              config.llm.model_path, shard.identity.select(["id", CONTENT_KEY]), answer_keys,
                              config.review_below)
        done = self.table.replace_partition(shard.key, table, whole_partition=whole, on_wait=self.log.info)
        if whole:
            with Staged(config.files.completions_parquet_path(shard.key)) as staged:
                pq.write_table(done.rows, staged.path)
        try:  # a convenience beside the answers: a database that cannot read the snapshot fails no shard
            self.table.replace_prompts_view(config.files.prompts_path, config.dataset.columns)
        except Exception as exc:
            self.log.warning(f"the view {config.output_table}_with_prompts was not made: {exc}")
        return ShardWrite(table, done.rows.num_rows, done.written)

    def answered_ids(self, ids: pa.Array, keys: set[str]) -> set:
        return self.table.answered_ids(ids, keys)
