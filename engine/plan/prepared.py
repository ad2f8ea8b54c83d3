"""Planning's output and a batch ready to run: two types, each with every field it needs.

    planned, prepared = plan_prompts(table, tokenizer, engine_settings, sampling)  # tokenize, check, plan
    prepared = prepare_batch(table, tokenizer, engine_settings, sampling)           # the runnable one alone

A ``PlannedBatch`` is what planning made of a table held in memory (``batchllm plan`` and ``run``,
doctor, the bench): the plan and its shards (``batch_plan``: the plan every job makes, in a plan
database of its own), each row's output budget, error, response format and duplicate set, and how
long it took. A job's plan step (``engine.jobs.plan_job``) makes its plan on disk with the same row
checks (``check_rows``) and the same queries.

A ``PreparedBatch`` is everything a run needs and nothing it must recompute: token ids, output
budgets, errors, run order, group and group prefix of each row. It is a ``PlannedBatch`` joined with
its token ids (``runnable``), or restored from a plan table (``engine.plan.plan_table``).

Rows that cannot run (empty prompt, bad chat messages, too long for the model, bad max_tokens)
keep a reason in ``errors`` and run nothing; the rest of the batch goes on.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ..response_format import ResponseFormat
from ..settings import EngineSettings, SamplingSettings, SchedulerSettings
from ..table.dataset import Columns
from ..table.prompt_snapshot import CONTENT_KEY
from .answer_lengths import AnswerLengths
from .batch_plan import PrefixPlan, plan_blocks
from .block_hashes import RowBlocks
from .duplicates import count_duplicates, duplicate_sets, token_keys
from .row_checks import output_budgets, row_response_formats
from .tokenizing import TokenizedBatch, tokenize_rows

log = logging.getLogger(__name__)


@dataclass
class PreparedBatch:
    """A batch ready to run (see the module doc)."""

    ids: list  # row ids in input order
    id_type: pa.DataType | None
    batch: TokenizedBatch  # rows with an error have no tokens
    max_tokens: np.ndarray
    errors: dict[int, str]
    order: np.ndarray  # row indices in run order; each group's rows are contiguous
    group_of_row: np.ndarray  # group id per row
    prefix_tokens_of_row: np.ndarray  # tokens of the row's group prefix (whole blocks; 0 = none)
    block_size: int
    response_formats: dict[int, ResponseFormat] = field(default_factory=dict)  # rows with their own constraint
    duplicate_set: np.ndarray | None = None  # identical rows share a set number (engine.plan.duplicates)
    answer_lengths: AnswerLengths | None = None  # learned from the job's last nights: what admission counts

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    @property
    def counted_output(self) -> np.ndarray:
        """Each row's output as admission counts it: the learned answer length where there is one,
        never above the row's ``max_tokens`` (its limit, which vLLM keeps)."""
        return self.max_tokens if self.answer_lengths is None else self.answer_lengths.reserved(self.max_tokens)

    def prefix_tokens_at(self, rows: np.ndarray) -> np.ndarray:
        """The group prefix of each of ``rows``."""
        return self.prefix_tokens_of_row[rows]

    def subset(self, rows) -> "PreparedBatch":
        """The same batch restricted to ``rows`` (kept in input order, plan order preserved)."""
        rows = np.sort(np.asarray(rows, dtype=np.int64))
        new_index = np.full(self.num_rows, -1, dtype=np.int64)
        new_index[rows] = np.arange(rows.size)
        in_subset = new_index[self.order] >= 0
        batch = TokenizedBatch.from_rows([self.batch.tokens_of(int(r)) for r in rows])
        return PreparedBatch(
            ids=[self.ids[r] for r in rows], id_type=self.id_type, batch=batch, max_tokens=self.max_tokens[rows],
            errors={int(new_index[r]): e for r, e in self.errors.items() if new_index[r] >= 0},
            order=new_index[self.order[in_subset]], group_of_row=self.group_of_row[rows],
            prefix_tokens_of_row=self.prefix_tokens_of_row[rows], block_size=self.block_size,
            response_formats={int(new_index[r]): f for r, f in self.response_formats.items() if new_index[r] >= 0},
            duplicate_set=None if self.duplicate_set is None else self.duplicate_set[rows],
            answer_lengths=self.answer_lengths,
        )


