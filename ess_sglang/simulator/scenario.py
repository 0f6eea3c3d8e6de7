"""Scenario files (``configs/scenarios/*.yaml``): the cluster, the serving setup, ESS, and what to report.

Every field, its unit and its default are in docs/simulator.md; ``configs/scenarios/paper-32k.yaml`` is the
ESS paper's setup. Unknown fields are errors and every error names its field (``scenario.serving.mtp_acceptance:
...``). The hardware is a preset name or a file, plus optional ``hardware_overrides`` (same field names).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from ess_sglang.config import DA_REMOVED
from ess_sglang.simulator.errors import SimulatorConfigError, read_yaml, validate
from ess_sglang.simulator.hardware import REPO_ROOT, Hardware, load_hardware
from ess_sglang.simulator.model import OVERLAP_MODES

SCENARIO_DIR = REPO_ROOT / "configs" / "scenarios"
DEFAULT_SCENARIO = SCENARIO_DIR / "paper-32k.yaml"


def _check(test, requirement: str):
    def check(v):
        if not test(v):
            raise ValueError(f"must be {requirement} (got {v!r})")
        return v

    return AfterValidator(check)


Num = Annotated[float, Field(strict=False)]
PositiveNum = Annotated[Num, _check(lambda v: math.isfinite(v) and v > 0, "a finite number > 0")]
Ratio = Annotated[Num, _check(lambda v: math.isfinite(v) and 0 < v <= 1, "in (0, 1]")]
PositiveInt = Annotated[int, Field(strict=True, gt=0)]


class Cluster(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: PositiveInt
    ep: PositiveInt | None = None
    """Expert-parallel group size; default: every GPU of the cluster (nodes x gpus_per_node)."""
    redundant_experts: Annotated[int, Field(strict=True, ge=0)] = 0
    """Extra expert replicas spread over the EP group (DeepSeek's EPLB); they cost HBM."""


class Serving(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    context_tokens: PositiveInt
    """KV length of every request during decode (tokens)."""
    mtp_tokens: PositiveInt = 2
    """Tokens verified per request and step (1 = no MTP; 2 = one MTP draft token)."""
    mtp_acceptance: PositiveNum = 1.7
    """Tokens emitted per request and step on average (1 <= a <= mtp_tokens)."""
    two_batch_overlap: StrictBool = True
    mem_fraction_static: Ratio = 0.85
    """SGLang's --mem-fraction-static: share of HBM for weights + KV pools; the rest is activations, CUDA graphs,
    communication buffers."""

    @model_validator(mode="after")
    def _acceptance(self) -> Serving:
        if not 1 <= self.mtp_acceptance <= self.mtp_tokens:
            raise ValueError(f"mtp_acceptance must be in [1, mtp_tokens = {self.mtp_tokens}] "
                             f"(got {self.mtp_acceptance})")
        return self


class MissModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ref_ratio: Annotated[Num, _check(lambda v: math.isfinite(v) and 0 < v < 1, "in (0, 1)")] = 0.2
    ref_context_tokens: PositiveInt = 32768
    ref_misses_min: Annotated[Num, _check(lambda v: math.isfinite(v) and v >= 0, ">= 0")] = 17.0
    ref_misses_max: Annotated[Num, _check(lambda v: math.isfinite(v) and v >= 0, ">= 0")] = 605.0
    alpha: Annotated[Num, _check(lambda v: math.isfinite(v) and 0 <= v <= 4, "in [0, 4]")] = 1.0
    profile: StrictStr | None = None
    """A per-layer miss profile (traffic.MissProfile); replaces ref_ratio / ref_context_tokens / ref_misses_*."""

    @model_validator(mode="after")
    def _order(self) -> MissModelSpec:
        if self.ref_misses_min > self.ref_misses_max:
            raise ValueError(f"ref_misses_min ({self.ref_misses_min}) must be <= ref_misses_max "
                             f"({self.ref_misses_max})")
        return self


class Ess(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: StrictBool = True
    overlap: StrictStr = "auto"
    """sync (fetch then attend), dba, or auto (per layer the better of sync and dba)."""
    min_pool_ratio: Ratio | None = None
    """The smallest hot-pool ratio the operator accepts (bounds the batch); default: only the hot-pool floor."""
    miss_model: MissModelSpec = MissModelSpec()

    @model_validator(mode="after")
    def _mode(self) -> Ess:
        if self.overlap == "da":
            raise ValueError(f"overlap: {DA_REMOVED}; use sync, dba or auto (got 'da')")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap must be one of {', '.join(OVERLAP_MODES)} (got {self.overlap!r})")
        return self


class ReferenceRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    batch: PositiveInt
    ratio: Ratio
    throughput: PositiveNum
    per_request: PositiveNum


class Reference(BaseModel):
    """Published numbers to compare against; never used by the model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: StrictStr
    max_batch_without_ess: PositiveInt | None = None
    rows: list[ReferenceRow] = Field(min_length=1)


class Sweep(BaseModel):
    """Batches for the plot (throughput against batch)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch: PositiveInt = 256
    step: PositiveInt = 4


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: StrictStr
    description: StrictStr = ""
    hardware: StrictStr
    """Preset name (configs/hardware/<name>.yaml) or path to a hardware file."""
    hardware_overrides: dict[str, Any] = Field(default_factory=dict)
    cluster: Cluster
    serving: Serving
    ess: Ess = Ess()
    batches: list[PositiveInt] = Field(min_length=1)
    """Batches (requests per GPU) for the table."""
    sweep: Sweep = Sweep()
    reference: Reference | None = None


class LoadedScenario:
    """A validated scenario with its hardware resolved."""

    def __init__(self, scenario: Scenario, hardware: Hardware, path: Path | None):
        self.scenario, self.hardware, self.path = scenario, hardware, path
        total = scenario.cluster.nodes * hardware.gpus_per_node
        self.ep = scenario.cluster.ep or total
        if self.ep > total or total % self.ep:
            raise SimulatorConfigError(f"scenario.cluster.ep: must divide the cluster's {total} GPUs "
                                       f"(got {self.ep})")

    @property
    def base_dir(self) -> Path:
        return self.path.parent if self.path else Path.cwd()


def load_scenario(path: str | Path | None = None, data: dict[str, Any] | None = None) -> LoadedScenario:
    """Load and validate a scenario file (or a mapping), and its hardware."""
    p = Path(path) if path is not None else None
    if data is None:
        if p is None:
            p = DEFAULT_SCENARIO
            if not p.is_file():
                raise SimulatorConfigError(f"scenario: the default scenario {p} is not there (installed without "
                                           "the checkout?); pass --scenario FILE")
        data = read_yaml(p, "scenario")
    sc = validate(Scenario, data, "scenario")
    base = p.parent if p else Path.cwd()
    hw = load_hardware(sc.hardware, sc.hardware_overrides, base_dir=base)
    return LoadedScenario(sc, hw, p)
