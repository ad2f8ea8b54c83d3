"""The three assets materialized through Dagster on real vLLM (CPU, tiny model)."""

import dagster as dg
import duckdb
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from assets import build_batch_defs
from batchllm_dagster import BatchJobConfig, DatasetSpec, EngineSettings, SamplingSettings
from engine.response_format import ResponseFormat

from .conftest import make_prompt_table

pytestmark = pytest.mark.slow  # real vLLM, dg, Ray or a browser


@pytest.fixture
def job(tmp_path, tiny_model):
    database = tmp_path / "warehouse.duckdb"
    con = duckdb.connect(str(database))
    con.register("incoming", make_prompt_table())
    con.execute("CREATE TABLE prompt_rows AS SELECT * FROM incoming")
    con.close()
    sql = tmp_path / "batch.sql"
    # A trailing ``;`` and comment are fine for prompts and the source sensor alike.
    sql.write_text("SELECT id, prompt, messages FROM prompt_rows; -- the whole batch")
    return BatchJobConfig(
        name="e2e",
        dataset=DatasetSpec(sql_file=str(sql), database=str(database)),
        llm=EngineSettings(model_path=tiny_model, kv_cache_blocks=64),
        sampling=SamplingSettings(max_tokens=6),
        shards=2,
        output_database=str(database),
        output_table="answers",
        storage_dir=str(tmp_path / "jobs"),
    )


def materialize_graph(defs, config, instance):
    graph = defs.resolve_asset_graph()
    key = lambda name: dg.AssetKey([config.name, name])  # noqa: E731
    assets = [graph.assets_def_for_key(key(n)) for n in ("prompts", "prefix_groups", "completions")]
    planned = dg.materialize(assets[:2], instance=instance)
    assert planned.success
    partitions = instance.get_dynamic_partitions(config.names.partitions_name)
    results = {}
    for partition in partitions:
        result = dg.materialize(assets, selection=[key("completions")], partition_key=partition, instance=instance)
        assert result.success
        results[partition] = result
    return planned, results


def test_materializes_prompts_groups_and_one_completion_per_row(job):
    defs = build_batch_defs(job)
    with dg.instance_for_test() as instance:
        planned, results = materialize_graph(defs, job, instance)
        assert len(results) == 2
        groups_meta = planned.asset_materializations_for_node("e2e__prefix_groups")[0].metadata
        assert groups_meta["groups"].value >= 2 and groups_meta["shared_fraction"].value > 0.3
        for result in results.values():
            meta = result.asset_materializations_for_node("e2e__completions")[0].metadata
            for name in ("planned_rows", "computed_rows", "prompt_tokens", "cached_prompt_tokens", "output_tokens",
                         "wall_s", "tokens_per_s", "output_tokens_per_s", "startup_s", "mean_kv_usage", "rows_per_step",
                         "engine_steps"):
                assert isinstance(meta[name].value, (int, float)), name
            # vLLM's start is part of the start-up, and start-up plus run fit in the step that measured them.
            step = next(s for s in instance.get_run_step_stats(result.run_id) if "completions" in s.step_key)
            assert 0 < meta["engine_start_s"].value <= meta["startup_s"].value
            assert meta["startup_s"].value + meta["wall_s"].value <= step.end_time - step.start_time
            assert 0 < meta["mean_kv_usage"].value <= 1 and meta["rows_per_step"].value >= 1
            assert meta["computed_rows"].value > 0 and meta["tokens_per_s"].value > 0
            assert meta["device"].value and meta["hardware_partition"].value == "cpu"
            # who admitted the rows, and why: a small shard fits the KV cache, so vLLM itself
            assert meta["admission"].value == "vllm" and "fits the KV cache" in meta["admission_reason"].value
            assert "vllm" in meta["engine"].value["build"]
            # what vLLM's start spent its time on, within the start the step measured
            startup = meta["engine"].value["startup"]
            assert set(startup["phases"]) >= {"import", "engine"} and startup["weights_bytes"] > 0
            assert startup["phases"]["engine"] <= meta["engine_start_s"].value
            assert 0 <= startup["weights_in_page_cache"] <= 1 and startup["compile_cache_entries"] is None  # eager
            checks = result.get_asset_check_evaluations()
            assert {c.check_name for c in checks if c.passed} >= {"one_completion_per_row", "no_silent_empties"}

        # Rerunning a partition reuses its unchanged rows and replaces them: one row per id.
        first = sorted(results)[0]
        graph = defs.resolve_asset_graph()
        rerun = dg.materialize([graph.assets_def_for_key(dg.AssetKey(["e2e", "completions"]))], partition_key=first,
                               instance=instance)
        meta = rerun.asset_materializations_for_node("e2e__completions")[0].metadata
        first_meta = results[first].asset_materializations_for_node("e2e__completions")[0].metadata
        assert meta["reused_rows"].value == first_meta["dagster/row_count"].value
        assert meta["computed_rows"].value == 0  # nothing recomputed
        assert (job.files.job_dir / "completions" / f"{first}.parquet").exists()

    ids = make_prompt_table().column("id").to_pylist()
    with duckdb.connect(job.output_database, read_only=True) as con:
        rows = con.execute("SELECT id, count(*), max(text), max(status) FROM answers GROUP BY id").fetchall()
        groups = con.execute("SELECT count(*), sum(rows) FROM answers_prefix_groups").fetchall()[0]
    assert sorted(r[0] for r in rows) == sorted(ids)
    assert all(count == 1 and text and status == "ok" for _, count, text, status in rows)
    assert groups[1] == len(ids)
    assert pq.read_table(job.files.job_dir / "plan.parquet").num_rows == len(ids)


