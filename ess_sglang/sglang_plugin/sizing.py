"""Pool sizing with ESS: how SGLang's HiSparse pools are laid out when ESS drives them.

SGLang's HiSparse allocator has two address spaces: *logical* KV locations (``req_to_token``; every one has an
indexer K entry on the GPU, ``index_buf_size = size * host_to_device_ratio``) and *physical* latent slots in the
device pool (``size``, what the pool configurator's ``max_total_num_tokens`` sets). Without ESS, HiSparse sizes the
device pool from the GPU budget and the host pool as ``host_to_device_ratio`` x the device pool. With ESS:

* the host pool (pinned, latent entries) holds ``ess_config.memory_pool_size_gb`` (or max_running_requests x
  context) tokens, capped by how many indexer entries the GPU can hold;
* the device pool holds only what ESS needs on the GPU: the hot pools (``hot_slots_per_layer``, sized by
  ``max_gpu_buffer_size_gb``, ``hot_slots_per_layer`` or ``sparse_memory_ratio`` x the host pool), one slot per
  request row for the token being decoded (plus as many again, which SGLang's PD admission counts as per-request
  device room), and, in colocated serving, room for one prompt's prefill before it is staged to host memory;
* every remaining GPU byte goes to indexer entries, i.e. logical locations: more and longer requests.

The HiSparse ratio is an integer, so the plan picks the (device slots, ratio) pair that holds the most logical
locations within the GPU budget and the host pool. ``size_pools`` is plain arithmetic (no SGLang, no torch); the
hooks at the bottom feed it SGLang's profiled budget.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from ess_sglang.config import (
    DEFAULT_SPARSE_MEMORY_RATIO,
    GIB,
    Deployment,
    EssConfig,
    EssConfigError,
    PoolPlan,
    round_up,
)
from ess_sglang.formats import INDEXER_ENTRY_BYTES as INDEXER_BYTES  # indexer K entry per token and layer
from ess_sglang.formats import LATENT_ENTRY_BYTES as LATENT_BYTES  # FlashMLA V32 entry per token and layer

logger = logging.getLogger("ess_sglang.sglang_plugin")

MAP_BYTES_PER_LOCATION = 4  # HotPoolCacheManager.loc_to_slot (int32) per location and layer
MAP_BYTES_PER_SLOT = 12  # slot_to_loc (int32) + slot_stamp (int64) per hot slot and layer
MAX_RUNNING_SEARCH = 4096
HOST_MEMORY_FRACTION = 0.8
"""Share of the machine's memory the host pool may take when ess_config.memory_pool_size_gb is not set."""


def _round_down(n: int, m: int) -> int:
    return n // m * m


@dataclass(frozen=True)
class SglangPools:
    """The pool layout ESS asks SGLang for (token counts per layer; bytes over all layers of one rank)."""

    device_tokens: int
    """Physical latent slots of SGLang's HiSparse device pool (its max_total_num_tokens)."""
    host_to_device_ratio: int
    logical_tokens: int
    """KV locations = device_tokens x ratio; each has an indexer entry on the GPU and can hold a host entry."""
    host_tokens: int
    """Host pool capacity in tokens (= logical_tokens: a token needs a location and a host entry)."""
    hot_slots_per_layer: int
    new_token_slots: int
    prefill_staging_tokens: int
    max_running_requests: int
    gpu_bytes: int
    host_bytes: int
    limited_by: str
    plan: PoolPlan

    @property
    def hot_base(self) -> int:
        """First physical slot of the hot region: the allocator reserves page 0 as padding and hands out the
        following pages in order from a fresh pool, so the region ESS reserves first starts at page_size."""
        return self.plan.page_size

    def describe(self) -> str:
        return (f"ESS pools: host {self.host_tokens:,} tokens ({self.host_bytes / GIB:.1f} GiB pinned), GPU indexer "
                f"{self.logical_tokens:,} tokens, hot pool {self.hot_slots_per_layer:,} slots/layer, device slots "
                f"{self.device_tokens:,} (hot + {self.new_token_slots:,} new-token + "
                f"{self.prefill_staging_tokens:,} prefill staging), HiSparse ratio {self.host_to_device_ratio}, "
                f"max_running_requests {self.max_running_requests}, GPU {self.gpu_bytes / GIB:.1f} GiB; "
                f"host pool limited by {self.limited_by}")


def gpu_bytes(num_layers: int, device_tokens: int, ratio: int, page_size: int) -> int:
    """GPU bytes of the device pool, the indexer cache and the ESS maps for one layout (hot-pool maps are counted
    for every device slot, a slight over-estimate)."""
    logical = device_tokens * ratio
    per_layer = ((device_tokens + page_size) * (LATENT_BYTES + MAP_BYTES_PER_SLOT)
                 + (logical + page_size) * INDEXER_BYTES + (logical + 1) * MAP_BYTES_PER_LOCATION)
    return num_layers * per_layer


