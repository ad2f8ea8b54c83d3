"""Prompts from fields: the rendering, the greedy field order, and a dataset that declares them."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.dataset import DatasetError
from engine.fields import FieldOrder, PromptFields, field_orders, field_positions, render_prompts, with_prompt_column


def reviews(products=4, per_product=5, seed=0) -> pa.Table:
    rng = np.random.default_rng(seed)
    description = [" ".join(rng.choice(["ka", "lo", "mi", "ne"], 60)) for _ in range(products)]
    rows = [(f"r{p}-{k}", f"review {p}-{k} {rng.integers(1000)}", description[p], f"cat {p % 2}", int(rng.integers(1, 6)))
            for p in range(products) for k in range(per_product)]
    order = rng.permutation(len(rows))
    columns = list(zip(*[rows[i] for i in order]))
    return pa.table(dict(zip(["id", "review", "description", "category", "stars"], columns)))


SPEC = PromptFields(instruction="Label it.", fields=["review", "description", "category", "stars"], question="Label:")


def test_a_prompt_is_rendered_in_the_documented_format():
    table = pa.table({"a": ["x"], "b": [None], "c": [3]})
    spec = PromptFields(instruction="Do it.", fields=["a", "b", "c"], question="Answer:")
    assert render_prompts(table, spec).to_pylist() == ["Do it.\n\na: x\nb: \nc: 3\n\nAnswer:"]
    no_question = spec.model_copy(update={"question": None})
    assert render_prompts(table, no_question).to_pylist() == ["Do it.\n\na: x\nb: \nc: 3"]


def test_the_declared_order_is_kept_unless_asked_to_optimize():
    orders = field_orders(reviews(), SPEC)
    assert (orders == np.arange(4)).all()


def test_optimize_puts_the_long_shared_field_first_then_what_is_constant_and_the_unique_field_last():
    table = reviews()
    spec = SPEC.model_copy(update={"field_order": FieldOrder.optimize})
    orders = field_orders(table, spec)
    names = [[spec.fields[f] for f in row] for row in orders.tolist()]
    assert all(row[:2] == ["description", "category"] for row in names)  # category is constant per product
    assert all(row[-1] in ("review", "stars") and set(row) == set(spec.fields) for row in names)
    assert field_positions(orders, spec)["description"] == [table.num_rows, 0, 0, 0]
    prompts = render_prompts(table, spec, orders).to_pylist()
    same_product = [p for p, d in zip(prompts, table.column("description").to_pylist()) if d == table["description"][0].as_py()]
    first_line = "Label it.\n\ndescription: " + table["description"][0].as_py() + "\ncategory: "
    assert len(same_product) == 5 and all(p.startswith(first_line) for p in same_product)


def test_the_optimized_order_computes_fewer_unique_characters_than_the_declared_one():
    table = reviews(products=6, per_product=8)

    def unique_prefix_chars(prompts):  # characters a perfect prefix cache computes, on sorted prompts
        prompts = sorted(prompts)
        total = len(prompts[0])
        for a, b in zip(prompts, prompts[1:]):
            common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            total += len(b) - common
        return total

    declared = unique_prefix_chars(render_prompts(table, SPEC).to_pylist())
    optimized = unique_prefix_chars(render_prompts(table, SPEC.model_copy(update={"field_order": "optimize"})).to_pylist())
    assert optimized < 0.5 * declared


def test_bad_declarations_are_refused_with_what_to_fix():
    with pytest.raises(ValueError, match="at least one field"):
        PromptFields(instruction="x", fields=[])
    with pytest.raises(ValueError, match="more than once"):
        PromptFields(instruction="x", fields=["a", "a"])
    with pytest.raises(ValueError, match=r"\['nope'\] are not columns"):
        field_orders(reviews(), PromptFields(instruction="x", fields=["review", "nope"], field_order="optimize"))
    with pytest.raises(ValueError, match="has a 'review' column"):
        with_prompt_column(reviews(), SPEC, "review")


def test_a_dataset_declared_with_fields_snapshots_the_rendered_prompts(tmp_path):
    from assets.prompts import snapshot_dataset
    from batchllm_dagster.config import BatchJobConfig, DatasetSpec
    from engine.settings import EngineSettings

    table = reviews()
    pq.write_table(table, tmp_path / "reviews.parquet")
    spec = SPEC.model_copy(update={"field_order": FieldOrder.optimize})
    config = BatchJobConfig(name="reviews", dataset=DatasetSpec(parquet=str(tmp_path / "reviews.parquet"), prompt=spec),
                            llm=EngineSettings(model_path="unused"), output_database=str(tmp_path / "o.duckdb"),
                            storage_dir=str(tmp_path / "jobs"))
    rows, _ = snapshot_dataset(config, tmp_path / "snapshot.parquet")
    snapshot = pq.read_table(tmp_path / "snapshot.parquet")
    assert rows == table.num_rows
    assert snapshot.column("prompt").to_pylist() == render_prompts(table, spec).to_pylist()
    assert snapshot.column("id").to_pylist() == table.column("id").to_pylist()

    clash = config.model_copy(update={"dataset": DatasetSpec(parquet=str(tmp_path / "reviews.parquet"),
                                                             prompt=spec.model_copy(update={"fields": ["nope"]}))})
    with pytest.raises(DatasetError, match="not columns"):
        snapshot_dataset(clash, tmp_path / "other.parquet")
