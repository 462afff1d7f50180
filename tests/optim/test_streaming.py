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
    assert streamer.stats.prefetch_hits > 0
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
