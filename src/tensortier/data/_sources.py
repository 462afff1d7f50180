"""What a catalog is built from besides an iterable of records: Arrow tables, lists, files.

- Arrow. A Hugging Face ``datasets.Dataset`` or ``IterableDataset`` (read with the ``"arrow"``
  format, so a ``select``/``shuffle``'s indices mapping is honoured) and a ``pyarrow.Table`` or
  ``RecordBatch`` are read a batch of rows at a time, column by column: numbers and strings
  through Arrow's own conversion, a list-of-numbers column as numpy views of the column's values
  (one per row, the Arrow dtype kept: int32 token ids stay int32; nested lists, list views, HF
  ``Array2D``..``5D`` and fixed-shape tensors as arrays of their numbers' dtype), struct columns
  flattened to ``"outer.inner"`` keys (an HF ``Image`` column gives ``image.bytes`` and ``image.path``).
  Never the row-by-row Python formatting of ``datasets`` (``ds[i]``, ``iter(ds)``).
- Lists. A record, or a field of a dict record, that is a list or tuple of numbers (nested lists
  rectangular) is stored as ``np.asarray`` of it (int64, float64 or bool): :func:`coerce`.
- Files (``tensortier catalog build``): text lines, JSON lines, Parquet (through Arrow), and
  ``.npy`` files. Bad input is a :class:`ConfigError` naming the file, the line or the pattern.

pyarrow is optional (``pip install 'tensortier[catalog]'``; ``datasets`` brings it too): only
the Parquet path imports it, and Arrow objects come with it already imported.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from tensortier.errors import ConfigError

ARROW_BATCH = 4096  # rows converted at a time
EXTRA = "pip install 'tensortier[catalog]'"


def pyarrow() -> Any:
    """The ``pyarrow`` module, or an ImportError naming the extra that installs it."""
    try:
        import pyarrow
    except ImportError as exc:
        raise ImportError(
            f"reading Parquet into a catalog needs pyarrow: {EXTRA} (or pip install pyarrow)"
        ) from exc
    return pyarrow


# --------------------------------------------------------------------------- records in Python
def coerce(rec: Any) -> Any:
    """``rec`` with its lists of numbers as numpy arrays; TypeError naming what cannot be stored.
    Any mapping (``OrderedDict``, ``defaultdict``) is a dict record, as it is to the codec."""
    if isinstance(rec, Mapping):
        return {k: _value(v, f"field {k!r}") for k, v in rec.items()}
    return _value(rec, "the record")


def _value(v: Any, where: str) -> Any:
    if v is None:
        raise TypeError(f"{where} is null (None); fill or drop nulls before building")
    if not isinstance(v, (list, tuple)):
        return v
    try:
        arr = np.asarray(v)
    except ValueError as exc:
        raise TypeError(
            f"{where} is a ragged nested list ({exc}); store one array per row, or pad the rows"
        ) from exc
    if arr.dtype.kind == "O" and _holds_none(v):
        raise TypeError(
            f"{where} is a list holding a null (None); fill or drop nulls before building"
        )
    if arr.dtype.kind not in "biuf":
        raise TypeError(
            f"{where} is a list that is not all numbers (numpy makes it {arr.dtype}); a list of "
            f"numbers becomes an array, other lists cannot be stored (join strings into one str)"
        )
    return arr


def _holds_none(v: Any) -> bool:
    return any(x is None or (isinstance(x, (list, tuple)) and _holds_none(x)) for x in v)


# --------------------------------------------------------------------------- Arrow
def _is_arrow(obj: Any) -> bool:
    return type(obj).__module__.startswith("pyarrow") and type(obj).__name__ in (
        "Table",
        "RecordBatch",
    )


def _is_hf(obj: Any) -> bool:
    return type(obj).__module__.startswith("datasets.") and hasattr(obj, "with_format")


def source(records: Any) -> tuple[Any, int | None]:
    """(iterable of records, number of records or None) for what ``Catalog.build`` was given."""
    if _is_hf(records) and isinstance(records, Mapping):  # what load_dataset gives without split=
        raise ConfigError(
            f"Catalog.build: records is a {type(records).__name__} of splits {list(records)}; "
            f"build a catalog of one split: Catalog.build(directory, ds[{next(iter(records), 'train')!r}])"
        )
    if _is_hf(records):
        batches = _hf_arrow(records).iter(batch_size=ARROW_BATCH)
        total = records.num_rows if hasattr(records, "num_rows") else None
        return arrow_rows(batches), total
    if _is_arrow(records):
        if type(records).__name__ == "RecordBatch":
            return arrow_rows([records]), records.num_rows
        return arrow_rows(records.to_batches(max_chunksize=ARROW_BATCH)), records.num_rows
    return records, len(records) if hasattr(records, "__len__") else None


def _hf_arrow(ds: Any) -> Any:
    """``ds`` formatted as Arrow, keeping the columns its format selects (``with_format(...,
    columns=)``); a ``with_transform`` is refused, as the Arrow columns would skip it."""
    fmt = getattr(ds, "format", None)  # a Dataset's; an IterableDataset selects no columns
    if not isinstance(fmt, dict):
        return ds.with_format("arrow")
    if fmt.get("type") == "custom":
        raise ConfigError(
            f"Catalog.build: the dataset has a transform (with_transform or set_transform: "
            f"{fmt.get('format_kwargs', {}).get('transform')!r}) that the catalog would skip, "
            f"storing the columns it reads from Arrow instead; apply it with ds.map(fn, "
            f"batched=True) first, or drop it with ds.with_format(None)"
        )
    return ds.with_format(
        "arrow", columns=fmt.get("columns"), output_all_columns=fmt.get("output_all_columns", False)
    )


def arrow_rows(batches: Iterable) -> Iterator[dict]:
    """One dict per row of Arrow tables or record batches, converted a column at a time."""
    import pyarrow as pa  # present: these batches are Arrow objects

    for b in batches:
        table = b if isinstance(b, pa.Table) else pa.Table.from_batches([b])
        while any(pa.types.is_struct(f.type) for f in table.schema):
            table = table.flatten()  # one level per pass: "image" -> "image.bytes", ...
        names = table.column_names
        cols = []
        for col in table.columns:
            values: list = []
            for chunk in col.chunks:
                values += _column(pa, chunk)
            cols.append(values)
        for row in zip(*cols):
            yield dict(zip(names, row))


def _column(pa: Any, arr: Any) -> list:
    """The values of one Arrow array, one per row, as the catalog stores them."""
    t = arr.type
    if isinstance(t, pa.FixedShapeTensorType):
        return list(arr.to_numpy_ndarray())  # (rows, *shape) of the tensor's dtype
    if isinstance(t, pa.ExtensionType):  # an HF Array2D..5D: nested lists of its dtype
        arr = arr.storage
        t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    if arr.null_count:
        return arr.to_pylist()  # None is refused by coerce, naming the field
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return arr.to_numpy(zero_copy_only=False).tolist()
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        v = t.value_type
        if pa.types.is_integer(v) or pa.types.is_floating(v) or pa.types.is_boolean(v):
            flat = arr.flatten()
            if not flat.null_count:
                values = flat.to_numpy(zero_copy_only=False)
                if pa.types.is_fixed_size_list(t):
                    return list(values.reshape(len(arr), t.list_size))
                offsets = np.asarray(arr.offsets)
                return np.split(values, (offsets[1:-1] - offsets[0]).tolist())
    leaf = _leaf_dtype(pa, t)
    if leaf is not None:  # nested lists (list views too) of numbers: arrays of the leaf's dtype
        return [_rows_array(row, leaf) for row in arr.to_pylist()]
    if pa.types.is_temporal(t):
        return list(arr.to_numpy(zero_copy_only=False))  # datetime64 / timedelta64 scalars
    return arr.to_pylist()  # str, bytes; anything else is refused by the codec, naming it


def _leaf_dtype(pa: Any, t: Any) -> np.dtype | None:
    """The numpy dtype of the numbers inside list type ``t`` (any depth), None if not numbers."""
    nested = (
        pa.types.is_list,
        pa.types.is_large_list,
        pa.types.is_fixed_size_list,
        pa.types.is_list_view,
        pa.types.is_large_list_view,
    )
    if not any(f(t) for f in nested):
        return None
    while any(f(t) for f in nested):
        t = t.value_type
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return np.dtype(t.to_pandas_dtype())
    return None


def _rows_array(row: Any, dtype: np.dtype) -> Any:
    """One row of a nested list column as an array of the column's dtype; a ragged row or one
    holding a null stays a list, which :func:`coerce` refuses naming the field."""
    try:
        return np.asarray(row, dtype=dtype)
    except (ValueError, TypeError):
        return row


# --------------------------------------------------------------------------- files (CLI)
def _decode(raw: bytes, name: str, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"line {lineno} of {name} is not UTF-8 (byte {raw[exc.start]:#04x} at column "
            f"{exc.start + 1}); convert the file to UTF-8 (e.g. iconv -t utf-8), or store the raw "
            f"bytes with --files"
        ) from None


def _binary_lines(path: str) -> Iterator[tuple[int, bytes]]:
    f = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    try:
        for lineno, raw in enumerate(f, 1):
            yield lineno, raw.rstrip(b"\n").removesuffix(b"\r")
    finally:
        if path != "-":
            f.close()


def lines(path: str) -> Iterator[str]:
    """One str per line of a UTF-8 text file (``-``: stdin), without its newline."""
    name = "stdin" if path == "-" else path
    for lineno, raw in _binary_lines(path):
        yield _decode(raw, name, lineno)


def jsonl(path: str) -> Iterator[Any]:
    """One record per non-blank line of a JSON-lines file: an object becomes a dict record."""
    name = "stdin" if path == "-" else path
    for lineno, raw in _binary_lines(path):
        text = _decode(raw, name, lineno)
        if not text.strip():
            continue
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"line {lineno} of {name} is not JSON ({exc})") from None
        if isinstance(value, dict) and any(isinstance(v, dict) for v in value.values()):
            key = next(k for k, v in value.items() if isinstance(v, dict))
            raise ConfigError(
                f"line {lineno} of {name}: field {key!r} is a nested object; a record's fields "
                f"are str, numbers, bools or lists of numbers (flatten it, e.g. 'outer.inner')"
            )
        try:
            yield coerce(value)
        except TypeError as exc:
            raise ConfigError(f"line {lineno} of {name}: {exc}") from None


def expand(patterns: list[str], what: str) -> list[str]:
    """The files each glob pattern matches (``**`` recurses); ConfigError naming one with none."""
    out = []
    for pattern in patterns:
        names = [n for n in sorted(glob.glob(pattern, recursive=True)) if os.path.isfile(n)]
        if not names:
            raise ConfigError(
                f"{what} {pattern!r} matches no file; check the path (quote the pattern so the "
                f"shell does not expand it, '**' recurses)"
            )
        out += names
    return out


def files(names: list[str]) -> Iterator[dict]:
    """One ``{"path": str, "data": bytes}`` per file."""
    for name in names:
        with open(name, "rb") as f:
            yield {"path": name, "data": f.read()}


def parquet(names: list[str]) -> tuple[Iterator[dict], int]:
    """(one dict per row of the Parquet files, their total rows)."""
    pa = pyarrow()
    import pyarrow.parquet as pq

    try:
        handles = [pq.ParquetFile(n) for n in names]
    except (OSError, pa.ArrowException) as exc:
        raise ConfigError(f"cannot read Parquet: {exc}") from exc
    total = sum(h.metadata.num_rows for h in handles)

    def rows() -> Iterator[dict]:
        for h in handles:
            yield from arrow_rows(h.iter_batches(batch_size=ARROW_BATCH))

    return rows(), total


def npy(path: str) -> tuple[Iterator, int]:
    """(records, count) of ``.npy`` input: a folder gives ``{"path", "data"}`` per file (sorted by
    name); one file gives one array per row (read through a memory map)."""
    if os.path.isfile(path):
        arr = _load(path, mmap_mode="r")
        if arr.ndim == 0:
            raise ConfigError(
                f"--npy {path!r} holds a scalar; pass an array whose rows are records"
            )
        return (np.asarray(arr[i]) for i in range(len(arr))), len(arr)
    if not os.path.isdir(path):
        raise ConfigError(f"--npy {path!r} is neither a folder of .npy files nor a .npy file")
    names = sorted(glob.glob(os.path.join(glob.escape(path), "*.npy")))
    if not names:
        raise ConfigError(f"--npy {path!r}: the folder holds no .npy file")
    return ({"path": n, "data": _load(n)} for n in names), len(names)


def _load(name: str, mmap_mode: str | None = None) -> np.ndarray:
    try:
        return np.load(name, mmap_mode=mmap_mode, allow_pickle=False)
    except (OSError, ValueError) as exc:  # object arrays need pickle: refused
        raise ConfigError(f"cannot read {name!r} as a .npy array ({exc})") from exc
