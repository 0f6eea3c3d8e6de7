"""ECHO prefetch candidates in two Triton launches: what `EchoPrefetcher.candidates` computes with ~20 torch ops.

A position of request b is a candidate when it is visible (below seq_len, in a request row of the table: the rule of
`ess_sglang.kernels.translate.locate`), its table entry is a valid location, some
query token scores it above the request's threshold, and its entry is not resident. Candidates are listed most recent
first, at most cap[b] per request, in a [B, width] table of KV locations (-1 padded):

    K1 count   one program per (request, tile of positions): the tile's number of candidates -> counts[b, tile],
               and its first KEEP candidates' locations, in position order -> kept[b, tile]
    K2 write   each program sums the counts of the later tiles of its request and writes its tile's candidates at
               that offset + rank from the tile's end, below the request's cap: read from `kept`, or, for a tile
               with more than KEEP candidates, recomputed (re-reading the logits, the request table and the slot
               map, which `kept` saves the other tiles); the tile-0 program also writes the -1 padding after the
               request's last candidate (the output is never filled by a launch of its own)

The torch definition is `ess_sglang.prefetch.EchoPrefetcher.candidates` (impl="torch"); the tests check the two are
equal under TRITON_INTERPRET.

Two more launches of the prefetch path live here, each beside its torch definition: the threshold's EMA update
(`EchoPrefetcher.update`) and the settle that counts a prefetch's useful and wasted entries
(`HotPoolCacheManager.settle_prefetch`). Each replaces a chain of ~10 small torch kernels on the decode step's
critical path (a kernel timeline at batch 64: ~30 and ~70 us a layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ess_sglang.kernels.translate import locate

BLOCK = 1024
KEEP = 128  # candidates per tile that K1 keeps for K2 (a tile with more is recomputed by K2)


@triton.jit
def _candidates(logits_ptr, l_stride_b, l_stride_q, Q, thr_ptr, rpi_ptr, seq_ptr, r2t_ptr, r2t_stride, r2t_rows,
                r2t_width, width_t, l2s_ptr, num_locations, b, t, BLOCK: tl.constexpr):
    row = tl.load(rpi_ptr + b).to(tl.int64)
    row_ok = (row >= 0) & (row < r2t_rows)  # a row outside the table has no threshold and no candidates
    thr = tl.load(thr_ptr + row, mask=row_ok, other=float("inf"))
    above = tl.zeros((BLOCK,), tl.int1)
    for q in range(Q):
        x = tl.load(logits_ptr + b * l_stride_b + q * l_stride_q + t, mask=t < width_t, other=float("-inf"))
        above = above | (x > thr)
    # only positions above the threshold (a few percent) read the request table and the slot map
    loc, _, ok = locate(t, tl.zeros_like(t) + b, (t < width_t) & above, seq_ptr, rpi_ptr, r2t_ptr, r2t_stride,
                        r2t_rows, r2t_width, num_locations)
    slot = tl.load(l2s_ptr + loc, mask=ok, other=-1)
    return ok & (slot < 0), loc


@triton.jit
def _count_kernel(logits_ptr, l_stride_b, l_stride_q, Q, T, thr_ptr, rpi_ptr, seq_ptr, r2t_ptr, r2t_stride,
                  r2t_rows, r2t_width, l2s_ptr, num_locations, counts_ptr, kept_ptr, tiles, BLOCK: tl.constexpr,
                  KEEP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    t = tile * BLOCK + tl.arange(0, BLOCK)
    cand, loc = _candidates(logits_ptr, l_stride_b, l_stride_q, Q, thr_ptr, rpi_ptr, seq_ptr, r2t_ptr, r2t_stride,
                            r2t_rows, r2t_width, T, l2s_ptr, num_locations, b, t, BLOCK)
    c = cand.to(tl.int64)
    tl.store(counts_ptr + b * tiles + tile, tl.sum(c))
    # the tile's first KEEP candidates, in position order: K2 then reads them instead of recomputing the tile
    at = tl.cumsum(c, 0) - 1
    tl.store(kept_ptr + (b * tiles + tile) * KEEP + at, loc, mask=cand & (at < KEEP))


@triton.jit
def _write_kernel(logits_ptr, l_stride_b, l_stride_q, Q, T, thr_ptr, rpi_ptr, seq_ptr, r2t_ptr, r2t_stride,
                  r2t_rows, r2t_width, l2s_ptr, num_locations, counts_ptr, kept_ptr, tiles, cap_fraction_ptr, cap_min,
                  out_ptr, width, BLOCK: tl.constexpr, TILES: tl.constexpr, KEEP: tl.constexpr,
                  WBLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    later = tl.arange(0, TILES)
    later_counts = tl.load(counts_ptr + b * tiles + later, mask=(later > tile) & (later < tiles), other=0)
    after = tl.sum(later_counts)  # the request's candidates in later tiles (ranked before this tile's)
    n = tl.load(counts_ptr + b * tiles + tile)
    # the request's cap, as EchoPrefetcher.caps: clamp(ceil(seq_len * cap_fraction), cap_min, width), in float64 (a
    # Python float argument would arrive as float32, whose rounding moves some caps by one)
    seq = tl.load(seq_ptr + b).to(tl.float64)
    cap = tl.minimum(tl.maximum(tl.math.ceil(seq * tl.load(cap_fraction_ptr)).to(tl.int64), cap_min), width)
    if tile == 0:  # the request's row past its last candidate is padding (-1): no separate fill launch
        total = tl.minimum(after + n, cap)
        for r0 in range(0, width, WBLOCK):
            r = r0 + tl.arange(0, WBLOCK)
            tl.store(out_ptr + b * width + r, tl.full((WBLOCK,), -1, tl.int64), mask=(r >= total) & (r < width))
    if n <= KEEP:  # K1 kept all of the tile's candidates: the j-th has n - 1 - j candidates after it in the tile
        j = tl.arange(0, KEEP)
        kept = tl.load(kept_ptr + (b * tiles + tile) * KEEP + j, mask=j < n, other=-1)
        kept_rank = after + n - 1 - j
        tl.store(out_ptr + b * width + kept_rank, kept, mask=(j < n) & (kept_rank < cap))
    else:  # a tile with more candidates than K1 kept: recompute it
        t = tile * BLOCK + tl.arange(0, BLOCK)
        cand, loc = _candidates(logits_ptr, l_stride_b, l_stride_q, Q, thr_ptr, rpi_ptr, seq_ptr, r2t_ptr,
                                r2t_stride, r2t_rows, r2t_width, T, l2s_ptr, num_locations, b, t, BLOCK)
        c = cand.to(tl.int64)
        from_end = tl.sum(c) - tl.cumsum(c, 0)  # candidates after this one within the tile
        rank = after + from_end
        tl.store(out_ptr + b * width + rank, loc, mask=cand & (rank < cap))


def prefetch_candidates_triton(logits: torch.Tensor, thresholds: torch.Tensor, req_to_token: torch.Tensor,
                               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, loc_to_slot: torch.Tensor,
                               num_locations: int, cap_fraction: torch.Tensor, cap_min_tokens: int,
                               width: int) -> torch.Tensor:
    """logits [B, Q, T] (T <= the table width); thresholds [rows] (by request row); a request's cap is
    clamp(ceil(seq_len * cap_fraction), cap_min_tokens, width), cap_fraction a float64 [1] device tensor.

    Returns int64 KV locations [B * width], most recent first per request, -1 padded.
    """
    B, Q, T = logits.shape
    if logits.stride(-1) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("prefetch_candidates_triton wants logits and req_to_token rows contiguous")
    if B == 0 or T == 0:
        return torch.full((B * width,), -1, dtype=torch.int64, device=logits.device)
    out = torch.empty((B, width), dtype=torch.int64, device=logits.device)  # K2 writes every element
    if cap_fraction.dtype != torch.float64 or cap_fraction.numel() != 1:
        raise ValueError("prefetch_candidates_triton wants cap_fraction as a float64 tensor of one element")
    tiles = triton.cdiv(T, BLOCK)
    counts = torch.empty((B, tiles), dtype=torch.int64, device=logits.device)
    kept = torch.empty((B, tiles, KEEP), dtype=torch.int64, device=logits.device)
    args = (logits, logits.stride(0), logits.stride(1), Q, T, thresholds, req_pool_indices, seq_lens, req_to_token,
            req_to_token.stride(0), req_to_token.shape[0], req_to_token.shape[1], loc_to_slot, num_locations)
    _count_kernel[(B, tiles)](*args, counts, kept, tiles, BLOCK=BLOCK, KEEP=KEEP)
    _write_kernel[(B, tiles)](*args, counts, kept, tiles, cap_fraction, int(cap_min_tokens), out, width, BLOCK=BLOCK,
                              TILES=triton.next_power_of_2(tiles), KEEP=KEEP,
                              WBLOCK=min(triton.next_power_of_2(max(width, 1)), 1024))
    return out.view(-1)


@triton.jit
def _ema_kernel(kth_ptr, kth_stride, Q, rpi_ptr, thr_ptr, num_rows, B, alpha, keep, BLOCK: tl.constexpr):
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    kth = tl.full((BLOCK,), float("inf"), tl.float32)
    for q in range(Q):  # the lowest k-th best score over the query tokens counts (NaN wins, as in torch.amin)
        kth = tl.minimum(kth, tl.load(kth_ptr + b * kth_stride + q, mask=b < B, other=float("inf")).to(tl.float32),
                         propagate_nan=tl.PropagateNan.ALL)
    row = tl.load(rpi_ptr + b, mask=b < B, other=-1).to(tl.int64)
    m = (b < B) & (row >= 0) & (row < num_rows)  # a request row outside the table is never written
    old = tl.load(thr_ptr + row, mask=m, other=0.0)
    finite = (old == old) & (tl.abs(old) != float("inf"))
    new = tl.where(finite, alpha * kth + keep * old, kth)
    tl.store(thr_ptr + row, new, mask=m)


def ema_update_triton(thresholds: torch.Tensor, kth_scores: torch.Tensor, req_pool_indices: torch.Tensor,
                      alpha: float) -> None:
    """threshold[row b] <- alpha * kth_b + (1 - alpha) * threshold (kth_b alone where the threshold is not finite);
    kth_scores [B, Q] (or [B]). One launch of what `EchoPrefetcher.update` does in torch ops."""
    kth = kth_scores.reshape(kth_scores.shape[0], -1)
    if kth.stride(-1) != 1:
        kth = kth.contiguous()
    B, Q = kth.shape
    if B:
        _ema_kernel[(triton.cdiv(B, 128),)](kth, kth.stride(0), Q, req_pool_indices, thresholds, thresholds.numel(), B,
                                             float(alpha), 1 - float(alpha), BLOCK=128)


@triton.jit
def _settle_kernel(src_ptr, dst_ptr, count_ptr, n, s2l_ptr, stamp_ptr, clock_ptr, cnt_ptr, C_USEFUL: tl.constexpr,
                   C_WASTED: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < tl.minimum(tl.load(count_ptr), n)  # the list's real pairs come first (see FetchList)
    if tl.program_id(0) * BLOCK < tl.load(count_ptr):
        slot = tl.load(dst_ptr + i, mask=m, other=-1)
        got = m & (slot >= 0)
        owner = tl.load(s2l_ptr + slot, mask=got, other=-1).to(tl.int64)
        stamp = tl.load(stamp_ptr + slot, mask=got, other=0)
        useful = got & (owner == tl.load(src_ptr + i, mask=got, other=-2)) & (stamp == tl.load(clock_ptr))
        n_got, n_useful = tl.sum(got.to(tl.int64)), tl.sum(useful.to(tl.int64))
        if n_got > 0:
            tl.atomic_add(cnt_ptr + C_USEFUL, n_useful, sem="relaxed")
            tl.atomic_add(cnt_ptr + C_WASTED, n_got - n_useful, sem="relaxed")


def settle_prefetch_triton(src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor, slot_to_loc: torch.Tensor,
                           slot_stamp: torch.Tensor, clock: torch.Tensor, counters: torch.Tensor,
                           counter_ids: tuple[int, int]) -> None:
    """Count a prefetch's (location src[i] -> slot dst[i]) pairs, the first count[0] of the list: useful where the
    slot still holds the location and is stamped with this step (selected), wasted elsewhere. One launch."""
    n = dst.numel()
    if n:
        _settle_kernel[(triton.cdiv(n, 1024),)](src, dst, count, n, slot_to_loc, slot_stamp, clock, counters,
                                                C_USEFUL=counter_ids[0], C_WASTED=counter_ids[1], BLOCK=1024)
