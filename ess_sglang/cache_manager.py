"""Per-layer GPU hot pools and the cache manager that turns a layer's exact top-k selection into hot-pool slots.

State (all fixed-size device tensors, so every call below runs inside a captured CUDA graph, with no host
synchronisation):

    hot_entries[layer, slot, :]   the hot pool: `slots_per_layer` latent entries per layer (FlashMLA reads these)
    loc_to_slot[layer, loc]       token -> slot map, -1 when the token's entry is not resident
    slot_to_loc[layer, slot]      slot -> token map, -1 when the slot is free
    slot_stamp[layer, slot]       recency: the step in which the slot was last selected or filled (FREE_STAMP if free);
                                  with decayed retention also a bonus above BONUS_SHIFT (`last_step` strips it)
    clock                         the current decode step (a 0-dim device tensor, advanced by `begin_step`)
    spare[layer, :]               spare slots (`spare_slots` per layer, default none): free slots set aside by
    spare_taken[layer]            `refill_spares`; those from spare_taken on are still free to take
    counters[layer, Counter]      hits, misses, bytes, ... (int64; read back asynchronously by the metrics code)

Every map has one extra "sink" element at the end (index `slots_per_layer` / `num_locations`): writes that a mask
turns off are sent there instead of being skipped, which keeps every shape static. Sinks are never read unmasked.

The data path of one layer, in order (see `resolve`):
    1. mask bad positions (-1 padding stays; past the sequence length or below -1 -> -1, counted), translate the rest
       to KV locations through the request table;
    2. lookup: slot = loc_to_slot[loc]; hits are stamped with the current step, which protects them from eviction;
    3. deduplicate the misses (the same location may be selected by several query tokens or requests);
    4. give the distinct misses the layer's spare slots first, then evict the least-recently-used unprotected slots
       for the rest, and assign them;
    5. fetch the missing entries from the host pool with FlashTrans (H2D gather);
    6. with `new_tokens`, write this step's tokens back (host pool, and their hot slots where they have one);
    7. return the slot table, same shape as the selection, -1 where the selection was padding.
Attention then reads only hot-pool slots, the exact entries the selection named: the output is unchanged.

Spare slots move step 4's pool scans off the critical path: `refill_spares(layer)`, run once per layer and step
where nothing waits for it (the decode stack queues it beside attention), evicts the least-recently-used slots ahead
of time, as many as the resolves took since the last refill, and keeps them free (stamped in the future:
`SPARE_STAMP`, so no LRU scan takes them). A resolve whose misses the spare slots cover then needs no scan at all.
With `refill_interval` K it does so only in every K-th step of the layer (or when few spare slots are left) and
returns at once otherwise. The pool keeps up to `spare_slots` fewer entries resident in exchange, and the
least-recently-used entries are evicted up to K steps earlier than they would be otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import torch

from ess_sglang.host_pool import HostTotalPool
from ess_sglang.kernels.flashtrans import copy_rows, copy_rows_counted, copy_rows_reference
from ess_sglang.kernels.new_tokens import store_reserved_triton
from ess_sglang.kernels.resolve import (
    BONUS_SHIFT,
    MODE_LOCATIONS,
    MODE_POSITIONS,
    SPARE_STAMP,
    FusedResolver,
    decay_retention,
    pdl_setting,
)

FREE_STAMP = -(1 << 40)
MAX_REFILL_INTERVAL = 1024  # steps between a layer's spare-slot refills, at most (`refill_interval`)
AGE_BUCKETS = 256  # LRU order is exact per step for the last 255 steps; older slots tie (evicted first, by slot index)


class Counter(IntEnum):
    """Per-layer event counts kept on the device."""

    LOOKUPS = 0  # valid selected entries (after masking)
    HITS = 1  # selected entries already resident
    MISSES = 2  # distinct missing entries fetched for a selection
    H2D_ENTRIES = 3  # entries copied host -> device (misses and warm-up)
    D2H_ENTRIES = 4  # entries written back device -> host (new tokens)
    BAD_INDICES = 5  # selected positions masked because they were out of range
    OVERFLOW = 6  # entries that found no free slot (never happens when the config checks passed)
    WARMUP_ENTRIES = 7  # entries loaded by warm-up
    EVICTIONS = 8  # resident entries evicted to make room
    NEW_TOKENS = 9  # newly decoded entries inserted
    PREFETCHED = 10  # entries fetched by prefetch, before the exact top-k was known (also counted in H2D_ENTRIES)
    PREFETCH_USEFUL = 11  # prefetched entries that the exact top-k of the same step selected
    PREFETCH_WASTED = 12  # prefetched entries that it did not select
    NOT_RESIDENT = 13  # entries a resident-only lookup did not find (a broken all-resident promise: must stay 0)


@dataclass
class FetchList:
    """The host -> hot-pool copies a deferred resolve leaves to do: host location src[i] into slot dst[i].

    Fixed-size int64 tensors (so that they live inside a CUDA graph); -1 in both where there is nothing to copy.
    `count` (one int64 on the device): only the first `count` pairs can be real (the fused resolve lists its misses
    first), so the copy kernel stops there without the host ever reading it. Past `count` the pairs are -1, except in
    a list written by `HotPoolCacheManager.prefetch_above`, whose tail keeps whatever it held (stale pairs that look
    real): a reader of the whole list masks it with `real_pairs`.
    """

    src: torch.Tensor
    dst: torch.Tensor
    count: torch.Tensor

    def check_holds(self, n: int, caller: str, what: str) -> None:
        if self.src.numel() < n:
            raise ValueError(f"{caller}: the fetch list holds {self.src.numel()} entries, the {what} {n}")

    def real_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(src, dst) with -1 past `count` (torch ops, no host read): what a reader of the whole list may use when
        the producer left the tail as it was (`HotPoolCacheManager.prefetch_above`)."""
        past = torch.arange(self.src.numel(), device=self.src.device) >= self.count
        return self.src.masked_fill(past, -1), self.dst.masked_fill(past, -1)

    def clear_from(self, n: int) -> None:
        """Mark the pairs from n on as empty (a call over n entries writes only the first n)."""
        if self.src.numel() > n:
            self.src[n:].fill_(-1)
            self.dst[n:].fill_(-1)


class NewTokens(NamedTuple):
    """This step's token of each batch entry, written back by `HotPoolCacheManager.resolve(new_tokens=...)` once the
    selection is resolved (what `write_new_tokens(locs, entries, insert=False, entry_rows=entry_rows)` stores). The
    locations are distinct (each token its own; -1 aside), and the entry rows are not hot-pool rows (the SGLang plugin's
    new-token slots lie outside its hot region): on a GPU the write-back programs run side by side."""

    locs: torch.Tensor  # [batch] ints: the token's host location, -1 for none (e.g. a CUDA-graph padding row)
    entries: torch.Tensor  # [rows, entry_bytes] uint8 on the device: a table holding the tokens' entries
    entry_rows: torch.Tensor  # [batch] ints: the token's row of `entries`, read in place (outside it: skipped)
    # True (``new_tokens: insert``): the token also takes a hot slot in the resolve itself, as a miss would but
    # neither copied nor counted as a lookup (NEW_TOKENS): resident from the step that computes it, with no launch
    # of its own; a selection naming it counts a hit. False (``on_demand``): only its host row is written (and a
    # slot it already has); a later selection naming it fetches it
    insert: bool = False


def last_step(stamp: torch.Tensor) -> torch.Tensor:
    """`kernels.resolve.last_step`: the step a slot was last selected or filled in, its stamp less the decay bonus."""
    return torch.where(stamp < 0, stamp, stamp & ((1 << BONUS_SHIFT) - 1))


