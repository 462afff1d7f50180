"""``defer_gather=True`` under ``torch.compile``: the forward pre-hook that writes deferred
parameters must run before a compiled module reads them. Gathers are held back until the
compiled forward starts; its output must equal DDP + fused AdamW's, bit for bit."""

import threading

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import distributed
from tests.optim.test_sharded import _iterate, _square_model
from tests.optim.test_sharded_defer import _gate_gathers, _pair

pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile")


def _compile_fn(m: torch.nn.Module):
    ddp = DDP(m)
    return torch.compile(lambda x: ddp(x), backend="aot_eager")


WRAPS = {
    "compile(ddp)": lambda m: torch.compile(DDP(m), backend="aot_eager"),
    "compile(fn)": _compile_fn,  # a compiled function calling DDP
    "ddp(compile)": lambda m: DDP(torch.compile(m, backend="aot_eager")),
}


def _compiled(rank: int, world: int, wrap: str) -> dict:
    (ref, rddp, ropt), (m, run, opt) = _pair(
        _square_model, rank, wrap=WRAPS[wrap], bucket_size="16KiB"
    )
    g = torch.Generator().manual_seed(100 + rank)
    gate, log, equal = threading.Event(), [], []
    _gate_gathers(gate, log)
    for _ in range(3):
        x = torch.randn(4, 64, generator=g)
        _iterate(x, (rddp, ropt))
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


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_compiled_forward_waits_for_deferred_gathers(wrap):
    for r in distributed.run(_compiled, 2, wrap, timeout=240):
        assert r["equal"] == [True] * 3
