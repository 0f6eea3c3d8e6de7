"""Store this step's new latent entries into slots reserved for them, in one launch.

When every live token of a batch fits the hot pools, each request's next tokens get slots ahead of time
(`HotPoolCacheManager.reserve`), and storing a new token is, per entry (the same kernel, without the NOT_RESIDENT
count, writes new tokens back that are fetched on demand when selected: `write_new_tokens(..., insert=False)`):

    host[loc]  = entry                      (D2H write-back into the pinned total pool, through UVA)
    hot[slot]  = entry, stamp[slot] = clock  where slot = loc_to_slot[loc] is a slot (protected this step)
    counters:  D2H_ENTRIES += 1;  NOT_RESIDENT += 1 where the location has no slot after all

for every location with 0 <= loc < num_locations (others are skipped, as in the torch path). With `entry_rows`
the entries are read in place from rows of a larger table (e.g. the new-token slots of an engine's KV pool; a row
outside the table skips its entry), instead of from a gathered [n, entry_bytes] tensor. The plain-torch
definition is `HotPoolCacheManager.write_new_tokens(..., reserved=True)` with `resolve_impl="torch"`; before this
kernel that path was ~15 small launches on the decode stack's side stream, which small batches could not hide.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 4  # entries per program (a decode step stores one or two per request)


@triton.jit
def _store_entries(entries_ptr, src, entry_stride, host_ptr, loc, hot_ptr, slot, stamp_ptr, clock_ptr, ok, resident,
                   WORDS: tl.constexpr, HOST_STRIDE: tl.constexpr, HOT_STRIDE: tl.constexpr,
                   BLOCK_WORDS: tl.constexpr):
    """Entry rows `src` of the entries table (where ok) into host rows `loc`, and into hot slots `slot` where
    resident, those stamped with the clock (protected this step). Also the resolve's write-back of new tokens."""
    tl.store(stamp_ptr + slot, tl.zeros_like(slot) + tl.load(clock_ptr), mask=resident)
    w = tl.arange(0, BLOCK_WORDS)
    cols = (w < WORDS)[None, :]
    vals = tl.load(entries_ptr + src[:, None] * entry_stride + w[None, :], mask=ok[:, None] & cols)
    tl.store(host_ptr + loc[:, None] * HOST_STRIDE + w[None, :], vals, mask=ok[:, None] & cols)
    tl.store(hot_ptr + slot[:, None] * HOT_STRIDE + w[None, :], vals, mask=resident[:, None] & cols)


@triton.jit(do_not_specialize=("n",))
def _store_reserved_kernel(entries_ptr, host_ptr, hot_ptr, locs_ptr, l2s_ptr, stamp_ptr, clock_ptr, cnt_ptr,
                           slots_out_ptr, n, num_locations, num_slots, rows_ptr, entry_stride, entry_rows,
                           WORDS: tl.constexpr, HOST_STRIDE: tl.constexpr, HOT_STRIDE: tl.constexpr,
                           BLOCK_WORDS: tl.constexpr, C_D2H: tl.constexpr, C_NOT_RESIDENT: tl.constexpr,
                           ROWS: tl.constexpr, GATHER: tl.constexpr = False):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m = r < n
    loc = tl.load(locs_ptr + r, mask=m, other=-1).to(tl.int64)
    src = r.to(tl.int64)
    if GATHER:  # entry r is row rows[r] of a larger table (read in place); a row outside it skips the entry
        src = tl.load(rows_ptr + r, mask=m, other=-1).to(tl.int64)
        m = m & (src >= 0) & (src < entry_rows)
    ok = m & (loc >= 0) & (loc < num_locations)
    slot = tl.load(l2s_ptr + loc, mask=ok, other=-1).to(tl.int64)
    resident = ok & (slot >= 0) & (slot < num_slots)
    _store_entries(entries_ptr, src, entry_stride, host_ptr, loc, hot_ptr, slot, stamp_ptr, clock_ptr, ok, resident,
                   WORDS, HOST_STRIDE, HOT_STRIDE, BLOCK_WORDS)
    tl.store(slots_out_ptr + r, tl.where(resident, slot, -1), mask=r < n)
    tl.atomic_add(cnt_ptr + C_D2H, tl.sum(ok.to(tl.int64)), sem="relaxed")
    if C_NOT_RESIDENT >= 0:
        tl.atomic_add(cnt_ptr + C_NOT_RESIDENT, tl.sum((ok & ~resident).to(tl.int64)), sem="relaxed")


