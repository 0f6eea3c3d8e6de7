import pytest
import torch

from ess_sglang.host_pool import HostTotalPool, PinnedMemoryError, PoolFullError


def test_alloc_free_and_accounting():
    pool = HostTotalPool(2, 100, device="cpu")
    a = pool.alloc(60)
    assert a.unique().numel() == 60 and pool.num_used == 60
    with pytest.raises(PoolFullError, match="40 free"):
        pool.alloc(41)
    assert pool.num_free == 40, "a failed alloc must not change the pool"
    pool.free(a[:10])
    pool.check_invariants()
    b = pool.alloc(50)
    assert set(b.tolist()).isdisjoint(a[10:].tolist())
    pool.free(torch.cat([a[10:], b]))
    assert pool.num_free == 100
    pool.check_invariants()


def test_bad_free_changes_nothing():
    pool = HostTotalPool(1, 10, device="cpu")
    a = pool.alloc(4)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(torch.tensor([a[0].item(), 9]))
    with pytest.raises(ValueError, match="twice"):
        pool.free(torch.tensor([a[0].item(), a[0].item()]))
    with pytest.raises(ValueError, match="must lie in"):
        pool.free(torch.tensor([10]))
    assert pool.num_used == 4
    pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free(a[:1])


def test_scrub_on_free_zeroes_every_layer():
    pool = HostTotalPool(3, 16, device="cpu", scrub_on_free=True)
    pool.entries.fill_(7)
    a = pool.alloc(4)
    pool.free(a[:2])
    assert (pool.entries[:, a[:2]] == 0).all()
    assert (pool.entries[:, a[2:]] == 7).all()


def test_pinning_failure_is_clear_and_holds_nothing(monkeypatch):
    if not torch.cuda.is_available():
        with pytest.raises(PinnedMemoryError, match="needs a CUDA device"):
            HostTotalPool(1, 8, pin=True)
    real_empty = torch.empty

    def failing_empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("cudaHostAlloc: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", failing_empty)
    with pytest.raises(PinnedMemoryError, match=r"memory_pool_size_gb.*out of memory"):
        HostTotalPool(61, 1000, pin=True, device="cpu")


def test_sizes_must_be_positive():
    with pytest.raises(ValueError, match="num_tokens=0"):
        HostTotalPool(1, 0, device="cpu")
