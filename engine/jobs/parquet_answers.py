"""``batchllm run``'s answer store: one Parquet file of every row's answer, in input order."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from ..plan.plan_table import PlannedShard
from ..run.results import RowResult, results_to_table
from ..table.output import write_result
from .shard_job import ShardWrite


class ParquetAnswers:
    """``output``: the answers of the prompts at ``source`` (marked so, ``write_result``); an
    earlier run's file there is reused by row fingerprint."""

    def __init__(self, output: Path, source: str):
        self.output, self.source = output, source

    def stored(self, ids: pa.Array) -> list[Path | pa.Table]:
        return [self.output] if self.output.exists() else []

    def write(self, shard: PlannedShard, results: list[RowResult], whole: bool, answer_keys: dict) -> ShardWrite:
        position = {row_id: i for i, row_id in enumerate(shard.prepared.ids)}
        results = sorted(results, key=lambda r: position[r.id])  # one row per id, in input order
        table = results_to_table(results, shard.prepared.id_type)
        write_result(table, self.output, self.source)
        return ShardWrite(table, table.num_rows, table.num_rows)

    def answered_ids(self, ids: pa.Array, keys: set[str]) -> set:
        return set()  # one shard: no other keys' checkpoints to prune