@dataclass
class PlannedBatch:
    """What planning made of a table (see the module doc): no token ids."""

    ids: pa.ChunkedArray | pa.Array  # row ids in input order (Arrow: no Python object a row at 10M rows)
    id_type: pa.DataType | None
    max_tokens: np.ndarray
    errors: dict[int, str]
    plan: PrefixPlan
    response_formats: dict[int, ResponseFormat] = field(default_factory=dict)
    duplicate_set: np.ndarray | None = None
    tokenize_s: float = 0.0
    plan_s: float = 0.0

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    @property
    def order(self) -> np.ndarray:
        return self.plan.order

    @property
    def group_of_row(self) -> np.ndarray:
        return self.plan.group_of_row

    @property
    def prefix_tokens_of_row(self) -> np.ndarray:
        return self.plan.group_prefix_tokens[self.plan.group_of_row]

    def prefix_tokens_at(self, rows: np.ndarray) -> np.ndarray:
        """The group prefix of each of ``rows`` (no array of every row's)."""
        return self.plan.group_prefix_tokens[self.plan.group_of_row[rows]]

    @property
    def block_size(self) -> int:
        return self.plan.block_size

    def runnable(self, batch: TokenizedBatch) -> PreparedBatch:
        """This plan with its rows' token ids (``batch``, in input order): the batch a run takes.
        A row planned as an error has no tokens in it, whatever ``batch`` holds."""
        return PreparedBatch(ids=self.ids.to_pylist(), id_type=self.id_type,
                             batch=_without_rows(batch, set(self.errors)), max_tokens=self.max_tokens,
                             errors=self.errors, order=self.order,
                             group_of_row=self.group_of_row, prefix_tokens_of_row=self.prefix_tokens_of_row,
                             block_size=self.block_size, response_formats=self.response_formats,
                             duplicate_set=self.duplicate_set)


def _column(table: pa.Table, name: str) -> list | None:
    return table.column(name).to_pylist() if name in table.column_names else None


def _arrow_column(table: pa.Table, name: str) -> pa.ChunkedArray | None:
    return table.column(name) if name in table.column_names else None


def _without_rows(batch: TokenizedBatch, drop: set[int]) -> TokenizedBatch:
    """The same batch with the tokens of ``drop`` rows removed (their length becomes 0)."""
    if not drop:
        return batch
    keep = np.ones(batch.tokens.size, dtype=bool)
    lengths = batch.lengths.copy()
    for row in drop:
        keep[batch.offsets[row] : batch.offsets[row + 1]] = False
        lengths[row] = 0
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return TokenizedBatch(batch.tokens[keep], offsets, batch.errors, batch.seconds)


def plan_prompts(
    table: pa.Table,
    tokenizer,
    engine_settings: EngineSettings,
    sampling: SamplingSettings,
    columns: Columns = Columns(),
    scheduler: SchedulerSettings = SchedulerSettings(),
    shards: int = 1,
) -> tuple[PlannedBatch, PreparedBatch]:
    """Tokenize and plan a validated prompt table (cut into ``shards``): the plan, and the batch that runs it."""
    n = table.num_rows
    batch = tokenize_rows(tokenizer, _column(table, columns.prompt) or [None] * n, _column(table, columns.messages))
    planned = plan_tokenized(table, batch, engine_settings, sampling, columns, scheduler, shards)
    return planned, planned.runnable(batch)


def prepare_batch(*args, **kwargs) -> PreparedBatch:
    """The runnable batch of a validated prompt table: ``plan_prompts`` (same arguments) without the plan."""
    return plan_prompts(*args, **kwargs)[1]


@dataclass
class CheckedRows:
    """What the row checks make of a table's rows before any plan: each row's output budget, error
    and own response format, the rows that were tokenized but cannot run, and the sets of identical
    rows (``duplicates``). The same for a batch's plan and a job's."""

    max_tokens: np.ndarray
    errors: dict[int, str]  # the tokenizer's and the checks'
    formats: dict[int, ResponseFormat]
    dropped: np.ndarray  # tokenized, cannot run: planned empty
    duplicate_set: np.ndarray


