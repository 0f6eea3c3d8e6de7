"""ESS misses per layer: from a per-layer profile, or a model of miss count against pool ratio and context.

The unit everywhere is *misses per request, per layer, per decode step* (one step verifies q tokens): the
latent entries that a request's exact top-k selects and that are not in the GPU hot pool, so they cross
PCIe (656 B each) before the layer's sparse attention.

Model (used to move a reference profile to another pool ratio r and context L)::

    misses_l(r, L) = misses_l(r_ref, L_ref) * s(r, L) / s(r_ref, L_ref),   s(r, L) = (1 - r) / (r L)^alpha

clipped to [0, q x min(k, L)]. It is 0 at r = 1 (everything resident), grows as the pool shrinks, and falls
as context grows at a fixed ratio (the pool, r L slots, grows while the top-k stays 2048): design brief, docs/design.md.
``alpha = 1`` (misses inversely proportional to the pool size) is an assumption, not a measurement.

Reference without a profile: ESS reports 17 to 605 misses per layer at ratio 0.2 and 32K context; the
default spreads the 61 layers geometrically between those two numbers (mean 165, i.e. ~92% hits), the MTP
layer gets the mean. A measured profile replaces this spread (``load_profile``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictStr

from ess_sglang.config import DA_REMOVED
from ess_sglang.simulator.errors import SimulatorConfigError, validate
from ess_sglang.simulator.model import OVERLAP_MODES, ModelArch


def _ratio(v: float) -> float:
    if not (math.isfinite(v) and 0 < v <= 1):
        raise ValueError(f"must be in (0, 1] (got {v!r})")
    return v


def _non_negative(v: float) -> float:
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"must be a finite number >= 0 (got {v!r})")
    return v


def _mode(v: str) -> str:
    if v == "da":
        raise ValueError(f"{DA_REMOVED}; use sync, dba or auto")
    if v not in OVERLAP_MODES:
        raise ValueError(f"must be one of {', '.join(OVERLAP_MODES)} (got {v!r})")
    return v


PoolRatio = Annotated[float, Field(strict=False), AfterValidator(_ratio)]
NonNegative = Annotated[float, Field(strict=False), AfterValidator(_non_negative)]
Mode = Annotated[str, AfterValidator(_mode)]


class MissProfile(BaseModel):
    """A per-layer miss profile, as measured offline at one pool ratio and context length.

    File (YAML or JSON)::

        pool_ratio: 0.2
        context_tokens: 32768
        misses_per_request: [...]   # one number per layer (61, or 62 with the MTP layer last)
        overlap_modes: [...]        # optional: dba / sync / auto per layer
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: StrictStr = ""
    pool_ratio: PoolRatio
    context_tokens: int = Field(gt=0)
    misses_per_request: list[NonNegative] = Field(min_length=1)
    overlap_modes: list[Mode] | None = None


def load_profile(path: str | Path, arch: ModelArch, root: str = "profile") -> MissProfile:
    p = Path(path)
    try:
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise SimulatorConfigError(f"{root}: cannot read {p}: {exc}") from None
    prof = validate(MissProfile, data, root)
    allowed = (arch.num_layers, arch.num_kv_layers)
    if len(prof.misses_per_request) not in allowed:
        raise SimulatorConfigError(f"{root}.misses_per_request: needs {allowed[0]} or {allowed[1]} values "
                                   f"(got {len(prof.misses_per_request)})")
    if prof.overlap_modes is not None and len(prof.overlap_modes) not in allowed:
        raise SimulatorConfigError(f"{root}.overlap_modes: needs {allowed[0]} or {allowed[1]} values "
                                   f"(got {len(prof.overlap_modes)})")
    return prof


def geometric_spread(low: float, high: float, n: int) -> list[float]:
    """n values from low to high, evenly spaced in log scale (the default per-layer reference)."""
    if n == 1:
        return [math.sqrt(low * high)]
    if low <= 0:
        return [low + (high - low) * i / (n - 1) for i in range(n)]
    return [low * (high / low) ** (i / (n - 1)) for i in range(n)]


class MissModel:
    """Misses per request, layer and step at any (pool ratio, context), from a reference profile."""

    def __init__(self, arch: ModelArch, reference: list[float], ref_ratio: float, ref_context: int,
                 alpha: float = 1.0, modes: list[str] | None = None):
        if len(reference) == arch.num_layers:  # the MTP layer gets the mean of the main layers
            reference = list(reference) + [sum(reference) / len(reference)] * arch.num_mtp_layers
        if modes is not None and len(modes) == arch.num_layers:
            modes = list(modes) + ["auto"] * arch.num_mtp_layers
        if len(reference) != arch.num_kv_layers:
            raise ValueError(f"reference needs {arch.num_kv_layers} values, got {len(reference)}")
        if not 0 < ref_ratio < 1:
            raise ValueError(f"the reference pool ratio must be in (0, 1) (got {ref_ratio})")
        self.arch, self.reference, self.modes = arch, list(reference), modes
        self.ref_ratio, self.ref_context, self.alpha = ref_ratio, ref_context, alpha

    def _shape(self, ratio: float, context: int) -> float:
        return (1.0 - ratio) / (ratio * context) ** self.alpha

    def misses(self, ratio: float, context: int, mtp_tokens: int) -> list[float]:
        """Per layer (main layers, then MTP layer): misses per request and step."""
        if ratio >= 1.0:
            return [0.0] * len(self.reference)
        if ratio <= 0:
            raise ValueError(f"pool ratio must be > 0 (got {ratio})")
        scale = self._shape(ratio, context) / self._shape(self.ref_ratio, self.ref_context)
        cap = mtp_tokens * min(self.arch.index_topk, context)
        return [min(cap, m * scale) for m in self.reference]

    @classmethod
    def from_profile(cls, arch: ModelArch, prof: MissProfile, alpha: float = 1.0) -> MissModel:
        return cls(arch, list(prof.misses_per_request), prof.pool_ratio, prof.context_tokens, alpha,
                   list(prof.overlap_modes) if prof.overlap_modes else None)


def hit_rate(misses: list[float], mtp_tokens: int, arch: ModelArch, context: int) -> float:
    """Share of selected entries found in the hot pool, averaged over layers (selections counted as
    q x k per request and layer: an upper bound, since the q tokens' top-k sets overlap)."""
    selected = mtp_tokens * min(arch.index_topk, context)
    return 1.0 - sum(misses) / (len(misses) * selected)
