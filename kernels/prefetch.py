"""ECHO prefetch candidates: what `EchoPrefetcher.candidates` computes with ~20 torch ops, in Triton launches.

A position of request b is a candidate when it is visible (below seq_len, in a request row of the table: the rule of
`ess_sglang.kernels.translate.locate`), its table entry is a valid location, some
query token scores it above the request's threshold, and its entry is not resident. Candidates are listed most recent
first, at most cap[b] per request, in a [B, width] table of KV locations (-1 padded).

Three launches, every count kept on the device:

    K1 count    one program per (request, tile of TILE positions): the tile's number of candidates -> counts[b, tile],
                and their locations in position order, compacted to the front of kept[b, tile, :] (int32; the whole
                tile fits, so nothing is recomputed later)
    K2 offsets  one program per request: for each tile, the candidates in the request's later tiles (which rank
                before it: most recent first)
    K3 write    one program per (request, group of tiles): each kept candidate at offset + rank from its tile's end,
                below the request's cap; the group-0 program also writes the -1 padding after the request's last
                candidate (the output is never filled by a launch of its own)

The torch definition is `ess_sglang.prefetch.EchoPrefetcher.candidates` (impl="torch"); the tests check both ways
equal it under TRITON_INTERPRET.

With spare slots, the prefetch can instead find a segment's candidates and claim their spare slots in one launch and a
one-program close (`claim_above_triton`, below: the same state as K1-K3 followed by the spare-only claim of
`kernels/resolve.py`, under the interpreter). Two more launches of the prefetch path live here, each beside its torch
definition: the threshold's EMA update (`EchoPrefetcher.update`) and the settle that counts a prefetch's useful and
wasted entries (`HotPoolCacheManager.settle_prefetch`). Each replaces a chain of ~10 small torch kernels on the decode
step's critical path (a kernel timeline at batch 64: ~30 and ~70 us a layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from ess_sglang.kernels.resolve import _NEVER, _pdl_enter, last_step, pdl_launch
from ess_sglang.kernels.translate import locate

TILE = 1024  # positions per program of the count kernel (K1) and of the one-launch claim
WRITE_BLOCK = 1024  # kept entries per program of the write kernel: WRITE_BLOCK // tile tiles


@dataclass
class TileCandidates:
    """K1's output for B requests: counts [B, tiles] int32 and kept [B, tiles, tile] int32 (see the module
    docstring), read by K2 and K3."""

    counts: torch.Tensor
    kept: torch.Tensor

    @property
    def tile(self) -> int:
        return self.kept.shape[2]


def new_tile_candidates(batch: int, positions: int, tile: int, num_locations: int,
                        device: torch.device) -> TileCandidates:
    """Scratch for `batch` requests of `positions` scored positions in tiles of `tile` (a power of two)."""
    if tile <= 0 or tile & (tile - 1) or tile > WRITE_BLOCK:
        raise ValueError(f"candidate tiles must be a power of two <= {WRITE_BLOCK} positions, got {tile}")
    if num_locations >= 1 << 31:
        raise ValueError(f"candidate locations are kept as int32: {num_locations} locations is too many")
    tiles = triton.cdiv(positions, tile)
    return TileCandidates(torch.empty((batch, tiles), dtype=torch.int32, device=device),
                          torch.empty((batch, tiles, tile), dtype=torch.int32, device=device))


@triton.jit
def _segment_cap(seq_ptr, b, cap_fraction_ptr, cap_min, width, first_pos, T):
    """Request b's cap, as EchoPrefetcher.caps: clamp(ceil(seq_len * cap_fraction), cap_min, width), in float64 (a
    Python float argument would arrive as float32, whose rounding moves some caps by one); a segment of the positions
    ([first_pos, first_pos + T)) gets its share of it, rounded up (the whole cap where the logits cover every
    position below seq_len)."""
    seq = tl.load(seq_ptr + b).to(tl.int64)
    cap = tl.minimum(tl.maximum(tl.math.ceil(seq.to(tl.float64) * tl.load(cap_fraction_ptr)).to(tl.int64), cap_min),
                     width)
    seen = tl.minimum(tl.maximum(seq - first_pos, 0), T)
    return tl.where(seen > 0, (cap * seen + tl.maximum(seq, 1) - 1) // tl.maximum(seq, 1), 0)


@triton.jit
def _tile_candidates(logits_ptr, l_stride_b, l_stride_q, Q, T, first_pos, thr_ptr, margin, rpi_ptr, seq_ptr,
                     r2t_ptr, r2t_stride, r2t_rows, r2t_width, l2s_ptr, num_locations, b, tile, TILE: tl.constexpr):
    """Request b's candidates among the TILE positions of logits tile `tile`: (their KV locations, the mask)."""
    i = tile * TILE + tl.arange(0, TILE)  # logits column; position first_pos + i
    t = first_pos + i
    row = tl.load(rpi_ptr + b).to(tl.int64)
    row_ok = (row >= 0) & (row < r2t_rows)  # a row outside the table has no threshold and no candidates
    thr = tl.load(thr_ptr + tl.where(row_ok, row, 0))
    thr = tl.where(row_ok, thr, float("inf"))
    thr = tl.where(tl.abs(thr) != float("inf"), thr - margin * tl.abs(thr), thr)  # the bar a candidate must pass
    above = tl.zeros((TILE,), tl.int1)
    for q in range(Q):
        x = tl.load(logits_ptr + b * l_stride_b + q * l_stride_q + i, mask=i < T, other=float("-inf"))
        above = above | (x > thr)
    # only positions above the threshold (a few percent) read the request table and the slot map
    loc, _, ok = locate(t, tl.zeros_like(t) + b, (i < T) & above, seq_ptr, rpi_ptr, r2t_ptr, r2t_stride, r2t_rows,
                        r2t_width, num_locations)
    return loc, ok & (tl.load(l2s_ptr + loc, mask=ok, other=-1) < 0)


