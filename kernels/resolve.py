"""Fused Triton kernels for one layer's resolve: lookup, protect, dedup, evict LRU, assign, fetch, slot table.

The plain-torch definition is `HotPoolCacheManager` with `resolve_impl="torch"` (ess_sglang/cache_manager.py): these
kernels compute the same maps, counters and slot table. Five launches, each over the selection
(n entries) or the layer's slots (S), with every count kept on the device:

    K1 lookup     entry -> KV location (bounds-checked through the request's own row), slot = loc_to_slot[loc];
                  a hit stamps its slot with the clock (protected this step); a miss claims its location with
                  atomic_max(S + n - i), so the first entry naming a location wins
    K2 misses     the winners are compacted into a miss list (block counts reserved with one atomic each);
      + ages      other programs of the same launch histogram the slots' ages (clock - stamp, clamped)
    K3 victims    from the histogram: the age threshold T below which nothing is taken; every slot older than T,
                  then slots of age exactly T, are written to the victim list (age 0 = protected, never taken)
    K4 assign     victim j gets miss j: evict its old token, map both ways, stamp, write the slot table entry,
                  and copy the entry host -> hot slot (the FlashTrans gather, fused); a fixed grid of persistent
                  programs walks the misses only (their count is on the device)
    K5 finish     entries that named a location another entry won read the winner's slot

Under TRITON_INTERPRET programs run in order, so the miss and victim lists come out in the same order as the torch
version and the whole state is bit-identical to it (the CPU tests check this). On a GPU, blocks reserve list ranges
in whatever order they reach the atomics: which of several equally old slots are evicted, and which slot a miss
gets, may differ between runs; the set of resident entries and the slot table's contents (the entries named) do not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ess_sglang.kernels.flashtrans import NUM_WARPS, ROWS_PER_PROGRAM, _copy_masked
from ess_sglang.kernels.translate import block_for, position_to_location

ROWS = ROWS_PER_PROGRAM  # misses assigned (and copied) per program of the assign kernel
AGE_BUCKETS = 256
SCR_MISS, SCR_ABOVE, SCR_AT, SCR_HIST = 0, 1, 2, 8
SCR_SIZE = 512  # a power of two >= SCR_HIST + AGE_BUCKETS, so that K5 can clear it with one block
MODE_POSITIONS, MODE_LOCATIONS = 0, 1


@triton.jit
def _lookup_kernel(src_ptr, seq_ptr, rpi_ptr, r2t_ptr, r2t_stride, r2t_rows, width, n, per_batch,
                   l2s_ptr, stamp_ptr, clock_ptr, out_ptr, loc_ptr, cnt_ptr, num_locations, num_slots,
                   MODE: tl.constexpr, COUNT: tl.constexpr, PROTECT: tl.constexpr, C_LOOKUPS: tl.constexpr,
                   C_HITS: tl.constexpr, C_BAD: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    if MODE == 0:  # positions within each request, translated through its own row of the request table
        pos, loc, valid, ok = position_to_location(src_ptr, seq_ptr, rpi_ptr, r2t_ptr, r2t_stride, r2t_rows, width,
                                                   per_batch, num_locations, i, m)
        bad = m & (((pos != -1) & ~valid) | (valid & ~ok))
    else:  # KV locations given directly (new tokens, warm-up)
        loc = tl.load(src_ptr + i, mask=m, other=-1).to(tl.int64)
        ok = m & (loc >= 0) & (loc < num_locations)
        bad = m & (loc != -1) & ~ok
    cur = tl.load(l2s_ptr + loc, mask=ok, other=-1)
    hit = ok & (cur >= 0) & (cur < num_slots)
    if PROTECT:  # a prefetch (PROTECT false) leaves the recency of what it finds resident alone
        clock = tl.load(clock_ptr)
        tl.store(stamp_ptr + cur, tl.zeros_like(cur).to(tl.int64) + clock, mask=hit)
    miss = ok & ~hit
    claim = (num_slots + n - i).to(tl.int32)
    tl.atomic_max(l2s_ptr + loc, claim, mask=miss, sem="relaxed")
    tl.store(out_ptr + i, tl.where(hit, cur, -1), mask=m)
    tl.store(loc_ptr + i, tl.where(ok, loc, -1), mask=m)
    if COUNT:
        tl.atomic_add(cnt_ptr + C_LOOKUPS, tl.sum(ok.to(tl.int64)), sem="relaxed")
        tl.atomic_add(cnt_ptr + C_HITS, tl.sum(hit.to(tl.int64)), sem="relaxed")
        tl.atomic_add(cnt_ptr + C_BAD, tl.sum(bad.to(tl.int64)), sem="relaxed")


@triton.jit
def _age(stamp_ptr, s, ms, clock, A: tl.constexpr):
    stamp = tl.load(stamp_ptr + s, mask=ms, other=0)
    return tl.minimum(tl.maximum(clock - stamp, 0), A - 1).to(tl.int32)


@triton.jit
def _misses_and_ages_kernel(loc_ptr, out_ptr, l2s_ptr, stamp_ptr, clock_ptr, scr_ptr, miss_loc_ptr, miss_idx_ptr,
                            n, num_slots, entry_blocks, A: tl.constexpr, BLOCK: tl.constexpr,
                            SBLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid < entry_blocks:
        i = pid * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        loc = tl.load(loc_ptr + i, mask=m, other=-1)
        out = tl.load(out_ptr + i, mask=m, other=0)
        miss = m & (loc >= 0) & (out < 0)
        cur = tl.load(l2s_ptr + loc, mask=miss, other=0)
        rep = miss & (cur == (num_slots + n - i).to(tl.int32))
        rep32 = rep.to(tl.int32)
        base = tl.atomic_add(scr_ptr + 0, tl.sum(rep32), sem="relaxed")
        at = base + tl.cumsum(rep32, 0) - 1
        tl.store(miss_loc_ptr + at, loc, mask=rep)
        tl.store(miss_idx_ptr + at, i.to(tl.int32), mask=rep)
    else:
        s = (pid - entry_blocks) * SBLOCK + tl.arange(0, SBLOCK)
        ms = s < num_slots
        age = _age(stamp_ptr, s, ms, tl.load(clock_ptr), A)
        hist = tl.histogram(age, A, mask=ms)
        # only the ages this block holds: every program adding all 256 bins queues thousands of atomics per bin
        tl.atomic_add(scr_ptr + 8 + tl.arange(0, A), hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _victims_kernel(stamp_ptr, clock_ptr, scr_ptr, victims_ptr, num_slots, A: tl.constexpr, BLOCK: tl.constexpr):
    a = tl.arange(0, A)
    hist = tl.load(scr_ptr + 8 + a)
    n_miss = tl.load(scr_ptr + 0)
    at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist
    eligible = (at_or_above >= n_miss) & (a >= 1)
    T = tl.maximum(tl.max(tl.where(eligible, a, 0)), 1)
    n_above = tl.sum(tl.where(a == T + 1, at_or_above, 0))
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ms = (s < num_slots) & (n_miss > 0)  # no misses: no victims, and no stamp is read
    age = _age(stamp_ptr, s, ms, tl.load(clock_ptr), A)
    # most blocks hold no victim: they skip the list counters, on which every program would otherwise queue
    above = ms & (age > T)
    above32 = above.to(tl.int32)
    n_a = tl.sum(above32)
    if n_a > 0:
        ra = tl.atomic_add(scr_ptr + 1, n_a, sem="relaxed") + tl.cumsum(above32, 0) - 1
        tl.store(victims_ptr + ra, s + 1, mask=above & (ra < n_miss))
    at_t = ms & (age == T)
    at32 = at_t.to(tl.int32)
    n_t = tl.sum(at32)
    if n_t > 0:
        rt = tl.atomic_add(scr_ptr + 2, n_t, sem="relaxed") + tl.cumsum(at32, 0) - 1
        tl.store(victims_ptr + n_above + rt, s + 1, mask=at_t & (rt < n_miss - n_above))


@triton.jit
def _assign_kernel(scr_ptr, victims_ptr, miss_loc_ptr, miss_idx_ptr, l2s_ptr, s2l_ptr, stamp_ptr, clock_ptr,
                   out_ptr, cnt_ptr, src_ptr, dst_ptr, pend_src_ptr, pend_dst_ptr, pend_count_ptr, n,
                   COPY: tl.constexpr, PEND: tl.constexpr, WORDS: tl.constexpr, BLOCK_WORDS: tl.constexpr,
                   C_FETCH_A: tl.constexpr, C_FETCH_B: tl.constexpr, C_EVICT: tl.constexpr, C_OVERFLOW: tl.constexpr,
                   STAMP_BACK: tl.constexpr, ROWS: tl.constexpr, CLEAR: tl.constexpr):
    # Persistent: a fixed grid walks the n_miss misses ROWS at a time (the grid no longer grows with the selection,
    # of which the misses are a few percent)
    pid, programs = tl.program_id(0), tl.num_programs(0)
    n_miss = tl.load(scr_ptr + 0)
    # victims written by K3: every slot older than T (scr[1] of them), then up to n_miss - scr[1] of age T (scr[2])
    n_victims = tl.minimum(n_miss, tl.load(scr_ptr + 1) + tl.load(scr_ptr + 2))
    n_assign = tl.minimum(n_miss, n)
    if PEND:  # the fetch list of a deferred copy: (host location, slot) of each miss that got a slot, -1 elsewhere
        if pid == 0:
            tl.store(pend_count_ptr, n_assign.to(tl.int64))
        for c0 in range(pid * CLEAR, n, programs * CLEAR):
            c = c0 + tl.arange(0, CLEAR)
            rest = (c >= n_assign) & (c < n)
            tl.store(pend_src_ptr + c, tl.full(c.shape, -1, tl.int64), mask=rest)
            tl.store(pend_dst_ptr + c, tl.full(c.shape, -1, tl.int64), mask=rest)
    clock = tl.load(clock_ptr) - STAMP_BACK  # 1 for a prefetch: the newest, yet evictable in this step
    n_got = tl.zeros((), tl.int64)
    n_evict = tl.zeros((), tl.int64)
    n_over = tl.zeros((), tl.int64)
    for j0 in range(pid * ROWS, n_assign, programs * ROWS):
        j = j0 + tl.arange(0, ROWS)
        mj = j < n_assign
        v = tl.where(j < n_victims, tl.load(victims_ptr + j, mask=mj, other=0) - 1, -1).to(tl.int64)
        loc = tl.load(miss_loc_ptr + j, mask=mj, other=-1)
        i = tl.load(miss_idx_ptr + j, mask=mj, other=0)
        got = mj & (v >= 0)
        old = tl.load(s2l_ptr + v, mask=got, other=-1).to(tl.int64)
        evict = got & (old >= 0)
        tl.store(l2s_ptr + old, tl.full(old.shape, -1, tl.int32), mask=evict)
        tl.store(s2l_ptr + v, loc.to(tl.int32), mask=got)
        tl.store(l2s_ptr + loc, tl.where(got, v, -1).to(tl.int32), mask=mj)  # overflow: the claim goes back to absent
        tl.store(stamp_ptr + v, tl.zeros_like(v) + clock, mask=got)
        tl.store(out_ptr + i, tl.where(got, v, -1).to(tl.int32), mask=mj)
        if PEND:
            tl.store(pend_src_ptr + j, tl.where(got, loc, -1), mask=mj)
            tl.store(pend_dst_ptr + j, tl.where(got, v, -1), mask=mj)
        n_got += tl.sum(got.to(tl.int64))
        n_evict += tl.sum(evict.to(tl.int64))
        n_over += tl.sum((mj & ~got).to(tl.int64))
        if COPY:  # the FlashTrans gather, fused: host entry of `loc` -> hot slot `v`
            _copy_masked(src_ptr, dst_ptr, loc, v, got, WORDS, WORDS, WORDS, BLOCK_WORDS)
    if n_got + n_over > 0:  # programs with no misses add nothing (and do not queue on the counters' atomics)
        if C_FETCH_A >= 0:
            tl.atomic_add(cnt_ptr + C_FETCH_A, n_got, sem="relaxed")
        if C_FETCH_B >= 0:
            tl.atomic_add(cnt_ptr + C_FETCH_B, n_got, sem="relaxed")
        tl.atomic_add(cnt_ptr + C_EVICT, n_evict, sem="relaxed")
        tl.atomic_add(cnt_ptr + C_OVERFLOW, n_over, sem="relaxed")


@triton.jit
def _finish_kernel(loc_ptr, out_ptr, l2s_ptr, scr_ptr, n, num_slots, SCR: tl.constexpr, BLOCK: tl.constexpr):
    if tl.program_id(0) == 0:  # the scratch counters and histogram are read for the last time in K4: clear them
        tl.store(scr_ptr + tl.arange(0, SCR), tl.zeros((SCR,), tl.int32))
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    loc = tl.load(loc_ptr + i, mask=m, other=-1)
    out = tl.load(out_ptr + i, mask=m, other=0)
    need = m & (loc >= 0) & (out < 0)
    cur = tl.load(l2s_ptr + loc, mask=need, other=-1)
    tl.store(out_ptr + i, tl.where((cur >= 0) & (cur < num_slots), cur, -1), mask=need)


class FusedResolver:
    """Scratch buffers and launches of the fused path for selections of up to `max_entries` entries."""

    def __init__(self, num_slots: int, max_entries: int, device: torch.device,
                 assign_programs: tuple[int, int] | None = None):
        self.num_slots = num_slots
        # persistent programs of the assign kernel (without, with the inline copy): 4 and 1 per SM, the best measured
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
        self.assign_programs = assign_programs or (4 * sms, sms)
        # Slots per program and warps of the two launches over the pool (age histogram, victim scan), the best of a
        # sweep over pools of 164K-3.4M slots at batch 64 (benchmarks/NOTES.md): small blocks, now that blocks
        # without ages or victims of their own skip the shared atomics
        self.age_block, self.age_warps = 1024, 4
        self.victim_block, self.victim_warps = 512, (4 if num_slots < 1 << 20 else 2)
        self.lookup_block = 256  # entries per program of the lookup (256: 5.2 us at batch 64, 1024: 6.5)
        self.max_entries = 0
        self.device = device
        self._grow(max(max_entries, 1))

    def _grow(self, n: int) -> None:
        """Size the scratch for n entries (never during graph capture: size it with max_entries up front)."""
        if n <= self.max_entries:
            return
        d = self.device
        self.max_entries = n
        # counters and age histogram; zero between calls (K5 clears them after K4's last read)
        self.scratch = torch.zeros(SCR_SIZE, dtype=torch.int32, device=d)
        self.victims = torch.zeros(n, dtype=torch.int32, device=d)  # slot + 1, valid below the victim count
        self.miss_loc = torch.empty(n, dtype=torch.int64, device=d)
        self.miss_idx = torch.empty(n, dtype=torch.int32, device=d)
        self.locs = torch.empty(n, dtype=torch.int64, device=d)

    def run(self, *, src: torch.Tensor, mode: int, l2s: torch.Tensor, s2l: torch.Tensor, stamp: torch.Tensor,
            clock: torch.Tensor, counters: torch.Tensor, count: bool, fetch_counters: tuple[int, int],
            counter_ids: dict[str, int], copy_from: torch.Tensor | None, hot: torch.Tensor | None,
            seq_lens: torch.Tensor | None = None, req_pool_indices: torch.Tensor | None = None,
            req_to_token: torch.Tensor | None = None, per_batch: int = 1,
            fetch_list: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            protect: bool = True) -> torch.Tensor:
        """Resolve the flat list `src` (positions in MODE_POSITIONS, KV locations in MODE_LOCATIONS); returns the
        int32 slot of each entry (-1 where padding, bad, or overflowed).

        `fetch_list`: (src, dst, count) int64 tensors, src and dst of at least n elements; when given, the assign
        kernel records (host location, slot) of every newly assigned miss in their first n elements (-1 elsewhere),
        misses first, and their number in count[0], whether or not it copies."""
        n = src.numel()
        self._grow(n)
        S = self.num_slots
        out = torch.empty(n, dtype=torch.int32, device=src.device)
        if n == 0:
            return out
        if mode == MODE_POSITIONS:
            r2t, r2t_stride, width = req_to_token, req_to_token.stride(0), req_to_token.shape[1]
            r2t_rows = req_to_token.shape[0]
            seq, rpi = seq_lens, req_pool_indices
        else:
            r2t, r2t_stride, r2t_rows, width, seq, rpi = src, 0, 0, 0, src, src
        # entries per program: 256 at batch 1-16, up to 1024 at batch 64-128 (the best measured)
        block = block_for(n, 256, 1024, 128)
        entry_blocks = triton.cdiv(n, block)
        _lookup_kernel[(triton.cdiv(n, self.lookup_block),)](
            src, seq, rpi, r2t, r2t_stride, r2t_rows, width, n, per_batch, l2s, stamp, clock, out, self.locs, counters,
            l2s.shape[0] - 1, S, MODE=mode, COUNT=count, PROTECT=protect, C_LOOKUPS=counter_ids["LOOKUPS"],
            C_HITS=counter_ids["HITS"], C_BAD=counter_ids["BAD_INDICES"], BLOCK=self.lookup_block)
        _misses_and_ages_kernel[(entry_blocks + triton.cdiv(S, self.age_block),)](
            self.locs, out, l2s, stamp, clock, self.scratch, self.miss_loc, self.miss_idx, n, S, entry_blocks,
            A=AGE_BUCKETS, BLOCK=block, SBLOCK=self.age_block, num_warps=self.age_warps)
        _victims_kernel[(triton.cdiv(S, self.victim_block),)](stamp, clock, self.scratch, self.victims, S,
                                                              A=AGE_BUCKETS, BLOCK=self.victim_block,
                                                              num_warps=self.victim_warps)
        copy = copy_from is not None
        words = (copy_from.shape[1] // 4) if copy else 4
        src_w = copy_from.view(torch.int32) if copy else self.scratch
        dst_w = hot.view(torch.int32) if copy else self.scratch
        pend = fetch_list is not None
        pend_src, pend_dst, pend_count = fetch_list if pend else (self.miss_loc, self.miss_loc, self.miss_loc)
        # the inline copy is fastest with one program per SM, the bookkeeping alone with four (benchmarks/NOTES.md)
        programs = self.assign_programs[1 if copy else 0]
        _assign_kernel[(min(triton.cdiv(n, ROWS), programs),)](
            self.scratch, self.victims, self.miss_loc, self.miss_idx, l2s, s2l, stamp, clock, out, counters,
            src_w, dst_w, pend_src, pend_dst, pend_count, n, COPY=copy, PEND=pend, WORDS=words,
            BLOCK_WORDS=triton.next_power_of_2(words),
            C_FETCH_A=fetch_counters[0], C_FETCH_B=fetch_counters[1], C_EVICT=counter_ids["EVICTIONS"],
            C_OVERFLOW=counter_ids["OVERFLOW"], STAMP_BACK=0 if protect else 1, ROWS=ROWS, CLEAR=block,
            num_warps=NUM_WARPS)
        _finish_kernel[(entry_blocks,)](self.locs, out, l2s, self.scratch, n, S, SCR=SCR_SIZE,
                                        BLOCK=block)
        return out
