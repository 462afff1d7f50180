import gc
import threading

import pytest
import torch

from tensortier import ConfigError, TierFullError
from tensortier._lifetime import quiesce
from tensortier.tiers.host import PAGE, HostPool, size_class


def test_size_classes_bound_slack_and_are_page_multiples():
    for n in [1, 4095, 4096, 4097, 10_000, 2**20 + 1, 3 * 2**20, 2**30 - 7]:
        c = size_class(n)
        assert c >= n and c % PAGE == 0
        assert c <= max(PAGE, n * 1.25 + PAGE)


def test_blocks_are_page_aligned_and_sized():
    with HostPool("64MiB", pin=False) as pool:
        for n in [0, 1, 5000, 1 << 20]:
            b = pool.alloc(n)
            assert b.buffer.data_ptr() % PAGE == 0
            assert b.view.numel() == n and b.buffer.numel() == size_class(n)
            b.free()


def test_reuse_of_same_class_is_a_hit():
    with HostPool("64MiB", pin=False) as pool:
        a = pool.alloc(1 << 20)
        ptr = a.buffer.data_ptr()
        a.free()
        b = pool.alloc((1 << 20) - 100)  # same class
        assert b.buffer.data_ptr() == ptr
        assert pool.stats.hits == 1 and pool.stats.misses == 1
        assert pool.stats.in_use == size_class(1 << 20) and pool.stats.cached == 0


def test_budget_exceeded_raises_typed_error_and_pool_stays_usable():
    with HostPool("1MiB", pin=False) as pool:
        a = pool.alloc(600 * 1024)
        with pytest.raises(TierFullError) as err:
            pool.alloc(600 * 1024)
        assert err.value.tier == "host" and err.value.limit == 1 << 20
        assert "raise the host budget" in str(err.value)
        a.free()
        pool.alloc(600 * 1024).free()  # fits again


def test_cache_is_dropped_to_make_room():
    with HostPool("1MiB", pin=False) as pool:
        pool.alloc(512 * 1024).free()
        assert pool.stats.cached == 512 * 1024
        b = pool.alloc(768 * 1024)  # other class: cached block is released to fit the budget
        assert pool.stats.evictions == 1 and pool.stats.reserved <= pool.budget
        b.free()


def test_stats_peak_and_double_free():
    with HostPool("16MiB", pin=False) as pool:
        blocks = [pool.alloc(1 << 20) for _ in range(4)]
        for b in blocks:
            b.free()
        assert pool.stats.peak_in_use == 4 << 20 and pool.stats.in_use == 0
        with pytest.raises(RuntimeError, match="twice"):
            blocks[0].free()


def test_dropped_block_is_reclaimed_by_gc():
    with HostPool("16MiB", pin=False) as pool:
        pool.alloc(1 << 20)
        gc.collect()
        assert pool.stats.in_use == 0 and pool.stats.cached == 1 << 20


def test_bad_budget_and_sizes():
    with pytest.raises(ConfigError):
        HostPool("4 gigs")
    with pytest.raises(ConfigError):
        HostPool(0)
    with HostPool("1MiB", pin=False) as pool, pytest.raises(ValueError, match="negative"):
        pool.alloc(-1)


def test_pin_without_cuda_is_refused():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="pin=True needs CUDA"):
        HostPool("1MiB", pin=True)


