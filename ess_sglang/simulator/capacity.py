"""HBM and host memory -> how many requests one GPU can hold, and the hot-pool ratio at a given batch.

Per GPU (attention DP: each GPU holds its own requests' KV cache)::

    weights   = embedding + LM head (bf16) + (61 + 1 MTP) x (MLA + indexer projections (fp8) + W_UK/W_UV (bf16)
                + router (fp32)) + 3 dense FFNs + (58 + 1) x (shared expert + experts_per_gpu routed experts) (fp8)
    KV budget = hbm x mem_fraction_static - weights          (SGLang's --mem-fraction-static: weights + KV pools)
    per token = n_kv x (656 latent + 132 indexer)            (n_kv = 61 layers + 1 MTP layer; 61 without MTP)

    without ESS:  B_max = floor(KV budget / (L x n_kv x 788))
    with ESS:     the GPU holds every token's indexer entry and a hot pool of ratio x L latent slots per request:
                  ratio(B) = min(1, (KV budget / B - L x n_kv x 132) / (L x n_kv x 656))
                  the pool may not shrink below one step's selections, q x (min(k, L) + 1) slots (ratio_min),
                  the host holds every latent (host_usable / gpus_per_node per GPU), and the operator may ask
                  for a minimum ratio (scenario ess.min_pool_ratio).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ess_sglang.simulator.hardware import GIB, Hardware
from ess_sglang.simulator.model import ModelArch


def weights_bytes_per_gpu(arch: ModelArch, experts_per_gpu: int, with_mtp: bool = True) -> float:
    n_mtp = arch.num_mtp_layers if with_mtp else 0
    n_attn = arch.num_layers + n_mtp
    n_moe = arch.num_moe_layers + n_mtp
    embed_and_head = 2 * arch.vocab * arch.hidden * 2  # bf16; the MTP layer shares both
    mtp_proj = n_mtp * 2 * arch.hidden * arch.hidden * 2  # eh_proj, bf16
    attn = n_attn * (arch.attn_fp8_params + 2 * arch.absorb_bf16_params)
    router = n_moe * 4 * arch.router_params
    ffn = arch.num_dense_layers * arch.dense_ffn_params
    experts = n_moe * (arch.num_shared_experts + experts_per_gpu) * arch.expert_params
    return float(embed_and_head + mtp_proj + attn + router + ffn + experts)


def kv_bytes_per_token(arch: ModelArch, with_mtp: bool = True) -> tuple[int, int]:
    """(latent, indexer) bytes of one token over all KV layers (the MTP layer has its own cache)."""
    n = arch.num_layers + (arch.num_mtp_layers if with_mtp else 0)
    return n * arch.latent_bytes, n * arch.indexer_bytes


@dataclass(frozen=True)
class Capacity:
    """The memory arithmetic of one scenario (one GPU)."""

    weights_bytes: float
    kv_budget_bytes: float
    context: int
    latent_per_request: float
    indexer_per_request: float
    host_per_gpu_bytes: float
    ratio_min: float  # the hot-pool floor, as a ratio of the context
    min_pool_ratio: float | None  # the operator's target, if any

    @property
    def requests_without_ess(self) -> float:
        """Continuous HBM bound without ESS (requests)."""
        return self.kv_budget_bytes / (self.latent_per_request + self.indexer_per_request)

    def max_batch_without_ess(self) -> int:
        return max(0, math.floor(self.requests_without_ess + 1e-9))

    def ratio_at(self, batch: float) -> float:
        """Largest hot-pool ratio HBM allows at ``batch`` requests (can be < ratio_min: does not fit)."""
        per_request = self.kv_budget_bytes / batch
        return min(1.0, (per_request - self.indexer_per_request) / self.latent_per_request)

    def ess_bounds(self) -> dict[str, int]:
        """Requests per GPU each factor allows with ESS."""
        floor_ratio = max(self.ratio_min, self.min_pool_ratio or 0.0)
        hbm = self.kv_budget_bytes / (self.indexer_per_request + floor_ratio * self.latent_per_request)
        bounds = {"hbm": math.floor(hbm + 1e-9), "host_memory": math.floor(self.host_per_gpu_bytes /
                                                                            self.latent_per_request + 1e-9)}
        if self.min_pool_ratio and self.min_pool_ratio > self.ratio_min:
            bounds["target_ratio"] = bounds.pop("hbm")
        return bounds

    def max_batch_with_ess(self) -> tuple[int, str]:
        bounds = self.ess_bounds()
        limit = min(bounds, key=bounds.__getitem__)
        return max(0, bounds[limit]), limit

    def fits(self, batch: int, ess: bool) -> tuple[bool, str]:
        """Whether ``batch`` requests fit; if not, what stops them."""
        if not ess:
            return batch <= self.max_batch_without_ess(), "hbm"
        bounds = self.ess_bounds()
        limit = min(bounds, key=bounds.__getitem__)  # the tightest factor
        return (True, "") if batch <= bounds[limit] else (False, limit)

    def summary(self) -> dict[str, float]:
        return {
            "weights_gib": self.weights_bytes / GIB,
            "kv_budget_gib": self.kv_budget_bytes / GIB,
            "latent_per_request_gib": self.latent_per_request / GIB,
            "indexer_per_request_gib": self.indexer_per_request / GIB,
            "host_latent_per_gpu_gib": self.host_per_gpu_bytes / GIB,
            "requests_without_ess_continuous": self.requests_without_ess,
            "max_batch_without_ess": self.max_batch_without_ess(),
            "ratio_min": self.ratio_min,
        }


def capacity(arch: ModelArch, hw: Hardware, context: int, experts_per_gpu: int, mem_fraction_static: float,
             mtp_tokens: int, min_pool_ratio: float | None = None) -> Capacity:
    with_mtp = mtp_tokens > 1  # without MTP the MTP layer is neither loaded nor cached
    weights = weights_bytes_per_gpu(arch, experts_per_gpu, with_mtp)
    latent, indexer = kv_bytes_per_token(arch, with_mtp)
    floor_slots = mtp_tokens * (min(arch.index_topk, context) + 1)
    return Capacity(
        weights_bytes=weights,
        kv_budget_bytes=max(0.0, hw.hbm_bytes * mem_fraction_static - weights),
        context=context,
        latent_per_request=float(context * latent),
        indexer_per_request=float(context * indexer),
        host_per_gpu_bytes=hw.host_latent_bytes_node / hw.gpus_per_node,
        ratio_min=min(1.0, floor_slots / context),
        min_pool_ratio=min_pool_ratio,
    )
