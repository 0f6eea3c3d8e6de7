"""Top-k traces: which positions every layer of every request selected at every decode step, and their replay.

A trace is what a DSA model's indexer hands the cache manager, recorded once and replayed through several cache
policies so that they see identical work (`benchmarks/vs_hisparse.py` replays one through ESS's shared per-layer LRU
pool and through an emulation of SGLang HiSparse's per-request buffers).

Format (`TopKTrace`, saved with `save` as a compressed ``.npz``, read back with `TopKTrace.load`):

    topk         int32 [steps, layers, batch, k]   positions within each request, best first; -1 pads a row that
                                                   has fewer than k visible positions
    seq_lens     int32 [steps, batch]              tokens of each request at that step, counting the token decoded
                                                   in it (whose position is seq_len - 1); grows by exactly one a step
    warmup_topk  int32 [layers, batch, windows, k] optional: the top-k of the prefill's last `windows` query tokens
                                                   (window w is the query at position prompt_len - windows + w), the
                                                   input of ESS's LRU warm-up; absent when windows == 0
    meta         dict (stored as JSON)             where the trace came from and with which settings

One query token per request and step (no MTP). `validate` checks shapes, dtypes, ranges (every position in
[0, seq_len) of its own request, warm-up positions in [0, prompt_len)), distinct positions within a row and the
one-token growth, and names the offending field (``trace.topk: ...``). On disk, positions are stored as int16 when
every sequence is shorter than 32,767 tokens, and widened to int32 on load. `save(path, compact=True)` sorts every
row and stores the gaps between neighbouring positions (``encoding = "sorted_delta"``; about half the size once
compressed): the sets are kept, their best-first order is not (neither policy's hit count depends on it, except
HiSparse's order of filling slots within one step); `meta["rows_sorted"]` records it.

Sources:
- `synthetic_trace(SyntheticTraceConfig(...))`: a generator with documented knobs (step-to-step overlap per layer,
  recency bias, attention-sink tokens, bursts of new topics, clustered picks, requests of different lengths),
  deterministic for a seed;
- `record_demo_trace(...)`: the embedded demo DSA model's own indexer (`ess_sglang.reference.model`);
- `benchmarks/record_real_traces.py`: a real small causal LM (SmolLM2-135M) over real text.

`replay_ess` replays a trace through `HotPoolCacheManager` (plain-torch path, CPU is fine) and returns per-layer
counts (`ReplayStats`); `ess_sglang.hisparse_policy.replay_hisparse` does the same for HiSparse's policy.

This module imports numpy and pydantic only; torch is imported inside the functions that need it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ess_sglang.entry_sizes import LATENT_ENTRY_BYTES

FORMAT_VERSION = 1


class TraceError(ValueError):
    """An invalid trace; the message starts with the offending field (``trace.topk: ...``)."""


# ------------------------------------------------------------------------------------------------------ format

@dataclass
class TopKTrace:
    topk: np.ndarray
    seq_lens: np.ndarray
    warmup_topk: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.topk = np.asarray(self.topk)
        self.seq_lens = np.asarray(self.seq_lens)
        if self.warmup_topk is not None:
            self.warmup_topk = np.asarray(self.warmup_topk)
            if self.warmup_topk.ndim == 4 and self.warmup_topk.shape[2] == 0:
                self.warmup_topk = None

    # ---------------------------------------------------------------- shape
    @property
    def steps(self) -> int:
        return int(self.topk.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.topk.shape[1])

    @property
    def batch(self) -> int:
        return int(self.topk.shape[2])

    @property
    def top_k(self) -> int:
        return int(self.topk.shape[3])

    @property
    def prompt_lens(self) -> np.ndarray:
        """Tokens of each request before its first decode step."""
        return (self.seq_lens[0].astype(np.int64) - 1)

    @property
    def warmup_windows(self) -> int:
        return 0 if self.warmup_topk is None else int(self.warmup_topk.shape[2])

    def lookups(self) -> np.ndarray:
        """Valid selected positions per layer (what both replays count as lookups), int64 [layers]."""
        return (self.topk >= 0).sum(axis=(0, 2, 3)).astype(np.int64)

    # ---------------------------------------------------------------- checks
    def validate(self) -> TopKTrace:
        t, s = self.topk, self.seq_lens
        if t.ndim != 4:
            raise TraceError(f"trace.topk: must be [steps, layers, batch, k], got shape {t.shape}")
        if not np.issubdtype(t.dtype, np.integer):
            raise TraceError(f"trace.topk: must hold integers, got dtype {t.dtype}")
        S, L, B, K = t.shape
        if min(S, L, B, K) <= 0:
            raise TraceError(f"trace.topk: every dimension must be > 0, got shape {t.shape}")
        if s.shape != (S, B):
            raise TraceError(f"trace.seq_lens: must be [steps, batch] = [{S}, {B}], got shape {s.shape}")
        if not np.issubdtype(s.dtype, np.integer):
            raise TraceError(f"trace.seq_lens: must hold integers, got dtype {s.dtype}")
        if (s[0] < 2).any():
            b = int(np.argmax(s[0] < 2))
            raise TraceError(f"trace.seq_lens: request {b} has seq_len {int(s[0, b])} at step 0; decode needs a prompt "
                             f"(seq_len >= 2)")
        grow = np.diff(s.astype(np.int64), axis=0)
        if (grow != 1).any():
            st, b = np.argwhere(grow != 1)[0]
            raise TraceError(f"trace.seq_lens: must grow by one token a step; request {b} goes from {int(s[st, b])} "
                             f"to {int(s[st + 1, b])} at step {st + 1}")
        lim = s.astype(np.int64)[:, None, :, None]
        bad = (t < -1) | (t >= lim)
        if bad.any():
            st, ly, b, j = np.argwhere(bad)[0]
            raise TraceError(f"trace.topk: position {int(t[st, ly, b, j])} at step {st}, layer {ly}, request {b} is "
                             f"outside [0, seq_len={int(s[st, b])}) (and not -1 padding)")
        _check_distinct(t, "trace.topk")
        if self.warmup_topk is not None:
            w = self.warmup_topk
            if w.ndim != 4 or w.shape[0] != L or w.shape[1] != B or w.shape[3] != K:
                raise TraceError(f"trace.warmup_topk: must be [layers, batch, windows, k] = [{L}, {B}, W, {K}], "
                                 f"got shape {w.shape}")
            if not np.issubdtype(w.dtype, np.integer):
                raise TraceError(f"trace.warmup_topk: must hold integers, got dtype {w.dtype}")
            plim = self.prompt_lens[None, :, None, None]
            bad = (w < -1) | (w >= plim)
            if bad.any():
                ly, b, win, j = np.argwhere(bad)[0]
                raise TraceError(f"trace.warmup_topk: position {int(w[ly, b, win, j])} at layer {ly}, request {b}, "
                                 f"window {win} is outside the prompt [0, {int(self.prompt_lens[b])})")
            _check_distinct(w, "trace.warmup_topk")
        if not isinstance(self.meta, dict):
            raise TraceError(f"trace.meta: must be a dict, got {type(self.meta).__name__}")
        try:
            json.dumps(self.meta)
        except (TypeError, ValueError) as exc:
            raise TraceError(f"trace.meta: must be JSON-serialisable: {exc}") from exc
        return self

    # ---------------------------------------------------------------- io
    def save(self, path: str | Path, compact: bool = False) -> Path:
        """Validate, then write a compressed .npz (positions as int16 when they fit). Returns the path written.

        compact: store every row sorted, as gaps (see the module docstring); the loaded trace has sorted rows.
        """
        self.validate()
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_suffix(".npz")
        path.parent.mkdir(parents=True, exist_ok=True)
        sentinel = int(self.seq_lens.max())  # > every position: stands for padding when rows are sorted
        narrow = sentinel < np.iinfo(np.int16).max
        pos_dtype = np.int16 if narrow else np.int32
        meta = dict(self.meta, rows_sorted=True) if compact else self.meta

        def enc(a: np.ndarray) -> np.ndarray:
            return (_sorted_delta(a, sentinel) if compact else a).astype(pos_dtype)

        arrays = dict(format_version=np.int32(FORMAT_VERSION), encoding=np.array("sorted_delta" if compact else
                                                                                  "plain"),
                      pad_sentinel=np.int64(sentinel), topk=enc(self.topk), seq_lens=self.seq_lens.astype(np.int32),
                      meta=np.array(json.dumps(meta, sort_keys=True)))
        if self.warmup_topk is not None:
            arrays["warmup_topk"] = enc(self.warmup_topk)
        with open(path, "wb") as f:
            np.savez_compressed(f, **arrays)
        return path

    @classmethod
    def load(cls, path: str | Path) -> TopKTrace:
        """Read a trace written by `save` and validate it."""
        path = Path(path)
        with np.load(path, allow_pickle=False) as z:
            keys = set(z.files)
            missing = {"format_version", "topk", "seq_lens", "meta"} - keys
            if missing:
                raise TraceError(f"trace file {path}: missing {sorted(missing)} (not a top-k trace?)")
            version = int(z["format_version"])
            if version != FORMAT_VERSION:
                raise TraceError(f"trace.format_version: {version} is not supported (this code reads {FORMAT_VERSION})")
            encoding = str(z["encoding"]) if "encoding" in keys else "plain"
            if encoding not in ("plain", "sorted_delta"):
                raise TraceError(f"trace.encoding: {encoding!r} is not 'plain' or 'sorted_delta'")
            sentinel = int(z["pad_sentinel"]) if "pad_sentinel" in keys else 0

            def dec(a: np.ndarray) -> np.ndarray:
                return (_undo_sorted_delta(a, sentinel) if encoding == "sorted_delta" else a).astype(np.int32)

            trace = cls(topk=dec(z["topk"]), seq_lens=z["seq_lens"].astype(np.int32),
                        warmup_topk=dec(z["warmup_topk"]) if "warmup_topk" in keys else None,
                        meta=json.loads(str(z["meta"])))
        return trace.validate()

    # ---------------------------------------------------------------- slicing (small samples)
    def subset(self, steps: int | None = None, layers: list[int] | None = None,
               requests: list[int] | None = None) -> TopKTrace:
        """The first `steps` steps of the given layers and requests (all by default), as a new trace."""
        st = slice(0, steps)
        ly = list(range(self.num_layers)) if layers is None else list(layers)
        rq = list(range(self.batch)) if requests is None else list(requests)
        topk = self.topk[st][:, ly][:, :, rq]
        warm = None if self.warmup_topk is None else self.warmup_topk[ly][:, rq]
        meta = dict(self.meta, subset=dict(steps=int(topk.shape[0]), layers=ly, requests=rq))
        return TopKTrace(topk=topk.copy(), seq_lens=self.seq_lens[st][:, rq].copy(),
                         warmup_topk=None if warm is None else warm.copy(), meta=meta)


def _sorted_delta(a: np.ndarray, sentinel: int) -> np.ndarray:
    """Sort each row (padding, as `sentinel`, last) and keep the first value and the gaps after it."""
    v = np.sort(np.where(a < 0, sentinel, a).astype(np.int64), axis=-1)
    return np.diff(v, axis=-1, prepend=0)


def _undo_sorted_delta(d: np.ndarray, sentinel: int) -> np.ndarray:
    v = np.cumsum(d.astype(np.int64), axis=-1)
    return np.where(v >= sentinel, -1, v)


def _check_distinct(t: np.ndarray, name: str) -> None:
    """Within each row of the last axis, valid positions (>= 0) must be distinct."""
    rows = np.sort(t.reshape(-1, t.shape[-1]).astype(np.int64), axis=1)
    dup = (rows[:, 1:] == rows[:, :-1]) & (rows[:, 1:] >= 0)
    if dup.any():
        r, j = np.argwhere(dup)[0]
        idx = np.unravel_index(r, t.shape[:-1])
        raise TraceError(f"{name}: position {int(rows[r, j])} is selected twice in row {tuple(int(i) for i in idx)}")


# ------------------------------------------------------------------------------------------------------ generator

class SyntheticTraceConfig(BaseModel):
    """Knobs of the synthetic top-k generator (`synthetic_trace`); each field's description says what it moves.

    Each (request, layer) selection evolves as a set: every step keeps `overlap` of the previous step's picks (other
    than the fixed ones) and replaces the rest with fresh picks; a fraction `recency` of the fresh picks fall in the
    most recent `recent_window` tokens, the others are runs of about `cluster_len` neighbouring positions anywhere in
    the context ("topics"). The first `sink_tokens` positions and, with `newest_always`, the token decoded in the step
    are selected every step. With probability `burst_prob` a request has a burst at a step (a new topic, the same step
    for all its layers): then every layer keeps at most 1 - `burst_fraction` of its set. The context grows by one
    token a step; requests start from different prompt lengths.
    """

    model_config = ConfigDict(extra="forbid")

    batch: int = Field(4, ge=1, description="requests decoded together")
    context_len: int = Field(32768, ge=2, description="prompt length of the longest request")
    length_spread: float = Field(0.5, ge=0.0, lt=1.0, description="prompt lengths are drawn uniformly from "
                                 "[context_len * (1 - length_spread), context_len]; the first request gets context_len")
    steps: int = Field(128, ge=1, description="decode steps")
    num_layers: int = Field(4, ge=1)
    top_k: int = Field(2048, ge=1, description="positions selected per request, layer and step")
    overlap: float | list[float] = Field(0.9, description="fraction of the previous step's (non-fixed) picks kept; "
                                         "one value for every layer, or one per layer")
    recency: float = Field(0.2, ge=0.0, le=1.0, description="fraction of each step's fresh picks drawn from the most "
                           "recent `recent_window` tokens")
    recent_window: int = Field(1024, ge=1, description="how many of the most recent tokens count as recent")
    sink_tokens: int = Field(4, ge=0, description="positions 0 .. sink_tokens - 1 are selected at every step")
    newest_always: bool = Field(True, description="the token decoded in the step (position seq_len - 1) is selected")
    cluster_len: float = Field(8.0, ge=1.0, description="mean length of a run of neighbouring fresh topic picks "
                                "(geometric); 1 = independent uniform picks")
    burst_prob: float = Field(0.0, ge=0.0, le=1.0, description="probability that a request changes topic at a step")
    burst_fraction: float = Field(0.6, ge=0.0, le=1.0, description="fraction of the set a burst replaces (at least)")
    warmup_windows: int = Field(32, ge=0, description="prefill query windows recorded for ESS warm-up")
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> SyntheticTraceConfig:
        ov = self.overlap if isinstance(self.overlap, list) else [self.overlap]
        if isinstance(self.overlap, list) and len(self.overlap) != self.num_layers:
            raise ValueError(f"overlap: {len(self.overlap)} values given for num_layers={self.num_layers}")
        if any(not 0.0 <= o <= 1.0 for o in ov):
            raise ValueError(f"overlap: every value must be in [0, 1], got {self.overlap}")
        if self.sink_tokens + int(self.newest_always) > self.top_k:
            raise ValueError(f"sink_tokens: {self.sink_tokens} sinks (+ the newest token) exceed top_k={self.top_k}")
        if self.warmup_windows >= self.context_len * (1 - self.length_spread):
            raise ValueError(f"warmup_windows: {self.warmup_windows} windows need longer prompts than "
                             f"{self.context_len * (1 - self.length_spread):.0f} tokens")
        return self

    def layer_overlap(self) -> list[float]:
        return list(self.overlap) if isinstance(self.overlap, list) else [float(self.overlap)] * self.num_layers

    def prompt_lengths(self) -> list[int]:
        rng = np.random.default_rng([self.seed, 1])
        lo = int(math.ceil(self.context_len * (1 - self.length_spread)))
        lens = rng.integers(lo, self.context_len + 1, self.batch)
        lens[0] = self.context_len
        return [int(x) for x in lens]


def _clustered(rng: np.random.Generator, lo: int, hi: int, n: int, cluster_len: float) -> np.ndarray:
    """About n candidate positions in [lo, hi), as runs of geometric length (mean cluster_len)."""
    if cluster_len <= 1.0:
        return rng.integers(lo, hi, n)
    runs = max(int(math.ceil(n / cluster_len)), 1)
    starts = rng.integers(lo, hi, runs)
    lens = rng.geometric(1.0 / cluster_len, runs)
    offs = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    pos = np.repeat(starts, lens) + offs
    return pos[pos < hi]


def _draw(rng: np.random.Generator, taken: np.ndarray, lo: int, hi: int, count: int, cluster_len: float) -> np.ndarray:
    """`count` distinct positions of [lo, hi) not yet taken (marking them taken); fewer if fewer are left."""
    out: list[np.ndarray] = []
    need = count
    for _ in range(8):
        if need <= 0 or hi <= lo:
            break
        cand = _clustered(rng, lo, hi, 2 * need, cluster_len)
        cand = cand[~taken[cand]]
        _, first = np.unique(cand, return_index=True)
        cand = cand[np.sort(first)][:need]
        taken[cand] = True
        out.append(cand)
        need -= cand.size
    if need > 0 and hi > lo:  # the range is nearly full: take what is left at random
        left = np.flatnonzero(~taken[lo:hi]) + lo
        cand = rng.permutation(left)[:need]
        taken[cand] = True
        out.append(cand)
    return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


def synthetic_trace(cfg: SyntheticTraceConfig) -> TopKTrace:
    """A trace drawn from the knobs of `cfg` (see `SyntheticTraceConfig`); the same config gives the same trace."""
    B, L, K, S, W = cfg.batch, cfg.num_layers, cfg.top_k, cfg.steps, cfg.warmup_windows
    prompts = cfg.prompt_lengths()
    overlap = cfg.layer_overlap()
    topk = np.full((S, L, B, K), -1, dtype=np.int32)
    warm = np.full((L, B, W, K), -1, dtype=np.int32) if W else None
    seq_lens = np.array([[p + 1 + s for p in prompts] for s in range(S)], dtype=np.int32)
    for b, prompt in enumerate(prompts):
        bursts = np.random.default_rng([cfg.seed, 2, b]).random(W + S) < cfg.burst_prob
        taken = np.zeros(prompt + S + 1, dtype=bool)
        for layer in range(L):
            rng = np.random.default_rng([cfg.seed, 3, b, layer])
            prev = np.empty(0, dtype=np.int64)
            # the process runs W steps before decode (the prefill's last query windows), then S decode steps
            for t in range(W + S):
                n = prompt - W + 1 + t  # visible positions of this query
                fixed = list(range(min(cfg.sink_tokens, n)))
                if cfg.newest_always and n - 1 >= len(fixed):
                    fixed.append(n - 1)
                fixed_a = np.asarray(fixed, dtype=np.int64)
                taken[fixed_a] = True
                budget = min(K, n) - fixed_a.size
                rest = prev[~taken[prev]] if prev.size else prev
                keep_frac = overlap[layer] if not bursts[t] else min(overlap[layer], 1.0 - cfg.burst_fraction)
                n_keep = min(int(round(keep_frac * rest.size)), budget)
                keep = rest[np.sort(rng.choice(rest.size, n_keep, replace=False))] if n_keep else rest[:0]
                taken[keep] = True
                n_fresh = budget - n_keep
                n_recent = int(round(cfg.recency * n_fresh))
                recent = _draw(rng, taken, max(0, n - cfg.recent_window), n, n_recent, 1.0)
                topic = _draw(rng, taken, 0, n, n_fresh - recent.size, cfg.cluster_len)
                sel = np.concatenate([fixed_a, keep, recent, topic])
                taken[sel] = False
                prev = sel[fixed_a.size:]
                if t < W:
                    warm[layer, b, t, : sel.size] = sel
                else:
                    topk[t - W, layer, b, : sel.size] = sel
    meta = dict(source="synthetic", config=cfg.model_dump())
    return TopKTrace(topk=topk, seq_lens=seq_lens, warmup_topk=warm, meta=meta).validate()


# ------------------------------------------------------------------------------------------------------ demo model

def record_demo_trace(batch: int = 4, context_len: int = 4096, steps: int = 64, layers: int = 4, top_k: int = 256,
                      seed: int = 0, warmup_windows: int = 32, num_heads: int = 16) -> TopKTrace:
    """Decode the embedded demo DSA model (`ess_sglang.reference.model`) on CPU and record its indexer's top-k.

    The model runs as in `ess demo`'s all-in-device reference run: the same prompt lengths (context_len minus up to
    1/16), hidden states, weights and input drift for a seed. A thin wrapper around `DeviceCacheBackend` records the
    `topk_pos` every layer's `attention_table` is given; the prefill's last `warmup_windows` query windows come from
    `DemoDecoder.window_topk`, as the demo's warm-up uses them.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see replay_ess: small gathers are far slower with torch's CPU thread pool
    try:
        return _record_demo_trace(batch, context_len, steps, layers, top_k, seed, warmup_windows, num_heads)
    finally:
        torch.set_num_threads(threads)


