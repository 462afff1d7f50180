"""``Placement`` and ``check_remote`` (issue 26): one rule for ``remote=`` in every client, and
one message family naming the value and the fix."""

from __future__ import annotations

import os

import pytest

import tensortier as tt
from tensortier.errors import ConfigError
from tensortier.optim import OffloadedAdamW
from tensortier.rl import MemoryBank, ReplayBuffer
from tensortier.tiers.disk import DiskStore
from tensortier.tiers.placement import Placement, check_remote

BAD = [None, "8GiB", {"timeout": 30}, object()]


@pytest.mark.parametrize("remote", BAD, ids=["none", "size", "no-budget", "object"])
def test_every_client_refuses_a_bad_pool_with_the_same_sentence(remote):
    torch = pytest.importorskip("torch")
    params = [torch.nn.Parameter(torch.zeros(4))]
    calls = {
        "Offloader(tier='remote')": lambda: tt.Offloader("remote", remote=remote),
        "OffloadedAdamW(tier='remote')": lambda: OffloadedAdamW(
            params, tier="remote", remote=remote
        ),
        "ReplayBuffer: tier='remote'": lambda: ReplayBuffer(8, tier="remote", remote=remote),
        "MemoryBank: tier=['remote']": lambda: MemoryBank(8, tier=["remote"], remote=remote),
    }
    for where, call in calls.items():
        with pytest.raises(ConfigError) as info:
            call()
        text = str(info.value)
        assert text.startswith(f"{where} needs remote=tt.tiers.RemoteStore(budget)"), text
        assert f"got remote={remote!r}" in text and "remote=RemoteStore(budget='8GiB')" in text


def test_a_dict_of_arguments_is_taken_only_where_the_client_makes_the_pool():
    args = {"budget": "8MiB"}
    check_remote(args, where="Offloader(tier='remote')", needed=True)  # made and closed there
    with pytest.raises(ConfigError, match="or a dict") as info:
        check_remote("8MiB", where="x", needed=True)
    assert "remote={'budget': '8GiB'}" in str(info.value)
    with pytest.raises(ConfigError, match=r"remote=\{'budget'") as info:
        check_remote(args, where="ReplayBuffer: tier='remote'", needed=True, args=False)
    assert "a dict" not in str(info.value)  # this client takes an open store only
    check_remote(None, where="x", needed=False)


def test_placement_checks_tiers_and_sizes_once(tmp_path):
    p = Placement(["host", "disk"], directory=tmp_path, host_budget="1MiB", disk_budget="8MiB")
    assert p.tiers == ("host", "disk") and p.host_budget == 1 << 20
    assert Placement("disk").tiers == ("disk",)
    for tiers in ((), ("host", "host"), ("nvme",), ("disk", "gpu")):
        with pytest.raises(ConfigError, match="distinct tiers"):
            Placement(tiers, where="me")
    with pytest.raises(ConfigError, match="host_budget"):
        Placement(("host",), host_budget="lots")
    with pytest.raises(ConfigError, match="disk_budget"):
        Placement(("disk",), disk_budget=0)
    with pytest.raises(ConfigError, match="remote="):
        Placement(("disk", "remote"))  # the remote tier needs its pool


def test_open_disk_makes_a_private_store_under_the_directory(tmp_path):
    p = Placement(("disk",), directory=tmp_path, disk_budget="1MiB")
    store = p.open_disk(owner="tt-test", io_threads=1)
    try:
        assert isinstance(store, DiskStore) and store.budget == 1 << 20
        assert os.path.dirname(store.directory) == str(tmp_path)
    finally:
        store.close()
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
    "args,match",
    [
        ({"budget": "8MiB", "bogus": 1}, r"names \['bogus'\], which RemoteStore does not take"),
        ({"budget": "8MiB", "capacity": "8MiB"}, r"names \['capacity'\]"),
        ({"budget": "8XB"}, "remote budget"),
    ],
    ids=["unknown", "old-name", "budget"],
)
def test_a_dict_of_arguments_is_checked_when_the_client_is_built(args, match):
    # An unknown name was a raw "RemoteStore.__init__() got an unexpected keyword argument".
    torch = pytest.importorskip("torch")
    params = [torch.nn.Parameter(torch.zeros(4))]
    calls = {
        "Offloader(tier='remote')": lambda: tt.Offloader("remote", remote=args),
        "OffloadedAdamW(tier='remote')": lambda: OffloadedAdamW(params, tier="remote", remote=args),
    }
    for where, call in calls.items():
        with pytest.raises(ConfigError, match=match) as info:
            call()
        if "bogus" in args:  # the client's own name leads, as in check_remote's other errors
            assert str(info.value).startswith(where)
