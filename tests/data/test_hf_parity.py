"""A catalog built from a Hugging Face dataset reads back what ``datasets`` gives for the same
rows, type by type: numbers and strings as HF's Python values, list columns as arrays of the
column's dtype holding HF's values (nested lists, ``Array2D``/``Array3D``, list views and
fixed-shape tensors too), through random access, epochs and DataLoader workers."""

from __future__ import annotations

import numpy as np
import pytest

from tensortier.data import Catalog

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
F = datasets.Features


def rows(n: int) -> list[dict]:
    """Realistic records: text (non-ASCII and empty), token ids of every length, a label, a
    float score (nan and -0.0), a flag, a nested sequence, a fixed-shape 2-D array."""
    rng = np.random.default_rng(0)
    texts = ["", "héllo wörld", "日本語のテキスト 🎉", "a\x00b", "plain"]
    return [
        {
            "text": texts[i % 5] * (i % 3),
            "input_ids": rng.integers(0, 50_000, i % 13).tolist(),
            "label": i % 3,
            "score": [float("nan"), -0.0, i / 7][i % 3],
            "ok": bool(i % 2),
            "spans": [[i, i + 1], [i + 2, i + 3]][: i % 3],
            "patch": rng.standard_normal((2, 3)).astype(np.float32).tolist(),
        }
        for i in range(n)
    ]


FEATURES = F(
    {
        "text": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "label": datasets.ClassLabel(names=["a", "b", "c"]),
        "score": datasets.Value("float32"),
        "ok": datasets.Value("bool"),
        "spans": datasets.Sequence(datasets.Sequence(datasets.Value("int16"))),
        "patch": datasets.Array2D((2, 3), "float32"),
    }
)
DTYPES = {"input_ids": np.int32, "spans": np.int16, "patch": np.float32}


def same_as_hf(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        if k in DTYPES:  # arrays of the column's dtype, HF's values
            assert isinstance(g, np.ndarray) and g.dtype == DTYPES[k], (k, g)
            assert np.asarray(w, DTYPES[k]).reshape(g.shape).tobytes() == g.tobytes(), k
            assert g.tolist() == w or g.size == 0 and np.asarray(w).size == 0, k
        else:  # str, int, float, bool as HF gives them; floats to the bit (nan, -0.0)
            assert type(g) is type(w), (k, g, w)
            if isinstance(w, float):
                assert np.float64(g).tobytes() == np.float64(w).tobytes(), k
            else:
                assert g == w, k


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    hf = datasets.Dataset.from_list(rows(240), features=FEATURES)
    cat = Catalog.build(tmp_path_factory.mktemp("hf") / "c", hf, batch_bytes="4KiB")
    yield hf, cat
    cat.close()


def test_every_row_reads_back_as_hf_gives_it(built):
    hf, cat = built
    want = hf[:]
    want = [{k: want[k][i] for k in want} for i in range(len(hf))]
    for i in (0, 1, 2, 5, 239):
        same_as_hf(cat[i], want[i])
    for got, w in zip(cat[:], want, strict=True):
        same_as_hf(got, w)
    # HF's own numpy format agrees on the fixed-shape column's dtype
    assert hf.with_format("numpy")[7]["patch"].dtype == cat[7]["patch"].dtype == np.float32


def test_epochs_with_two_workers_read_the_same_values(built):
    hf, cat = built
    want = hf[:]
    seen = []
    for batch in cat.epochs(batch=32, seed=4, num_workers=2):
        for i, got in zip(batch.indices.tolist(), batch.data):
            same_as_hf(got, {k: want[k][i] for k in want})
            seen.append(i)
    assert sorted(seen) == list(range(len(hf)))


@pytest.mark.parametrize(
    "column,dtype,shape",
    [
        (pa.array([[[1, 2], [3, 4]], [[5, 6]]], pa.list_(pa.list_(pa.int16()))), np.int16, (2, 2)),
        (pa.array([[[0.5], [-0.0]]], pa.large_list(pa.list_(pa.float16()))), np.float16, (2, 1)),
        (pa.array([[1], [2, 3]], pa.list_view(pa.int32())), np.int32, (1,)),
        (pa.array([[[True]]], pa.list_(pa.list_(pa.bool_(), 1))), np.bool_, (1, 1)),
        (
            pa.ExtensionArray.from_storage(
                pa.fixed_shape_tensor(pa.float32(), (2, 2)),
                pa.array([[1, 2, 3, 4], [5, 6, 7, 8]], pa.list_(pa.float32(), 4)),
            ),
            np.float32,
            (2, 2),
        ),
    ],
    ids=["list-list-int16", "large-list-f16", "list-view-int32", "fixed-bool", "tensor-f32"],
)
def test_nested_and_extension_list_columns_keep_their_dtype(tmp_path, column, dtype, shape):
    """They came back as int64/float64 arrays of ``np.asarray(row.to_pylist())`` (a fixed-shape
    tensor as a flat row), against the README's "arrays of the column's type"."""
    table = pa.table({"x": column})
    with Catalog.build(tmp_path / "c", table) as cat:
        got = cat[0]["x"]
    assert got.dtype == dtype and got.shape == shape
    if isinstance(column.type, pa.FixedShapeTensorType):
        assert got.tobytes() == column.to_numpy_ndarray()[0].tobytes()
    else:
        assert got.tolist() == column[0].as_py()


def test_hf_array3d_keeps_its_dtype(tmp_path):
    feats = F({"a": datasets.Array3D((1, 2, 2), "int8")})
    hf = datasets.Dataset.from_dict({"a": [[[[1, -2], [3, 4]]]]}, features=feats)
    with Catalog.build(tmp_path / "c", hf) as cat:
        got = cat[0]["a"]
    assert got.dtype == np.int8 and got.tolist() == hf[0]["a"]  # (HF's numpy format: int64)


def test_a_ragged_or_null_nested_row_is_refused_naming_the_field(tmp_path):
    from tensortier.errors import RecordTypeError

    ragged = pa.table({"x": pa.array([[[1], [2]], [[1], [2, 3]]], pa.list_(pa.list_(pa.int8())))})
    with pytest.raises(RecordTypeError, match="record 1 cannot be stored: field 'x' is a ragged"):
        Catalog.build(tmp_path / "r", ragged)
    nulls = pa.table({"x": pa.array([[[1, None]]], pa.list_(pa.list_(pa.int8())))})
    with pytest.raises(RecordTypeError, match="field 'x' is a list holding a null"):
        Catalog.build(tmp_path / "n", nulls)