@triton.jit
def _count_kernel(logits_ptr, l_stride_b, l_stride_q, Q, T, first_pos, thr_ptr, margin, rpi_ptr, seq_ptr, r2t_ptr,
                  r2t_stride, r2t_rows, r2t_width, l2s_ptr, num_locations, counts_ptr, kept_ptr, tiles,
                  TILE: tl.constexpr, PDL: tl.constexpr):
    _pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    loc, cand = _tile_candidates(logits_ptr, l_stride_b, l_stride_q, Q, T, first_pos, thr_ptr, margin, rpi_ptr,
                                 seq_ptr, r2t_ptr, r2t_stride, r2t_rows, r2t_width, l2s_ptr, num_locations, b, tile,
                                 TILE)
    # the tile's count, and its candidates' locations in position order at the front of kept[b, tile, :]
    c = cand.to(tl.int32)
    at = b * tiles + tile
    tl.store(counts_ptr + at, tl.sum(c))
    tl.store(kept_ptr + at * TILE + tl.cumsum(c, 0) - 1, loc.to(tl.int32), mask=cand)


@triton.jit
def _offsets_kernel(counts_ptr, after_ptr, tiles, TILES: tl.constexpr, PDL: tl.constexpr):
    _pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, TILES)
    c = tl.load(counts_ptr + b * tiles + t, mask=t < tiles, other=0)
    # candidates in the request's later tiles (ranked before this tile's: most recent first)
    tl.store(after_ptr + b * tiles + t, tl.sum(c) - tl.cumsum(c, 0), mask=t < tiles)


