"""The token cache: a rerun tokenizes only new or changed rows and gets the same token ids."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.plan.block_hashes import RowBlocks
from engine.plan.token_cache import TokenCache, _PartChains
from engine.plan.tokenizing import load_tokenizer, tokenize_rows
from engine.table.dataset import Columns
from engine.table.prompt_snapshot import CONTENT_KEY, content_keys

BLOCK = 4  # small blocks: the short test rows have several


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


def chain_rows(chains, batch_rows: int = 1024) -> list[tuple[int, list[int]]]:
    """Each row's length and chained block hashes, in row order, as a plan loads them (``row_batches``)."""
    found = {}
    for batch in chains.row_batches(batch_rows):
        found.update((row, (length, hashes)) for row, length, hashes in zip(*(batch.column(name).to_pylist()
                                                                              for name in ("row", "length", "hashes"))))
    return [found[row] for row in sorted(found)] if sorted(found) == list(range(len(found))) else []


def blocks_rows(blocks: RowBlocks) -> list[tuple[int, list[int]]]:
    return [(int(length), blocks.chain(row)) for row, length in enumerate(blocks.lengths)]


def looked_up(cache, path, tokenizer, block_size, keep=None, **options):
    """The cache's rows of the snapshot at ``path``, with their chains (``rows``, read inside
    ``writing``'s block, as a plan reads them), the cache compacted after, keeping ``keep``."""
    with cache.writing(path, block_size) as writer:
        found = writer.rows(writer.tokenize(writer.look_up(), tokenizer, Columns(), **options))
        found.rows = chain_rows(found.chains)
        if found.worth_compacting:
            writer.compact(found, keep)
    return found


def same_rows(cached, fresh, block_size=BLOCK):
    """The cache's view of the rows (their lengths and chained block hashes) is the one computed from
    fresh token ids."""
    expected = (fresh.rows if hasattr(fresh, "rows")  # another cache's rows
                else blocks_rows(fresh.row_blocks(block_size)))  # token ids
    return cached.rows == expected and len(expected) > 0 and cached.errors == fresh.errors


def test_a_rerun_tokenizes_only_changed_rows_and_gets_fresh_token_ids(tmp_path, tiny_model):
    prompts, messages = rows(range(40), count=30)  # some rows share content: tokenized once
    prompts[3] = ""  # an error row is cached with its reason
    path = tmp_path / "prompts.parquet"
    keys = snapshot(path, prompts, messages)[CONTENT_KEY].combine_chunks()
    cache = TokenCache(tmp_path / "cache", "fp1")
    counting = CountingTokenizer(tiny_model)
    first = looked_up(cache, path, counting, BLOCK)
    fresh = tokenize_rows(load_tokenizer(tiny_model), prompts, messages)
    assert same_rows(first, fresh) and first.errors == {3: "empty prompt"}
    assert (first.cached_rows, first.tokenized_rows) == (0, len(set(zip(prompts, messages))))
    tokens, offsets, _ = cache.lookup(keys)  # what a partition reads
    assert np.array_equal(tokens, fresh.tokens) and np.array_equal(offsets, fresh.offsets)

    again = looked_up(cache, path, NoTokenizer(), BLOCK)
    assert same_rows(again, fresh) and again.tokenized_rows == 0

    prompts[7] = "An edited row."
    keys = snapshot(path, prompts, messages)[CONTENT_KEY].combine_chunks()
    counting.rows = 0
    edited = looked_up(cache, path, counting, BLOCK)
    assert (edited.cached_rows, edited.tokenized_rows) == (39, 1) and counting.rows == 1
    assert same_rows(edited, tokenize_rows(load_tokenizer(tiny_model), prompts, messages))
    tokens, offsets, _ = cache.lookup(keys)
    assert tokens[offsets[7]:offsets[8]].tolist() == load_tokenizer(tiny_model)("An edited row.")["input_ids"]


