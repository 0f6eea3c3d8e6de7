"""Per-layer overlap policy: which way each decode layer hides its miss fetch, chosen offline from a profile.

Every decode layer resolves the indexer's exact top-k selection against its hot pool, and fetches the distinct
misses over PCIe before attention reads them. Six modes, chosen per layer:

    sync  resolve + fetch, then attention: nothing overlaps.
    dba   dual-batch: the batch is split in two halves (a fraction f = dba_split of it in half A); half A's resolve +
          fetch run on a side stream while half B's indexer + top-k run; then half B's resolve + fetch, exposed;
          then ONE attention over the whole batch once both halves are resident (`dba_attention="whole"` in
          ess_sglang/decode_stack.py, the runtime's default, exact). The optional "split" attention variant (half A
          attends while half B's fetch runs) is not modelled.
    prefetch   sync, plus ECHO prefetch: candidates scoring above the EMA of the k-th best score are fetched on a side
               stream beside the top-k; the exact resolve then fetches what is still missing.
    prefetch2  prefetch with the indexer run in two batch chunks: the first chunk's prefetch also overlaps the
               second chunk's indexer.
    prefetch3  the same in three chunks, of the fractions the calibration was measured with (e.g. 0.5 / 0.3 / 0.2,
               `decode_layers.py --prefetch-fractions`, recorded in the profile with the chunks' split, launch and
               last-chunk setting: `profile_stack_options`; the decode harness runs them so, the plugin not at all).
    prefetch_margin, prefetch2_margin, prefetch3_margin
               the same with the threshold lowered by the calibration's margin m (candidates above thr - m|thr|):
               more of the step's misses caught, more copies wasted; offered only by a calibration that measured a
               run at that margin (`ess_sglang.stack_calibration`), whose margin the layer then runs with
               (`layer_prefetch_margins`).

A seventh, da (dual attention: attention over the hits while the misses copy, then over the misses, merged by
log-sum-exp), was removed: it was slower than sync in every configuration the decode harness measured (docs/design.md,
"Overlap modes"). A profile or device-timings file written before then loads without da's times and constants; a
profile with a layer that chose da is refused at load (`config.DA_REMOVED`), as is the level "da".

Where the policy gets the modes' costs: from a measured calibration of the device (`DeviceTimings.measured`, built
by `ess profile --calibration` from a `benchmarks/decode_layers.py` run: every mode's exposed time at a grid of
batch x context x hit rate, interpolated; `ess_sglang.stack_calibration`) wherever its grid covers the profile's
batch and context; elsewhere, and always without a calibration, from the analytic cost model below, which covers
sync / dba only (prefetch's gain depends on how long the top-k and the second chunk's indexer run beside its
candidate kernels, and on how much of what it fetches the top-k then selects: a three-constant term fitted to one
run predicted the better of sync and prefetch in 10 of 18 configurations, docs/design.md, so it is not
modelled).

`ess profile` (ess_sglang/profile_cmd.py) replays top-k traces through the cache manager to count every layer's
misses per step, applies the costs above and writes an overlap profile (YAML, `OverlapProfile`). The decode stack
takes its per-layer options from it with `layer_settings(path, num_layers, level)` (overlap mode and prefetch chunks
of each layer), `layer_prefetch_margins` (each layer's threshold margin) and `profile_stack_options` (how its prefetch
chunks run, as the calibration measured them); `benchmarks/decode_layers.py`'s
layerwise mode writes one profile per configuration and runs what it reads back. The SGLang plugin
(`ess_sglang.sglang_plugin.echo.plan`) runs only sync and one-chunk prefetch (SGLang computes a layer's logits and its
attention in one call each): a profile's layer in another mode runs the faster of those by the layer's own times
(`OverlapProfile.modes_within`), with each layer's margin.

Cost model (one layer, one decode step; all times in microseconds, constants in `DeviceTimings`)::

    M        distinct misses of the whole batch in the step
    B, C     batch (requests) and mean context length (tokens per request)
    T        = M x entry_bytes / h2d_gbps / 1e3          fetch time of the misses over PCIe
    I(b, C)  = indexer_topk_us x (b x C) / (indexer_ref_batch x indexer_ref_context)    indexer + top-k
    R        = resolve_us                                 resolve bookkeeping (lookup, dedup, eviction)
    h_dba    = dba_hidden_fraction    share of the overlapped work that DBA hides beside the indexer + top-k
             (measured: a copy on a side stream competes with the kernel beside it for SMs and HBM bandwidth)
    f        = dba_split              fraction of the batch in DBA's half A

    exposed time (what ESS adds to the layer's critical path, against the same layer with every latent in HBM):
    sync  = R + T
    dba   = R + T - h_dba x min(f (T + R), I((1 - f) B, C)) + dba_overhead_us
            (half A's share of the resolve + fetch, f (T + R), overlaps half B's indexer + top-k; half B's share
            is exposed; f B is not rounded; dba is unavailable, None, when B < 2)

    mode = the one with the smallest exposed time (ties go to the earlier of MODES); M == 0 always gives "sync".

Resolve is on the critical path in sync. In dba half A's resolve runs on the side stream before its copy, so it joins
the overlapped work and is hidden at the same fraction h_dba (the overlap was measured for the copy alone); half B's
resolve is exposed. The exposed times read as ESS's whole per-layer cost.

With the H200 defaults at B = 64, C = 32K (T = 0.0156 us per miss, f = 0.75 so half B holds 16 requests, I(16, 32K) =
75 us): sync at every miss count. DBA hides at most 0.8 x 75 = 60 us (half B's window is full from 0.75 (T + 40) = 75,
T = 60 us, 3,842 misses), less than its 130 us overhead (mostly the split's second torch.topk), so it stays at least
70 us behind sync (exactly 70 from 3,842 misses). The measured decode stack ranks them the same way
(benchmarks/results/decode_layers/decode_layers_1454.json, 2026-11-29 14:54 UTC, H200, hit 0.95, per layer: all-HBM
561.5 us, sync 697.9, dba 732.1; the model predicts dba +70 over sync, measured +34).

DBA beats sync only where 0.8 x I((1 - f) B, C) exceeds 130 us (half B's window above 162.5 us, B x C above
4,543,829 tokens: batch 64 from 70,998 tokens of context, batch 128 from 35,499, 32K context from batch 139), and then
only above T = 176.7 us (11,311 misses, where 0.8 x 0.75 (T + R) passes 130 us). At 32K context the model therefore
picks sync below batch 139, and dba above 11,311 misses from batch 139.

Checked against the measured decode stack (benchmarks/results/decode_layers/decode_layers_1454.json: 4 layers, 32K and
128K context, batch 16 / 64 / 128, hit 0.90 / 0.95 / 0.99, dba at split 0.75): with each layer's mode chosen from the
sync row's misses per layer, the model picks the faster measured of sync / dba at 15 of the 18 configurations.
The three misses are sync where dba was faster, at 32K: batch 128 hit 0.90 (+4.4%) and 0.95 (+4.9%), batch 64 hit 0.90
(+0.3%); the measured DBA hides more than the linear window I((1 - f) B, C) allows (half B's torch.topk is
latency-bound, ~120 us at any row count; dba - sync measured -63 us at 32K, batch 128, hit 0.90, predicted +10). In
that run ECHO prefetch (then in one chunk only) was the fastest measured mode in 6 of those 18 configurations (batch
16, and 64 at 32K), by 0.4-6.6%; the analytic model does not offer it (above), a calibration does.

File layout (`save_profile` writes it, `load_profile` validates it)::

    format_version: 1
    header:  {command, date, source, trace, slots_per_layer, ratio, batch, context, top_k, steps, ...}
    device:  {entry_bytes, h2d_gbps, indexer_topk_us, ..., note}
    layers:
    - {layer: 0, misses_mean, misses_p95, lookups_mean, hit_rate, model_misses, mode,
       exposed_us: {sync, dba, prefetch, prefetch2, prefetch3, and their _margin modes}}
                                                             (null: the mode is not offered there)
    (device.measured, when calibrated: its source, points, prefetch_margin (the margin of the *_margin modes), topk
     and prefetch_chunking (how its prefetch2 / prefetch3 runs split the indexer))

Every error is an `OverlapProfileError` naming the file, the YAML key (``layers[3].mode``) and the layer.
This module imports pydantic, numpy and pyyaml only (no torch): the runtime reads profiles before allocating.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from ess_sglang.config import DA_REMOVED
from ess_sglang.stack_calibration import CALIBRATED_MODES, MARGIN_MODES, NonNegFloat, StackCalibration

logger = logging.getLogger(__name__)

MODES = CALIBRATED_MODES
"""What a layer may run, in the policy's order (ties go to the earlier). prefetch / prefetch2 / prefetch3 are sync with
ECHO prefetch (the indexer in one launch / in two / three chunks), *_margin the same with the calibration's threshold
margin; only a measured calibration offers them."""
PREFETCH_CHUNKS = {"prefetch": 1, "prefetch2": 2, "prefetch3": 3, "prefetch_margin": 1, "prefetch2_margin": 2,
                   "prefetch3_margin": 3}
ONE_CALL_MODES = ("sync", "prefetch", "prefetch_margin")
"""What a runtime that computes a layer's indexer logits in one call and its attention in one can run (the SGLang
plugin): ECHO prefetch in one chunk, beside the top-k, or none (`OverlapProfile.modes_within`)."""
FORMAT_VERSION = 1
LATER_MODE_KEYS = ("prefetch3", "prefetch3_margin")
"""Modes added to format 1 later: written only where a layer has a time for them."""
OVERLAP_LEVELS = ("auto", "none", "full")
"""`ess_config.prefetch_overlap_level` values that `restrict_modes` understands."""

_LINE = ("ESS per-layer overlap profile: sync / dba (dual-batch) / prefetch / prefetch2 (ECHO; _margin: with the "
         "calibration's threshold margin) per decode layer.")
DA_DEVICE_KEYS = ("da_overhead_us", "da_hidden_fraction", "attention_us")
"""The cost model's constants of the removed mode da (its fixed cost, the share of its copy hidden, and the attention
table A(b) only its term read): left out where a file written before its removal carries them."""


class OverlapProfileError(ValueError):
    """An invalid overlap profile or request; the message names the file, the YAML key and the layer."""


# ------------------------------------------------------------------------------------------------ models

PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
PosInt = Annotated[StrictInt, Field(gt=0)]
NonNegInt = Annotated[StrictInt, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
OpenFraction = Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)]

H200_NOTE = ("NVIDIA H200 (PCIe Gen5 x16), docs DESIGN.md section 2, measured 2026-11-29: UVA gather of 656-B entries "
             "39-45 GB/s; persistent FlashTrans copy of 3,700 / 7,400 scattered 656-B entries 41-44 GB/s (scratch "
             "measurement; 42 used; bulk memcpy 49-51 GB/s); the copy on a side stream beside the Triton indexer at "
             "batch 32 and 32K context 76-84% hidden (indexer 177 us, copy 58-64, together 188-191, 16-32 copy "
             "programs; scratch; 0.8 used); indexer + top-k ~300 us per layer at batch 64 and 32K context, linear in "
             "batch x context (estimate); resolve ~40 us per layer (estimate, fused Triton resolve not yet at "
             "target); DBA fixed overhead 130 us: the second top-k of the split ~120 us (torch.topk, k 2048 over 32K, "
             "is ~30 small latency-bound kernels: 121 us for 48 rows, 126 us for 16) plus extra launches (measured "
             "2026-11-29); decode-stack timeline at batch 64 and 32K context (benchmarks/decode_layers.py, 4 layers, "
             "CUDA-graph replay, 2026-11-29) per layer: all latents in HBM 574 us, sync 776, dba 800 (whole-batch "
             "attention, split 0.75, 16 copy programs) and 828 (split 0.5); full decode-stack benchmark (an early run "
             "of benchmarks/decode_layers.py, 4 layers, dba split 0.75, 16 copy programs, torch top-k, 2026-11-29) at "
             "hit 0.95, x all-HBM, sync / dba: 32K batch 64 1.345 / 1.379, batch 128 1.411 / 1.309; 128K batch 64 "
             "1.199 / 1.208, batch 128 1.201 / 1.180")


class DeviceTimings(BaseModel):
    """The cost model's constants (see the module docstring); the defaults are the project's H200."""

    model_config = ConfigDict(extra="forbid")

    name: StrictStr = "NVIDIA H200 (PCIe Gen5 x16)"
    note: StrictStr = H200_NOTE
    """Where the numbers come from."""
    entry_bytes: PosInt = 656
    """Bytes one miss moves (V32 latent entry)."""
    h2d_gbps: PosFloat = 42.0
    """Achieved H2D gather bandwidth for scattered entries, GB/s (1e9 B/s)."""
    indexer_topk_us: NonNegFloat = 300.0
    """Indexer + top-k time of one layer at indexer_ref_batch x indexer_ref_context; linear in batch x context."""
    indexer_ref_batch: PosInt = 64
    indexer_ref_context: PosInt = 32768
    resolve_us: NonNegFloat = 40.0
    """Resolve bookkeeping per layer (lookup, dedup, eviction, slot table)."""
    dba_overhead_us: NonNegFloat = 130.0
    """Fixed cost of DBA: the second top-k of the split ~120 us (torch.topk is latency-bound: the same time for 16
    and 48 rows) plus the split halves' extra launches and the side-stream synchronisation; measured 2026-11-29."""
    dba_hidden_fraction: Fraction = 0.8
    """h_dba: share of half A's resolve + copy overlapping half B's indexer + top-k that DBA actually hides."""
    dba_split: OpenFraction = 0.75
    """f: fraction of the batch in DBA's half A; must equal the runtime's `dba_split` (StackOptions.dba_split, whose
    default is 0.5: run DBA with 0.75, or set this key to the value that runs). 0.75 is what the decode-stack benchmark
    runs because it measured faster than 0.5 (batch 64, 32K context: dba 800 against 828 us per layer): a larger half A
    puts more of the fetch on the side stream, and half B's window shrinks less than linearly (its torch.topk is
    latency-bound). The model's linear window I((1 - f) B, C) does not see that, so it under-predicts DBA at 0.75."""

    measured: StackCalibration | None = None
    """Measured exposed time of each mode on this device (`ess_sglang.stack_calibration`, from a decode-stack
    benchmark run): inside its grid of batches x contexts it replaces the analytic model, and it is the only source
    of the prefetch modes' costs. None: the analytic model only."""

    # ---------------------------------------------------------------- the model's terms
    def fetch_us(self, misses: float) -> float:
        """T: time to fetch `misses` entries over PCIe."""
        return misses * self.entry_bytes / (self.h2d_gbps * 1e3)

    def indexer_time_us(self, batch: float, context: float) -> float:
        """I(b, C): indexer + top-k of one layer."""
        return self.indexer_topk_us * batch * context / (self.indexer_ref_batch * self.indexer_ref_context)


