"""The token cache: a rerun tokenizes only new or changed rows and gets the same token ids."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.token_cache import CONTENT_KEY, TokenCache, content_keys
from engine.tokenizing import load_tokenizer, tokenize_rows


class CountingTokenizer:
    """The real tokenizer, counting the rows it is asked to encode."""

    def __init__(self, model):
        self.inner, self.rows = load_tokenizer(model), 0

    def __call__(self, texts, **kwargs):
        self.rows += len(texts)
        return self.inner(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class NoTokenizer:
    def __getattr__(self, name):
        raise AssertionError("the tokenizer must not be used when every row is cached")


def snapshot(path, prompts, messages):
    n = len(prompts)
    table = pa.table({"id": list(range(n)), "prompt": pa.array(prompts, pa.string()),
                      "messages": pa.array(messages, pa.string())})
    table = table.append_column(CONTENT_KEY, content_keys(table["prompt"].combine_chunks(),
                                                          table["messages"].combine_chunks(), n))
    pq.write_table(table, path)
    return table


def rows(prompts, count):
    chat = json.dumps([{"role": "user", "content": "What is in the box?"}])
    return ([None if i % 5 == 0 else f"Shared instruction. Row {i % count}." for i in range(len(prompts))],
            [chat if i % 5 == 0 else None for i in range(len(prompts))])


def test_a_rerun_tokenizes_only_changed_rows_and_gets_fresh_token_ids(tmp_path, tiny_model):
    prompts, messages = rows(range(40), count=30)  # some rows share content: tokenized once
    prompts[3] = ""  # an error row is cached with its reason
    path = tmp_path / "prompts.parquet"
    snapshot(path, prompts, messages)
    cache = TokenCache(tmp_path / "cache", "fp1")
    counting = CountingTokenizer(tiny_model)
    first, counts = cache.tokens_for(path, counting, "prompt", "messages")
    fresh = tokenize_rows(load_tokenizer(tiny_model), prompts, messages)
    assert np.array_equal(first.tokens, fresh.tokens) and np.array_equal(first.offsets, fresh.offsets)
    assert first.errors == fresh.errors == {3: "empty prompt"}
    distinct = len(set(zip(prompts, messages)))
    assert counts == {"cached_rows": 0, "tokenized_rows": distinct}

    again, counts = cache.tokens_for(path, NoTokenizer(), "prompt", "messages")
    assert np.array_equal(again.tokens, fresh.tokens) and counts["tokenized_rows"] == 0

    prompts[7] = "An edited row."
    snapshot(path, prompts, messages)
    counting.rows = 0
    edited, counts = cache.tokens_for(path, counting, "prompt", "messages")
    assert counts == {"cached_rows": 39, "tokenized_rows": 1} and counting.rows == 1
    assert edited.row(7) == load_tokenizer(tiny_model)("An edited row.")["input_ids"]
    assert np.array_equal(edited.offsets, tokenize_rows(load_tokenizer(tiny_model), prompts, messages).offsets)


def test_another_tokenizer_starts_a_new_cache_and_stale_parts_are_compacted(tmp_path, tiny_model):
    path = tmp_path / "prompts.parquet"
    prompts, messages = [f"Old row {i}." for i in range(20)], [None] * 20
    snapshot(path, prompts, messages)
    TokenCache(tmp_path / "cache", "fp1").tokens_for(path, load_tokenizer(tiny_model), "prompt", "messages")
    other = CountingTokenizer(tiny_model)
    TokenCache(tmp_path / "cache", "fp2").tokens_for(path, other, "prompt", "messages")
    assert other.rows > 0  # nothing reused across tokenizers
    snapshot(path, [f"Completely new row {i}." for i in range(20)], [None] * 20)
    cache = TokenCache(tmp_path / "cache", "fp1")
    cache.tokens_for(path, load_tokenizer(tiny_model), "prompt", "messages")
    assert len(list((tmp_path / "cache" / "fp1").glob("part-*.arrow"))) == 1  # old rows dropped
    assert cache.load().num_rows == 20


@pytest.mark.parametrize("rows_, hardware, expected", [(95_000, ["cpu"], 10), (10, ["cpu", "gpu"], 2),
                                                      (10**10, ["cpu"], 100_000), (0, ["cpu"], 1)])
def test_the_shard_count_derives_from_the_rows(rows_, hardware, expected):
    from batchllm_dagster import BatchJobConfig, DatasetSpec

    config = BatchJobConfig(name="j", dataset=DatasetSpec(parquet="p.parquet"), hardware=hardware,
                            output_database="o.duckdb", storage_dir="s")
    assert config.shard_count(rows_) == expected
    assert config.model_copy(update={"shards": 3}).shard_count(rows_) == 3


def test_gathering_rows_in_any_order_across_parts_copies_the_right_ids():
    from engine.token_cache import _gather

    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 100, rng.integers(0, 7)).tolist() for _ in range(50)]
    chunks = [pa.array(rows[:20], pa.large_list(pa.int32())), pa.array(rows[20:], pa.large_list(pa.int32()))]
    position = np.concatenate([np.arange(10, 30), rng.permutation(50)])  # a run across the parts, then shuffled
    tokens, offsets = _gather(pa.chunked_array(chunks), position)
    assert [tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(position.size)] == [rows[p] for p in position]
