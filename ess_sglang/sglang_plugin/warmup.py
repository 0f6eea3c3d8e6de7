"""Warm-up of a new request's hot-pool entries, and where the warm-up sets come from.

While a prompt is prefilled, ``DeepseekSparseAttnBackend.forward_extend`` receives every layer's top-k selection
for every prompt token. A BEFORE hook keeps, per request row and layer, the selections of the last
``ess_config.warmup_windows`` query tokens (the prompt's last query windows; a final chunk shorter than that is
completed from the previous chunk's windows). Where the capture lives:

* colocated serving: in the ESS coordinator; when the request is staged to host memory, ``warmup_positions`` turns
  their union into the positions to load (most-selected first, then most recent);
* PD prefill instance with ``--enable-ess``: in the window sender (``pd_windows``); when SGLang fills the request's
  transfer metadata, the sets are reduced to each layer's union in warm-up priority order
  (``rank_window_sets``) and sent beside the KV; the decode instance loads the first entries of that order that
  fit its budget (``ranked_warmup_positions``), which are exactly the entries ``warmup_positions`` chooses.

The selections reach the backend in one of three forms, all turned back into positions within the request:

* unfused top-k (``SGLANG_DSA_FUSE_TOPK=0``): positions already;
* fused top-k, PAGED transform (fp8 KV with the flashmla_kv prefill kernel, SGLang's choice on H200): KV locations
  ``page_table_1[request, position]``: inverted through the request's row of ``forward_metadata.page_table_1``
  (sorted once per batch and request, reused by every layer);
* fused top-k, RAGGED transform (EXTEND batches with a flashmla_sparse-family prefill kernel): indices into the
  batch's concatenated KV, i.e. position + the request's KV offset (``forward_metadata.topk_indices_offset``, which
  the fused kernel added): subtracted again.

Capture is skipped (warm-up then loads the most recent tokens, logged once) with SGLang's compressed indexer pool
(``index_kpool`` > 1), DSA prefill context parallelism, and while a CUDA graph is being captured.
"""

from __future__ import annotations

import inspect
import logging
import weakref

import torch

logger = logging.getLogger("ess_sglang.sglang_plugin")


class WindowCapture:
    """Per request row and layer: the last query windows' top-k positions ([windows, k] int32, device), with the
    prompt length they end at.

    min_seq_len: requests whose prompt (so far) is at most this long are not recorded (warm-up loads all of them).
    max_bytes: rows not yet recorded are skipped once the capture holds this many bytes (None: unbounded).
    """

    def __init__(self, num_layers: int, windows: int, *, min_seq_len: int = 0, max_bytes: int | None = None):
        self.num_layers = num_layers
        self.windows = windows
        self.min_seq_len = min_seq_len
        self.max_bytes = max_bytes
        self._rows: dict[int, list[tuple[torch.Tensor, int | None] | None]] = {}
        self._bytes: dict[int, int] = {}
        self.nbytes = 0
        """Bytes held (all rows)."""
        self.skipped_rows = 0
        """Rows not recorded because of max_bytes."""

    def _set_bytes(self, row: int, n: int | None) -> None:
        self.nbytes += (n or 0) - self._bytes.pop(row, 0)
        if n is not None:
            self._bytes[row] = n

    def record(self, row: int, layer: int, topk_rows: torch.Tensor, seq_end: int | None = None) -> None:
        """Keep the last windows of `topk_rows` (the top-k of the query tokens that end at position seq_end - 1).

        When the row's previous record of this layer ended where this chunk starts, a chunk with fewer rows than
        `windows` is completed with the previous chunk's last ones."""
        if self.windows <= 0 or not 0 <= layer < self.num_layers:
            return
        n = int(topk_rows.shape[0])
        if seq_end is not None and int(seq_end) <= self.min_seq_len:
            self.drop(row)
            return
        slots = self._rows.get(row)
        if slots is None:
            if self.max_bytes is not None and self.nbytes + self._row_bytes(topk_rows) > self.max_bytes:
                self.skipped_rows += 1
                return
            slots = self._rows[row] = [None] * self.num_layers
        kept = topk_rows[-self.windows:]
        prev = slots[layer]
        if n < self.windows and prev is not None and seq_end is not None and prev[1] == int(seq_end) - n:
            kept = torch.cat([prev[0][-(self.windows - n):], kept])
        kept = kept.clone()
        old = prev[0].numel() * prev[0].element_size() if prev is not None else 0
        slots[layer] = (kept, int(seq_end) if seq_end is not None else None)
        self._set_bytes(row, self._bytes.get(row, 0) - old + kept.numel() * kept.element_size())

    def _row_bytes(self, topk_rows: torch.Tensor) -> int:
        return self.num_layers * min(self.windows, int(topk_rows.shape[0])) * int(topk_rows.shape[1]) * \
            topk_rows.element_size()

    def take(self, row: int, seq_len: int | None = None) -> list[torch.Tensor | None] | None:
        """The row's windows per layer (None where a layer recorded nothing), and forget them. With `seq_len`,
        None unless the last chunk recorded ends at seq_len (else the windows belong to an earlier request)."""
        slots = self._rows.pop(row, None)
        self._set_bytes(row, None)
        if slots is None:
            return None
        if seq_len is not None and any(s is not None and s[1] is not None and s[1] != seq_len for s in slots):
            return None
        if all(s is None for s in slots):
            return None
        return [s[0] if s is not None else None for s in slots]

    def drop(self, row: int) -> None:
        self._rows.pop(row, None)
        self._set_bytes(row, None)


