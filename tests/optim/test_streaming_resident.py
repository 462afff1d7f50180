"""``stream_parameters``: what runs inside ``resident()``, parameters read outside their module's
forward, and a constructor that fails late (stop 37's leads)."""

import os

import pytest
import torch
import torch.nn.functional as F

import tensortier as tt
from tensortier.errors import ConfigError
from tests.optim.test_streaming import _model


def _same_grads(m, ref) -> None:
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_forward_inside_resident_backpropagates_as_the_resident_model(tier, spill_dir):
    """``resident()`` ran its block under ``no_grad``: a forward there had no graph, and
    ``backward()`` failed with torch's "element 0 of tensors does not require grad"."""
    ref, m = _model(), _model()
    streamer = tt.stream_parameters(m, tier=tier, spill_dir=spill_dir)
    x = torch.randn(5, 8)
    try:
        with streamer.resident():  # forward and backward inside
            y = m(x)
            assert torch.equal(y, ref(x).detach())
            y.square().sum().backward()
        ref(x).square().sum().backward()
        _same_grads(m, ref)
        with streamer.resident():  # forward inside, backward after the block
            loss = m(x).square().sum()
        loss.backward()
        ref(x).square().sum().backward()
        _same_grads(m, ref)
        with streamer.resident(), torch.no_grad():  # an evaluation stays one
            assert not m(x).requires_grad
    finally:
        streamer.close()


def test_a_step_then_a_forward_inside_resident_match_the_resident_model():
    """A forward inside ``resident()`` after the step loaded and prefetched the tier's values
    from before the step (stored back only at the block's end); the prefetch of the next unit
    stayed pending, and the next forward after the block used those stale values: silently
    wrong outputs."""
    ref, m = _model(), _model()
    streamer = tt.stream_parameters(m)
    opts = [torch.optim.SGD(x.parameters(), lr=0.1) for x in (ref, m)]
    x = torch.randn(5, 8)
    try:
        for model in (ref, m):
            model(x).sum().backward()
        opts[0].step()
        with streamer.resident():
            opts[1].step()
            loss = m(x).square().sum()  # with the updated values, as in plain torch
            loss.backward()
            m[0](x)  # a submodule alone: its unit used to prefetch the next one
        ref(x).square().sum().backward()
        _same_grads(m, ref)
        assert torch.equal(m(x), ref(x))
    finally:
        streamer.close()


class _TiedByParent(torch.nn.Module):
    """The parent reads its child's weight itself (nanoGPT-style tying, ``F.linear``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(12, 8)
        self.body = torch.nn.Linear(8, 8)

    def forward(self, idx):
        return F.linear(self.body(self.embed(idx)), self.embed.weight)


def test_a_parent_reading_a_childs_parameter_is_refused_naming_the_fix():
    """The parent computed with the child's NaN placeholder: a NaN loss, silently wrong."""
    ref, m = _TiedByParent(), _TiedByParent()
    streamer = tt.stream_parameters(m)
    idx = torch.tensor([[1, 2, 3]])
    try:
        with pytest.raises(ConfigError, match=r"'embed\.weight'.*outside.*resident\(\)"):
            m(idx)
        with streamer.resident():  # the fix the error names: the whole model installed
            m(idx).square().sum().backward()
        ref(idx).square().sum().backward()
        _same_grads(m, ref)
        assert torch.equal(m.body(m.embed(idx)), ref.body(ref.embed(idx)))  # still streams
    finally:
        streamer.close()


def test_state_dict_of_a_parameter_replaced_while_streamed_is_refused():
    """HF ``resize_token_embeddings`` copies ``weight.data`` (the NaN placeholder) and then sets
    ``weight.data``: the next forward said so, but ``state_dict()`` (``save_pretrained``) saved
    the NaN rows silently."""
    m = _model()
    streamer = tt.stream_parameters(m)
    with torch.no_grad():
        m[0].weight.data = torch.cat([m[0].weight.data, m[0].weight.data[:1]])
    try:
        with pytest.raises(ConfigError, match="resize_token_embeddings.*close"):
            m.state_dict()
    finally:
        streamer.close()


def test_a_constructor_failing_late_leaves_no_files_and_the_model_intact(spill_dir):
    """A failure after the tier was written (here a buffer that cannot move) left the spill file
    and the loader until garbage collection, while the error was held (a notebook's last
    traceback keeps it)."""
    m = _model()
    want = [p.detach().clone() for p in m.parameters()]
    m[2].register_buffer("lazy", torch.empty(3, device="meta"))
    with pytest.raises(NotImplementedError) as info:
        tt.stream_parameters(m, tier="disk", spill_dir=spill_dir)
    assert info.value is not None  # the error, and its frames, are still held
    assert [f for _, _, fs in os.walk(spill_dir) for f in fs] == []
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), want))
    del m[2].lazy
    tt.stream_parameters(m).close()  # nothing is left marked as streamed


