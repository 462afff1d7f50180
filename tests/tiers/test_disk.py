import errno
import gc
import os
import stat
import subprocess
import sys
import threading
import warnings
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensortier import (
    ClosedError,
    ConfigError,
    CorruptDataError,
    DiskStore,
    SpillDirError,
    TierFullError,
)
from tensortier._lifetime import quiesce
from tensortier.tiers.host import PAGE, aligned_empty
from tests.conftest import ALL_DTYPES, bit_equal, make_tensor


@pytest.fixture(params=[None, False], ids=["direct-auto", "buffered"])
def store(request, spill_dir):
    with DiskStore(spill_dir, slab_size="4MiB", direct=request.param) as s:
        yield s


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 5), (7, 1, 13), (1000, 33)], ids=str)
def test_round_trip_every_dtype_and_shape(store, dtype, shape):
    x = make_tensor(shape, dtype)
    y = store.read(store.write(x))
    assert bit_equal(x, y)


def test_round_trip_special_values(store):
    x = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45], dtype=torch.float32)
    assert bit_equal(x, store.read(store.write(x)))
    z = torch.tensor([complex(1, -2), complex(float("nan"), 0)], dtype=torch.complex64)
    assert bit_equal(z, store.read(store.write(z)))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(64, 48).t(),  # transposed
        lambda: torch.randn(10, 20, 30)[:, ::3, 1:],  # strided slice
        lambda: torch.randn(8, 1).expand(8, 100),  # broadcast (stride 0)
        lambda: torch.randn(6, 6, dtype=torch.complex64).conj(),  # lazy conjugate
        lambda: torch.randn(5, 7).to(torch.bfloat16)[1:, ::2],
        lambda: torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last),
        # contiguous() keeps these strides (2), which a byte view refused
        lambda: torch.tensor([3.0, 4.0], dtype=torch.bfloat16)[::2],
        lambda: torch.zeros(0, 4, dtype=torch.float16)[:, ::2],
    ],
    ids=[
        "transposed",
        "sliced",
        "expanded",
        "conj",
        "bf16-slice",
        "channels-last",
        "one-element-stride-2",
        "empty-stride-2",
    ],
)
def test_round_trip_non_contiguous_gives_equal_values(store, make):
    x = make()
    y = store.read(store.write(x))
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y, x.resolve_conj())


def test_tensor_larger_than_a_slab_and_than_a_chunk(spill_dir):
    with DiskStore(spill_dir, slab_size="1MiB") as s:
        x = torch.randint(0, 256, (40 << 20,), dtype=torch.uint8)  # 40 MiB: 3 I/O chunks, own slab
        assert torch.equal(s.read(s.write(x)), x)


