import pytest
import torch

import tensortier as tt
from tensortier.errors import BudgetError, ConfigError


class Block(torch.nn.Module):
    """A module that owns a parameter and calls children: the owner's values span its children."""

    def __init__(self, d):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(d))
        self.inner = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.LayerNorm(d))

    def forward(self, x):
        return self.inner(x) * self.scale + x


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), Block(16), Block(16), torch.nn.Linear(16, 2)
    )


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_outputs_and_grads_identical_to_resident(tier, spill_dir):
    ref, m = _model(), _model()
    streamer = tt.stream_parameters(m, tier=tier, spill_dir=spill_dir)
    x = torch.randn(5, 8)
    for _ in range(2):  # twice: the second forward reuses the stored values
        y_ref, y = ref(x), m(x)
        assert torch.equal(y, y_ref)
        y_ref.square().sum().backward()
        y.square().sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
    assert streamer.stats().prefetch_hits > 0
    streamer.close()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_params_are_placeholders_between_uses_and_optimizer_step_in_resident():
    ref, m = _model(), _model()
    streamer = tt.stream_parameters(m)
    assert torch.isnan(m[0].weight).all() and m[0].weight.stride() == (0, 0)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for x in torch.randn(3, 4, 8):
        ref(x).sum().backward()
        m(x).sum().backward()
        opt_ref.step()
        with streamer.resident():
            opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    streamer.close()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_budget_too_small_names_minimum():
    with pytest.raises(BudgetError) as info:
        tt.stream_parameters(_model(), budget="100B")
    assert info.value.minimum == 16 * 16 * 4 + 16 * 4
    with pytest.raises(ConfigError):
        tt.stream_parameters(_model(), tier="tape")


# ---------------------------------------------------------------- devices, tied weights, nesting
def _layernorm_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    )


def test_device_spelled_with_an_index_is_the_same_device():
    """``device=cpu:0`` (as ``"cuda"`` vs ``cuda:0``) must match the tensors' ``cpu``: else
    nothing is tokenised, LayerNorm keeps the Parameter itself and backward reads NaN."""
    ref, m = _layernorm_model(), _layernorm_model()
    x = torch.randn(8, 16)
    ref(x).pow(2).mean().backward()
    streamer = tt.stream_parameters(m, device=torch.device("cpu", 0))
    try:
        m(x).pow(2).mean().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
        assert streamer.device == torch.device("cpu")
        # backward loaded the parameters again: autograd held tokens, not the installed values
        assert streamer.stats().loads > len(streamer.units)
    finally:
        streamer.close()


def test_buffers_go_to_the_streaming_device_and_a_shared_one_stays_shared():
    """H100 run 2: ``stream_parameters(cpu_model, device="cuda")`` left the GPT's causal-mask
    buffer on the CPU and the forward failed in ``masked_fill``. Buffers move once, as
    ``model.to(device)`` moves them. This machine has one real device: the move is checked on
    ``meta``, which any CPU tensor can be moved to (the CUDA path: ``test_cuda_device_without_
    index_streams_and_matches_resident``)."""
    from tensortier.optim.streaming import _buffers_to

    m = _layernorm_model()
    shared = torch.arange(4.0)
    m[0].register_buffer("table", shared)
    m[2].register_buffer("table", shared)  # one tensor, two owners (a tied rotary table)
    m[1].register_buffer("empty", None)
    _buffers_to(m, torch.device("meta"))
    assert m[0].table.device.type == "meta" and m[0].table is m[2].table
    assert m[1].empty is None
    assert all(p.device.type == "cpu" for p in m.parameters())  # parameters are the streamer's


