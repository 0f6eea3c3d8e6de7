"""DeepSeek-V3.2-Exp decode-step cost model: one GPU of a PD-disaggregated decode cluster.

Deployment modelled: attention data-parallel (every GPU holds its own ``B`` requests and their KV
cache), experts spread over ``ep`` GPUs (DeepEP-style dispatch and combine), MTP speculative decoding
that verifies ``q`` tokens per request and step, optionally two-batch overlap (TBO). Everything here
is per GPU and per decode step; docs/simulator.md derives every term.

Every GPU kernel is a roofline term plus, where measurement says so, a fixed cost::

    time(op) = max(flops / (peak(precision) * eta), bytes / (hbm_bw * e_stream)) + fixed(op)

``eta`` is the fitted compute efficiency; ``e_stream`` the share of the HBM peak its stream class reaches: bf16
weight-streaming GEMMs and KV-streaming kernels at the hardware's measured shares, fp8 weight-streaming GEMMs at the
fitted ``fp8_weights`` (calibration.py). Fixed costs (hardware preset): FlashMLA decode + combine and top-k per layer,
one kernel floor for the indexer, ``calibration.SMALL_KERNELS`` small kernels (norms, RoPE, activations, ...) per
layer at one floor each, ESS's resolve, and once a step sampling, metadata and the GPU's idle time.

Per layer and micro-batch of ``b`` requests (``t = q * b`` query tokens, context ``L``):

    attention projections  fp8   flops 2 t P_attn          bytes P_attn (weights)
    absorbed W_UK / W_UV   bf16  flops 2 t P_absorb        bytes 2 P_absorb
    indexer logits         fp8   flops 2 t 64*128 L        bytes b L 132 + t L 4              + kernel floor
    top-k                        bytes t L 4                                                 + top-k fixed
    sparse MLA (FlashMLA)  bf16  flops t 128 k (2*576 + 2*512)    bytes t k 656          (k = 2048) + FlashMLA fixed
    small kernels                                                       (15 + 6 MoE or 1 dense) x kernel floor
    dense FFN (3 layers)   fp8   flops 2 t P_dense         bytes P_dense
    MoE (58 layers)        fp8   flops 2 t (8 + 1) P_exp   bytes (active local experts + shared) P_exp
    dispatch + combine     net   bytes t 8 (7168 + 224) + t 8 7168*2, split remote (NIC) / local (NVLink)
    ESS resolve                  bytes t k 12                                   + resolve fixed + per request x b
    ESS fetch (misses)     PCIe  bytes b m 656 / h2d rate, exposed according to the overlap mode

With TBO the two micro-batches' compute overlaps the other's communication, so a layer takes
``max(sum compute + exposed fetch, sum network, PCIe link busy)``; without TBO the three add up
(compute + exposed fetch + network). A step is the 61 layers, the LM head over ``q B`` tokens, the
MTP draft (the MTP layer over ``q B`` tokens plus an LM head over ``B`` tokens) and the step's fixed costs.
Routing is uniform unless the deployment says "identical" (dummy weights). Output per request and
step is the MTP acceptance ``a`` tokens, so per-request rate = a / step time and per-node throughput =
gpus_per_node x B x a / step time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ess_sglang.entry_sizes import INDEXER_ENTRY_BYTES, LATENT_ENTRY_BYTES  # bytes per token and layer
from ess_sglang.simulator.calibration import FP8_WEIGHT_EFFICIENCY, SMALL_KERNELS, KernelCounts
from ess_sglang.simulator.hardware import Hardware

OVERLAP_MODES = ("sync", "dba", "auto")
ROUTINGS = ("uniform", "identical")


@dataclass(frozen=True)
class ModelArch:
    """DeepSeek-V3.2-Exp (config.json of deepseek-ai/DeepSeek-V3.2-Exp; docs/design.md, from the design brief)."""

    hidden: int = 7168
    num_layers: int = 61
    num_dense_layers: int = 3  # first_k_dense_replace
    num_mtp_layers: int = 1  # num_nextn_predict_layers; has its own (DSA) KV cache
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_dim: int = 128
    qk_rope_dim: int = 64
    v_head_dim: int = 128
    num_heads: int = 128
    dense_intermediate: int = 18432
    moe_intermediate: int = 2048
    num_routed_experts: int = 256
    num_shared_experts: int = 1
    experts_per_token: int = 8
    vocab: int = 129280
    index_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    latent_bytes: int = LATENT_ENTRY_BYTES
    indexer_bytes: int = INDEXER_ENTRY_BYTES
    weight_bytes: int = 1
    """Bytes per weight of the projections, FFNs and experts: 1 (fp8, DeepSeek-V3.2's release) or 2 (bf16, e.g. a
    model served with dummy weights and no quantisation config)."""

    @property
    def weight_precision(self) -> str:
        return "fp8" if self.weight_bytes == 1 else "bf16"

    # ---- parameter counts (weights of weight_bytes each, fp8 in the release, except where noted)
    @property
    def attn_fp8_params(self) -> int:
        """MLA projections (q_a, q_b, kv_a, o) plus the indexer's (wq_b, wk, weights_proj)."""
        h, n = self.hidden, self.num_heads
        mla = (h * self.q_lora_rank + self.q_lora_rank * n * (self.qk_nope_dim + self.qk_rope_dim)
               + h * (self.kv_lora_rank + self.qk_rope_dim) + n * self.v_head_dim * h)
        indexer = self.q_lora_rank * self.index_heads * self.index_head_dim + h * self.index_head_dim \
            + h * self.index_heads
        return mla + indexer

    @property
    def absorb_bf16_params(self) -> int:
        """kv_b_proj split into W_UK and W_UV, absorbed into the query / output path (kept in bf16)."""
        return self.num_heads * self.kv_lora_rank * (self.qk_nope_dim + self.v_head_dim)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    @property
    def dense_ffn_params(self) -> int:
        return 3 * self.hidden * self.dense_intermediate

    @property
    def router_params(self) -> int:
        return self.hidden * self.num_routed_experts  # kept in fp32

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache: the main layers and the MTP layer."""
        return self.num_layers + self.num_mtp_layers

    @property
    def sparse_attn_flops_per_token(self) -> int:
        """QK over 576 dims and PV over 512 dims, for every head and selected entry."""
        d_qk = self.kv_lora_rank + self.qk_rope_dim
        return self.num_heads * self.index_topk * (2 * d_qk + 2 * self.kv_lora_rank)

    @property
    def dispatch_bytes_per_copy(self) -> int:
        """FP8 hidden state plus one fp32 scale per 128 values."""
        return self.hidden + 4 * (self.hidden // 128)

    @property
    def combine_bytes_per_copy(self) -> int:
        return 2 * self.hidden  # bf16


DSV32 = ModelArch()


@dataclass(frozen=True)
class Deployment:
    """How the model is spread over the decode cluster (what a scenario fixes besides the batch)."""

    ep: int
    gpus_per_node: int
    experts_per_gpu: int
    mtp_tokens: int  # q: tokens verified per request and step (1 = no MTP)
    mtp_acceptance: float  # a: tokens emitted per request and step
    two_batch_overlap: bool
    overlap_mode: str = "auto"
    routing: str = "uniform"
    """How the batch's tokens spread over the routed experts: "uniform" (each token picks its experts independently
    and uniformly: a real model's router, balanced) or "identical" (every token of the batch picks the same experts:
    what the router of a model served with dummy weights does, measured in ``validate.py``)."""


@dataclass
class Breakdown:
    """Where the time of one decode step goes (seconds). The shares add up to ``step``."""

    step: float = 0.0
    hbm_bound: float = 0.0  # kernels limited by HBM bandwidth
    flops_bound: float = 0.0  # kernels limited by tensor-core rate
    fixed: float = 0.0  # kernel floors: the fixed costs of kernels (small kernels, FlashMLA, top-k, launches)
    network: float = 0.0  # EP dispatch / combine time not hidden behind compute
    pcie: float = 0.0  # ESS fetch time not hidden (exposed), plus time the PCIe link alone sets
    pcie_busy: float = 0.0  # total H2D link time (for utilisation)
    d2h_busy: float = 0.0
    network_busy: float = 0.0  # total dispatch + combine time
    per_op: dict[str, float] = field(default_factory=dict)

    def add_op(self, name: str, seconds: float) -> None:
        self.per_op[name] = self.per_op.get(name, 0.0) + seconds

    def bottleneck(self) -> str:
        shares = {"HBM bandwidth": self.hbm_bound, "compute": self.flops_bound, "kernel floors": self.fixed,
                  "network": self.network, "PCIe": self.pcie}
        return max(shares, key=shares.__getitem__)


class Roofline:
    """Kernel times on one GPU. Tensor-core work runs at the compute efficiency ``eta`` (fitted, calibration.py);
    HBM traffic at the share of the peak bandwidth its stream class reaches: bf16 weight-streaming GEMMs and
    KV-streaming kernels at the hardware's measured shares (``hbm_efficiency_weights``, ``hbm_efficiency_kv``), fp8
    weight-streaming GEMMs at ``fp8_weights`` (fitted, calibration.py)."""

    STREAMS = ("weights", "weights_fp8", "kv")

    def __init__(self, hw: Hardware, eta: float, fp8_weights: float = FP8_WEIGHT_EFFICIENCY):
        for name, v in (("kernel efficiency", eta), ("fp8 weight efficiency", fp8_weights)):
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1] (got {v})")
        self.peak = {"fp8": hw.fp8_tflops * 1e12 * eta, "bf16": hw.bf16_tflops * 1e12 * eta}
        bw = hw.hbm_bw_tbps * 1e12
        self.bw = {"weights": bw * hw.hbm_efficiency_weights, "weights_fp8": bw * fp8_weights,
                   "kv": bw * hw.hbm_efficiency_kv}

    def time(self, flops: float, nbytes: float, precision: str = "bf16", stream: str = "kv") -> tuple[float, bool]:
        """(seconds, limited by HBM?)"""
        tc = flops / self.peak[precision]
        tm = nbytes / self.bw[stream]
        return max(tc, tm), tm >= tc


@dataclass(frozen=True)
class LayerCost:
    """One layer, one micro-batch."""

    compute: float  # kernels, seconds (rooflines and fixed costs)
    hbm_part: float  # of which HBM-bound
    fixed_part: float  # of which fixed kernel costs (floors)
    network: float  # dispatch + combine
    fetch: float  # ESS H2D time on the link
    exposed: float  # of ``fetch``, what the compute stream waits for (after overlap)
    writeback: float  # D2H of the new tokens' latents
    ops: dict[str, float]


def active_experts(local: int, tokens_global: float, arch: ModelArch, routing: str = "uniform") -> float:
    """Expected local experts that receive at least one token. Uniform routing: each of the ``tokens_global`` tokens
    of the EP group picks ``experts_per_token`` of the routed experts independently. Identical routing: every token
    picks the same experts, so the group reads as many experts as one token does."""
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r} (expected one of {', '.join(ROUTINGS)})")
    tokens = min(tokens_global, 1.0) if routing == "identical" else tokens_global
    p_idle = (1.0 - arch.experts_per_token / arch.num_routed_experts) ** tokens
    return local * (1.0 - p_idle)


def exposed_fetch(mode: str, fetch: float, attn: float, indexer: float, kappa: float) -> tuple[float, str]:
    """Time the compute stream waits for the ESS fetch of one layer (and micro-batch), and the mode used.

    sync: fetch, then attend (what SGLang HiSparse does, and the SGLang plugin by default): all of it is exposed.
    dba:  dual-batch attention: half A's fetch runs beside half B's indexer, half B's beside half A's attention.
    auto: per layer, the cheaper of dba and sync (what ESS's offline profiling picks between them).
    ``kappa`` of every overlapped second is lost to SM / HBM sharing (measured, hardware.overlap_interference).
    DA (dual attention) is not modelled: ESS removed it, slower than sync in every configuration its decode harness
    measured (docs/design.md, "Overlap modes").
    """
    if mode not in OVERLAP_MODES:
        raise ValueError(f"unknown overlap mode {mode!r} (expected one of {', '.join(OVERLAP_MODES)})")
    if fetch <= 0:
        return 0.0, mode
    if mode == "sync":
        return fetch, "sync"
    half = fetch / 2
    dba = (max(0.0, half - indexer / 2) + kappa * min(half, indexer / 2)
           + max(0.0, half - attn / 2) + kappa * min(half, attn / 2))
    if mode == "dba":
        return dba, "dba"
    return min((dba, "dba"), (fetch, "sync"))  # auto


def layer_cost(arch: ModelArch, hw: Hardware, roof: Roofline, dep: Deployment, requests: float, tokens: float,
               context: int, kind: str, ess: bool = False, misses: float = 0.0, mode: str = "auto",
               kernels: KernelCounts = SMALL_KERNELS) -> LayerCost:
    """Cost of one layer for one micro-batch of ``requests`` requests and ``tokens`` query tokens.

    kind: "dense" or "moe". ess: latents live in host memory (new tokens are written back); misses: ESS
    misses per request for this layer and step; mode: the overlap mode for the fetch (``exposed_fetch``);
    kernels: how many small kernels a layer launches (``calibration.SMALL_KERNELS``).
    """
    b, t, L = requests, tokens, context
    ops: dict[str, float] = {}
    hbm_part = fixed_part = 0.0

    def run(name: str, flops: float, nbytes: float, precision: str = "bf16", stream: str = "kv",
            fixed_us: float = 0.0) -> float:
        """A kernel: its roofline plus its fixed cost (us)."""
        nonlocal hbm_part, fixed_part
        s, mem = roof.time(flops, nbytes, precision, stream)
        if mem:
            hbm_part += s
        fixed_part += fixed_us * 1e-6
        s += fixed_us * 1e-6
        ops[name] = ops.get(name, 0.0) + s
        return s

    wb, wp = arch.weight_bytes, arch.weight_precision
    ws = "weights_fp8" if wp == "fp8" else "weights"  # the stream class of the projections, FFNs and experts
    floor = hw.kernel_floor_us
    run("attn_proj", 2 * t * arch.attn_fp8_params, wb * arch.attn_fp8_params, wp, ws)
    run("attn_absorb", 2 * t * arch.absorb_bf16_params, 2 * arch.absorb_bf16_params, "bf16", "weights")
    idx = run("indexer", 2 * t * arch.index_heads * arch.index_head_dim * L,
              b * L * arch.indexer_bytes + t * L * 4, "fp8", fixed_us=floor)
    idx += run("topk", 0.0, t * L * 4, fixed_us=hw.topk_fixed_us)
    k = min(arch.index_topk, L)
    attn = run("sparse_mla", t * arch.sparse_attn_flops_per_token * k / arch.index_topk,
               t * k * arch.latent_bytes, "bf16", fixed_us=hw.flashmla_fixed_us)
    small = kernels.per_layer + (kernels.per_dense_layer if kind == "dense" else kernels.per_moe_layer)
    run("small_kernels", 0.0, 0.0, fixed_us=small * floor)

    network = 0.0
    if kind == "dense":
        run("dense_ffn", 2 * t * arch.dense_ffn_params, wb * arch.dense_ffn_params, wp, ws)
    else:
        run("router", 2 * t * arch.router_params, 4 * arch.router_params, "bf16", "weights")
        copies = t * arch.experts_per_token  # token copies this GPU sends (and, balanced, receives)
        active = active_experts(dep.experts_per_gpu, t * dep.ep, arch, dep.routing)
        run("moe_experts", 2 * copies * arch.expert_params, wb * active * arch.expert_params, wp, ws)
        run("shared_expert", 2 * t * arch.num_shared_experts * arch.expert_params,
            wb * arch.num_shared_experts * arch.expert_params, wp, ws)
        if dep.ep > 1:
            local_gpus = min(dep.gpus_per_node, dep.ep)
            remote = (dep.ep - local_gpus) / dep.ep
            local = (local_gpus - 1) / dep.ep  # copies to the GPU itself cross no link
            for per_copy in (arch.dispatch_bytes_per_copy, arch.combine_bytes_per_copy):
                nbytes = copies * per_copy
                network += max(nbytes * remote / (hw.nic_gbps * 1e9), nbytes * local / (hw.nvlink_gbps * 1e9))
                network += hw.ep_latency_us * 1e-6

    fetch = exposed = writeback = 0.0
    if ess:
        writeback = t * arch.latent_bytes / hw.d2h_rate()  # the new tokens' latents go to the host pool
        # the resolve (hot-pool lookup, victims, slot assignment): read the selected indices, probe the slot map,
        # write the slot table; measured fixed cost a layer plus a cost a request
        run("ess_resolve", 0.0, t * k * 12, fixed_us=hw.ess_resolve_us + hw.ess_resolve_per_request_us * b)
    if ess and misses > 0:
        fetch = b * misses * arch.latent_bytes / hw.h2d_rate() + hw.pcie_fetch_latency_us * 1e-6
        exposed, used = exposed_fetch(mode, fetch, attn, idx, hw.overlap_interference)
        ops["ess_exposed_" + used] = exposed
    compute = sum(v for n, v in ops.items() if not n.startswith("ess_exposed_"))
    return LayerCost(compute=compute, hbm_part=hbm_part, fixed_part=fixed_part, network=network, fetch=fetch,
                     exposed=exposed, writeback=writeback, ops=ops)


def decode_step(arch: ModelArch, hw: Hardware, dep: Deployment, eta: float, batch: float, context: int,
                misses_per_layer: Sequence[float] | None = None,
                modes_per_layer: Sequence[str] | None = None, kernels: KernelCounts = SMALL_KERNELS,
                fp8_weights: float = FP8_WEIGHT_EFFICIENCY) -> Breakdown:
    """Time of one decode step on one GPU holding ``batch`` requests of ``context`` tokens.

    misses_per_layer: ESS misses per request and step for each of the ``num_kv_layers`` layers (main layers
    first, then the MTP layer); None runs without ESS (all latents in HBM). modes_per_layer overrides the
    deployment's overlap mode per layer. kernels: the small kernels a layer and a step launch. eta and
    fp8_weights: the fitted compute and fp8 weight-streaming efficiencies (``Roofline``).
    """
    if batch <= 0:
        raise ValueError(f"batch must be > 0 (got {batch})")
    roof = Roofline(hw, eta, fp8_weights)
    q = dep.mtp_tokens
    n_mb = 2 if dep.two_batch_overlap and batch >= 2 else 1
    b = batch / n_mb
    out = Breakdown()
    ess = misses_per_layer is not None
    if ess and len(misses_per_layer) != arch.num_kv_layers:
        raise ValueError(f"misses_per_layer needs {arch.num_kv_layers} values, got {len(misses_per_layer)}")

    def account(costs: list[LayerCost], overlapped: bool) -> None:
        """Add one layer (all its micro-batches) to ``out``."""
        comp = sum(c.compute for c in costs)
        hbm = sum(c.hbm_part for c in costs)
        fixed = sum(c.fixed_part for c in costs)
        expo = sum(c.exposed for c in costs)
        net = sum(c.network for c in costs)
        link = sum(c.fetch for c in costs)
        d2h = sum(c.writeback for c in costs)
        for c in costs:
            for k, v in c.ops.items():
                out.add_op(k, v)
        out.pcie_busy += link
        out.d2h_busy += d2h
        out.network_busy += net
        gpu = comp + expo
        if overlapped:  # TBO: each micro-batch's compute hides the other's network time
            over_net = max(0.0, net - gpu)
            over_link = max(0.0, max(link, d2h) - max(gpu, net))
        else:
            over_net = net
            over_link = max(0.0, max(link, d2h) - (gpu + net))
        out.step += gpu + over_net + over_link
        out.hbm_bound += hbm
        out.fixed += fixed
        out.flops_bound += comp - hbm - fixed
        out.pcie += expo + over_link
        out.network += over_net

    for layer in range(arch.num_layers):
        kind = "dense" if layer < arch.num_dense_layers else "moe"
        m = misses_per_layer[layer] if ess else 0.0
        mode = modes_per_layer[layer] if modes_per_layer else dep.overlap_mode
        cost = layer_cost(arch, hw, roof, dep, b, q * b, context, kind, ess, m, mode, kernels)
        account([cost] * n_mb, overlapped=n_mb == 2)

    def head(tokens: float) -> None:
        params = arch.vocab * arch.hidden
        s, mem = roof.time(2 * tokens * params, 2 * params, "bf16", "weights")
        out.step += s
        out.add_op("lm_head", s)
        out.hbm_bound += s if mem else 0.0
        out.flops_bound += 0.0 if mem else s

    head(q * batch)
    if q > 1:
        # MTP draft: the MTP layer extends over the q verified tokens (proposing the next draft), no TBO,
        # then an LM head over one position per request.
        for j in range(arch.num_mtp_layers):
            idx = arch.num_layers + j
            m = misses_per_layer[idx] if ess else 0.0
            mode = modes_per_layer[idx] if modes_per_layer else dep.overlap_mode
            cost = layer_cost(arch, hw, roof, dep, batch, q * batch, context, "moe", ess, m, mode, kernels)
            account([cost], overlapped=False)
        head(batch)
    # once a step: sampling over the vocabulary, FlashMLA's scheduling metadata, the step's small kernels, and the
    # time the GPU idles between kernels and steps
    per_step = (hw.step_fixed_us + kernels.per_step * hw.kernel_floor_us + hw.step_idle_us) * 1e-6
    out.step += per_step
    out.fixed += per_step
    out.add_op("step_fixed", per_step)
    return out


def per_request_rate(dep: Deployment, step: float) -> float:
    return dep.mtp_acceptance / step


def node_throughput(dep: Deployment, batch: float, step: float) -> float:
    return dep.gpus_per_node * batch * dep.mtp_acceptance / step
