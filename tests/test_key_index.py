"""``KeyIndex`` finds each key's first position among values as Arrow's hash lookup does, for any
keys: those whose first 8 bytes collide (digests' almost never do), duplicates, chunks, slices."""

import struct
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.plan import key_index
from engine.plan.key_index import KeyIndex, first_positions_among

# Keys from few words, so that first words collide and values repeat.
_KEYS = st.tuples(st.integers(0, 3), st.integers(0, 3)).map(lambda w: struct.pack("<QQ", *w))


def _expected(keys: list[bytes], values: list[bytes]) -> list[int]:
    found = pc.index_in(pa.array(keys, pa.binary(16)), value_set=pa.array(values, pa.binary(16)))
    return [-1 if p is None else p for p in found.to_pylist()]


@settings(max_examples=200, deadline=None)
@given(st.lists(_KEYS, max_size=30), st.lists(_KEYS, max_size=30), st.integers(1, 4), st.integers(0, 30))
def test_each_key_is_found_at_its_first_position_among_the_values(keys, values, batch, cut):
    with mock.patch.object(key_index, "_QUERY_BATCH", batch):
        expected = _expected(keys, values)
        assert KeyIndex(pa.array(values, pa.binary(16))).first_positions(pa.array(keys, pa.binary(16))).tolist() \
            == expected
        cut = min(cut, len(values))  # values in two chunks, the keys a slice of a longer array
        chunked = pa.chunked_array([pa.array(values[:cut], pa.binary(16)), pa.array(values[cut:], pa.binary(16))],
                                   pa.binary(16))
        sliced = pa.array([b"\xff" * 16] + keys, pa.binary(16)).slice(1)
        assert KeyIndex(chunked).first_positions(sliced).tolist() == expected
        in_chunks = pa.chunked_array([sliced.slice(0, cut), sliced.slice(cut)], pa.binary(16))
        assert KeyIndex(chunked).first_positions(in_chunks).tolist() == expected
        assert first_positions_among(in_chunks, chunked).tolist() == expected  # the keys indexed instead


def test_digests_are_found_as_the_hash_lookup_finds_them():
    rng = np.random.default_rng(0)
    values = [rng.bytes(16) for _ in range(5000)]
    keys = [values[i] for i in rng.integers(0, 5000, 3000)] + [rng.bytes(16) for _ in range(500)]
    got = KeyIndex(pa.array(values, pa.binary(16))).first_positions(pa.array(keys, pa.binary(16)))
    assert got.tolist() == _expected(keys, values) and (got[:3000] >= 0).all() and (got[3000:] == -1).all()