def test_tied_weights_are_stored_once_and_match_the_resident_model():
    from tensortier.models.gpt import GPT, GPTConfig, random_batch

    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    m = GPT(cfg)
    assert m.transformer.wte.weight is m.lm_head.weight
    x, y = random_batch(cfg, 2)
    streamer = tt.stream_parameters(m)
    owners = [u.index for u in streamer.units if any(p is m.lm_head.weight for p in u.params)]
    assert len(owners) == 2  # installed for both modules that use it
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    try:
        for _ in range(2):
            loss_ref, loss = ref(x, y), m(x, y)
            assert torch.equal(loss, loss_ref)
            loss_ref.backward()
            loss.backward()
            for p, q in zip(m.parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad)
            opt_ref.step()
            with streamer.resident():
                opt.step()
            opt_ref.zero_grad()
            opt.zero_grad()
        assert sum(s.param is m.lm_head.weight for s in streamer._slots) == 1  # stored once
    finally:
        streamer.close()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert m.transformer.wte.weight is m.lm_head.weight


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_streaming_a_streamed_model_is_refused_and_nothing_is_lost(tier, spill_dir):
    ref, m = _model(), _model()
    first = tt.stream_parameters(m, tier=tier, spill_dir=spill_dir)
    with pytest.raises(ConfigError, match="already streamed.*close"):
        tt.stream_parameters(m, tier=tier, spill_dir=spill_dir)
    with pytest.raises(ConfigError, match="already streamed"):
        tt.stream_parameters(m[2], tier="host")  # part of it, too
    first.close()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    again = tt.stream_parameters(m)  # closed: the model can be streamed again
    again.close()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_a_forward_that_raises_puts_the_placeholders_back():
    class Boom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))
            self.fail = True

        def forward(self, x):
            y = x * self.w
            if self.fail:
                raise RuntimeError("boom")
            return y

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), Boom())
    ref = [p.detach().clone() for p in m.parameters()]
    streamer = tt.stream_parameters(m)
    with pytest.raises(RuntimeError, match="boom"):
        m(torch.randn(2, 4))
    assert all(torch.isnan(p).all() for p in m.parameters())
    m[1].fail = False
    m(torch.randn(2, 4)).sum().backward()
    streamer.close()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), ref))


def test_a_dropped_streamer_is_cleaned_up_by_the_reaper(spill_dir):
    import gc
    import threading

    from tensortier._lifetime import quiesce

    m = _model()
    tt.stream_parameters(m, tier="disk", spill_dir=spill_dir)
    m(torch.randn(2, 8))
    del m
    gc.collect()
    assert quiesce()
    assert not [t for t in threading.enumerate() if t.name.startswith("tt-params")]
    # (the spill_dir fixture checks that the files are gone)


# ---------------------------------------------------------------- CUDA (review findings #2, #10)
def _gpt(n_layer=8, n_embd=512, vocab=256, seq=64):
    from tensortier.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(n_layer=n_layer, n_head=8, n_embd=n_embd, block_size=seq, vocab_size=vocab)
    torch.manual_seed(0)
    return GPT(cfg), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cuda_device_without_index_streams_and_matches_resident(tier, spill_dir):
    from tensortier.models.gpt import random_batch

    ref, cfg = _gpt()
    ref = ref.cuda()
    m, _ = _gpt()  # stays on CPU: the streamer brings it to the GPU
    x, y = random_batch(cfg, 2, device="cuda")
    param_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss_ref = ref(x, y)
    activations = torch.cuda.max_memory_allocated() - base
    loss_ref.backward()
    streamer = tt.stream_parameters(m, device="cuda", tier=tier, spill_dir=spill_dir)
    try:
        assert streamer.device == torch.device("cuda", torch.cuda.current_device())
        # H100 run 2 failed here: the causal mask buffer stayed on the CPU (masked_fill raised)
        off_device = {n: b.device for n, b in m.named_buffers() if b.device != streamer.device}
        assert not off_device, f"buffers not on {streamer.device}: {off_device}"
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = m(x, y)
        torch.cuda.synchronize()
        streamed_peak = torch.cuda.max_memory_allocated() - base
        loss.backward()
        assert torch.equal(loss, loss_ref), (loss.item(), loss_ref.item())
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), f"{name}: {(p.grad - q.grad).abs().max()}"
        # the forward held a few modules' parameters, never all of them
        assert streamed_peak < activations + param_bytes // 2, (
            streamed_peak,
            activations,
            param_bytes,
        )
    finally:
        streamer.close()