def test_another_block_size_or_an_older_part_is_hashed_again_without_tokenizing(tmp_path, tiny_model, monkeypatch):
    prompts, messages = rows(range(30), count=30)
    path = tmp_path / "prompts.parquet"
    snapshot(path, prompts, messages)
    cache = TokenCache(tmp_path / "cache", "fp1")
    looked_up(cache, path, load_tokenizer(tiny_model), BLOCK)
    fresh = tokenize_rows(load_tokenizer(tiny_model), prompts, messages)
    assert same_rows(looked_up(cache, path, NoTokenizer(), 2), fresh, block_size=2)

    # A part written before block hashes were cached: (key, token_ids, error) only.
    (part,) = cache._parts()
    old = pa.ipc.open_file(pa.memory_map(str(part))).read_all().select(["key", "token_ids", "error"])
    staging = part.with_suffix(".old")
    with pa.OSFile(str(staging), "wb") as sink, pa.ipc.new_file(sink, old.schema) as writer:
        writer.write_table(old)
    staging.replace(part)  # a new file: the old one may still be mapped
    assert same_rows(looked_up(cache, path, NoTokenizer(), BLOCK), fresh)

    # Hashes made by another version of the hash function are made again.
    import engine.plan.token_cache

    monkeypatch.setattr(engine.plan.token_cache, "HASH_VERSION", 99)
    assert same_rows(looked_up(cache, path, NoTokenizer(), BLOCK), fresh)
    (part,) = cache._parts()
    assert pa.ipc.open_file(str(part)).schema.metadata[b"batchllm.block_hashes"] == b"v99 blocks of 4"


@pytest.mark.parametrize("rows_, hardware, expected", [(95_000, ["cpu"], 10), (10, ["cpu", "big"], 2),
                                                      (10**10, ["cpu"], 100_000), (0, ["cpu"], 1)])
def test_the_shard_count_derives_from_the_rows(rows_, hardware, expected):
    from batchllm_dagster import BatchJobConfig, DatasetSpec

    config = BatchJobConfig(name="j", dataset=DatasetSpec(parquet="p.parquet"), hardware=hardware,
                            output_database="o.duckdb", storage_dir="s")
    assert config.shard_count(rows_) == expected
    assert config.model_copy(update={"shards": 3}).shard_count(rows_) == 3


def test_gathering_rows_in_any_order_across_parts_copies_the_right_ids():
    from engine.plan.token_cache import _gather

    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 100, rng.integers(0, 7)).tolist() for _ in range(50)]
    chunks = [pa.array(rows[:20], pa.large_list(pa.int32())), pa.array(rows[20:], pa.large_list(pa.int32()))]
    position = np.concatenate([np.arange(10, 30), rng.permutation(50)])  # a run across the parts, then shuffled
    tokens, offsets = _gather(pa.chunked_array(chunks), position)
    assert [tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(position.size)] == [rows[p] for p in position]


def test_an_item_of_lists_in_any_order_across_chunks_is_the_right_one():
    from engine.plan.token_cache import _items_at

    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 2**60, rng.integers(3, 7), dtype=np.uint64).tolist() for _ in range(50)]
    chunks = [pa.array(rows[:20], pa.large_list(pa.uint64())), pa.array(rows[20:], pa.large_list(pa.uint64()))]
    entries = np.concatenate([np.arange(10, 30), rng.permutation(50)])
    for index in (0, 2):
        assert _items_at(pa.chunked_array(chunks), entries, index).tolist() == [rows[e][index] for e in entries]


