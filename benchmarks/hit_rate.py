"""Hit rate of hot-pool retention policies against pool size, on real and synthetic top-k traces (CPU).

For each trace family and pool size (a multiple of one step's selection, batch x top-k, per layer), the same trace
replayed through:

* ``ess``         ESS's runtime pool as it ships (`traces.replay_ess`: the cache manager itself, LRU, each decoded
                  token given a hot slot by its own step's resolve: `new_tokens: insert`),
* ``ess_on_demand`` the same with decoded tokens only written back, fetched when selected (`new_tokens: on_demand`),
* ``ess_decay``   the runtime pool with decayed retention (`retention: decay`, gamma per ``--gamma``: the kernels'
                  fixed-point count, which forgets an entry's history when it is evicted),
* ``lru``, ``lru_newest``, ``lru2``, ``decay`` (decayed selection count, gamma per ``--gamma``), ``belady`` (the
                  offline optimum): `ess_sglang.retention.replay_policy`, numpy replays of the same step model,
* ``hisparse``    SGLang HiSparse's per-request buffers at the same memory (`hisparse_policy.replay_hisparse`, staged
                  warm-up; its buffer per request = slots / batch - one page).

Families: the real SmolLM2-135M traces over prose and over code (`benchmarks/traces/`, recorded by
`record_real_traces.py`), synthetic traces
(`traces.synthetic_trace`), and "cycle", which alternates each step between two slowly drifting selections that share
a quarter of their positions, as a model with dummy weights does when it decodes a two-token cycle (the serving
benchmark's model). Writes hit_rate.json and hit_rate.png under --out and prints a table: per family and pool size each
policy's hit rate, and the share of the LRU-with-newest-token -> optimum gap the runtime's decayed retention
(``ess_decay``) and the numpy decay policy close.

    python benchmarks/hit_rate.py                 # ~6 minutes on 2 cores
    python benchmarks/hit_rate.py --quick         # small traces, a smoke run (seconds)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ess_sglang.hisparse_policy import replay_hisparse  # noqa: E402
from ess_sglang.retention import DEFAULT_DECAY_GAMMA, replay_policy  # noqa: E402
from ess_sglang.traces import SyntheticTraceConfig, TopKTrace, replay_ess, synthetic_trace  # noqa: E402

REAL_TRACES = {  # family: (recorded trace, what it is)
    "real": (ROOT / "benchmarks" / "traces" / "smollm2-135m_sample.npz",
             "SmolLM2-135M over pydoc topics (prose): 4 requests of 3.3K-4.1K, top-256, 30 layers, 64 steps"),
    "real-code": (ROOT / "benchmarks" / "traces" / "smollm2-135m_code_sample.npz",
                  "SmolLM2-135M over standard-library source (code): 4 requests of 3.3K-4.1K, top-256, 30 layers, "
                  "80 steps"),
}
POOL_FACTORS = (1.0625, 1.25, 1.5, 2.0, 3.0)
NUMPY_POLICIES = ("lru", "lru_newest", "lru2", "decay", "belady")
DSA_PAGE, DSA_TOP_K = 64, 2048


def cycle_trace(cfg: SyntheticTraceConfig, shared: float = 0.25) -> TopKTrace:
    """Even steps take one synthetic trace's selections, odd steps another's that keeps `shared` of them: two slowly
    drifting sets, alternating (every request with the same prompt length, so that both share the steps' lengths)."""
    a = synthetic_trace(cfg)
    b = synthetic_trace(cfg.model_copy(update=dict(seed=cfg.seed + 1)))
    topk = a.topk.copy()
    rng = np.random.default_rng(cfg.seed)
    odd = b.topk[1::2].copy()
    keep = rng.random(odd.shape) < shared  # share part of the even step's positions (distinct per row)
    for idx in np.argwhere(keep.any(axis=-1)):
        s, layer, r = idx
        row, src = odd[s, layer, r], a.topk[2 * s + 1, layer, r]
        take = keep[s, layer, r]
        merged = np.where(take, src, row)
        _, first = np.unique(merged, return_index=True)
        if first.size == merged.size:
            odd[s, layer, r] = merged
    topk[1::2] = odd
    meta = dict(a.meta, source="synthetic-cycle", shared=shared)
    return TopKTrace(topk=topk, seq_lens=a.seq_lens, warmup_topk=a.warmup_topk, meta=meta).validate()


def families(quick: bool, traces: list[Path] = ()) -> list[tuple[str, str, object]]:
    if quick:
        base = dict(batch=2, context_len=2048, top_k=128, steps=24, num_layers=2, recent_window=128, warmup_windows=8)
    else:
        base = dict(batch=4, context_len=8192, top_k=512, steps=96, num_layers=4, recent_window=512,
                    warmup_windows=32)
    out = []
    for name, (path, describe) in REAL_TRACES.items():
        if path.exists():
            out.append((name, describe, lambda path=path: TopKTrace.load(path) if not quick else
                        TopKTrace.load(path).subset(steps=16, layers=[0, 15, 29])))
    for name, describe, knobs in [
        ("syn-steady", "overlap 0.9, recency 0.2", {}),
        ("syn-recent", "recency 0.6", dict(recency=0.6)),
        ("syn-bursty", "bursts: p 0.05 a step, replace 60%", dict(burst_prob=0.05, burst_fraction=0.6)),
    ]:
        cfg = SyntheticTraceConfig(**base, **knobs)
        out.append((name, describe, lambda cfg=cfg: synthetic_trace(cfg)))
    for path in traces:  # recorded traces not kept in the repository (e.g. thousands of steps)
        def make(path=path):
            return TopKTrace.load(path)

        out.append((path.stem, f"recorded trace {path.name}", make))
    cyc = SyntheticTraceConfig(**base, overlap=0.97, length_spread=0.0)
    out.append(("cycle", "two drifting selections (overlap 0.97 each), alternating, sharing 25%",
                lambda: cycle_trace(cyc)))
    return out


def run_family(name: str, describe: str, make, factors, gamma: float) -> dict:
    t0 = time.time()
    trace = make()
    B, K = trace.batch, trace.top_k
    page = max(1, DSA_PAGE * K // DSA_TOP_K)
    rows = []
    for f in factors:
        slots = -(-int(f * B * K) // page) * page
        if slots < B * (K + 1):
            slots = -(-(B * (K + 1)) // page) * page
        rates = {"ess": replay_ess(trace, slots).hit_rate,
                 "ess_on_demand": replay_ess(trace, slots, new_tokens="on_demand").hit_rate,
                 "ess_decay": replay_ess(trace, slots, decay_gamma=gamma).hit_rate}
        for policy in NUMPY_POLICIES:
            rates[policy] = replay_policy(trace, slots, policy, gamma=gamma).hit_rate
        hs_buffer = slots // B - page
        rates["hisparse"] = replay_hisparse(trace, hs_buffer, extra_page=page).hit_rate if hs_buffer >= K else None
        gap = rates["belady"] - rates["lru_newest"]
        rows.append(dict(factor=f, slots_per_layer=slots, hit_rate=rates,
                         decay_closes=(rates["decay"] - rates["lru_newest"]) / gap if gap > 0 else None,
                         ess_decay_closes=(rates["ess_decay"] - rates["lru_newest"]) / gap if gap > 0 else None))
        print(f"  {name} x{f:g} ({slots:,} slots): " + ", ".join(f"{k} {v:.4f}" for k, v in rates.items()
                                                               if v is not None), flush=True)
    return dict(name=name, describe=describe, batch=B, top_k=K, steps=trace.steps, layers=trace.num_layers,
                prompt_lens=[int(p) for p in trace.prompt_lens], seconds=round(time.time() - t0, 1), rows=rows)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = doc["families"]
    fig, axes = plt.subplots(1, len(fams), figsize=(4.2 * len(fams), 3.8), squeeze=False)
    for ax, fam in zip(axes[0], fams, strict=True):
        x = [r["factor"] for r in fam["rows"]]
        for policy in ("ess", "ess_decay", "lru_newest", "lru2", "decay", "belady", "hisparse"):
            y = [r["hit_rate"].get(policy) for r in fam["rows"]]
            if any(v is not None for v in y):
                ax.plot(x, [np.nan if v is None else v for v in y], marker="o", ms=3, label=policy,
                        linestyle="--" if policy == "belady" else "-")
        ax.set_title(fam["name"])
        ax.set_xlabel("slots per layer / (batch x top-k)")
        ax.set_ylabel("hit rate")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small traces and two pool sizes (a smoke run)")
    p.add_argument("--gamma", type=float, default=DEFAULT_DECAY_GAMMA, help="the decay policy's factor per step")
    p.add_argument("--families", nargs="*", default=None, help="only these families (by name)")
    p.add_argument("--trace", type=Path, action="append", default=[],
                   help="a recorded trace (.npz of record_real_traces.py) as one more family, named by its file")
    p.add_argument("--factors", default=None,
                   help="comma-separated pool sizes as multiples of batch x top-k (default "
                        f"{','.join(f'{f:g}' for f in POOL_FACTORS)})")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "hit_rate", help="output folder")
    a = p.parse_args(argv)
    if not 0.0 < a.gamma < 1.0:
        p.error(f"--gamma must be in (0, 1), got {a.gamma}")
    missing = [str(t) for t in a.trace if not t.is_file()]
    if missing:
        p.error(f"--trace: no such file {', '.join(missing)}")
    fams = families(a.quick, a.trace)
    if a.families:
        unknown = sorted(set(a.families) - {f[0] for f in fams})
        if unknown:
            p.error(f"--families: unknown {', '.join(unknown)} (known: {', '.join(f[0] for f in fams)})")
        fams = [f for f in fams if f[0] in a.families]
    try:
        factors = tuple(float(x) for x in a.factors.split(",")) if a.factors else \
            (POOL_FACTORS[:2] if a.quick else POOL_FACTORS)
    except ValueError:
        p.error(f"--factors: expected numbers like 1.25,2, got {a.factors!r}")
    if any(f < 1 for f in factors):
        p.error(f"--factors: a pool must hold one step's selection (factor >= 1), got {a.factors!r}")
    t0 = time.time()
    results = [run_family(*f, factors, a.gamma) for f in fams]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    doc = dict(commit=commit, date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               device="CPU", command=" ".join(["benchmarks/hit_rate.py", *(argv or sys.argv[1:])]), gamma=a.gamma,
               seconds=round(time.time() - t0), families=results)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "hit_rate.json").write_text(json.dumps(doc, indent=1))
    plot(doc, a.out / "hit_rate.png")
    print(f"\n{'family':11} {'x':>6} {'slots':>7} {'ess':>7} {'ess-dec':>7} {'lru+new':>7} {'lru2':>7} {'decay':>7} "
          f"{'belady':>7} {'hisparse':>8} {'closes':>6} {'numpy':>6}")
    pct = lambda v: f"{v:.0%}" if v is not None else "-"  # noqa: E731
    for fam in results:
        for r in fam["rows"]:
            h = r["hit_rate"]
            hs = f"{h['hisparse']:.4f}" if h["hisparse"] is not None else "-"
            print(f"{fam['name']:11} {r['factor']:>6g} {r['slots_per_layer']:>7,} {h['ess']:>7.4f} "
                  f"{h['ess_decay']:>7.4f} {h['lru_newest']:>7.4f} {h['lru2']:>7.4f} {h['decay']:>7.4f} "
                  f"{h['belady']:>7.4f} {hs:>8} {pct(r['ess_decay_closes']):>6} {pct(r['decay_closes']):>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
