"""DSA indexer kernel against its torch reference: Triton interpreter at small sizes on CPU, and on the GPU (marked)."""

import numpy as np
import pytest
import torch
from ess_sglang.kernels.indexer import (
    DOT_FP32,
    dot_mode,
    indexer_logits,
    indexer_logits_reference,
    indexer_logits_triton,
    indexer_topk,
    quantize_index_q,
)

from ess_sglang.formats import FP8, INDEXER_ENTRY_BYTES, pack_indexer_key, unpack_indexer_key
from ess_sglang.reference.dsa import indexer_logits as dsa_indexer_logits
from ess_sglang.reference.dsa import topk_positions

MAX_REL = {}  # worst relative error seen per test case, printed by test_report_errors (pytest -s)
NAN_BYTE = 0x7F  # fp8 e4m3fn NaN: a poisoned key byte


def _seed():
    return int(torch.randint(0, 2**31 - 1, ()).item())  # fresh data every run; the seed is in the failure message


def _case(B, Q, H, max_len, seed, n_loc=None, rows=6, q_dtype=torch.float32, signed_weights=False, device="cpu"):
    """Random cache and request table; each request's positions map to distinct locations of its own."""
    g = torch.Generator().manual_seed(seed)
    n_loc = n_loc or rows * max_len + 17
    cache = pack_indexer_key(torch.randn(n_loc, 128, generator=g) * torch.rand(n_loc, 1, generator=g) * 4)
    perm = torch.randperm(n_loc, generator=g)[:rows * max_len].view(rows, max_len)
    r2t = perm.to(torch.int32)
    rpi = torch.randperm(rows, generator=g)[:B]
    seq = torch.randint(0, max_len + 1, (B,), generator=g)
    seq[0] = max_len  # one full row, one at least Q long
    seq[-1] = max(int(seq[-1]), Q)
    q = torch.randn(B, Q, H, 128, generator=g)
    w = torch.randn(B, Q, H, generator=g) if signed_weights else torch.rand(B, Q, H, generator=g) + 0.05
    if q_dtype == FP8:
        q, w = quantize_index_q(q, w)
    else:
        q = q.to(q_dtype)
    args = [q, w, cache, r2t, rpi, seq]
    return [a.to(device) for a in args] + [max_len]


def _poisoned(B, Q, T, device="cpu"):
    return torch.full((B, Q, T), float("nan"), device=device)


def _compare(got, want, cond=None):
    """Same -inf pattern; returns (max error relative to |want|, max error relative to the condition scale `cond`).

    A logit is a sum of relu'd dot products whose own terms can cancel: fp32 summation in another order then moves it
    by ~1e-7 of sum |terms| (`_condition`), which can be a large fraction of a small logit. So the relative error is
    taken over the logits that are not cancellation-dominated (|want| >= 1e-2 x condition), and the error over all
    logits is measured against the condition scale."""
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)), "different masked positions"
    assert torch.equal(got[~fin], want[~fin]), "masked positions must be -inf"
    if not fin.any():
        return 0.0, 0.0
    diff = (got[fin] - want[fin]).abs()
    if cond is None:
        return (diff / want[fin].abs().clamp_min(1e-30)).max().item(), 0.0
    c = cond[fin].clamp_min(1e-30)
    well = want[fin].abs() >= 1e-2 * c
    rel = (diff[well] / want[fin].abs()[well]).max().item() if well.any() else 0.0
    return rel, (diff / c).max().item()


def _check_close(got, args, want=None, name=None, seed=None):
    want = dsa_indexer_logits(*args) if want is None else want
    rel, cond = _compare(got, want, _condition(*args))
    if name:
        MAX_REL[name] = (rel, cond)
    assert rel <= 1e-5 and cond <= 1e-6, f"seed {seed}: relative error {rel:.3e}, error / condition {cond:.3e}"


