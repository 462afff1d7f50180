"""``_ray.end_actors``: ``ray.kill`` is asynchronous, so close() must ping until the actor is dead.

A fake ``ray`` module stands in for Ray: its actors keep answering pings for a while after the
kill (as a real actor does when the ping arrives before the kill), then fail like a dead actor.
"""

import sys
import types

from tensortier._ray import end_actors


class _Died(Exception):
    pass


def _fake_ray(monkeypatch):
    ray = types.ModuleType("ray")
    ray.exceptions = types.SimpleNamespace(GetTimeoutError=TimeoutError)
    ray.killed = []
    ray.kill = ray.killed.append

    def get(ref, timeout=None):
        if isinstance(ref, Exception):
            raise ref
        return ref

    ray.get = get
    ray.is_initialized = lambda: True
    monkeypatch.setitem(sys.modules, "ray", ray)
    return ray


class _Actor:
    def __init__(self, answers_after_kill: int):
        self.left, self.pings = answers_after_kill, 0

    def ping(self):
        self.pings += 1
        if self.left > 0:
            self.left -= 1
            return True  # served: the kill has not landed yet
        return _Died("actor died")


def test_end_actors_pings_until_every_actor_is_dead(monkeypatch):
    ray = _fake_ray(monkeypatch)
    a, b = _Actor(answers_after_kill=2), _Actor(answers_after_kill=0)
    end_actors([a, b], lambda actor: actor.ping())
    assert ray.killed == [a, b]
    assert a.pings == 3 and b.pings == 1  # a answered twice after the kill, then failed


def test_end_actors_gives_up_at_its_timeout(monkeypatch):
    _fake_ray(monkeypatch)
    immortal = _Actor(answers_after_kill=10**9)
    end_actors([immortal], lambda actor: actor.ping(), timeout=0.2)  # returns, never hangs
    assert immortal.pings >= 1
