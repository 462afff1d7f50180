"""Known-order epochs: batches follow the order, resume exactly (also across worker counts),
ranks get equal shares, DataLoader workers (fork and spawn) yield the same stream."""

import itertools
import signal
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import tensortier.data as tt_data
from tensortier.data import (
    Catalog,
    CatalogDataset,
    EpochBatch,
    EpochConfig,
    EpochDataset,
    Loader,
)
from tensortier.data._order import Order
from tensortier.errors import ClosedError, ConfigError
from tests.data._records import record, same

N = 3000


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    path = tmp_path_factory.mktemp("loader") / "cat"
    c = Catalog.build(path, (record(i) for i in range(N)), io_threads=2, batch_bytes="64KiB")
    yield c
    c.close()


def indices(batches) -> np.ndarray:
    return np.concatenate([b.indices for b in batches]) if batches else np.empty(0, np.int64)


def check_records(batches) -> None:
    for b in batches:
        assert len(b.data) == len(b.indices)
        for i, r in zip(b.indices.tolist(), b.data):
            assert same(r, record(i))


@pytest.mark.parametrize("shuffle", ["full", "block", "none"])
def test_batches_follow_the_epoch_order_and_hold_the_right_records(cat, shuffle):
    loader = cat.epochs(batch=100, seed=3, shuffle=shuffle, prefetch_budget="64KiB", io_threads=3)
    batches = list(loader)
    assert [len(b) for b in batches] == [100] * 30 and len(loader) == 30
    order = Order(loader.dataset.spec, 0, 0).indices(0, N)
    assert np.array_equal(indices(batches), order)
    check_records(batches)
    assert [b.position for b in batches] == list(range(100, N + 1, 100))
    assert loader.epoch == 1 and loader.position == 0  # the next iteration is epoch 1
    second = indices(list(loader))
    assert not np.array_equal(second, order) or shuffle == "none"
    assert loader.stats().max_inflight_bytes <= 64 << 10 or loader.stats().pieces == 1
    assert loader.stats().records == 2 * N and loader.stats().bytes_read > 0


@pytest.mark.parametrize("shuffle", ["full", "block"])
@pytest.mark.parametrize("stop", [0, 1, 17, 29])
def test_a_resumed_epoch_equals_the_uninterrupted_one(cat, shuffle, stop):
    kw = dict(batch=100, seed=11, shuffle=shuffle, world_size=3, rank=1, even="pad")
    whole = cat.epochs(**kw)
    reference = [indices(list(whole)) for _ in range(2)]  # epochs 0 and 1
    first = cat.epochs(**kw)
    it = iter(first)
    seen = [next(it) for _ in range(min(stop, len(first)))]
    state = first.state_dict()
    first.close()
    resumed = cat.epochs(**kw)
    resumed.load_state_dict(state)
    rest = list(resumed)
    if stop >= len(first):  # the epoch was finished: the state points at the next one
        assert state["epoch"] == 1 and state["position"] == 0
        assert np.array_equal(indices(rest), reference[1])
    else:
        assert np.array_equal(np.concatenate([indices(seen), indices(rest)]), reference[0])
        assert np.array_equal(indices(list(resumed)), reference[1])
    check_records(rest[:2])


def test_breaking_out_and_iterating_again_continues_the_epoch(cat):
    loader = cat.epochs(batch=250, seed=1)
    ref = indices(list(cat.epochs(batch=250, seed=1)))
    got = []
    for i, b in enumerate(loader):
        got.append(b)
        if i == 4:
            break
    got += list(loader)
    assert np.array_equal(indices(got), ref)
    loader.set_epoch(0)
    assert np.array_equal(indices(list(loader)), ref)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_taking_exactly_an_epochs_batches_then_iterating_again_gives_the_next_epoch(
    cat, num_workers
):
    # islice(loader, len(loader)) (or a loop that breaks after its last step) takes the epoch's
    # last batch without the final next(): the next iteration is still a whole epoch, not empty
    loader = cat.epochs(batch=500, seed=4, num_workers=num_workers)
    ref = cat.epochs(batch=500, seed=4)
    first, second = list(ref), list(ref)
    got = list(itertools.islice(loader, len(loader)))
    assert np.array_equal(indices(got), indices(first))
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 0
    again = list(loader)
    assert len(again) == len(loader) and {b.epoch for b in again} == {1}
    assert np.array_equal(indices(again), indices(second))
    loader.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_closing_the_catalog_stops_a_running_loader(tmp_path, num_workers):
    # README: after cat.close() every read and loader raises ClosedError; DataLoader workers
    # hold their own copy of the catalog, so they read on unless the loader checks
    c = Catalog.build(tmp_path / "cat", [np.array([i], np.int64) for i in range(400)])
    loader = c.epochs(batch=8, seed=0, num_workers=num_workers,
                      multiprocessing_context="fork" if num_workers else None)  # fmt: skip
    it = iter(loader)
    next(it)
    c.close()
    with pytest.raises(ClosedError):
        next(it)
    assert loader.position == 8
    loader.close()


