"""ECHO prefetch: fetch likely misses while the exact top-k is still being computed.

The indexer's k-th best score moves slowly from step to step. Per layer and request row we keep an EMA of it,

    threshold <- alpha * kth_score + (1 - alpha) * threshold        (the first step takes kth_score as it is)

and, as soon as a step's indexer logits exist, every visible position scoring above the threshold whose entry is
not resident is a prefetch candidate. Candidates are taken most recent first, at most `cap(seq_len)` per request:

    cap(seq_len) = clamp(ceil(cap_fraction * seq_len), cap_min_tokens, width),   width = the static list width

so the cap grows with context length and bounds the bytes a wrong guess can waste. Logits of a segment of the
positions only (the decode stack's prefetch in position segments) take the segment's share of the cap, rounded up:
ceil(cap x seen / seq_len), seen the segment's positions below seq_len; segments that tile the positions take at most
the cap plus one per segment. With `margin` > 0 the bar a
position must pass is lowered to threshold - margin x |threshold| (finite thresholds): more of the step's misses are
caught, for more wasted bytes. The margin may differ per layer (an overlap profile's *_margin layers). The cache
manager fetches them (`HotPoolCacheManager.prefetch`) on a side stream while the main stream runs the top-k; the
exact resolve that follows finds them resident, counts them useful or wasted, and fetches whatever is still missing
(exact backfill), so prefetching changes which entries are resident, never which entries attention reads.

Everything here is fixed-shape torch ops on device tensors (no host synchronisation): it runs inside a CUDA graph.
A row's threshold starts at +inf (nothing is prefetched before the row's first step); `reset_rows` restores that
when a request row is reused.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ess_sglang.config import EssConfig

_DEFAULTS = {name: EssConfig.model_fields[f"prefetch_{key}"].default
             for name, key in (("alpha", "ema_alpha"), ("cap_fraction", "cap_fraction"),
                               ("cap_min_tokens", "cap_min_tokens"), ("margin", "threshold_margin"))}


def is_margin(value: object) -> bool:
    """A valid threshold margin: a real number (not a bool) in [0, 1)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and 0 <= value < 1


@dataclass(frozen=True)
class ScoredSegment:
    """One layer's indexer logits [B, Q, T] of positions [first_pos, first_pos + T), with what picks their prefetch
    candidates (`EchoPrefetcher.scored`)."""

    prefetcher: EchoPrefetcher
    layer: int
    logits: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    margin: float
    first_pos: int

    @property
    def rows(self) -> int:
        return self.logits.shape[0]

    def candidates(self, loc_to_slot: torch.Tensor, num_locations: int) -> torch.Tensor:
        """`EchoPrefetcher.candidates` of the segment (int64 [B * width], most recent first, -1 padded)."""
        return self.prefetcher.candidates(self.layer, self.logits, self.req_to_token, self.req_pool_indices,
                                          self.seq_lens, loc_to_slot, num_locations, margin=self.margin,
                                          first_pos=self.first_pos)

    def triton_args(self) -> tuple:
        """The score-side arguments of `kernels.prefetch.claim_above_triton`, in its order (without num_locations,
        which the pool gives)."""
        pf = self.prefetcher
        rows = self.logits if self.logits.stride(-1) == 1 else self.logits.contiguous()
        return (rows, pf.threshold[self.layer], self.margin, self.req_to_token, self.req_pool_indices, self.seq_lens,
                self.first_pos, pf._cap_fraction, pf.cap_min_tokens, pf.width)