def test_concurrent_alloc_free_keeps_accounting_exact():
    pool = HostPool("256MiB", pin=False)

    def work(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(200):
            n = int(torch.randint(1, 1 << 20, (1,), generator=g))
            b = pool.alloc(n)
            b.view.fill_(seed)
            assert bool((b.view == seed).all())
            b.free()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.stats.in_use == 0
    assert pool.stats.reserved <= pool.budget


@pytest.mark.gpu
def test_pinned_on_cuda():
    with HostPool("16MiB") as pool:
        b = pool.alloc(1 << 20)
        assert b.buffer.is_pinned()
        b.free()


def test_lent_tensor_returns_to_the_pool_when_its_storage_dies():
    with HostPool("16MiB", pin=False) as pool:
        t = pool.lend(1 << 20)
        assert t.numel() == 1 << 20 and t.data_ptr() % PAGE == 0
        view = t[10:20].view(torch.int16)  # a view keeps the storage (and the block) alive
        ptr = t.data_ptr()
        del t
        gc.collect()
        assert pool.stats.in_use == 1 << 20
        del view
        gc.collect()
        assert pool.stats.in_use == 0
        again = pool.lend(1 << 20)
        assert again.data_ptr() == ptr and pool.stats.hits == 1


# ----------------------------------------------------------------------------- lifetimes and pinning
def _finishes(fn, seconds: float = 5.0) -> bool:
    """Whether ``fn`` returns within ``seconds`` (run on a thread, so a deadlock fails, not hangs)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def test_freeing_never_takes_the_pool_lock():
    """Block finalizers run on any thread, possibly one that holds the pool's lock (LIFETIME.md):
    freeing, explicitly or by GC, only queues the block; the pool takes it back at its next call."""
    pool = HostPool("16MiB", pin=False)
    a, b = pool.alloc(1 << 20), pool.alloc(1 << 20)

    def free_both():
        nonlocal b
        a.free()
        b = None  # refcount drop: the finalizer runs here
        gc.collect()

    with pool._lock:  # as if GC ran on a thread inside alloc()
        done = _finishes(free_both)
    assert done, "freeing a block waited for the pool's lock"
    assert pool.stats.in_use == 0 and pool.stats.cached == 2 << 20
    pool.close()


def test_block_dropped_by_refcount_is_reused_by_the_next_alloc():
    with HostPool("16MiB", pin=False) as pool:
        b = pool.alloc(3 << 20)
        ptr = b.buffer.data_ptr()
        del b
        again = pool.alloc(3 << 20)
        assert again.buffer.data_ptr() == ptr and pool.stats.hits == 1
        again.free()


class _FakePinning:
    """Stands in for cudaHostRegister/cudaHostUnregister: records what is pinned right now."""

    def __init__(self):
        self.pinned: dict[int, int] = {}
        self.peak = 0

    def register(self, buffer):
        assert buffer.data_ptr() % PAGE == 0 and buffer.numel() % PAGE == 0
        assert buffer.data_ptr() not in self.pinned
        self.pinned[buffer.data_ptr()] = buffer.numel()
        self.peak = max(self.peak, self.bytes)

    def unregister(self, buffer):
        del self.pinned[buffer.data_ptr()]

    @property
    def bytes(self) -> int:
        return sum(self.pinned.values())


@pytest.fixture
def pinning(monkeypatch):
    from tensortier.tiers import host

    fake = _FakePinning()
    monkeypatch.setattr(host, "_cuda_available", lambda: True)
    monkeypatch.setattr(host, "_register", fake.register)
    monkeypatch.setattr(host, "_unregister", fake.unregister)
    return fake


@pytest.mark.parametrize("pin", [False, True])
def test_pool_buffers_start_their_own_storage(pin, pinning):
    """H100 run 2: ``is_pinned()`` was False on pool blocks. PyTorch asks CUDA about a tensor's
    *storage* start, and a block was a view into a larger unaligned tensor whose first byte lies
    in a page that was never registered. Every buffer the pool or ``aligned_empty`` hands out
    must begin its storage at its aligned first byte (the byte that is registered)."""
    from tensortier.tiers import host

    with HostPool("16MiB", pin=pin) as pool:
        b = pool.alloc(1 << 20)
        assert b.buffer.untyped_storage().data_ptr() == b.buffer.data_ptr()
        assert b.buffer.data_ptr() % PAGE == 0
        b.free()
    t = host.aligned_empty(10_000, alignment=4096)
    assert t.untyped_storage().data_ptr() == t.data_ptr() and t.data_ptr() % 4096 == 0
    assert t.numel() == 10_000


def test_pinned_bytes_are_the_accounted_bytes_and_never_exceed_the_budget(pinning):
    """PyTorch's host allocator would pin 64 MiB for each 40 MiB class (powers of two) and never
    unpin; the pool pins exactly its size classes and unpins what it evicts or drops."""
    budget = 256 << 20
    with HostPool(budget) as pool:
        assert pool.pin
        blocks = []
        with pytest.raises(TierFullError):
            while True:
                blocks.append(pool.alloc(40 << 20))
        assert len(blocks) == 6 and pinning.bytes == pool.stats.reserved == 6 * (40 << 20)
        for b in blocks:
            b.free()
        assert pinning.bytes == pool.stats.reserved == pool.stats.cached
        big = pool.alloc(200 << 20)  # evicts cached 40 MiB blocks: they are unpinned
        assert pool.stats.evictions >= 5 and pinning.bytes == pool.stats.reserved <= budget
        big.free()
        assert pool.empty_cache() > 0 and pinning.bytes == 0 == pool.stats.reserved
        pool.alloc(1 << 20).free()
    assert pinning.bytes == 0  # close() unpins the cache
    assert pinning.peak <= budget


def test_block_freed_after_close_is_unpinned(pinning):
    pool = HostPool("16MiB")
    block = pool.alloc(1 << 20)
    pool.close()
    assert pinning.bytes == 1 << 20  # still in use
    del block
    gc.collect()
    assert quiesce()
    assert pinning.bytes == 0


def test_blocks_given_back_after_close_leave_the_pools_stats():
    """A block still lent when the pool closes and given back later leaves ``in_use``: the pool
    reads 0 reserved once everything it lent came back (before, it kept counting the block, and
    whether a replaced offloader's pool read 0 depended on when the GC found a cycle that held
    one of its blocks: a flaky ``test_switching_offload_settings_every_step_releases_everything``)."""
    pool = HostPool("16MiB", pin=False)
    kept, freed = pool.alloc(1 << 20), pool.alloc(2 << 20)
    pool.close()
    freed.free()
    del kept
    gc.collect()
    assert quiesce()
    assert pool.stats.in_use == 0 and pool.stats.reserved == 0


def test_dropped_pool_unpins_its_cache_on_the_reaper(pinning):
    pool = HostPool("16MiB")
    pool.warm([1 << 20, 2 << 20])
    assert pinning.bytes == (1 << 20) + (2 << 20)
    del pool
    gc.collect()
    assert quiesce()
    assert pinning.bytes == 0


def test_warm_makes_later_allocations_hits():
    with HostPool("64MiB", pin=False) as pool:
        assert pool.warm([1 << 20, 5 << 20, 5 << 20]) == (1 << 20) + 2 * size_class(5 << 20)
        misses = pool.stats.misses
        blocks = [pool.alloc(5 << 20), pool.alloc(5 << 20), pool.alloc(1 << 20)]
        assert pool.stats.misses == misses and pool.stats.hits == 3
        for b in blocks:
            b.free()


@pytest.mark.gpu
def test_pinned_pool_stays_within_its_budget_on_cuda(monkeypatch):
    """REVIEW #9: 40 MiB blocks until the budget is reached; what is pinned is what is accounted,
    PyTorch's host allocator is not involved, and close() unpins everything."""
    from tensortier.tiers import host

    real_register, real_unregister = host._register, host._unregister
    fake = _FakePinning()

    def register(buffer):
        real_register(buffer)
        fake.register(buffer)

    def unregister(buffer):
        real_unregister(buffer)
        fake.unregister(buffer)

    monkeypatch.setattr(host, "_register", register)
    monkeypatch.setattr(host, "_unregister", unregister)
    before = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    pool = HostPool("1GiB")
    blocks = []
    with pytest.raises(TierFullError):
        while True:
            blocks.append(pool.alloc(40 << 20))
    assert all(b.buffer.is_pinned() for b in blocks)
    assert fake.bytes == pool.stats.reserved <= pool.budget
    after = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    assert after == before  # no cudaHostAlloc: PyTorch's power-of-two allocator is not used
    x = torch.randn(10 << 20, device="cuda")
    blocks[0].view[: x.numel() * 4].view(torch.float32).copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(blocks[0].view[: x.numel() * 4].view(torch.float32), x.cpu())
    for b in blocks:
        b.free()
    pool.close()
    assert fake.bytes == 0


# ----------------------------------------------------------------------------- copies in flight (review-12-18 #3)
class _Copy:
    """A copy's completion marker, as a CUDA event is: ``query()`` and ``synchronize()``."""

    def __init__(self):
        self.done = threading.Event()
        self.waited = 0

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.waited += 1
        self.done.set()  # as if the device reached the event


def test_freed_block_is_not_lent_while_a_copy_still_reads_it():
    """PyTorch's CachingHostAllocator records an event per copy and never reuses a block before it
    completes; a freed block whose copy is queued must not be handed out and rewritten."""
    with HostPool("64MiB", pin=False) as pool:
        block = pool.alloc(1 << 20)
        ptr = block.buffer.data_ptr()
        copy = _Copy()
        block.record(copy)
        block.free()
        other = pool.alloc(1 << 20)
        assert other.buffer.data_ptr() != ptr, "a block was lent again under its queued copy"
        assert pool.stats.busy == 1 << 20 and pool.stats.cached == 0
        copy.done.set()  # the copy completed: the block joins the cache at the next call
        again = pool.alloc(1 << 20)
        assert again.buffer.data_ptr() == ptr and pool.stats.busy == 0
        assert copy.waited == 0  # queried, never waited for
        other.free()
        again.free()


def test_full_pool_waits_for_a_busy_block_or_raises_on_transfer_threads():
    with HostPool("1MiB", pin=False) as pool:
        block = pool.alloc(1 << 20)
        ptr = block.buffer.data_ptr()
        copy = _Copy()
        block.record(copy)
        block.free()
        with pytest.raises(TierFullError, match="still read by copies"):
            pool.alloc(1 << 20, wait=False)
        again = pool.alloc(1 << 20)  # waits for the copy, then reuses the block
        assert copy.waited == 1 and again.buffer.data_ptr() == ptr
        again.free()
        assert pool.stats.reserved == pool.stats.cached == 1 << 20


def test_record_on_a_freed_block_is_refused():
    with HostPool("1MiB", pin=False) as pool:
        block = pool.alloc(100)
        block.free()
        with pytest.raises(RuntimeError, match="already freed"):
            block.record(_Copy())


def test_a_held_view_keeps_its_block_alive():
    """HostBlock.hold(): the memory is not lent again while a tensor viewing it lives."""
    with HostPool("16MiB", pin=False) as pool:
        view = pool.alloc(1 << 20).hold().view(torch.float32)
        view.fill_(1.0)
        gc.collect()
        assert pool.stats.in_use == 1 << 20
        other = pool.alloc(1 << 20)
        other.view.fill_(7)
        assert bool((view == 1.0).all())
        part = view[10:20]
        del view
        gc.collect()
        assert pool.stats.in_use == 2 << 20  # a view of the view still holds it
        del part
        gc.collect()
        assert pool.stats.in_use == 1 << 20
        other.free()


def test_closed_pool_unpins_a_busy_block_only_after_its_copy(pinning):
    pool = HostPool("16MiB")
    block = pool.alloc(1 << 20)
    copy = _Copy()
    block.record(copy)
    pool.close()
    block.free()
    gc.collect()
    assert quiesce()  # the reaper waited for the copy (synchronize), then unpinned
    assert copy.waited == 1 and pinning.bytes == 0


# ----------------------------------------------------------------------------- pinning outside pools (review-12-18 #6)
def test_pinned_aligned_empty_registers_exactly_its_pages_and_unpins_when_dropped(pinning):
    """PyTorch's host allocator would pin 16 KiB for 10 000 bytes (a power of two) and keep it
    cached after the tensor dies; aligned_empty(pin=True) pins its 3 pages, counted in
    pinned_bytes(), and unpins them on the reaper once the last view is gone."""
    from tensortier.tiers.host import aligned_empty, pinned_bytes

    base = pinned_bytes()
    t = aligned_empty(10_000, pin=True, alignment=64)
    assert t.numel() == 10_000 and t.dtype == torch.uint8 and t.data_ptr() % PAGE == 0
    assert pinning.bytes == 3 * PAGE == pinned_bytes() - base
    part = t[4096:8192].view(torch.float32)
    part.fill_(1.0)
    del t
    gc.collect()
    assert quiesce() and pinning.bytes == 3 * PAGE  # a view still uses it
    del part
    gc.collect()
    assert quiesce()
    assert pinning.bytes == 0 and pinned_bytes() == base


def test_dropped_pinned_buffer_is_unpinned_on_the_reaper_after_the_devices(pinning, monkeypatch):
    """A copy queued before the last tensor died may still use the memory: every device finishes
    its queued work before the pages are unregistered, never inside the finalizer."""
    from tensortier.tiers import host

    events = []
    monkeypatch.setattr(host, "_synchronize_devices", lambda: events.append("sync"))
    unregister = pinning.unregister

    def record(buffer):
        events.append(("unregister", threading.current_thread().name))
        unregister(buffer)

    monkeypatch.setattr(host, "_unregister", record)
    t = host.aligned_empty(1 << 20, pin=True)
    del t
    gc.collect()
    assert quiesce()
    assert events == ["sync", ("unregister", "tt-reaper")]


def test_pinned_copy_and_pools_share_the_count(pinning):
    from tensortier.tiers.host import pinned_bytes, pinned_copy

    base = pinned_bytes()
    x = torch.randn(3, 1000, dtype=torch.float64)
    c = pinned_copy(x)
    assert torch.equal(c, x) and c.dtype == x.dtype and c.data_ptr() % PAGE == 0
    with HostPool("16MiB") as pool:
        block = pool.alloc(1 << 20)
        assert pinned_bytes() - base == (1 << 20) + 24 * 1024 == pinning.bytes
        block.free()
    del c
    gc.collect()
    assert quiesce() and pinned_bytes() == base == pinning.bytes


def test_optimizer_masters_pin_what_they_hold(pinning):
    """OffloadedAdamW's pinned masters (one call site of aligned_empty(pin=True)): a bucket of
    3 MiB + 4 bytes pins 3 MiB + one page, not 4 MiB, and nothing once dropped."""
    from tensortier.optim._states import _HostBuf

    buf = _HostBuf((3 << 18) + 1, torch.float32, pin=True)
    assert pinning.bytes == (3 << 20) + PAGE
    del buf
    gc.collect()
    assert quiesce() and pinning.bytes == 0


@pytest.mark.gpu
def test_pinned_aligned_empty_on_cuda_is_exact_and_returned(monkeypatch):
    """review-12-18 #6: checkpoint images, optimizer masters/snapshots/ring and streamer homes pin
    through aligned_empty(pin=True): exact pages, no PyTorch host allocation, unpinned once
    dropped, and usable for asynchronous copies."""
    from tensortier.tiers.host import aligned_empty, pinned_bytes

    gc.collect()
    quiesce()
    base = pinned_bytes()
    before = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    n = (40 << 20) + 100  # PyTorch's allocator would pin 64 MiB
    t = aligned_empty(n, pin=True)
    assert t.is_pinned() and pinned_bytes() - base == (40 << 20) + PAGE
    assert torch.cuda.host_memory_stats().get("num_host_alloc", 0) == before
    x = torch.randn(10 << 20, device="cuda")
    t[: x.numel() * 4].view(torch.float32).copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(t[: x.numel() * 4].view(torch.float32), x.cpu())
    y = torch.empty_like(x)
    torch.cuda._sleep(1_000_000_000)
    y.copy_(t[: x.numel() * 4].view(torch.float32), non_blocking=True)  # queued behind the sleep
    del t  # the reaper waits for the device before unpinning and freeing
    gc.collect()
    assert quiesce()
    assert torch.equal(y, x) and pinned_bytes() == base