def _slow(record):
    time.sleep(0.002)
    return record


@pytest.mark.parametrize("num_workers", [0, 2])
def test_close_from_another_thread_stops_the_running_iteration(cat, num_workers):
    # a watchdog or signal-handling thread closes the loader while the training thread is
    # inside next(): close() returns, and the iteration raises ClosedError instead of going on
    loader = cat.epochs(batch=20, seed=1, transform=_slow, io_threads=2, num_workers=num_workers,
                        multiprocessing_context="fork" if num_workers else None)  # fmt: skip
    it = iter(loader)
    next(it)
    closed = []
    closer = threading.Thread(target=lambda: closed.append(loader.close() or "ok"))
    got = 1
    with pytest.raises(ClosedError):
        for _ in it:
            got += 1
            if got == 3:
                closer.start()
    closer.join(timeout=60)
    assert closed == ["ok"] and got < len(loader)
    assert loader.state_dict()["position"] <= got * 20


def test_close_while_a_prefetch_thread_is_inside_next(cat):
    # a prefetching wrapper: the iterator is made here and consumed by a background thread;
    # close() here while that thread waits inside next() returns, and the thread gets ClosedError
    loader = cat.epochs(batch=20, seed=1, transform=_slow, io_threads=1, prefetch_budget=4096)
    it = iter(loader)
    outcome = []

    def consume():
        try:
            for _ in it:
                outcome.append("batch")
        except ClosedError:
            outcome.append("closed")

    consumer = threading.Thread(target=consume)
    consumer.start()
    while not outcome:
        time.sleep(0.01)
    loader.close()
    consumer.join(timeout=60)
    assert outcome[-1] == "closed" and len(outcome) < len(loader)


class _Interrupt(Exception):
    """What a SIGALRM handler raises here, as SIGINT's raises KeyboardInterrupt."""


def _raise_interrupt(signum, frame):
    raise _Interrupt


def test_ctrl_c_while_waiting_for_a_read_interrupts_the_iteration(cat):
    # the consumer waits on the read-ahead's futures: an exception from a signal handler
    # (KeyboardInterrupt) raised during that wait must propagate, not be swallowed
    loader = cat.epochs(batch=1, seed=1, transform=_slow, io_threads=1, prefetch_budget=4096)
    previous = signal.signal(signal.SIGALRM, _raise_interrupt)
    got = 0
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(_Interrupt):
            for _ in loader:  # N records at 2 ms each on one thread: ~6 s
                got += 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert 0 < got < N and loader.position == got
    rest = list(itertools.islice(loader, 5))  # the next iteration resumes after the last batch
    ref = indices(list(cat.epochs(batch=1, seed=1)))
    assert np.array_equal(indices(rest), ref[got : got + 5])
    loader.close()


def test_ranks_get_equal_disjoint_shares_that_cover_the_epoch(cat):
    for even, per in (("pad", 1000), ("drop", 750)):
        world = 3 if even == "pad" else 4
        shares = [
            indices(list(cat.epochs(batch=64, seed=5, rank=r, world_size=world, even=even)))
            for r in range(world)
        ]
        assert [len(s) for s in shares] == [per] * world
        flat = np.concatenate(shares)
        assert len(np.unique(flat)) == len(flat)
        assert len(flat) == N if even == "pad" else len(flat) == 3000
    loaders = [cat.epochs(batch=64, rank=r, world_size=7, drop_last=True) for r in range(7)]
    assert {len(ld) for ld in loaders} == {6}  # 429 each, 6 full batches on every rank


def test_transform_and_collate_run_on_the_reading_side(cat):
    loader = cat.epochs(
        batch=8,
        shuffle="none",
        transform=lambda r: 1,
        collate=lambda rs: torch.tensor(rs),
        drop_last=True,
    )
    b = next(iter(loader))
    assert torch.equal(b.data, torch.ones(8, dtype=torch.int64))
    assert np.array_equal(b.indices, np.arange(8))


