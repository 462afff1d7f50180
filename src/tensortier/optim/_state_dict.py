"""The optimizer's state-dict forms, in ``torch.optim.AdamW(fused=True)``'s layout.

- ``local()`` (``state_dict()``): per parameter ``step``, ``exp_avg``, ``exp_avg_sq`` and
  ``master_param`` when the masters differ in dtype from the parameter. Sharded or FSDP2 it is
  this rank's *local form* for DCP: DTensors (``Shard(0)`` over the group's CPU mesh, or the
  FSDP2 parameter's own layout), plain tensors for pieces owned whole, one entry per parameter
  held (``step`` 0 when never stepped).
- ``full_sharded()`` / ``full_fsdp()`` (``full_state_dict()``): the full layout on every rank,
  a collective.
- ``parse()`` + ``write()`` + ``adopt()`` (``load_state_dict()``): any of these forms, or
  ``torch.optim.AdamW``'s, saved on any world size; each rank cuts its pieces locally.

Reads only the committed state; tensors and plain values only (never pickled). The coordinator
waits for or drops speculation around these calls; this module never touches a gradient.
"""

from __future__ import annotations

import torch

from tensortier import _dist
from tensortier.optim._dtensor import is_dtensor, like_param, local_region
from tensortier.optim._layout import TORCH_KEYS, Layout, Slot, check_group
from tensortier.optim._zero import Sharding

# per slot: (exp_avg, exp_avg_sq, master or None, step), this rank's flat elements
Loaded = dict[int, tuple]