def test_whole_table_check_finds_missing_rows(job):
    defs = build_batch_defs(job)
    graph = defs.resolve_asset_graph()
    (check,) = [c for c in graph.assets_defs if c.check_keys and not c.keys]  # resources bound
    with dg.instance_for_test() as instance:
        planned = dg.materialize(
            [graph.assets_def_for_key(dg.AssetKey(["e2e", n])) for n in ("prompts", "prefix_groups")], instance=instance
        )
        assert planned.success
        partition = instance.get_dynamic_partitions(job.names.partitions_name)[0]
        completions = graph.assets_def_for_key(dg.AssetKey(["e2e", "completions"]))
        # One partition materialized with its asset's checks, as the UI or `dg launch --partition`
        # does: the table check checks the landed shard's rows, the other shard's are outstanding.
        one = dg.materialize([completions, check], partition_key=partition, instance=instance)
        assert one.success
        assert all(e.passed for e in one.get_asset_check_evaluations())
        table_check = next(e for e in one.get_asset_check_evaluations() if e.check_name == "all_prompts_answered")
        assert table_check.metadata["missing"].value == 0 and table_check.metadata["outstanding_shards"].value == 1
        assert table_check.metadata["outstanding_rows"].value > 0
        # Selected alone, it evaluates whatever the shards.
        result = dg.materialize([completions, check], selection=dg.AssetSelection.checks(check), instance=instance)
    evaluation = result.get_asset_check_evaluations()[0]
    assert not evaluation.passed  # one of two shards ran: the other shard's rows are missing
    assert evaluation.metadata["missing"].value > 0


def test_source_sensor_requests_a_plan_only_when_the_rows_change(job):
    defs = build_batch_defs(job)
    sensor = defs.resolve_sensor_def("e2e_source_changed")
    with dg.instance_for_test() as instance:
        context = dg.build_sensor_context(instance=instance)
        first = sensor.evaluate_tick(context)
        assert len(first.run_requests) == 1
        context = dg.build_sensor_context(instance=instance, cursor=first.cursor)
        assert not sensor.evaluate_tick(context).run_requests
        with duckdb.connect(job.dataset.database) as con:
            con.execute("UPDATE prompt_rows SET prompt = prompt || ' (edited)' WHERE id = 'doc0-q0'")
        changed = sensor.evaluate_tick(dg.build_sensor_context(instance=instance, cursor=first.cursor))
        assert len(changed.run_requests) == 1 and changed.cursor != first.cursor


