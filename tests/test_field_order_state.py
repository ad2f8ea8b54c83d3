"""A chosen field order is kept from night to night: old rows keep their prompts, new rows are placed."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from engine.table.field_order_state import kept_field_orders
from engine.table.fields import PromptFields, distinct_value_order, render_prompts

from .test_fields import categories_of_products, reviews, unique_prefix_chars

GREEDY_WINS = PromptFields(instruction="Label it.", fields=["review", "description", "category", "stars"],
                           field_order="optimize")
GLOBAL_WINS = PromptFields(instruction="Rate.", fields=["review", "product", "category"], field_order="optimize")


def recorded(table, spec, id_column, state, counter):
    """The night's orders, recorded as the prompts step does once its snapshot landed."""
    kept = kept_field_orders(table, spec, id_column, state, counter)
    kept.record(state)
    return kept


def grown(table: pa.Table, extra: pa.Table) -> pa.Table:
    return pa.concat_tables([table, extra.select(table.column_names)])


def prompts_by_id(table, spec, kept):
    return dict(zip(table.column("id").to_pylist(), render_prompts(table, spec, kept.choice.orders).to_pylist()))


def test_old_rows_keep_their_prompts_when_rows_are_added_and_new_rows_join_their_groups(tmp_path):
    state = tmp_path / "field_order.parquet"
    night1 = reviews(products=6, per_product=8, seed=1)
    first = recorded(night1, GREEDY_WINS, "id", state, unique_prefix_chars)
    assert first.reason == "first choice" and state.exists()
    # Night 2: rows of existing products and of a new product; the table's row order shuffled too.
    extra = reviews(products=7, per_product=9, seed=1)
    extra = extra.filter(pa.compute.invert(pa.compute.is_in(extra.column("id"), night1.column("id"))))
    night2 = grown(night1, extra).take(np.random.default_rng(2).permutation(night1.num_rows + extra.num_rows))
    second = recorded(night2, GREEDY_WINS, "id", state, unique_prefix_chars)
    assert second.reason == "kept" and second.kept_rows == night1.num_rows and second.new_rows == extra.num_rows
    before, after = prompts_by_id(night1, GREEDY_WINS, first), prompts_by_id(night2, GREEDY_WINS, second)
    assert all(after[i] == before[i] for i in before)  # no old row's prompt changed
    # A new review of a known product leads with that product's description, as its old reviews do.
    described = dict(zip(night1.column("id").to_pylist(), night1.column("description").to_pylist()))
    for i, description in zip(night2.column("id").to_pylist(), night2.column("description").to_pylist()):
        if i not in before and description in described.values():
            assert after[i].startswith("Label it.\n\ndescription: " + description)
    assert "kept" in second.describe() and f"{extra.num_rows} new rows placed" in second.describe()


def test_a_global_order_stays_even_where_a_new_choice_would_differ_and_is_chosen_again_only_when_asked(tmp_path):
    state = tmp_path / "field_order.parquet"
    night1 = categories_of_products()
    first = recorded(night1, GLOBAL_WINS, "id", state, unique_prefix_chars)
    assert first.choice.chosen == "distinct_values" and (first.choice.orders == [2, 1, 0]).all()
    # Night 2 adds 40 rows of one new product listed under 40 new categories: by distinct values the
    # product would now come first, and every old row's prompt would change.
    extra = pa.table({"id": [f"new-{c}" for c in range(40)], "category": [f"category new {c}" for c in range(40)],
                      "product": ["product new"] * 40, "review": [f"review {c}" for c in range(40)]})
    night2 = grown(night1, extra)
    assert (distinct_value_order(night2, GLOBAL_WINS) == [1, 2, 0]).all()
    second = recorded(night2, GLOBAL_WINS, "id", state, unique_prefix_chars)
    assert second.reason == "kept" and (second.choice.orders == [2, 1, 0]).all()
    again = recorded(night2, GLOBAL_WINS.model_copy(update={"choose_order_again": True}), "id", state,
                              unique_prefix_chars)
    assert again.reason == "asked" and set(again.choice.candidates) == {"declared", "distinct_values", "greedy"}
    fewer = GLOBAL_WINS.model_copy(update={"fields": ["review", "product"]})
    assert recorded(night2, fewer, "id", state, unique_prefix_chars).reason == "fields changed"
    stored = pq.read_table(state)
    assert stored.num_rows == night2.num_rows and stored.schema.field("order").type == pa.list_(pa.int16())