class ModeTimes(BaseModel):
    """Predicted exposed time of each mode for one layer, microseconds; None where the mode is not offered (dba at
    batch 1; prefetch modes without a measured calibration; modes a calibration did not measure)."""

    model_config = ConfigDict(extra="forbid")

    sync: NonNegFloat
    dba: NonNegFloat | None
    prefetch: NonNegFloat | None = None
    prefetch2: NonNegFloat | None = None
    prefetch3: NonNegFloat | None = None
    prefetch_margin: NonNegFloat | None = None
    prefetch2_margin: NonNegFloat | None = None
    prefetch3_margin: NonNegFloat | None = None

    def as_dict(self) -> dict[str, float | None]:
        return {m: getattr(self, m) for m in MODES}


class LayerProfile(BaseModel):
    """One decode layer: its measured misses and the mode chosen for it."""

    model_config = ConfigDict(extra="forbid")

    layer: NonNegInt
    misses_mean: NonNegFloat
    """Distinct misses per step, whole batch, mean over the profiled steps."""
    misses_p95: NonNegFloat
    """95th percentile of the same."""
    lookups_mean: NonNegFloat
    """Selected entries per step, whole batch."""
    hit_rate: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
    model_misses: NonNegFloat
    """Misses per step the cost model used: misses_mean or misses_p95 (header.chosen_by) x header.miss_scale."""
    mode: StrictStr
    exposed_us: ModeTimes

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, v: str) -> str:
        if v not in MODES:
            raise ValueError(f"unknown mode {v!r}; expected one of {', '.join(MODES)}")
        return v


