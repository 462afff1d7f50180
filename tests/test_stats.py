"""``tt.stats()`` (issue 26 #4): every live client's counters in one flat, JSON-able shape, keyed
``"<kind>:<n>"``; closed or collected clients drop out; the registry keeps nothing alive. And the
public surface: ``tt.__all__`` is the list the README's "Public API" table gives.

Other tests of the session may leave clients alive, so each test looks only at the keys that
appeared after it started."""

from __future__ import annotations

import gc
import importlib
import json
import pathlib
import re
import subprocess
import sys
import threading
import weakref

import numpy as np
import torch

import tensortier as tt
from tensortier.rl import ReplayBuffer

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

PUBLIC = {
    # activations
    "Action",
    "OffloadStats",
    "Offloader",
    "SavedTensorInfo",
    "offload",
    "offload_module",
    "offload_stats",
    # every live client's counters
    "stats",
    # optimizer state and parameters
    "OffloadedAdamW",
    "OptimizerStats",
    "stream_parameters",
    # checkpoints
    "Checkpointer",
    # tiers and the mover
    "DiskStore",
    "HostPool",
    "RemoteStore",
    "TransferEngine",
    "get_codec",
    # sizes
    "format_size",
    "parse_size",
    # errors
    "BudgetError",
    "ClosedError",
    "ConfigError",
    "CorruptDataError",
    "NodeLostError",
    "PermissionDeniedError",
    "RateLimitTimeout",
    "RecordTypeError",
    "ShardLostError",
    "SpillDirError",
    "TensortierError",
    "TierFullError",
    # subpackages
    "data",
    "rl",
}


def new_entries(before: set[str], kind: str) -> dict[str, dict]:
    """Entries of ``kind`` that appeared since ``before`` (a set of keys), by key."""
    return {k: v for k, v in tt.stats().items() if k not in before and v["kind"] == kind}


def one_new(before: set[str], kind: str) -> dict:
    found = new_entries(before, kind)
    assert len(found) == 1, (kind, sorted(found))
    return next(iter(found.values()))


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))


def one_pass(off: tt.Offloader, model: torch.nn.Module, x: torch.Tensor) -> None:
    with off:
        loss = model(x).sum()
    loss.backward()


def test_an_offloader_in_use_reports_moving_counters():
    model, x = small_model(), torch.randn(32, 64)
    before = set(tt.stats())
    off = tt.Offloader("host", min_bytes=0)
    one_pass(off, model, x)
    first = one_new(before, "offloader")
    assert first["passes"] == 1 and first["tensors_offloaded"] > 0
    assert first["bytes_offloaded.host"] > 0  # nested per-tier bytes: dotted keys
    one_pass(off, model, x)
    second = one_new(before, "offloader")
    assert second["passes"] == 2
    assert second["bytes_offloaded.host"] == 2 * first["bytes_offloaded.host"]
    # its parts are listed beside it
    assert one_new(before, "host_pool")["peak_in_use"] > 0
    # the engine counts a copy when it completes; a tensor whose write is still in flight when
    # backward wants it is read from its source, so its copy may land later (or, under load, not
    # yet): the engine's count trails the offloader's
    moved = one_new(before, "transfer_engine")["bytes.d2h"]
    assert 0 < moved <= second["bytes_offloaded.host"]
    off.close()
    assert new_entries(before, "offloader") == new_entries(before, "host_pool") == {}


def test_an_optimizer_reports_its_steps():
    model = small_model()
    before = set(tt.stats())
    opt = tt.OffloadedAdamW(model.parameters(), lr=1e-3)
    assert one_new(before, "optimizer")["steps"] == 0
    for expected in (1, 2):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        entry = one_new(before, "optimizer")
        assert entry["steps"] == expected and entry["host_state_bytes"] > 0
    opt.close()
    assert new_entries(before, "optimizer") == {}


def test_a_disk_store_reports_puts_and_gets(spill_dir):
    before = set(tt.stats())
    with tt.DiskStore(spill_dir) as disk:
        x = torch.arange(4096, dtype=torch.float32)
        handle = disk.write(x)
        assert torch.equal(disk.read(handle), x)
        entry = one_new(before, "disk_store")
        assert (entry["puts"], entry["gets"], entry["live_tensors"]) == (1, 1, 1)
        assert entry["bytes_written"] >= x.numel() * 4
    assert new_entries(before, "disk_store") == {}  # closed: gone


def test_a_replay_buffer_reports_adds_and_samples():
    before = set(tt.stats())
    buf = ReplayBuffer(16, seed=0)
    for i in range(10):
        buf.add({"obs": np.full(8, i, np.float32)})
    buf.sample(4)
    entry = one_new(before, "replay_buffer")
    assert entry["items"] == 10 and entry["ram_items"] == 10
    buf.close()
    assert new_entries(before, "replay_buffer") == {}


