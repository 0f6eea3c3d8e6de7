"""Fused Triton kernels for one layer's resolve: lookup, protect, dedup, take spare or LRU slots, fetch, slot table.

The plain-torch definition is `HotPoolCacheManager` with `resolve_impl="torch"` (ess_sglang/cache_manager.py): these
kernels compute the same maps, counters and slot table. A resolve is five launches over the selection (n entries)
or the layer's slots (S), with every count kept on the device (three with spare slots, and without them for one or
two requests: K2-K4 are then one launch, below):

    K1 lookup     entry -> KV location (bounds-checked through the request's own row; a padding entry, request
                  row -1, is ignored), slot = loc_to_slot[loc];
                  a hit stamps its slot with the clock (protected this step); a miss claims its absent location
                  (compare-and-swap -1 -> num_slots + its index: the first entry naming a location wins, the others
                  read the winner's slot in K5); the winners are ranked (one atomic per block); the first `avail`
                  ranks take the layer's spare slots (free slots set aside beforehand, `refill` below): slot -> token,
                  the slot table (as -2 - slot until K5), and the (location, slot) pair for the copy; later winners
                  go to the overflow list. The token -> slot map keeps the claim until K5, so that a later block sees
                  a duplicate as a miss, as the torch definition does, and a spare slot keeps its stamp (age 0) until
                  K5, so that K3 never takes it. With a copy, each program then copies its own spare-slot winners
                  ranked below `lookup_copy_cap` (1,024) host -> hot slot (the FlashTrans gather, fused): those
                  copies are in flight while other programs still look up, instead of starting after K1-K3
    K2 ages       only when the overflow list is not empty: the slots' ages (clock - stamp, clamped) histogrammed
    K3 victims    from the histogram: the age threshold T below which nothing is taken; every slot older than T,
                  then slots of age exactly T, are written to the victim list (age 0 = protected, never taken; spare
                  slots are stamped in the future, so they have age 0 too)
    K4 assign     overflow winner j gets victim j: evict its old token, map both ways, stamp, slot table, and is
                  copied host -> hot slot (the FlashTrans gather, fused), as are the spare-slot winners K1 left (ranks
                  from the cap on); or, for a deferred copy, every winner is listed in rank order in the fetch list;
                  a fixed grid of persistent programs walks the winners only (their count is on the device)
    K5 finish     spare-slot winners: token -> slot, stamp, slot table; entries that named a location another entry
                  won read the winner's slot (from the map, or through the claim from the winner's table entry);
                  the spare count moves; with a table offset (`run(table_offset=)`), every entry's slot + offset
                  into a table of its own (an engine's row numbers); with new tokens (`run(new_tokens=)`), programs
                  of its own first write this step's tokens back: host row, and the token's slot where it has one
                  (selected or merely resident), over whatever K1 / K4 copied there from the not yet written host
                  row (the SGLang plugin: the token's entry exists only just before the resolve)

With `insert_locs` (the SGLang plugin's `new_tokens: insert`), K1 runs over the selection plus one entry per batch
entry, this step's token: those claim slots as misses do (spare, else K4's victims) but are not copied (K5's
write-back fills the slot) nor counted as lookups or fetches; a selected entry naming its own batch entry's token
does not claim it and reads the token's slot in K5, as entries that lost a claim do, counted as a hit.

With `decay` (`decay_retention`) the stamps carry a decayed-count bonus above BONUS_SHIFT: K1 restamps a hit with
the bonus its age bucket gives (`_stamp_selected`), and K2/K3 bucket by `stamp_age`; everything else is unchanged.

With `pdl` (programmatic dependent launch, sm_90+: `HotPoolCacheManager(resolve_pdl=...)`, on by default there) K2-K5
(with spare slots: the merged tail and K5) are launched with the PDL attribute and begin with
`griddepcontrol.wait` then `launch_dependents` (`_pdl_enter`); K1 is launched plainly (after the top-k and the
stream joins) but releases the next kernel the same way. Each kernel's programs are then
scheduled while the one before runs, and the launch gaps overlap work; the order of every read and write is the
same (a kernel waits for the whole previous grid and its writes before it reads anything).

A prefetch with spare slots (`spare_only`) takes spare slots only: K1 lists its spare-slot winners in the fetch list
itself, K2-K4 are not launched, and K5 gives overflowed claims back (those entries are not prefetched; the exact
resolve fetches them if selected) and clears the rest of the fetch list; a one-program launch then moves the counts.
Three launches instead of five beside the indexer and the top-k, none of them over the pool.

With spare slots, K2-K4 are one launch (`_tail_kernel`, over `FusedResolver.tail_programs` programs, all resident at
once): its programs build the histogram, wait for one another (a counter in the scratch), list the victims, wait
again and walk the winners; where no victims are needed (every program reads that alike from K1's counts) they skip
straight to the walk. On the H200 at batch 64 (2026-12-01; docs/design.md, "Resolve") the one launch ran
1.8-5.0 us a layer faster than the three at 32K, and from 11.9 faster to 7.1 slower at 128K. The grid-wide waits
assume every program of the tail is resident at once (2 x SMs programs of 2 warps, or the assign walk's, up to 4 x
SMs): true on a whole GPU, not guaranteed where the GPU is shared by SM limits (MPS), which this does not check;
`tail_programs = None` there gives the three launches.

Without spare slots, a resolve of at most `MERGED_TAIL_MAX_ENTRIES` entries (one or two requests at top-k 2048, with
their tokens) runs the merged tail too, scanning the pool inside it: over a 101,696-slot pool with each request's
token inserted (the SGLang plugin at one and two 32K requests) the resolve took 9.1 / 9.3 us against 10.3 / 10.5 with
the three launches; at batch 16 and 48 over pools of 1.25 selections the merged tail was 3.5-5.4 us slower (H100,
2026-12-07; docs/design.md, "Resolve"). Larger resolves without spare slots keep the three launches.

With no spare slots (the default) every winner overflows and the resolve is the plain LRU one. With enough of them,
the tail finds no victims to list and no winners to walk, and returns at once: the two pool scans run instead in
`refill`, off the critical path (the decode stack queues it beside attention), in every step or, with a refill
interval K, in every K-th step of a layer (the layers in turn) and whenever fewer than 1/K of its spare slots are
left; a refill that is not due returns at once:

    R2 ages, R3 victims (as K2, K3, for the number of spare slots taken since the last refill), R4: evict each victim
    (its token's map entry cleared, the eviction counted), mark it spare, put it back in the spare list; R5 the
    counts (K5 with no entries).

Under TRITON_INTERPRET programs run in order (and a compare-and-swap over a block in element order), so the miss,
spare and victim lists come out in the same order as the torch version and the whole state is bit-identical to it
(the CPU tests check this). On a GPU, blocks reserve list ranges in whatever order they reach the atomics: which of
several equally old slots are evicted, which slot a miss gets, and which of several entries naming one location
claims it, may differ between runs; the set of resident entries and the slot table's contents (the entries named)
do not.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from ess_sglang.kernels.flashtrans import NUM_WARPS, ROWS_PER_PROGRAM, _copy_masked, interpreting
from ess_sglang.kernels.new_tokens import _store_entries
from ess_sglang.kernels.translate import block_for, position_to_location

ROWS = ROWS_PER_PROGRAM  # misses assigned (and copied, those K1 does not copy) per program of the assign kernel
LOOKUP_COPY_ROWS = 16  # spare-slot winners a lookup program copies at a time (few: most programs have none)
# Misses (by rank) the lookup copies itself; K4 copies the rest. Few misses (after a prefetch) are then in flight while
# the lookup runs; many (a resolve with no prefetch) would put all of them in flight at once: without the cap, sync
# with spare slots ran 14-31 us a layer slower on the H200 than K4's persistent walk (2026-11-30;
# docs/design.md, "Resolve")
LOOKUP_COPY_CAP = 1024
# A resolve without spare slots runs its scans and assign walk as the merged tail up to this many entries, the three
# launches above it (see the module docstring: faster at batch 1-2, slower at 16-48)
MERGED_TAIL_MAX_ENTRIES = 4608
NEW_TOKEN_ROWS = 4  # this step's tokens a write-back program of the finish kernel stores (one per request)
AGE_BUCKETS = 256
# scratch words: winners (misses) of the call, victims found older than T and at T, the age histogram
SCR_MISS, SCR_ABOVE, SCR_AT, SCR_HIST = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(8)
# the merged tail's grid-wide waits (`_tail_kernel`): programs arrived after the histogram, after the victim list
SCR_BAR_AGES, SCR_BAR_VICTIMS = tl.constexpr(3), tl.constexpr(4)
SCR_SIZE = 512  # a power of two >= SCR_HIST + AGE_BUCKETS, so that K5 can clear it with one block
MODE_POSITIONS, MODE_LOCATIONS = 0, 1
SPARE_STAMP = 1 << 40  # the stamp of a spare slot: in the future, so its age clamps to 0 (never an LRU victim)
_SPARE_STAMP = tl.constexpr(SPARE_STAMP)
# Decayed retention (`decay_retention`): a selected slot's stamp also carries, from this bit up, its bonus: how many
# 1/units steps its decayed selection count puts it ahead of its last selection. LRU stamps carry none.
BONUS_SHIFT = 48
_BONUS_SHIFT = tl.constexpr(BONUS_SHIFT)
_LAST_MASK = tl.constexpr((1 << BONUS_SHIFT) - 1)
# a compare value no map entry holds: the compare-and-swap of a lane that claims nothing fails
_NEVER = tl.constexpr(-(1 << 31))


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    """Programmatic dependent launch (sm_90+), first thing in a kernel compiled with PDL: wait until the previous
    kernel of the stream has finished and its writes are visible (a no-op where this launch did not ask for PDL),
    then let the next kernel launch: its programs are scheduled while this one runs, and wait here in turn, so the
    launch gap between the resolve's kernels overlaps their work. Waiting first keeps at most one launch ahead."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _victims_needed(scr_ptr, taken_ptr, num_spare, clock_ptr, phase, interval, REFILL: tl.constexpr):
    """Victims the LRU scan must find: a refill replaces the spare slots taken, when it is due (`refill_due`); a
    resolve needs one per winner the spare slots left did not cover."""
    taken = tl.load(taken_ptr)
    if REFILL:  # (fewer than num_spare / interval left, in int64: taken is; no product of two Python ints)
        due = ((tl.load(clock_ptr) + phase) % interval == 0) | ((num_spare - taken) * interval < num_spare)
        return tl.where(due, taken, 0)
    return tl.maximum(tl.load(scr_ptr + SCR_MISS).to(tl.int64) - (num_spare - taken), 0)


