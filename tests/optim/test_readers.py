"""``defer_write_back=True`` (``optim/_readers.py``): ``step()`` returns with the parameters' copies
queued, and every reader that can be intercepted waits for them first.

On the CPU the waits are recorded instead of made (CPU parameters are written in ``step()``);
the gpu tests hold the side stream back so that a missing wait changes the losses."""

import pytest
import torch

from tensortier.errors import ConfigError
from tensortier.optim import OffloadedAdamW
from tensortier.optim._readers import DeferredWriteBack
from tests.ecosystem._hf import BATCH, SEQ, VOCAB, build


def _recorded(monkeypatch) -> list:
    waits = []
    monkeypatch.setattr(DeferredWriteBack, "_wait", staticmethod(lambda d, e: waits.append(e)))
    return waits


def test_each_module_waits_for_its_own_parameters_before_it_runs(monkeypatch):
    waits = _recorded(monkeypatch)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    for name, mod in m.named_children():  # what ran when: a wait must come before its module
        mod.register_forward_pre_hook(lambda mod, args, name=name: waits.append(f"run {name}"))
    readers = DeferredWriteBack()
    readers.add_params(m.parameters())
    readers.written([m[0].weight, m[0].bias], "e0")
    readers.written([m[2].weight, m[2].bias], "e2")
    m(torch.randn(3, 4))
    assert waits == ["e0", "run 0", "run 1", "e2", "run 2"]  # once per event, in forward order
    assert readers.pending == 0
    waits.clear()
    m(torch.randn(3, 4))  # nothing left to wait for
    assert waits == ["run 0", "run 1", "run 2"]

    waits.clear()
    readers.written([m[0].weight], "e0'")
    readers.written([m[2].bias], "e2'")
    m.state_dict()  # the modules holding the parameters wait for everything
    assert sorted(waits) == ["e0'", "e2'"] and readers.pending == 0
    waits.clear()
    readers.written([m[2].weight], "e3")
    readers.synchronize()
    assert waits == ["e3"] and readers.pending == 0
    readers.close()
    waits.clear()
    readers.written([m[0].weight], "e4")
    m(torch.randn(3, 4))
    assert waits == ["run 0", "run 1", "run 2"]  # closed: no hooks left


def _train(defer: bool, overlap: bool, order: list | None = None):
    model = build("gpt2").to(torch.bfloat16)  # fp32 masters: written back (fp32 CPU: in place)
    opt = OffloadedAdamW(model.parameters(), lr=1e-2, bucket_size="8KiB", overlap=overlap,
                         defer_write_back=defer)  # fmt: skip
    if order is not None:  # the first parameter of each write-back, as issued
        real = opt._staging.write_back

        def write_back(pairs, holder=None):
            ptr = pairs[0][0].data_ptr()
            order.append(next(i for i, p in enumerate(model.parameters()) if p.data_ptr() == ptr))
            return real(pairs, holder)

        opt._staging.write_back = write_back
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(4):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    opt.close()
    return torch.stack(losses), torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("overlap", [False, True], ids=["in-step", "speculating"])