@pytest.mark.gpu
def test_cuda_streaming_on_a_side_compute_stream_without_syncs():
    """Copies on the streamer's own stream, consumers wait on its event and ``record_stream``
    the values: a forward on a non-default stream reads the parameters only once they landed,
    and the forward and backward never synchronize the host."""
    from tensortier.models.gpt import random_batch

    ref, cfg = _gpt(n_layer=4, n_embd=1024)
    ref = ref.cuda()
    m, _ = _gpt(n_layer=4, n_embd=1024)
    x, y = random_batch(cfg, 4, device="cuda")
    ref(x, y).backward()
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    # a budget that holds everything: the rate limiter never needs to wait for the GPU
    streamer = tt.stream_parameters(m, budget=2 * total, device="cuda")
    compute = torch.cuda.Stream()
    try:
        for _ in range(2):  # the second pass reuses memory the first freed
            m.zero_grad(set_to_none=True)
            compute.wait_stream(torch.cuda.current_stream())
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.cuda.stream(compute):
                    torch.cuda._sleep(50_000_000)  # compute lags: a racy read would see garbage
                    loss = m(x, y)
                    loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.current_stream().wait_stream(compute)
            for (name, p), q in zip(m.named_parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad), f"{name}: {(p.grad - q.grad).abs().max()}"
    finally:
        streamer.close()


def _streamed_under_ddp(rank: int, world: int) -> bool:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref, m = _model(), _model()
    ref_ddp = DDP(ref)
    ddp = DDP(m)  # first: DDP's constructor broadcasts the parameters
    streamer = tt.stream_parameters(m)
    opts = [torch.optim.AdamW(x.parameters(), lr=1e-2) for x in (ref, m)]
    g = torch.Generator().manual_seed(rank)  # each rank its own data: DDP averages
    for _ in range(3):
        x = torch.randn(4, 8, generator=g)
        ref_ddp(x).sum().backward()
        ddp(x).sum().backward()
        opts[0].step()
        with streamer.resident():
            opts[1].step()
        for opt in opts:
            opt.zero_grad()
    streamer.close()
    return all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters()))


def test_a_model_streamed_inside_ddp_trains_as_ddp():
    from tests import distributed

    assert distributed.run(_streamed_under_ddp, 2) == [True, True]


# ---------------------------------------------------------------- the model's own API while streamed
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_state_dict_while_streamed_holds_the_real_values(tier, spill_dir):
    """``torch.save(model.state_dict())`` (HF ``save_pretrained``, a checkpoint) between steps
    saved the NaN placeholders: every weight was lost, silently."""
    ref, m = _model(), _model()
    streamer = tt.stream_parameters(m, tier=tier, spill_dir=spill_dir)
    try:
        got, want = m.state_dict(), ref.state_dict()
        assert list(got) == list(want)
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        sub = m[2].state_dict(prefix="b.")  # a submodule's own, with a prefix
        assert torch.equal(sub["b.scale"], ref[2].scale)
        got["0.weight"].add_(1)  # a copy: editing it leaves the streamed value alone
        assert torch.equal(m(torch.ones(1, 8)), ref(torch.ones(1, 8)))
        assert m.state_dict(keep_vars=True)["0.weight"] is m[0].weight
    finally:
        streamer.close()


