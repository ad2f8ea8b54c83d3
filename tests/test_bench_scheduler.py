"""The scheduler-overhead benchmark runs, and its stand-in engine drives the real scheduler to the end;
on short answers the engine keeps a GPU's batch as full as vLLM alone on sorted rows."""

import pytest

from engine.bench.bench_scheduler import _median_of, measure, measure_fill, run_scheduler_only


def test_the_scheduler_overhead_benchmark_runs_every_row_and_counts_only_our_time(monkeypatch):
    """Every row runs to its end at about the size asked; the stand-in's own time (here 3 ms a step,
    a GPU's step) is taken out of the per-step cost, which is then ours alone."""
    import time

    from engine.bench.bench_scheduler import SteadyDecodeEngine

    report = SteadyDecodeEngine._report

    def slow_report(self, entered, finished):
        time.sleep(0.003)
        return report(self, entered, finished)

    monkeypatch.setattr(SteadyDecodeEngine, "_report", slow_report)
    result = measure(512, finishing_per_step=8)
    assert result["rows"] == 1024 and 0.5 * 512 <= result["rows_in_flight"] <= 1.5 * 512
    assert result["steps"] >= 1024 // 8
    assert result["us_per_step_median"] < 3000 and result["us_per_step_mean_all"] < 3000


def test_on_short_answers_the_batch_runs_as_full_as_vllm_alone_on_sorted_rows():
    # An engine scaled down from an H200 (1,024 sequences, 16,384 tokens per step) so that 3,000 rows
    # reach a steady state; KV to spare, as on the GPU.
    small_gpu = {"kv_blocks": 8_000, "max_num_seqs": 128, "max_num_batched_tokens": 2_048}
    result = measure_fill(3_000, small_gpu)
    ours, theirs = result["runs"]["batchllm"], result["runs"]["vllm_generate_sorted"]
    assert ours["rows"] == theirs["rows"] == 3_000 and ours["prefill_tokens"] == theirs["prefill_tokens"]
    assert ours["rows_in_flight_median"] >= 0.9 * theirs["rows_in_flight_median"]
    assert ours["batched_tokens_per_step_mean"] >= 0.9 * theirs["batched_tokens_per_step_mean"]
    assert ours["steps"] <= 1.05 * theirs["steps"] and ours["preemptions"] == 0


@pytest.mark.slow  # imports vLLM (SamplingParams)
def test_the_vllm_handle_is_measured_over_a_stand_in_and_builds_one_sampling_params_per_kind():
    """``--scheduler-only`` also times ``VLLMEngine`` itself over an engine that emits what vLLM
    emits (first output, last output): every row comes back through the handle; and the handle
    builds one ``SamplingParams`` per (sampling, max_tokens), which vLLM clones per request."""
    import numpy as np

    from engine.bench.bench_scheduler import LLMEngineStandIn
    from engine.run.requests import RequestKind, Submission
    from engine.settings import SamplingSettings
    from engine.vllm.vllm_engine import VLLMEngine

    result = measure(256, with_handle=True)
    assert result["rows"] == 512 and result["us_per_step_mean_all"] > 0
    report = run_scheduler_only([256], repeat=3)  # the handle's mean per step: median and range of three runs
    (handle_run,) = report["with_vllm_handle"]
    assert handle_run["runs"] == 3 and len(handle_run["us_per_step_mean_all_range"]) == 2
    # The report's median and range, on runs whose numbers are known: the middle run, the extremes.
    runs = [{"us_per_step_mean_all": v, "steps": i} for i, v in enumerate([50.0, 10.0, 30.0])]
    assert _median_of(runs) == {"us_per_step_mean_all": 30.0, "steps": 2, "us_per_step_mean_all_range": [10.0, 50.0],
                                "runs": 3}
    stand_in = LLMEngineStandIn()
    sent = []
    stand_in.add_request = lambda request_id, engine_input, params: sent.append(params)
    handle = VLLMEngine.over(stand_in, 16, 100)
    plain, labels = SamplingSettings(), SamplingSettings(response_format={"choice": ["a", "b"]})
    for i, (sampling, max_tokens) in enumerate([(plain, 8), (plain, 8), (plain, 9), (labels, 8), (labels, 8)]):
        handle.submit(Submission(RequestKind.ROW, i, np.arange(5), max_tokens), sampling)
    assert sent[0] is sent[1] and sent[3] is sent[4] and len({id(p) for p in sent}) == 3
    assert [p.max_tokens for p in sent] == [8, 8, 9, 8, 8] and sent[3].structured_outputs is not None
