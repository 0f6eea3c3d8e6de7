"""Warm-up of a new request's hot-pool entries, and where the warm-up sets come from.

Colocated serving: while the prompt is prefilled, ``DeepseekSparseAttnBackend.forward_extend`` receives every
layer's top-k selection for every prompt token (positions within the request). A BEFORE hook keeps, per request
row and layer, the selections of the last ``ess_config.warmup_windows`` query tokens (the prompt's last query
windows); when the request is staged to host memory, ``warmup_positions`` turns their union into the positions to
load (most-selected first, then most recent).

PD decode: the KV arrives from the prefill instance straight into the host pool. When the transfer carries the
prefill's window top-k sets (``req.ess_window_topk``, [layers, windows, k]; the prefill-side extension of SGLang's
transfer metadata is not implemented, see docs/sglang.md), they are used; otherwise the most recent tokens are.

Capture is skipped (and warm-up falls back to the most recent tokens) when SGLang hands the backend already
translated locations (its fused top-k, ``SGLANG_DSA_FUSE_TOPK``, which is on by default: set it to 0 on a
colocated instance to warm up from the query windows) or while a CUDA graph is being captured.
"""

from __future__ import annotations

import inspect
import logging

import torch

logger = logging.getLogger("ess_sglang.sglang_plugin")


class WindowCapture:
    """Per request row: a list (one entry per layer) of [windows, k] int32 device tensors, or None."""

    def __init__(self, num_layers: int, windows: int):
        self.num_layers = num_layers
        self.windows = windows
        self._rows: dict[int, list[torch.Tensor | None]] = {}

    def record(self, row: int, layer: int, topk_rows: torch.Tensor) -> None:
        if self.windows <= 0 or not 0 <= layer < self.num_layers:
            return
        slots = self._rows.setdefault(row, [None] * self.num_layers)
        slots[layer] = topk_rows[-self.windows:].clone()

    def take(self, row: int) -> list[torch.Tensor | None] | None:
        return self._rows.pop(row, None)

    def drop(self, row: int) -> None:
        self._rows.pop(row, None)


def record_extend(capture: WindowCapture, layer: int, topk_indices: torch.Tensor, req_rows: list[int],
                  extend_lens: list[int]) -> None:
    """Split an extend batch's top-k rows [tokens, k] by request and keep each request's last windows."""
    start = 0
    for row, n in zip(req_rows, extend_lens, strict=True):
        if n > 0:
            capture.record(int(row), layer, topk_indices[start:start + n])
        start += n


_EXTEND_PARAMS: list[str] | None = None


def _extend_args(args, kwargs) -> dict:
    global _EXTEND_PARAMS
    if _EXTEND_PARAMS is None:
        from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

        fn = DeepseekSparseAttnBackend.forward_extend
        while hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        _EXTEND_PARAMS = list(inspect.signature(fn).parameters)
    bound = dict(zip(_EXTEND_PARAMS, args, strict=False))
    bound.update(kwargs)
    return bound


def forward_extend_hook(*args, **kwargs):
    """BEFORE DeepseekSparseAttnBackend.forward_extend: keep the last query windows' top-k of each request."""
    from ess_sglang.sglang_plugin.coordinator import active_coordinator

    coord = active_coordinator()
    if coord is None or coord.capture is None:
        return None
    a = _extend_args(args, kwargs)
    backend, topk, fb, layer = a.get("self"), a.get("topk_indices"), a.get("forward_batch"), a.get("layer")
    if topk is None or fb is None or layer is None or topk.dim() != 2:
        return None
    if getattr(backend, "use_fused_topk", False):  # the selections are device slots, not positions
        coord.note_capture_unavailable("SGLang's fused top-k (SGLANG_DSA_FUSE_TOPK, on by default) hands the "
                                       "backend KV locations, not positions; set SGLANG_DSA_FUSE_TOPK=0 to warm up "
                                       "from the prefill's query windows")
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    mode = getattr(fb, "forward_mode", None)
    if mode is None or not mode.is_extend() or fb.extend_seq_lens_cpu is None:
        return None
    rows = fb.req_pool_indices_cpu if fb.req_pool_indices_cpu is not None else fb.req_pool_indices.cpu()
    lens = list(fb.extend_seq_lens_cpu)
    if sum(lens) > topk.shape[0]:
        return None
    record_extend(coord.capture, layer.layer_id - coord.start_layer, topk, [int(r) for r in rows.tolist()], lens)
    return None
