"""PyTorch's own saved-tensor-hook semantics, with ``tt.offload`` in place of the hooks.

The cases follow the saved-tensor-hook tests of PyTorch's ``test/test_autograd.py``
(``test_saved_variable_packing_unpacking_*``, ``test_saved_tensors_hook_*``,
``test_default_saved_variable_hooks_*``/``test_default_saved_tensors_hooks_double_backward``,
``test_setting_default_saved_variable_hooks_twice_*``, ``test_disabling_saved_tensor_hooks*``,
``test_pack_hook_with_inplace_modification_should_fail``, ``test_save_on_cpu_and_checkpoint``,
``test_saving_variable_to_disk``, ``test_wrapped_number_saved_tensors_hooks``,
``test_graph_save_on_cpu*``, ``test_unpack_hooks_exec_count``, and the custom ``Function``,
view, ``retain_graph`` and grad-mode tests around them). They were rewritten here, not copied:
where PyTorch's test checks what an arbitrary pair of hooks may do, the port checks what an
offloader must do (give back bit-identical tensors with the right ``grad_fn``, dtype, layout and
strides, and behave as plain autograd otherwise). PyTorch is BSD-3-Clause licensed,
Copyright (c) Meta Platforms, Inc. and affiliates and the PyTorch contributors; the test ideas
are theirs.

Every test that takes the ``offload`` fixture runs once with ``tier="host"`` and once with
``tier="disk"``; ``min_bytes=0`` so that even these tiny tensors move.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import Function
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

import tensortier as tt
from tests.conftest import bit_equal


@pytest.fixture(params=["host", "disk"])
def offload(request, spill_dir):
    """``offload()`` is the context a user writes: ``tt.offload(tier=..., min_bytes=0)``; every
    offloader a test made is closed after it (``spill_dir`` then checks nothing is left)."""
    made = []

    def make(**kw):
        off = tt.offload(tier=request.param, spill_dir=spill_dir, min_bytes=0, **kw)
        made.append(off)
        return off

    yield make
    for off in made:
        off.close()


def _leaf(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()


def _grads_match(fn, inputs, ctx) -> None:
    """``fn(*inputs).sum().backward()`` plain and under ``ctx``: bit-identical outputs and grads."""
    plain = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    moved = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    want = fn(*plain)
    want.sum().backward()
    with ctx:
        got = fn(*moved)
    got.sum().backward()
    assert bit_equal(got.detach(), want.detach())
    for a, b in zip(moved, plain):
        if b.requires_grad:
            assert bit_equal(a.grad, b.grad)


# --------------------------------------------------------------------- what comes back
def test_saved_leaf_input_comes_back_equal(offload):
    a = _leaf(5)
    with offload():
        y = a * a
    assert bit_equal(y.grad_fn._saved_self, a.detach())
    assert bit_equal(y.grad_fn._saved_other, a.detach())
    y.sum().backward()
    assert bit_equal(a.grad, (2 * a).detach())


def test_saved_nonleaf_input_keeps_its_grad_fn(offload):
    a = _leaf(5) + 1
    grad_fn = a.grad_fn
    with offload():
        y = a * a
    assert bit_equal(y.grad_fn._saved_self, a.detach())
    assert y.grad_fn._saved_self.grad_fn is grad_fn
    y.sum().backward()


def test_saved_output_comes_back_equal_and_keeps_its_grad_fn(offload):
    a = _leaf(5)
    with offload():
        y = torch.exp(a)
    assert bit_equal(y.grad_fn._saved_result, y.detach())
    assert y.grad_fn._saved_result.grad_fn is y.grad_fn
    y.sum().backward()
    assert bit_equal(a.grad, y.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_and_layout_are_kept(offload, dtype):
    a = _leaf(5, dtype=dtype)
    with offload():
        y = a * a
    saved = y.grad_fn._saved_self
    assert saved.dtype == a.dtype and saved.layout == a.layout and saved.device == a.device
    y.sum().backward()
    assert bit_equal(a.grad, (2 * a).detach())


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "nonleaf"])
def test_double_backward_through_saved_input(offload, leaf):
    def first_grad(a):
        h = a if leaf else a * 1
        return torch.autograd.grad((h**3).sum(), h, create_graph=True)[0]

    _grads_match(first_grad, [_leaf(5)], offload())


def test_each_save_goes_through_the_offloader_and_one_storage_moves_once(offload):
    a = _leaf(64)
    h = a * 1  # not a leaf: a leaf that requires grad is held by the graph, saved by reference
    off = offload()
    with off:
        y = h * h  # saves h twice
    assert off.stats.tensors_packed == 2 and off.stats.tensors_offloaded == 1
    assert off.stats.bytes_deduplicated > 0
    y.sum().backward()
    assert bit_equal(a.grad, (2 * a).detach())


def test_a_saved_tensor_that_already_has_hooks_refuses_more_like_with_torch_hooks(offload):
    a = _leaf(5)
    with torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x):
        y = a * a
    with pytest.raises(RuntimeError) as want:
        y.grad_fn._raw_saved_self.register_hooks(lambda x: x, lambda x: x)
    with offload():
        y = a * a
    with pytest.raises(RuntimeError) as got:
        y.grad_fn._raw_saved_self.register_hooks(lambda x: x, lambda x: x)
    assert str(got.value) == str(want.value)


def test_pack_never_modifies_its_input(offload):
    a = _leaf(5)
    h = a * 1
    before = (a._version, h._version)
    with offload():  # PyTorch raises if a pack hook modifies its input in place
        y = torch.exp(h)
        z = h.sin()
    assert (a._version, h._version) == before
    (y + z).sum().backward()


# --------------------------------------------------------------------- entering and leaving
def test_hooks_are_gone_after_the_block(offload):
    a = _leaf(5)
    off = offload()
    with off:
        a * a
    packed = off.stats.tensors_packed
    y = a * a
    assert off.stats.tensors_packed == packed
    assert y.grad_fn._saved_self is a  # saved as plain autograd saves it


def test_hooks_are_gone_after_an_exception_in_the_block(offload):
    a = _leaf(5)
    with pytest.raises(KeyError, match="mid-forward"), offload():
        y = a * a
        raise KeyError("mid-forward")
    y = a * a
    assert y.grad_fn._saved_self is a


def test_nested_offloaders_do_not_fail(offload):
    with offload(), offload():
        pass
    a = _leaf(5)
    with offload(), offload():
        y = a * a
    y.sum().backward()
    assert bit_equal(a.grad, (2 * a).detach())


def test_the_same_offloader_refuses_to_nest_in_itself(offload):
    off = offload()
    with off:
        with pytest.raises(RuntimeError, match="already active"):
            off.__enter__()
        a = _leaf(5)
        y = a * a  # the outer block still works
    y.sum().backward()
    assert bit_equal(a.grad, (2 * a).detach())


def test_inner_offloader_is_used(spill_dir):
    outer = tt.Offloader("host", min_bytes=0)
    inner = tt.Offloader("disk", spill_dir=spill_dir, min_bytes=0)
    try:
        b = _leaf(5, seed=1)
        a = _leaf(5, seed=2)
        with outer:  # a * 1: a leaf that requires grad is saved by reference, never moved
            with inner:
                y = (a * 1) * (a * 1)
            z = (b * 1) * (b * 1)
        assert inner.stats.bytes_offloaded["disk"] > 0 and inner.stats.bytes_offloaded["host"] == 0
        assert outer.stats.bytes_offloaded["host"] > 0 and outer.stats.bytes_offloaded["disk"] == 0
        y.sum().backward()
        z.sum().backward()
        assert bit_equal(a.grad, (2 * a).detach()) and bit_equal(b.grad, (2 * b).detach())
    finally:
        outer.close()
        inner.close()


def test_offload_inside_disabled_hooks_raises_pytorchs_error_and_stays_usable(offload):
    off = offload()
    with (
        torch.autograd.graph.disable_saved_tensors_hooks("no hooks in this region"),
        pytest.raises(RuntimeError, match="no hooks in this region"),
        off,
    ):
        pass
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()
    a = _leaf(5)
    with off:  # the refused entry left nothing behind
        y = a * a
    y.sum().backward()
    assert bit_equal(a.grad, (2 * a).detach())


def test_disabling_hooks_inside_offload_raises(offload):
    with (
        offload(),
        pytest.raises(RuntimeError, match="no hooks here"),
        torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"),
    ):
        pass
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()


def test_errors_in_forward_propagate_and_the_offloader_recovers(offload):
    class Boom(Exception):
        pass

    class Fails(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            raise Boom("forward")

        @staticmethod
        def backward(ctx, g):
            return g

    a = _leaf(5)
    with pytest.raises(Boom, match="forward"), offload():
        Fails.apply(a * 2)
    _grads_match(lambda x: (x * 2).sin(), [a], offload())


def test_errors_in_backward_propagate_and_the_offloader_recovers(offload):
    class Fails(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clone()

        @staticmethod
        @once_differentiable
        def backward(ctx, g):
            raise ValueError("backward")

    a = _leaf(5)
    with offload():
        y = Fails.apply(a * 2).sin()
    with pytest.raises(ValueError, match="backward"):
        y.sum().backward()
    _grads_match(lambda x: (x * 2).sin(), [a], offload())


# --------------------------------------------------------------------- how often
def test_one_pack_per_saved_tensor(offload):
    x = torch.ones(4, requires_grad=True)
    y = torch.full((4,), 3.0)
    off = offload()
    with off:
        out = x * y  # only y is needed for x's gradient
    assert off.stats.tensors_packed == 1
    out.sum().backward()
    assert bit_equal(x.grad, y)


def test_wrapped_numbers_are_not_packed(offload):
    a = _leaf(5)
    off = offload()
    with off:
        out = (a * 3).sum()
    assert off.stats.tensors_packed == 0
    (g,) = torch.autograd.grad(out, (a,))
    assert bit_equal(g, torch.full_like(a, 3.0))


def test_sparse_saved_tensors_are_left_alone(offload):
    def f(x):
        return (x * x).to_dense()

    x = torch.sparse_coo_tensor(
        torch.tensor([[1, 1]]), torch.tensor([1.5, 2.5]), (3,), check_invariants=True
    )
    plain = x.clone().requires_grad_()
    moved = x.clone().requires_grad_()
    f(plain).sum().backward()
    off = offload()
    with off:
        out = f(moved)
    out.sum().backward()
    assert torch.equal(moved.grad.to_dense(), plain.grad.to_dense())
    assert off.stats.tensors_offloaded == 0


# --------------------------------------------------------------------- custom Functions
class _MulAdd(Function):
    """Saves both inputs; differentiable backward (double backward works)."""

    @staticmethod
    def forward(ctx, t1, scalar, t2):
        ctx.scalar = scalar
        ctx.save_for_backward(t1, t2)
        return t1 + scalar * t2 + t1 * t2

    @staticmethod
    def backward(ctx, g):
        t1, t2 = ctx.saved_tensors
        return g + g * t2, None, g * ctx.scalar + g * t1


def test_custom_function_saved_inputs_with_create_graph(offload):
    def run(ctx):
        x, y = _leaf(5, 5, seed=1), _leaf(5, 5, seed=2)
        with ctx:
            out = _MulAdd.apply(x, 2, y)
        go = torch.ones((), requires_grad=True)
        out.sum().backward(go, create_graph=True)
        assert x.grad.grad_fn is not None and y.grad.grad_fn is not None
        (x.grad.sum() + y.grad.sum()).backward()  # through the saved tensors again
        return x.grad.detach(), y.grad.detach(), go.grad

    want = run(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    got = run(offload())
    assert all(bit_equal(a, b) for a, b in zip(got, want))


def test_custom_function_saving_its_output(offload):
    class Exp(Function):
        @staticmethod
        def forward(ctx, x):
            out = x.exp()
            ctx.save_for_backward(out)
            return out

        @staticmethod
        def backward(ctx, g):
            (out,) = ctx.saved_tensors
            return g * out

    _grads_match(lambda x: Exp.apply(x * 2), [_leaf(6)], offload())


def test_custom_function_saving_a_detached_intermediate(offload):
    class Func(Function):
        @staticmethod
        def forward(ctx, x):
            mid = x.exp()
            ctx.save_for_backward(mid.clone().detach_().requires_grad_(True))
            return x.exp()

        @staticmethod
        def backward(ctx, g):
            (mid,) = ctx.saved_tensors
            return g * mid

    _grads_match(lambda x: Func.apply(x), [_leaf(6)], offload())


def test_custom_function_saving_none_and_non_tensors(offload):
    class Func(Function):
        @staticmethod
        def forward(ctx, x, k):
            ctx.k = k
            ctx.save_for_backward(x, None)
            return x * k

        @staticmethod
        def backward(ctx, g):
            x, none = ctx.saved_tensors
            assert none is None
            return g * ctx.k + 0 * x, None

    _grads_match(lambda x: Func.apply(x, 3.0), [_leaf(6)], offload())


def test_custom_function_that_modifies_its_input_in_place(offload):
    class Double(Function):
        @staticmethod
        def forward(ctx, x):
            x.mul_(2)
            ctx.mark_dirty(x)
            ctx.save_for_backward(x)
            return x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * 2 + 0 * x

    _grads_match(lambda x: Double.apply(x * 1).sin(), [_leaf(6)], offload())


def test_unpacked_tensor_has_its_own_version_counter(offload):
    seen = {}

    class Func(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.sin()

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            before = h._version
            x.add_(1)
            seen["same"] = h._version == before
            return g

    h = _leaf(5) * 1
    with offload():
        out = Func.apply(h)
    out.sum().backward()
    assert seen["same"]


# --------------------------------------------------------------------- double backward
def test_double_backward_offload_around_everything(offload):
    def run(ctx):
        a = _leaf(5)
        with ctx:
            (g,) = torch.autograd.grad((a**3).sum(), (a,), create_graph=True)
            g.sum().backward()
        return a.grad

    assert bit_equal(
        run(offload()), run(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    )


def test_double_backward_offload_around_the_forward_only(offload):
    def run(ctx):
        a = _leaf(5)
        with ctx:
            s = (a**3).sum()
        (g,) = torch.autograd.grad(s, (a,), create_graph=True)
        g.sum().backward()
        return a.grad

    assert bit_equal(
        run(offload()), run(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    )


def test_double_backward_offload_around_the_backward_only(offload):
    def run(ctx):
        a = _leaf(5)
        s = (a**3).sum()
        with ctx:  # the saved tensors of the backward graph go through the offloader
            (g,) = torch.autograd.grad(s, (a,), create_graph=True)
        g.sum().backward()
        return a.grad

    assert bit_equal(
        run(offload()), run(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    )


# --------------------------------------------------------------------- checkpoint
def _pows(a):
    return a.pow(2).pow(2).pow(2).pow(2)


def test_offload_around_a_checkpointed_region(offload):
    def f(a):
        h = a.pow(2)
        h = checkpoint(lambda x: x.pow(2).pow(2), h, use_reentrant=False)
        return h.pow(2)

    _grads_match(f, [_leaf(2, 2)], offload())
    _grads_match(_pows, [_leaf(2, 2)], offload())


def test_offload_inside_a_checkpointed_function(offload):
    def f(a):
        h = a.pow(2)
        with offload():
            h = h.pow(2).pow(2)
        return h.pow(2)

    a = _leaf(2, 2)
    plain = a.detach().clone().requires_grad_()
    _pows(plain).sum().backward()
    checkpoint(f, a, use_reentrant=False).sum().backward()
    assert bit_equal(a.grad, plain.grad)


# --------------------------------------------------------------------- views and layouts
def test_a_saved_strided_view_comes_back_with_its_strides(offload):
    x = _leaf(8, 6) * 1
    v = x[::2, 1:]
    with offload():
        y = v * v
    saved = y.grad_fn._saved_self
    assert bit_equal(saved, v.detach()) and saved.stride() == v.stride()
    assert saved.storage_offset() == v.storage_offset()
    y.sum().backward()


def test_a_view_and_its_base_saved_together(offload):
    def f(x):
        a = x * 1
        return a.sin() + a.t().cos().t() + a[1:].exp().sum()

    off = offload()
    _grads_match(f, [_leaf(6, 6)], off)
    assert off.stats.bytes_deduplicated > 0


def test_channels_last_convolution(offload):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)

    def f(inp):
        return torch.nn.functional.gelu(conv(inp)) * 2

    _grads_match(f, [x.requires_grad_()], offload())


def test_integer_and_bool_saved_tensors(offload):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    idx = torch.tensor([[1, 2, 3], [4, 5, 9]])
    mask = torch.tensor([[True, False, True], [False, True, True]])

    def f(w):
        e = torch.nn.functional.embedding(idx, w)  # saves the int64 indices
        e = e.masked_fill(mask.unsqueeze(-1), 0.0)  # saves the bool mask
        return torch.where(mask.unsqueeze(-1), e.sin(), e.cos())

    _grads_match(f, [emb.weight.detach().clone().requires_grad_()], offload())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_saved_tensors_of_every_float_dtype(offload, dtype):
    _grads_match(
        lambda a, b: (a * b).sin() * a,
        [_leaf(7, dtype=dtype, seed=1), _leaf(7, dtype=dtype, seed=2)],
        offload(),
    )


def test_autocast_bf16(offload):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.nn.functional.gelu(lin(x)).float()

    plain_x, x = _leaf(4, 8), _leaf(4, 8)
    f(plain_x).sum().backward()
    want = lin.weight.grad.clone()
    lin.zero_grad()
    with offload():
        out = f(x)
    out.sum().backward()
    assert bit_equal(x.grad, plain_x.grad) and bit_equal(lin.weight.grad, want)


# --------------------------------------------------------------------- retain_graph, partial grads
def test_retain_graph_and_a_second_backward(offload):
    def run(ctx):
        a = _leaf(6)
        with ctx:
            y = (a * 2).sin().exp()
        y.sum().backward(retain_graph=True)
        first = a.grad.clone()
        y.sum().backward()
        return first, a.grad

    got = run(offload())
    want = run(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    assert all(bit_equal(a, b) for a, b in zip(got, want))


def test_second_backward_without_retain_graph_raises_like_plain(offload):
    a = _leaf(6)
    with offload():
        y = (a * 2).sin()
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()


def test_grad_of_a_subset_of_inputs_then_the_rest(offload):
    def run(ctx):
        a, b = _leaf(5, seed=1), _leaf(5, seed=2)
        with ctx:
            y = (a * b).sin() * a.exp()
        (ga,) = torch.autograd.grad(y.sum(), a, retain_graph=True)
        y.sum().backward(inputs=[b])
        return ga, b.grad

    got = run(offload())
    want = run(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    assert all(bit_equal(a, b) for a, b in zip(got, want))


# --------------------------------------------------------------------- grad modes
def test_no_grad_inside_offload_packs_nothing(offload):
    a = _leaf(6)
    off = offload()
    with off, torch.no_grad():
        y = (a * 2).sin()
    assert off.stats.tensors_packed == 0 and y.grad_fn is None


def test_inference_mode_inside_offload_packs_nothing(offload):
    a = _leaf(6)
    off = offload()
    with off, torch.inference_mode():
        y = (a * 2).sin()
    assert off.stats.tensors_packed == 0 and y.is_inference()


def test_enable_grad_inside_no_grad_inside_offload(offload):
    a = _leaf(6)
    off = offload()
    with off, torch.no_grad(), torch.enable_grad():
        y = (a * 2).sin()
    assert off.stats.tensors_packed > 0
    y.sum().backward()
    assert bit_equal(a.grad, ((a * 2).cos() * 2).detach())


# --------------------------------------------------------------------- in-place modification (issue 12 #11)
_INPLACE = "modified by an inplace operation"


def _plain_raises(build) -> None:
    """The same program without offload raises PyTorch's in-place error (so must the port)."""
    y = build()
    with pytest.raises(RuntimeError, match=_INPLACE):
        y.sum().backward()