def test_hashes_are_gathered_part_by_part_for_rows_in_any_order(tmp_path, tiny_model):
    """A plan reads its rows' hashes one part at a time (each part mapped on its own, let go before
    the next): rows of several parts, shuffled and repeated, get the hashes fresh token ids give."""
    prompts, messages = rows(range(30), count=30)
    path = tmp_path / "prompts.parquet"
    cache = TokenCache(tmp_path / "cache", "fp")
    tokenizer = load_tokenizer(tiny_model)
    snapshot(path, prompts[:12], messages[:12])
    looked_up(cache, path, tokenizer, BLOCK)  # part one
    snapshot(path, prompts[12:], messages[12:])
    looked_up(cache, path, tokenizer, BLOCK)  # part two
    order = np.random.default_rng(1).permutation(30).tolist() + [3, 20, 3]
    shuffled = ([prompts[i] for i in order], [messages[i] for i in order])
    snapshot(path, *shuffled)
    got = looked_up(cache, path, NoTokenizer(), BLOCK)
    assert len(list((tmp_path / "cache" / "fp").glob("part-*"))) == 2
    fresh = tokenize_rows(tokenizer, *shuffled)
    assert same_rows(got, fresh)
    # In batches smaller than a part, each batch of one part: the same rows.
    parts = cache._mapped(BLOCK)
    position = cache._positions(pq.read_table(path).column(CONTENT_KEY).combine_chunks(),
                                cache.load(BLOCK))
    expected = fresh.row_blocks(BLOCK)
    chains = _PartChains.of([(path, table.num_rows) for path, table in parts], position, expected.lengths, BLOCK)
    assert chain_rows(chains, batch_rows=5) == blocks_rows(expected)
    assert max(len(hashes) for _, hashes in blocks_rows(expected)) > 3



LOAD = """
import json, sys
from engine.plan.tokenizing import load_tokenizer
tokenizer = load_tokenizer(sys.argv[1])
print(json.dumps({"auto": "transformers.models.auto.tokenization_auto" in sys.modules, "torch": "torch" in sys.modules,
                  "ids": tokenizer(["Shared instruction. Row 1.", "x"])["input_ids"],
                  "chat": tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                        add_generation_prompt=True)}))
"""


