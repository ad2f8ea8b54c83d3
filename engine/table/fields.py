"""Prompts built from a row's fields, in the order that shares most.

A row's prompt is ``{instruction}``, a blank line, one ``{field}: {value}`` line per field, and
``{question}`` after a blank line (README, "Prompts from fields", has the user's rules). Values are
rendered so that two different rows never give the same prompt and a value gives the same text
whatever its SQL type: NULL is empty; backslash, newline and carriage return are escaped, so a
value stays on its line (``field_text``); numbers in their shortest form; lists, structs and
maps as JSON with sorted keys; a type Arrow cannot cast to text is refused with its field's name.

``field_order: optimize`` chooses among ``declared``, ``distinct_values`` (fields by ascending
distinct values: the hand recipe) and ``greedy`` (the per-row grouping of Liu et al., arXiv
2403.05821) by the exact count: each candidate is tokenized and planned, and the fewest prompt
tokens to compute at the job's KV block size (the minimum prefill) wins; a tie goes to a global
order. A different order can change an answer: ``batchllm bench --fields`` reports how many
answers two orders share.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .dataset import Columns, DatasetError


class FieldOrder(str, Enum):
    as_declared = "as_declared"
    optimize = "optimize"


class PromptFields(BaseModel):
    """A prompt made of fields: a dataset's YAML ``prompt:`` and the CLI's ``--instruction/--fields``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    instruction: str = Field(description="text before the fields (shared by every row)")
    fields: list[str] = Field(description="columns rendered as 'name: value' lines")
    question: str | None = Field(None, description="text after the fields")
    field_order: FieldOrder = Field(FieldOrder.as_declared, description="as_declared, or optimize (shares most)")
    choose_order_again: bool = Field(
        False, description="optimize: choose the order again instead of keeping the job's (every old row's prompt "
        "may change, and its answer with it)")

    @model_validator(mode="after")
    def _fields_given(self) -> "PromptFields":
        if not self.fields:
            raise ValueError("a prompt made of fields needs at least one field")
        if len(set(self.fields)) != len(self.fields):
            raise ValueError(f"fields are listed more than once: {self.fields}")
        unclear = [f for f in self.fields if "\n" in f or "\r" in f or ": " in f]
        if unclear:
            raise ValueError(f"field names may not hold a newline or ': ' (a line would not say which field it is): "
                             f"{unclear}")
        return self

    def declared(self) -> "PromptFields":
        """The same prompt with its fields in the declared order."""
        return self.model_copy(update={"field_order": FieldOrder.as_declared})


def _missing(table: pa.Table, spec: PromptFields) -> None:
    missing = [f for f in spec.fields if f not in table.column_names]
    if missing:
        raise DatasetError(f"the prompt's fields {missing} are not columns of the table "
                         f"(it has {', '.join(table.column_names)})")


def field_text(column: pa.ChunkedArray | pa.Array, name: str) -> pa.Array:
    """A field's values as they are rendered in a prompt (see the module doc)."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    kind = column.type
    if pa.types.is_nested(kind):
        text = pa.array([None if v is None else json.dumps(v, ensure_ascii=False, sort_keys=True, default=str)
                         for v in column.to_pylist()], pa.string())
    else:
        try:
            text = pc.cast(column, pa.string())
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid) as exc:
            raise DatasetError(f"field {name!r} of type {kind} cannot be rendered as text ({exc}): cast it in the "
                               f"dataset's SQL") from None
        if pa.types.is_decimal(kind):  # 4.50 and 4.00 as 4.5 and 4, as a DOUBLE renders them
            text = pc.replace_substring_regex(pc.replace_substring_regex(text, r"(\.\d*?)0+$", r"\1"), r"\.$", "")
    text = pc.fill_null(text, "")
    for raw, escaped in (("\\", "\\\\"), ("\n", "\\n"), ("\r", "\\r")):  # the backslash first
        text = pc.replace_substring(text, raw, escaped)
    return text


def _values(table: pa.Table, spec: PromptFields) -> list[list[str]]:
    """Each field's values as rendered text."""
    return [field_text(table.column(f), f).to_pylist() for f in spec.fields]


# The prompt tokens sorted rows compute for these prompts (tokenized and planned at the job's block
# size): ``engine.plan.prepared.sorted_prefill_counter`` gives one for a tokenizer.
PrefillCounter = Callable[[list[str]], int]


@dataclass
class FieldOrderChoice:
    """Each row's field order ((rows, fields) indices into the spec's fields), which candidate it
    is, and every candidate's prompt tokens to compute (empty for ``as_declared``: nothing chosen)."""

    orders: np.ndarray
    chosen: str
    candidates: dict[str, int]


def declared_order(table: pa.Table, spec: PromptFields) -> np.ndarray:
    _missing(table, spec)
    k = len(spec.fields)
    return np.broadcast_to(np.arange(k, dtype=np.int16), (table.num_rows, k)).copy()


def choose_field_orders(table: pa.Table, spec: PromptFields, prefill_tokens: PrefillCounter | None) -> FieldOrderChoice:
    """The field order of every row (see the module doc). ``prefill_tokens`` counts a candidate's
    cost; ``optimize`` needs one, ``as_declared`` does not."""
    if spec.field_order is FieldOrder.as_declared:
        return FieldOrderChoice(declared_order(table, spec), "declared", {})
    if prefill_tokens is None:
        raise ValueError("field_order: optimize chooses by the prompt tokens each order computes: give a counter")
    candidates = {"declared": declared_order(table, spec), "distinct_values": distinct_value_order(table, spec),
                  "greedy": greedy_field_orders(table, spec)}
    costs = {name: int(prefill_tokens(render_prompts(table, spec, orders).to_pylist()))
             for name, orders in candidates.items()}
    chosen = min(costs, key=costs.__getitem__)  # the first of equals: a global order before the per-row one
    return FieldOrderChoice(candidates[chosen], chosen, costs)