def job_assets(job) -> dict:
    """The job's three assets by name, from the resolved graph (their resources bound)."""
    graph = build_batch_defs(job).resolve_asset_graph()
    return {
        n: graph.assets_def_for_key(dg.AssetKey([job.name, n])) for n in ("prompts", "prefix_groups", "completions")
    }


def test_a_partition_runs_the_materialized_plan_without_tokenizer_or_planner(job, monkeypatch):
    assets = job_assets(job)
    with dg.instance_for_test() as instance:
        assert dg.materialize([assets["prompts"], assets["prefix_groups"]], instance=instance).success
        plan = pq.read_table(job.files.job_dir / "plan.parquet")

        def forbidden(*args, **kwargs):
            raise AssertionError("a completions partition must not tokenize or plan")

        import engine.plan.batch_plan
        import engine.plan.sorted_plan
        import engine.plan.tokenizing

        # The functions' code is replaced, not a module's name for them: every name bound by
        # `from ... import` anywhere calls the forbidden body too. (vLLM imports transformers itself,
        # so "transformers never imported" cannot be the test.)
        for function in (
            engine.plan.tokenizing.load_tokenizer,
            engine.plan.tokenizing.tokenize_rows,
            engine.plan.tokenizing._render_chat,
            engine.plan.batch_plan.plan_blocks,
            engine.plan.sorted_plan.plan_rows,
        ):
            monkeypatch.setattr(function, "__code__", forbidden.__code__)
        import engine.plan.token_cache

        with pytest.raises(AssertionError, match="must not tokenize"):  # names bound before the patch call it too
            engine.plan.token_cache.tokenize_rows(None, ["x"])
        partition = instance.get_dynamic_partitions(job.names.partitions_name)[0]
        assert dg.materialize([assets["completions"]], partition_key=partition, instance=instance).success
        monkeypatch.undo()

        # Answers carry the plan's global group ids.
        mine = plan.filter(pc.equal(plan["partition_key"], partition))
        with duckdb.connect(job.output_database, read_only=True) as con:
            groups = dict(con.execute("SELECT id, \"group\" FROM answers").fetchall())
        assert groups == dict(zip(mine["id"].to_pylist(), mine["group"].to_pylist()))

        # A new prompt snapshot makes the plan stale: the partition refuses it before starting vLLM.
        with duckdb.connect(job.dataset.database) as con:
            con.execute("UPDATE prompt_rows SET prompt = prompt || ' (edited)' WHERE id = 'doc0-q0'")
        assert dg.materialize([assets["prompts"]], instance=instance).success
        stale = dg.materialize([assets["completions"]], partition_key=partition, instance=instance,
                               raise_on_error=False)
    assert not stale.success
    failure = stale.get_step_failure_events()[0].event_specific_data.error.message
    assert "the prompt snapshot changed" in failure and "rematerialize e2e/prefix_groups" in failure


def test_a_failed_duckdb_write_leaves_parquet_and_duckdb_agreeing_and_keeps_the_checkpoint(job, monkeypatch):
    from batchllm_dagster.output_table import OutputTable

    assets_by_name = job_assets(job)
    with dg.instance_for_test() as instance:
        assert dg.materialize([assets_by_name["prompts"], assets_by_name["prefix_groups"]], instance=instance).success
        partition = instance.get_dynamic_partitions(job.names.partitions_name)[0]

        def lock_timeout(*args, **kwargs):
            raise TimeoutError("simulated: another process held the DuckDB lock for too long")

        monkeypatch.setattr(OutputTable, "replace_partition", lock_timeout)
        failed = dg.materialize([assets_by_name["completions"]], partition_key=partition, instance=instance,
                                raise_on_error=False)
        assert not failed.success
        assert not job.files.completions_parquet_path(partition).exists()  # not published without the table rows
        assert not list(job.files.completions_parquet_path(partition).parent.glob("*.partial"))
        assert list(job.files.checkpoints.of(partition).glob("part-*.parquet"))  # the rerun will reuse them
        monkeypatch.undo()
        rerun = dg.materialize([assets_by_name["completions"]], partition_key=partition, instance=instance)
    meta = rerun.asset_materializations_for_node("e2e__completions")[0].metadata
    assert meta["reused_rows"].value == meta["dagster/row_count"].value > 0 and meta["computed_rows"].value == 0
    assert job.files.completions_parquet_path(partition).exists()


