"""The prompt sets a bench runs: a shape's or a sample of the user's table, each planned as a job
plans its rows (``plan_tokenized``): the declared prompts, the hand order and batchllm's own
(``engine.bench.runs.Run.prompts``)."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa

from ..jobs.job_options import engine_settings_from, prompt_fields_from
from ..response_format import ResponseFormat
from ..settings import EngineSettings, SamplingSettings
from ..table.dataset import Columns
from ..table.fields import FieldOrder, PromptFields, distinct_value_order, with_prompt_column
from .shapes import (
    FIELDS_SHAPE,
    SHORT_SHAPE,
    Workload,
    duplicates_tokens,
    fields_table,
    kv_bound_tokens,
    long_budget_table,
    nested_tokens,
    short_table,
    synthetic_tokens,
    templates_tokens,
)

log = logging.getLogger(__name__)


def field_prompt_tables(
    table: pa.Table, fields: PromptFields, tokenizer, block_size: int
) -> tuple[dict[str, pa.Table], float]:
    """The table with its prompt column rendered for each prompt set of ``Run`` (``chosen`` only
    where ``fields`` reorders), and the seconds choosing batchllm's order took (charged to it)."""
    from ..plan.prepared import sorted_prefill_counter
    from ..table.prompt_rendering import rendered_table

    columns = Columns()
    tables = {"declared": rendered_table(table, fields.declared(), columns)[0],
              "hand": with_prompt_column(table, fields, columns.prompt, distinct_value_order(table, fields))}
    order_s = 0.0
    if fields.field_order is not FieldOrder.as_declared:
        started = time.perf_counter()
        tables["chosen"], kept = rendered_table(table, fields, columns, sorted_prefill_counter(tokenizer, block_size))
        order_s = time.perf_counter() - started
        log.info("bench: field order %s chosen; prompt tokens to compute per candidate: %s", kept.choice.chosen,
                 kept.choice.candidates)
    return tables, order_s


def field_batches(table: pa.Table, fields: PromptFields, tokenizer, block_size: int) -> tuple[dict, float]:
    """Each prompt set's token ids (see ``field_prompt_tables``) and the seconds choosing took."""
    from ..plan.tokenizing import tokenize_rows

    tables, order_s = field_prompt_tables(table, fields, tokenizer, block_size)
    return {name: tokenize_rows(tokenizer, t.column("prompt").to_pylist()) for name, t in tables.items()}, order_s


def planned_prompt_set(
    batch, max_tokens, block_size: int, ids: list | None = None, response_formats: dict | None = None
):
    """A synthetic prompt set planned as a table's rows are (``plan_tokenized``): the plan, and the
    batch every run gets. Each row runs: the context is set to hold the longest row."""
    from ..plan.prepared import plan_tokenized
    from ..plan.row_checks import answer_floors

    response_formats = response_formats or {}
    n = max_tokens.size
    table = pa.table({"id": ids or [f"row-{i:06d}" for i in range(n)], "max_tokens": max_tokens,
                      "response_format": [response_formats[r].to_text() if r in response_formats else None
                                          for r in range(n)]})
    budgets = np.maximum(max_tokens, answer_floors(n, response_formats, None))  # a choice's budget is raised
    room = EngineSettings(block_size=block_size, max_model_len=int((batch.lengths + budgets).max(initial=1)))
    planned = plan_tokenized(table, batch, room, SamplingSettings(max_tokens=int(max_tokens.max(initial=1))))
    return planned, planned.runnable(batch)


# Block sizes a bench reports each prompt set's minimum prefill at: a GPU's default (vLLM's), the
# CPU's (the smallest its attention kernel takes) and vLLM's CPU build's own default.
REPORTED_BLOCK_SIZES = (16, 32, 128)


def prefill_by_block_size(prepared) -> dict[int, int]:
    """A prompt set's minimum prefill at each of ``REPORTED_BLOCK_SIZES``: vLLM shares whole blocks
    only, so where shared prefixes end costs up to a block per row."""
    return {size: int(planned_prompt_set(prepared.batch, prepared.max_tokens, size)[0].plan.unique_tokens)
            for size in REPORTED_BLOCK_SIZES}


