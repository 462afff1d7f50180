"""``OffloadedAdamW.state``: the ``opt.state[p]`` of torch.optim over state that lives off the
device, edits included.

torch users read ``opt.state[p]["exp_avg"]`` and also change it (``.zero_()`` to reset the
moments of re-initialised units, ``["step"] = 0``). The moments here live in host buffers or
spill files, so ``opt.state[p]`` is a copy; to keep such edits from being lost silently, the
view remembers what it handed out (each tensor and its version) and, before the optimizer next
reads its state (``step()``, ``state_dict()``, ``full_state_dict()``), loads the entries that
were changed in place or re-assigned, as ``load_state_dict`` would. A copy is a snapshot: after
that point it is stale, and an in-place edit of a stale copy is not applied, with a warning (a
key re-assigned in a stale copy is neither applied nor seen: plain dicts cannot be watched).
The copies handed out are kept until that point (an edit of a temporary, as in
``opt.state[p]["exp_avg"].zero_()``, must still be seen); stale ones only weakly.

As torch's ``defaultdict``, the view takes ``opt.state[p] = entry`` (the entry is loaded at that
point, and stays the live dict until then) and ``del opt.state[p]`` (and ``pop``, ``clear``, as
``MutableMapping`` derives them): the parameter's next step starts from fresh state, as torch's
does for an empty entry. Assigning ``opt.state`` itself (``opt.state = defaultdict(dict)``, a
reset some training code does) replaces every entry the same way.

An always empty ``state`` made ``torch.distributed.checkpoint.state_dict``'s
``get_optimizer_state_dict`` take a "first" step with zero gradients, advancing every step
counter and decaying the moments: so ``len``, iteration and ``in`` list the stepped parameters.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator, MutableMapping

import torch

# what an entry was when handed out: each value, and a tensor's version counter
_Snapshot = dict[str, tuple[object, int]]


def _snapshot(entry: dict) -> _Snapshot:
    return {k: (v, v._version if torch.is_tensor(v) else -1) for k, v in entry.items()}


def _changed(entry: dict, snap: _Snapshot | None) -> bool:
    if snap is None or entry.keys() != snap.keys():
        return True
    for k, (v, version) in snap.items():
        now = entry[k]
        if now is not v or (torch.is_tensor(now) and now._version != version):
            return True
    return False


class StateView(MutableMapping):
    """``opt.state``: stepped parameters -> copies of their state; edits applied (module doc)."""

    def __init__(self, ref: weakref.ref):
        self._ref = ref  # the optimizer holds this view: no cycle
        # handed out (or assigned: no snapshot) since the last read
        self._handed: list[tuple[torch.Tensor, dict, _Snapshot | None]] = []
        self._stale: list[tuple[weakref.ref, int]] = []  # tensors handed out before, versions

    def _params(self) -> list[torch.Tensor]:
        """The parameters with state: stepped ones, as the edits not yet loaded leave them."""
        opt = self._ref()
        if opt is None or not getattr(opt, "_ready", False):
            return []
        edited = {id(p): entry is not None for p, entry, _ in self._handed}  # None: deleted
        return [s.param for s in opt._layout.slots() if edited.get(id(s.param), s.has_state)]

    def __getitem__(self, param: torch.Tensor) -> dict:
        opt = self._ref()
        if opt is None or not getattr(opt, "_ready", False):
            return {}
        opt._check_open()
        for p, entry, _ in self._handed:  # read again before the state changed: the same copy,
            if p is param and entry is not None:  # with the edits made to it (torch's dict is
                return entry  # one live object)
            if p is param:  # deleted: a new empty entry, as torch's defaultdict makes
                self[param] = {}
                return self[param]
        opt.synchronize()
        opt._spec.wait()
        entry = opt._dicts.entry(param)
        if opt._layout.where.get(id(param)) is not None:  # a parameter of this optimizer
            self._handed.append((param, entry, _snapshot(entry)))
        return entry

    def __setitem__(self, param: torch.Tensor, entry: dict) -> None:
        """``opt.state[p] = entry``: loaded before the optimizer next reads its state (an empty
        dict: fresh state); ``entry`` is the live dict until then."""
        opt = self._ref()
        opt._check_open()
        if opt._layout.where.get(id(param)) is None:
            raise KeyError(
                "opt.state[p] = ...: p is not a parameter of this optimizer (its state lives "
                "off the device, keyed by the parameters it was given)"
            )
        if not isinstance(entry, dict):
            raise TypeError(
                f"opt.state[p] = {type(entry).__name__}: pass a dict like the one opt.state[p] "
                f"returns (step, exp_avg, exp_avg_sq), or {{}} for fresh state"
            )
        self._handed = [h for h in self._handed if h[0] is not param]
        self._handed.append((param, entry, None))  # no snapshot: always an edit

    def __delitem__(self, param: torch.Tensor) -> None:
        """``del opt.state[p]``: the next step starts ``p`` from fresh state, as in torch."""
        if param not in self:
            raise KeyError(param)
        self[param] = {}
        self._handed[-1] = (param, None, None)  # out of the mapping, fresh at the next step

    def get(self, param: object, default=None):
        """As ``defaultdict.get``: ``default`` for a parameter without state (no entry made)."""
        if param not in self:
            return default
        return self[param]

    def clear(self) -> None:
        """Every parameter starts from fresh state at the next step (no state is read)."""
        params = self._params()
        gone = {id(p) for p in params}
        self._handed = [h for h in self._handed if id(h[0]) not in gone]
        self._handed += [(p, None, None) for p in params]

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
            for t in (entry or {}).values()
            if torch.is_tensor(t)
        ]
        self._handed = []
        return edits

    def forget(self) -> None:
        """After ``load_state_dict``: every copy handed out is of a state that was replaced."""
        self._handed, self._stale = [], []
