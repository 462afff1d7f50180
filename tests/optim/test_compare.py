"""Issue 25: step()'s validation compared every gradient snapshot with one ``memcmp`` on the main
thread, one core of a 16-core host (GPT-2 8 x 2048 on an H100: 1.9 GB against 1.9 GB per step).
The comparison now runs on ATen's thread count, as the update kernel does. A many-core host is
emulated by reporting 16 threads from ``torch.get_num_threads`` (what ATen says on 16 cores)."""

import threading

import pytest
import torch

from tensortier.optim import OffloadedAdamW, _compare
from tensortier.optim._compare import MIN_CHUNK, Comparer, split

MiB = 1 << 20


def _compare_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("tt-adamw-compare")}


@pytest.fixture
def sixteen_cores(monkeypatch):
    """What ATen reports on a 16-core host (its default: physical cores)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)


def test_split_shares_the_bytes_among_the_threads_in_order():
    far = 1 << 40  # the second pair's addresses
    ranges = [(0, 1 << 30, 40 * MiB), (far, far + (1 << 30), 24 * MiB + 8)]
    groups = split(ranges, 16)
    assert len(groups) == 16
    flat = [r for g in groups for r in g]
    # in order, contiguous, every byte once
    seen = [0, 0]
    for a, b, n in flat:
        src = int(a >= far)
        assert (a - ranges[src][0], b - ranges[src][1]) == (seen[src], seen[src])
        seen[src] += n
    assert seen == [40 * MiB, 24 * MiB + 8]
    sizes = [sum(n for _, _, n in g) for g in groups]
    assert len(set(sizes[:-1])) == 1 and sizes[0] % 64 == 0 and sizes[0] >= MIN_CHUNK
    assert 0 < sizes[-1] <= sizes[0]


@pytest.mark.parametrize("threads", [1, 16])
def test_split_keeps_small_comparisons_on_one_thread(threads):
    assert split([], threads) == []
    assert len(split([(0, 0, MIN_CHUNK + 1)], threads)) == 1
    assert len(split([(0, 0, 2 * MIN_CHUNK)], threads)) == min(threads, 2)


@pytest.fixture
def shares(monkeypatch):
    """(thread name, bytes) of every share compared, through the real ``memcmp``."""
    seen: list[tuple[str, int]] = []
    real = _compare._equal_ranges

    def spy(group):
        seen.append((threading.current_thread().name, sum(n for _, _, n in group)))
        return real(group)

    monkeypatch.setattr(_compare, "_equal_ranges", spy)
    return seen


def test_comparer_uses_the_hosts_threads_and_finds_a_difference_anywhere(sixteen_cores, shares):
    n = 16 * MIN_CHUNK // 4  # 16 shares of float32
    a = torch.randn(n)
    b = a.clone()
    before = _compare_threads()  # other tests' optimizers may not be collected yet
    cmp = Comparer()
    try:
        assert cmp.equal([(a, b)]) and cmp.last_threads == 16
        me = threading.current_thread().name
        assert len(shares) == 16 and sum(name == me for name, _ in shares) == 1
        assert all(name.startswith("tt-adamw-compare") for name, _ in shares if name != me)
        assert sum(nb for _, nb in shares) == 4 * n
        for i in (0, n // 2 + 3, n - 1):  # the caller's share, a pool thread's, the last one
            b[i] += 1.0
            assert not cmp.equal([(a, b)]), i
            b[i] = a[i]
        z, nz = torch.zeros(n), torch.zeros(n)
        nz[-1] = -0.0  # -0.0 == 0.0 as floats, not as bits
        assert not cmp.equal([(z, nz)]) and cmp.equal([(z, z.clone())])
        assert not cmp.equal([(a, b.view(-1, 4))])  # shapes differ
        assert cmp.equal([(a[::2], b[::2])])  # strided: compared on the caller
        assert _compare_threads() - before
    finally:
        cmp.close()
    assert not _compare_threads() - before


def _train(opt_of, steps: int, edit_at: int | None = None):
    """One 8M-parameter tensor (32 MiB), plain autograd; ``edit_at``: change the last gradient
    element before that step without bumping its version (``.data``), after the snapshot."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(2 * MiB, 4) * 0.1)
    opt = opt_of([p])
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        w = torch.randn(p.shape, generator=g)
        (p * w).sum().backward()
        if i == edit_at:
            if isinstance(opt, OffloadedAdamW):
                opt._spec.wait()  # the snapshot surely predates the edit
            p.grad.data[-1, -1] += 1.0
        opt.step()
        opt.zero_grad()
    return p.detach(), opt


def _tt(params):
    return OffloadedAdamW(params, lr=1e-2, weight_decay=0.05, overlap=True)


def _torch(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05, fused=True)


def test_validation_compares_on_the_hosts_threads_bit_identical_to_torch(sixteen_cores, shares):
    ref, _ = _train(_torch, 3, edit_at=2)
    before = _compare_threads()
    got, opt = _train(_tt, 3, edit_at=2)
    try:
        st = opt.stats()
        assert st.speculated == 2 and st.validated == 1 and st.unversioned_edits == 1
        # 32 MiB in shares of >= 4 MiB: 8 of the 16 threads, in each of the 2 steps that compared
        assert st.compare_threads == 8 and len(shares) == 16 and st.compare_seconds > 0
        assert len({name for name, _ in shares}) > 1
        # the worker's phases are counted: snapshot copies (CPU), spare copies after each step
        assert st.grad_wait_seconds > 0 and st.prepare_seconds > 0 and st.spec_wait_seconds >= 0
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    finally:
        opt.close()
    assert not _compare_threads() - before  # close() joins them


def test_the_kernel_runs_with_atens_thread_count_on_the_worker():
    """The worker thread's ATen count is the process setting (no cap of our own)."""
    _, opt = _train(_tt, 2)
    try:
        assert opt.stats().kernel_threads == torch.get_num_threads()
    finally:
        opt.close()


def test_memcmp_is_loaded():
    assert _compare._memcmp is not None  # else every comparison falls back to torch.equal
