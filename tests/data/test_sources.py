"""Building from Hugging Face datasets, Arrow tables and lists of numbers (``_sources.py``)."""

import numpy as np
import pytest

from tensortier.data import Catalog

# optional: the GPU machine's image has neither, and the tests of lists of numbers still run there
try:
    import datasets
except ImportError:
    datasets = None
try:
    import pyarrow as pa
except ImportError:
    pa = None
needs_hf = pytest.mark.skipif(datasets is None, reason="needs Hugging Face datasets")
needs_arrow = pytest.mark.skipif(pa is None, reason="needs pyarrow")


def hf_rows(ds) -> list[dict]:
    """What a user gets from the dataset row by row, its lists as the arrays the catalog stores:
    of the column's Arrow type (``datasets`` stores ``input_ids`` as int32; an empty list too)."""
    schema = ds.features.arrow_schema
    dtypes = {
        f.name: np.dtype(f.type.value_type.to_pandas_dtype())
        for f in schema
        if pa.types.is_list(f.type)
    }
    return [{k: np.asarray(v, dtypes[k]) if k in dtypes else v for k, v in r.items()} for r in ds]


def equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)):
                return False
            if x.shape != y.shape or x.tobytes() != y.tobytes():
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


@pytest.fixture(scope="module")
def hf():
    rng = np.random.default_rng(0)
    n = 3000
    return datasets.Dataset.from_dict(
        {
            "input_ids": [
                rng.integers(0, 50_000, int(rng.integers(0, 40))).tolist() for _ in range(n)
            ],
            "text": [f"row {i} " + "é" * (i % 7) for i in range(n)],
            "label": [int(i % 5) for i in range(n)],
            "score": [float(i) / 3 for i in range(n)],
            "keep": [bool(i % 2) for i in range(n)],
            "raw": [bytes([i % 256]) * (i % 9) for i in range(n)],
        }
    )


@needs_hf
def test_a_hugging_face_dataset_is_stored_row_for_row_from_its_arrow_columns(
    tmp_path, hf, monkeypatch
):
    from datasets.formatting import formatting

    def no_python_rows(*a, **k):  # the slow row-by-row path must not be taken
        raise AssertionError("Python formatting of rows was used")

    want = hf_rows(hf)
    for name in ("format_row", "format_batch"):
        monkeypatch.setattr(formatting.PythonFormatter, name, no_python_rows)
    cat = Catalog.build(tmp_path / "c", hf)
    monkeypatch.undo()
    assert len(cat) == len(hf)
    got = cat[:]
    assert all(equal(g, w) for g, w in zip(got, want))
    assert got[1]["input_ids"].dtype == np.int32  # Arrow's type kept (datasets made it int32)


@needs_hf
def test_a_shuffled_and_selected_dataset_is_stored_in_its_own_order(tmp_path, hf):
    sub = hf.shuffle(seed=1).select(range(100, 400))
    cat = Catalog.build(tmp_path / "c", sub)
    assert all(equal(g, w) for g, w in zip(cat[:], hf_rows(sub)))


@needs_hf
def test_an_iterable_dataset_is_read_as_arrow_too(tmp_path, hf):
    it = hf.to_iterable_dataset(num_shards=2)
    cat = Catalog.build(tmp_path / "c", it)
    assert all(equal(g, w) for g, w in zip(cat[:], hf_rows(hf)))


@needs_hf
def test_a_datasets_format_columns_are_kept_and_a_transform_is_refused(tmp_path, hf):
    # what ds[i] gives: with_format(columns=) selects columns; with_transform would be skipped
    # by the Arrow read, so it is refused (apply it with map) instead of silently not applied
    from tensortier.errors import ConfigError

    picked = hf.with_format("torch", columns=["label"])
    cat = Catalog.build(tmp_path / "c", picked)
    assert [set(r) for r in cat[:3]] == [{"label"}] * 3
    assert [r["label"] for r in cat[:]] == [int(r["label"]) for r in picked]
    tokens = hf.with_transform(lambda b: {"n": [x * 2 for x in b["label"]]})
    with pytest.raises(ConfigError, match="with_transform.*ds.map"):
        Catalog.build(tmp_path / "d", tokens)
    assert not (tmp_path / "d").exists()