def test_deferred_write_back_is_bit_identical_and_written_in_forward_order(overlap):
    """CPU parameters are written in ``step()`` either way: the results are the default's, and
    the write-backs are issued highest bucket first, i.e. the order forward reads them."""
    want = _train(False, overlap)
    order: list[int] = []
    got = _train(True, overlap, order)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    steps = [order[i : i + len(order) // 4] for i in range(0, len(order), len(order) // 4)]
    assert len(steps[0]) > 2 and all(s == sorted(s) for s in steps), steps  # wte first


def test_the_step_hands_each_bucket_event_to_the_modules_holding_its_parameters(monkeypatch):
    """CPU parameters have no copy in flight, so each write-back is given a stand-in event: the
    next forward must wait for every one of them, each before the first module holding one of
    its parameters runs (the parameters, not the step's detached views, are what modules hold)."""
    waits = _recorded(monkeypatch)
    model = build("gpt2").to(torch.bfloat16)
    opt = OffloadedAdamW(model.parameters(), lr=1e-2, bucket_size="8KiB", overlap=False,
                         defer_write_back=True)  # fmt: skip
    real, issued = opt._staging.write_back, []

    def write_back(pairs, holder=None):
        real(pairs, holder)
        issued.append(f"bucket {len(issued)}")
        return issued[-1]

    opt._staging.write_back = write_back
    owner = {}  # event -> the names of the parameters it covers
    real_written = opt._staging.deferred.written

    def written(params, event):
        names = {id(p): n for n, p in model.named_parameters()}
        owner[event] = {names[id(p)] for p in params}
        real_written(params, event)

    opt._staging.deferred.written = written
    for name, mod in model.named_modules():
        mod.register_forward_pre_hook(lambda mod, args, name=name: waits.append(("run", name)))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    opt.step()
    assert len(issued) > 2 and opt._staging.deferred.pending > 0
    waits.clear()
    model(ids, labels=ids)
    # every event, at least once (a module waits once per event among its own parameters)
    assert {e for e in waits if isinstance(e, str)} == set(issued)
    for event in issued:  # the next module to run holds one of the event's parameters
        name = next(w[1] for w in waits[waits.index(event) :] if isinstance(w, tuple))
        held = {f"{name}.{n}".lstrip(".") for n, _ in model.get_submodule(name).named_parameters(
            recurse=False)}  # fmt: skip
        assert held & owner[event] or event == issued[0], (event, name, owner[event])
    opt.close()


def test_deferred_write_back_needs_unsharded_host_states(tmp_path):
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ConfigError, match="defer_write_back=True needs host states.*tier='disk'"):
        OffloadedAdamW(p, tier="disk", spill_dir=str(tmp_path), defer_write_back=True)


def _closed(model: torch.nn.Module, opt: OffloadedAdamW) -> torch.Tensor:
    """The parameters once every deferred copy landed (on the host), the optimizer closed."""
    opt.synchronize()
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    opt.close()
    return params


def _cuda_run(defer: bool, hold_copies: bool):
    """Five steps of a tiny GPT-2 on the GPU; ``hold_copies``: the side stream sleeps ~0.1 s
    before each step, so its write-back copies run while the next forward is queued."""
    model = build("gpt2").cuda()
    opt = OffloadedAdamW(model.parameters(), lr=1e-2, bucket_size="8KiB",
                         defer_write_back=defer)  # fmt: skip
    side = opt._staging._streams.stream(next(model.parameters()).device, "h2d")
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(5):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).cuda()
        loss = model(ids, labels=ids).loss
        loss.backward()
        if hold_copies:
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses).cpu(), _closed(model, opt)


@pytest.mark.gpu
def test_cuda_deferred_write_back_is_bit_identical_and_waited_for(monkeypatch):
    want = _cuda_run(False, hold_copies=False)
    got = _cuda_run(True, hold_copies=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the control: without the per-module wait, the forward reads parameters not yet written
    monkeypatch.setattr(DeferredWriteBack, "wait_for", lambda self, module: None)
    losses, _ = _cuda_run(True, hold_copies=True)
    assert not torch.equal(losses, want[0])


def test_model_load_state_dict_waits_for_the_copies_it_would_race(monkeypatch):
    """``model.load_state_dict`` (a rollback, ``Checkpointer.restore``) writes the parameters on
    the current stream: a copy still queued would land after it and undo the load, so every
    module holding one of the parameters waits for all of them before its tensors are loaded."""
    waits = _recorded(monkeypatch)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    readers = DeferredWriteBack()
    readers.add_params(m.parameters())
    m(torch.randn(3, 4))  # the modules are found by a forward
    saved = {k: v.clone() for k, v in m.state_dict().items()}
    readers.written([m[0].weight, m[0].bias], "e0")
    readers.written([m[2].weight], "e2")
    m[0].register_load_state_dict_pre_hook(lambda *a: waits.append("load 0"))
    m.load_state_dict(saved)
    assert waits[:2] == ["e0", "e2"] and "load 0" in waits and readers.pending == 0
    readers.close()


def _stand_in_events(model, opt) -> tuple[list[str], dict]:
    """Each write-back of ``opt`` gets a named stand-in event (CPU parameters have no copy in
    flight); returns (the events in issue order, event -> names of the parameters it covers)."""
    real, issued, owner = opt._staging.write_back, [], {}
    names = {id(p): n for n, p in model.named_parameters()}

    def write_back(pairs, holder=None):
        real(pairs, holder)
        issued.append(f"bucket {len(issued)}")
        return issued[-1]

    real_written = opt._staging.deferred.written

    def written(params, event):
        owner[event] = {names[id(p)] for p in params}
        real_written(params, event)

    opt._staging.write_back, opt._staging.deferred.written = write_back, written
    return issued, owner


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_torch_attention_modules_wait_for_the_parameters_their_forward_reads(monkeypatch, mode):
    """``nn.MultiheadAttention`` reads ``out_proj``'s parameters without calling ``out_proj``,
    and ``nn.TransformerEncoderLayer``'s inference fast path (``eval()`` under ``no_grad``)
    reads every parameter of the layer without calling any submodule: before either runs, the
    copies of all the parameters under it must be waited for."""
    waits = _recorded(monkeypatch)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), layer, torch.nn.Linear(16, 4))
    model = model.to(torch.bfloat16)  # fp32 masters: written back (fp32 CPU: in place)
    opt = OffloadedAdamW(model.parameters(), lr=1e-2, bucket_size="1KiB", overlap=False,
                         defer_write_back=True)  # fmt: skip
    issued, owner = _stand_in_events(model, opt)
    # what ran when, seen by a global hook (after the optimizer's): a hook on a module of the
    # layer would turn its fast path off
    names = {mod: name for name, mod in model.named_modules()}
    ran = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda mod, args: waits.append(("run", names.get(mod)))
    )
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    model(x).square().mean().backward()
    opt.step()
    assert len(issued) > 4
    waits.clear()
    reader = "1.self_attn" if mode == "train" else "1"
    model.train(mode == "train")
    with torch.set_grad_enabled(mode == "train"):
        model(x)
    ran.remove()
    runs = [w[1] for w in waits if isinstance(w, tuple)]
    assert ("1.linear1" in runs) == (mode == "train"), runs  # eval: the fast path ran alone
    at = waits.index(("run", reader))
    needed = {e for e, held in owner.items() if any(n.startswith(reader + ".") for n in held)}
    assert needed and needed <= set(waits[:at]), (needed, waits[:at])
    opt.close()