def test_state_dict_of_a_streamed_tied_model_shares_the_tied_tensor():
    from tensortier.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32)
    torch.manual_seed(0)
    m = GPT(cfg)

    def ptr(sd, key):
        return sd[key].untyped_storage().data_ptr()

    want = m.state_dict()
    assert ptr(want, "lm_head.weight") == ptr(want, "transformer.wte.weight")
    streamer = tt.stream_parameters(m)
    try:
        got = m.state_dict()
        # one storage, as torch's: torch.save and safetensors write it once
        assert ptr(got, "lm_head.weight") == ptr(got, "transformer.wte.weight")
        assert all(torch.equal(got[k], v) for k, v in want.items())
        again = m.state_dict()
        assert ptr(again, "lm_head.weight") != ptr(got, "lm_head.weight")  # each call a copy
    finally:
        streamer.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_load_state_dict_while_streamed_loads_into_the_tier(tier, spill_dir):
    """``load_state_dict`` copied into the expanded placeholders: torch's raw "more than one
    element of the written-to tensor refers to a single memory location"."""
    ref, m = _model(), _model()
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(-2)
    streamer = tt.stream_parameters(m, tier=tier, spill_dir=spill_dir)
    x = torch.randn(3, 8)
    try:
        m[0](x)  # its pre-hook prefetched the next unit: values from before the load
        assert streamer._pending
        m.load_state_dict(ref.state_dict())
        assert all(torch.isnan(p).all() for p in m.parameters())  # streamed again
        assert torch.equal(m(x), ref(x))
        with pytest.raises(ConfigError, match="without assign="):
            m.load_state_dict(ref.state_dict(), assign=True)  # swapped in unstreamed tensors
        assert all(tt.optim.streaming.is_streamed(p) for p in m.parameters())
        m[2].load_state_dict(_model()[2].state_dict())  # a submodule alone
        assert torch.equal(m.state_dict()["2.scale"], _model()[2].scale)
    finally:
        streamer.close()


def test_a_model_converted_while_streamed_is_refused_naming_close():
    """``model.double()`` while streamed replaced the placeholders; the forward then installed
    the streamer's float32 values and failed in a matmul, naming neither cause nor fix."""
    m = _model()
    streamer = tt.stream_parameters(m)
    m.double()
    with pytest.raises(ConfigError, match=r"0\.weight.*close\(\)"):
        m(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ConfigError, match="close"), streamer.resident():
        pass
    streamer.close()


def test_tt_offload_around_a_streamed_model_still_offloads_activations():
    """The streamer's saved-tensor hooks shadowed ``tt.offload``'s: under ``with tt.offload():``
    no activation of a streamed model was offloaded (9 packed unstreamed, 1 streamed)."""
    ref, m = _model(), _model()
    x = torch.randn(5, 8)
    with tt.offload(min_bytes=0) as off:
        ref(x).square().sum().backward()
    want = off.stats.tensors_offloaded
    streamer = tt.stream_parameters(m)
    try:
        with tt.offload(min_bytes=0) as off:  # the same offloader: its stats go on counting
            m(x).square().sum().backward()
        # the same activations reached it (the parameters never do: it keeps those)
        assert off.stats.tensors_offloaded == 2 * want > 2
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
    finally:
        streamer.close()


def test_offload_module_inside_a_streamed_model_hands_weight_views_to_the_streamer():
    """``nn.Linear`` saves ``weight.t()``, a view, not the Parameter: ``offload_module`` inside a
    streamed model offloaded (or kept) a copy of every weight it ran, so the installed values
    lived until backward (the streaming budget broken) instead of being reloaded as tokens."""
    ref, m = _model(), _model()
    x = torch.randn(5, 8)
    ref(x).square().sum().backward()
    streamer = tt.stream_parameters(m)
    m(x).square().sum().backward()
    plain = streamer.stats().loads  # forward and backward loads of the streamed model alone
    handle = tt.offload_module(m, tier="host", min_bytes=0)
    try:
        for p in m.parameters():
            p.grad = None
        m(x).square().sum().backward()
        assert streamer.stats().loads == 2 * plain  # backward reloaded every unit again
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
    finally:
        handle.remove()
        streamer.close()


def test_a_load_that_fails_in_the_pre_hook_leaves_the_next_forward_correct():
    """torch runs ``always_call`` forward hooks when a pre-hook raised: the post-hook undid an
    install that never happened (count -1), so the next forward kept the NaN placeholder."""
    ref, m = _model(), _model()
    streamer = tt.stream_parameters(m)
    start, calls = streamer._start, []

    def failing_once(u):
        calls.append(u.index)
        if len(calls) == 1:
            raise OSError("a read failed")
        return start(u)

    streamer._start = failing_once
    x = torch.randn(3, 8)
    try:
        with pytest.raises(OSError, match="read failed"):
            m(x)
        assert torch.equal(m(x), ref(x))
    finally:
        streamer.close()


