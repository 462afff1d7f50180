"""The plan cache (``tt.offload(budget=..., plan_cache=DIR)``): keys, reading and writing.

A profile and its plan are stored as JSON (never pickle), one file per key: the model's
structure, the inputs' shape bucket and dtypes, the budget and the settings (:func:`cache_key`).
A file is written atomically (temporary file, then rename), so a reader never sees half a plan.
The cache is an optimization, never a failure: a file that cannot be read is warned about and
the model is profiled again; a directory that cannot be written is warned about once and plans
stay in memory. Who reads and writes it (rank 0 alone) is the runtime's business.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile

import torch
from torch import nn

from tensortier import _dist
from tensortier.planner.buckets import bucket
from tensortier.planner.config import PlanConfig
from tensortier.planner.policies import Choice, Options
from tensortier.planner.profile import FORMAT, Profile
from tensortier.planner.simulator import Plan

log = logging.getLogger(__name__)
# 2: stop 37's profiler marks a unit that writes its inputs in place not recomputable; plans
# cached before it may recompute one (wrong gradients), so they are profiled again
# 3: stop 38's also a unit whose input view is written through another view of its base, one
# whose input passed by keyword is written, and one whose forward changes a buffer
CACHE_FORMAT = 3


def model_signature(root: nn.Module) -> str:
    """Hash of what a profile depends on in the model: module types and names, parameter
    shapes, dtypes and whether they train."""
    h = hashlib.sha256()
    for name, m in root.named_modules():
        h.update(f"{name}:{type(m).__qualname__};".encode())
    for name, p in root.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    return h.hexdigest()[:32]


def cache_key(config: PlanConfig, device: torch.device, signature: str, shapes: list) -> dict:
    """What a cached plan is valid for; any difference means profiling again."""
    opts = config.options or Options()
    return {
        "format": CACHE_FORMAT,
        "profile_format": FORMAT,
        "model": signature,
        "inputs": [[[bucket(d) for d in shape], dtype] for shape, dtype in shapes],
        "budget": config.budget,
        "policy": config.policy,
        "tier": config.tier,
        "remote": config.remote is not None,  # a plan made with a pool needs one, and vice versa
        "device": str(device.type),
        "world": _dist.world(),  # per-rank inputs and FSDP shards depend on it
        "torch": torch.__version__,
        "options": {
            "tiers": list(opts.tiers),
            "allow_lossy": opts.allow_lossy,
            "fine": opts.fine,
            "margin": opts.margin,
            "seed": opts.seed,
        },
    }


def _key_file(directory: str, key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(directory, f"plan-{digest}.json")


def load_cached(directory: str, key: dict) -> tuple[Profile, Plan, dict] | None:
    """The cached profile and plan for ``key``, or None (absent, another key, unreadable)."""
    path = _key_file(directory, key)
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("key") != key:
            return None
        return Profile.from_dict(data["profile"]), Plan.from_dict(data["plan"]), data
    except FileNotFoundError:
        return None
    except Exception as exc:  # damaged or from another version: profile again, say why
        log.warning("tensortier plan cache %s unusable (%s): profiling again", path, exc)
        return None


def save_cached(
    directory: str, key: dict, profile: Profile, choice: Choice, shapes, overhead: int = 0
) -> str | None:
    """Write atomically (temporary file, then rename): a reader never sees half a plan.

    The cache is an optimization: a directory that cannot be written (read-only, shared, full,
    a path under a file) gets one warning and the plan stays in memory; training goes on.
    Returns the file written, or None."""
    path = _key_file(directory, key)
    data = {
        "key": key,
        "shapes": shapes,
        "overhead_bytes": overhead,
        "profile": profile.to_dict(),
        "plan": choice.plan.to_dict(),
        "predicted": choice.result.summary(),
    }
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".plan-", suffix=".tmp")
    except OSError as exc:
        _unwritable(directory, exc)
        return None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # already gone, or the directory went read-only: nothing more to clean
        if not isinstance(exc, OSError):
            raise
        _unwritable(directory, exc)
        return None
    return path


_warned_unwritable: set[str] = set()  # plan-cache directories already warned about


def _unwritable(directory: str, exc: OSError) -> None:
    if directory not in _warned_unwritable:
        _warned_unwritable.add(directory)
        log.warning(
            "tensortier plan cache %s cannot be written (%s): plans stay in memory for this "
            "run; make the directory writable or pass another plan_cache to keep them",
            directory,
            exc,
        )
