"""The decode-step model against step times measured in a real SGLang server (``ess simulate --validate``).

`benchmarks/serving.py` writes, per system, context and concurrency, SGLang's own decode rate at its fullest decode
batch (``decode_tok_s`` with ``admitted`` requests decoding at once) and, for ESS, the hit rate. The measured step
time is ``admitted / decode_tok_s``. The model predicts the same step from the served model's config.json (layers,
experts, weight precision), the hardware preset of the GPU the run names (``device``: an H200 run with ``h200``, an
H100 run with ``h100``; ``--hardware`` overrides) and, for ESS, the misses the hit rate implies (``(1 - hit) x
top_k`` per request and layer, fetched before attention: the plugin's default, sync), on one GPU without expert
parallelism, MTP or two-batch overlap. Rows without a decode rate (HiSparse is not modelled) or, for ESS, without a
hit rate are listed as skipped.

Routing: the serving runs load dummy weights (``--load-format dummy``, benchmarks/sglang_server.py), whose router
sends every token of a batch to the same experts: SGLang's profiler measured the routed experts' kernel
(``fused_moe_kernel``) at 1,705 us a step with 8 requests and 1,710 us with one (H100, 32K,
benchmarks/results/serving/h100_32k_profile*/profile_hbm.json), where uniform routing would read 16 experts instead
of 8 at 8 requests. So the default routing here is "identical"; "uniform" (a real model's) is what the scenarios use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ess_sglang.simulator.errors import SimulatorConfigError
from ess_sglang.simulator.hardware import Hardware, load_hardware
from ess_sglang.simulator.model import Deployment, ModelArch, decode_step

MODELLED = ("hbm", "ess")
DEVICE_PRESETS = (("H200", "h200"), ("H100", "h100"))
"""(substring of the ``device`` a serving.json names, hardware preset)"""


def preset_for_device(device: str | None) -> str | None:
    """The hardware preset for a GPU name as nvidia-smi reports it (``NVIDIA H200``), or None."""
    for key, preset in DEVICE_PRESETS:
        if device and key in device.upper():
            return preset
    return None


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
    hardware: str
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
        return dict(hardware=self.hardware, system=self.system, name=self.name, context=self.context, batch=self.batch,
                    measured_ms=self.measured_ms, predicted_ms=self.predicted_ms, error=self.error,
                    hit_rate=self.hit_rate, bottleneck=self.bottleneck, skipped=self.skipped)


def validate_serving(paths: list[Path], arch: ModelArch, hw: Hardware | None, eta: float,
                     routing: str = "identical") -> list[Check]:
    """Predict every measured decode step of the serving runs in `paths` (serving.json files). ``hw`` None: each
    file's own GPU (``preset_for_device``)."""
    dep = Deployment(ep=1, gpus_per_node=1, experts_per_gpu=arch.num_routed_experts, mtp_tokens=1,
                     mtp_acceptance=1.0, two_batch_overlap=False, overlap_mode="sync", routing=routing)
    out = []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
            runs = doc["runs"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SimulatorConfigError(f"--validate {path}: not a serving.json of benchmarks/serving.py "
                                       f"({exc})") from None
        file_hw = hw
        if file_hw is None:
            preset = preset_for_device(doc.get("device"))
            if preset is None:
                raise SimulatorConfigError(f"--validate {path}: no hardware preset for its device "
                                           f"{doc.get('device')!r}; pass --hardware")
            file_hw = load_hardware(preset)
        for r in runs:
            if not r.get("concurrency"):
                continue
            system, name = r["system"], r.get("name") or r["system"]
            batch, rate = int(r.get("admitted") or 0), r.get("decode_tok_s")
            base = dict(hardware=file_hw.name, system=system, name=name, context=int(r["context"]), batch=batch,
                        hit_rate=r.get("hit_rate"))
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
            step = decode_step(arch, file_hw, dep, eta, batch, base["context"], misses)
            out.append(Check(**base, measured_ms=batch / rate * 1e3, predicted_ms=step.step * 1e3,
                             bottleneck=step.bottleneck()))
    return out


def print_checks(checks: list[Check]) -> None:
    print(f"{'hardware':8} {'server':12} {'context':>8} {'batch':>5} {'hit':>6} {'measured ms':>11} "
          f"{'predicted ms':>12} {'error':>7}  bottleneck")
    for c in checks:
        hit = f"{c.hit_rate:.3f}" if c.hit_rate is not None else "-"
        head = f"{c.hardware:8} {c.name:12} {c.context:>8} {c.batch:>5} {hit:>6}"
        if c.skipped:
            print(f"{head} {'':>11} {'':>12} {'':>7}  skipped: {c.skipped}")
            continue
        print(f"{head} {c.measured_ms:>11.2f} {c.predicted_ms:>12.2f} {c.error:>+7.1%}  {c.bottleneck}")
    errs = [abs(c.error) for c in checks if c.error is not None]
    if errs:
        print(f"{len(errs)} steps predicted; largest error {max(errs):.1%}, "
              f"{sum(e <= 0.15 for e in errs)} within 15%")