SPARE_HEADROOM = 1.25
"""Spare slots per misses per step of the busiest layer (the prefetch's wasted entries take spare slots too)."""


class ProfileHeader(BaseModel):
    """What produced the profile, and the cost model's inputs."""

    model_config = ConfigDict(extra="forbid")

    command: StrictStr
    """The `ess profile` command line that regenerates the file."""
    date: StrictStr
    source: Literal["trace", "synthetic", "demo"]
    trace: StrictStr | None = None
    """Trace file (source trace), or a short description of the generated trace."""
    trace_batch: PosInt
    trace_top_k: PosInt
    trace_context_mean: NonNegFloat
    """Mean tokens per request over the profiled steps."""
    steps: PosInt
    """Decode steps replayed."""
    slots_per_layer: PosInt
    ratio: PosFloat | None = None
    """Hot-pool ratio the slots came from (slots / tokens held), None when slots were given directly."""
    warmup: StrictStr
    batch: PosInt
    """Cost model: requests per decode batch."""
    context: PosInt
    """Cost model: tokens per request."""
    top_k: PosInt
    """Cost model: entries selected per request and layer."""
    miss_scale: PosFloat
    """(batch / trace_batch) x (top_k / trace_top_k): measured misses x this = the cost model's misses."""
    chosen_by: Literal["mean", "p95"]


