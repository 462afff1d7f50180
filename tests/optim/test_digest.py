"""Gradient digests (``optim/_digest.py``): what speculation's validation on CUDA relies on.

The digest must equal an int64 reference exactly (CPU and any device), see every change a
training loop can make to a gradient (one byte, a sign, a swap, ulp steps that cancel in a plain
sum, a zeroed or scaled tensor), and a device whose kernel fails or disagrees must fall back to the
full comparison with the same results."""

import logging
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensortier.optim import OffloadedAdamW
from tensortier.optim._digest import COLS, MIN_ROWS, Digests, K

CPU = torch.device("cpu")


def _grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(MIN_ROWS * K // 4 + 1000, generator=g),  # whole rows, then a tail
        torch.randn(64, 48, generator=g),  # tail only
        torch.randn(5, 3, generator=g).to(torch.bfloat16),
        torch.randn(40, 30, generator=g)[:, ::3],  # not contiguous
    ]


def test_digest_equals_the_int64_reference_and_the_same_bits_give_the_same_digest():
    d = Digests(seed=7)
    grads = _grads()
    got = d.of(grads)
    assert got.dtype == torch.int32 and torch.equal(got, d.reference(grads))
    assert torch.equal(d.of([g.clone() for g in grads]), got)  # content, not identity
    assert torch.equal(Digests(seed=7).of(grads), got)  # the matrix is the seed's
    assert not torch.equal(Digests(seed=8).of(grads), got)
    # 0.4% of the bytes of whole rows (8 int32 per 8 KiB), one padded block for the rest
    assert got.numel() == MIN_ROWS * COLS + MIN_ROWS * COLS


def _changed(grads, i, fn):
    out = [g.clone() for g in grads]
    out[i] = fn(out[i])
    return out


def _flip_byte(t, pos, mask=1):
    b = t.view(-1).view(torch.uint8)
    b[pos] ^= mask
    return t


CHANGES = {
    "one low bit in the rows": lambda gs: _changed(gs, 0, lambda t: _flip_byte(t, 12345)),
    "one high bit in the tail": lambda gs: _changed(
        gs, 0, lambda t: _flip_byte(t, t.numel() * 4 - 1, 0x80)
    ),
    "a sign in a bf16 tensor": lambda gs: _changed(gs, 2, lambda t: _flip_byte(t, 5, 0x80)),
    "every sign (negated)": lambda gs: _changed(gs, 0, lambda t: -t),
    "two elements swapped": lambda gs: _changed(
        gs, 1, lambda t: t.view(-1)[[1, 0, *range(2, t.numel())]].view_as(t)
    ),
    "scaled by 0.5 (clipping)": lambda gs: _changed(gs, 0, lambda t: t * 0.5),
    "zeroed": lambda gs: _changed(gs, 1, torch.zeros_like),
    "+1 and -1 ulp, cancelling in a sum": lambda gs: _changed(
        gs, 0, lambda t: _ulps(t, [(3, 1), (4, -1)])
    ),
    "+1 -2 +1 ulp in a row": lambda gs: _changed(
        gs, 0, lambda t: _ulps(t, [(100, 1), (101, -2), (102, 1)])
    ),
}


def _ulps(t, steps):
    w = t.view(torch.int32)
    for i, s in steps:
        w[i] += s
    return t


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_kind_of_change_changes_the_digest(change):
    d = Digests(seed=3)
    grads = _grads()
    assert not torch.equal(d.of(CHANGES[change](grads)), d.of(grads))


@settings(max_examples=40, deadline=None)
@given(
    pos=st.lists(st.integers(0, MIN_ROWS * K + 3999), min_size=1, max_size=4, unique=True),
    delta=st.integers(1, 255),
)
def test_any_few_bytes_changed_change_the_digest(pos, delta):
    d = Digests(seed=5)
    grads = _grads()
    changed = [g.clone() for g in grads]
    b = changed[0].view(-1).view(torch.uint8)
    for p in pos:
        b[p] = (int(b[p]) + delta) % 256
    assert not torch.equal(d.of(changed), d.of(grads))


