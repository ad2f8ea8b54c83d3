"""``batchllm bench``: this engine against plain vLLM, one run after the other on one machine.

Runs, each in its own fresh Python process and vLLM engine with the same KV cache (sized below
the batch's prefix working set, as in a real offline job with thousands of documents):

* ``vllm_nocache``         - vLLM, prefix caching off, rows in input order (shuffled, like a table);
* ``vllm_apc``             - vLLM with its automatic prefix cache, input order;
* ``vllm_apc_sorted``      - vLLM with prefix caching on ``sorted()`` rows (our engine loop);
* ``vllm_generate_sorted`` - vLLM's own ``LLM.generate`` on ``sorted()`` rows with vLLM's own batch
  sizes: the one line a user would write instead of this package;
* ``batchllm``             - this engine on the same prompts: global plan, groups, KV-budgeted admission;
* ``vllm_hand_order`` and ``batchllm_field_order`` where prompts come from fields (below).

All get the same token ids and greedy sampling with ``ignore_eos`` (fixed output lengths).
``--repeat N`` runs them all N times, the order rotated each time; every ratio is reported with
its median and range over the repetitions ("on par" when the range crosses 1.0), with and
without batchllm's planning time charged to it, and the verdict names the strongest baseline.
``--shape`` picks the synthetic table:

* ``groups``    - groups x rows: a system prompt shared by all, a prefix per group, a suffix per row;
* ``nested``    - one long instruction block shared by every row, documents each asked 2-6
  questions, a question per row, outputs of 16-96 tokens;
* ``templates`` - a dozen few-shot blocks each shared by many rows, unique row text, 15% of the
  rows sharing nothing, outputs of 8-48 tokens;
* ``duplicates`` - the nested shape with 20% of the rows copies of another row under other ids
  (this engine computes each content once; vLLM computes every row);
* ``fields``    - reviews joined to products, each prompt built from fields declared unique first
  (review, description, category, brand, stars), answers of 2-8 tokens;
* ``short``     - support tickets joined to a small customer table (the customer, then the ticket):
  many groups of 1-3 rows beyond a shared instruction, answers of 1-8 tokens, 40% of them
  constrained to a choice (stop at EOS, not ``ignore_eos``).

With prompts from fields (``fields``, ``short``, or ``--fields`` on a user's table: ``batchllm
bench PROMPTS --fields a,b --field-order optimize``) the baselines and ``batchllm`` run the
declared order; ``vllm_hand_order`` is ``LLM.generate`` on sorted prompts with the fields in one
global order by ascending distinct values (a user's hand recipe), and ``batchllm_field_order`` is
this engine with the order ``field_order: optimize`` chooses (``engine.table.fields``).

``batchllm bench PROMPTS`` runs the same four on a sample of the user's own table instead (whole
prefix groups, so the sample shares what the table shares), each row with its own ``max_tokens``.

``--analysis`` times the plan alone on synthetic token ids (no model); ``--scheduler-only`` our
own cost per engine step at GPU batch sizes, and with ``--shape short`` how full the batch runs at
an H200's settings on the block-accounting stand-in (``engine/bench/bench_scheduler.py``, no model).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..jobs.job_options import (
    DEFAULT_MODEL,
    add_engine_options,
    add_prompt_fields_options,
    add_response_format_options,
    at_least_one,
    engine_settings_from,
    prompt_fields_from,
    response_format_from,
)
from ..machine import current_platform
from ..plan.duplicates import count_duplicates
from ..plan.prefix_tree import build_plan, reusable_tokens
from ..plan.tokenizing import TokenizedBatch
from ..response_format import ResponseFormat
from ..run.console import route_library_output
from ..run.results import RunStats
from ..run.step_profile import StepProfile
from ..settings import EngineSettings, ReserveOutput, SamplingSettings, SchedulerSettings
from ..table.dataset import Columns
from ..table.fields import FieldOrder, PromptFields, distinct_value_order, with_prompt_column

log = logging.getLogger(__name__)

def input_order(prepared) -> list[int]:
    """The rows as the table has them: what plain vLLM gets."""
    return list(range(prepared.num_rows))


def sorted_order(prepared) -> list[int]:
    """The ``sorted()`` baseline: rows in lexicographic order of their token ids."""
    return sorted(range(prepared.num_rows), key=prepared.batch.row)


@dataclass(frozen=True)
class Run:
    """One run of the bench: the prompts it gets, the order a baseline feeds vLLM its rows in
    (None: this engine's scheduler), whether vLLM's prefix caching is on, and whether it is vLLM's
    own ``LLM.generate`` with vLLM's own batch sizes (the one line a user would otherwise write).

    Prompts: ``declared``, the table's prompts (from fields: in the declared order); ``chosen``,
    batchllm's own field order; ``hand``, the fields in one global order by ascending number of
    distinct values, what a user who knows prefix caching writes by hand."""

    prompts: str
    order: object = None
    caching: bool = True
    generate: bool = False


RUNS = {
    "vllm_nocache": Run("declared", input_order, caching=False),
    "vllm_apc": Run("declared", input_order),
    "vllm_apc_sorted": Run("declared", sorted_order),
    "vllm_generate_sorted": Run("declared", sorted_order, generate=True),
    "vllm_hand_order": Run("hand", sorted_order, generate=True),
    "batchllm": Run("declared"),  # the engine on exactly the baselines' prompts
    "batchllm_field_order": Run("chosen"),  # the engine with its own field order
}
ENGINE_RUNS = [name for name, run in RUNS.items() if run.order is None]
BASELINES = [name for name in RUNS if name not in ENGINE_RUNS]
FIELD_RUNS = [name for name, run in RUNS.items() if run.prompts != "declared"]  # prompts from fields only
SHAPES = ("groups", "nested", "templates", "duplicates", "fields", "short")


@dataclass
class Workload:
    groups: int = 16
    rows_per_group: int = 12
    system_tokens: int = 64  # shared by every row (nesting level 1)
    prefix_tokens: int = 320  # shared by a group's rows (level 2)
    suffix_tokens: int = 32  # each row's own tokens
    output_tokens: int = 32
    # Output lengths: "fixed" (every row output_tokens), "rows" (each row between output/4 and
    # 2*output), "tasks" (each group is a short task, output/8, or a long one, 3*output: a table
    # mixing classification and generation prompts).
    output_mix: str = "fixed"
    seed: int = 0

    @property
    def rows(self) -> int:
        return self.groups * self.rows_per_group


def synthetic_tokens(workload: Workload, vocab: tuple[int, int]):
    """Token ids and per-row output lengths of the workload, rows in a shuffled (table) order."""
    rng = np.random.default_rng(workload.seed)
    lo, hi = vocab
    system = rng.integers(lo, hi, workload.system_tokens, dtype=np.int32)
    prefixes = rng.integers(lo, hi, (workload.groups, workload.prefix_tokens), dtype=np.int32)
    group = np.repeat(np.arange(workload.groups), workload.rows_per_group)
    rng.shuffle(group)
    suffixes = rng.integers(lo, hi, (workload.rows, workload.suffix_tokens), dtype=np.int32)
    rows = np.concatenate([np.broadcast_to(system, (workload.rows, system.size)), prefixes[group], suffixes], axis=1)
    length = rows.shape[1]
    offsets = np.arange(workload.rows + 1, dtype=np.int64) * length
    if workload.output_mix == "rows":
        max_tokens = rng.integers(max(1, workload.output_tokens // 4), 2 * workload.output_tokens + 1, workload.rows)
    elif workload.output_mix == "tasks":
        long_task = rng.permutation(workload.groups) < workload.groups // 2
        max_tokens = np.where(long_task[group], 3 * workload.output_tokens, max(1, workload.output_tokens // 8))
    else:
        max_tokens = np.full(workload.rows, workload.output_tokens)
    return TokenizedBatch(tokens=rows.ravel(), offsets=offsets), max_tokens.astype(np.int64)


def nested_tokens(vocab: tuple[int, int], seed: int = 0, documents: int = 45, instruction_tokens: int = 384):
    """One instruction block above every row, documents of 160-320 tokens each asked 2-6
    questions of 12-40 tokens, outputs of 16-96 tokens; rows in a shuffled (table) order."""
    rng = np.random.default_rng(seed)
    lo, hi = vocab
    instruction = rng.integers(lo, hi, instruction_tokens)
    rows, max_tokens = [], []
    for _ in range(documents):
        document = rng.integers(lo, hi, rng.integers(160, 321))
        for _ in range(rng.integers(2, 7)):
            rows.append(np.concatenate([instruction, document, rng.integers(lo, hi, rng.integers(12, 41))]))
            max_tokens.append(rng.integers(16, 97))
    order = rng.permutation(len(rows))
    return TokenizedBatch.from_rows([rows[i] for i in order]), np.asarray(max_tokens, dtype=np.int64)[order]


def templates_tokens(vocab: tuple[int, int], seed: int = 0, rows: int = 200, templates: int = 12):
    """A dozen few-shot blocks of 256-448 tokens, each shared by many rows with 24-96 tokens of
    their own; 15% of the rows share nothing (128-384 tokens); outputs of 8-48 tokens."""
    rng = np.random.default_rng(seed)
    lo, hi = vocab
    blocks = [rng.integers(lo, hi, rng.integers(256, 449)) for _ in range(templates)]
    out = []
    for _ in range(rows):
        if rng.random() < 0.15:
            out.append(rng.integers(lo, hi, rng.integers(128, 385)))
        else:
            out.append(np.concatenate([blocks[rng.integers(templates)], rng.integers(lo, hi, rng.integers(24, 97))]))
    return TokenizedBatch.from_rows(out), rng.integers(8, 49, rows).astype(np.int64)


def duplicates_tokens(vocab: tuple[int, int], seed: int = 0, share: float = 0.2):
    """The nested shape with a share of its rows repeated under other ids (the same question
    about the same document asked twice, a re-sent ticket): ``share`` of the rows are copies of
    another row, its tokens and max_tokens; rows in a shuffled (table) order."""
    batch, max_tokens = nested_tokens(vocab, seed)
    rng = np.random.default_rng(seed + 1)
    n = max_tokens.size
    copied = rng.integers(0, n, round(n * share / (1 - share)))
    rows = [batch.row(r) for r in range(n)] + [batch.row(int(r)) for r in copied]
    max_tokens = np.concatenate([max_tokens, max_tokens[copied]])
    order = rng.permutation(len(rows))
    return TokenizedBatch.from_rows([rows[i] for i in order]), max_tokens[order]


FIELDS_SHAPE = PromptFields(
    instruction="Read the product and its review. Say whether the review is positive, negative or neutral.",
    fields=["review", "description", "category", "brand", "stars"], question="Sentiment:",
    field_order=FieldOrder.optimize)


def fields_table(seed: int = 0, products: int = 24, reviews: int = 240) -> pa.Table:
    """A join of reviews and products, declared unique field first: a review of 12-30 words, the
    product's description of 150-250 words (shared by the product's reviews), its category (6)
    and brand (12), the stars (5); rows in a shuffled (table) order."""
    rng = np.random.default_rng(seed)
    words = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "pu", "ra", "si", "to", "vu", "ze")
             for b in ("l", "n", "r", "s", "t", "")]

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(words, int(rng.integers(lo, hi + 1))))

    described = [text(150, 250) for _ in range(products)]
    category, brand = rng.integers(0, 6, products), rng.integers(0, 12, products)
    product = rng.integers(0, products, reviews)
    return pa.table({
        "id": [f"review-{i:05d}" for i in range(reviews)],
        "review": [text(12, 30) for _ in range(reviews)],
        "description": [described[p] for p in product],
        "category": [f"category {category[p]}" for p in product],
        "brand": [f"brand {brand[p]}" for p in product],
        "stars": rng.integers(1, 6, reviews).tolist(),
    })


SHORT_SHAPE = PromptFields(
    instruction="You route support tickets. Read the customer and the ticket, then answer with one word: the team "
                "that should handle it (billing, technical, account or shipping), or a short label.",
    fields=["customer", "profile", "plan", "region", "ticket", "priority"], question="Team:",
    field_order=FieldOrder.optimize)
SHORT_CHOICES = ["billing", "technical", "account", "shipping"]


def short_table(seed: int = 0, customers: int = 100) -> tuple[pa.Table, np.ndarray, dict[int, list[str]]]:
    """Tickets joined to a small customer table, declared as a user would (the customer, then the
    ticket): a customer's name and profile of 20-45 words, its plan (3) and region (5), then the
    ticket of 8-20 words and its priority (3). Each customer has 1-3 tickets, so beyond the shared
    instruction the prompts form many groups of 1-3 rows. Answers of 1-8 tokens; 40% of the rows
    are constrained to a choice of teams. Returns the table (rows shuffled), each row's max_tokens,
    and the choices of the constrained rows."""
    rng = np.random.default_rng(seed)
    words = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "pu", "ra", "si", "to", "vu", "ze")
             for b in ("l", "n", "r", "s", "t", "")]

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(words, int(rng.integers(lo, hi + 1))))

    plans, regions, priorities = ["basic", "pro", "enterprise"], ["north", "south", "east", "west", "central"], \
        ["low", "normal", "urgent"]
    profile = [text(20, 45) for _ in range(customers)]
    plan, region = rng.integers(0, 3, customers), rng.integers(0, 5, customers)
    customer = np.repeat(np.arange(customers), rng.integers(1, 4, customers))
    customer = customer[rng.permutation(customer.size)]
    n = customer.size
    table = pa.table({
        "id": [f"ticket-{i:05d}" for i in range(n)],
        "customer": [f"customer {c:04d}" for c in customer],
        "profile": [profile[c] for c in customer],
        "plan": [plans[plan[c]] for c in customer],
        "region": [regions[region[c]] for c in customer],
        "ticket": [text(8, 20) for _ in range(n)],
        "priority": [priorities[p] for p in rng.integers(0, 3, n)],
    })
    max_tokens = rng.integers(1, 9, n).astype(np.int64)
    constrained = np.flatnonzero(rng.random(n) < 0.4)
    max_tokens[constrained] = 8  # room for the longest choice
    return table, max_tokens, {int(r): SHORT_CHOICES for r in constrained}


def field_prompt_tables(table: pa.Table, fields: PromptFields, tokenizer, block_size: int) -> tuple[dict[str, pa.Table], float]:
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


def _field_batches(table: pa.Table, fields: PromptFields, tokenizer, block_size: int) -> tuple[dict, float]:
    """Each prompt set's token ids (see ``field_prompt_tables``) and the seconds choosing took."""
    from ..plan.tokenizing import tokenize_rows

    tables, order_s = field_prompt_tables(table, fields, tokenizer, block_size)
    return {name: tokenize_rows(tokenizer, t.column("prompt").to_pylist()) for name, t in tables.items()}, order_s


