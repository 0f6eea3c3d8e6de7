"""`ess profile`: count every layer's misses per decode step on a top-k trace and choose each layer's overlap mode.

The trace (a recorded ``.npz``, a synthetic one, or the demo model's own) is replayed on CPU through the real
`HotPoolCacheManager` (plain-torch resolve, no entry bytes moved) exactly as `ess_sglang.traces.replay_ess` does:
warm-up, then per step `begin_step`, and per layer the resolve with the step's new tokens, as the SGLang plugin runs
it (`new_tokens: insert`, the default: a selected new token is no miss). The manager's device counters are
snapshotted after every step, which gives the distinct misses and the lookups of every layer in every step. The cost
model of `ess_sglang.overlap_policy` then picks sync / dba per layer (and prefetch / prefetch2 / prefetch3 too,
with a measured `--calibration`, and their threshold-margin variants with `--calibration-margin`), and the profile is
written as YAML::

    ess profile --trace benchmarks/traces/smollm2-135m_sample.npz --ratio 0.2 --out configs/overlap/x.yaml
    ess profile --synthetic --gen-layers 16 --batch 64 --context 32768 --top-k 2048
    ess profile --demo --slots-per-layer 4096
    ess profile --synthetic --batch 64 --context 32768 --top-k 2048 --calibration-spare \
        --calibration configs/overlap/calibration/h200_sglang-topk_margin0.json \
        --calibration-margin configs/overlap/calibration/h200_sglang-topk_margin0.01.json

The cost model runs at --batch / --context / --top-k (default: the trace's own); when they differ from the trace's,
the measured misses are scaled by (batch / trace batch) x (top_k / trace top-k), i.e. the measured miss rate per
selected entry is assumed to carry over.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections import Counter
from datetime import datetime, timezone

import numpy as np

from ess_sglang.config import DEFAULT_SPARSE_MEMORY_RATIO, EssConfig, round_up
from ess_sglang.overlap_policy import (
    MODES,
    ONE_CALL_MODES,
    PREFETCH_CHUNKS,
    SPARE_HEADROOM,
    DeviceTimings,
    OverlapProfile,
    OverlapProfileError,
    ProfileHeader,
    build_profile,
    device_timings_from_mapping,
    dump_profile,
    read_yaml,
    save_profile,
)

PAGE_SIZE = EssConfig.model_fields["page_size"].default  # hot slots from --ratio round up to it, as EssConfig.plan
DEFAULT_RATIO = DEFAULT_SPARSE_MEMORY_RATIO
SYNTHETIC_DEFAULTS = dict(batch=4, context=8192, layers=8, steps=64, top_k=512, overlap="0.98:0.80", burst_prob=0.02)
DEMO_DEFAULTS = dict(batch=4, context=4096, layers=4, steps=64, top_k=256)

# (dest, flag) in the order the regenerating command line lists them
_FLAGS = [("trace", "--trace"), ("synthetic", "--synthetic"), ("demo", "--demo"), ("gen_batch", "--gen-batch"),
          ("gen_context", "--gen-context"), ("gen_layers", "--gen-layers"), ("gen_steps", "--gen-steps"),
          ("gen_top_k", "--gen-top-k"), ("seed", "--seed"), ("overlap", "--overlap"), ("burst_prob", "--burst-prob"),
          ("ratio", "--ratio"), ("slots_per_layer", "--slots-per-layer"), ("warmup", "--warmup"),
          ("batch", "--batch"), ("context", "--context"), ("top_k", "--top-k"), ("by", "--by"),
          ("device_timings", "--device-timings"), ("calibration", "--calibration"),
          ("calibration_margin", "--calibration-margin"), ("calibration_spare", "--calibration-spare"),
          ("out", "--out")]
_GEN_DESTS = ("gen_batch", "gen_context", "gen_layers", "gen_steps", "gen_top_k", "seed", "overlap", "burst_prob")


class _FlagError(Exception):
    """Bad input, phrased with the flag's name."""


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a{'n integer' if kind is int else ' number'}: {text!r}") from None
        if not (math.isfinite(v) and v > 0):
            raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
        return v
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``ess profile``. Every default is None here and resolved in `run`, so that the command line written
    into the profile lists exactly the flags that were given."""
    src = p.add_argument_group("trace (one of them; default --synthetic)").add_mutually_exclusive_group()
    src.add_argument("--trace", metavar="PATH.npz", help="a recorded top-k trace (ess_sglang.traces format)")
    src.add_argument("--synthetic", action="store_true", help="generate a synthetic trace (knobs below)")
    src.add_argument("--demo", action="store_true", help="record the embedded demo DSA model's top-k on CPU")
    s, d = SYNTHETIC_DEFAULTS, DEMO_DEFAULTS
    gen = p.add_argument_group("generated trace (--synthetic / --demo)")
    gen.add_argument("--gen-batch", type=_positive(int), metavar="N",
                     help=f"requests (default {s['batch']} / {d['batch']})")
    gen.add_argument("--gen-context", type=_positive(int), metavar="TOKENS",
                     help=f"prompt length of the longest request (default {s['context']} / {d['context']})")
    gen.add_argument("--gen-layers", type=_positive(int), metavar="N", help=f"layers (default {s['layers']} / "
                     f"{d['layers']})")
    gen.add_argument("--gen-steps", type=_positive(int), metavar="N", help=f"decode steps (default {s['steps']} / "
                     f"{d['steps']})")
    gen.add_argument("--gen-top-k", type=_positive(int), metavar="K", help=f"positions selected per request and layer "
                     f"(default {s['top_k']} / {d['top_k']})")
    gen.add_argument("--seed", type=int, help="generator / model seed (default 0)")
    gen.add_argument("--overlap", metavar="F|F,F,..|A:B", help="synthetic: fraction of each step's picks kept from the "
                     "previous step: one value, one per layer, or A:B spread linearly from the first layer to the "
                     f"last (default {s['overlap']})")
    gen.add_argument("--burst-prob", type=float, metavar="P", help="synthetic: probability that a request changes "
                     f"topic at a step (default {s['burst_prob']})")
    pool = p.add_argument_group("hot pool").add_mutually_exclusive_group()
    pool.add_argument("--ratio", type=_positive(float), help="hot slots per layer / tokens the trace holds at its last "
                      f"step, rounded up to a multiple of {PAGE_SIZE} (default {DEFAULT_RATIO})")
    pool.add_argument("--slots-per-layer", type=_positive(int), metavar="N", help="hot slots per layer, directly")
    p.add_argument("--warmup", choices=["auto", "windows", "recent", "none"],
                   help="warm-up before the first step, as replay_ess (default auto: windows when the trace has them)")
    cost = p.add_argument_group("cost model (ess_sglang.overlap_policy)")
    cost.add_argument("--batch", type=_positive(int), help="requests per decode batch (default: the trace's)")
    cost.add_argument("--context", type=_positive(int), metavar="TOKENS",
                      help="tokens per request (default: the trace's mean)")
    cost.add_argument("--top-k", type=_positive(int), metavar="K", help="selected entries per request and layer "
                      "(default: the trace's)")
    cost.add_argument("--by", choices=["mean", "p95"], help="choose on each layer's mean or p95 misses per step "
                      "(default mean)")
    cost.add_argument("--device-timings", metavar="YAML", help="override the H200 timing constants: a mapping of "
                      "DeviceTimings keys, or a profile's device: section")
    cost.add_argument("--calibration", metavar="JSON", help="measured exposed time of every mode on this device: the "
                      "JSON of a benchmarks/decode_layers.py run (with its sync, prefetch, prefetch2, ... modes); "
                      "where its grid of batches x contexts covers --batch / --context it replaces the analytic model "
                      "and adds the prefetch modes")
    cost.add_argument("--calibration-margin", metavar="JSON", help="a second decode_layers.py run, at "
                      "--prefetch-margin m > 0 (the --calibration run at margin 0): its prefetch modes are offered "
                      "as prefetch_margin / prefetch2_margin, and a layer that runs one prefetches with margin m")
    cost.add_argument("--calibration-spare", action="store_true", help="take the calibration's runs with spare "
                      "slots (rows 'mode+spare' of a run with --spare), for a runtime that keeps spare slots")
    p.add_argument("--out", metavar="PATH.yaml", help="write the profile here (default: print the YAML to stdout, "
                   "the table to stderr)")


def command_line(args: argparse.Namespace) -> str:
    """The `ess profile` command line of the flags given (those not None / False)."""
    parts = ["ess", "profile"]
    for dest, flag in _FLAGS:
        v = getattr(args, dest, None)
        if v is None or v is False:
            continue
        parts.append(flag)
        if v is not True:
            parts.append(f"{v:g}" if isinstance(v, float) else str(v))
    return shlex.join(parts)


# ------------------------------------------------------------------------------------------------ replay

def replay_misses(trace, slots_per_layer: int, warmup: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """Replay `trace` through `HotPoolCacheManager` as `replay_ess` does; per-step counts of every layer.

    Returns (misses, lookups), int64 [steps, layers]: the distinct entries fetched and the valid selected entries of
    each layer's resolve in each step (the whole batch). Their sums over steps equal replay_ess's per-layer counts.
    """
    import torch

    from ess_sglang.cache_manager import Counter
    from ess_sglang.traces import replay_ess

    trace.validate()
    if warmup == "windows" and trace.warmup_topk is None:
        raise _FlagError("--warmup windows: the trace has no warm-up windows (warmup_topk); use recent or none")
    cols = [int(Counter.LOOKUPS), int(Counter.MISSES)]
    after = [torch.zeros((trace.topk.shape[1], 2), dtype=torch.int64)]  # warm-up counts neither

    def snapshot(step, manager) -> None:
        after.append(manager.counters[:, cols].clone())

    try:
        replay_ess(trace, slots_per_layer, warmup=warmup, on_step=snapshot)
    except RuntimeError as exc:  # the pool cannot hold one step's selections
        raise _FlagError(f"the hot pool ({slots_per_layer} slots per layer) is too small for one step: {exc}; "
                         f"raise --ratio or --slots-per-layer") from None
    per_step = torch.diff(torch.stack(after), dim=0).numpy()
    return per_step[:, :, 1].astype(np.int64), per_step[:, :, 0].astype(np.int64)


# ------------------------------------------------------------------------------------------------ inputs

def _overlap_values(text: str, layers: int) -> float | list[float]:
    try:
        if ":" in text:
            a, b = (float(x) for x in text.split(":"))
            return [round(float(v), 6) for v in np.linspace(a, b, layers)] if layers > 1 else a
        if "," in text:
            return [float(x) for x in text.split(",")]
        return float(text)
    except ValueError:
        raise _FlagError(f"--overlap: {text!r} is not a number, a comma-separated list or A:B") from None


def _load_trace(args: argparse.Namespace):
    """(trace, source, description) from the flags."""
    from pydantic import ValidationError

    from ess_sglang.traces import SyntheticTraceConfig, TopKTrace, TraceError, record_demo_trace, synthetic_trace

    gen_given = [flag for dest, flag in _FLAGS if dest in _GEN_DESTS and getattr(args, dest) is not None]
    if args.trace is not None:
        if gen_given:
            raise _FlagError(f"{', '.join(gen_given)}: only for --synthetic / --demo, not with --trace")
        try:
            return TopKTrace.load(args.trace), "trace", args.trace
        except FileNotFoundError:
            raise _FlagError(f"--trace {args.trace}: no such file") from None
        except TraceError as exc:
            raise _FlagError(f"--trace {args.trace}: {exc}") from None
        except (OSError, ValueError, KeyError) as exc:
            raise _FlagError(f"--trace {args.trace}: cannot read it as a top-k trace (.npz): {exc}") from None
    if args.demo:
        d = DEMO_DEFAULTS
        for flag in ("--overlap", "--burst-prob"):
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                raise _FlagError(f"{flag}: only for --synthetic")
        kw = dict(batch=args.gen_batch or d["batch"], context_len=args.gen_context or d["context"],
                  steps=args.gen_steps or d["steps"], layers=args.gen_layers or d["layers"],
                  top_k=args.gen_top_k or d["top_k"], seed=args.seed or 0)
        if kw["top_k"] > kw["context_len"] // 2:
            raise _FlagError(f"--gen-top-k: {kw['top_k']} is too large for --gen-context {kw['context_len']}")
        desc = "demo model: " + ", ".join(f"{k} {v}" for k, v in kw.items())
        return record_demo_trace(**kw), "demo", desc
    s = SYNTHETIC_DEFAULTS
    layers = args.gen_layers or s["layers"]
    ctx = args.gen_context or s["context"]
    top_k = args.gen_top_k or s["top_k"]
    knobs = dict(batch=args.gen_batch or s["batch"], context_len=ctx, num_layers=layers,
                 steps=args.gen_steps or s["steps"], top_k=top_k, seed=args.seed or 0,
                 overlap=_overlap_values(args.overlap or s["overlap"], layers),
                 burst_prob=s["burst_prob"] if args.burst_prob is None else args.burst_prob,
                 recent_window=min(1024, ctx // 2), warmup_windows=min(32, ctx // 4))
    try:
        cfg = SyntheticTraceConfig(**knobs)
    except ValidationError as exc:
        flags = dict(batch="--gen-batch", context_len="--gen-context", num_layers="--gen-layers",
                     steps="--gen-steps", top_k="--gen-top-k", overlap="--overlap", burst_prob="--burst-prob",
                     seed="--seed")
        lines = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            msg = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
            if not field and msg.split(": ", 1)[0] in flags:  # a model-level check names its field first
                field, msg = msg.split(": ", 1)
            lines.append(f"{flags.get(field, field or 'synthetic trace')}: {msg}")
        raise _FlagError("\n".join(lines)) from None
    desc = "synthetic: " + ", ".join(f"{k} {v}" for k, v in knobs.items() if k not in ("recent_window",))
    return synthetic_trace(cfg), "synthetic", desc


def _slots(args: argparse.Namespace, trace) -> tuple[int, float | None]:
    need = trace.batch * (trace.top_k + 1)
    if args.slots_per_layer is not None:
        slots, ratio, flag = args.slots_per_layer, None, f"--slots-per-layer {args.slots_per_layer}"
    else:
        ratio = DEFAULT_RATIO if args.ratio is None else args.ratio
        tokens = int(trace.prompt_lens.sum()) + trace.steps * trace.batch
        slots = round_up(math.ceil(ratio * tokens - 1e-9), PAGE_SIZE)
        flag = f"--ratio {ratio:g} ({slots} slots per layer for {tokens} tokens)"
    if slots < need:
        raise _FlagError(f"{flag}: one step needs batch {trace.batch} x (top-k {trace.top_k} + 1 new token) = {need} "
                         f"hot slots per layer; raise it")
    return slots, ratio


def _device(args: argparse.Namespace) -> DeviceTimings:
    device = DeviceTimings()
    if args.device_timings is not None:
        where = f"--device-timings {args.device_timings}"
        device = device_timings_from_mapping(read_yaml(args.device_timings, "--device-timings"), where)
    spare = bool(getattr(args, "calibration_spare", False))
    margin = getattr(args, "calibration_margin", None)
    if getattr(args, "calibration", None) is not None:
        device = device.model_copy(update={"measured": _calibration(args.calibration, spare, margin)})
    elif spare:
        raise _FlagError("--calibration-spare: needs --calibration (the JSON whose runs with spare slots to read)")
    elif margin is not None:
        raise _FlagError("--calibration-margin: needs --calibration (the run at margin 0 it adds to)")
    return device


def _calibration(path: str, spare_slots: bool = False, margin_path: str | None = None):
    from ess_sglang.stack_calibration import CalibrationError, load_calibration

    where = f"--calibration {path}" + (f" --calibration-margin {margin_path}" if margin_path else "")
    try:
        # (the runs' prefetch chunking is recorded in the profile, for the decode harness's prefetchN layers)
        return load_calibration([path] if margin_path is None else [path, margin_path], where,
                                spare_slots=spare_slots)
    except CalibrationError as exc:
        raise _FlagError(str(exc)) from None


def make_profile(args: argparse.Namespace) -> OverlapProfile:
    """Everything `ess profile` computes, without printing (raises _FlagError / OverlapProfileError)."""
    device = _device(args)
    trace, source, desc = _load_trace(args)
    slots, ratio = _slots(args, trace)
    warmup = args.warmup or "auto"
    misses, lookups = replay_misses(trace, slots, warmup)
    context_mean = float(trace.seq_lens.mean())
    batch = args.batch or trace.batch
    top_k = args.top_k or trace.top_k
    header = ProfileHeader(
        command=command_line(args), date=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        source=source, trace=desc, trace_batch=trace.batch, trace_top_k=trace.top_k,
        trace_context_mean=round(context_mean, 3), steps=trace.steps, slots_per_layer=slots, ratio=ratio,
        warmup=warmup, batch=batch, context=args.context or max(int(round(context_mean)), 1), top_k=top_k,
        miss_scale=round((batch / trace.batch) * (top_k / trace.top_k), 6), chosen_by=args.by or "mean")
    return build_profile(misses, lookups, header, device)


# ------------------------------------------------------------------------------------------------ output

def print_table(profile: OverlapProfile, stderr: bool = False) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    h = profile.header
    console = Console(stderr=stderr)
    # the modes offered somewhere (prefetch ones only with a calibration); exposed microseconds per layer
    shown = [m for m in MODES if any(lp.exposed_us.as_dict()[m] is not None for lp in profile.layers)]
    # every column whole (numbers are never cut), even in a narrow terminal
    console.width = max(console.width, 104, 54 + 10 * len(shown) + 8 * sum(m.endswith("_margin") for m in shown))
    ratio = f" (ratio {h.ratio:g})" if h.ratio is not None else ""
    scale = f", misses x {h.miss_scale:g}" if h.miss_scale != 1 else ""
    t = Table(title=f"overlap profile: {h.source}, {h.steps} steps, {h.slots_per_layer} hot slots/layer{ratio}; "
                    f"cost model at batch {h.batch}, context {h.context}, top-k {h.top_k}{scale}")
    t.box, t.caption = box.SIMPLE_HEAD, "exposed us per layer of each mode; the chosen one in bold"
    for name in ("layer", "misses/step", "p95", "hit rate", *shown):
        t.add_column(name, justify="right")
    t.add_column("mode", no_wrap=True)
    for lp in profile.layers:
        times = {m: lp.exposed_us.as_dict()[m] for m in shown}
        cells = [("-" if v is None else f"{v:.1f}") for v in times.values()]
        cells = [f"[bold]{c}[/]" if m == lp.mode else c for c, m in zip(cells, times, strict=True)]
        t.add_row(str(lp.layer), f"{lp.misses_mean:.1f}", f"{lp.misses_p95:.1f}", f"{lp.hit_rate:.4f}", *cells,
                  lp.mode)
    console.print(t)
    counts = {m: profile.modes().count(m) for m in MODES}
    console.print("modes: " + ", ".join(f"{n} {m}" for m, n in counts.items() if n or m in ("sync", "dba")),
                  highlight=False)
    console.print(f"spare slots, for a runtime that keeps them (HotPoolCacheManager(spare_slots=...)): "
                  f"{profile.spare_slots():,} per layer ({SPARE_HEADROOM:g} x the busiest layer's misses per step; K "
                  f"times as many when refilled every K-th step: HotPoolCacheManager(refill_interval=K))"
                  + (f"; the calibration's runs with spare slots refilled every {refill} steps"
                     if (refill := getattr(profile.device.measured, "spare_refill_interval", None)) else ""),
                  highlight=False)
    plugin = Counter(profile.modes_within(ONE_CALL_MODES))
    console.print("the SGLang plugin (one indexer launch and one attention launch per layer) runs: "
                  + ", ".join(f"{n} {m}" for m, n in plugin.items()), highlight=False)
    if profile.device.measured is not None:
        where = "inside" if profile.device.measured.covers(h.batch, h.context) else "outside (analytic model used)"
        margin = profile.device.measured.prefetch_margin
        console.print(f"calibration: batch {h.batch} / context {h.context} is {where} its grid of batches "
                      f"{profile.device.measured.batches} x contexts {profile.device.measured.contexts}"
                      + (f"; the *_margin modes prefetch with threshold margin {margin:g}" if margin else ""),
                      highlight=False)
        chunking = profile.device.measured.prefetch_chunking
        if chunking is not None and any(PREFETCH_CHUNKS.get(m, 0) > 1 for m in profile.modes()):
            fr = (f"{len(chunking.fractions)} chunks of {' / '.join(f'{f:g}' for f in chunking.fractions)}, "
                  if chunking.fractions else "")
            launches = chunking.indexer or "not recorded (the stack default)"
            tiles = chunking.indexer_tiles
            launches += " (the kernel's own tiles a program)" if tiles is None else \
                f" ({tiles} tile{'s' if tiles > 1 else ''} a program after the first)"
            console.print(f"its prefetchN layers run as the calibration measured them: {fr}split by "
                          f"{chunking.split}, indexer launches {launches}, "
                          f"last chunk {'prefetching' if chunking.last_chunk_prefetch else 'left to the resolve'} "
                          f"(overlap_policy.profile_stack_options)", highlight=False)
        topk = profile.device.measured.topk
        if topk not in (None, "sglang"):
            console.print(f"warning: the calibration selected with --topk {topk}; SGLang's decode (and the plugin) "
                          f"selects with its own top-k kernel, which takes far less time: the prefetch modes hide "
                          f"less beside it than this calibration measured (calibrate with --topk sglang)",
                          highlight=False)


def run(args: argparse.Namespace) -> int:
    """``ess profile``: 0 when the profile was written, 2 on bad input."""
    try:
        profile = make_profile(args)
    except (_FlagError, OverlapProfileError) as exc:
        print(f"ess profile: error: {exc}", file=sys.stderr)
        return 2
    if args.out is None:
        print_table(profile, stderr=True)
        sys.stdout.write(dump_profile(profile))
    else:
        print_table(profile)
        path = save_profile(profile, args.out)
        print(f"wrote {path}")
    return 0
