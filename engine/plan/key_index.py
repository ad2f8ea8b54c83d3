"""Where each of many 16-byte content keys first occurs among others, found by sorting, not hashing.

The token cache finds a night's rows among its entries by content key (``digests.row_key``, 128
bits of blake2b). Arrow's hash lookup (``index_in``) held ~75 bytes an entry at its peak (the plan
step's largest stage: docs/benchmark-history.md); this holds 20: the entries' two 64-bit words sorted by the
first, and the order that sorts them (int32). A key is found by binary search on its first word (a
batch of keys sorted first, so the searches walk the array in order) and checked on its second. Digests'
first words almost never collide, but the answer is right for any keys: where a first word starts
a run of several entries whose first does not match, the run is scanned in entry order.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .duplicates import key_words

_QUERY_BATCH = 262_144  # keys sorted and searched at a time (a few MB)


class KeyIndex:
    """``values`` (16-byte keys, chunks allowed) ready to be searched: ``first_positions``."""

    def __init__(self, values: pa.Array | pa.ChunkedArray):
        chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
        words = [key_words(chunk) for chunk in chunks if len(chunk)]
        first = np.concatenate([w[:, 0] for w in words]) if words else np.zeros(0, np.uint64)
        order = np.argsort(first, kind="stable")  # equal first words: entries in their order
        self.first = first[order]
        del first
        # The second words scattered to their sorted places a chunk at a time (no copy of them all
        # in entry order beside the sorted one); positions as int32 where they fit.
        self.order = order.astype(np.int32) if order.size < 2**31 else order
        del order
        sorted_place = np.empty(self.order.size, dtype=self.order.dtype)
        sorted_place[self.order] = np.arange(self.order.size, dtype=self.order.dtype)
        self.second = np.empty(self.order.size, dtype=np.uint64)
        start = 0
        for w in words:
            self.second[sorted_place[start:start + len(w)]] = w[:, 1]
            start += len(w)

    def __len__(self) -> int:
        return self.order.size

    def first_positions(self, keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """Each key's first position among the values (int64), -1 where it is not there."""
        out = np.full(len(keys), -1, dtype=np.int64)
        if not len(self):
            return out
        start = 0
        for chunk in keys.chunks if isinstance(keys, pa.ChunkedArray) else [keys]:  # a chunk at a time: no copy
            words = key_words(chunk) if len(chunk) else np.zeros((0, 2), np.uint64)
            for lo in range(0, len(chunk), _QUERY_BATCH):
                batch = words[lo:lo + _QUERY_BATCH]
                by_word = np.argsort(batch[:, 0])
                out[start + lo + by_word] = self._found(batch[by_word, 0], batch[by_word, 1])
            start += len(chunk)
        return out

    def _found(self, first: np.ndarray, second: np.ndarray) -> np.ndarray:
        at = np.searchsorted(self.first, first)  # the first entry of the key's first word, if any
        clipped = np.minimum(at, len(self) - 1)
        same_word = (at < len(self)) & (self.first[clipped] == first)
        hit = same_word & (self.second[clipped] == second)
        found = np.where(hit, self.order[clipped], -1)
        for j in np.flatnonzero(same_word & ~hit):  # another key with this first word comes first
            end = np.searchsorted(self.first, first[j], side="right")
            match = np.flatnonzero(self.second[at[j]:end] == second[j])
            if match.size:
                found[j] = self.order[at[j] + match[0]]
        return found


def first_positions_among(keys: pa.Array | pa.ChunkedArray, values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """``KeyIndex(values).first_positions(keys)`` for a few keys among many values: the keys are
    indexed and the values scanned a chunk at a time, so what is held follows the keys (a shard's
    lookup of its rows in a token cache of every row's contents)."""
    index = KeyIndex(keys)
    first_equal_key = index.first_positions(keys)  # a key repeated: each copy answers as its first
    found = np.full(len(keys), -1, dtype=np.int64)
    start = 0
    for chunk in values.chunks if isinstance(values, pa.ChunkedArray) else [values]:
        among_keys = index.first_positions(chunk)
        hits = np.flatnonzero(among_keys >= 0)
        key, first_hit = np.unique(among_keys[hits], return_index=True)  # each key's first value in the chunk
        unset = found[key] < 0
        found[key[unset]] = start + hits[first_hit[unset]]
        start += len(chunk)
    return found[first_equal_key]
