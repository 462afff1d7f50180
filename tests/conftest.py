import gc
import os
import threading

import numpy as np
import pytest
import torch

from tensortier._lifetime import quiesce


def pytest_collection_modifyitems(config, items):
    _ray_modules_last(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session) -> None:
    """No automatic collection while the test modules import (torch, transformers, hypothesis:
    the heap grows by half a million objects, and Python walks all of it each time it grew by a
    quarter: 6 s of a session's start); ``pytest_collection_finish`` collects once instead."""
    gc.disable()


def pytest_collection_finish(session) -> None:
    gc.enable()
    _freeze_what_lives()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """Before a module's first test (and its module fixtures): freeze what earlier modules
    imported (Ray, dynamo, transformers' lazy modules), for the reason of ``_freeze_what_lives``."""
    if item.module is not _frozen_at_module[0]:
        _frozen_at_module[0] = item.module
        _freeze_what_lives()


_frozen_at_module: list = [None]


def _freeze_what_lives() -> None:
    """Collect the garbage, then move every object alive now out of the collector's sight
    (``gc.freeze``). The session's heap (torch, transformers, Ray, every collected test: over
    half a million objects) is otherwise walked by each full collection, a quarter to over a
    second each, and the suite makes hundreds (the tests' own ``gc.collect()`` and Python's
    automatic ones): 17 of 44 s in a run of the lifetime, disk and host tests. Objects a test
    makes are not frozen, so what a test drops is still collected (refcounts and weak references
    work on frozen objects too)."""
    gc.collect()
    gc.freeze()


def _ray_modules_last(items: list) -> None:
    """The modules on the shared Ray cluster (``ray_nodes``) run together, last, in their order:
    the cluster then runs only while they do (its idle processes take CPU from other tests)."""
    ray_modules = {item.module for item in items if "ray_nodes" in item.fixturenames}
    items[:] = [i for i in items if i.module not in ray_modules] + [
        i for i in items if i.module in ray_modules
    ]


@pytest.fixture(scope="session")
def ray_nodes():
    """One Ray cluster of simulated nodes for every module that asks (``tests/ray_cluster.py``):
    starting one costs 7-70 s here, so seven modules share it; each connects through
    ``ray_nodes.module()`` and finds it as new."""
    pytest.importorskip("ray")
    from tests.ray_cluster import SharedCluster

    shared = SharedCluster()
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture(autouse=True, scope="session")
def _warm_cpu_kernels():
    """Run the common float kernels once on every intra-op thread before any test compares.

    On the 2-core CI machine (torch 2.13 CPU) the first parallel ``exp`` of a process returns
    the second thread's half up to 1.5e-4 off, with or without tensortier; a test comparing an
    offloaded run with a plain one must not see that as a difference made by offloading.
    """
    x = torch.randn(256, 256)
    for op in (torch.exp, torch.sin, torch.cos, torch.tanh, torch.sigmoid, torch.log1p):
        op(x)
    torch.nn.functional.gelu(x), x.softmax(-1), x.log_softmax(-1), x @ x
    yield


@pytest.fixture
def spill_dir(tmp_path):
    """A spill directory that must be empty again when the test ends (nothing left behind).

    Stores a test dropped without close() are cleaned up by the reaper thread once collected; a
    full garbage collection walks the whole session's heap (over a second late in a full run, on
    every test that uses this fixture), so it runs only when files are still there after the
    reaper's queue drained: the verdict is the same, a clean test pays nothing."""
    d = tmp_path / "spill"
    d.mkdir()
    yield str(d)
    quiesce()
    if os.listdir(d):
        gc.collect()
        quiesce()
    leftovers = os.listdir(d)
    assert leftovers == [], f"files left behind in the spill directory: {leftovers}"


ALL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


def make_tensor(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, -0.0-safe)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    from tensortier.tiers.disk import as_bytes

    return torch.equal(as_bytes(a.cpu()), as_bytes(b.cpu()))


def in_thread(fn, limit: float = 30.0):
    """Run ``fn`` in a thread; returns what it returned or raised (a hang fails, not blocks, the
    test)."""
    out = {}

    def go():
        try:
            out["r"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out["r"] = exc

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"still running after {limit}s"
    return out["r"]


def same_item(a, b) -> bool:
    """Items equal to the bit: dicts field by field, tensors and arrays by dtype, shape and bytes,
    anything else by type and ``==``."""
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same_item(a[k], b[k]) for k in a)
        )
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and bit_equal(a, b)
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    return type(a) is type(b) and a == b
