"""Hardware description of one decode node (8 GPUs, their HBM, links and host memory), loaded from YAML.

A hardware file is a flat mapping (``configs/hardware/h200.yaml`` is an example); every number is per GPU
unless its name says ``node``. Rates are in decimal units (GB/s = 1e9 B/s, TB/s = 1e12 B/s, TFLOPS = 1e12
FLOP/s); capacities are in GiB (2**30 B), as drivers report them. Unknown fields are errors, and every
error names its field (``hardware.hbm_bw_tbps: ...``).

Presets are looked up by name in ``configs/hardware/<name>.yaml`` of the checkout: ``h800``, ``h20``,
``h200``, ``h100``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr

from ess_sglang.simulator.errors import SimulatorConfigError, read_yaml, validate

GIB = 2**30
REPO_ROOT = Path(__file__).resolve().parents[2]
HARDWARE_DIR = REPO_ROOT / "configs" / "hardware"


def _positive(v: float) -> float:
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"must be a finite number > 0 (got {v!r})")
    return v


def _fraction(v: float) -> float:
    if not (math.isfinite(v) and 0 <= v <= 1):
        raise ValueError(f"must be in [0, 1] (got {v!r})")
    return v


def _share(v: float) -> float:
    if not (math.isfinite(v) and 0 < v <= 1):
        raise ValueError(f"must be in (0, 1] (got {v!r})")
    return v


def _non_negative(v: float) -> float:
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"must be a finite number >= 0 (got {v!r})")
    return v


Positive = Annotated[float, Field(strict=False), AfterValidator(_positive)]
NonNegative = Annotated[float, Field(strict=False), AfterValidator(_non_negative)]
Fraction = Annotated[float, Field(strict=False), AfterValidator(_fraction)]
Share = Annotated[float, Field(strict=False), AfterValidator(_share)]


class Hardware(BaseModel):
    """One node of the decode cluster. Per GPU unless the name says ``node``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: StrictStr
    description: StrictStr = ""
    gpus_per_node: StrictInt = Field(gt=0)

    # --- the GPU
    hbm_gib: Positive
    """HBM the driver reports (GiB)."""
    hbm_bw_tbps: Positive
    """Peak HBM bandwidth (TB/s)."""
    fp8_tflops: Positive
    """Dense FP8 tensor-core peak (TFLOPS, no sparsity)."""
    bf16_tflops: Positive
    """Dense BF16 tensor-core peak (TFLOPS, no sparsity)."""

    # --- what decode kernels reach on it (measured; see configs/hardware/h200.yaml for the sources)
    hbm_efficiency_weights: Share = 0.86
    """Share of ``hbm_bw_tbps`` that the bf16 (and fp32) weight-streaming GEMMs of a decode step reach (projections,
    experts, LM head, with their own launch and split-K costs). Fp8 weights stream at the fitted
    ``calibration.FP8_WEIGHT_EFFICIENCY`` instead."""
    hbm_efficiency_kv: Share = 0.86
    """Share of ``hbm_bw_tbps`` that the KV-streaming kernels reach (the indexer over the indexer cache, sparse
    attention's latents, top-k's logits, ESS's bookkeeping)."""
    kernel_floor_us: NonNegative = 2.4
    """Time of one small kernel of a decode layer (norms, RoPE, activations, quantisation, cache stores, routing
    bookkeeping: ``calibration.SMALL_KERNELS`` counts them); also the indexer's fixed cost (us)."""
    flashmla_fixed_us: NonNegative = 20.4
    """Fixed cost of FlashMLA's sparse decode and its split-KV combine, per layer and micro-batch (us)."""
    topk_fixed_us: NonNegative = 9.8
    """Fixed cost of SGLang's decode top-k over the indexer logits, per layer and micro-batch (us)."""
    step_fixed_us: NonNegative = 69.0
    """Fixed cost once a step: sampling over the vocabulary and FlashMLA's scheduling metadata (us)."""
    step_idle_us: NonNegative = 170.0
    """Time a step leaves the GPU idle between its kernels and between steps (us)."""
    ess_resolve_us: NonNegative = 14.5
    """ESS's resolve (hot-pool lookup, victims, slot assignment) per layer and micro-batch at one request (us)."""
    ess_resolve_per_request_us: NonNegative = 0.095
    """What each request of the micro-batch adds to the resolve (us)."""

    # --- expert-parallel network
    nvlink_gbps: Positive
    """All-to-all bandwidth one GPU achieves to GPUs of its own node (GB/s, one direction)."""
    nic_gbps: Positive
    """RDMA bandwidth per GPU to other nodes (GB/s, one direction)."""
    ep_latency_us: NonNegative
    """Fixed time of one MoE dispatch or combine, on top of its bytes / bandwidth (us)."""

    # --- PCIe between the GPU and pinned host memory
    pcie_gen: StrictInt = Field(ge=3, le=7)
    pcie_bulk_gbps: Positive
    """Bulk pinned copy rate (GB/s); the ceiling for the two rates below."""
    pcie_h2d_gbps: Positive
    """Scattered 656-B host->GPU gather rate that ESS's fetch kernel reaches (GB/s)."""
    pcie_d2h_gbps: Positive
    """Scattered 656-B GPU->host scatter rate (GB/s), for writing new tokens back."""
    pcie_h2d_all_gpus_share: Share = 1.0
    """Share of its own gather rate a GPU keeps while every GPU of the node gathers at once
    (benchmarks/multi_gpu.py)."""
    pcie_d2h_all_gpus_share: Share = 1.0
    """The same for the scatter (write-back) rate."""
    pcie_fetch_latency_us: NonNegative = 3.0
    """Fixed time of one fetch kernel (us)."""
    overlap_interference: Fraction = 0.19
    """When a fetch runs beside attention, this fraction of the overlapped time is lost (SM and HBM sharing)."""

    # --- host
    host_mem_gib_node: Positive
    """Host memory per node (GiB)."""
    host_mem_usable_fraction: Fraction = 0.9
    """Share of host memory that may be pinned for latents (the rest: OS, SGLang, staging)."""
    host_mem_bw_gbps_node: Positive
    """Host memory bandwidth per node (GB/s); the GPUs' fetches share it."""

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * GIB

    @property
    def host_latent_bytes_node(self) -> float:
        return self.host_mem_gib_node * GIB * self.host_mem_usable_fraction

    def _h2d_link_gbps(self) -> float:
        """The gather kernel's rate on the link (at most bulk), less what the node's other GPUs take."""
        return min(self.pcie_h2d_gbps, self.pcie_bulk_gbps) * self.pcie_h2d_all_gpus_share

    def h2d_rate(self) -> float:
        """Effective host->GPU fetch rate per GPU (B/s) with every GPU of the node fetching: the kernel's rate on
        the link, less what concurrent GPUs take, and the host memory's share."""
        return 1e9 * min(self._h2d_link_gbps(), self.host_mem_bw_gbps_node / self.gpus_per_node)

    def d2h_rate(self) -> float:
        link = min(self.pcie_d2h_gbps, self.pcie_bulk_gbps) * self.pcie_d2h_all_gpus_share
        return 1e9 * min(link, self.host_mem_bw_gbps_node / self.gpus_per_node)

    def h2d_limited_by(self) -> str:
        rates = {"pcie": self._h2d_link_gbps(),
                 "host_memory_bw": self.host_mem_bw_gbps_node / self.gpus_per_node}
        return min(rates, key=rates.__getitem__)


