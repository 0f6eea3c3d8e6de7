"""The decode-step model against step times measured in a real SGLang server (``ess simulate --validate``).

`benchmarks/serving.py` writes, per system, context and concurrency, SGLang's own decode rate at its fullest decode
batch (``decode_tok_s`` with ``admitted`` requests decoding at once) and, for ESS, the hit rate. The measured step
time is ``admitted / decode_tok_s``. The model predicts the same step from the served model's config.json (layers,
experts, weight precision), the hardware preset and, for ESS, the misses the hit rate implies (``(1 - hit) x top_k``
per request and layer, fetched before attention: the plugin's default, sync), on one GPU without expert parallelism,
MTP or two-batch overlap. Rows without a decode rate (HiSparse is not modelled) or, for ESS, without a hit rate are
listed as skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ess_sglang.simulator.errors import SimulatorConfigError
from ess_sglang.simulator.hardware import Hardware
from ess_sglang.simulator.model import Deployment, ModelArch, decode_step

MODELLED = ("hbm", "ess")


def arch_from_hf_config(path: Path) -> ModelArch:
    """A DeepSeek-V3.2-shaped ModelArch from a Hugging Face config.json (bf16 weights unless it declares fp8)."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SimulatorConfigError(f"--model-config {path}: not a readable config.json ({exc})") from None
    need = ("num_hidden_layers", "hidden_size", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise SimulatorConfigError(f"--model-config {path}: not a DeepSeek-V3-style config (missing "
                                   f"{', '.join(missing)})")
    quant = cfg.get("quantization_config") or {}
    fp8 = "fp8" in str(quant.get("quant_method", "")).lower() or "fp8" in str(quant.get("fmt", "")).lower()
    return ModelArch(
        hidden=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
        num_dense_layers=cfg.get("first_k_dense_replace", 0), num_mtp_layers=cfg.get("num_nextn_predict_layers", 0),
        q_lora_rank=cfg.get("q_lora_rank", 1536), kv_lora_rank=cfg.get("kv_lora_rank", 512),
        qk_nope_dim=cfg.get("qk_nope_head_dim", 128), qk_rope_dim=cfg.get("qk_rope_head_dim", 64),
        v_head_dim=cfg.get("v_head_dim", 128), num_heads=cfg.get("num_attention_heads", 128),
        dense_intermediate=cfg.get("intermediate_size", 18432), moe_intermediate=cfg["moe_intermediate_size"],
        num_routed_experts=cfg["n_routed_experts"], num_shared_experts=cfg.get("n_shared_experts", 1),
        experts_per_token=cfg["num_experts_per_tok"], vocab=cfg.get("vocab_size", 129280),
        index_heads=cfg.get("index_n_heads", 64), index_head_dim=cfg.get("index_head_dim", 128),
        index_topk=cfg.get("index_topk", 2048), weight_bytes=1 if fp8 else 2)


@dataclass(frozen=True)
class Check:
    system: str
    name: str
    context: int
    batch: int
    measured_ms: float | None
    predicted_ms: float | None
    hit_rate: float | None
    bottleneck: str | None
    skipped: str | None = None

    @property
    def error(self) -> float | None:
        if self.measured_ms is None or self.predicted_ms is None:
            return None
        return self.predicted_ms / self.measured_ms - 1.0

    def to_dict(self) -> dict[str, Any]:
        return dict(system=self.system, name=self.name, context=self.context, batch=self.batch,
                    measured_ms=self.measured_ms, predicted_ms=self.predicted_ms, error=self.error,
                    hit_rate=self.hit_rate, bottleneck=self.bottleneck, skipped=self.skipped)


def validate_serving(paths: list[Path], arch: ModelArch, hw: Hardware, eta: float) -> list[Check]:
    """Predict every measured decode step of the serving runs in `paths` (serving.json files)."""
    dep = Deployment(ep=1, gpus_per_node=1, experts_per_gpu=arch.num_routed_experts, mtp_tokens=1,
                     mtp_acceptance=1.0, two_batch_overlap=False, overlap_mode="sync")
    out = []
    for path in paths:
        try:
            runs = json.loads(Path(path).read_text())["runs"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SimulatorConfigError(f"--validate {path}: not a serving.json of benchmarks/serving.py "
                                       f"({exc})") from None
        for r in runs:
            if not r.get("concurrency"):
                continue
            system, name = r["system"], r.get("name") or r["system"]
            batch, rate = int(r.get("admitted") or 0), r.get("decode_tok_s")
            base = dict(system=system, name=name, context=int(r["context"]), batch=batch, hit_rate=r.get("hit_rate"))
            if system not in MODELLED:
                out.append(Check(**base, measured_ms=None, predicted_ms=None, bottleneck=None,
                                 skipped=f"{system} is not modelled"))
                continue
            if not rate or batch <= 0:
                out.append(Check(**base, measured_ms=None, predicted_ms=None, bottleneck=None,
                                 skipped="no decode rate in the run"))
                continue
            misses = None
            if system == "ess":
                if r.get("hit_rate") is None:
                    out.append(Check(**base, measured_ms=batch / rate * 1e3, predicted_ms=None, bottleneck=None,
                                     skipped="no hit rate in the run"))
                    continue
                misses = [(1.0 - r["hit_rate"]) * min(arch.index_topk, base["context"])] * arch.num_kv_layers
            step = decode_step(arch, hw, dep, eta, batch, base["context"], misses)
            out.append(Check(**base, measured_ms=batch / rate * 1e3, predicted_ms=step.step * 1e3,
                             bottleneck=step.bottleneck()))
    return out


def print_checks(checks: list[Check]) -> None:
    print(f"{'server':12} {'context':>8} {'batch':>5} {'hit':>6} {'measured ms':>11} {'predicted ms':>12} "
          f"{'error':>7}  bottleneck")
    for c in checks:
        hit = f"{c.hit_rate:.3f}" if c.hit_rate is not None else "-"
        if c.skipped:
            print(f"{c.name:12} {c.context:>8} {c.batch:>5} {hit:>6} {'':>11} {'':>12} {'':>7}  skipped: {c.skipped}")
            continue
        print(f"{c.name:12} {c.context:>8} {c.batch:>5} {hit:>6} {c.measured_ms:>11.2f} {c.predicted_ms:>12.2f} "
              f"{c.error:>+7.0%}  {c.bottleneck}")
    errs = [abs(c.error) for c in checks if c.error is not None]
    if errs:
        print(f"{len(errs)} steps predicted; largest error {max(errs):.0%}, "
              f"{sum(e <= 0.15 for e in errs)} within 15%")