@pytest.mark.slow
def test_the_tokenizer_class_autotokenizer_picked_is_loaded_directly_the_next_time(tmp_path, tiny_model):
    """A rerun with a few changed rows must not pay AutoTokenizer's imports (torch, every model's
    config), and must tokenize exactly as AutoTokenizer's tokenizer does."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "BATCHLLM_CACHE_DIR": str(tmp_path)}

    def load():
        done = subprocess.run([sys.executable, "-c", LOAD, tiny_model], env=env, capture_output=True, text=True,
                              check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = load(), load()
    assert first["auto"] and not second["auto"] and not second["torch"]
    assert len(list((tmp_path / "tokenizer_classes").iterdir())) == 1
    assert (first["ids"], first["chat"]) == (second["ids"], second["chat"])


class FailingTokenizer(CountingTokenizer):
    """Fails once it has encoded ``limit`` rows: a crash in the middle of the first night."""

    def __init__(self, model, limit):
        super().__init__(model)
        self.limit = limit

    def __call__(self, texts, **kwargs):
        if self.rows + len(texts) > self.limit:
            raise RuntimeError("killed")
        return super().__call__(texts, **kwargs)


def test_a_crash_while_tokenizing_keeps_the_parts_written_and_progress_is_reported(tmp_path, tiny_model, monkeypatch):
    import engine.plan.token_cache

    monkeypatch.setattr(engine.plan.token_cache, "_TEXT_BATCH", 4)
    monkeypatch.setattr(engine.plan.token_cache, "_PART_ROWS", 8)
    prompts = [f"Row {i} asks its own question." for i in range(40)]
    path = tmp_path / "prompts.parquet"
    snapshot(path, prompts, [None] * 40)
    cache = TokenCache(tmp_path / "cache", "fp1")
    with pytest.raises(RuntimeError, match="killed"):
        looked_up(cache, path, FailingTokenizer(tiny_model, limit=20), BLOCK)
    kept = cache.load(BLOCK).num_rows
    assert 8 <= kept <= 20 and kept % 8 == 0  # whole parts only: the batch being written is lost

    counting, lines = CountingTokenizer(tiny_model), []
    rows_ = looked_up(cache, path, counting, BLOCK, progress=lines.append)
    assert (rows_.cached_rows, rows_.tokenized_rows, counting.rows) == (kept, 40 - kept, 40 - kept)
    assert same_rows(rows_, tokenize_rows(load_tokenizer(tiny_model), prompts, [None] * 40))
    assert lines[-1].startswith(f"tokenized {40 - kept} of {40 - kept} new contents")


def test_compaction_keeps_what_the_plan_on_disk_names_and_waits_for_readers(tmp_path, tiny_model):
    """Two nights of edits: compaction drops entries the snapshot no longer has, except those the
    plan on disk still names (its partitions may be queued), and never while a partition is
    reading its entries (it holds the reader lock from reading its plan to mapping its ids)."""
    import threading

    path = tmp_path / "prompts.parquet"
    cache = TokenCache(tmp_path / "cache", "fp1")
    tokenizer = load_tokenizer(tiny_model)
    first = snapshot(path, [f"night one row {i}" for i in range(10)], [None] * 10)[CONTENT_KEY].combine_chunks()
    looked_up(cache, path, tokenizer, BLOCK)
    planned = first.slice(0, 4)  # the plan on disk: partitions of it may still run
    snapshot(path, [f"night two row {i}" for i in range(10)], [None] * 10)

    compacted = threading.Event()

    def plan_again():
        looked_up(cache, path, tokenizer, BLOCK, keep=planned)
        compacted.set()

    with TokenCache.reading(tmp_path / "cache"):
        worker = threading.Thread(target=plan_again)
        worker.start()
        assert not compacted.wait(1.0)  # compaction waits for the reading partition
        tokens, _, _ = cache.lookup(planned)  # its entries are all there
        assert tokens.size
    worker.join(30)
    assert compacted.is_set()
    assert len(cache._parts()) == 1  # compacted
    kept = cache.load().column("key").combine_chunks()
    assert set(planned.to_pylist()) <= set(kept.to_pylist())  # the plan's entries survived
    assert not set(first.slice(4).to_pylist()) & set(kept.to_pylist())  # the rest of night one's went
    cache.lookup(planned)  # a queued partition of the previous plan still finds its rows


def test_compaction_deletes_only_the_parts_it_read(tmp_path, tiny_model):
    """A part another writer published after this one loaded the cache is never deleted under it."""
    path = tmp_path / "prompts.parquet"
    cache = TokenCache(tmp_path / "cache", "fp1")
    keys = snapshot(path, [f"row {i}" for i in range(6)], [None] * 6)[CONTENT_KEY].combine_chunks()
    looked_up(cache, path, load_tokenizer(tiny_model), BLOCK)
    loaded = cache._parts()
    late = tmp_path / "late.parquet"
    snapshot(late, ["a late row"], [None])
    other = TokenCache(tmp_path / "cache", "fp1")
    with other.writing(late, BLOCK) as writer:  # another writer's part (not compacted)
        writer.tokenize(writer.look_up(), load_tokenizer(tiny_model), Columns())
    late_part = sorted(set(cache._parts()) - set(loaded))
    assert late_part
    cache._compact(loaded, keys, None, BLOCK)
    assert all(p.exists() for p in late_part)


def test_a_damaged_part_is_named_set_aside_and_its_rows_tokenized_again(tmp_path, tiny_model):
    prompts, messages = rows(range(30), count=30)
    path = tmp_path / "prompts.parquet"
    snapshot(path, prompts, messages)
    said = []
    cache = TokenCache(tmp_path / "cache", "fp1", on_damaged=said.append)
    first = looked_up(cache, path, CountingTokenizer(tiny_model), BLOCK)
    (part,) = cache.folder.glob("part-*.arrow")
    part.write_bytes(part.read_bytes()[:100])  # truncated outside the package
    again = looked_up(cache, path, CountingTokenizer(tiny_model), BLOCK)
    assert same_rows(again, first) and again.tokenized_rows == first.tokenized_rows
    (line,) = said
    assert line.startswith(f"the token cache part {part} is damaged (") and "; its rows are tokenized again" in line
    assert "\n" not in line and len(list(cache.folder.glob(f"{part.name}.damaged-*"))) == 1


@pytest.mark.slow  # starts a local Ray
def test_workers_on_ray_make_the_entries_one_process_makes_in_its_order(tmp_path, tiny_model, monkeypatch):
    """Two Ray workers tokenize the batches of a first night: the cache's rows equal one process's
    (lengths, hashes, errors: an empty prompt and a chat row among them), in the snapshot's order;
    a night of fewer new rows than ``min_rows`` stays in the process (no Ray)."""
    import engine.plan.token_cache
    from engine.plan.tokenize_workers import TokenizeWorkers

    monkeypatch.setattr(engine.plan.token_cache, "_TEXT_BATCH", 16)  # several batches in flight
    monkeypatch.setattr(engine.plan.token_cache, "_WORKER_BATCH", 16)
    prompts, messages = rows(range(200), 60)
    prompts[7] = ""  # an error row, kept in its place
    path = tmp_path / "prompts.parquet"
    snapshot(path, prompts, messages)
    fresh = tokenize_rows(load_tokenizer(tiny_model), prompts, messages)
    alone = looked_up(TokenCache(tmp_path / "alone", "fp"), path, load_tokenizer(tiny_model), BLOCK)
    lines = []
    workers = TokenizeWorkers(2, min_rows=10)
    spread = looked_up(TokenCache(tmp_path / "spread", "fp"), path, load_tokenizer(tiny_model), BLOCK,
                       progress=lines.append, workers=workers)
    assert same_rows(alone, fresh) and same_rows(spread, fresh) and 7 in spread.errors
    assert spread.tokenized_rows == alone.tokenized_rows and "on 2 workers" in lines[-1]
    # Each worker wrote its batches' parts itself (the part's name carries the writer's pid).
    writers = {int(p.stem.rsplit("-", 1)[1]) for p in (tmp_path / "spread" / "fp").glob("part-*.arrow")}
    assert len(list((tmp_path / "spread" / "fp").glob("part-*.arrow"))) > 1  # a part per batch with new contents
    assert writers and os.getpid() not in writers
    assert TokenizeWorkers(2, min_rows=10_000).used_for(spread.tokenized_rows) == 1  # a small night: here


def test_rows_repeating_a_content_are_not_read_again(tmp_path, tiny_model, monkeypatch):
    """A night whose new rows repeat contents (copied rows), over several batches, reads and
    tokenizes each content once: only a content's first row is read (a batch of contents seen
    before once failed the night: take([]))."""
    import engine.plan.token_cache

    monkeypatch.setattr(engine.plan.token_cache, "_TEXT_BATCH", 4)
    prompts = [f"Row {i % 4} asks." for i in range(12)]
    path = tmp_path / "prompts.parquet"
    snapshot(path, prompts, [None] * 12)
    counting = CountingTokenizer(tiny_model)
    cached = looked_up(TokenCache(tmp_path / "cache", "fp"), path, counting, BLOCK)
    assert cached.tokenized_rows == counting.rows == 4
    assert same_rows(cached, tokenize_rows(load_tokenizer(tiny_model), prompts, [None] * 12))


def test_the_writers_stages_go_in_their_order(tmp_path, tiny_model):
    """A lookup with rows missing has no chains (they come of ``tokenize``), and a cache with
    nothing stale is not worth compacting."""
    path = tmp_path / "prompts.parquet"
    snapshot(path, [f"row {i}" for i in range(6)], [None] * 6)
    cache = TokenCache(tmp_path / "cache", "fp1")
    with cache.writing(path, BLOCK) as writer:
        lookup = writer.look_up()
        with pytest.raises(KeyError, match="6 rows are not in the token cache"):
            writer.rows(lookup)
        rows_ = writer.rows(writer.tokenize(lookup, load_tokenizer(tiny_model), Columns()))
        assert (rows_.cached_rows, rows_.tokenized_rows, rows_.stale_entries, rows_.entries) == (0, 6, 0, 6)
        assert not rows_.worth_compacting
