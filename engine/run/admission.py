"""Who admits a batch's rows into vLLM: the engine's group-wise scheduler, or vLLM itself, given the
rows in plan order. Decided once per batch, from the plan and the engine's KV size, before any row runs.

Group-wise admission gains only where vLLM admitting the same rows in the same order computes prompt
tokens twice: a shared prefix evicted before its last sharer runs, or rows preempted and computed
again (vLLM admits a prompt that fits and preempts it when its output needs a block the cache no
longer has). Its price is a batch a little less full (it reserves the block a row's next token writes
and counts rows by what they may hold). So where vLLM alone computes the minimum, vLLM admits: its
schedule exactly, plus the plan's order, identical rows computed once and earlier answers reused.

The question is answered on vLLM's scheduler in miniature (``engine.run.stand_in``, the KV block
accounting of vLLM's ``KVCacheManager``): the rows in plan order with their counted output (their
``max_tokens``, an upper bound, or the length their job's answers were learned to take:
``PreparedBatch.counted_output``), on the engine's KV capacity, ``max_num_seqs`` and token budget.
A batch whose every block fits the cache at once needs no simulation: nothing is evicted or preempted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..plan.block_hashes import RowBlocks
from ..plan.common_prefix import common_whole_blocks
from ..plan.tokenizing import TokenizedBatch
from ..settings import Admission
from .kv_budget import KVBudget, KVGroups
from .requests import RequestKind, Submission
from .stand_in import BlockAccountingEngine

# Group-wise admission is chosen where vLLM alone would compute more than this share of prompt tokens
# over the minimum: below it, a fuller batch gains more than is computed twice (README, "How a batch
# runs", lists the bench's shapes on either side of it).
MIN_RECOMPUTED_SHARE = 0.02
# The simulation covers the first rows in plan order up to this many times the KV capacity (the
# regime shows within a few fills) and this many row-steps: its cost is paid before every shard's
# first request (README: benchmarks/admission_cost.py measures it at a GPU's sizes).
SIMULATED_FILLS = 4
SIMULATED_ROW_STEPS = 400_000
MIN_SIMULATED_FILLS = 2  # fewer (long answers, a large cache) tell nothing: group-wise, as BatchLLM runs them


@dataclass(frozen=True)
class AdmissionChoice:
    admission: Admission
    reason: str


@dataclass(frozen=True)
class EngineLimits:
    """What vLLM's own admission is bounded by, read from the started engine."""

    block_size: int
    capacity_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    steps_ahead: int = 0
    kv_groups: KVGroups = KVGroups()  # the KV cache groups sharing the pool (``kv_budget``)

    @classmethod
    def of(cls, engine) -> "EngineLimits":
        # An engine that does not say (a test double over no vLLM): vLLM's default 256 rows, no token
        # budget, one full-attention KV cache group.
        return cls(engine.block_size, engine.kv_capacity_blocks, getattr(engine, "max_num_seqs", None) or 256,
                   getattr(engine, "max_num_batched_tokens", None), engine.steps_ahead,
                   getattr(engine, "kv_groups", None) or KVGroups())

    @property
    def kv(self) -> KVBudget:
        return KVBudget(self.capacity_blocks, self.block_size, self.kv_groups)


