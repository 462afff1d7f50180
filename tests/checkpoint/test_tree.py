import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tensortier.checkpoint._tree import decode, encode
from tensortier.errors import ConfigError, CorruptDataError

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
keys = st.text(max_size=6) | st.integers() | st.booleans()
trees = st.recursive(
    scalars | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(keys, inner, max_size=4)
    ),
    max_leaves=20,
)


def roundtrip(obj):
    tensors = {}

    def add(path, t):
        tensors[path] = t
        return path

    import json

    text = json.dumps(encode(obj, "root", add), allow_nan=False)
    return decode(json.loads(text), tensors)


def same(a, b):
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


@given(trees)
def test_json_like_state_round_trips_exactly(obj):
    assert same(roundtrip(obj), obj)


def test_tensors_arrays_dtypes_and_reserved_keys():
    obj = {
        "t": torch.arange(3),
        "np": np.arange(4, dtype=np.uint32),
        "dt": torch.bfloat16,
        "$tt": "not a tag when it is user data",
        7: {"inf": float("-inf")},
    }
    out = roundtrip(obj)
    assert torch.equal(out["t"], obj["t"]) and out["np"].dtype == np.uint32
    assert (out["np"] == obj["np"]).all() and out["dt"] is torch.bfloat16
    assert out["$tt"] == obj["$tt"] and out[7] == {"inf": float("-inf")}


@pytest.mark.parametrize("bad", [object(), {1, 2}, lambda: 0, np.array(["a"])])
def test_unsupported_values_are_refused(bad):
    with pytest.raises(ConfigError, match="root"):
        encode({"x": bad}, "root", lambda p, t: p)


@pytest.mark.parametrize(
    "crafted",
    [
        {"$tt": "pickle", "data": "x"},
        {"$tt": "tensor", "name": "nope"},
        {"$tt": "float", "value": "__import__('os')"},
        {"$tt": "ndarray", "dtype": "object", "shape": [1], "data": [1]},
        {"$tt": "dtype", "name": "os.system"},
        {"$tt": "dict", "items": [[[1], 2]]},
    ],
)
def test_decoder_only_resolves_its_allow_list(crafted):
    with pytest.raises(CorruptDataError):
        decode(crafted, {})
