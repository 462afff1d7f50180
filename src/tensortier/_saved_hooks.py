"""Saved-tensor hooks that compose: ours shadow the hooks around them, so what ours do not
handle is handed on to those (only the innermost pair of ``saved_tensors_hooks`` runs).

Two clients nest: ``stream_parameters`` (parameters saved as tokens, reloaded in backward) and
the activation offloader (``tt.offload``, ``offload_module``). Either may be inside the other, and
each used to swallow what the outer one had to see: ``tt.offload`` around a streamed model
offloaded nothing, and ``offload_module`` inside one saved the streamed parameters by reference,
so backward read their NaN placeholders. This module owns the hand-over, never a policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# attribute set on a streamed Parameter: a weakref to its streamer (one streamer per parameter)
STREAMED_ATTR = "_tensortier_streamer"


@dataclass(frozen=True)
class Outer:
    """A saved tensor packed by the hooks that were around ours."""

    packed: Any
    unpack: Any


def outer_hooks() -> tuple | None:
    """The (pack, unpack) pair in effect now, to call before pushing ours; ``None`` if none."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def pack_outer(hooks: tuple, t: torch.Tensor) -> Outer:
    return Outer(hooks[0](t), hooks[1])


def is_streamed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter ``stream_parameters`` swaps placeholders into between uses
    (saving it by reference keeps the Parameter, whose values are gone by backward)."""
    owner = getattr(t, STREAMED_ATTR, None)
    return owner is not None and owner() is not None


def of_streamed(t: torch.Tensor) -> bool:
    """Whether saving ``t`` must go to the streamer: a streamed parameter or a view of one
    (``nn.Linear`` saves ``weight.t()``; kept or offloaded, its values stayed alive or were
    copied until backward, beyond the streaming budget)."""
    return is_streamed(t) or (t._base is not None and is_streamed(t._base))