def check_rows(table: pa.Table, lengths: np.ndarray, tokenizer_errors: dict[int, str],
               engine_settings: EngineSettings, sampling: SamplingSettings, columns: Columns,
               find_duplicates: Callable[[np.ndarray, object, np.ndarray], np.ndarray]) -> CheckedRows:
    """The row checks of rows of ``lengths`` prompt tokens (``table``: their ``max_tokens`` and
    ``response_format`` columns, those it has). ``find_duplicates(max_tokens, own formats,
    runnable)``: the sets of identical rows (``duplicate_sets`` of the rows' content keys; a plan on
    disk finds them there)."""
    errors = dict(tokenizer_errors)
    n = lengths.size
    own_formats = _arrow_column(table, columns.response_format)
    formats = row_response_formats(own_formats, errors)
    max_tokens = output_budgets(_arrow_column(table, columns.max_tokens), sampling.max_tokens, lengths,
                                engine_settings, errors, formats, sampling.response_format, sampling.score_choices)
    dropped = np.array(sorted(set(errors) - set(tokenizer_errors)), dtype=np.int64)
    runnable = np.ones(n, dtype=bool)
    runnable[list(errors)] = False
    same = find_duplicates(max_tokens, own_formats, runnable)
    return CheckedRows(max_tokens, errors, formats, dropped, same)


def check_tokenized(table: pa.Table, rows: TokenizedBatch, engine_settings: EngineSettings,
                    sampling: SamplingSettings, columns: Columns) -> tuple[RowBlocks, CheckedRows]:
    """The row checks of rows already tokenized (``rows``, in ``table``'s order; ``engine_settings``
    at its block size): their block hashes, and what the checks found (identical rows by the
    snapshot's content key where ``table`` has it, else by their token ids)."""
    blocks = rows.row_blocks(engine_settings.block_size)
    keys = (table.column(CONTENT_KEY).combine_chunks() if CONTENT_KEY in table.column_names
            else token_keys(rows.tokens, rows.offsets))
    return blocks, check_rows(table, blocks.lengths, rows.errors, engine_settings, sampling, columns,
                              functools.partial(duplicate_sets, keys))


def plan_tokenized(
    table: pa.Table,
    rows: TokenizedBatch,
    engine_settings: EngineSettings,
    sampling: SamplingSettings,
    columns: Columns = Columns(),
    scheduler: SchedulerSettings = SchedulerSettings(),
    shards: int = 1,
) -> PlannedBatch:
    """Plan rows already tokenized (``rows``, in ``table``'s order), cut into ``shards``. ``table``
    needs only the id, ``max_tokens`` and ``response_format`` columns (and the content key where it
    has one: the prompt snapshot's)."""
    engine_settings = engine_settings.with_block_size()  # a plan counts in whole KV blocks
    ids = table.column(columns.id)
    n = len(ids)

    started = time.perf_counter()
    blocks, checked = check_tokenized(table, rows, engine_settings, sampling, columns)
    runs = blocks.lengths > 0
    runs[checked.dropped] = False
    same = checked.duplicate_set
    plan = plan_blocks(blocks, np.where(runs, checked.max_tokens, 0), scheduler.min_group_rows, same,
                       checked.dropped, shards)
    plan_s = time.perf_counter() - started
    log.info(
        "planned %d rows: %d groups, %d prompt tokens, shared %.1f%%, %d identical to another row "
        "(tokenize %.2fs, plan %.2fs)",
        n, plan.num_groups, plan.prompt_tokens, 100 * plan.shared_fraction, count_duplicates(same), rows.seconds,
        plan_s,
    )
    return PlannedBatch(ids, table.schema.field(columns.id).type, checked.max_tokens, checked.errors, plan,
                        response_formats=checked.formats, duplicate_set=same, tokenize_s=rows.seconds, plan_s=plan_s)


def sorted_prefill_counter(tokenizer, block_size: int):
    """A ``fields.PrefillCounter``: the prompt tokens sorted rows compute for these prompts, the
    planner's minimum prefill at this KV block size (whole blocks shared, as vLLM's cache shares them)."""
    def count(prompts: list[str]) -> int:
        batch = tokenize_rows(tokenizer, prompts)
        blocks = RowBlocks.of_tokens(batch.tokens, batch.offsets, block_size)
        return int(plan_blocks(blocks, np.zeros(len(prompts), dtype=np.int64)).unique_tokens)

    return count