def test_replacing_a_child_that_holds_streamed_parameters_is_refused_a_wrapper_is_not():
    """A child rebuilt from the placeholders (HF ``resize_token_embeddings``' untied head)
    replaced the streamed one: its weights were lost, even after ``close()``."""
    ref, m = _model(), _model()
    streamer = tt.stream_parameters(m)
    x = torch.randn(3, 8)
    try:
        with pytest.raises(ConfigError, match=r"child module '4' holds parameter '4\.weight'"):
            m[4] = torch.nn.Linear(16, 2)
        m[1] = torch.nn.Sequential(m[1])  # keeps what it wraps (a parameterless child, too)
        m[4] = torch.nn.Sequential(m[4], torch.nn.Identity())  # a wrapper keeps the child
        assert torch.equal(m(x), ref(x))
    finally:
        streamer.close()


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward makes its stream lag, and marks when that stream caught up."""

    done: list = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        torch.cuda._sleep(2_000_000_000)  # about a second: the host is long done by then
        _SleepInBackward.done.append(torch.cuda.Event())
        _SleepInBackward.done[-1].record()
        return g


class _TwoStreams(torch.nn.Module):
    """Branch ``a`` on the current stream, branch ``b`` on a side stream, independent."""

    def __init__(self, side):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.side = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256), side

    def forward(self, x):
        main = torch.cuda.current_stream()
        ha = self.a(x)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            hb = self.b(_SleepInBackward.apply(x))
        main.wait_stream(self.side)
        return ha + hb


@pytest.mark.gpu
def test_cuda_a_unit_read_on_a_side_stream_in_backward_is_released_on_that_stream():
    """Backward released a unit on the stream of the *next* unit's node. ``b``'s backward ran
    on the side stream and ``a``'s on the current one, independent: the budget counted ``b``'s
    bytes as free while the side stream was still reading them (with ``budget`` = one unit,
    ``a`` was loaded before the side stream was done, the host never waited for it)."""
    side = torch.cuda.Stream()
    ref, m = _TwoStreams(side).cuda(), _TwoStreams(side)
    x = torch.randn(8, 256, device="cuda", requires_grad=True)
    ref(x).square().sum().backward()
    streamer = tt.stream_parameters(m, budget=256 * 257 * 4, device="cuda")
    try:
        _SleepInBackward.done.clear()
        m(x).square().sum().backward()
        # loading ``a`` waited for ``b``'s release, recorded after the sleep on the side stream
        assert _SleepInBackward.done[-1].query()
        torch.cuda.synchronize()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
    finally:
        streamer.close()


def test_re_tying_a_streamed_parameter_is_refused_naming_close():
    """``head.weight = embed.weight`` (HF ``tie_weights``) while streamed: the head's unit kept
    installing its old parameter, so its forward read the tied one's NaN placeholder: a wrong
    evaluation silently, and in training an error that named this very tying as the fix."""
    ref, m = _model(), _model()
    streamer = tt.stream_parameters(m)
    try:
        with pytest.raises(ConfigError, match=r"Linear\.weight = \.\.\..*close\(\) first"):
            m[2].inner[0].weight = m[3].inner[0].weight
        with pytest.raises(ConfigError, match=r"Linear\.weight = \.\.\."):
            m[4].weight = torch.nn.Parameter(torch.zeros(2, 16))
        m[4].weight = m[4].weight  # the same Parameter again (an idempotent tie_weights)
        x = torch.randn(3, 8)
        with torch.no_grad():
            assert torch.equal(m(x), ref(x))
    finally:
        streamer.close()
    m[2].inner[0].weight = m[3].inner[0].weight  # closed: the model is the user's again


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_parameter_replaced_inside_resident_is_refused_and_the_rest_is_kept(tier, spill_dir):
    """``resize_token_embeddings`` (or ``.half()``) inside ``resident()``: the host tier failed
    at the block's end in torch's ``copy_`` (size mismatch), leaving the later parameters
    installed; the disk tier stored the new value while the parameter went back to the old
    placeholder: the module computed with the old shape, silently."""
    ref, m = _model(), _model()
    streamer = tt.stream_parameters(m, tier=tier, spill_dir=spill_dir)
    x = torch.randn(3, 8)
    try:
        refused = pytest.raises(ConfigError, match=r"'0\.weight' was replaced inside resident")
        with refused, streamer.resident(), torch.no_grad():
            m[0].weight.data = torch.zeros(17, 8)
            m[4].bias.add_(1)  # an update next to it is kept
            ref[4].bias.add_(1)
        assert torch.equal(m(x), ref(x))
    finally:
        streamer.close()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters()))


def test_a_load_that_fails_entering_resident_installs_nothing():
    """A read failing on the third unit as ``resident()`` began left the first units installed
    for good (their device memory never released, outside the budget's count)."""
    ref, m = _model(), _model()
    streamer = tt.stream_parameters(m)
    start, calls = streamer._start, []

    def failing_third(u):
        calls.append(u.index)
        if len(calls) == 3:
            raise OSError("a read failed")
        return start(u)

    streamer._start = failing_third
    try:
        with pytest.raises(OSError, match="read failed"), streamer.resident():
            pass
        assert all(torch.isnan(p).all() for p in m.parameters())  # placeholders, every one
        streamer._start = start
        x = torch.randn(3, 8)
        assert torch.equal(m(x), ref(x))
    finally:
        streamer.close()


class _GraphConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, adj, x):
        return torch.sparse.mm(adj, x @ self.weight)  # a unit's forward saves ``adj``


class _Graph(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = _GraphConv()

    def forward(self, adj, x):
        return self.conv(adj, torch.sparse.mm(adj, x))  # saved outside any unit too


def test_a_sparse_tensor_saved_by_a_streamed_model_trains_as_the_resident_model():
    """A GNN's sparse adjacency saved for backward (outside and inside a unit): the saved-tensor
    hook asked it for its storage, "Cannot access storage of SparseTensorImpl"."""
    ref, m = _Graph(), _Graph()
    streamer = tt.stream_parameters(m)
    adj = torch.eye(5).to_sparse().requires_grad_()
    x = torch.randn(5, 4, requires_grad=True)
    try:
        for model in (ref, m):
            model(adj, x).square().sum().backward()
        _same_grads(m, ref)
    finally:
        streamer.close()