def _planned(batch, max_tokens, block_size: int, ids: list | None = None, response_formats: dict | None = None):
    """A synthetic prompt set planned as a table's rows are (``plan_tokenized``): the plan, and the
    batch every run gets. Each row runs: the context is set to hold the longest row."""
    from ..plan.prepared import plan_tokenized

    response_formats = response_formats or {}
    n = max_tokens.size
    table = pa.table({"id": ids or [f"row-{i:06d}" for i in range(n)], "max_tokens": max_tokens,
                      "response_format": [response_formats[r].to_text() if r in response_formats else None
                                          for r in range(n)]})
    room = EngineSettings(block_size=block_size, max_model_len=int((batch.lengths + max_tokens).max(initial=1)))
    planned = plan_tokenized(table, batch, room, SamplingSettings(max_tokens=int(max_tokens.max(initial=1))))
    return planned, planned.runnable(batch)


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
    planned = {name: prepare_batch(t, tokenizer, engine_settings, sampling) for name, t in tables.items()}
    whole = planned.get("chosen", planned["declared"])  # the groups of the order batchllm runs
    ok = np.asarray([all(r not in p.errors for p in planned.values()) for r in range(whole.num_rows)])
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
    return {name: p.subset(chosen) for name, p in planned.items()}, described, field_order_s


