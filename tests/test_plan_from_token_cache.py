"""The plan step's planner (rows from the token cache, their tree built a depth at a time,
duplicates by content key) makes the plan the in-memory planner makes from token ids: the same
groups, run order, prefixes and shards."""

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.plan.prepared import plan_prompts, plan_tokenized
from engine.plan.shards import assign_shards
from engine.plan.token_cache import TokenCache
from engine.plan.tokenizing import load_tokenizer
from engine.settings import EngineSettings, SamplingSettings, SchedulerSettings
from engine.table.dataset import Columns
from engine.table.prompt_snapshot import CONTENT_KEY, content_keys

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
def test_the_plan_from_the_token_cache_is_the_plan_from_token_ids(tmp_path, tiny_model, seed):
    table = table_of(seed, 300)
    path = tmp_path / "prompts.parquet"
    pq.write_table(table, path)
    settings = EngineSettings(model_path=tiny_model, block_size=8, max_model_len=256)
    sampling, scheduler = SamplingSettings(max_tokens=5), SchedulerSettings(min_group_rows=2)
    tokenizer = load_tokenizer(tiny_model)
    in_memory, _ = plan_prompts(table, tokenizer, settings, sampling, scheduler=scheduler)
    with TokenCache(tmp_path / "cache", "fp").rows_for(path, tokenizer, Columns(), 8) as rows:
        from_cache = plan_tokenized(table.drop_columns(["prompt", "messages"]), rows, settings, sampling,
                                    scheduler=scheduler)
    a, b = in_memory.plan, from_cache.plan
    assert in_memory.errors == from_cache.errors and len(a.order) == 300
    for name in ("order", "group_of_row", "group_prefix_tokens", "group_sizes", "row_unique_tokens"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.num_groups < 300 and a.shared_prompt_tokens > 0  # the rows share: the plans have something to agree on
    assert np.array_equal(in_memory.duplicate_set >= 0, from_cache.duplicate_set >= 0)
    assert (in_memory.duplicate_set >= 0).sum() > 0
    for count in (1, 3, 7):
        assert np.array_equal(assign_shards(a, count).shard_of_row, assign_shards(b, count).shard_of_row)