def _cuda_transformer_run(hold_copies: bool, defer: bool = True):
    """Five steps of a one-layer ``nn.TransformerEncoderLayer`` model on the GPU, each followed
    by an inference forward (the layer's fast path reads its parameters without calling its
    submodules); ``hold_copies``: the side stream sleeps ~0.1 s before each step."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), layer, torch.nn.Linear(32, 4)).cuda()
    opt = OffloadedAdamW(model.parameters(), lr=1e-2, bucket_size="4KiB",
                         defer_write_back=defer)  # fmt: skip
    side = opt._staging._streams.stream(next(model.parameters()).device, "h2d")
    g = torch.Generator().manual_seed(3)
    outs = []
    for _ in range(5):
        x = torch.randn(4, 6, 8, generator=g).cuda()
        model.train()
        model(x).square().mean().backward()
        if hold_copies:
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            outs.append(model(x))
    return torch.stack(outs).cpu(), _closed(model, opt)


@pytest.mark.gpu
def test_cuda_transformer_layers_wait_for_their_submodules_parameters(monkeypatch):
    want = _cuda_transformer_run(False, defer=False)
    got = _cuda_transformer_run(True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the control: a layer that waits for its own parameters only (it holds none) reads stale ones
    monkeypatch.setattr("tensortier.optim._readers._SUBTREE_READERS", ())
    outs, _ = _cuda_transformer_run(True)
    assert not torch.equal(outs, want[0])


def test_a_model_compiled_and_run_before_the_optimizer_still_waits(monkeypatch):
    """Dynamo does not guard on module hooks (``skip_nnmodule_hook_guards``): code compiled
    before the optimizer registered its forward pre-hook would never call it, and every forward
    would read parameters whose copies are still queued. Creating the optimizer drops that code,
    so the next call recompiles with the hook."""
    waits = _recorded(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = model.to(torch.bfloat16)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    compiled(x)  # e.g. a first evaluation, before the optimizer is made
    opt = OffloadedAdamW(model.parameters(), lr=1e-2, bucket_size="128B", overlap=False,
                         defer_write_back=True)  # fmt: skip
    issued, _ = _stand_in_events(model, opt)
    compiled(x).float().square().mean().backward()
    opt.step()
    assert len(issued) > 1
    waits.clear()
    compiled(x)
    assert set(waits) == set(issued) and opt._staging.deferred.pending == 0, waits
    opt.close()


def test_data_parallel_waits_for_every_parameter_before_replicating(monkeypatch):
    """``nn.DataParallel`` over several GPUs reads every parameter of its module (``replicate``
    broadcasts them) before any submodule runs, and the replicas' forwards hold copies, not the
    parameters: the DataParallel module itself waits for all of them (driven on the CPU, where
    it calls its module directly: every wait must precede the first submodule)."""
    waits = _recorded(monkeypatch)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    dp = torch.nn.DataParallel(m)
    readers = DeferredWriteBack()
    readers.add_params(m.parameters())
    m[0].register_forward_pre_hook(lambda *a: waits.append("run 0"))
    readers.written([m[0].weight, m[0].bias], "e0")
    readers.written([m[2].weight], "e2")
    dp(torch.randn(3, 4))
    assert waits[:3] == ["e0", "e2", "run 0"], waits
    readers.close()
