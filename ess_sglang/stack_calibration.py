"""Measured exposed time of each overlap mode, from a decode-stack benchmark run, for the layer-wise policy.

The analytic cost model in `ess_sglang.overlap_policy` predicts sync / dba from a few device constants. ECHO
prefetch (one indexer launch, or the indexer in two batch chunks) is harder to model: what it hides depends on how
long the top-k and the second chunk's indexer take beside its candidate kernels, and on how many of its fetches the
top-k then selects. So the policy can also read the modes' costs from a measurement of the device itself: the JSON
that `benchmarks/decode_layers.py` writes (`ess profile --calibration FILE`).

A calibration is a grid of measured configurations (batch x context), each measured at two or more miss counts (the
benchmark's hit rates). One point holds, for one configuration and hit rate::

    misses      distinct misses per layer and step of the sync run (whole batch)
    exposed_us  per mode: the mode's time per layer minus the all-HBM stack's, same run, microseconds

The exposed time of a mode for a layer with M misses per step at batch B and context C (`StackCalibration.exposed`):

    1. the grid's batches b0 <= B <= b1 and contexts c0 <= C <= c1 that bracket the query (a query outside the grid
       gets None: the caller falls back to the analytic model);
    2. at each of those (up to four) corners (b, c): the corner's points, ordered by misses, interpolated linearly
       at M x b / B (the same misses per request), beyond the first or last point along the end segment's slope,
       and never below zero;
    3. the corners combined bilinearly in log batch and log context.

At a measured configuration this returns the measured exposed times exactly. Modes missing from any point are left
out of the whole calibration (a mode is offered only where every point measured it). A run's rows of other variants
(layerwise, or da: dual attention, removed, whose rows older runs hold) are not read; a calibration written into an
older profile loads without its da times (`overlap_policy.profile_from_mapping`).

A run with `--spare` measured every mode again with spare slots (rows "mode+spare"); `spare_slots=True` reads those
rows' times instead, for a runtime that keeps spare slots (the misses stay the sync run's without them, the measure of
the configuration).

ECHO's threshold margin (`prefetch_threshold_margin`: candidates above thr - m|thr|) is a dimension of the choice too:
it catches more of a step's misses for more wasted copies, which paid at hit 0.95 and cost at hit 0.9 in the same
calls (benchmarks/RESULTS.md). A second run of the benchmark with `--prefetch-margin m` (m > 0) adds its prefetch modes
as "prefetch_margin" / "prefetch2_margin" (`load_calibration([run_m0, run_m])`); the calibration records m
(`prefetch_margin`), and a layer that runs one of those modes prefetches with that margin. The other modes, and the
misses that place each point, come from the first run (margin 0).

This module imports pydantic only (no torch): profiles are read before anything is allocated.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from ess_sglang.config import DA_REMOVED

CALIBRATED_MODES = ("sync", "dba", "prefetch", "prefetch2", "prefetch3", "prefetch_margin", "prefetch2_margin",
                    "prefetch3_margin")
"""Modes a calibration may hold, in the policy's order (ties go to the earlier)."""
MARGIN_MODES = {"prefetch_margin": "prefetch", "prefetch2_margin": "prefetch2", "prefetch3_margin": "prefetch3"}
"""The prefetch modes run with the calibration's threshold margin, and the mode each is measured as in its run."""

NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
PosInt = Annotated[int, Field(gt=0, strict=True)]


class CalibrationError(ValueError):
    """A calibration that cannot be built or used; the message names the file or key."""


class MeasuredPoint(BaseModel):
    """One configuration at one hit rate: the sync run's misses and each mode's exposed time per layer."""

    model_config = ConfigDict(extra="forbid")

    batch: PosInt
    context: PosInt
    misses: NonNegFloat
    """Distinct misses per layer and step, whole batch, of the sync run."""
    exposed_us: dict[str, Finite]
    """Mode -> its time per layer minus the all-HBM stack's (may be negative: measurement noise at tiny costs)."""

    @model_validator(mode="after")
    def _modes(self) -> MeasuredPoint:
        if "da" in self.exposed_us:
            raise ValueError(f"exposed_us.da: {DA_REMOVED}; regenerate the calibration without it")
        unknown = sorted(set(self.exposed_us) - set(CALIBRATED_MODES))
        if unknown:
            raise ValueError(f"exposed_us: unknown mode {unknown[0]!r}; expected some of {', '.join(CALIBRATED_MODES)}")
        if "sync" not in self.exposed_us:
            raise ValueError("exposed_us: needs the sync mode (the baseline every point is measured with)")
        return self