def _one_run(name: str, prepared, engine_settings: EngineSettings, sampling: SamplingSettings,
             scheduler: SchedulerSettings) -> tuple[dict, dict]:
    """One run in this process: its report and each row's answer by id."""
    from ..run.batch_run import BatchRun
    from ..run.scheduler import InOrder, Planned
    from ..vllm.vllm_engine import open_engine

    spec = RUNS[name]
    if spec.generate:
        return _generate_sorted(prepared, engine_settings, sampling)
    with open_engine(engine_settings, enable_prefix_caching=spec.caching) as engine:
        profile = StepProfile.of(prepared.group_of_row)
        scheduling = InOrder(spec.order(prepared)) if spec.order else Planned()
        run = BatchRun(prepared, engine, sampling, scheduler, rows=input_order(prepared), scheduling=scheduling,
                       step_profile=profile)
        outputs = {r.id: r.text for r in run}
        info = engine.info
    report = _report(run.stats, info.max_num_seqs, info.kv_capacity_blocks)
    report["per_step"] = profile.summary()
    if report["per_step"]:  # the run's time outside vLLM's steps: our scheduler, submissions, results
        report["per_step"]["outside_steps_s"] = round(run.stats.wall_s - report["per_step"]["step_s"], 3)
    return report, outputs


