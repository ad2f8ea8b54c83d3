"""The scheduler-overhead benchmark runs, and its stand-in engine drives the real scheduler to the end."""

from engine.bench_scheduler import measure


def test_the_scheduler_overhead_benchmark_runs_every_row_and_reports_per_step_cost():
    result = measure(512, finishing_per_step=8)
    assert result["rows"] == 1024 and result["rows_in_flight"] > 100
    assert result["us_per_step_median"] > 0 and result["us_recount_all_rows"] > 0