def _record_demo_trace(batch: int, context_len: int, steps: int, layers: int, top_k: int, seed: int,
                       warmup_windows: int, num_heads: int) -> TopKTrace:
    import torch

    from ess_sglang.reference.model import (
        DemoDecoder,
        DemoModelSpec,
        DemoWeights,
        DeviceCacheBackend,
        context_hidden,
        drift,
    )
    from ess_sglang.request_table import RequestTable

    dev = torch.device("cpu")
    dtype = torch.float32
    spec = DemoModelSpec(num_layers=layers, num_heads=num_heads, top_k=top_k, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    lengths = [context_len - int(torch.randint(0, max(context_len // 16, 1), (1,), generator=g)) for _ in range(batch)]
    num_locations = sum(lengths) + batch * steps

    class RecordingBackend(DeviceCacheBackend):
        def __init__(self):
            super().__init__(layers, num_locations, dev)
            self.step_topk: list[torch.Tensor] = []

        def attention_table(self, layer, topk_pos, req_to_token, req_pool_indices, seq_lens):
            self.step_topk.append(topk_pos[:, 0, :].clone())
            return super().attention_table(layer, topk_pos, req_to_token, req_pool_indices, seq_lens)

    backend = RecordingBackend()
    weights = DemoWeights(spec, dev, dtype)
    dec = DemoDecoder(spec, weights, backend, num_locations, dev, "reference")
    table = RequestTable(batch, context_len + steps, device=dev)
    hidden = context_hidden(spec, lengths, seed + 2, dev, dtype)
    next_loc = 0
    rows = []
    for b, n in enumerate(lengths):
        row = table.alloc_row()
        locs = torch.arange(next_loc, next_loc + n)
        next_loc += n
        table.set(row, 0, locs)
        dec.load_context(hidden[b], locs)
        rows.append(row)
    warm = None
    if warmup_windows:
        warm = np.full((layers, batch, warmup_windows, top_k), -1, dtype=np.int32)
        for layer in range(layers):
            for b, n in enumerate(lengths):
                win = dec.window_topk(layer, hidden[b][-warmup_windows:], table.req_to_token, rows[b], n)
                warm[layer, b] = win.numpy()
    rpi = torch.tensor(rows)
    seq_lens = torch.tensor(lengths)
    x = torch.stack([h[-1] for h in hidden])
    topk = np.full((steps, layers, batch, top_k), -1, dtype=np.int32)
    lens = np.zeros((steps, batch), dtype=np.int32)
    for s in range(steps):
        new_locs = torch.arange(next_loc, next_loc + batch)
        next_loc += batch
        for b in range(batch):
            table.req_to_token[rows[b], seq_lens[b]] = int(new_locs[b])
        seq_lens = seq_lens + 1
        backend.step_topk.clear()
        y, _ = dec.step(x, new_locs, table.req_to_token, rpi, seq_lens)
        topk[s] = torch.stack(backend.step_topk).numpy()
        lens[s] = seq_lens.numpy()
        x = drift(spec, x, y, s, seed)
    meta = dict(source="demo", batch=batch, context_len=context_len, steps=steps, layers=layers, top_k=top_k,
                seed=seed, warmup_windows=warmup_windows, num_heads=num_heads, prompt_lens=lengths)
    return TopKTrace(topk=topk, seq_lens=lens, warmup_topk=warm, meta=meta).validate()


# ------------------------------------------------------------------------------------------------------ replay

@dataclass
class ReplayStats:
    """Per-layer counts of one policy replaying one trace (int64 arrays of length num_layers)."""

    policy: str
    lookups: np.ndarray
    misses: np.ndarray
    warmup_entries: np.ndarray
    slots_per_layer: int
    entry_bytes: int = LATENT_ENTRY_BYTES  # what one miss moves over PCIe
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hits(self) -> np.ndarray:
        return self.lookups - self.misses

    def hit_rate_per_layer(self) -> np.ndarray:
        return np.where(self.lookups > 0, 1.0 - self.misses / np.maximum(self.lookups, 1), 1.0)

    @property
    def hit_rate(self) -> float:
        look = int(self.lookups.sum())
        return 1.0 - int(self.misses.sum()) / look if look else 1.0

    def miss_bytes_per_layer(self) -> np.ndarray:
        return self.misses * self.entry_bytes

    @property
    def miss_bytes(self) -> int:
        return int(self.misses.sum()) * self.entry_bytes

    @property
    def warmup_bytes(self) -> int:
        return int(self.warmup_entries.sum()) * self.entry_bytes

    def to_dict(self) -> dict[str, Any]:
        return dict(policy=self.policy, slots_per_layer=self.slots_per_layer, hit_rate=self.hit_rate,
                    lookups=int(self.lookups.sum()), misses=int(self.misses.sum()), miss_bytes=self.miss_bytes,
                    warmup_entries=int(self.warmup_entries.sum()), warmup_bytes=self.warmup_bytes,
                    per_layer=dict(hit_rate=[float(x) for x in self.hit_rate_per_layer()],
                                   lookups=[int(x) for x in self.lookups], misses=[int(x) for x in self.misses],
                                   miss_bytes=[int(x) for x in self.miss_bytes_per_layer()],
                                   warmup_entries=[int(x) for x in self.warmup_entries]),
                    **self.extra)


def replay_ess(trace: TopKTrace, slots_per_layer: int, warmup: str = "auto", resolve_impl: str = "torch",
               device: str = "cpu", warmup_budget: int | None = None, on_step=None,
               new_tokens: str | None = None, decay_gamma: float | None = None) -> ReplayStats:
    """Replay `trace` through ESS's shared per-layer LRU hot pool (`HotPoolCacheManager`) and count its work.

    The pool has `slots_per_layer` slots per layer shared by all requests. Per step, as in the SGLang plugin's decode:
    `begin_step`, then per layer the layer's selection is resolved with the step's new tokens (`resolve(new_tokens=)`:
    written back; with new_tokens="insert" also given a protected hot slot by the same resolve, with "on_demand"
    fetched as a miss when selected; default: EssConfig's, what the runtime does). Hits and misses are read from the
    manager's counters (LOOKUPS, MISSES). No entry bytes move (`copy_impl="none"`, 4-byte host entries): bytes are
    misses x 656.

    warmup: "windows" (ESS's LRU warm-up: the union of the prefill's last query windows' top-k, `warmup_positions`,
    budget slots_per_layer // batch per request), "recent" (the most recent prompt tokens), "none", or "auto"
    (windows when the trace has them, else recent). `warmup_budget` overrides the per-request budget.
    `on_step(step, manager)`, when given, is called after every step (e.g. to read per-step counters).
    `decay_gamma`: the pool's retention is decayed selection count with this factor (EssConfig.retention "decay");
    None: LRU.
    """
    import torch

    trace.validate()
    from ess_sglang.config import new_token_mode

    new_tokens = new_token_mode(new_tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: torch's CPU thread pool costs more than it gains (x[idx]: 8 ms vs 75 us)
    try:
        return _replay_ess(trace, slots_per_layer, warmup, resolve_impl, device, warmup_budget, on_step, new_tokens,
                           decay_gamma)
    finally:
        torch.set_num_threads(threads)


def _replay_ess(trace: TopKTrace, slots_per_layer: int, warmup: str, resolve_impl: str, device: str,
                warmup_budget: int | None, on_step, new_tokens: str, decay_gamma: float | None) -> ReplayStats:
    import torch

    from ess_sglang.cache_manager import Counter, HotPoolCacheManager, NewTokens
    from ess_sglang.host_pool import HostTotalPool
    from ess_sglang.request_table import RequestTable
    from ess_sglang.warmup import warmup_positions

    if warmup == "auto":
        warmup = "windows" if trace.warmup_topk is not None else "recent"
    if warmup not in ("windows", "recent", "none"):
        raise ValueError(f"warmup must be 'auto', 'windows', 'recent' or 'none', got {warmup!r}")
    if warmup == "windows" and trace.warmup_topk is None:
        raise ValueError("warmup='windows' needs a trace with warmup_topk")
    dev = torch.device(device)
    S, L, B, K = trace.topk.shape
    prompts = [int(p) for p in trace.prompt_lens]
    tokens = sum(prompts) + S * B
    host = HostTotalPool(L, tokens, entry_bytes=4, device=dev, pin=False)  # (one word: rows the resolve can read)
    m = HotPoolCacheManager(host, slots_per_layer, device=dev, max_selected=B * (K + 1), copy_impl="none",
                            resolve_impl=resolve_impl, decay_gamma=decay_gamma)
    table = RequestTable(B, max(prompts) + S + 1, device=dev)
    rows = []
    for p in prompts:
        row = table.alloc_row()
        table.set(row, 0, host.alloc(p))
        rows.append(row)
    if warmup != "none":
        budget = slots_per_layer // B if warmup_budget is None else min(warmup_budget, slots_per_layer // B)
        for layer in range(L):
            for b, p in enumerate(prompts):
                win = torch.from_numpy(trace.warmup_topk[layer, b]) if warmup == "windows" else None
                pos = warmup_positions(p, budget, win)
                m.warm_up(layer, table.req_to_token[rows[b], pos.to(dev)])
    rpi = torch.tensor(rows, device=dev)
    topk = torch.from_numpy(trace.topk).to(dev)
    seq_all = torch.from_numpy(trace.seq_lens.astype(np.int64)).to(dev)
    new_entries = torch.zeros((B, 4), dtype=torch.uint8, device=dev)
    new_rows = torch.arange(B, device=dev)
    first_step = 0
    for s in range(S):
        seq = seq_all[s]
        new_locs = host.alloc(B).to(dev)
        table.req_to_token[rpi, seq - 1] = new_locs.to(torch.int32)
        m.begin_step()
        for layer in range(L):  # as the SGLang plugin resolves: the step's tokens ride in the resolve
            m.resolve(layer, topk[s, layer].unsqueeze(1), table.req_to_token, rpi, seq,
                      new_tokens=NewTokens(new_locs, new_entries, new_rows, insert=new_tokens == "insert"))
        if s == 0:
            first_step = int(m.counters[:, Counter.MISSES].sum())
        if on_step is not None:
            on_step(s, m)
    c = m.counters.cpu().numpy()
    if c[:, Counter.OVERFLOW].any() or c[:, Counter.BAD_INDICES].any():
        raise RuntimeError(f"replay_ess: {int(c[:, Counter.OVERFLOW].sum())} overflowing entries, "
                           f"{int(c[:, Counter.BAD_INDICES].sum())} bad indices: the pool is too small for a step")
    return ReplayStats(policy="ess", lookups=c[:, Counter.LOOKUPS].astype(np.int64),
                       misses=c[:, Counter.MISSES].astype(np.int64),
                       warmup_entries=c[:, Counter.WARMUP_ENTRIES].astype(np.int64), slots_per_layer=slots_per_layer,
                       extra=dict(warmup=warmup, warmup_budget=warmup_budget, first_step_misses=first_step,
                                  new_tokens_mode=new_tokens, decay_gamma=decay_gamma,
                                  evictions=int(c[:, Counter.EVICTIONS].sum()),
                                  new_tokens=int(c[:, Counter.NEW_TOKENS].sum())))
