"""Random-number-generator states: captured at save, validated before restore touches anything.

A checkpoint holds the torch CPU, numpy, Python and (when initialised) CUDA generator states. A
restore first checks each state by loading it into a throwaway generator of the same kind, so a
malformed state is found before the model, optimizer or any global generator is modified.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch

from tensortier.errors import CorruptDataError


def rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def check_rng_state(state: object) -> None:
    """Raise :class:`CorruptDataError` unless ``state`` can be applied by :func:`set_rng_state`."""
    if not isinstance(state, dict):
        raise CorruptDataError(f"RNG state is a {type(state).__name__}, not a mapping")
    unknown = set(state) - {"torch", "numpy", "python", "cuda"}
    if unknown:
        raise CorruptDataError(f"unknown RNG streams {sorted(map(str, unknown))} in manifest")
    for name in ("torch", "numpy", "python"):
        if name not in state:
            raise CorruptDataError(f"manifest lacks the {name} RNG state")
    try:
        _check_torch(state["torch"], "torch")
        np.random.RandomState().set_state(state["numpy"])
        random.Random().setstate(state["python"])
    except (TypeError, ValueError, RuntimeError, OverflowError, IndexError, KeyError) as exc:
        raise CorruptDataError(f"malformed RNG state in manifest: {exc}") from exc
    cuda = state.get("cuda")
    if cuda is not None:
        if not isinstance(cuda, list):
            raise CorruptDataError("CUDA RNG states in manifest are not a list")
        for i, t in enumerate(cuda):
            _check_torch(t, f"cuda:{i}")


def _check_torch(t: object, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise CorruptDataError(f"the {name} RNG state in manifest is not a 1-D uint8 tensor")
    if name == "torch":
        torch.Generator().set_state(t)  # checks the size and content like torch.set_rng_state
    elif torch.cuda.is_available():
        index = int(name.split(":")[1])
        if index < torch.cuda.device_count():
            expected = torch.cuda.get_rng_state(index).numel()
            if t.numel() != expected:
                raise CorruptDataError(
                    f"the {name} RNG state in manifest has {t.numel()} bytes, not {expected}"
                )


def set_rng_state(state: dict) -> None:
    """Apply a state that passed :func:`check_rng_state`."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda is not None:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all(cuda)
        else:
            warnings.warn(
                f"the checkpoint holds RNG states of {len(cuda)} CUDA devices but this process "
                f"sees {torch.cuda.device_count() if torch.cuda.is_available() else 0}; CUDA "
                f"random streams are not restored, so the resumed run may differ",
                stacklevel=4,
            )