def test_reads_into_given_buffer(store):
    x = torch.randn(1000)
    h = store.write(x)
    buf = aligned_empty(h.length + 128)[128:]  # 64-byte but not page aligned: staged I/O
    y = store.get(h, into=buf).result()
    assert torch.equal(x, y) and y.data_ptr() == buf.data_ptr()
    with pytest.raises(ValueError, match="uint8"):
        store.get(h, into=torch.empty(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="aligned"):
        store.get(h, into=aligned_empty(h.length + 3)[3:])


def test_extents_are_page_aligned(store):
    hs = [store.write(torch.randn(n)) for n in [1, 1000, 5000, 33333]]
    for h in hs:
        assert h.offset % PAGE == 0 and h.length % PAGE == 0 and h.length >= h.nbytes


def test_free_list_reuse_no_file_growth_over_1000_cycles(spill_dir):
    g = torch.Generator().manual_seed(0)
    with DiskStore(spill_dir, slab_size="8MiB") as s:
        live = []
        sizes_seen = []
        for cycle in range(1000):
            n = int(torch.randint(1, 300_000, (1,), generator=g))  # up to ~1.2 MB of float32
            live.append((s.write(torch.full((n,), float(cycle))), cycle))
            if len(live) > 5:  # at most 6 live: ~7 MB, fits in one slab when space is reused
                i = int(torch.randint(0, len(live), (1,), generator=g))
                h, c = live.pop(i)
                assert bool((s.read(h) == c).all())
                s.free(h)
            sizes_seen.append(s.stats.file_bytes)
        slabs = [f for f in os.listdir(s.directory) if f.startswith("slab-")]
        on_disk = sum(os.path.getsize(os.path.join(s.directory, f)) for f in slabs)
        assert max(sizes_seen) == sizes_seen[-1] == on_disk
        assert on_disk <= 16 << 20, f"files grew to {on_disk} bytes: extents are not reused"
        for h, _ in live:
            s.free(h)
        slab = next(iter(s._files.slabs.values()))
        assert slab.free_list == [(0, slab.size)]  # every extent merged back


def test_budget_exhaustion_is_typed_and_store_stays_usable(spill_dir):
    with DiskStore(spill_dir, budget="2MiB", slab_size="1MiB") as s:
        a = s.write(torch.zeros(200_000))  # 800 KB
        b = s.write(torch.zeros(200_000))
        with pytest.raises(TierFullError) as err:
            s.put(torch.zeros(200_000))  # raised by put itself, at the write that hit it
        assert err.value.tier == "disk" and err.value.limit == 2 << 20
        assert "raise the budget" in str(err.value)
        assert len(s) == 2 and torch.equal(s.read(a), torch.zeros(200_000))
        s.free(b)
        c = s.write(torch.ones(200_000))
        assert torch.equal(s.read(c), torch.ones(200_000)) and torch.equal(
            s.read(a), torch.zeros(200_000)
        )


def test_a_tensor_larger_than_the_whole_budget_says_freeing_cannot_help(spill_dir):
    with DiskStore(spill_dir, budget="64KiB") as s:
        with pytest.raises(TierFullError, match="larger than the whole disk budget") as err:
            s.put(torch.zeros(100_000))  # 400 KB: was "Free tensors or raise the budget"
        assert "Free tensors" not in str(err.value) and err.value.requested == 401_408  # pages
        assert s.stats.file_bytes == 0 and len(s) == 0


def test_full_disk_during_write_is_typed_and_rolled_back(store, monkeypatch):
    keep = store.write(torch.arange(1000.0))
    used = store.stats.used_bytes
    real_pwrite = os.pwrite

    def enospc(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", enospc)
    fut = store.put(torch.randn(300_000))
    with pytest.raises(TierFullError, match="disk full") as err:
        fut.result()
    assert isinstance(err.value.__cause__, OSError)
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert store.stats.used_bytes == used and len(store) == 1
    assert torch.equal(store.read(keep), torch.arange(1000.0))
    x = torch.randn(300_000)
    assert torch.equal(store.read(store.write(x)), x)  # the rolled-back extent is reusable


def _slab_path(store: DiskStore) -> str:
    (path,) = [os.path.join(store.directory, n) for n in os.listdir(store.directory) if "slab" in n]
    return path


@pytest.mark.parametrize("where", [0, 5000, 300_000 * 4 - 1], ids=["first", "middle", "last"])
def test_a_flipped_bit_in_the_spill_file_is_a_corrupt_data_error(store, where):
    x = torch.randn(300_000)
    h = store.write(x)
    fd = os.open(_slab_path(store), os.O_RDWR)
    try:
        byte = os.pread(fd, 1, h.offset + where)
        os.pwrite(fd, bytes([byte[0] ^ 0x04]), h.offset + where)
    finally:
        os.close(fd)
    with pytest.raises(CorruptDataError, match="CRC32C") as err:
        store.read(h)  # was: a tensor one bit off, returned as if intact
    assert err.value.path == _slab_path(store)
    y = torch.arange(10.0)
    assert torch.equal(store.read(store.write(y)), y)  # the store stays usable


def test_a_truncated_spill_file_is_a_corrupt_data_error(store):
    h = store.write(torch.randn(300_000))
    os.truncate(_slab_path(store), h.offset + PAGE)
    with pytest.raises(CorruptDataError, match="truncated"):  # was: OSError(EIO, "short read")
        store.read(h)


def test_full_disk_at_preallocation_is_typed(spill_dir, monkeypatch):
    def enospc(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    with DiskStore(spill_dir, slab_size="1MiB") as s:
        monkeypatch.setattr(os, "posix_fallocate", enospc)
        with pytest.raises(TierFullError, match="disk full"):
            s.put(torch.zeros(10))
        monkeypatch.undo()
        assert torch.equal(s.read(s.write(torch.ones(10))), torch.ones(10))


def _disk_with_room(monkeypatch, directory: str, room: int) -> None:
    """posix_fallocate as on a disk with ``room`` bytes free for the slabs in ``directory``."""
    real = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        used = sum(e.stat().st_size for e in os.scandir(directory) if e.name.startswith("slab"))
        if used + length > room:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)


def test_a_nearly_full_disk_still_takes_what_fits(spill_dir, monkeypatch):
    with DiskStore(spill_dir, slab_size="256MiB") as s:
        _disk_with_room(monkeypatch, s.directory, 1 << 20)
        # was TierFullError "cannot preallocate 256MiB" with 1 MiB free: now slabs of their size
        hs = [s.write(torch.full((1 << 16,), float(i))) for i in range(4)]  # 256 KiB each
        with pytest.raises(TierFullError, match="disk full"):
            s.put(torch.ones(10))  # the disk is full now
        assert all(
            torch.equal(s.read(h), torch.full((1 << 16,), float(i))) for i, h in enumerate(hs)
        )
        for h in hs:
            s.free(h)
        x = torch.randn(1 << 18)  # 1 MiB: the 4 empty slabs are deleted to make room for it
        assert torch.equal(s.read(s.write(x)), x)
        assert s.stats.file_bytes == 1 << 20 and len(s) == 1


def test_missing_spill_dir_names_the_fix(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(SpillDirError, match="does not exist.*mkdir -p"):
        DiskStore(missing)


@pytest.mark.parametrize("value", [5, b"/tmp", ["/tmp"]], ids=["int", "bytes", "list"])
def test_spill_dir_of_a_wrong_type_names_it_and_the_fix(value):
    # was os.fspath's "expected str, bytes or os.PathLike object, not int" (or, for bytes,
    # tempfile's "Can't mix strings and bytes in path components")
    with pytest.raises(TypeError, match=r"spill_dir=.*pass a directory path as a str"):
        DiskStore(value)


def test_spill_dir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SpillDirError, match="not a directory"):
        DiskStore(f)


def test_unwritable_spill_dir_names_the_fix(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.access(ro, os.W_OK):  # root ignores permission bits: make creation fail as it would
        import tempfile

        def denied(*a, **k):
            raise PermissionError(errno.EACCES, "Permission denied")

        monkeypatch.setattr(tempfile, "mkdtemp", denied)
    with pytest.raises(SpillDirError, match="make it writable or pass another spill_dir"):
        DiskStore(ro)
    ro.chmod(stat.S_IRWXU)


def test_read_only_filesystem_is_refused():
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc")
    with pytest.raises(SpillDirError):
        DiskStore("/proc/self")


def test_private_directory_and_files_removed_on_close(spill_dir):
    s = DiskStore(spill_dir)
    assert stat.S_IMODE(os.stat(s.directory).st_mode) == 0o700
    s.write(torch.randn(100))
    assert os.listdir(s.directory)
    s.close()
    assert not os.path.exists(s.directory)
    with pytest.raises(ClosedError):
        s.put(torch.randn(3))
    s.close()  # idempotent


def test_files_removed_after_exception_in_context(spill_dir):
    with pytest.raises(ZeroDivisionError), DiskStore(spill_dir) as s:
        s.write(torch.randn(100))
        root = s.directory
        1 / 0  # noqa: B018
    assert not os.path.exists(root)


def test_files_removed_on_garbage_collection(spill_dir):
    s = DiskStore(spill_dir)
    s.write(torch.randn(100))
    root = s.directory
    del s
    gc.collect()
    assert quiesce()  # GC hands the cleanup to the reaper thread (tensortier._lifetime)
    assert not os.path.exists(root)


def test_free_twice_and_foreign_handles(spill_dir):
    with DiskStore(spill_dir) as a, DiskStore(spill_dir) as b:
        h = a.write(torch.randn(10))
        with pytest.raises(KeyError):
            b.read(h)
        a.free(h)
        with pytest.raises(KeyError, match="freed twice"):
            a.free(h)
        with pytest.raises(KeyError):
            a.read(h)


def test_bad_arguments(spill_dir):
    with pytest.raises(ConfigError):
        DiskStore(spill_dir, budget="lots")
    with pytest.raises(ConfigError, match="negative"):
        DiskStore(spill_dir, budget=-1)
    with pytest.raises(ValueError, match="io_threads"):
        DiskStore(spill_dir, io_threads=0)
    with DiskStore(spill_dir) as s, pytest.raises(TypeError, match="to_dense"):
        s.put(torch.eye(3).to_sparse())


@pytest.mark.parametrize("value", ["4", 4.0, True, None, 0, -2, 10**6])
def test_bad_io_threads_is_a_config_error_naming_it_and_the_fix(spill_dir, value):
    with pytest.raises(ConfigError, match=r"io_threads=.*pass"):
        DiskStore(spill_dir, io_threads=value)
    assert os.listdir(spill_dir) == []  # refused before any directory was made


def test_bad_direct_and_tiny_budget_are_config_errors(spill_dir):
    with pytest.raises(ConfigError, match="direct='yes'.*True.*False.*None"):
        DiskStore(spill_dir, direct="yes")
    with pytest.raises(ConfigError, match="budget=100.*at least 4KiB"):
        DiskStore(spill_dir, budget=100)


def test_wrong_operands_are_type_errors_naming_the_argument(spill_dir):
    with DiskStore(spill_dir) as s:
        with pytest.raises(TypeError, match=r"put\(tensor\).*got list.*torch.as_tensor"):
            s.put([1, 2, 3])
        with pytest.raises(TypeError, match=r"put\(tensor\).*got ndarray"):
            s.put(torch.ones(3).numpy())
        with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
        with pytest.raises(TypeError, match="quantized"):
            s.put(q)
        with pytest.raises(ValueError, match="CPU tensors.*meta"):
            s.put(torch.empty(3, device="meta"))
        with warnings.catch_warnings():  # the strided nested layout is a prototype
            warnings.simplefilter("ignore", UserWarning)
            nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        with pytest.raises(TypeError, match=r"nested.*unbind"):  # was torch's reshape error
            s.put(nested)
        with pytest.raises(TypeError, match=r"get\(handle\).*DiskHandle.*got int"):
            s.get(3)
        with pytest.raises(TypeError, match=r"free\(handle\).*DiskHandle.*got NoneType"):
            s.free(None)


def test_every_call_after_close_is_a_closed_error(spill_dir):
    s = DiskStore(spill_dir)
    h = s.write(torch.ones(10))
    s.close()
    for call in (
        lambda: s.put(torch.ones(10)),
        lambda: s.put(torch.ones(0)),  # nothing to write, still refused
        lambda: s.get(h),
        lambda: s.write(torch.ones(3)),
    ):
        with pytest.raises(ClosedError, match="closed"):
            call()
    s.free(h)  # a no-op after close: finalizers of other objects may still free extents


def test_close_fails_queued_io_instead_of_leaving_futures_unresolved(spill_dir, monkeypatch):
    gate, started = threading.Event(), threading.Event()
    s = DiskStore(spill_dir, io_threads=1, slab_size="1MiB")
    real = s._write_chunk

    def held(fd, pos, data):
        started.set()
        assert gate.wait(30)
        real(fd, pos, data)

    monkeypatch.setattr(s, "_write_chunk", held)
    running = s.put(torch.ones(10))  # occupies the only I/O thread
    assert started.wait(30)
    queued = s.put(torch.ones(10))  # waits in the pool's queue
    closer = threading.Thread(target=s.close)
    closer.start()
    try:
        error = queued.exception(timeout=10)  # before the fix: never resolved (TimeoutError)
        assert isinstance(error, ClosedError)
    finally:
        gate.set()
        closer.join(30)
    assert not closer.is_alive()
    assert running.exception(timeout=10) is None  # the running write completed
    assert not os.path.exists(s.directory)


# --------------------------------------------------------------------------- budget vs slabs
def test_budget_below_the_slab_size_still_stores_tensors(spill_dir):
    with DiskStore(spill_dir, budget="8MiB") as s:  # default slab_size is 256MiB
        assert s.slab_size == 8 << 20
        x = torch.arange(10.0)
        assert torch.equal(s.read(s.write(x)), x)
        big = torch.ones(7 << 18)  # 7 MiB: fits the budget
        assert torch.equal(s.read(s.write(big)), big)
        assert s.stats.file_bytes <= 8 << 20
        with pytest.raises(TierFullError, match="raise the budget"):
            s.put(torch.ones(2 << 18))  # 2 MiB more does not fit in 8 MiB
        assert len(s) == 2


def test_last_slab_is_cut_to_the_budget_left(spill_dir):
    with DiskStore(spill_dir, budget="3MiB", slab_size="2MiB") as s:
        a = s.write(torch.ones(1 << 19))  # 2 MiB: the first slab
        b = s.write(torch.ones(1 << 18))  # 1 MiB: a 2 MiB slab would exceed 3 MiB; a 1 MiB one fits
        assert s.stats.file_bytes == 3 << 20
        assert torch.equal(s.read(b), torch.ones(1 << 18)) and torch.equal(
            s.read(a), torch.ones(1 << 19)
        )


def test_offload_with_a_small_disk_budget_works(spill_dir):
    """What ``tt.offload(tier="disk", disk_budget="64MiB")`` builds (issue 18 #15)."""
    import tensortier as tt

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
    x = torch.randn(1024, 256)
    m(x).sum().backward()
    expected = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    off = tt.Offloader("disk", spill_dir=spill_dir, min_bytes="256KiB", disk_budget="64MiB")
    try:
        with off:
            loss = m(x).sum()
        loss.backward()  # before the fix: TierFullError (a 256 MiB slab in a 64 MiB budget)
        assert off.stats.bytes_offloaded["disk"] > 0
    finally:
        off.close()
    assert all(torch.equal(p.grad, e) for p, e in zip(m.parameters(), expected))


# --------------------------------------------------------------------------- lifetime
def test_free_never_waits_for_the_lock_and_the_space_is_reused_after(spill_dir):
    """free() runs in finalizers: GC can run it on a thread that already holds the store's lock."""
    with DiskStore(spill_dir, slab_size="1MiB") as s:
        h = s.write(torch.ones(1 << 18))  # fills the 1 MiB slab
        slab = next(iter(s._files.slabs.values()))
        done = threading.Event()

        def gc_inside_a_locked_section():
            with s._lock:  # what a GC pass inside put/get bookkeeping looks like
                s.free(h)  # before the fix: blocks forever on the store's own lock
                done.set()

        t = threading.Thread(target=gc_inside_a_locked_section, daemon=True)
        t.start()
        assert done.wait(10), "free() blocked on the store lock"
        t.join(10)
        assert h not in s and len(s) == 0
        h2 = s.write(torch.ones(1 << 18))  # the next call drains the queue: same slab reused
        assert len(s._files.slabs) == 1 and h2.slab == slab.index and h2.offset == 0
        assert s.stats.used_bytes == h2.length and s.stats.live_tensors == 1


def test_free_from_a_weakref_finalizer_gives_the_space_back_at_once(spill_dir):
    with DiskStore(spill_dir, slab_size="1MiB") as s:
        h = s.write(torch.ones(1 << 18))

        class Record:
            pass

        r = Record()
        weakref.finalize(r, s.free, h)
        del r
        gc.collect()
        slab = next(iter(s._files.slabs.values()))
        assert slab.free_list == [(0, slab.size)] and s.stats.used_bytes == 0


def test_dropped_on_its_own_io_thread_still_removes_its_files(spill_dir, monkeypatch):
    """The last reference dropped in a put() callback: cleanup cannot join the I/O thread there."""
    gate = threading.Event()
    real = DiskStore._write_chunk

    def held(self, fd, pos, data):  # the write is still running when the callback is added
        assert gate.wait(30)
        real(self, fd, pos, data)

    monkeypatch.setattr(DiskStore, "_write_chunk", held)
    s = DiskStore(spill_dir, slab_size="1MiB")
    root = s.directory
    box, ran_on = [s], []
    fut = s.put(torch.ones(1000))

    def drop(_f):
        ran_on.append(threading.current_thread().name)
        box.clear()  # the last reference goes here, on the I/O thread

    fut.add_done_callback(drop)
    del s
    gate.set()
    fut.result(timeout=30)
    assert ran_on and ran_on[0].startswith("tt-disk")
    gc.collect()
    assert quiesce()
    assert not os.path.exists(root)
    assert not [
        fd
        for fd in os.listdir("/proc/self/fd")
        if os.path.realpath(f"/proc/self/fd/{fd}").startswith(root)
    ]


def test_collected_under_threading_locks_does_not_deadlock(tmp_path):
    """GC inside threading's bookkeeping must not join the store's threads (issue 18 #6)."""
    child = r"""
import gc, sys, threading, torch
from tensortier import DiskStore
from tensortier._lifetime import quiesce
s = DiskStore(sys.argv[1])
root = s.directory
s.put(torch.ones(1000)).result()
cycle = [s]; cycle.append(cycle)
del s, cycle
gc.disable()
with threading._shutdown_locks_lock:
    gc.collect()
assert quiesce(20)
import os
assert not os.path.exists(root)
print("OK", flush=True)
"""
    try:
        r = subprocess.run(
            [sys.executable, "-c", child, str(tmp_path)], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a DiskStore collected under threading's locks deadlocked the process")
    assert "OK" in r.stdout, r.stderr


def test_concurrent_puts_and_gets_from_4_threads(spill_dir):
    errors = []
    with DiskStore(spill_dir, slab_size="2MiB", io_threads=4) as s:

        def worker(seed):
            try:
                for i in range(50):
                    x = make_tensor(
                        (int(1000 + 997 * i % 50_000),), ALL_DTYPES[(seed + i) % 12], seed
                    )
                    h = s.write(x)
                    assert bit_equal(s.read(h), x)
                    if i % 3:
                        s.free(h)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert len(s) == 4 * 17


def test_stats_count_bytes(store):
    h = store.write(torch.zeros(1024))
    store.read(h)
    assert store.stats.bytes_written >= 4096 and store.stats.bytes_read >= 4096
    assert store.stats.puts == 1 and store.stats.gets == 1 and store.stats.live_tensors == 1
    store.free(h)
    assert store.stats.used_bytes == 0 and store.stats.live_tensors == 0


_ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "free"]),
        st.integers(0, 10**6),
        st.sampled_from(range(len(ALL_DTYPES))),
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_ops)
def test_property_random_put_get_free_keeps_live_tensors_intact(tmp_path, ops):
    with DiskStore(tmp_path, slab_size="1MiB") as s:
        live: list = []
        for op, n, d in ops:
            if op == "put" or not live:
                x = make_tensor(((n % 70_000),), ALL_DTYPES[d], seed=n)
                live.append((s.write(x), x))
            elif op == "get":
                h, x = live[n % len(live)]
                assert bit_equal(s.read(h), x)
            else:
                h, _ = live.pop(n % len(live))
                s.free(h)
        for h, x in live:
            assert bit_equal(s.read(h), x)
        assert s.stats.used_bytes == sum(h.length for h, _ in live)


def test_the_staging_buffer_grows_to_the_pieces_it_carries(spill_dir):
    """Unaligned memory goes through a per-thread aligned buffer, resident (a CPU budget pays for
    it): sized to the largest piece carried, in powers of two up to 4 MiB, not 4 MiB from the
    first 100 KB tensor (issue 27); every byte still comes back."""

    def unaligned(n: int) -> torch.Tensor:
        t = torch.empty(n + 64 + PAGE, dtype=torch.uint8)
        start = 64 if t.data_ptr() % PAGE == 0 else 0  # 64-byte aligned, not page-aligned
        t = t[start : start + n]
        assert t.data_ptr() % 64 == 0 and t.data_ptr() % PAGE
        return t

    with DiskStore(spill_dir, io_threads=1) as s:
        if not s.direct:
            pytest.skip("no O_DIRECT here: nothing is staged")
        sizes = ((100_000, 128 << 10), (1_500_000, 2 << 20), (50_000, 2 << 20), (9 << 20, 4 << 20))
        for n, held in sizes:  # the last one in 4 MiB pieces
            t = unaligned(n).copy_(torch.randint(0, 255, (n,), dtype=torch.uint8))
            h = s.put(t).result(timeout=60)
            out = unaligned(h.length)
            s.get(h, into=out).result(timeout=60)
            assert torch.equal(out[:n], t)
            assert s.stats.staging_bytes == held + PAGE, (n, s.stats.staging_bytes)
            s.free(h)


def _put_dtensor(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    x = distribute_tensor(
        torch.arange(12.0).reshape(3, 4), init_device_mesh("cpu", (world,)), [Shard(0)]
    )
    with DiskStore(budget="1MiB") as s:
        try:
            s.put(x)
        except TypeError as exc:
            return str(exc)
        return "stored"


def test_a_dtensor_is_refused_naming_its_local_and_full_tensors():
    """An FSDP2/DTensor shard given to put() raised torch's raw "numpy() is not supported for
    tensor subclasses" (RuntimeError)."""
    from tests import distributed

    (told,) = distributed.run(_put_dtensor, 1)
    assert "DTensor" in told and "to_local()" in told and "full_tensor()" in told, told