class OverlapProfile(BaseModel):
    """A whole profile file."""

    model_config = ConfigDict(extra="forbid")

    format_version: Literal[1] = FORMAT_VERSION
    header: ProfileHeader
    device: DeviceTimings = Field(default_factory=DeviceTimings)
    layers: list[LayerProfile]

    @model_validator(mode="after")
    def _layers_in_order(self) -> OverlapProfile:
        if not self.layers:
            raise ValueError("layers: the profile lists no layers")
        for i, lp in enumerate(self.layers):
            if lp.layer != i:
                raise ValueError(f"layers[{i}].layer (layer {lp.layer}): layers must be listed in order 0, 1, ...; "
                                 f"expected layer {i} here")
        if self.device.measured is None or self.device.measured.prefetch_margin is None:
            for i, lp in enumerate(self.layers):
                if lp.mode in MARGIN_MODES:
                    raise ValueError(f"layers[{i}].mode (layer {i}): {lp.mode!r} runs the calibration's threshold "
                                     f"margin, and device.measured.prefetch_margin gives none")
        return self

    def prefetch_margins(self, modes: Sequence[str] | None = None) -> list[float]:
        """Each layer's ECHO threshold margin: the calibration's for a *_margin mode, else 0; of the profile's modes,
        or of `modes` (one per layer, e.g. `modes_within`'s)."""
        m = self.device.measured
        margin = m.prefetch_margin if m is not None and m.prefetch_margin is not None else 0.0
        modes = self.modes() if modes is None else list(modes)
        return [margin if mode in MARGIN_MODES else 0.0 for mode in modes]

    def modes_within(self, runnable: Collection[str]) -> list[str]:
        """Each layer's mode where `runnable` holds it; elsewhere the mode of `runnable` (or sync) with the smallest
        exposed time the profile gives that layer: what a runtime that cannot run every mode (the SGLang plugin: one
        indexer call, one attention call) runs instead. The *_margin modes count only where the calibration measured
        a margin (their times mean nothing without one)."""
        m = self.device.measured
        if m is None or m.prefetch_margin is None:
            runnable = [r for r in runnable if r not in MARGIN_MODES]
        return [lp.mode if lp.mode in runnable else best_mode(lp.exposed_us, lp.model_misses, runnable)
                for lp in self.layers]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def modes(self) -> list[str]:
        return [lp.mode for lp in self.layers]

    def spare_slots(self, headroom: float = SPARE_HEADROOM, page: int = 64) -> int:
        """Spare slots per layer for a runtime that keeps them (`HotPoolCacheManager(spare_slots=...)`):
        `spare_slots_for` the layers' cost-model misses per step."""
        return spare_slots_for([lp.model_misses for lp in self.layers], headroom, page)


