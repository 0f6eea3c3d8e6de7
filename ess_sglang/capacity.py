"""How many long-context requests fit on one GPU, with and without ESS; the ``ess plan`` command.

Without ESS the GPU holds, for every token of every admitted request, the latent entry and the indexer
entry of every layer. With ESS it holds the indexer entries of every token plus a hot pool of latent
entries (``ratio`` x the admitted requests' tokens, or a fixed size); the latents live in host memory.

Numbers are per KV cache: one GPU under attention DP (with attention TP the latent cache is replicated,
so the same numbers hold per TP group). This module must not import torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictStr

from ess_sglang.config import GIB, EssConfigError, NonNegativeInt, PositiveInt, load_config, validate_mapping
from ess_sglang.entry_sizes import INDEXER_ENTRY_BYTES, LATENT_ENTRY_BYTES  # noqa: F401  (bytes per token and layer)

FACTORS = ("hbm", "host_memory", "indexer_cache", "hot_pool_min")
"""What can limit the number of requests (see ``plan_capacity``)."""


class ModelSpec(BaseModel):
    """The cache-relevant numbers of a DeepSeek Sparse Attention model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: StrictStr
    num_layers: PositiveInt
    latent_bytes_per_token_layer: PositiveInt = LATENT_ENTRY_BYTES
    indexer_bytes_per_token_layer: PositiveInt = INDEXER_ENTRY_BYTES
    weights_bytes_per_gpu: NonNegativeInt | None = None
    """Weight bytes one GPU holds (depends on the parallelism); used with ``ess plan --gpu-gb``."""
    top_k: PositiveInt = 2048

    @property
    def latent_bytes_per_token(self) -> int:
        return self.latent_bytes_per_token_layer * self.num_layers

    @property
    def indexer_bytes_per_token(self) -> int:
        return self.indexer_bytes_per_token_layer * self.num_layers

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], root: str = "model") -> ModelSpec:
        """Validate a mapping (raises EssConfigError naming ``root.<key>``)."""
        return validate_mapping(cls, data, root)


MODEL_PRESETS: dict[str, ModelSpec] = {
    # design brief (docs/design.md): 61 layers, kv_lora_rank 512 + rope 64 (V32 fp8), index head dim 128, top-k 2048.
    "deepseek-v3.2-exp": ModelSpec(name="deepseek-v3.2-exp", num_layers=61, top_k=2048),
    # GLM-5 / GLM-5.1 (GlmMoeDsaForCausalLM): 78 layers (3 dense + 75 MoE), kv_lora_rank 512, rope 64,
    # index head dim 128, index_topk 2048 (GLM-5 technical report; NVIDIA Megatron-Bridge model notes).
    "glm-5": ModelSpec(name="glm-5", num_layers=78, top_k=2048),
}


class Limit(BaseModel):
    """Requests that fit under one setting, what limits them, and the bound each factor sets."""

    model_config = ConfigDict(frozen=True)

    requests: int
    limited_by: str
    """The binding factor: the key of ``bounds`` with the smallest value."""
    bounds: dict[str, int]
    """Factor -> the most requests it allows on its own."""
    detail: str
    """The arithmetic behind the binding bound, in words."""


class CapacityReport(BaseModel):
    """``plan_capacity``'s answer for one context length."""

    model_config = ConfigDict(frozen=True)

    model: str
    context_len: int
    q_tokens_per_step: int
    ratio: float | None
    """Hot-pool ratio (None when the hot pool has a fixed size)."""
    hot_pool_bytes: int | None
    """Fixed hot-pool size, all layers (None when it scales with ``ratio``)."""
    hbm_kv_budget_bytes: int
    host_memory_bytes: int
    latent_bytes_per_request: int
    indexer_bytes_per_request: int
    hot_slots_min_per_request: int
    """Hot slots per layer one request needs in a step: q_tokens_per_step x (min(top_k, context) + 1)."""
    without_ess: Limit
    with_ess: Limit
    gain: float | None
    """with_ess.requests / without_ess.requests (None when nothing fits without ESS)."""


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _limit(bounds: dict[str, int], details: dict[str, str]) -> Limit:
    binding = min(bounds, key=bounds.__getitem__)  # ties go to the first listed
    return Limit(requests=bounds[binding], limited_by=binding, bounds=bounds, detail=details[binding])