def store_reserved_triton(entries: torch.Tensor, host_layer: torch.Tensor, hot_layer: torch.Tensor,
                          locs: torch.Tensor, loc_to_slot: torch.Tensor, slot_stamp: torch.Tensor,
                          clock: torch.Tensor, counters: torch.Tensor, counter_ids: tuple[int, int],
                          num_locations: int, entry_rows: torch.Tensor | None = None) -> torch.Tensor:
    """entries [n, entry_bytes] uint8 (device); host_layer / hot_layer [rows, entry_bytes] uint8 (the host layer as
    its UVA view on a GPU); locs [n] KV locations (-1 to skip, distinct), stored where 0 <= loc < num_locations
    (<= host rows); loc_to_slot [locations + 1] int32 and slot_stamp [slots + 1] int64 of the layer; clock a 0-d
    int64 tensor; counters the layer's int64 counters, counter_ids (D2H_ENTRIES, NOT_RESIDENT; -1: not counted,
    for new tokens that are not meant to be resident). `entry_rows` [n] (int): entry j is row entry_rows[j] of
    `entries`, then any [rows, entry_bytes] table (e.g. an engine's KV pool), read in place; a row outside it skips
    entry j. Returns the int64 slot of each entry, -1 where it was not stored in the hot pool (skipped or without a
    slot)."""
    n = locs.shape[0]
    eb = entries.shape[1] if entries.dim() == 2 else -1
    if locs.dim() != 1 or (entry_rows is None and entries.shape[0] != n) or eb < 0 or host_layer.shape[1] != eb \
            or hot_layer.shape[1] != eb or (entry_rows is not None and entry_rows.shape != (n,)):
        raise ValueError(f"store_reserved_triton wants locs [n], entries [n, B] (or [rows, B] with entry_rows [n]) "
                         f"and pools [rows, B], got {tuple(locs.shape)}, {tuple(entries.shape)}, "
                         f"{tuple(host_layer.shape)}, {tuple(hot_layer.shape)}"
                         + ("" if entry_rows is None else f", entry_rows {tuple(entry_rows.shape)}"))
    if not 0 <= num_locations <= host_layer.shape[0] or loc_to_slot.shape[0] < num_locations:
        raise ValueError(f"store_reserved_triton: num_locations {num_locations} exceeds the host layer's "
                         f"{host_layer.shape[0]} rows or the {loc_to_slot.shape[0]}-entry location map")
    if eb % 4 or host_layer.stride(1) != 1 or hot_layer.stride(1) != 1 or host_layer.stride(0) % 4 \
            or hot_layer.stride(0) % 4 \
            or (entry_rows is not None and (entries.stride(1) != 1 or entries.stride(0) % 4)):
        raise ValueError("store_reserved_triton moves 4-byte words: entry bytes and row strides must be multiples of 4")
    slots = torch.empty(n, dtype=torch.int64, device=locs.device)
    if n == 0:
        return slots
    words = eb // 4
    table = entries.contiguous() if entry_rows is None else entries
    _store_reserved_kernel[(triton.cdiv(n, ROWS),)](
        table.view(torch.int32), host_layer.view(torch.int32), hot_layer.view(torch.int32),
        locs.contiguous(), loc_to_slot, slot_stamp, clock, counters, slots, n, num_locations, hot_layer.shape[0],
        locs if entry_rows is None else entry_rows.contiguous(), table.stride(0) // 4, table.shape[0],
        WORDS=words, HOST_STRIDE=host_layer.stride(0) // 4, HOT_STRIDE=hot_layer.stride(0) // 4,
        BLOCK_WORDS=triton.next_power_of_2(words), C_D2H=counter_ids[0], C_NOT_RESIDENT=counter_ids[1], ROWS=ROWS,
        GATHER=entry_rows is not None, num_warps=2)
    return slots
