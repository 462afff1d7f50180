"""Catalog build, open and random access: round trips, views, bad input, refused states."""

import collections
import os
import pickle
import stat
import threading

import numpy as np
import pytest
import torch

import tensortier as tt
from tensortier.data import Catalog
from tensortier.errors import ClosedError, ConfigError, CorruptDataError
from tests.data._records import record, same


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """100k records of mixed types and sizes (0 B to ~6 KB), three writers, small segments (io_threads=3)."""
    path = tmp_path_factory.mktemp("mixed") / "cat"
    n = 100_000
    cat = Catalog.build(
        path, (record(i) for i in range(n)), segment_size="8MiB", io_threads=3, batch_bytes="256KiB"
    )
    yield cat, n
    cat.close()


def test_100k_mixed_records_round_trip_exactly(mixed):
    cat, n = mixed
    assert len(cat) == n and cat.build_stats["records"] == n
    assert cat.manifest.writers == 3 and len(cat.manifest.segments) > 3
    got = cat.read(np.arange(n))
    bad = [i for i in range(n) if not same(record(i), got[i])]
    assert bad == []
    rng = np.random.default_rng(1)
    for i in rng.integers(0, n, 300).tolist():  # one pread each
        assert same(record(i), cat[i])
    assert same(record(n - 1), cat[-1])


def test_slices_lists_and_arrays_read_in_the_order_asked(mixed):
    cat, n = mixed
    assert all(same(a, record(i)) for a, i in zip(cat[10:20], range(10, 20)))
    assert all(same(a, record(i)) for a, i in zip(cat[n - 5 :: 2], range(n - 5, n, 2)))
    order = [99_999, 3, 50_000, 3, 7]
    for got in (cat[order], cat.read(np.array(order)), cat.read(torch.tensor(order))):
        assert all(same(a, record(i)) for a, i in zip(got, order))
    assert cat[5:5] == [] and cat.read([]) == []


def test_index_errors_and_type_errors(mixed):
    cat, n = mixed
    for bad in (n, -n - 1, 10**12):
        with pytest.raises(IndexError, match=f"record index {bad} is out of range"):
            cat[bad]
    with pytest.raises(IndexError, match=f"{n + 3}"):
        cat.read([0, n + 3, 1])
    for key in ("a", 1.5, None, [0.5]):
        with pytest.raises(TypeError):
            cat[key]


def test_arrays_and_tensors_are_aligned_writable_views_of_one_read(mixed):
    cat, _ = mixed
    rec = cat[4]  # a dict: name, label, box (float64), raw
    box = rec["box"]
    assert box.flags.writeable and box.ctypes.data % 8 == 0
    assert box.base is not None  # a view of the buffer the record was read into, not a copy
    t = cat[5]["t"]
    assert t.data_ptr() % 2 == 0 and t.dtype == torch.bfloat16
    t += 1  # private: the next read is unaffected
    assert same(cat[5], record(5))


def test_catalog_pickles_as_its_path_and_reopens(mixed):
    cat, _ = mixed
    clone = pickle.loads(pickle.dumps(cat))
    assert (
        clone.directory == cat.directory and len(clone) == len(cat) and same(clone[12], record(12))
    )
    clone.close()


