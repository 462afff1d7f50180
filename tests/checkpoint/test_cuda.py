"""CUDA snapshot ordering (GPU-path review #3 and "Minor"; issue 12 #6b).

Per device, the snapshot's side stream waits for *that device's* current stream (where the
optimizer step is queued), and the next optimizer step on that device waits for the copies. Early
tensors (buffers, scheduler, extra) are copied asynchronously too: ``maybe_save`` never
synchronizes. The long ``torch.cuda._sleep`` keeps the step queued while the snapshot is issued,
so a copy that is not ordered after it reads the parameters before the step (a torn checkpoint
with a valid checksum).
"""

import pytest
import torch
from safetensors.torch import load_file

from tensortier.checkpoint import Checkpointer

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)
LONG = 2_000_000_000  # GPU cycles (about a second): far longer than issuing the snapshot


def _linears(device, n=4, width=4096):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(n)]).to(device)


def _after_sgd_step(*models):
    """The parameters an SGD(lr=1) step will produce, computed synchronously beforehand."""
    return [{n: (p.detach() - p.grad).cpu() for n, p in m.named_parameters()} for m in models]


def _backward(model, device):
    model(torch.randn(64, model[0].in_features, device=device)).square().mean().backward()


def _restored(tmp_path, *models):
    with Checkpointer(tmp_path) as ck:
        ck.restore(model=torch.nn.ModuleList(models))
    return [{n: p.detach().cpu() for n, p in m.named_parameters()} for m in models]


@two_gpus
def test_snapshot_waits_for_the_step_on_the_models_device_not_the_current_one(tmp_path):
    torch.cuda.set_device(0)  # the model lives on cuda:1, which is not current
    dev = torch.device("cuda:1")
    model = _linears(dev)  # 256 MiB of parameters
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    _backward(model, dev)
    expected = _after_sgd_step(model)
    with Checkpointer(tmp_path, every=1) as ck:
        with torch.cuda.device(dev):
            torch.cuda._sleep(LONG)  # cuda:1's stream: the step below stays queued
        opt.step()
        ck.maybe_save(0, model=torch.nn.ModuleList([model]), optimizer=opt)
        opt.step()  # the pre-hook must make cuda:1 wait for the copy before this overwrites it
        ck.wait()
    (got,) = _restored(tmp_path, _linears(dev))
    assert got.keys() == expected[0].keys()
    assert all(torch.equal(got[k], expected[0][k]) for k in got)  # before the fix: pre-step values


@two_gpus
def test_tensors_on_two_devices_are_each_ordered_by_their_own_stream(tmp_path):
    torch.cuda.set_device(0)
    devices = [torch.device("cuda:0"), torch.device("cuda:1")]
    models = [_linears(d, n=2) for d in devices]
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=1.0)
    for m, d in zip(models, devices):
        _backward(m, d)
    expected = _after_sgd_step(*models)
    with Checkpointer(tmp_path, every=1) as ck:
        for d in devices:
            with torch.cuda.device(d):
                torch.cuda._sleep(LONG)
        opt.step()
        ck.maybe_save(0, model=torch.nn.ModuleList(models), optimizer=opt)
        opt.step()
        ck.wait()
    got = _restored(tmp_path, *[_linears(d, n=2) for d in devices])
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        assert all(torch.equal(g[k], e[k]) for k in g)


def test_buffers_scheduler_and_extra_are_copied_without_synchronizing(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    extra = {"ema": torch.ones(3, device="cuda")}
    with Checkpointer(tmp_path, every=1) as ck:
        for step in range(2):  # the first save allocates the pinned images
            _backward(model, "cuda")
            opt.step()
            opt.zero_grad()
            sched.step()
            if step == 1:
                torch.cuda.set_sync_debug_mode("error")  # any synchronizing copy raises
            try:
                ck.maybe_save(step, model=model, optimizer=opt, scheduler=sched, extra=extra)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            ck.wait()


def test_buffers_changed_by_the_next_forward_are_saved_as_they_were(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(tmp_path, every=1) as ck:
        _backward(model, "cuda")
        opt.step()
        torch.cuda._sleep(LONG)  # the snapshot's copies queue behind this
        ck.maybe_save(0, model=model, optimizer=opt)
        before = {k: v.clone() for k, v in model.named_buffers()}  # in stream order
        _backward(model, "cuda")  # forward updates the BatchNorm statistics right away
        ck.wait()
        saved = load_file(str(tmp_path / "step-0" / "shard-00000.safetensors"))
    for k, v in before.items():
        assert torch.equal(saved[f"model/{k}"], v.cpu()), k
