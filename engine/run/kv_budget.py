"""The engine's KV cache counted in blocks, one way for everyone who counts it: the scheduler's
admission, the choice of who admits (``admission``) and the block-accounting stand-in (as vLLM keeps
its KV cache manager apart from its scheduler). vLLM keeps one block of its cache as the null block,
so a cache of ``capacity_blocks`` holds ``usable`` blocks of rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KVBudget:
    capacity_blocks: int  # what vLLM reports (``cache_config.num_gpu_blocks``), its null block included
    block_size: int

    @property
    def usable(self) -> int:
        """Blocks rows can hold."""
        return max(1, self.capacity_blocks - 1)

    def share(self, fraction: float) -> int:
        """The blocks a scheduler may keep in flight at ``fraction`` of the usable ones (at least one)."""
        return max(1, int(self.usable * fraction))

    def blocks_for(self, tokens):
        """Blocks that hold ``tokens`` tokens (an int or a NumPy array of them)."""
        return -(-np.asarray(tokens, dtype=np.int64) // self.block_size)

    def too_large_reason(self, blocks: int) -> str:
        """Why a row that needs ``blocks`` blocks alone (with its output) cannot run at all."""
        return (f"needs {blocks} KV blocks with its output; the KV cache has {self.usable} "
                f"(block size {self.block_size})")