def record_extend(capture: WindowCapture, layer: int, topk_indices: torch.Tensor, req_rows: list[int],
                  extend_lens: list[int], seq_lens: list[int] | None = None) -> None:
    """Split an extend batch's top-k rows [tokens, k] (positions) by request and keep each request's last windows."""
    start = 0
    for i, (row, n) in enumerate(zip(req_rows, extend_lens, strict=True)):
        if n > 0:
            capture.record(int(row), layer, topk_indices[start:start + n],
                           seq_lens[i] if seq_lens is not None else None)
        start += n


# ---------------------------------------------------------------------------------------------- fused top-k

def ragged_to_positions(topk_rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """RAGGED fused top-k rows (position + the request's offset in the batch's concatenated KV, -1 padding)
    -> positions. offsets: [rows] (the offset the fused kernel added to each row)."""
    off = offsets.to(device=topk_rows.device, dtype=topk_rows.dtype).view(-1, 1)
    return torch.where(topk_rows >= 0, topk_rows - off, -1)


def locations_to_positions(topk_rows: torch.Tensor, sorted_locs: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """PAGED fused top-k rows (KV locations of one request, -1 padding) -> positions, through the request's page
    table row sorted by location (`sorted_locs`, `order` = the positions in that order). Locations not in the row
    become -1."""
    if sorted_locs.numel() == 0:
        return torch.full_like(topk_rows, -1)
    locs = topk_rows.long()
    idx = torch.searchsorted(sorted_locs, locs.clamp(min=0)).clamp(max=sorted_locs.numel() - 1)
    found = (locs >= 0) & (sorted_locs[idx] == locs)
    return torch.where(found, order[idx], -1).to(topk_rows.dtype)


def invert_page_table_row(page_table_row: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted locations, their positions) of positions [0, seq_len) of one request's page_table_1 row."""
    sorted_locs, order = torch.sort(page_table_row[:seq_len].long())
    return sorted_locs, order


class _PagedInverse:
    """Per forward batch: each request's inverted page table row, shared by all layers."""

    def __init__(self):
        self._key: tuple | None = None
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, forward_batch, metadata, b: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (forward_batch, metadata)
        if self._key is None or self._key[0] is not forward_batch or self._key[1] is not metadata:
            self._key, self._rows = key, {}
        got = self._rows.get(b)
        if got is None:
            got = self._rows[b] = invert_page_table_row(metadata.page_table_1[b], seq_len)
        return got

    def clear(self) -> None:
        self._key, self._rows = None, {}


_PAGED = _PagedInverse()


# ---------------------------------------------------------------------------------------------- warm-up sets

def rank_window_sets(windows: list[torch.Tensor | None], seq_len: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each layer's union of window positions in warm-up priority order (most windows first, then the most recent),
    the first `cap` of them.

    Returns (ranked [layers, cap] int32 CPU, -1 padding; union [layers] int64 CPU: the union sizes before
    truncation). The first `b` entries of a layer's order are exactly what ``ess_sglang.warmup.warmup_positions``
    loads for a budget b < union size; all of them when the union fits. One device pass over all layers."""
    L = len(windows)
    ranked = torch.full((L, cap), -1, dtype=torch.int32)
    union = torch.zeros(L, dtype=torch.int64)
    present = [(i, w) for i, w in enumerate(windows) if w is not None and w.numel() > 0]
    if not present or seq_len <= 0 or cap <= 0:
        return ranked, union
    dev = present[0][1].device
    S = int(seq_len) + 1
    sentinel = L * S
    flat = torch.cat([torch.where((f >= 0) & (f < seq_len), f + i * S, sentinel)
                      for i, f in ((i, w.reshape(-1).long()) for i, w in present)])
    keys, votes = torch.unique(flat, return_counts=True)  # ascending
    keep = keys < sentinel
    keys, votes = keys[keep], votes[keep]
    if keys.numel() == 0:
        return ranked, union
    layer, pos = keys // S, keys % S
    vmax = int(votes.max()) + 1
    order = torch.argsort(layer * (vmax * S) + (vmax - 1 - votes) * S + (S - 1 - pos))  # layer, votes desc, pos desc
    layer, pos = layer[order], pos[order]
    counts = torch.bincount(layer, minlength=L)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(layer.numel(), device=dev) - starts[layer]
    sel = rank < cap
    out = torch.full((L, cap), -1, dtype=torch.int32, device=dev)
    out[layer[sel], rank[sel]] = pos[sel].to(torch.int32)
    return out.cpu(), counts.cpu()


def ranked_warmup_positions(seq_len: int, budget: int, ranked: torch.Tensor | None) -> torch.Tensor:
    """Positions (int64, CPU, ascending) to load for one layer from its ranked union (``rank_window_sets``): the
    same rule as ``ess_sglang.warmup.warmup_positions`` (all of a prompt that fits, else the first `budget` of the
    priority order, else the most recent tokens)."""
    if budget <= 0 or seq_len <= 0:
        return torch.empty(0, dtype=torch.int64)
    if seq_len <= budget:
        return torch.arange(seq_len, dtype=torch.int64)
    if ranked is not None:
        p = ranked.reshape(-1).long().cpu()
        p = p[(p >= 0) & (p < seq_len)]
        if p.numel() > 0:
            return p[:budget].sort().values
    return torch.arange(max(seq_len - budget, 0), seq_len, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------- the hook

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


def capture_sink():
    """Whoever collects this process's windows: the ESS coordinator (colocated / PD decode), else the PD prefill
    window sender, else None. Both have ``capture``, ``start_layer`` and ``note_capture_unavailable(why)``."""
    from ess_sglang.sglang_plugin.active import active_coordinator

    coord = active_coordinator()
    if coord is not None:
        return coord
    from ess_sglang.sglang_plugin.active import active_sender

    return active_sender()


_PREFILL_CP: bool | None = None


def _prefill_cp() -> bool:
    global _PREFILL_CP
    if _PREFILL_CP is None:
        try:
            from sglang.srt.layers.attention.dsa.utils import is_dsa_enable_prefill_cp

            _PREFILL_CP = bool(is_dsa_enable_prefill_cp())
        except Exception:  # nothing published (tests): no context parallelism
            _PREFILL_CP = False
    return _PREFILL_CP


def _is_plain_extend(mode) -> bool:
    if mode is None or not mode.is_extend():
        return False
    plain = getattr(mode, "is_extend_without_speculative", None)
    return bool(plain()) if plain is not None else True


_ROWS: tuple[weakref.ref, weakref.ref, list[int]] | None = None
"""(forward batch, its request-row tensor, the rows as read back): every layer of a forward gets the same batch."""


def _request_rows(fb) -> list[int]:
    """The extend batch's request rows on the host: the batch's host copy (``req_pool_indices_cpu``), else the
    device tensor read back once per forward batch, not once per layer (each read waits for the GPU; SGLang
    0.5.17's ForwardBatch has no host copy)."""
    global _ROWS
    host = getattr(fb, "req_pool_indices_cpu", None)
    if host is not None:
        return [int(r) for r in host.tolist()]
    device = fb.req_pool_indices
    if _ROWS is not None and _ROWS[0]() is fb and _ROWS[1]() is device:
        return _ROWS[2]
    rows = [int(r) for r in device.tolist()]
    try:
        _ROWS = (weakref.ref(fb), weakref.ref(device), rows)
    except TypeError:  # (an object without weak references: read again next time)
        _ROWS = None
    return rows


def forward_extend_hook(*args, **kwargs):
    """BEFORE DeepseekSparseAttnBackend.forward_extend: keep the last query windows' top-k of each request."""
    sink = capture_sink()
    if sink is None or sink.capture is None:
        return None
    a = _extend_args(args, kwargs)
    backend, topk, fb, layer = a.get("self"), a.get("topk_indices"), a.get("forward_batch"), a.get("layer")
    if topk is None or fb is None or layer is None or topk.dim() != 2:
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    if not _is_plain_extend(getattr(fb, "forward_mode", None)) or fb.extend_seq_lens_cpu is None:
        return None
    if int(getattr(backend, "dsa_index_kpool", 1) or 1) > 1:
        sink.note_capture_unavailable("SGLang's compressed indexer pool (index_kpool > 1) appends tail tokens to the "
                                      "top-k rows")
        return None
    if _prefill_cp():
        sink.note_capture_unavailable("DSA prefill context parallelism splits the prompt's query tokens across ranks")
        return None
    rows = _request_rows(fb)
    lens = [int(n) for n in fb.extend_seq_lens_cpu]
    if sum(lens) > topk.shape[0]:
        return None
    seq_lens = getattr(fb, "seq_lens_cpu", None)
    seq_lens = [int(s) for s in seq_lens.tolist()] if seq_lens is not None else None
    capture = sink.capture
    lid = layer.layer_id - sink.start_layer
    if not getattr(backend, "use_fused_topk", False):
        record_extend(capture, lid, topk, rows, lens, seq_lens)
        return None
    # Fused top-k: turn the last windows of each request back into positions.
    if seq_lens is None:
        return None
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod

    metadata = getattr(backend, "forward_metadata", None)
    method = backend.get_topk_transform_method(fb.forward_mode)
    start = 0
    offsets = None
    if method == TopkTransformMethod.RAGGED:
        offsets = getattr(metadata, "topk_indices_offset", None)
        if offsets is None:  # the offsets the kernel adds: each request's start in the concatenated KV
            cu = torch.tensor([0] + seq_lens[:-1], dtype=torch.int64).cumsum(0)
            offsets = torch.repeat_interleave(cu, torch.tensor(lens, dtype=torch.int64)).to(topk.device)
    elif getattr(metadata, "page_table_1", None) is None:
        sink.note_capture_unavailable("the fused PAGED top-k ran without a page_size=1 page table")
        return None
    for b, (row, n) in enumerate(zip(rows, lens, strict=True)):
        if n > 0 and seq_lens[b] <= capture.min_seq_len:
            capture.drop(row)  # loaded whole at warm-up: nothing to convert
        elif n > 0:
            w = min(n, capture.windows)
            lo, hi = start + n - w, start + n
            if method == TopkTransformMethod.RAGGED:
                pos = ragged_to_positions(topk[lo:hi], offsets[lo:hi])
            else:
                sorted_locs, order = _PAGED.get(fb, metadata, b, seq_lens[b])
                pos = locations_to_positions(topk[lo:hi], sorted_locs, order)
            capture.record(row, lid, pos, seq_lens[b])
        start += n
    if lid == capture.num_layers - 1:
        _PAGED.clear()
    return None
