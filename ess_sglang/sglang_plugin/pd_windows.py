"""PD disaggregation: the prefill's query-window top-k sets travel to the decode instance beside the KV.

A decode instance warms a new request up from the union of the top-k sets of the prompt's last ``warmup_windows``
query windows, which only the prefill instance computed. With ``--enable-ess`` on the prefill instance too:

1. prefill, during the extend pass: the BEFORE hook on ``DeepseekSparseAttnBackend.forward_extend``
   (``warmup.forward_extend_hook``, the same capture as colocated serving) keeps each request's last windows per
   DSA layer in the ``WindowSender``;
2. prefill, when SGLang fills the request's transfer metadata (``MetadataBuffers.set_buf``, last chunk): each
   layer's union is ranked in warm-up priority order (most windows first, then the most recent;
   ``warmup.rank_window_sets``) and its first ``cap`` positions are written to the request's slot of an extra
   metadata buffer, ``MetadataBuffers.ess_windows``;
3. the transfer engine copies that slot to the decode instance with the other metadata buffers (SGLang pairs
   metadata buffers by position; ``get_buf_infos`` lists this one last, after SGLang's own optional ones);
4. decode, when the transfer completes (``DecodeTransferQueue._commit_transfer_to_req``): the slot is checked
   (magic, the request's bootstrap_room, layout, prompt length) and becomes ``req.ess_warmup_ranked``
   ([layers, cap] int32), which the coordinator's ``admit_request_direct`` warms up from: the first entries of each
   layer's order that fit the budget, exactly the entries colocated warm-up (``ess_sglang.warmup.warmup_positions``)
   loads for the same windows. A slot without valid sets (prefill without ESS, an older plugin, a capture that was
   skipped) falls back to the most recent tokens, logged once.

The slot of one request, int32 (size fixed by the model, so both instances agree on it without negotiation):

    header   16   magic, version, bootstrap_room (lo, hi), layers, cap, prompt length, windows captured,
                  layers whose union exceeded cap, state (sets / short prompt / not captured), reserved
    union    L    each layer's union size before truncation
    ranked   L x cap   each layer's union positions in priority order, -1 padding

with L = the model's num_hidden_layers and cap = 2 x index_topk (4,096 for DeepSeek-V3.2): 999,732 bytes per slot
for DeepSeek-V3.2. SGLang allocates 2 x max_running_requests slots on a prefill instance and 2 x request rows on a
decode instance. A layer's union is truncated to cap by priority (counted): a decode budget up to cap still loads
exactly what colocated warm-up would; ESS-sized decode instances use about index_topk + 1.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

import torch

from ess_sglang.sglang_plugin import compat
from ess_sglang.sglang_plugin import settings as settings_mod
from ess_sglang.sglang_plugin.active import set_sender
from ess_sglang.sglang_plugin.warmup import WindowCapture, rank_window_sets

logger = logging.getLogger("ess_sglang.sglang_plugin")

MAGIC = 0x45535357  # "ESSW"
VERSION = 1
HEADER_INTS = 16
H_MAGIC, H_VERSION, H_ROOM_LO, H_ROOM_HI, H_LAYERS, H_CAP, H_SEQ_LEN, H_WINDOWS, H_TRUNCATED, H_STATE = range(10)
STATE_SETS, STATE_SHORT, STATE_NOT_CAPTURED = 0, 1, 2
"""H_STATE: sets follow; the prompt is short enough to be loaded whole (no sets needed); no sets were captured
(the prefill instance's log says why)."""
CAP_PER_TOP_K = 2
"""Positions sent per layer, as a multiple of the model's index_topk."""

ENV_CAPTURE_MAX_GB = "ESS_SGLANG_PREFILL_CAPTURE_MAX_GB"
DEFAULT_CAPTURE_MAX_BYTES = 1 << 30
"""GPU bytes the prefill instance holds for window sets not yet sent (16 MB per request for DeepSeek-V3.2: 61 layers
x 32 windows x 2048 x 4 B); requests beyond it are sent without sets (counted, logged once)."""


@dataclass(frozen=True)
class WireLayout:
    layers: int
    cap: int

    @property
    def row_ints(self) -> int:
        return HEADER_INTS + self.layers + self.layers * self.cap

    @property
    def row_bytes(self) -> int:
        return 4 * self.row_ints


def layout_for(hf_text_config) -> WireLayout:
    """The slot layout for a model: identical on the prefill and the decode instance of one deployment."""
    return WireLayout(int(hf_text_config.num_hidden_layers), CAP_PER_TOP_K * int(hf_text_config.index_topk))


def _i32(x: int) -> int:
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


def _room_halves(room: int | None) -> tuple[int, int]:
    r = int(room or 0)
    return _i32(r), _i32(r >> 32)


def encode_row(row: torch.Tensor, layout: WireLayout, *, room: int | None, seq_len: int, ranked: torch.Tensor,
               union: torch.Tensor, windows: int) -> int:
    """Write one request's ranked sets into its slot; returns the number of layers truncated to cap."""
    L, cap = layout.layers, layout.cap
    n = min(L, ranked.shape[0])
    truncated = int((union[:n] > cap).sum())
    body = row[HEADER_INTS:]
    body[:L].zero_()
    body[:n] = union[:n].clamp(max=(1 << 31) - 1).to(torch.int32)
    grid = body[L:].view(L, cap)
    grid.fill_(-1)
    grid[:n] = ranked[:n].to(torch.int32)
    _write_header(row, layout, room=room, seq_len=seq_len, windows=windows, truncated=truncated, state=STATE_SETS)
    return truncated


def encode_no_sets(row: torch.Tensor, layout: WireLayout, *, room: int | None, seq_len: int, state: int) -> None:
    """A slot that says why it carries no sets (STATE_SHORT or STATE_NOT_CAPTURED)."""
    _write_header(row, layout, room=room, seq_len=seq_len, windows=0, truncated=0, state=state)


def _write_header(row: torch.Tensor, layout: WireLayout, *, room, seq_len, windows, truncated, state) -> None:
    lo, hi = _room_halves(room)
    header = [MAGIC, VERSION, lo, hi, layout.layers, layout.cap, int(seq_len), int(windows), int(truncated),
              int(state)]
    row[:HEADER_INTS] = 0
    row[:len(header)] = torch.tensor(header, dtype=torch.int32)  # the header last: it validates the rest


def decode_row(row: torch.Tensor, layout: WireLayout, *, room: int | None, seq_len: int):
    """(ranked [L, cap] int32 CPU, union [L] int64, truncated layers) from a received slot; ranked is None when
    the prefill sent no sets because the prompt is loaded whole anyway. A string when the slot holds nothing usable
    for this request: the reason."""
    h = row[:HEADER_INTS].tolist()
    if h[H_MAGIC] != MAGIC:
        return ("the transfer metadata carries no window sets (is --enable-ess set on the prefill instance, with "
                "ess-sglang of the same version?)")
    if h[H_VERSION] != VERSION:
        return f"the window sets are in format version {h[H_VERSION]}, this plugin reads version {VERSION}"
    if (h[H_ROOM_LO], h[H_ROOM_HI]) != _room_halves(room):
        return "the window-set slot belongs to another request (bootstrap_room differs)"
    if (h[H_LAYERS], h[H_CAP]) != (layout.layers, layout.cap):
        return (f"the prefill sent {h[H_LAYERS]} layers x {h[H_CAP]} positions, this instance expects "
                f"{layout.layers} x {layout.cap}")
    if h[H_SEQ_LEN] != int(seq_len):
        return f"the window sets are for a {h[H_SEQ_LEN]}-token prompt, the request has {seq_len}"
    if h[H_STATE] == STATE_SHORT:
        return None, torch.zeros(layout.layers, dtype=torch.int64), 0
    if h[H_STATE] != STATE_SETS:
        return "the prefill instance captured no window sets for the request (its log says why)"
    body = row[HEADER_INTS:].cpu()
    union = body[:layout.layers].to(torch.int64)
    ranked = body[layout.layers:].view(layout.layers, layout.cap).clone()
    return ranked, union, int(h[H_TRUNCATED])


# ---------------------------------------------------------------------------------------------- bookkeeping

@dataclass
class PdWindowStats:
    sent: int = 0
    """Prefill: requests whose sets were sent."""
    unsent: int = 0
    """Prefill: requests longer than index_topk + 1 sent without sets (capture skipped, unavailable or stale)."""
    received: int = 0
    """Decode: requests that received sets."""
    missing: int = 0
    """Decode: requests that received none (warm-up from the most recent tokens)."""
    truncated_layers: int = 0
    """Layers whose union exceeded cap (prefill: sent; decode: received)."""
    notes: set = field(default_factory=set)


STATS = PdWindowStats()


def note_once(key: str, message: str, *args) -> None:
    if key not in STATS.notes:
        STATS.notes.add(key)
        logger.warning(message, *args)


def note_missing(reason: str) -> None:
    STATS.missing += 1
    note_once("missing:" + re.sub(r"\d+", "#", reason.split(" (")[0]),
              "ESS warm-up (PD decode): %s; such requests warm up from their most recent tokens (logged once)", reason)


def _disaggregation_mode() -> str:
    try:
        from sglang.srt.runtime_context import get_disagg

        mode = getattr(get_disagg(), "disaggregation_mode", "null")
        return str(getattr(mode, "value", mode))
    except Exception:  # nothing published in this process
        return "null"


def _hf_text_config():
    try:
        from sglang.srt.runtime_context import process_model_config
    except ImportError:  # SGLang 0.5.17: the published record's
        from sglang.srt.runtime_context import get_server_args

        mc = compat.model_config_of(get_server_args())
    else:
        mc = process_model_config()
    return getattr(mc, "hf_text_config", None) or mc.hf_config


def current_role() -> str | None:
    """'prefill' on a prefill instance started with --enable-ess, 'decode' on a decode instance with ESS, else
    None."""
    s = settings_mod.current()
    mode = _disaggregation_mode()
    if mode == "decode" and s.enabled:
        return "decode"
    if mode == "prefill" and s.send_windows:
        return "prefill"
    return None


def _capture_max_bytes() -> int:
    raw = os.environ.get(ENV_CAPTURE_MAX_GB)
    if not raw:
        return DEFAULT_CAPTURE_MAX_BYTES
    try:
        return max(0, int(float(raw) * (1 << 30)))
    except ValueError:
        logger.warning("ESS: %s=%r is not a number; using %d GiB", ENV_CAPTURE_MAX_GB, raw,
                       DEFAULT_CAPTURE_MAX_BYTES >> 30)
        return DEFAULT_CAPTURE_MAX_BYTES


class WindowSender:
    """Prefill side: the capture (``warmup.capture_sink`` finds it) and the encoding into metadata slots."""

    start_layer = 0  # --pp-size 1 is required on a prefill instance with ESS

    def __init__(self, layout: WireLayout, windows: int, top_k: int, max_bytes: int | None = None):
        self.layout = layout
        # An ESS decode instance's budget is at least top_k + 1 slots: a prompt that short is loaded whole.
        self.capture = WindowCapture(layout.layers, windows, min_seq_len=top_k + 1,
                                     max_bytes=_capture_max_bytes() if max_bytes is None else max_bytes) \
            if windows > 0 else None

    def note_capture_unavailable(self, why: str) -> None:
        note_once("capture:" + why, "ESS (PD prefill): cannot capture the query windows (%s); the decode instance "
                  "warms such requests up from their most recent tokens (logged once)", why)

    def write(self, buffers, req) -> None:
        """Fill the request's slot from its captured windows, or say why there are none."""
        idx = int(req.metadata_buffer_index)
        row = buffers.ess_windows[idx]
        row[:HEADER_INTS] = 0
        seq_len = len(req.origin_input_ids)
        if self.capture is None:
            encode_no_sets(row, self.layout, room=req.bootstrap_room, seq_len=seq_len, state=STATE_NOT_CAPTURED)
            return
        rp = compat.req_row(req)
        windows = self.capture.take(int(rp), seq_len=seq_len) if rp is not None else None
        if windows is None:
            short = seq_len <= self.capture.min_seq_len
            encode_no_sets(row, self.layout, room=req.bootstrap_room, seq_len=seq_len,
                           state=STATE_SHORT if short else STATE_NOT_CAPTURED)
            if short:
                return
            STATS.unsent += 1
            if self.capture.skipped_rows:
                note_once("capture:bytes", "ESS (PD prefill): %d request(s) were not captured: their window sets "
                          "would exceed %s GiB of GPU memory (raise %s)", self.capture.skipped_rows,
                          f"{self.capture.max_bytes / (1 << 30):g}", ENV_CAPTURE_MAX_GB)
            return
        ranked, union = rank_window_sets(windows, seq_len, self.layout.cap)
        n_windows = max((int(w.shape[0]) for w in windows if w is not None), default=0)
        truncated = encode_row(row, self.layout, room=req.bootstrap_room, seq_len=seq_len, ranked=ranked,
                               union=union, windows=n_windows)
        STATS.sent += 1
        STATS.truncated_layers += truncated


# ---------------------------------------------------------------------------------------------- hooks

def metadata_buffers_init_hook(result, buffers, *args, **kwargs):
    """AFTER MetadataBuffers.__init__: the ESS window-set buffer, one slot per metadata slot (PD prefill with ESS,
    PD decode with ESS)."""
    role = current_role()
    if role is None:
        return None
    try:
        hf = _hf_text_config()
        layout = layout_for(hf)
    except Exception as exc:  # not a DSA model config: no sets (a launch with ESS on a non-DSA model is refused)
        logger.warning("ESS: no window-set metadata buffer (%s)", exc)
        return None
    size = int(buffers.output_ids.shape[0])
    buffers.ess_windows = torch.zeros((size, layout.row_ints), dtype=torch.int32, device=buffers.bootstrap_room.device)
    buffers.ess_layout = layout
    if role == "prefill":
        s = settings_mod.current()
        sender = WindowSender(layout, s.config.warmup_windows, int(hf.index_topk))
        buffers.ess_sender = sender
        set_sender(sender)
    logger.info("ESS PD warm-up sets (%s): metadata buffer of %d slots x %s B (%d layers x %d positions) = %.1f MiB",
                role, size, f"{layout.row_bytes:,}", layout.layers, layout.cap, size * layout.row_bytes / 2**20)
    return None


def get_buf_infos_hook(result, buffers, *args, **kwargs):
    """AFTER MetadataBuffers.get_buf_infos: register the window-set buffer with the transfer engine, last."""
    t = getattr(buffers, "ess_windows", None)
    if t is None:
        return None
    ptrs, lens, items = result
    return list(ptrs) + [t.data_ptr()], list(lens) + [t.nbytes], list(items) + [t[0].nbytes]


def set_buf_hook(result, buffers, req, *args, **kwargs):
    """AFTER MetadataBuffers.set_buf(req) (prefill, last chunk): the request's window sets into its slot."""
    sender = getattr(buffers, "ess_sender", None)
    if sender is not None:
        sender.write(buffers, req)
    return None


def clear_slot_hook(result, buffers, idx, *args, **kwargs):
    """AFTER MetadataBuffers.clear_slot(idx): the next owner of the slot must not read this request's sets."""
    t = getattr(buffers, "ess_windows", None)
    if t is not None:
        t[int(idx), :HEADER_INTS] = 0
    return None


def commit_transfer_hook(result, queue, decode_req, *args, **kwargs):
    """AFTER DecodeTransferQueue._commit_transfer_to_req(decode_req) (decode): the received sets onto the request,
    where the ESS coordinator's admit_request_direct reads them."""
    buffers = getattr(queue, "metadata_buffers", None)
    t = getattr(buffers, "ess_windows", None)
    if t is None:
        return None
    req = decode_req.req
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if isinstance(req.finished_reason, FINISH_ABORT) or compat.is_fake_transfer(req):
        return None
    got = decode_row(t[int(decode_req.metadata_buffer_index)], buffers.ess_layout, room=req.bootstrap_room,
                     seq_len=len(req.origin_input_ids))
    if isinstance(got, str):
        note_missing(got)
        return None
    ranked, _union, truncated = got
    req.ess_warmup_ranked = ranked  # None: a short prompt, loaded whole
    STATS.received += 1
    STATS.truncated_layers += truncated
    return None
