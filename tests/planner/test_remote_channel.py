"""The remote channel in the planner (issue 16): synthetic profiles, no Ray needed."""

from __future__ import annotations

import dataclasses

import pytest

from tensortier.errors import ConfigError
from tensortier.planner.cache import _key_file, cache_key
from tensortier.planner.config import PlanConfig
from tensortier.planner.policies import Options, choose
from tensortier.planner.profile import Bandwidth, Profile
from tensortier.planner.runtime import planned_offload
from tensortier.planner.simulator import Mode, Plan, UnitAction, path_of, simulate
from tests.planner.conftest import GB, chain


def _with(p: Profile, **bw) -> Profile:
    p.bandwidth = dataclasses.replace(p.bandwidth, **bw)
    return p


def _modes(choice) -> set[Mode]:
    return {a.mode for a in choice.plan.actions.values()}


@pytest.mark.parametrize("unified", [True, False])
def test_a_remote_swap_is_modelled_as_a_disk_swap_on_its_own_channels(unified):
    """Same bandwidths: the same peak and step as disk, on h2remote/remote2h, device -> host ->
    remote on a GPU and one hop on a unified machine."""
    p = _with(chain(unified=unified), h2remote=2 * GB, remote2h=2 * GB)
    assert path_of(p, "remote", None, outbound=True) == (
        ["h2remote"] if unified else ["d2h", "h2remote"]
    )
    assert path_of(p, "remote", None, outbound=False) == (
        ["remote2h"] if unified else ["remote2h", "h2d"]
    )
    disk = simulate(p, Plan("d", {u.name: UnitAction(Mode.DISK) for u in p.units}))
    remote = simulate(p, Plan("r", {u.name: UnitAction(Mode.REMOTE) for u in p.units}))
    assert remote.peak_bytes == disk.peak_bytes
    assert remote.step_s == pytest.approx(disk.step_s)
    assert remote.peak_bytes < simulate(p, Plan("keep", {})).peak_bytes  # bytes left the peak
    lanes = {s.lane for s in remote.spans}
    assert {"h2remote", "remote2h"} <= lanes and not {"h2disk", "disk2h"} & lanes


def test_remote_wins_where_it_hides_and_disk_does_not():
    # disk at 0.1 GB/s cannot hide a 1 GB tensor behind 1 s of compute; remote at 10 GB/s can
    p = _with(chain(bw=0.1 * GB), h2remote=10 * GB, remote2h=10 * GB)
    budget = 5 * GB  # keeping everything peaks at 8 GB: something must move or recompute
    local = choose(p, budget, "auto", Options(tiers=("disk",)))
    both = choose(p, budget, "auto", Options(tiers=("disk", "remote")))
    assert Mode.REMOTE not in _modes(local)
    assert Mode.REMOTE in _modes(both)
    assert both.result.step_s < local.result.step_s
    assert both.result.peak_bytes <= budget


def test_slow_remote_is_never_chosen():
    p = _with(chain(bw=10 * GB), h2remote=0.05 * GB, remote2h=0.05 * GB)
    budget = 5 * GB
    local = choose(p, budget, "auto", Options(tiers=("disk",)))
    both = choose(p, budget, "auto", Options(tiers=("disk", "remote")))
    assert Mode.REMOTE not in _modes(both)
    assert both.result.step_s == pytest.approx(local.result.step_s)


def test_a_remote_pool_as_fast_as_the_disk_is_not_chosen():
    """Both hide: no step is faster with remote memory, so the plan stays on this machine."""
    p = _with(chain(bw=10 * GB), h2remote=10 * GB, remote2h=10 * GB)
    both = choose(p, 5 * GB, "auto", Options(tiers=("disk", "remote")))
    assert Mode.REMOTE not in _modes(both)
    assert both.result.peak_bytes <= 5 * GB


def test_remote_is_not_a_tier_without_a_measured_pool():
    """A profile made without a pool (remote channels 0) never plans a remote swap, whatever
    the options say; only remote allowed is a ConfigError naming the fix."""
    p = chain(bw=0.1 * GB)
    assert not p.bandwidth.remote
    c = choose(p, 5 * GB, "auto", Options(tiers=("disk", "remote")))
    assert Mode.REMOTE not in _modes(c)
    with pytest.raises(ConfigError, match="remote=pool"):
        choose(p, 5 * GB, "swap_all", Options(tiers=("remote",)))
    with pytest.raises(ConfigError, match="no measured remote channels"):
        simulate(p, Plan("r", {"h.0": UnitAction(Mode.REMOTE)}))


def test_only_remote_allowed_swaps_to_remote():
    p = _with(chain(bw=0.1 * GB), h2remote=10 * GB, remote2h=10 * GB)
    c = choose(p, 5 * GB, "swap_all", Options(tiers=("remote",)))
    assert _modes(c) == {Mode.REMOTE}


def test_profile_and_plan_json_round_trip_with_remote():
    p = _with(chain(), h2remote=3 * GB, remote2h=4 * GB)
    back = Profile.from_json(p.to_json())
    assert back.bandwidth == p.bandwidth and back.bandwidth.remote
    old = p.to_dict()  # a profile written before the remote channels existed still loads
    del old["bandwidth"]["h2remote"], old["bandwidth"]["remote2h"]
    assert not Profile.from_dict(old).bandwidth.remote
    plan = Plan("x", {"h.0": UnitAction(Mode.REMOTE), "h.1": UnitAction(Mode.REMOTE, part={1})})
    again = Plan.from_dict(plan.to_dict())
    assert again.actions == plan.actions
    assert again.to_dict()["actions"] == {"h.0": "remote", "h.1": "remote[1]"}


def test_a_plan_made_without_a_pool_is_not_reused_with_one(tmp_path):
    import torch

    plain = PlanConfig(budget=GB, plan_cache=str(tmp_path))
    pooled = PlanConfig(budget=GB, plan_cache=str(tmp_path), remote=object())
    a = cache_key(plain, torch.device("cpu"), "sig", [])
    b = cache_key(pooled, torch.device("cpu"), "sig", [])
    assert a != b and _key_file(str(tmp_path), a) != _key_file(str(tmp_path), b)
    assert "remote" not in repr(pooled)  # the in-process cache key: a store's repr has stats


def test_to_remote_without_a_pool_is_a_config_error_naming_the_fix():
    with pytest.raises(ConfigError, match=r"tier='remote'.*remote=RemoteStore"):
        planned_offload("64MiB", tier="remote")
    with pytest.raises(ConfigError, match=r"remote=.*RemoteStore"):
        planned_offload("64MiB", remote={"budget": "8MiB"})


def test_bandwidth_defaults_keep_old_constructors_working():
    bw = Bandwidth(d2h=1.0, h2d=1.0, h2disk=1.0, disk2h=1.0)
    assert bw.h2remote == 0.0 and bw.of("remote2h") == 0.0 and not bw.remote
