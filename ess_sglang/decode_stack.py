"""A stack of DSA decode layers with ESS, in each overlap mode, beside the same stack with every latent in HBM.

One layer of one decode step, top to bottom (`EssDecodeStack.forward_layer`):

    1. store this step's token: its indexer key into the device indexer cache (main stream); its latent entry
       written back to the host pool (D2H, side stream, overlapping the indexer), then fetched like any other miss
       if the top-k selects it (with `new_tokens="insert"` also into a hot slot of its own: a resolve more);
    2. indexer logits over the request's whole context (main stream);
    3. [prefetch, in every layer (`prefetch`) or in the layers `prefetch_layers` names] candidates scoring above the
       EMA of the k-th best score are fetched on the side stream while the main stream runs the top-k (ECHO;
       `ess_sglang.prefetch`); with `prefetch_chunks` > 1 the indexer runs over the batch in that many chunks and
       each chunk's candidates are fetched as soon as its logits exist, beside the next chunk's indexer (the last
       chunk's beside the top-k); the chunks before the last launch on a high-priority stream of their own and the
       last at once on the main stream (`prefetch_indexer="overlapped"`), so the last launch's blocks fill the first
       one's last wave instead of waiting for it (or one after the other on the main stream, "serial"; "chained":
       serial, each launch after the first with programmatic dependent launch on sm_90+, so that its blocks fill the
       previous launch's last wave before the side stream's claim kernel for that launch's segment takes the SMs);
       the launches after the first score `chunk_indexer_tiles` tiles a program (default 1, the first launch the
       kernel's own, also 1: docs/design.md, "Indexer"), so that their short programs free SM slots for the
       side stream's claim and copy; on sm_90+ a chunk's candidate kernels after the first (and, with spare slots
       and the resolve's PDL, its three claim launches) use programmatic dependent launch
       (`EchoPrefetcher(pdl=...)`); `last_chunk_priority="normal"`
       queues the last chunk's launches at the main stream's priority instead of the side stream's high one; with
       `prefetch_split="positions"` the chunks are segments of the positions instead (every request, positions
       [lo, hi)), so the last segment's copy (its share of the misses) is what is left beside the top-k;
       `last_chunk_prefetch=False` drops the last chunk's prefetch (its launch still covers the previous chunk's
       copy): its misses are left to the exact resolve's copy;
    4. top-k positions (torch.topk, the Triton kernel `ess_sglang.kernels.topk`, or a caller's, e.g. SGLang's decode
       top-k); the k-th best score (the top-k's, or, from a top-k that gives positions only, the lowest selected
       logit, found by `selection_kth_scores` where it is folded in) updates the prefetch threshold on the side stream
       beside attention, behind the layer's candidate reads there (`threshold_update="side"`; "main": at the end of
       the layer on the main stream);
    5. resolve + fetch, then attention over hot-pool slots, in the layer's mode:
       sync  resolve (lookup, protect, evict, assign; each miss is copied host -> hot slot as it gets its slot: by
             the lookup for the first 1,024 that take spare slots, by the assign kernel otherwise; on sm_90+ the
             kernels after the lookup use programmatic dependent launch), then attend
             (`sync_copy="counted"`: a separate persistent copy over the miss list). Exact.
       dba   dual-batch attention: the batch is split in two (or more chunks, `dba_split`); half A's resolve +
             copy run on the side stream while the main stream runs half B's indexer and top-k (and so on).
             Then either one attention over the whole batch once the last copy has landed
             (`dba_attention="whole"`, the default: exact), or half A attends while half B's copy runs ("split":
             hides more, but FlashMLA's split-KV schedule depends on the batch size, so half-batch attention can
             differ from whole-batch attention by rounding; the all-HBM stack given the same split is
             bit-identical).
       (A third, da: dual attention over the hits while the misses copy, then over the misses, merged by log-sum-exp,
       was removed: slower than sync in every measured configuration, docs/design.md, "Overlap modes".)
    6. [spare slots] the layer's spare slots taken since its last refill are refilled when it is due: every step, or
       with the manager's `refill_interval` K every K-th step of the layer and whenever fewer than 1/K are left
       (`HotPoolCacheManager.refill_spares`: the LRU scans a resolve would otherwise run, evicting ahead; when not
       due its launches return at once), queued last on the side stream, beside attention
       (`refill_priority="normal"`: at the main stream's priority, joined into the side stream);
    7. the main stream waits for the side stream before the layer ends (for all of it but the refill, which nothing
       before the layer's next step reads; the step's end waits for everything).

Copies that overlap compute (DBA's halves, prefetches) run with `overlap_programs` persistent programs of
`overlap_copy_rows` rows in flight each, leaving the other SMs to the kernels they overlap. When the caller knows that
every live token of the batch is resident (`step(..., all_resident=True)`: small batches whose tokens all fit the pools
and were loaded, with slots reserved for the tokens to come), the new token goes straight to its reserved slot and step
5 is one lookup kernel (`HotPoolCacheManager.lookup_resident`) and attention: no resolve, no eviction, no H2D traffic.

`HbmDecodeStack` is the reference: the same steps 1, 2, 4 with every latent entry in device memory, positions
translated to KV locations by one kernel, and attention over them; `split_attention=True` splits its attention
the way DBA does, so that DBA can be checked bit for bit.

On CPU both stacks run with the torch references (no streams: the overlap modes then run their steps in order,
which is what the CPU tests check for correctness); on a GPU with the Triton indexer, the fused resolve and FlashMLA,
and every step can be captured in one CUDA graph (no host synchronisation anywhere).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ess_sglang.cache_manager import FetchList, HotPoolCacheManager, positions_to_locations
from ess_sglang.config import DA_REMOVED, new_token_mode
from ess_sglang.formats import QK_HEAD_DIM
from ess_sglang.prefetch import EchoPrefetcher, is_margin
from ess_sglang.reference.dsa import latent_store_rows, sparse_mla_flashmla, sparse_mla_reference
from ess_sglang.reference.dsa import topk_with_scores as reference_topk
from ess_sglang.streams import SideStream

MODES = ("sync", "dba")
PREFETCH_INDEXER_LAUNCHES = ("serial", "overlapped", "chained")
"""How a layer's prefetch chunks launch their indexer (`StackOptions.prefetch_indexer`)."""
TopK = Callable[[torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""A caller's top-k: (scores [B, Q, T], k, seq_lens [B]) -> (positions [B, Q, k] int32, -1 padded; k-th score
[B, Q], or None: a prefetching ESS stack then finds it itself). If it has a ``begin_step(seq_lens, width)`` method,
the stacks call it at the start of each step, before any kernel of the step (width: the score rows' length), and, if
it has ``prepare(seq_lens, width)``, an ESS stack with DBA layers calls that for each chunk of the batch it will
select for: e.g. SGLang's top-k makes its routing plan once a step (benchmarks/sglang_topk.py)."""


@dataclass
class DecodeBatch:
    """The request tables of one decode step, shared by every layer."""

    req_to_token: torch.Tensor  # [rows, max_context] int32 KV location of each position
    req_pool_indices: torch.Tensor  # [B] request row of each batch entry
    seq_lens: torch.Tensor  # [B] tokens of each request, this step's included
    new_locs: torch.Tensor  # [B] KV location of this step's token


@dataclass
class LayerInputs:
    """What one DSA layer computes from its hidden states in a decode step (the projections are not modelled)."""

    q_index: torch.Tensor  # [B, Q, index_heads, 128] indexer queries (fp8 e4m3 or bf16 / fp32)
    w_index: torch.Tensor  # [B, Q, index_heads] per-head indexer weights (scales folded in)
    q: torch.Tensor  # [B, Q, heads, 576] attention queries
    new_latent: torch.Tensor  # [B, 656] uint8 this step's latent entry (V32)
    new_index_key: torch.Tensor  # [B, 132] uint8 this step's indexer key


@dataclass
class StackOptions:
    modes: Sequence[str]  # one per layer: "sync" or "dba"
    top_k: int = 2048
    prefetch: bool = False  # ECHO prefetch in every layer
    prefetch_chunks: int | Sequence[float] = 1  # prefetch: the indexer runs in this many equal batch chunks (or in
    # chunks of these fractions of the batch, or of the positions: `prefetch_split`), each chunk's prefetch beside the
    # next chunk's indexer (1: one indexer launch, the prefetch beside the top-k only)
    prefetch_layers: Sequence[int] | None = None  # instead of `prefetch`: per layer, 0 (no prefetch) or the number
    # of indexer chunks its prefetch runs in (the overlap profile's prefetch* layers)
    chunk_plans: Mapping[int, Sequence[float]] | None = None  # prefetch_layers: the fractions a layer of N chunks runs
    # (N: fractions of N values summing to 1; N not given: N equal chunks), e.g. {3: (0.5, 0.3, 0.2)} for the profile's
    # prefetch3 layers measured so
    prefetch_split: str = "rows"  # with chunks: what the chunks split: "rows" (batch rows: each chunk is some requests
    # over all their positions) or "positions" (segments of the positions, as fractions of the table width rounded to
    # multiples of 64 positions (the indexer's tile when the calibrations were measured; any boundary gives the same
    # logits): each chunk is every request over positions [lo, hi); the last segment's copy is
    # its share of the misses whatever the batch size; each segment prefetches at most its share of a request's cap;
    # the segments are fractions of the table width, not of each request's length: they split the work as intended
    # where requests are about as long as the table is wide, as in the benchmark; a request much shorter than the
    # table has all its positions in the first segments, and the last ones then prefetch nothing for it)
    prefetch_indexer: str = "overlapped"  # with chunks: "serial" (the chunks' indexer launches one after the other
    # on the main stream), "overlapped" (every chunk but the last on a high-priority stream of their own, the last
    # on the main stream at once: the block scheduler fills the first launch's last wave with the next one's blocks;
    # 5-6 us a layer faster at batch 64-128, benchmarks/RESULTS.md) or "chained" (serial, each launch after the first
    # with programmatic dependent launch where the Triton indexer runs on sm_90+, serial elsewhere: its programs are
    # scheduled once the previous launch's have all started, and end after it: `indexer_logits_triton(chain=...)`)
    chunk_indexer_tiles: int | None = 1  # prefetch in chunks, the Triton indexer: tiles a program in the launches
    # of the chunks after the first (those beside an earlier chunk's claim and copy on the side stream), None: the
    # kernel's default (`kernels.indexer.TILES`: 1, formerly 8; docs/design.md, "Indexer"); the logits do not
    # depend on it. 1 measured fastest at batch 64, hit 0.95, 3 position segments launched chained
    # (benchmarks/RESULTS.md): 32K 488-522 us a layer (4 processes) against 542-568 with 8 (2) and 525-529 with 2 (2);
    # 128K, one process: 1,387-1,397 against 1,405-1,413 with 8, 1,482 with 2. It applies to chunks by rows and on
    # the lead stream too, where it was not measured
    threshold_update: str = "side"  # prefetch: where the EMA of the k-th best score is folded in: "side" (on the
    # side stream beside attention, after the layer's settle: it only has to follow the layer's candidate reads, which
    # are on that stream) or "main" (one launch on the main stream at the layer's end; with the resolve's PDL, 5-7 us a
    # layer slower at batch 64-128 / 32K, benchmarks/RESULTS.md)
    dba_split: float | Sequence[float] = 0.75  # chunk A's fraction of the batch (measured best), or every chunk's
    dba_attention: str = "whole"  # "whole": one attention over the batch (exact); "split": per half (hides more)
    overlap_programs: int = 32  # persistent programs of a copy that overlaps compute (the rest of the SMs compute)
    overlap_copy_rows: int = 8  # rows each of those programs has in flight at a time (a power of two up to 64); on
    # the H200, 8 programs x 16 rows were no faster than 16 x 8, and 4 x 32 much slower (benchmarks/RESULTS.md)
    last_chunk_programs: int | None = None  # prefetch in chunks: the last chunk's copy (beside the top-k) with this
    # many programs instead of overlap_programs (None: the same; 8 measured much slower than 16, benchmarks/RESULTS.md)
    last_chunk_margin: float | None = None  # prefetch in chunks: the last chunk's threshold margin instead of the
    # layer's (None: the layer's), e.g. 0: fewer wasted copies beside the top-k, more misses left to the exact resolve
    last_chunk_prefetch: bool = True  # prefetch in chunks: False runs the last chunk's indexer only (its own launch,
    # under which the previous chunk's copy hides) and leaves its misses to the layer's exact resolve and copy, which
    # move only what the top-k selected: no candidate, claim or copy kernels beside the top-k (the other last-chunk
    # settings then have nothing to act on: refused with it); a layer of one chunk prefetches either way
    last_chunk_priority: str = "high"  # prefetch in chunks: the last chunk's candidate, claim and copy launches on the
    # high-priority side stream ("high"), or on a stream at the main stream's priority, joined into the side stream
    # ("normal": its wide candidate kernel then shares the SMs with the top-k's first kernels, not taking them all;
    # measured -8 us a layer at 128K / 64, +9.5 at 32K / 128, no change at 32K / 64: benchmarks/RESULTS.md)
    refill_priority: str = "high"  # spare slots: the refill's launches (beside attention and the next layer's first
    # kernels) on the high-priority side stream ("high"), or on a stream at the main stream's priority joined into
    # the side stream ("normal": its scans' thousands of programs then share the SMs with the main stream's kernels
    # instead of taking every free one first; measured no faster: 1,394.4 / 1,411.5 us a layer against 1,380.7 /
    # 1,406.2 at 128K / 64, within the repeats at 32K / 64: H200, 2026-11-30, not kept: docs/design.md)
    prefetch_claim: str = "one_launch"  # prefetch with spare slots on the fused path: "one_launch" (each chunk's
    # candidates found and their spare slots claimed in one kernel, then a one-program close,
    # `HotPoolCacheManager.prefetch_above`) or
    # "separate" (the candidate kernels, then the spare-only claim: six launches); the same state under the
    # interpreter, on a GPU the same entries wherever no cap binds
    sync_copy: str = "inline"  # sync mode: "inline" (in the resolve's own kernels: measured faster) or "counted"
    # The harness writes each token on the side stream before its selection exists, so its "insert" is a resolve of
    # its own there; "on_demand" (only written back, fetched like any miss when selected) measured faster here: 1.243
    # against 1.261 x all-HBM at batch 64 / 32K, 1.122 against 1.127 at 128 / 128K (benchmarks/RESULTS.md). The
    # plugin's resolve inserts the token in its own launches (EssConfig.new_tokens, default "insert")
    new_tokens: str = "on_demand"
    attention: str = "auto"  # "flashmla", "reference", or "auto" (FlashMLA on CUDA)
    indexer: str = "auto"  # "triton", "torch", or "auto"
    topk: str | TopK = "auto"  # "triton" (Triton radix select), "torch" (torch.topk), "auto" (torch: faster so far),
    # or a callable (scores [B, Q, T], k, seq_lens [B]) -> (positions [B, Q, k] int32, k-th best score [B, Q]), e.g.
    # SGLang's own decode top-k (docs/design.md); both stacks of a comparison must use the same one

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad:
            raise ValueError(f"overlap mode 'da': {DA_REMOVED}; use {', '.join(MODES)}" if bad[0] == "da" else
                             f"overlap modes must be one of {MODES}, got {bad[0]!r}")
        fr = (self.dba_split, 1 - self.dba_split) if isinstance(self.dba_split, (int, float)) else \
            tuple(float(f) for f in self.dba_split)
        if len(fr) < 2 or any(not 0 < f < 1 for f in fr) or abs(sum(fr) - 1) > 1e-6:
            raise ValueError(f"dba_split must be a fraction in (0, 1) or >= 2 fractions in (0, 1) summing to 1, "
                             f"got {self.dba_split}")
        self.dba_fractions = fr
        if self.dba_attention not in ("whole", "split"):
            raise ValueError(f"dba_attention must be 'whole' or 'split', got {self.dba_attention!r}")
        new_token_mode(self.new_tokens)
        if self.sync_copy not in ("counted", "inline"):
            raise ValueError(f"sync_copy must be 'counted' or 'inline', got {self.sync_copy!r}")
        if not callable(self.topk) and self.topk not in ("auto", "triton", "torch"):
            raise ValueError(f"topk must be 'auto', 'triton', 'torch' or a callable, got {self.topk!r}")
        self.prefetch_fractions = _fractions("prefetch_chunks", self.prefetch_chunks)
        if self.prefetch_layers is None:
            if self.chunk_plans:
                raise ValueError("chunk_plans give prefetch_layers' N-chunk layers their fractions: give "
                                 "prefetch_layers, or prefetch_chunks for every layer")
            per_layer = [self.prefetch_fractions if self.prefetch else None] * len(self.modes)
        else:
            chunks = list(self.prefetch_layers)
            if self.prefetch:
                raise ValueError("prefetch (every layer) and prefetch_layers (per layer) are exclusive: give one")
            if len(chunks) != len(self.modes):
                raise ValueError(f"prefetch_layers: {len(chunks)} values for {len(self.modes)} layers")
            bad_chunks = [c for c in chunks if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 0]
            if bad_chunks:
                raise ValueError(f"prefetch_layers: each layer's value must be 0 (no prefetch) or a chunk count >= 1, "
                                 f"got {bad_chunks[0]!r}")
            plans = {}
            for n, fr in (self.chunk_plans or {}).items():
                plans[n] = _fractions("chunk_plans", tuple(fr))
                if isinstance(n, bool) or not isinstance(n, numbers.Integral) or len(plans[n]) != n:
                    raise ValueError(f"chunk_plans: {n!r} chunks need {n!r} fractions, got {tuple(fr)!r}")
            per_layer = [plans.get(int(c)) or _fractions("prefetch_layers", int(c)) if c else None for c in chunks]
        self.layer_prefetch_fractions: tuple[tuple[float, ...] | None, ...] = tuple(per_layer)
        """Per layer: its prefetch's chunk fractions of the batch, or None where the layer does not prefetch."""
        self.any_prefetch = any(f is not None for f in per_layer)
        if self.prefetch_split not in ("rows", "positions"):
            raise ValueError(f"prefetch_split must be 'rows' or 'positions', got {self.prefetch_split!r}")
        if self.prefetch_indexer not in PREFETCH_INDEXER_LAUNCHES:
            raise ValueError(f"prefetch_indexer must be one of {', '.join(PREFETCH_INDEXER_LAUNCHES)}, got "
                             f"{self.prefetch_indexer!r}")
        from ess_sglang.kernels.indexer import check_tiles

        check_tiles(self.chunk_indexer_tiles, "chunk_indexer_tiles")
        if self.threshold_update not in ("main", "side"):
            raise ValueError(f"threshold_update must be 'main' or 'side', got {self.threshold_update!r}")
        if self.overlap_programs < 1:
            raise ValueError(f"overlap_programs must be >= 1, got {self.overlap_programs}")
        r = self.overlap_copy_rows
        if isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 1 <= r <= 64 or r & (r - 1):
            raise ValueError(f"overlap_copy_rows must be a power of two from 1 to 64, got {r!r}")
        if self.last_chunk_programs is not None and self.last_chunk_programs < 1:
            raise ValueError(f"last_chunk_programs must be >= 1 or None, got {self.last_chunk_programs}")
        if self.last_chunk_margin is not None and not is_margin(self.last_chunk_margin):
            raise ValueError(f"last_chunk_margin must be in [0, 1) or None, got {self.last_chunk_margin!r}")
        if not isinstance(self.last_chunk_prefetch, bool):
            raise ValueError(f"last_chunk_prefetch must be True or False, got {self.last_chunk_prefetch!r}")
        if not self.last_chunk_prefetch:
            idle = [n for n, on in (("last_chunk_programs", self.last_chunk_programs is not None),
                                    ("last_chunk_margin", self.last_chunk_margin is not None),
                                    ("last_chunk_priority", self.last_chunk_priority != "high")) if on]
            if idle:
                raise ValueError(f"{idle[0]} sets the last chunk's prefetch, which last_chunk_prefetch=False drops")
        if self.refill_priority not in ("high", "normal"):
            raise ValueError(f"refill_priority must be 'high' or 'normal', got {self.refill_priority!r}")
        if self.last_chunk_priority not in ("high", "normal"):
            raise ValueError(f"last_chunk_priority must be 'high' or 'normal', got {self.last_chunk_priority!r}")
        if self.prefetch_claim not in ("one_launch", "separate"):
            raise ValueError(f"prefetch_claim must be 'one_launch' or 'separate', got {self.prefetch_claim!r}")


def _fractions(name: str, chunks: int | Sequence[float]) -> tuple[float, ...]:
    """Chunk fractions of the batch: n equal ones for an integer n >= 1, or the given fractions (each in (0, 1],
    summing to 1)."""
    bad = ValueError(f"{name} must be an integer >= 1 or fractions of the batch in (0, 1] summing to 1, got {chunks!r}")
    if isinstance(chunks, numbers.Integral) and not isinstance(chunks, bool):
        if chunks < 1:
            raise bad
        return (1 / int(chunks),) * int(chunks)
    if not isinstance(chunks, Sequence) or isinstance(chunks, str) or \
            not all(isinstance(f, numbers.Real) and not isinstance(f, bool) for f in chunks):
        raise bad
    fr = tuple(float(f) for f in chunks)
    if not fr or any(not 0 < f <= 1 for f in fr) or abs(sum(fr) - 1) > 1e-6:
        raise bad
    return fr


# ------------------------------------------------------------------------------------------------ shared pieces
def attend(kind: str, q: torch.Tensor, entries: torch.Tensor, table: torch.Tensor, scale: float,
           schedules: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over `entries` rows named by `table` [B, Q, K] (-1 padding).

    `schedules`: FlashMLA split-KV schedules by table shape, computed by the first call of a step and reused by the
    other layers (as SGLang does once per forward batch); None computes one per call.
    Returns (out [B, Q, H, 512], lse [B, Q, H] natural log, -inf for a row with no entry).
    """
    if kind == "flashmla":
        meta = None
        if schedules is not None:
            from flash_mla import get_mla_metadata

            key = (tuple(table.shape), q.shape[2])
            if key not in schedules:
                schedules[key] = get_mla_metadata()[0]
            meta = schedules[key]
        out, lse = sparse_mla_flashmla(q, entries, table, scale, metadata=meta)
        lse = lse.transpose(1, 2)  # FlashMLA: [B, H, Q]; +inf where a row has no entry
        empty = (table < 0).all(dim=-1).unsqueeze(-1)
        return out, torch.where(empty, float("-inf"), lse)
    return sparse_mla_reference(q, entries, table, scale)


def topk_with_scores(scores: torch.Tensor, k: int, impl: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k positions [B, Q, k] int32 (-1 where fewer than k are visible) and the k-th best score [B, Q].

    impl "triton": `ess_sglang.kernels.topk.topk_triton` (its default "tiles" variant; ties broken by position,
    positions in its own order); "torch": torch.topk. Both stacks of a comparison must use the same one.
    """
    if impl == "triton":
        from ess_sglang.kernels.topk import topk_triton
        return topk_triton(scores.float().contiguous(), k)
    return reference_topk(scores, k)


def selection_kth_scores(logits: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The k-th best score [B, Q] of a top-k that gave positions [B, Q, k] only, from its logits [B, Q, T]
    (`ess_sglang.kernels.topk.kth_of_selection_any`: one Triton launch on CUDA)."""
    from ess_sglang.kernels.topk import kth_of_selection_any

    B, Q, T = logits.shape
    return kth_of_selection_any(logits.reshape(B * Q, T), pos.reshape(B * Q, pos.shape[-1])).view(B, Q)


def _indexer(kind: str):
    from ess_sglang.kernels.indexer import indexer_logits

    def run(q_index, w_index, cache, batch: DecodeBatch, max_len: int, out: torch.Tensor | None = None,
            first_pos: int = 0, chain: str = "off", tiles: int | None = None) -> torch.Tensor:
        return indexer_logits(q_index, w_index, cache, batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                              max_len, impl=kind, out=out, first_pos=first_pos, chain=chain, tiles=tiles)
    return run


def _slice(batch: DecodeBatch, x: LayerInputs, lo: int, hi: int) -> tuple[DecodeBatch, LayerInputs]:
    b = DecodeBatch(batch.req_to_token, batch.req_pool_indices[lo:hi], batch.seq_lens[lo:hi], batch.new_locs[lo:hi])
    return b, LayerInputs(x.q_index[lo:hi], x.w_index[lo:hi], x.q[lo:hi], x.new_latent[lo:hi],
                          x.new_index_key[lo:hi])


ScoreHook = Callable[[int, torch.Tensor, DecodeBatch], torch.Tensor]


class _StackBase:
    def __init__(self, num_layers: int, index_cache: torch.Tensor, max_len: int, options: StackOptions,
                 score_hook: ScoreHook | None):
        if len(options.modes) != num_layers:
            raise ValueError(f"{len(options.modes)} overlap modes for {num_layers} layers")
        self.num_layers = num_layers
        self.index_cache = index_cache  # [layers, locations, 132] uint8, every token of every layer
        self.max_len = max_len  # positions the indexer scores (the request table's width)
        self.options = options
        dev = index_cache.device
        self.attention = options.attention if options.attention != "auto" else (
            "flashmla" if dev.type == "cuda" else "reference")
        self.run_indexer = _indexer(options.indexer)
        # torch.topk is faster than both Triton top-k variants on the H200 from 64 rows (benchmarks/RESULTS.md)
        self.topk_impl = "torch" if isinstance(options.topk, str) and options.topk == "auto" else options.topk
        self.score_hook = score_hook  # benchmarks: scores that replace the logits for the selection
        self.softmax_scale = QK_HEAD_DIM ** -0.5
        self.schedules: dict = {}  # FlashMLA schedules of the current step, by table shape

    def _attend(self, q: torch.Tensor, entries: torch.Tensor, table: torch.Tensor):
        return attend(self.attention, q, entries, table, self.softmax_scale, self.schedules)

    def _scores(self, layer: int, x: LayerInputs, batch: DecodeBatch, out: torch.Tensor | None = None,
                first_pos: int = 0, end_pos: int | None = None, chain: str = "off",
                tiles: int | None = None) -> torch.Tensor:
        """Indexer logits [B, Q, max_len] (or, when a score hook is set, the scores it puts in their place), written
        to `out` when given; of the positions [first_pos, end_pos) only where those are given (no score hook).
        `chain`: the indexer kernel's launch in a series of position segments (`indexer_logits_triton`); `tiles`: its
        tiles a program (None: the kernel's default)."""
        end = self.max_len if end_pos is None else end_pos
        logits = self.run_indexer(x.q_index, x.w_index, self.index_cache[layer], batch, end, out, first_pos, chain,
                                  tiles)
        if (first_pos, end) != (0, self.max_len):
            if self.score_hook is not None:
                raise ValueError("a score hook replaces the whole logits: it cannot score a segment of the positions")
            return logits
        if self.score_hook is None:
            return logits
        scores = self.score_hook(layer, logits, batch)
        if out is None:
            return scores
        if scores.shape != out.shape:
            raise ValueError(f"score hook: returned scores of shape {tuple(scores.shape)} for logits of shape "
                             f"{tuple(out.shape)}")
        return out.copy_(scores)

    def _select(self, layer: int, x: LayerInputs, batch: DecodeBatch) -> torch.Tensor:
        """The top-k positions of the layer's scores."""
        return self._topk(self._scores(layer, x, batch), batch)[0]

    def _begin_step(self, batch: DecodeBatch, chunks: Sequence[tuple[int, int]] = ()) -> None:
        """Tell a caller's top-k that a step starts (its per-step preparation, if it has one), and the batch chunks
        (rows lo:hi) it will also select for."""
        begin = getattr(self.topk_impl, "begin_step", None)
        if begin is None:
            return
        begin(batch.seq_lens, self.max_len)
        prepare = getattr(self.topk_impl, "prepare", None)
        for lo, hi in chunks if prepare is not None else ():
            prepare(batch.seq_lens[lo:hi], self.max_len)

    def _topk(self, scores: torch.Tensor, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(Top-k positions [B, Q, k], k-th best score [B, Q]) of scores [B, Q, T], with the stack's top-k."""
        if callable(self.topk_impl):
            return self.topk_impl(scores, self.options.top_k, batch.seq_lens)
        return topk_with_scores(scores, self.options.top_k, self.topk_impl)


class HbmDecodeStack(_StackBase):
    """The reference: every latent entry of every layer in device memory at its KV location."""

    def __init__(self, latents: torch.Tensor, index_cache: torch.Tensor, max_len: int, options: StackOptions,
                 score_hook: ScoreHook | None = None, split_attention: bool = False):
        super().__init__(latents.shape[0], index_cache, max_len, options, score_hook)
        if latents.shape[1] % 64:
            raise ValueError("the latent store must hold a multiple of 64 rows (FlashMLA pages)")
        self.latents = latents  # [layers, rows, 656] uint8
        self.num_locations = latents.shape[1]
        self.split_attention = split_attention

    def _translate(self, pos: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        if pos.is_cuda:
            from ess_sglang.kernels.translate import translate_positions_triton
            return translate_positions_triton(pos, batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                              self.num_locations)
        locs, _ = positions_to_locations(pos, batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                         self.num_locations)
        return locs.to(torch.int32)

    def forward_layer(self, layer: int, batch: DecodeBatch, x: LayerInputs) -> torch.Tensor:
        at = batch.new_locs.long()
        self.index_cache[layer, at] = x.new_index_key
        self.latents[layer, at] = x.new_latent
        pos = self._select(layer, x, batch)
        table = self._translate(pos, batch)
        if self.split_attention and self.options.modes[layer] == "dba":
            outs = [self._attend(x.q[lo:hi], self.latents[layer], table[lo:hi].contiguous())[0]
                    for lo, hi in chunk_bounds(pos.shape[0], self.options.dba_fractions)]
            return torch.cat(outs)
        return self._attend(x.q, self.latents[layer], table)[0]

    def step(self, batch: DecodeBatch, inputs: Sequence[LayerInputs]) -> list[torch.Tensor]:
        self.schedules = {}
        self._begin_step(batch)
        return [self.forward_layer(layer, batch, inputs[layer]) for layer in range(self.num_layers)]


def _ranges(ends: Sequence[int]) -> list[tuple[int, int]]:
    """[lo, hi) ranges from 0 to each end in turn; empty ones dropped."""
    bounds, lo = [], 0
    for hi in ends:
        if hi > lo:
            bounds.append((lo, hi))
            lo = hi
    return bounds


def _cumulative(fractions: Sequence[float]) -> list[float]:
    """The running sums of every fraction but the last (the boundaries between chunks, as fractions of the whole)."""
    out, acc = [], 0.0
    for f in fractions[:-1]:
        acc += f
        out.append(acc)
    return out


def segment_bounds(T: int, fractions: Sequence[float], align: int = 64) -> list[tuple[int, int]]:
    """[lo, hi) position ranges of the prefetch's segments: cumulative fractions of T rounded to multiples of
    `align` (64: the indexer's tile when the calibrations were measured; the kernel takes any boundary); empty
    segments dropped."""
    return _ranges([min(T, round(T * c / align) * align) for c in _cumulative(fractions)] + [T])


def chunk_bounds(B: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of DBA's chunks: cumulative fractions of B, rounded; empty chunks dropped."""
    return _ranges([min(B, max(1, round(B * c))) for c in _cumulative(fractions)] + [B])


class EssDecodeStack(_StackBase):
    """ESS: latents in the host total pool, hot pools on the device, one of the modes above per layer."""

    def __init__(self, manager: HotPoolCacheManager, index_cache: torch.Tensor, max_len: int, options: StackOptions,
                 max_batch: int, prefetcher: EchoPrefetcher | None = None, score_hook: ScoreHook | None = None):
        super().__init__(manager.num_layers, index_cache, max_len, options, score_hook)
        if options.any_prefetch and prefetcher is None:
            raise ValueError("options.prefetch / prefetch_layers need an EchoPrefetcher")
        if manager.slots_per_layer % 64:
            raise ValueError("hot pools must hold a multiple of 64 slots (FlashMLA pages)")
        if options.prefetch_split == "positions" and score_hook is not None:
            raise ValueError("prefetch_split='positions' scores segments of the positions: a score hook (which "
                             "replaces the whole logits) needs prefetch_split='rows'")
        self.m = manager
        self.prefetcher = prefetcher if options.any_prefetch else None
        self._pending_thresholds: list = []
        self.streams = SideStream(manager.device)
        q_rows = max_batch * 2  # up to 2 query tokens per request (MTP)
        self.fetch_list = manager.new_fetch_list(q_rows * options.top_k)  # a deferred resolve's copies (DBA, counted)
        if self.prefetcher is not None:
            most_chunks = max(len(f) for f in options.layer_prefetch_fractions if f is not None)
            # by rows, the chunks' lists are the slices of their rows; by positions, each segment has a whole one
            lists = most_chunks if options.prefetch_split == "positions" else 1
            self.prefetch_list = manager.new_fetch_list(lists * max_batch * self.prefetcher.width)
            self._prefetch_counts = torch.zeros(most_chunks, dtype=torch.int64, device=manager.device)
            # prefetch_claim "one_launch": each chunk's claim kernel its own counters (a layer's claims run in one
            # order today, the normal-priority last chunk's too, which waits for the side stream; with counters of
            # their own that need not stay so)
            from ess_sglang.kernels.prefetch import new_claim_counters

            self._claim_counters = [new_claim_counters(max_batch, manager.device) for _ in range(most_chunks)]
        manager.reserve_scratch(max(q_rows * options.top_k, max_batch * self.prefetcher.width if self.prefetcher
                                    else 0))
        self._side_inputs: list[torch.Tensor] = []  # tensors the side stream reads: alive until the layer joins it
        # prefetch_indexer "overlapped": the stream of the indexer chunks before the last (high priority: their blocks
        # are dispatched before the last chunk's, which fill their tail)
        chunked = any(f is not None and len(f) > 1 for f in options.layer_prefetch_fractions)
        self._lead = torch.cuda.Stream(manager.device, priority=-1) if self.streams.cuda and chunked and \
            options.prefetch_indexer == "overlapped" else None
        # prefetch_indexer "chained": the segments' launches chain with PDL where the Triton indexer runs on sm_90+
        # (and no score hook replaces the logits); serial elsewhere
        from ess_sglang.kernels.resolve import pdl_supported

        self._chain = chunked and options.prefetch_indexer == "chained" and score_hook is None and \
            options.indexer in ("auto", "triton") and pdl_supported(manager.device)
        self._before_refill = None  # the side stream's mark before this layer's refill, if one was queued

    def step(self, batch: DecodeBatch, inputs: Sequence[LayerInputs], all_resident: bool = False) -> list[torch.Tensor]:
        """One decode step of every layer. `all_resident`: the caller knows every live token of the batch is in
        every layer's hot pool (all of them fit and were loaded), so each layer only looks its selection up."""
        self.m.begin_step()
        self.schedules = {}
        dba = "dba" in self.options.modes and not all_resident  # (DBA selects chunk by chunk)
        self._begin_step(batch, chunk_bounds(batch.seq_lens.shape[0], self.options.dba_fractions) if dba else ())
        out = [self.forward_layer(layer, batch, inputs[layer], all_resident) for layer in range(self.num_layers)]
        self.streams.wait()  # the last refills (the next step's clock must not move under them)
        return out

    def forward_layer(self, layer: int, batch: DecodeBatch, x: LayerInputs, all_resident: bool = False) -> torch.Tensor:
        m, st = self.m, self.streams
        # 1. this step's token: indexer key on the device; latent to host (D2H; with new_tokens="insert" also into
        # a hot slot), on the side stream
        self.index_cache[layer, batch.new_locs.long()] = x.new_index_key
        with st.on_side():
            m.write_new_tokens(layer, batch.new_locs, x.new_latent, reserved=all_resident,
                               insert=self.options.new_tokens == "insert")
        if all_resident:  # small batches whose every token fits: a lookup instead of a resolve, no traffic but D2H
            pos = self._select(layer, x, batch)
            st.wait()
            slots = m.lookup_resident(layer, pos, batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
            out = self._attend(x.q, m.layer_entries(layer), slots)[0]
        elif self.options.modes[layer] == "dba":
            out = self._dual_batch(layer, batch, x)
        else:
            # 2-4. indexer, [prefetch on the side stream], top-k
            pos = self._select_and_prefetch(layer, x, batch)
            st.wait()  # the new token is in its slot, prefetches have landed: the exact resolve may start
            # 5. resolve + fetch + attention (sync)
            slots = self._resolve_and_fetch(layer, batch, pos)
            self._refill_beside(layer)  # 6.
            out = self._attend(x.q, m.layer_entries(layer), slots)[0]
        st.wait(self._before_refill)  # 7. (everything, where no refill was queued)
        self._before_refill = None
        self._side_inputs.clear()  # the side stream is done with them: the allocator may reuse their memory now
        self._fold_thresholds(layer)  # (nothing left pending where "side" folded them beside attention)
        return out

    # -------------------------------------------------------------------------------------------- pieces
    def _resolve_and_fetch(self, layer: int, batch: DecodeBatch, pos: torch.Tensor,
                           programs: int | None = None) -> torch.Tensor:
        """Resolve, then copy the misses (with the whole GPU unless `programs` says fewer); returns the slots."""
        if self.options.sync_copy == "inline" and programs is None:
            slots = self.m.resolve(layer, pos, batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
        else:
            slots = self.m.resolve(layer, pos, batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                   fetch_list=self.fetch_list)
            self.m.fetch(layer, self.fetch_list, programs, None if programs is None else self.options.overlap_copy_rows)
        self._settle_beside(layer)
        return slots

    def _settle_beside(self, layer: int) -> None:
        """Count this layer's prefetches useful or wasted on the side stream, beside attention (it reads the maps the
        exact resolve just left; nothing changes them before the layer joins the side stream). In DBA, where each
        chunk's resolve already runs on the side stream, it follows that chunk's copy there."""
        if self.options.layer_prefetch_fractions[layer] is not None:  # (then the stack has a prefetcher)
            with self.streams.on_side():
                self.m.settle_prefetch(layer)
                if self.options.threshold_update == "side":
                    self._side_inputs.extend(t for pending in self._pending_thresholds for t in pending
                                             if t is not None)
                    self._fold_thresholds(layer)

    def _fold_thresholds(self, layer: int) -> None:
        """ECHO: fold the k-th best scores of the layer's top-k(s) so far into its thresholds (on the current
        stream). The layer's candidate reads must come before: the main stream's layer end, or, with
        threshold_update "side", the side stream after the settle, which follows every candidate kernel queued there
        (in DBA, a chunk's settle folds that chunk's rows, which the later chunks' candidates do not read). Where the
        top-k gave no k-th score, it is found here, on the same stream: the lowest selected logit of each row."""
        for kth, rows, logits, pos in self._pending_thresholds:
            if kth is None:
                kth = selection_kth_scores(logits, pos)
            self.prefetcher.update(layer, kth, rows)
        self._pending_thresholds.clear()

    def _refill_beside(self, layer: int) -> None:
        """Queue the refill of the layer's spare slots last on the side stream (beside attention), and remember what
        the layer's end waits for: the side stream up to the refill. The next user of the side stream (the next
        layer) queues behind it, and every main-stream wait of the next layer covers it."""
        if self.m.num_spare:
            self._before_refill = self.streams.mark()
            with self.streams.on_normal() if self.options.refill_priority == "normal" else self.streams.on_side():
                self.m.refill_spares(layer)

    def _select_and_prefetch(self, layer: int, x: LayerInputs, batch: DecodeBatch) -> torch.Tensor:
        """Steps 2-4: indexer logits; prefetch above the threshold on the side stream; top-k on the main stream.

        With `prefetch_chunks` > 1 the indexer runs chunk by chunk (batch rows, or with `prefetch_split="positions"`
        segments of the positions) into one logits tensor, and each chunk's prefetch (into its own slice of the
        prefetch list) starts as soon as the chunk's logits exist (but the last chunk's, with
        `last_chunk_prefetch=False`: its misses are the exact resolve's). With
        `prefetch_indexer="chained"` (sm_90+, the Triton indexer) the chunks' launches after the first are chained to
        the one before by programmatic dependent launch (`indexer_logits_triton(chain=...)`). With
        `prefetch_indexer="overlapped"` (on CUDA) the chunks before the last run on the lead stream, forked from the
        main stream here (so every write their prefetch reads comes before), and each one's prefetch waits for its
        event; the main stream joins the lead stream before the top-k."""
        fractions = self.options.layer_prefetch_fractions[layer]
        if fractions is None:  # a layer that prefetches implies a prefetcher (checked in __init__)
            return self._select(layer, x, batch)
        B = batch.seq_lens.shape[0]
        logits = torch.empty((B, x.q_index.shape[1], self.max_len), dtype=torch.float32, device=x.q_index.device)
        self._side_inputs.append(logits)
        by_rows = self.options.prefetch_split == "rows"
        bounds = chunk_bounds(B, fractions) if by_rows else segment_bounds(self.max_len, fractions)
        lead = self._lead if len(bounds) > 1 else None
        if lead is not None:  # "overlapped": the chunks before the last start from here, on the lead stream
            lead.wait_stream(torch.cuda.current_stream())
        for i, (lo, hi) in enumerate(bounds):
            # a chunk: rows lo:hi over every position, or every row over positions lo:hi
            b, xi = _slice(batch, x, lo, hi) if by_rows else (batch, x)
            out, first, end = (logits[lo:hi], 0, None) if by_rows else (logits[..., lo:hi], lo, hi)
            tiles = self.options.chunk_indexer_tiles if i else None  # a launch beside an earlier chunk's prefetch
            if lead is not None and i < len(bounds) - 1:
                with torch.cuda.stream(lead):
                    chunk_logits = self._scores(layer, xi, b, out=out, first_pos=first, end_pos=end, tiles=tiles)
                done = torch.cuda.Event()
                done.record(lead)
            else:
                chain = "off" if not self._chain or len(bounds) == 1 else "head" if i == 0 else "link"
                chunk_logits = self._scores(layer, xi, b, out=out, first_pos=first, end_pos=end, chain=chain,
                                            tiles=tiles)
                done = None
            last = i == len(bounds) - 1 and len(bounds) > 1  # the chunk whose prefetch runs beside the top-k
            if last and not self.options.last_chunk_prefetch:
                break  # its misses are the exact resolve's
            # its slice of the prefetch list: its rows' part, or (by positions) a whole list of its own
            at = (lo, hi) if by_rows else (i * B, (i + 1) * B)
            self._prefetch_chunk(layer, i, *at, b, chunk_logits, done, last, first_pos=first)
        if lead is not None:
            torch.cuda.current_stream().wait_stream(lead)  # the top-k reads every chunk's logits
        pos, kth = self._topk(logits, batch)
        # the threshold moves only once the side stream has read it (at the end of the layer); a top-k that gives no
        # k-th score (SGLang's) leaves it to be found from the logits and positions where it is folded in
        self._pending_thresholds.append((kth, batch.req_pool_indices, logits, pos))
        return pos

    def _prefetch_chunk(self, layer: int, i: int, lo: int, hi: int, b: DecodeBatch, chunk_logits: torch.Tensor,
                        after, last: bool, first_pos: int = 0) -> None:
        """Queue chunk i's candidates (of the logits `chunk_logits` of batch `b`, positions from `first_pos`) and
        their prefetch, into rows lo:hi of the prefetch list (as many rows as `b` has),
        beside the main stream: after the event `after` (None: after everything queued on the main stream so far).
        `last`: the chunk beside the top-k (its own copy programs, margin and priority; its logits are on the main
        stream, so `after` is None for it, which `on_normal` follows)."""
        opts, pf, W, pl = self.options, self.prefetcher, self.prefetcher.width, self.prefetch_list
        beside_topk = last and opts.last_chunk_priority == "normal"
        if beside_topk and after is not None:
            raise ValueError("the last chunk's prefetch at normal priority follows the main stream, not an event")
        record = FetchList(pl.src[lo * W:hi * W], pl.dst[lo * W:hi * W], self._prefetch_counts[i:i + 1])
        programs = opts.last_chunk_programs if last and opts.last_chunk_programs is not None else opts.overlap_programs
        margin = opts.last_chunk_margin if last else None
        with self.streams.on_normal() if beside_topk else self.streams.on_side(after=after):
            if opts.prefetch_claim == "one_launch":
                scored = pf.scored(layer, chunk_logits, b.req_to_token, b.req_pool_indices, b.seq_lens, margin=margin,
                                   first_pos=first_pos)
                self.m.prefetch_above(layer, scored, record, self._claim_counters[i], programs=programs,
                                      chained=pf.pdl, rows_per_program=opts.overlap_copy_rows)
                return
            cand = pf.candidates(layer, chunk_logits, b.req_to_token, b.req_pool_indices, b.seq_lens,
                                 self.m.loc_to_slot[layer], self.m.num_locations, margin=margin, first_pos=first_pos)
            self.m.prefetch(layer, cand, record, programs=programs, chained=pf.pdl,
                            rows_per_program=opts.overlap_copy_rows)

    def _dual_batch(self, layer: int, batch: DecodeBatch, x: LayerInputs) -> torch.Tensor:
        m, st = self.m, self.streams
        B = batch.seq_lens.shape[0]
        halves = [_slice(batch, x, lo, hi) for lo, hi in chunk_bounds(B, self.options.dba_fractions)]
        marks, slot_tables = [], []
        for b, xi in halves:
            pos = self._select_and_prefetch(layer, xi, b)  # main stream (chunk i+1's overlaps chunk i's fetch)
            self._side_inputs.append(pos)
            with st.on_side():  # every chunk's resolve + copy run here, in order, sharing one fetch list
                slot_tables.append(self._resolve_and_fetch(layer, b, pos, self.options.overlap_programs))
            marks.append(st.mark())
        if self.options.dba_attention == "whole":
            st.wait()
            self._refill_beside(layer)  # 6.
            return self._attend(x.q, m.layer_entries(layer), torch.cat(slot_tables))[0]
        self._refill_beside(layer)  # 6. (after the last half's copy; the halves wait for their own marks)
        outs = []
        for (_, xi), mark, slots in zip(halves, marks, slot_tables, strict=True):
            st.wait(mark)  # this half's entries are resident (half B's copy overlaps half A's attention)
            outs.append(self._attend(xi.q, m.layer_entries(layer), slots)[0])
        return torch.cat(outs)


__all__ = ["MODES", "TopK", "DecodeBatch", "LayerInputs", "StackOptions", "HbmDecodeStack", "EssDecodeStack",
           "chunk_bounds", "segment_bounds", "attend", "topk_with_scores", "selection_kth_scores",
           "latent_store_rows"]
