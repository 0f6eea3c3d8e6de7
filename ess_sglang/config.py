"""The ESS configuration: a pydantic model loadable from YAML, and the pool plan derived from it.

Operators write the shape of their deployment guides::

    ess_config:
      enabled: true
      offload_target: cpu_memory
      prefetch_overlap_level: auto      # auto | none | full
      max_gpu_buffer_size_gb: 16
      memory_pool_size_gb: 200

``load_config(path)`` / ``EssConfig.from_mapping(d)`` validate it; every problem is raised as one
``EssConfigError`` whose lines name the offending key as its YAML path (``ess_config.memory_pool_size_gb:
must be > 0 (got -3)``). ``EssConfig.plan(Deployment(...))`` turns the sizes into token counts (pure
arithmetic, nothing is allocated) and checks them against each other and against the deployment.

This module must not import torch: it runs before anything is allocated.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    model_validator,
)

from ess_sglang.entry_sizes import LATENT_ENTRY_BYTES

GIB = 2**30
DEFAULT_SPARSE_MEMORY_RATIO = 0.2
SIZING_KNOBS = ("hot_slots_per_layer", "sparse_memory_ratio", "max_gpu_buffer_size_gb")
"""The fields that can decide the hot-pool size; at most one may be given."""


class EssConfigError(ValueError):
    """An invalid ESS configuration. ``problems`` holds one line per problem, each naming its YAML path."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


# ----------------------------------------------------------------------------------------------- field rules

def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else repr(value)


def _rule(test: Callable[[Any], bool], requirement: str) -> AfterValidator:
    """A validator that fails with ``must be <requirement> (got <value>)``."""

    def check(value: Any) -> Any:
        if not test(value):
            raise ValueError(f"must be {requirement} (got {_show(value)})")
        return value

    return AfterValidator(check)


_FINITE = _rule(math.isfinite, "a finite number")
_POSITIVE = _rule(lambda v: v > 0, "> 0")
_NON_NEGATIVE = _rule(lambda v: v >= 0, ">= 0")

PositiveInt = Annotated[StrictInt, _POSITIVE]
NonNegativeInt = Annotated[StrictInt, _NON_NEGATIVE]
PositiveSize = Annotated[StrictFloat, _FINITE, _POSITIVE]
Ratio = Annotated[StrictFloat, _FINITE, _rule(lambda v: 0 < v <= 1, "in (0, 1]")]
Fraction01 = Annotated[StrictFloat, _FINITE, _rule(lambda v: 0 <= v <= 1, "in [0, 1]")]

DA_REMOVED = ("'da' was removed (dual attention was slower than sync in every measured configuration: "
              "docs/design.md, \"Overlap modes\")")
"""What a config, an overlap profile, a calibration or the decode harness says when it meets the removed overlap mode
(or level) "da"."""


def _not_da(value: Any) -> Any:
    if value == "da":
        raise ValueError(f"{DA_REMOVED}; use none, auto or full")
    return value


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the (nested) model found at ``loc``, for 'did you mean' hints."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)


def _convert(exc: ValidationError, root: str, model: type[BaseModel]) -> EssConfigError:
    """One line per pydantic error: ``<root>.<path>: <message>``."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = root + "".join(f"[{p}]" if isinstance(p, int) and not isinstance(p, bool) else f".{p}" for p in loc)
        if err["type"] == "extra_forbidden":
            message = "unknown key"
            close = difflib.get_close_matches(str(loc[-1]), _fields_at(model, loc[:-1]), n=1)
            if close:
                message += f" (did you mean {close[0]!r}?)"
        elif err["type"] == "value_error":
            message = str(err["ctx"]["error"])
        elif err["type"] == "missing":
            message = "required"
        else:
            message = err["msg"][:1].lower() + err["msg"][1:]
            if "input" in err:
                message += f" (got {_show(err['input'])})"
        lines.append(f"{path}: {message}")
    return EssConfigError(lines)


def validate_mapping(model: type[BaseModel], data: Any, root: str) -> Any:
    """Validate ``data`` as ``model``; errors become one EssConfigError whose lines start with ``root``."""
    if isinstance(data, model):
        return data
    if not isinstance(data, Mapping):
        raise EssConfigError(f"{root}: expected a mapping, got {type(data).__name__}")
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise _convert(exc, root, model) from None


# ----------------------------------------------------------------------------------------------- the config

class MetricsConfig(BaseModel):
    """What the metrics exporter reports and how often it reads the GPU counters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: StrictBool = True
    readout_interval_steps: PositiveInt = 16
    """Copy the GPU-side counters to the host every this many decode steps (the copy synchronises)."""
    per_layer: StrictBool = False
    """Also export per-layer series (61 x more series for DeepSeek-V3.2)."""


