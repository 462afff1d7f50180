"""GPU: every pinned buffer outside the pools goes through ``aligned_empty(pin=True)`` (review-12-18
#6): PyTorch's caching host allocator is never used, what is pinned is counted by
``pinned_bytes()`` and is given back once its owner is closed. (CPU checks with a fake
``cudaHostRegister`` are in ``test_host.py``.)"""

import gc

import pytest
import torch

import tensortier as tt
from tensortier._lifetime import quiesce
from tensortier.tiers.host import pinned_bytes

pytestmark = pytest.mark.gpu


def _host_allocs() -> int:
    return torch.cuda.host_memory_stats().get("num_host_alloc", 0)


def _settled() -> int:
    gc.collect()
    assert quiesce()
    torch.cuda.synchronize()
    return pinned_bytes()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)).cuda()


@pytest.mark.parametrize("states", ["host", "disk"])
@pytest.mark.parametrize("overlap", [False, True])
def test_optimizer_pins_exactly_and_gives_it_back(spill_dir, states, overlap):
    base, allocs = _settled(), _host_allocs()
    model = _model()
    opt = tt.OffloadedAdamW(
        model.parameters(), states=states, spill_dir=spill_dir, overlap=overlap, lr=1e-3
    )
    for _ in range(3):
        model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    assert pinned_bytes() > base
    assert _host_allocs() == allocs, "PyTorch's caching host allocator was used"
    opt.close()
    del opt
    assert _settled() == base


def test_checkpoint_images_pin_what_host_bytes_says(tmp_path):
    base, allocs = _settled(), _host_allocs()
    model = _model()
    with tt.Checkpointer(tmp_path, every=1) as ck:
        ck.save(0, model=model)
        ck.wait()
        pinned = pinned_bytes() - base
        assert _host_allocs() == allocs, "PyTorch's caching host allocator was used"
        need = ck.stats().host_bytes
        assert need <= pinned <= need + 4096 * len(ck._images)
    assert _settled() == base


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_streamer_homes_and_staging_pin_exactly_and_give_it_back(spill_dir, tier):
    base, allocs = _settled(), _host_allocs()
    model = _model()
    x = torch.randn(8, 1024, device="cuda")
    ref = model(x)
    streamer = tt.stream_parameters(model, tier=tier, spill_dir=spill_dir)
    for _ in range(2):
        assert torch.equal(model(x), ref)
    assert _host_allocs() == allocs, "PyTorch's caching host allocator was used"
    if tier == "host":  # the homes: every parameter's bytes, page by page
        homes = sum(-(-p.numel() * p.element_size() // 4096) * 4096 for p in model.parameters())
        assert pinned_bytes() - base == homes
    streamer.close()
    del streamer
    assert _settled() == base
