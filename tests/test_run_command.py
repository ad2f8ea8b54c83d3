"""``batchllm-dagster run``'s console: a line per shard landed and a total, from partition metadata."""

from batchllm_dagster.cli import shard_lines


def test_a_line_per_shard_and_a_total_from_each_partitions_metadata():
    ran = {"planned_rows": 99, "computed_rows": 95, "reused_rows": 4, "error_rows": 1, "wall_s": 10.0,
           "prompt_tokens": 9_000, "output_tokens": 1_000, "prefill_tokens": 3_000, "admission": "group_wise"}
    reused = {"planned_rows": 50, "computed_rows": 0, "reused_rows": 50, "error_rows": 0}
    assert shard_lines([("cpu-00-a", ran), ("cpu-01-b", reused)]) == [
        "  cpu-00-a: 99 rows (95 computed, 4 reused, 1 errors), 9.5 rows/s, 1,000 tok/s, saved 6,000 prompt tok, "
        "admission group_wise, wall 10.00 s",
        "  cpu-01-b: 50 rows (0 computed, 50 reused, 0 errors), nothing to run",
        "  total: 149 rows (95 computed, 54 reused, 1 errors), 9.5 rows/s, 1,000 tok/s, saved 6,000 prompt tok, "
        "wall 10.00 s"]
    assert shard_lines([]) == []
