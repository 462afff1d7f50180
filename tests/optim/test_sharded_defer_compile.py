"""``defer_gather=True`` under ``torch.compile``: the forward pre-hook that writes deferred
parameters must run before a compiled module reads them. Gathers are held back until the
compiled forward starts; its output must equal DDP + fused AdamW's, bit for bit."""

import threading

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tensortier.optim import OffloadedAdamW
from tests import distributed
from tests.optim.test_sharded import _square_model
from tests.optim.test_sharded_defer import _gate_gathers

pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile")


def _compiled(rank: int, world: int, wrap: str) -> dict:
    ref, m = _square_model(), _square_model()
    rddp = DDP(ref)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt = OffloadedAdamW(
        m.parameters(), lr=1e-2, weight_decay=0.1, defer_gather=True, bucket_size="16KiB"
    )
    if wrap == "compile(ddp)":
        run = torch.compile(DDP(m), backend="aot_eager")
    elif wrap == "compile(fn)":
        ddp = DDP(m)
        run = torch.compile(lambda x: ddp(x), backend="aot_eager")
    else:  # DDP around the compiled module
        run = DDP(torch.compile(m, backend="aot_eager"))
    g = torch.Generator().manual_seed(100 + rank)
    gate, log, equal = threading.Event(), [], []
    _gate_gathers(gate, log)
    for _ in range(3):
        x = torch.randn(4, 64, generator=g)
        rddp(x).square().mean().backward()
        ropt.step()
        ropt.zero_grad()
        run(x).square().mean().backward()
        gate.clear()
        opt.step()
        opt.zero_grad()
        threading.Timer(0.5, gate.set).start()  # released only while the next forward waits
        y = torch.randn(4, 64, generator=g)
        with torch.no_grad():
            equal.append(torch.equal(run(y), rddp(y)))
    opt.close()
    return {"equal": equal}


@pytest.mark.parametrize("wrap", ["compile(ddp)", "compile(fn)", "ddp(compile)"])
def test_compiled_forward_waits_for_deferred_gathers(wrap):
    for r in distributed.run(_compiled, 2, wrap, timeout=240):
        assert r["equal"] == [True] * 3