def spare_slots_for(misses_per_layer: Sequence[float], headroom: float = SPARE_HEADROOM, page: int = 64) -> int:
    """Spare slots per layer: `headroom` x the most distinct misses per step of any layer (whole batch), rounded up
    to whole pages (what `benchmarks/decode_layers.py --spare auto` measures with). A layer's spare slots cover its
    resolves' misses in a step without an LRU scan; more only hold fewer entries resident."""
    if not misses_per_layer or any(not math.isfinite(m) or m < 0 for m in misses_per_layer):
        raise OverlapProfileError(f"misses per layer: finite numbers >= 0 needed, got {list(misses_per_layer)!r}")
    if not (math.isfinite(headroom) and headroom > 0) or page <= 0:
        raise OverlapProfileError(f"spare slots: headroom > 0 and page > 0 needed, got {headroom}, {page}")
    return math.ceil(headroom * max(misses_per_layer) / page) * page


# ------------------------------------------------------------------------------------------------ cost model

def exposed_times(misses: float, batch: int, context: float, device: DeviceTimings | None = None) -> ModeTimes:
    """Predicted exposed time of each mode for one layer with `misses` distinct misses per step (module docstring):
    from the device's measured calibration where its grid covers (batch, context), else from the analytic model."""
    d = device or DeviceTimings()
    if misses < 0 or not math.isfinite(misses):
        raise OverlapProfileError(f"misses: must be a finite number >= 0, got {misses}")
    if batch < 1 or context <= 0:
        raise OverlapProfileError(f"batch and context must be positive, got batch={batch}, context={context}")
    if d.measured is not None:
        measured = d.measured.exposed(misses, batch, context)
        if measured is not None:
            return ModeTimes(**{m: measured.get(m) for m in MODES})
    T, R, f = d.fetch_us(misses), d.resolve_us, d.dba_split
    sync = R + T
    dba = None
    if batch >= 2:
        window = d.indexer_time_us((1 - f) * batch, context)  # half B's indexer + top-k
        dba = R + T - d.dba_hidden_fraction * min(f * (T + R), window) + d.dba_overhead_us
    return ModeTimes(sync=sync, dba=dba)


def best_mode(times: ModeTimes, misses: float, among: Collection[str] = MODES) -> str:
    """The mode with the smallest exposed time (ties: the earlier of MODES), of those in `among` (sync always
    counts); "sync" when there are no misses."""
    if misses <= 0:
        return "sync"
    cand = [(t, i) for i, (m, t) in enumerate(times.as_dict().items())
            if t is not None and (m in among or m == "sync")]
    return MODES[min(cand)[1]]


