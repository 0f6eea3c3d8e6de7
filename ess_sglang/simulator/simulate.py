"""Run a scenario: capacity, the table rows (batch, pool ratio, throughput, bottleneck) and the sweep for the plot."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ess_sglang.simulator.calibration import FIT_ROWS, FP8_WEIGHT_EFFICIENCY, KERNEL_EFFICIENCY
from ess_sglang.simulator.capacity import Capacity, capacity
from ess_sglang.simulator.model import DSV32, Deployment, ModelArch, decode_step, node_throughput, per_request_rate
from ess_sglang.simulator.scenario import LoadedScenario
from ess_sglang.simulator.traffic import MissModel, geometric_spread, hit_rate, load_profile


@dataclass
class Row:
    batch: int
    ess: bool  # latents offloaded (pool ratio < 1)
    fits: bool
    limit: str  # what stops a larger batch ("" when it fits)
    ratio: float | None = None
    step_ms: float | None = None
    per_request: float | None = None  # output tokens/s per request
    throughput: float | None = None  # output tokens/s per node
    throughput_cluster: float | None = None
    bottleneck: str = ""
    shares_ms: dict[str, float] = field(default_factory=dict)
    mean_misses: float = 0.0  # per request, layer and step
    hit_rate: float = 1.0
    pcie_busy_share: float = 0.0  # H2D link time / step time
    network_busy_share: float = 0.0
    per_op_ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Simulator:
    def __init__(self, loaded: LoadedScenario, eta: float = KERNEL_EFFICIENCY, arch: ModelArch = DSV32,
                 fp8_weights: float = FP8_WEIGHT_EFFICIENCY):
        self.loaded, self.eta, self.arch, self.fp8_weights = loaded, eta, arch, fp8_weights
        sc, hw = loaded.scenario, loaded.hardware
        self.hw = hw
        total_experts = arch.num_routed_experts + sc.cluster.redundant_experts
        self.dep = Deployment(
            ep=loaded.ep, gpus_per_node=hw.gpus_per_node, experts_per_gpu=math.ceil(total_experts / loaded.ep),
            mtp_tokens=sc.serving.mtp_tokens, mtp_acceptance=sc.serving.mtp_acceptance,
            two_batch_overlap=sc.serving.two_batch_overlap, overlap_mode=sc.ess.overlap)
        self.context = sc.serving.context_tokens
        self.cap: Capacity = capacity(arch, hw, self.context, self.dep.experts_per_gpu,
                                      sc.serving.mem_fraction_static, self.dep.mtp_tokens, sc.ess.min_pool_ratio)
        mm = sc.ess.miss_model
        if mm.profile:
            path = loaded.base_dir / mm.profile  # an absolute profile path stays as it is
            self.misses = MissModel.from_profile(arch, load_profile(path, arch, "scenario.ess.miss_model.profile"),
                                                 mm.alpha)
        else:
            ref = geometric_spread(mm.ref_misses_min, mm.ref_misses_max, arch.num_layers)
            self.misses = MissModel(arch, ref, mm.ref_ratio, mm.ref_context_tokens, mm.alpha)

    def with_eta(self, eta: float, fp8_weights: float | None = None) -> Simulator:
        """The same scenario at another compute efficiency (and, if given, fp8 weight-streaming efficiency)."""
        other = object.__new__(Simulator)
        other.__dict__.update(self.__dict__)
        other.eta = eta
        if fp8_weights is not None:
            other.fp8_weights = fp8_weights
        return other

    def run_batch(self, batch: int, ess: bool | None = None, ratio: float | None = None) -> Row:
        """One batch. ess=None: without ESS if the batch fits in HBM, else with ESS at the largest pool ratio
        HBM allows. ratio forces a pool ratio (ESS on)."""
        cap, arch, dep = self.cap, self.arch, self.dep
        fits_plain, _ = cap.fits(batch, ess=False)
        if ess is None:
            ess = not fits_plain and self.loaded.scenario.ess.enabled
        if ess:
            r = ratio if ratio is not None else cap.ratio_at(batch)
            fits, limit = cap.fits(batch, ess=True)
            if fits and r < cap.ratio_min:  # a forced ratio below the hot-pool floor
                fits, limit = False, "hot_pool_min"
            if ratio is None and r >= 1.0:
                ess = False  # the whole latent cache fits: nothing to offload
        else:
            r = 1.0
            fits, limit = fits_plain, "" if fits_plain else "hbm"
        row = Row(batch=batch, ess=ess, fits=fits, limit="" if fits else limit, ratio=r if fits else None)
        if not fits:
            return row
        misses = self.misses.misses(r, self.context, dep.mtp_tokens) if ess else None
        modes = self.misses.modes if ess else None
        bd = decode_step(arch, self.hw, dep, self.eta, batch, self.context, misses, modes,
                         fp8_weights=self.fp8_weights)
        row.step_ms = bd.step * 1e3
        row.per_request = per_request_rate(dep, bd.step)
        row.throughput = node_throughput(dep, batch, bd.step)
        row.throughput_cluster = row.throughput * self.loaded.scenario.cluster.nodes
        row.bottleneck = bd.bottleneck()
        row.shares_ms = {"HBM bandwidth": bd.hbm_bound * 1e3, "compute": bd.flops_bound * 1e3,
                         "kernel floors": bd.fixed * 1e3, "network": bd.network * 1e3, "PCIe": bd.pcie * 1e3}
        row.pcie_busy_share = bd.pcie_busy / bd.step
        row.network_busy_share = bd.network_busy / bd.step
        row.per_op_ms = {k: v * 1e3 for k, v in sorted(bd.per_op.items())}
        if misses is not None:
            row.mean_misses = sum(misses) / len(misses)
            row.hit_rate = hit_rate(misses, dep.mtp_tokens, arch, self.context)
        return row

    def ideal(self, batch: int) -> Row:
        """Without ESS, as if HBM held any batch (the reference for ESS's cost)."""
        dep = self.dep
        bd = decode_step(self.arch, self.hw, dep, self.eta, batch, self.context, fp8_weights=self.fp8_weights)
        return Row(batch=batch, ess=False, fits=True, limit="", ratio=1.0, step_ms=bd.step * 1e3,
                   per_request=per_request_rate(dep, bd.step), throughput=node_throughput(dep, batch, bd.step),
                   bottleneck=bd.bottleneck())

    def sweep_batches(self, last: int) -> list[int]:
        sw = self.loaded.scenario.sweep
        grid = {1, 2, *range(sw.step, sw.max_batch + 1, sw.step)}
        return sorted(b for b in grid | {last} if b <= min(last, sw.max_batch))

    def sweep(self, mode: str) -> list[Row]:
        """mode: "without_ess" (up to the HBM capacity), "with_ess" (up to the ESS bound),
        "without_ess_unlimited_hbm" (over the ESS range, ignoring capacity)."""
        if mode == "without_ess":
            return [self.run_batch(b, ess=False) for b in self.sweep_batches(self.cap.max_batch_without_ess())]
        last = self.cap.max_batch_with_ess()[0]
        if mode == "with_ess":
            rows = [self.run_batch(b) for b in self.sweep_batches(last)]
            return [r for r in rows if r.fits]
        if mode == "without_ess_unlimited_hbm":
            return [self.ideal(b) for b in self.sweep_batches(last)]
        raise ValueError(f"unknown sweep {mode!r}")


def run_scenario(loaded: LoadedScenario, eta: float = KERNEL_EFFICIENCY,
                 fp8_weights: float = FP8_WEIGHT_EFFICIENCY) -> dict[str, Any]:
    """Everything ``ess simulate`` prints and writes, as one JSON-able mapping."""
    sim = Simulator(loaded, eta, fp8_weights=fp8_weights)
    sc = loaded.scenario
    max_ess, ess_limit = sim.cap.max_batch_with_ess()
    rows = [sim.run_batch(b) for b in sc.batches]
    out: dict[str, Any] = {
        "scenario": sc.model_dump(mode="json"),
        "hardware": loaded.hardware.model_dump(mode="json"),
        "kernel_efficiency": eta,
        "fp8_weight_efficiency": fp8_weights,
        "deployment": asdict(sim.dep),
        "capacity": {**sim.cap.summary(), "max_batch_with_ess": max_ess, "max_batch_with_ess_limited_by": ess_limit,
                     "ess_bounds": sim.cap.ess_bounds()},
        "rows": [r.to_dict() for r in rows],
        "sweep": {mode: [_point(r) for r in sim.sweep(mode)] if sc.ess.enabled or mode == "without_ess" else []
                  for mode in ("without_ess", "with_ess", "without_ess_unlimited_hbm")},
    }
    if sc.reference is not None:
        out["reference"] = compare(sc.reference, rows, sim.cap.max_batch_without_ess())
    return out


def _point(r: Row) -> dict[str, Any]:
    return {"batch": r.batch, "ratio": r.ratio, "throughput": r.throughput, "per_request": r.per_request,
            "bottleneck": r.bottleneck}


def compare(reference, rows: list[Row], max_plain: int) -> dict[str, Any]:
    by_batch = {r.batch: r for r in rows}
    comp = []
    for ref in reference.rows:
        r = by_batch.get(ref.batch)
        if r is None or not r.fits:
            comp.append({"batch": ref.batch, "fits": False})
            continue
        comp.append({
            "batch": ref.batch,
            "ratio": r.ratio, "ratio_ref": ref.ratio,
            "throughput": r.throughput, "throughput_ref": ref.throughput,
            "throughput_error": r.throughput / ref.throughput - 1,
            "per_request": r.per_request, "per_request_ref": ref.per_request,
            "per_request_error": r.per_request / ref.per_request - 1,
        })
    return {"source": reference.source, "rows": comp, "max_batch_without_ess": max_plain,
            "max_batch_without_ess_ref": reference.max_batch_without_ess}


def fit_kernel_efficiency(loaded, batch: int = FIT_ROWS[0][0], per_request: float = FIT_ROWS[0][1],
                          fp8_weights: float = FP8_WEIGHT_EFFICIENCY, tol: float = 1e-7) -> float:
    """The compute efficiency at which the baseline (no ESS) per-request rate at ``batch`` equals ``per_request``,
    at the given fp8 weight-streaming efficiency. Raises ValueError if even a compute efficiency of 1 is too slow."""
    sim = Simulator(loaded, eta=1.0, fp8_weights=fp8_weights)
    lo, hi = 1e-3, 1.0
    if sim.with_eta(hi).run_batch(batch, ess=False).per_request < per_request:
        raise ValueError("even eta = 1 is slower than the target rate")
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if sim.with_eta(mid).run_batch(batch, ess=False).per_request < per_request:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def fit_efficiencies(loaded, rows=FIT_ROWS, tol: float = 1e-5) -> tuple[float, float]:
    """(compute efficiency, fp8 weight-streaming efficiency) that reproduce both ``rows`` ((batch, per-request rate)
    pairs: a baseline row without ESS, then a larger batch) exactly. For each fp8 weight efficiency the compute
    efficiency is fitted on the first row; the fp8 weight efficiency is then bisected on the second row, whose rate
    falls as it rises (a faster weight stream leaves more of the first row's step to FLOP-bound work, which grows
    with the batch)."""
    (b1, r1), (b2, r2) = rows

    def second_row_high(fp8_weights: float) -> tuple[bool, float]:
        """(second row faster than the target?, compute efficiency fitted on the first row)"""
        try:
            eta = fit_kernel_efficiency(loaded, b1, r1, fp8_weights, tol=tol / 10)
        except ValueError:  # weights so slow the first row cannot be reached: move up
            return True, 1.0
        rate = Simulator(loaded, eta, fp8_weights=fp8_weights).run_batch(b2).per_request
        return rate > r2, eta

    lo, hi = 0.05, 1.0
    if second_row_high(hi)[0]:
        raise ValueError("even an fp8 weight efficiency of 1 leaves the second row faster than its target")
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if second_row_high(mid)[0]:
            lo = mid
        else:
            hi = mid
    fp8_weights = (lo + hi) / 2
    return second_row_high(fp8_weights)[1], fp8_weights
