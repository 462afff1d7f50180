"""The end of one backward, as the parameters' post-accumulate-grad hooks can see it.

Why its own module: eager autograd and compiled autograd (``torch._dynamo.compiled_autograd``,
torchtitan's option) end a backward differently. Eager, a hook can queue an autograd final
callback, which engine.cpp runs once the whole graph task is done. Under compiled autograd
(torch 2.13), dynamo refuses to trace ``queue_callback`` from a hook ("only supported when
Compiled Autograd is enabled with fullgraph=True"), and a callback queued from a hook that runs
eagerly is accepted but never run. There the end is the last of the parameters' gradients
accumulated, which the hooks can count.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch


def in_compiled_autograd() -> bool:
    """Whether compiled autograd is running the backward now (free when dynamo is not loaded)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(ca is not None and ca.in_compiled_autograd_region)


def eager(hook: Callable) -> Callable:
    """``hook``, run eagerly where compiled autograd traces hooks with dynamo: the bookkeeping
    in tensortier's hooks (clocks, locks, meters) is host code, not part of the graph. Imports
    dynamo once (about 0.8 s)."""
    return torch.compiler.disable(hook)


class BackwardEnd:
    """Calls ``fn`` once, when the backward that accumulates ``n`` parameters' gradients ends.

    Call :meth:`accumulated` from each of those parameters' post-accumulate-grad hooks. Eager
    autograd: the first call queues ``fn`` as a final callback. Under compiled autograd: the
    ``n``-th call runs ``fn`` (the hooks run in the compiled graph's order, the last one after
    every parameter gradient). A backward that reaches only some of them does not end here
    (``ended`` stays False): the owner's next call reads what ``fn`` would have, as it does when
    no backward ran, and arms the next backward with :meth:`learned` (the gradients this one
    reached: a model with unused parameters).
    """

    def __init__(self, n: int, fn: Callable[[], None]):
        self.n, self.fn = n, fn
        self.ended = False  # fn ran, or is queued to run when the backward ends
        self.seen = 0  # gradients accumulated under compiled autograd

    def accumulated(self) -> None:
        if self.ended:
            return
        if in_compiled_autograd():
            self.seen += 1
            if self.seen >= self.n:
                self.ended = True
                self.fn()
            return
        self.ended = True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.fn)
        except RuntimeError:  # not inside a backward after all: the owner's next call reads it
            pass

    def learned(self) -> int:
        """The ``n`` for the next backward: what this one reached if it did not end here."""
        return self.seen if not self.ended and self.seen else self.n
