"""The fast add path: cached encode plans, scalar single adds, queued tree updates, extend."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensortier.rl import Prioritized, ReplayBuffer, Uniform
from tensortier.rl.sampler import SumMinTree
from tensortier.tiers import itemcodec as _codec

NP_DTYPES = ["<f4", "<f8", "<f2", "|u1", "<i8", "|b1", ">f4", "<c8"]


def _value(kind: str, rng: np.random.Generator, shape: list[int], dtype: str):
    if kind == "array":
        raw = rng.integers(0, 256, int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
        return np.frombuffer(raw.tobytes(), dtype).reshape(shape)
    if kind == "strided":
        return np.ones(2 * (shape[0] if shape else 1), dtype=dtype)[::2]
    if kind == "int":
        return int(rng.integers(-(2**62), 2**62))
    if kind == "bigint":
        return 2**63 + 5  # past int64: numpy stores it as uint64
    if kind == "float":
        return float(rng.standard_normal())
    if kind == "nan":
        return float("nan")
    if kind == "bool":
        return bool(rng.integers(0, 2))
    if kind == "npscalar":
        return np.float32(rng.standard_normal())
    if kind == "bytes":
        return bytes(rng.integers(0, 256, shape[0] if shape else 3, dtype=np.uint8))
    return torch.from_numpy(rng.standard_normal(shape or [2]).astype(np.float32))


KINDS = ["array", "strided", "int", "bigint", "float", "nan", "bool", "npscalar", "bytes", "tensor"]


@settings(max_examples=80, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=5),
    shape=st.lists(st.integers(0, 4), max_size=3),
    dtype=st.sampled_from(NP_DTYPES),
    seed=st.integers(0, 10_000),
    single=st.booleans(),
)
def test_plan_encodes_the_same_bytes_as_the_general_path(kinds, shape, dtype, seed, single):
    """Items of one shape take the cached plan; its bytes are exactly the general path's."""
    rng = np.random.default_rng(seed)
    _codec._plans.clear()
    for _ in range(3):  # the first builds the plan, the others use it
        values = [_value(k, rng, shape, dtype) for k in kinds]
        item = values[0] if single else {f"f{i}": v for i, v in enumerate(values)}
        assert _codec.encode(item) == _codec._encode_general(item)
    # another shape under the same field names falls back, still exactly
    other = {f"f{i}": np.zeros(7, np.int16) for i in range(len(kinds))}
    if not single:
        assert _codec.encode(other) == _codec._encode_general(other)


def test_plan_does_no_per_field_dispatch(monkeypatch):
    """After the first item, arrays and Python numbers are encoded without ``_field``."""
    item = {"obs": np.arange(10, dtype=np.float32), "action": 3, "reward": 0.5, "done": False}
    first = _codec.encode(item)

    def boom(*a, **k):
        raise AssertionError("per-field dispatch on the fast path")

    monkeypatch.setattr(_codec, "_field", boom)
    again = {"obs": np.arange(10, dtype=np.float32), "action": 3, "reward": 0.5, "done": False}
    assert _codec.encode(again) == first


def test_single_adds_queue_their_tree_updates(monkeypatch):
    """A stream of adds costs no tree walk per add: they are applied in one set at the next read."""
    calls = []
    real = SumMinTree.set

    def counting(self, slots, values):
        calls.append(len(slots))
        return real(self, slots, values)

    monkeypatch.setattr(SumMinTree, "set", counting)
    buf = ReplayBuffer(1000, sampler=Prioritized(), seed=0)
    for i in range(200):
        buf.add({"x": i})
    assert calls == []
    buf.sample(4)
    assert calls == [200]
    buf.close()


def _fill(buf: ReplayBuffer, items: list, chunk: int | None) -> list[int]:
    if chunk is None:
        return [buf.add(it) for it in items]
    out: list[int] = []
    for i in range(0, len(items), chunk):
        out += buf.extend(items[i : i + chunk]).tolist()
    return out


