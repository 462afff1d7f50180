"""One mode rule for durable artifacts (``_modes.py``): a catalog and a saved replay buffer.

Every file of one artifact has the same mode (private 0600 by default, 0640/0644 on request),
the directory the matching 0700/0750/0755, whatever the umask; a file this process may not read
is a ``PermissionDeniedError`` naming it. The cross-user checks fork a child that becomes uid
65534 (they need root; as another user the checks below them cover the same paths).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile

import numpy as np
import pytest
import torch

import tensortier as tt
from tensortier.data import Catalog
from tensortier.errors import ConfigError, PermissionDeniedError

ROOT = os.geteuid() == 0
NOBODY = 65534


def modes(path) -> tuple[int, set[int]]:
    """(directory mode, set of file modes) of an artifact directory."""
    files = {stat.S_IMODE(os.stat(os.path.join(path, n)).st_mode) for n in os.listdir(path)}
    return stat.S_IMODE(os.stat(path).st_mode), files


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def shared_tmp():
    """A directory every user can traverse (pytest's tmp_path is private to its owner)."""
    base = tempfile.mkdtemp(prefix="tt-modes-")
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def as_nobody(fn) -> str:
    """Run ``fn()`` in a child process as uid 65534; what it returns (a short str) or raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.close(r)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = fn()
        except BaseException as exc:
            out = f"{type(exc).__name__}: {exc}"
        os.write(w, str(out).encode()[:4000])
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        text = f.read().decode()
    os.waitpid(pid, 0)
    return text


# --------------------------------------------------------------------------- catalog
def test_a_catalog_is_private_by_default_every_file_alike(tmp_path):
    with umask(0o022):  # the usual umask made the manifest and index 0644 before
        Catalog.build(tmp_path / "c", [b"a", b"b"], io_threads=2).close()
    assert modes(tmp_path / "c") == (0o700, {0o600})


@pytest.mark.parametrize("mode,dmode", [(0o640, 0o750), (0o644, 0o755)])
def test_a_shared_catalog_gets_its_mode_exactly_whatever_the_umask(tmp_path, mode, dmode):
    with umask(0o077):
        cat = Catalog.build(tmp_path / "c", [b"a", b"b", b"c"], io_threads=2, mode=mode)
    assert modes(tmp_path / "c") == (dmode, {mode})
    assert cat[:] == [b"a", b"b", b"c"]


def test_bad_modes_are_refused_before_anything_is_made(tmp_path):
    for bad in (0o666, 0o755, 0o400, "644", True, None):
        with pytest.raises(ConfigError, match="mode="):
            Catalog.build(tmp_path / "c", [b"a"], mode=bad)
    assert not (tmp_path / "c").exists()


@pytest.mark.skipif(not ROOT, reason="becoming another user needs root")
def test_another_user_reads_a_shared_catalog_and_is_refused_a_private_one(shared_tmp):
    import tensortier.data._files  # noqa: F401  (imported before dropping privileges)
    import tensortier.tiers.itemcodec  # noqa: F401

    shared = os.path.join(shared_tmp, "shared")
    private = os.path.join(shared_tmp, "private")
    Catalog.build(shared, [b"x" * 10, b"y"], mode=0o644).close()
    Catalog.build(private, [b"z"]).close()

    def read_shared() -> str:
        cat = Catalog.open(shared)
        return f"{cat[:]!r} {cat.verify().ok}"

    assert as_nobody(read_shared) == f"{[b'x' * 10, b'y']!r} True"

    def read_private() -> str:
        try:
            Catalog.open(private)
        except PermissionDeniedError as exc:
            return f"denied {exc.path}"
        return "opened"

    assert as_nobody(read_private) == f"denied {os.path.join(private, 'catalog.json')}"

    os.chmod(os.path.join(shared, "seg-00000000.ttr"), 0o600)  # one file off the rule

    def open_shared() -> str:
        try:
            Catalog.open(shared)
        except PermissionDeniedError as exc:
            return f"denied {exc.path}"
        return "opened"

    assert as_nobody(open_shared) == f"denied {os.path.join(shared, 'seg-00000000.ttr')}"


@pytest.mark.skipif(ROOT, reason="root reads files whatever their mode")
def test_an_unreadable_segment_is_a_typed_error_naming_it(tmp_path):
    cat = Catalog.build(tmp_path / "c", [b"a", b"b"])
    seg = str(tmp_path / "c" / "seg-00000000.ttr")
    os.chmod(seg, 0)
    try:
        with pytest.raises(PermissionDeniedError, match="seg-00000000.ttr") as err:
            cat[0]  # opened before the change: the read names the file
        assert err.value.path == seg and isinstance(err.value, PermissionError)
        with pytest.raises(PermissionDeniedError, match="seg-00000000.ttr"):
            Catalog.open(tmp_path / "c")  # refused at open, not at every read
    finally:
        os.chmod(seg, 0o600)


# --------------------------------------------------------------------------- replay buffer
def _buffer(spill: str) -> tt.rl.ReplayBuffer:
    buf = tt.rl.ReplayBuffer(64, host_budget="4KiB", spill_dir=spill, segment_size="8KiB")
    for i in range(40):  # most items spill to segments
        buf.add({"obs": torch.full((64,), float(i)), "a": i})
    return buf


def test_a_saved_replay_buffer_follows_the_same_rule(tmp_path):
    buf = _buffer(str(tmp_path))
    try:
        with umask(0o022):  # buffer.json and state.npz were 0644 beside 0600 segments before
            buf.save(tmp_path / "private")
        dmode, files = modes(tmp_path / "private")
        assert (dmode, files) == (0o700, {0o600})
        assert any(n.startswith("seg-") for n in os.listdir(tmp_path / "private"))
        with umask(0o077):
            buf.save(tmp_path / "shared", mode=0o644)
        assert modes(tmp_path / "shared") == (0o755, {0o644})
        with pytest.raises(ConfigError, match="mode="):
            buf.save(tmp_path / "bad", mode=0o777)
        back = tt.rl.ReplayBuffer.load(tmp_path / "shared", spill_dir=str(tmp_path))
        try:
            np.testing.assert_array_equal(back.indices(), buf.indices())
            for k in buf.indices().tolist():
                assert torch.equal(back[k]["obs"], buf[k]["obs"]) and back[k]["a"] == buf[k]["a"]
        finally:
            back.close()
    finally:
        buf.close()


@pytest.mark.skipif(not ROOT, reason="becoming another user needs root")
def test_another_user_loading_a_private_saved_buffer_gets_a_typed_error(shared_tmp):
    import tensortier.rl._saved  # noqa: F401

    buf = _buffer(shared_tmp)
    try:
        buf.save(os.path.join(shared_tmp, "saved"))
    finally:
        buf.close()
    os.chmod(os.path.join(shared_tmp, "saved"), 0o755)  # the directory shared, the files not

    def load() -> str:
        try:
            tt.rl._saved.read(os.path.join(shared_tmp, "saved"), fix="")
        except PermissionDeniedError as exc:
            return f"denied {os.path.basename(exc.path)}"
        return "read"

    assert as_nobody(load) == "denied buffer.json"


def test_check_mode_and_dir_mode():
    from tensortier import _modes

    assert [_modes.dir_mode(m) for m in (0o600, 0o640, 0o644)] == [0o700, 0o750, 0o755]
    assert _modes.check_mode(0o640, "x") == 0o640
    with pytest.raises(ConfigError, match=r"mode=0o604.*0o600"):
        _modes.check_mode(0o604, "x")
    with pytest.raises(ConfigError):
        _modes.check_mode(np.int64(0o600), "x")