def test_a_catalog_rebuilt_under_a_worker_is_refused_not_read(tmp_path):
    # a DataLoader worker opens the catalog's files by path: one deleted and rebuilt there
    # (same record count, other records) must not be read under the parent's order
    import shutil

    from torch.utils.data import DataLoader

    path = tmp_path / "cat"
    cat = Catalog.build(path, [np.array([i], np.int64) for i in range(40)])
    ds = tt.data.EpochDataset(cat, batch=8, seed=0)
    shutil.rmtree(path)
    Catalog.build(path, [np.array([1000 + i], np.int64) for i in range(40)]).close()
    clone = pickle.loads(pickle.dumps(cat))
    with pytest.raises(CorruptDataError, match="replaced after it was opened"):
        clone[0]
    for context in ("spawn", "fork"):  # fork: the parent's mapped index, the new files
        dl = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context=context)
        with pytest.raises(CorruptDataError, match="replaced after it was opened"):
            list(dl)
    maps = tt.data.CatalogDataset(cat)
    dl = DataLoader(maps, batch_size=4, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(CorruptDataError, match="replaced after it was opened"):
        list(dl)
    cat.close()


def test_a_closed_catalog_stays_closed_in_spawned_workers(tmp_path):
    # README: after cat.close() every read and loader raises ClosedError -- forked workers did,
    # spawned ones reopened the directory and read on
    from torch.utils.data import DataLoader

    cat = Catalog.build(tmp_path / "cat", [np.array([i], np.int64) for i in range(40)])
    ds = tt.data.CatalogDataset(cat)
    cat.close()
    clone = pickle.loads(pickle.dumps(cat))
    with pytest.raises(ClosedError):
        clone[0]
    dl = DataLoader(ds, batch_size=8, num_workers=1, multiprocessing_context="spawn",
                    collate_fn=list)  # fmt: skip
    with pytest.raises(ClosedError):
        list(dl)


def test_lazy_subpackage_and_info(mixed):
    cat, n = mixed
    assert tt.data.Catalog is Catalog
    info = cat.info()
    assert info["records"] == n and info["index_bytes"] == 20 * n and info["io_threads"] == 3
    assert info["file_bytes"] == sum(
        os.path.getsize(os.path.join(cat.directory, f))
        for f in os.listdir(cat.directory)
        if "seg-" in f
    )


def test_empty_catalog(tmp_path):
    cat = Catalog.build(tmp_path / "empty", [])
    assert len(cat) == 0 and cat[0:10] == [] and cat.verify().ok
    with pytest.raises(IndexError):
        cat[0]
    assert list(cat.epochs(batch=4)) == []


def test_parallel_writers_give_the_same_records(tmp_path):
    recs = [record(i) for i in range(3000)]
    one = Catalog.build(tmp_path / "one", recs, io_threads=1, batch_bytes="8KiB")
    four = Catalog.build(tmp_path / "four", recs, io_threads=4, batch_bytes="8KiB")
    assert len(four.manifest.segments) == 4
    assert all(same(a, b) for a, b in zip(one[:], four[:]))
    files = {f for f in os.listdir(four.directory)}
    assert files == {"catalog.json", "index.bin"} | {f"seg-{w:08d}.ttr" for w in range(4)}


# --------------------------------------------------------------------------- bad input
def _files_of(root) -> dict[str, bytes]:
    """Every file of a catalog, the manifest without its build time."""
    import json

    out = {}
    for name in sorted(os.listdir(root)):
        data = (root / name).read_bytes()
        if name == "catalog.json":
            meta = json.loads(data)
            meta.pop("created")
            data = json.dumps(meta).encode()
        out[name] = data
    return out


def test_a_build_is_deterministic_byte_for_byte(tmp_path):
    """Same records, same settings: the same files, bit for bit (the build's encoding hands
    bytes records to the writers in pieces, which must not change what is written)."""
    recs = [record(i) for i in range(1500)]
    recs += [b"", bytearray(b"x" * 70_000), [1, 2, 3], "s" * 5000, os.urandom(200_000)]
    for name in ("a", "b"):
        Catalog.build(tmp_path / name, recs, io_threads=3, batch_bytes="64KiB", segment_size="1MiB")
    a, b = _files_of(tmp_path / "a"), _files_of(tmp_path / "b")
    assert a.keys() == b.keys() and len(a) > 4 and all(a[k] == b[k] for k in a)
    cat = Catalog.open(tmp_path / "a")
    assert all(same(got, want) for got, want in zip(cat[:1500], recs[:1500]))
    assert cat[-1] == recs[-1] and cat[-2] == "s" * 5000


def test_a_source_that_reuses_its_buffers_is_stored_as_yielded(tmp_path):
    """Arrays, tensors and bytearrays are copied before the source runs again (only immutable
    bytes travel to the writers uncopied)."""
    arr, ten, raw = np.zeros(5000), torch.zeros(3000), bytearray(40_000)

    def source():
        for i in range(300):
            arr[:], raw[:] = i, bytes([i % 256]) * len(raw)
            ten.fill_(i)
            yield {"a": arr, "t": ten, "r": raw}

    cat = Catalog.build(tmp_path / "c", source(), io_threads=2, batch_bytes="1MiB")
    for i, r in enumerate(cat):
        assert (r["a"] == i).all() and (r["t"] == i).all() and r["r"] == bytes([i % 256]) * 40_000


def test_unsupported_record_is_refused_naming_it_and_the_accepted_types(tmp_path):
    path = tmp_path / "bad"
    recs = [b"ok", "fine", {"a": np.zeros(2)}, {1, 2}]
    with pytest.raises(TypeError, match=r"record 3 cannot be stored.*bytes, str, a numpy array"):
        Catalog.build(path, recs)
    assert not path.exists()  # nothing left behind
    with pytest.raises(TypeError, match="record 0"):
        Catalog.build(path, [np.array([object()])])
    with pytest.raises(TypeError, match="iterable of records"):
        Catalog.build(path, b"not a list of records")
    assert not path.exists()


def test_an_exception_during_build_leaves_nothing_and_the_directory_is_reusable(tmp_path):
    path = tmp_path / "cat"
    path.mkdir()  # an existing empty directory stays, empty

    def boom():
        for i in range(5000):
            if i == 4000:
                raise RuntimeError("source failed")
            yield record(i)

    with pytest.raises(RuntimeError, match="source failed"):
        Catalog.build(path, boom(), batch_bytes="8KiB")
    assert os.listdir(path) == []
    with pytest.raises(FileNotFoundError, match="no catalog"):
        Catalog.open(path)
    assert len(Catalog.build(path, [b"x"])) == 1


def test_bad_build_arguments_are_config_errors(tmp_path):
    for kwargs, match in [
        ({"io_threads": 0}, "io_threads=0"),
        ({"io_threads": True}, "io_threads=True"),
        ({"segment_size": "1XB"}, "segment_size"),
        ({"segment_size": "2TiB"}, "below 1TiB"),
        ({"batch_bytes": 0}, "batch_bytes"),
    ]:
        with pytest.raises(ConfigError, match=match):
            Catalog.build(tmp_path / "c", [b"x"], **kwargs)
    with pytest.raises(ConfigError, match="directory must be a directory path"):
        Catalog.build(123, [b"x"])
    assert not (tmp_path / "c").exists()


def test_existing_catalogs_and_foreign_directories_are_refused(tmp_path):
    Catalog.build(tmp_path / "c", [b"x"])
    with pytest.raises(ConfigError, match="already exists"):
        Catalog.build(tmp_path / "c", [b"y"])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        Catalog.build(tmp_path / "d", [b"y"])
    assert os.listdir(tmp_path / "d") == ["notes.txt"]
    (tmp_path / "f").write_text("a file")
    with pytest.raises(ConfigError, match="is a file"):
        Catalog.build(tmp_path / "f", [b"y"])


def test_a_catalog_being_built_is_refused_with_the_builders_pid(tmp_path):
    path = tmp_path / "c"
    started, release = threading.Event(), threading.Event()

    def slow():
        for i in range(100):
            if i == 50:
                started.set()
                assert release.wait(30)
            yield record(i)

    errors = []

    def run():
        try:
            Catalog.build(path, slow(), batch_bytes="1KiB")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    builder = threading.Thread(target=run)
    builder.start()
    try:
        assert started.wait(30)
        with pytest.raises(ConfigError, match=rf"still being built by process {os.getpid()}"):
            Catalog.open(path)
        with pytest.raises(ConfigError, match="Catalog.build"):
            Catalog.build(path, [b"second builder"])
    finally:
        release.set()
        builder.join(30)
    assert errors == []
    assert len(Catalog.open(path)) == 100
    assert ".tt-build.lock" not in os.listdir(path)


def test_leftovers_of_a_dead_build_are_refused_then_rebuilt(tmp_path):
    path = tmp_path / "c"
    path.mkdir()
    (path / "seg-00000000.ttr").write_bytes(b"half a record")
    (path / "index.bin").write_bytes(b"\0" * 40)
    with pytest.raises(CorruptDataError, match="incomplete catalog build"):
        Catalog.open(path)
    cat = Catalog.build(path, [b"a", b"b"])
    assert cat[:] == [b"a", b"b"]


def test_open_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Catalog.open(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no catalog"):
        Catalog.open(tmp_path)
    with pytest.raises(ConfigError, match="directory must be"):
        Catalog.open(3)
    with pytest.raises(ConfigError, match="direct="):
        Catalog.open(tmp_path, direct="yes")


def test_closed_catalog_raises_closed_error(tmp_path):
    cat = Catalog.build(tmp_path / "c", [b"a"])
    rec = cat[0]
    cat.close()
    with pytest.raises(tt.ClosedError):
        cat[0]
    assert rec == b"a"


# --------------------------------------------------------------------------- whose directory
def test_a_lock_file_planted_as_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    path = tmp_path / "c"
    path.mkdir()
    os.symlink(victim, path / ".tt-build.lock")
    with pytest.raises(ConfigError, match=r"'\.tt-build\.lock', which is a symlink"):
        Catalog.build(path, [b"a"])
    assert victim.read_text() == "precious\n"
    assert os.listdir(path) == [".tt-build.lock"]  # a refused directory stays as it was
    os.symlink(victim, path / "index.bin.other")  # not a build file: "not empty"
    with pytest.raises(ConfigError, match="not empty"):
        Catalog.build(path, [b"a"])


def test_a_directory_everyone_may_write_is_refused(tmp_path):
    path = tmp_path / "c"
    path.mkdir()
    os.chmod(path, 0o777)  # like /tmp/<name> made by someone with umask 0
    with pytest.raises(ConfigError, match="writable by every user"):
        Catalog.build(path, [b"a"])
    assert os.listdir(path) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_of_another_user_is_refused_even_empty_or_with_build_leftovers(tmp_path):
    path = tmp_path / "c"
    path.mkdir()
    os.chown(path, 65534, 65534)  # another user made it first under a shared parent
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        Catalog.build(path, [b"a"])
    assert os.listdir(path) == []
    os.chown(path, 0, 0)
    (path / "index.bin").write_bytes(b"\0" * 20)  # a "leftover" someone else put there
    os.chown(path / "index.bin", 65534, 65534)
    with pytest.raises(ConfigError, match="'index.bin', which is owned by uid 65534"):
        Catalog.build(path, [b"a"])
    assert os.listdir(path) == ["index.bin"]
    link = tmp_path / "link"
    os.symlink(path, link)
    os.lchown(link, 65534, 65534)  # a symlink planted by another user, even to our directory
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        Catalog.build(link, [b"a"])


def test_a_new_directory_stays_private_until_the_build_commits(tmp_path):
    path = tmp_path / "c"
    during = []

    def records():
        for i in range(100):
            if i == 50:
                during.append(stat.S_IMODE(os.stat(path).st_mode))
            yield b"r%d" % i

    Catalog.build(path, records(), mode=0o644).close()
    assert during == [0o700] and stat.S_IMODE(os.stat(path).st_mode) == 0o755


# --------------------------------------------------------------------------- after close
def catalog_fds(path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(path))
        except OSError:
            pass
    return n


def test_epochs_after_close_and_a_loader_running_across_close_raise_closed_error(tmp_path):
    import gc

    from tensortier._lifetime import quiesce

    path = tmp_path / "c"
    cat = Catalog.build(path, [bytes([i % 256]) * 1000 for i in range(5000)])
    running = iter(cat.epochs(batch=8, io_threads=1, prefetch_budget="16KiB"))
    first = next(running)
    assert len(first) == 8
    cat.close()
    with pytest.raises(tt.ClosedError, match="closed"):
        cat.epochs(batch=8)
    with pytest.raises(tt.ClosedError, match="closed"):
        for _ in running:  # read ahead before close at most, then ClosedError
            pass
    with pytest.raises(tt.ClosedError):
        list(tt.data.EpochDataset(cat, batch=8))
    del running, cat, first
    gc.collect()
    quiesce()
    assert catalog_fds(path) == 0  # no descriptor outlives close


def test_refusals_name_the_directory_argument_by_its_name(tmp_path):
    """The messages said ``path=``, the old name that now warns as deprecated."""
    Catalog.build(tmp_path / "a", [b"x"]).close()
    with pytest.raises(tt.ConfigError, match=r"already exists in directory='.*a'"):
        Catalog.build(tmp_path / "a", [b"y"])
    (tmp_path / "f").write_bytes(b"")
    for call in (Catalog.build, lambda d, r: Catalog.open(d)):
        with pytest.raises(tt.ConfigError, match=r"directory='.*f' is a file") as err:
            call(tmp_path / "f", [b"y"])
        assert "path=" not in str(err.value)


def test_old_keywords_still_work_with_a_warning(tmp_path):
    """One vocabulary (issue 26): directory, io_threads; the old names map to them with a
    DeprecationWarning for 0.1."""
    with (
        pytest.warns(DeprecationWarning, match="path= is now directory="),
        Catalog.build(path=tmp_path / "a", records=[b"x"]) as cat,
    ):
        assert cat.directory == str(tmp_path / "a")
    with pytest.warns(DeprecationWarning, match="writers= is now io_threads="):
        Catalog.build(tmp_path / "b", [b"x"], writers=2).close()
    with Catalog.build(directory=tmp_path / "c", records=[b"x"], io_threads=1) as cat:
        assert cat.directory == str(tmp_path / "c") and cat.info()["io_threads"] == 1
    with pytest.warns(DeprecationWarning, match="path= is now directory="):
        Catalog.open(path=tmp_path / "c").close()
    Catalog.open(directory=tmp_path / "c").close()


def test_bytes_records_are_built_without_python_work_per_record_outside_the_loop(
    tmp_path, monkeypatch
):
    """The calling thread lays bytes/str records out itself: no per-record encode or
    Segments.append call, one Segments.write_staged per batch (the writer only writes)."""
    from tensortier.tiers import itemcodec, segments

    calls = collections.Counter()

    def counted(owner, name):
        real = getattr(owner, name)

        def wrapper(*a, **k):
            calls[name] += 1
            return real(*a, **k)

        monkeypatch.setattr(owner, name, wrapper)

    counted(itemcodec, "encode_aligned_parts")
    counted(itemcodec, "encode")
    counted(segments.Segments, "append")
    counted(segments.Segments, "_append_chunk")
    counted(segments.Segments, "write_staged")
    blobs = [os.urandom(int(n)) for n in np.random.default_rng(0).integers(1, 50_000, 2000)]
    texts = [f"record {i} " * (i % 300) for i in range(3000)]
    for name, recs in (("b", blobs), ("s", texts)):
        Catalog.build(tmp_path / name, recs, io_threads=2, batch_bytes="1MiB")
        assert Catalog.open(tmp_path / name)[:] == recs
    batches = calls.pop("write_staged", 0)
    assert calls == {} and 20 < batches < 100
