"""BackwardEnd: one call at the end of a backward, in eager autograd and under compiled autograd."""

from __future__ import annotations

import torch
from torch import nn

from tensortier._backward_end import BackwardEnd, eager, in_compiled_autograd


def _compiled_autograd():
    from torch._dynamo import compiled_autograd

    return compiled_autograd._enable(lambda gm: torch.compile(gm, backend="eager"))


def _armed(model: nn.Module, calls: list) -> tuple[BackwardEnd, list]:
    """A BackwardEnd over ``model``'s parameters that records, when it runs, whether every
    gradient was there and whether a backward was still running."""
    params = list(model.parameters())

    def fn() -> None:
        ready = all(p.grad is not None for p in params)
        calls.append((ready, torch._C._current_graph_task_id() != -1 or in_compiled_autograd()))

    end = BackwardEnd(len(params), fn)
    hook = eager(lambda _p: end.accumulated())
    return end, [p.register_post_accumulate_grad_hook(hook) for p in params]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_eager_runs_once_after_every_gradient_inside_the_backward():
    m, calls = _model(), []
    end, handles = _armed(m, calls)
    m(torch.randn(3, 4)).sum().backward()
    assert calls == [(True, True)] and end.ended
    for h in handles:
        h.remove()


def test_compiled_autograd_runs_once_at_the_last_gradient():
    """The final callback a hook queues is dropped under compiled autograd: the count ends it."""
    m, calls = _model(), []
    end, handles = _armed(m, calls)
    with _compiled_autograd():
        m(torch.randn(3, 4)).sum().backward()
    assert calls == [(True, True)] and end.ended
    for h in handles:
        h.remove()


def test_a_backward_that_misses_a_parameter_ends_from_the_next_one_under_compiled_autograd():
    m, calls = _model(), []
    end, handles = _armed(m, calls)
    m[2].weight.requires_grad_(False)  # its hook never runs: the owner's fallback reads it
    with _compiled_autograd():
        m(torch.randn(3, 4)).sum().backward()
    assert calls == [] and not end.ended and end.learned() == 3  # all but the frozen weight
    for h in handles:
        h.remove()
    again = BackwardEnd(end.learned(), lambda: calls.append("ended"))
    hook = eager(lambda _p: again.accumulated())
    handles = [
        p.register_post_accumulate_grad_hook(hook) for p in m.parameters() if p.requires_grad
    ]
    with _compiled_autograd():
        m(torch.randn(3, 4)).sum().backward()
    assert calls == ["ended"] and again.learned() == 3
    for h in handles:
        h.remove()


def test_torch_still_drops_a_callback_queued_from_a_hook_under_compiled_autograd():
    """Why BackwardEnd counts: if this fails, torch runs such callbacks now, and the count can go
    (``_backward_end.py``, ``optim/_speculation.py``'s fence)."""
    ran: list = []

    def hook(_p) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: ran.append(1))

    w = nn.Parameter(torch.ones(3))
    w.register_post_accumulate_grad_hook(eager(hook))
    with _compiled_autograd():
        (w * 2).sum().backward()
    assert ran == []
