"""``OffloadedAdamW.state``: the ``opt.state[p]`` of torch.optim over state that lives off the
device, edits included.

torch users read ``opt.state[p]["exp_avg"]`` and also change it (``.zero_()`` to reset the
moments of re-initialised units, ``["step"] = 0``). The moments here live in host buffers or
spill files, so ``opt.state[p]`` is a copy; to keep such edits from being lost silently, the
view remembers what it handed out (each tensor and its version) and, before the optimizer next
reads its state (``step()``, ``state_dict()``, ``full_state_dict()``), loads the entries that
were changed in place or re-assigned, as ``load_state_dict`` would. A copy is a snapshot: after
that point it is stale, and an in-place edit of a stale copy is not applied, with a warning.
The copies handed out are kept until that point (an edit of a temporary, as in
``opt.state[p]["exp_avg"].zero_()``, must still be seen); stale ones only weakly.

An always empty ``state`` made ``torch.distributed.checkpoint.state_dict``'s
``get_optimizer_state_dict`` take a "first" step with zero gradients, advancing every step
counter and decaying the moments: so ``len``, iteration and ``in`` list the stepped parameters.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator, Mapping

import torch

# what an entry was when handed out: each value, and a tensor's version counter
_Snapshot = dict[str, tuple[object, int]]


def _snapshot(entry: dict) -> _Snapshot:
    return {k: (v, v._version if torch.is_tensor(v) else -1) for k, v in entry.items()}


def _changed(entry: dict, snap: _Snapshot) -> bool:
    if entry.keys() != snap.keys():
        return True
    for k, (v, version) in snap.items():
        now = entry[k]
        if now is not v or (torch.is_tensor(now) and now._version != version):
            return True
    return False


class StateView(Mapping):
    """``opt.state``: stepped parameters -> copies of their state; edits applied (module doc)."""

    def __init__(self, ref: weakref.ref):
        self._ref = ref  # the optimizer holds this view: no cycle
        self._handed: list[tuple[torch.Tensor, dict, _Snapshot]] = []  # since the last read
        self._stale: list[tuple[weakref.ref, int]] = []  # tensors handed out before, versions

    def _params(self) -> list[torch.Tensor]:
        opt = self._ref()
        if opt is None or not getattr(opt, "_ready", False):
            return []
        return [s.param for s in opt._layout.slots() if s.has_state]

    def __getitem__(self, param: torch.Tensor) -> dict:
        opt = self._ref()
        if opt is None or not getattr(opt, "_ready", False):
            return {}
        opt._check_open()
        for p, entry, _ in self._handed:  # read again before the state changed: the same copy,
            if p is param:  # with the edits made to it (torch's dict is one live object)
                return entry
        opt.synchronize()
        opt._spec.wait()
        entry = opt._dicts.entry(param)
        if opt._layout.where.get(id(param)) is not None:  # a parameter of this optimizer
            self._handed.append((param, entry, _snapshot(entry)))
        return entry

    def __contains__(self, param: object) -> bool:  # without reading the state (Mapping's would)
        return any(p is param for p in self._params())

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._params())

    def __len__(self) -> int:
        return len(self._params())

    def take_edits(self) -> list[tuple[torch.Tensor, dict]]:
        """The entries changed since they were handed out; every copy handed out becomes stale. Warns about edits of copies that already were."""
        if any((t := ref()) is not None and t._version != v for ref, v in self._stale):
            warnings.warn(
                "an opt.state[p] copy read before the optimizer's last step was changed after "
                "it; that edit is not applied: read opt.state[p] again after step() and change "
                "the new copy",
                stacklevel=4,
            )
        edits = [(p, entry) for p, entry, snap in self._handed if _changed(entry, snap)]
        self._stale = [
            (weakref.ref(t), t._version)
            for _, entry, _ in self._handed
            for t in entry.values()
            if torch.is_tensor(t)
        ]
        self._handed = []
        return edits

    def forget(self) -> None:
        """After ``load_state_dict``: every copy handed out is of a state that was replaced."""
        self._handed, self._stale = [], []
