"""An emulation, in numpy, of SGLang 0.5.23 HiSparse's per-request hot-buffer policy (which entries hit and miss).

Read from the sglang 0.5.23 wheel (paths below are inside the `sglang` package; line numbers of that release):

Kernel `load_cache_to_device_buffer_kernel` (`kernels/jit/csrc/kvcacheio/hisparse.cuh`), one thread block per request,
one launch per layer, called by `HiSparseCoordinator._run_swap_in_kernel` (`srt/managers/hisparse_coordinator.py:1467`)
with `hot_buffer_size = device_buffer_size` and a 2-D top-k (one query token; MTP goes through a separate spec path):

- State per request and layer: `device_buffer_tokens[slot]` (which token position a slot holds, -1 = none) for
  `HOT_BUFFER_SIZE` LRU slots plus one extra page whose first slot (index HOT_BUFFER_SIZE) holds the newest token
  (.cuh:326-330), and `lru_slots`, an int16 permutation of the HOT_BUFFER_SIZE slots, least recently used first
  (.cuh:673, `coordinator:690-697`, initialised to 0, 1, 2, ...).
- Fast path: `seq_len <= HOT_BUFFER_SIZE` -> every token lives in the buffer at slot = position; all hits, the LRU
  order is not touched (.cuh:418-440).
- Otherwise: the selected position `seq_len - 1` (the newest token) is a hit in the extra page (.cuh:493-497). Every
  other selected position is hashed (.cuh:483-510); the LRU slots are scanned in LRU order and a slot whose token is
  selected is a hit, every other slot is evictable (.cuh:513-594). Misses are the selected positions not found, in
  top-k order; miss number m takes the m-th evictable slot in LRU order (the least recently used first) and is
  copied from the host (.cuh:603-664, 709-721). Exact LRU at step granularity, not CLOCK.
- New LRU order (.cuh:673-707): [evictable slots not taken, in their old order] + [the slots just filled, in miss
  order] + [the hit slots, in their old relative order] -- so within one step, filled slots rank older than hits.
- -1 padding equals `TOKEN_HIT` (0xFFFFFFFF) and is skipped as a hit (.cuh:27, 508, 619); we count only valid
  positions as lookups, as ESS does.

Newly decoded tokens (`coordinator:1100-1263`): the token decoded in a step is written to the extra page's slot
(`map_last_loc_to_buffer`, reserved position min(seq_len - 1, device_buffer_size)); at the next step it is backed up
to the host (`_eager_backup_previous_token`) and the slot is reused, so for a long request every decoded token leaves
the device after one step and is a miss when selected later. While `seq_len <= device_buffer_size` the token goes to
slot seq_len - 1 and stays.

Warm-up (`alloc_device_buffer`, `coordinator:937-985`): `device_buffer_tokens[:device_buffer_size] = arange`, i.e. the
prompt's first device_buffer_size tokens are resident (the allocator keeps their prefill device locations,
`mem_cache/allocator/hisparse.py:160-194`) -- the "staged" path of a non-PD server (`admit_request_into_staging`,
`collect_ready_reqs`). On a PD decode server (`admit_request_direct`, `coordinator:878-910`), a prompt longer than the
buffer starts with every slot empty (all misses), a shorter one is preloaded in full from the host.

Sizes (`srt/mem_cache/sparsity/factory.py:79-80`): `device_buffer_size` defaults to 2 x top_k (4096 for DeepSeek's
2048); the extra page is one page of the device pool (64 tokens for DSA). Per request and layer: 4096 + 64 slots.
"""

from __future__ import annotations

import numpy as np

from ess_sglang.traces import ReplayStats, TopKTrace

WARM_MODES = ("staged", "pd_direct")


