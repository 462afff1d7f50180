import gc
import threading

import pytest
import torch

from tensortier import ConfigError, TierFullError
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
