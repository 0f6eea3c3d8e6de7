"""ESS against SGLang 0.5.23 HiSparse on identical top-k traces: hit rate and bytes moved (CPU), at equal GPU memory.

Two policies replay the same traces (`ess_sglang.traces`):

- ESS: one LRU hot pool per layer shared by the whole batch (`HotPoolCacheManager`, plain-torch path on the CPU), with
  ESS's warm-up (the union of the prefill's last query windows' top-k; the most recent prompt tokens when a trace
  has no windows), new tokens written back and fetched when selected (the runtime's default; a second replay keeps
  each in a protected hot slot, `new_tokens="insert"`); hits and misses from its counters.
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
`--real-trace PATH` for another).

GPU timing (`--gpu`, on the H200; the CPU part above is not run then): SGLang 0.5.23 HiSparse's swap-in kernel
(`load_cache_to_device_buffer_kernel`, JIT-built from the sglang wheel by `hisparse_kernel.py`) against ESS's
`HotPoolCacheManager.resolve` (fused Triton path with the FlashTrans copy), one layer, top-k 2048, on identical
synthetic traces (one trace of 128 requests per family; batch b replays its first b requests), at equal GPU memory for
hot entries: HiSparse (4096 + 64) slots per request, ESS the same bytes as one shared pool (b x 4160 slots). Both are
captured in a CUDA graph and replayed step by step (each step's top-k and sequence lengths copied into the static
inputs; the decoded token's KV write, HiSparse's newest-slot write and ESS's `write_new_tokens`, is done outside the
timed replay); time per layer = median over steps >= 1 (step 0, the cold start, reported apart). Hit rates: HiSparse
from its kernel's state (checked against the emulation above, per request and step), ESS from its counters. Before
timing, an eager pass checks that every selected entry's device row equals its host entry, for both.

    bash scripts/hisparse_wheels.sh        # here: .whl/apache_tvm_ffi-*.whl and .whl/hisparse/sglang-0.5.23-*.whl
    ESS_RUN_DIR=. bash scripts/gpu_run.sh python3 benchmarks/vs_hisparse.py --gpu --quick --out /tmp/res   # ~2 min
    ESS_RUN_DIR=. bash scripts/gpu_run.sh python3 benchmarks/vs_hisparse.py --gpu --out /tmp/res           # ~5 min

Writes vs_hisparse_gpu.json and vs_hisparse_gpu.png (time per layer against batch, both on one axis) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hisparse_kernel import TOP_K as DEEPSEEK_TOP_K  # benchmarks/hisparse_kernel.py (numpy only at import)
from hisparse_kernel import sizes_for

from ess_sglang.entry_sizes import LATENT_ENTRY_BYTES
from ess_sglang.hisparse_policy import replay_hisparse
from ess_sglang.traces import (
    ReplayStats,
    SyntheticTraceConfig,
    TopKTrace,
    record_demo_trace,
    replay_ess,
    synthetic_trace,
)

HERE = Path(__file__).resolve().parent
DEFAULT_REAL = HERE / "traces" / "smollm2-135m_sample.npz"


GPU_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]
GPU_FAMILIES = {  # name: (description, knobs of SyntheticTraceConfig on top of the GPU base)
    "syn-steady": ("overlap 0.9, recency 0.2, 4 sinks", {}),
    "syn-sticky": ("overlap 0.97", dict(overlap=0.97)),
    "syn-bursty": ("bursts: p=0.05 per step, replace 60%", dict(burst_prob=0.05, burst_fraction=0.6)),
}


def gpu_trace(name: str, batch: int, context: int, steps: int, seed: int = 0) -> TopKTrace:
    """One layer, top-k 2048, `batch` requests of [context / 2, context] prompt tokens, `steps` decode steps."""
    knobs = GPU_FAMILIES[name][1]
    cfg = SyntheticTraceConfig(batch=batch, context_len=context, top_k=DEEPSEEK_TOP_K, steps=steps, num_layers=1,
                               recent_window=1024, warmup_windows=8, length_spread=0.5, seed=seed, **knobs)
    return synthetic_trace(cfg)


def time_ess(th, batch: int, reps: int = 2, copy: bool = True, check: bool = True, resolve_impl: str = "triton"
             ) -> dict:
    """ESS's resolve (fused Triton path, FlashTrans copy fused in; `copy=False`: bookkeeping only) on the first
    `batch` requests of `th` (a `hisparse_kernel.TraceHost`), pool = batch x (4096 + 64) slots, timed like
    `hisparse_kernel.time_hisparse`: eager pass with checks, then one resolve captured in a CUDA graph and replayed
    per step (begin_step and write_new_tokens run eagerly before each replay, untimed). `resolve_impl="torch"` and
    a CPU `th` run the same steps on the CPU (tests)."""
    import torch
    from hisparse_kernel import ITEM_BYTES, GraphRunner, summarize_times, sync

    from ess_sglang.cache_manager import Counter, HotPoolCacheManager
    from ess_sglang.warmup import warmup_positions

    tr = th.trace
    S, _, _, K = tr.topk.shape
    H, P = sizes_for(K)
    dev = torch.device(th.device)
    slots = batch * (H + P)
    m = HotPoolCacheManager(th.host, slots, device=dev, max_selected=batch * K, resolve_impl=resolve_impl,
                            copy_impl="auto" if copy else "none")
    r2t = torch.from_numpy(th.loc[:batch].astype(np.int32)).to(dev)
    rpi = torch.arange(batch, dtype=torch.int64, device=dev)
    prompts = tr.prompt_lens[:batch]
    for r in range(batch):  # ESS's warm-up, as replay_ess ("auto": the prefill windows' union, the request's share)
        win = torch.from_numpy(tr.warmup_topk[0, r]) if tr.warmup_topk is not None else None
        pos = warmup_positions(int(prompts[r]), slots // batch, win)
        m.warm_up(0, r2t[r, pos.to(dev)])
    m.counters.zero_()
    keys = [k for k in ("loc_to_slot", "slot_to_loc", "slot_stamp", "clock", "counters", "hot_entries")
            if isinstance(getattr(m, k, None), torch.Tensor)]
    snap = {k: getattr(m, k).clone() for k in keys}

    def restore() -> None:
        for k in keys:
            getattr(m, k).copy_(snap[k])

    topk_all = torch.from_numpy(np.ascontiguousarray(tr.topk[:, 0, :batch])).to(dev, torch.int32)
    topk_all = topk_all.view(S, batch, 1, K)
    seq_np = tr.seq_lens[:, :batch].astype(np.int64)
    seq_all = torch.from_numpy(seq_np).to(dev)
    new_locs = torch.from_numpy(th.loc[np.arange(batch)[None, :], seq_np - 1]).to(dev)  # [S, batch]
    loc_t = th.loc_tensor()[:batch]

    def new_tokens(s: int) -> None:
        m.begin_step()
        m.write_new_tokens(0, new_locs[s], th.host_view[new_locs[s]])

    # eager pass: checks and per-step misses
    checks = dict(checked=0, no_slot=0, differ=0) if check and copy else None
    eager_miss = torch.zeros(S, dtype=torch.int64, device=dev)
    for s in range(S):
        new_tokens(s)
        c0 = m.counters[0, Counter.MISSES].clone()
        sl = m.resolve(0, topk_all[s], r2t, rpi, seq_all[s]).view(batch, K).long()
        eager_miss[s] = m.counters[0, Counter.MISSES] - c0
        if checks is not None:
            valid = topk_all[s].view(batch, K) >= 0
            checks["no_slot"] += int((valid & (sl < 0)).sum())
            sel = valid & (sl >= 0)
            host_loc = loc_t.gather(1, topk_all[s].view(batch, K).long().clamp(min=0))
            rows_dev = m.hot_entries[0][sl[sel]]
            checks["differ"] += int((rows_dev != th.host_view[host_loc[sel]]).any(dim=1).sum())
            checks["checked"] += int(sel.sum())
    eager_np = eager_miss.cpu().numpy()
    lookups = (tr.topk[:, 0, :batch] >= 0).sum(axis=1).astype(np.int64)
    # graph
    restore()
    static_topk = topk_all[0].clone()
    static_seq = seq_all[0].clone()
    sync(dev)
    runner = GraphRunner(lambda: m.resolve(0, static_topk, r2t, rpi, static_seq), dev)
    graph_miss = torch.zeros((reps, S), dtype=torch.int64, device=dev)
    for rep in range(reps):
        restore()
        for s in range(S):
            static_topk.copy_(topk_all[s])
            static_seq.copy_(seq_all[s])
            new_tokens(s)
            c0 = m.counters[0, Counter.MISSES].clone()
            runner.timed_replay()
            graph_miss[rep, s] = m.counters[0, Counter.MISSES] - c0
    times = runner.times_us().reshape(reps, S)
    out = summarize_times(times, eager_np, lookups, ITEM_BYTES)
    out.update(batch=batch, steps=S, reps=reps, slots_per_layer=slots, device_bytes=slots * ITEM_BYTES, copy=copy,
               graph_vs_eager_mismatch_steps=int((graph_miss.cpu().numpy() != eager_np[None]).sum()),
               overflow=int(m.counters[0, Counter.OVERFLOW]), resolve_impl=resolve_impl, checks=checks)
    del runner
    return out


def gpu_timing(batches: list[int] | None = None, families: list[str] | None = None, context: int = 32768,
               steps: int = 64, reps: int = 2, warm: str = "staged", sglang_source: str | None = None,
               bookkeeping: bool = False, check: bool = True, quick: bool = False, device: str = "cuda",
               make_kernel=None, resolve_impl: str = "triton") -> dict:
    """Time HiSparse's `load_cache_to_device_buffer_mla` kernel against ESS's resolve + FlashTrans on the GPU.

    For each family, one trace of max(batches) requests; for each batch b, both replay its first b requests (see the
    module docstring). `bookkeeping`: also time both without moving KV bytes (HiSparse's own SkipIO instantiation,
    ESS's copy_impl="none"). Returns a JSON-able dict.

    `device="cpu"` with `make_kernel` (config -> a stand-in with the kernel's call signature) and
    `resolve_impl="torch"` runs the whole pipeline on the CPU (the tests' dry run); times are then meaningless.
    """
    import torch
    from hisparse_kernel import KernelConfig, build, emulate_misses, make_trace_host, time_hisparse

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("vs_hisparse --gpu: no CUDA GPU here")
    batches = batches or GPU_BATCHES
    families = families or ["syn-steady", "syn-sticky"]
    t0 = time.time()
    H, P = sizes_for(DEEPSEEK_TOP_K)
    make_kernel = make_kernel or (lambda cfg: build(sglang_source, cfg, verbose=True))
    kernel = make_kernel(KernelConfig(num_top_k=DEEPSEEK_TOP_K, hot_buffer_size=H))
    kernel_noio = make_kernel(KernelConfig(num_top_k=DEEPSEEK_TOP_K, hot_buffer_size=H, skip_io=True)) \
        if bookkeeping else None
    t_build = time.time() - t0
    srcs = getattr(kernel, "sources", None)
    print(f"gpu: HiSparse kernel built in {t_build:.1f} s from {getattr(srcs, 'origin', '-')} (sglang "
          f"{getattr(srcs, 'version', '-')}): {getattr(kernel, 'so_path', type(kernel).__name__)}", flush=True)
    rows = []
    fam_info = []
    for fam in families:
        t1 = time.time()
        trace = gpu_trace(fam, max(batches), context, steps)
        th = make_trace_host(trace, device=device)
        emu = emulate_misses(th.trace, H, warm)
        fam_info.append(dict(name=fam, describe=GPU_FAMILIES[fam][0], prompt_lens=[int(p) for p in trace.prompt_lens],
                             steps=steps, setup_s=time.time() - t1, host_tokens=int(th.host.num_tokens)))
        print(f"gpu: {fam}: trace + host pool ({th.host.num_tokens} tokens, "
              f"{th.host.nbytes / 2**30:.2f} GiB pinned) + emulation in {time.time() - t1:.1f} s", flush=True)
        for b in batches:
            t2 = time.time()
            hs = time_hisparse(th.trace, b, kernel, th=th, reps=reps, warm=warm, check=check, emulated=emu)
            es = time_ess(th, b, reps=reps, copy=True, check=check, resolve_impl=resolve_impl)
            row = dict(family=fam, batch=b, hisparse=hs, ess=es, ratio=es["us"] / hs["us"])
            if bookkeeping:
                hn = time_hisparse(th.trace, b, kernel_noio, th=th, reps=reps, warm=warm, check=False, emulated=emu)
                en = time_ess(th, b, reps=reps, copy=False, check=False, resolve_impl=resolve_impl)
                row.update(hisparse_noio=hn, ess_noio=en, ratio_noio=en["us"] / hn["us"])
            rows.append(row)
            print(f"gpu: {fam} batch {b:>3}: HiSparse {hs['us']:8.1f} us (hit {hs['hit_rate']:.4f}), ESS "
                  f"{es['us']:8.1f} us (hit {es['hit_rate']:.4f}), ESS / HiSparse {row['ratio']:.2f}; "
                  f"{time.time() - t2:.1f} s", flush=True)
        del th
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    cuda = torch.device(device).type == "cuda"
    return dict(what="time per layer of the swap-in: SGLang 0.5.23 HiSparse kernel vs ESS resolve + FlashTrans, "
                     "identical traces, equal GPU memory for hot entries, CUDA graph replay",
                device=torch.cuda.get_device_name() if cuda else "cpu (dry run)", torch=torch.__version__,
                date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                sglang=dict(version=getattr(srcs, "version", None), origin=getattr(srcs, "origin", None),
                            kernel=f"load_cache_to_device_buffer<{kernel.config.template_args()}>",
                            so=str(getattr(kernel, "so_path", "")), build_s=t_build),
                entry_bytes=LATENT_ENTRY_BYTES, top_k=DEEPSEEK_TOP_K, hot_buffer_size=H, page=P, context=context,
                steps=steps, reps=reps, warm=warm, quick=quick, bookkeeping=bookkeeping, families=fam_info, rows=rows,
                seconds=time.time() - t0)


def print_gpu_table(doc: dict) -> None:
    bk = doc.get("bookkeeping")
    print("\n| family | batch | HiSparse us/layer | ESS us/layer | ESS / HiSparse | "
          "HiSparse hit (after step 0 / all) | ESS hit (after step 0 / all) | HiSparse MB/step | ESS MB/step | "
          "step 0 us: HiSparse / ESS |" +
          (" no KV bytes, us: HiSparse / ESS (ratio) |" if bk else "") + " checks |")
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if bk else "") + "---|")
    for r in doc["rows"]:
        h, e = r["hisparse"], r["ess"]
        hc, ec = h.get("checks") or {}, e.get("checks") or {}
        bad = (hc.get("differ", 0) + hc.get("no_slot", 0) + hc.get("duplicate_rows", 0) + ec.get("differ", 0)
               + ec.get("no_slot", 0))
        chk = "rows ok" if hc and ec and not bad else ("rows not checked" if not hc else f"{bad} bad rows")
        chk += "; emulator = kernel" if not h["emulator_mismatch_requests"] else \
            f"; emulator differs on {h['emulator_mismatch_requests']} request-steps"
        if h["graph_vs_eager_mismatch"] or e["graph_vs_eager_mismatch_steps"]:
            chk += f"; graph != eager misses ({h['graph_vs_eager_mismatch']} / {e['graph_vs_eager_mismatch_steps']})"
        noio = (f" {r['hisparse_noio']['us']:.1f} / {r['ess_noio']['us']:.1f} ({r['ratio_noio']:.2f}) |"
                if bk else "")
        print(f"| {r['family']} | {r['batch']} | {h['us']:.1f} | {e['us']:.1f} | {r['ratio']:.2f} | "
              f"{h['hit_rate_after_step0']:.4f} / {h['hit_rate']:.4f} | "
              f"{e['hit_rate_after_step0']:.4f} / {e['hit_rate']:.4f} | {h['bytes_per_step'] / 1e6:.2f} | "
              f"{e['bytes_per_step'] / 1e6:.2f} | {h['us_step0']:.0f} / {e['us_step0']:.0f} |{noio} {chk} |")
    print("(time = median over steps >= 1 of CUDA-graph replays; MB/step = misses x 656 B, mean over steps >= 1)")


def plot_gpu(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = list(dict.fromkeys(r["family"] for r in doc["rows"]))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    styles = ["-", "--", ":", "-."]
    for i, fam in enumerate(fams):
        rs = [r for r in doc["rows"] if r["family"] == fam]
        x = [r["batch"] for r in rs]
        ls = styles[i % len(styles)]
        for key, label, color in (("hisparse", "HiSparse kernel", "tab:orange"), ("ess", "ESS resolve + FlashTrans",
                                                                                   "tab:blue")):
            y = [r[key]["us"] for r in rs]
            lo = [r[key]["us_p10"] for r in rs]
            hi = [r[key]["us_p90"] for r in rs]
            axes[0].plot(x, y, ls, marker="o", ms=4, color=color, label=f"{label} ({fam})")
            axes[0].fill_between(x, lo, hi, color=color, alpha=0.12)
            if doc.get("bookkeeping") and f"{key}_noio" in rs[0]:
                axes[0].plot(x, [r[f"{key}_noio"]["us"] for r in rs], ls, marker="x", ms=4, color=color, alpha=0.5,
                             label=f"{label}, no KV bytes ({fam})")
        axes[1].plot(x, [r["ratio"] for r in rs], ls, marker="o", ms=4, color="k", label=f"time ESS / HiSparse ({fam})")
        axes[1].plot(x, [r["ess"]["bytes_per_step"] / max(r["hisparse"]["bytes_per_step"], 1) for r in rs], ls,
                     marker="s", ms=4, color="tab:green", label=f"bytes moved per step ESS / HiSparse ({fam})")
    batches = sorted({r["batch"] for r in doc["rows"]})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches)
        ax.set_xticklabels([str(b) for b in batches])
        ax.set_xlabel("batch (requests), top-k 2048, one layer")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("us per layer (median of steps >= 1; band p10-p90)")
    axes[0].set_title(f"swap-in time per layer at equal GPU memory ({doc['device']})")
    axes[0].legend(fontsize=7)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set_ylabel("ESS / HiSparse")
    axes[1].set_title("ratios (< 1: ESS better)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_gpu(a) -> int:
    quick = a.quick
    batches = [int(x) for x in a.batches.split(",")] if a.batches else ([1, 8, 64] if quick else GPU_BATCHES)
    fams = a.gpu_families.split(",") if a.gpu_families else (["syn-steady"] if quick else None)
    steps = a.steps or (24 if quick else 64)
    context = a.context or (16384 if quick else 32768)
    reps = a.reps or (1 if quick else 2)
    for f in fams or []:
        if f not in GPU_FAMILIES:
            raise SystemExit(f"--gpu-families: unknown family {f!r}; known: {sorted(GPU_FAMILIES)}")
    doc = gpu_timing(batches=batches, families=fams, context=context, steps=steps, reps=reps, warm=a.hisparse_warm,
                     sglang_source=a.sglang_wheel, bookkeeping=a.bookkeeping, check=not a.no_check, quick=quick)
    doc["command"] = " ".join(["python", "benchmarks/vs_hisparse.py", *sys.argv[1:]])
    print_gpu_table(doc)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_hisparse_gpu.json").write_text(json.dumps(doc, indent=1))
    if not a.no_plot:
        plot_gpu(doc, out / "vs_hisparse_gpu.png")
    print(f"\nwrote {out / 'vs_hisparse_gpu.json'}" + ("" if a.no_plot else f" and {out / 'vs_hisparse_gpu.png'}")
          + f" ({doc['seconds']:.0f} s)")
    return 0


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
    H, page = sizes_for(trace.top_k)
    slots = trace.batch * (H + page)
    t0 = time.time()
    look0 = int((trace.topk[0] >= 0).sum())
    ess = replay_ess(trace, slots)  # new tokens as the runtime stores them (EssConfig.new_tokens: insert)
    ess_on_demand = replay_ess(trace, slots, new_tokens="on_demand")  # new tokens fetched when a selection names them
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
               ess=ess.to_dict(), ess_on_demand=ess_on_demand.to_dict(), hisparse=hs.to_dict(),
               hisparse_pd=hs_pd.to_dict(),
               ess_warmup_variants=variants)
    for key, st in (("ess", ess), ("ess_on_demand", ess_on_demand), ("hisparse", hs), ("hisparse_pd", hs_pd)):
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
    print("\nESS with decoded tokens fetched on demand (new_tokens=on_demand) against the default (insert):")
    print("| family | ESS hit (on demand) | ESS hit (insert) | HiSparse hit (staged) | miss MB (on demand) | "
          "miss MB (insert) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        e, o = r["ess"], r.get("ess_on_demand")
        if o is not None:
            print(f"| {r['name']} | {o['hit_rate']:.4f} | {e['hit_rate']:.4f} | {r['hisparse']['hit_rate']:.4f} | "
                  f"{_mb(o['miss_bytes'])} | {_mb(e['miss_bytes'])} |")
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
    g = p.add_argument_group("GPU timing (--gpu: HiSparse's kernel vs ESS's resolve; the CPU part is skipped)")
    g.add_argument("--gpu", action="store_true", help="time the swap-in on the GPU instead of the CPU hit-rate part")
    g.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,2,4,...,128; quick 1,8,64)")
    g.add_argument("--gpu-families", default=None,
                   help=f"comma-separated, of {','.join(GPU_FAMILIES)} (default syn-steady,syn-sticky; "
                        "quick syn-steady)")
    g.add_argument("--steps", type=int, default=None, help="decode steps replayed (default 64; quick 24)")
    g.add_argument("--context", type=int, default=None, help="longest prompt (default 32768; quick 16384)")
    g.add_argument("--reps", type=int, default=None, help="timed passes over the trace (default 2; quick 1)")
    g.add_argument("--hisparse-warm", default="staged", choices=["staged", "pd_direct"],
                   help="HiSparse's start: prompt's first 4096 tokens resident (staged) or nothing (PD decode)")
    g.add_argument("--sglang-wheel", default=None,
                   help="sglang 0.5.23 wheel or folder (default: $ESS_SGLANG_WHEEL, .whl/hisparse/, installed sglang)")
    g.add_argument("--bookkeeping", action="store_true",
                   help="also time both without moving KV bytes (HiSparse SkipIO build, ESS copy_impl='none')")
    g.add_argument("--no-check", action="store_true", help="skip the eager pass's row-by-row checks")
    a = p.parse_args(argv)
    if a.gpu:
        return run_gpu(a)

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
               entry_bytes=LATENT_ENTRY_BYTES, quick=a.quick, command=" ".join(["python", "benchmarks/vs_hisparse.py",
                                                                          *(argv or sys.argv[1:])]),
               families=results)
    (out / "vs_hisparse_hits.json").write_text(json.dumps(doc, indent=1))
    if not a.no_plot:
        plot(results, out / "vs_hisparse_hits.png")
    print(f"\nwrote {out / 'vs_hisparse_hits.json'}" + ("" if a.no_plot else f" and {out / 'vs_hisparse_hits.png'}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
