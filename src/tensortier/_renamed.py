"""Keyword arguments renamed by the one vocabulary (README "Vocabulary"), still accepted for 0.1.

Scripts written against the first names keep running: the old keyword is mapped to the new one
with a ``DeprecationWarning`` that names the new one; passing both is a ``TypeError``. The old
names go in 0.2. One decorator, so every public entry point renames the same way.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

# The offload verbs' old names (``tt.offload``, ``Offloader``, ``offload``, ``offload_module``):
# one table, so the four entry points accept exactly the same ones.
OFFLOAD_RENAMES = {
    "to": "tier",
    "disk_capacity": "disk_budget",
    "max_inflight": "inflight_budget",
    "prefetch": "prefetch_budget",
    "disk_io_threads": "io_threads",
}


def renamed(**old_to_new: str) -> Callable[[F], F]:
    """``@renamed(to="tier", disk_capacity="disk_budget")`` on a function or ``__init__``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            for old, new in old_to_new.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(
                        f"{fn.__qualname__}() got both {old}= and {new}=: pass only {new}= "
                        f"({old}= is its old name)"
                    )
                warnings.warn(
                    f"{fn.__qualname__}(): {old}= is now {new}= (the old name goes in 0.2)",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        inner.__renamed__ = dict(old_to_new)  # type: ignore[attr-defined]
        return inner  # type: ignore[return-value]

    return wrap


def renamed_attribute(old: str, new: str) -> property:
    """``path = renamed_attribute("path", "directory")`` in a class body: reading ``obj.path``
    returns ``obj.directory`` with a ``DeprecationWarning`` that names the new attribute."""

    def get(self):
        warnings.warn(
            f"{type(self).__name__}.{old} is now .{new} (the old name goes in 0.2)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(self, new)

    return property(get, doc=f"Deprecated: the old name of ``{new}``.")
