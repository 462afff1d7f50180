"""DTensor parameters (FSDP2's ``fully_shard``): local shards and the DTensor form of their state.

FSDP2 already shards parameters, so ``OffloadedAdamW`` updates each rank's *local shard*
(``to_local()``) of parameters and gradients, and lays masters and moments out over local shards
(PROTOCOL.md, "FSDP2"). This module owns the conversions between a slot's flat state and the
DTensor with the parameter's own mesh and placements (what ``state_dict()`` returns and DCP
saves and reshards), and cuts this rank's region out of a loaded state. It holds no state and
issues no collective itself.
"""

from __future__ import annotations

import torch


def is_dtensor(t) -> bool:
    if type(t) in _PLAIN:  # the common case, asked several times per parameter and step
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 parameters and gradients), else the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def like_param(flat: torch.Tensor, local_shape: torch.Size, p: torch.Tensor) -> torch.Tensor:
    """A slot's flat state as a DTensor laid out like DTensor parameter ``p`` (its local shard
    has ``local_shape``)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        flat.view(local_shape),
        p.device_mesh,
        p.placements,
        run_check=False,
        shape=p.shape,
        stride=p.stride(),
    )


def local_region(value, p: torch.Tensor, what: str) -> torch.Tensor | None:
    """This rank's flat region of a loaded state ``value`` of DTensor parameter ``p``: from a
    DTensor of the parameter's layout, or a full tensor of its shape (any world size). None when
    ``value`` is neither (the caller's checks then name what it is)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        if (
            tuple(value.placements) != tuple(p.placements)
            or value.device_mesh.size() != p.device_mesh.size()
            or tuple(value.shape) != tuple(p.shape)
        ):
            raise ValueError(
                f"{what} is a DTensor with placements {value.placements} on "
                f"{value.device_mesh.size()} ranks; the parameter has {p.placements} on "
                f"{p.device_mesh.size()}: pass its full_tensor() instead"
            )
        return value.to_local().reshape(-1)
    if torch.is_tensor(value) and tuple(value.shape) == tuple(p.shape):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return value[tuple(slice(o, o + n) for o, n in zip(offsets, shape))].reshape(-1)
    return None