def test_every_run_of_a_hardware_partition_carries_its_tags_and_pool(job):
    """Two hardware partitions: the demo's way of running a plan (the run_shards sensor's requests)
    launches each shard on its hardware's job, with that hardware's placement tags and run pool."""
    from dagster_project.demo import run_planned_shards

    # Both run on this CPU machine: names that say no GPU (a GPU's partition must declare `platform: cuda`).
    k8s = '{"pod_spec_config": {"node_selector": {"node-pool": "big"}}}'
    job = BatchJobConfig.model_validate({**job.model_dump(), "hardware": [
        {"name": "big-nodes", "pool": "big_pool", "run_tags": {"dagster-k8s/config": k8s}}, "cpu"]})
    defs = build_batch_defs(job)
    assert job.inference_pool is None  # no op pool that would serialize the two kinds of machine
    with dg.instance_for_test() as instance:
        graph = defs.resolve_asset_graph()
        upstream = [graph.assets_def_for_key(dg.AssetKey(["e2e", n])) for n in ("prompts", "prefix_groups")]
        assert dg.materialize(upstream, instance=instance).success
        results = run_planned_shards(instance, defs, "e2e")
        tags = {r.dagster_run.tags["dagster/partition"]: r.dagster_run.tags for r in results}
        checks = [[e.check_name for e in r.get_asset_check_evaluations()] for r in results]
        passed = all(e.passed for r in results for e in r.get_asset_check_evaluations())
    # Each shard's run checks its shard, and the whole table as far as it is decided (the other
    # shard's rows are outstanding in the first run, not missing), so no check is red.
    shard_checks = ["one_completion_per_row", "no_silent_empties", "prefix_saving", "answers_follow_response_format",
                    "error_rows_within_bound"]
    assert sorted(checks[0]) == sorted(checks[1]) == sorted(shard_checks + ["all_prompts_answered"])
    assert passed
    assert len(tags) == 2
    big = next(t for key, t in tags.items() if key.startswith("big-nodes-00-"))
    cpu = next(t for key, t in tags.items() if key.startswith("cpu-01-"))
    assert big["dagster-k8s/config"] == k8s and big["batchllm/pool"] == "big_pool"
    assert big["batchllm/hardware"] == "big-nodes"
    assert cpu["batchllm/pool"] == "inference_cpu" and "dagster-k8s/config" not in cpu


def test_a_rerun_tokenizes_only_changed_rows_and_keeps_the_shard_keys(job):
    assets_by_name = job_assets(job)
    plan = [assets_by_name["prompts"], assets_by_name["prefix_groups"]]
    rows = make_prompt_table().num_rows
    with dg.instance_for_test() as instance:
        first = dg.materialize(plan, instance=instance)
        keys = sorted(instance.get_dynamic_partitions(job.names.partitions_name))
        with duckdb.connect(job.dataset.database) as con:
            con.execute("UPDATE prompt_rows SET prompt = prompt || ' (edited)' WHERE id = 'doc0-q0'")
        second = dg.materialize(plan, instance=instance)
        assert sorted(instance.get_dynamic_partitions(job.names.partitions_name)) == keys
    before = first.asset_materializations_for_node("e2e__prefix_groups")[0].metadata
    after = second.asset_materializations_for_node("e2e__prefix_groups")[0].metadata
    assert before["token_cache_rows"].value == 0 and before["tokenized_rows"].value == rows
    assert after["token_cache_rows"].value == rows - 1 and after["tokenized_rows"].value == 1


