"""The indexer tap: the two hooks around each decode layer's indexer top-k. They select with the kernel SGLang runs
without ESS (decode_topk.py), and hand the ESS coordinator the layer's indexer logits and top-k, so that the
layer's ECHO prefetch runs beside the top-k (echo.py, steps 1-2).

SGLang 0.5.23's DSA decode path computes the logits and selects in one method:

    Indexer._get_topk_paged(forward_batch, layer_id, q_fp8, weights, metadata)
        logits = DeepGEMM fp8_paged_mqa_logits(...)           [rows, max_seq_len] float32
        topk = metadata.topk_transform(logits, index_topk)    [rows, k] positions (-1 padded): with a HiSparse
                                                              coordinator the top-k is forced unfused in decode

* AROUND ``Indexer._get_topk_paged``: in a plain decode batch with ESS it opens a tap for the call (coordinator,
  layer, the batch's request rows and lengths, and whether the layer prefetches: where ESS prefetches in the layer,
  the batch has at least ``prefetch_min_batch`` requests and the top-k is the unfused one).
* AROUND ``DSAIndexerMetadata.topk_transform``: the first top-k inside an open tap is the layer's decode selection:
  the coordinator queues the prefetch (``prefetch_from_logits``) before it, the selection runs with SGLang's top-k v2
  kernel and plan as SGLang without ESS would (``decode_topk.select``; SGLang's own call where that does not apply),
  and the coordinator keeps the selection and the logits (``note_selection``) after it, for the k-th best scores
  found beside attention.

Anywhere else (prefill, speculative verify, ESS off) both pass straight through. The open tap is the coordinator's
(``EssCoordinator.decode_tap``), for the length of the indexer call: SGLang runs a scheduler's forward passes on one
thread, and during CUDA-graph capture these hooks run once per captured batch size, queueing their kernels into the
graph like the rest of the layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ess_sglang.sglang_plugin import decode_topk

logger = logging.getLogger("ess_sglang.sglang_plugin")


@dataclass
class _Tap:
    coordinator: Any
    layer_id: int
    req_pool_indices: Any
    seq_lens: Any
    prefetch: bool
    used: bool = False


_WARNED: set[str] = set()
"""Warnings logged once per process."""


def open_tap() -> _Tap | None:
    """The tap of the indexer call in progress in this process, if any."""
    from ess_sglang.sglang_plugin.active import active_coordinator

    return getattr(active_coordinator(), "decode_tap", None)


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else args[i] if len(args) > i else None


def _plain_decode(forward_batch: Any) -> bool:
    mode = getattr(forward_batch, "forward_mode", None)
    return mode is not None and bool(mode.is_decode())


def _batch_size(forward_batch: Any) -> int | None:
    size = getattr(forward_batch, "batch_size", None)
    if isinstance(size, int):
        return size
    rows = getattr(forward_batch, "req_pool_indices", None)
    return int(rows.shape[0]) if rows is not None else None


def get_topk_paged_hook(original, indexer, *args, **kwargs):
    """AROUND Indexer._get_topk_paged: open the tap for a decode layer of an ESS instance."""
    from ess_sglang.sglang_plugin.active import active_coordinator

    coord = active_coordinator()
    forward_batch = _arg(args, kwargs, 0, "forward_batch")
    layer_id = _arg(args, kwargs, 1, "layer_id")
    metadata = _arg(args, kwargs, 4, "metadata")
    if coord is None or layer_id is None or not _plain_decode(forward_batch):
        return original(indexer, *args, **kwargs)
    prefetch = bool(coord.prefetches(layer_id, _batch_size(forward_batch)))
    if not getattr(metadata, "force_unfused_topk", False):
        if "fused" not in _WARNED:
            _WARNED.add("fused")
            logger.warning("ESS: the indexer's top-k is not the unfused one (positions) in this decode step; no "
                           "prefetch and no ESS top-k there")
        return original(indexer, *args, **kwargs)
    coord.decode_tap = _Tap(coord, int(layer_id), forward_batch.req_pool_indices, forward_batch.seq_lens, prefetch)
    try:
        return original(indexer, *args, **kwargs)
    finally:
        coord.decode_tap = None


def topk_transform_hook(original, metadata, logits, topk, *args, **kwargs):
    """AROUND DSAIndexerMetadata.topk_transform: prefetch before, the top-k as without ESS, keep the
    selection for its k-th best scores after."""
    tap = open_tap()
    if tap is None or tap.used or getattr(logits, "dim", lambda: 0)() != 2:
        return original(metadata, logits, topk, *args, **kwargs)
    tap.used = True  # one selection per call: any other top-k inside it is not the layer's decode selection
    if tap.prefetch:
        tap.coordinator.prefetch_from_logits(tap.layer_id, logits, tap.req_pool_indices, tap.seq_lens)
    result = decode_topk.select(getattr(tap.coordinator, "config", None), metadata, logits, topk, args, kwargs)
    if result is None:
        result = original(metadata, logits, topk, *args, **kwargs)
    if tap.prefetch and getattr(result, "dim", lambda: 0)() == 2:
        tap.coordinator.note_selection(tap.layer_id, logits, result, tap.req_pool_indices)
    return result