@triton.jit
def _write_kernel(counts_ptr, after_ptr, kept_ptr, tiles, seq_ptr, cap_fraction_ptr, cap_min, first_pos, T, out_ptr,
                  width, TILE: tl.constexpr, GROUP: tl.constexpr, WBLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    tile = g * GROUP + tl.arange(0, GROUP)
    mt = tile < tiles
    n = tl.load(counts_ptr + b * tiles + tile, mask=mt, other=0)
    after = tl.load(after_ptr + b * tiles + tile, mask=mt, other=0)
    cap = _segment_cap(seq_ptr, b, cap_fraction_ptr, cap_min, width, first_pos, T)
    if g == 0:  # the request's row past its last candidate is padding (-1): no separate fill launch
        total = tl.minimum(tl.sum(tl.where(tile == 0, after + n, 0)).to(tl.int64), cap)
        for r0 in range(0, width, WBLOCK):
            r = r0 + tl.arange(0, WBLOCK)
            tl.store(out_ptr + b * width + r, tl.full((WBLOCK,), -1, tl.int64), mask=(r >= total) & (r < width))
    # the j-th kept candidate of a tile has n - 1 - j candidates after it in the tile
    j = tl.arange(0, TILE)
    m = mt[:, None] & (j[None, :] < n[:, None])
    kept = tl.load(kept_ptr + (b * tiles + tile[:, None]) * TILE + j[None, :], mask=m, other=-1)
    rank = (after + n - 1)[:, None].to(tl.int64) - j[None, :]
    tl.store(out_ptr + b * width + rank, kept.to(tl.int64), mask=m & (rank < cap))


def candidates_from_tiles(tc: TileCandidates, seq_lens: torch.Tensor, cap_fraction: torch.Tensor,
                          cap_min_tokens: int, width: int, pdl: bool = False, first_pos: int = 0,
                          positions: int | None = None) -> torch.Tensor:
    """K2 + K3: the per-tile candidates of B requests -> int64 KV locations [B * width], most recent first per
    request, at most cap = clamp(ceil(seq_len * cap_fraction), cap_min_tokens, width) each, -1 padded; where the
    tiles cover only the positions [first_pos, first_pos + positions) (a segment; positions None: every position
    from first_pos), at most ceil(cap * seen / seq_len), seen the segment's positions below seq_len (the whole cap
    where the segment holds all of them). cap_fraction: a float64 [1] device tensor. `pdl` (sm_90+): both launched
    with programmatic dependent launch, each waiting for the kernel before it first thing, so that their launches
    overlap the kernel before."""
    B, tiles = tc.counts.shape
    if positions is None:
        positions = 1 << 62
    if first_pos < 0 or positions < 0:
        raise ValueError(f"candidates_from_tiles: first_pos and positions must be >= 0, got {first_pos}, {positions}")
    if cap_fraction.dtype != torch.float64 or cap_fraction.numel() != 1:
        raise ValueError("candidates_from_tiles wants cap_fraction as a float64 tensor of one element")
    if B == 0 or tiles == 0:
        return torch.full((B * width,), -1, dtype=torch.int64, device=tc.counts.device)
    out = torch.empty((B, width), dtype=torch.int64, device=tc.counts.device)  # K3 writes every element
    after = torch.empty_like(tc.counts)
    _offsets_kernel[(B,)](tc.counts, after, tiles, TILES=triton.next_power_of_2(tiles), **pdl_launch(pdl))
    group = WRITE_BLOCK // tc.tile
    _write_kernel[(B, triton.cdiv(tiles, group))](tc.counts, after, tc.kept, tiles, seq_lens, cap_fraction,
                                                  int(cap_min_tokens), int(first_pos), int(positions), out, width,
                                                  TILE=tc.tile, GROUP=group,
                                                  WBLOCK=min(triton.next_power_of_2(max(width, 1)), 1024),
                                                  **pdl_launch(pdl))
    return out.view(-1)


def prefetch_candidates_triton(logits: torch.Tensor, thresholds: torch.Tensor, req_to_token: torch.Tensor,
                               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, loc_to_slot: torch.Tensor,
                               num_locations: int, cap_fraction: torch.Tensor, cap_min_tokens: int,
                               width: int, margin: float = 0.0, pdl: bool = False, first_pos: int = 0) -> torch.Tensor:
    """K1-K3 over logits [B, Q, T] of positions [first_pos, first_pos + T) (within the table width); thresholds
    [rows] (by request row), lowered by `margin` x their magnitude where finite (as `EchoPrefetcher.candidates`
    defines); caps as in `candidates_from_tiles` (a segment's share where the logits miss some of a request's
    positions). `pdl` (sm_90+): K1 launched plainly but releasing K2 at once, K2 and K3 with programmatic dependent
    launch. Returns int64 KV locations [B * width], most recent first per request, -1 padded."""
    B, Q, T = logits.shape
    if logits.stride(-1) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("prefetch_candidates_triton wants logits and req_to_token rows contiguous")
    tc = new_tile_candidates(B, T, TILE, num_locations, logits.device)
    tiles = tc.counts.shape[1]
    if B and T:
        _count_kernel[(B, tiles)](logits, logits.stride(0), logits.stride(1), Q, T, int(first_pos), thresholds,
                                  float(margin),
                                  req_pool_indices, seq_lens, req_to_token, req_to_token.stride(0),
                                  req_to_token.shape[0], req_to_token.shape[1], loc_to_slot, num_locations, tc.counts,
                                  tc.kept, tiles, TILE=TILE, PDL=pdl)
    return candidates_from_tiles(tc, seq_lens, cap_fraction, cap_min_tokens, width, pdl, first_pos, T)


CLAIM_ROWS = 32  # kept candidates a claiming program takes at a time (a tile keeps a few on average)


@triton.jit
def _claim_above_kernel(logits_ptr, l_stride_b, l_stride_q, Q, T, first_pos, thr_ptr, margin, rpi_ptr, seq_ptr,
                        r2t_ptr, r2t_stride, r2t_rows, r2t_width, num_locations, cap_fraction_ptr, cap_min, width,
                        l2s_ptr, s2l_ptr, stamp_ptr, clock_ptr, num_slots, spare_ptr, taken_ptr, num_spare,
                        src_ptr, dst_ptr, ctr_ptr, kept_ptr, B, tiles, TILE: tl.constexpr, KEEP: tl.constexpr,
                        ROWS: tl.constexpr):
    # one dimension, request-major: programs are dispatched (and run under the interpreter) in this order, so that
    # the shared rank mostly follows it: each request's candidates come out together in the fetch list, which keeps
    # the copy's host reads near each other (a request's entries are near each other in the host pool); x-fastest
    # dispatch of a (B, tiles) grid interleaved the requests, and the copy of 128 / 32K's first segment took 194 us
    # against 161 (H200, docs/design.md)
    me = tl.program_id(0).to(tl.int64)
    b = me // tiles
    p = me % tiles
    # the words a program with candidates reads after its scan, loaded before it (no program of the launch changes
    # them; the close launch moves the spare slots taken): their latency overlaps the logits' instead of adding to
    # the program's chain of dependent loads and atomics (128K / 64: 3-11 us a layer less, 32K / 64: 2-4; H200,
    # 2026-12-01; docs/design.md, "Prefetch")
    taken = tl.load(taken_ptr)
    stamp = tl.load(clock_ptr) - 1  # the newest entries, yet evictable in this step (a prefetch protects nothing)
    cap = _segment_cap(seq_ptr, b, cap_fraction_ptr, cap_min, width, first_pos, T)
    # the request's most recent tile first: in program order (the interpreter's, and roughly a GPU's) each request's
    # candidates are then ranked most recent first, which is the order the cap keeps
    loc, cand = _tile_candidates(logits_ptr, l_stride_b, l_stride_q, Q, T, first_pos, thr_ptr, margin, rpi_ptr,
                                 seq_ptr, r2t_ptr, r2t_stride, r2t_rows, r2t_width, l2s_ptr, num_locations, b,
                                 tiles - 1 - p, TILE)
    c = cand.to(tl.int32)
    n_cand = tl.sum(c)
    if n_cand > 0:
        # the cap: the request's candidates ranked before this tile's are those of the programs that counted first
        before = tl.atomic_add(ctr_ptr + b, n_cand, sem="relaxed").to(tl.int64)
        rank = (n_cand - tl.cumsum(c, 0)).to(tl.int64)  # 0: the tile's most recent candidate
        keep = cand & (before + rank < cap)
        n_keep = tl.sum(keep.to(tl.int32))
        # the kept ones, most recent first, at the front of this program's scratch row; read back (by other threads
        # of the program) once every thread has stored its own
        tl.store(kept_ptr + me * KEEP + rank, loc.to(tl.int32), mask=keep)
        tl.debug_barrier()
        avail = num_spare - taken
        # (no spare slot left: every claim would be given back, so none is made)
        for j0 in range(0, tl.where(avail > 0, n_keep, 0), ROWS):
            j = j0 + tl.arange(0, ROWS)
            mj = j < n_keep
            own = kept_ptr + me * KEEP + j  # (a lane past the kept ones compares its own scratch word: no change
            # that anything reads, and no two lanes on one address)
            lj = tl.load(own, mask=mj, other=0).to(tl.int64)
            # claim: absent (-1) -> num_slots, which no reader takes for a slot; another program's claim of the same
            # location (a duplicate) wins, and this one is not prefetched
            old = tl.atomic_cas(tl.where(mj, l2s_ptr + lj, own), tl.where(mj, -1, _NEVER).to(tl.int32),
                                (tl.zeros((ROWS,), tl.int64) + num_slots).to(tl.int32), sem="relaxed")
            win = mj & (old == -1)
            w32 = win.to(tl.int32)
            n_win = tl.sum(w32)
            if n_win > 0:
                r = (tl.atomic_add(ctr_ptr + B, n_win, sem="relaxed") + tl.cumsum(w32, 0) - 1).to(tl.int64)
                spare = win & (r < avail)  # the first `avail` winners take the spare slots, in rank order
                v = tl.load(spare_ptr + taken + r, mask=spare, other=0).to(tl.int64)
                tl.store(s2l_ptr + v, lj.to(tl.int32), mask=spare)
                tl.store(stamp_ptr + v, tl.zeros_like(v) + stamp, mask=spare)
                tl.store(l2s_ptr + lj, tl.where(spare, v, -1).to(tl.int32), mask=win)  # no slot: the claim goes back
                tl.store(src_ptr + r, lj, mask=spare)
                tl.store(dst_ptr + r, v, mask=spare)


@triton.jit
def _claim_close_kernel(ctr_ptr, B, taken_ptr, num_spare, count_ptr, cnt_ptr, C_FETCH_A: tl.constexpr,
                        C_FETCH_B: tl.constexpr, ZERO: tl.constexpr):
    # one program after the claim launch: the list's count (its spare-slot winners), the spare slots taken, the fetch
    # counters, and the claim counters back to zero for the next launch. (The claim's last program did this before,
    # found by a counter every program incremented with acq_rel: at 128K / 64 the claim kernel is now 13-14% shorter,
    # 8-9% counting this launch: H200, 2026-12-01; docs/design.md, "Prefetch")
    total = tl.load(ctr_ptr + B).to(tl.int64)
    taken = tl.load(taken_ptr)
    listed = tl.minimum(total, tl.maximum(num_spare - taken, 0))
    tl.store(count_ptr, listed)
    tl.store(taken_ptr, taken + listed)
    tl.atomic_add(cnt_ptr + C_FETCH_A, listed, sem="relaxed")  # (atomic: the main stream's resolve adds to the row)
    tl.atomic_add(cnt_ptr + C_FETCH_B, listed, sem="relaxed")
    for z0 in range(0, B + 1, ZERO):
        z = z0 + tl.arange(0, ZERO)
        tl.store(ctr_ptr + z, tl.zeros((ZERO,), tl.int32), mask=z < B + 1)


def new_claim_counters(max_batch: int, device: torch.device | str) -> torch.Tensor:
    """The zeroed counters `claim_above_triton` needs for batches of up to `max_batch` requests (each launch leaves
    them zero again). Launches that may run at once (on two streams) need counters of their own."""
    return torch.zeros(max_batch + 1, dtype=torch.int32, device=device)


def check_claim_counters(claim_counters: torch.Tensor, batch: int) -> None:
    """`claim_counters` fit a launch over `batch` requests (`new_claim_counters`), or a ValueError that says why."""
    if claim_counters.dtype != torch.int32 or claim_counters.dim() != 1 or claim_counters.numel() < batch + 1:
        raise ValueError(f"claim_above_triton wants int32 claim counters for {batch} requests (new_claim_counters: "
                         f"{batch + 1} words), got {claim_counters.dtype} x {tuple(claim_counters.shape)}")


def claim_above_triton(logits: torch.Tensor, thresholds: torch.Tensor, margin: float, req_to_token: torch.Tensor,
                       req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, first_pos: int,
                       cap_fraction: torch.Tensor, cap_min_tokens: int, width: int, *, num_locations: int,
                       loc_to_slot: torch.Tensor, slot_to_loc: torch.Tensor, slot_stamp: torch.Tensor,
                       clock: torch.Tensor, num_slots: int, spare: torch.Tensor, spare_taken: torch.Tensor,
                       num_spare: int, fetch_src: torch.Tensor, fetch_dst: torch.Tensor, fetch_count: torch.Tensor,
                       counters: torch.Tensor, fetch_counter_ids: tuple[int, int],
                       claim_counters: torch.Tensor) -> None:
    """ECHO candidates and their spare-slot claims in one launch (and a one-program close): what
    `prefetch_candidates_triton` followed by a spare-only prefetch claim (`HotPoolCacheManager.prefetch` with spare
    slots: lookup, finish, close) does in six.

    One program per (request, tile of TILE positions) of logits [B, Q, T] (positions [first_pos, first_pos + T)),
    request-major. Each finds its candidates (as `_count_kernel` does), ranks them most recent first within the
    request through a per-request counter, and keeps those below the request's cap (`candidates_from_tiles`' rule);
    each kept one claims its location (compare-and-swap), and the winners take the layer's free spare slots (from
    spare_taken[0]) in the order of one shared counter: slot -> location, location -> slot, stamp clock - 1, and the
    pair (location, slot) into the fetch list at its rank; winners past the spare slots give their claim back (with
    none left, nothing is claimed). A one-program launch after it closes: fetch_count[0] (the pairs listed: only those
    are real, the rest of the list is left as it was), the fetch counters (`fetch_counter_ids` of `counters`, by the
    pairs listed), spare_taken, and `claim_counters` (`new_claim_counters`) zeroed for the next launch.

    Under TRITON_INTERPRET (programs in order) the state equals the six launches' where no two candidates share a
    location. On a GPU, where the cap binds, which candidates it keeps follows the order programs reach its counter
    (most recent tiles first, roughly), and which spare slot a winner takes may differ between runs; a prefetch only
    fills slots, so no output depends on either. A candidate whose location another program has already prefetched
    in this launch (two positions naming one location) is seen resident here and not counted against its cap."""
    B, Q, T = logits.shape
    if logits.stride(-1) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("claim_above_triton wants logits and req_to_token rows contiguous")
    check_claim_counters(claim_counters, B)
    if any(t.dtype != torch.int64 for t in (fetch_src, fetch_dst, fetch_count)):
        raise ValueError("claim_above_triton wants an int64 fetch list (HotPoolCacheManager.new_fetch_list)")
    if num_locations >= 1 << 31:
        raise ValueError(f"claim_above_triton keeps locations as int32: {num_locations} locations is too many")
    if cap_fraction.dtype != torch.float64 or cap_fraction.numel() != 1:
        raise ValueError("claim_above_triton wants cap_fraction as a float64 tensor of one element")
    if fetch_src.numel() < B * width or fetch_dst.numel() < B * width:
        raise ValueError(f"claim_above_triton: the fetch list holds {fetch_src.numel()} pairs, {B} rows of "
                         f"{width} candidates need {B * width}")
    tiles = triton.cdiv(T, TILE)
    if B == 0 or tiles == 0:
        fetch_count.zero_()
        return
    # a program's kept candidates (at most its cap, at most a tile), rounded to whole claim rows: a lane past them
    # compares its own word of this row
    keep = max(CLAIM_ROWS, min(TILE, triton.next_power_of_2(max(width, 1))))
    assert keep % CLAIM_ROWS == 0
    kept = torch.empty(B * tiles * keep, dtype=torch.int32, device=logits.device)  # per program, read back by it
    _claim_above_kernel[(B * tiles,)](
        logits, logits.stride(0), logits.stride(1), Q, T, int(first_pos), thresholds, float(margin), req_pool_indices,
        seq_lens, req_to_token, req_to_token.stride(0), req_to_token.shape[0], req_to_token.shape[1], num_locations,
        cap_fraction, int(cap_min_tokens), int(width), loc_to_slot, slot_to_loc, slot_stamp, clock, int(num_slots),
        spare, spare_taken, int(num_spare), fetch_src, fetch_dst, claim_counters, kept, B, tiles, TILE=TILE,
        KEEP=keep, ROWS=CLAIM_ROWS)
    _claim_close_kernel[(1,)](claim_counters, B, spare_taken, int(num_spare), fetch_count, counters,
                              C_FETCH_A=int(fetch_counter_ids[0]), C_FETCH_B=int(fetch_counter_ids[1]), ZERO=128)


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
        useful = got & (owner == tl.load(src_ptr + i, mask=got, other=-2)) & (last_step(stamp) == tl.load(clock_ptr))
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
