"""The embedded DSA decode model of `ess demo` and of the lossless tests.

A small multi-layer DeepSeek-Sparse-Attention decoder with random weights. Per layer and step:

    entry  = V32(x W_kv)              new latent entry of this step's token, stored before attention
    ikey   = fp8(x W_ik)              new indexer key, stored in the device indexer cache (every token, every layer)
    logits = indexer(x W_iq, x W_iw)  over the request's tokens; top-k positions
    table  = backend.attention_table(...)   positions -> rows of the latent store the backend attends over
    out    = sparse MLA(x W_q, store, table)
    x      = norm(x + out W_o)

and the next step's input drifts from the last layer's output (seeded noise), so consecutive top-k sets overlap as
in real DSA models, and any difference in an attention output would change every later step.

Two backends hold the latent entries: `DeviceCacheBackend` keeps all of them in device memory (the reference);
`EssBackend` keeps them in the host total pool with a per-layer hot pool in front (ESS). The model code is the same
for both: only the table and the store it names differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ess_sglang.cache_manager import HotPoolCacheManager, positions_to_locations
from ess_sglang.config import new_token_mode
from ess_sglang.formats import (
    INDEX_HEAD_DIM,
    INDEXER_ENTRY_BYTES,
    KV_LORA_RANK,
    LATENT_ENTRY_BYTES,
    QK_HEAD_DIM,
    pack_indexer_key,
    pack_latent,
)
from ess_sglang.reference.dsa import (
    indexer_logits,
    latent_store_rows,
    sparse_mla_flashmla,
    sparse_mla_reference,
    topk_positions,
)


@dataclass(frozen=True)
class DemoModelSpec:
    num_layers: int = 4
    d_model: int = 256
    num_heads: int = 16
    index_heads: int = 8
    top_k: int = 2048
    seed: int = 0
    # how the hidden state moves: context tokens follow a random walk; a decode step's input is the last input moved
    # a little towards the last output, plus seeded noise
    context_persistence: float = 0.98
    output_feedback: float = 0.05
    noise: float = 0.1


class DemoWeights:
    def __init__(self, spec: DemoModelSpec, device: torch.device, dtype: torch.dtype):
        g = torch.Generator().manual_seed(spec.seed)
        d = spec.d_model

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / shape[0] ** 0.5).to(device=device, dtype=dtype)

        self.layers = [
            dict(kv=w(d, QK_HEAD_DIM), ik=w(d, INDEX_HEAD_DIM), iq=w(d, spec.index_heads * INDEX_HEAD_DIM),
                 iw=w(d, spec.index_heads), q=w(d, spec.num_heads * QK_HEAD_DIM),
                 o=w(spec.num_heads * KV_LORA_RANK, d))
            for _ in range(spec.num_layers)
        ]


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x / x.float().norm(dim=-1, keepdim=True).clamp_min(1e-6).to(x.dtype)


def context_hidden(spec: DemoModelSpec, lengths: list[int], seed: int, device, dtype) -> list[torch.Tensor]:
    """Hidden states of each request's context tokens: an AR(1) random walk (unit variance per component), so
    neighbouring tokens resemble each other and far ones do not; each state is normalised."""
    g = torch.Generator().manual_seed(seed)
    n_max, a = max(lengths), spec.context_persistence
    noise = torch.randn(n_max, len(lengths), spec.d_model, generator=g) * (1 - a * a) ** 0.5
    walk = torch.empty_like(noise)
    cur = torch.randn(len(lengths), spec.d_model, generator=g)
    for t in range(n_max):
        cur = a * cur + noise[t]
        walk[t] = cur
    return [_norm(walk[:n, b]).to(device=device, dtype=dtype) for b, n in enumerate(lengths)]


def latent_entries(weights: DemoWeights, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    kv = (hidden @ weights.layers[layer]["kv"]).float()
    return pack_latent(kv[..., :KV_LORA_RANK], kv[..., KV_LORA_RANK:])


def index_entries(weights: DemoWeights, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    return pack_indexer_key((hidden @ weights.layers[layer]["ik"]).float())


class DeviceCacheBackend:
    """The reference: every latent entry of every layer in device memory, indexed by KV location."""

    name = "all-in-device"

    def __init__(self, num_layers: int, num_locations: int, device):
        self.latents = torch.zeros((num_layers, latent_store_rows(num_locations), LATENT_ENTRY_BYTES),
                                   dtype=torch.uint8, device=device)
        self.num_locations = num_locations

    def load_context(self, layer: int, locs: torch.Tensor, entries: torch.Tensor) -> None:
        self.latents[layer, locs.to(self.latents.device).long()] = entries

    def store_new(self, layer: int, locs: torch.Tensor, entries: torch.Tensor) -> None:
        self.latents[layer, locs.long()] = entries

    def attention_table(self, layer, topk_pos, req_to_token, req_pool_indices, seq_lens):
        locs, _ = positions_to_locations(topk_pos, req_to_token, req_pool_indices, seq_lens, self.num_locations)
        return self.latents[layer], locs.to(torch.int32)


class EssBackend:
    """ESS: latents in the host total pool, a hot pool per layer in device memory, the cache manager in between."""

    name = "ess"

    def __init__(self, manager: HotPoolCacheManager, new_tokens: str | None = None):
        """`new_tokens`: EssConfig.new_tokens ("on_demand": written back, fetched when selected; "insert": also a
        protected hot slot; None: the default)."""
        self.manager = manager
        self.insert_new = new_token_mode(new_tokens) == "insert"

    def load_context(self, layer: int, locs: torch.Tensor, entries: torch.Tensor) -> None:
        """Prefill output lands in the host pool (as PD transfer does), not in the hot pool."""
        self.manager.host.entries[layer, locs.cpu().long()] = entries.cpu()

    def store_new(self, layer: int, locs: torch.Tensor, entries: torch.Tensor) -> None:
        self.manager.write_new_tokens(layer, locs, entries, insert=self.insert_new)

    def attention_table(self, layer, topk_pos, req_to_token, req_pool_indices, seq_lens):
        slots = self.manager.resolve(layer, topk_pos, req_to_token, req_pool_indices, seq_lens)
        return self.manager.layer_entries(layer), slots


class DemoDecoder:
    """Runs decode steps of the demo model over one backend; owns its indexer cache and attention choice."""

    def __init__(self, spec: DemoModelSpec, weights: DemoWeights, backend, num_locations: int, device,
                 attention: str = "reference"):
        self.spec, self.weights, self.backend = spec, weights, backend
        self.index_cache = torch.zeros((spec.num_layers, num_locations, INDEXER_ENTRY_BYTES), dtype=torch.uint8,
                                       device=device)
        if attention not in ("reference", "flashmla"):
            raise ValueError(f"attention must be 'reference' or 'flashmla', got {attention!r}")
        self.attention = attention
        self.softmax_scale = QK_HEAD_DIM ** -0.5

    def load_context(self, hidden: torch.Tensor, locs: torch.Tensor) -> None:
        at = locs.to(self.index_cache.device).long()
        for layer in range(self.spec.num_layers):
            self.index_cache[layer, at] = index_entries(self.weights, layer, hidden)
            self.backend.load_context(layer, locs, latent_entries(self.weights, layer, hidden))

    def window_topk(self, layer: int, hidden_tail: torch.Tensor, req_to_token, row: int, seq_len: int) -> torch.Tensor:
        """Top-k positions chosen by the indexer for the last len(hidden_tail) prefill queries: [windows, k]."""
        W = hidden_tail.shape[0]
        lw = self.weights.layers[layer]
        q_index = (hidden_tail @ lw["iq"]).view(1, W, self.spec.index_heads, INDEX_HEAD_DIM)
        weights = (hidden_tail @ lw["iw"]).view(1, W, self.spec.index_heads)
        dev = hidden_tail.device
        logits = indexer_logits(q_index, weights, self.index_cache[layer], req_to_token,
                                torch.tensor([row], device=dev), torch.tensor([seq_len], device=dev), seq_len)
        return topk_positions(logits, self.spec.top_k)[0]

    def step(self, x: torch.Tensor, new_locs: torch.Tensor, req_to_token, req_pool_indices, seq_lens):
        """One decode step for a batch: x [B, d] -> (next x, per-layer attention outputs [B, 1, H, 512])."""
        spec = self.spec
        B = x.shape[0]
        outs = []
        for layer in range(spec.num_layers):
            lw = self.weights.layers[layer]
            self.index_cache[layer, new_locs.long()] = index_entries(self.weights, layer, x)
            self.backend.store_new(layer, new_locs, latent_entries(self.weights, layer, x))
            q_index = (x @ lw["iq"]).view(B, 1, spec.index_heads, INDEX_HEAD_DIM)
            w_index = (x @ lw["iw"]).view(B, 1, spec.index_heads)
            max_len = int(req_to_token.shape[1])
            logits = indexer_logits(q_index, w_index, self.index_cache[layer], req_to_token, req_pool_indices,
                                    seq_lens, max_len)
            topk = topk_positions(logits, spec.top_k)
            store, table = self.backend.attention_table(layer, topk, req_to_token, req_pool_indices, seq_lens)
            q = (x @ lw["q"]).view(B, 1, spec.num_heads, QK_HEAD_DIM)
            if self.attention == "flashmla":
                out, _ = sparse_mla_flashmla(q, store, table, self.softmax_scale)
            else:
                out, _ = sparse_mla_reference(q, store, table, self.softmax_scale)
            outs.append(out)
            x = _norm(x + (out.reshape(B, -1).to(x.dtype) @ lw["o"]))
        return x, outs


def drift(spec: DemoModelSpec, x_in: torch.Tensor, x_out: torch.Tensor, step: int, seed: int) -> torch.Tensor:
    """The next step's input: the last input moved towards the last output, plus seeded noise (equal in every run).

    The output term makes every later step depend on every attention output so far.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    noise = _norm(torch.randn(x_in.shape, generator=g)).to(device=x_in.device, dtype=x_in.dtype)
    return _norm(x_in + spec.output_feedback * (x_out - x_in) + spec.noise * noise)