def test_state_dict_mismatches_are_refused(cat):
    state = cat.epochs(batch=100, seed=1).state_dict()
    for kwargs, key in (
        ({"seed": 2}, "seed"),
        ({"shuffle": "block"}, "shuffle"),
        ({"world_size": 2, "rank": 0}, "world_size"),
        ({"batch": 50}, "batch"),
    ):
        base = {"batch": 100, "seed": 1, **kwargs}
        with pytest.raises(ConfigError, match=f"saved with {key}="):
            cat.epochs(**base).load_state_dict(state)
    with pytest.raises(ConfigError, match="not a state"):
        cat.epochs(batch=100).load_state_dict({"epoch": 0})
    bad = dict(state, position=150)
    with pytest.raises(ConfigError, match="batch boundary"):
        cat.epochs(batch=100, seed=1).load_state_dict(bad)


def test_bad_loader_arguments_are_config_errors_naming_them(cat):
    for kwargs, match in (
        ({"batch": 0}, "batch=0"),
        ({"batch": 8, "shuffle": "random"}, "shuffle='random'"),
        ({"batch": 8, "even": "resample"}, "even='resample'"),
        ({"batch": 8, "rank": 2, "world_size": 2}, "rank=2"),
        ({"batch": 8, "prefetch_budget": "lots"}, "prefetch_budget"),
        ({"batch": 8, "io_threads": 0}, "io_threads=0"),
        ({"batch": 8, "num_workers": -1}, "num_workers=-1"),
        ({"batch": 8, "multiprocessing_context": "thread"}, "multiprocessing_context"),
        ({"batch": 8, "transform": 3}, "transform=3"),
    ):
        with pytest.raises(ConfigError, match=match):
            cat.epochs(**kwargs)
    tiny = Catalog.build(cat.directory + "-tiny", [b"a", b"b"])
    with pytest.raises(ConfigError, match="even='pad'"):
        tiny.epochs(batch=1, rank=0, world_size=3, even="drop")


# --------------------------------------------------------------------------- DataLoader workers
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_yield_the_in_process_stream(cat, context):
    kw = dict(batch=128, seed=9, shuffle="block", world_size=2, rank=0)
    ref = list(cat.epochs(**kw))
    loader = cat.epochs(**kw, num_workers=2, multiprocessing_context=context)
    got = list(loader)
    assert [len(b) for b in got] == [len(b) for b in ref]
    assert np.array_equal(indices(got), indices(ref))
    check_records(got[:3])
    assert loader.epoch == 1 and loader.stats().batches == len(ref)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker")
def test_resume_across_a_change_of_worker_count(cat):
    kw = dict(batch=64, seed=4, shuffle="full")
    ref = indices(list(cat.epochs(**kw)))
    first = cat.epochs(**kw, num_workers=2, multiprocessing_context="fork")
    it = iter(first)
    seen = [next(it) for _ in range(9)]
    state = first.state_dict()
    first.close()
    for workers in (0, 3):
        resumed = cat.epochs(**kw, num_workers=workers, multiprocessing_context="fork")
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert np.array_equal(np.concatenate([indices(seen), indices(rest)]), ref), workers


def test_epoch_dataset_in_a_plain_dataloader_shards_batches_across_workers(cat):
    ds = EpochDataset(cat, batch=100, seed=2)
    ref = indices(list(ds.iterate(0, 0)))
    dl = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    got = list(dl)
    assert all(isinstance(b, EpochBatch) for b in got) and np.array_equal(indices(got), ref)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_set_epoch_reaches_persistent_dataloader_workers(cat, context):
    # persistent workers keep the dataset copy they started with: set_epoch (and a resumed
    # start) must still reach them, or every epoch repeats epoch 0's order
    ds = EpochDataset(cat, batch=250, seed=6)
    dl = DataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context=context
    )
    for epoch, start in ((0, 0), (1, 0), (2, 0), (3, 1000)):
        ds.set_epoch(epoch, start)
        want = indices(list(EpochDataset(cat, batch=250, seed=6).iterate(epoch, start)))
        got = list(dl)
        assert {b.epoch for b in got} == {epoch}
        assert np.array_equal(indices(got), want), (epoch, start)
    del dl


def test_map_style_dataset_reads_batches_through_getitems(cat):
    ds = CatalogDataset(cat.directory, transform=lambda r: type(r).__name__)
    dl = DataLoader(ds, batch_size=7, num_workers=2, multiprocessing_context="fork",
                    collate_fn=list)  # fmt: skip
    names = [n for batch in dl for n in batch]
    assert len(names) == N and names[:7] == [type(record(i)).__name__ for i in range(7)]
    assert ds.__getitems__([5, 2]) == [type(record(5)).__name__, type(record(2)).__name__]
    assert isinstance(Loader(cat, batch=3), Loader)


