"""``restore(strict=False)``: fine-tuning from a checkpoint into a model with another head, as
``model.load_state_dict(sd, strict=False)`` does: the keys both have load, the others are named
on the returned state, a shape that differs is still refused before anything loads."""

import pytest
import torch

from tensortier.checkpoint import Checkpointer
from tensortier.errors import ConfigError


class Net(torch.nn.Module):
    def __init__(self, head: str, classes: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
        setattr(self, head, torch.nn.Linear(8, classes))


class Wrapped(torch.nn.Module):  # keys "module.*", as DDP(model) saves them
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.module = inner


def _fresh(head: str, classes: int = 3) -> torch.nn.Module:
    net = Net(head, classes)
    torch.manual_seed(1)
    for p in net.parameters():
        torch.nn.init.normal_(p)  # nothing equal to the saved values by chance
    return net


@pytest.mark.parametrize("wrapped", [False, True])
def test_restore_strict_false_loads_what_load_state_dict_strict_false_loads(tmp_path, wrapped):
    saved = Net("head")
    with Checkpointer(tmp_path) as ck:
        ck.save(7, model=Wrapped(saved) if wrapped else saved)

    ours, theirs = _fresh("classifier"), _fresh("classifier")
    reference = theirs.load_state_dict(saved.state_dict(), strict=False)
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(ConfigError, match=r"missing classifier.*strict=False"):
            ck.restore(model=_fresh("classifier"))
        state = ck.restore(model=ours, strict=False)

    assert state.saved_step == 7
    assert state.missing_keys == tuple(reference.missing_keys)
    unexpected = tuple(("module." if wrapped else "") + k for k in reference.unexpected_keys)
    assert state.unexpected_keys == unexpected
    for (k, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b), k
    assert torch.equal(ours.body[0].weight, saved.body[0].weight)


def test_restore_strict_false_still_refuses_another_shape_before_loading(tmp_path):
    with Checkpointer(tmp_path) as ck:
        ck.save(0, model=Net("head", classes=3))
    target = _fresh("head", classes=5)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(ConfigError, match=r"other shapes \(head.weight: \(3, 8\) vs \(5, 8\)"):
            ck.restore(model=target, strict=False)
        with pytest.raises(ConfigError, match="strict='no'"):
            ck.restore(model=target, strict="no")
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_strict_restore_reports_no_keys(tmp_path):
    with Checkpointer(tmp_path) as ck:
        ck.save(0, model=Net("head"))
        state = ck.restore(model=_fresh("head"))
    assert (state.missing_keys, state.unexpected_keys) == ((), ())
