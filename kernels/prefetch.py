"""ECHO prefetch candidates in two Triton launches: what `EchoPrefetcher.candidates` computes with ~20 torch ops.

A position of request b is a candidate when it is visible (below seq_len, in a request row of the table: the rule of
`ess_sglang.kernels.translate.locate`), its table entry is a valid location, some
query token scores it above the request's threshold, and its entry is not resident. Candidates are listed most recent
first, at most cap[b] per request, in a [B, width] table of KV locations (-1 padded):

    K1 count   one program per (request, tile of positions): the tile's number of candidates -> counts[b, tile]
    (torch)    offsets[b, tile] = candidates in the later tiles (a reverse cumulative sum over the few tiles)
    K2 write   each program recomputes its tile's candidates and writes them at offsets + rank from the tile's end

The torch definition is `ess_sglang.prefetch.EchoPrefetcher.candidates` (impl="torch"); the tests check the two are
equal under TRITON_INTERPRET.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ess_sglang.kernels.translate import locate

BLOCK = 1024


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
    loc, _, ok = locate(t, tl.zeros_like(t) + b, t < width_t, seq_ptr, rpi_ptr, r2t_ptr, r2t_stride, r2t_rows,
                        r2t_width, num_locations)
    slot = tl.load(l2s_ptr + loc, mask=ok, other=-1)
    return above & ok & (slot < 0), loc


@triton.jit
def _count_kernel(logits_ptr, l_stride_b, l_stride_q, Q, T, thr_ptr, rpi_ptr, seq_ptr, r2t_ptr, r2t_stride,
                  r2t_rows, r2t_width, l2s_ptr, num_locations, counts_ptr, tiles, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    t = tile * BLOCK + tl.arange(0, BLOCK)
    cand, _ = _candidates(logits_ptr, l_stride_b, l_stride_q, Q, thr_ptr, rpi_ptr, seq_ptr, r2t_ptr, r2t_stride,
                          r2t_rows, r2t_width, T, l2s_ptr, num_locations, b, t, BLOCK)
    tl.store(counts_ptr + b * tiles + tile, tl.sum(cand.to(tl.int64)))


@triton.jit
def _write_kernel(logits_ptr, l_stride_b, l_stride_q, Q, T, thr_ptr, rpi_ptr, seq_ptr, r2t_ptr, r2t_stride,
                  r2t_rows, r2t_width, l2s_ptr, num_locations, offsets_ptr, caps_ptr, tiles, out_ptr, width,
                  BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    t = tile * BLOCK + tl.arange(0, BLOCK)
    cand, loc = _candidates(logits_ptr, l_stride_b, l_stride_q, Q, thr_ptr, rpi_ptr, seq_ptr, r2t_ptr, r2t_stride,
                            r2t_rows, r2t_width, T, l2s_ptr, num_locations, b, t, BLOCK)
    c = cand.to(tl.int64)
    from_end = tl.sum(c) - tl.cumsum(c, 0)  # candidates after this one within the tile
    rank = tl.load(offsets_ptr + b * tiles + tile) + from_end
    cap = tl.load(caps_ptr + b)
    tl.store(out_ptr + b * width + rank, loc, mask=cand & (rank < cap))


def prefetch_candidates_triton(logits: torch.Tensor, thresholds: torch.Tensor, req_to_token: torch.Tensor,
                               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, loc_to_slot: torch.Tensor,
                               num_locations: int, caps: torch.Tensor, width: int) -> torch.Tensor:
    """logits [B, Q, T] (T <= the table width); thresholds [rows] (by request row); caps [B] (<= width).

    Returns int64 KV locations [B * width], most recent first per request, -1 padded.
    """
    B, Q, T = logits.shape
    if logits.stride(-1) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("prefetch_candidates_triton wants logits and req_to_token rows contiguous")
    out = torch.full((B, width), -1, dtype=torch.int64, device=logits.device)
    if B == 0 or T == 0:
        return out.view(-1)
    tiles = triton.cdiv(T, BLOCK)
    counts = torch.empty((B, tiles), dtype=torch.int64, device=logits.device)
    args = (logits, logits.stride(0), logits.stride(1), Q, T, thresholds, req_pool_indices, seq_lens, req_to_token,
            req_to_token.stride(0), req_to_token.shape[0], req_to_token.shape[1], loc_to_slot, num_locations)
    _count_kernel[(B, tiles)](*args, counts, tiles, BLOCK=BLOCK)
    offsets = counts.flip(1).cumsum(1).flip(1) - counts  # candidates in the later tiles
    _write_kernel[(B, tiles)](*args, offsets, caps, tiles, out, width, BLOCK=BLOCK)
    return out.view(-1)