def test_a_loader_dropped_mid_epoch_is_collected_and_its_threads_end(cat):
    import gc
    import threading
    import weakref

    from tensortier._lifetime import quiesce

    def readers() -> set:
        return {t for t in threading.enumerate() if t.name.startswith("tt-catalog-read")}

    gc.collect()  # an earlier test's dropped pool may still be ending: not this loader's threads
    assert quiesce()
    before = readers()
    loader = cat.epochs(batch=10, prefetch_budget="32KiB", io_threads=3)
    it = iter(loader)
    next(it)
    assert readers() - before
    ref = weakref.ref(loader)
    del loader, it
    gc.collect()
    assert quiesce()
    assert ref() is None and not readers() - before


# --------------------------------------------------------------------------- ranks and lifetimes
def _reads_per_setting(rank: int, world: int, path: str) -> dict:
    cat = Catalog.open(path)

    def read(**kw) -> list[int]:
        return [i for b in cat.epochs(batch=10, seed=4, **kw) for i in b.indices.tolist()]

    return {
        "explicit": read(rank=rank, world_size=world),
        "world_only": read(world_size=world),  # every rank was rank 0 before
        "rank_only": read(rank=rank),
        "neither": read(),
    }


def test_rank_and_world_size_come_from_torch_distributed_each_when_omitted(tmp_path):
    from tests.distributed import run

    path = tmp_path / "c"
    Catalog.build(path, [b"%d" % i for i in range(100)]).close()
    results = run(_reads_per_setting, 2, str(path))
    for r in results:
        assert r["world_only"] == r["rank_only"] == r["neither"] == r["explicit"]
    a, b = set(results[0]["explicit"]), set(results[1]["explicit"])
    assert not a & b and a | b == set(range(100))


def test_a_torchrun_launch_before_init_process_group_is_refused(cat, monkeypatch):
    # torchrun sets WORLD_SIZE; a loader made before init_process_group would read the whole
    # catalog in the same order on every rank (DistributedSampler raises there too)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match="WORLD_SIZE=2.*init_process_group"):
        cat.epochs(batch=100)
    with pytest.raises(ConfigError, match="WORLD_SIZE=2"):
        EpochDataset(cat, batch=100)
    assert cat.epochs(batch=100, rank=1, world_size=2).dataset.rank == 1
    assert cat.epochs(batch=100, world_size=1).records_per_epoch == N


