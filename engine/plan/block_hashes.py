"""What the planner needs of a row without its token ids: its length and its chained block hashes.

A row's ``k``-th hash covers its first ``k + 1`` whole KV blocks (a 64-bit chain, as vLLM's prefix
cache keys its blocks), so two rows share a prefix tree node at depth ``k`` exactly when their
``k``-th hashes are equal (up to collisions, ~n^2 / 2^64). A row's hashes depend on its tokens
alone, so they are computed once per content and cached next to its token ids: a nightly rerun
plans a million rows without reading 2 GB of ids back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

HASH_VERSION = 1  # bump when the hash changes: cached hashes of another version are recomputed
_HASH_SEED = 0x5EED_BA7C
_CHUNK_BLOCKS = 1 << 16  # blocks hashed at a time: bounds the temporary (blocks x block_size) copy
_CHUNK_ROWS = 1 << 16  # rows chained at a time: bounds the per-block index arrays


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: spreads a 64-bit value's bits (wrapping arithmetic on uint64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _block_hashes(tokens: np.ndarray, starts: np.ndarray, block_size: int) -> np.ndarray:
    """Hash of the ``block_size`` tokens at each start offset (a weighted sum, mixed per depth later)."""
    weights = _mix(np.arange(1, block_size + 1, dtype=np.uint64) + np.uint64(_HASH_SEED)) | np.uint64(1)
    out = np.empty(starts.size, dtype=np.uint64)
    if tokens.size < block_size:
        return out
    windows = sliding_window_view(tokens, block_size)  # row ``s`` = the block starting at ``s``, no copy
    for lo in range(0, starts.size, _CHUNK_BLOCKS):
        blocks = windows[starts[lo : lo + _CHUNK_BLOCKS]]
        # Column by column: numpy reduces a short last axis slowly, and this never widens the whole copy.
        acc = blocks[:, 0].astype(np.uint64) * weights[0]
        for j in range(1, block_size):
            acc += blocks[:, j].astype(np.uint64) * weights[j]
        out[lo : lo + acc.size] = acc
    return out


def rows_by_depth(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows sorted by whole blocks, most first, and how many reach each depth: the rows with a
    block at depth ``k`` are ``deepest_first[:reaching[k + 1]]``."""
    deepest_first = np.argsort(-blocks, kind="stable")
    reaching = np.bincount(blocks, minlength=int(blocks.max(initial=0)) + 1)[::-1].cumsum()[::-1]
    return deepest_first, reaching


def _chains(tokens: np.ndarray, offsets: np.ndarray, block_size: int) -> np.ndarray:
    """The chained hashes of the rows ``tokens[offsets[i]:offsets[i + 1]]``, one row after the other."""
    lengths = np.diff(offsets)
    blocks = lengths // block_size
    first = np.concatenate([[0], np.cumsum(blocks)]).astype(np.int64)  # each row's first block
    row = np.repeat(np.arange(lengths.size), blocks)  # the row of every block
    depth = np.arange(int(first[-1]), dtype=np.int64) - first[row]  # the block's index in its row
    own = _block_hashes(np.asarray(tokens), offsets[row] + depth * block_size, block_size)
    del row, depth
    # Chain depth by depth: row r's block k mixes in its block k-1's chained hash.
    chained = np.empty(own.size, dtype=np.uint64)
    deepest_first, reaching = rows_by_depth(blocks)
    for k in range(reaching.size - 1):
        at = first[deepest_first[: reaching[k + 1]]] + k
        previous = chained[at - 1] if k else np.zeros(at.size, dtype=np.uint64)
        chained[at] = _mix(previous ^ _mix(own[at] + np.uint64(k)))
    return chained


@dataclass
class RowBlocks:
    """Rows as the planner sees them: row ``i`` has ``lengths[i]`` tokens and one chained hash per
    whole block, ``hashes[offsets[i]:offsets[i + 1]]`` (``offsets`` from ``lengths // block_size``)."""

    block_size: int
    lengths: np.ndarray  # int64, prompt tokens per row
    hashes: np.ndarray  # uint64, every row's chain one after the other

    def __post_init__(self):
        self.lengths = np.asarray(self.lengths, dtype=np.int64)
        if self.hashes.size != int((self.lengths // self.block_size).sum()):
            raise ValueError(f"{self.hashes.size} block hashes for rows of {int(self.lengths.sum())} tokens "
                             f"in blocks of {self.block_size}")

    @property
    def num_rows(self) -> int:
        return int(self.lengths.size)

    @property
    def blocks(self) -> np.ndarray:
        """Whole blocks per row."""
        return self.lengths // self.block_size

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.blocks)]).astype(np.int64)

    @classmethod
    def of_tokens(cls, tokens: np.ndarray, offsets: np.ndarray, block_size: int) -> "RowBlocks":
        """Hash the rows ``tokens[offsets[i]:offsets[i + 1]]``."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, not {block_size}")
        offsets = np.asarray(offsets, dtype=np.int64)
        lengths = np.diff(offsets)
        # A row's hashes depend on its tokens alone: hash a slice of rows at a time to bound memory.
        chains = [_chains(tokens, offsets[lo : lo + _CHUNK_ROWS + 1], block_size)
                  for lo in range(0, lengths.size, _CHUNK_ROWS)]
        return cls(block_size, lengths, np.concatenate(chains) if chains else np.zeros(0, np.uint64))

    def chain(self, row: int) -> list[int]:
        """Row ``row``'s chained hashes as Python ints (keys of a dict or Counter)."""
        offsets = self.offsets
        return self.hashes[offsets[row] : offsets[row + 1]].tolist()

    def without(self, rows) -> "RowBlocks":
        """The same rows with ``rows`` emptied (length 0, no blocks): rows that will not run."""
        rows = np.asarray(sorted(rows), dtype=np.int64)
        if not rows.size:
            return self
        keep = np.ones(self.hashes.size, dtype=bool)
        offsets = self.offsets
        for row in rows:
            keep[offsets[row] : offsets[row + 1]] = False
        lengths = self.lengths.copy()
        lengths[rows] = 0
        return RowBlocks(self.block_size, lengths, self.hashes[keep])
