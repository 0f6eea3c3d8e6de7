"""Top-k of indexer scores for decode: the positions of each row's k largest scores, and the k-th largest score.

torch.topk (k = 2048 over 32K-128K scores) is a chain of ~30 small kernels that takes ~120 us on the H200 whether the
batch has 16 or 48 rows (docs/design.md); the decode stack runs it once per layer (twice in dual-batch mode).
Two variants of one radix selection (four 8-bit passes of histograms, each narrowing the prefix of the k-th largest
key, then the selected positions are written): "row", one program per row in one launch (slower than torch.topk on
the H200: one SM reads the row five times), and "tiles", many programs per row with per-row histograms in global
memory (~16 small launches; not yet timed on a GPU).

Keys: a float32 score maps to an unsigned key whose integer order is the float order (negative floats: all bits
flipped; others: the sign bit set). The selection is every position whose key is above the threshold key, then
positions equal to it, lowest position first, until k are taken (ties are broken by position, deterministically).
Positions whose score is -inf (invisible: past the causal length) or NaN are never reported: where fewer than k
scores are finite the list is padded with -1, and the k-th score is -inf, as `reference.dsa.topk_positions` does.

Output order: the positions above the threshold in increasing order, then the tied ones in increasing order, then -1
padding (torch.topk orders by score instead; the sets are equal wherever no two scores tie at the threshold).

`topk_reference` is the plain-torch definition with the same tie rule; `topk_triton` the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


def _keys(scores: torch.Tensor) -> torch.Tensor:
    """Order-preserving int64 keys of float32 scores (torch reference)."""
    scores = scores.float().nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    bits = scores.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    neg = bits >= 0x80000000
    return torch.where(neg, bits ^ 0xFFFFFFFF, bits | 0x80000000)


def topk_reference(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B, Q, T] float -> (positions int32 [B, Q, k] in the kernel's order, k-th score float32 [B, Q])."""
    B, Q, T = scores.shape
    flat = scores.float().reshape(B * Q, T)
    keys = _keys(flat)
    pos = torch.full((B * Q, k), -1, dtype=torch.int32)
    kth = torch.full((B * Q,), float("-inf"))
    for r in range(B * Q):
        order = sorted(range(T), key=lambda t, kr=keys[r]: (-int(kr[t]), t))[:k]  # noqa: B023
        thr = keys[r, order[-1]] if order else None
        above = [t for t in range(T) if thr is not None and keys[r, t] > thr]
        tied = sorted(t for t in order if keys[r, t] == thr)
        chosen = [t for t in above + tied if torch.isfinite(flat[r, t])]
        pos[r, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
        if len(chosen) == k:
            kth[r] = flat[r, order[-1]]
    return pos.view(B, Q, k), kth.view(B, Q)


@triton.jit
def _key(x):
    x = tl.where(x != x, float("-inf"), x)  # NaN scores are treated as invisible (-inf)
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, ~bits, bits | (-2147483648)).to(tl.uint32, bitcast=True)


@triton.jit
def _select_digit(hist, need, bins):
    """From a 256-bin histogram of the keys still in play: the highest digit that holds the need-th largest key,
    and how many keys equal to the threshold remain to take once the higher digits' keys are counted."""
    at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist
    j = tl.max(tl.where(at_or_above >= need, bins, 0))
    return j, need - tl.sum(tl.where(bins > j, hist, 0))


