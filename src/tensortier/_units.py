"""Sizes written by people ("512MiB", "4GiB", "1.5GB") turned into bytes, and back.

This is the only place that parses a size; every budget, capacity and threshold goes through it
so that a typo is caught once, with one message that lists the accepted forms. Counts (threads,
items, steps, seeds) go through :func:`check_int`, which refuses a bool where an int belongs;
index arguments (an int, a sequence, an array or a tensor of ints) through :func:`index_array`.
Rows of numbers go back to people as a plain-text table (:func:`print_table`, used by
``tensortier plan`` and the benchmarks).
"""

from __future__ import annotations

import math
import re

import numpy as np

from tensortier.errors import ConfigError

_BINARY = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}
_DECIMAL = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
_UNITS = {**_BINARY, **_DECIMAL}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")

ACCEPTED = (
    "an integer number of bytes (e.g. 1048576) or a number followed by a unit: "
    "B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000), "
    "e.g. '512MiB', '4GiB', '1.5GB'"
)

SizeLike = int | str


def parse_size(value: SizeLike, *, name: str = "size", allow_zero: bool = True) -> int:
    """Return ``value`` in bytes. Raises :class:`ConfigError` naming ``name`` and the accepted forms.

    Units are case-insensitive but must be spelled out: a bare "G" or "4 gigs" is ambiguous
    (GiB or GB?) and is refused rather than guessed.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}: got {value!r}; expected {ACCEPTED}")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ConfigError(
                f"{name}: got {value!r}; a float must be a whole number of bytes. "
                f"Expected {ACCEPTED}"
            )
        nbytes = int(value)
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if match is None:
            raise ConfigError(f"{name}: cannot parse {value!r}; expected {ACCEPTED}")
        number, unit = match.group(1), match.group(2).lower()
        if unit == "":
            if "." in number:
                raise ConfigError(
                    f"{name}: {value!r} has a fraction but no unit; expected {ACCEPTED}"
                )
            nbytes = int(number)
        elif unit in _UNITS:
            nbytes = int(float(number) * _UNITS[unit])
        else:
            raise ConfigError(
                f"{name}: unknown or ambiguous unit {match.group(2)!r} in {value!r}; "
                f"expected {ACCEPTED}"
            )
    else:
        raise ConfigError(f"{name}: got {type(value).__name__} {value!r}; expected {ACCEPTED}")
    if nbytes < 0:
        raise ConfigError(f"{name}: got {value!r}, a negative size; sizes are >= 0 bytes")
    if nbytes == 0 and not allow_zero:
        raise ConfigError(f"{name}: got {value!r}; it must be larger than 0 bytes")
    return nbytes


def is_int(value: object, *, numpy: bool = False) -> bool:
    """An ``int`` (or, with ``numpy=True``, a numpy integer too), and not a bool: ``True`` is an
    ``int`` to Python, so a flag passed where a count belongs would otherwise count as 1."""
    kinds = (int, np.integer) if numpy else int
    return isinstance(value, kinds) and not isinstance(value, bool)


def check_int(
    value: object,
    message: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    numpy: bool = False,
    error: type[Exception] = ConfigError,
) -> int:
    """``int(value)`` when :func:`is_int` (``numpy``: numpy integers too) and within
    ``[minimum, maximum]``; else raises ``error(message)``. The message is the caller's own
    sentence: it names the argument, the value received and the fix, in the words of the API it
    belongs to."""
    if not is_int(value, numpy=numpy):
        raise error(message)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise error(message)
    return int(value)


def index_array(indices: object, message: str, *, copy: bool = False) -> np.ndarray:
    """``indices`` (an int, a sequence, an array or a tensor of ints) as a 1-D int64 array, a
    copy only where needed (``copy=True``: always, for a caller that edits it). Anything else is a
    ``TypeError``: ``message`` (the caller's words for what an index is) with the dtype and shape
    received appended."""
    if hasattr(indices, "detach"):
        indices = indices.detach().cpu().numpy()  # type: ignore[union-attr]
    arr = np.asarray(indices)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise TypeError(f"{message}, got {arr.dtype} {arr.shape}")
    return arr.astype(np.int64, copy=copy)


def format_size(nbytes: float) -> str:
    """Human-readable binary size: 1536 -> '1.5KiB'."""
    sign = "-" if nbytes < 0 else ""
    value = float(abs(nbytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            # three significant digits, never an exponent: "{:.3g}" gave "1e+03KiB" for
            # 1000-1023 KiB, which parse_size cannot read back
            decimals = 0 if unit == "B" else max(0, 3 - len(str(int(value))))
            text = f"{value:.{decimals}f}"
            if decimals:
                text = text.rstrip("0").rstrip(".")
            return f"{sign}{text}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_size_up(nbytes: int) -> str:
    """:func:`format_size` rounded up, for a size printed as a minimum: "at least 1.04GiB" must
    be enough when passed back (``parse_size`` of it is ``>= nbytes``)."""
    if nbytes < 1024:
        return f"{max(0, int(nbytes))}B"
    scale, unit = 1024, "KiB"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 * scale or unit == "TiB":
            break
        scale *= 1024
    decimals = max(0, 3 - len(str(nbytes // scale)))  # three significant digits
    q = 10**decimals
    up = math.ceil(round(nbytes / scale * q, 6)) / q
    if int(up * scale) < nbytes:  # the float rounding went below: one more step
        up += 1 / q
    text = f"{up:.{decimals}f}"
    return (text.rstrip("0").rstrip(".") if decimals else text) + unit


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Print ``rows`` as left-aligned columns under a header; floats with three digits."""

    def fmt(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
