"""The bench's synthetic workloads (``--shape``): token ids, or tables whose prompts come from
fields; the scale of ``--analysis`` too. Each is seeded: the same shape is the same rows every run.

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
  constrained to a choice (stop at EOS, not ``ignore_eos``);
* ``kv_bound``  - rows that share little beyond an instruction, answers of one small length (8 tokens),
  a KV cache that holds ~140 of them: the regime where KV binds and vLLM's own admission is hard to beat;
* ``long_budget`` - the ``short`` shape's tickets (300 customers) with a generous ``max_tokens`` (160)
  and short answers: each a JSON object of a team and a flag, ended by its format (EOS), as a job
  that sets a large budget for a small extraction runs (what ``batchllm_learned`` learns lengths on).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ..plan.tokenizing import TokenizedBatch
from ..table.fields import FieldOrder, PromptFields

SHAPES = ("groups", "nested", "templates", "duplicates", "fields", "short", "kv_bound", "long_budget")


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


def kv_bound_tokens(vocab: tuple[int, int], seed: int = 0, rows: int = 480, instruction_tokens: int = 40,
                    output_tokens: int = 8):
    """Rows sharing only an instruction of ``instruction_tokens`` (one whole block of 32), each with
    64-160 tokens of its own, answers of ``output_tokens`` each: at the bench's KV size (a third of
    the working set) ~140 rows fit, so KV binds and rows admitted together finish together."""
    rng = np.random.default_rng(seed)
    lo, hi = vocab
    instruction = rng.integers(lo, hi, instruction_tokens)
    out = [np.concatenate([instruction, rng.integers(lo, hi, rng.integers(64, 161))]) for _ in range(rows)]
    return TokenizedBatch.from_rows(out), np.full(rows, output_tokens, dtype=np.int64)


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


LONG_BUDGET_TOKENS = 160
LONG_BUDGET_FORMAT = {"type": "object", "properties": {"team": {"enum": SHORT_CHOICES}, "urgent": {"type": "boolean"}},
                      "required": ["team", "urgent"], "additionalProperties": False}


def long_budget_table(seed: int = 0, customers: int = 300) -> tuple[pa.Table, np.ndarray, dict]:
    """``short_table``'s tickets, each row's budget ``LONG_BUDGET_TOKENS`` and its answer a JSON object
    (``LONG_BUDGET_FORMAT``, a dozen tokens): the table, each row's max_tokens and each row's format."""
    table, _, _ = short_table(seed, customers)
    return table, np.full(table.num_rows, LONG_BUDGET_TOKENS, dtype=np.int64), {
        row: {"json_schema": LONG_BUDGET_FORMAT} for row in range(table.num_rows)}


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