class EchoPrefetcher:
    def __init__(self, num_layers: int, num_rows: int, max_context: int, alpha: float = _DEFAULTS["alpha"],
                 cap_fraction: float = _DEFAULTS["cap_fraction"], cap_min_tokens: int = _DEFAULTS["cap_min_tokens"],
                 device: torch.device | str = "cpu", impl: str = "auto",
                 margin: float | Sequence[float] = _DEFAULTS["margin"], pdl: bool | None = None):
        """Defaults: EssConfig's prefetch_ema_alpha, prefetch_cap_fraction, prefetch_cap_min_tokens and
        prefetch_threshold_margin. `margin`: one for every layer, or one per layer. `pdl`: the Triton candidate
        kernels after the first with programmatic dependent launch (None: where supported, sm_90+; the decode stack
        then also chains the prefetch's claim launches, `HotPoolCacheManager.prefetch(chained=True)`); True where it
        cannot run (no sm_90+ GPU, or `impl="torch"`) is refused, by the resolve's own rule
        (`ess_sglang.kernels.resolve.pdl_setting`)."""
        if not 0 < alpha <= 1:
            raise ValueError(f"prefetch alpha must be in (0, 1], got {alpha}")
        if isinstance(margin, str | bytes):
            raise ValueError(f"prefetch margin: a number in [0, 1) or one per layer, got {margin!r}")
        if getattr(margin, "ndim", None) == 0:  # a 0-d tensor or numpy array: one number
            margin = float(margin)
        per_layer = [margin] * num_layers if isinstance(margin, numbers.Real) else list(margin)
        if len(per_layer) != num_layers:
            raise ValueError(f"prefetch margin: one number or one per layer ({num_layers}), got {len(per_layer)}")
        bad = [m for m in per_layer if not is_margin(m)]
        if bad:
            raise ValueError(f"prefetch margin must be in [0, 1), got {bad[0]!r}")
        if not 0 <= cap_fraction <= 1 or cap_min_tokens < 0 or max_context <= 0:
            raise ValueError(f"prefetch cap: cap_fraction in [0, 1], cap_min_tokens >= 0 and max_context > 0 needed, "
                             f"got {cap_fraction}, {cap_min_tokens}, {max_context}")
        self.alpha = float(alpha)
        self.margins = tuple(float(m) for m in per_layer)  # per layer
        self.cap_fraction = float(cap_fraction)
        self.cap_min_tokens = int(cap_min_tokens)
        self.width = max(1, min(max_context, max(cap_min_tokens, math.ceil(cap_fraction * max_context))))
        self.device = torch.device(device)
        self.impl = impl  # candidate selection: "triton", "torch" or "auto" (triton on CUDA)
        from ess_sglang.kernels.resolve import pdl_setting

        self.pdl = pdl_setting(pdl, self.device, impl != "torch", "prefetch pdl", "the Triton candidate kernels",
                               f"impl {impl!r} on {self.device}")
        # the cap fraction as the Triton kernel reads it (float64, on the device: a graph cannot copy it there later)
        self._cap_fraction = torch.tensor([self.cap_fraction], dtype=torch.float64, device=self.device)
        self.threshold = torch.full((num_layers, num_rows), math.inf, dtype=torch.float32, device=self.device)

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Forget the thresholds of request rows (a new request takes them)."""
        self.threshold[:, rows.long().to(self.device)] = math.inf

    def caps(self, seq_lens: torch.Tensor, first_pos: int = 0, positions: int | None = None) -> torch.Tensor:
        """Most entries prefetched per request and layer, [B] int64; for logits of the positions [first_pos,
        first_pos + positions) only, the segment's share (see the module docstring)."""
        cap = torch.ceil(seq_lens.double() * self.cap_fraction).long()
        cap = cap.clamp(min=self.cap_min_tokens).clamp(max=self.width)
        seq = seq_lens.long()
        seen = (seq - first_pos).clamp(min=0)
        if positions is not None:
            seen = seen.clamp(max=positions)
        return torch.where(seen > 0, (cap * seen + seq.clamp(min=1) - 1) // seq.clamp(min=1), 0)

    def runs_triton(self, logits: torch.Tensor, impl: str | None = None) -> bool:
        """Whether candidates of `logits` are found by the Triton kernels (impl "triton", or "auto" on CUDA)."""
        impl = self.impl if impl is None else impl
        return impl == "triton" or (impl == "auto" and logits.is_cuda)

    def _check_segment(self, layer: int, logits: torch.Tensor, req_to_token: torch.Tensor, margin: float | None,
                       first_pos: int) -> float:
        """The margin a call uses (the layer's where None), once its segment and margin are checked."""
        T = logits.shape[-1]
        if first_pos < 0 or (first_pos and first_pos + T > req_to_token.shape[1]):
            raise ValueError(f"prefetch candidates: logits of positions [{first_pos}, {first_pos + T}) must lie within "
                             f"the request table's {req_to_token.shape[1]} positions")
        if margin is None:
            return self.margins[layer]
        if not is_margin(margin):
            raise ValueError(f"prefetch margin must be in [0, 1), got {margin!r}")
        return margin

    def scored(self, layer: int, logits: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor, margin: float | None = None, first_pos: int = 0) -> ScoredSegment:
        """A layer's logits of positions [first_pos, first_pos + T), checked as `candidates` checks them, for
        `HotPoolCacheManager.prefetch_above` (which finds and claims their candidates in one launch where it can)."""
        margin = self._check_segment(layer, logits, req_to_token, margin, first_pos)
        return ScoredSegment(self, layer, logits, req_to_token, req_pool_indices, seq_lens, float(margin), first_pos)

    def candidates(self, layer: int, logits: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                   seq_lens: torch.Tensor, loc_to_slot: torch.Tensor, num_locations: int,
                   impl: str | None = None, margin: float | None = None, first_pos: int = 0) -> torch.Tensor:
        """KV locations to prefetch for one layer: int64 [B * width], -1 padded.

        logits [B, Q, T] of the positions [first_pos, first_pos + T) (within the table width; a segment takes its
        share of the cap); loc_to_slot: the layer's token -> slot map (with its sink element).
        impl: "triton" (two launches, `ess_sglang.kernels.prefetch`), "torch" (the definition below), "auto"
        (triton on CUDA); None: the prefetcher's own `impl`. margin: this call's threshold margin instead of the
        layer's (None: the layer's).
        """
        impl = self.impl if impl is None else impl
        margin = self._check_segment(layer, logits, req_to_token, margin, first_pos)
        if self.runs_triton(logits, impl):
            from ess_sglang.kernels.prefetch import prefetch_candidates_triton
            # the kernels take row strides: only a strided last dimension is copied (DeepGEMM's logits are a view
            # of a buffer with padded rows)
            rows = logits if logits.stride(-1) == 1 else logits.contiguous()
            return prefetch_candidates_triton(rows, self.threshold[layer], req_to_token,
                                              req_pool_indices, seq_lens, loc_to_slot, num_locations,
                                              self._cap_fraction, self.cap_min_tokens, self.width, float(margin),
                                              pdl=self.pdl and logits.is_cuda, first_pos=first_pos)
        B, _, T = logits.shape
        rows = req_pool_indices.long()
        row_ok = (rows >= 0) & (rows < req_to_token.shape[0])  # a row outside the table: no candidates
        rows = torch.where(row_ok, rows, 0)
        thr = self.threshold[layer, rows]
        thr = torch.where(torch.isfinite(thr), thr - margin * thr.abs(), thr).view(B, 1, 1)
        above = (logits > thr).any(dim=1)  # [B, T]
        pos = torch.arange(first_pos, first_pos + T, device=logits.device).view(1, T)
        locs = req_to_token[rows, first_pos:first_pos + T].long()
        ok = row_ok.view(B, 1) & (pos < seq_lens.long().view(B, 1)) & (locs >= 0) & (locs < num_locations)
        at = torch.where(ok, locs, num_locations)
        resident = loc_to_slot[at] >= 0
        cand = above & ok & ~resident
        rank = cand.flip(-1).cumsum(-1).flip(-1) - 1  # 0 = the most recent candidate
        take = cand & (rank < self.caps(seq_lens, first_pos, T).view(B, 1))
        W = self.width
        out = torch.full((B, W + 1), -1, dtype=torch.int64, device=logits.device)
        out.scatter_(1, torch.where(take, rank, W), torch.where(take, locs, -1))
        return out[:, :W].reshape(-1)

    def update(self, layer: int, kth_scores: torch.Tensor, req_pool_indices: torch.Tensor) -> None:
        """Fold this step's k-th best score of each request ([B, Q] or [B]; the lowest over query tokens counts).
        One Triton launch on CUDA (`kernels/prefetch.ema_update_triton`; it may round the last bit differently)."""
        if self.impl == "triton" or (self.impl == "auto" and kth_scores.is_cuda):
            from ess_sglang.kernels.prefetch import ema_update_triton
            ema_update_triton(self.threshold[layer], kth_scores, req_pool_indices, self.alpha)
            return
        kth = kth_scores.float().reshape(kth_scores.shape[0], -1).amin(dim=1)
        rows = req_pool_indices.long()
        old = self.threshold[layer, rows]
        new = torch.where(torch.isfinite(old), self.alpha * kth + (1 - self.alpha) * old, kth)
        self.threshold[layer].index_copy_(0, rows, new)
