"""Crash consistency of Catalog.build: a SIGKILL at any point never leaves a catalog that opens
with part of its records; the commit (the manifest's rename) is all or nothing."""

import multiprocessing
import random
import signal
import time

import pytest

from tensortier.data import Catalog
from tensortier.errors import CorruptDataError
from tests.data import _crash_child
from tests.data._records import record, same

N = 3000

# (kill point, does the catalog open afterwards?)
POINTS = [
    ("batch-indexed:1", False),  # first batch written and indexed
    ("batch-indexed:40", False),  # in the middle
    ("index-synced", False),  # every record written, nothing committed
    ("segments-synced", False),
    ("manifest-written", False),  # the manifest exists under its temporary name only
    ("manifest-renamed", True),  # committed (the directory fsync and lock removal still pending)
]


def _child(path, fault=None):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.data._crash_child"])
    proc = ctx.Process(target=_crash_child.main, args=(str(path), N, fault))
    proc.start()
    return proc


def _check(path) -> bool:
    """True if the catalog at ``path`` opens; then it must hold every record, intact."""
    try:
        cat = Catalog.open(path)
    except (CorruptDataError, FileNotFoundError) as exc:
        assert "incomplete" in str(exc) or "no catalog" in str(exc)
        return False
    assert len(cat) == N and cat.verify().ok
    assert all(same(r, record(i)) for i, r in enumerate(cat[:]))
    cat.close()
    return True


@pytest.mark.slow
def test_sigkill_at_every_point_of_a_build(tmp_path):
    for i, (point, opens) in enumerate(POINTS):
        path = tmp_path / f"run{i}"
        proc = _child(path, point)
        proc.join(timeout=120)
        assert proc.exitcode == -signal.SIGKILL, f"{point}: child was not killed ({proc.exitcode})"
        assert _check(path) is opens, point
        if not opens:  # the next build reuses the dead build's directory
            Catalog.build(path, (record(i) for i in range(N))).close()
            assert _check(path)


@pytest.mark.slow
def test_sigkill_at_random_times_never_opens_a_partial_catalog(tmp_path):
    rng = random.Random(14)
    for name in ("warm-up", "probe"):  # the first child also starts the forkserver
        t0 = time.monotonic()
        probe = _child(tmp_path / name)
        probe.join(timeout=120)
        assert probe.exitcode == 0 and _check(tmp_path / name)
    whole = time.monotonic() - t0
    outcomes = []
    for i in range(6):
        proc = _child(tmp_path / f"run{i}")
        time.sleep(rng.uniform(0.05, 0.9) * whole)
        proc.kill()
        proc.join(timeout=60)
        outcomes.append(_check(tmp_path / f"run{i}"))
    assert False in outcomes  # some kills landed mid-build; none opened partial (_check)
