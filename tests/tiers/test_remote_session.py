"""A RemoteStore whose Ray session ends under it (``ray.shutdown()``), on the shared cluster.

Its own module: the test shuts the driver's Ray down, which ends every actor this driver owns,
so it cannot share a module-scoped store with other tests."""

import pytest
import torch

ray = pytest.importorskip("ray")

from tensortier.errors import ClosedError  # noqa: E402
from tensortier.tiers.remote import RemoteStore  # noqa: E402
from tests.ray_cluster import cluster_fixture  # noqa: E402

cluster = cluster_fixture()

_GONE = r"ray\.shutdown\(\).*make a new one after ray\.init\(\)"


def test_a_store_outliving_ray_shutdown_raises_closed_error_and_never_reconnects(cluster):
    # Each call used to reach Ray, which quietly ran ray.init() again (on an I/O thread) and then
    # failed with a raw "Can't find actor" or "owner is unknown" error.
    s = RemoteStore("8MiB", timeout=30)
    h = s.write(torch.arange(10))
    ray.shutdown()
    try:
        calls = {
            "put": lambda: s.put(torch.ones(3)),
            "put_many": lambda: s.put_many([torch.ones(3)]),
            "get": lambda: s.get(h),
            "get_many": lambda: s.get_many([h]),
            "prefetch": lambda: s.prefetch([h]),
        }
        for name, call in calls.items():
            with pytest.raises(ClosedError, match=_GONE):
                call()
            assert not ray.is_initialized(), name  # nothing connected again
        ray.init(address=cluster.cluster.address, log_to_driver=False)
        with pytest.raises(ClosedError, match=_GONE):  # a new session: its nodes are still gone
            s.put(torch.ones(3))
        with RemoteStore("8MiB", timeout=30) as fresh:
            assert torch.equal(fresh.read(fresh.write(torch.arange(4))), torch.arange(4))
    finally:
        s.close()
        if not ray.is_initialized():
            ray.init(address=cluster.cluster.address, log_to_driver=False)
    assert s.closed and len(s) == 0
