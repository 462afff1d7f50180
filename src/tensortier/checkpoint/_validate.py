"""Everything a restore checks before it modifies anything (see PROTOCOL.md, "Restore").

Two kinds of defect, two errors. A state tree that this package cannot have written (wrong
types, malformed optimizer or RNG state) is :class:`CorruptDataError`: the checkpoint is skipped
and restore falls back to an older one, as for a bad checksum. A well-formed checkpoint that does
not fit the objects passed to ``restore`` (other parameter names or shapes, another number of
parameter groups) is :class:`ConfigError`: older checkpoints of the same run would not fit either,
so nothing falls back and nothing is loaded.
"""

from __future__ import annotations

from collections import Counter

import torch

from tensortier.checkpoint._rng import check_rng_state
from tensortier.errors import ConfigError, CorruptDataError

PARTS = ("model", "optimizer", "scheduler", "rng", "extra")


def check_tree(tree: object) -> dict:
    """The decoded ``state`` of a manifest, checked for structure; raises CorruptDataError."""
    if not isinstance(tree, dict):
        raise CorruptDataError("manifest state is not a mapping")
    unknown = set(tree) - set(PARTS)
    if unknown:
        raise CorruptDataError(f"unknown parts {sorted(map(str, unknown))} in manifest state")
    for part in ("model", "scheduler"):
        value = tree.get(part)
        if value is not None and not _str_keyed(value):
            raise CorruptDataError(f"the {part} state in manifest is not a mapping of names")
    optimizer = tree.get("optimizer")
    if optimizer is not None:
        _check_optimizer(optimizer)
    if tree.get("rng") is not None:
        check_rng_state(tree["rng"])
    return tree


def _str_keyed(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) for k in value)


def _check_optimizer(state: object) -> None:
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
        raise CorruptDataError("the optimizer state in manifest lacks its 'state' mapping")
    groups = state.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise CorruptDataError("the optimizer state in manifest has malformed 'param_groups'")
    for entry in state["state"].values():
        if not isinstance(entry, dict):
            raise CorruptDataError("a per-parameter optimizer state in manifest is not a mapping")


# wrappers that prefix a module's state_dict keys: DDP, torch.compile, FSDP1, checkpoint_wrapper
WRAPPERS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def _bare(key: str) -> str:
    return ".".join(part for part in key.split(".") if part not in WRAPPERS)


def align_model_keys(tree: dict, own: dict) -> dict:
    """``tree`` with its model keys renamed to ``own``'s where the two differ only by wrapper
    prefixes (saved from ``DDP(model)``, restored into the bare model in one process, or
    back), as DCP's ``get_model_state_dict`` names parameters. A key is renamed only when its
    bare name matches exactly one of ``own``'s and no other saved key does; the rest stay as
    saved (``check_fits`` then names the keys that differ, ``strict=False`` skips them)."""
    saved = tree.get("model")
    if not isinstance(saved, dict) or saved.keys() == own.keys():
        return tree
    owners: dict[str, str | None] = {}  # bare name -> own key; None when two share it
    for k in own:
        owners[_bare(k)] = None if _bare(k) in owners else k
    targets = [k if k in own else owners.get(_bare(k)) for k in saved]
    counts = Counter(t for t in targets if t is not None)
    renamed = {
        (t if t is not None and counts[t] == 1 else k): v
        for (k, v), t in zip(saved.items(), targets)
    }
    if renamed.keys() == own.keys():
        renamed = {k: renamed[k] for k in own}  # the model's own order
    return {**tree, "model": renamed}


def check_fits(tree: dict, path: str, model, optimizer, scheduler, strict: bool = True) -> None:
    """Raise ConfigError (before anything is loaded) if the checkpoint does not fit the objects.

    ``strict=False`` allows model keys missing on either side, as ``load_state_dict(strict=False)``
    does; a key both have must still have the same shape."""
    for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)):
        if obj is not None and tree.get(name) is None:
            raise ConfigError(
                f"checkpoint {path} holds no {name} state, but a {name} was passed to restore"
            )
    if model is not None:
        _check_model(tree["model"], model.state_dict(), path, strict)
    if optimizer is not None:
        groups = tree["optimizer"]["param_groups"]
        if len(groups) != len(optimizer.param_groups) or any(
            len(g["params"]) != len(mine["params"])
            for g, mine in zip(groups, optimizer.param_groups)
        ):
            raise ConfigError(
                f"checkpoint {path} holds an optimizer with parameter groups of sizes "
                f"{[len(g['params']) for g in groups]}, the optimizer passed has "
                f"{[len(g['params']) for g in optimizer.param_groups]}; build the optimizer "
                f"over the same parameters and groups as the saved run"
            )
        check_optimizer_loads(tree["optimizer"], optimizer, path)