def _snapshot(buf: ReplayBuffer) -> tuple:
    keys = buf.indices()
    items = buf[keys]
    tree = buf._sampler.tree if hasattr(buf._sampler, "tree") else None
    sums = [a.copy() for a in tree.sums] if tree is not None else None
    # (which items sit in RAM and which on disk depends on batching: spills are chunked)
    stats = {k: buf.stats[k] for k in ("items", "evicted_items", "stale_updates")}
    return keys.tolist(), items, buf.priorities(keys).tolist(), sums, stats


@pytest.mark.parametrize("sampler", [Prioritized(alpha=0.7), Uniform()])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_extend_equals_repeated_add(spill_dir, sampler, chunk):
    """Same indices, items, priorities, tree and counters, with eviction and spilling."""
    rng = np.random.default_rng(0)
    items = [{"obs": rng.standard_normal(50).astype(np.float32), "i": i} for i in range(300)]
    kw = dict(host_budget="8KiB", spill_dir=spill_dir, sampler=sampler, seed=3)
    a, b = ReplayBuffer(128, **kw), ReplayBuffer(128, **kw)
    ka, kb = _fill(a, items, None), _fill(b, items, chunk)
    assert ka == kb
    a.update_priorities(ka[-50:], np.arange(50) + 1.0)
    b.update_priorities(kb[-50:], np.arange(50) + 1.0)
    # adds after an update get the new max priority on both paths
    _fill(a, items[:20], None)
    _fill(b, items[:20], chunk)
    sa, sb = _snapshot(a), _snapshot(b)
    assert sa[0] == sb[0] and sa[2] == sb[2] and sa[4] == sb[4]
    for x, y in zip(sa[1], sb[1]):
        assert x["i"] == y["i"] and x["obs"].tobytes() == y["obs"].tobytes()
    if sa[3] is not None:
        assert all(np.array_equal(x, y) for x, y in zip(sa[3], sb[3]))
    assert a.stats["spilled_items"] > 0  # the spill path was exercised
    if isinstance(sampler, Prioritized):  # same tree, same seed: the same draws
        ba, bb = a.sample(32), b.sample(32)
        assert ba.indices.tolist() == bb.indices.tolist()
        assert ba.weights.tolist() == bb.weights.tolist()
    a.close()
    b.close()


def test_extend_equals_repeated_add_after_durable_recovery(tmp_path):
    items = [{"obs": np.full(30, i, np.int32), "i": i} for i in range(90)]
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    bufs = [
        ReplayBuffer(64, durable=True, spill_dir=d, host_budget="4KiB", sampler=Prioritized())
        for d in dirs
    ]
    ka, kb = _fill(bufs[0], items, None), _fill(bufs[1], items, 16)
    assert ka == kb
    for buf in bufs:
        buf.update_priorities(ka[-10:], np.arange(10) + 2.0)
        buf.checkpoint()
    _fill(bufs[0], items[:5], None)
    _fill(bufs[1], items[:5], 16)
    for buf in bufs:  # dropped without close(): what a crash leaves (no final checkpoint)
        buf._store.close()
        buf._closed = True
    back = [ReplayBuffer(64, durable=True, spill_dir=d, sampler=Prioritized()) for d in dirs]
    sa, sb = _snapshot(back[0]), _snapshot(back[1])
    assert sa[0] == sb[0] and len(sa[0]) == 64 and sa[2] == sb[2]
    assert (
        [x["i"] for x in sa[1]] == [y["i"] for y in sb[1]] == list(range(31, 90)) + [0, 1, 2, 3, 4]
    )
    for buf in back:
        buf.close()


def test_empty_tensor_round_trips():
    """An empty tensor (stride 0 after reshape) used to fail inside ``.view(torch.uint8)``."""
    t = torch.empty(0, 3)
    out = _codec.decode(_codec.encode({"t": t}))["t"]
    assert out.shape == (0, 3) and out.dtype == torch.float32
