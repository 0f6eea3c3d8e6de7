"""The Triton top-k kernel against its torch definition (interpreted on CPU) and against torch.topk."""

import pytest
import torch
from ess_sglang.kernels.topk import topk_reference, topk_triton
from hypothesis import given, settings
from hypothesis import strategies as st

from ess_sglang.reference.dsa import topk_positions


@pytest.mark.parametrize("variant", ["row", "tiles"])
@pytest.mark.parametrize("B,Q,T,k", [(2, 1, 300, 64), (1, 2, 2570, 100), (3, 1, 50, 64), (1, 1, 4100, 2048)])
def test_kernel_matches_reference_with_ties_and_invisible_positions(B, Q, T, k, variant):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(B, Q, T, generator=g)
    x[0, 0, 10:20] = 1.5  # ties at (or near) the threshold
    x[0, -1, -40:] = float("-inf")  # invisible positions
    if B > 2:
        x[2] = float("-inf")  # a row with fewer finite scores than k
        x[2, 0, :5] = torch.randn(5, generator=g)
    want_pos, want_kth = topk_reference(x, k)
    pos, kth = topk_triton(x, k, variant)
    assert torch.equal(pos, want_pos) and torch.equal(kth, want_kth)


@settings(max_examples=10, deadline=None)
@given(T=st.integers(1, 2500), k=st.integers(1, 300), seed=st.integers(0, 10_000), neg=st.booleans(),
       variant=st.sampled_from(["row", "tiles"]))
def test_same_set_and_kth_as_torch_topk(T, k, seed, neg, variant):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 1, T, generator=g) * 5 - (10 if neg else 0)  # distinct values: no ties
    x[1, 0, T // 2:] = float("-inf")
    pos, kth = topk_triton(x, k, variant)
    ref = topk_positions(x, k)
    for r in range(2):
        assert sorted(pos[r, 0].tolist()) == sorted(ref[r, 0].tolist())
    vals, _ = torch.topk(x, min(k, T), dim=-1)
    want = torch.where(torch.isfinite(vals[..., -1]), vals[..., -1], float("-inf")) if k <= T else \
        torch.full((2, 1), float("-inf"))
    assert torch.equal(kth, want)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(1, 32768), (64, 32768), (16, 131072)])
def test_gpu_full_size_same_set_as_torch_topk(B, T):  # and prints both timings
    g = torch.Generator(device="cuda").manual_seed(B)
    x = torch.randn(B, 1, T, device="cuda", generator=g)
    x[:, :, T - 100:] = float("-inf")
    vals, ref = torch.topk(x, 2048, dim=-1)
    for variant in ("row", "tiles"):
        pos, kth = topk_triton(x, 2048, variant)
        assert torch.equal(pos.sort(-1).values, ref.int().sort(-1).values), variant
        assert torch.equal(kth, vals[..., -1]), variant

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            graph.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3 / 20

    t_row, t_tiles = timed(lambda: topk_triton(x, 2048, "row")), timed(lambda: topk_triton(x, 2048, "tiles"))
    t_torch = timed(lambda: torch.topk(x, 2048, dim=-1))
    print(f"\ntop-2048 of {B} x {T}: triton row {t_row:.1f} us, tiles {t_tiles:.1f} us, torch.topk {t_torch:.1f} us")


@pytest.mark.parametrize("variant", ["row", "tiles"])
def test_nan_scores_are_never_reported(variant):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 1, 300, generator=g)
    x[0, 0, [3, 50, 200]] = float("nan")
    x[1, 0, 20:] = float("nan")  # fewer than k usable scores
    pos, kth = topk_triton(x, 16, variant)
    want_pos, want_kth = topk_reference(x, 16)
    assert torch.equal(pos, want_pos) and torch.equal(kth, want_kth)
    assert not set(pos[0, 0].tolist()) & {3, 50, 200} and bool((pos >= -1).all()) and bool((pos < 300).all())
    assert (pos[1, 0] >= 0).sum() == 16 and kth[1, 0] > float("-inf")
    x[1, 0, 10:] = float("nan")
    pos, kth = topk_triton(x, 16, variant)
    assert (pos[1, 0] >= 0).sum() == 10 and kth[1, 0] == float("-inf")


@pytest.mark.parametrize("K,T,seed", [(16, 50, 0), (64, 64, 1), (40, 300, 2)])
def test_kth_of_selection_against_its_reference(K, T, seed):
    """The lowest selected score per row; -inf for a row with a -1 or a position outside the row (never read)."""
    from ess_sglang.kernels.topk import kth_of_selection, kth_of_selection_reference

    g = torch.Generator().manual_seed(seed)
    R = 5
    x = torch.randn(R, T + 3, generator=g)[:, :T]  # a row stride above T
    pos = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(R)]).int()
    pos[1, 3] = -1
    pos[2, K - 1] = T  # out of the row: treated as no selection
    pos[3, 0] = -7
    got, want = kth_of_selection(x, pos), kth_of_selection_reference(x, pos)
    assert torch.equal(got, want)
    assert got[0] == x[0, pos[0].long()].min() and got[4] == x[4, pos[4].long()].min()
    assert (got[1:4] == float("-inf")).all()
    lowest, want_lowest = kth_of_selection(x, pos, "lowest"), kth_of_selection_reference(x, pos, "lowest")
    assert torch.equal(lowest, want_lowest) and torch.equal(lowest[[0, 4]], got[[0, 4]])
    ok = (pos[1] >= 0) & (pos[1] < T)
    assert lowest[1] == x[1, pos[1][ok].long()].min()  # the lowest of what the row did select
    none = torch.full_like(pos, -1)
    assert torch.isinf(kth_of_selection(x, none, "lowest")).all() and (kth_of_selection(x, none, "lowest") > 0).all()
    with pytest.raises(ValueError, match="int32 positions"):
        kth_of_selection(x, pos.long())
    with pytest.raises(ValueError, match="short_rows must be one of"):
        kth_of_selection(x, pos, "zero")
    nan = x.clone()
    nan[0, pos[0, 0].long()] = float("nan")  # a NaN score is never the lowest (kernel and reference alike)
    assert torch.equal(kth_of_selection(nan, pos), kth_of_selection_reference(nan, pos))
    assert not kth_of_selection(nan, pos)[0].isnan()
    from ess_sglang.kernels.topk import kth_of_selection_any  # (the reference here, on the CPU, for any int dtype)

    assert torch.equal(kth_of_selection_any(x, pos.long(), "lowest"), want_lowest)