def check_optimizer_loads(state: dict, optimizer, path: str) -> None:
    """ConfigError if ``optimizer.load_state_dict(state)`` would fail, with nothing changed.

    The model loads before the optimizer (OffloadedAdamW takes its fp32 masters from the
    loaded parameters), so a state the optimizer refuses only then (SGD's momentum into AdamW:
    torch's ``load_state_dict`` checks group sizes, then fails in ``__setstate__``) would leave
    the model loaded and the error untyped. torch.optim's own ``load_state_dict`` is run on a
    shallow twin (its ``__setstate__`` replaces the twin's state and groups, never the
    optimizer's); OffloadedAdamW checks a state dict whole before it changes anything.
    """
    from tensortier.optim.adamw import OffloadedAdamW

    try:
        if isinstance(optimizer, OffloadedAdamW):
            optimizer._dicts.parse(state)
        elif type(optimizer).load_state_dict is torch.optim.Optimizer.load_state_dict:
            twin = object.__new__(type(optimizer))
            twin.__dict__.update(optimizer.__dict__)
            # over data-less stand-ins of the parameters: torch moves each loaded state tensor
            # to its parameter's device and dtype, which for the twin then copies nothing
            twin.param_groups = [
                {**g, "params": [_ghost(p) for p in g["params"]]} for g in optimizer.param_groups
            ]
            twin.load_state_dict(state)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as exc:
        raise ConfigError(
            f"checkpoint {path} holds an optimizer state that the {type(optimizer).__name__} "
            f"passed cannot load ({exc!r}); nothing was loaded. Restore with the optimizer the "
            f"saved run used"
        ) from exc


def _ghost(p: torch.Tensor) -> torch.Tensor:
    """A meta tensor like ``p`` (a DTensor or other subclass is kept: it has its own rules)."""
    if type(p) in (torch.Tensor, torch.nn.Parameter):
        return torch.empty_like(p, device="meta")
    return p


def refuse_partial(t: object, name: str, restoring: bool = False) -> None:
    """A DTensor with a ``Partial`` placement over more than one rank holds on each rank an
    addend of its value, not a chunk of it. Saved as its local tensor (like a ``Replicate``
    one), the checkpoint would silently hold one rank's addend. Restored, every rank would hold
    the whole value as its addend. Either way, raise a ``ConfigError`` that names the fix."""
    placements = getattr(t, "placements", None)
    if placements is None or not any(
        p.is_partial() and t.device_mesh.size(d) > 1 for d, p in enumerate(placements)
    ):
        return
    what = (
        f"{name} is a DTensor with placements {tuple(placements)}: a Partial placement holds on "
        f"each rank an addend of the value, not the value, so"
    )
    if restoring:
        raise ConfigError(
            f"{what} a checkpoint cannot be restored into it; restore into a Replicate (or "
            f"plain) tensor, then redistribute it"
        )
    raise ConfigError(
        f"{what} it cannot be checkpointed; reduce it first, e.g. "
        f"t.redistribute(placements=[Replicate()]) (a collective, on every rank), and save that"
    )


def _check_model(saved: dict, own: dict, path: str, strict: bool) -> None:
    for k, v in own.items():
        refuse_partial(v, f"model/{k}", restoring=True)
    missing = [k for k in own if k not in saved] if strict else []
    unexpected = [k for k in saved if k not in own] if strict else []
    shapes = [
        f"{k}: {_shape(saved[k])} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in saved
        and isinstance(v, torch.Tensor)
        and (not isinstance(saved[k], torch.Tensor) or saved[k].shape != v.shape)
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected {_few(unexpected)}")
        if shapes:
            parts.append(f"other shapes ({_few(shapes)})")
        raise ConfigError(
            f"checkpoint {path} does not fit the model passed to restore: {'; '.join(parts)}. "
            f"Build the model with the saved run's configuration, or restore into one that has it"
            + ("" if shapes else " (restore(strict=False) loads the keys both have)")
        )


def _shape(value: object) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def _few(items: list[str]) -> str:
    head = ", ".join(map(str, items[:5]))
    return head + (f" and {len(items) - 5} more" if len(items) > 5 else "")