def _condition(q, w, cache, r2t, rpi, seq, max_len):
    """sum_h |w_h| * sum_d |q_hd k_td| * |s_t|: the scale of the rounding error of a logit (signed weights cancel)."""
    B = q.shape[0]
    locs = r2t[rpi.long(), :max_len].long().clamp(0, cache.shape[0] - 1)
    keys, s = unpack_indexer_key(cache[locs])
    mag = torch.einsum("bqhd,btd->bqht", q.float().abs(), keys.abs()) * s.abs().view(B, 1, 1, -1)
    return (mag * w.float().abs().unsqueeze(-1)).sum(dim=2)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16, FP8])
@pytest.mark.parametrize("Q,H,max_len", [(1, 4, 300), (2, 16, 130), (1, 64, 200), (2, 64, 65)])
def test_kernel_matches_reference(Q, H, max_len, q_dtype):
    seed = _seed()
    args = _case(2, Q, H, max_len, seed, q_dtype=q_dtype)
    want = dsa_indexer_logits(*args)
    assert torch.equal(indexer_logits_reference(*args), want), "reference variant differs from reference.dsa"
    got = indexer_logits_triton(*args, out=_poisoned(2, Q, max_len))
    _check_close(got, args, want, f"Q={Q} H={H} T={max_len} {q_dtype}", seed)


@pytest.mark.parametrize("block_t,tiles,stages", [(16, 1, 1), (32, 1, 1), (128, 1, 1), (16, 4, 2), (32, 3, 1)])
def test_signed_weights_and_tiles(block_t, tiles, stages):
    """Tile sizes, and programs that score several tiles (the last group partly past max_len, groups past a short
    request's length)."""
    seed = _seed()
    args = _case(2, 2, 8, 150, seed, signed_weights=True)
    args[5][1] = 40  # the second request's groups from position 64 on lie wholly past its length
    got = indexer_logits_triton(*args, out=_poisoned(2, 2, 150), block_t=block_t, tiles=tiles, stages=stages)
    _check_close(got, args, name=f"signed weights, block_t={block_t} x {tiles}", seed=seed)


@pytest.mark.parametrize("first_pos", [0, 64, 128, 256])
def test_position_segments_tile_the_whole(first_pos):
    """Scoring positions [first_pos, max_len) alone into a slice of the whole logits gives what the whole call gives
    there (the decode stack's prefetch in position segments), on both paths; segments that tile the positions
    rebuild the whole."""
    seed = _seed()
    args = _case(3, 2, 8, 300, seed)
    whole, cond = dsa_indexer_logits(*args), _condition(*args)
    for impl in ("torch", "triton"):
        buf = torch.full((3, 2, 300), float("nan"))
        got = indexer_logits(*args[:-1], 300, impl=impl, out=buf[..., first_pos:], first_pos=first_pos)
        assert got.shape == (3, 2, 300 - first_pos) and buf[..., :first_pos].isnan().all()
        if impl == "torch":
            assert torch.equal(got, whole[..., first_pos:]), f"seed {seed}"
        else:  # the tolerances of _check_close
            rel, err = _compare(got, whole[..., first_pos:], cond[..., first_pos:])
            assert rel <= 1e-5 and err <= 1e-6, f"seed {seed}"
        if first_pos:
            indexer_logits(*args[:-1], first_pos, impl=impl, out=buf[..., :first_pos])
            rel, err = _compare(buf, whole, cond)
            assert rel <= 1e-5 and err <= 1e-6, f"seed {seed}"
    with pytest.raises(ValueError, match="first_pos"):
        indexer_logits_triton(*args, first_pos=301)


def test_short_and_empty_requests():
    seed = _seed()
    q, w, cache, r2t, rpi, seq, T = _case(4, 3, 4, 40, seed)
    seq = torch.tensor([40, 0, 2, 3])  # 0 and 2 leave nothing / one position visible to the first query tokens
    got = indexer_logits_triton(q, w, cache, r2t, rpi, seq, T, out=_poisoned(4, 3, T))
    _check_close(got, (q, w, cache, r2t, rpi, seq, T), seed=seed)
    assert torch.isinf(got[1]).all() and torch.isinf(got[2, 0]).all() and torch.isinf(got[2, 1, 1:]).all()
    assert torch.isfinite(got[2, 1, :1]).all() and torch.isfinite(got[2, 2, :2]).all()
    assert indexer_logits_triton(q[:0], w[:0], cache, r2t, rpi[:0], seq[:0], T).shape == (0, 3, T)