def _tiny_model(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return m.to(device)


def _tiny(validate: str, device: str = "cpu"):
    """(model, optimizer, data generator): three buckets; ``validate="none"``: no speculation."""
    m = _tiny_model(device)
    opt = OffloadedAdamW(m.parameters(), lr=1e-2, bucket_size="1KiB", overlap=validate != "none",
                         validate="bits" if validate == "none" else validate)  # fmt: skip
    return m, opt, torch.Generator().manual_seed(1)


def _speculating_run(validate: str):
    m, opt, g = _tiny(validate)
    for i in range(6):
        m(torch.randn(8, 16, generator=g)).square().mean().backward()
        if i == 3:
            opt._spec.wait()
            m[0].weight.grad.data.mul_(2)  # no version bump: seen by content only
        opt.step()
        opt.zero_grad()
    stats = opt.stats()
    opt.close()
    return torch.cat([p.detach().flatten() for p in m.parameters()]), stats


@pytest.mark.parametrize("broken", ["fails", "disagrees", "fails later"])
def test_a_device_whose_kernel_fails_or_disagrees_falls_back_to_comparing_bits(
    broken, monkeypatch, caplog
):
    """``fails later``: the check passes, then a bucket's digest fails in a backward hook (a shape
    the check did not try): training goes on, compared bit for bit from then on."""
    reference, bits = _speculating_run("bits")
    assert bits.digest_checks == 0 and bits.unversioned_edits == 1
    real, calls = torch._int_mm, []

    def int_mm(a, b):
        calls.append(a.shape)
        if broken == "fails" or (broken == "fails later" and len(calls) > 6):
            raise RuntimeError("no int8 GEMM for this shape")
        return real(a, b) + (broken == "disagrees")

    monkeypatch.setattr(torch, "_int_mm", int_mm)
    with caplog.at_level(logging.WARNING, logger="tensortier.optim.adamw"):
        params, stats = _speculating_run("digest")
    assert "full comparison" in caplog.text
    assert torch.equal(params, reference)
    assert stats.compare_seconds > 0 and stats.unversioned_edits == 1  # compared bit for bit
    assert stats.validated == bits.validated > 0
    assert (stats.digest_checks > 0) == (broken == "fails later")  # digested until it failed
    monkeypatch.undo()
    params, stats = _speculating_run("digest")
    assert torch.equal(params, reference) and stats.digest_checks > 0
    assert stats.unversioned_edits == 1 and stats.compare_seconds == 0


def test_validate_is_checked():
    from tensortier.errors import ConfigError

    with pytest.raises(ConfigError, match="validate='hash'.*'auto', 'digest', 'bits'"):
        OffloadedAdamW([torch.nn.Parameter(torch.zeros(3))], validate="hash")


@pytest.mark.gpu
def test_cuda_digests_equal_the_cpu_reference():
    d = Digests(seed=11)
    assert d.usable(torch.device("cuda"))
    grads = _grads()
    got = d.of([g.cuda() for g in grads])
    assert got.is_cuda and torch.equal(got.cpu(), d.reference(grads))
    for change in CHANGES.values():
        assert not torch.equal(d.of([g.cuda() for g in change(grads)]).cpu(), got.cpu())


def _reinterpreting_run(validate: str, edit):
    """Five steps; after the fourth backward, ``edit`` swaps a gradient's ``.data`` for the same
    bytes under another dtype or shape (no version bump on ``.grad``, same bytes to a digest)."""
    m, opt, g = _tiny(validate)
    for i in range(5):
        m(torch.randn(8, 16, generator=g)).square().mean().backward()
        if i == 3:
            opt._spec.wait()
            grad = m[0].weight.grad
            grad.data = edit(grad.data)
        opt.step()
        opt.zero_grad()
    stats = opt.stats()
    opt.close()
    return torch.cat([p.detach().flatten() for p in m.parameters()]), stats


@pytest.mark.parametrize("edit", [lambda t: t.view(torch.int32)], ids=["dtype"])
def test_a_gradient_reinterpreted_under_another_layout_is_not_kept_on_its_digest(edit):
    """The digest sees bytes only: a gradient whose ``.data`` became the same bytes as int32 must
    be redone as the full comparison redoes it (it checks the dtype), giving the results of
    ``overlap=False``. (The same bytes under another shape are refused by ``step()`` in every
    mode: ``test_adamw.py``'s ``..._not_shaped_like_its_parameter_...``.)"""
    plain, _ = _reinterpreting_run("none", edit)
    bits_params, bits = _reinterpreting_run("bits", edit)
    params, digest = _reinterpreting_run("digest", edit)
    assert bits.redone == 1 and torch.equal(bits_params, plain)
    assert digest.digest_checks > 0
    assert digest.redone == bits.redone, digest
    assert torch.equal(params, plain)


def test_a_gradient_at_an_unaligned_address_is_digested_from_aligned_operands(monkeypatch):
    """A gradient can be a view at any offset of a larger buffer (autograd steals the slices of
    ``torch.cat``'s gradient); cuBLASLt's int8 GEMM needs 4-byte aligned operands (16 for its fast
    kernels), so every operand handed to ``_int_mm`` must be 16-byte aligned, with the digest of the
    same bytes at an aligned address."""
    buf = torch.randn(MIN_ROWS * K + 300, generator=torch.Generator().manual_seed(2))
    view = buf.to(torch.bfloat16)[1:]  # 2 bytes past an aligned start: whole rows and a tail
    assert view.data_ptr() % 4 == 2
    d, real, seen = Digests(seed=4), torch._int_mm, []

    def int_mm(a, b):
        seen.append((a.data_ptr() % 16, b.data_ptr() % 16))
        return real(a, b)

    monkeypatch.setattr(torch, "_int_mm", int_mm)
    got = d.of([view])
    assert seen and all(s == (0, 0) for s in seen), seen
    assert torch.equal(got, d.of([view.clone()])) and torch.equal(got, d.reference([view]))


def test_every_int8_gemm_has_the_shapes_and_layout_cuda_takes(monkeypatch):
    """The CPU's ``_int_mm`` takes any operands; CUDA's (``_int_mm_out_cuda``, cuBLASLt) needs more
    than 16 rows, ``K`` and the columns multiples of 8, and the layout PyTorch's ``test__int_mm``
    shows working on every GPU generation: ``a`` row-major, ``b`` column-major (a row-major ``b``
    fails before sm80 and is several times slower after). Checked here on every call a training
    run makes, so a change that would only fall back (slower) on a GPU fails on the CPU."""
    real, seen = torch._int_mm, []

    def int_mm(a, b):
        seen.append(a.shape)
        assert a.dim() == b.dim() == 2 and a.size(1) == b.size(0)
        assert a.size(0) > 16 and a.size(1) % 8 == 0 and b.size(1) % 8 == 0, (a.shape, b.shape)
        assert a.stride() == (a.size(1), 1), a.stride()  # row-major
        assert b.stride() == (1, b.size(0)), b.stride()  # column-major
        assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
        return real(a, b)

    monkeypatch.setattr(torch, "_int_mm", int_mm)
    d = Digests(seed=9)
    grads = _grads()
    assert torch.equal(d.of(grads), d.reference(grads))
    _, stats = _speculating_run("digest")
    assert stats.digest_checks > 0 and len(seen) > stats.digest_checks


def _restoring_run(validate: str, device: str = "cpu"):
    """Five steps; at the fourth, every gradient is doubled while the snapshots are still to be
    copied, the copies are let run, and the gradients are halved again before ``step()``: the
    same bits as after backward, while a snapshot copied then would hold the doubled ones.

    CPU: the worker is held by a gate until the gradients are doubled. CUDA: the side stream
    sleeps first (the copies queue behind it), the device is synchronized after the doubling."""
    m, opt, g = _tiny(validate, device)
    side = None
    if device == "cuda":
        side = opt._staging._streams.stream(next(m.parameters()).device, "d2h")
    for i in range(5):
        gate = threading.Event()
        if i == 3 and validate != "none":
            if side is None:
                opt._updater.submit(gate.wait)  # a worker copy would run after the gate
            else:
                with torch.cuda.stream(side):
                    torch.cuda._sleep(200_000_000)  # ~0.1 s: backward is queued long before
        m(torch.randn(8, 16, generator=g).to(device)).square().mean().backward()
        if i == 3:
            for p in m.parameters():
                p.grad.mul_(2)
            gate.set()
            if side is None:
                opt._spec.wait()  # the snapshots are taken
            else:
                torch.cuda.synchronize()  # the side stream's copies have run
            for p in m.parameters():
                p.grad.div_(2)  # exact: the bits after backward again
        opt.step()
        opt.zero_grad()
    opt.close()
    return torch.cat([p.detach().flatten() for p in m.parameters()]).cpu()


def _unfenced(monkeypatch):
    """The speculator without its fence: snapshots are copied whenever the copy runs."""
    from tensortier.optim._speculation import Speculator

    monkeypatch.setattr(Speculator, "_fence", lambda self, staged, device: None)


def test_an_edit_undone_while_the_snapshot_is_copied_is_seen(monkeypatch):
    """PROTOCOL.md: a digest is of the gradients when the bucket was ready, so the snapshot must
    not change after it: with digests the CPU snapshot is copied in the hook. Without that fence
    the speculation computed on the doubled copy would be kept (the control at the end)."""
    plain = _restoring_run("none")
    assert torch.equal(_restoring_run("bits"), plain)  # the full comparison reads the snapshot
    assert torch.equal(_restoring_run("digest"), plain)
    _unfenced(monkeypatch)
    assert not torch.equal(_restoring_run("digest"), plain)  # the test sees a missing fence


@pytest.mark.gpu
def test_cuda_an_edit_undone_while_the_snapshot_is_copied_is_seen(monkeypatch):
    """CUDA: the end of backward makes the compute stream wait for the snapshot copies
    (``Staging.fence``), so an edit after backward runs after them."""
    plain = _restoring_run("none", "cuda")
    assert torch.equal(_restoring_run("bits", "cuda"), plain)
    assert torch.equal(_restoring_run("digest", "cuda"), plain)
    _unfenced(monkeypatch)
    assert not torch.equal(_restoring_run("digest", "cuda"), plain)  # the race is reproduced


def test_cuda_fences_are_placed_once_per_device_at_the_end_of_each_backward(monkeypatch):
    """The CUDA fence's plumbing, driven on the CPU with the stream wait recorded: each device
    with a digested snapshot is fenced once, after the last hook of the backward that took it
    (autograd's final callback); a hook run outside a backward fences at once; a backward that
    failed before its end does not stop the next one's fence."""
    _, opt, _ = _tiny("digest")
    spec, events = opt._spec, []
    monkeypatch.setattr(opt._staging, "fence", lambda d: events.append(("fence", str(d))))
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    w = torch.nn.Parameter(torch.ones(3))

    def hook(p):
        for d in (cuda0, cuda1, cuda0):
            events.append(("hook", str(d)))
            spec._fence(None, d)

    w.register_post_accumulate_grad_hook(hook)
    v = torch.nn.Parameter(torch.ones(3))
    v.register_post_accumulate_grad_hook(hook)
    (w * 2).sum().backward()
    assert events == [("hook", "cuda:0"), ("hook", "cuda:1"), ("hook", "cuda:0"),
                      ("fence", "cuda:0"), ("fence", "cuda:1")]  # fmt: skip
    events.clear()
    spec._fence(None, cuda1)  # outside a backward
    assert events == [("fence", "cuda:1")]

    events.clear()
    with pytest.raises(RuntimeError, match="backward failed"):
        (_FailLast.apply(w * 2) + v).sum().backward()  # v's hook runs first (a leaf ready first)
    assert ("hook", "cuda:0") in events and ("fence", "cuda:0") not in events  # hook, failure
    events.clear()
    w.grad = None
    (w * 2).sum().backward()
    assert [e for e in events if e[0] == "fence"] == [("fence", "cuda:0"), ("fence", "cuda:1")]
    opt.close()


def test_cuda_fences_cover_a_device_whose_snapshot_preceded_a_reentrant_backward(monkeypatch):
    """``torch.utils.checkpoint(use_reentrant=True)`` runs a backward of its own inside the
    user's: its final callback comes first. A device snapshotted in the outer backward before it
    (cuda:0) must still be fenced, not dropped when the inner one (cuda:1) takes over."""
    _, opt, _ = _tiny("digest")
    spec, events = opt._spec, []
    monkeypatch.setattr(opt._staging, "fence", lambda d: events.append(("fence", str(d))))
    outer, inner = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    for p, d in ((outer, torch.device("cuda", 0)), (inner, torch.device("cuda", 1))):
        p.register_post_accumulate_grad_hook(lambda p, d=d: spec._fence(None, d))
    x = torch.ones(3, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(lambda x: x * inner, x, use_reentrant=True)
    (y * outer).sum().backward()  # outer's leaf is ready first, then the inner backward runs
    assert sorted(events) == [("fence", "cuda:0"), ("fence", "cuda:1")], events
    opt.close()


def test_a_snapshot_whose_backward_raised_is_compared_bit_for_bit(monkeypatch):
    """A CUDA backward that raised after its hooks took digested snapshots never runs its final
    callback, so no fence orders them before later edits; a ``step()`` called anyway compares
    those snapshots' bits instead of trusting their digests. Driven on the CPU: the fence is
    replaced by what such a backward leaves (the device marked unfenced, the copy unordered)."""
    from tensortier.optim._speculation import Speculator

    plain = _restoring_run("none")

    def unfenced(self, staged, device):
        self.__dict__.setdefault("_unfenced", {})[device] = None

    monkeypatch.setattr(Speculator, "_fence", unfenced)
    assert torch.equal(_restoring_run("digest"), plain)


class _FailLast(torch.autograd.Function):
    """Raises in backward. Made before the model's forward, its node has the lowest sequence
    number on the device's ready queue: it runs after every other node (and hook) of the pass."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("backward failed")


def _failing_run(validate: str):
    """Five CUDA steps; the fourth backward raises after every hook ran (snapshots taken, no
    final callback), the side stream is held so the copies run after the gradients are doubled,
    which are halved back before ``step()``: the same bits, a doubled snapshot."""
    m, opt, g = _tiny(validate, "cuda")
    side = opt._staging._streams.stream(next(m.parameters()).device, "d2h")
    for i in range(5):
        x = torch.randn(8, 16, generator=g).cuda()
        if i != 3:
            m(x).square().mean().backward()
        else:
            doomed = _FailLast.apply(torch.zeros(1, device="cuda", requires_grad=True))
            loss = m(x).square().mean() + doomed.sum()
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)  # ~0.1 s: the snapshot copies queue behind it
            with pytest.raises(RuntimeError, match="backward failed"):
                loss.backward()
            for p in m.parameters():
                p.grad.mul_(2)
            torch.cuda.synchronize()
            for p in m.parameters():
                p.grad.div_(2)
        opt.step()
        opt.zero_grad()
    opt.close()
    return torch.cat([p.detach().flatten() for p in m.parameters()]).cpu()


@pytest.mark.gpu
def test_cuda_a_snapshot_whose_backward_raised_is_compared_bit_for_bit():
    assert torch.equal(_failing_run("digest"), _failing_run("none"))


def _compiled_autograd_run(validate: str):
    """Five steps with backward under compiled autograd (``torch._dynamo.compiled_autograd``,
    as torchtitan's option turns it on), against fused AdamW in eager autograd."""
    from torch._dynamo import compiled_autograd

    ref, (m, opt, g) = _tiny_model(), _tiny(validate)
    want = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for _ in range(5):
        x = torch.randn(8, 16, generator=g)
        ref(x).square().mean().backward()
        want.step()
        want.zero_grad()
        with compiled_autograd._enable(lambda gm: torch.compile(gm, backend="eager")):
            m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    stats = opt.stats()
    opt.close()
    same = all(torch.equal(a, b) for a, b in zip(ref.parameters(), m.parameters()))
    return same, stats


@pytest.mark.parametrize("validate", ["bits", "digest"])
def test_speculation_under_compiled_autograd_is_exact(validate):
    """Compiled autograd traced the gradient hook with dynamo and failed its guards on the
    optimizer's bookkeeping ("Guard failed on the same frame it was created"); the hook runs
    eagerly now, speculating during backward as without it."""
    same, stats = _compiled_autograd_run(validate)
    assert same and stats.launched_in_backward > 0 and stats.redone == 0, stats


def test_a_fence_queued_under_compiled_autograd_is_made_or_its_snapshots_compared_in_full(
    monkeypatch,
):
    """Under compiled autograd (torch 2.13) a final callback queued from a hook does not run:
    the device must then stay unfenced, so that ``step()`` compares its snapshots bit for bit."""
    from torch._dynamo import compiled_autograd

    _, opt, _ = _tiny("digest")
    spec, events = opt._spec, []
    monkeypatch.setattr(opt._staging, "fence", lambda d: events.append(str(d)))
    cuda0 = torch.device("cuda", 0)
    w = torch.nn.Parameter(torch.ones(3))
    w.register_post_accumulate_grad_hook(torch.compiler.disable(lambda p: spec._fence(None, cuda0)))
    with compiled_autograd._enable(lambda gm: torch.compile(gm, backend="eager")):
        (w * 2).sum().backward()
    assert events == ["cuda:0"] or cuda0 in spec._unfenced, (events, spec._unfenced)
    opt.close()
