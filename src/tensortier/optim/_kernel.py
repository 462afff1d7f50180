"""The CPU AdamW update of one bucket: ``torch._fused_adamw_`` on CPU tensors.

Measured on the 2-core CI machine (50M fp32 parameters, ms per update, one run): the fused CPU
kernel ~84, the ``_foreach_*`` formulation ~217 (it makes five passes over memory), so the fused
kernel is used. It is vectorised and multi-threaded by ATen, and it is the kernel behind
``torch.optim.AdamW(fused=True)``, so results match that optimizer bit for bit, *not* the
for-loop/foreach AdamW (those round differently in about 1 element in 2000 per step).

Why per-slot calls give the same bits as torch's per-parameter calls (ATen's
``cpu/FusedAdamKernel.cpp``): ``_fused_adamw_`` runs one ``adam_fused_step_impl`` per tensor;
it splits the tensor into 64-byte *units counted from the tensor's first element* for
``parallel_for`` and, inside each chunk, runs the vector loop over whole ``Vectorized`` widths
and a scalar tail. Unit boundaries are multiples of every vector width, so only the last
``numel % width`` elements take the scalar path, whatever the thread count or the address. The
states additionally start every slot on a 64-byte boundary (``_states.slot_layout``), like a
fresh CPU allocation, so nothing about the address differs from torch's own tensors either.

With ``grad_scale`` the kernel divides each gradient by it *and writes the quotient back into
the gradient tensor* (as ``torch.optim.AdamW(fused=True)`` does under ``GradScaler``): callers
that must keep their gradient buffer pass a scratch copy.
This module owns arithmetic only: no buffers, no I/O, no threads.
"""

from __future__ import annotations

import torch


def adamw_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """Advance ``steps`` by one and apply decoupled-weight-decay Adam in place (CPU tensors).

    ``grad_scale``: a float32 CPU scalar the gradients are divided by first (GradScaler).
    """
    if not params:
        return
    torch._foreach_add_(steps, 1)
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        weight_decay=float(weight_decay),
        eps=float(eps),
        amsgrad=False,
        maximize=maximize,
        grad_scale=grad_scale,
    )
