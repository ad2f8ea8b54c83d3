"""Which rows can run, from a table's own columns as read (Arrow, chunks, any integer type): each
row's budget and own format, and the reason of each row that cannot run."""

from unittest import mock

import numpy as np
import pyarrow as pa

from engine.plan.row_checks import output_budgets, row_response_formats
from engine.response_format import ResponseFormat
from engine.settings import EngineSettings

SETTINGS = EngineSettings(model_path="unused", block_size=8, max_model_len=100)
LABELS = ResponseFormat(choice=["positive", "negative"])


def test_own_budgets_of_any_integer_type_keep_their_value_or_say_why_not():
    lengths = np.array([10, 10, 10, 10, 10, 95, 10])
    for type_ in (pa.int64(), pa.uint64(), pa.int16()):
        values = [None, 0, 7, 100, 101, 6, 2**63 + 5 if type_ == pa.uint64() else -3]
        column = pa.chunked_array([pa.array(values[:3], type_), pa.array(values[3:], type_)])
        errors: dict[int, str] = {}
        budgets = output_budgets(column, 16, lengths, SETTINGS, errors)
        assert budgets[[0, 2]].tolist() == [16, 7]  # null: the job's; else its own
        assert errors[1] == "invalid max_tokens 0: must be between 1 and the context of 100 tokens"
        assert errors[4] == "invalid max_tokens 101: must be between 1 and the context of 100 tokens"
        assert errors[6] == f"invalid max_tokens {values[6]}: must be between 1 and the context of 100 tokens"
        assert errors[3].startswith("prompt of 10 tokens + max_tokens 100 exceeds the model's context of 100")
        assert errors[5].startswith("prompt of 95 tokens + max_tokens 6 exceeds")  # fits alone, not beside its prompt
        assert sorted(errors) == [1, 3, 4, 5, 6]
    assert output_budgets(None, 16, lengths, SETTINGS, {}).tolist() == [16] * 7


def test_own_formats_are_parsed_once_each_and_a_bad_one_is_the_rows_reason():
    texts = [None, LABELS.to_text(), "not json", None, LABELS.to_text(), ""]
    column = pa.chunked_array([pa.array(texts[:2]), pa.array(texts[2:])])
    errors: dict[int, str] = {}
    with mock.patch.object(ResponseFormat, "from_text", wraps=ResponseFormat.from_text) as parse:
        formats = row_response_formats(column, errors)
    assert parse.call_count == 3  # the labels, "not json" and ""
    assert formats == {1: LABELS, 4: LABELS}
    assert sorted(errors) == [2, 5] and all(e.startswith("invalid response_format: ") for e in errors.values())
    assert row_response_formats(None, errors) == {}