def greedy_field_orders(table: pa.Table, spec: PromptFields) -> np.ndarray:
    """Each row's field order by the greedy recursive grouping (see the module doc)."""
    declared = declared_order(table, spec)
    n, k = declared.shape
    if n < 2:
        return declared
    codes = np.empty((n, k), dtype=np.int64)
    line_length = []
    for j, name in enumerate(spec.fields):
        encoded = pc.dictionary_encode(field_text(table.column(name), name))
        codes[:, j] = encoded.indices.to_numpy(zero_copy_only=False)
        # The length of the value's line, in UTF-8 bytes: a proxy for its tokens.
        line_length.append(pc.binary_length(encoded.dictionary).to_numpy(zero_copy_only=False) + len(name) + 3)
    return _greedy_grouping(codes, line_length, declared)


def distinct_value_order(table: pa.Table, spec: PromptFields) -> np.ndarray:
    """The order a user who knows prefix caching writes by hand: one global order, the fields by
    ascending number of distinct values (ties in the declared order), the same for every row."""
    _missing(table, spec)
    distinct = [pc.count_distinct(field_text(table.column(f), f)).as_py() for f in spec.fields]
    order = np.array(sorted(range(len(spec.fields)), key=lambda j: (distinct[j], j)), dtype=np.int16)
    return np.broadcast_to(order, (table.num_rows, order.size)).copy()


def _greedy_grouping(codes: np.ndarray, line_length: list[np.ndarray], orders: np.ndarray) -> np.ndarray:
    """The greedy recursive grouping (see the module doc), with an explicit stack: a node is rows
    that share their first ``position`` fields, and the fields not yet placed."""
    stack = [(np.arange(codes.shape[0]), list(range(codes.shape[1])), 0)]
    while stack:
        rows, fields, position = stack.pop()
        if rows.size < 2 or not fields:
            orders[rows, position:] = fields
            continue
        best, best_saving = None, 0
        for f in fields:
            values, counts = np.unique(codes[rows, f], return_counts=True)
            saving = int(((counts - 1) * line_length[f][values]).sum())
            if saving > best_saving:
                best, best_saving = f, saving
        if best is None:  # nothing repeats among these rows: any order shares the same
            orders[rows, position:] = fields
            continue
        values, inverse, counts = np.unique(codes[rows, best], return_inverse=True, return_counts=True)
        repeated = counts[inverse] > 1
        if (~repeated).any():  # rows whose value is their own: grouped again by the other fields
            stack.append((rows[~repeated], fields, position))
        shared = rows[repeated]
        shared = shared[np.argsort(codes[shared, best], kind="stable")]
        starts = np.concatenate([[0], np.flatnonzero(np.diff(codes[shared, best])) + 1])
        rest = [f for f in fields if f != best]
        # Per value's rows: the other fields constant among them follow the chosen one.
        constant = {f: np.minimum.reduceat(codes[shared, f], starts) == np.maximum.reduceat(codes[shared, f], starts)
                    for f in rest}
        ends = np.append(starts[1:], shared.size)
        for g, (a, b) in enumerate(zip(starts, ends)):
            group = shared[a:b]
            prefix = [best] + [f for f in rest if constant[f][g]]
            orders[group, position : position + len(prefix)] = prefix
            stack.append((group, [f for f in rest if f not in prefix], position + len(prefix)))
    return orders


def render_prompts(table: pa.Table, spec: PromptFields, orders: np.ndarray | None = None) -> pa.Array:
    """Each row's prompt (see the module doc), its fields in ``orders`` (``choose_field_orders``;
    may be left out for ``as_declared``)."""
    if orders is None:
        if spec.field_order is not FieldOrder.as_declared:
            raise ValueError("render_prompts: an optimized field order is chosen first (choose_field_orders)")
        orders = declared_order(table, spec)
    values = _values(table, spec)
    head = spec.instruction + "\n\n"
    tail = "\n\n" + spec.question if spec.question else ""
    names = spec.fields
    return pa.array([head + "\n".join(f"{names[f]}: {values[f][i]}" for f in order) + tail
                     for i, order in enumerate(orders.tolist())], pa.string())


def field_positions(orders: np.ndarray, spec: PromptFields) -> dict[str, list[int]]:
    """How often each field went to each position (the order chosen per field, for people)."""
    k = len(spec.fields)
    return {name: np.bincount(np.flatnonzero(orders == j) % k, minlength=k).tolist() if orders.size else [0] * k
            for j, name in enumerate(spec.fields)}


def with_prompt_column(table: pa.Table, spec: PromptFields, column: str, orders: np.ndarray | None = None,
                       messages_column: str = Columns().messages) -> pa.Table:
    """``table`` with its prompt ``column`` rendered from the fields; refused if it has one already,
    or chat messages in a row (a row's messages would be run instead of its fields)."""
    if column in table.column_names:
        raise DatasetError(f"the table has a {column!r} column and the dataset builds its prompt from fields: "
                         f"drop one of them (or rename the column)")
    if messages_column in table.column_names and table.column(messages_column).null_count < table.num_rows:
        raise DatasetError(f"the table has chat messages in its {messages_column!r} column and the dataset builds its "
                           f"prompt from fields: a row runs one or the other; drop the column or the fields")
    return table.append_column(column, render_prompts(table, spec, orders))
