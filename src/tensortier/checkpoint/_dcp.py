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
number of ranks. Non-tensor DCP entries are read by DCP (``torch.load`` with
``weights_only=True``); tensortier's own format is never unpickled.
"""

from __future__ import annotations

import os

from tensortier.errors import ConfigError

PARTS = ("model", "optimizer", "scheduler", "extra")


def export_dcp(directory: str | os.PathLike, dcp_dir: str | os.PathLike, *, step=None) -> int:
    """Write a tensortier checkpoint of ``directory`` (the newest that verifies, or ``step``) as
    a DCP checkpoint in ``dcp_dir``; returns its step."""
    import torch.distributed.checkpoint as dcp

    from tensortier.checkpoint.checkpointer import read_checkpoint

    tree, saved = read_checkpoint(os.fspath(directory), step)
    state = {k: tree[k] for k in PARTS if tree.get(k) is not None}
    dcp.save(state, checkpoint_id=os.fspath(dcp_dir), no_dist=True)
    return saved


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


def import_dcp(
    dcp_dir: str | os.PathLike, directory: str | os.PathLike, *, step: int, **settings
) -> str:
    """Write the DCP checkpoint in ``dcp_dir`` as tensortier checkpoint ``step`` in
    ``directory``; returns its path. Its ``model``/``optimizer``/``scheduler``/``extra`` keys
    become those parts (other top-level keys go to ``extra``); no RNG state is stored."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from tensortier.checkpoint.checkpointer import Checkpointer

    state: dict = {}  # filled from the metadata, as torch's own dcp_to_torch_save does
    _load_state_dict(
        state,
        storage_reader=FileSystemReader(os.fspath(dcp_dir)),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    if not state:
        raise ConfigError(f"{os.fspath(dcp_dir)!r} holds no DCP state; pass a DCP checkpoint")
    parts = {k: state.pop(k, None) for k in PARTS}
    if state:  # keys of another layout (e.g. torchtitan's "dataloader"): kept in extra
        parts["extra"] = {"extra": parts["extra"], **state} if parts["extra"] is not None else state
    for k in ("model", "optimizer", "scheduler"):
        if parts[k] is not None and not isinstance(parts[k], dict):
            raise ConfigError(f"the DCP checkpoint's {k!r} entry is not a state dict")
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