def choose_modes(misses_per_step: Sequence[float], batch: int, context: float,
                 device: DeviceTimings | None = None) -> list[str]:
    """The mode of every layer, given each layer's distinct misses per step (whole batch)."""
    return [best_mode(exposed_times(m, batch, context, device), m) for m in misses_per_step]


def restrict_modes(modes: Sequence[str], level: str) -> list[str]:
    """Apply `ess_config.prefetch_overlap_level`: "none" -> all sync; "auto" and "full" -> as is (they differ only
    without a profile: the runtime's own default). The removed level "da" is refused (`config.DA_REMOVED`)."""
    if level == "da":
        raise OverlapProfileError(f"prefetch_overlap_level: {DA_REMOVED}; use none, auto or full")
    if level not in OVERLAP_LEVELS:
        raise OverlapProfileError(f"prefetch_overlap_level: {level!r} is not one of {', '.join(OVERLAP_LEVELS)}")
    if level == "none":
        return ["sync"] * len(modes)
    return list(modes)


def stack_settings(modes: Sequence[str]) -> tuple[list[str], list[int]]:
    """The decode stack's per-layer settings of policy modes: (overlap mode of each layer, "sync" / "dba";
    prefetch chunks of each layer, 0 = no prefetch) for `StackOptions(modes=..., prefetch_layers=...)`."""
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise OverlapProfileError(f"mode {bad[0]!r} is not one of {', '.join(MODES)}")
    return (["sync" if m in PREFETCH_CHUNKS else m for m in modes], [PREFETCH_CHUNKS.get(m, 0) for m in modes])


def build_profile(misses: np.ndarray, lookups: np.ndarray, header: ProfileHeader,
                  device: DeviceTimings | None = None) -> OverlapProfile:
    """A profile from per-step counts: `misses` and `lookups` are [steps, layers] (whole batch, one layer's step).

    The cost model runs at header.batch / header.context with misses_mean (or misses_p95, header.chosen_by) x
    header.miss_scale. Numbers are rounded as they will be written (3 decimals; hit rate 6), so a saved and loaded
    profile equals this one.
    """
    d = device or DeviceTimings()
    misses = np.asarray(misses, dtype=np.float64)
    lookups = np.asarray(lookups, dtype=np.float64)
    if misses.ndim != 2 or misses.shape != lookups.shape or misses.shape[0] < 1 or misses.shape[1] < 1:
        raise OverlapProfileError(f"misses and lookups must both be [steps, layers], got {misses.shape} and "
                                  f"{lookups.shape}")
    layers = []
    for layer in range(misses.shape[1]):
        m, look = misses[:, layer], lookups[:, layer]
        mean, p95 = round(float(m.mean()), 3), round(float(np.percentile(m, 95)), 3)
        model_m = round((mean if header.chosen_by == "mean" else p95) * header.miss_scale, 3)
        t = exposed_times(model_m, header.batch, header.context, d)
        times = ModeTimes(**{k: None if v is None else round(v, 3) for k, v in t.as_dict().items()})
        hit = 1.0 - float(m.sum()) / float(look.sum()) if look.sum() > 0 else 1.0
        layers.append(LayerProfile(layer=layer, misses_mean=mean, misses_p95=p95,
                                   lookups_mean=round(float(look.mean()), 3), hit_rate=round(hit, 6),
                                   model_misses=model_m, mode=best_mode(t, model_m), exposed_us=times))
    return OverlapProfile(header=header, device=d, layers=layers)


# ------------------------------------------------------------------------------------------------ files