def _generate_sorted(prepared, engine_settings: EngineSettings, sampling: SamplingSettings) -> tuple[dict, dict]:
    """vLLM's ``LLM.generate`` on the rows sorted by prompt, vLLM's own batch sizes (no
    ``max_num_seqs`` from our plan), the same KV blocks and sampling as every run."""
    from ..run.drive import row_sampling
    from ..vllm.vllm_engine import sampling_params
    from ..vllm.vllm_env import configure, engine_args

    platform = current_platform()
    configure(engine_settings, platform)
    from vllm import LLM

    llm = LLM(**engine_args(engine_settings, platform, enable_prefix_caching=True))
    order = sorted_order(prepared)
    config = llm.llm_engine.vllm_config
    started = time.perf_counter()
    done = llm.generate([{"prompt_token_ids": prepared.batch.row(r)} for r in order],
                        [sampling_params(row_sampling(sampling, prepared.response_formats.get(r)),
                                         int(prepared.max_tokens[r])) for r in order], use_tqdm=False)
    stats = RunStats(rows=len(order), ok_rows=len(order), wall_s=time.perf_counter() - started,
                     reusable_tokens=reusable_tokens(prepared.batch, [int(r) for r in prepared.order],
                                                     prepared.block_size))
    outputs = {}
    for row, out in zip(order, done):
        stats.prompt_tokens += len(out.prompt_token_ids)
        stats.cached_tokens += int(out.num_cached_tokens or 0)
        stats.output_tokens += len(out.outputs[0].token_ids)
        outputs[prepared.ids[row]] = out.outputs[0].text
    report = _report(stats, config.scheduler_config.max_num_seqs, config.cache_config.num_gpu_blocks)
    for unknown in ("preemptions", "engine_steps", "rows_per_step", "mean_kv_usage"):  # LLM.generate does not say
        report[unknown] = None
    return report, outputs


def _report(stats: RunStats, max_num_seqs: int, kv_capacity_blocks: int) -> dict:
    out = {**stats.to_dict(), "max_num_seqs": max_num_seqs, "kv_capacity_blocks": kv_capacity_blocks}
    keep = ["tokens_per_s", "output_tokens_per_s", "wall_s", "prompt_tokens", "cached_tokens", "reusable_tokens",
            "prefill_tokens", "saving_vs_ideal", "output_tokens", "preemptions", "prefix_requests", "max_num_seqs",
            "kv_capacity_blocks", "engine_steps", "rows_per_step", "mean_kv_usage"]
    return {k: out[k] for k in keep}


def _in_fresh_process(job: Path, name: str, log_file: Path) -> tuple[dict, dict]:
    """One run in a new Python process (no warm caches, no allocator state, no threads left over
    from an earlier run): its report, with the process id, and its answers."""
    out = job.with_name(f"{name}-{time.time_ns()}.json")
    subprocess.run([sys.executable, "-m", "engine.bench.compare", str(job), name, str(out), str(log_file)], check=True)
    result = json.loads(out.read_text())
    out.unlink()
    return result["report"], result["outputs"]