def table_sample(args, tokenizer, model_path: str, fields: PromptFields | None = None):
    """Whole prefix groups of the user's table, picked at random until ``--sample`` rows, in the
    table's own order (what plain vLLM would be handed); rows that cannot run are left out. The
    sample of each prompt set (see ``Run``; with ``fields`` the hand order too, and batchllm's own
    where it reorders), the same rows in each, and the seconds choosing batchllm's order took; the
    groups are those of the prompts batchllm runs in its own order."""
    from ..plan.prepared import prepare_batch
    from ..table.dataset import load_prompts, read_source, validate

    field_order_s = 0.0
    engine_settings, sampling = engine_settings_from(args, model_path), SamplingSettings(max_tokens=args.max_tokens)
    if fields is None:
        tables = {"declared": load_prompts(args.prompts, args.database)}
    else:
        rendered, field_order_s = field_prompt_tables(read_source(args.prompts, args.database), fields, tokenizer,
                                                      engine_settings.block_size)
        tables = {name: validate(t) for name, t in rendered.items()}
    prepared_sets = {name: prepare_batch(t, tokenizer, engine_settings, sampling) for name, t in tables.items()}
    whole = prepared_sets.get("chosen", prepared_sets["declared"])  # the groups of the order batchllm runs
    ok = np.asarray([all(r not in p.errors for p in prepared_sets.values()) for r in range(whole.num_rows)])
    groups = np.unique(whole.group_of_row[ok])
    rng = np.random.default_rng(args.seed)
    picked, rows = set(), 0
    sizes = np.bincount(whole.group_of_row[ok])
    for group in rng.permutation(groups):
        if rows >= args.sample:
            break
        picked.add(int(group))
        rows += int(sizes[group])
    chosen = [r for r in range(whole.num_rows) if ok[r] and int(whole.group_of_row[r]) in picked]
    described = {"shape": "table", "source": args.prompts, "table_rows": whole.num_rows,
                 "error_rows_left_out": int((~ok).sum()), "sampled_groups": len(picked), "seed": args.seed}
    if fields is not None:
        described.update(fields=fields.fields, field_order=fields.field_order.value)
    return {name: p.subset(chosen) for name, p in prepared_sets.items()}, described, field_order_s


@dataclass
class BenchPromptSets:
    """What every run of one bench gets: each prompt set planned (``planned``) and runnable
    (``prepared``), the rows' output budgets and formats, the workload described, and the seconds
    choosing batchllm's field order took (charged to it)."""

    planned: dict
    prepared: dict
    max_tokens: np.ndarray
    response_formats: dict
    described: dict
    field_order_s: float


def bench_prompt_sets(args, tokenizer, model_path: str, block_size: int) -> BenchPromptSets:
    """The prompt sets of ``--shape`` (or of a sample of the user's table, ``PROMPTS``), planned in
    KV blocks of ``block_size``."""
    special = max(tokenizer.all_special_ids or [0])
    vocab = (special + 1, min(len(tokenizer), 32000))
    response_formats, ids, batches = {}, None, {}  # batches: each prompt set's token ids (see Run)
    field_order_s = 0.0
    fields = prompt_fields_from(args)
    if args.prompts:
        samples, described, field_order_s = table_sample(args, tokenizer, model_path, fields)
        sample = samples["declared"]
        max_tokens, ids, response_formats = sample.max_tokens, sample.ids, sample.response_formats
        batches = {name: s.batch for name, s in samples.items()}
    elif args.shape in ("fields", "short", "long_budget"):
        fields = fields or (FIELDS_SHAPE if args.shape == "fields" else SHORT_SHAPE)
        if args.shape == "fields":
            table, choices = fields_table(args.seed), {}
            max_tokens = np.random.default_rng(args.seed).integers(2, 9, table.num_rows).astype(np.int64)  # short
        elif args.shape == "short":
            table, max_tokens, choices = short_table(args.seed)
        else:
            table, max_tokens, formats = long_budget_table(args.seed)
            choices = {}
            response_formats = {row: ResponseFormat(**f) for row, f in formats.items()}
        batches, field_order_s = field_batches(table, fields, tokenizer, block_size)
        response_formats = response_formats or {row: ResponseFormat(choice=c) for row, c in choices.items()}
        ids = table.column("id").to_pylist()
        described = {"shape": args.shape, "seed": args.seed, "fields": fields.fields,
                     "field_order": fields.field_order.value,
                     **({"constrained_rows": len(response_formats)} if response_formats else {})}
    elif args.shape == "nested":
        batches["declared"], max_tokens = nested_tokens(vocab, args.seed)
        described = {"shape": "nested", "seed": args.seed}
    elif args.shape == "templates":
        batches["declared"], max_tokens = templates_tokens(vocab, args.seed)
        described = {"shape": "templates", "seed": args.seed}
    elif args.shape == "kv_bound":
        batches["declared"], max_tokens = kv_bound_tokens(vocab, args.seed)
        described = {"shape": "kv_bound", "seed": args.seed}
    elif args.shape == "duplicates":
        batches["declared"], max_tokens = duplicates_tokens(vocab, args.seed)
        described = {"shape": "duplicates", "seed": args.seed}
    else:
        workload = Workload(
            groups=args.groups, rows_per_group=args.rows_per_group, system_tokens=args.system_tokens,
            prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens, output_tokens=args.output_tokens,
            output_mix=args.output_mix, seed=args.seed,
        )
        batches["declared"], max_tokens = synthetic_tokens(workload, vocab)
        described = {"shape": "groups", **asdict(workload)}
    ids = ids or [f"row-{i:06d}" for i in range(max_tokens.size)]
    both = {
        name: planned_prompt_set(b, max_tokens, block_size, ids, response_formats) for name, b in batches.items()
    }
    planned_sets = {name: planned for name, (planned, _) in both.items()}  # each prompt set's plan
    prompt_sets = {name: prepared for name, (_, prepared) in both.items()}  # ... and the batch its runs get
    return BenchPromptSets(planned_sets, prompt_sets, max_tokens, response_formats, described, field_order_s)
