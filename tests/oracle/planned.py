"""``engine.plan.prepared.plan_tokenized`` with the prefix tree (the oracle) making the plan: the
same row checks and duplicate sets, the tree's groups and order instead of the queries'."""

import numpy as np
import pyarrow as pa

from engine.plan.prepared import PlannedBatch, check_tokenized
from engine.plan.tokenizing import TokenizedBatch
from engine.settings import EngineSettings, SamplingSettings, SchedulerSettings
from engine.table.dataset import Columns

from .prefix_tree import PrefixTree


def planned_by_tree(table: pa.Table, rows: TokenizedBatch, settings: EngineSettings, sampling: SamplingSettings,
                    columns: Columns = Columns(), scheduler: SchedulerSettings = SchedulerSettings()) -> PlannedBatch:
    blocks, checked = check_tokenized(table, rows, settings.with_block_size(), sampling, columns)
    tree = PrefixTree.of(blocks).planned(checked.dropped, checked.duplicate_set)
    plan = tree.plan(np.where(tree.lengths > 0, checked.max_tokens, 0), scheduler.min_group_rows)
    return PlannedBatch(table.column(columns.id), table.schema.field(columns.id).type, checked.max_tokens,
                        checked.errors, plan, response_formats=checked.formats, duplicate_set=checked.duplicate_set)
