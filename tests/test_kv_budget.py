"""The KV cache counted in blocks (``engine/run/kv_budget.py``), one way for admission, its choice and
the stand-in: the null block apart, a model's KV cache groups, a sliding window's prefill cap and its
decoding hold."""

import numpy as np
import pytest

from engine.run.kv_budget import KVBudget, KVGroups
from engine.run.stand_in import BlockAccountingEngine


def test_the_kv_cache_is_counted_one_way_its_null_block_apart():
    kv = KVBudget(capacity_blocks=65, block_size=32)
    assert kv.usable == 64 and kv.share(0.5) == 32 and kv.blocks_for(33) == 2
    assert kv.blocks_for(np.array([1, 32, 64, 65])).tolist() == [1, 1, 2, 3]
    assert kv.too_large_reason(70) == "needs 70 KV blocks with its output; the KV cache has 64 (block size 32)"
    assert KVBudget(1, 16).usable == 1  # never none
    engine = BlockAccountingEngine(65, 32)
    assert engine.free_blocks == kv.usable and engine.referenced_blocks == 0


def test_a_row_alone_holds_its_full_attention_blocks_and_its_windows_up_to_their_caps():
    """Gemma 3's kind in miniature: one full-attention group, one sliding window of 4 blocks while a
    row prefills and 2 once it decodes (vLLM frees what the window has left)."""
    kv = KVBudget(100, 16, KVGroups(full=1, window_caps=(4,), window_holds=(2,)))
    tokens = np.array([16, 48, 160])  # 1, 3 and 10 blocks
    assert kv.alone_blocks(tokens).tolist() == [1 + 1, 3 + 3, 10 + 4]
    assert kv.alone_blocks(tokens, decoding=True).tolist() == [1 + 1, 3 + 2, 10 + 2]
    growing, constant = kv.window_weights(tokens)
    assert growing.tolist() == [1, 1, 0] and constant.tolist() == [0, 0, 4]  # a capped row counts its cap whole
    assert kv.per_shared_block == 1  # a shared prefix block: once, in the full-attention group only
    assert "1 full-attention, 1 sliding-window (at most 4 blocks a row, 2 decoding)" in kv.too_large_reason(200)


def test_a_window_group_with_a_hold_above_its_cap_or_no_group_is_refused():
    with pytest.raises(ValueError, match="decoding hold must be in 1..its cap"):
        KVGroups(1, (4,), (5,))
    with pytest.raises(ValueError, match="no KV cache group"):
        KVGroups(0, ())
