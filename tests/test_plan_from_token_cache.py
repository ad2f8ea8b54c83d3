"""A table's plan in memory (``plan_prompts``: ``batchllm plan`` and ``run``, the bench) is the prefix
tree's (the test oracle) on real tokenized rows, with errors, own budgets and formats and identical
rows: the same groups, run order, prefixes, row checks and shards. (A job's plan from its token
cache: ``test_plan_job.py``.)"""

import json
import random

import numpy as np
import pyarrow as pa
import pytest

from engine.plan.prepared import plan_prompts
from engine.plan.tokenizing import load_tokenizer, tokenize_rows
from engine.settings import EngineSettings, SamplingSettings, SchedulerSettings
from engine.table.dataset import Columns
from engine.table.prompt_snapshot import CONTENT_KEY, content_keys

from .oracle.planned import planned_by_tree
from .oracle.shards import assign_shards

HEADS = ["You are a careful assistant. Answer in one word.", "Summarize the review below in a sentence.",
         "Translate to French, keeping names as they are, and say nothing else at all."]
DOCUMENTS = ["The box holds three red apples and a pear.", "Our trip to the coast was cold but the food was good.",
             "Invoice 42: two chairs, one table, delivered Monday."]


def table_of(seed: int, n: int) -> pa.Table:
    """Rows sharing a head and a document at random, some identical, some empty or chat rows,
    some with their own max_tokens or format."""
    rng = random.Random(seed)
    prompts, messages, max_tokens, formats = [], [], [], []
    for _ in range(n):
        kind = rng.random()
        question = f"Question {rng.randint(0, n // 3)}?"
        prompts.append("" if kind < 0.05 else None if kind < 0.12 else
                       f"{rng.choice(HEADS)} {rng.choice(DOCUMENTS)} {question}")
        messages.append(json.dumps([{"role": "user", "content": question}]) if 0.05 <= kind < 0.12 else None)
        max_tokens.append(rng.choice([None, None, 3, 9]))
        formats.append(rng.choice([None, None, None, '{"choice": ["yes", "no"]}']))
    table = pa.table({"id": [f"r{i}" for i in range(n)], "prompt": pa.array(prompts, pa.string()),
                      "messages": pa.array(messages, pa.string()), "max_tokens": pa.array(max_tokens, pa.int64()),
                      "response_format": pa.array(formats, pa.string())})
    return table.append_column(CONTENT_KEY, content_keys(table["prompt"].combine_chunks(),
                                                         table["messages"].combine_chunks(), n))


@pytest.mark.parametrize("seed", range(4))
def test_a_tables_plan_in_memory_is_the_prefix_trees_plan(tiny_model, seed):
    table = table_of(seed, 300)
    settings = EngineSettings(model_path=tiny_model, block_size=8, max_model_len=256)
    sampling, scheduler = SamplingSettings(max_tokens=5), SchedulerSettings(min_group_rows=2)
    tokenizer = load_tokenizer(tiny_model)
    expected = planned_by_tree(table, tokenize_rows(tokenizer, table["prompt"].to_pylist(),
                                                    table["messages"].to_pylist()), settings, sampling, Columns(),
                               scheduler)
    for count in (1, 3, 7):
        planned, _ = plan_prompts(table, tokenizer, settings, sampling, scheduler=scheduler, shards=count)
        got, want = planned.plan, expected.plan
        assert planned.errors == expected.errors and len(got.order) == 300
        assert planned.max_tokens.tolist() == expected.max_tokens.tolist()
        assert planned.response_formats == expected.response_formats
        for name in ("order", "group_of_row", "group_prefix_tokens", "group_sizes", "row_unique_tokens", "lengths",
                     "decode_tokens"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), name
        assert np.array_equal(planned.duplicate_set, expected.duplicate_set)
        shards = assign_shards(want, count)
        assert np.array_equal(got.shard_of_row, shards.shard_of_row)
        assert got.shards.prefill_tokens.tolist() == shards.prefill_tokens.tolist()
    assert want.num_groups < 300 and want.shared_prompt_tokens > 0  # the rows share: something to agree on
    assert (expected.duplicate_set >= 0).sum() > 0 and expected.errors
