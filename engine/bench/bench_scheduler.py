"""``batchllm bench --scheduler-only``: our own cost per engine step at GPU batch sizes, without vLLM.

A GPU with 141 GB admits thousands of rows at once; what the scheduler and the drive loop spend
between two engine steps must stay a small part of a step (an 8B model's decode step at 16,384
rows is tens of milliseconds). Here the engine is a stand-in that decodes every running row by one
token per step and finishes it at its ``max_tokens``, at a cost of O(rows admitted + finished),
with its own time measured and taken out: what remains is the scheduler (``GroupScheduler``:
admission, block counting, growth) and ``drive``, per step, at 256 / 1,024 / 16,384 rows in flight;
and the same with ``VLLMEngine`` itself over a stand-in that emits what vLLM emits.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from ..plan.tokenizing import TokenizedBatch
from ..run.drive import StepTotals, drive
from ..run.requests import StepReport, Submission
from ..run.scheduler import GroupScheduler, PlannedGroup
from ..settings import SamplingSettings, SchedulerSettings

BLOCK = 16  # vLLM's default KV block on GPUs
PREFIX_TOKENS, OWN_TOKENS, ROWS_PER_GROUP = 512, 48, 256


class _SteadyDecode:
    """Every running request gets one token per step (its first in the step it enters) and
    finishes at its ``max_tokens``; the stand-in's own time is kept in ``engine_s``, and the time
    outside it between two steps (ours) in ``gaps``. Subclasses say what a step reports."""

    def __init__(self):
        self._step, self.running, self.engine_s = 0, 0, 0.0
        self._entering: list = []
        self._finishing: dict[int, list] = defaultdict(list)
        self._left_at: float | None = None
        self.gaps: list[float] = []
        self.in_flight: list[int] = []

    def _max_tokens(self, request) -> int:
        raise NotImplementedError

    def _report(self, entered: list, finished: list):
        raise NotImplementedError

    def _advance(self):
        started = time.perf_counter()
        if self._left_at is not None:
            self.gaps.append(started - self._left_at)
        self._step += 1
        entered, self._entering = self._entering, []
        for request in entered:
            self.running += 1
            self._finishing[self._step + self._max_tokens(request) - 1].append(request)
        finished = self._finishing.pop(self._step, [])
        self.running -= len(finished)
        self.in_flight.append(self.running)
        report = self._report(entered, finished)
        self._left_at = time.perf_counter()
        self.engine_s += self._left_at - started
        return report


class SteadyDecodeEngine(_SteadyDecode):
    """The stand-in as an ``Engine`` the drive loop calls directly: the scheduler's cost alone."""

    def __init__(self, kv_capacity_blocks: int):
        super().__init__()
        self.block_size, self.kv_capacity_blocks = BLOCK, kv_capacity_blocks
        self.steps_ahead = 0

    def refusal(self, sampling) -> None:
        return None

    def submit(self, submission: Submission, sampling) -> None:
        self._entering.append(submission)

    def has_unfinished(self) -> bool:
        return bool(self.running or self._entering)

    def step(self) -> StepReport:
        return self._advance()

    def _max_tokens(self, submission: Submission) -> int:
        return submission.max_tokens

    def _report(self, entered: list, finished: list) -> StepReport:
        report = StepReport(running=self.running)
        report.started = [s.key for s in entered if s.max_tokens > 1]
        report.finished = [_finished(s) for s in finished]
        return report


def _finished(submission: Submission):
    from ..run.requests import Finished

    return Finished(submission=submission, text="", token_ids=[0] * submission.max_tokens,
                    prompt_tokens=len(submission.token_ids), cached_tokens=0, finish_reason="length")


