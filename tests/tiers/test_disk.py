import errno
import gc
import os
import stat
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensortier import ClosedError, ConfigError, DiskStore, SpillDirError, TierFullError
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
    ],
    ids=["transposed", "sliced", "expanded", "conj", "bf16-slice", "channels-last"],
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
        slabs = [f for f in os.listdir(s.root) if f.startswith("slab-")]
        on_disk = sum(os.path.getsize(os.path.join(s.root, f)) for f in slabs)
        assert max(sizes_seen) == sizes_seen[-1] == on_disk
        assert on_disk <= 16 << 20, f"files grew to {on_disk} bytes: extents are not reused"
        for h, _ in live:
            s.free(h)
        slab = next(iter(s._files.slabs.values()))
        assert slab.free_list == [(0, slab.size)]  # every extent merged back


def test_capacity_exhaustion_is_typed_and_store_stays_usable(spill_dir):
    with DiskStore(spill_dir, capacity="2MiB", slab_size="1MiB") as s:
        a = s.write(torch.zeros(200_000))  # 800 KB
        b = s.write(torch.zeros(200_000))
        with pytest.raises(TierFullError) as err:
            s.put(torch.zeros(200_000))  # raised by put itself, at the write that hit it
        assert err.value.tier == "disk" and err.value.limit == 2 << 20
        assert "raise capacity" in str(err.value)
        assert len(s) == 2 and torch.equal(s.read(a), torch.zeros(200_000))
        s.free(b)
        c = s.write(torch.ones(200_000))
        assert torch.equal(s.read(c), torch.ones(200_000)) and torch.equal(
            s.read(a), torch.zeros(200_000)
        )


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


def test_full_disk_at_preallocation_is_typed(spill_dir, monkeypatch):
    def enospc(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    with DiskStore(spill_dir, slab_size="1MiB") as s:
        monkeypatch.setattr(os, "posix_fallocate", enospc)
        with pytest.raises(TierFullError, match="disk full"):
            s.put(torch.zeros(10))
        monkeypatch.undo()
        assert torch.equal(s.read(s.write(torch.ones(10))), torch.ones(10))


def test_missing_spill_dir_names_the_fix(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(SpillDirError, match="does not exist.*mkdir -p"):
        DiskStore(missing)


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
    assert stat.S_IMODE(os.stat(s.root).st_mode) == 0o700
    s.write(torch.randn(100))
    assert os.listdir(s.root)
    s.close()
    assert not os.path.exists(s.root)
    with pytest.raises(ClosedError):
        s.put(torch.randn(3))
    s.close()  # idempotent


def test_files_removed_after_exception_in_context(spill_dir):
    with pytest.raises(ZeroDivisionError), DiskStore(spill_dir) as s:
        s.write(torch.randn(100))
        root = s.root
        1 / 0  # noqa: B018
    assert not os.path.exists(root)


def test_files_removed_on_garbage_collection(spill_dir):
    s = DiskStore(spill_dir)
    s.write(torch.randn(100))
    root = s.root
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
        DiskStore(spill_dir, capacity="lots")
    with pytest.raises(ConfigError, match="negative"):
        DiskStore(spill_dir, capacity=-1)
    with pytest.raises(ValueError, match="io_threads"):
        DiskStore(spill_dir, io_threads=0)
    with DiskStore(spill_dir) as s, pytest.raises(TypeError, match="to_dense"):
        s.put(torch.eye(3).to_sparse())


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