@triton.jit
def _topk_kernel(scores_ptr, row_stride, T, K, out_pos_ptr, out_kth_ptr, BLOCK: tl.constexpr):
    # requires T >= K (the wrapper pads otherwise)
    r = tl.program_id(0).to(tl.int64)
    base = scores_ptr + r * row_stride
    bins = tl.arange(0, 256)
    prefix = tl.zeros((), tl.uint32)
    need = K  # keys equal to the threshold still to take, once the keys above it are accounted for
    for p in tl.static_range(4):  # the threshold key's bits 31..24, 23..16, 15..8, 7..0
        hist = tl.zeros((256,), tl.int32)
        for t0 in range(0, T, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            m = t < T
            key = _key(tl.load(base + t, mask=m, other=float("-inf")))
            if p > 0:
                m = m & ((key >> (32 - 8 * p)) == prefix)
            hist += tl.histogram(((key >> (24 - 8 * p)) & 255).to(tl.int32), 256, mask=m)
        j, need = _select_digit(hist, need, bins)
        prefix = (prefix << 8) | j.to(tl.uint32)
    thr = prefix  # the k-th largest key: K - need keys lie above it, `need` equal ones are taken, lowest first
    n_above = K - need
    out = out_pos_ptr + r * K
    above_at = tl.zeros((), tl.int32)
    tied_at = tl.zeros((), tl.int32)
    for t0 in range(0, T, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        m = t < T
        x = tl.load(base + t, mask=m, other=float("-inf"))
        key = _key(x)
        finite = m & (x > float("-inf"))  # NaN compares false: never reported
        above = finite & (key > thr)
        tied = finite & (key == thr)
        a_rank = above_at + tl.cumsum(above.to(tl.int32), 0) - 1
        t_rank = tied_at + tl.cumsum(tied.to(tl.int32), 0) - 1
        tl.store(out + a_rank, t.to(tl.int32), mask=above)
        tl.store(out + n_above + t_rank, t.to(tl.int32), mask=tied & (t_rank < need))
        above_at += tl.sum(above.to(tl.int32))
        tied_at += tl.sum(tied.to(tl.int32))
    taken = above_at + tl.minimum(tied_at, need)  # fewer than K when fewer than K scores are finite
    for k0 in range(0, K, BLOCK):
        i = k0 + tl.arange(0, BLOCK)
        tl.store(out + i, tl.full((BLOCK,), -1, tl.int32), mask=(i < K) & (i >= taken))
    thr_i = thr.to(tl.int32, bitcast=True)  # sign bit set: a float >= +0 (its bits are the rest); else all flipped
    bits = tl.where(thr_i < 0, thr_i & 2147483647, ~thr_i)
    tl.store(out_kth_ptr + r, tl.where(taken == K, bits.to(tl.float32, bitcast=True), float("-inf")))


# ---------------------------------------------------------------------------------------------- tiled variant
# The same selection with many programs per row: each pass histograms tiles of the row into a per-row global
# histogram (atomics), a one-program-per-row kernel picks the digit; then the tiles count and write their selections
# at offsets from an exclusive prefix sum over tiles. Same output, in the same order, as the one-program kernel.

@triton.jit
def _tile_hist_kernel(scores_ptr, row_stride, T, prefix_ptr, hist_ptr, P: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = t < T
    key = _key(tl.load(scores_ptr + r * row_stride + t, mask=m, other=float("-inf")))
    if P > 0:
        m = m & ((key >> (32 - 8 * P)) == tl.load(prefix_ptr + r).to(tl.uint32))
    h = tl.histogram(((key >> (24 - 8 * P)) & 255).to(tl.int32), 256, mask=m)
    tl.atomic_add(hist_ptr + r * 256 + tl.arange(0, 256), h, sem="relaxed")


@triton.jit
def _tile_select_kernel(hist_ptr, prefix_ptr, need_ptr):
    r = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, 256)
    hist = tl.load(hist_ptr + r * 256 + bins)
    j, need = _select_digit(hist, tl.load(need_ptr + r), bins)
    tl.store(need_ptr + r, need)
    tl.store(prefix_ptr + r, (tl.load(prefix_ptr + r) << 8) | j.to(tl.int64))
    tl.store(hist_ptr + r * 256 + bins, tl.zeros((256,), tl.int32))  # ready for the next pass


@triton.jit
def _tile_pick(scores_ptr, row_stride, T, prefix_ptr, r, t):
    m = t < T
    x = tl.load(scores_ptr + r * row_stride + t, mask=m, other=float("-inf"))
    key = _key(x)
    thr = tl.load(prefix_ptr + r).to(tl.uint32)
    finite = m & (x > float("-inf"))
    return finite & (key > thr), finite & (key == thr)


@triton.jit
def _tile_count_kernel(scores_ptr, row_stride, T, prefix_ptr, counts_ptr, tiles, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    above, tied = _tile_pick(scores_ptr, row_stride, T, prefix_ptr, r, tile * BLOCK + tl.arange(0, BLOCK))
    tl.store(counts_ptr + (r * 2) * tiles + tile, tl.sum(above.to(tl.int32)))
    tl.store(counts_ptr + (r * 2 + 1) * tiles + tile, tl.sum(tied.to(tl.int32)))


@triton.jit
def _tile_write_kernel(scores_ptr, row_stride, T, K, prefix_ptr, need_ptr, offsets_ptr, tiles, out_pos_ptr,
                       BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    t = tile * BLOCK + tl.arange(0, BLOCK)
    above, tied = _tile_pick(scores_ptr, row_stride, T, prefix_ptr, r, t)
    need = tl.load(need_ptr + r)
    a_rank = tl.load(offsets_ptr + (r * 2) * tiles + tile) + tl.cumsum(above.to(tl.int32), 0) - 1
    t_rank = tl.load(offsets_ptr + (r * 2 + 1) * tiles + tile) + tl.cumsum(tied.to(tl.int32), 0) - 1
    out = out_pos_ptr + r * K
    tl.store(out + a_rank, t.to(tl.int32), mask=above)
    tl.store(out + (K - need) + t_rank, t.to(tl.int32), mask=tied & (t_rank < need))


def _topk_tiled(flat: torch.Tensor, k: int, pos: torch.Tensor, kth: torch.Tensor) -> None:
    R, T = flat.shape
    dev = flat.device
    tiles = triton.cdiv(T, BLOCK)
    hist = torch.zeros((R, 256), dtype=torch.int32, device=dev)
    prefix = torch.zeros(R, dtype=torch.int64, device=dev)
    need = torch.full((R,), k, dtype=torch.int32, device=dev)
    for p in range(4):
        _tile_hist_kernel[(R, tiles)](flat, flat.stride(0), T, prefix, hist, P=p, BLOCK=BLOCK, num_warps=8)
        _tile_select_kernel[(R,)](hist, prefix, need)
    counts = torch.empty((R, 2, tiles), dtype=torch.int32, device=dev)
    _tile_count_kernel[(R, tiles)](flat, flat.stride(0), T, prefix, counts, tiles, BLOCK=BLOCK, num_warps=8)
    offsets = counts.cumsum(-1, dtype=torch.int32) - counts
    pos.fill_(-1)
    _tile_write_kernel[(R, tiles)](flat, flat.stride(0), T, k, prefix, need, offsets, tiles, pos, BLOCK=BLOCK,
                                   num_warps=8)
    taken = counts[:, 0].sum(-1) + torch.minimum(counts[:, 1].sum(-1), need)
    thr = prefix  # the threshold key back to its float: sign bit set -> the float's bits; else all bits flipped
    bits = torch.where(thr >= 1 << 31, thr & 0x7FFFFFFF, (~thr) & 0xFFFFFFFF)
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
    kth.copy_(torch.where(taken == k, bits.view(torch.float32), float("-inf")))


def topk_triton(scores: torch.Tensor, k: int, variant: str = "tiles") -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B, Q, T] float32 (last dim contiguous) -> (positions int32 [B, Q, k], k-th score [B, Q]).

    variant "row": one program per row (one launch; measured slower than torch.topk on the H200); "tiles": many
    programs per row (~16 launches, not yet timed on a GPU). Both give the same output. No host synchronisation
    (CUDA-graph safe). Where T < k the missing entries are -1.
    """
    if scores.dim() != 3 or scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(f"topk_triton wants float32 scores [B, Q, T] with a contiguous last dim, got "
                         f"{scores.dtype} {tuple(scores.shape)}")
    B, Q, T = scores.shape
    flat = scores.reshape(B * Q, T)
    kk = min(k, T)
    pos = torch.empty((B * Q, kk), dtype=torch.int32, device=scores.device)
    kth = torch.empty((B * Q,), dtype=torch.float32, device=scores.device)
    if variant not in ("row", "tiles"):
        raise ValueError(f"topk_triton: variant must be 'row' or 'tiles', got {variant!r}")
    if B * Q and kk:
        if variant == "row":
            _topk_kernel[(B * Q,)](flat, flat.stride(0), T, kk, pos, kth, BLOCK=BLOCK, num_warps=8)
        else:
            _topk_tiled(flat, kk, pos, kth)
    if kk < k:  # fewer scores than k: pad, and there is no k-th score
        pos = torch.cat([pos, pos.new_full((B * Q, k - kk), -1)], dim=1)
        kth.fill_(float("-inf"))
    return pos.view(B, Q, k), kth.view(B, Q)


# ------------------------------------------------------------------------------------------------ the k-th score of
# a selection made elsewhere (a top-k that gives positions only, as SGLang's decode top-k does)


SHORT_ROWS = ("neg_inf", "lowest")


def kth_of_selection_reference(scores: torch.Tensor, positions: torch.Tensor, short_rows: str = "neg_inf"
                               ) -> torch.Tensor:
    """scores [R, T] float, positions [R, k] int (-1: none) -> the k-th best score [R] float32: the lowest selected
    score. A row that selected fewer than k positions (a -1, or a position outside [0, T), which is not read) gets
    -inf (short_rows "neg_inf": no k-th score, as `topk_reference` says), or the lowest score it did select, +inf if
    none ("lowest": the SGLang plugin's rule)."""
    if short_rows not in SHORT_ROWS:
        raise ValueError(f"short_rows must be one of {SHORT_ROWS}, got {short_rows!r}")
    R, T = scores.shape
    ok = (positions >= 0) & (positions < T)
    vals = torch.gather(scores.float(), 1, torch.where(ok, positions, 0).long())
    low = torch.where(ok & ~vals.isnan(), vals, float("inf")).amin(dim=1)  # (a NaN score is never the lowest)
    return low if short_rows == "lowest" else torch.where(ok.all(dim=1), low, float("-inf"))


@triton.jit
def _kth_of_selection_kernel(scores_ptr, row_stride, T, pos_ptr, pos_stride, K, out_ptr, BLOCK_K: tl.constexpr,
                             SHORT_NEG_INF: tl.constexpr):
    r = tl.program_id(0)
    low = float("inf")
    short = 0
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        p = tl.load(pos_ptr + r * pos_stride + ks, mask=ks < K, other=0).to(tl.int64)
        ok = (p >= 0) & (p < T) & (ks < K)
        v = tl.load(scores_ptr + r.to(tl.int64) * row_stride + p, mask=ok, other=float("inf")).to(tl.float32)
        v = tl.where(v != v, float("inf"), v)  # a NaN score is never the lowest
        low = tl.minimum(low, tl.min(v, axis=0))
        short += tl.sum(((~ok) & (ks < K)).to(tl.int32), axis=0)
    if SHORT_NEG_INF:
        low = tl.where(short > 0, float("-inf"), low)
    tl.store(out_ptr + r, low)


def kth_of_selection(scores: torch.Tensor, positions: torch.Tensor, short_rows: str = "neg_inf") -> torch.Tensor:
    """`kth_of_selection_reference` in one launch (one program per row): scores [R, T] float32 with unit stride,
    positions [R, k] int32 -> [R] float32. No host synchronisation (CUDA-graph safe)."""
    if short_rows not in SHORT_ROWS:
        raise ValueError(f"short_rows must be one of {SHORT_ROWS}, got {short_rows!r}")
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"kth_of_selection wants float32 scores [R, T] with unit stride, got {scores.dtype} "
                         f"{tuple(scores.shape)} strides {scores.stride()}")
    if positions.dim() != 2 or positions.shape[0] != scores.shape[0] or positions.dtype != torch.int32 \
            or positions.stride(1) != 1 or positions.device != scores.device:
        raise ValueError(f"kth_of_selection wants int32 positions [{scores.shape[0]}, k] with unit stride on "
                         f"{scores.device}, got {positions.dtype} {tuple(positions.shape)} on {positions.device}")
    R, K = positions.shape
    out = torch.empty(R, dtype=torch.float32, device=scores.device)
    if R:
        block = min(2048, triton.next_power_of_2(max(K, 16)))
        _kth_of_selection_kernel[(R,)](scores, scores.stride(0), scores.shape[1], positions, positions.stride(0), K,
                                       out, BLOCK_K=block, SHORT_NEG_INF=short_rows == "neg_inf", num_warps=4)
    return out


def kth_of_selection_any(scores: torch.Tensor, positions: torch.Tensor, short_rows: str = "neg_inf") -> torch.Tensor:
    """The k-th score of a selection from whatever a caller holds: `kth_of_selection` (one launch) for float32 CUDA
    scores and int32 positions with unit last strides (what the decode stacks and SGLang's top-k give), the torch
    reference otherwise (on the CPU, or other dtypes)."""
    if scores.is_cuda and scores.dtype == torch.float32 and scores.stride(-1) == 1 \
            and positions.dtype == torch.int32 and positions.stride(-1) == 1:
        return kth_of_selection(scores, positions, short_rows)
    return kth_of_selection_reference(scores, positions, short_rows)