class PrefetchChunking(BaseModel):
    """How the calibration's runs ran their prefetch in chunks (the prefetch2 / prefetch3 modes: `decode_layers.py
    --prefetch-fractions`, `--prefetch-split`, `--prefetch-indexer` and `--last-chunk-prefetch`), recorded so that a
    profile's prefetchN layers run as they were measured (`stack_options`). One-chunk prefetch, the only prefetch the
    SGLang plugin runs, depends on none of them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fractions: tuple[Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)], ...] | None = None
    """The prefetchN mode with N = len(fractions) ran these chunk fractions (summing to 1); every other prefetchN
    ran N equal chunks. None: every one ran equal chunks."""
    split: Literal["rows", "positions"] = "rows"
    """What the chunks split: batch rows, or segments of the positions."""
    indexer: Literal["serial", "overlapped", "chained"] | None = None
    """How the chunks' indexer launches ran ("serial" for a run from before the key; None: a run that recorded
    null)."""
    last_chunk_prefetch: StrictBool = True
    """False: the last chunk did not prefetch (its misses were the exact resolve's)."""
    indexer_tiles: Annotated[StrictInt, Field(ge=1)] | None = None
    """The Triton indexer's tiles a program in the launches of the chunks after the first
    (`StackOptions.chunk_indexer_tiles`); None: the kernel's own (a run from before the key, or one that recorded
    null), which a profile's stack then runs too."""

    @model_validator(mode="after")
    def _fractions_sum_to_one(self) -> PrefetchChunking:
        if self.fractions is not None and (len(self.fractions) < 2 or abs(sum(self.fractions) - 1) > 1e-6):
            raise ValueError(f"fractions: two or more fractions in (0, 1) summing to 1, got {list(self.fractions)}")
        return self

    def stack_options(self) -> dict[str, Any]:
        """`StackOptions` keywords that run a profile's prefetchN layers as measured (with the profile's
        `prefetch_layers`; `overlap_policy.profile_stack_options`)."""
        out: dict[str, Any] = dict(prefetch_split=self.split, last_chunk_prefetch=self.last_chunk_prefetch,
                                   chunk_plans={len(self.fractions): self.fractions} if self.fractions else None)
        if self.indexer is not None:
            out["prefetch_indexer"] = self.indexer
        out["chunk_indexer_tiles"] = self.indexer_tiles  # (None: the kernel's own, as the runs measured)
        return out


class StackCalibration(BaseModel):
    """A grid of measured points (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    source: StrictStr
    """Where the numbers come from: file, command, date and device of the benchmark run."""
    points: list[MeasuredPoint]
    prefetch_margin: Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)] | None = None
    """The threshold margin the "prefetch_margin" / "prefetch2_margin" modes were measured with (and run with);
    None when the calibration has no such mode."""
    topk: StrictStr | None = None
    """The top-k the runs selected with (`decode_layers.py --topk`: "sglang", SGLang's decode kernel, or "torch" /
    "triton"); None where not recorded. The prefetch hides beside the top-k, so its modes' times depend on it."""
    prefetch_chunking: PrefetchChunking | None = None
    """How the runs' prefetch2 / prefetch3 modes split the indexer; None in a profile written before the key (what its
    runs measured is not known here: the decode stack's defaults run its layers)."""
    spare_refill_interval: PosInt | None = None
    """Where the times are the runs' with spare slots (`spare_slots=True`): every how many steps those runs refilled a
    layer's spare slots (`decode_layers.py --refill-interval`, `meta.refill_interval`; 1 where not recorded). None
    for times without spare slots, and in a profile written before the key."""

    @model_validator(mode="after")
    def _full_grid(self) -> StackCalibration:
        if not self.points:
            raise ValueError("points: the calibration holds no points")
        with_margin = sorted({m for p in self.points for m in p.exposed_us if m in MARGIN_MODES})
        if with_margin and self.prefetch_margin is None:
            raise ValueError(f"prefetch_margin: the points measure {with_margin[0]!r}, whose threshold margin this "
                             f"key must give")
        cells = self._cells()
        batches = sorted({b for b, _ in cells})
        contexts = sorted({c for _, c in cells})
        for b in batches:
            for c in contexts:
                pts = cells.get((b, c))
                if pts is None:
                    raise ValueError(f"points: batch {b} at context {c} is missing (the points must form a full "
                                     f"grid of batches {batches} x contexts {contexts})")
                misses = [p.misses for p in pts]
                if len(misses) < 2 or len(set(misses)) != len(misses):
                    raise ValueError(f"points: batch {b} at context {c} needs two or more points with distinct miss "
                                     f"counts, got misses {misses}")
        return self

    def _cells(self) -> dict[tuple[int, int], list[MeasuredPoint]]:
        cells: dict[tuple[int, int], list[MeasuredPoint]] = {}
        for p in self.points:
            cells.setdefault((p.batch, p.context), []).append(p)
        return {k: sorted(v, key=lambda p: p.misses) for k, v in cells.items()}

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes every point measured, in CALIBRATED_MODES order."""
        return tuple(m for m in CALIBRATED_MODES if all(m in p.exposed_us for p in self.points))

    @property
    def batches(self) -> list[int]:
        return sorted({p.batch for p in self.points})

    @property
    def contexts(self) -> list[int]:
        return sorted({p.context for p in self.points})

    def covers(self, batch: float, context: float) -> bool:
        """True when (batch, context) lies inside the measured grid."""
        b, c = self.batches, self.contexts
        return b[0] <= batch <= b[-1] and c[0] <= context <= c[-1]

    def exposed(self, misses: float, batch: float, context: float) -> dict[str, float] | None:
        """Each calibrated mode's exposed time (us per layer) at `misses` per step, or None outside the grid."""
        if misses < 0 or not math.isfinite(misses):
            raise CalibrationError(f"misses: must be a finite number >= 0, got {misses}")
        if batch <= 0 or context <= 0:
            raise CalibrationError(f"batch and context must be positive, got batch={batch}, context={context}")
        if not self.covers(batch, context):
            return None
        cells = self._cells()
        corners = [(b, wb * wc, c) for b, wb in _bracket(self.batches, batch) for c, wc in _bracket(self.contexts,
                                                                                                   context)]
        out = {}
        for mode in self.modes:
            out[mode] = max(sum(w * _along_misses(cells[(b, c)], mode, misses * b / batch)
                                for b, w, c in corners if w > 0), 0.0)
        return out


def _bracket(values: Sequence[int], x: float) -> list[tuple[int, float]]:
    """The grid values around x with their weights, linear in log x (one value with weight 1 on a grid point)."""
    i = bisect.bisect_left(values, x)
    if i < len(values) and values[i] == x:
        return [(values[i], 1.0)]
    lo, hi = values[i - 1], values[i]
    w = (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return [(lo, 1.0 - w), (hi, w)]


def _along_misses(points: Sequence[MeasuredPoint], mode: str, misses: float) -> float:
    """A corner's exposed time at `misses`: linear between its points, the end segments' slopes beyond them."""
    xs = [p.misses for p in points]
    i = min(max(bisect.bisect_right(xs, misses) - 1, 0), len(xs) - 2)
    x0, x1 = xs[i], xs[i + 1]
    y0, y1 = points[i].exposed_us[mode], points[i + 1].exposed_us[mode]
    return y0 + (y1 - y0) * (misses - x0) / (x1 - x0)


UNCHECKED = object()
"""`prefetch_fractions` not named by the caller: not checked (the calibration records the runs' own)."""


def load_calibration(path: str | Path | Sequence[str | Path], where: str | None = None,
                     spare_slots: bool = False, topk: str | None = None,
                     prefetch_split: str | None = None, prefetch_fractions: Any = UNCHECKED,
                     prefetch_indexer: str | None = None,
                     last_chunk_prefetch: bool | None = None,
                     chunk_indexer_tiles: Any = UNCHECKED, refill_interval: int | None = None) -> StackCalibration:
    """`calibration_from_decode_layers` of a JSON file, or of two: a run at margin 0 and a run at a threshold margin
    (`--prefetch-margin`), whose prefetch modes join as the *_margin modes. Every error is a CalibrationError
    starting with `where` (default: the path or paths)."""
    paths = [path] if isinstance(path, str | Path) else list(path)
    if not 1 <= len(paths) <= 2:
        raise CalibrationError(f"{where or 'calibration'}: one decode-stack run, or two (margin 0, then a threshold "
                               f"margin), got {len(paths)}")
    listed = ", ".join(str(p) for p in paths)
    where = where or listed
    runs = []
    for p in paths:
        at = where if len(paths) == 1 else str(p) if where == listed else f"{where}: {p}"
        try:
            runs.append(json.loads(Path(p).read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise CalibrationError(f"{at}: no such file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CalibrationError(f"{at}: cannot read JSON: {exc}") from None
    return calibration_from_decode_layers(runs[0], where, spare_slots, margin_run=runs[1] if len(runs) > 1 else None,
                                          topk=topk, prefetch_split=prefetch_split,
                                          prefetch_fractions=prefetch_fractions, prefetch_indexer=prefetch_indexer,
                                          last_chunk_prefetch=last_chunk_prefetch,
                                          chunk_indexer_tiles=chunk_indexer_tiles, refill_interval=refill_interval)


COMPARABLE_META = ("layers", "warm", "steps", "ratio", "pool_batch", "dba_split", "overlap_programs", "topk", "spare",
                   "device", "prefetch_indexer", "prefetch_fractions", "prefetch_split", "new_tokens_per_step",
                   "threshold_update", "resolve_pdl", "prefetch_pdl", "last_chunk_programs", "last_chunk_margin",
                   "last_chunk_priority", "last_chunk_prefetch", "overlap_copy_rows", "prefetch_claim",
                   "chunk_indexer_tiles", "refill_priority", "refill_interval")
"""`meta` keys of a decode-stack run that the two runs of a margin calibration must share (what else they measure
with), besides the margin itself."""


META_DEFAULTS = {"prefetch_split": "rows", "new_tokens_per_step": False, "last_chunk_prefetch": True,
                 "overlap_copy_rows": 8, "prefetch_claim": "separate", "prefetch_indexer": "serial",
                 "chunk_indexer_tiles": None, "refill_priority": "high", "refill_interval": 1}
"""What a run's meta key meant before the key was recorded (older runs lack it; chunk_indexer_tiles None: every
chunk's launch had the indexer kernel's own tiles a program)."""


def _fractions_key(fractions: Any) -> tuple[float, ...] | None:
    return None if fractions is None else tuple(round(float(f), 9) for f in fractions)


def _setting(meta: Mapping, key: str) -> Any:
    return meta.get(key, META_DEFAULTS.get(key))


def _meta(data: Any, where: str) -> Mapping:
    if not isinstance(data, Mapping) or not isinstance(data.get("rows"), list):
        raise CalibrationError(f"{where}: expected the JSON of benchmarks/decode_layers.py, a mapping with a 'rows' "
                               f"list")
    meta = data.get("meta")
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise CalibrationError(f"{where}: meta: expected a mapping, got {type(meta).__name__}")
    return meta


def _chunking(meta: Mapping, where: str) -> PrefetchChunking:
    """The run's prefetch chunking from its meta (keys absent in older runs: what they meant then)."""
    fractions = meta.get("prefetch_fractions")
    if fractions is not None and (isinstance(fractions, str | bytes) or not isinstance(fractions, Sequence)):
        raise CalibrationError(f"{where}: meta.prefetch_fractions: expected a list of chunk fractions or null, got "
                               f"{fractions!r}")
    try:
        indexer = _setting(meta, "prefetch_indexer")
        indexer = LEGACY_INDEXER.get(indexer, indexer) if isinstance(indexer, str) else indexer
        return PrefetchChunking(fractions=None if fractions is None else tuple(fractions),
                                split=_setting(meta, "prefetch_split"), indexer=indexer,
                                last_chunk_prefetch=_setting(meta, "last_chunk_prefetch"),
                                indexer_tiles=_setting(meta, "chunk_indexer_tiles"))
    except ValidationError as exc:
        first = exc.errors()[0]
        key = _CHUNKING_META.get(str(first["loc"][0]) if first["loc"] else "fractions", "prefetch_fractions")
        raise CalibrationError(f"{where}: meta.{key}: {first['msg']} (got {_setting(meta, key)!r})") from None


LEGACY_INDEXER = {"split": "serial"}
"""`meta.prefetch_indexer` values of runs from before its current names ("split", the name before "serial": one indexer
launch per chunk, one after the other on the main stream)."""
_CHUNKING_META = {"fractions": "prefetch_fractions", "split": "prefetch_split", "indexer": "prefetch_indexer",
                  "last_chunk_prefetch": "last_chunk_prefetch", "indexer_tiles": "chunk_indexer_tiles"}
"""PrefetchChunking's fields -> the decode-stack run's meta keys they come from."""


def _run_margin(meta: Mapping, where: str) -> float:
    margin = meta.get("prefetch_margin", 0.0)
    if margin is None:
        return 0.0
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < 1:
        raise CalibrationError(f"{where}: meta.prefetch_margin: expected a number in [0, 1), got {margin!r}")
    return float(margin)


def calibration_from_decode_layers(data: Any, where: str = "decode-stack results", spare_slots: bool = False,
                                   margin_run: Any = None, topk: str | None = None,
                                   prefetch_split: str | None = None,
                                   prefetch_fractions: Any = UNCHECKED,
                                   prefetch_indexer: str | None = None,
                                   last_chunk_prefetch: bool | None = None,
                                   chunk_indexer_tiles: Any = UNCHECKED,
                                   refill_interval: int | None = None) -> StackCalibration:
    """A calibration from the parsed JSON of `benchmarks/decode_layers.py` (`{"meta": ..., "rows": [...]}`).

    Every configuration (context, batch, hit) with an all-HBM row and a sync row with misses becomes a point; the
    configurations whose batch was measured at a single miss count (the small batches, whose tokens all fit) are left
    out, and so is every mode not measured at every remaining point. `spare_slots`: each mode's time from its run with
    spare slots (row "mode+spare"). The run must be at prefetch margin 0 (`meta.prefetch_margin`: its prefetch
    modes run at margin 0). `margin_run`: the JSON of a run at `--prefetch-margin m` > 0 with the same settings
    otherwise (`COMPARABLE_META`): its prefetch modes, against its own all-HBM rows, become "prefetch_margin" /
    "prefetch2_margin", which must then be measured at every point. `topk`: the top-k (decode_layers.py --topk) the
    runs must have selected with (`meta.topk`; a run without it selected with torch.topk): the prefetch hides beside
    the top-k, so another one's exposed times do not apply. `prefetch_split`: likewise, what the runs' prefetch
    chunks split (`meta.prefetch_split`, "rows" where absent): the prefetch2 layers of the profile run that way.
    `prefetch_fractions`: the chunk fractions the caller runs its prefetchN layers with (decode_layers.py
    --prefetch-fractions, None for equal chunks): the runs must have measured with the same (`meta.prefetch_fractions`).
    `prefetch_indexer`: how the caller launches its chunks ("serial" / "overlapped" / "chained"); a run launched
    otherwise (`meta.prefetch_indexer`, "serial" where absent: the runs before the key launched their chunks one after
    the other) is refused (serial and overlapped chunks measured 1.168 against 1.243 x at 64 / 32K).
    `last_chunk_prefetch`: whether the caller's last chunk prefetches; a run measured otherwise
    (`meta.last_chunk_prefetch`, True where absent) is refused. `chunk_indexer_tiles`: the tiles a program of the
    caller's chunk launches after the first (None: the kernel's own); a run measured with others
    (`meta.chunk_indexer_tiles`, None where absent) is refused. `refill_interval`: every how many steps the caller
    refills its spare slots; a run that refilled at another interval (`meta.refill_interval`, 1 where absent) is
    refused. What is not named is not checked: the calibration
    records the runs' chunking (`StackCalibration.prefetch_chunking`), and a profile's layers run it
    (`overlap_policy.profile_stack_options`)."""
    meta = _meta(data, where)
    where2 = f"{where} (margin run)"
    meta2 = _meta(margin_run, where2) if margin_run is not None else {}
    runs = [(meta, where)] + ([(meta2, where2)] if margin_run is not None else [])
    chunkings = [_chunking(m, w) for m, w in runs]  # (validated first: a malformed key is named, not a TypeError)
    for (m, w), ch in zip(runs, chunkings, strict=True):
        if prefetch_fractions is not UNCHECKED and _fractions_key(ch.fractions) != _fractions_key(prefetch_fractions):
            raise CalibrationError(f"{w}: measured with indexer chunks {m.get('prefetch_fractions')!r} "
                                   f"(meta.prefetch_fractions), this "
                                   f"run's are {None if prefetch_fractions is None else list(prefetch_fractions)!r}: "
                                   f"its exposed times do not apply")
        if topk is not None:
            measured_with = m.get("topk", "torch")
            if measured_with != topk:
                raise CalibrationError(f"{w}: measured with --topk {measured_with} (meta.topk), this run selects with "
                                       f"--topk {topk}: its exposed times do not apply (the top-k is what ECHO hides "
                                       f"beside)")
        if prefetch_indexer is not None and ch.indexer != prefetch_indexer:
            raise CalibrationError(f"{w}: its prefetch chunks were launched {ch.indexer} (meta.prefetch_indexer), "
                                   f"this run's {prefetch_indexer}: its exposed times do not apply")
        if last_chunk_prefetch is not None and ch.last_chunk_prefetch != last_chunk_prefetch:
            raise CalibrationError(f"{w}: its last prefetch chunk prefetched: {ch.last_chunk_prefetch} "
                                   f"(meta.last_chunk_prefetch), this caller's: {last_chunk_prefetch}: its exposed "
                                   f"times do not apply")
        theirs = _setting(m, "refill_interval")
        if refill_interval is not None and theirs != refill_interval:
            raise CalibrationError(f"{w}: its spare slots were refilled every {theirs} steps (meta.refill_interval), "
                                   f"this run's every {refill_interval}: its times do not apply")
        if chunk_indexer_tiles is not UNCHECKED and ch.indexer_tiles != chunk_indexer_tiles:
            raise CalibrationError(f"{w}: its later prefetch chunks' indexer launches ran {ch.indexer_tiles} tiles a "
                                   f"program (meta.chunk_indexer_tiles; None: the kernel's own), this run's "
                                   f"{chunk_indexer_tiles}: its exposed times do not apply")
        if prefetch_split is not None and ch.split != prefetch_split:
            raise CalibrationError(f"{w}: its prefetch chunks split {ch.split} "
                                   f"(meta.prefetch_split), this run's split {prefetch_split}: its exposed times do "
                                   f"not apply")
    first = _run_margin(meta, where)
    if first != 0:
        raise CalibrationError(f"{where}: measured at prefetch margin {first} (meta.prefetch_margin), but its prefetch "
                               f"modes would run at margin 0: give a run at margin 0, and this one as the margin run "
                               f"(ess profile / decode_layers.py --calibration-margin)")
    margin = None
    if margin_run is not None:
        margin = _run_margin(meta2, where2)
        if margin == 0:
            raise CalibrationError(f"{where}: the margin run must be at a prefetch margin in (0, 1) "
                                   f"(meta.prefetch_margin; decode_layers.py --prefetch-margin), got 0")
        # (the chunking keys compared as read: a legacy name and its current one are the same launch)
        differ = [k for k in COMPARABLE_META if k not in _CHUNKING_META.values() and _setting(meta, k) !=
                  _setting(meta2, k)] + [key for field, key in _CHUNKING_META.items()
                                        if getattr(chunkings[0], field) != getattr(chunkings[1], field)]
        if differ:
            k = differ[0]
            raise CalibrationError(f"{where}: the two runs differ in meta.{k} ({_setting(meta, k)!r} against "
                                   f"{_setting(meta2, k)!r}): measure both with the same settings but the margin")
    raw = _measured(data, where, spare_slots)
    if margin_run is not None:
        extra = _measured(margin_run, where2, spare_slots, with_misses=False)
        for key, p in raw.items():
            got = extra[key]["exposed_us"] if key in extra else {}
            p["exposed_us"].update({mode: got[as_mode] for mode, as_mode in MARGIN_MODES.items() if as_mode in got})
    # batches measured at one miss count only cannot be interpolated along misses: leave their whole batch out
    counts: dict[tuple[int, int], set] = {}
    for p in raw.values():
        counts.setdefault((p["batch"], p["context"]), set()).add(p["misses"])
    thin = {b for (b, _), m in counts.items() if len(m) < 2}
    raw = {key: p for key, p in raw.items() if p["batch"] not in thin}
    if not raw:
        raise CalibrationError(f"{where}: no configuration was measured at two or more hit rates with misses")
    common = [m for m in CALIBRATED_MODES if all(m in p["exposed_us"] for p in raw.values())]
    if margin_run is not None and not any(m in MARGIN_MODES for m in common):
        lacking = [key for key, p in raw.items() if not any(m in p["exposed_us"] for m in MARGIN_MODES)]
        raise CalibrationError(f"{where}: the margin run measured neither prefetch, prefetch2 nor prefetch3"
                               f"{' with spare slots' if spare_slots else ''} at every point of the first run; "
                               f"missing at (context, batch, hit) {lacking[0]}" + (f" and {len(lacking) - 1} more"
                                                                                   if len(lacking) > 1 else ""))
    for p in raw.values():
        p["exposed_us"] = {m: p["exposed_us"][m] for m in common}
    source = (f"{where}: {meta.get('command', '?')} ({meta.get('date', '?')}, {meta.get('device', '?')}); "
              f"time per layer minus the all-HBM stack's{' (the runs with spare slots)' if spare_slots else ''}, "
              f"misses per layer of the sync run")
    if margin is not None:
        source += (f"; the *_margin modes from {meta2.get('command', '?')} ({meta2.get('date', '?')}), prefetch "
                   f"margin {margin}")
    try:
        return StackCalibration(source=source, points=[MeasuredPoint(**p) for p in raw.values()],
                                prefetch_margin=margin, topk=meta.get("topk", "torch"),
                                prefetch_chunking=chunkings[0],
                                spare_refill_interval=_setting(meta, "refill_interval") if spare_slots else None)
    except ValueError as exc:
        raise CalibrationError(f"{where}: {exc}") from None


def _measured(data: Any, where: str, spare_slots: bool, with_misses: bool = True) -> dict[tuple, dict]:
    """Per configuration (context, batch, hit) of a decode-stack run: batch, context, the sync run's misses per
    layer and step, and each measured mode's exposed time (`spare_slots`: from the "mode+spare" rows).
    `with_misses=False` (a margin run, whose misses are not used): configurations without a sync row count too."""
    _meta(data, where)
    by_config: dict[tuple, dict[str, Mapping]] = {}
    for i, row in enumerate(data["rows"]):
        try:
            key = (int(row["context"]), int(row["batch"]), float(row["target_hit"]))
            by_config.setdefault(key, {})[str(row["variant"])] = row
        except (KeyError, TypeError, ValueError) as exc:
            raise CalibrationError(f"{where}: rows[{i}]: not a decode-stack row ({exc!r})") from None
    suffix = "+spare" if spare_slots else ""
    if spare_slots and not any(v.endswith(suffix) for rows in by_config.values() for v in rows):
        raise CalibrationError(f"{where}: no runs with spare slots (rows 'mode+spare': benchmarks/decode_layers.py "
                               f"--spare 0,auto)")
    raw = {}
    for key, rows in sorted(by_config.items()):
        context, batch, _hit = key
        if "hbm" not in rows or with_misses and "sync" not in rows:
            continue
        per_layer = (rows["sync"].get("misses_per_layer_step") or []) if with_misses else [math.nan]
        if not per_layer:
            continue
        hbm_us = float(rows["hbm"]["layer_us"])
        exposed = {m: round(float(rows[m + suffix]["layer_us"]) - hbm_us, 3) for m in CALIBRATED_MODES
                   if m not in MARGIN_MODES and m + suffix in rows and "layer_us" in rows[m + suffix]}
        raw[key] = dict(batch=batch, context=context, misses=round(sum(per_layer) / len(per_layer), 3),
                        exposed_us=exposed)
    return raw
