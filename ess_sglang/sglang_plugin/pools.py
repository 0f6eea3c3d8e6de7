"""The memory ESS works in inside SGLang: views of SGLang's host pool and of its per-layer device pools, in the shapes
the cache manager takes, and the allocation of the host pool. The coordinator (coordinator.py) builds them at
start-up; nothing here runs on the decode path."""

from __future__ import annotations

from typing import Any

import torch

from ess_sglang.sglang_plugin import compat


class HostPoolView:
    """``HostTotalPool``'s interface over SGLang's host pool (``MLATokenToKVPoolHost``, layer-first layout).

    Locations are the host pool's slot indices (what ``req_to_host_pool`` holds). On CUDA, ``layer(l)`` is a UVA
    view of the registered host buffer, which FlashTrans reads and writes over PCIe.
    """

    def __init__(self, host_pool: Any, num_layers: int, entry_bytes: int, device: torch.device):
        buf = host_pool.kv_buffer
        if not isinstance(buf, torch.Tensor) or buf.dim() != 4 or buf.shape[0] != num_layers:
            raise RuntimeError(f"ESS expects a layer-first host pool [layers, tokens, 1, {entry_bytes}], got "
                               f"{type(buf).__name__} {tuple(getattr(buf, 'shape', ()))}")
        self.pool = host_pool
        self.entries = buf.view(torch.uint8).view(num_layers, buf.shape[1], -1)
        if self.entries.shape[2] != entry_bytes:
            raise RuntimeError(f"ESS expects {entry_bytes}-byte host entries, the host pool has "
                               f"{self.entries.shape[2]}")
        self.device = device
        if device.type == "cuda":
            from ess_sglang.uva import device_view

            self.device_entries = device_view(self.entries, device)
        else:
            self.device_entries = self.entries
        self.num_layers, self.num_tokens, self.entry_bytes = num_layers, int(buf.shape[1]), entry_bytes

    def layer(self, layer: int) -> torch.Tensor:
        return self.device_entries[layer]

    @property
    def num_free(self) -> int:
        return int(self.pool.available_size())

    @property
    def num_used(self) -> int:
        return self.num_tokens - self.num_free


class LayerViews:
    """Per-layer [slots, entry_bytes] views standing in for the cache manager's ``hot_entries`` tensor: the hot
    pools live inside SGLang's per-layer device pool tensors, which are separate allocations."""

    def __init__(self, views: list[torch.Tensor]):
        self._views = views

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self._views[layer]

    def __len__(self) -> int:
        return len(self._views)

    def numel(self) -> int:
        return sum(v.numel() for v in self._views)


def build_cache_manager(host: HostPoolView, slots: int, hot_views: LayerViews, device: torch.device,
                        max_selected: int, copy_impl: str = "auto", resolve_impl: str = "auto",
                        spare_slots: int = 0, resolve_pdl: bool | None = None, refill_interval: int = 1,
                        decay_gamma: float | None = None, spare_max_entries: int | None = None):
    """A HotPoolCacheManager whose hot pools are `hot_views` (regions of SGLang's device pool); `decay_gamma`:
    decayed retention with that factor (None: LRU)."""
    from ess_sglang.cache_manager import HotPoolCacheManager

    return HotPoolCacheManager(host, slots, device=device, max_selected=max_selected, copy_impl=copy_impl,
                               resolve_impl=resolve_impl, hot_entries=hot_views, spare_slots=spare_slots,
                               resolve_pdl=resolve_pdl, refill_interval=refill_interval,
                               decay_gamma=decay_gamma, spare_max_entries=spare_max_entries)


def allocate_host_pool(pool: Any, host_tokens: int, pin_memory: bool) -> Any:
    """SGLang's host pool for `host_tokens` latent entries of every layer; an allocation that fails (the machine's
    memory, or the locked-memory limit for a pinned one) is one line that names the size and what to change."""
    try:
        return compat.make_host_pool(pool, host_tokens, pin_memory)
    except (RuntimeError, MemoryError) as exc:
        size = host_tokens * pool.layer_num * pool.kv_cache_dim * torch.empty((), dtype=pool.store_dtype).element_size()
        what = "pinned " if pin_memory else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise compat.EssLaunchError(
            f"ESS: could not allocate the {what}host pool of {size / (1 << 30):.2f} GiB ({host_tokens:,} tokens x "
            f"{pool.layer_num} layers): {first}; lower ess_config.memory_pool_size_gb, or allow more locked memory "
            f"(ulimit -l, the container's memlock limit)") from exc


def first_of_run(indices: torch.Tensor) -> int | None:
    """First index when `indices` is one ascending run, else None."""
    if indices is None or indices.numel() == 0:
        return None
    first = int(indices[0])
    ok = torch.equal(indices.cpu().long(), torch.arange(first, first + indices.numel(), dtype=torch.long))
    return first if ok else None