def _child(job: str, name: str, out: str, log_file: str) -> None:
    """``python -m engine.bench.compare JOB NAME OUT LOG``: run NAME on the pickled batch and settings in JOB."""
    route_library_output(Path(log_file))  # vLLM's log lines to the bench's log file, as in the parent
    with open(job, "rb") as f:
        prompt_sets, engine_settings, sampling, scheduler = pickle.load(f)
    report, outputs = _one_run(name, prompt_sets[RUNS[name].prompts], engine_settings, sampling, scheduler)
    report["pid"] = os.getpid()
    Path(out).write_text(json.dumps({"report": report, "outputs": outputs}))


def rotated(names: list[str], repetition: int) -> list[str]:
    """The runs' order in repetition ``repetition``: each run goes first once every len(names)."""
    k = repetition % len(names)
    return names[k:] + names[:k]


def ratio_summary(values: list[float]) -> dict:
    """Median and range of one ratio over the repetitions; a range that crosses 1.0 is on par."""
    lo, hi = min(values), max(values)
    call = "faster" if lo > 1 else "slower" if hi < 1 else "on par"
    return {"median": round(float(np.median(values)), 3), "min": round(lo, 3), "max": round(hi, 3), "call": call}


def run_bench(args) -> dict:
    from ..models import resolve_model
    from ..plan.tokenizing import load_tokenizer

    model_path = resolve_model(args.model or DEFAULT_MODEL)
    tokenizer = load_tokenizer(model_path)
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
    elif args.shape == "fields":
        fields = fields or FIELDS_SHAPE
        table = fields_table(args.seed)
        batches, field_order_s = _field_batches(table, fields, tokenizer, args.block_size)
        max_tokens = np.random.default_rng(args.seed).integers(2, 9, table.num_rows).astype(np.int64)  # short answers
        ids = table.column("id").to_pylist()
        described = {"shape": "fields", "seed": args.seed, "fields": fields.fields, "field_order": fields.field_order.value}
    elif args.shape == "short":
        fields = fields or SHORT_SHAPE
        table, max_tokens, choices = short_table(args.seed)
        batches, field_order_s = _field_batches(table, fields, tokenizer, args.block_size)
        response_formats = {row: ResponseFormat(choice=c) for row, c in choices.items()}
        ids = table.column("id").to_pylist()
        described = {"shape": "short", "seed": args.seed, "fields": fields.fields, "field_order": fields.field_order.value,
                     "constrained_rows": len(choices)}
    elif args.shape == "nested":
        batches["declared"], max_tokens = nested_tokens(vocab, args.seed)
        described = {"shape": "nested", "seed": args.seed}
    elif args.shape == "templates":
        batches["declared"], max_tokens = templates_tokens(vocab, args.seed)
        described = {"shape": "templates", "seed": args.seed}
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
    both = {name: _planned(b, max_tokens, args.block_size, ids, response_formats) for name, b in batches.items()}
    planned_sets = {name: planned for name, (planned, _) in both.items()}  # each prompt set's plan
    prompt_sets = {name: prepared for name, (_, prepared) in both.items()}  # ... and the batch its runs get
    prepared, reordered = planned_sets["declared"], planned_sets.get("chosen")
    plan = prepared.plan
    working_set = int(plan.unique_tokens // args.block_size)
    kv_blocks = args.kv_cache_blocks or max(64, working_set // 3)
    engine_settings = engine_settings_from(args, model_path).model_copy(update={"kv_cache_blocks": kv_blocks})
    # Fixed output lengths (ignore_eos) make the runs' token counts equal; a constrained answer ends
    # where its format does, in every run alike.
    response_format = response_format_from(args)
    constrained = response_format is not None or bool(response_formats)
    sampling = SamplingSettings(max_tokens=int(max_tokens.max()), ignore_eos=not constrained,
                                response_format=response_format)
    scheduler = SchedulerSettings(
        kv_budget_fraction=args.kv_budget_fraction, prefix_requests=args.prefix_requests,
        reserve_output=args.reserve_output, lookahead_tokens=args.lookahead_tokens,
    )
    names = args.runs.split(",") if args.runs else [n for n, run in RUNS.items() if run.prompts in prompt_sets]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise ValueError(f"unknown run(s) {unknown}: choose from {', '.join(RUNS)}")
    lacking = [n for n in names if RUNS[n].prompts not in prompt_sets]
    if lacking:
        raise ValueError(f"run(s) {lacking} need prompts from fields (--fields, or the fields and short shapes)"
                         + ("; batchllm_field_order needs --field-order optimize"
                            if "batchllm_field_order" in lacking else ""))
    repetitions, outputs = [], {}
    with tempfile.TemporaryDirectory(prefix="batchllm-bench-") as folder:
        job = Path(folder) / "job.pickle"
        with open(job, "wb") as f:  # the batch as planned, without the plan's tree: what every run gets
            pickle.dump((prompt_sets, engine_settings, sampling, scheduler), f)
        for repetition in range(args.repeat):
            runs = {}
            for name in rotated(names, repetition):
                log.info("bench: %s (repetition %d of %d)", name, repetition + 1, args.repeat)
                runs[name], answers = _in_fresh_process(job, name, args.log_file)
                outputs.setdefault(name, []).append(answers)
                log.info("bench: %s -> %s", name, runs[name])
            repetitions.append(runs)

    # Answers are compared among runs of the same prompts; answers in another field order are
    # compared with them apart (a different prompt may change an answer).
    same_prompts = {n: runs for n, runs in outputs.items() if RUNS[n].prompts == "declared"} or outputs
    reference = (same_prompts.get("vllm_apc") or next(iter(same_prompts.values())))[0]
    every = [answers for runs in same_prompts.values() for answers in runs]
    mismatched = [i for i in reference if any(answers.get(i) != reference[i] for answers in every)]
    agreement = 1 - len(mismatched) / max(len(reference), 1)
    field_order_agreement = None
    if "batchllm_field_order" in outputs and len(same_prompts) < len(outputs):
        ours = outputs["batchllm_field_order"][0]
        field_order_agreement = round(sum(ours.get(i) == reference[i] for i in reference) / max(len(reference), 1), 4)
    # Charged to each engine run: the plan of the prompts it ran, and choosing their field order.
    planning_s = {"batchllm": prepared.plan_s,
                  "batchllm_field_order": (reordered.plan_s + field_order_s) if reordered else 0.0}
    ratios, with_planning = _ratios(repetitions, planning_s)
    return {
        "workload": {**described, "rows": prepared.num_rows, "model": args.model or DEFAULT_MODEL, "dtype": engine_settings.for_platform(current_platform()).dtype,
                     "block_size": args.block_size, "kv_cache_blocks": kv_blocks,
                     "prefix_working_set_blocks": working_set, "prompt_tokens": plan.prompt_tokens,
                     "unique_tokens": plan.unique_tokens, "shared_prompt_tokens": plan.shared_prompt_tokens,
                     "duplicate_rows": count_duplicates(prepared.duplicate_set), "plan_s": round(prepared.plan_s, 4),
                     # batchllm's own prompts where it reorders their fields (the baselines keep the declared order)
                     **({"batchllm_prompt_tokens": reordered.plan.prompt_tokens,
                         "batchllm_unique_tokens": reordered.plan.unique_tokens,
                         "field_order_s": round(field_order_s, 4)} if reordered else {}),
                     "planning_s_charged": {name: round(s, 4) for name, s in planning_s.items() if name in names}},
        "repeat": args.repeat,
        "run_order": [list(runs) for runs in repetitions],  # each repetition's order (rotated)
        "runs": {name: _median_run([runs[name] for runs in repetitions]) for name in names},
        # batchllm's tokens/s over each baseline's, per repetition: median and range
        "ratios": ratios,
        # the same with batchllm charged its planning time (the baselines need none)
        "ratios_with_planning": with_planning,
        # batchllm's prefill tokens over each baseline's: under 1 is fewer tokens computed
        "prefill_ratios": _prefill_ratios(repetitions),
        # prompt tokens each prompt set computes at least (sorted, at this block size; see Run)
        "prompt_set_prefill": {name: int(p.plan.prompt_tokens - p.plan.shared_prompt_tokens)
                               for name, p in planned_sets.items()},
        "outputs_equal": not mismatched,
        # With reordered fields: the share of rows whose answer is the same in both orders.
        "field_order_agreement": field_order_agreement,
        "rows_with_different_outputs": len(mismatched),
        # Share of rows whose greedy answer was the same in every run. Equal by construction on CPU
        # (fp32); on a GPU, bf16 kernels depend on the batch's composition unless vLLM runs
        # batch-invariant (--batch-invariant: VLLM_BATCH_INVARIANT=1), so an order can change an answer.
        "answer_agreement": round(agreement, 4),
        "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT") == "1",
        "verdict": verdict(with_planning, agreement, prepared.num_rows, described, field_order_agreement),  # charged
    }


def _ratios(repetitions: list[dict], plan_s: dict[str, float]) -> tuple[dict, dict]:
    """Each engine run against each baseline, per repetition (runs of one repetition ran back to
    back), summarized: without and with the engine run's planning time charged to its wall time.
    ``batchllm`` is compared only with runs of its own prompts, ``batchllm_field_order`` with all.
    Throughput is rows answered per second: runs on other prompts (another field order) answer the
    same rows with other token counts."""
    plain, charged = {}, {}
    for ours_name in ENGINE_RUNS:
        for baseline in BASELINES:
            if RUNS[ours_name].prompts == "declared" and RUNS[baseline].prompts != "declared":
                continue  # the engine's own effect: on exactly the prompts the baseline ran
            pairs = [(runs[ours_name], runs[baseline]) for runs in repetitions if ours_name in runs and baseline in runs]
            pairs = [(ours, theirs) for ours, theirs in pairs if theirs["wall_s"]]
            if not pairs:
                continue
            plain.setdefault(ours_name, {})[f"vs_{baseline}"] = ratio_summary(
                [theirs["wall_s"] / ours["wall_s"] for ours, theirs in pairs])
            charged.setdefault(ours_name, {})[f"vs_{baseline}"] = ratio_summary(
                [theirs["wall_s"] / (ours["wall_s"] + plan_s[ours_name]) for ours, theirs in pairs])
    return plain, charged


def _prefill_ratios(repetitions: list[dict]) -> dict:
    """Each engine run's computed prompt tokens over each baseline's (the first repetition: counts do not vary)."""
    runs = repetitions[0]
    return {ours: {f"vs_{b}": round(runs[ours]["prefill_tokens"] / runs[b]["prefill_tokens"], 4)
                   for b in BASELINES if b in runs and runs[b]["prefill_tokens"]}
            for ours in ENGINE_RUNS if ours in runs}


def _median_run(reports: list[dict]) -> dict:
    """One run's report over the repetitions: each number's median, tokens/s with its range."""
    out = {key: (float(np.median([r[key] for r in reports])) if isinstance(value, float) else value)
           for key, value in reports[0].items() if key not in ("pid", "per_step")}
    out["tokens_per_s_range"] = [min(r["tokens_per_s"] for r in reports), max(r["tokens_per_s"] for r in reports)]
    out["pids"] = [r["pid"] for r in reports]
    if "per_step" in reports[0]:  # each repetition's own profile: a median of profiles would describe no run
        out["per_step"] = [r["per_step"] for r in reports]
    return out


LABELS = {"vllm_generate_sorted": "vLLM's LLM.generate on sorted rows", "vllm_apc_sorted": "vLLM on sorted rows",
          "vllm_apc": "vLLM with prefix caching", "vllm_nocache": "vLLM without it",
          "vllm_hand_order": "LLM.generate on sorted rows with fields by distinct values (by hand)"}
ENGINE_LABELS = {"batchllm": "batchllm on the same prompts", "batchllm_field_order": "batchllm with its field order"}


def verdict(ratios: dict, agreement: float, rows: int, described: dict, field_order_agreement: float | None = None) -> str:
    """Lines a team can act on: how each engine run compared with the strongest baseline that ran
    (the one it leads by least), with the range over the repetitions. ``batchllm`` is judged on
    the baselines' own prompts (the engine's effect); ``batchllm_field_order`` against every
    baseline, the hand order included (the engine and its field order together)."""
    what = f"{rows} rows of {described['source']}" if described["shape"] == "table" else f"the {described['shape']} shape"
    if not ratios:
        return f"on {what}: run batchllm and a vLLM run to compare"
    equal = "outputs equal" if agreement == 1 else f"OUTPUTS DIFFER in {100 * (1 - agreement):.1f}% of rows"
    if field_order_agreement is not None:
        equal = (f"outputs on the same prompts {'equal' if agreement == 1 else 'DIFFER'}; batchllm's field order gave "
                 f"the same answer for {100 * field_order_agreement:.1f}% of rows")
    lines = []
    for ours, against in ratios.items():
        strongest = min(against, key=lambda key: against[key]["median"])
        r = against[strongest]
        spread = f"{r['median']:.2f}x (range {r['min']:.2f}-{r['max']:.2f})" if r["min"] != r["max"] else f"{r['median']:.2f}x"
        call = {"faster": "faster than", "on par": "on par with", "slower": "SLOWER than"}[r["call"]]
        others = ", ".join(f"{against[k]['median']:.2f}x {LABELS[k[3:]]}" for k in against if k != strongest)
        lines.append(f"{ENGINE_LABELS[ours]} is {call} the strongest baseline, {LABELS[strongest[3:]]}: {spread}"
                     + (f"; {others}" if others else ""))
    return f"on {what}: " + "; ".join(lines) + f" ({equal})"


def synthetic_analysis_tokens(rows: int, tokens_per_row: int, rows_per_group: int, seed: int = 0):
    """A million-row batch: groups share most of each row, the rest is unique."""
    rng = np.random.default_rng(seed)
    shared = tokens_per_row * 4 // 5
    groups = max(1, rows // rows_per_group)
    prefixes = rng.integers(10, 50000, (groups, shared), dtype=np.int32)
    out = np.empty((rows, tokens_per_row), dtype=np.int32)
    group = rng.integers(0, groups, rows)
    for lo in range(0, rows, 1 << 17):  # in chunks: no second full-size temporary
        hi = min(rows, lo + (1 << 17))
        out[lo:hi, :shared] = prefixes[group[lo:hi]]
        out[lo:hi, shared:] = rng.integers(10, 50000, (hi - lo, tokens_per_row - shared), dtype=np.int32)
    del prefixes
    return out.reshape(-1), np.arange(rows + 1, dtype=np.int64) * tokens_per_row


def run_analysis(args) -> dict:
    tokens, offsets = synthetic_analysis_tokens(args.rows, args.tokens_per_row, args.rows_per_group, args.seed)
    decode = np.full(args.rows, args.output_tokens, dtype=np.int64)
    gc.collect()
    tracemalloc.start()
    started = time.perf_counter()
    plan = build_plan(tokens, offsets, decode, args.block_size)
    plan_s = time.perf_counter() - started
    _, peak_alloc = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "rows": args.rows,
        "tokens": int(tokens.size),
        "token_array_bytes": int(tokens.nbytes),
        "plan_s": round(plan_s, 3),
        "plan_peak_alloc_bytes": int(peak_alloc),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "groups": plan.num_groups,
        "shared_fraction": round(plan.shared_fraction, 4),
    }


def cmd_bench(args) -> int:
    if args.scale:
        # The scale benchmark runs the Dagster assets, which the engine does not import: it is a
        # program of the code location, run as its own process (its phases each in a fresh one).
        command = [sys.executable, "-m", "dagster_project.scale_bench", "--rows", str(args.scale),
                   "--model", args.model or "tiny", "--partition-rows", str(args.partition_rows)]
        return subprocess.call(command)
    if getattr(args, "batch_invariant", False):
        if current_platform() != "cuda":  # vLLM's batch-invariant kernels are Triton kernels for GPUs
            raise SystemExit(f"batchllm bench: --batch-invariant needs a CUDA GPU (vLLM's Triton kernels); "
                             f"this platform is {current_platform()}, where fp32 answers do not depend on "
                             f"the batch: leave the option out")
        os.environ["VLLM_BATCH_INVARIANT"] = "1"  # read by vLLM when its engines start
    if args.scheduler_only:
        from .bench_scheduler import measure_fill, run_scheduler_only

        if args.shape == "short":  # how full the batch runs at a GPU's settings
            result = measure_fill()
        else:
            result = run_scheduler_only([int(n) for n in args.rows_in_flight.split(",")])
    else:
        result = run_analysis(args) if args.analysis else run_bench(args)
    if "verdict" in result:
        log.info("bench: %s", result["verdict"])
    print(json.dumps(result, indent=2))
    return 0


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="compare this engine with plain vLLM in one run")
    bench.add_argument("prompts", nargs="?", help="a prompt table (Parquet, .sql, or a table of --database): bench a "
                       "sample of its rows instead of a synthetic --shape")
    bench.add_argument("--database", help="DuckDB database PROMPTS refers to (opened read-only)")
    bench.add_argument("--sample", type=at_least_one, default=500,
                       help="rows of PROMPTS to bench, as whole prefix groups (default 500)")
    bench.add_argument("--max-tokens", type=at_least_one, default=64, help="output tokens of a PROMPTS row without its own")
    bench.add_argument("--json", action="store_true", help="JSON on stdout (always; logs go to stderr)")
    bench.add_argument("--runs", help="comma-separated subset of " + ",".join(RUNS) + " (default: every run the "
                       "prompts allow; " + ", ".join(FIELD_RUNS) + " need prompts from fields)")
    bench.add_argument("--repeat", type=at_least_one, default=1,
                       help="run every run N times, the order rotated each time; ratios get a median and a range")
    bench.add_argument("--shape", choices=SHAPES, default="groups", help="the synthetic table (see the module doc)")
    bench.add_argument("--groups", type=int, default=Workload.groups)
    bench.add_argument("--rows-per-group", type=int, default=Workload.rows_per_group)
    bench.add_argument("--system-tokens", type=int, default=Workload.system_tokens)
    bench.add_argument("--prefix-tokens", type=int, default=Workload.prefix_tokens)
    bench.add_argument("--suffix-tokens", type=int, default=Workload.suffix_tokens)
    bench.add_argument("--output-tokens", type=int, default=Workload.output_tokens)
    bench.add_argument("--output-mix", choices=["fixed", "rows", "tasks"], default=Workload.output_mix,
                       help="fixed lengths, random per row, or a short or long task per group")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--kv-budget-fraction", type=float, default=SchedulerSettings().kv_budget_fraction)
    bench.add_argument("--prefix-requests", action="store_true",
                       help="compute a group's prefix by a request of its own where its rows cannot all enter at once")
    bench.add_argument("--reserve-output", choices=[r.value for r in ReserveOutput],
                       default=SchedulerSettings().reserve_output.value)
    bench.add_argument("--lookahead-tokens", type=int, default=SchedulerSettings().lookahead_tokens)
    bench.add_argument("--batch-invariant", action="store_true",
                       help="run vLLM batch-invariant (VLLM_BATCH_INVARIANT=1): on a GPU, answers then do not "
                       "depend on which rows share a step, so the runs' answers can be compared exactly")
    bench.add_argument("--analysis", action="store_true", help="time the plan alone on synthetic token ids")
    bench.add_argument("--scheduler-only", action="store_true",
                       help="our own cost per engine step (scheduler + drive loop) on a stand-in engine, no vLLM; "
                       "with --shape short, how full the batch runs at an H200's settings on the block-accounting "
                       "stand-in, against vLLM alone on sorted rows")
    bench.add_argument("--rows-in-flight", default="1024,4096,16384", help="sizes for --scheduler-only")
    bench.add_argument("--scale", type=at_least_one, metavar="ROWS",
                       help="a ROWS-row nightly job through Dagster: first plan, a rerun with 1%% of the rows "
                       "changed, one completions partition (see dagster_project/scale_bench.py)")
    bench.add_argument("--partition-rows", type=at_least_one, default=10_000, help="rows per shard for --scale")
    bench.add_argument("--rows", type=int, default=1_000_000, help="rows for --analysis")
    bench.add_argument("--tokens-per-row", type=int, default=500, help="tokens per row for --analysis")
    add_engine_options(bench)  # --kv-cache-blocks defaults to a third of the prefix working set here
    add_response_format_options(bench)
    add_prompt_fields_options(bench)
    bench.set_defaults(func=cmd_bench)


if __name__ == "__main__":  # one run of a bench, in its own process (see _in_fresh_process)
    _child(*sys.argv[1:])