def _layout(*, available_bytes: int, num_layers: int, page_size: int, host_tokens: int, extra: int, hot_min: int,
            ratio: float | None, context_len: int):
    """(device_tokens, host_to_device_ratio, bound) holding the most logical locations, or None.

    The device pool is hot pool + `extra` (new-token and staging slots); every device slot the integer ratio leaves
    over goes to the hot pool. With `ratio` (sparse_memory_ratio) the hot pool must hold ratio x the logical
    locations, else at least `hot_min` slots. bound: "host" when the host pool capped the layout, else "gpu".
    """
    L = num_layers
    H = _round_down(host_tokens, page_size)
    fixed = gpu_bytes(L, 0, 1, page_size)  # the page of padding every pool has (independent of the ratio)
    budget = available_bytes - fixed
    if budget <= 0:
        return None
    best = None
    r = 1
    while True:
        per_device_token = gpu_bytes(L, 1, r, page_size) - fixed
        by_gpu = _round_down(budget // per_device_token, page_size)
        if by_gpu < extra + hot_min or (ratio is not None and ratio * r >= 1):
            break  # larger ratios only shrink the device pool further
        by_host = _round_down(H // r, page_size)
        d = min(by_gpu, by_host)
        need = max(hot_min, math.ceil(ratio * d * r)) if ratio is not None else hot_min
        if d - extra >= need and d * r >= context_len:
            key = (d * r, d)
            if best is None or key > (best[0] * best[1], best[0]):
                best = (d, r, "host" if by_host <= by_gpu else "gpu")
        if by_host < extra + hot_min:
            break
        r += 1
    return best


def size_pools(config: EssConfig, *, available_bytes: int, num_layers: int, page_size: int, context_len: int,
               max_running_requests: int | None = None, colocated: bool, prefill_tokens: int = 0,
               host_memory_bytes: int | None = None, extra_rows: int = 0) -> SglangPools:
    """Lay out SGLang's pools for ESS within `available_bytes` of GPU memory (the KV budget SGLang profiled).

    `max_running_requests`: the user's --max-running-requests, else the largest number that fits is chosen.
    `prefill_tokens`: device room for prompts awaiting staging to host (colocated serving only).
    `extra_rows`: request rows SGLang adds beyond max_running_requests (PD decode: requests in transfer).
    Raises EssConfigError (naming what to change) when no layout fits.
    """
    if page_size != config.page_size:
        raise EssConfigError(f"ess_config.page_size: SGLang uses pages of {page_size} tokens, the config says "
                             f"{config.page_size}; set ess_config.page_size: {page_size}")

    # Without memory_pool_size_gb the host pool is not the limit: as many tokens as the GPU indexer cache can
    # address, up to HOST_MEMORY_FRACTION of the machine's memory.
    per_token = LATENT_BYTES * num_layers
    host_hint = int(HOST_MEMORY_FRACTION * host_memory_bytes) // per_token if host_memory_bytes else 1 << 36

    def attempt(m: int) -> SglangPools:
        plan = config.plan(Deployment(num_layers=num_layers, max_running_requests=m, max_context_len=context_len,
                                      host_tokens=max(host_hint, context_len)),
                           host_memory_bytes=host_memory_bytes)
        # one slot per request row (+ the padding row), and as many again: SGLang's PD queue counts free device
        # slots per incoming request
        new_slots = round_up(2 * (m + extra_rows + 1), page_size)
        staging = round_up(prefill_tokens, page_size) if colocated else 0
        extra = new_slots + staging
        step_need = round_up(plan.hot_slots_needed, page_size)
        by_ratio = plan.hot_pool_sized_by == "sparse_memory_ratio"
        ratio = (config.sparse_memory_ratio or DEFAULT_SPARSE_MEMORY_RATIO) if by_ratio else None
        hot_min = step_need if by_ratio else max(step_need, plan.hot_slots_per_layer)
        best = _layout(available_bytes=available_bytes, num_layers=num_layers, page_size=page_size,
                       host_tokens=plan.host_tokens, extra=extra, hot_min=hot_min, ratio=ratio,
                       context_len=context_len)
        if best is None:
            need = gpu_bytes(num_layers, extra + hot_min, 1, page_size) + \
                num_layers * context_len * (INDEXER_BYTES + MAP_BYTES_PER_LOCATION)
            raise EssConfigError(
                f"ess_config.{plan.hot_pool_sized_by}: the GPU budget for the KV cache "
                f"({available_bytes / GIB:.2f} GiB) cannot hold a hot pool of {hot_min:,}+ slots per layer"
                f"{f' (ratio {ratio})' if ratio else ''}, {new_slots:,} new-token slots, {staging:,} prefill staging "
                f"slots and the indexer entries of one {context_len:,}-token request (at least {need / GIB:.2f} "
                f"GiB): lower the hot pool (ess_config.max_gpu_buffer_size_gb or sparse_memory_ratio), "
                f"--max-running-requests or --context-length, or raise --mem-fraction-static")
        d, r, bound = best
        logical = d * r
        limited_by = plan.host_pool_sized_by if bound == "host" else "the GPU budget (indexer cache)"
        return SglangPools(
            device_tokens=d, host_to_device_ratio=r, logical_tokens=logical, host_tokens=logical,
            hot_slots_per_layer=d - extra, new_token_slots=new_slots, prefill_staging_tokens=staging,
            max_running_requests=m, gpu_bytes=gpu_bytes(num_layers, d, r, page_size),
            host_bytes=logical * num_layers * LATENT_BYTES, limited_by=limited_by, plan=plan)

    if max_running_requests is not None:
        return attempt(max_running_requests)
    # Capacity first: the layout for one running request holds the most locations; then as many running requests
    # as its hot pool serves in one step (each needs top_k + 1 slots per layer).
    first = attempt(1)
    m = max(1, min(MAX_RUNNING_SEARCH, first.hot_slots_per_layer // (config.top_k + 1)))
    for _ in range(16):
        try:
            return attempt(m)
        except EssConfigError:
            if m == 1:
                break
            m = max(1, m * 9 // 10)
    return first


def host_memory_bytes() -> int | None:
    """Physical memory of this machine (None when unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


# ------------------------------------------------------------------------------------------------ SGLang glue

_POOLS: SglangPools | None = None


def current_pools() -> SglangPools | None:
    return _POOLS


def set_current_pools(pools: SglangPools | None) -> None:
    global _POOLS
    _POOLS = pools


def config_from_budget_hook(original, kvc, budget_bytes, *args, **kwargs):
    """AROUND KVCacheConfigurator.config_from_budget(budget_bytes): ESS lays out the HiSparse pools itself."""
    from ess_sglang.sglang_plugin import settings

    s = settings.current()
    if not s.enabled or getattr(kvc, "is_draft_worker", False):
        return original(kvc, budget_bytes, *args, **kwargs)
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig
    from sglang.srt.runtime_context import get_disagg, get_schedule

    pools = current_pools()
    if pools is None:  # first call: the profiled budget (later calls, e.g. post-capture resizing, keep the layout)
        schedule = get_schedule()
        disagg = get_disagg()
        colocated = disagg.disaggregation_mode != "decode"
        extra_rows = 0 if colocated else int(getattr(disagg, "disaggregation_decode_extra_slots", 0) or 0)
        prefill = max(int(schedule.chunked_prefill_size or 0), int(kvc.model_config.context_len)) if colocated else 0
        budget = int(budget_bytes)
        if s.config.max_kv_cache_gb is not None:
            budget = min(budget, int(s.config.max_kv_cache_gb * GIB))
        pools = size_pools(
            s.config, available_bytes=budget, num_layers=int(kvc.layer_info.num_effective_layers),
            page_size=int(schedule.page_size), context_len=int(kvc.model_config.context_len),
            max_running_requests=schedule.max_running_requests, colocated=colocated, prefill_tokens=prefill,
            host_memory_bytes=host_memory_bytes(), extra_rows=extra_rows)
        set_current_pools(pools)
        logger.info("%s", pools.describe())
    return MemoryPoolConfig(max_total_num_tokens=pools.device_tokens)


def parse_hisparse_config_hook(result, *args, **kwargs):
    """AFTER sparsity.parse_hisparse_config(): the ratio and top-k ESS planned (HiSparse's defaults otherwise)."""
    from ess_sglang.sglang_plugin import settings

    s = settings.current()
    if not s.enabled:
        return None
    import dataclasses

    pools = current_pools()
    ratio = pools.host_to_device_ratio if pools is not None else result.host_to_device_ratio
    return dataclasses.replace(result, top_k=s.config.top_k, host_to_device_ratio=ratio,
                               device_buffer_size=max(result.device_buffer_size, s.config.top_k))


def resolve_max_num_reqs_hook(result, kvc, *args, **kwargs):
    """AFTER KVCacheConfigurator.resolve_max_num_reqs(): no more request rows than ESS planned new-token slots for."""
    from ess_sglang.sglang_plugin import settings

    pools = current_pools()
    if not settings.current().enabled or pools is None or getattr(kvc, "is_draft_worker", False):
        return None
    return min(int(result), pools.max_running_requests)