def plan_capacity(model: ModelSpec, hbm_kv_budget_bytes: int, host_memory_bytes: int, context_len: int,
                  ratio: float | None, q_tokens_per_step: int = 1, *,
                  hot_pool_bytes: int | None = None) -> CapacityReport:
    """Requests of ``context_len`` tokens that fit in ``hbm_kv_budget_bytes`` of GPU memory, without and with ESS.

    With ESS the hot pool is ``ratio`` x the admitted requests' tokens per layer, or, when ``hot_pool_bytes``
    is given instead (all layers), that fixed size. Factors:
      hbm            the GPU holds every request's indexer entries and its share of the ratio-sized hot pool
                     (without ESS: latent + indexer entries of every token);
      host_memory    host memory holds every request's latents;
      indexer_cache  with a fixed hot pool, the GPU memory left beside it holds the indexer entries;
      hot_pool_min   the hot pool must hold each request's selections plus its new tokens every step
                     (q x (min(top_k, context) + 1) slots per layer), even when ``ratio`` asks for less.
    """
    if (ratio is None) == (hot_pool_bytes is None):
        raise ValueError("give exactly one of ratio and hot_pool_bytes")
    for name, value in [("hbm_kv_budget_bytes", hbm_kv_budget_bytes), ("host_memory_bytes", host_memory_bytes),
                        ("context_len", context_len), ("q_tokens_per_step", q_tokens_per_step)]:
        if not value > 0:
            raise ValueError(f"{name} must be > 0 (got {value})")
    if ratio is not None and not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1] (got {ratio})")
    if hot_pool_bytes is not None and hot_pool_bytes <= 0:
        raise ValueError(f"hot_pool_bytes must be > 0 (got {hot_pool_bytes})")

    slot = model.latent_bytes_per_token  # one hot slot in every layer
    latent = context_len * model.latent_bytes_per_token
    indexer = context_len * model.indexer_bytes_per_token
    floor = q_tokens_per_step * (min(model.top_k, context_len) + 1)
    hbm, host = hbm_kv_budget_bytes, host_memory_bytes

    without = _limit({"hbm": hbm // (latent + indexer)},
                     {"hbm": f"{_size(hbm)} HBM / {_size(latent + indexer)} latent + indexer per request"})

    host_bound = host // latent
    details = {"host_memory": f"{_size(host)} host memory / {_size(latent)} latents per request"}
    if ratio is not None:
        hot = math.ceil(ratio * context_len - 1e-9)
        bounds = {"hbm": hbm // (indexer + hot * slot), "hot_pool_min": hbm // (indexer + floor * slot),
                  "host_memory": host_bound}
        details["hbm"] = (f"{_size(hbm)} HBM / ({_size(indexer)} indexer + {_size(hot * slot)} hot pool at "
                          f"ratio {ratio:g}) per request")
        details["hot_pool_min"] = (f"{_size(hbm)} HBM / ({_size(indexer)} indexer + {_size(floor * slot)} for the "
                                   f"hot-pool floor of {floor:,} slots, above ratio x context = {hot:,}) per request")
    else:
        slots = hot_pool_bytes // slot
        left = max(0, hbm - hot_pool_bytes)
        bounds = {"indexer_cache": left // indexer, "hot_pool_min": slots // floor, "host_memory": host_bound}
        details["indexer_cache"] = (f"({_size(hbm)} HBM - {_size(hot_pool_bytes)} hot pool) / {_size(indexer)} "
                                    f"indexer per request")
        details["hot_pool_min"] = f"{slots:,} hot slots per layer / {floor:,} needed per request and step"
    with_ess = _limit(bounds, details)

    return CapacityReport(
        model=model.name, context_len=context_len, q_tokens_per_step=q_tokens_per_step, ratio=ratio,
        hot_pool_bytes=hot_pool_bytes, hbm_kv_budget_bytes=hbm, host_memory_bytes=host,
        latent_bytes_per_request=latent, indexer_bytes_per_request=indexer, hot_slots_min_per_request=floor,
        without_ess=without, with_ess=with_ess,
        gain=with_ess.requests / without.requests if without.requests else None,
    )


# ----------------------------------------------------------------------------------------------- ess plan

_TOKENS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_tokens(text: str) -> int:
    """'32K' -> 32768, '128k' -> 131072, '1M' -> 1048576, '131072' -> 131072."""
    m = _TOKENS.match(text)
    value = float(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20}[m.group(2).lower()] if m else 0
    if not value >= 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a token count like 32K, 128K or 131072 (got {text!r})")
    return int(value)


def _number(kind: type, low: float, low_ok: bool = False, high: float | None = None):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number (got {text!r})") from None
        if not (math.isfinite(value) and (value >= low if low_ok else value > low) and (high is None or value <= high)):
            rng = f"{'>=' if low_ok else '>'} {low:g}" + (f" and <= {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"must be {rng} (got {text})")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``ess plan``."""
    parser.add_argument("--model", default="deepseek-v3.2-exp",
                        help=f"preset ({', '.join(MODEL_PRESETS)}) or a model YAML file (default: %(default)s)")
    custom = parser.add_argument_group("custom model (override the preset's numbers)")
    custom.add_argument("--num-layers", type=_number(int, 0), help="layers with a KV cache")
    custom.add_argument("--latent-bytes", type=_number(int, 0), help="latent bytes per token and layer (656)")
    custom.add_argument("--indexer-bytes", type=_number(int, 0), help="indexer bytes per token and layer (132)")
    custom.add_argument("--top-k", type=_number(int, 0), help="entries selected per query token (2048)")
    custom.add_argument("--weights-gb", type=_number(float, 0, low_ok=True), help="GiB of weights per GPU")
    gpu = parser.add_mutually_exclusive_group(required=True)
    gpu.add_argument("--hbm-gb", type=_number(float, 0), help="GiB of GPU memory for the KV cache")
    gpu.add_argument("--gpu-gb", type=_number(float, 0),
                     help="GiB of GPU memory; the KV budget is this x --mem-fraction - the weights")
    parser.add_argument("--mem-fraction", type=_number(float, 0, high=1), default=0.9,
                        help="share of --gpu-gb for weights + KV cache (default: %(default)s)")
    parser.add_argument("--host-gb", type=_number(float, 0), help="GiB of host memory for the latent pool")
    parser.add_argument("--context-len", nargs="+", type=parse_tokens, default=[32 * 2**10, 64 * 2**10, 128 * 2**10],
                        metavar="N", help="context lengths: 32K 128K 131072 ... (default: 32K 64K 128K)")
    parser.add_argument("--ratio", type=_number(float, 0, high=1),
                        help="hot-pool ratio (default: from --config, else 0.2)")
    parser.add_argument("--q-tokens", type=_number(int, 0), default=1,
                        help="query tokens per request and step: 1 + MTP draft tokens (default: 1)")
    parser.add_argument("--config", metavar="ESS_YAML",
                        help="take the hot-pool ratio or size and the host size from an ESS config")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


class _FlagError(Exception):
    """Bad input, already phrased with the flag's name."""


def _load_model(args: argparse.Namespace) -> ModelSpec:
    name = args.model
    if name in MODEL_PRESETS:
        base = MODEL_PRESETS[name].model_dump()
    elif name.endswith((".yaml", ".yml")) or os.path.isfile(name):
        import yaml

        try:
            with open(name, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as exc:
            raise _FlagError(f"--model {name}: cannot read: {' '.join(str(exc).split())}") from None
        data = data.get("model", data) if isinstance(data, Mapping) else data
        base = dict(data) if isinstance(data, Mapping) else data
        if isinstance(base, dict):
            base.setdefault("name", os.path.splitext(os.path.basename(name))[0])
    elif args.num_layers is not None:
        base = {"name": name}
    else:
        raise _FlagError(f"--model: unknown preset {name!r} (presets: {', '.join(MODEL_PRESETS)}); give a model "
                         f"YAML file, or --num-layers etc. for a custom model")
    overrides = {"num_layers": args.num_layers, "latent_bytes_per_token_layer": args.latent_bytes,
                 "indexer_bytes_per_token_layer": args.indexer_bytes, "top_k": args.top_k,
                 "weights_bytes_per_gpu": None if args.weights_gb is None else int(args.weights_gb * GIB)}
    if isinstance(base, dict):
        base.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ModelSpec.from_mapping(base)
    except EssConfigError as exc:
        raise _FlagError("\n".join(f"--model {name}: {line}" for line in exc.problems)) from None


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Flags (and --config) -> plan_capacity's arguments, except the context length."""
    model = _load_model(args)
    cfg = None
    if args.config:
        try:
            cfg = load_config(args.config)
        except EssConfigError as exc:
            raise _FlagError("\n".join(f"--config {line}" for line in exc.problems)) from None
    if args.hbm_gb is not None:
        hbm = int(args.hbm_gb * GIB)
    else:
        if model.weights_bytes_per_gpu is None:
            raise _FlagError("--gpu-gb: needs the weights per GPU: give --weights-gb (or use --hbm-gb)")
        hbm = int(args.gpu_gb * GIB * args.mem_fraction) - model.weights_bytes_per_gpu
        if hbm <= 0:
            raise _FlagError(f"--gpu-gb: {args.gpu_gb:g} GiB x {args.mem_fraction:g} leaves no room for the KV "
                             f"cache beside {_size(model.weights_bytes_per_gpu)} of weights")
    if args.host_gb is not None:
        host = int(args.host_gb * GIB)
    elif cfg is not None and cfg.memory_pool_size_gb is not None:
        host = int(cfg.memory_pool_size_gb * GIB)
    else:
        raise _FlagError("--host-gb: required (or give memory_pool_size_gb in --config)")
    ratio, hot_pool_bytes = args.ratio, None
    if ratio is None and cfg is not None:
        if cfg.max_gpu_buffer_size_gb is not None:
            hot_pool_bytes = int(cfg.max_gpu_buffer_size_gb * GIB)
        elif cfg.hot_slots_per_layer is not None:
            hot_pool_bytes = cfg.hot_slots_per_layer * model.latent_bytes_per_token
        else:
            ratio = cfg.sparse_memory_ratio
    if ratio is None and hot_pool_bytes is None:
        ratio = 0.2
    return {"model": model, "hbm_kv_budget_bytes": hbm, "host_memory_bytes": host, "ratio": ratio,
            "q_tokens_per_step": args.q_tokens, "hot_pool_bytes": hot_pool_bytes}


def _tokens(n: int) -> str:
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"


def _print_table(model: ModelSpec, reports: list[CapacityReport]) -> None:
    from rich.console import Console
    from rich.table import Table

    first = reports[0]
    hot = f"ratio {first.ratio:g}" if first.ratio is not None else f"fixed {_size(first.hot_pool_bytes)}"
    console = Console()
    console.print(f"[bold]{model.name}[/]: {model.num_layers} layers, {model.latent_bytes_per_token_layer} B latent + "
                  f"{model.indexer_bytes_per_token_layer} B indexer per token and layer, top-k {model.top_k}")
    console.print(f"HBM KV budget {_size(first.hbm_kv_budget_bytes)}, host memory {_size(first.host_memory_bytes)}, "
                  f"hot pool {hot}, {first.q_tokens_per_step} query token(s) per step", highlight=False)
    table = Table()
    for name in ("context", "without ESS", "with ESS", "limited by", "gain"):
        table.add_column(name, justify="left" if name == "limited by" else "right")
    for r in reports:
        gain = f"{r.gain:.2f}x" if r.gain is not None else "-"
        table.add_row(_tokens(r.context_len), str(r.without_ess.requests), str(r.with_ess.requests),
                      r.with_ess.limited_by, gain)
    console.print(table)
    for r in reports:
        console.print(f"{_tokens(r.context_len)}: without ESS, {r.without_ess.detail}; with ESS, "
                      f"{r.with_ess.limited_by}: {r.with_ess.detail}", highlight=False)


def run(args: argparse.Namespace) -> int:
    """``ess plan``: print the capacity table (or JSON); 2 on bad input."""
    try:
        inputs = _resolve(args)
        reports = [plan_capacity(context_len=n, **inputs) for n in args.context_len]
    except (_FlagError, ValueError) as exc:
        print(f"ess plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": inputs["model"].model_dump(), "reports": [r.model_dump() for r in reports]},
                         indent=2))
    else:
        _print_table(inputs["model"], reports)
    return 0