def test_topk_sets_match_reference():
    seed = _seed()
    k = 48
    q, w, cache, r2t, rpi, seq, T = _case(2, 2, 16, 260, seed)
    seq[1] = 30  # fewer than k positions: -1 padding
    got = indexer_topk(indexer_logits_triton(q, w, cache, r2t, rpi, seq, T, out=_poisoned(2, 2, T)), k)
    ref_logits = dsa_indexer_logits(q, w, cache, r2t, rpi, seq, T)
    want = topk_positions(ref_logits, k)
    assert got.dtype == torch.int32 and got.shape == want.shape
    checked = 0
    for b in range(2):
        for j in range(2):
            g, r = got[b, j], want[b, j]
            assert torch.equal(g < 0, r < 0), "different padding"
            vals = ref_logits[b, j].sort(descending=True).values
            n = int((r >= 0).sum())
            if n < T and n == k and torch.isfinite(vals[k]) and (vals[k - 1] - vals[k]) <= 1e-5 * vals[k - 1].abs():
                # a near-tie at the boundary: the kernel's picks must still score as the reference's k best
                picked = ref_logits[b, j, g[g >= 0].long()].sort(descending=True).values
                assert torch.allclose(picked, vals[:n], rtol=1e-5), f"seed {seed}"
                continue
            assert set(g[g >= 0].tolist()) == set(r[r >= 0].tolist()), f"seed {seed}: b={b} j={j}"
            checked += 1
    assert checked >= 3


def test_bad_table_entries_are_never_read():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    Q, H, T, N = 2, 8, 100, 120
    q, w, _, _, rpi, seq, _ = _case(2, Q, H, T, seed)
    seq = torch.tensor([T, 60])
    poison = torch.full((N + 2, INDEXER_ENTRY_BYTES), NAN_BYTE, dtype=torch.uint8)
    cache = poison[1:N + 1]  # rows -1 and N of this view are NaN rows of the same allocation
    cache[:] = pack_indexer_key(torch.randn(N, 128, generator=g))
    r2t = torch.randint(0, N, (6, T), generator=g, dtype=torch.int32)
    bad_at = {0: [3, 50, 99], 1: [0, 59]}
    bad_vals = [-1, N, N + 7, -(2**31)]
    for b, ps in bad_at.items():
        for i, p in enumerate(ps):
            r2t[rpi[b], p] = bad_vals[i % len(bad_vals)]
    r2t[rpi[1], 60:] = 2**30  # past seq_len: would fault if read
    got = indexer_logits_triton(q, w, cache, r2t, rpi, seq, T, out=_poisoned(2, Q, T))
    assert not got.isnan().any()
    args = (q, w, cache, r2t, rpi, seq, T)
    _check_close(got, args, indexer_logits_reference(*args), seed=seed)
    for b, ps in bad_at.items():
        assert torch.isinf(got[b, :, ps]).all() and (got[b, :, ps] < 0).all()
    fixed = r2t.clone()  # the same table with the bad entries made valid: every other logit is unchanged
    for b, ps in bad_at.items():
        fixed[rpi[b], ps] = 0
    fixed[rpi[1], 60:] = 0
    other = dsa_indexer_logits(q, w, cache, fixed, rpi, seq, T)
    keep = torch.ones(2, Q, T, dtype=torch.bool)
    for b, ps in bad_at.items():
        keep[b, :, ps] = False
    rel, cond = _compare(got[keep], other[keep], _condition(q, w, cache, fixed, rpi, seq, T)[keep])
    assert rel <= 1e-5 and cond <= 1e-6, f"seed {seed}"


