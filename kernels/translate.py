"""Top-k positions -> KV locations in one launch: what an all-in-HBM DSA decode does before sparse attention.

SGLang's DSA backend turns the indexer's positions into rows of the device KV cache with one kernel
(`transform_index_page_table_decode`); the decode-stack benchmark's all-HBM baseline must be as lean, so this is
one Triton kernel beside its torch definition, `ess_sglang.cache_manager.positions_to_locations` (the same
bounds rules: a position is read from its own request's row only when 0 <= pos < seq_len and pos < the table
width; a table entry outside [0, num_locations) gives -1, as padding does; a batch entry whose request row is -1 is
padding, whatever its positions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def block_for(n: int, lo: int, hi: int, programs: int) -> int:
    """Entries per program for a launch over n entries: a power of two in [lo, hi] giving about `programs` programs,
    so that a small selection is spread over many SMs (these kernels are latency-bound chains of dependent loads)
    and a large one does not pay for thousands of tiny programs. Measured on the H200 (docs/design.md)."""
    return max(lo, min(hi, triton.next_power_of_2(max(1, n // programs))))


@triton.jit
def locate(pos, b, m, seq_ptr, rpi_ptr, r2t_ptr, r2t_stride, num_rows, width, num_locations):
    """Positions `pos` of batch entries `b` (mask m): (location, position visible, location valid).

    A position is read from its own request's row only when 0 <= pos < seq_len, pos < the table width and the row
    is one of the table's; a table entry outside [0, num_locations) is not valid. The rule of
    `cache_manager.positions_to_locations`, shared by translate, the fused resolve and the prefetch candidates."""
    seq = tl.load(seq_ptr + b, mask=m, other=0).to(tl.int64)
    row = tl.load(rpi_ptr + b, mask=m, other=-1).to(tl.int64)
    valid = m & (pos >= 0) & (pos < seq) & (pos < width) & (row >= 0) & (row < num_rows)
    loc = tl.load(r2t_ptr + row * r2t_stride + pos, mask=valid, other=-1).to(tl.int64)
    return loc, valid, valid & (loc >= 0) & (loc < num_locations)


@triton.jit
def position_to_location(pos_ptr, seq_ptr, rpi_ptr, r2t_ptr, r2t_stride, num_rows, width, per_batch, num_locations,
                         i, m):
    """Entries i (mask m) of a flat [B, Q, K] selection: (position, location, position visible, location valid).
    A batch entry whose request row is -1 is padding (e.g. a CUDA graph's unused row): its positions read as -1."""
    b = i // per_batch
    pos = tl.load(pos_ptr + i, mask=m, other=-1).to(tl.int64)
    pos = tl.where(tl.load(rpi_ptr + b, mask=m, other=-1) == -1, -1, pos)
    loc, valid, ok = locate(pos, b, m, seq_ptr, rpi_ptr, r2t_ptr, r2t_stride, num_rows, width, num_locations)
    return pos, loc, valid, ok


@triton.jit(do_not_specialize=("n", "per_batch"))
def _translate_kernel(pos_ptr, seq_ptr, rpi_ptr, r2t_ptr, r2t_stride, num_rows, width, n, per_batch, num_locations,
                      out_ptr,
                      l2s_ptr, num_slots, cnt_ptr, THROUGH_SLOTS: tl.constexpr, C_LOOKUPS: tl.constexpr,
                      C_HITS: tl.constexpr, C_NOT_RESIDENT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    _, loc, _, ok = position_to_location(pos_ptr, seq_ptr, rpi_ptr, r2t_ptr, r2t_stride, num_rows, width,
                                         per_batch, num_locations, i, m)
    if THROUGH_SLOTS:  # an ESS layer whose every live entry is resident: location -> hot slot, counted
        slot = tl.load(l2s_ptr + loc, mask=ok, other=-1)
        found = ok & (slot >= 0) & (slot < num_slots)
        tl.store(out_ptr + i, tl.where(found, slot, -1).to(tl.int32), mask=m)
        tl.atomic_add(cnt_ptr + C_LOOKUPS, tl.sum(ok.to(tl.int64)), sem="relaxed")
        tl.atomic_add(cnt_ptr + C_HITS, tl.sum(found.to(tl.int64)), sem="relaxed")
        tl.atomic_add(cnt_ptr + C_NOT_RESIDENT, tl.sum((ok & ~found).to(tl.int64)), sem="relaxed")
    else:
        tl.store(out_ptr + i, tl.where(ok, loc, -1).to(tl.int32), mask=m)


def translate_positions_triton(topk_pos: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                               seq_lens: torch.Tensor, num_locations: int, loc_to_slot: torch.Tensor | None = None,
                               num_slots: int = 0, counters: torch.Tensor | None = None,
                               counter_ids: tuple[int, int, int] = (0, 0, 0)) -> torch.Tensor:
    """topk_pos [B, Q, K] -> int32 KV locations [B, Q, K], -1 where padding or out of bounds.

    With `loc_to_slot` (a layer's token -> slot map), each location goes on to its hot slot (-1 if not resident),
    and `counters[counter_ids]` (LOOKUPS, HITS, NOT_RESIDENT) are incremented.
    """
    if topk_pos.dim() != 3 or req_to_token.stride(1) != 1:
        raise ValueError("translate_positions_triton wants topk_pos [B, Q, K] and req_to_token rows contiguous")
    pos = topk_pos.contiguous()
    out = torch.empty(pos.shape, dtype=torch.int32, device=pos.device)
    n = pos.numel()
    if n:
        block = block_for(n, 128, 512, 256)  # best of 128-1024 at batch 1, 2 and 64 (top-k 2048)
        _translate_kernel[(triton.cdiv(n, block),)](
            pos, seq_lens, req_pool_indices, req_to_token, req_to_token.stride(0), req_to_token.shape[0],
            req_to_token.shape[1], n,
            pos.shape[1] * pos.shape[2], num_locations, out,
            loc_to_slot if loc_to_slot is not None else out, num_slots, counters if counters is not None else out,
            THROUGH_SLOTS=loc_to_slot is not None, C_LOOKUPS=counter_ids[0], C_HITS=counter_ids[1],
            C_NOT_RESIDENT=counter_ids[2], BLOCK=block)
    return out
