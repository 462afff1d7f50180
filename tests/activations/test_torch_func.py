"""``torch.func`` around and inside an offload block: what PyTorch supports gives bit-identical
gradients, what it refuses (its grad transforms with saved-tensor hooks) raises its own error."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import tensortier as tt


def _ensemble_grads(off=None) -> list[torch.Tensor]:
    """PyTorch's model-ensembling recipe: three MLPs' weights stacked, run at once by ``vmap``
    over ``functional_call`` of a meta-device copy; the gradients of the stacked weights."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)) for _ in range(3)]
    params, buffers = torch.func.stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(8, 16)

    def one(p, b, inp):
        return torch.func.functional_call(base, (p, b), (inp,))

    with off if off is not None else contextlib.nullcontext():
        y = torch.vmap(one, in_dims=(0, 0, None))(params, buffers, x)
    y.square().mean().backward()
    return [params[k].grad for k in sorted(params)]


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_vmapped_model_ensemble(spill_dir, tier):
    ref = _ensemble_grads()
    off = tt.Offloader(tier, spill_dir=spill_dir, min_bytes=0)
    try:
        # before: the forward failed in module tracking ("Cannot access storage of
        # BatchedTensorImpl": vmap hands the module batched weights)
        assert all(torch.equal(a, b) for a, b in zip(ref, _ensemble_grads(off)))
        assert off.stats.tensors_offloaded > 0
    finally:
        off.close()


@pytest.mark.parametrize("inside", [False, True], ids=["grad-in-offload", "offload-in-grad"])
def test_func_grad_raises_pytorchs_own_error_like_save_on_cpu(inside):
    def f(a):
        return (a.sin() * a).sum()

    def run(ctx):
        x = torch.randn(5)
        if inside:

            def g(a):
                with ctx():
                    return f(a)

            return torch.func.grad(g)(x)
        with ctx():
            return torch.func.grad(f)(x)

    with pytest.raises(RuntimeError, match="support saved tensor hooks") as want:
        run(torch.autograd.graph.save_on_cpu)
    off = tt.Offloader("host", min_bytes=0)
    try:
        with pytest.raises(RuntimeError) as got:
            run(lambda: off)
        assert str(got.value) == str(want.value)
        a = torch.randn(6, requires_grad=True)
        with off:  # still usable: the refused entry left nothing behind
            y = (a * 1).exp()
        y.sum().backward()
        assert torch.equal(a.grad, (a * 1).exp().detach())
    finally:
        off.close()
