"""Indexing a catalog the ways numpy, torch and Python lists are indexed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensortier.data import Catalog
from tests.data._records import record, same


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    c = Catalog.build(tmp_path_factory.mktemp("i") / "c", [record(i) for i in range(50)])
    yield c
    c.close()


@pytest.mark.parametrize(
    "key",
    [np.int32(7), np.array(7), torch.tensor(7), torch.tensor(7, dtype=torch.int32), np.array(-43)],
    ids=["np.int32", "0-d array", "0-d tensor", "0-d int32 tensor", "negative 0-d array"],
)
def test_a_0d_integer_index_is_one_record_as_in_numpy_and_torch(cat, key):
    """``torch.randint(n, ())`` or ``np.array(i)`` came back as a list of one record (0-d keys
    went the sequence path); ``lst[np.array(7)]`` and ``t[torch.tensor(7)]`` give one element."""
    assert list(range(50))[key] == 7 and torch.arange(50)[key].item() == 7  # the convention
    assert same(cat[key], record(7))


@pytest.mark.parametrize("key", [torch.tensor(True), np.array(2.0), torch.tensor(1.5)])
def test_a_0d_index_that_is_not_an_int_is_refused(cat, key):
    with pytest.raises(TypeError, match="0-d index must hold an int"):
        cat[key]


def test_a_0d_index_out_of_range_is_an_index_error(cat):
    with pytest.raises(IndexError, match="record index 50 is out of range"):
        cat[torch.tensor(50)]
    assert [same(a, record(i)) for a, i in zip(cat[torch.tensor([3, 4])], (3, 4))] == [True] * 2
