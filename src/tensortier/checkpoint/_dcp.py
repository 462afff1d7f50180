"""Moving checkpoints to and from ``torch.distributed.checkpoint`` (DCP), e.g. torchtitan's.

Both directions run in one process and hold one full copy of the state in host memory: a
conversion, not a training-time path. ``export_dcp`` writes the newest verified tensortier
checkpoint (saved by any number of ranks) as a DCP checkpoint whose top-level keys are
``model``, ``optimizer``, ``scheduler`` and ``extra`` (those present), the optimizer in
``torch.optim``'s layout (integer parameter ids, full tensors). ``import_dcp`` reads any DCP
checkpoint with DCP's own planner (``_EmptyStateDictLoadPlanner``: the state dict is rebuilt from
the checkpoint's metadata, DTensor shards assembled into full tensors, exactly as torch's
``format_utils.dcp_to_torch_save`` reads it) and writes it as a
one-process tensortier checkpoint of ``step``, which ``Checkpointer.restore`` then loads on any
number of ranks. A DCP checkpoint may come from anywhere, so nothing in it can run code
(``_dcp_read.py``): its ``.metadata`` pickle is read by an unpickler that resolves only DCP's
metadata classes, its non-tensor entries with ``torch.load(weights_only=True)``; tensortier's
own format is never unpickled.
"""

from __future__ import annotations

import os

from tensortier.errors import ConfigError

PARTS = ("model", "optimizer", "scheduler", "extra")


def export_dcp(directory: str | os.PathLike, dcp_dir: str | os.PathLike, *, step=None) -> int:
    """Write a tensortier checkpoint of ``directory`` (the newest that verifies, or ``step``) as
    a DCP checkpoint in ``dcp_dir``; returns its step.

    The optimizer keeps the layout it was saved in: ``torch.optim``'s integer ids, which
    ``dcp.load`` fills into a template of that layout (``dcp_to_torch_save`` reads it whole).
    Model keys are the bare model's FQNs, as DCP's ``get_model_state_dict`` names them: a
    wrapper's leading ``module.`` (DDP) or ``_orig_mod.`` (``torch.compile``) that every saved
    key carries is dropped, so a model saved wrapped loads into the bare model's template (a
    model whose only child is itself named ``module`` loses that name too). DCP's
    ``get_state_dict(model, optimizer)`` names parameters by FQN instead, and naming them
    needs the objects: for that layout (torchtitan's), ``Checkpointer.restore`` into them, then
    ``dcp.save`` what ``get_state_dict`` returns."""
    import torch.distributed.checkpoint as dcp

    from tensortier.checkpoint.checkpointer import read_checkpoint

    tree, saved = read_checkpoint(os.fspath(directory), step)  # ConfigError if there is none
    state = {k: tree[k] for k in PARTS if tree.get(k) is not None}
    if isinstance(state.get("model"), dict):
        state["model"] = _unwrapped(state["model"])
    dcp.save(state, checkpoint_id=os.fspath(dcp_dir), no_dist=True)
    return saved


def _unwrapped(model: dict) -> dict:
    """``model`` without the wrapper names that lead every key (``module._orig_mod.w`` -> ``w``)."""
    from tensortier.checkpoint._validate import WRAPPERS

    while model and all(
        isinstance(k, str) and "." in k and k.split(".", 1)[0] in WRAPPERS for k in model
    ):
        heads = {k.split(".", 1)[0] for k in model}
        if len(heads) != 1:
            break
        model = {k.split(".", 1)[1]: v for k, v in model.items()}
    return model


class _Saved:
    """A state dict standing in for the object it came from, so a Checkpointer can save it."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state

    def parameters(self):
        return iter(())

    def register_step_pre_hook(self, hook):
        return _NoHandle()


class _NoHandle:
    def remove(self) -> None:
        pass


def _integer_ids(optimizer: dict) -> dict:
    """torch.optim's layout back: DCP's flattened keys turn the state's integer parameter ids
    into strings ("0"), which ``Optimizer.load_state_dict`` would keep apart from the
    parameters (their state silently dropped). FQN-keyed layouts are left as they are."""
    state, groups = optimizer.get("state"), optimizer.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, list):
        return optimizer
    ids = {p for g in groups if isinstance(g, dict) for p in g.get("params", ())}
    if not all(isinstance(p, int) for p in ids):
        return optimizer
    if not all(isinstance(k, str) and k.isdecimal() and int(k) in ids for k in state):
        return optimizer
    return {**optimizer, "state": {int(k): v for k, v in state.items()}}


def import_dcp(
    dcp_dir: str | os.PathLike, directory: str | os.PathLike, *, step: int, **settings
) -> str:
    """Write the DCP checkpoint in ``dcp_dir`` as tensortier checkpoint ``step`` in
    ``directory``; returns its path. Its ``model``/``optimizer``/``scheduler``/``extra`` keys
    become those parts (other top-level keys go to ``extra``); no RNG state is stored.

    Safe on a checkpoint from an untrusted source: its metadata is unpickled through an
    allow-list of DCP's own classes and its non-tensor entries weights-only, so a crafted file
    is refused (:class:`CorruptDataError`) instead of running code; so is a damaged one.
    """
    from tensortier.checkpoint._dcp_read import read_dcp
    from tensortier.checkpoint.checkpointer import Checkpointer, _check_step

    step = _check_step(step, "import_dcp")  # before reading: step-5.0 would never be restored
    state = read_dcp(os.fspath(dcp_dir))
    if not state:
        raise ConfigError(f"{os.fspath(dcp_dir)!r} holds no DCP state; pass a DCP checkpoint")
    parts = {k: state.pop(k, None) for k in PARTS}
    if state:  # keys of another layout (e.g. torchtitan's "dataloader"): kept in extra
        parts["extra"] = {"extra": parts["extra"], **state} if parts["extra"] is not None else state
    for k in ("model", "optimizer", "scheduler"):
        if parts[k] is not None and not isinstance(parts[k], dict):
            raise ConfigError(f"the DCP checkpoint's {k!r} entry is not a state dict")
    if parts["optimizer"] is not None:
        parts["optimizer"] = _integer_ids(parts["optimizer"])
    wrap = {k: (_Saved(v) if v is not None else None) for k, v in parts.items() if k != "extra"}
    with Checkpointer(directory, **settings) as ck:
        ck._start(
            step,
            wrap["model"],
            wrap["optimizer"],
            wrap["scheduler"],
            parts["extra"],
            entered=0.0,
            rng=False,
        )
    return os.path.join(os.path.abspath(os.fspath(directory)), f"step-{step}")