NEW_TOKEN_MODES = ("on_demand", "insert")
DEFAULT_NEW_TOKENS = "insert"


def new_token_mode(mode: str | None) -> str:
    """EssConfig.new_tokens for code outside the config (decode stack, trace replay): None -> the default, anything
    but "insert" / "on_demand" -> ValueError."""
    if mode is None:
        return DEFAULT_NEW_TOKENS
    if mode not in NEW_TOKEN_MODES:
        raise ValueError(f"new_tokens must be 'insert' or 'on_demand', got {mode!r}")
    return mode


class EssConfig(BaseModel):
    """The whole ESS configuration (the mapping under ``ess_config:``).

    Hot-pool size: at most one of ``hot_slots_per_layer``, ``sparse_memory_ratio`` and
    ``max_gpu_buffer_size_gb`` decides it; with none, the ratio is ``DEFAULT_SPARSE_MEMORY_RATIO``.
    Host-pool size: ``memory_pool_size_gb`` when given, else what the deployment needs.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: StrictBool = True
    offload_target: Literal["cpu_memory"] = "cpu_memory"
    """Where the latent cache lives: pinned host memory (the only target so far)."""
    prefetch_overlap_level: Annotated[Literal["auto", "none", "full"], BeforeValidator(_not_da)] = "auto"
    """How decode layers hide their fetches. auto: each layer as ``overlap_profile`` says, and without a profile no
    prefetch (misses fetched after the top-k): in the decode harness's last three tables, the one-chunk ECHO prefetch
    the SGLang plugin can run was slower than that in 13, 14 and 14 of 18 configurations (benchmarks/RESULTS.md); full:
    as the profile says, and without one ECHO prefetch in every layer; none: every layer fetches its misses, then
    attends (a profile's modes are not used). The level "da" (dual attention) was removed: it is refused at load."""
    max_gpu_buffer_size_gb: PositiveSize | None = None
    """GiB of GPU memory for the hot pools of all layers together."""
    memory_pool_size_gb: PositiveSize | None = None
    """GiB of pinned host memory for the host total pool (all layers)."""
    max_kv_cache_gb: PositiveSize | None = None
    """SGLang plugin: GiB of GPU memory per rank for all of ESS's KV pools together (indexer cache, hot pools,
    new-token and prefill-staging slots, maps); unset: the KV budget SGLang profiles from --mem-fraction-static.
    The ESS counterpart of --max-total-tokens (which ESS refuses): a token's KV in an all-HBM DSA pool takes
    layers x (656 + 132) bytes."""
    sparse_memory_ratio: Ratio | None = None
    """Hot slots per layer as a fraction of the latent tokens the instance holds (0 < r <= 1)."""
    hot_slots_per_layer: PositiveInt | None = None
    """Hot slots per layer, given directly (rounded up to a multiple of page_size)."""
    top_k: PositiveInt = 2048
    """Entries the indexer selects per query token and layer."""
    page_size: PositiveInt = 64
    """Tokens per KV page (SGLang's page size)."""
    warmup_windows: NonNegativeInt = 32
    """After prefill, load the union of the top-k sets of this many last query windows; 0 disables warm-up."""
    prefetch_ema_alpha: Ratio = 0.5
    """EMA weight of the newest k-th best indexer score in the prefetch threshold."""
    prefetch_cap_fraction: Fraction01 = 0.01
    """Cap on prefetched entries per request and layer, as a fraction of the request's context length."""
    prefetch_cap_min_tokens: NonNegativeInt = 64
    """The prefetch cap is never below this many entries."""
    prefetch_threshold_margin: Annotated[StrictFloat, _FINITE, _rule(lambda v: 0 <= v < 1, "in [0, 1)")] = 0.0
    """A position is a prefetch candidate above threshold - margin x |threshold|: a margin catches more of a step's
    misses for more wasted bytes."""
    decode_topk: Literal["as_without_ess", "hisparse"] = "as_without_ess"
    """SGLang plugin: the top-k of a decode layer. "as_without_ess": the kernel and plan SGLang runs without ESS (its
    top-k v2 kernel with the forward's plan, writing positions), so that ESS selects the entries SGLang without ESS
    selects; "hisparse": SGLang's HiSparse decode top-k (sgl_kernel.fast_topk_v2 with the default backend), which can
    select others where the k-th score's bin holds more candidates than it keeps."""
    prefetch_min_batch: PositiveInt = 16
    """SGLang plugin: decode batches smaller than this do not prefetch (on the H200 prefetch lost to synchronous
    fetching at batch 1-2 and won from batch 16 at hit rates 0.9-0.95; batches 3-15 were not measured)."""
    spare_slot_fraction: Fraction01 | None = None
    """SGLang plugin: spare slots per layer (free slots evicted ahead, beside attention, so that a resolve or a
    prefetch takes no LRU scan), as a fraction of top_k x max_running_requests, in whole pages, at most 1/8 of the
    hot pool. None: 1/16 x the refill interval where the instance prefetches (about 1.25 x a step's misses at 95%
    hits, per step between refills); else one page a layer, taken only by resolves of one or two requests (larger
    batches run as without spare slots), which took the decode step at one and two 32K requests from 1.042x all-HBM's
    to 1.029x and 1.027x in the real server (H100). 0: none."""
    spare_refill_interval: Annotated[StrictInt, _rule(lambda v: 1 <= v <= 1024, "in [1, 1024]")] | None = None
    """SGLang plugin: a layer's spare slots are refilled in every decode step (1), or in every K-th step of the layer
    (the layers in turn) and in any step where fewer than 1/K of them are left. Size spare_slot_fraction to K steps'
    misses. None: the interval the overlap profile's spare-slot runs were measured with (4 in the shipped
    SGLang-top-k profile) where a profile is loaded (not with prefetch_overlap_level none), else 1; 64 for the
    one-page reserve of an instance that prefetches nowhere (spare_slot_fraction unset). In the decode
    harness on the H200 (prefetch in three segments, hit 0.95, batch 64), K = 4 with twice the spare slots took
    9.4-11.3 us a layer less than refilling every step at 128K, 1.9-4.1 at 32K (docs/design.md, "Resolve");
    not measured inside SGLang."""
    new_tokens: Literal[NEW_TOKEN_MODES] = DEFAULT_NEW_TOKENS
    """Each decoded token's latent entry is written back to the host pool; "insert": also given a protected hot slot
    by the same resolve (no launch of its own), so it is resident from the step that computes it, as LRU with the
    newest token keeps it (benchmarks/hit_rate.py); "on_demand": fetched like any miss when a selection names it."""
    retention: Literal["lru", "decay"] = "lru"
    """Which hot entries a miss evicts: "lru", the least recently selected; "decay", the lowest decayed selection
    count (every selection adds 1, every step multiplies by ``decay_gamma``), which on the real traces closes about a
    quarter of the LRU -> optimum gap at the smallest pools (benchmarks/hit_rate.py). Both are exact."""
    decay_gamma: Annotated[StrictFloat, _FINITE, _rule(lambda v: 0 < v <= 0.9, "in (0, 0.9]")] = 0.75
    """retention "decay": the factor a selection count keeps per step (about 1 / (1 - gamma) steps of memory; at most
    0.9, where the resolve's 256 age buckets still order 42 steps of age)."""
    resolve_pdl: StrictBool | None = None
    """The fused resolve's kernels after its lookup with programmatic dependent launch (each one's programs are
    scheduled while the one before runs), and so the ECHO prefetch's candidate kernels after the first and its
    claim launches. None: on wherever it can run (a GPU of compute capability 9.0+); true on an older GPU is refused
    at start-up."""
    scrub_on_free: StrictBool = False
    """Zero host and hot-pool entries when their tokens are freed (costs PCIe / HBM bandwidth). SGLang plugin: a
    finished request's host entries, on the GPU's stream over PCIe, before the host pool can give them out again; its
    hot slots are released (a slot is read only after a fetch or the resolve's write-back filled it)."""
    invariant_check_interval_steps: NonNegativeInt = 0
    """SGLang plugin: every this many decode steps, between two steps, synchronise the GPU and check ESS's state (the
    hot pools' maps, the host pool's bookkeeping, the admission reservations); violations are logged and counted in
    sglang:ess_invariant_violations_total. 0: never (each check stalls the step: it waits for the GPU and reads
    every layer's maps back). The same checks, and that everything is released, run whenever the scheduler goes idle,
    whatever this is."""
    overlap_profile: Annotated[str, _rule(lambda v: v.strip() != "", "a non-empty path")] | None = None
    """Path to a per-layer overlap profile YAML (``ess profile``: each layer's mode, e.g. sync, dba or prefetch)."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _one_sizing_knob(self) -> EssConfig:
        given = [name for name in SIZING_KNOBS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"{' and '.join('ess_config.' + g for g in given)} both size the hot pool; give only one of "
                f"{', '.join(SIZING_KNOBS)}"
            )
        return self

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> EssConfig:
        """Validate the mapping under ``ess_config:`` (None or {} gives the defaults)."""
        return validate_mapping(cls, {} if data is None else data, "ess_config")

    @property
    def hot_pool_sized_by(self) -> str:
        """The field that decides the hot-pool size (``sparse_memory_ratio`` when the default ratio applies)."""
        return next((name for name in SIZING_KNOBS if getattr(self, name) is not None), "sparse_memory_ratio")

    def plan(self, deployment: Deployment | Mapping[str, Any], host_memory_bytes: int | None = None) -> PoolPlan:
        """Size the host and hot pools for ``deployment``; raise EssConfigError if the sizes cannot work.

        ``host_memory_bytes``: the machine's memory, if known; a host pool larger than it is an error.
        """
        return _plan(self, validate_mapping(Deployment, deployment, "deployment"), host_memory_bytes)


class Deployment(BaseModel):
    """What the serving instance will run: the numbers the pools are sized against."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: PositiveInt
    max_running_requests: PositiveInt
    max_context_len: PositiveInt
    q_tokens_per_step: PositiveInt = 1
    """Query tokens per request and decode step: 1 + MTP draft tokens."""
    host_tokens: PositiveInt | None = None
    """Latent token locations per layer the host pool should hold, if the caller already knows."""


@dataclass(frozen=True)
class PoolPlan:
    """Pool sizes for one instance. Token counts are per layer; byte counts cover all layers.

    Bytes count the 656-B latent entries only, not the hot pool's metadata tensors.
    """

    num_layers: int
    host_tokens: int
    """Latent token locations in the host total pool, per layer."""
    hot_slots_per_layer: int
    """Hot-pool slots per layer (a multiple of page_size, except when capped by max_gpu_buffer_size_gb)."""
    host_bytes: int
    hot_pool_bytes: int
    top_k: int
    page_size: int
    max_running_requests: int
    q_tokens_per_step: int
    max_requests_at_full_context: int
    """Requests of max_context_len tokens the host pool holds at once (admission queues the rest)."""
    hot_slots_needed: int
    """The least hot slots per layer one decode step can work with (selections + new tokens)."""
    hot_pool_sized_by: str
    """hot_slots_per_layer, sparse_memory_ratio (given or default) or max_gpu_buffer_size_gb."""
    host_pool_sized_by: str
    """memory_pool_size_gb, deployment.host_tokens, or max_running_requests x max_context_len."""

    @property
    def hot_ratio(self) -> float:
        """Hot slots per layer / host tokens per layer."""
        return self.hot_slots_per_layer / self.host_tokens

    def describe(self) -> str:
        """One line for logs."""
        return (
            f"ESS pools: host {self.host_tokens:,} tokens/layer ({self.host_bytes / GIB:.2f} GiB, "
            f"{self.max_requests_at_full_context} requests at full context; by {self.host_pool_sized_by}), "
            f"hot {self.hot_slots_per_layer:,} slots/layer ({self.hot_pool_bytes / GIB:.2f} GiB, "
            f"ratio {self.hot_ratio:.3f}, needs >= {self.hot_slots_needed:,}; by {self.hot_pool_sized_by})"
        )


# ----------------------------------------------------------------------------------------------- planning

def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def _gib_up(nbytes: float) -> str:
    return f"{math.ceil(nbytes / GIB * 100) / 100:.2f}"


def _plan(cfg: EssConfig, dep: Deployment, host_memory_bytes: int | None) -> PoolPlan:
    entry = LATENT_ENTRY_BYTES * dep.num_layers  # bytes of one token location across all layers
    requests, q, ctx = dep.max_running_requests, dep.q_tokens_per_step, dep.max_context_len

    # Host pool.
    if cfg.memory_pool_size_gb is not None:
        host_by, host_field = "memory_pool_size_gb", "ess_config.memory_pool_size_gb"
        host_tokens = int(cfg.memory_pool_size_gb * GIB // entry)
        host_asked = cfg.memory_pool_size_gb * GIB
    elif dep.host_tokens is not None:
        host_by = host_field = "deployment.host_tokens"
        host_tokens = dep.host_tokens
        host_asked = host_tokens * entry
    else:
        host_by, host_field = "max_running_requests x max_context_len", "deployment.max_context_len"
        host_tokens = requests * ctx
        host_asked = host_tokens * entry
    if host_memory_bytes is not None and host_asked > host_memory_bytes:
        raise EssConfigError(
            f"ess_config.memory_pool_size_gb: a host pool of {host_asked / GIB:.2f} GiB does not fit in this "
            f"machine's {host_memory_bytes / GIB:.2f} GiB of memory; set ess_config.memory_pool_size_gb below it"
        )
    if host_tokens < ctx:
        raise EssConfigError(
            f"{host_field}: the host pool holds {host_tokens:,} tokens per layer, less than one request of "
            f"max_context_len {ctx:,} ({_gib_up(ctx * entry)} GiB)"
        )

    # Hot pool: one step's selections plus the step's new tokens must fit.
    needed = requests * q * (min(cfg.top_k, ctx) + 1)
    knob = cfg.hot_pool_sized_by
    if cfg.hot_slots_per_layer is not None:
        asked = cfg.hot_slots_per_layer
        slots = round_up(asked, cfg.page_size)
    elif cfg.max_gpu_buffer_size_gb is not None:
        asked = int(cfg.max_gpu_buffer_size_gb * GIB // entry)
        slots = asked // cfg.page_size * cfg.page_size  # a budget, so rounded down
    else:
        ratio = cfg.sparse_memory_ratio if cfg.sparse_memory_ratio is not None else DEFAULT_SPARSE_MEMORY_RATIO
        asked = math.ceil(ratio * host_tokens - 1e-9)
        slots = round_up(asked, cfg.page_size)
    shown = f"ess_config.{knob}"
    if getattr(cfg, knob) is None:
        shown += f" (default {DEFAULT_SPARSE_MEMORY_RATIO})"
    step = (f"{requests} max_running_requests x {q} q_tokens_per_step x (min(top_k {cfg.top_k}, max_context_len "
            f"{ctx:,}) + 1 new token) = {needed:,} slots per layer")
    if needed > host_tokens:
        raise EssConfigError(
            f"{shown}: one decode step needs {step}, more than the host pool's {host_tokens:,} tokens per layer: "
            f"every entry would be hot and ESS cannot help; lower deployment.max_running_requests or enlarge "
            f"ess_config.memory_pool_size_gb"
        )
    if slots < needed:
        raise EssConfigError(f"{shown}: the hot pool has {slots:,} slots per layer but one decode step needs "
                             f"{step}; {_raise_hint(knob, needed, host_tokens, entry, cfg.page_size)}")
    if asked > host_tokens:
        raise EssConfigError(
            f"{shown}: the hot pool ({asked:,} slots per layer) is larger than the host pool ({host_tokens:,} "
            f"tokens per layer), which is pointless; lower it to at most {host_tokens:,} slots"
        )

    return PoolPlan(
        num_layers=dep.num_layers, host_tokens=host_tokens, hot_slots_per_layer=slots,
        host_bytes=host_tokens * entry, hot_pool_bytes=slots * entry, top_k=cfg.top_k, page_size=cfg.page_size,
        max_running_requests=requests, q_tokens_per_step=q, max_requests_at_full_context=host_tokens // ctx,
        hot_slots_needed=needed, hot_pool_sized_by=knob, host_pool_sized_by=host_by,
    )


def _raise_hint(knob: str, needed: int, host_tokens: int, entry: int, page_size: int) -> str:
    slots = round_up(needed, page_size)
    if knob == "hot_slots_per_layer":
        to = f"at least {slots:,}"
    elif knob == "max_gpu_buffer_size_gb":
        to = f"at least {_gib_up(slots * entry)} GiB"
    else:
        to = f"at least {math.ceil(needed / host_tokens * 1000) / 1000:.3f}"
    return f"raise ess_config.{knob} to {to} (or lower max_running_requests or q_tokens_per_step)"


# ----------------------------------------------------------------------------------------------- loading

def load_config(path: str | os.PathLike[str]) -> EssConfig:
    """Read an ESS config from YAML: the mapping under a top-level ``ess_config:`` key, or a bare mapping.

    With ``ess_config:`` present, other top-level keys belong to other tools and are ignored, except ESS
    field names (a mis-indented ESS key), which are an error. Errors name the file and the key.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise EssConfigError(f"{path}: no such file") from None
    except OSError as exc:
        raise EssConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise EssConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(data, Mapping):
        got = "an empty file" if data is None else f"a {type(data).__name__}"
        raise EssConfigError(f"{path}: expected a mapping (ess_config: ...), got {got}")
    if "ess_config" in data:
        stray = [k for k in data if k in EssConfig.model_fields]
        if stray:
            raise EssConfigError([f"{path}: {k}: ESS key outside the ess_config: mapping (indent it under "
                                  f"ess_config:)" for k in stray])
        data = data["ess_config"]
    try:
        return EssConfig.from_mapping(data)
    except EssConfigError as exc:
        raise EssConfigError([f"{path}: {line}" for line in exc.problems]) from None