class LLMEngineStandIn(_SteadyDecode):
    """vLLM's ``LLMEngine`` as ``VLLMEngine`` drives it, with no model. With DELTA outputs and
    ``STREAM_INTERVAL`` vLLM emits a ``RequestOutput`` at a request's first token and at its finish
    only, and so does this; what is measured is ours: the handle turning outputs into reports and
    building each request's ``SamplingParams``, the scheduler, drive."""

    def __init__(self):
        from types import SimpleNamespace

        super().__init__()
        self.renderer = SimpleNamespace(render_cmpl=lambda prompts: prompts)

    def add_request(self, request_id: str, engine_input: dict, params) -> None:
        self._entering.append((request_id, params.max_tokens, len(engine_input["prompt_token_ids"])))

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self._entering)

    def step(self) -> list:
        return self._advance()

    def _max_tokens(self, request) -> int:
        return request[1]

    def _report(self, entered: list, finished: list) -> list:
        return [
            _request_output(request_id, 1, False, prompt)
            for request_id, max_tokens, prompt in entered
            if max_tokens > 1
        ] + [
            _request_output(request_id, max(max_tokens - 1, 1), True, prompt)
            for request_id, max_tokens, prompt in finished
        ]


def _request_output(request_id: str, new_tokens: int, finished: bool, prompt_tokens: int):
    """What ``VLLMEngine.step`` reads of a vLLM ``RequestOutput`` (DELTA: the new tokens only)."""
    from types import SimpleNamespace

    completion = SimpleNamespace(token_ids=[7] * new_tokens, text="x" * new_tokens,
                                 finish_reason="length" if finished else None, stop_reason=None)
    return SimpleNamespace(request_id=request_id, outputs=[completion], finished=finished,
                           prompt_token_ids=range(prompt_tokens), num_cached_tokens=0)


