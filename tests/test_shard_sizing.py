"""Shards sized from what the last nights measured per hardware partition: start-up and
orchestration at most 5% of a partition's time, the fastest hardware deciding; a first night takes
the documented default; a job's own ``rows_per_shard`` or ``shards`` wins."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchllm_dagster.shard_sizing import FIRST_NIGHT_ROWS_PER_SHARD, Measured, measured_by_hardware, shard_size


def partition(hardware, rows, engine_s, startup_s=1.0, stop_s=0.5, write_s=0.5):
    return {"computed_rows": rows, "wall_s": engine_s, "startup_s": startup_s, "engine_stop_s": stop_s,
            "write_s": write_s, "hardware_partition": hardware}


def test_the_size_keeps_overhead_at_five_percent_on_the_hardware_that_needs_the_most():
    assert shard_size({}).rows_per_shard == FIRST_NIGHT_ROWS_PER_SHARD
    metadata = [partition("a100", 1000, 100.0), partition("a100", 1000, 80.0), partition("a100", 1000, 120.0),
                partition("h200", 1000, 25.0), {"computed_rows": 0, "hardware_partition": "h200"}]  # all reused
    measured = measured_by_hardware(metadata)
    # median rate, mean overhead (the forecast's parts of it: a run's start and stop, a partition's own)
    assert measured["a100"] == Measured(rows_per_s=10.0, overhead_s=2.0, partitions=3, run_overhead_s=0.5,
                                        partition_overhead_s=1.5)
    assert measured["h200"] == Measured(rows_per_s=40.0, overhead_s=2.0, partitions=1, run_overhead_s=0.5,
                                        partition_overhead_s=1.5)
    size = shard_size(measured)
    # The H200 needs 2 s x 40 rows/s x 19 = 1,520 rows for 2 s to be 5%: rounded up to 2,048.
    assert size.rows_per_shard == 2048 and "h200" in size.why
    overhead, rows_per_s = 2.0, 40.0
    assert overhead / (overhead + size.rows_per_shard / rows_per_s) <= 0.05
    assert shard_size({"h200": Measured(40.0, 2.0, 1)}, share=0.10).rows_per_shard == 1024  # 720 -> 1,024
    # Partitions of an earlier version named their computed rows ``rows``: still measured.
    older = [{("rows" if k == "computed_rows" else k): v for k, v in m.items()} for m in metadata[:4]]
    assert all("computed_rows" not in m for m in older)
    assert measured_by_hardware(older) == {k: v for k, v in measured.items()}


def test_a_partition_whose_engine_start_outlasts_its_rows_is_measured_all_the_same():
    """A GPU's first partitions: vLLM starts (and compiles) for a minute, the rows run 20 s. Their
    engine time is ``wall_s`` (the run alone), never less for the start (which once made it 0 or
    less, so such partitions were never measured and the first-night size stayed)."""
    measured = measured_by_hardware([partition("h200", 2000, 20.0, startup_s=60.0, stop_s=2.0, write_s=1.0)])
    assert measured["h200"].rows_per_s == 100.0 and measured["h200"].overhead_s == 63.0


def test_a_run_of_several_partitions_spreads_its_one_vllm_start_over_them():
    """partitions_per_run: 4: vLLM starts in the first partition (60 s) and stops after the last (4 s);
    each partition pays 1 s of its own. The overhead per partition is the run's 68 s over 4, 17 s:
    a median (1.5 s) would drop the start that every partition of the run shared."""
    run = [partition("h200", 2000, 20.0, startup_s=60.5, stop_s=0.0),
           partition("h200", 2000, 20.0, startup_s=0.5, stop_s=0.0),
           partition("h200", 2000, 20.0, startup_s=0.5, stop_s=0.0),
           partition("h200", 2000, 20.0, startup_s=0.5, stop_s=4.0)]
    measured = measured_by_hardware(run)["h200"]
    assert measured.overhead_s == pytest.approx((60.5 + 0.5 * 3 + 4.0 + 0.5 * 4) / 4) == 17.0
    alone = measured_by_hardware([partition("h200", 2000, 20.0, startup_s=60.5, stop_s=4.0)])["h200"]
    assert shard_size({"h200": measured}).rows_per_shard < shard_size({"h200": alone}).rows_per_shard


@pytest.mark.parametrize("own", [None, 8])
def test_the_plan_takes_the_size_the_last_partitions_measured(tmp_path, tiny_model, own):
    import dagster as dg

    from assets import build_batch_defs
    from batchllm_dagster import BatchJobConfig, DatasetSpec, EngineSettings

    source = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": list(range(50)), "prompt": [f"a question about topic {i}?" for i in range(50)]}),
                   source)
    config = BatchJobConfig(
        name="sized",
        dataset=DatasetSpec(parquet=str(source)),
        llm=EngineSettings(model_path=tiny_model),
        rows_per_shard=own,
        output_database=str(tmp_path / "o.duckdb"),
        storage_dir=str(tmp_path / "j"),
    )
    graph = build_batch_defs(config).resolve_asset_graph()
    upstream = [graph.assets_def_for_key(dg.AssetKey(["sized", n])) for n in ("prompts", "prefix_groups")]

    def plan(instance) -> dict:
        result = dg.materialize(upstream, instance=instance)
        return {
            k: v.value for k, v in result.asset_materializations_for_node("sized__prefix_groups")[0].metadata.items()
        }

    with dg.instance_for_test() as instance:
        first = plan(instance)
        assert first["shards"] == (7 if own else 1)  # a first night: 10,000 rows a shard, or the job's 8
        assert first.get("rows_per_shard") == (None if own else FIRST_NIGHT_ROWS_PER_SHARD)
        for _ in range(3):  # what three partitions of completions recorded: 1 row/s, 0.5 s around it
            instance.report_runless_asset_event(dg.AssetMaterialization(
                dg.AssetKey(["sized", "completions"]), metadata=partition("cpu", 20, 20.0, 0.3, 0.1, 0.1)))
        second = plan(instance)
        if own:
            assert second["shards"] == 7 and "rows_per_shard" not in second
        else:  # 0.5 s x 1 row/s x 19 = 9.5 rows: 16 a shard, 50 rows in 4 shards
            assert second["rows_per_shard"] == 16 and second["shards"] == 4
            assert "at most 5% of a partition" in second["rows_per_shard_why"]


def test_a_shard_on_ray_gets_a_time_limit_from_what_its_hardware_measured():
    from batchllm_dagster.shard_sizing import MIN_TIMEOUT_S, TIMEOUT_FACTOR, shard_time_limit

    assert shard_time_limit(None, 10_000) is None  # nothing measured: no limit to guess
    limit = shard_time_limit(Measured(rows_per_s=10.0, overhead_s=60.0, partitions=3), 10_000)
    assert limit.seconds == TIMEOUT_FACTOR * (10_000 / 10.0 + 60.0) == 4240.0
    assert "10,000 rows" in limit.why and "10.0 rows/s" in limit.why
    assert shard_time_limit(Measured(100.0, 1.0, 1), 100).seconds == MIN_TIMEOUT_S  # never a hair trigger
