"""Device-visible (UVA) views of pinned host memory.

On CUDA, a pinned host allocation has a device-valid address (unified virtual addressing): a tensor built on it with
``device="cuda"`` is read and written by kernels directly over PCIe. torch has no public call for this, so the view is
made through ``__cuda_array_interface__`` carrying the host pointer.
"""

from __future__ import annotations

import torch


class _HostPointer:
    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape),
            "typestr": "|u1",
            "data": (t.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def device_view(host: torch.Tensor, device: torch.device | str = "cuda") -> torch.Tensor:
    """A cuda tensor aliasing the pinned uint8 host tensor `host` (same shape); the host tensor must stay alive."""
    if host.device.type != "cpu" or host.dtype != torch.uint8 or not host.is_contiguous():
        raise ValueError("device_view wants a contiguous uint8 host tensor")
    if not host.is_pinned():
        raise ValueError("device_view wants pinned host memory: pageable memory has no device address")
    view = torch.as_tensor(_HostPointer(host), device=device)
    if view.data_ptr() != host.data_ptr():
        raise RuntimeError("UVA view does not alias the host allocation (is unified addressing available?)")
    return view