def _batch(rows: int, mean_output: int, seed: int) -> tuple[TokenizedBatch, np.ndarray, list[PlannedGroup]]:
    rng = np.random.default_rng(seed)
    groups, tokens = [], []
    for start in range(0, rows, ROWS_PER_GROUP):
        prefix = rng.integers(10, 30000, PREFIX_TOKENS, dtype=np.int32)
        members = list(range(start, min(rows, start + ROWS_PER_GROUP)))
        tokens += [np.concatenate([prefix, rng.integers(10, 30000, OWN_TOKENS, dtype=np.int32)]) for _ in members]
        groups.append(PlannedGroup(prefix_tokens=PREFIX_TOKENS, rows=members))
    max_tokens = rng.integers(mean_output // 2, mean_output * 3 // 2 + 1, rows)
    return TokenizedBatch.from_rows(tokens), max_tokens, groups


def measure(in_flight: int, finishing_per_step: int = 16, seed: int = 0, with_handle: bool = False) -> dict:
    """Our per-step cost with about ``in_flight`` rows in the engine, about ``finishing_per_step``
    of them finishing (and as many entering) each step: outputs average in_flight / that many
    tokens, as a long-output job at GPU scale. The same rows changing per step at every size shows
    whether the cost follows the rows in flight or the rows that change. ``with_handle``: the
    engine is ``VLLMEngine`` over ``LLMEngineStandIn``, so the handle's cost per output is ours too."""
    mean_output = max(8, in_flight // finishing_per_step)
    rows = in_flight * 2  # the engine fills, stays full while rows finish and enter, then drains
    batch, max_tokens, groups = _batch(rows, mean_output, seed)
    settings = SchedulerSettings(log_every_s=3600)  # lookahead: counts that grow with the steps
    # A row holds its own tokens and its output so far, plus the lookahead (about half its output
    # at mid-life); its group's prefix is shared by 256 rows.
    capacity = in_flight * (-(-(OWN_TOKENS + mean_output // 2 + 16) // BLOCK) + 1) * 2 // 3
    if with_handle:
        from ..vllm.vllm_engine import VLLMEngine, sampling_params

        sampling_params(SamplingSettings(), 1)  # vLLM's import, once, before anything is timed

        engine = LLMEngineStandIn()  # its time and gaps; the handle's work falls in the gaps
        driven = VLLMEngine.over(engine, BLOCK, capacity)
    else:
        engine = driven = SteadyDecodeEngine(capacity)
    scheduler = GroupScheduler(batch, max_tokens, groups, settings, BLOCK, capacity)
    recount_s = []

    def recount(report) -> None:  # what every step cost before: all rows in flight recounted
        if len(engine.gaps) % 50 == 25:
            started = time.perf_counter()
            scheduler.blocks_held({})
            recount_s.append(time.perf_counter() - started)
            engine._left_at += time.perf_counter() - started  # not part of today's step

    started = time.perf_counter()
    finished = sum(1 for _ in drive(scheduler, driven, SamplingSettings(), StepTotals(), on_step=recount))
    wall = time.perf_counter() - started
    steady = slice(len(engine.gaps) // 4, len(engine.gaps) * 3 // 4)  # full: without the fill and the drain
    gaps = np.array(engine.gaps[steady]) * 1e6
    return {
        "asked_rows_in_flight": in_flight,
        "rows_in_flight": int(np.median(engine.in_flight[steady])),
        "rows": finished,
        "steps": len(engine.gaps) + 1,
        "rows_finishing_per_step": round(rows / max(len(engine.gaps), 1), 1),
        "us_per_step_median": round(float(np.median(gaps)), 1),
        "us_per_step_p90": round(float(np.percentile(gaps, 90)), 1),
        "us_per_step_mean_all": round((wall - engine.engine_s - sum(recount_s)) / max(len(engine.gaps), 1) * 1e6, 1),
        "us_recount_all_rows": round(float(np.median(recount_s)) * 1e6, 1) if recount_s else None,
    }


def run_scheduler_only(sizes: list[int], repeat: int = 5) -> dict:
    """Per size: the scheduler and drive alone, and with the vLLM handle over an engine stand-in that
    emits what vLLM emits (the host work a GPU waits for between two steps), ``repeat`` times: the
    run with the median mean cost per step, and the range of that mean over the runs."""
    results = [measure(n) for n in sizes]
    with_handle = [_median_of([measure(n, with_handle=True, seed=seed) for seed in range(repeat)]) for n in sizes]
    worst = max(results, key=lambda r: r["rows_in_flight"])
    at_1024 = [r for r in with_handle if r["asked_rows_in_flight"] == 1024]
    return {
        "scheduler_overhead": results,
        "with_vllm_handle": with_handle,
        "target_us_per_step_at_16384": 200,
        "target_us_per_step_mean_with_handle_at_1024": 200,
        "verdict": f"{worst['us_per_step_median']:.0f} us per step (median; p90 {worst['us_per_step_p90']:.0f}) at "
        f"{worst['rows_in_flight']:,} rows in flight, {worst['rows_finishing_per_step']} finishing per "
        f"step; recounting every row in flight, as each step did before: {worst['us_recount_all_rows']:.0f} us"
        + (
            f"; with the vLLM handle at 1,024: {at_1024[0]['us_per_step_mean_all']:.0f} us per step, mean over "
            f"all steps (median of {repeat} runs, {at_1024[0]['us_per_step_mean_all_range'][0]:.0f}-"
            f"{at_1024[0]['us_per_step_mean_all_range'][1]:.0f})"
            if at_1024
            else ""
        ),
    }


def _median_of(runs: list[dict]) -> dict:
    """The run whose mean cost per step is the median, with that mean's range over all the runs."""
    means = sorted(r["us_per_step_mean_all"] for r in runs)
    median = sorted(runs, key=lambda r: r["us_per_step_mean_all"])[(len(runs) - 1) // 2]
    return {**median, "us_per_step_mean_all_range": [means[0], means[-1]], "runs": len(runs)}


# An H200 running an 8B model in bf16 (128 KiB of KV per token): about 106 GB of its 141 GB left for
# the KV cache at vLLM's 0.9 memory share, 810,000 tokens, 50,000 blocks of 16; vLLM's offline
# batch sizes there (``LLM`` usage context): 1,024 sequences and 16,384 batched tokens per step.
H200 = {"kv_blocks": 50_000, "max_num_seqs": 1024, "max_num_batched_tokens": 16_384}


def short_shape_tokens(rows: int = 20_000, seed: int = 0) -> tuple[TokenizedBatch, np.ndarray]:
    """The bench's ``short`` shape at GPU scale, as token ids: an instruction above every row,
    customers (profile and attributes, 60-120 tokens) each with 1-3 tickets of 15-40 tokens,
    answers of 1-8 tokens; rows in a shuffled (table) order."""
    rng = np.random.default_rng(seed)
    instruction = rng.integers(10, 30000, 64, dtype=np.int32)
    out = []
    while len(out) < rows:
        customer = rng.integers(10, 30000, int(rng.integers(60, 121)), dtype=np.int32)
        for _ in range(int(rng.integers(1, 4))):
            ticket = rng.integers(10, 30000, int(rng.integers(15, 41)), dtype=np.int32)
            out.append(np.concatenate([instruction, customer, ticket]))
    out = out[:rows]
    order = rng.permutation(rows)
    return TokenizedBatch.from_rows([out[i] for i in order]), rng.integers(1, 9, rows)


def measure_fill(rows: int = 20_000, platform: dict = H200, seed: int = 0) -> dict:
    """How full the engine's batch runs on the ``short`` shape at a GPU's settings, on the
    block-accounting stand-in (``engine.run.stand_in``): rows in flight and batched tokens per
    step in steady state (the middle half of the steps), for this engine and for vLLM alone on
    sorted rows (every row submitted at once, as ``LLM.generate`` does)."""
    from ..plan.batch_plan import plan_token_ids
    from ..run.scheduler import InOrderScheduler, groups_in_run_order
    from ..run.stand_in import BlockAccountingEngine

    batch, max_tokens = short_shape_tokens(rows, seed)
    plan = plan_token_ids(batch.tokens, batch.offsets, max_tokens, BLOCK)
    out = {}
    for name in ("vllm_generate_sorted", "batchllm"):
        engine = BlockAccountingEngine(platform["kv_blocks"], BLOCK, platform["max_num_seqs"],
                                       platform["max_num_batched_tokens"])
        if name == "batchllm":
            groups = groups_in_run_order(
                plan.order.tolist(), plan.group_of_row, plan.group_prefix_tokens[plan.group_of_row]
            )
            scheduler = GroupScheduler(batch, max_tokens, groups, SchedulerSettings(log_every_s=3600), BLOCK,
                                       platform["kv_blocks"])
        else:
            scheduler = InOrderScheduler(batch, max_tokens, sorted(range(rows), key=batch.row))
        running, batched = [], []

        def record(report, running=running, batched=batched) -> None:  # this loop's lists
            running.append(report.running)
            batched.append(report.prefill_tokens + report.decode_tokens)

        finished = sum(1 for _ in drive(scheduler, engine, SamplingSettings(), StepTotals(), on_step=record))
        steady = slice(len(running) // 4, len(running) * 3 // 4)
        out[name] = {"rows": finished, "steps": len(running), "prefill_tokens": engine.prefill_tokens,
                     "rows_in_flight_median": float(np.median(running[steady])),
                     "batched_tokens_per_step_mean": round(float(np.mean(batched[steady])), 1),
                     "prefix_requests": scheduler.stats.prefix_requests, "preemptions": engine.preemptions}
    ours, theirs = out["batchllm"], out["vllm_generate_sorted"]
    share = ours["rows_in_flight_median"] / max(theirs["rows_in_flight_median"], 1)
    return {
        "shape": "short",
        "rows": rows,
        "platform": platform,
        "block_size": BLOCK,
        "runs": out,
        "rows_in_flight_share": round(share, 3),
        "steps_ratio": round(theirs["steps"] / max(ours["steps"], 1), 3),
        "verdict": f"short shape at {platform['max_num_seqs']:,} sequences, {platform['max_num_batched_tokens']:,} "
        f"tokens per step and {platform['kv_blocks']:,} KV blocks: batchllm keeps "
        f"{ours['rows_in_flight_median']:.0f} rows in flight in steady state, {100 * share:.0f}% of the "
        f"{theirs['rows_in_flight_median']:.0f} of vLLM alone on sorted rows, "
        f"{ours['batched_tokens_per_step_mean']:,.0f} tokens per step against "
        f"{theirs['batched_tokens_per_step_mean']:,.0f}; {ours['steps']} steps against {theirs['steps']}",
    }