def test_the_declared_order_keeps_no_state(tmp_path):
    state = tmp_path / "field_order.parquet"
    kept = recorded(reviews(), GREEDY_WINS.declared(), "id", state, None)
    assert kept.reason == "declared" and (kept.choice.orders == np.arange(4)).all() and not state.exists()


def test_through_dagster_a_night_that_adds_rows_changes_no_old_rows_prompt(tmp_path, tiny_model):
    import dagster as dg

    from assets import build_batch_defs
    from batchllm_dagster import BatchJobConfig, DatasetSpec, EngineSettings

    source = tmp_path / "reviews.parquet"
    table = reviews(products=10, per_product=10, seed=4)
    night1 = table.slice(0, 95)
    pq.write_table(night1, source)
    config = BatchJobConfig(name="kept", dataset=DatasetSpec(parquet=str(source), prompt=GREEDY_WINS),
                            llm=EngineSettings(model_path=tiny_model), output_database=str(tmp_path / "o.duckdb"),
                            storage_dir=str(tmp_path / "jobs"))
    prompts = build_batch_defs(config).resolve_asset_graph().assets_def_for_key(dg.AssetKey(["kept", "prompts"]))
    instance = dg.DagsterInstance.ephemeral()

    def night() -> tuple[dict, dict]:
        result = dg.materialize([prompts], instance=instance)
        assert result.success
        snapshot = pq.read_table(config.files.prompts_path)
        metadata = result.asset_materializations_for_node(prompts.node_def.name)[0].metadata
        return dict(zip(snapshot.column("id").to_pylist(), snapshot.column("prompt").to_pylist())), metadata

    first, metadata = night()
    assert metadata["field_order_chosen"].value == "first choice"
    pq.write_table(table, source)  # 5 new rows (5%)
    second, metadata = night()
    assert metadata["field_order_chosen"].value == "kept"
    assert metadata["field_order_kept_rows"].value == 95 and metadata["field_order_new_rows"].value == 5
    assert all(second[i] == prompt for i, prompt in first.items())


def test_a_damaged_kept_order_stops_the_night_named_with_both_ways_out(tmp_path):
    """It cannot be made again as it was (a new choice may change old rows' prompts): never silently."""
    import pytest

    from engine.table.dataset import DatasetError

    state = tmp_path / "field_order.parquet"
    night1 = reviews(products=6, per_product=8, seed=1)
    recorded(night1, GREEDY_WINS, "id", state, unique_prefix_chars)
    state.write_bytes(state.read_bytes()[:50])
    with pytest.raises(DatasetError, match=r"the kept field order .*field_order.parquet is damaged .*restore it "
                                           r"from a backup, or remove it to choose the order again"):
        kept_field_orders(night1, GREEDY_WINS, "id", state, unique_prefix_chars)


def test_an_empty_night_records_nothing_and_an_empty_kept_order_is_chosen_again(tmp_path):
    state = tmp_path / "field_order.parquet"
    night1 = reviews(products=6, per_product=8, seed=1)
    first = recorded(night1, GREEDY_WINS, "id", state, unique_prefix_chars)
    kept = state.read_bytes()
    recorded(night1.slice(0, 0), GREEDY_WINS, "id", state, unique_prefix_chars)  # the source came back empty
    assert state.read_bytes() == kept
    back = recorded(night1, GREEDY_WINS, "id", state, unique_prefix_chars)
    assert back.reason == "kept" and prompts_by_id(night1, GREEDY_WINS, back) == prompts_by_id(
        night1, GREEDY_WINS, first)
    # An empty order an earlier version recorded: chosen again, not a crash.
    pq.write_table(pq.read_table(state).slice(0, 0), state)  # its choice kept in the schema, no rows
    assert kept_field_orders(night1, GREEDY_WINS, "id", state, unique_prefix_chars).reason == "none kept"