class StateDicts:
    """Builds and loads the state dicts of the optimizer whose parts it is given."""

    def __init__(self, layout: Layout, states, sharding: Sharding, groups: list[dict]):
        self.layout, self.states, self.sharding = layout, states, sharding
        self.groups = groups

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.groups for p in g["params"]]

    def packed_groups(self) -> list[dict]:
        groups, start = [], 0
        for g in self.groups:
            packed = {
                k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"
            }
            packed.update(TORCH_KEYS)
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        return groups

    # ------------------------------------------------------------------ saving
    def local(self) -> dict:
        local_form = self.sharding.local_form
        pos = {id(p): i for i, p in enumerate(self._params())}
        state: dict[int, dict] = {}
        for b in self.layout.buckets:
            if not any(s.has_state or local_form for s in b.slots):
                continue
            read = self.states.read(b.id)
            for s in b.slots:
                if s.has_state or local_form:
                    state[pos[id(s.param)]] = self._entry(s, b, read)
        return {"state": state, "param_groups": self.packed_groups()}

    def entry(self, param: torch.Tensor) -> dict:
        """``param``'s state as ``local()`` has it (copies), reading only its bucket; ``{}``
        before its first step, as ``torch.optim``'s ``state[param]``."""
        found = self.layout.where.get(id(param))
        if found is None or not found[0].has_state:
            return {}
        s, b = found
        return self._entry(s, b, self.states.read(b.id))

    def _entry(self, s: Slot, b, read) -> dict:
        master, m, v = read
        sl = slice(s.offset, s.offset + s.numel)
        stepped = s.has_state
        entry = {
            "step": s.step.clone() if stepped else torch.zeros((), dtype=torch.float32),
            "exp_avg": self._shaped(s, m[sl].clone()),
            "exp_avg_sq": self._shaped(s, v[sl].clone()),
        }
        if b.dtype != s.param.dtype:
            seeded = s.version != -1
            src = master[sl] if seeded else s.tensor().reshape(-1)
            entry["master_param"] = self._shaped(s, src.to("cpu", b.dtype, copy=True))
        return entry

    def _shaped(self, s: Slot, flat: torch.Tensor) -> torch.Tensor:
        """A slot's flat state as the parameter's shape, or its ``Shard(0)`` DTensor (sharded)."""
        p = s.param
        from torch.distributed.tensor import DTensor, Shard

        if self.sharding.fsdp and is_dtensor(p):  # the parameter's own layout
            return like_param(flat, s.local.shape, p)
        if s.whole:
            return flat.view(p.shape)

        rows = s.numel // (p.numel() // p.shape[0])
        return DTensor.from_local(
            flat.view(rows, *p.shape[1:]),
            self.sharding.device_mesh(),
            [Shard(0)],
            run_check=False,
            shape=p.shape,
            stride=p.stride(),
        )

    def full_sharded(self) -> dict:
        """Sharded: each bucket's pieces all-gathered into the full layout on every rank."""
        pos = {id(p): i for i, p in enumerate(self._params())}
        mine = {pos[id(s.param)]: float(s.step) for s in self.layout.slots() if s.has_state}
        steps: dict[int, float] = {}
        for other in _dist.gather_objects(mine, self.sharding.pg):
            steps.update(other)
        full: dict[int, dict] = {
            i: {"step": torch.tensor(st, dtype=torch.float32)} for i, st in steps.items()
        }
        for b in self.layout.buckets:
            read = self.states.read(b.id) if b.slots else None
            for k, key in enumerate(("master_param", "exp_avg", "exp_avg_sq")):
                values = {}
                for s in b.slots:
                    if not s.has_state or (k == 0 and s.param.dtype == b.dtype):
                        continue
                    flat = read[k][s.offset : s.offset + s.numel]
                    if k == 0 and s.version == -1:
                        flat = s.tensor().reshape(-1).to("cpu", b.dtype)
                    values[s.index] = flat

                def dest(i, pc, key=key, plan=b.plan, dtype=b.dtype):
                    p = plan.params[i]
                    entry = full.setdefault(pos[id(p)], {})  # sent: the sender has its state
                    t = entry.setdefault(key, torch.zeros(p.shape, dtype=dtype))
                    return t.view(-1)[pc.start : pc.stop]

                self.sharding.gatherer.gather(b.plan, values, dest=dest, dtype=b.dtype)
        return {"state": full, "param_groups": self.packed_groups()}

    def full_fsdp(self) -> dict:
        """FSDP2: every DTensor state gathered with ``full_tensor()`` (a collective per tensor,
        in the same parameter order on every rank)."""
        pos = {id(p): i for i, p in enumerate(self._params())}

        def full(s: Slot, flat: torch.Tensor) -> torch.Tensor:
            t = self._shaped(s, flat.clone())
            return t.full_tensor() if is_dtensor(t) else t

        state: dict[int, dict] = {}
        for b in self.layout.buckets:
            if not any(s.has_state for s in b.slots):
                continue
            master, m, v = self.states.read(b.id)
            for s in b.slots:
                if not s.has_state:
                    continue
                sl = slice(s.offset, s.offset + s.numel)
                entry = {"step": s.step.clone(), "exp_avg": full(s, m[sl])}
                entry["exp_avg_sq"] = full(s, v[sl])
                if b.dtype != s.param.dtype:
                    seeded = s.version != -1
                    src = master[sl] if seeded else s.tensor().reshape(-1).to("cpu", b.dtype)
                    entry["master_param"] = full(s, src)
                state[pos[id(s.param)]] = entry
        return {"state": state, "param_groups": self.packed_groups()}

    # ------------------------------------------------------------------ loading
    def parse(self, state_dict: dict) -> Loaded:
        """Check ``state_dict`` against the optimizer and cut out each slot's elements; raises
        (``ValueError``, ``ConfigError``) before anything is changed."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.groups):
            raise ValueError(
                f"loaded state dict has {len(groups)} parameter groups, the optimizer has "
                f"{len(self.groups)}"
            )
        for g, sg in zip(self.groups, groups):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size "
                    f"of optimizer's group ({len(sg['params'])} vs {len(g['params'])} parameters)"
                )
            check_group(dict(sg), "the loaded state dict's param group", loaded=True)
        ids = [i for sg in groups for i in sg["params"]]
        pos = {id(p): k for k, p in enumerate(self._params())}
        loaded: Loaded = {}
        for s in self.layout.slots():
            i = ids[pos[id(s.param)]]
            e = state_dict["state"].get(i, state_dict["state"].get(str(i)))
            if not e:  # absent, or torch's empty entry (opt.state[p] read before p's first step)
                continue
            step = e.get("step")
            step = float(step.item() if torch.is_tensor(step) else step)
            if self.sharding.local_form and step == 0:
                continue  # a never-stepped entry of the sharded form: fresh state
            what = f"state of parameter {pos[id(s.param)]}"
            parts = []
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in e:
                    raise ValueError(f"{what} has no {key!r}")
                parts.append(self._local_state(e[key], s, f"{what} {key!r}"))
            master = e.get("master_param")
            parts.append(None if master is None else self._local_state(master, s, f"{what} master"))
            loaded[id(s)] = (*parts, step)
        return loaded

    def _local_state(self, value, s: Slot, what: str) -> torch.Tensor:
        """The flat elements of ``value`` this slot holds: from a full tensor of the parameter's
        shape (any world size) or a ``Shard(0)`` DTensor over the same group (DCP's sharded
        form)."""
        from torch.distributed.tensor import DTensor

        p = s.param
        if self.sharding.fsdp and is_dtensor(p):  # FSDP2: this rank's shard of p's layout
            region = local_region(value, p, what)
            if region is not None:
                return region
        if isinstance(value, DTensor):
            local = value.to_local()
            same = (
                self.sharding.sharded
                and len(value.placements) == 1
                and value.placements[0].is_shard(0)
                and value.device_mesh.size() == self.sharding.world
                and tuple(value.shape) == tuple(s.param.shape)
                and local.numel() == s.numel
            )
            if not same:
                raise ValueError(
                    f"{what} is a DTensor with placements {value.placements} on a mesh of "
                    f"{value.device_mesh.size()} ranks, not this optimizer's Shard(0) over "
                    f"{self.sharding.world}; pass its full_tensor() or the full_state_dict() layout"
                )
            return local.reshape(-1)
        if not torch.is_tensor(value):
            raise ValueError(f"{what} is a {type(value).__name__}, not a tensor")
        # a plain tensor is the full state, shaped like the parameter: one with as many elements
        # as this rank's piece cannot be told from a smaller model's state (and every rank would
        # take the same tensor), so pieces come only as this optimizer's Shard(0) DTensors
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"{what} has shape {tuple(value.shape)}; the parameter has {tuple(p.shape)} "
                f"(the state of another model?): pass the full state (torch.optim.AdamW's "
                f"state_dict() or full_state_dict()) or this optimizer's own state_dict()"
            )
        return s.view(value.reshape(-1)) if not s.whole else value.reshape(-1)

    def write(self, loaded: Loaded) -> None:
        """Replace the committed state of every bucket (all of it, or none on an error)."""
        try:
            for b in self.layout.buckets:
                if not b.slots:
                    continue
                token, (master, m, v) = self.states.blank(b.id)
                try:
                    for s in b.slots:
                        got = loaded.get(id(s))
                        if got is None:
                            continue
                        sl = slice(s.offset, s.offset + s.numel)
                        m[sl].copy_(got[0])
                        v[sl].copy_(got[1])
                        if b.in_place:  # the parameter is the master: a loaded one is ignored,
                            continue  # as torch.optim.AdamW ignores it
                        src = got[2] if got[2] is not None else s.tensor()
                        master[sl].copy_(src.reshape(-1))
                except BaseException:
                    self.states.discard(token)  # not saved: back to the ring, once
                    raise
                self.states.save(b.id, token, (master, m, v))  # owns the token from here
            self.states.commit()
        except BaseException:
            self.states.abort()
            raise

    def adopt(self, loaded: Loaded, groups: list[dict]) -> None:
        """After ``write``: the slots' step counters and the loaded groups' hyper-parameters."""
        for s in self.layout.slots():
            got = loaded.get(id(s))
            s.has_state = got is not None
            s.step = torch.tensor(got[3] if got else 0.0, dtype=torch.float32)
            s.version = s.data_version if got is not None else -1
        for g, sg in zip(self.groups, groups):
            for k, v in sg.items():
                if k != "params" and k not in TORCH_KEYS:
                    g[k] = tuple(v) if k == "betas" else v