def test_a_checkpointer_reports_its_saves(tmp_path):
    model = small_model()
    before = set(tt.stats())
    with tt.Checkpointer(tmp_path / "ck", every=1) as ck:
        assert one_new(before, "checkpointer")["saves"] == 0
        ck.save(1, model=model)
        ck.wait()
        entry = one_new(before, "checkpointer")
        assert entry["saves"] == 1 and entry["committed"] == 1
        assert entry["last_committed_step"] == 1 and entry["last_persist_bytes"] > 0
        assert "history" not in entry  # a list of records: in ck.stats only (flat values here)
    assert new_entries(before, "checkpointer") == {}


def test_a_collected_client_disappears_and_is_not_kept_alive(spill_dir):
    before = set(tt.stats())
    disk = tt.DiskStore(spill_dir)
    assert len(new_entries(before, "disk_store")) == 1
    ref = weakref.ref(disk)
    del disk
    gc.collect()
    assert ref() is None, "the stats registry keeps a dropped client alive"
    assert new_entries(before, "disk_store") == {}


def test_keys_count_each_kind_in_creation_order(spill_dir):
    before = set(tt.stats())
    first, second = tt.HostPool("1MiB", pin=False), tt.HostPool("2MiB", pin=False)
    found = new_entries(before, "host_pool")
    assert len(found) == 2
    (k1, e1), (k2, e2) = sorted(found.items(), key=lambda kv: int(kv[0].split(":")[1]))
    assert (e1["budget"], e2["budget"]) == (1 << 20, 2 << 20)
    first.close()
    assert list(new_entries(before, "host_pool")) == [k2]  # the key stays with its client
    third = tt.HostPool("3MiB", pin=False)
    k3 = next(k for k in new_entries(before, "host_pool") if k != k2)
    assert int(k3.split(":")[1]) > int(k2.split(":")[1])  # never reused
    second.close(), third.close()


def test_every_entry_is_flat_and_survives_json(tmp_path, spill_dir):
    model, x = small_model(), torch.randn(8, 64)
    off = tt.Offloader("host", min_bytes=0)
    one_pass(off, model, x)
    with tt.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, model=model)
        ck.wait()
        with tt.DiskStore(spill_dir) as disk:
            disk.free(disk.write(x))
            out = tt.stats()
    off.close()
    assert {"offloader", "host_pool", "transfer_engine", "checkpointer", "disk_store"} <= {
        e["kind"] for e in out.values()
    }
    for key, entry in out.items():
        assert re.fullmatch(r"[a-z_]+:\d+", key) and key.startswith(entry["kind"] + ":")
        for name, value in entry.items():
            flat = isinstance(value, (bool, int, float, str, type(None)))
            scalars = isinstance(value, list) and all(
                isinstance(v, (bool, int, float, str, type(None))) for v in value
            )
            assert flat or scalars, (key, name, value)
    assert json.loads(json.dumps(out)) == out


def test_stats_is_safe_while_clients_come_and_go():
    errors: list[BaseException] = []
    stop = threading.Event()

    def churn() -> None:
        try:
            while not stop.is_set():
                tt.HostPool("1MiB", pin=False).close()
                tt.HostPool("1MiB", pin=False)  # dropped open: collected
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(200):
            json.dumps(tt.stats())
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []


def test_the_public_surface_is_the_listed_one():
    assert set(tt.__all__) == PUBLIC and len(tt.__all__) == len(PUBLIC)
    for name in tt.__all__:
        assert getattr(tt, name) is not None, name
    # internals left the surface, still importable where they live
    for module, name in [
        ("tensortier.transfer", "HostTensor"),
        ("tensortier.transfer", "Transfer"),
        ("tensortier.tiers", "DiskHandle"),
    ]:
        assert name not in tt.__all__
        assert hasattr(importlib.import_module(module), name)


def test_the_readme_lists_the_public_surface():
    text = README.read_text()
    section = text.split("\n## Public API", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    cells = [row.split("|")[2] for row in rows[1:]]  # the names column, below the header
    names = {n.removeprefix("tt.") for cell in cells for n in re.findall(r"`([^`]+)`", cell)}
    assert names == PUBLIC


def test_remote_store_is_public_without_importing_ray():
    code = "import sys, tensortier as tt; tt.RemoteStore; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _make_and_list() -> None:
    pool = tt.HostPool("1MiB", pin=False)
    assert any(e["kind"] == "host_pool" for e in tt.stats().values())
    pool.close()


def test_a_forked_child_registers_while_a_parent_thread_held_the_registry():
    """A fork while another thread of the parent is inside the registry (here: holding its
    lock) must not leave the child's copy locked forever."""
    import multiprocessing

    from tensortier import _stats

    with _stats._lock:
        child = multiprocessing.get_context("fork").Process(target=_make_and_list)
        child.start()
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0