def test_a_job_whose_prompt_is_built_from_a_joins_fields_runs_end_to_end(tmp_path, tiny_model):
    """The demo's tickets job (a join of tickets and customers, prompt from fields, optimized order,
    teams scored as choices) on the tiny model: every ticket answered, the order chosen and its saving
    in the metadata, each row's prompt readable from the snapshot, each answer's probability stored
    and the answers under ``review_below`` marked and counted."""
    import random

    from batchllm_dagster.config import PromptFields
    from dagster_project.sample_data import customers_and_tickets

    customers, tickets = customers_and_tickets(random.Random(5), customers=12)
    database = tmp_path / "warehouse.duckdb"
    with duckdb.connect(str(database)) as con:
        for name, table in (("customers", customers), ("support_tickets", tickets)):
            con.register("incoming", table)
            con.execute(f"CREATE TABLE {name} AS SELECT * FROM incoming")
    sql = "SELECT t.id, c.name AS customer, c.profile, c.plan, c.region, t.subject AS ticket, t.priority " \
          "FROM support_tickets t JOIN customers c USING (customer_id)"
    fields = PromptFields(instruction="Route the support ticket.", question="Team:", field_order="optimize",
                          fields=["customer", "profile", "plan", "region", "ticket", "priority"])
    config = BatchJobConfig(name="tickets", dataset=DatasetSpec(sql=sql, database=str(database), prompt=fields),
                            llm=EngineSettings(model_path=tiny_model, kv_cache_blocks=64),
                            sampling=SamplingSettings(max_tokens=3, score_choices=True, response_format=ResponseFormat(
                                choice=["billing", "technical", "account", "other"])), review_below=0.5,
                            output_database=str(database), output_table="ticket_teams",
                            storage_dir=str(tmp_path / "jobs"))
    marked = 0
    with dg.instance_for_test() as instance:
        planned, results = materialize_graph(build_batch_defs(config), config, instance)
        prompts = planned.asset_materializations_for_node("tickets__prompts")[0].metadata
        chosen = prompts["field_order"].value
        assert prompts["field_order_chosen"].value == "first choice"
        assert prompts[f"prompt_tokens_{chosen}_order"].value < prompts["prompt_tokens_declared_order"].value
        saved = prompts["prompt_tokens_declared_order"].value - prompts[f"prompt_tokens_{chosen}_order"].value
        for result in results.values():  # each partition says which order its prompts were built in, and its saving
            meta = result.asset_materializations_for_node("tickets__completions")[0].metadata
            assert meta["field_order"].value == chosen and meta["field_order_saved_prompt_tokens"].value == saved
            assert meta["scored_rows"].value == meta["dagster/row_count"].value and meta["review_below"].value == 0.5
            marked += meta["rows_for_review"].value
    with duckdb.connect(str(database), read_only=True) as con:
        answered = con.execute("SELECT count(*) FROM ticket_teams WHERE status = 'ok'").fetchone()[0]
        scored = con.execute("SELECT count(*) FILTER (WHERE finish_reason = 'scored' AND choice_probability >= 0.25 "
                             "AND needs_review = (choice_probability < 0.5)), count(*) FILTER (WHERE needs_review) "
                             "FROM ticket_teams_with_prompts").fetchone()
        # The prompt each row ran with: the snapshot, as the README's query reads it.
        ran_with = dict(con.execute(f"SELECT id, prompt FROM read_parquet('{config.files.prompts_path}')").fetchall())
    assert answered == tickets.num_rows and set(ran_with) == set(tickets.column("id").to_pylist())
    assert scored == (tickets.num_rows, marked)
    assert all(p.startswith("Route the support ticket.\n\n") and p.endswith("\n\nTeam:") for p in ran_with.values())