def _same_device(a: torch.device, b: torch.device) -> bool:
    """The same device, a CUDA device without an index read as the current one."""
    def norm(d: torch.device) -> tuple:
        return (d.type, torch.cuda.current_device() if d.type == "cuda" and d.index is None else d.index)
    return a.type == b.type and (a.type != "cuda" or norm(a) == norm(b))


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors (views of one buffer included) may share an element: their byte spans, from the first
    element to the last one their strides reach, overlap. Conservative for interleaved strided views."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _lists_share_memory(a: FetchList, b: FetchList) -> bool:
    return any(_shares_memory(x, y) for x in (a.src, a.dst, a.count) for y in (b.src, b.dst, b.count))


def positions_to_locations(topk_pos: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                           seq_lens: torch.Tensor, num_locations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [B, Q, K] -> KV locations (int64, -1 where padding or bad) and the mask of bad positions.

    A position is read from the request table only when 0 <= pos < seq_len of its own request (and the request's
    row is one of the table's), so a selection can name nothing outside its own request; a table entry outside
    [0, num_locations) is treated as bad too. A batch entry whose request row is -1 is padding (e.g. a CUDA graph's
    unused row): its positions count as -1 (not read, not bad).
    """
    B = topk_pos.shape[0]
    R, width = req_to_token.shape
    rows = req_pool_indices.long().view(B, 1, 1).expand_as(topk_pos)
    pos = torch.where(rows == -1, -1, topk_pos.long())
    valid = (pos >= 0) & (pos < seq_lens.long().view(B, 1, 1)) & (pos < width) & (rows >= 0) & (rows < R)
    loc = req_to_token[torch.where(valid, rows, 0), torch.where(valid, pos, 0)].long()
    loc_ok = valid & (loc >= 0) & (loc < num_locations)
    bad = ((pos != -1) & ~valid) | (valid & ~loc_ok)
    return torch.where(loc_ok, loc, -1), bad


_COUNTER_IDS = {c.name: int(c) for c in Counter}


def _check_hot_entries(hot: torch.Tensor | Sequence[torch.Tensor], layers: int, slots: int, entry_bytes: int,
                       device: torch.device) -> None:
    """Engine-provided hot-pool storage must be `layers` contiguous uint8 [slots, entry_bytes] blocks on `device`."""
    if len(hot) != layers:
        raise ValueError(f"hot_entries: {len(hot)} layers given, {layers} needed")
    for layer in range(layers):
        v = hot[layer]
        if v.shape != (slots, entry_bytes) or v.dtype != torch.uint8 or not v.is_contiguous() \
                or not _same_device(v.device, device):
            raise ValueError(f"hot_entries[{layer}]: want a contiguous uint8 [{slots}, {entry_bytes}] tensor on "
                             f"{device}, got {v.dtype} {tuple(v.shape)} on {v.device}")


def resolve_settings(resolve_impl: str, resolve_pdl: bool | None, device: torch.device) -> tuple[str, bool]:
    """The resolve's implementation and PDL setting on `device`, or a ValueError naming what cannot run there:
    resolve_impl "auto" is the Triton path on CUDA, torch elsewhere; resolve_pdl None is on wherever it can run (the
    Triton resolve on a GPU of compute capability 9.0+). Allocates nothing: callers check it first."""
    if resolve_impl == "auto":
        resolve_impl = "triton" if device.type == "cuda" else "torch"
    if resolve_impl not in ("triton", "torch"):
        raise ValueError(f"resolve_impl must be 'auto', 'triton' or 'torch', got {resolve_impl!r}")
    return resolve_impl, pdl_setting(resolve_pdl, device, resolve_impl == "triton", "resolve_pdl", "the Triton resolve",
                                     f"resolve_impl {resolve_impl!r} on {device}")


class HotPoolCacheManager:
    def __init__(self, host_pool: HostTotalPool, slots_per_layer: int, device: torch.device | str | None = None,
                 max_selected: int = 0, copy_impl: str = "auto", resolve_impl: str = "auto",
                 hot_entries: torch.Tensor | Sequence[torch.Tensor] | None = None, spare_slots: int = 0,
                 resolve_pdl: bool | None = None, refill_interval: int = 1, decay_gamma: float | None = None,
                 spare_max_entries: int | None = None):
        """`max_selected` sizes scratch tensors for the largest selection (batch x q_tokens x top_k) one call sees,
        plus the batch where a resolve inserts the step's tokens (`NewTokens.insert`).

        `resolve_impl`: "triton" (the fused kernels of ess_sglang.kernels.resolve), "torch" (plain torch ops, the
        definition the kernels are tested against) or "auto" (triton on CUDA, torch on CPU).
        `copy_impl` picks FlashTrans's implementation for the torch path ("auto": the Triton kernel on CUDA, torch on
        CPU); "none" moves no data on either path and exists only so that benchmarks can time the bookkeeping alone.
        `hot_entries`: storage for the hot pools, when the engine owns it (the SGLang plugin places them in regions of
        its device KV pool): one contiguous uint8 [slots_per_layer, entry_bytes] tensor per layer, or one
        [layers, slots_per_layer, entry_bytes] tensor. By default the manager allocates its own.
        `spare_slots`: free slots per layer that `refill_spares` keeps set aside for the resolves (0: none, every
        miss evicts at its resolve). Size it to the misses of one step of a layer: more holds fewer entries resident,
        fewer leaves the excess to an LRU scan at resolve time.
        `refill_interval`: `refill_spares` refills a layer's spare slots in every step (1), or in every K-th step of
        the layer, the layers in turn (layer l where clock + l is a multiple of K), and in any step where fewer than
        1/K of them are left: the two pool scans of a refill then run in 1/K of the steps. Size the spare slots to K
        steps' misses.
        `spare_max_entries`: only calls of at most this many entries (a resolve's selection plus the tokens it inserts,
        a warm-up's or prefetch's locations) take spare slots, and a layer's refill runs only after a resolve that
        could take them; larger calls run as without spare slots (None: every call). The SGLang plugin keeps a
        one-page reserve for one or two requests this way, where it prefetches nowhere.
        `resolve_pdl`: the fused resolve's kernels after its lookup use programmatic dependent launch (sm_90+, the
        Triton path only; 5-7 us a layer less at batch 64-128 / 32K together with the side-stream threshold update,
        benchmarks/RESULTS.md). None: wherever it can (the Triton resolve on a GPU of compute capability 9.0+).
        `decay_gamma`: evict the lowest decayed selection count first, with this factor per step
        (`kernels.resolve.decay_retention`), instead of the least recently used (None); a slot's count starts when it
        is filled (an evicted entry's history is not kept).
        """
        if slots_per_layer <= 0:
            raise ValueError(f"slots_per_layer must be > 0, got {slots_per_layer}")
        if isinstance(spare_slots, bool) or not isinstance(spare_slots, int) or not 0 <= spare_slots < slots_per_layer:
            raise ValueError(f"spare_slots must be an integer in [0, slots_per_layer = {slots_per_layer}), "
                             f"got {spare_slots!r}")
        if isinstance(refill_interval, bool) or not isinstance(refill_interval, int) or \
                not 1 <= refill_interval <= MAX_REFILL_INTERVAL:
            raise ValueError(f"refill_interval must be an integer in [1, {MAX_REFILL_INTERVAL}], got "
                             f"{refill_interval!r}")
        if spare_max_entries is not None and (isinstance(spare_max_entries, bool) or
                                              not isinstance(spare_max_entries, int) or spare_max_entries < 1):
            raise ValueError(f"spare_max_entries must be a positive integer or None, got {spare_max_entries!r}")
        dev = torch.device(device) if device is not None else host_pool.device
        resolve_impl, resolve_pdl = resolve_settings(resolve_impl, resolve_pdl, dev)
        decay = decay_retention(decay_gamma, device=dev) if decay_gamma is not None else None
        self.host = host_pool
        self.copy_impl = copy_impl
        self.device = dev
        L, S, T = host_pool.num_layers, slots_per_layer, host_pool.num_tokens
        self.num_layers, self.slots_per_layer, self.num_locations = L, S, T
        self.entry_bytes = host_pool.entry_bytes
        if hot_entries is None:
            hot_entries = torch.zeros((L, S, self.entry_bytes), dtype=torch.uint8, device=dev)
        else:
            _check_hot_entries(hot_entries, L, S, self.entry_bytes, dev)
        self.hot_entries = hot_entries
        self.loc_to_slot = torch.full((L, T + 1), -1, dtype=torch.int32, device=dev)
        self.slot_to_loc = torch.full((L, S + 1), -1, dtype=torch.int32, device=dev)
        self.slot_stamp = torch.full((L, S + 1), FREE_STAMP, dtype=torch.int64, device=dev)
        self.clock = torch.zeros((), dtype=torch.int64, device=dev)
        self.counters = torch.zeros((L, len(Counter)), dtype=torch.int64, device=dev)
        self.num_spare = spare_slots
        self.refill_interval = refill_interval
        self.spare_max_entries = spare_max_entries
        # per layer: whether its last resolve could take spare slots (`uses_spare`); a refill follows only those
        self._resolve_took_spare = [True] * L
        # spare[layer, spare_taken[layer]:num_spare] are free slots to take (all taken, i.e. none, until a refill);
        # one sink element at the end, like the maps
        self.spare = torch.full((L, spare_slots + 1), -1, dtype=torch.int32, device=dev)
        self.spare_taken = torch.full((L,), spare_slots, dtype=torch.int64, device=dev)
        # the prefetches not yet settled, all of one layer (layer, their fetch lists): each list's pairs say what was
        # prefetched where
        self._unsettled_prefetch: tuple[int, list[FetchList]] | None = None
        self._slot_ids = torch.arange(S, dtype=torch.int64, device=dev)
        self._ones = torch.ones(S, dtype=torch.int64, device=dev)
        self._age_ids = torch.arange(AGE_BUCKETS, dtype=torch.int64, device=dev)
        self._entry_ids = torch.arange(max(max_selected, 1), dtype=torch.int64, device=dev)
        self.resolve_impl = resolve_impl
        self.decay = decay
        self._fused = FusedResolver(S, max_selected, dev, num_spare=spare_slots, pdl=resolve_pdl, decay=decay) \
            if resolve_impl == "triton" else None
        # persistent programs of a deferred fetch when the caller names none: enough to fill the GPU
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0
        self.copy_programs = 4 * sms if sms else 2
        # Optional observer of PCIe copies, called as on_transfer(direction, run) and expected to call run(): the
        # demo times them with it. The fused resolve copies misses inside its kernel, without passing through here.
        self.on_transfer = None

    def uses_spare(self, entries: int) -> bool:
        """Whether a call of `entries` entries takes spare slots (there are some, and `spare_max_entries` allows)."""
        return self.num_spare > 0 and (self.spare_max_entries is None or entries <= self.spare_max_entries)

    def refill_follows(self, layer: int) -> bool:
        """Whether `refill_spares(layer)` does anything now: the layer has spare slots and its last resolve could take
        them."""
        return self.num_spare > 0 and self._resolve_took_spare[layer]

    def reset(self) -> None:
        """Empty every hot pool and zero the clock and counters (the host pool is untouched): benchmarks start each
        variant from the same state with it."""
        self.empty_pools()
        self.clock.zero_()
        self.counters.zero_()

    def empty_pools(self) -> None:
        """Forget every resident entry and spare slot (the next refill of each layer sets spare slots aside again);
        the clock and the counters go on (a server's flush keeps its metrics monotonic)."""
        self.loc_to_slot.fill_(-1)
        self.slot_to_loc.fill_(-1)
        self.slot_stamp.fill_(FREE_STAMP)
        self.spare.fill_(-1)
        self.spare_taken.fill_(self.num_spare)
        self._unsettled_prefetch = None

    # ------------------------------------------------------------------ per step
    def begin_step(self) -> None:
        """Advance the clock: entries stamped in earlier steps become evictable again."""
        self.clock += 1

    def layer_entries(self, layer: int) -> torch.Tensor:
        """[slots_per_layer, entry_bytes] hot pool of one layer (index it with the slot table)."""
        return self.hot_entries[layer]

    def resolve(self, layer: int, topk_pos: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                seq_lens: torch.Tensor, fetch_list: FetchList | None = None,
                settle_prefetch: bool = False, slot_offset: int | None = None,
                new_tokens: NewTokens | None = None) -> torch.Tensor:
        """Make every selected entry resident and return its slot.

        topk_pos: [batch, q_tokens, k] int32, positions within each request, -1 as padding.
        req_to_token: [rows, max_context] int32, the KV location of each position of each request row.
        req_pool_indices: [batch], the request row of each batch entry (-1: a padding entry, whose positions are
        ignored: not read, not counted bad). seq_lens: [batch], tokens of each request.
        fetch_list: when given, the misses get their slots but are not copied: their (location, slot) pairs are written
        to it, and `fetch(layer, fetch_list)` copies them later (dual-batch attention runs that copy on a side stream).
        settle_prefetch: count the layer's prefetches of this step as useful (selected) or wasted entries, after the
        resolve (`settle_prefetch(layer)` does it alone: the decode stack runs it beside attention).
        slot_offset: return slot + slot_offset instead (an engine's row numbers, where the hot pool is a region of its
        KV pool), with no launch of its own on the fused path.
        new_tokens: this step's token of each batch entry (`NewTokens`), written back after the selection is resolved
        (and before the settle), as `write_new_tokens(..., insert=False)` would then store it: into the host pool,
        and over its hot slot where it has one (protected), so that a selection naming it reads its entry although
        its host row was not written before the resolve. On the fused path the resolve's last launch does it, with
        no launch of its own: for an engine that has the token's entry only just before the resolve (the SGLang
        plugin).
        Returns int32 [batch, q_tokens, k]: hot-pool slot of each selected entry, -1 where the input was padding or bad.
        """
        if slot_offset is not None and (not isinstance(slot_offset, int) or isinstance(slot_offset, bool)
                                        or not 0 <= slot_offset < 2**31 - self.slots_per_layer):
            raise ValueError(f"resolve: slot_offset must be an int in [0, 2**31 - slots_per_layer), got "
                             f"{slot_offset!r}")
        if topk_pos.dim() != 3:
            raise ValueError(f"resolve: topk_pos must be [batch, q_tokens, k], got {tuple(topk_pos.shape)}")
        B = topk_pos.shape[0]
        if req_pool_indices.shape != (B,) or seq_lens.shape != (B,):
            raise ValueError(f"resolve: req_pool_indices and seq_lens must be [{B}], got "
                             f"{tuple(req_pool_indices.shape)} and {tuple(seq_lens.shape)}")
        if new_tokens is not None:
            self._check_new_entries("resolve(new_tokens=)", new_tokens.locs, new_tokens.entries, new_tokens.entry_rows)
            if new_tokens.locs.shape != (B,):
                raise ValueError(f"resolve: new_tokens wants one token per batch entry ({B}), got "
                                 f"{tuple(new_tokens.locs.shape)}")
        # the write-back in the resolve's last launch, where write_new_tokens itself would be one launch
        fused_new = new_tokens is not None and self._fused is not None and self.on_transfer is None \
            and self.copy_impl != "none" and topk_pos.numel() > 0
        insert = new_tokens is not None and new_tokens.insert and topk_pos.numel() > 0
        # this step's tokens as the kernels read them (int64, on the device), once for the write-back and the insert
        new_locs = new_tokens.locs.to(self.device, torch.int64).contiguous() if fused_new or insert else None
        ins_locs = new_locs if insert else None
        if fetch_list is not None:
            fetch_list.check_holds(topk_pos.numel() + (B if insert else 0), "resolve", "selection")
            if self._unsettled_prefetch is not None and \
                    any(_lists_share_memory(r, fetch_list) for r in self._unsettled_prefetch[1]):
                raise ValueError("resolve: the fetch list is the unsettled prefetch's own list; the resolve would "
                                 "overwrite the pairs its settle counts: give the prefetch and the resolve their own")
        self._resolve_took_spare[layer] = self.uses_spare(topk_pos.numel() + (B if insert else 0))
        if self._fused is not None:
            pos = topk_pos.reshape(-1)
            slots = self._fused_run(layer, pos, MODE_POSITIONS, count=True, fetch=(Counter.MISSES, Counter.H2D_ENTRIES),
                                    copy_from=None if fetch_list is not None else self.host.layer(layer),
                                    seq_lens=seq_lens, req_pool_indices=req_pool_indices, req_to_token=req_to_token,
                                    per_batch=topk_pos.shape[1] * topk_pos.shape[2], fetch_list=fetch_list,
                                    table_offset=slot_offset, new_tokens=(
                                        new_locs,
                                        new_tokens.entry_rows.to(self.device).contiguous(), new_tokens.entries,
                                        self.host.layer(layer)) if fused_new else None, insert_locs=ins_locs)
        else:
            locs, bad = self.translate(topk_pos, req_to_token, req_pool_indices, seq_lens)
            flat = locs.reshape(-1)
            cnt = self.counters[layer]
            cnt[Counter.BAD_INDICES] += bad.sum()
            cnt[Counter.LOOKUPS] += (flat >= 0).sum()
            n = flat.shape[0]
            if insert:  # this step's tokens after the selection; a selected entry naming its own one reads its slot
                own = ins_locs.repeat_interleave(n // B)
                newest = (flat >= 0) & (flat == own)
                ins = self._valid_locations(ins_locs)
                slots, hits, fetched = self._make_resident(layer, torch.cat([torch.where(newest, -1, flat), ins]),
                                                           copy=fetch_list is None, record=fetch_list,
                                                           fresh_from=n)
                cnt[Counter.NEW_TOKENS] += ((slots[n:] >= 0) & (ins >= 0)).sum() - hits[1]
                slots = torch.where(newest, self._lookup(layer, flat), slots[:n])
                hits = hits[0] + newest.sum()
            else:
                slots, hits, fetched = self._make_resident(layer, flat, copy=fetch_list is None, record=fetch_list)
            cnt[Counter.HITS] += hits
            cnt[Counter.MISSES] += fetched
            cnt[Counter.H2D_ENTRIES] += fetched
            slots = slots.to(torch.int32)
            if slot_offset is not None:
                slots = torch.where(slots >= 0, slots + slot_offset, -1).to(torch.int32)
        if new_tokens is not None and not fused_new:  # (an empty selection inserts the tokens here, if asked)
            self.write_new_tokens(layer, new_tokens.locs, new_tokens.entries, insert=new_tokens.insert and not insert,
                                  entry_rows=new_tokens.entry_rows)
        if settle_prefetch:
            self.settle_prefetch(layer)
        return slots.view(topk_pos.shape)

    def lookup_resident(self, layer: int, topk_pos: torch.Tensor, req_to_token: torch.Tensor,
                        req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """The slot table of a selection whose every entry is known to be resident (the caller's promise, e.g. all
        live tokens fit the pool and were loaded): one lookup, no protection, eviction or copy, for small batches.

        Counts LOOKUPS and HITS; an entry that is not resident after all gets slot -1 and counts NOT_RESIDENT.
        """
        cnt = self.counters[layer]
        if topk_pos.is_cuda:
            from ess_sglang.kernels.translate import translate_positions_triton
            return translate_positions_triton(
                topk_pos, req_to_token, req_pool_indices, seq_lens, self.num_locations,
                loc_to_slot=self.loc_to_slot[layer], num_slots=self.slots_per_layer, counters=cnt,
                counter_ids=(int(Counter.LOOKUPS), int(Counter.HITS), int(Counter.NOT_RESIDENT)))
        locs, _ = self.translate(topk_pos, req_to_token, req_pool_indices, seq_lens)
        slot = self._lookup(layer, locs.reshape(-1)).view(locs.shape)
        ok = locs >= 0
        cnt[Counter.LOOKUPS] += ok.sum()
        cnt[Counter.HITS] += (slot >= 0).sum()
        cnt[Counter.NOT_RESIDENT] += (ok & (slot < 0)).sum()
        return slot.to(torch.int32)

    def reserve_scratch(self, n: int) -> None:
        """Size every scratch buffer for calls of up to `n` entries now (never during graph capture: a buffer that grew
        lazily inside a capture, or under another stream, would be freed while still in use)."""
        if n > self._entry_ids.numel():
            self._entry_ids = torch.arange(n, dtype=torch.int64, device=self.device)
        if self._fused is not None:
            self._fused._grow(n)
        self._prefetch_scratch(n)

    def new_fetch_list(self, capacity: int | None = None) -> FetchList:
        """A fetch list for deferred resolves of up to `capacity` entries (default: `max_selected`)."""
        n = capacity if capacity is not None else self._entry_ids.numel()
        return FetchList(torch.full((n,), -1, dtype=torch.int64, device=self.device),
                         torch.full((n,), -1, dtype=torch.int64, device=self.device),
                         torch.zeros(1, dtype=torch.int64, device=self.device))

    def fetch(self, layer: int, fetch_list: FetchList, programs: int | None = None,
              rows_per_program: int | None = None) -> None:
        """Copy what a deferred resolve left to do (FlashTrans H2D gather into the hot slots).

        `programs`: persistent copy programs (default `copy_programs`, enough for the whole GPU); fewer leave SMs to
        the compute a copy on a side stream overlaps. `rows_per_program`: the rows each program has in flight at a
        time (a power of two; default the kernel's 8): fewer programs with more rows each keep as many rows in
        flight on fewer SMs.
        """
        if self.copy_impl == "none":
            return
        src, dst = self.host.layer(layer), self.hot_entries[layer]

        def run() -> None:
            if self.copy_impl == "triton" or (self.copy_impl == "auto" and fetch_list.src.is_cuda):
                copy_rows_counted(src, dst, fetch_list.src, fetch_list.dst, fetch_list.count,
                                  programs or self.copy_programs,
                                  **({} if rows_per_program is None else dict(rows_per_program=rows_per_program)))
            else:  # the torch definition, over the first `count` pairs
                copy_rows_reference(src, dst, *fetch_list.real_pairs())

        if self.on_transfer is not None:
            self.on_transfer("h2d", run)
        else:
            run()

    def prefetch(self, layer: int, locs: torch.Tensor, fetch_list: FetchList | None = None,
                 programs: int | None = None, chained: bool = False,
                 rows_per_program: int | None = None) -> torch.Tensor:
        """Fetch the given KV locations (1-D, -1 to skip) before the exact top-k is known (ECHO prefetch).

        Like warm-up, but nothing is protected: resident entries keep their recency and new ones are stamped as the
        newest evictable entries (clock - 1), so the exact resolve of the step can always evict them (a prefetch can
        cost extra misses, never an overflow). With spare slots, a prefetch takes spare slots only, never scanning or
        evicting (three small launches on the fused path, none over the pool): what does not fit is not prefetched.
        The exact resolve that follows (`settle_prefetch=True`) counts each fetched entry as useful (selected, its
        slot still holding it) or wasted, from the fetch list, which must not be reused before then. Several
        prefetches of one layer may precede its settle (the decode stack prefetches each batch chunk as soon as its
        indexer logits exist), each into a list of its own (slices of one list are fine if they do not overlap); a
        prefetch of another layer, or one into a list still unsettled, is refused.
        `fetch_list` (at least len(locs) entries) receives what was fetched; by default a scratch list. `programs`,
        `rows_per_program`: the copy's persistent programs and rows in flight per program (see `fetch`). `chained`:
        `locs` was just written by a kernel on this stream (the prefetch candidates): on the fused path with spare
        slots, the three small launches then use programmatic dependent launch where the resolve does (`resolve_pdl`).
        Returns the int32 slot of each location (-1: skipped, or not fetched for want of an evictable or spare slot).
        """
        # the fused lookup bounds-checks every location itself (never reading outside the maps), so on that path the
        # decode stack's side stream skips the four small kernels of the torch check
        flat = self._valid_locations(locs) if self._fused is None else locs.reshape(-1).to(self.device, torch.int64)
        if fetch_list is not None:
            fetch_list.check_holds(flat.numel(), "prefetch", "candidates")
        record = fetch_list if fetch_list is not None else self._prefetch_scratch(flat.numel())
        self._check_unsettled(layer, record)
        spare_only = self.uses_spare(locs.numel())  # a prefetch never scans or evicts when it has spare slots
        if self._fused is not None:
            slots = self._fused_run(layer, flat, MODE_LOCATIONS, count=False,
                                    fetch=(Counter.PREFETCHED, Counter.H2D_ENTRIES),
                                    copy_from=None, fetch_list=record, protect=False, spare_only=spare_only,
                                    chained=chained and spare_only)
        else:
            slots, _, fetched = self._make_resident(layer, flat, copy=False, record=record, protect=False,
                                                    spare_only=spare_only)
            slots = slots.int()
            self.counters[layer, Counter.PREFETCHED] += fetched
            self.counters[layer, Counter.H2D_ENTRIES] += fetched
        self.fetch(layer, record, programs, rows_per_program)
        self._mark_unsettled(layer, record)
        return slots

    def prefetch_above(self, layer: int, scored, fetch_list: FetchList, claim_counters: torch.Tensor,
                       programs: int | None = None, chained: bool = False,
                       rows_per_program: int | None = None) -> None:
        """ECHO prefetch straight from a layer's indexer logits: `scored` (`EchoPrefetcher.scored`: the logits of
        some positions, the thresholds, margin and caps) names the candidates; they are claimed and fetched as
        `prefetch(layer, scored.candidates(...))` would, into `fetch_list` (at least B x the prefetcher's width): the
        same state under the interpreter; on a GPU the same entries wherever no cap binds (which slot each takes, and
        where a cap binds which candidates it keeps, follow the order programs reach the counters).

        With spare slots on the fused path, and the prefetcher's Triton candidates, finding and claiming them is one
        launch and a one-program close (`kernels/prefetch.claim_above_triton`, with `claim_counters` from
        `new_claim_counters`, its own for every launch that may run beside another) instead of six; the fetch list then
        holds its real pairs in the first count[0] only (every reader of this manager reads no further). Elsewhere it is
        candidates, then `prefetch` (`chained` passed on). Returns nothing: a caller that wants each candidate's slot
        uses those two.
        """
        pf = scored.prefetcher
        if scored.layer != layer:
            raise ValueError(f"prefetch_above(layer {layer}): the scores are layer {scored.layer}'s")
        fetch_list.check_holds(scored.rows * pf.width, "prefetch_above", "candidates")
        from ess_sglang.kernels.prefetch import check_claim_counters

        check_claim_counters(claim_counters, scored.rows)  # (on every path: a bad one fails here, not only on a GPU)
        if self._fused is None or self.num_spare == 0 or self.spare_max_entries is not None or \
                not pf.runs_triton(scored.logits):
            cand = scored.candidates(self.loc_to_slot[layer], self.num_locations)
            self.prefetch(layer, cand, fetch_list, programs=programs, chained=chained,
                          rows_per_program=rows_per_program)
            return
        self._check_unsettled(layer, fetch_list)
        from ess_sglang.kernels.prefetch import claim_above_triton

        claim_above_triton(*scored.triton_args(), num_locations=self.num_locations, loc_to_slot=self.loc_to_slot[layer],
                           slot_to_loc=self.slot_to_loc[layer], slot_stamp=self.slot_stamp[layer], clock=self.clock,
                           num_slots=self.slots_per_layer, spare=self.spare[layer],
                           spare_taken=self.spare_taken[layer:layer + 1], num_spare=self.num_spare,
                           fetch_src=fetch_list.src, fetch_dst=fetch_list.dst, fetch_count=fetch_list.count,
                           counters=self.counters[layer],
                           fetch_counter_ids=(int(Counter.PREFETCHED), int(Counter.H2D_ENTRIES)),
                           claim_counters=claim_counters)
        self.fetch(layer, fetch_list, programs, rows_per_program)
        self._mark_unsettled(layer, fetch_list)

    def _check_unsettled(self, layer: int, record: FetchList) -> None:
        """A prefetch of `layer` into `record` may start: no other layer's prefetch is unsettled, and no unsettled
        one of this layer shares the list."""
        if self._unsettled_prefetch is not None:
            pending_layer, pending = self._unsettled_prefetch
            if pending_layer != layer:
                raise ValueError(f"prefetch(layer {layer}): the prefetch of layer {pending_layer} is not settled "
                                 f"yet; call resolve(..., settle_prefetch=True) for that layer first")
            if any(_lists_share_memory(r, record) for r in pending):
                raise ValueError(f"prefetch(layer {layer}): its fetch list overlaps the list of a prefetch of this "
                                 f"layer that is not settled yet; give each prefetch before the settle its own list")

    def _mark_unsettled(self, layer: int, record: FetchList) -> None:
        """The prefetch into `record` is read by the exact resolve's settle."""
        if self._unsettled_prefetch is None:
            self._unsettled_prefetch = (layer, [record])
        else:
            self._unsettled_prefetch[1].append(record)

    def _prefetch_scratch(self, n: int) -> FetchList:
        have = getattr(self, "_prefetch_list", None)
        if have is None or have.src.numel() < n:  # grows outside graph capture only
            self._prefetch_list = self.new_fetch_list(max(n, 1))
        return self._prefetch_list

    def settle_pending_prefetch(self) -> None:
        """Settle whatever prefetch is still unsettled, of any layer (a caller whose step was cut short between a
        prefetch and its settle, e.g. by an exception, starts the next one clean)."""
        if self._unsettled_prefetch is not None:
            self.settle_prefetch(self._unsettled_prefetch[0])

    def settle_prefetch(self, layer: int) -> None:
        """Count the layer's unsettled prefetches, if any, once the selection's resolve has run: an entry is useful
        when its slot still holds it (it was not evicted again) and is stamped with the current step, which a prefetch
        never does (clock - 1) and a selection always does; every other prefetched entry is wasted. (So do warm-up,
        `reserve` and the protection of a new token's resident entry: between a prefetch and its settle, only the
        selection's resolves may run, as in the decode step.) It only reads the layer's maps, so it may run on another
        stream beside attention; the lists count as settled once it is queued, so a caller that runs it on another
        stream orders any later write into them (the decode stack joins the side stream at the end of each layer).
        Work follows the prefetch lists, not the pool; one launch per list on the fused path
        (`kernels/prefetch.settle_prefetch_triton`)."""
        if self._unsettled_prefetch is None or self._unsettled_prefetch[0] != layer:
            return
        records = self._unsettled_prefetch[1]
        self._unsettled_prefetch = None
        cnt = self.counters[layer]
        ids = (int(Counter.PREFETCH_USEFUL), int(Counter.PREFETCH_WASTED))
        if self._fused is not None:
            from ess_sglang.kernels.prefetch import settle_prefetch_triton

            for record in records:
                settle_prefetch_triton(record.src, record.dst, record.count, self.slot_to_loc[layer],
                                       self.slot_stamp[layer], self.clock, cnt, ids)
            return
        for record in records:
            src, dst = record.real_pairs()
            got = dst >= 0
            at = torch.where(got, dst, self.slots_per_layer)
            useful = (got & (self.slot_to_loc[layer][at].long() == src)
                      & (last_step(self.slot_stamp[layer][at]) == self.clock)).sum()
            cnt[ids[0]] += useful
            cnt[ids[1]] += got.sum() - useful

    def translate(self, topk_pos: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                  seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return positions_to_locations(topk_pos, req_to_token, req_pool_indices, seq_lens, self.num_locations)

    def write_new_tokens(self, layer: int, locs: torch.Tensor, entries: torch.Tensor,
                         reserved: bool = False, insert: bool = True,
                         entry_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Store this step's new entries: D2H into the host pool, and into hot slots (protected this step).

        locs: [n] KV locations (-1 to skip), distinct; entries: [n, entry_bytes] uint8 on the device.
        entry_rows: [n] ints: entry j is row entry_rows[j] of `entries`, then any [rows, entry_bytes] uint8 table on
        the device (e.g. an engine's KV pool), read in place where the write-back is one launch (a row outside the
        table skips entry j: nothing is read or written for it).
        reserved: every location already has a slot (`reserve`): write into it, with no lookup-and-evict pass (an
        entry without one is skipped in the hot pool and counted NOT_RESIDENT; the host copy is always written).
        insert: give entries without a slot one (a lookup-and-evict pass over the pool). False: only the write-back,
        plus the hot slot of an entry that already has one; a new token a later resolve selects is then a miss,
        fetched from the host copy just written (lossless; one resolve fewer per layer).
        Returns the slot of each entry (int64, -1 where skipped).
        """
        if entry_rows is not None:
            self._check_new_entries("write_new_tokens", locs, entries, entry_rows)
        elif locs.dim() != 1 or entries.shape != (locs.shape[0], self.entry_bytes):
            raise ValueError(f"write_new_tokens wants locs [n] and entries [n, {self.entry_bytes}], got "
                             f"{tuple(locs.shape)} and {tuple(entries.shape)}")
        no_insert = reserved or not insert
        if no_insert and self._fused is not None and self.on_transfer is None and self.copy_impl != "none":
            # one launch for what the torch path below does in ~15 (kernels/new_tokens.py)
            not_resident = int(Counter.NOT_RESIDENT) if reserved else -1
            return store_reserved_triton(entries, self.host.layer(layer), self.hot_entries[layer], locs,
                                         self.loc_to_slot[layer], self.slot_stamp[layer], self.clock,
                                         self.counters[layer], (int(Counter.D2H_ENTRIES), not_resident),
                                         self.num_locations, entry_rows=entry_rows)
        if entry_rows is not None:  # the rows, gathered (a row outside the table: its entry is skipped)
            inside = (entry_rows >= 0) & (entry_rows < entries.shape[0])
            locs = torch.where(inside, locs.to(entry_rows.device), -1)
            entries = entries[torch.where(inside, entry_rows, 0).long()] if entries.shape[0] else \
                entries.new_zeros((locs.shape[0], self.entry_bytes))
        flat = self._valid_locations(locs)
        n = flat.shape[0]
        rows = torch.arange(n, device=self.device)
        # write-back (D2H), then the same entries into their hot slots (device to device)
        self._copy(entries, self.host.layer(layer), torch.where(flat >= 0, rows, -1), flat, direction="d2h")
        if no_insert:
            slot = self._lookup(layer, flat)
            self._stamp_now(layer, slot)  # a later resolve sees them as just used, like any new token
            if reserved:
                self.counters[layer, Counter.NOT_RESIDENT] += ((flat >= 0) & (slot < 0)).sum()
        elif self._fused is not None:
            slot = self._fused_run(layer, flat, MODE_LOCATIONS, count=False, fetch=(Counter.NEW_TOKENS, -1),
                                   copy_from=None).long()
        else:
            slot = self._lookup(layer, flat)
            self._protect(layer, slot)
            new_slot = self._insert(layer, torch.where((flat >= 0) & (slot < 0), flat, -1),
                                    use_spare=self.uses_spare(n))
            slot = torch.where(slot >= 0, slot, new_slot)
            self.counters[layer, Counter.NEW_TOKENS] += (new_slot >= 0).sum()
        self._copy(entries, self.hot_entries[layer], torch.where(slot >= 0, rows, -1), slot)
        self.counters[layer, Counter.D2H_ENTRIES] += (flat >= 0).sum()
        return slot

    def warm_up(self, layer: int, locs: torch.Tensor) -> torch.Tensor:
        """Load the given KV locations (1-D, -1 to skip) of one layer into its hot pool; returns their slots."""
        flat = self._valid_locations(locs)
        if self._fused is not None:
            return self._fused_run(layer, flat, MODE_LOCATIONS, count=False,
                                   fetch=(Counter.WARMUP_ENTRIES, Counter.H2D_ENTRIES),
                                   copy_from=self.host.layer(layer)).long()
        slots, _, fetched = self._make_resident(layer, flat)
        self.counters[layer, Counter.WARMUP_ENTRIES] += fetched
        self.counters[layer, Counter.H2D_ENTRIES] += fetched
        return slots

    def reserve(self, layer: int, locs: torch.Tensor) -> torch.Tensor:
        """Give the given KV locations (1-D, -1 to skip) slots without loading anything: for tokens still to come,
        so that `write_new_tokens(..., reserved=True)` can store them directly. Returns their slots."""
        flat = self._valid_locations(locs)
        if self._fused is not None:
            return self._fused_run(layer, flat, MODE_LOCATIONS, count=False, fetch=(-1, -1), copy_from=None).long()
        return self._make_resident(layer, flat, copy=False)[0]

    def release(self, locs: torch.Tensor) -> None:
        """Forget the given KV locations in every layer (a request finished or was aborted): frees their slots."""
        flat = locs.reshape(-1).long().to(self.device)
        ok = (flat >= 0) & (flat < self.num_locations)
        at = torch.where(ok, flat, self.num_locations).unsqueeze(0).expand(self.num_layers, -1)
        slot = torch.where(ok, self.loc_to_slot.gather(1, at).long(), -1)
        to_sink = torch.where(slot >= 0, slot, self.slots_per_layer)
        self.slot_to_loc.scatter_(1, to_sink, -1)
        self.slot_stamp.scatter_(1, to_sink, FREE_STAMP)
        self.loc_to_slot.scatter_(1, at, -1)

    # ------------------------------------------------------------------ internals
    def _fused_run(self, layer: int, src: torch.Tensor, mode: int, count: bool, fetch: tuple[int, int],
                   copy_from: torch.Tensor | None, fetch_list: FetchList | None = None, protect: bool = True,
                   spare_only: bool = False, chained: bool = False, **tables) -> torch.Tensor:
        inserted = tables.get("insert_locs")
        entries = src.numel() + (inserted.numel() if inserted is not None else 0)
        slots = self._fused.run(
            src=src.contiguous(), mode=mode, l2s=self.loc_to_slot[layer], s2l=self.slot_to_loc[layer],
            stamp=self.slot_stamp[layer], clock=self.clock, counters=self.counters[layer], count=count,
            fetch_counters=(int(fetch[0]), int(fetch[1])), counter_ids=_COUNTER_IDS,
            copy_from=copy_from if self.copy_impl != "none" else None, hot=self.hot_entries[layer],
            fetch_list=(fetch_list.src, fetch_list.dst, fetch_list.count) if fetch_list is not None else None,
            protect=protect, spare=self.spare[layer], spare_taken=self.spare_taken[layer:layer + 1],
            spare_only=spare_only, chained=chained, use_spare=self.uses_spare(entries), **tables)
        if fetch_list is not None:  # the assign kernel writes the first n pairs only (the inserted tokens count)
            fetch_list.clear_from(entries)
        return slots

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor,
              direction: str | None = None) -> None:
        """Every FlashTrans call of the manager; PCIe ones (`direction` "h2d" / "d2h") go through `on_transfer`."""
        if self.copy_impl == "none":
            return

        def run() -> None:
            copy_rows(src, dst, src_rows, dst_rows, self.copy_impl)

        if direction is not None and self.on_transfer is not None:
            self.on_transfer(direction, run)
        else:
            run()

    def _check_new_entries(self, caller: str, locs: torch.Tensor, entries: torch.Tensor,
                           entry_rows: torch.Tensor) -> None:
        """New tokens read in place from rows of a table: locs [n], entry_rows [n] ints, entries [rows, entry_bytes]
        (uint8 on the manager's device, rows of whole 4-byte words, for the kernels that read them)."""
        if locs.dim() != 1 or entry_rows.shape != locs.shape or entry_rows.dtype.is_floating_point \
                or entry_rows.dtype == torch.bool or locs.dtype.is_floating_point or locs.dtype == torch.bool \
                or entries.dim() != 2 or entries.shape[1] != self.entry_bytes:
            raise ValueError(f"{caller} wants locs [n] and entry_rows [n] ints and entries [rows, "
                             f"{self.entry_bytes}], got {tuple(locs.shape)} {locs.dtype}, {tuple(entry_rows.shape)} "
                             f"{entry_rows.dtype} and {tuple(entries.shape)}")
        if entries.dtype != torch.uint8 or not _same_device(entries.device, self.device) or entries.stride(1) != 1 \
                or entries.stride(0) % 4 or entries.storage_offset() % 4:
            raise ValueError(f"{caller}: entries must be uint8 rows on {self.device} starting and strided on whole "
                             f"4-byte words, got {entries.dtype} on {entries.device} with strides "
                             f"{tuple(entries.stride())} at offset {entries.storage_offset()}")

    def _valid_locations(self, locs: torch.Tensor) -> torch.Tensor:
        """KV locations as a flat int64 device tensor, -1 where outside [0, num_locations) (never read)."""
        flat = locs.reshape(-1).long().to(self.device)
        return torch.where((flat >= 0) & (flat < self.num_locations), flat, -1)

    def _lookup(self, layer: int, flat: torch.Tensor) -> torch.Tensor:
        """Slot of each location (int64, -1 when not resident or when the location is -1)."""
        at = torch.where(flat >= 0, flat, self.num_locations)
        return torch.where(flat >= 0, self.loc_to_slot[layer][at].long(), -1)

    def _stamp_now(self, layer: int, slot: torch.Tensor) -> None:
        """Stamp slots (-1 skipped) with the clock: filled or written in this step, protected, no decay bonus."""
        self.slot_stamp[layer].scatter_(0, torch.where(slot >= 0, slot, self.slots_per_layer),
                                        self.clock.expand(slot.shape[0]))

    def _protect(self, layer: int, slot: torch.Tensor) -> None:
        """Slots (-1 skipped) selected in this step: stamped with the clock (`_stamp_now`), or with decayed retention
        with the clock and their new bonus (`kernels.resolve._stamp_selected`); one stamped already in this step keeps
        its stamp, so that duplicates count once."""
        if self.decay is None:
            return self._stamp_now(layer, slot)
        at = torch.where(slot >= 0, slot, self.slots_per_layer)
        b = self._age_bucket(self.slot_stamp[layer][at])
        again = (slot >= 0) & (b > 0)
        new = self.clock + (self.decay.bonus[b] << BONUS_SHIFT)
        self.slot_stamp[layer].scatter_(0, torch.where(again, at, self.slots_per_layer), new)

    def _age_bucket(self, stamp: torch.Tensor) -> torch.Tensor:
        """`kernels.resolve.stamp_age`: 0 (selected this step, or spare) to AGE_BUCKETS - 1 (oldest, or free)."""
        A = AGE_BUCKETS
        if self.decay is None:
            return (self.clock - stamp).clamp(0, A - 1)
        last = last_step(stamp)
        q = self.decay.units * (self.clock - last) - torch.where(stamp < 0, 0, stamp >> BONUS_SHIFT) + self.decay.offset
        return torch.where(last >= self.clock, 0, q.clamp(1, A - 1))

    def _make_resident(self, layer: int, flat: torch.Tensor, copy: bool = True, record: FetchList | None = None,
                       protect: bool = True, spare_only: bool = False,
                       fresh_from: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Lookup, protect, deduplicate and fetch the misses of `flat` (int64 locations, -1 skipped).

        `copy`: copy the misses now; `record`: also write their (location, slot) pairs to this fetch list;
        `protect` False (prefetch): hits keep their stamps, new entries are stamped clock - 1 (evictable);
        `spare_only`: misses take spare slots only (see `_insert`); `fresh_from`: the entries from this index on are
        this step's tokens (`NewTokens.insert`): they get slots but are neither copied, recorded nor counted, and the
        hits are returned as (the selection's, the tokens').

        Returns (slot of every entry, number of hits, number of distinct entries fetched), counts as device tensors.
        """
        n = flat.shape[0]
        if n > self._entry_ids.numel():  # grows outside graph capture only: size it with `max_selected`
            self._entry_ids = torch.arange(n, dtype=torch.int64, device=self.device)
        l2s = self.loc_to_slot[layer]
        sink = self.num_locations
        slot = self._lookup(layer, flat)
        hit = slot >= 0
        if protect:
            self._protect(layer, slot)
        # Dedup: every missing entry claims its location in the map with -2 - (its index); the largest claim, i.e.
        # the first entry naming the location, wins (a deterministic reduction, so replays assign the same slots).
        # The winner is the representative that gets a slot; the others read that slot afterwards.
        miss = (flat >= 0) & ~hit
        miss_at = torch.where(miss, flat, sink)
        claim = (-2 - self._entry_ids[:n]).to(torch.int32)
        l2s.scatter_reduce_(0, miss_at, claim, reduce="amax", include_self=False)
        rep = miss & (l2s[miss_at] == claim)
        new_slot = self._insert(layer, torch.where(rep, flat, -1), stamp_back=0 if protect else 1,
                                spare_only=spare_only, use_spare=self.uses_spare(n))
        l2s.scatter_(0, torch.where(rep & (new_slot < 0), flat, sink), -1)  # overflowed claims: back to "absent"
        slot = torch.where(miss, l2s[miss_at].long().clamp(min=-1), slot)
        fetched = new_slot >= 0
        if fresh_from is not None:
            fetched[fresh_from:] = False
            hit = torch.stack([hit[:fresh_from].sum(), hit[fresh_from:].sum()])
        fetch_src = torch.where(fetched, flat, -1)
        fetch_dst = torch.where(fetched, new_slot, -1)
        if record is not None:
            record.src[:n].copy_(fetch_src)
            record.dst[:n].copy_(fetch_dst)
            record.clear_from(n)
            record.count.fill_(n)
        if copy:
            self._copy(self.host.layer(layer), self.hot_entries[layer], fetch_src, fetch_dst, direction="h2d")
        return slot, hit if fresh_from is not None else hit.sum(), fetched.sum()

    def _insert(self, layer: int, flat: torch.Tensor, stamp_back: int = 0, spare_only: bool = False,
                use_spare: bool = True) -> torch.Tensor:
        """Give each location in `flat` (distinct, not resident; -1 skipped) a slot: the layer's spare slots first,
        in order, then LRU victims (evicted); `spare_only` (a prefetch with spare slots): no victims; `use_spare`
        False: the spare slots are left alone (LRU victims only).

        Returns the slot of each (int64, -1 where skipped or where no slot was left: counted as overflow, except
        where `spare_only`).
        """
        n = flat.shape[0]
        need = flat >= 0
        n_need = need.sum()
        rank = (need.cumsum(0) - 1).clamp(min=0)
        taken = self.spare_taken[layer]
        avail = self.num_spare - taken if use_spare else torch.zeros_like(taken)
        spare = self.spare[layer][(taken + rank).clamp(max=self.num_spare)].long()
        victims = self._take_victims(layer, (n_need - avail).clamp(min=0) * (not spare_only), n)
        slot = torch.where(need, torch.where(rank < avail, spare, victims[(rank - avail).clamp(min=0)]), -1)
        if use_spare:
            self.spare_taken[layer] = (taken + n_need).clamp(max=self.num_spare)
        got = slot >= 0
        if not spare_only:
            self.counters[layer, Counter.OVERFLOW] += (need & ~got).sum()
        slot_at = self._evict_owners(layer, slot, got)
        self.slot_to_loc[layer].scatter_(0, slot_at, flat.to(torch.int32))
        self.loc_to_slot[layer].scatter_(0, torch.where(got, flat, self.num_locations), slot.to(torch.int32))
        self.slot_stamp[layer].scatter_(0, slot_at, (self.clock - stamp_back).expand(n))
        return slot

    def _evict_owners(self, layer: int, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Unmap the tokens that the `mask`ed `slots` hold (counted as evictions); returns the slots with the sink
        where not masked, for the caller's writes to them."""
        at = torch.where(mask, slots, self.slots_per_layer)
        old = torch.where(mask, self.slot_to_loc[layer][at].long(), -1)
        self.loc_to_slot[layer].scatter_(0, torch.where(old >= 0, old, self.num_locations), -1)
        self.counters[layer, Counter.EVICTIONS] += (old >= 0).sum()
        return at

    def refill_spares(self, layer: int) -> None:
        """Replace the layer's spare slots taken since the last refill with its least-recently-used unprotected
        slots, evicted (fewer when fewer are evictable; the next refill tries again), when the refill is due
        (`refill_due`; otherwise nothing changes). Nothing is copied; no host synchronisation. Entries selected in
        this step (and new tokens' reserved slots) are protected, so it may run while attention reads this step's
        slots. On the fused path it shares its scratch with every resolve and prefetch: order it with them (the
        decode stack queues it on its side stream, behind which the next layer's prefetches queue, and joins that
        stream before the next exact resolve). Nothing is launched after a resolve of the layer that left the spare
        slots alone (`spare_max_entries`): a CUDA graph of such a batch then holds no refill."""
        if not self.refill_follows(layer):
            return
        K, phase = self.refill_interval, layer % self.refill_interval
        if self._fused is not None:
            self._fused.refill(l2s=self.loc_to_slot[layer], s2l=self.slot_to_loc[layer], stamp=self.slot_stamp[layer],
                               clock=self.clock, counters=self.counters[layer], counter_ids=_COUNTER_IDS,
                               spare=self.spare[layer], spare_taken=self.spare_taken[layer:layer + 1], phase=phase,
                               interval=K)
            return
        R = self.num_spare
        taken = self.spare_taken[layer]
        need = torch.where(self.refill_due(layer), taken, 0)
        victims = self._take_victims(layer, need, R)  # in the order the resolve's scan would take them (none: -1)
        got = victims >= 0
        found = got.sum()
        at = self._evict_owners(layer, victims, got)
        self.slot_to_loc[layer].scatter_(0, at, -1)
        self.slot_stamp[layer].scatter_(0, at, SPARE_STAMP)
        # victim j becomes spare slot taken - found + j: the free ones stay one run, [taken, R)
        place = torch.where(got, taken - found + torch.arange(R, device=self.device), R)
        self.spare[layer].scatter_(0, place, victims.to(torch.int32))
        self.spare_taken[layer] = taken - found

    def refill_due(self, layer: int) -> torch.Tensor:
        """Whether the layer's refill runs in this step (a 0-dim bool on the device): with refill interval K, in the
        steps where clock + layer is a multiple of K, and in any step where fewer than num_spare / K spare slots are
        left ((num_spare - taken) x K < num_spare); with K = 1 in every step. (Without spare slots `refill_spares`
        does nothing, due or not.)"""
        K = self.refill_interval
        taken = self.spare_taken[layer]
        return ((self.clock + layer % K) % K == 0) | ((self.num_spare - taken) * K < self.num_spare)

    def _take_victims(self, layer: int, n_need: torch.Tensor, max_need: int) -> torch.Tensor:
        """The `n_need` least-recently-used unprotected slots, as a list of `max_need` (int64, -1 padded).

        Ages (clock - stamp, clamped to AGE_BUCKETS - 1) are histogrammed; the threshold age T is the largest one with
        at least n_need slots at or above it. All slots older than T are taken, then slots of age exactly T by slot
        index until n_need are taken. Age 0 means "selected this step" (or spare): never taken.
        """
        A = AGE_BUCKETS
        age = self._age_bucket(self.slot_stamp[layer, : self.slots_per_layer])
        hist = torch.zeros(A, dtype=torch.int64, device=self.device).scatter_add_(0, age, self._ones)
        at_or_above = hist.flip(0).cumsum(0).flip(0)
        eligible = (at_or_above >= n_need) & (self._age_ids >= 1)
        T = (eligible.long() * self._age_ids).amax().clamp(min=1)
        n_above = torch.where(T + 1 < A, at_or_above.gather(0, (T + 1).clamp(max=A - 1).view(1)), 0)  # no .item()
        above = age > T
        at_T = age == T
        rank_T = at_T.cumsum(0) - 1
        take_T = at_T & (rank_T < n_need - n_above)
        # the list holds the slots older than T (in slot order), then the ones taken at age T
        order = torch.where(above, above.cumsum(0) - 1, n_above + rank_T)
        victims = torch.full((max_need + 1,), -1, dtype=torch.int64, device=self.device)
        victims.scatter_(0, torch.where((above | take_T) & (order < max_need), order, max_need), self._slot_ids)
        return victims[:max_need]

    # ------------------------------------------------------------------ checks (tests, debugging; synchronise)
    def resident_count(self, layer: int) -> int:
        return int((self.slot_to_loc[layer, : self.slots_per_layer] >= 0).sum())

    def check_invariants(self, live_locs: torch.Tensor | None = None) -> None:
        """Assert the maps agree: no slot owned twice, token->slot and slot->token are inverse, stamps consistent.

        `live_locs`, when given, are the locations held by live requests: nothing else may be resident.
        """
        S, T = self.slots_per_layer, self.num_locations
        for layer in range(self.num_layers):
            s2l = self.slot_to_loc[layer, :S].long().cpu()
            l2s = self.loc_to_slot[layer, :T].long().cpu()
            stamp = self.slot_stamp[layer, :S].cpu()
            used = s2l >= 0
            owners = s2l[used]
            assert owners.unique().numel() == owners.numel(), f"layer {layer}: a token owns two slots"
            assert torch.equal(l2s[owners], torch.nonzero(used).view(-1)), f"layer {layer}: slot->token != token->slot"
            resident = l2s >= 0
            assert int(resident.sum()) == int(used.sum()), f"layer {layer}: resident counts differ"
            assert torch.equal(s2l[l2s[resident]], torch.nonzero(resident).view(-1)), (
                f"layer {layer}: token->slot != slot->token")
            assert bool((l2s >= -1).all()), f"layer {layer}: a dedup claim was left in the token map"
            spare = self.spare[layer, int(self.spare_taken[layer]): self.num_spare].long().cpu()
            assert spare.unique().numel() == spare.numel(), f"layer {layer}: a spare slot is listed twice"
            assert bool((spare >= 0).all() & (spare < S).all()), f"layer {layer}: a spare slot out of range"
            is_spare = torch.zeros(S, dtype=torch.bool)
            is_spare[spare] = True
            assert not bool((is_spare & used).any()), f"layer {layer}: a spare slot holds a token"
            assert torch.equal(stamp == SPARE_STAMP, is_spare), f"layer {layer}: spare stamps != spare list"
            assert bool((stamp[~used & ~is_spare] == FREE_STAMP).all()), f"layer {layer}: a free slot has a stamp"
            assert bool(((stamp[used] > FREE_STAMP) & (last_step(stamp[used]) < SPARE_STAMP)).all()), (
                f"layer {layer}: a used slot has the free or spare stamp")
            if live_locs is not None:
                live = torch.zeros(T, dtype=torch.bool)
                live[live_locs.long().cpu()] = True
                assert bool(live[owners].all()), f"layer {layer}: a slot holds a token of no live request"

    @property
    def pdl(self) -> bool:
        """Whether the fused resolve's kernels use programmatic dependent launch (`resolve_pdl`)."""
        return self._fused is not None and self._fused.pdl

    @property
    def hot_pool_bytes(self) -> int:
        return self.num_layers * self.slots_per_layer * self.entry_bytes