def test_nested_resident_blocks_keep_the_weights():
    """The inner block's exit put the placeholders back and the outer one stored those NaN
    placeholders as the weights: every parameter was lost."""
    ref, m = _model(), _model()
    streamer = tt.stream_parameters(m)
    with streamer.resident():
        with torch.no_grad():
            m[0].bias.add_(1)
            ref[0].bias.add_(1)
        with streamer.resident():  # e.g. a helper that saves or steps, called inside one
            assert torch.equal(m[0].bias, ref[0].bias)
        assert torch.equal(m[0].bias, ref[0].bias)  # still installed
    x = torch.randn(2, 8)
    assert torch.equal(m(x), ref(x))
    streamer.close()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters()))


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_backward_of_a_graph_made_before_close_matches_the_resident_model(tier, spill_dir):
    """``close()`` between forward and backward: backward asked the shut-down loader for the
    parameters ("cannot schedule new futures after shutdown"); they are resident again."""
    ref, m = _model(), _model()
    x = torch.randn(5, 8)
    streamer = tt.stream_parameters(m, tier=tier, spill_dir=spill_dir)
    loss = m(x).square().sum()
    streamer.close()
    loss.backward()
    ref(x).square().sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def _deferred_gather_of_streamed(rank: int, world: int) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = _model()
    DDP(m)
    streamer = tt.stream_parameters(m)
    try:
        tt.OffloadedAdamW(m.parameters(), defer_gather=True)
    except ConfigError as e:
        return str(e)
    finally:
        streamer.close()
    return "built"


def test_deferred_writes_of_streamed_parameters_are_refused_naming_the_setting():
    """``defer_gather=True`` on streamed parameters: ``resident()`` ended before the gathers
    landed, every rank's next forward raised "a deferred parameter all-gather failed; ...
    restore from a checkpoint"."""
    from tests import distributed

    for msg in distributed.run(_deferred_gather_of_streamed, 2):
        assert "stream_parameters" in msg and "defer_gather=False" in msg
    m = _model()
    streamer = tt.stream_parameters(m)
    with pytest.raises(ConfigError, match="pass defer_write_back=False"):
        tt.OffloadedAdamW(m.parameters(), defer_write_back=True)
    streamer.close()


def test_an_optimizer_step_outside_resident_names_resident():
    """torch raised "more than one element of the written-to tensor refers to a single memory
    location" from inside AdamW, naming neither the streamer nor ``resident()``."""
    ref, m = _model(), _model()
    streamer = tt.stream_parameters(m)
    opt, opt_ref = (torch.optim.AdamW(x.parameters(), lr=1e-2) for x in (m, ref))
    x = torch.randn(3, 8)
    m(x).sum().backward()
    ref(x).sum().backward()
    with pytest.raises(ConfigError, match=r"streamer\.resident\(\): opt\.step\(\)"):
        opt.step()
    with streamer.resident():  # nothing was changed: the step can be done as documented
        opt.step()
    opt_ref.step()
    torch.optim.AdamW(_model().parameters()).step()  # other optimizers are not concerned
    streamer.close()
    opt.step()  # closed: resident again, steps as usual
    opt_ref.step()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters()))


class _Checkpointed(torch.nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList([Block(16), Block(16)])
        self.out = torch.nn.Linear(16, 2)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.out(x)


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_of_a_streamed_model_matches_the_resident_model(reentrant):
    """``use_reentrant=True`` (HF's ``gradient_checkpointing_enable()`` default): the recompute
    in backward calls each block alone, outside the model's forward, so the streamer's hooks
    were off, autograd kept the parameters themselves, and the block's post-hook had put the
    NaN placeholders back before the inner backward read them: every gradient was NaN."""
    ref, m = _Checkpointed(reentrant), _Checkpointed(reentrant)
    streamer = tt.stream_parameters(m)
    x = torch.randn(5, 8)
    try:
        for _ in range(2):
            ref(x).square().sum().backward()
            m(x).square().sum().backward()
            for p, q in zip(m.parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad)
    finally:
        streamer.close()
