"""A run's statistics and progress lines."""

import re

import pytest

from engine.run.progress import Progress, format_eta
from engine.run.results import RunStats, merge_stats


def test_progress_never_prints_nan(monkeypatch):
    lines = []
    progress = Progress(total_rows=100, every_s=0, sink=lines.append)
    progress.update(0, 0, 0, in_flight=5, kv_usage=0.5, preemptions=0)
    progress.started -= 10
    progress.update(50, 5000, 100, in_flight=5, kv_usage=0.9, preemptions=1)
    assert "nan" not in " ".join(lines).lower()
    assert "eta ?" in lines[0]
    assert re.search(r"50/100 rows \(50%\), 5\.0 rows/s, \d+ tok/s", lines[1]) and "eta 10s" in lines[1]
    assert format_eta(125) == "2m05s" and format_eta(float("nan")) == "?"


def test_merge_stats_adds_counts_takes_the_longest_time_and_weights_gauges_by_steps():
    a = RunStats(rows=3, ok_rows=3, prompt_tokens=30, cached_tokens=10, reused_rows=1, engine_steps=10,
                 mean_kv_usage=0.5, rows_per_step=2.0, wall_s=4.0, startup_s=1.0)
    b = RunStats(rows=2, ok_rows=1, error_rows=1, prompt_tokens=20, cached_tokens=20, reused_rows=2, engine_steps=30,
                 mean_kv_usage=0.9, rows_per_step=4.0, wall_s=6.0, startup_s=2.0)
    merged = merge_stats([a, b])
    assert (merged.rows, merged.ok_rows, merged.error_rows, merged.reused_rows) == (5, 4, 1, 3)
    assert (merged.prompt_tokens, merged.cached_tokens, merged.engine_steps) == (50, 30, 40)
    assert (merged.wall_s, merged.startup_s) == (6.0, 2.0)
    assert merged.mean_kv_usage == pytest.approx((0.5 * 10 + 0.9 * 30) / 40)
    assert merged.rows_per_step == pytest.approx((2 * 10 + 4 * 30) / 40)