def test_request_rows_outside_the_table_are_never_read():
    """A request whose row is past the table's end or negative sees nothing (every logit -inf) and reads no table row:
    the table here is a view of a larger allocation whose neighbouring rows hold valid locations, which would give
    finite logits if read."""
    seed = _seed()
    q, w, cache, r2t, rpi, seq, T = _case(4, 2, 8, 90, seed, rows=6)
    outer = torch.full((8, T), 5, dtype=torch.int32)  # rows -1 and 6 of the view: a valid location
    outer[1:7] = r2t
    table = outer[1:7]
    bad = torch.tensor([int(rpi[0]), 6, -1, int(rpi[3])])
    got = indexer_logits_triton(q, w, cache, table, bad, seq, T, out=_poisoned(4, 2, T))
    want = indexer_logits_reference(q, w, cache, table, bad, seq, T)
    assert torch.isinf(got[1:3]).all() and (got[1:3] < 0).all() and torch.equal(want[1:3], got[1:3])
    for b in (0, 3):  # the requests with rows of their own are unchanged
        one = indexer_logits_reference(q[b:b + 1], w[b:b + 1], cache, table, bad[b:b + 1], seq[b:b + 1], T)
        assert torch.equal(want[b:b + 1], one)
    own = [0, 3]
    _check_close(got[own], (q[own], w[own], cache, table, bad[own], seq[own], T), want[own], seed=seed)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the other requests now read random bytes (NaN, inf scales)
def test_request_isolation():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    q, w, cache, r2t, rpi, seq, T = _case(3, 2, 8, 90, seed)
    base = indexer_logits_triton(q, w, cache, r2t, rpi, seq, T, out=_poisoned(3, 2, T))
    # rewrite every location request 0 cannot see (the others' entries, unused rows), and the other table rows
    mine = r2t[rpi[0], :int(seq[0])].long()
    others = torch.ones(cache.shape[0], dtype=torch.bool)
    others[mine] = False
    cache2 = cache.clone()
    cache2[others] = torch.randint(0, 256, (int(others.sum()), INDEXER_ENTRY_BYTES), dtype=torch.uint8, generator=g)
    r2t2 = r2t.clone()
    rest = [r for r in range(r2t.shape[0]) if r != int(rpi[0])]
    r2t2[rest] = torch.randint(-5, cache.shape[0] + 5, (len(rest), T), generator=g, dtype=torch.int32)
    r2t2[rpi[0], int(seq[0]):] = -3  # past its own seq_len
    q2, w2, seq2 = q.clone(), w.clone(), seq.clone()
    q2[1:], w2[1:], seq2[1:] = torch.randn_like(q2[1:]), torch.rand_like(w2[1:]), torch.randint(0, T, (2,))
    after = indexer_logits_triton(q2, w2, cache2, r2t2, rpi, seq2, T, out=_poisoned(3, 2, T))
    assert torch.equal(after[0], base[0]), f"seed {seed}: request 0 saw another request's data"


def test_quantize_index_q_matches_unquantised():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 1, 64, 128, generator=g)
    w = torch.rand(2, 1, 64, generator=g)
    q8, wf = quantize_index_q(q, w)
    assert q8.dtype == FP8 and wf.dtype == torch.float32
    s = wf / w
    assert torch.equal(torch.exp2(torch.log2(s).round()), s), "ue8m0 scales are powers of two"
    assert ((q8.float() * s.unsqueeze(-1) - q).abs() <= q.abs().amax(-1, keepdim=True) / 8).all()
    _, _, cache, r2t, rpi, seq, T = _case(2, 1, 64, 80, seed)
    exact = dsa_indexer_logits(q, w, cache, r2t, rpi, seq, T)
    quant = indexer_logits_triton(q8, wf, cache, r2t, rpi, seq, T)
    fin = torch.isfinite(exact)
    assert torch.isfinite(quant).eq(fin).all()
    assert ((quant[fin] - exact[fin]).abs() <= 0.1 * exact[fin].abs() + 1e-3 * exact[fin].abs().max()).all()


def test_topk_contract():
    logits = torch.randn(2, 3, 20)
    logits[0, 0, 5:] = float("-inf")
    for k in (1, 4, 20, 25):
        assert torch.equal(indexer_topk(logits, k), topk_positions(logits, k))
    assert (indexer_topk(logits, 8)[0, 0, 5:] == -1).all()