@triton.jit(do_not_specialize=("width", "n", "per_batch", "n_sel"))
def _lookup_kernel(src_ptr, seq_ptr, rpi_ptr, r2t_ptr, r2t_stride, r2t_rows, width, n, per_batch,
                   l2s_ptr, s2l_ptr, stamp_ptr, clock_ptr, out_ptr, loc_ptr, cnt_ptr, scr_ptr, over_loc_ptr,
                   over_idx_ptr, spare_ptr, taken_ptr, num_spare, took_loc_ptr, took_slot_ptr, num_locations,
                   num_slots, host_ptr, hot_ptr, copy_cap, MODE: tl.constexpr, COUNT: tl.constexpr,
                   PROTECT: tl.constexpr, LIST: tl.constexpr, SPARE_ONLY: tl.constexpr,
                   C_LOOKUPS: tl.constexpr, C_HITS: tl.constexpr, C_BAD: tl.constexpr, C_FETCH_A: tl.constexpr,
                   C_FETCH_B: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, COPY: tl.constexpr = False,
                   WORDS: tl.constexpr = 4, BLOCK_WORDS: tl.constexpr = 4, COPY_ROWS: tl.constexpr = 16,
                   ins_ptr=None, n_sel=0, INSERT: tl.constexpr = False, C_NEW: tl.constexpr = -1,
                   bonus_ptr=None, A: tl.constexpr = 256, UNITS: tl.constexpr = 1, OFFSET: tl.constexpr = 0):
    _pdl_enter(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    sel = m
    if INSERT:  # entries from n_sel on are this step's tokens (`insert`), one per batch entry, at ins_ptr
        sel = m & (i < n_sel)
    if MODE == 0:  # positions within each request, translated through its own row of the request table
        pos, loc, valid, ok = position_to_location(src_ptr, seq_ptr, rpi_ptr, r2t_ptr, r2t_stride, r2t_rows, width,
                                                   per_batch, num_locations, i, sel)
        bad = sel & (((pos != -1) & ~valid) | (valid & ~ok))
    else:  # KV locations given directly (new tokens, warm-up, prefetch)
        loc = tl.load(src_ptr + i, mask=sel, other=-1).to(tl.int64)
        ok = sel & (loc >= 0) & (loc < num_locations)
        bad = sel & (loc != -1) & ~ok
    fresh = m & ~sel  # (all false without INSERT)
    newest = fresh
    if INSERT:
        # a selected entry naming its own request's token does not claim it: the token's entry (`fresh`) does, and
        # K5 reads the slot from there, as for any entry whose location another entry won; the selection finds it
        # resident, as it would had the token been inserted before the resolve
        own_token = tl.load(ins_ptr + i // per_batch, mask=sel, other=-1).to(tl.int64)
        newest = ok & (loc == own_token)
        ins = tl.load(ins_ptr + (i - n_sel), mask=fresh, other=-1).to(tl.int64)
        loc = tl.where(fresh, ins, loc)
        fresh = fresh & (ins >= 0) & (ins < num_locations)
    looked = ok  # counted as lookups: the selection's entries
    ok = (ok & ~newest) | fresh
    cur = tl.load(l2s_ptr + loc, mask=ok, other=-1)
    hit = ok & (cur >= 0) & (cur < num_slots)
    clock = tl.load(clock_ptr)
    if PROTECT:  # a prefetch (PROTECT false) leaves the recency of what it finds resident alone
        _stamp_selected(stamp_ptr, cur, hit, clock, bonus_ptr, A, UNITS, OFFSET)
    miss = ok & ~hit
    if INSERT:  # (its loc, for K5's read of the token's slot)
        ok = ok | newest
    tl.store(loc_ptr + i, tl.where(ok, loc, -1), mask=m)
    slot = tl.where(hit, cur, -1).to(tl.int64)
    if tl.sum(miss.to(tl.int32)) > 0:
        # claim: compare-and-swap absent (-1) -> num_slots + i (which no reader takes for a slot); it has no mask, so
        # a lane that claims nothing compares its own slot-table entry (written below) against a value no entry
        # holds: distinct addresses, nothing changed
        own = out_ptr + tl.where(m, i, 0)
        old = tl.atomic_cas(tl.where(miss, l2s_ptr + loc, own), tl.where(miss, -1, _NEVER).to(tl.int32),
                            (num_slots + i).to(tl.int32), sem="relaxed")
        win = miss & (old == -1)
        win32 = win.to(tl.int32)
        n_win = tl.sum(win32)
        if n_win > 0:
            base = tl.atomic_add(scr_ptr + SCR_MISS, n_win, sem="relaxed")
            r = (base + tl.cumsum(win32, 0) - 1).to(tl.int64)  # the winner's rank among this call's misses
            taken = tl.load(taken_ptr)
            avail = num_spare - taken
            spare = win & (r < avail)  # a prefix of the block's winners (ranks grow along the block)
            v = tl.load(spare_ptr + taken + r, mask=spare, other=0).to(tl.int64)
            tl.store(s2l_ptr + v, loc.to(tl.int32), mask=spare)
            slot = tl.where(spare, -2 - v, slot)  # K5: the map, the stamp, the slot
            fetched = spare & ~fresh  # (a token's slot is written by K5's write-back, not copied)
            if not SPARE_ONLY:  # (spare only: K5 gives the overflow's claims back)
                over = win & ~spare
                tl.store(over_loc_ptr + (r - avail), loc, mask=over)
                tl.store(over_idx_ptr + (r - avail), i.to(tl.int32), mask=over)
            if LIST:  # K4 lists every winner in rank order for a deferred copy (and copies the overflow); spare
                # only: the fetch list itself (took_* are then its src and dst)
                tl.store(took_loc_ptr + r, tl.where(fresh, -1, loc), mask=spare)
                tl.store(took_slot_ptr + r, tl.where(fresh, -1, v), mask=spare)
            n_spare = tl.sum(spare.to(tl.int64))
            n_fetch = tl.sum(fetched.to(tl.int64))
            if COPY:  # the FlashTrans gather of this program's spare-slot winners ranked below `copy_cap`, fused
                # here rather than in K4: their copies are in flight while other programs still look up. Their ranks
                # are one run from `base`; each row is read back from took_* once every thread of the program has
                # stored its own
                tl.debug_barrier()
                first_rank = base.to(tl.int64)
                end = tl.minimum(first_rank + n_spare, copy_cap)
                for r0 in range(first_rank, end, COPY_ROWS):
                    rr = r0 + tl.arange(0, COPY_ROWS)
                    mine = rr < end
                    s = tl.load(took_loc_ptr + rr, mask=mine, other=-1)
                    d = tl.load(took_slot_ptr + rr, mask=mine, other=-1)
                    _copy_masked(host_ptr, hot_ptr, s, d, mine & (s >= 0), WORDS, WORDS, WORDS, BLOCK_WORDS)
            if n_fetch > 0:
                if C_FETCH_A >= 0:
                    tl.atomic_add(cnt_ptr + C_FETCH_A, n_fetch, sem="relaxed")
                if C_FETCH_B >= 0:
                    tl.atomic_add(cnt_ptr + C_FETCH_B, n_fetch, sem="relaxed")
            if INSERT and C_NEW >= 0 and n_spare > n_fetch:
                tl.atomic_add(cnt_ptr + C_NEW, n_spare - n_fetch, sem="relaxed")
    tl.store(out_ptr + i, slot.to(tl.int32), mask=m)
    if COUNT:
        tl.atomic_add(cnt_ptr + C_LOOKUPS, tl.sum(looked.to(tl.int64)), sem="relaxed")
        tl.atomic_add(cnt_ptr + C_HITS, tl.sum((hit & sel).to(tl.int64) + newest.to(tl.int64)), sem="relaxed")
        tl.atomic_add(cnt_ptr + C_BAD, tl.sum(bad.to(tl.int64)), sem="relaxed")


@triton.jit
def last_step(stamp):
    """The step in which a slot was last selected or filled: its stamp less the decay bonus (a free slot's stamp is
    negative and carries none)."""
    return tl.where(stamp < 0, stamp, stamp & _LAST_MASK)


@triton.jit
def stamp_age(stamp, clock, A: tl.constexpr, UNITS: tl.constexpr, OFFSET: tl.constexpr):
    """The eviction age bucket of a stamp, 0 (selected this step, or spare: never taken) to A - 1 (the oldest, free
    slots among them). LRU (UNITS 1, OFFSET 0): clock - stamp, clamped. Decayed retention: UNITS x (clock - the last
    step) - the bonus + OFFSET, clamped to [1, A - 1], so that older and less often selected slots go first."""
    if UNITS == 1 and OFFSET == 0:
        return tl.minimum(tl.maximum(clock - stamp, 0), A - 1).to(tl.int32)
    last = last_step(stamp)
    q = UNITS * (clock - last) - tl.where(stamp < 0, 0, stamp >> _BONUS_SHIFT) + OFFSET
    return tl.where(last >= clock, 0, tl.minimum(tl.maximum(q, 1), A - 1)).to(tl.int32)


@triton.jit
def _age(stamp_ptr, s, ms, clock, A: tl.constexpr, UNITS: tl.constexpr, OFFSET: tl.constexpr):
    return stamp_age(tl.load(stamp_ptr + s, mask=ms, other=0), clock, A, UNITS, OFFSET)


@triton.jit
def _stamp_selected(stamp_ptr, slot, m, clock, bonus_ptr, A: tl.constexpr, UNITS: tl.constexpr,
                    OFFSET: tl.constexpr):
    """Slots `slot` (mask m) were selected in this step: stamp them with the clock (LRU), or (decayed retention) with
    the clock and the bonus of their new decayed count, from the table `bonus_ptr` by their age bucket. A slot already
    stamped this step keeps its stamp, so that several entries naming one slot count it once, in any order."""
    if UNITS == 1 and OFFSET == 0:
        tl.store(stamp_ptr + slot, tl.zeros_like(slot).to(tl.int64) + clock, mask=m)
    else:
        b = stamp_age(tl.load(stamp_ptr + slot, mask=m, other=0), clock, A, UNITS, OFFSET)
        again = m & (b > 0)
        bonus = tl.load(bonus_ptr + b, mask=again, other=0)
        tl.store(stamp_ptr + slot, clock + (bonus << _BONUS_SHIFT), mask=again)


@triton.jit
def _age_histogram(stamp_ptr, clock_ptr, scr_ptr, num_slots, per, pid, A: tl.constexpr, SBLOCK: tl.constexpr,
                   UNITS: tl.constexpr, OFFSET: tl.constexpr):
    """K2's work in program `pid`: the ages of `per` consecutive blocks of SBLOCK slots, added to the histogram."""
    clock = tl.load(clock_ptr)
    hist = tl.zeros((A,), tl.int32)
    for k in range(0, per):
        s = (pid * per + k) * SBLOCK + tl.arange(0, SBLOCK)
        ms = s < num_slots
        hist += tl.histogram(_age(stamp_ptr, s, ms, clock, A, UNITS, OFFSET), A, mask=ms)
    # only the ages this program holds: every program adding all 256 bins queues thousands of atomics per bin
    tl.atomic_add(scr_ptr + SCR_HIST + tl.arange(0, A), hist, mask=hist > 0, sem="relaxed")


@triton.jit(do_not_specialize=("per",))
def _ages_kernel(stamp_ptr, clock_ptr, scr_ptr, taken_ptr, num_spare, num_slots, per, phase, interval,
                 REFILL: tl.constexpr, A: tl.constexpr, SBLOCK: tl.constexpr, PDL: tl.constexpr,
                 UNITS: tl.constexpr = 1, OFFSET: tl.constexpr = 0):
    # each program scans `per` consecutive blocks of SBLOCK slots (one, or a few over a short grid)
    _pdl_enter(PDL)
    need = _victims_needed(scr_ptr, taken_ptr, num_spare, clock_ptr, phase, interval, REFILL)
    if need > 0:  # else every program returns at once
        _age_histogram(stamp_ptr, clock_ptr, scr_ptr, num_slots, per, tl.program_id(0), A, SBLOCK, UNITS, OFFSET)


@triton.jit
def _list_victims(stamp_ptr, clock_ptr, scr_ptr, victims_ptr, need, num_slots, per, pid, A: tl.constexpr,
                  BLOCK: tl.constexpr, CM: tl.constexpr, UNITS: tl.constexpr, OFFSET: tl.constexpr):
    """K3's work in program `pid`: from the histogram, the age threshold T; the victims among `per` consecutive blocks
    of BLOCK slots, in order (so that under the interpreter the list comes out in slot order whatever the grid).
    CM: the cache modifier of the histogram's load (".cg" where this launch wrote it: past L1)."""
    a = tl.arange(0, A)
    hist = tl.load(scr_ptr + SCR_HIST + a, cache_modifier=CM)
    at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist
    eligible = (at_or_above >= need) & (a >= 1)
    T = tl.maximum(tl.max(tl.where(eligible, a, 0)), 1)
    n_above = tl.sum(tl.where(a == T + 1, at_or_above, 0))
    clock = tl.load(clock_ptr)
    for k in range(0, per):
        s = (pid * per + k) * BLOCK + tl.arange(0, BLOCK)
        ms = s < num_slots
        age = _age(stamp_ptr, s, ms, clock, A, UNITS, OFFSET)
        # most blocks hold no victim: they skip the list counters, on which every block would otherwise queue
        above = ms & (age > T)
        above32 = above.to(tl.int32)
        n_a = tl.sum(above32)
        if n_a > 0:
            ra = tl.atomic_add(scr_ptr + SCR_ABOVE, n_a, sem="relaxed") + tl.cumsum(above32, 0) - 1
            tl.store(victims_ptr + ra, s + 1, mask=above & (ra < need))
        at_t = ms & (age == T)
        at32 = at_t.to(tl.int32)
        n_t = tl.sum(at32)
        if n_t > 0:
            rt = tl.atomic_add(scr_ptr + SCR_AT, n_t, sem="relaxed") + tl.cumsum(at32, 0) - 1
            tl.store(victims_ptr + n_above + rt, s + 1, mask=at_t & (rt < need - n_above))


@triton.jit(do_not_specialize=("per",))
def _victims_kernel(stamp_ptr, clock_ptr, scr_ptr, victims_ptr, taken_ptr, num_spare, num_slots, per, phase,
                    interval, REFILL: tl.constexpr, A: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                    UNITS: tl.constexpr = 1, OFFSET: tl.constexpr = 0):
    # each program scans `per` consecutive blocks of BLOCK slots
    _pdl_enter(PDL)
    need = _victims_needed(scr_ptr, taken_ptr, num_spare, clock_ptr, phase, interval, REFILL)
    if need > 0:  # none needed: no victims, and no stamp is read
        _list_victims(stamp_ptr, clock_ptr, scr_ptr, victims_ptr, need, num_slots, per, tl.program_id(0), A, BLOCK,
                      "", UNITS, OFFSET)


@triton.jit
def _evict_owner(s2l_ptr, l2s_ptr, v, m):
    """Slots `v` (mask m) are being taken: unmap the token each one holds. Returns where one was evicted."""
    old = tl.load(s2l_ptr + v, mask=m, other=-1).to(tl.int64)
    evict = m & (old >= 0)
    tl.store(l2s_ptr + old, tl.full(old.shape, -1, tl.int32), mask=evict)
    return evict


@triton.jit
def _assign_walk(scr_ptr, victims_ptr, over_loc_ptr, over_idx_ptr, took_loc_ptr, took_slot_ptr, l2s_ptr, s2l_ptr,
                 stamp_ptr, clock_ptr, out_ptr, cnt_ptr, src_ptr, dst_ptr, pend_src_ptr, pend_dst_ptr,
                 pend_count_ptr, taken_ptr, num_spare, n, n_sel, copy_cap, pid, programs, COPY: tl.constexpr,
                 PEND: tl.constexpr, WORDS: tl.constexpr, BLOCK_WORDS: tl.constexpr, C_FETCH_A: tl.constexpr,
                 C_FETCH_B: tl.constexpr, C_EVICT: tl.constexpr, C_OVERFLOW: tl.constexpr,
                 C_NEW: tl.constexpr, STAMP_BACK: tl.constexpr,
                 ROWS: tl.constexpr, CLEAR: tl.constexpr, CM: tl.constexpr):
    """K4's work in program `pid` of `programs`. CM: the cache modifier of the loads of what K3 wrote (".cg" where
    this launch wrote it: past L1)."""
    # Persistent: a fixed grid walks the overflow ROWS at a time (the grid does not grow with the selection, of
    # which the misses are a few percent)
    n_miss = tl.minimum(tl.load(scr_ptr + SCR_MISS).to(tl.int64), n)
    avail = num_spare - tl.load(taken_ptr)
    n_over = tl.maximum(n_miss - avail, 0)
    first = n_miss - n_over  # the rank of the first overflow winner: ranks below it took spare slots in K1
    # victims written by K3: every slot older than T (scr[1] of them), then up to n_over - scr[1] of age T (scr[2])
    n_victims = tl.minimum(n_over, tl.load(scr_ptr + SCR_ABOVE, cache_modifier=CM)
                           + tl.load(scr_ptr + SCR_AT, cache_modifier=CM))
    if PEND:  # the fetch list of a deferred copy: (host location, slot) of each miss that got a slot, -1 elsewhere
        if pid == 0:
            tl.store(pend_count_ptr, n_miss)
        for c0 in range(pid * CLEAR, n, programs * CLEAR):
            c = c0 + tl.arange(0, CLEAR)
            rest = (c >= n_miss) & (c < n)
            tl.store(pend_src_ptr + c, tl.full(c.shape, -1, tl.int64), mask=rest)
            tl.store(pend_dst_ptr + c, tl.full(c.shape, -1, tl.int64), mask=rest)
    clock = tl.load(clock_ptr) - STAMP_BACK  # 1 for a prefetch: the newest, yet evictable in this step
    n_got = tl.zeros((), tl.int64)
    n_new = tl.zeros((), tl.int64)
    n_evict = tl.zeros((), tl.int64)
    n_over_left = tl.zeros((), tl.int64)
    # ranks [lo, n_miss): the overflow (ranks from `first`) is assigned victims and copied; so are the spare-slot
    # winners before it that K1 did not copy (ranks from `copy_cap`); with a fetch list every winner is walked,
    # for its (location, slot) pair from K1
    lo = first
    if COPY:
        lo = tl.minimum(first, copy_cap)
    if PEND:
        lo = tl.zeros_like(first)
    for r0 in range(lo + pid * ROWS, n_miss, programs * ROWS):
        r = r0 + tl.arange(0, ROWS)
        mr = r < n_miss
        sp = mr & (r < first)
        ov = mr & (r >= first)
        j = r - first  # the overflow's own index (victim j, overflow list entry j)
        v = tl.where(j < n_victims, tl.load(victims_ptr + j, mask=ov, other=0, cache_modifier=CM) - 1,
                     -1).to(tl.int64)
        v = tl.where(sp, tl.load(took_slot_ptr + r, mask=sp, other=-1), v)
        loc = tl.load(over_loc_ptr + j, mask=ov, other=-1)
        loc = tl.where(sp, tl.load(took_loc_ptr + r, mask=sp, other=-1), loc)
        i = tl.load(over_idx_ptr + j, mask=ov, other=0)
        got = ov & (v >= 0)
        fresh = got & (i >= n_sel)  # this step's token (`insert`): K5 writes its slot, nothing is copied
        evict = _evict_owner(s2l_ptr, l2s_ptr, v, got)
        tl.store(s2l_ptr + v, loc.to(tl.int32), mask=got)
        tl.store(l2s_ptr + loc, tl.where(got, v, -1).to(tl.int32), mask=ov)  # no slot: the claim goes back to absent
        tl.store(stamp_ptr + v, tl.zeros_like(v) + clock, mask=got)
        tl.store(out_ptr + i, tl.where(got, v, -1).to(tl.int32), mask=ov)
        live = (sp & (loc >= 0)) | (got & ~fresh)  # a slot to fill (a spare-slot token's loc reads -1 here)
        if PEND:
            tl.store(pend_src_ptr + r, tl.where(live, loc, -1), mask=mr)
            tl.store(pend_dst_ptr + r, tl.where(live, v, -1), mask=mr)
        n_got += tl.sum((got & ~fresh).to(tl.int64))
        n_new += tl.sum(fresh.to(tl.int64))
        n_evict += tl.sum(evict.to(tl.int64))
        n_over_left += tl.sum((ov & ~got).to(tl.int64))
        if COPY:  # the FlashTrans gather, fused: host entry of `loc` -> hot slot `v`
            _copy_masked(src_ptr, dst_ptr, loc, v, (got & ~fresh) | (sp & (r >= copy_cap) & (loc >= 0)), WORDS,
                         WORDS, WORDS, BLOCK_WORDS)
    if n_got + n_new + n_over_left > 0:  # programs with no misses add nothing (nor queue on the counters' atomics)
        if C_FETCH_A >= 0:
            tl.atomic_add(cnt_ptr + C_FETCH_A, n_got, sem="relaxed")
        if C_FETCH_B >= 0:
            tl.atomic_add(cnt_ptr + C_FETCH_B, n_got, sem="relaxed")
        if C_NEW >= 0:
            tl.atomic_add(cnt_ptr + C_NEW, n_new, sem="relaxed")
        tl.atomic_add(cnt_ptr + C_EVICT, n_evict, sem="relaxed")
        tl.atomic_add(cnt_ptr + C_OVERFLOW, n_over_left, sem="relaxed")


@triton.jit(do_not_specialize=("n", "n_sel"))
def _assign_kernel(scr_ptr, victims_ptr, over_loc_ptr, over_idx_ptr, took_loc_ptr, took_slot_ptr, l2s_ptr, s2l_ptr,
                   stamp_ptr, clock_ptr, out_ptr, cnt_ptr, src_ptr, dst_ptr, pend_src_ptr, pend_dst_ptr,
                   pend_count_ptr, taken_ptr, num_spare, n, n_sel, copy_cap, COPY: tl.constexpr, PEND: tl.constexpr,
                   WORDS: tl.constexpr, BLOCK_WORDS: tl.constexpr, C_FETCH_A: tl.constexpr, C_FETCH_B: tl.constexpr,
                   C_EVICT: tl.constexpr, C_OVERFLOW: tl.constexpr,
                   C_NEW: tl.constexpr, STAMP_BACK: tl.constexpr, ROWS: tl.constexpr,
                   CLEAR: tl.constexpr, PDL: tl.constexpr):
    _pdl_enter(PDL)
    _assign_walk(scr_ptr, victims_ptr, over_loc_ptr, over_idx_ptr, took_loc_ptr, took_slot_ptr, l2s_ptr, s2l_ptr,
                 stamp_ptr, clock_ptr, out_ptr, cnt_ptr, src_ptr, dst_ptr, pend_src_ptr, pend_dst_ptr, pend_count_ptr,
                 taken_ptr, num_spare, n, n_sel, copy_cap, tl.program_id(0), tl.num_programs(0), COPY, PEND, WORDS,
                 BLOCK_WORDS, C_FETCH_A, C_FETCH_B, C_EVICT, C_OVERFLOW, C_NEW, STAMP_BACK, ROWS, CLEAR, "")


@triton.jit
def _grid_sync(bar_ptr, programs):
    """Wait until all `programs` programs of the launch have arrived here (a counter in the scratch, cleared by every
    closing finish: the resolve's K5, the refill's, the spare-only prefetch's close), their writes before it visible
    to the reads after it. Only for a grid whose programs are all resident at once (`tail_programs`); under the
    interpreter, which runs programs one after the other, the grid is one program."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    arrived = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while arrived < programs:
        arrived = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit(do_not_specialize=("n", "n_sel", "age_per", "victim_per", "assign_programs"))
def _tail_kernel(stamp_ptr, clock_ptr, scr_ptr, victims_ptr, over_loc_ptr, over_idx_ptr, took_loc_ptr, took_slot_ptr,
                 l2s_ptr, s2l_ptr, out_ptr, cnt_ptr, src_ptr, dst_ptr, pend_src_ptr, pend_dst_ptr, pend_count_ptr,
                 taken_ptr, num_spare, num_slots, n, n_sel, copy_cap, age_per, victim_per, assign_programs,
                 A: tl.constexpr, SBLOCK: tl.constexpr, VBLOCK: tl.constexpr, COPY: tl.constexpr, PEND: tl.constexpr,
                 WORDS: tl.constexpr, BLOCK_WORDS: tl.constexpr, C_FETCH_A: tl.constexpr, C_FETCH_B: tl.constexpr,
                 C_EVICT: tl.constexpr, C_OVERFLOW: tl.constexpr,
                 C_NEW: tl.constexpr, STAMP_BACK: tl.constexpr, ROWS: tl.constexpr,
                 CLEAR: tl.constexpr, PDL: tl.constexpr, UNITS: tl.constexpr = 1, OFFSET: tl.constexpr = 0):
    # K2 + K3 + K4 in one launch (a resolve with spare slots: `FusedResolver.tail_programs`), the phases separated by
    # grid-wide waits only where victims are needed, which every program reads alike from what K1 left
    _pdl_enter(PDL)
    pid, programs = tl.program_id(0), tl.num_programs(0)
    need = _victims_needed(scr_ptr, taken_ptr, num_spare, clock_ptr, 0, 1, False)
    if need > 0:
        _age_histogram(stamp_ptr, clock_ptr, scr_ptr, num_slots, age_per, pid, A, SBLOCK, UNITS, OFFSET)
        _grid_sync(scr_ptr + SCR_BAR_AGES, programs)
        _list_victims(stamp_ptr, clock_ptr, scr_ptr, victims_ptr, need, num_slots, victim_per, pid, A, VBLOCK, ".cg",
                      UNITS, OFFSET)
        _grid_sync(scr_ptr + SCR_BAR_VICTIMS, programs)
    if pid < assign_programs:
        _assign_walk(scr_ptr, victims_ptr, over_loc_ptr, over_idx_ptr, took_loc_ptr, took_slot_ptr, l2s_ptr, s2l_ptr,
                     stamp_ptr, clock_ptr, out_ptr, cnt_ptr, src_ptr, dst_ptr, pend_src_ptr, pend_dst_ptr,
                     pend_count_ptr, taken_ptr, num_spare, n, n_sel, copy_cap, pid, assign_programs, COPY, PEND, WORDS,
                     BLOCK_WORDS, C_FETCH_A, C_FETCH_B, C_EVICT, C_OVERFLOW, C_NEW, STAMP_BACK, ROWS, CLEAR, ".cg")


@triton.jit
def _refill_kernel(scr_ptr, victims_ptr, l2s_ptr, s2l_ptr, stamp_ptr, spare_ptr, taken_ptr, cnt_ptr,
                   C_EVICT: tl.constexpr, ROWS: tl.constexpr):
    # Persistent, like K4: victim j is evicted and becomes spare slot (taken - found + j), so that the spare list
    # stays one contiguous run [taken, num_spare). A refill that is not due found no victims: R3 listed none and the
    # scratch counters are zero (every resolve, prefetch and refill closes by clearing them), so found is 0 here and
    # in R5
    pid, programs = tl.program_id(0), tl.num_programs(0)
    need = tl.load(taken_ptr)
    found = tl.minimum(need, tl.load(scr_ptr + SCR_ABOVE) + tl.load(scr_ptr + SCR_AT))
    n_evict = tl.zeros((), tl.int64)
    for j0 in range(pid * ROWS, found, programs * ROWS):
        j = j0 + tl.arange(0, ROWS)
        mj = j < found
        v = (tl.load(victims_ptr + j, mask=mj, other=1) - 1).to(tl.int64)
        evict = _evict_owner(s2l_ptr, l2s_ptr, v, mj)
        tl.store(s2l_ptr + v, tl.full(v.shape, -1, tl.int32), mask=mj)
        tl.store(stamp_ptr + v, tl.full(v.shape, _SPARE_STAMP, tl.int64), mask=mj)
        tl.store(spare_ptr + need - found + j, v.to(tl.int32), mask=mj)
        n_evict += tl.sum(evict.to(tl.int64))
    if n_evict > 0:
        tl.atomic_add(cnt_ptr + C_EVICT, n_evict, sem="relaxed")


@triton.jit
def _slot_in_finish(l2s_ptr, out_ptr, loc, m, num_slots):
    """The slot of location `loc` (mask m) while K5 runs: from the map, or, where an entry of this resolve still holds
    its claim there (num_slots + its index), from that winner's table entry (-2 - slot until K5 maps it, then the
    slot). Returns (the map's value, whether it is a claim, the slot or -1)."""
    cur = tl.load(l2s_ptr + loc, mask=m, other=-1)
    claimed = m & (cur >= num_slots)
    w = tl.load(out_ptr + (cur - num_slots), mask=claimed, other=-1)
    w = tl.where(w <= -2, -2 - w, w)
    return cur, claimed, tl.where(m & (cur >= 0) & (cur < num_slots), cur, tl.where(claimed, w, -1))


@triton.jit
def _write_back_new_tokens(new_loc_ptr, new_rows_ptr, entries_ptr, entry_stride, entry_rows, host_ptr, hot_ptr,
                           l2s_ptr, stamp_ptr, clock_ptr, out_ptr, cnt_ptr, n_new, num_locations, num_slots, first,
                           WORDS: tl.constexpr, HOST_STRIDE: tl.constexpr, HOT_STRIDE: tl.constexpr,
                           BLOCK_WORDS: tl.constexpr, C_D2H: tl.constexpr, ROWS: tl.constexpr):
    """K5's write-back of this step's tokens, ROWS of them from `first`: token r (host location new_loc[r], its entry
    row new_rows[r] of the entries table, read in place; a row outside the table or a location outside the host pool
    skips it) is written to the host pool and, where the location has a slot, into that slot, stamped with the clock
    (protected this step). The slot is read from the map, or, where an entry of this resolve claimed the location
    and another program of this launch has not yet mapped it, through the claim from the winner's table entry (as K5
    does for the entries that lost a location): a selected token gets its entry over whatever K1 / K4 copied into its
    slot from the host row, which held no token yet."""
    r = first + tl.arange(0, ROWS)
    m = r < n_new
    loc = tl.load(new_loc_ptr + r, mask=m, other=-1).to(tl.int64)
    src = tl.load(new_rows_ptr + r, mask=m, other=-1).to(tl.int64)
    ok = m & (src >= 0) & (src < entry_rows) & (loc >= 0) & (loc < num_locations)
    slot = _slot_in_finish(l2s_ptr, out_ptr, loc, ok, num_slots)[2].to(tl.int64)
    _store_entries(entries_ptr, src, entry_stride, host_ptr, loc, hot_ptr, slot, stamp_ptr, clock_ptr, ok, slot >= 0,
                   WORDS, HOST_STRIDE, HOT_STRIDE, BLOCK_WORDS)
    n_ok = tl.sum(ok.to(tl.int64))
    if n_ok > 0:
        tl.atomic_add(cnt_ptr + C_D2H, n_ok, sem="relaxed")


@triton.jit(do_not_specialize=("n", "table_offset", "n_new", "new_programs", "n_sel"))
def _finish_kernel(loc_ptr, out_ptr, l2s_ptr, stamp_ptr, clock_ptr, scr_ptr, taken_ptr, num_spare, n, num_slots,
                   pend_src_ptr, pend_dst_ptr, pend_count_ptr, table_ptr, table_offset, REFILL: tl.constexpr,
                   SPARE_ONLY: tl.constexpr, PEND: tl.constexpr, CLOSE: tl.constexpr, STAMP_BACK: tl.constexpr,
                   SCR: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, TABLE: tl.constexpr = False,
                   new_loc_ptr=None, new_rows_ptr=None, entries_ptr=None, entry_stride=0, entry_rows=0,
                   host_ptr=None, hot_ptr=None, cnt_ptr=None, n_new=0, new_programs=0, num_locations=0,
                   NEW: tl.constexpr = False, WORDS: tl.constexpr = 4, HOST_STRIDE: tl.constexpr = 4,
                   HOT_STRIDE: tl.constexpr = 4, BLOCK_WORDS: tl.constexpr = 4, C_D2H: tl.constexpr = -1,
                   NEW_ROWS: tl.constexpr = 4, n_sel=0):
    _pdl_enter(PDL)
    # NEW: the first `new_programs` programs write this step's tokens back (`_write_back_new_tokens`), the others
    # finish the entries. (First, so that under TRITON_INTERPRET, where programs run in order, they meet the claims
    # that the entry programs have not mapped yet, as they can on a GPU.)
    e = tl.program_id(0)
    if NEW:
        if e < new_programs:
            _write_back_new_tokens(new_loc_ptr, new_rows_ptr, entries_ptr, entry_stride, entry_rows, host_ptr,
                                   hot_ptr, l2s_ptr, stamp_ptr, clock_ptr, out_ptr, cnt_ptr, n_new, num_locations,
                                   num_slots, e * NEW_ROWS, WORDS, HOST_STRIDE, HOT_STRIDE, BLOCK_WORDS, C_D2H,
                                   NEW_ROWS)
        e = e - new_programs
    # CLOSE: entry program 0 moves the counts and clears the scratch (read for the last time in K4 / R4). A
    # spare-only resolve closes in a second, one-program launch: here every program reads the counts, to clear its
    # part of the fetch list K1 wrote (-1 past its count)
    if SPARE_ONLY and PEND and not CLOSE:
        listed = tl.minimum(tl.load(scr_ptr + SCR_MISS).to(tl.int64), num_spare - tl.load(taken_ptr))
        c = e * BLOCK + tl.arange(0, BLOCK)
        rest = (c >= listed) & (c < n)
        tl.store(pend_src_ptr + c, tl.full(c.shape, -1, tl.int64), mask=rest)
        tl.store(pend_dst_ptr + c, tl.full(c.shape, -1, tl.int64), mask=rest)
    if CLOSE and e == 0:
        taken = tl.load(taken_ptr)
        if SPARE_ONLY and PEND:
            tl.store(pend_count_ptr, tl.minimum(tl.load(scr_ptr + SCR_MISS).to(tl.int64), num_spare - taken))
        if REFILL:
            found = tl.minimum(taken, (tl.load(scr_ptr + SCR_ABOVE) + tl.load(scr_ptr + SCR_AT)).to(tl.int64))
            tl.store(taken_ptr, taken - found)
        else:
            tl.store(taken_ptr, tl.minimum(taken + tl.load(scr_ptr + SCR_MISS), num_spare))
        tl.store(scr_ptr + tl.arange(0, SCR), tl.zeros((SCR,), tl.int32))
    i = e * BLOCK + tl.arange(0, BLOCK)
    m = (i >= 0) & (i < n)  # (a write-back program's e is negative: no entries)
    loc = tl.load(loc_ptr + i, mask=m, other=-1)
    out = tl.load(out_ptr + i, mask=m, other=0)
    # a winner that took a spare slot v (its table entry -2 - v): map, stamp (now that K3 has run), slot
    won = m & (out <= -2)
    v = (-2 - out).to(tl.int64)
    tl.store(l2s_ptr + loc, v.to(tl.int32), mask=won)
    tl.store(stamp_ptr + v, tl.zeros_like(v) + (tl.load(clock_ptr) - STAMP_BACK), mask=won)
    tl.store(out_ptr + i, v.to(tl.int32), mask=won)
    # an entry whose location another entry won: the winner's slot, from the map (a hit's or K4's slot, or a spare
    # slot another program of this launch has just mapped), else through the claim from the winner's table entry;
    # a winner that found no slot and still holds its claim (a spare-only prefetch) gives it back
    lost = m & (loc >= 0) & (out == -1)
    cur, claimed, slot = _slot_in_finish(l2s_ptr, out_ptr, loc, lost, num_slots)
    tl.store(l2s_ptr + loc, tl.full(cur.shape, -1, tl.int32), mask=claimed & (cur - num_slots == i))
    tl.store(out_ptr + i, slot, mask=lost)
    if TABLE:  # every entry's slot + table_offset (-1 where none), in a table of its own: `out` stays the slots,
        # which other programs of this launch read for the entries they lost to these
        final = tl.where(won, v, tl.where(lost, slot.to(tl.int64), out.to(tl.int64)))
        tl.store(table_ptr + i, tl.where(final >= 0, final + table_offset, -1).to(tl.int32), mask=m & (i < n_sel))


def pdl_launch(on: bool) -> dict:
    """Launch arguments of a kernel that starts with `_pdl_enter`: with `on`, PDL compiles its wait-and-release
    prologue in and launch_pdl asks for programmatic dependent launch; without, neither."""
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


def pdl_supported(device: torch.device) -> bool:
    """Whether the resolve's kernels can use programmatic dependent launch on `device`: a CUDA GPU of compute
    capability 9.0 or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_setting(requested: bool | None, device: torch.device, runs_triton: bool, what: str, needs: str,
                got: str) -> bool:
    """One rule for every path that can launch its Triton kernels with programmatic dependent launch (the resolve,
    the prefetch's candidate kernels): `requested` None is on wherever it can run (the path runs Triton on a GPU of
    compute capability 9.0+); True where it cannot run, or anything but None / True / False, is a ValueError naming
    the setting (`what`), what it needs (`needs`, e.g. "the Triton resolve") and what it got. Allocates nothing."""
    if requested is not None and not isinstance(requested, bool):
        raise ValueError(f"{what} must be true, false or unset (None), got {requested!r}")
    ok = runs_triton and pdl_supported(device)
    if requested and not ok:
        raise ValueError(f"{what}: programmatic dependent launch needs {needs} on a CUDA GPU of compute capability "
                         f"9.0 or newer, got {got}")
    return ok if requested is None else requested


def _one_program(device: torch.device) -> bool:
    """Whether a grid-wide wait must run as one program: under the interpreter (programs in turn) or off CUDA."""
    return interpreting() or device.type != "cuda"


MIN_DECAY_STEPS = 16  # steps of age the decayed retention's buckets must still tell apart (with no bonus)
MAX_DECAY_GAMMA = 0.9  # the largest gamma the config accepts: its buckets tell 42 steps apart at 4 units


class DecayRetention(NamedTuple):
    """Decayed-selection-count retention as the resolve keeps it (`decay_retention`)."""

    gamma: float
    units: int  # age buckets per step
    offset: int  # added to every unprotected age, so that the largest bonus still leaves bucket 1
    bonus: torch.Tensor  # int64 [AGE_BUCKETS]: the bonus a slot of age bucket b gets when selected again (b > 0)


def decay_retention(gamma: float, units: int = 4, device: torch.device | str = "cpu") -> DecayRetention:
    """Retention by decayed selection count: every selection adds 1 to a slot's count, every step multiplies it by
    `gamma`, and the lowest count is evicted first (ties: the oldest). The order of two counts never changes between
    selections, so it is kept as a key per slot, key = log_{1/gamma}(sum over selections of gamma^-t): its last step
    plus a bonus (`BONUS_SHIFT`), in 1/units steps, that a new selection at step c sets to
    log_{1/gamma}(1 + gamma^(c - old key)). The eviction age is units x (clock - key) + offset, bucketed as LRU's
    (`stamp_age`); the new bonus is a function of the age bucket alone, tabled here in float64 once, so that the
    kernels and the torch definition compute the same integers. LRU is the special case with no bonus."""
    import math

    if not 0.0 < gamma < 1.0:
        raise ValueError(f"decay gamma must be in (0, 1), got {gamma!r}")
    if not isinstance(units, int) or not 1 <= units <= 16:
        raise ValueError(f"decay units must be an int in [1, 16], got {units!r}")
    top = math.ceil(units * math.log(1.0 / (1.0 - gamma)) / math.log(1.0 / gamma))  # the bonus's supremum
    offset = top - units + 1
    if offset + MIN_DECAY_STEPS * units > AGE_BUCKETS - 1:  # (and so top < 2**15: the bonus fits above BONUS_SHIFT)
        raise ValueError(f"decay gamma {gamma} with {units} units a step leaves the age buckets fewer than "
                         f"{MIN_DECAY_STEPS} steps to order the unselected slots by: use a smaller gamma (at most "
                         f"about {MAX_DECAY_GAMMA} at 4 units) or fewer units")
    table = [0] * AGE_BUCKETS
    for b in range(1, AGE_BUCKETS):
        x = (b - offset) / units  # clock - old key, in steps
        table[b] = min(top, round(units * math.log1p(gamma ** x) / math.log(1.0 / gamma)))
    return DecayRetention(gamma, units, offset, torch.tensor(table, dtype=torch.int64, device=device))


class FusedResolver:
    """Scratch buffers and launches of the fused path for selections of up to `max_entries` entries and up to
    `num_spare` spare slots."""

    def __init__(self, num_slots: int, max_entries: int, device: torch.device,
                 assign_programs: tuple[int, int] | None = None, num_spare: int = 0, pdl: bool = False,
                 decay: DecayRetention | None = None):
        """`pdl`: the resolve's kernels after the lookup are launched with programmatic dependent launch (sm_90+,
        CUDA only): each one's programs are scheduled while the one before runs and wait for it on the device.
        `decay`: evict by decayed selection count (`decay_retention`) instead of least recently used."""
        if pdl and not pdl_supported(device):
            raise ValueError(f"pdl: programmatic dependent launch needs a CUDA GPU of compute capability 9.0 or "
                             f"newer, got {device}")
        self.pdl = pdl
        self.bonus = decay.bonus.to(device) if decay is not None else None
        self.ages = dict(UNITS=decay.units, OFFSET=decay.offset) if decay is not None else {}
        self.num_slots = num_slots
        self.num_spare = num_spare
        # persistent programs of the assign kernel (without, with the inline copy): 4 and 1 per SM, the best measured
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
        self.assign_programs = assign_programs or (4 * sms, sms)
        # programs of the refill's evictions per step of its interval: few, since it runs beside attention and the
        # next indexer (which want the SMs); a refill every K-th step evicts K steps' victims, over K times as many
        # (16 a step: at 128K / 64 with K = 4, 64 programs took 2.1-2.3 us a layer less than 16, whose evictions
        # ran 31 us, after attention in the last layer: H200, 2026-12-01; docs/design.md, "Resolve")
        self.refill_programs = 16 if device.type == "cuda" else 2
        self.max_refill_programs = max(self.refill_programs, sms)
        # Slots per block and warps of the two launches over the pool (age histogram, victim scan), the best of a
        # sweep over pools of 164K-3.4M slots at batch 64 (H200, 2026-11-29): small blocks, now that blocks
        # without ages or victims of their own skip the shared atomics
        self.age_block, self.age_warps = 1024, 4
        self.victim_block, self.victim_warps = 512, (4 if num_slots < 1 << 20 else 2)
        # programs of a resolve's scans where spare slots take the misses: a wave of them (the merged tail's grid, or
        # `_scans`' where `tail_programs` is None)
        self.scan_programs = 2 * sms
        # programs of a refill's age and victim scans (None: one per block, measured faster than 2 x SMs for both:
        # H200, 2026-11-30; victims over 8 x SMs measured no faster; docs/design.md, "Resolve")
        self.refill_age_programs: int | None = None
        self.refill_victim_programs: int | None = None
        # K2-K4 of a resolve as one launch (`_tail_kernel`) over this many programs (at least the assign walk's): all
        # resident at once, as its grid-wide waits need; one under the interpreter, which runs programs in turn.
        # With spare slots always, without them up to `merged_tail_max_entries` entries. None: three launches always
        self.tail_programs: int | None = 1 if _one_program(device) else self.scan_programs
        self.merged_tail_max_entries = MERGED_TAIL_MAX_ENTRIES
        self.lookup_block = 256  # entries per program of the lookup (256: 5.2 us at batch 64, 1024: 6.5)
        self.lookup_copy_cap = LOOKUP_COPY_CAP  # a resolve's misses ranked below this are copied by the lookup
        self.max_entries = 0
        self.device = device
        self.scratch = torch.zeros(SCR_SIZE, dtype=torch.int32, device=device)
        # the spare count of a call that leaves the spare slots alone (`run(use_spare=False)`): 0 before and after
        self._no_spare_taken = torch.zeros(1, dtype=torch.int64, device=device)
        self._grow(max(max_entries, 1))

    def _grow(self, n: int) -> None:
        """Size the scratch for n entries (never during graph capture: size it with max_entries up front)."""
        if n <= self.max_entries:
            return
        d = self.device
        self.max_entries = n
        # counters, the tail's wait counters and the age histogram (self.scratch): zero between calls, K5 clears them
        # after K4's last read
        self.victims = torch.zeros(max(n, self.num_spare), dtype=torch.int32, device=d)  # slot + 1
        self.over_loc = torch.empty(n, dtype=torch.int64, device=d)
        self.over_idx = torch.empty(n, dtype=torch.int32, device=d)
        self.took_loc = torch.empty(n, dtype=torch.int64, device=d)
        self.took_slot = torch.empty(n, dtype=torch.int64, device=d)
        self.locs = torch.empty(n, dtype=torch.int64, device=d)

    def _pdl(self, on: bool) -> dict:
        """Launch arguments of a resolve kernel: `pdl_launch`, where the resolver uses PDL."""
        return pdl_launch(on and self.pdl)

    def _scans(self, stamp: torch.Tensor, clock: torch.Tensor, spare_taken: torch.Tensor, refill: bool,
               phase: int = 0, interval: int = 1, num_spare: int | None = None) -> None:
        """K2 + K3 (R2 + R3): the LRU victims, when any are needed (otherwise both launches return at once; a refill
        needs them when it is due: `phase` and `interval` as `refill`'s).

        A refill, and a resolve without spare slots (every miss overflows), scan the pool in one program per block
        (a refill: unless `refill_age_programs` / `refill_victim_programs` give a grid). A resolve with spare slots
        needs victims only once they run out (rarely; these launches only where `tail_programs` is None, else the
        merged tail does the same work): its scans run over a short grid (`scan_programs`, each
        program walking consecutive blocks), so that the usual no-victim launch is a wave of programs that return at
        once rather than thousands. When such a resolve does need victims (a layer's first resolve, before its first
        refill; misses beyond the spare slots left) the short grid scans the pool with fewer programs at once: that
        case is not timed (docs/design.md, "Resolve")."""
        S = self.num_slots
        num_spare = self.num_spare if num_spare is None else num_spare
        resolve_grid = self.scan_programs if num_spare > 0 else None  # (a resolve's: short with spare slots)

        def per_program(block: int, grid: int | None) -> tuple[int, int]:  # (blocks per program, programs)
            blocks = triton.cdiv(S, block)
            per = triton.cdiv(blocks, grid) if grid else 1
            return per, triton.cdiv(blocks, per)

        per, programs = per_program(self.age_block, self.refill_age_programs if refill else resolve_grid)
        _ages_kernel[(programs,)](stamp, clock, self.scratch, spare_taken, num_spare, S, per, phase, interval,
                                  REFILL=refill, A=AGE_BUCKETS, SBLOCK=self.age_block, num_warps=self.age_warps,
                                  **self._pdl(not refill), **self.ages)
        per, programs = per_program(self.victim_block, self.refill_victim_programs if refill else resolve_grid)
        _victims_kernel[(programs,)](stamp, clock, self.scratch, self.victims, spare_taken, num_spare, S, per,
                                     phase, interval, REFILL=refill, A=AGE_BUCKETS, BLOCK=self.victim_block,
                                     num_warps=self.victim_warps, **self._pdl(not refill), **self.ages)

    def run(self, *, src: torch.Tensor, mode: int, l2s: torch.Tensor, s2l: torch.Tensor, stamp: torch.Tensor,
            clock: torch.Tensor, counters: torch.Tensor, count: bool, fetch_counters: tuple[int, int],
            counter_ids: dict[str, int], copy_from: torch.Tensor | None, hot: torch.Tensor | None,
            spare: torch.Tensor, spare_taken: torch.Tensor,
            seq_lens: torch.Tensor | None = None, req_pool_indices: torch.Tensor | None = None,
            req_to_token: torch.Tensor | None = None, per_batch: int = 1,
            fetch_list: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            protect: bool = True, spare_only: bool = False, chained: bool = False,
            table_offset: int | None = None,
            new_tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            insert_locs: torch.Tensor | None = None, use_spare: bool = True) -> torch.Tensor:
        """Resolve the flat list `src` (positions in MODE_POSITIONS, KV locations in MODE_LOCATIONS); returns the
        int32 slot of each entry (-1 where padding, bad, or overflowed).

        `spare` (int32, the layer's spare slots; those from `spare_taken[0]` (int64) on are free to take): misses
        take these first, in rank order, then LRU victims. `fetch_list`: (src, dst, count) int64 tensors, src and
        dst of at least n elements; when given, the misses' (host location, slot) pairs are recorded in their first
        n elements (-1 elsewhere), misses first, and their number in count[0], and nothing is copied.
        `spare_only` (a prefetch): misses take spare slots only; the rest get -1 (never a scan or an eviction; with
        no spare slots, nothing gets a slot, as in the torch definition). `chained` (a spare-only run that follows
        another kernel on its stream, e.g. the prefetch candidates' last kernel): its three launches use programmatic
        dependent launch too, where the resolver does (`pdl`). `table_offset` (not with `spare_only`): return each
        entry's slot + table_offset instead (-1 where none), written by the last launch into a table of its own (an
        engine's row numbers, where the hot pool is a region of its KV pool), with no launch of its own.
        `new_tokens` (not with `spare_only`; protecting resolves only): (locs [m] int64, rows [m] int, entries
        [rows, entry_bytes] uint8, host [locations, entry_bytes] uint8, the host layer as seen from the device): this
        step's tokens, written back by the last launch after the selection is resolved (`_write_back_new_tokens`:
        host row, and the token's slot where it has one, stamped), with no launch of their own.
        `insert_locs` (MODE_POSITIONS, protecting resolves only): int64 [batch], this step's token of each batch
        entry (-1: none): each gets a slot in this resolve, as a miss would, but is not copied (its entry is written
        there by the write-back: pass `new_tokens` too, or write it after) and not counted as a lookup, hit or
        fetch (counted NEW_TOKENS); a selected entry naming its own batch entry's token counts as a hit and reads
        that slot. The token is then resident from the step that computes it (the replays' ``lru_newest``).
        `use_spare` False: the call leaves the spare slots alone (`spare`, `spare_taken` are not read or written) and
        runs as a resolver without them, every miss an LRU victim, against a spare count of its own that stays 0."""
        spare_taken, num_spare = (spare_taken, self.num_spare) if use_spare else (self._no_spare_taken, 0)
        n_sel = src.numel()
        n_ins = insert_locs.numel() if insert_locs is not None else 0
        n = n_sel + n_ins
        self._grow(n)
        S = self.num_slots
        out = torch.empty(n, dtype=torch.int32, device=src.device)
        if n_sel == 0:
            if new_tokens is not None:  # (no launch to ride in: HotPoolCacheManager.resolve writes them back alone)
                raise ValueError("new_tokens: an empty selection launches nothing to write the tokens back in")
            return out[:0]
        if insert_locs is not None and (mode != MODE_POSITIONS or spare_only or not protect):
            raise ValueError("insert_locs: only a protecting resolve of a selection inserts this step's tokens")
        if mode == MODE_POSITIONS:
            r2t, r2t_stride, width = req_to_token, req_to_token.stride(0), req_to_token.shape[1]
            r2t_rows = req_to_token.shape[0]
            seq, rpi = seq_lens, req_pool_indices
        else:
            r2t, r2t_stride, r2t_rows, width, seq, rpi = src, 0, 0, 0, src, src
        copy = copy_from is not None
        words = (copy_from.shape[1] // 4) if copy else 4
        src_w = copy_from.view(torch.int32) if copy else self.scratch
        dst_w = hot.view(torch.int32) if copy else self.scratch
        pend = fetch_list is not None
        pend_src, pend_dst, pend_count = fetch_list if pend else (self.over_loc, self.over_loc, self.over_loc)
        fa, fb = fetch_counters
        if spare_only and copy:
            raise ValueError("a spare-only resolve (a prefetch) copies through its fetch list, not inline")
        if spare_only and table_offset is not None:
            raise ValueError("a spare-only resolve (a prefetch) returns its slots, not a table with an offset")
        if new_tokens is not None and (spare_only or not protect or hot is None):
            raise ValueError("new_tokens: only a protecting resolve into a hot pool writes this step's tokens back")
        table = torch.empty(n_sel, dtype=torch.int32, device=src.device) if table_offset is not None else out
        new = {}
        if new_tokens is not None:  # the finish's write-back programs, first in its grid (views taken before any
            # launch: a call that raises leaves no kernel half done)
            new_locs, new_rows, entries, host = new_tokens
            nw = entries.shape[1] // 4
            new = dict(new_loc_ptr=new_locs, new_rows_ptr=new_rows, entries_ptr=entries.view(torch.int32),
                       entry_stride=entries.stride(0) // 4, entry_rows=entries.shape[0],
                       host_ptr=host.view(torch.int32), hot_ptr=hot.view(torch.int32), cnt_ptr=counters,
                       n_new=new_locs.numel(), new_programs=triton.cdiv(new_locs.numel(), NEW_TOKEN_ROWS),
                       num_locations=l2s.shape[0] - 1, NEW=True, WORDS=nw, HOST_STRIDE=host.stride(0) // 4,
                       HOT_STRIDE=hot.stride(0) // 4, BLOCK_WORDS=triton.next_power_of_2(nw),
                       C_D2H=counter_ids["D2H_ENTRIES"], NEW_ROWS=NEW_TOKEN_ROWS)
        # spare only: K1 writes the fetch list itself (and only where one is given)
        took_loc, took_slot = (pend_src, pend_dst) if spare_only else (self.took_loc, self.took_slot)
        _lookup_kernel[(triton.cdiv(n, self.lookup_block),)](
            src, seq, rpi, r2t, r2t_stride, r2t_rows, width, n, per_batch, l2s, s2l, stamp, clock, out, self.locs,
            counters, self.scratch, self.over_loc, self.over_idx, spare, spare_taken, num_spare, took_loc,
            took_slot, l2s.shape[0] - 1, S, src_w, dst_w, self.lookup_copy_cap, MODE=mode, COUNT=count, PROTECT=protect,
            LIST=copy or pend, SPARE_ONLY=spare_only, C_LOOKUPS=counter_ids["LOOKUPS"], C_HITS=counter_ids["HITS"],
            C_BAD=counter_ids["BAD_INDICES"], C_FETCH_A=fa, C_FETCH_B=fb, BLOCK=self.lookup_block,
            COPY=copy, WORDS=words, BLOCK_WORDS=triton.next_power_of_2(words), COPY_ROWS=LOOKUP_COPY_ROWS,
            ins_ptr=insert_locs, n_sel=n_sel, INSERT=insert_locs is not None, C_NEW=counter_ids["NEW_TOKENS"],
            bonus_ptr=self.bonus, A=AGE_BUCKETS, **self.ages,
            # (a resolve's K1 follows the top-k and the stream joins: launched plainly; compiled with PDL, it lets K2
            # launch early)
            **(self._pdl(chained) if spare_only else dict(PDL=self.pdl)))
        # entries per program of the finish and of the fetch list's clearing: 256 at batch 1-16, up to 1024 at 64-128
        block = block_for(n, 256, 1024, 128)
        if spare_only:
            for close in (False, True):  # (see _finish_kernel: the close is a one-program launch here)
                _finish_kernel[(1 if close else triton.cdiv(n, block),)](
                    self.locs, out, l2s, stamp, clock, self.scratch, spare_taken, num_spare, 0 if close else n,
                    S, pend_src, pend_dst, pend_count, out, 0, REFILL=False, SPARE_ONLY=True, PEND=pend, CLOSE=close,
                    STAMP_BACK=0 if protect else 1, SCR=SCR_SIZE, BLOCK=block, **self._pdl(chained))
            return out
        # the inline copy is fastest with one program per SM, the bookkeeping alone with four (docs/design.md;
        # measured when K4 copied every miss, before K1 copied the first ones)
        assign = min(triton.cdiv(n, ROWS), self.assign_programs[1 if copy else 0])
        walk = dict(COPY=copy, PEND=pend, WORDS=words, BLOCK_WORDS=triton.next_power_of_2(words), C_FETCH_A=fa,
                    C_FETCH_B=fb, C_EVICT=counter_ids["EVICTIONS"], C_OVERFLOW=counter_ids["OVERFLOW"],
                    C_NEW=counter_ids["NEW_TOKENS"], STAMP_BACK=0 if protect else 1, ROWS=ROWS, CLEAR=block,
                    num_warps=NUM_WARPS, **self._pdl(True))
        if self.tail_programs is not None and (num_spare > 0 or n <= self.merged_tail_max_entries):
            # K2-K4 in one launch
            grid = 1 if _one_program(self.device) else max(self.tail_programs, assign)
            _tail_kernel[(grid,)](
                stamp, clock, self.scratch, self.victims, self.over_loc, self.over_idx, self.took_loc,
                self.took_slot, l2s, s2l, out, counters, src_w, dst_w, pend_src, pend_dst, pend_count, spare_taken,
                num_spare, S, n, n_sel, self.lookup_copy_cap, triton.cdiv(triton.cdiv(S, self.age_block), grid),
                triton.cdiv(triton.cdiv(S, self.victim_block), grid), min(assign, grid), A=AGE_BUCKETS,
                SBLOCK=self.age_block, VBLOCK=self.victim_block, **walk, **self.ages)
        else:
            self._scans(stamp, clock, spare_taken, refill=False, num_spare=num_spare)
            _assign_kernel[(assign,)](
                self.scratch, self.victims, self.over_loc, self.over_idx, self.took_loc, self.took_slot, l2s, s2l,
                stamp, clock, out, counters, src_w, dst_w, pend_src, pend_dst, pend_count, spare_taken,
                num_spare, n, n_sel, self.lookup_copy_cap, **walk)
        _finish_kernel[(new.get("new_programs", 0) + triton.cdiv(n, block),)](
            self.locs, out, l2s, stamp, clock, self.scratch, spare_taken, num_spare, n, S, pend_src, pend_dst,
            pend_count, table, table_offset or 0, REFILL=False, SPARE_ONLY=False, PEND=pend, CLOSE=True,
            STAMP_BACK=0 if protect else 1, SCR=SCR_SIZE, BLOCK=block, TABLE=table_offset is not None,
            n_sel=n_sel, **new, **self._pdl(True))
        return table[:n_sel]

    def refill(self, *, l2s: torch.Tensor, s2l: torch.Tensor, stamp: torch.Tensor, clock: torch.Tensor,
               counters: torch.Tensor, counter_ids: dict[str, int], spare: torch.Tensor,
               spare_taken: torch.Tensor, phase: int = 0, interval: int = 1) -> None:
        """Replace the spare slots taken since the last refill with the least-recently-used unprotected slots
        (evicted; fewer when fewer are evictable), when the refill is due: in the steps whose clock + `phase` is a
        multiple of `interval`, or when fewer than num_spare / interval spare slots are left (with interval 1: every
        step). Otherwise every launch returns at once. Four launches, no host synchronisation."""
        if self.num_spare == 0:
            return
        self._scans(stamp, clock, spare_taken, refill=True, phase=phase, interval=interval)
        programs = min(self.refill_programs * interval, self.max_refill_programs)
        _refill_kernel[(programs,)](self.scratch, self.victims, l2s, s2l, stamp, spare, spare_taken, counters,
                                    C_EVICT=counter_ids["EVICTIONS"], ROWS=ROWS * 8, num_warps=NUM_WARPS)
        _finish_kernel[(1,)](self.locs, self.took_slot, l2s, stamp, clock, self.scratch, spare_taken, self.num_spare,
                             0, self.num_slots, self.over_loc, self.over_loc, self.over_loc, self.took_slot, 0,
                             REFILL=True,
                             SPARE_ONLY=False, PEND=False, CLOSE=True, STAMP_BACK=0, SCR=SCR_SIZE, BLOCK=16,
                             PDL=False)
