"""ECHO prefetch and spare-slot refills in SGLang's decode step: what the plugin adds around each DSA layer.

One decode layer with ESS in SGLang 0.5.23, top to bottom (main stream unless noted; the whole step is one CUDA
graph, and everything below is fixed-shape device work):

  1. ``Indexer._get_topk_paged``: the indexer logits [rows, max_seq_len] (DeepGEMM ``fp8_paged_mqa_logits``).
     [tap, before ``metadata.topk_transform``] where the layer prefetches, on the side stream: the positions
     scoring above the layer's EMA threshold whose entries are not resident (``EchoPrefetcher.candidates``, most
     recent first, capped per request) are fetched into spare slots (``HotPoolCacheManager.prefetch_above``: with
     spare slots on the GPU, candidates and claims in one launch and a close) while the main stream runs the top-k.
     This step's own token is a candidate too, though its host row is not written yet (SGLang stores the token in the
     attention backend, after the indexer): the prefetch copies a stale row, the exact resolve in 3c finds it
     resident instead of fetching it over PCIe on the critical path, and the write-back at the resolve's end writes
     the token's entry into that slot (the write-back writes the hot slot of a resident entry too). (The write-back
     also protects it: a prefetched new token counts as useful in 3d even in the rare step whose top-k does not
     select it, at most one entry per request and layer; unless that resolve needed LRU victims and evicted it first,
     being a prefetched entry, stamped evictable: then it is counted wasted, and fetched if a later step selects it.)
  2. ``metadata.topk_transform``: the top-k positions [rows, k], with the kernel and plan SGLang runs without ESS
     (``decode_topk.select``: HiSparse would force SGLang's unfused top-k, which can select other entries).
     [tap, after] the logits and the positions are kept for 3d (no launch here: the k-th best score is found
     beside attention, off the main stream).
  3. ``DeepseekSparseAttnBackend.forward_decode``: SGLang writes the token into its new-token slot, then
     ``EssCoordinator.swap_in_selected_pages``:
       a. the main stream waits for the side stream: the prefetch has landed, and the previous layer's refill is
          done (it shares the resolve's scratch buffers);
       b. (nothing: the thresholds move in d, off the main stream);
       c. the exact resolve: lookup, spare slots then LRU victims, fetch of whatever is still missing (exact
          backfill: attention reads exactly the selected entries), with ``new_tokens: insert`` (the default) giving
          this step's token a protected hot slot too (as a miss, not copied); its last launch writes the token back
          (host pool, and its hot slot where it has one, over whatever the fetch or the prefetch copied from its
          unwritten host row). The step's request rows are computed and the LRU clock advanced once a step, in the
          first layer (at its tap in 1 where that layer prefetches, else here);
       d. on the side stream, beside attention: the prefetched entries counted useful or wasted
          (``settle_prefetch``), each row's k-th best score (the lowest logit among its selected positions, from
          the logits and positions kept in 2) folded into the layer's thresholds (after the prefetch's candidate
          reads, which are on that stream), the spare slots taken since the layer's last refill refilled when due
          (``refill_spares``: every step, or every ``spare_refill_interval``-th). The logits stay alive until the
          main stream next waits for the side stream (SGLang's indexer backends allocate them per call, DeepGEMM's
          ``fp8_paged_mqa_logits`` included: a reference keeps their memory from reuse);
       e. in the last layer the main stream waits for the side stream: nothing stays queued past the step (the
          graph ends there, and warm-up and release run between steps).
  4. FlashMLA over the returned device-pool rows.

This mirrors ``ess_sglang.decode_stack`` (one-chunk prefetch, ``prefetch_chunks=1``: SGLang computes the logits in
one call, so the indexer is not split). Which layers prefetch and how many spare slots a layer keeps is decided
at start-up (``plan``), from ``ess_config``.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ess_sglang.cache_manager import MAX_REFILL_INTERVAL, FetchList, HotPoolCacheManager
from ess_sglang.config import EssConfig
from ess_sglang.kernels.prefetch import new_claim_counters
from ess_sglang.kernels.resolve import MERGED_TAIL_MAX_ENTRIES
from ess_sglang.kernels.topk import kth_of_selection_any
from ess_sglang.overlap_policy import ONE_CALL_MODES, PREFETCH_CHUNKS, load_profile
from ess_sglang.prefetch import EchoPrefetcher
from ess_sglang.streams import SideStream

logger = logging.getLogger("ess_sglang.sglang_plugin")

PREFETCH_PROGRAMS = 16  # persistent copy programs of a prefetch beside the top-k (decode_layers.py's setting)
AUTO_SPARE_FRACTION = 1 / 16  # of top_k x max_running_requests: 1.25 x the misses of a step at 95% hits
MAX_SPARE_SHARE = 1 / 8  # spare slots never take more than this share of a layer's hot pool
# Where no layer prefetches: one page of spare slots a layer, refilled every 64 steps, taken only by calls of up to
# MERGED_TAIL_MAX_ENTRIES entries (one or two requests at top-k 2,048 with their tokens), so that those resolves run no
# pool scan in most steps. In the real server at 32K on an H100 (one run with all-HBM, docs/design.md, "In the real
# server") the decode step went from 1.042x all-HBM's to 1.029x at one request and from 1.042x to 1.027x at two;
# larger batches run as without spare slots (their graphs hold no refill)
SMALL_BATCH_SPARE_REFILL_INTERVAL = 64
SMALL_BATCH_SPARE_MAX_ENTRIES = MERGED_TAIL_MAX_ENTRIES
PLUGIN_MODES = ONE_CALL_MODES
"""What the plugin runs in a decode layer: SGLang computes a layer's indexer logits in one call and its attention in
one, so ECHO prefetch in one chunk (beside the top-k), or none. DBA and the prefetch in chunks run in the decode
harness only; a profile's layer in one of those runs the fastest of these by the profile's own times."""


@dataclass(frozen=True)
class OverlapPlan:
    """What the plugin runs in each decode layer."""

    prefetch_layers: tuple[bool, ...]
    spare_slots: int
    note: str  # one line for the start-up log
    prefetch_margins: tuple[float, ...] = ()  # per layer: its ECHO threshold margin (empty: DecodeOverlap gives every
    # layer ess_config.prefetch_threshold_margin)
    refill_interval: int = 1  # a layer's spare slots are refilled every this many steps (and when few are left)
    spare_max_entries: int | None = None  # only calls of at most this many entries take spare slots (None: all)


def plan(config: EssConfig, num_layers: int, top_k: int, max_running_requests: int, hot_slots_per_layer: int,
         page_size: int) -> OverlapPlan:
    """Prefetching layers, their threshold margins and spare slots per layer, from ``prefetch_overlap_level``,
    ``overlap_profile``, ``prefetch_threshold_margin``, ``spare_slot_fraction`` and ``spare_refill_interval`` (unset:
    the interval the profile's spare-slot runs were measured with, else 1; the automatic spare size covers that many
    steps; where no layer prefetches and ``spare_slot_fraction`` is unset, one page a layer for resolves of one or two
    requests, refilled every 64 steps unless set: ``SMALL_BATCH_SPARE_*``). Without a profile, level
    ``auto`` (the default) prefetches in no layer and ``full`` in every one: in the decode harness's last three tables,
    this one-chunk prefetch with spare slots was slower than no prefetch without them in 13, 14 and 14 of 18
    configurations at batch 16-128 (benchmarks/RESULTS.md, decode_layers), and a profile
    calibrated from any of those runs gives every layer sync. A profile whose calibration
    measured a margin (``ess profile --calibration-margin``) sets every layer's: its *_margin layers run that margin,
    its other prefetch layers none (the policy chose them because margin 0 measured faster there), and
    ``prefetch_threshold_margin`` is then not used (a warning says so if it is set); otherwise every layer runs
    ``prefetch_threshold_margin``. DBA needs SGLang's indexer call split in batch halves, and prefetch in chunks its
    indexer call split, which the plugin does not do: a profile's layer in one of those modes runs the one of
    ``PLUGIN_MODES`` the profile gives the smallest exposed time (`OverlapProfile.modes_within`; exact, like every
    mode)."""
    level = config.prefetch_overlap_level
    margins = [config.prefetch_threshold_margin] * num_layers
    measured = None  # the overlap profile's calibration, if it has one
    if level == "none":
        layers, why = [False] * num_layers, "prefetch_overlap_level none"
    elif level == "auto" and config.overlap_profile is None:
        layers, why = [False] * num_layers, ("prefetch_overlap_level auto without an overlap_profile: one-chunk "
                                             "prefetch measured slower than none in most harness configurations; "
                                             "give a profile from `ess profile --calibration`, or level full")
    elif config.overlap_profile is not None:
        profile = load_profile(config.overlap_profile, num_layers)
        profiled = profile.modes()
        modes = profile.modes_within(PLUGIN_MODES)
        layers = [m in PREFETCH_CHUNKS for m in modes]
        measured = profile.device.measured
        if measured is not None and measured.prefetch_margin is not None:  # the profile chose each layer's margin
            if config.prefetch_threshold_margin:
                logger.warning("ESS: prefetch_threshold_margin %g is not used: overlap profile %s sets each layer's "
                               "margin (its calibration measured margin 0 and %g)", config.prefetch_threshold_margin,
                               config.overlap_profile, measured.prefetch_margin)
            margins = profile.prefetch_margins(modes)
        moved = Counter((p, m) for p, m in zip(profiled, modes, strict=True) if p != m)
        why = f"overlap profile {config.overlap_profile}" + (
            f" (its layers in modes the plugin does not run take the fastest mode it runs by the profile's times: "
            f"{', '.join(f'{n} {p} -> {m}' for (p, m), n in sorted(moved.items()))})" if moved else "")
    else:
        layers, why = [True] * num_layers, "prefetch_overlap_level full without an overlap_profile"
    # the refill interval: as set, else the one the profile's spare-slot runs were measured with, else every step
    theirs = measured.spare_refill_interval if measured is not None else None
    interval = config.spare_refill_interval or theirs or 1
    if not 1 <= interval <= MAX_REFILL_INTERVAL:
        raise ValueError(f"overlap profile {config.overlap_profile}: its spare_refill_interval {interval} is outside "
                         f"[1, {MAX_REFILL_INTERVAL}]; set ess_config.spare_refill_interval")
    fraction = config.spare_slot_fraction
    small_batch = fraction is None and not any(layers)  # the one-page reserve for one or two requests
    if small_batch:
        interval = config.spare_refill_interval or SMALL_BATCH_SPARE_REFILL_INTERVAL
        wanted = page_size
    else:
        if fraction is None:
            fraction = AUTO_SPARE_FRACTION * interval
        wanted = math.ceil(fraction * top_k * max_running_requests / page_size) * page_size
    cap = int(hot_slots_per_layer * MAX_SPARE_SHARE) // page_size * page_size
    spare = min(wanted, cap)
    if spare and theirs is not None and theirs != interval:
        logger.warning("ESS: overlap profile %s chose its modes from runs whose spare slots were refilled every %d "
                       "steps; this instance refills every %d (spare_refill_interval): the times it chose by may not "
                       "apply", config.overlap_profile, theirs, interval)
    with_margin = sorted({m for m, on in zip(margins, layers, strict=True) if on and m > 0})
    note = (f"ECHO prefetch in {sum(layers)} of {num_layers} layers ({why})"
            + (f", threshold margin {' / '.join(f'{m:g}' for m in with_margin)}" if with_margin else "")
            + f"; {spare} spare slots per layer"
            + (f" for resolves of up to {SMALL_BATCH_SPARE_MAX_ENTRIES:,} entries (one or two requests)"
               if spare and small_batch else "")
            + (f", refilled every {interval} steps" if spare and interval > 1 else "")
            + (f" (asked {wanted}, capped at 1/8 of the hot pool)" if spare < wanted else ""))
    return OverlapPlan(tuple(layers), spare, note, tuple(float(m) for m in margins), interval,
                       SMALL_BATCH_SPARE_MAX_ENTRIES if small_batch and spare else None)


class DecodeOverlap:
    """The side-stream work of the decode step (module docstring): ECHO prefetch and spare-slot refills."""

    def __init__(self, manager: HotPoolCacheManager, plan: OverlapPlan, num_rows: int, max_context: int,
                 max_batch: int, config: EssConfig):
        if len(plan.prefetch_layers) != manager.num_layers:
            raise ValueError(f"overlap plan for {len(plan.prefetch_layers)} layers, the pools have "
                             f"{manager.num_layers}")
        self.m = manager
        self.num_layers = manager.num_layers
        self.prefetch_layers = plan.prefetch_layers
        self.min_batch = config.prefetch_min_batch
        self.streams = SideStream(manager.device)
        self.prefetcher = None
        if any(plan.prefetch_layers):
            self.prefetcher = EchoPrefetcher(self.num_layers, num_rows, max_context, alpha=config.prefetch_ema_alpha,
                                             cap_fraction=config.prefetch_cap_fraction,
                                             cap_min_tokens=config.prefetch_cap_min_tokens, device=manager.device,
                                             margin=plan.prefetch_margins or config.prefetch_threshold_margin,
                                             pdl=manager.pdl)  # one setting (ess_config.resolve_pdl) for both
            n = max_batch * self.prefetcher.width
            self.fetch_list = manager.new_fetch_list(n)
            self._claim_counters = new_claim_counters(max_batch, manager.device)  # (zero between launches)
            manager.reserve_scratch(n)
        # layer -> (logits, top-k positions, request rows) of its selection, for its k-th best scores
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._side_reads: list[torch.Tensor] = []  # what the side stream reads: alive until the main stream waits
        self._folding: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # the layer's note, 3a to 3d

    def prefetches(self, layer: int, batch: int | None = None) -> bool:
        """Whether the layer prefetches (in a decode batch of `batch` requests: not below `prefetch_min_batch`).
        SGLang captures one CUDA graph per batch size, so each graph either prefetches or does not."""
        return (self.prefetcher is not None and 0 <= layer < self.num_layers and self.prefetch_layers[layer]
                and (batch is None or batch >= self.min_batch))

    # ------------------------------------------------------------------------------------------ 1. before the top-k
    def prefetch(self, layer: int, logits: torch.Tensor, req_pool_indices: torch.Tensor, visible_lens: torch.Tensor,
                 req_to_host_pool: torch.Tensor) -> None:
        """Queue the layer's prefetch on the side stream. logits [rows, T] (rows <= the batch: SGLang computes the
        real rows only); visible_lens [batch]: positions a candidate may come from (0 for padding rows)."""
        pf = self.prefetcher
        B = min(logits.shape[0], req_pool_indices.shape[0])
        span = logits.shape[-1]
        if span > req_to_host_pool.shape[1]:
            raise ValueError(f"ESS prefetch: the indexer logits cover {span} positions, the host-pool table only "
                             f"{req_to_host_pool.shape[1]}")
        scores = logits[:B].unsqueeze(1)
        W = pf.width
        self._side_reads.extend((logits, req_pool_indices, visible_lens))
        self.m.settle_pending_prefetch()  # a step cut short before its settle (an exception) leaves nothing behind
        self._pending.pop(layer, None)  # (nor a k-th score noted in it)
        with self.streams.on_side():
            # (with spare slots on the GPU, candidates and claims in one launch and a close:
            # HotPoolCacheManager.prefetch_above)
            scored = pf.scored(layer, scores, req_to_host_pool, req_pool_indices[:B], visible_lens[:B])
            record = FetchList(self.fetch_list.src[:B * W], self.fetch_list.dst[:B * W], self.fetch_list.count)
            self.m.prefetch_above(layer, scored, record, self._claim_counters, programs=PREFETCH_PROGRAMS,
                                  chained=pf.pdl)

    # ------------------------------------------------------------------------------------------ 2. after the top-k
    def note_selection(self, layer: int, logits: torch.Tensor, positions: torch.Tensor,
                       req_pool_indices: torch.Tensor) -> None:
        """Keep the layer's logits and top-k positions: each row's k-th best score, the lowest logit among its
        selected positions (-1: none; a row with nothing selected gives +inf, which leaves a threshold at +inf), is
        found and folded into the thresholds beside attention (3d), not here on the main stream between the top-k
        and the resolve (in the decode harness on the H200 that placement cost 1.5-7.4 us a layer:
        benchmarks/RESULTS.md, decode_layers)."""
        B = min(logits.shape[0], positions.shape[0], req_pool_indices.shape[0])
        self._pending[layer] = (logits[:B], positions[:B], req_pool_indices[:B])

    # ------------------------------------------------------------------------------------------ 3. swap-in
    def before_resolve(self, layer: int) -> None:
        """3a: wait for the side stream (the layer's prefetch, the previous layer's refill); take the layer's noted
        k-th scores (used once: a resolve that raises leaves none behind for a later step)."""
        self.streams.wait()
        self._side_reads.clear()
        self._folding = self._pending.pop(layer, None) if self.prefetcher is not None else None

    def after_resolve(self, layer: int) -> None:
        """3d-e: settle, move the thresholds and refill beside attention; the last layer joins the side stream."""
        pending, self._folding = self._folding, None
        refill = self.m.refill_follows(layer)  # (not after a resolve that left the spare slots alone)
        if pending is not None or self.prefetches(layer) or refill:
            with self.streams.on_side():
                self.m.settle_prefetch(layer)  # (nothing to count where the tap did not prefetch)
                if pending is not None:  # after this layer's candidate reads, queued before on this stream
                    logits, positions, rows = pending
                    self._side_reads.extend(pending)
                    # (one launch for what SGLang's decode top-k gives: float32 logits, int32 positions)
                    self.prefetcher.update(layer, kth_of_selection_any(logits, positions, short_rows="lowest"), rows)
                if refill:
                    self.m.refill_spares(layer)
        if layer == self.num_layers - 1:
            self.streams.wait()
            self._side_reads.clear()  # (nothing the side stream reads outlives the step: graphs share a memory pool)
            self._pending.clear()  # notes of layers whose resolve did not run (a step cut short) are stale now

    def forget_rows(self, rows: Sequence[int] | torch.Tensor) -> None:
        """Request rows that a new request will take: their thresholds start again at +inf."""
        if self.prefetcher is not None:
            self.prefetcher.reset_rows(torch.as_tensor(rows, dtype=torch.int64))