def test_dispatch_and_bad_arguments():
    q, w, cache, r2t, rpi, seq, T = _case(2, 1, 4, 20, 0)
    assert torch.equal(indexer_logits(q, w, cache, r2t, rpi, seq, T), dsa_indexer_logits(q, w, cache, r2t, rpi, seq, T))
    assert dot_mode(torch.bfloat16) == DOT_FP32  # the interpreter has no bf16 / fp8 dot
    with pytest.raises(ValueError, match="impl"):
        indexer_logits(q, w, cache, r2t, rpi, seq, T, impl="cuda")
    with pytest.raises(ValueError, match="q_index"):
        indexer_logits_triton(q[..., :64], w, cache, r2t, rpi, seq, T)
    with pytest.raises(ValueError, match="weights"):
        indexer_logits_triton(q, w[:, :, :2], cache, r2t, rpi, seq, T)
    with pytest.raises(ValueError, match="index_cache"):
        indexer_logits_triton(q, w, cache[:, :128], r2t, rpi, seq, T)
    with pytest.raises(ValueError, match="out"):
        indexer_logits_triton(q, w, cache, r2t, rpi, seq, T, out=torch.empty(2, 1, T + 1))
    for impl in ("torch", "triton"):  # the same check on both paths, before anything is written
        for bad in (torch.empty(2, 1, T + 1), torch.empty(2, 1, T, dtype=torch.float64), torch.empty(1, 1, T)):
            with pytest.raises(ValueError, match=r"out must be fp32 \[B, Q, positions\]"):
                indexer_logits(q, w, cache, r2t, rpi, seq, T, impl=impl, out=bad)
    rows = torch.full((4, 1, T), float("nan"))
    assert torch.equal(indexer_logits(q, w, cache, r2t, rpi, seq, T, impl="torch", out=rows[1:3]), rows[1:3])
    assert torch.equal(rows[1:3], dsa_indexer_logits(q, w, cache, r2t, rpi, seq, T)) and rows[0].isnan().all()
    # a chained launch needs programmatic dependent launch (sm_90+): refused on CPU, as is an unknown position, and
    # the reference has no launch to chain
    for chain in ("head", "link"):
        with pytest.raises(ValueError, match=f"chain '{chain}' needs programmatic dependent launch"):
            indexer_logits_triton(q, w, cache, r2t, rpi, seq, T, chain=chain)
        with pytest.raises(ValueError, match=f"chain '{chain}' is the Triton kernel's launch; impl 'torch'"):
            indexer_logits(q, w, cache, r2t, rpi, seq, T, impl="torch", chain=chain)
    # tiles a program: a launch shape, checked on both paths (the reference's result does not depend on it)
    for impl in ("torch", "triton"):
        for bad in (0, True, 2.0):
            with pytest.raises(ValueError, match=f"tiles must be an integer >= 1 or None, got {bad!r}"):
                indexer_logits(q, w, cache, r2t, rpi, seq, T, impl=impl, tiles=bad)
    for tiles in (3, np.int64(2)):  # (a numpy integer too, as StackOptions takes)
        assert torch.equal(indexer_logits(q, w, cache, r2t, rpi, seq, T, impl="torch", tiles=tiles),
                           dsa_indexer_logits(q, w, cache, r2t, rpi, seq, T))
    _check_close(indexer_logits(q, w, cache, r2t, rpi, seq, T, impl="triton", tiles=np.int64(2)),
                 (q, w, cache, r2t, rpi, seq, T))
    with pytest.raises(ValueError, match="chain must be one of off, head, link, got 'tail'"):
        indexer_logits_triton(q, w, cache, r2t, rpi, seq, T, chain="tail")
    with pytest.raises(ValueError, match="tiles and stages must be >= 1, got 0 and 1"):
        indexer_logits_triton(q, w, cache, r2t, rpi, seq, T, tiles=0, stages=1)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16, FP8])
