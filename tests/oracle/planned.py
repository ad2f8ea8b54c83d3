"""``engine.plan.prepared.plan_tokenized`` with the prefix tree (the oracle) making the plan: the
same row checks and duplicate sets, the tree's groups and order instead of the queries'."""

import functools

import numpy as np
import pyarrow as pa

from engine.plan.duplicates import duplicate_sets, token_keys
from engine.plan.prepared import PlannedBatch, check_rows
from engine.plan.tokenizing import TokenizedBatch
from engine.settings import EngineSettings, SamplingSettings, SchedulerSettings
from engine.table.dataset import Columns
from engine.table.prompt_snapshot import CONTENT_KEY

from .prefix_tree import PrefixTree


def planned_by_tree(table: pa.Table, rows: TokenizedBatch, settings: EngineSettings, sampling: SamplingSettings,
                    columns: Columns = Columns(), scheduler: SchedulerSettings = SchedulerSettings()) -> PlannedBatch:
    settings = settings.with_block_size()
    blocks = rows.row_blocks(settings.block_size)
    keys = (table.column(CONTENT_KEY).combine_chunks() if CONTENT_KEY in table.column_names
            else token_keys(rows.tokens, rows.offsets))
    checked = check_rows(table, blocks.lengths, rows.errors, settings, sampling, columns,
                         functools.partial(duplicate_sets, keys))
    tree = PrefixTree.of(blocks).planned(checked.dropped, checked.duplicate_set)
    plan = tree.plan(np.where(tree.lengths > 0, checked.max_tokens, 0), scheduler.min_group_rows)
    return PlannedBatch(table.column(columns.id), table.schema.field(columns.id).type, checked.max_tokens,
                        checked.errors, plan, response_formats=checked.formats, duplicate_set=checked.duplicate_set)
