"""ESS against SGLang 0.5.23 HiSparse on identical top-k traces: hit rate and bytes moved (CPU), at equal GPU memory.

Two policies replay the same traces (`ess_sglang.traces`):

- ESS: one LRU hot pool per layer shared by the whole batch (`HotPoolCacheManager`, plain-torch path on the CPU), with
  ESS's warm-up (the union of the prefill's last query windows' top-k; the most recent prompt tokens when a trace
  has no windows), new tokens stored into protected hot slots every step; hits and misses from its counters.
- HiSparse: an emulation of its per-request, per-layer buffer (`ess_sglang.hisparse_policy`, read from the sglang
  0.5.23 source: exact LRU at step granularity over `device_buffer_size` slots, newest token in an extra page and
  dropped after one step, warm-up = the prompt's first `device_buffer_size` tokens on a non-PD server ("staged"),
  nothing for a long prompt on a PD decode server ("pd_direct")).

Equal GPU memory: HiSparse holds device_buffer_size + one page per request and layer (2 x top_k + 64 = 4,160 slots at
DeepSeek's top_k 2,048; `device_buffer_size` defaults to 2 x top_k in sglang); ESS gets the same bytes as one shared
pool per layer: batch x 4,160 slots. For traces with a smaller k (the demo at a small size, the real 135M model at 4K
context) both sizes scale with k: device_buffer_size = 2 x k and the page = 64 x k / 2048 (at least 1).

Bytes moved = misses x 656 (one V32 latent entry each), per layer and overall; warm-up loads are reported apart
(HiSparse's staged warm-up moves nothing: the prefill's device copies stay; ESS's warm-up reads the host pool). Both
policies write every new token back to the host once (same D2H bytes): not counted.

    python benchmarks/vs_hisparse.py                   # all families; table, results/vs_hisparse_hits.{json,png}
    python benchmarks/vs_hisparse.py --quick           # small synthetic traces only (a smoke run, ~10 s)

The real-model family reads `benchmarks/traces/smollm2-135m_sample.npz` (recorded by `record_real_traces.py`;
`--real-trace PATH` for another). The GPU timing side (HiSparse's kernel built through tvm-ffi against our resolve on
the H200) is not here: `gpu_timing` raises NotImplementedError.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ess_sglang.hisparse_policy import replay_hisparse
from ess_sglang.traces import (
    ENTRY_BYTES,
    ReplayStats,
    SyntheticTraceConfig,
    TopKTrace,
    record_demo_trace,
    replay_ess,
    synthetic_trace,
)

HERE = Path(__file__).resolve().parent
DEFAULT_REAL = HERE / "traces" / "smollm2-135m_sample.npz"
DEEPSEEK_TOP_K, HISPARSE_BUFFER, HISPARSE_PAGE = 2048, 4096, 64


def gpu_timing(*args, **kwargs):
    """Time HiSparse's `load_cache_to_device_buffer_mla` kernel against our resolve + FlashTrans on the H200.

    Not written here: the GPU side of issue 3 belongs to another piece of work.
    """
    raise NotImplementedError("GPU timing side: see RESULTS.md")


def hisparse_sizes(top_k: int) -> tuple[int, int]:
    """(device_buffer_size, extra page) for a trace's k: 4096 + 64 at k = 2048, scaled with k otherwise."""
    if top_k == DEEPSEEK_TOP_K:
        return HISPARSE_BUFFER, HISPARSE_PAGE
    return 2 * top_k, max(1, HISPARSE_PAGE * top_k // DEEPSEEK_TOP_K)


@dataclass
class Family:
    name: str
    kind: str  # synthetic | demo | real
    describe: str
    make: object  # () -> TopKTrace


def synthetic_families(quick: bool) -> list[Family]:
    if quick:
        base = dict(batch=4, context_len=4096, top_k=256, steps=48, num_layers=2, recent_window=128,
                    warmup_windows=8)
    else:
        base = dict(batch=8, context_len=32768, top_k=2048, steps=128, num_layers=4, recent_window=1024,
                    warmup_windows=32)
    settings = [
        ("syn-steady", "overlap 0.9, recency 0.2, 4 sinks", {}),
        ("syn-sticky", "overlap 0.97", dict(overlap=0.97)),
        ("syn-recent", "recency 0.6 (fresh picks mostly among the last 1K tokens)", dict(recency=0.6)),
        ("syn-bursty", "bursts: p=0.05 per step, replace 60%", dict(burst_prob=0.05, burst_fraction=0.6)),
        ("syn-layers", "overlap per layer 0.98 / 0.93 / 0.85 / 0.7",
         dict(overlap=[0.98, 0.93, 0.85, 0.7] if not quick else [0.95, 0.7])),
        ("syn-short-mix", "prompt lengths spread over [0.1, 1] x 32K (some shorter than HiSparse's buffer)",
         dict(length_spread=0.9)),
        ("syn-short", "every prompt 3,000-4,000 tokens: shorter than HiSparse's buffer (2 x k)",
         dict(context_len=4000, length_spread=0.25) if not quick else dict(context_len=500, length_spread=0.25)),
    ]
    out = []
    for name, describe, knobs in settings:
        cfg = SyntheticTraceConfig(**{**base, **knobs})
        out.append(Family(name, "synthetic", describe, lambda cfg=cfg: synthetic_trace(cfg)))
    return out


def demo_family(quick: bool) -> Family:
    kw = (dict(batch=2, context_len=2048, steps=16, layers=2, top_k=128, warmup_windows=8) if quick else
          dict(batch=4, context_len=32768, steps=64, layers=4, top_k=2048, warmup_windows=32))
    return Family("demo", "demo", f"demo DSA model's indexer: batch {kw['batch']}, context {kw['context_len']}, "
                  f"top-k {kw['top_k']}, {kw['layers']} layers, {kw['steps']} steps",
                  lambda: record_demo_trace(**kw))


def real_family(path: Path) -> Family:
    def make() -> TopKTrace:
        return TopKTrace.load(path)

    return Family("real", "real", f"SmolLM2-135M over pydoc topics ({path.name})", make)


def run_family(fam: Family) -> dict:
    t0 = time.time()
    trace = fam.make()
    t_make = time.time() - t0
    H, page = hisparse_sizes(trace.top_k)
    slots = trace.batch * (H + page)
    t0 = time.time()
    look0 = int((trace.topk[0] >= 0).sum())
    ess = replay_ess(trace, slots)
    hs = replay_hisparse(trace, H, warm="staged", extra_page=page)
    hs_pd = replay_hisparse(trace, H, warm="pd_direct", extra_page=page)
    variants = []
    for warm, budget in WARMUP_VARIANTS:
        budget = trace.top_k if budget == "k" else budget
        v = ess if (warm, budget) == ("auto", None) else replay_ess(trace, slots, warmup=warm, warmup_budget=budget)
        variants.append(dict(warmup=v.extra["warmup"], budget=budget or slots // trace.batch, **_summary(v, look0)))
    t_replay = time.time() - t0
    out = dict(name=fam.name, kind=fam.kind, describe=fam.describe, steps=trace.steps, layers=trace.num_layers,
               batch=trace.batch, top_k=trace.top_k, prompt_lens=[int(p) for p in trace.prompt_lens],
               hisparse_buffer=H, hisparse_page=page, ess_slots_per_layer=slots,
               scaled=trace.top_k != DEEPSEEK_TOP_K, rows_sorted=bool(trace.meta.get("rows_sorted", False)),
               seconds=dict(trace=t_make, replay=t_replay), first_step_lookups=look0,
               ess=ess.to_dict(), hisparse=hs.to_dict(), hisparse_pd=hs_pd.to_dict(), ess_warmup_variants=variants)
    for key, st in (("ess", ess), ("hisparse", hs), ("hisparse_pd", hs_pd)):
        out[key].update(_summary(st, look0))
    return out


# ESS warm-up variants replayed beside the design's (auto = the prefill windows' union, budget = the request's share)
WARMUP_VARIANTS = [("auto", None), ("windows", "k"), ("recent", None), ("none", None)]


def _summary(st: ReplayStats, look0: int) -> dict:
    """Hit rate after the first decode step (warm-up effects aside) and bytes including warm-up loads."""
    look = int(st.lookups.sum())
    later = int(st.misses.sum()) - int(st.extra["first_step_misses"])
    return dict(hit_rate=st.hit_rate, hit_rate_after_step0=1.0 - later / max(look - look0, 1),
                miss_bytes=st.miss_bytes, warmup_bytes=st.warmup_bytes, total_bytes=st.miss_bytes + st.warmup_bytes)


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def print_tables(results: list[dict]) -> None:
    print("\n| family | k | batch | HiSparse slots / request | ESS slots / layer | ESS hit | HiSparse hit (staged) | "
          "HiSparse hit (PD) | ESS hit after step 0 | HiSparse hit after step 0 | ESS miss MB | HiSparse miss MB | "
          "HiSparse PD miss MB | ESS warm-up MB | HiSparse PD warm-up MB | ESS / HiSparse miss bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        e, h, p = r["ess"], r["hisparse"], r["hisparse_pd"]
        ratio = e["miss_bytes"] / h["miss_bytes"] if h["miss_bytes"] else float("nan")
        print(f"| {r['name']} | {r['top_k']} | {r['batch']} | {r['hisparse_buffer']}+{r['hisparse_page']} | "
              f"{r['ess_slots_per_layer']} | {e['hit_rate']:.4f} | {h['hit_rate']:.4f} | {p['hit_rate']:.4f} | "
              f"{e['hit_rate_after_step0']:.4f} | {h['hit_rate_after_step0']:.4f} | {_mb(e['miss_bytes'])} | "
              f"{_mb(h['miss_bytes'])} | {_mb(p['miss_bytes'])} | {_mb(e['warmup_bytes'])} | "
              f"{_mb(p['warmup_bytes'])} | {ratio:.2f} |")
    print("\nESS warm-up variants (same pool; budget = entries per request and layer):")
    print("| family | warm-up | budget | hit | hit after step 0 | miss MB | warm-up MB | total MB | "
          "HiSparse staged total MB | HiSparse PD total MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for v in r["ess_warmup_variants"]:
            print(f"| {r['name']} | {v['warmup']} | {v['budget']} | {v['hit_rate']:.4f} | "
                  f"{v['hit_rate_after_step0']:.4f} | {_mb(v['miss_bytes'])} | {_mb(v['warmup_bytes'])} | "
                  f"{_mb(v['total_bytes'])} | {_mb(r['hisparse']['total_bytes'])} | "
                  f"{_mb(r['hisparse_pd']['total_bytes'])} |")
    print("\nper layer (ESS vs HiSparse staged):")
    print("| family | layer | ESS hit | HiSparse hit | ESS misses | HiSparse misses | ESS MB | HiSparse MB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        e, h = r["ess"]["per_layer"], r["hisparse"]["per_layer"]
        for i in range(r["layers"]):
            print(f"| {r['name']} | {i} | {e['hit_rate'][i]:.4f} | {h['hit_rate'][i]:.4f} | {e['misses'][i]} | "
                  f"{h['misses'][i]} | {_mb(e['miss_bytes'][i])} | {_mb(h['miss_bytes'][i])} |")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results]
    x = np.arange(len(names))
    w = 0.27
    series = [("ESS (shared LRU pool)", "ess", "tab:blue"), ("HiSparse (staged warm-up)", "hisparse", "tab:orange"),
              ("HiSparse (PD decode)", "hisparse_pd", "tab:gray")]
    real = [r for r in results if r["kind"] == "real"]
    fig, axes = plt.subplots(1, 3 if real else 2, figsize=(19 if real else 13, 5))
    cap = 2.5
    for j, (label, key, color) in enumerate(series):
        xs = x + (j - 1) * w
        axes[0].bar(xs, [r[key]["hit_rate"] for r in results], w, label=label, color=color)
        base = [max(r["hisparse"]["miss_bytes"], 1) for r in results]
        miss = np.array([r[key]["miss_bytes"] for r in results]) / base
        warm = np.array([r[key]["warmup_bytes"] for r in results]) / base
        axes[1].bar(xs, np.minimum(miss, cap), w, color=color, label=f"{label}: misses")
        axes[1].bar(xs, np.clip(warm, 0, cap - np.minimum(miss, cap)), w, bottom=np.minimum(miss, cap), color=color,
                    alpha=0.35, hatch="//", label=f"{label}: warm-up loads")
        for xi, total in zip(xs, miss + warm, strict=True):
            if total > cap:
                axes[1].text(xi, cap * 1.01, f"{total:.0f}x", ha="center", va="bottom", fontsize=7)
    lo = min(min(r[k]["hit_rate"] for k in ("ess", "hisparse", "hisparse_pd")) for r in results)
    axes[0].set_ylim(max(0.0, lo - 0.05), 1.0)
    axes[0].set_ylabel("hit rate")
    axes[0].set_title("hit rate at equal GPU memory")
    axes[1].set_ylim(0, cap * 1.15)
    axes[1].set_ylabel("H2D bytes / HiSparse (staged) miss bytes")
    axes[1].set_title("bytes moved: misses, plus warm-up loads (hatched)")
    for ax in axes[:2]:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=30, ha="right")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(loc="lower left", fontsize=8)
    axes[1].legend(loc="upper left", fontsize=6, ncol=2)
    if real:
        r = real[0]
        layers = np.arange(r["layers"])
        for label, key, color in series:
            axes[2].plot(layers, r[key]["per_layer"]["hit_rate"], marker="o", ms=3, label=label, color=color)
        axes[2].set_xlabel("layer")
        axes[2].set_ylabel("hit rate")
        axes[2].set_title(f"real model ({r['layers']} layers, k={r['top_k']}), per layer")
        axes[2].grid(alpha=0.3)
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(HERE / "results"), help="folder for vs_hisparse_hits.json / .png")
    p.add_argument("--real-trace", default=str(DEFAULT_REAL), help="recorded real-model trace (.npz)")
    p.add_argument("--quick", action="store_true", help="small traces only (smoke run)")
    p.add_argument("--families", nargs="*", default=None, help="only these families (by name)")
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(argv)

    fams = synthetic_families(a.quick) + [demo_family(a.quick)]
    real = Path(a.real_trace)
    if real.is_file():
        fams.append(real_family(real))
    else:
        print(f"vs_hisparse: no real-model trace at {real}: skipping that family "
              f"(record one with benchmarks/record_real_traces.py)", file=sys.stderr)
    if a.families:
        fams = [f for f in fams if f.name in a.families]
    results = []
    for fam in fams:
        r = run_family(fam)
        results.append(r)
        print(f"{fam.name}: ESS {r['ess']['hit_rate']:.4f}, HiSparse {r['hisparse']['hit_rate']:.4f} "
              f"(PD {r['hisparse_pd']['hit_rate']:.4f}); trace {r['seconds']['trace']:.1f} s, "
              f"replays {r['seconds']['replay']:.1f} s", flush=True)
    print_tables(results)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = dict(what="hit rate and bytes moved, ESS shared per-layer LRU pool vs SGLang 0.5.23 HiSparse per-request "
                    "buffers (emulated), identical traces, equal GPU memory",
               entry_bytes=ENTRY_BYTES, quick=a.quick, command=" ".join(["python", "benchmarks/vs_hisparse.py",
                                                                          *(argv or sys.argv[1:])]),
               families=results)
    (out / "vs_hisparse_hits.json").write_text(json.dumps(doc, indent=1))
    if not a.no_plot:
        plot(results, out / "vs_hisparse_hits.png")
    print(f"\nwrote {out / 'vs_hisparse_hits.json'}" + ("" if a.no_plot else f" and {out / 'vs_hisparse_hits.png'}"))
    return 0


def summarize(stats: ReplayStats) -> str:  # handy in a REPL
    return f"{stats.policy}: hit {stats.hit_rate:.4f}, misses {int(stats.misses.sum())}, {_mb(stats.miss_bytes)} MB"


if __name__ == "__main__":
    raise SystemExit(main())
