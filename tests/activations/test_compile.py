"""torch.compile under tensortier: it works around a compiled model, or fails with a clear error."""

import pytest
import torch
from torch import nn

import tensortier as tt
from tensortier import ConfigError

# the offloader's module-tracking hooks are global hooks: dynamo warns that the OptimizedModule
# wrapper fires them once more (harmless: they only record names and parameter storages)
pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10)
    )


X = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))


def _grads(model, compiled, ctx=None, steps=2):
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if ctx is None:
            loss = compiled(X).square().mean()
        else:
            with ctx:
                loss = compiled(X).square().mean()
        loss.backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


@pytest.fixture(scope="module")
def compiled_reference():
    torch._dynamo.reset()
    model = mlp()
    return _grads(model, torch.compile(model))


def test_compiled_model_inside_offload_matches_the_compiled_model(compiled_reference, spill_dir):
    model = mlp()
    off = tt.Offloader("disk", spill_dir=spill_dir, min_bytes=0)
    try:
        grads = _grads(model, torch.compile(model), off)
        for ref, got in zip(compiled_reference, grads):
            assert all(torch.equal(a, b) for a, b in zip(ref, got))
        # the compiled graph's saved tensors went through the hooks at run time, every step
        assert off.stats.passes == 2 and off.stats.tensors_offloaded >= 2 * 3
    finally:
        off.close()


def test_dynamo_traces_through_the_offloader_hooks_without_graph_breaks():
    """The module-tracking hooks are global, so dynamo traces them: they must leave nothing in the
    graph (before: dynamo failed on the module list they keep)."""
    off = tt.Offloader("host", min_bytes=0)
    try:
        with off:
            explained = torch._dynamo.explain(mlp())(X)
        assert explained.graph_count == 1 and explained.graph_break_count == 0
    finally:
        off.close()


def test_offload_module_inside_a_compiled_model_fails_with_a_clear_error(compiled_reference):
    model = mlp()
    with pytest.raises(ConfigError, match="torch.compile'd module"):
        tt.offload_module(torch.compile(model[0]), tier="host")
    torch._dynamo.reset()  # dynamo does not guard on hooks: code compiled without them ignores them
    handle = tt.offload_module(nn.ModuleList([model[0], model[2]]), tier="host", min_bytes=0)
    compiled = torch.compile(model)
    try:
        # dynamo compiles the hooks away inside the compiled graph: never offload nothing silently
        with pytest.raises(ConfigError, match="torch.compile traced tensortier"):
            _grads(model, compiled, steps=3)
    finally:
        handle.remove()