def _key_path(loc: Sequence[Any]) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) and not isinstance(p, bool) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _convert(exc: ValidationError, where: str) -> OverlapProfileError:
    """One line per pydantic problem: ``<where>: <yaml key> (layer N): <message>``."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = _key_path(loc)
        if len(loc) >= 2 and loc[0] == "layers" and isinstance(loc[1], int):
            key += f" (layer {loc[1]})"
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif err["type"] == "value_error":
            msg = str(err["ctx"]["error"])
            if not loc and ":" in msg:  # a model-level check already names its key
                key, msg = msg.split(": ", 1)
        else:
            msg = err["msg"][:1].lower() + err["msg"][1:]
            if "input" in err and not isinstance(err["input"], Mapping | list):
                msg += f" (got {err['input']!r})"
        lines.append(f"{where}: {key}: {msg}")
    return OverlapProfileError("\n".join(lines))


def _da_layer(data: Mapping) -> str | None:
    """The YAML key of the first layer whose chosen mode is the removed mode da, or None."""
    layers = data.get("layers") if isinstance(data.get("layers"), list) else []
    for i, lp in enumerate(layers):
        if isinstance(lp, Mapping) and lp.get("mode") == "da":
            return f"layers[{i}].mode (layer {i})"
    return None


def _without_da_time(entry: Any) -> Any:
    """A profile layer or calibration point without its da time in ``exposed_us`` (anything else as it is)."""
    if not (isinstance(entry, Mapping) and isinstance(entry.get("exposed_us"), Mapping)):
        return entry
    return {**entry, "exposed_us": {m: t for m, t in entry["exposed_us"].items() if m != "da"}}


def _without_da_times(device: Mapping) -> dict:
    """A `device:` mapping without what only the removed mode da read (`DA_DEVICE_KEYS`, the calibration points' da
    times)."""
    device = {k: v for k, v in device.items() if k not in DA_DEVICE_KEYS}
    measured = device.get("measured")
    if isinstance(measured, Mapping) and isinstance(measured.get("points"), list):
        device["measured"] = {**measured, "points": [_without_da_time(p) for p in measured["points"]]}
    return device


def _without_da(data: Mapping) -> dict:
    """A profile written before da's removal, without da's times: per layer, in the device constants and the
    calibration points. No layer chose da (`_da_layer` is checked first), so every choice stands."""
    data = dict(data)
    if isinstance(data.get("layers"), list):
        data["layers"] = [_without_da_time(lp) for lp in data["layers"]]
    if isinstance(data.get("device"), Mapping):
        data["device"] = _without_da_times(data["device"])
    return data


def profile_from_mapping(data: Any, where: str = "overlap profile") -> OverlapProfile:
    """Validate a parsed YAML document; `where` (the file) starts every error line. A profile written before the mode
    da was removed loads without da's times; one with a layer that chose da is refused in one line naming it."""
    if not isinstance(data, Mapping):
        raise OverlapProfileError(f"{where}: expected a mapping with keys format_version, header, device, layers; "
                                  f"got {type(data).__name__}")
    if "format_version" in data and data["format_version"] != FORMAT_VERSION:
        raise OverlapProfileError(f"{where}: format_version: {data['format_version']!r} is not supported (this "
                                  f"code reads {FORMAT_VERSION})")
    da = _da_layer(data)
    if da is not None:
        raise OverlapProfileError(f"{where}: {da}: {DA_REMOVED}; regenerate the profile with `ess profile` "
                                  f"(header.command)")
    try:
        return OverlapProfile.model_validate(_without_da(data))
    except ValidationError as exc:
        raise _convert(exc, where) from None


def device_timings_from_mapping(data: Any, where: str = "device timings") -> DeviceTimings:
    """DeviceTimings from a mapping (the `device:` section of a profile, or a bare mapping of its keys).

    Keys not given keep their H200 defaults; the removed mode da's constants (`DA_DEVICE_KEYS`), which files
    written before its removal carry, are left out with a warning naming them.
    """
    if isinstance(data, Mapping) and "device" in data:
        data, prefix = data["device"], "device."
    else:
        prefix = ""
    if not isinstance(data, Mapping):
        raise OverlapProfileError(f"{where}: {prefix or '(top level)'}: expected a mapping of device timings, got "
                                  f"{type(data).__name__}")
    dropped = [k for k in DA_DEVICE_KEYS if k in data]
    if dropped:
        logger.warning("%s: %s left out: constants of the removed overlap mode da, which nothing reads", where,
                       ", ".join(prefix + k for k in dropped))
    try:
        return DeviceTimings.model_validate({**DeviceTimings().model_dump(), **_without_da_times(data)})
    except ValidationError as exc:
        err = _convert(exc, where)
        if prefix:
            err = OverlapProfileError("\n".join(line.replace(f"{where}: ", f"{where}: {prefix}", 1)
                                                for line in str(err).splitlines()))
        raise err from None


