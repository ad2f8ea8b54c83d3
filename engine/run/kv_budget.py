"""The engine's KV cache counted in blocks, one way for everyone who counts it: the scheduler's
admission, the choice of who admits (``admission``) and the block-accounting stand-in (as vLLM keeps
its KV cache manager apart from its scheduler). vLLM keeps one block of its cache as the null block,
so a cache of ``capacity_blocks`` holds ``usable`` blocks of rows.

A model may mix attention kinds (Gemma 2 and 3, gpt-oss, Mistral with a sliding window): vLLM then
splits its layers into KV cache groups of equal size that allocate from the same pool, a row holding
blocks in each. A full-attention group holds every token of a row; a sliding-window group at most
``max_admission_blocks_per_request`` blocks of it (its window and the tokens a step has in flight:
vLLM frees the blocks the window has left behind), and once it decodes far fewer: its window and the
few tokens a decoding row has in flight (``window_holds``: 66 blocks of 16 for Gemma 3's 1,024-token
window, where a prefill may hold 2,113). ``KVGroups`` says how many of each the pool serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class KVGroups:
    """The KV cache groups sharing vLLM's pool: ``full`` full-attention groups, and per sliding-window
    group the most blocks a row holds in it (``window_caps``). One full-attention group: most models."""

    full: int = 1
    window_caps: tuple[int, ...] = ()
    # per sliding-window group, the most blocks a row holds in it once it decodes (vLLM's own bound on
    # a decoding row's tokens in flight); none given: its cap, counted as at its prefill
    window_holds: tuple[int, ...] = ()

    def __post_init__(self):
        if self.full < 0 or self.full + len(self.window_caps) < 1 or any(c < 1 for c in self.window_caps):
            raise ValueError(f"no KV cache group to count: {self}")
        if self.window_holds and (len(self.window_holds) != len(self.window_caps)
                                  or any(not 1 <= h <= c for h, c in zip(self.window_holds, self.window_caps))):
            raise ValueError(f"each window group's decoding hold must be in 1..its cap: {self}")

    def caps(self, decoding: bool = False) -> tuple[int, ...]:
        """The most blocks a row holds in each sliding-window group, while it prefills or once it decodes."""
        return (self.window_holds or self.window_caps) if decoding else self.window_caps

    def describe(self) -> str:
        decoding = f", {min(self.caps(decoding=True))} decoding" if self.window_holds else ""
        windows = f", {len(self.window_caps)} sliding-window (at most {min(self.window_caps)} blocks a row{decoding})" \
            if self.window_caps else ""
        return f"{self.full} full-attention{windows}"


@dataclass(frozen=True)
class KVBudget:
    capacity_blocks: int  # what vLLM reports (``cache_config.num_gpu_blocks``), its null block included
    block_size: int
    groups: KVGroups = field(default_factory=KVGroups)

    @property
    def usable(self) -> int:
        """Blocks rows can hold."""
        return max(1, self.capacity_blocks - 1)

    def share(self, fraction: float) -> int:
        """The blocks a scheduler may keep in flight at ``fraction`` of the usable ones (at least one)."""
        return max(1, int(self.usable * fraction))

    def blocks_for(self, tokens):
        """Blocks that hold ``tokens`` tokens in one group (an int or a NumPy array of them)."""
        return -(-np.asarray(tokens, dtype=np.int64) // self.block_size)

    @property
    def per_shared_block(self) -> int:
        """Pool blocks a block of a shared prefix takes, counted once: one in each full-attention group.
        A sliding-window group's blocks are counted per row (vLLM shares them too while they are in the
        window, and frees them after: counting them per row never counts fewer than it holds)."""
        return self.groups.full

    def window_weights(self, total_tokens, decoding: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """How a row of ``total_tokens`` (prompt and whole output) is counted in the sliding-window
        groups, while it prefills or once it decodes: per block of its tokens, ``growing`` (the groups
        whose cap it never reaches), plus ``constant`` (the caps of the groups it would reach, counted
        whole from then on)."""
        blocks = self.blocks_for(total_tokens)
        growing = np.zeros(blocks.shape, dtype=np.int64)
        constant = np.zeros(blocks.shape, dtype=np.int64)
        for cap in self.groups.caps(decoding):
            capped = blocks > cap
            growing += ~capped
            constant += np.where(capped, cap, 0)
        return growing, constant

    def window_blocks(self, tokens, decoding: bool = False):
        """What ``tokens`` tokens of one request take in the sliding-window groups, all of them, while
        it prefills or once it decodes."""
        blocks = self.blocks_for(tokens)
        return sum((np.minimum(blocks, cap) for cap in self.groups.caps(decoding)), np.zeros_like(blocks))

    def alone_blocks(self, total_tokens, decoding: bool = False):
        """Pool blocks a row of ``total_tokens`` holds at most, alone in the engine (``decoding``: at
        the end of its output, its windows' prefill blocks freed)."""
        return self.groups.full * self.blocks_for(total_tokens) + self.window_blocks(total_tokens, decoding)

    def too_large_reason(self, blocks: int) -> str:
        """Why a row that needs ``blocks`` blocks alone (with its output) cannot run at all."""
        groups = f"; KV cache groups: {self.groups.describe()}" if self.groups != KVGroups() else ""
        return (f"needs {blocks} KV blocks with its output; the KV cache has {self.usable} "
                f"(block size {self.block_size}{groups})")
