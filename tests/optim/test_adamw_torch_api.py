"""OffloadedAdamW used as a ``torch.optim`` user does: keywords, param groups, bad input.

Each refusal is a ``ConfigError`` naming the value and the fix, raised before anything changes;
what is accepted gives the bits of ``torch.optim.AdamW(fused=True)``.
"""

import copy

import pytest
import torch

from tensortier.errors import ClosedError, ConfigError
from tensortier.optim import OffloadedAdamW


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3), torch.nn.Linear(3, 2))


def _train(model, opt, steps, seed=1, before=None):
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        if before is not None:
            before(i)
        model(torch.randn(4, 6, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize(
    "kw",
    [
        dict(amsgrad=True),
        dict(capturable=True),
        dict(differentiable=True),
        dict(foreach=True),
        dict(fused=False),
    ],
)
def test_torch_keywords_other_than_fused_adamw_are_refused_naming_the_fix(kw):
    m = _model()
    (key,) = kw
    with pytest.raises(ConfigError, match=f"{key}=.*torch.optim.AdamW"):
        OffloadedAdamW(m.parameters(), **kw)
    with pytest.raises(ConfigError, match=key):
        OffloadedAdamW([{"params": m.parameters(), **kw}])


def test_torch_keywords_at_fused_adamw_values_are_accepted_with_its_results():
    a, b = _model(), _model()
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True, foreach=None, amsgrad=False)
    kw = dict(amsgrad=False, foreach=None, capturable=False, differentiable=False, fused=True)
    opt = OffloadedAdamW(b.parameters(), lr=1e-2, **kw)
    _train(a, ref, 3)
    _train(b, opt, 3)
    assert _same(a, b)
    opt.close()


BAD_GROUPS = [
    ({"lr": -1.0}, "learning rate"),
    ({"lr": float("nan")}, "learning rate"),
    ({"lr": "0.01"}, "learning rate"),
    ({"betas": (1.5, 0.9)}, "betas"),
    ({"betas": (0.9, 0.99, 0.9)}, "betas"),
    ({"eps": float("nan")}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"),
]


@pytest.mark.parametrize("bad, what", BAD_GROUPS)
def test_bad_hyper_parameters_are_refused_in_every_param_group(bad, what):
    m = _model()
    ps = list(m.parameters())
    with pytest.raises(ConfigError, match=what):
        OffloadedAdamW([{"params": ps[:2]}, {"params": ps[2:], **bad}])
    with pytest.raises(ConfigError, match=what):
        OffloadedAdamW(ps, **{k: v for k, v in bad.items()})


@pytest.mark.parametrize(
    "group",
    [{"amsgrad": True}, {"lr": -1.0}, {"fused": False}, {"twice": True}, {"dtype": torch.int64}],
)
def test_a_refused_add_param_group_leaves_the_optimizer_as_it_was(group):
    """torch.optim users add groups mid-training (unfreezing); a refused one must not stay
    half-added in ``param_groups`` (the next step would fail on it)."""
    a, b = _model(), _model()
    ps_a, ps_b = list(a.parameters()), list(b.parameters())
    ref = torch.optim.AdamW(ps_a[:4], lr=1e-2, fused=True)
    opt = OffloadedAdamW(ps_b[:4], lr=1e-2)
    extra = dict(group)
    if extra.pop("twice", False):
        new = [ps_b[4], ps_b[4]]
    elif "dtype" in extra:
        new = [torch.zeros(3, dtype=extra.pop("dtype"))]
    else:
        new = ps_b[4:]

    for i in range(4):
        if i == 1:
            ref.add_param_group({"params": ps_a[4:], "lr": 3e-2})
            with pytest.raises(ConfigError):
                opt.add_param_group({"params": new, **extra})
            assert len(opt.param_groups) == 1
            opt.add_param_group({"params": ps_b[4:], "lr": 3e-2})
        _train(a, ref, 1, seed=i)
        _train(b, opt, 1, seed=i)
    assert _same(a, b)
    opt.close()


def test_a_parameter_listed_twice_is_refused():
    """torch only warns and then steps it twice per step; here it would get two states."""
    m = _model()
    p = next(m.parameters())
    with pytest.raises(ConfigError, match="more than once"):
        OffloadedAdamW([p, p])


def test_add_param_group_after_close_is_a_closed_error():
    m = _model()
    ps = list(m.parameters())
    opt = OffloadedAdamW(ps[:4])
    opt.close()
    with pytest.raises(ClosedError):
        opt.add_param_group({"params": ps[4:]})


def test_state_dict_hooks_run_as_in_torch():
    """``register_(load_)state_dict_(pre|post)_hook`` are torch.optim API (DCP, accelerate and
    user code use them to rename or move state); they were silently not run."""
    m = _model()
    calls = {}
    for opt in (torch.optim.AdamW(m.parameters(), fused=True), OffloadedAdamW(m.parameters())):
        seen = calls.setdefault(type(opt).__name__, [])
        opt.register_state_dict_pre_hook(lambda o, seen=seen: seen.append("save_pre"))

        def save_post(o, sd, seen=seen):
            seen.append("save_post")
            return {**sd, "extra": 1}

        def load_pre(o, sd, seen=seen):
            seen.append(("load_pre", sd.pop("extra")))
            return sd

        opt.register_state_dict_post_hook(save_post)
        opt.register_load_state_dict_pre_hook(load_pre)
        opt.register_load_state_dict_post_hook(lambda o, seen=seen: seen.append("load_post"))
        _train(m, opt, 1)
        sd = opt.state_dict()
        assert sd["extra"] == 1
        opt.load_state_dict(sd)
        assert "extra" in sd  # the hook edited a shallow copy, as torch's does
    assert calls["OffloadedAdamW"] == calls["AdamW"]
    assert calls["AdamW"] == ["save_pre", "save_post", ("load_pre", 1), "load_post"]


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_pickling_the_optimizer_is_refused_naming_state_dict(how, tmp_path):
    """torch.optim pickles ``state``, which is empty here: ``torch.save(opt)`` kept no moments
    and the copy raised AttributeError at its first use."""
    m = _model()
    opt = OffloadedAdamW(m.parameters())
    _train(m, opt, 1)
    with pytest.raises(ConfigError, match=r"state_dict\(\)"):
        if how == "torch.save":
            torch.save(opt, tmp_path / "opt.pt")
        else:
            copy.deepcopy(opt)
    _train(m, opt, 1)  # still usable
    assert opt.state_dict()["state"][0]["step"] == 2
    opt.close()


def test_opt_state_reads_like_torch_and_dcp_get_state_dict_changes_nothing():
    """``opt.state`` was always empty: ``opt.state[p]["exp_avg"]`` raised KeyError, and DCP's
    ``get_optimizer_state_dict`` took its initialising step (zero gradients, lr 0) on every
    call: step counters advanced and the moments decayed."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    a, b = _model(), _model()
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True)
    opt = OffloadedAdamW(b.parameters(), lr=1e-2)
    assert not opt.state and len(opt.state) == 0 and opt.state[next(b.parameters())] == {}
    for m, o in ((a, ref), (b, opt)):
        _train(m, o, 2)
        get_optimizer_state_dict(m, o)
        _train(m, o, 1, seed=2)
    assert _same(a, b)
    assert len(opt.state) == len(ref.state) == 6
    for p, q in zip(a.parameters(), b.parameters()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ref.state[p][key], opt.state[q][key]), key
    opt.close()


def test_torch_state_dict_with_an_empty_entry_loads_as_fresh_state():
    """Reading ``opt.state[p]`` of a parameter that has no state yet inserts ``{}`` into torch's
    ``defaultdict``, and ``state_dict()`` keeps it; loading that raised a bare TypeError
    ("float() argument must be ... not 'NoneType'"). An empty entry is fresh state, as in torch."""
    a, b = _model(), _model()
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True)
    frozen = [a[2].weight, a[2].bias]
    for p in frozen:
        p.requires_grad_(False)
    _train(a, ref, 2)
    assert ref.state[frozen[0]] == {}  # inserted by the read
    for p in frozen:
        p.requires_grad_(True)
    opt = OffloadedAdamW(b.parameters(), lr=1e-2)
    opt.load_state_dict(ref.state_dict())
    b.load_state_dict(a.state_dict())
    for m, o in ((a, ref), (b, opt)):
        _train(m, o, 2, seed=3)
    assert _same(a, b)
    opt.close()