def test_a_shard_that_finishes_after_a_newer_plan_writes_nothing_stale(job, monkeypatch):
    """Shard S runs plan P1; meanwhile row X of its shard is edited and another of its rows deleted
    (so its key is gone), plan P2 lands (two hardware partitions) and P2's shards all run and write
    the fresh X. Then S finishes: it must not write its stale X over the fresh one, nor bring back a
    Parquet file P2 does not have. Nothing stale: P2's shards run again reuse every row."""
    from dagster_project.demo import run_planned_shards
    from engine.jobs.shard_job import ShardJob

    job = BatchJobConfig.model_validate({**job.model_dump(), "hardware": ["cpu", {"name": "cpu2", "pool": "p2"}]})
    defs = build_batch_defs(job)
    graph = defs.resolve_asset_graph()
    upstream = [graph.assets_def_for_key(dg.AssetKey(["e2e", n])) for n in ("prompts", "prefix_groups")]
    completions = graph.assets_def_for_key(dg.AssetKey(["e2e", "completions"]))
    run_shard = ShardJob.run
    landed = []

    def shard_overtaken_by_a_newer_plan(shard_job, *args, **kwargs):
        outcome = run_shard(shard_job, *args, **kwargs)
        key, prepared = shard_job.shard.key, shard_job.shard.prepared
        if not landed:  # the first shard's answers are ready; before it writes, a newer plan runs whole
            edited, deleted = prepared.ids[0], prepared.ids[1]
            landed.append(edited)
            with duckdb.connect(job.dataset.database) as con:
                con.execute("UPDATE prompt_rows SET prompt = prompt || ' Answer in French.' WHERE id = ?", [edited])
                con.execute("DELETE FROM prompt_rows WHERE id = ?", [deleted])
            assert dg.materialize(upstream, instance=instance).success
            assert key not in instance.get_dynamic_partitions(job.names.partitions_name)  # the shard's key is gone
            run_planned_shards(instance, defs, "e2e")
        return outcome

    with dg.instance_for_test() as instance:
        assert dg.materialize(upstream, instance=instance).success
        first_key = instance.get_dynamic_partitions(job.names.partitions_name)[0]
        monkeypatch.setattr(ShardJob, "run", shard_overtaken_by_a_newer_plan)
        # Its key is gone from the dynamic partitions, so Dagster fails the run when it records the
        # materialization; what matters is what it wrote before: nothing.
        dg.materialize([completions], partition_key=first_key, instance=instance, raise_on_error=False)
        monkeypatch.setattr(ShardJob, "run", run_shard)
        assert landed
        new_keys = set(instance.get_dynamic_partitions(job.names.partitions_name))
        # Every answer in DuckDB is the newer plan's: its shards, run again, reuse every row.
        again = [dg.materialize([completions], partition_key=k, instance=instance) for k in sorted(new_keys)]
        for run in again:
            m = run.asset_materializations_for_node("e2e__completions")[0].metadata
            assert m["computed_rows"].value == 0 and m["reused_rows"].value == m["dagster/row_count"].value > 0
    with duckdb.connect(job.dataset.database, read_only=True) as con:
        ids = [r[0] for r in con.execute("SELECT id FROM answers").fetchall()]
        total = con.execute("SELECT count(*) FROM prompt_rows").fetchone()[0]
    assert len(ids) == len(set(ids)) == total
    parquet_keys = {p.stem for p in job.files.completions_dir.glob("*.parquet")}
    assert parquet_keys <= new_keys  # no superseded key's file came back
    in_parquet = pq.read_table(job.files.completions_dir).column("id").to_pylist() if parquet_keys else []
    assert len(in_parquet) == len(set(in_parquet))


