"""Edits of ``opt.state[p]`` (``optim/_state_view.py``). torch users change the state in place
(``opt.state[p]["exp_avg"].zero_()`` to reset the moments of re-initialised units, as ReDo
does) or re-assign a key; here ``opt.state[p]`` is a copy, and such edits were lost silently.
Each test makes the same edits on ``torch.optim.AdamW(fused=True)`` and compares bit for bit."""

import collections

import pytest
import torch

from tensortier.errors import ConfigError
from tensortier.optim import OffloadedAdamW


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3), torch.nn.Linear(3, 2))


def _backward(model, g):
    model(torch.randn(4, 6, generator=g)).square().mean().backward()


def _reset(opt, params):
    """ReDo's reset: the moments of unit 1 of the first layer, a whole bias's moments, and the
    last layer's step counter re-assigned (a temporary dict each time, as users write it)."""
    opt.state[params[0]]["exp_avg"][1].zero_()
    opt.state[params[0]]["exp_avg_sq"][1].zero_()
    opt.state[params[1]]["exp_avg"].mul_(0.5)
    opt.state[params[-1]]["step"] = torch.tensor(1.0)


def _assert_same_as_torch(a, b, ref, opt) -> None:
    """Parameters and every AdamW state tensor of ``b``/``opt`` equal torch's ``a``/``ref``."""
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ref.state[p][key], opt.state[q][key]), key


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("when", ["after step", "between backward and step"])
def test_in_place_and_assigned_edits_of_opt_state_apply_as_in_torch(tmp_path, tier, when):
    a, b = _model(), _model()
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True)
    opt = OffloadedAdamW(b.parameters(), lr=1e-2, tier=tier, spill_dir=tmp_path)
    for model, o in ((a, ref), (b, opt)):
        g = torch.Generator().manual_seed(1)
        for i in range(4):
            _backward(model, g)
            if i == 2 and when == "between backward and step":  # after the speculation ran
                _reset(o, list(model.parameters()))
            o.step()
            o.zero_grad()
            if i == 1 and when == "after step":
                _reset(o, list(model.parameters()))
    _assert_same_as_torch(a, b, ref, opt)
    opt.close()


def test_state_dict_after_an_edit_holds_it_and_a_second_read_shows_it():
    model = _model()
    opt = OffloadedAdamW(model.parameters(), lr=1e-2)
    _backward(model, torch.Generator().manual_seed(1))
    opt.step()
    p = next(model.parameters())
    opt.state[p]["exp_avg"].fill_(3.0)
    assert torch.equal(opt.state[p]["exp_avg"], torch.full_like(p, 3.0))  # as torch's live dict
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], torch.full_like(p, 3.0))
    opt.close()


def test_an_edit_of_a_copy_read_before_the_last_step_warns_and_is_not_applied():
    model = _model()
    opt = OffloadedAdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    _backward(model, g)
    opt.step()
    p = next(model.parameters())
    stale = opt.state[p]
    _backward(model, g)
    opt.step()
    before = opt.state[p]["exp_avg"].clone()
    stale["exp_avg"].zero_()
    with pytest.warns(UserWarning, match=r"read opt.state\[p\] again after step\(\)"):
        opt.state_dict()
    assert torch.equal(opt.state[p]["exp_avg"], before)
    opt.close()


def test_an_edit_of_the_wrong_shape_is_refused_and_changes_nothing():
    model = _model()
    opt = OffloadedAdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    _backward(model, g)
    opt.step()
    before = opt.state_dict()
    opt.state[next(model.parameters())]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ConfigError, match=r"edited opt.state\[p\] cannot be loaded.*shape"):
        opt.step()
    after = opt.state_dict()
    for i, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, after["state"][i][key]), (i, key)
    opt.close()


def _replace(opt, params):
    """The whole-entry edits torch code makes on its ``defaultdict``: a re-assigned entry (then
    edited through the live dict), an emptied one, a deleted one and a popped one. Raised
    AttributeError, as did ``opt.state.clear()``; ``opt.state = defaultdict(dict)`` broke the
    next ``step()`` (AttributeError: no ``take_edits``)."""
    w = params[0]
    opt.state[w] = {k: v.clone() for k, v in opt.state[w].items()}
    opt.state[w]["exp_avg"].mul_(0.25)  # the assigned dict is the live one until the step
    opt.state[params[1]] = {}
    del opt.state[params[2]]
    assert params[2] not in opt.state and params[3] in opt.state
    opt.state.pop(params[3])


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_assigned_deleted_and_popped_entries_of_opt_state_behave_as_in_torch(tmp_path, tier):
    a, b = _model(), _model()
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True)
    opt = OffloadedAdamW(b.parameters(), lr=1e-2, tier=tier, spill_dir=tmp_path)
    for model, o in ((a, ref), (b, opt)):
        g = torch.Generator().manual_seed(1)
        for i in range(4):
            _backward(model, g)
            if i == 2:
                _replace(o, list(model.parameters()))
                assert len(o.state) == 4
            o.step()
            o.zero_grad()
        o.state.clear()  # everything fresh at the next step
        assert len(o.state) == 0
        _backward(model, g)
        o.step()
        o.state = collections.defaultdict(dict)  # a reset some training code does
        _backward(model, g)
        o.step()
    _assert_same_as_torch(a, b, ref, opt)
    opt.close()


def test_assigning_opt_state_of_a_foreign_parameter_or_a_non_dict_is_refused_get_is_torchs():
    model = _model()
    opt = OffloadedAdamW(model.parameters(), lr=1e-2)
    with pytest.raises(KeyError, match="not a parameter of this optimizer"):
        opt.state[torch.nn.Parameter(torch.zeros(2))] = {}
    with pytest.raises(TypeError, match="pass a dict like the one opt.state"):
        opt.state[next(model.parameters())] = None
    with pytest.raises(KeyError):
        del opt.state[next(model.parameters())]  # no state yet: as torch's defaultdict
    assert opt.state.get(next(model.parameters())) is None and len(opt.state) == 0  # no entry
    opt.close()