def test_a_world_size_without_a_rank_outside_torch_distributed_is_refused(cat):
    with pytest.raises(ConfigError, match="world_size=2 but no rank.*pass rank="):
        cat.epochs(batch=8, world_size=2)
    with pytest.raises(ConfigError, match="world_size=2 but no rank"):
        EpochDataset(cat, batch=8, world_size=2)
    assert len(cat.epochs(batch=8, world_size=1)) == -(-N // 8)  # one rank needs no rank


def test_a_temporary_epoch_dataset_can_be_iterated(cat):
    n = sum(len(b) for b in EpochDataset(cat.directory, batch=100, io_threads=2))
    assert n == N
    got = [b.indices for b in EpochDataset(cat, batch=500, shuffle="none")]
    assert np.array_equal(np.concatenate(got), np.arange(N))


ABANDON = """
import sys, tensortier as tt
cat = tt.data.Catalog.open(sys.argv[1])
it = iter(cat.epochs(batch=10, num_workers=2, multiprocessing_context="fork"))
next(it)
del it  # abandoned mid-epoch, workers running
for ctx in ("fork", "spawn"):
    n = sum(len(b) for b in cat.epochs(batch=10, num_workers=2, multiprocessing_context=ctx))
    assert n == len(cat), n
print("done", flush=True)
"""


def test_abandoning_a_worker_loader_shuts_down_cleanly_without_tracebacks(cat):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", ABANDON, cat.directory],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "AssertionError" not in out.stderr, out.stderr[-3000:]


def test_old_names_warn_or_are_gone(cat):
    """One vocabulary (issue 26): ``prefetch_budget`` (bytes), mapped from ``prefetch=`` with a
    DeprecationWarning for 0.1; the class ``Batch`` is ``EpochBatch``."""
    with pytest.warns(DeprecationWarning, match="prefetch= is now prefetch_budget="):
        batches = list(cat.epochs(batch=8, prefetch="1MiB"))
    assert batches
    with pytest.warns(DeprecationWarning, match="prefetch= is now prefetch_budget="):
        EpochDataset(cat, batch=8, prefetch="1MiB")
    assert not hasattr(tt_data, "Batch") and "EpochBatch" in tt_data.__all__


def test_an_epoch_config_built_directly_maps_prefetch_to_prefetch_budget(cat):
    """``EpochConfig(prefetch=)`` was bytes too: mapped like ``epochs``/``Loader``/``EpochDataset``
    (issue 26 #4), giving the same config and the same batches; both names is a TypeError."""
    with pytest.warns(DeprecationWarning, match="prefetch= is now prefetch_budget="):
        old = EpochConfig(batch=8, seed=3, prefetch="1MiB")
    new = EpochConfig(batch=8, seed=3, prefetch_budget="1MiB")
    assert old == new and old.checked(len(cat), 1).prefetch_budget == 1 << 20
    got, want = list(EpochDataset(cat, config=old)), list(cat.epochs(batch=8, seed=3))
    assert got and [b.indices.tolist() for b in got] == [b.indices.tolist() for b in want]
    for a, b in zip(got, want):
        assert all(same(x, y) for x, y in zip(a.data, b.data, strict=True))
    with pytest.raises(TypeError, match="both prefetch= and prefetch_budget="):
        EpochConfig(batch=8, prefetch="1MiB", prefetch_budget="1MiB")


def test_a_piece_is_read_and_checked_without_python_work_per_record(tmp_path, monkeypatch):
    """One ``preadv`` per coalesced run, one descriptor per segment and piece, every header
    checked over the whole piece at once and parsed once per schema (issue 27 #3): the per-record
    ``item_ok`` and header parse of the old reader are never called."""
    import os

    from tensortier.data import _files
    from tensortier.tiers import itemcodec

    n = 4000
    path = tmp_path / "cat"
    recs = [np.random.default_rng(i).bytes(100 + i % 50) for i in range(n)]
    Catalog.build(path, recs, io_threads=2, batch_bytes="64KiB").close()
    cat = Catalog.open(path, direct=False)
    cat.direct_io()  # its probe reads once
    calls = {"preadv": 0, "item_ok": 0, "header": 0, "acquire": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapper

    monkeypatch.setattr(os, "preadv", counted("preadv", os.preadv))
    monkeypatch.setattr(_files, "item_ok", counted("item_ok", _files.item_ok))
    monkeypatch.setattr(itemcodec, "_header", counted("header", itemcodec._header))
    monkeypatch.setattr(
        _files.Descriptors, "acquire", counted("acquire", _files.Descriptors.acquire)
    )
    loader = cat.epochs(batch=500, seed=1, shuffle="full", prefetch_budget="64KiB", io_threads=2)
    got = {}
    for b in loader:
        got.update(zip(b.indices.tolist(), b.data))
    stats = loader.stats()
    loader.close()
    cat.close()
    assert len(got) == n and all(got[i] == recs[i] for i in range(n))
    assert calls["preadv"] == stats.reads  # one per coalesced run
    assert calls["acquire"] <= stats.pieces * 2
    assert calls["item_ok"] == 0
    assert calls["header"] == stats.pieces  # one schema (bytes): parsed once per piece


def _tensors(data) -> list[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        return [data]
    if isinstance(data, dict):
        return [t for v in data.values() for t in _tensors(v)]
    if isinstance(data, (list, tuple)):
        return [t for v in data for t in _tensors(v)]
    return []


def test_dataloader_pin_memory_pins_the_batch_data(cat, monkeypatch):
    """``DataLoader(pin_memory=True)``'s pinning thread left an ``EpochBatch`` as it was (torch
    pins only the types it knows, or what has a ``pin_memory()``): every record stayed pageable,
    so each host-to-device copy was synchronous. No pinned memory on this CPU: torch's own
    function is run with ``Tensor.pin_memory`` recording what it is asked to pin."""
    from torch.utils.data._utils.pin_memory import pin_memory  # what DataLoader's thread runs

    asked: list[torch.Tensor] = []

    def pin(t, device=None):
        asked.append(t)
        return t.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    batch = next(iter(EpochDataset(cat, batch=40, seed=1)))
    out = pin_memory(batch)
    assert isinstance(out, EpochBatch) and np.array_equal(out.indices, batch.indices)
    assert (out.epoch, out.position) == (batch.epoch, batch.position)
    originals = _tensors(batch.data)
    assert len(originals) > 5 and [id(t) for t in asked] == [id(t) for t in originals]
    for a, b in zip(_tensors(out.data), originals):
        assert a is not b and torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_dataloader_pin_memory_yields_pinned_records(cat):
    dl = DataLoader(EpochDataset(cat, batch=40, seed=1), batch_size=None, pin_memory=True)
    batch = next(iter(dl))
    tensors = _tensors(batch.data)
    assert isinstance(batch, EpochBatch) and tensors and all(t.is_pinned() for t in tensors)
