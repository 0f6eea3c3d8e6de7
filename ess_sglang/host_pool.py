"""The host total pool: every latent entry of every layer, in pinned host memory, addressed by KV location.

Layout: ``entries[layer, location, :]`` (uint8, ``entry_bytes`` per token per layer). A KV location is the engine's
token address (SGLang's ``out_cache_loc``); the pool also hands locations out itself (``alloc`` / ``free``) for
engines that have no allocator of their own, such as the demo and the tests.

On a CUDA machine the pool is pinned and ``layer(l)`` is a UVA view that kernels read and write over PCIe. On a CPU
machine it is ordinary memory and ``layer(l)`` is the tensor itself.
"""

from __future__ import annotations

import numpy as np
import torch

from ess_sglang.formats import LATENT_ENTRY_BYTES


class HostPoolError(RuntimeError):
    """Base class of host pool failures."""


class PinnedMemoryError(HostPoolError):
    """The pinned allocation failed; the pool was not created and nothing is held."""


class PoolFullError(HostPoolError):
    """Fewer free locations than asked for; nothing was allocated."""


class HostTotalPool:
    def __init__(self, num_layers: int, num_tokens: int, entry_bytes: int = LATENT_ENTRY_BYTES,
                 device: torch.device | str | None = None, pin: bool | None = None, scrub_on_free: bool = False):
        if num_layers <= 0 or num_tokens <= 0 or entry_bytes <= 0:
            raise ValueError(f"HostTotalPool needs positive sizes, got num_layers={num_layers}, "
                             f"num_tokens={num_tokens}, entry_bytes={entry_bytes}")
        device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        pin = device.type == "cuda" if pin is None else pin
        nbytes = num_layers * num_tokens * entry_bytes
        if pin and not torch.cuda.is_available():
            raise PinnedMemoryError("pinned host memory needs a CUDA device; none is available (use pin=False on CPU)")
        try:
            entries = torch.empty((num_layers, num_tokens, entry_bytes), dtype=torch.uint8, pin_memory=pin)
        except RuntimeError as exc:  # cudaHostAlloc failed: report what was asked, keep no state
            raise PinnedMemoryError(
                f"could not {'pin' if pin else 'allocate'} {nbytes / 2**30:.2f} GiB of host memory for the total pool "
                f"({num_layers} layers x {num_tokens} tokens x {entry_bytes} B); lower memory_pool_size_gb "
                f"or raise the locked-memory limit (ulimit -l): {exc}") from exc
        if device.type == "cuda":
            from ess_sglang.uva import device_view
            view = device_view(entries, device)
        else:
            view = entries
        # Everything below is only reached once the allocation succeeded.
        self.entries = entries
        self.device_entries = view
        self.device = device
        self.num_layers, self.num_tokens, self.entry_bytes = num_layers, num_tokens, entry_bytes
        self.scrub_on_free = scrub_on_free
        self._free_stack = np.arange(num_tokens - 1, -1, -1, dtype=np.int64)  # pop from the end: 0, 1, 2, ...
        self._num_free = num_tokens
        self._allocated = np.zeros(num_tokens, dtype=bool)

    @property
    def nbytes(self) -> int:
        return self.entries.numel()

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_tokens - self._num_free

    def layer(self, layer: int) -> torch.Tensor:
        """[num_tokens, entry_bytes] view of one layer, addressable from `self.device`."""
        return self.device_entries[layer]

    def alloc(self, n: int) -> torch.Tensor:
        """Take `n` free locations (int64, on the CPU); PoolFullError and no change if fewer are free."""
        if n < 0:
            raise ValueError(f"alloc: n must be >= 0, got {n}")
        if n > self._num_free:
            raise PoolFullError(f"host total pool has {self._num_free} free token locations, {n} asked")
        top = self._num_free
        locs = self._free_stack[top - n:top][::-1].copy()
        self._num_free -= n
        self._allocated[locs] = True
        return torch.from_numpy(locs)

    def free(self, locs: torch.Tensor) -> None:
        """Return locations; every one must be allocated and listed once (else ValueError and no change)."""
        arr = np.asarray(locs.detach().cpu().numpy() if isinstance(locs, torch.Tensor) else locs, dtype=np.int64)
        arr = arr.reshape(-1)
        if arr.size == 0:
            return
        if arr.min() < 0 or arr.max() >= self.num_tokens:
            raise ValueError(f"free: locations must lie in [0, {self.num_tokens}), got [{arr.min()}, {arr.max()}]")
        if np.unique(arr).size != arr.size:
            raise ValueError("free: a location is listed twice")
        if not self._allocated[arr].all():
            raise ValueError(f"free: location {int(arr[~self._allocated[arr]][0])} is not allocated (double free?)")
        if self.scrub_on_free:
            self.entries[:, torch.from_numpy(arr)] = 0
        self._allocated[arr] = False
        self._free_stack[self._num_free:self._num_free + arr.size] = arr
        self._num_free += arr.size

    def is_allocated(self, locs: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self._allocated[np.asarray(locs.cpu().numpy(), dtype=np.int64)])

    def check_invariants(self) -> None:
        free = self._free_stack[:self._num_free]
        assert np.unique(free).size == free.size, "a free location is listed twice"
        assert not self._allocated[free].any(), "a free location is marked allocated"
        assert int(self._allocated.sum()) == self.num_used, "allocated count disagrees with the free list"
