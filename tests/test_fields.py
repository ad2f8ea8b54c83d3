"""Prompts from fields: the rendering, the candidate field orders and the choice among them by the
tokens each computes, and a dataset that declares them."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.table.dataset import DatasetError
from engine.table.fields import (
    FieldOrder,
    PromptFields,
    choose_field_orders,
    distinct_value_order,
    field_positions,
    greedy_field_orders,
    render_prompts,
    with_prompt_column,
)


def reviews(products=4, per_product=5, seed=0) -> pa.Table:
    rng = np.random.default_rng(seed)
    description = [" ".join(rng.choice(["ka", "lo", "mi", "ne"], 60)) for _ in range(products)]
    rows = [
        (f"r{p}-{k}", f"review {p}-{k} {rng.integers(1000)}", description[p], f"cat {p % 2}", int(rng.integers(1, 6)))
        for p in range(products)
        for k in range(per_product)
    ]
    order = rng.permutation(len(rows))
    columns = list(zip(*[rows[i] for i in order]))
    return pa.table(dict(zip(["id", "review", "description", "category", "stars"], columns)))


SPEC = PromptFields(instruction="Label it.", fields=["review", "description", "category", "stars"], question="Label:")


def unique_prefix_chars(prompts: list[str]) -> int:
    """A prefill counter at the finest grain: characters a perfect prefix cache computes on sorted prompts."""
    prompts = sorted(prompts)
    total = len(prompts[0])
    for a, b in zip(prompts, prompts[1:]):
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        total += len(b) - common
    return total


def categories_of_products(seed=0, categories=3, products_per=4, reviews_per=3) -> pa.Table:
    """Reviews of products within categories: each product in one category, its text about twice as long
    as the category's. Greedy grouping puts the product first (it saves more characters alone), then
    the category, repeated under each product; the global order by distinct values puts the category
    first and shares it across its products."""
    rng = np.random.default_rng(seed)
    rows = []
    for c in range(categories):
        category = f"category {c}: " + " ".join(rng.choice(["ka", "lo", "mi", "ne"], 30))
        for p in range(products_per):
            product = f"product {c}-{p} " + " ".join(rng.choice(["pu", "ra", "si", "to"], 60))
            rows += [(f"r{c}-{p}-{k}", category, product, f"review {rng.integers(10**6)}") for k in range(reviews_per)]
    order = rng.permutation(len(rows))
    return pa.table(dict(zip(["id", "category", "product", "review"], zip(*[rows[i] for i in order]))))


def test_a_prompt_is_rendered_in_the_documented_format():
    table = pa.table({"a": ["x"], "b": [None], "c": [3]})
    spec = PromptFields(instruction="Do it.", fields=["a", "b", "c"], question="Answer:")
    assert render_prompts(table, spec).to_pylist() == ["Do it.\n\na: x\nb: \nc: 3\n\nAnswer:"]
    no_question = spec.model_copy(update={"question": None})
    assert render_prompts(table, no_question).to_pylist() == ["Do it.\n\na: x\nb: \nc: 3"]


def test_the_declared_order_is_kept_unless_asked_to_optimize():
    choice = choose_field_orders(reviews(), SPEC, None)  # nothing to count: nothing is chosen
    assert (choice.orders == np.arange(4)).all() and choice.chosen == "declared" and choice.candidates == {}
    with pytest.raises(ValueError, match="an optimized field order is chosen first"):
        render_prompts(reviews(), SPEC.model_copy(update={"field_order": FieldOrder.optimize}))


def test_greedy_grouping_puts_the_long_shared_field_first_then_what_is_constant_and_the_unique_field_last():
    table = reviews()
    spec = SPEC.model_copy(update={"field_order": FieldOrder.optimize})
    orders = greedy_field_orders(table, spec)
    names = [[spec.fields[f] for f in row] for row in orders.tolist()]
    assert all(row[:2] == ["description", "category"] for row in names)  # category is constant per product
    assert all(row[-1] in ("review", "stars") and set(row) == set(spec.fields) for row in names)
    assert field_positions(orders, spec)["description"] == [table.num_rows, 0, 0, 0]
    prompts = render_prompts(table, spec, orders).to_pylist()
    same_product = [
        p for p, d in zip(prompts, table.column("description").to_pylist()) if d == table["description"][0].as_py()
    ]
    first_line = "Label it.\n\ndescription: " + table["description"][0].as_py() + "\ncategory: "
    assert len(same_product) == 5 and all(p.startswith(first_line) for p in same_product)


def test_the_optimized_order_computes_fewer_unique_characters_than_the_declared_one():
    table = reviews(products=6, per_product=8)
    spec = SPEC.model_copy(update={"field_order": "optimize"})
    choice = choose_field_orders(table, spec, unique_prefix_chars)
    optimized = unique_prefix_chars(render_prompts(table, spec, choice.orders).to_pylist())
    assert optimized == choice.candidates[choice.chosen] == min(choice.candidates.values())
    assert optimized < 0.5 * unique_prefix_chars(render_prompts(table, SPEC).to_pylist())


def test_where_greedy_grouping_loses_the_global_order_by_distinct_values_is_chosen():
    table = categories_of_products()
    spec = PromptFields(instruction="Rate.", fields=["review", "product", "category"], field_order="optimize")
    assert (distinct_value_order(table, spec) == [2, 1, 0]).all()  # category (3), product (12), review (36)
    greedy = greedy_field_orders(table, spec)
    assert (greedy == [1, 2, 0]).all()  # the product first: its category repeats under each of them
    choice = choose_field_orders(table, spec, unique_prefix_chars)
    assert choice.candidates["greedy"] > 1.2 * choice.candidates["distinct_values"]
    assert choice.chosen == "distinct_values" and (choice.orders == [2, 1, 0]).all()


def test_optimize_never_computes_more_prompt_tokens_than_a_global_order_at_the_block_size(tiny_model):
    from engine.plan.prepared import sorted_prefill_counter
    from engine.plan.tokenizing import load_tokenizer

    tokenizer = load_tokenizer(tiny_model)
    spec = PromptFields(instruction="Rate.", fields=["review", "product", "category"], field_order="optimize")
    for table in (categories_of_products(), reviews(products=6, per_product=8)):
        spec = spec.model_copy(update={"fields": [c for c in table.column_names if c != "id"]})
        for block_size in (1, 16, 32):
            count = sorted_prefill_counter(tokenizer, block_size)
            choice = choose_field_orders(table, spec, count)
            computed = count(render_prompts(table, spec, choice.orders).to_pylist())
            assert computed == choice.candidates[choice.chosen]
            assert computed <= min(choice.candidates["declared"], choice.candidates["distinct_values"])


def test_bad_declarations_are_refused_with_what_to_fix():
    with pytest.raises(ValueError, match="at least one field"):
        PromptFields(instruction="x", fields=[])
    with pytest.raises(ValueError, match="more than once"):
        PromptFields(instruction="x", fields=["a", "a"])
    with pytest.raises(ValueError, match=r"\['nope'\] are not columns"):
        choose_field_orders(reviews(), PromptFields(instruction="x", fields=["review", "nope"], field_order="optimize"),
                            unique_prefix_chars)
    with pytest.raises(ValueError, match="has a 'review' column"):
        with_prompt_column(reviews(), SPEC, "review")


def test_a_dataset_declared_with_fields_snapshots_the_rendered_prompts(tmp_path, tiny_model):
    from assets.prompts import snapshot_dataset
    from batchllm_dagster.config import BatchJobConfig, DatasetSpec
    from engine.settings import EngineSettings

    table = reviews()
    pq.write_table(table, tmp_path / "reviews.parquet")
    spec = SPEC.model_copy(update={"field_order": FieldOrder.optimize})
    config = BatchJobConfig(name="reviews", dataset=DatasetSpec(parquet=str(tmp_path / "reviews.parquet"), prompt=spec),
                            llm=EngineSettings(model_path=tiny_model), output_database=str(tmp_path / "o.duckdb"),
                            storage_dir=str(tmp_path / "jobs"))
    rows, _, kept = snapshot_dataset(config, tmp_path / "snapshot.parquet")
    choice = kept.choice
    snapshot = pq.read_table(tmp_path / "snapshot.parquet")
    assert rows == table.num_rows
    assert set(choice.candidates) == {"declared", "distinct_values", "greedy"}
    assert choice.candidates[choice.chosen] < choice.candidates["declared"]
    assert snapshot.column("prompt").to_pylist() == render_prompts(table, spec, choice.orders).to_pylist()
    assert snapshot.column("id").to_pylist() == table.column("id").to_pylist()

    clash = config.model_copy(update={"dataset": DatasetSpec(parquet=str(tmp_path / "reviews.parquet"),
                                                             prompt=spec.model_copy(update={"fields": ["nope"]}))})
    with pytest.raises(DatasetError, match="not columns"):
        snapshot_dataset(clash, tmp_path / "other.parquet")


def test_a_value_cannot_pass_for_another_field_and_two_rows_never_render_the_same_prompt():
    # Before values were escaped both rows rendered "a: x\nb: y\nb: ".
    table = pa.table({"a": ["x\nb: y", "x", "back\\slash\r"], "b": ["", "y\nb: ", None]})
    spec = PromptFields(instruction="Do it.", fields=["a", "b"])
    prompts = render_prompts(table, spec).to_pylist()
    assert len(set(prompts)) == 3
    assert prompts[0] == "Do it.\n\na: x\\nb: y\nb: "
    assert prompts[2] == "Do it.\n\na: back\\\\slash\\r\nb: "
    assert all(p.count("\n") == prompts[0].count("\n") for p in prompts)  # one line per field, always
    with pytest.raises(ValueError, match="may not hold a newline or ': '"):
        PromptFields(instruction="x", fields=["a: b"])


def test_numbers_render_alike_whatever_their_sql_type_and_nested_values_as_json():
    import decimal

    table = pa.table({"price": pa.array([decimal.Decimal("4.50"), decimal.Decimal("4.00"), decimal.Decimal("0.10")],
                                        pa.decimal128(6, 2)),
                      "as_double": [4.5, 4.0, 0.1], "as_int": [4, 4, 0],
                      "tags": [["b", "a"], [], None], "info": [{"k": 1, "a": "z"}, None, {"k": 2, "a": None}]})
    values = {name: render_prompts(table, PromptFields(instruction="", fields=[name])).to_pylist()
              for name in table.column_names}
    assert values["price"] == ["\n\nprice: 4.5", "\n\nprice: 4", "\n\nprice: 0.1"]
    assert [v.split(": ")[1] for v in values["price"]] == [v.split(": ")[1] for v in values["as_double"]]
    assert values["tags"] == ['\n\ntags: ["b", "a"]', "\n\ntags: []", "\n\ntags: "]
    assert values["info"] == ['\n\ninfo: {"a": "z", "k": 1}', "\n\ninfo: ", '\n\ninfo: {"a": null, "k": 2}']
    # The optimizer reads the same text: nested fields are no Arrow error there either.
    spec = PromptFields(instruction="", fields=["tags", "info", "price"], field_order="optimize")
    assert choose_field_orders(table, spec, unique_prefix_chars).orders.shape == (3, 3)


def test_fields_with_chat_messages_in_the_table_are_refused():
    table = pa.table({"id": [1, 2], "review": ["a", "b"], "messages": [None, '[{"role": "user", "content": "hi"}]']})
    spec = PromptFields(instruction="Rate.", fields=["review"])
    with pytest.raises(DatasetError, match="chat messages in its 'messages' column"):
        with_prompt_column(table, spec, "prompt")
    empty = table.set_column(2, "messages", pa.array([None, None], pa.string()))
    assert with_prompt_column(empty, spec, "prompt").column("prompt").to_pylist() == ["Rate.\n\nreview: a",
                                                                                      "Rate.\n\nreview: b"]


def test_one_rendering_path_batch_by_batch_or_whole_and_an_optimized_order_kept_only_where_state_is(tmp_path):
    """The asset streams batches, the CLI and the bench hold a table: both go through
    ``rendered_batches`` and get the same prompts; an optimized order is kept only with a state path,
    and recorded by the caller."""
    from engine.table.dataset import Columns
    from engine.table.fields import FieldOrder, with_prompt_column
    from engine.table.prompt_rendering import rendered_batches, rendered_table

    table = reviews()
    whole = with_prompt_column(table, SPEC, "prompt").column("prompt")
    batches, schema, kept = rendered_batches(table.to_batches(max_chunksize=3), table.schema, SPEC, Columns())
    streamed = pa.Table.from_batches(list(batches), schema).column("prompt")
    assert kept is None and streamed.to_pylist() == whole.to_pylist()

    optimize = SPEC.model_copy(update={"field_order": FieldOrder.optimize})
    afresh, kept = rendered_table(table, optimize, Columns(), unique_prefix_chars)
    assert kept.reason == "no kept state" and not list(tmp_path.iterdir())
    state = tmp_path / "field_order.parquet"
    saved, kept = rendered_table(table, optimize, Columns(), unique_prefix_chars, state)
    assert kept.reason == "first choice" and not state.exists()  # recorded once its prompts landed
    kept.record(state)
    assert state.exists()
    assert saved.column("prompt").to_pylist() == afresh.column("prompt").to_pylist()
