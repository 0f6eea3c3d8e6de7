"""A stack of DSA decode layers on the GPU: ESS in each overlap mode against the same stack with every latent in HBM.

Each layer of each step runs, as `ess_sglang.decode_stack` defines it: store the new token (indexer key; latent
entry), the Triton indexer over the whole context (64 index heads x 128, bf16 queries, fp8 keys), the top-2048
(by default SGLang 0.5.23's own decode top-k, `--topk sglang`: benchmarks/sglang_topk.py), then sparse MLA with
FlashMLA (V32, 128 heads). The all-HBM stack attends over a device latent store; the
ESS stack over hot pools filled by the cache manager from a pinned host pool, in one of these modes:

    sync       resolve + copy, then attention
    prefetch   sync, plus ECHO prefetch of candidates above the EMA threshold while the top-k runs
    prefetchN  prefetch with the indexer run in N batch chunks (e.g. prefetch2; `--prefetch-split positions`:
               segments of every request's positions; `--prefetch-fractions`: uneven ones): each chunk's prefetch
               starts as soon as its logits exist, beside the next chunk's indexer (the last chunk's beside the
               top-k, or, `--last-chunk-prefetch off`, none: its misses go to the exact resolve); the chunks
               before the last launch on a high-priority stream, the last at once on the main stream
               (`--prefetch-indexer overlapped`, the default; `serial`: one after the other)
    dba        dual-batch (half A's resolve + copy behind half B's indexer, half B's behind half A's attention)
    layerwise  the policy: when every token of the batch fits the pools, the all-resident path (one lookup per
               layer, new tokens into reserved slots); otherwise an overlap profile is built from the misses per
               layer the sync run of the same configuration measured (`ess_sglang.overlap_policy.build_profile`,
               the offline profile), written as YAML, read back (`layer_settings`), and each layer runs the mode it
               names: sync / dba from the analytic cost model, or, with `--calibration` (the JSON of an
               earlier run of this benchmark), whichever of sync / dba / prefetch / prefetch2 / prefetch3
               that run measured fastest (prefetch3 layers with the run's --prefetch-fractions, which this run must
               give too) at this batch, context and miss count (interpolated between its points);
               layerwise+spare from that run's modes with spare slots, where it measured them; with
               `--calibration-margin` (a second run, at `--prefetch-margin m`) also prefetch / prefetch2 with
               threshold margin m (modes prefetch_margin / prefetch2_margin), per layer

With `--spare S[,S...]` every ESS mode also runs with spare slots per layer (variant "mode+spare"): free slots that
`HotPoolCacheManager.refill_spares` evicts ahead of time, beside attention, so that a resolve whose misses they cover
skips its pool scans. They come out of the same hot pool (same memory). S is a fraction of batch x top-k, or "auto":
1.25 x the most misses per step of any layer in the configuration's sync run (what an overlap profile records).

Every variant of a configuration runs the same inputs from the same state: the hot pools are emptied, warmed with
each request's most recent tokens, then `--warm` untimed steps; the whole step (all layers) is captured in one CUDA
graph; each of `--steps` timed steps copies its inputs into the graph's buffers, then is timed alone with CUDA
events around the replay. The indexer queries drift from step to step as an AR(1) process q <- rho q + sqrt(1 - rho^2)
noise; rho is calibrated per configuration (bisection on the sync stack) so that the hit rate is near the target; the
table reports the hit rate each variant measured. Hot pools hold `--ratio` of the batch's tokens per layer.

Correctness is checked in the same run, eagerly, on the first configuration: sync and prefetch bit-identical to the
all-HBM stack; dba bit-identical to the all-HBM stack whose attention is split the same way (and its difference to
whole-batch attention reported). Mode da (dual attention) was removed: slower than sync in every configuration this
benchmark measured (docs/design.md, "Overlap modes"); `--modes da` is refused, and a calibration run's da rows (older
runs hold them) are not read.

    python benchmarks/decode_layers.py --out benchmarks/results            (decode_layers.json / .png)
    python benchmarks/decode_layers.py --quick --out /tmp/res              (a few configurations)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from timing import replay_us  # benchmarks/timing.py (run these files as scripts)

from ess_sglang.cache_manager import MAX_REFILL_INTERVAL, Counter, HotPoolCacheManager
from ess_sglang.config import DA_REMOVED
from ess_sglang.decode_stack import (
    PREFETCH_INDEXER_LAUNCHES,
    DecodeBatch,
    EssDecodeStack,
    HbmDecodeStack,
    LayerInputs,
    StackOptions,
    chunk_bounds,
    latent_store_rows,
    topk_with_scores,
)
from ess_sglang.formats import INDEXER_ENTRY_BYTES, LATENT_ENTRY_BYTES, pack_indexer_key, pack_latent
from ess_sglang.host_pool import HostTotalPool
from ess_sglang.overlap_policy import (
    PREFETCH_CHUNKS,
    DeviceTimings,
    ProfileHeader,
    build_profile,
    layer_prefetch_margins,
    layer_settings,
    load_profile,
    save_profile,
    spare_slots_for,
)
from ess_sglang.prefetch import EchoPrefetcher
from ess_sglang.stack_calibration import CalibrationError, load_calibration

HEADS, IHEADS, TOP_K = 128, 64, 2048
MODES = ["sync", "prefetch", "dba", "layerwise"]
EXTRA_MODES = ["sync_counted",  # sync with a deferred fetch list and a persistent copy (the previous default)
               "sync_insert",  # sync with each new token inserted into a hot slot (a resolve of its own; the previous
               # default: new tokens are now written back only, and fetched when selected)
               "dba_split"]  # dba with per-half attention (hides half B's copy behind half A's attention; inexact)


def prefetch_chunks(mode: str) -> int:
    """Indexer chunks of a prefetch mode: "prefetch" 1, "prefetchN" N; 0 for a mode without prefetch."""
    if not mode.startswith("prefetch"):
        return 0
    n = mode[len("prefetch"):]
    if n and not (n.isdigit() and int(n) >= 1):
        raise ValueError(f"mode {mode!r}: prefetch takes a chunk count, e.g. prefetch2")
    return int(n or 1)


def chunk_fractions(mode: str, fractions: tuple[float, ...] | None) -> int | tuple[float, ...]:
    """StackOptions.prefetch_chunks of a mode: its chunk count, or `fractions` (--prefetch-fractions) for the
    prefetchN modes with N = their number."""
    n = max(1, prefetch_chunks(mode))
    return fractions if fractions is not None and len(fractions) == n else n


class Pools:
    """Host pool, device latent store and indexer cache for up to `tokens` tokens, filled once with valid entries."""

    def __init__(self, layers: int, tokens: int, seed: int = 0):
        dev = torch.device("cuda")
        t0 = time.time()
        self.host = HostTotalPool(layers, tokens, device=dev)
        self.latents = torch.empty((layers, latent_store_rows(tokens), LATENT_ENTRY_BYTES), dtype=torch.uint8,
                                   device=dev)
        self.index_cache = torch.empty((layers, tokens, INDEXER_ENTRY_BYTES), dtype=torch.uint8, device=dev)
        g = torch.Generator(device=dev).manual_seed(seed)
        chunk = 1 << 20
        for layer in range(layers):
            for lo in range(0, tokens, chunk):
                hi = min(tokens, lo + chunk)
                n = hi - lo
                ent = pack_latent(torch.randn(n, 512, device=dev, generator=g),
                                  torch.randn(n, 64, device=dev, generator=g))
                self.latents[layer, lo:hi] = ent
                self.host.entries[layer, lo:hi].copy_(ent, non_blocking=True)
                self.index_cache[layer, lo:hi] = pack_indexer_key(torch.randn(n, 128, device=dev, generator=g))
        torch.cuda.synchronize()
        print(f"pools: {layers} layers x {tokens:,} tokens: host {self.host.entries.numel() / 2**30:.1f} GiB pinned, "
              f"{time.time() - t0:.1f} s", flush=True)


def table_width(context: int, steps: int) -> int:
    """Positions per request in the request table (and the indexer's score rows): the context and the steps' tokens,
    in whole pages of 64, as SGLang's tables are (SGLang's decode top-k also wants a row stride that is a multiple of
    4: benchmarks/sglang_topk.py)."""
    return math.ceil((context + steps) / 64) * 64


class Config:
    """One (context, batch) configuration: request table, step inputs, and the stacks' static buffers."""

    def __init__(self, pools: Pools, layers: int, context: int, batch: int, steps: int, seed: int):
        dev = torch.device("cuda")
        self.layers, self.context, self.batch, self.steps = layers, context, batch, steps
        width = table_width(context, steps)
        self.width = width
        self.req_to_token = (torch.arange(batch * width, device=dev, dtype=torch.int32).view(batch, width))
        self.rows = torch.arange(batch, device=dev, dtype=torch.int32)
        g = torch.Generator(device=dev).manual_seed(seed)
        self.w_index = [(torch.rand(batch, 1, IHEADS, device=dev, generator=g) * IHEADS ** -0.5).float()
                        for _ in range(layers)]
        self.q = [torch.randn(batch, 1, HEADS, 576, device=dev, generator=g).bfloat16() for _ in range(layers)]
        self.new_latent = [pack_latent(torch.randn(batch, 512, device=dev, generator=g),
                                       torch.randn(batch, 64, device=dev, generator=g)) for _ in range(layers)]
        self.new_key = [pack_indexer_key(torch.randn(batch, 128, device=dev, generator=g)) for _ in range(layers)]
        self.q0 = [torch.randn(batch, 1, IHEADS, 128, device=dev, generator=g) for _ in range(layers)]
        # each step's new tokens, distinct from every other step's (one key repeated every step would give equal
        # logits, ties that the top-k may break either way: a selection unlike the all-HBM stack's, both exact)
        self.step_latent = [[pack_latent(torch.randn(batch, 512, device=dev, generator=g),
                                         torch.randn(batch, 64, device=dev, generator=g)) for _ in range(layers)]
                            for _ in range(steps)]
        self.step_key = [[pack_indexer_key(torch.randn(batch, 128, device=dev, generator=g)) for _ in range(layers)]
                         for _ in range(steps)]
        self.noise_seed = seed + 1
        # static buffers the captured graphs read
        self.seq_lens = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.new_locs = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.q_index = [torch.zeros(batch, 1, IHEADS, 128, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
        self.batch_tables = DecodeBatch(self.req_to_token, self.rows, self.seq_lens, self.new_locs)
        self.inputs = [LayerInputs(self.q_index[i], self.w_index[i], self.q[i], self.new_latent[i], self.new_key[i])
                       for i in range(layers)]

    def queries(self, rho: float) -> list[list[torch.Tensor]]:
        """Indexer queries of every step and layer: an AR(1) drift with correlation rho between steps."""
        g = torch.Generator(device="cuda").manual_seed(self.noise_seed)
        cur = [q.clone() for q in self.q0]
        out = []
        for _ in range(self.steps):
            step = []
            for layer in range(self.layers):
                cur[layer] = rho * cur[layer] + math.sqrt(max(0.0, 1 - rho * rho)) * torch.randn(
                    cur[layer].shape, device="cuda", generator=g)
                step.append(cur[layer].bfloat16())
            out.append(step)
        return out

    def load_step(self, s: int, queries) -> None:
        self.seq_lens.fill_(self.context + s + 1)
        self.new_locs.copy_(self.rows.long() * self.width + self.context + s)
        for layer in range(self.layers):
            self.q_index[layer].copy_(queries[s][layer])
            self.new_latent[layer].copy_(self.step_latent[s][layer])
            self.new_key[layer].copy_(self.step_key[s][layer])


def spare_slots(size: float | str, batch: int, slots: int, sync_misses=None, refill_interval: int = 1) -> int:
    """Spare slots per layer, in whole pages, below the pool: a fraction of one step's selections (batch x top-k), or
    "auto": 1.25 x the most misses per step of any layer in the sync run, for each step between refills."""
    want = spare_slots_for(sync_misses) * refill_interval if size == "auto" else \
        math.ceil(size * batch * TOP_K / 64) * 64
    return min(want, slots - 64)


def stack_topk(topk, ordered: bool = False):
    """A stack's `StackOptions.topk` from the run's top-k: a name ("torch", "triton"), or SGLang's decode top-k (a
    built `sglang_topk.SglangTopKV2`) as a callable, ordered for the correctness check (benchmarks/sglang_topk.py).
    It gives positions only, as in SGLang: a prefetching ESS stack finds the k-th scores itself."""
    return topk if isinstance(topk, str | SelectionLog) else topk.stack_topk(ordered)


def build_ess(pools: Pools, cfg: Config, slots: int, modes, prefetch: bool, spare: int = 0, margin: float = 0.0,
              resolve_pdl: bool | None = None, prefetch_pdl: bool | None = None, topk="torch", ordered: bool = False,
              refill_interval: int = 1, **options) -> EssDecodeStack:
    m = HotPoolCacheManager(pools.host, slots, max_selected=cfg.batch * TOP_K, spare_slots=spare,
                            resolve_pdl=resolve_pdl, refill_interval=refill_interval)
    per_layer = options.get("prefetch_layers")
    pf = EchoPrefetcher(cfg.layers, cfg.batch, cfg.width, device="cuda", margin=margin, pdl=prefetch_pdl) \
        if prefetch or any(per_layer or ()) else None
    opts = StackOptions(modes=list(modes), top_k=TOP_K, prefetch=prefetch,
                        topk=stack_topk(topk, ordered), **options)
    return EssDecodeStack(m, pools.index_cache, cfg.width, opts, max_batch=cfg.batch, prefetcher=pf)


def fits(cfg: Config, slots: int) -> bool:
    """Every token the batch will have in this run fits one layer's hot pool (warm-up then loads all of them)."""
    return cfg.batch * cfg.width <= slots


def reset_and_warm(ess: EssDecodeStack, cfg: Config) -> None:
    """Empty the pools, then load each request's most recent tokens (as many as fit beside a few steps' growth)."""
    m = ess.m
    m.reset()
    if ess.prefetcher is not None:
        ess.prefetcher.threshold.fill_(math.inf)
    recent = cfg.context if fits(cfg, m.slots_per_layer) else max(
        0, min(cfg.context, m.slots_per_layer // cfg.batch - 2 * cfg.steps))
    locs = cfg.req_to_token[:, cfg.context - recent:cfg.context].reshape(-1)
    future = cfg.req_to_token[:, cfg.context:].reshape(-1)
    for layer in range(cfg.layers):
        m.warm_up(layer, locs)
        if fits(cfg, m.slots_per_layer):  # everything fits: slots for the tokens to come (all-resident writes)
            m.reserve(layer, future)
    m.counters.zero_()


def warm_and_capture(stack, cfg: Config, queries, warm: int, is_ess: bool, all_resident: bool = False):
    """From the warmed pools (ESS), run `warm` steps eagerly, then capture step `warm` in a CUDA graph (capture does
    not run it: replays start at step `warm`). Counters are zeroed before the capture."""
    kw = {"all_resident": True} if all_resident else {}
    if is_ess:
        reset_and_warm(stack, cfg)
    for s in range(warm):
        cfg.load_step(s, queries)
        stack.step(cfg.batch_tables, cfg.inputs, **kw)
    torch.cuda.synchronize()
    if is_ess:
        stack.m.counters.zero_()
    graph = torch.cuda.CUDAGraph()
    cfg.load_step(warm, queries)
    with torch.cuda.graph(graph):
        stack.step(cfg.batch_tables, cfg.inputs, **kw)
    return graph


def run_variant(stack, cfg: Config, queries, warm: int, is_ess: bool, all_resident: bool = False) -> dict:
    """Warm steps eagerly, capture one step, replay the timed steps; per-step times and counters of the timed part."""
    graph = warm_and_capture(stack, cfg, queries, warm, is_ess, all_resident)
    times = []
    for s in range(warm, cfg.steps):
        cfg.load_step(s, queries)
        times.append(replay_us(graph))
    # the median, and the mean, which counts the share of work that runs in some steps only (a refill interval's);
    # without the graph's first replay, which ran ~100-340 us longer than the others at 128K (H200)
    out = {"step_us": statistics.median(times), "layer_us": statistics.median(times) / cfg.layers,
           "step_us_mean": statistics.fmean(times[1:] or times), "steps_us": [round(t, 1) for t in times]}
    if is_ess:
        c = stack.m.counters.cpu()
        look = int(c[:, Counter.LOOKUPS].sum())
        n = cfg.steps - warm
        out.update(hit_rate=int(c[:, Counter.HITS].sum()) / max(1, look),
                   misses_per_layer_step=[int(x) / n for x in c[:, Counter.MISSES]],
                   h2d_mb_per_step=int(c[:, Counter.H2D_ENTRIES].sum()) * LATENT_ENTRY_BYTES / n / 1e6,
                   prefetched=int(c[:, Counter.PREFETCHED].sum()),
                   prefetch_useful=int(c[:, Counter.PREFETCH_USEFUL].sum()),
                   prefetch_wasted=int(c[:, Counter.PREFETCH_WASTED].sum()),
                   overflow=int(c[:, Counter.OVERFLOW].sum()), not_resident=int(c[:, Counter.NOT_RESIDENT].sum()))
    del graph
    return out


def calibrate_rho(pools, cfg, slots, target, warm, iters=7, topk="torch") -> tuple[float, float]:
    """Bisection on rho (1 - rho on a log scale) so that the sync stack's hit rate is near `target`."""
    ess = build_ess(pools, cfg, slots, ["sync"] * cfg.layers, prefetch=False, topk=topk)
    lo, hi = math.log(1e-5), math.log(0.5)  # log(1 - rho): small -> slow drift -> high hit rate
    best = (0.0, 0.0)
    n = min(cfg.steps, warm + 4)
    for _ in range(iters):
        mid = (lo + hi) / 2
        rho = 1 - math.exp(mid)
        queries = cfg.queries(rho)[:n]
        reset_and_warm(ess, cfg)
        for s in range(n):
            if s == warm:
                ess.m.counters.zero_()
            cfg.load_step(s, queries)
            ess.step(cfg.batch_tables, cfg.inputs)
        c = ess.m.counters.cpu()
        hit = int(c[:, Counter.HITS].sum()) / max(1, int(c[:, Counter.LOOKUPS].sum()))
        if abs(hit - target) < abs(best[1] - target):
            best = (rho, hit)
        if hit < target:
            hi = mid
        else:
            lo = mid
    return best


def _tiles_arg(text: str) -> int | None:
    """--chunk-indexer-tiles: a whole number >= 1, or "kernel" (None: the kernel's own)."""
    if text == "kernel":
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a whole number >= 1 or 'kernel', got {text!r}")
    return n


def stack_knobs(args) -> dict:
    """The StackOptions every ESS variant of a run takes from the command line (and the run's meta records)."""
    return dict(prefetch_split=args.prefetch_split, prefetch_indexer=args.prefetch_indexer,
                threshold_update=args.threshold_update, overlap_copy_rows=args.overlap_copy_rows,
                last_chunk_programs=args.last_chunk_programs, last_chunk_margin=args.last_chunk_margin,
                last_chunk_priority=args.last_chunk_priority, last_chunk_prefetch=args.last_chunk_prefetch == "on",
                prefetch_claim=args.prefetch_claim, chunk_indexer_tiles=args.chunk_indexer_tiles,
                refill_priority=args.refill_priority)


def ess_knobs(args) -> dict:
    """`build_ess`'s keywords every ESS variant of a run takes from the command line: `stack_knobs`, and the cache
    manager's refill interval (the run's meta records both)."""
    return dict(stack_knobs(args), refill_interval=args.refill_interval)


class SelectionLog:
    """A stack's top-k, recorded for the correctness check: per call, the positions (ascending, -1 last) and per row
    whether they are k best scores of the row (a valid top-k: min(k, visible) distinct visible positions, no visible
    unselected score above the lowest selected one; ties may go either way). So an exact mode that is not
    bit-identical to the all-HBM stack says why: another selection (which of the two stacks' top-k calls selected
    validly), or the same selection and other attention inputs (a bug). One query token per request (the
    harness's)."""

    def __init__(self, topk):
        self.topk = topk  # a name ("torch", "triton") or a callable (StackOptions.topk)
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []  # (positions ascending, valid) per call
        self.given: list[torch.Tensor] = []  # the positions as the top-k gave them (their order is attention's)
        for name in ("begin_step", "prepare"):
            if hasattr(topk, name):
                setattr(self, name, getattr(topk, name))

    def __call__(self, scores: torch.Tensor, k: int, seq_lens: torch.Tensor):
        pos, kth = self.topk(scores, k, seq_lens) if callable(self.topk) else topk_with_scores(scores, k, self.topk)
        B, Q, T = scores.shape
        p = pos.reshape(B * Q, -1).long()
        rows = scores.reshape(B * Q, T).float()
        visible = torch.arange(T, device=scores.device).view(1, T) < seq_lens.repeat_interleave(Q).view(-1, 1)
        chosen = torch.zeros_like(visible)
        chosen.scatter_(1, torch.where(p >= 0, p, 0), p >= 0)
        lowest = torch.where(chosen, rows, float("inf")).amin(dim=1)
        highest_left = torch.where(visible & ~chosen, rows, float("-inf")).amax(dim=1)
        # as many as there are to select, each visible, none of them twice
        counted = (chosen.sum(dim=1) == (p >= 0).sum(dim=1)) & \
            ((p >= 0).sum(dim=1) == visible.sum(dim=1).clamp(max=k)) & ~(chosen & ~visible).any(dim=1)
        ordered = torch.where(p >= 0, p, T).sort(dim=1).values
        self.calls.append((torch.where(ordered < T, ordered, -1).int(), (lowest >= highest_left) & counted))
        self.given.append(p.int())
        return pos, kth

    def per_layer(self, rows: int, given: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The calls grouped into whole-batch selections of `rows` rows (DBA selects chunk by chunk): (positions
        ascending, or with `given` in the top-k's own order; valid) per selection."""
        out, pos, ok = [], [], []
        for (p, v), g in zip(self.calls, self.given, strict=True):
            pos.append(g if given else p)
            ok.append(v)
            if sum(x.shape[0] for x in pos) == rows:
                out.append((torch.cat(pos), torch.cat(ok)))
                pos, ok = [], []
        return out


class ReplayedSelection:
    """A top-k that gives, call by call, the selections another stack's `SelectionLog` recorded, in the order that
    top-k gave them (whole-batch selections of `rows` rows; a DBA chunk's call takes the next rows of the current
    one): an ESS stack run with it attends over exactly what the all-HBM stack attended over, so its exact modes must
    then be bit-identical whatever the top-k does with ties. Positions only (a prefetching stack finds the k-th
    scores itself)."""

    def __init__(self, log: SelectionLog, rows: int):
        self.selections = [p for p, _ in log.per_layer(rows, given=True)]
        self.at, self.row = 0, 0

    def __call__(self, scores: torch.Tensor, k: int, seq_lens: torch.Tensor):
        B, Q, _ = scores.shape
        if self.at >= len(self.selections):
            raise RuntimeError(f"replayed selection: more top-k calls than the {len(self.selections)} recorded")
        whole = self.selections[self.at]
        if whole.shape[1] != k or self.row + B * Q > whole.shape[0]:
            raise RuntimeError(f"replayed selection: a call of {B * Q} rows x k {k} does not fit the recorded "
                               f"selection {tuple(whole.shape)} at row {self.row}")
        pos = whole[self.row:self.row + B * Q].reshape(B, Q, k).to(scores.device)
        self.row += B * Q
        if self.row == whole.shape[0]:
            self.at, self.row = self.at + 1, 0
        return pos, None


def compare_selections(got: SelectionLog, want: SelectionLog, rows: int) -> dict:
    """Per-row comparison of two stacks' selections over the same steps."""
    g, w = got.per_layer(rows), want.per_layer(rows)
    if len(g) != len(w):
        return dict(same_selection=False, note=f"{len(g)} selections against {len(w)}")
    differ = invalid_got = invalid_want = 0
    for (pg, vg), (pw, vw) in zip(g, w, strict=True):
        d = (pg != pw).any(dim=1)
        differ += int(d.sum())
        invalid_got += int((d & ~vg).sum())
        invalid_want += int((d & ~vw).sum())
    return dict(same_selection=differ == 0, rows_selected_otherwise=differ, of_those_not_a_valid_topk=invalid_got,
                of_those_hbm_not_a_valid_topk=invalid_want)


def check_correctness(pools, cfg, slots, queries, warm, spare_fraction: float = 0.0, margin: float = 0.0,
                      prefetch_fractions: tuple[float, ...] | None = None, resolve_pdl: bool | None = None,
                      prefetch_pdl: bool | None = None, topk="torch", **knobs) -> dict:
    """Eager steps from the same state: ESS modes against the all-HBM stack (whole-batch and split attention), every
    stack with the run's top-k, each stack's selections recorded (`SelectionLog`) and compared with the all-HBM
    stack's. `knobs`: `ess_knobs` of the run."""
    res = {}
    hbm_log = SelectionLog(stack_topk(topk, True))
    hbm = HbmDecodeStack(pools.latents, pools.index_cache, cfg.width,
                         StackOptions(modes=["sync"] * cfg.layers, top_k=TOP_K, topk=hbm_log))
    hbm_split = HbmDecodeStack(pools.latents, pools.index_cache, cfg.width,
                               StackOptions(modes=["dba"] * cfg.layers, top_k=TOP_K,
                                            topk=stack_topk(topk, True)), split_attention=True)
    want, want_split = [], []
    for s in range(cfg.steps):
        cfg.load_step(s, queries)
        want.append([o.clone() for o in hbm.step(cfg.batch_tables, cfg.inputs)])
        want_split.append([o.clone() for o in hbm_split.step(cfg.batch_tables, cfg.inputs)])
    variants = [("sync", "sync", False), ("prefetch", "sync", True), ("prefetch2", "sync", True),
                ("dba", "dba", False)]
    if prefetch_fractions is not None and len(prefetch_fractions) > 2:  # the run's own plan of N chunks as well
        variants.insert(3, (f"prefetch{len(prefetch_fractions)}", "sync", True))
    if spare_fraction:  # the same modes with spare slots (refilled beside attention)
        variants += [(f"{n}+spare", m, p) for n, m, p in variants if n != "prefetch"]
    for name, modes, prefetch in variants:
        def run(top, name=name, modes=modes, prefetch=prefetch):
            """(bit-identical to all-HBM, to split all-HBM, max relative error, hit rate) of the variant with `top`."""
            ess = build_ess(pools, cfg, slots, [modes] * cfg.layers, prefetch, margin=margin,
                            spare=spare_slots(spare_fraction, cfg.batch, slots) if name.endswith("+spare") else 0,
                            prefetch_chunks=chunk_fractions(name.removesuffix("+spare"), prefetch_fractions),
                            resolve_pdl=resolve_pdl, prefetch_pdl=prefetch_pdl, topk=top, **knobs)
            reset_and_warm(ess, cfg)
            identical, identical_split, rel = True, True, 0.0
            for s in range(cfg.steps):
                cfg.load_step(s, queries)
                got = ess.step(cfg.batch_tables, cfg.inputs)
                for layer in range(cfg.layers):
                    w, ws, g = want[s][layer].float(), want_split[s][layer].float(), got[layer].float()
                    identical &= torch.equal(g, w)
                    identical_split &= torch.equal(g, ws)
                    rel = max(rel, float((g - w).abs().max() / w.abs().max()))
            c = ess.m.counters.cpu()
            return identical, identical_split, rel, int(c[:, Counter.HITS].sum()) / max(1, int(
                c[:, Counter.LOOKUPS].sum()))

        log = SelectionLog(stack_topk(topk, True))
        identical, identical_split, rel, hit = run(log)
        res[name] = dict(bit_identical=identical, bit_identical_to_split_hbm=identical_split, max_rel_err=rel,
                         hit_rate=hit, **compare_selections(log, hbm_log, cfg.batch))
        if not res[name]["same_selection"]:  # the all-HBM stack's own selections, replayed: ESS's output for them
            same, _, rel_same, _ = run(SelectionLog(ReplayedSelection(hbm_log, cfg.batch)))
            res[name].update(bit_identical_given_hbm_selection=same, max_rel_err_given_hbm_selection=rel_same)
    return res


def pool_slots(args, batch: int, context: int, steps: int) -> int:
    """Hot slots per layer: `ratio` of the batch's tokens; a batch below 16 runs on an instance sized for
    `--pool-batch` requests (the small-batch case: a few requests on a big instance). Never below 1.25 selections."""
    sized_for = batch if batch >= 16 else max(batch, args.pool_batch)
    slots = math.ceil(args.ratio * sized_for * context / 64) * 64
    return max(slots, math.ceil(batch * (TOP_K + 2 * steps) * 1.25 / 64) * 64)


def layerwise_settings(sync_misses, cfg: Config, slots: int, hit: float,
                       timings: DeviceTimings) -> tuple[list[str], list[int], list[float]]:
    """The layer-wise policy's per-layer (overlap modes, prefetch chunks, prefetch threshold margins): a profile of
    the sync run's misses per layer, written as YAML and read back, as a deployment would run it."""
    misses = np.asarray([sync_misses], dtype=np.float64)
    header = ProfileHeader(command=f"benchmarks/decode_layers.py layerwise (context {cfg.context}, batch {cfg.batch}, "
                                   f"hit {hit})", date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           source="synthetic", trace="the sync run's misses per layer and step", trace_batch=cfg.batch,
                           trace_top_k=TOP_K, trace_context_mean=float(cfg.context), steps=1, slots_per_layer=slots,
                           warmup="recent", batch=cfg.batch, context=cfg.context, top_k=TOP_K, miss_scale=1.0,
                           chosen_by="mean")
    profile = build_profile(misses, np.full_like(misses, cfg.batch * TOP_K), header, timings)
    with tempfile.TemporaryDirectory() as d:
        read_back = load_profile(save_profile(profile, os.path.join(d, "profile.yaml")), cfg.layers)
    return (*layer_settings(read_back, cfg.layers), layer_prefetch_margins(read_back, cfg.layers))


def run_config(pools, layers, context, batch, hit, args, timings, timings_spare) -> list[dict]:
    cfg = Config(pools, layers, context, batch, args.warm + args.steps, seed=context + batch)
    slots = pool_slots(args, batch, context, cfg.steps)
    rho, cal_hit = calibrate_rho(pools, cfg, slots, hit, args.warm, topk=args.topk_impl)
    queries = cfg.queries(rho)
    rows = []
    base = dict(context=context, batch=batch, target_hit=hit, rho=rho, calibrated_hit=cal_hit, slots_per_layer=slots,
                layers=layers)
    if not isinstance(args.topk_impl, str):  # SGLang's top-k: its path for the whole batch and for DBA's chunks
        base.update(topk_path=args.topk_impl.path(batch, cfg.width),
                    topk_path_dba_chunks=[args.topk_impl.path(hi - lo, cfg.width) for lo, hi in chunk_bounds(
                        batch, StackOptions(modes=["dba"], dba_split=args.dba_split).dba_fractions)] if batch >= 2
                    else [])
    hbm = HbmDecodeStack(pools.latents, pools.index_cache, cfg.width,
                         StackOptions(modes=["sync"] * layers, top_k=TOP_K, topk=stack_topk(args.topk_impl)))
    t_hbm = run_variant(hbm, cfg, queries, args.warm, is_ess=False)
    rows.append(dict(base, variant="hbm", **t_hbm, ratio=1.0))
    sync_misses = None
    options = dict(dba_split=args.dba_split, overlap_programs=args.overlap_programs, topk=args.topk_impl,
                   **ess_knobs(args))
    for spare_size, mode in [(f, m) for f in args.spare for m in args.modes]:
        variant = f"{mode}+spare" if spare_size else mode
        if spare_size == "auto" and sync_misses is None:
            raise SystemExit("--spare auto needs the sync mode without spare slots first (its misses size them)")
        spare = spare_slots(spare_size, batch, slots, sync_misses, args.refill_interval)
        resident = False
        layer_prefetch = None
        margin = args.prefetch_margin
        if mode == "layerwise":  # the policy: all-resident lookups when everything fits, else the profile's modes
            if sync_misses is None:
                raise SystemExit("--modes: layerwise needs sync before it (its misses make the profile)")
            resident = fits(cfg, slots)
            modes, layer_prefetch, margin = layerwise_settings(sync_misses, cfg, slots, hit,
                                                               timings_spare if spare_size else timings)
            prefetch = False
        elif mode in EXTRA_MODES:
            modes, prefetch = [mode.split("_")[0]] * layers, False
        elif prefetch_chunks(mode):
            modes, prefetch = ["sync"] * layers, True
        else:
            modes, prefetch = [mode] * layers, False
        if "dba" in modes and batch < 2 or resident and spare_size:  # (all-resident: no misses, no spares)
            continue
        try:
            ess = build_ess(pools, cfg, slots, modes, prefetch, spare=spare, margin=margin,
                            resolve_pdl=args.resolve_pdl, prefetch_pdl=args.prefetch_pdl,
                            **dict(options, sync_copy="counted" if mode == "sync_counted" else "inline",
                                   prefetch_chunks=chunk_fractions(mode, args.prefetch_fractions),
                                   prefetch_layers=layer_prefetch,
                                   chunk_plans={len(args.prefetch_fractions): args.prefetch_fractions}
                                   if layer_prefetch is not None and args.prefetch_fractions else None,
                                   dba_attention="split" if mode == "dba_split" else "whole",
                                   new_tokens="insert" if mode == "sync_insert" else "on_demand"))
            r = run_variant(ess, cfg, queries, args.warm, is_ess=True, all_resident=resident)
        except Exception as exc:  # keep the other variants' results; the row says what failed
            print(f"{variant} at context {context}, batch {batch}: {type(exc).__name__}: {exc}", flush=True)
            rows.append(dict(base, variant=variant, error=f"{type(exc).__name__}: {exc}"))
            continue
        r["all_resident"] = resident
        if variant == "sync":
            sync_misses = r["misses_per_layer_step"]
        policy = {} if layer_prefetch is None else dict(layer_prefetch_chunks=list(layer_prefetch),
                                                        layer_prefetch_margins=list(margin))
        rows.append(dict(base, variant=variant, spare_slots=spare, layer_modes=list(modes), **policy, **r,
                         ratio=r["step_us"] / t_hbm["step_us"]))
        del ess
        torch.cuda.empty_cache()
    sync = next((r for r in rows if r["variant"] == "sync"), None)
    for r in rows:
        if sync is not None and r["variant"] != "hbm" and "step_us" in r:
            exposed_sync = sync["step_us"] - t_hbm["step_us"]
            r["hidden_fraction"] = (1 - (r["step_us"] - t_hbm["step_us"]) / exposed_sync) if exposed_sync > 0 else None
    return rows


def policy_modes(row) -> list[str]:
    """A row's per-layer modes in the overlap profile's names: a sync layer that prefetches in N chunks is
    "prefetch" (N = 1) or "prefetchN", with "_margin" where it runs a threshold margin."""
    n_layers = len(row.get("layer_modes", []))
    chunks = row.get("layer_prefetch_chunks") or [0] * n_layers
    margins = row.get("layer_prefetch_margins") or [0.0] * n_layers
    return [m if not n else ("prefetch" if n == 1 else f"prefetch{n}") + ("_margin" if g else "")
            for m, n, g in zip(row.get("layer_modes", []), chunks, margins, strict=True)]


def print_table(rows) -> None:
    print(f"\n{'ctx':>6} {'B':>4} {'hit*':>5} {'variant':>15} {'hit':>6} {'us/layer':>9} {'x HBM':>6} {'hidden':>7} "
          f"{'H2D MB/step':>11} {'pf useful/wasted':>17}  modes")
    for r in rows:
        if "error" in r:
            print(f"{r['context'] // 1024:>5}K {r['batch']:>4} {r['target_hit']:>5.2f} {r['variant']:>15} {r['error']}")
            continue
        hid = r.get("hidden_fraction")
        pf = f"{r.get('prefetch_useful', 0)}/{r.get('prefetch_wasted', 0)}" if r.get("prefetched") else ""
        modes = ",".join(sorted(set(policy_modes(r)))) if r["variant"].startswith("layerwise") else ""
        if r.get("all_resident"):
            modes = "all-resident lookup"
        print(f"{r['context'] // 1024:>5}K {r['batch']:>4} {r['target_hit']:>5.2f} {r['variant']:>15} "
              f"{r.get('hit_rate', float('nan')):>6.3f} {r['layer_us']:>9.1f} {r['ratio']:>6.3f} "
              f"{'' if hid is None else f'{hid:>6.0%}':>7} {r.get('h2d_mb_per_step', 0):>11.2f} {pf:>17}  {modes}")


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.2), squeeze=False)
    for ax, ctx in zip(axes[0], contexts, strict=True):
        sel = [r for r in rows if r["context"] == ctx and abs(r["target_hit"] - 0.95) < 1e-9]
        for variant in ["hbm"] + list(dict.fromkeys(r["variant"] for r in sel if r["variant"] != "hbm")):
            pts = sorted((r["batch"], r["ratio"]) for r in sel if r["variant"] == variant and "ratio" in r)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
        ax.axhline(1.05, color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("decode-stack time / all-HBM")
        ax.set_title(f"context {ctx // 1024}K, target hit rate 0.95")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--batches", default="1,2,16,64,128")
    p.add_argument("--hits", default="0.9,0.95,0.99")
    p.add_argument("--small-batch-hits", default="0.95", help="hit targets for batches below 16")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {MODES + EXTRA_MODES}")
    p.add_argument("--ratio", type=float, default=0.2, help="hot slots per layer / tokens of the batch")
    p.add_argument("--pool-batch", type=int, default=64, help="batches below 16 run on pools sized for this many")
    p.add_argument("--dba-split", default="0.5",
                   help="fraction of the batch in DBA's first chunk, or every chunk's fraction (0.5,0.3,0.2)")
    p.add_argument("--topk", default="sglang", choices=["sglang", "torch", "triton"],
                   help="top-k kernel of both stacks: sglang (default), SGLang 0.5.23's decode top-k "
                   "(topk_transform_paged_v2, what an SGLang decode runs), built from the sglang wheel at start "
                   "(benchmarks/sglang_topk.py; needs nvcc and tvm-ffi); torch: torch.topk (~7x slower at batch 64 / "
                   "32K, which flatters overlap); triton: ours")
    p.add_argument("--overlap-programs", type=int, default=32, help="programs of a copy that overlaps compute")
    p.add_argument("--warm", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="32K; hit 0.95; batches 2, 64 unless --batches says")
    p.add_argument("--max-tokens", type=int, default=0, help="skip configurations with more tokens than this")
    p.add_argument("--calibration", metavar="JSON", help="layerwise: choose the modes from the exposed times this "
                   "earlier run of the benchmark measured (sync / dba / prefetch / prefetch2) instead of the "
                   "analytic cost model")
    p.add_argument("--calibration-margin", metavar="JSON", help="with --calibration (a run at margin 0): a run at "
                   "--prefetch-margin m > 0, whose prefetch modes the policy may choose as prefetch_margin / "
                   "prefetch2_margin (those layers then prefetch with margin m)")
    p.add_argument("--spare", default="0", help="spare slots per layer, as fractions of batch x top-k or 'auto' "
                   "(from the sync run's misses), e.g. 0,auto: every mode runs once per value (variant 'mode+spare' "
                   "where not 0)")
    p.add_argument("--prefetch-margin", type=float, default=0.0,
                   help="ECHO candidates above threshold - margin x |threshold| (EchoPrefetcher margin)")
    p.add_argument("--prefetch-split", default="rows", choices=["rows", "positions"],
                   help="prefetchN: the indexer chunks are N groups of requests (rows) or N segments of the positions "
                   "of every request (positions: the last segment's copy is its share of the misses; segments are "
                   "fractions of the table width, which here is each request's length)")
    p.add_argument("--prefetch-indexer", default="overlapped", choices=list(PREFETCH_INDEXER_LAUNCHES),
                   help="prefetchN: the chunks' indexer launches one after the other on the main stream (serial), "
                   "all but the last on a high-priority stream of their own, the last at once on the main stream "
                   "(overlapped: the last chunk's blocks fill the first launch's last wave), or serial with each "
                   "launch after the first chained by programmatic dependent launch (chained: its blocks fill the "
                   "previous launch's last wave, ahead of that segment's claim kernel on the side stream)")
    p.add_argument("--prefetch-fractions", metavar="F,F,...",
                   help="prefetchN modes with N of these: the indexer chunks are these fractions of the batch (or of "
                   "the positions, --prefetch-split positions; summing "
                   "to 1, e.g. 0.5,0.3,0.2) instead of N equal ones; layerwise runs its profile's prefetchN layers "
                   "with them too, from a calibration measured with the same fractions")
    p.add_argument("--chunk-indexer-tiles", type=_tiles_arg, default=StackOptions.chunk_indexer_tiles,
                   metavar="N|kernel",
                   help="prefetchN and layerwise: the Triton indexer's tiles a program in the chunks' launches after "
                   "the first (beside an earlier chunk's claim and copy), or 'kernel' for the kernel's own (1 since "
                   "commit 4860304 of 2026-12-01, 8 before; the whole-logits launch always runs it)")
    p.add_argument("--threshold-update", default="side", choices=["main", "side"],
                   help="prefetch: the EMA threshold update at the layer's end on the main stream, or on the side "
                   "stream beside attention")
    p.add_argument("--last-chunk-programs", type=int, default=None,
                   help="prefetchN: the last chunk's copy (beside the top-k) with this many programs instead of "
                   "--overlap-programs")
    p.add_argument("--last-chunk-margin", type=float, default=None,
                   help="prefetchN: the last chunk's threshold margin (beside the top-k) instead of --prefetch-margin")
    p.add_argument("--overlap-copy-rows", type=int, default=8,
                   help="rows each of the --overlap-programs copy programs has in flight (a power of two up to 64)")
    p.add_argument("--last-chunk-prefetch", default="on", choices=["on", "off"],
                   help="prefetchN: off runs the last chunk's indexer launch without its prefetch (nothing beside the "
                   "top-k); its misses are left to the exact resolve")
    p.add_argument("--last-chunk-priority", default="high", choices=["high", "normal"],
                   help="prefetchN: the last chunk's candidate, claim and copy launches (beside the top-k) on the "
                   "high-priority side stream, or at the main stream's priority")
    p.add_argument("--refill-priority", default="high", choices=["high", "normal"],
                   help="spare slots: the refill's launches on the high-priority side stream, or at the main "
                   "stream's priority")
    p.add_argument("--refill-interval", type=int, default=1,
                   help="spare slots: refill each layer's in every step (1), or in every K-th step of the layer (the "
                   "layers in turn) and whenever fewer than 1/K of them are left; size --spare to K steps' misses "
                   "(auto does)")
    p.add_argument("--prefetch-claim", default="one_launch", choices=["one_launch", "separate"],
                   help="prefetch with spare slots: each chunk's candidates found and their spare slots claimed in "
                   "one kernel (then a one-program close), or the candidate kernels then the spare-only claim (six "
                   "launches)")
    p.add_argument("--resolve-pdl", default="auto", choices=["auto", "on", "off"],
                   help="the fused resolve's kernels after its lookup with programmatic dependent launch (auto: on "
                   "sm_90+)")
    p.add_argument("--prefetch-pdl", default="auto", choices=["auto", "on", "off"],
                   help="the prefetch's candidate kernels after the first (and, with spare slots and --resolve-pdl on, "
                   "its three claim launches) with programmatic dependent launch (auto: on sm_90+)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_layers.py needs a CUDA GPU (FlashMLA, pinned host memory)", file=sys.stderr)
        return 2
    if args.quick:
        args.contexts, args.hits = "32768", "0.95"
        args.batches = args.batches if args.batches != p.get_default("batches") else "2,64"
    args.modes = args.modes.split(",")
    try:
        args.spare = [f if f == "auto" else float(f) for f in args.spare.split(",")]
    except ValueError:
        p.error(f"--spare: fractions in [0, 1) or 'auto', got {args.spare!r}")
    if any(f != "auto" and not 0 <= f < 1 for f in args.spare) or len(set(args.spare)) != len(args.spare) or \
            args.spare[0] != 0 and ("layerwise" in args.modes or "auto" in args.spare):
        p.error("--spare: distinct fractions in [0, 1) or 'auto'; with layerwise or auto, the first must be 0 (the "
                "profile and the auto size need the sync run without spare slots)")
    if not 1 <= args.refill_interval <= MAX_REFILL_INTERVAL:
        p.error(f"--refill-interval: must be in [1, {MAX_REFILL_INTERVAL}], got {args.refill_interval}")

    def known(mode: str) -> bool:
        try:
            return mode in MODES + EXTRA_MODES or bool(prefetch_chunks(mode))
        except ValueError:
            return False

    if "da" in args.modes:
        p.error(f"--modes: da: {DA_REMOVED}")
    bad = [m for m in args.modes if not known(m)]
    if bad:
        p.error(f"--modes: unknown mode {bad[0]!r} (of {MODES + EXTRA_MODES}, or prefetchN)")
    if not 0 <= args.prefetch_margin < 1:
        p.error(f"--prefetch-margin: must be in [0, 1), got {args.prefetch_margin}")
    if args.last_chunk_margin is not None and not 0 <= args.last_chunk_margin < 1:
        p.error(f"--last-chunk-margin: must be in [0, 1), got {args.last_chunk_margin}")
    sm90 = torch.cuda.get_device_capability()[0] >= 9
    for name in ("resolve_pdl", "prefetch_pdl"):  # auto / on / off -> a bool
        flag = f"--{name.replace('_', '-')}"
        if getattr(args, name) == "on" and not sm90:
            p.error(f"{flag} on: programmatic dependent launch needs a GPU of compute capability 9.0 or newer")
        setattr(args, name, {"auto": sm90, "on": True, "off": False}[getattr(args, name)])
    if args.prefetch_fractions is not None:
        try:
            args.prefetch_fractions = tuple(float(f) for f in args.prefetch_fractions.split(","))
            StackOptions(modes=["sync"], prefetch=True, prefetch_chunks=args.prefetch_fractions)
        except ValueError as exc:
            p.error(f"--prefetch-fractions: {exc}")
        n = len(args.prefetch_fractions)
        policy_chunks = {c for c in PREFETCH_CHUNKS.values() if c > 1}  # what a layer-wise profile's layers run
        if not any(m == "layerwise" and n in policy_chunks or known(m) and prefetch_chunks(m) == n
                   for m in args.modes):
            can = " or ".join(str(c) for c in sorted(policy_chunks))
            p.error(f"--prefetch-fractions: {n} fractions, but no prefetch{n} mode in --modes runs that many chunks"
                    + ("" if n in policy_chunks else f" (nor a layer-wise profile's layers: they run {can})"))
    try:  # the stack's own checks of the knobs every ESS variant takes, before any allocation
        StackOptions(modes=["sync"], **stack_knobs(args))
    except ValueError as exc:
        p.error(f"stack options from the command line (--overlap-copy-rows, --last-chunk-*, ...): {exc}")
    if args.last_chunk_prefetch == "off" and not any(m == "layerwise" or known(m) and prefetch_chunks(m) > 1
                                                     for m in args.modes):
        p.error("--last-chunk-prefetch off: no prefetchN mode (N >= 2) or layerwise in --modes has a last chunk to "
                "leave out")
    split = [float(f) for f in args.dba_split.split(",")]
    args.dba_split = split[0] if len(split) == 1 else tuple(split)
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    hits = [float(x) for x in args.hits.split(",")]
    small_hits = [float(x) for x in args.small_batch_hits.split(",")]
    configs = [(c, b, h) for c in contexts for b in batches for h in (hits if b >= 16 else small_hits)
               if not args.max_tokens or c * b <= args.max_tokens]
    timings = timings_spare = DeviceTimings()
    if args.calibration_margin and not args.calibration:
        p.error("--calibration-margin: needs --calibration (the run at margin 0)")
    if args.calibration:
        runs = [args.calibration] + ([args.calibration_margin] if args.calibration_margin else [])
        # what the calibration's runs must have measured with: this run's top-k and prefetch chunks
        same_as_this_run = dict(topk=args.topk, prefetch_split=args.prefetch_split,
                                prefetch_fractions=args.prefetch_fractions, prefetch_indexer=args.prefetch_indexer,
                                last_chunk_prefetch=args.last_chunk_prefetch == "on",
                                chunk_indexer_tiles=args.chunk_indexer_tiles,
                                # (layerwise+spare: its spare slots must have been refilled as this run's)
                                refill_interval=args.refill_interval if any(args.spare) else None)
        try:
            timings = timings.model_copy(update={"measured": load_calibration(runs, **same_as_this_run)})
        except CalibrationError as exc:
            p.error(f"--calibration: {exc}")
        timings_spare = timings  # layerwise+spare: the calibration's runs with spare slots, where it has them
        if any(args.spare):
            try:
                spare_runs = load_calibration(runs, spare_slots=True, **same_as_this_run)
                timings_spare = timings.model_copy(update={"measured": spare_runs})
            except CalibrationError as exc:
                print(f"layerwise+spare chooses from the runs without spare slots: {exc}", flush=True)
    args.topk_impl, topk_meta = args.topk, {}
    if args.topk == "sglang":  # build (probe + nvcc, ~30 s) before the pools are pinned
        import hisparse_kernel
        import sglang_topk  # benchmarks/sglang_topk.py (needs tvm-ffi and nvcc)

        try:
            args.topk_impl = sglang_topk.build()
        except (hisparse_kernel.HiSparseBuildError, ImportError) as exc:
            p.error(f"--topk sglang: cannot build SGLang's decode top-k here ({exc}); --topk torch runs without it")
        topk_meta = dict(sglang_topk_clusters=args.topk_impl.clusters, sglang_topk_pdl=args.topk_impl.pdl)
    steps = args.warm + args.steps
    tokens = max(b * table_width(c, steps) for c, b, _ in configs)
    pools = Pools(args.layers, tokens)  # (after every argument and file is checked: pinned GBs)
    t0 = time.time()
    first = configs[0]
    cfg0 = Config(pools, args.layers, first[0], 16, steps, seed=7)
    slots0 = pool_slots(args, cfg0.batch, cfg0.context, steps)
    rho0, _ = calibrate_rho(pools, cfg0, slots0, 0.95, args.warm, topk=args.topk_impl)
    # with spare slots: the first fraction given, or 0.08 for auto (which needs a sync run: a fixed size here)
    fixed = [f for f in args.spare if f not in (0, "auto")]
    correctness = dict(context=cfg0.context, batch=cfg0.batch, **check_correctness(
        pools, cfg0, slots0, cfg0.queries(rho0), args.warm,
        spare_fraction=fixed[0] if fixed else 0.08 if "auto" in args.spare else 0.0, margin=args.prefetch_margin,
        prefetch_fractions=args.prefetch_fractions, resolve_pdl=args.resolve_pdl, prefetch_pdl=args.prefetch_pdl,
        topk=args.topk_impl, **ess_knobs(args)))
    print("correctness:", json.dumps(correctness), flush=True)
    rows = []
    os.makedirs(args.out, exist_ok=True)
    meta = dict(command="python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
                date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), device=torch.cuda.get_device_name(),
                wall_s=time.time() - t0, layers=args.layers, heads=HEADS, index_heads=IHEADS, top_k=TOP_K,
                ratio=args.ratio, warm=args.warm, steps=args.steps, pool_batch=args.pool_batch,
                dba_split=args.dba_split, overlap_programs=args.overlap_programs, topk=args.topk, **topk_meta,
                spare=args.spare,
                prefetch_margin=args.prefetch_margin, prefetch_fractions=args.prefetch_fractions,
                new_tokens_per_step=True,  # each step's new tokens its own (before: one new key and latent every step)
                resolve_pdl=args.resolve_pdl, prefetch_pdl=args.prefetch_pdl, **ess_knobs(args),
                calibration=timings.measured.source if timings.measured is not None else None,
                calibration_prefetch_margin=timings.measured.prefetch_margin if timings.measured is not None else None,
                calibration_spare=timings_spare.measured.source if timings_spare.measured is not None else None)
    for c, b, h in configs:
        rows += run_config(pools, args.layers, c, b, h, args, timings, timings_spare)
        print_table([r for r in rows if (r["context"], r["batch"], r["target_hit"]) == (c, b, h)])
        sys.stdout.flush()
        meta["wall_s"] = time.time() - t0
        with open(os.path.join(args.out, "decode_layers.json"), "w") as f:  # after every configuration
            json.dump(dict(meta=meta, correctness=correctness, rows=rows), f, indent=1)
    print_table(rows)
    plot(rows, os.path.join(args.out, "decode_layers.png"))
    print(f"wrote {args.out}/decode_layers.json and .png ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