def test_inplace_change_of_a_saved_input_after_forward_raises(offload):
    x = _leaf(64)
    with offload():
        h = x * 2
        y = h.sin()
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match=_INPLACE):
        y.sum().backward()


def test_inplace_change_of_a_saved_output_after_forward_raises(offload):
    x = _leaf(64)
    with offload():
        y = (x * 2).exp()
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError, match=_INPLACE):
        y.sum().backward()


def test_inplace_change_of_the_base_of_a_saved_view_raises(offload):
    x = _leaf(8, 8)
    with offload():
        h = x * 2
        y = h[2:].sin()
    with torch.no_grad():
        h.zero_()
    with pytest.raises(RuntimeError, match=_INPLACE):
        y.sum().backward()


def test_inplace_change_inside_the_block_after_the_save_raises(offload):
    x = _leaf(64)
    with offload():
        h = x * 2
        y = h.sin()
        h.add_(1)  # a later op of the same forward
    with pytest.raises(RuntimeError, match=_INPLACE):
        y.sum().backward()


def test_plain_pytorch_raises_on_those_programs():
    """The control: these programs are errors in plain PyTorch too."""

    def saved_input():
        x = _leaf(64)
        h = x * 2
        y = h.sin()
        with torch.no_grad():
            h.add_(1)
        return y

    def saved_output():
        x = _leaf(64)
        y = (x * 2).exp()
        with torch.no_grad():
            y.mul_(2)
        return y

    _plain_raises(saved_input)
    _plain_raises(saved_output)