def test_gpu_kernel_matches_reference(q_dtype):
    seed = _seed()
    args = _case(8, 2, 64, 3000, seed, rows=10, q_dtype=q_dtype, device="cuda")
    want = indexer_logits_reference(*args)
    got = indexer_logits_triton(*args, out=_poisoned(8, 2, 3000, "cuda"))
    _check_close(got, args, want, seed=seed)
    assert torch.equal(indexer_topk(got, 2048) >= 0, topk_positions(want, 2048) >= 0)


@pytest.mark.gpu
def test_gpu_position_segments_are_bit_identical_to_the_whole():
    """The decode stack's prefetch in position segments scores each segment alone: for its exact modes to stay
    bit-identical to the all-HBM stack, every logit must come out as the whole call computes it."""
    seed = _seed()
    args = _case(8, 2, 64, 3000, seed, rows=10, q_dtype=FP8, device="cuda")
    whole = indexer_logits_triton(*args)
    parts = _poisoned(8, 2, 3000, "cuda")
    for lo, hi in ((0, 1280), (1280, 2240), (2240, 3000)):
        indexer_logits_triton(*args[:-1], hi, out=parts[..., lo:hi], first_pos=lo)
    assert torch.equal(parts, whole), f"seed {seed}"


@pytest.mark.gpu
def test_gpu_chained_segments_are_bit_identical_to_the_whole():
    """A series of segment launches chained by programmatic dependent launch (the decode stack's
    prefetch_indexer="chained"): every logit as the whole call computes it, eagerly and replayed in a CUDA graph; the
    stream's next kernel (a copy of the logits) sees every segment's, and so does a high-priority side stream that
    copies each segment after an event recorded behind its launch."""
    seed = _seed()
    args = _case(64, 1, 64, 32768, seed, rows=70, q_dtype=FP8, device="cuda")
    whole = indexer_logits_triton(*args)
    parts = _poisoned(64, 1, 32768, "cuda")
    seen = torch.empty_like(parts)
    side = torch.cuda.Stream(priority=-1)  # a high-priority stream reading each segment once its launch has ended,
    seen_side = torch.empty_like(parts)  # as the decode stack's claim kernels do

    def series():
        side.wait_stream(torch.cuda.current_stream())
        for i, (lo, hi) in enumerate(((0, 16384), (16384, 26240), (26240, 32768))):
            indexer_logits_triton(*args[:-1], hi, out=parts[..., lo:hi], first_pos=lo,
                                  chain="head" if i == 0 else "link")
            done = torch.cuda.Event()
            done.record()
            side.wait_event(done)
            with torch.cuda.stream(side):
                seen_side[..., lo:hi].copy_(parts[..., lo:hi])
        seen.copy_(parts)
        torch.cuda.current_stream().wait_stream(side)

    series()
    torch.cuda.synchronize()
    assert torch.equal(parts, whole) and torch.equal(seen, whole) and torch.equal(seen_side, whole), f"seed {seed}"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        series()
    for _ in range(3):
        for t in (parts, seen, seen_side):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(parts, whole) and torch.equal(seen, whole) and torch.equal(seen_side, whole), \
            f"seed {seed}"


@pytest.mark.gpu
def test_gpu_fp8_tensor_core_dot_is_close_not_exact():
    """The opt-in fp8 x fp8 dot: Hopper's fp8 tensor-core accumulation is not full fp32 (2.7e-4 seen on the H200)."""
    seed = _seed()
    args = _case(8, 2, 64, 3000, seed, rows=10, q_dtype=FP8, device="cuda")
    want = indexer_logits_reference(*args)
    got = indexer_logits_triton(*args, out=_poisoned(8, 2, 3000, "cuda"), fp8_dot=True)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    scale = want[finite].abs().max()
    rel = ((got[finite] - want[finite]).abs().max() / scale).item()
    print(f"fp8 tensor-core dot: max error / largest logit {rel:.3e}")
    assert rel <= 2e-3


def test_report_errors():
    """Prints the worst relative error per case (run with -s); runs last in this file."""
    for name, (rel, cond) in MAX_REL.items():
        print(f"indexer {name}: max relative error {rel:.3e}, max error / condition {cond:.3e}")