def choose_admission(batch: TokenizedBatch, output_tokens: np.ndarray, rows_in_plan_order: list[int],
                     limits: EngineLimits, prefix_requests: bool = False) -> AdmissionChoice:
    """Group-wise where it can gain over vLLM admitting ``rows_in_plan_order`` itself, else vLLM."""
    if prefix_requests:
        return AdmissionChoice(Admission.GROUP_WISE, "prefix requests are on (scheduler.prefix_requests)")
    if limits.kv_groups.window_caps and not limits.kv_groups.window_holds:
        # Without a decoding row's hold, a window group is counted at its prefill's cap all along: far
        # above what vLLM holds once rows decode (66 blocks of Gemma 3's against 2,113). Group-wise
        # admission would then run fuller batches only by luck, and the stand-in would overstate
        # vLLM's own preemptions. With it (read from the started engine), the choice is made as for any model.
        return AdmissionChoice(Admission.VLLM, f"this model's KV cache has sliding-window groups "
                               f"({limits.kv_groups.describe()}) whose decoding hold is not known: vLLM admits, "
                               "in plan order")
    blocks, shared = _row_blocks(batch, output_tokens, rows_in_plan_order, limits.kv)
    demand = int(blocks.sum())
    usable = limits.kv.usable
    if demand <= usable:
        return AdmissionChoice(Admission.VLLM, f"the whole batch fits the KV cache ({demand} of {usable} blocks): "
                                               "nothing is evicted or preempted")
    count, sample_blocks = _simulated_count(blocks, output_tokens[rows_in_plan_order], usable)
    sample = rows_in_plan_order[:count]
    if sample_blocks < MIN_SIMULATED_FILLS * usable:  # long answers: the cost cap cut it before the cache filled twice
        return AdmissionChoice(Admission.GROUP_WISE, f"the first {len(sample)} rows' answers are too long to "
                               f"simulate vLLM alone on more than {sample_blocks / usable:.1f} caches' worth of "
                               "rows: group-wise admission, which never preempts for want of a row's next block")
    prefill, preemptions = simulate_vllm_admission(batch, output_tokens, sample, limits)
    minimum = int(batch.lengths[sample].sum()) - int(shared[:count].sum()) * limits.block_size
    extra = prefill - minimum
    measured = (f"vLLM admitting the first {len(sample)} rows in plan order computes {prefill} prompt tokens, "
                f"{extra} ({extra / max(minimum, 1):.1%}) over the minimum, with {preemptions} preemptions, "
                f"on a KV cache of {usable} blocks for a batch needing {demand}")
    if extra > MIN_RECOMPUTED_SHARE * minimum:
        return AdmissionChoice(Admission.GROUP_WISE, measured + ": group-wise admission computes them once")
    return AdmissionChoice(Admission.VLLM, measured + ": nothing for group-wise admission to gain")


def _row_blocks(batch: TokenizedBatch, output_tokens: np.ndarray, rows: list[int],
                kv: KVBudget) -> tuple[np.ndarray, np.ndarray]:
    """Per row in plan order: the pool's KV blocks it adds when all are in flight at the end of their
    output (each whole prompt block shared with the row before it counted once in each full-attention
    group; a sliding-window group's as a decoding row holds it), and those shared blocks."""
    shared = np.zeros(len(rows), dtype=np.int64)
    previous = None
    for i, row in enumerate(rows):
        tokens = batch.tokens_of(row)
        if previous is not None:
            shared[i] = common_whole_blocks(tokens, previous, kv.block_size)
        previous = tokens
    ends = batch.lengths[rows].astype(np.int64) + np.asarray(output_tokens)[rows]
    return kv.alone_blocks(ends, decoding=True) - kv.groups.full * shared, shared


def _simulated_count(blocks: np.ndarray, output_tokens: np.ndarray, usable: int) -> tuple[int, int]:
    """How many of the first rows are simulated: up to ``SIMULATED_FILLS`` caches' worth of blocks and
    ``SIMULATED_ROW_STEPS`` output tokens; and their blocks (the whole batch counts as enough)."""
    cut = np.flatnonzero((np.cumsum(blocks) >= SIMULATED_FILLS * usable)
                         | (np.cumsum(np.asarray(output_tokens, dtype=np.int64)) >= SIMULATED_ROW_STEPS))
    if cut.size == 0:
        return blocks.size, max(int(blocks.sum()), SIMULATED_FILLS * usable)  # the whole batch: nothing left out
    return int(cut[0]) + 1, int(blocks[: cut[0] + 1].sum())


def simulate_vllm_admission(batch: TokenizedBatch, output_tokens: np.ndarray, rows: list[int],
                            limits: EngineLimits) -> tuple[int, int]:
    """Prompt tokens vLLM computes for ``rows`` submitted at once in this order, and its
    preemptions: on the stand-in."""
    engine = BlockAccountingEngine(limits.capacity_blocks, limits.block_size, limits.max_num_seqs,
                                   limits.max_num_batched_tokens, limits.steps_ahead, limits.kv_groups)
    # The rows' block hashes in one vectorized pass (row by row, hashing was most of a 10,000-row run's set-up).
    tokens = [batch.tokens_of(row) for row in rows]
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in tokens])]).astype(np.int64)
    chains = RowBlocks.of_tokens(np.concatenate(tokens) if tokens else np.zeros(0, np.int32), offsets,
                                 limits.block_size)
    chain_at = chains.offsets
    for i, row in enumerate(rows):
        engine.submit(Submission(RequestKind.ROW, row, tokens[i], int(output_tokens[row])), None,
                      prompt_hashes=chains.hashes[chain_at[i]:chain_at[i + 1]].tolist())
    while engine.has_unfinished():
        engine.step()
    return engine.prefill_tokens, engine.preemptions