def preset_names() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml")) if HARDWARE_DIR.is_dir() else []


def resolve_hardware_path(ref: str, base_dir: Path | None = None) -> Path:
    """A preset name (``h200``) or a path (absolute, or relative to ``base_dir`` or the working directory)."""
    candidates = []
    if ref.endswith((".yaml", ".yml")) or "/" in ref:
        p = Path(ref)
        candidates += [p] if p.is_absolute() else ([base_dir / p] if base_dir else []) + [p, REPO_ROOT / p]
    else:
        candidates += [HARDWARE_DIR / f"{ref}.yaml"]
        if base_dir is not None:
            candidates += [base_dir / ".." / "hardware" / f"{ref}.yaml"]
    for c in candidates:
        if c.is_file():
            return c
    names = ", ".join(preset_names()) or f"none found in {HARDWARE_DIR}"
    raise SimulatorConfigError(f"hardware: no hardware file {ref!r} (presets: {names})")


def load_hardware(ref: str | Path, overrides: dict[str, Any] | None = None, base_dir: Path | None = None,
                  root: str = "hardware") -> Hardware:
    """Load a preset or file, apply ``overrides`` (same field names), and validate."""
    path = resolve_hardware_path(str(ref), base_dir)
    data = read_yaml(path, root)
    if overrides:
        unknown = [k for k in overrides if k not in Hardware.model_fields]
        if unknown:
            raise SimulatorConfigError([f"scenario.hardware_overrides.{k}: unknown hardware field" for k in unknown])
        data.update(overrides)
    return validate(Hardware, data, root)