def read_yaml(path: str | Path, what: str = "overlap profile") -> Any:
    """Parse a YAML file; a missing file or malformed YAML raises OverlapProfileError naming the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise OverlapProfileError(f"{what} {p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OverlapProfileError(f"{what} {p}: cannot read: {exc}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise OverlapProfileError(f"{what} {p}: malformed YAML{at}: {problem}") from None


def dump_profile(profile: OverlapProfile) -> str:
    """The YAML text of a profile: header and device as blocks, one line per layer."""
    def block(obj: Any) -> str:
        return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False, width=10**6, allow_unicode=True)

    data = profile.model_dump(mode="python")
    # keys added after format 1 was first written, left out where unset, so that a profile that does not use them
    # stays readable by code from before them (the models refuse unknown keys)
    for lp in data["layers"]:
        for key in LATER_MODE_KEYS:
            if lp["exposed_us"].get(key, 0) is None:
                del lp["exposed_us"][key]
    measured = data["device"].get("measured")
    for key in ("topk", "prefetch_chunking", "spare_refill_interval"):
        if measured is not None and measured.get(key) is None:
            del measured[key]
    if measured is not None and measured.get("prefetch_chunking") is not None:
        chunking = measured["prefetch_chunking"]
        if chunking.get("indexer_tiles") is None:
            chunking.pop("indexer_tiles", None)
        if chunking["fractions"] is not None:
            chunking["fractions"] = list(chunking["fractions"])  # (safe_dump writes lists, not tuples)
    lines = [f"# {_LINE}",
             "# Written by `ess profile` (ess_sglang/profile_cmd.py); regenerate with header.command. The decode",
             "# stack runs the `mode` of every layer (overlap_policy.layer_settings); the other numbers explain it.",
             block({"format_version": data["format_version"]}).rstrip("\n"),
             block({"header": data["header"]}).rstrip("\n"),
             block({"device": data["device"]}).rstrip("\n"),
             "layers:"]
    for lp in data["layers"]:
        lines.append("- " + yaml.safe_dump(lp, sort_keys=False, default_flow_style=True, width=10**6).strip())
    return "\n".join(lines) + "\n"


def save_profile(profile: OverlapProfile, path: str | Path) -> Path:
    """Write `profile` as YAML (creating parent directories); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(dump_profile(profile), encoding="utf-8")
    return p


def _check_num_layers(num_layers: Any) -> int:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int | np.integer) or num_layers < 1:
        raise OverlapProfileError(f"num_layers: must be a positive integer, got {num_layers!r}")
    return int(num_layers)


def _check_count(profile: OverlapProfile, num_layers: int | None, where: str) -> OverlapProfile:
    if num_layers is not None and profile.num_layers != _check_num_layers(num_layers):
        raise OverlapProfileError(f"{where}: layers: the profile lists {profile.num_layers} layers, the model has "
                                  f"{num_layers}; profile the model's own layers (ess profile)")
    return profile


def load_profile(path: str | Path, num_layers: int | None = None) -> OverlapProfile:
    """Read and validate a profile; with `num_layers`, also check that it lists exactly that many layers."""
    if num_layers is not None:
        _check_num_layers(num_layers)
    where = f"overlap profile {Path(path)}"
    return _check_count(profile_from_mapping(read_yaml(path), where), num_layers, where)


def _profile_of(path_or_profile: str | Path | OverlapProfile, num_layers: int) -> OverlapProfile:
    """The profile given, or read from the path given, checked to list the model's `num_layers` layers."""
    _check_num_layers(num_layers)
    if isinstance(path_or_profile, OverlapProfile):
        return _check_count(path_or_profile, num_layers, "overlap profile")
    if not isinstance(path_or_profile, str | Path):
        raise OverlapProfileError(f"overlap profile: expected a path or an OverlapProfile, got "
                                  f"{type(path_or_profile).__name__}")
    return load_profile(path_or_profile, num_layers)


def modes_for_layers(path_or_profile: str | Path | OverlapProfile, num_layers: int) -> list[str]:
    """The mode (one of MODES) of each of the model's `num_layers` decode layers, in layer order
    (`stack_settings` turns them into the decode stack's options)."""
    return _profile_of(path_or_profile, num_layers).modes()


def layer_settings(path_or_profile: str | Path | OverlapProfile, num_layers: int,
                   level: str = "full") -> tuple[list[str], list[int]]:
    """What the decode stack runs in each layer, from a profile: `stack_settings` of its modes after
    `restrict_modes(..., level)`; pass them as `StackOptions(modes=..., prefetch_layers=...)`."""
    return stack_settings(restrict_modes(modes_for_layers(path_or_profile, num_layers), level))


def profile_stack_options(path_or_profile: str | Path | OverlapProfile, num_layers: int) -> dict[str, Any]:
    """`StackOptions` keywords that run a profile's prefetch2 / prefetch3 layers as its calibration measured them:
    the chunk fractions (`chunk_plans`), what the chunks split, how their indexer launches run and whether the last
    chunk prefetches (`StackCalibration.prefetch_chunking`); {} for a profile that records none (no calibration, or
    one written before the key, whose runs' chunking is not known here: the stack's defaults then run its layers).
    Pass them with `layer_settings`' modes and prefetch layers."""
    m = _profile_of(path_or_profile, num_layers).device.measured
    return {} if m is None or m.prefetch_chunking is None else m.prefetch_chunking.stack_options()


def layer_prefetch_margins(path_or_profile: str | Path | OverlapProfile, num_layers: int) -> list[float]:
    """Each decode layer's ECHO threshold margin from a profile (`OverlapProfile.prefetch_margins`): pass them as
    `EchoPrefetcher(margin=...)`; a layer that does not prefetch ignores its value."""
    return _profile_of(path_or_profile, num_layers).prefetch_margins()