class HiSparseBuffer:
    """The hot buffer of one request in one layer, with HiSparse's policy (see the module docstring)."""

    def __init__(self, hot_buffer_size: int, prompt_len: int, max_len: int, warm: str = "staged"):
        if warm not in WARM_MODES:
            raise ValueError(f"warm must be one of {WARM_MODES}, got {warm!r}")
        if hot_buffer_size <= 0 or hot_buffer_size > np.iinfo(np.int16).max:
            raise ValueError(f"hot_buffer_size must be in [1, 32767] (int16 LRU order), got {hot_buffer_size}")
        H = hot_buffer_size
        self.hot_buffer_size = H
        self.order = np.arange(H, dtype=np.int64)  # lru_slots: least recently used first
        self.slot_token = np.full(H, -1, dtype=np.int64)  # device_buffer_tokens[:H]
        self.token_slot = np.full(max(max_len, H) + 1, -1, dtype=np.int64)  # inverse map (the kernel hashes instead)
        self.warmup_entries = 0  # entries loaded from the host before decode
        self.prompt_len = prompt_len
        self.decoded_misses = 0  # misses on tokens decoded after the prompt (backed up, then dropped)
        if warm == "staged" or prompt_len <= H:
            # alloc_device_buffer: tokens 0 .. H-1 at slots 0 .. H-1 (positions not decoded yet are filled later,
            # each in its own slot, while seq_len <= H)
            self.slot_token[:] = np.arange(H)
            self.token_slot[:H] = np.arange(H)
            if warm == "pd_direct":  # _preload_to_device_buffer: the whole (short) prompt comes from the host
                self.warmup_entries = prompt_len

    def step(self, selected: np.ndarray, seq_len: int) -> tuple[int, int]:
        """One swap-in: `selected` are this step's positions in top-k order (-1 padding allowed). Returns (hits,
        misses); misses are the entries copied from the host."""
        sel = np.asarray(selected, dtype=np.int64)
        sel = sel[sel >= 0]
        H = self.hot_buffer_size
        if seq_len <= H:  # fast path: everything resident, LRU untouched
            return int(sel.size), 0
        newest = sel == seq_len - 1
        rest = sel[~newest]
        slot = self.token_slot[rest]
        hit = slot >= 0
        hit_slot = np.zeros(H, dtype=bool)
        hit_slot[slot[hit]] = True
        in_order = hit_slot[self.order]
        hits_lru = self.order[in_order]
        evictable = self.order[~in_order]
        miss_tokens = rest[~hit]
        M = miss_tokens.size
        self.decoded_misses += int((miss_tokens >= self.prompt_len).sum())
        victims = evictable[:M]
        old = self.slot_token[victims]
        self.token_slot[old[old >= 0]] = -1
        self.slot_token[victims] = miss_tokens
        self.token_slot[miss_tokens] = victims
        self.order = np.concatenate([evictable[M:], victims, hits_lru])
        return int(hit.sum() + newest.sum()), int(M)

    def resident(self) -> set[int]:
        """Token positions held in the LRU slots (the extra page's newest token not included)."""
        return {int(t) for t in self.slot_token if t >= 0}

    def lru_tokens(self) -> list[int]:
        """Tokens of the LRU slots, least recently used first (-1 for an empty slot)."""
        return [int(self.slot_token[s]) for s in self.order]


def replay_hisparse(trace: TopKTrace, hot_buffer_size: int, warm: str = "staged",
                    extra_page: int = 64) -> ReplayStats:
    """Replay `trace` through HiSparse's per-request, per-layer buffers of `hot_buffer_size` LRU slots.

    `extra_page` only sizes the reported memory (slots_per_layer = batch x (hot_buffer_size + extra_page)); the policy
    uses its first slot for the newest token.
    """
    trace.validate()
    S, L, B, _ = trace.topk.shape
    prompts = trace.prompt_lens
    max_len = int(trace.seq_lens.max())
    lookups = np.zeros(L, dtype=np.int64)
    misses = np.zeros(L, dtype=np.int64)
    warmup = np.zeros(L, dtype=np.int64)
    first_step = decoded = 0
    for layer in range(L):
        bufs = [HiSparseBuffer(hot_buffer_size, int(prompts[b]), max_len, warm) for b in range(B)]
        warmup[layer] = sum(b.warmup_entries for b in bufs)
        for s in range(S):
            for b in range(B):
                h, m = bufs[b].step(trace.topk[s, layer, b], int(trace.seq_lens[s, b]))
                lookups[layer] += h + m
                misses[layer] += m
                first_step += m if s == 0 else 0
        decoded += sum(b.decoded_misses for b in bufs)
    return ReplayStats(policy="hisparse", lookups=lookups, misses=misses, warmup_entries=warmup,
                       slots_per_layer=B * (hot_buffer_size + extra_page),
                       extra=dict(warm=warm, hot_buffer_size=hot_buffer_size, extra_page=extra_page,
                                  first_step_misses=first_step, decoded_token_misses=decoded))