@needs_hf
def test_a_dataset_dict_of_splits_is_refused_naming_them(tmp_path, hf):
    # load_dataset(name) without split= gives a DatasetDict: say which splits, before any file
    from tensortier.errors import ConfigError

    splits = datasets.DatasetDict({"train": hf, "test": hf.select(range(3))})
    for dd in (splits, datasets.IterableDatasetDict({"train": hf.to_iterable_dataset()})):
        with pytest.raises(ConfigError, match=r"of splits \['train'.*ds\['train'\]"):
            Catalog.build(tmp_path / "c", dd)
        assert not (tmp_path / "c").exists()


@needs_arrow
def test_arrow_tables_structs_fixed_lists_dictionaries_and_sliced_lists(tmp_path):
    ids = pa.array([[1, 2, 3], [], [4], [5, 6]], pa.list_(pa.int32())).slice(1, 3)
    table = pa.table(
        {
            "ids": ids,
            "xy": pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], pa.list_(pa.float32(), 2)),
            "image": pa.array(
                [{"bytes": b"png1", "path": "a.png"}, {"bytes": b"", "path": "b.png"}] * 1
                + [{"bytes": b"png3", "path": "c.png"}]
            ),
            "tag": pa.array(["cat", "dog", "cat"]).dictionary_encode(),
            "grid": pa.array([[[1, 2], [3, 4]], [[5, 6], [7, 8]], [[9, 9], [9, 9]]]),
        }
    )
    cat = Catalog.build(tmp_path / "c", table)
    rows = cat[:]
    assert [r["ids"].tolist() for r in rows] == [[], [4], [5, 6]]
    assert rows[2]["ids"].dtype == np.int32
    assert rows[1]["xy"].tolist() == [3.0, 4.0] and rows[1]["xy"].dtype == np.float32
    assert [r["image.bytes"] for r in rows] == [b"png1", b"", b"png3"]
    assert [r["image.path"] for r in rows] == ["a.png", "b.png", "c.png"]
    assert [r["tag"] for r in rows] == ["cat", "dog", "cat"]
    assert rows[1]["grid"].tolist() == [[5, 6], [7, 8]] and rows[1]["grid"].shape == (2, 2)
    batch = table.to_batches()[0]
    assert all(
        equal(a, b) for a, b in zip(Catalog.build(tmp_path / "b", batch)[:], rows)
    )  # a RecordBatch too


@needs_arrow
def test_nulls_are_refused_naming_the_record_and_the_field(tmp_path):
    table = pa.table({"a": [1, 2, None], "b": ["x", "y", "z"]})
    with pytest.raises(TypeError, match=r"record 2 cannot be stored: field 'a' is null"):
        Catalog.build(tmp_path / "c", table)
    assert not (tmp_path / "c").exists()


def test_lists_of_numbers_are_stored_as_arrays(tmp_path):
    recs = [[1, 2, 3], (0.5, 1.5), [[1, 2], [3, 4]], [True, False], {"ids": [7, 8], "t": "x"}]
    got = Catalog.build(tmp_path / "c", recs)[:]
    want = [np.asarray(r) for r in recs[:4]] + [{"ids": np.array([7, 8]), "t": "x"}]
    for g, w in zip(got[:4], want[:4]):
        assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes()
    assert equal(got[4], want[4])


@pytest.mark.parametrize(
    "bad,match",
    [
        ([[1, 2], [3]], "ragged"),
        (["a", "b"], "not all numbers"),
        ({"x": [1, "a"]}, "field 'x' is a list that is not all numbers"),
        ({"x": None}, "field 'x' is null"),
        ([2**70], "not all numbers"),
    ],
)
def test_lists_that_are_not_arrays_are_refused_naming_the_record(tmp_path, bad, match):
    with pytest.raises(TypeError, match=rf"record 1 cannot be stored: .*{match}"):
        Catalog.build(tmp_path / "c", [b"ok", bad])
    assert not (tmp_path / "c").exists()


def test_any_mapping_is_a_dict_record_with_its_lists_as_arrays(tmp_path):
    """An ``OrderedDict`` or ``defaultdict`` record holding a list of numbers was refused
    ("cannot store list") where the same plain dict was stored: only ``type(rec) is dict``
    had its lists made arrays."""
    import collections
    import types

    recs = [
        collections.OrderedDict(ids=[1, 2], t="x"),
        collections.defaultdict(list, ids=[3], t="y"),
        types.MappingProxyType({"ids": [4, 5, 6], "t": "z"}),
    ]
    got = Catalog.build(tmp_path / "c", recs)[:]
    for g, r in zip(got, recs, strict=True):
        assert equal(g, {"ids": np.asarray(r["ids"]), "t": r["t"]})
