import gc
import multiprocessing as mp
import os

import pytest
import torch

from tensortier.rl import ParamStore
from tests.conftest import bit_equal


def _reader(path: str, seconds: float, out) -> None:
    import time

    from tensortier.rl import ParamStore

    reader = ParamStore.attach(path)
    seen, torn, versions = 0, 0, set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        p = reader.get(min_version=1, timeout=10)
        v = float(p.version)
        for t in p.values():  # every tensor of a version is filled with that version number
            arr = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
            want = (
                torch.tensor(v, dtype=t.dtype).view(torch.int16).item()
                if t.dtype == torch.bfloat16
                else v
            )
            if not bool((arr == want).all()):  # numpy: no torch thread pool in a forked child
                torn += 1
        versions.add(p.version)
        seen += 1
        del p
    out.put((seen, torn, len(versions)))


def state(v: int) -> dict:
    return {
        "w": torch.full((256, 1024), float(v)),  # 1 MiB
        "b": torch.full((1000,), float(v), dtype=torch.bfloat16),
        "step": torch.tensor(float(v), dtype=torch.float64),
    }


def test_round_trip_versions_and_zero_copy():
    with ParamStore() as ps:
        sd = {"a": torch.randn(3, 4), "i": torch.arange(5), "bf": torch.randn(7).bfloat16()}
        assert ps.version == 0
        v = ps.publish(sd)
        p = ps.get(min_version=v)
        assert p.version == v == 1 and set(p) == set(sd)
        assert all(bit_equal(p[k], sd[k]) for k in sd)
        p["a"].add_(1)  # copy-on-write: a reader's writes stay private
        assert bit_equal(ps.get()["a"], sd["a"])
        with pytest.raises(TimeoutError):
            ps.wait_for(5, timeout=0.05)


def test_old_versions_freed_unless_a_reader_holds_them():
    with ParamStore(keep=1) as ps:
        ps.publish(state(1))
        held = ps.get()
        for v in range(2, 6):
            ps.publish(state(v))
        assert ps.versions() == [1, 5]  # 1 is held; 2-4 were freed
        assert (held["w"] == 1).all()
        del held
        gc.collect()
        ps.publish(state(6))
        assert ps.versions() == [6]
    assert not os.path.exists(ps.path)


def test_bad_input():
    with ParamStore() as ps:
        with pytest.raises(TypeError):
            ps.publish({"x": [1, 2]})
        assert ps.version == 0


@pytest.mark.slow
def test_readers_in_other_processes_never_see_a_torn_version():
    ctx = mp.get_context("fork")  # the child only reads shared memory with numpy
    with ParamStore(keep=2) as ps:
        ps.publish(state(1))
        out = ctx.Queue()
        readers = [ctx.Process(target=_reader, args=(ps.path, 1.5, out)) for _ in range(2)]
        for r in readers:
            r.start()
        results = []
        v = 1
        while len(results) < len(readers):
            v += 1
            ps.publish(state(v))
            try:
                results.append(out.get(timeout=0.001))
            except Exception:
                pass
        for r in readers:
            r.join(timeout=30)
        assert all(torn == 0 for _, torn, _ in results), results
        assert all(seen > 10 and nver > 2 for seen, _, nver in results), results
        assert v > 10