def test_inplace_change_of_an_unsaved_tensor_is_fine(offload):
    x = _leaf(64)
    with offload():
        h = x * 2
        y = h.sin()
        k = x + 1  # saved by nobody
    with torch.no_grad():
        k.add_(1)
    y.sum().backward()
    assert bit_equal(x.grad, ((x * 2).cos() * 2).detach())


# --------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_saved_tensors_leave_the_device_during_forward():
    """``test_graph_save_on_cpu_cuda``: with every saved tensor offloaded, memory held by the graph
    after forward is what a no-grad forward holds (no prefetch window, copies drained)."""

    def f(x):
        a = x + 1
        return a * a

    x = torch.ones(1 << 20, device="cuda", requires_grad=True)
    with torch.no_grad():
        y = f(x)
    torch.cuda.synchronize()
    without_grad = torch.cuda.memory_allocated()
    del y
    off = tt.Offloader("host", min_bytes=0, prefetch_budget=0)
    try:
        with off:
            y = f(x)
        off._engine.synchronize()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - without_grad
        records = [r for r in (ref() for ref in off._pass.order) if r is not None]
        # H100 run 2 failed here: prefetch_budget=0 still read one record back (fixed since)
        assert held == 0, (
            f"{held} B more than a no-grad forward; window {off._pass.window} B, records "
            f"(nbytes, source held, fetched): "
            f"{[(r.nbytes, r.source is not None, r.fetched is not None) for r in records]}; "
            f"{off.stats}"
        )
        y.sum().backward()
        assert torch.equal(x.grad, 2 * (x.detach() + 1))
    finally:
        off.close()


@pytest.mark.gpu
def test_cuda_run_gives_a_cpu_saved_tensor_back_on_the_cpu():
    """Review #6: a CPU tensor saved during a CUDA forward must come back on the CPU."""

    class Mixed(Function):
        @staticmethod
        def forward(ctx, x, host):
            ctx.save_for_backward(host)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (host,) = ctx.saved_tensors
            assert host.device.type == "cpu", host.device
            return g * 2, None

    x = torch.ones(4, device="cuda", requires_grad=True)
    host = torch.randn(1 << 19)  # 2 MiB
    off = tt.Offloader("host", min_bytes="1MiB")
    try:
        with off:
            y = Mixed.apply(x, host)
        y.sum().backward()
    finally:
        off.close()