def test_one_run_answers_a_range_of_shards_on_one_vllm_start(job, tmp_path):
    """``partitions_per_run: 3``: the shard sensor asks for one run of the plan's three shards (a
    partition range, as a backfill under the asset's backfill policy runs it). vLLM starts once, in
    the first partition, and stops once, after the last; each partition is materialized with its own
    numbers, written under its own key with its own Parquet file, and checked on its own (the checks
    report once, with every partition's outcome); the answers equal a run per partition's."""
    from batchllm_dagster.partitions import RANGE_END, RANGE_START
    from dagster_project.demo import run_planned_shards

    def answers(config) -> tuple[list, list, list]:
        defs = build_batch_defs(config)
        graph = defs.resolve_asset_graph()
        with dg.instance_for_test() as instance:
            upstream = [graph.assets_def_for_key(dg.AssetKey(["e2e", n])) for n in ("prompts", "prefix_groups")]
            assert dg.materialize(upstream, instance=instance).success
            keys = instance.get_dynamic_partitions(config.names.partitions_name)
            runs = run_planned_shards(instance, defs, "e2e")
        with duckdb.connect(config.output_database, read_only=True) as con:
            rows = con.execute(f"SELECT id, partition_key, text FROM {config.output_table}").fetchall()
        return runs, keys, rows

    ranged = BatchJobConfig.model_validate({**job.model_dump(), "shards": 3, "partitions_per_run": 3})
    runs, keys, rows = answers(ranged)
    assert len(keys) == 3 and len(runs) == 1
    tags = runs[0].dagster_run.tags
    assert (tags[RANGE_START], tags[RANGE_END]) == (keys[0], keys[2])
    materialized = {m.partition: m.metadata for m in runs[0].asset_materializations_for_node("e2e__completions")}
    assert sorted(materialized) == sorted(keys)
    rows_of = {key: sum(1 for _, k, _ in rows if k == key) for key in keys}
    for i, key in enumerate(keys):
        meta = materialized[key]
        assert meta["partitions_in_run"].value == 3
        assert meta["ok_rows"].value + meta["error_rows"].value == rows_of[key] > 0
        assert (meta["engine_start_s"].value > 0) == (i == 0)  # one vLLM start, in the first partition
        assert (meta["engine_stop_s"].value > 0) == (i == 2)  # one stop, after the last
        assert ranged.files.completions_parquet_path(key).exists()
    checks = {e.check_name: e for e in runs[0].get_asset_check_evaluations()}
    assert set(checks) == {"one_completion_per_row", "no_silent_empties", "prefix_saving",
                           "answers_follow_response_format", "error_rows_within_bound", "all_prompts_answered"}
    assert all(e.passed for e in checks.values())
    assert checks["one_completion_per_row"].metadata["partitions"].value == 3
    assert set(checks["one_completion_per_row"].metadata["by_partition"].value) == set(keys)

    single = BatchJobConfig.model_validate({**job.model_dump(), "shards": 3, "output_table": "single",
                                            "partitions_per_run": 1, "storage_dir": str(tmp_path / "single")})
    single_runs, _, single_rows = answers(single)
    assert len(single_runs) == 3
    assert {i: text for i, _, text in rows} == {i: text for i, _, text in single_rows}


def test_a_range_run_queued_for_a_superseded_plan_says_so_before_starting_vllm(job):
    """A run of three shards queued by the sensor; then a row is deleted and a new plan drops one of
    its keys: the queued run, started late, fails with what happened (the range cannot be listed any
    more), not with Dagster's partition-range error."""
    from dagster._core.definitions.job_base import InMemoryJob
    from dagster._core.execution.api import execute_run

    from dagster_project.demo import QUIET

    ranged = BatchJobConfig.model_validate({**job.model_dump(), "shards": 3, "partitions_per_run": 3})
    defs = build_batch_defs(ranged)
    with dg.instance_for_test() as instance:
        assert defs.resolve_job_def("e2e_plan").execute_in_process(instance=instance, run_config=QUIET).success
        sensor = defs.resolve_sensor_def("e2e_run_shards")
        with dg.partition_loading_context(dynamic_partitions_store=instance):
            (request,) = sensor.evaluate_tick(dg.build_sensor_context(instance=instance, definitions=defs)).run_requests
        shard_job = defs.resolve_job_def(request.job_name)
        queued = instance.create_run_for_job(  # created now, as the daemon queues it; it starts later
            shard_job, tags={**shard_job.tags, **request.tags},
            run_config={"execution": {"config": {"in_process": {}}}})
        last = request.tags["dagster/asset_partition_range_end"]
        plan_rows = pq.read_table(ranged.files.plan_path)
        gone = plan_rows.filter(pc.equal(plan_rows["partition_key"], last))["id"].to_pylist()[:1]
        with duckdb.connect(job.dataset.database) as con:  # a row of the last shard deleted: its key changes
            con.execute("DELETE FROM prompt_rows WHERE id = ?", gone)
        assert defs.resolve_job_def("e2e_plan").execute_in_process(instance=instance, run_config=QUIET).success
        assert last not in instance.get_dynamic_partitions(ranged.names.partitions_name)
        late = execute_run(InMemoryJob(shard_job), instance.get_run_by_id(queued.run_id), instance)
    assert not late.success
    message = "\n".join(str(e.event_specific_data.error) for e in late.all_events if e.is_failure)
    assert "the plan changed since this run was queued" in message and "are no longer all in" in message
