"""Where a decode step's time goes inside a real SGLang server: one system at one context and batch, profiled with
SGLang's own profiler (``/start_profile``, torch profiler with CUDA activity, kernels inside CUDA graphs included)
once every request is decoding. Prints and writes (``profile_<system>.json`` under ``--out``) the decode step time,
the GPU time per step summed over kernels, and the kernels that take it, grouped by name.

    scripts/sglang_site.sh python3 benchmarks/serving_profile.py --systems ess,hbm --context 32768 --batch 4

``--transition`` profiles one request from before it is sent instead, over ``--steps`` forward steps (its prefill
chunks and first decode steps), and writes ``transition_<system>.json``: the trace's last ``--tail-ms`` as the GPU's
busy and idle stretches beside the host's spans and blocking CUDA calls, with the client's chunk arrival times: where
the time between the prompt's first token and its second goes.

    scripts/sglang_site.sh python3 benchmarks/serving_profile.py --transition --steps 10 --output-len 8

Uses the same server settings as benchmarks/serving.py (``--hbm-capacity-requests`` sets every system's KV HBM bytes).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402
from sglang_server import MODEL_DIR, Server, make_prompts, metric_sum, run_requests, scrape  # noqa: E402

HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function")
"""Trace categories of host-side spans (inclusive times: a Python function contains the ops it calls)."""


def trace_events(trace_path: Path) -> tuple[list[dict], list[dict]]:
    """(every event, the GPU kernels among them) of a torch-profiler chrome trace (.json or .json.gz)."""
    opener = gzip.open if trace_path.suffix == ".gz" else open
    with opener(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return events, [e for e in events if e.get("cat") == "kernel" and "dur" in e]


def kernel_table(trace_path: Path, steps: int) -> dict:
    """Kernel time per decode step from a torch-profiler chrome trace, grouped by kernel name (summed durations); the
    GPU's busy time (overlapping kernels counted once) and its share of the kernels' window (the rest is the GPU
    waiting for the host); and the host spans (inclusive) per step."""
    events, kernels = trace_events(trace_path)
    if not kernels:
        return {"steps": steps, "gpu_ms_per_step": None, "busy_ms_per_step": None, "window_ms_per_step": None,
                "gpu_busy_share": None,
                "kernels": [], "host": []}
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    busy = busy_and_alone(kernels)[0]  # (kernels that overlap, on streams or through PDL, counted once)
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES and "dur" in e]
    return {"steps": steps, "gpu_ms_per_step": sum(e["dur"] for e in kernels) / steps / 1000,
            "busy_ms_per_step": busy / steps / 1000, "window_ms_per_step": (end - start) / steps / 1000,
            "gpu_busy_share": busy / (end - start) if end > start else None,
            "kernels": _per_step(kernels, steps, 40), "host": _per_step(host, steps, 60)}


def busy_and_alone(kernels: list[dict]) -> tuple[float, dict[str, float]]:
    """(time any kernel runs, per kernel name the time it runs with no kernel of another name beside it), in the
    trace's units. A kernel launched with programmatic dependent launch (the ESS resolve's) starts while the one
    before it runs and waits on the device, so summed durations count that wait twice; busy time and time alone do
    not."""
    edges = sorted([(e["ts"], 1, e["name"][:160]) for e in kernels] + [(e["ts"] + e["dur"], -1, e["name"][:160])
                                                                       for e in kernels])
    active: dict[str, int] = defaultdict(int)
    alone: dict[str, float] = defaultdict(float)
    busy, last = 0.0, None
    for t, step, name in edges:
        if last is not None and t > last and active:
            busy += t - last
            if len(active) == 1:
                alone[next(iter(active))] += t - last
        active[name] += step
        if not active[name]:
            del active[name]
        last = t
    return busy, dict(alone)


def kernel_diff(trace_a: Path, trace_b: Path, steps: int, least_us: float = 1.0) -> dict:
    """Per decode step, the kernel time of trace A minus trace B, by kernel name (every kernel, not only the top
    ones): where one system's step spends GPU time the other's does not. Summed durations (``us_a``, ``us_b``) and
    the time each name runs alone (``alone_us_a``, ``alone_us_b``: ``busy_and_alone``); the totals also as busy time
    (``busy_us_per_step_a``, ``_b``), the step's GPU time with overlapping kernels counted once, and the time only
    kernels that B never runs run in A (``own_alone_us_per_step_a``: ESS's own kernels against all-HBM, with the
    chain of PDL launches among them counted once). Rows whose summed difference is under `least_us` are left out of
    the list, not of the totals."""
    def per_name(kernels: list[dict]) -> tuple[dict, dict, float, dict]:
        us: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for e in kernels:
            us[e["name"][:160]] += e["dur"] / steps
            calls[e["name"][:160]] += 1
        busy, alone = busy_and_alone(kernels)
        return us, calls, busy / steps, {n: t / steps for n, t in alone.items()}

    kernels_a = trace_events(trace_a)[1]
    (ua, ca, busy_a, alone_a), (ub, cb, busy_b, alone_b) = per_name(kernels_a), per_name(trace_events(trace_b)[1])
    own = set(ua) - set(ub)  # kernels only system A runs (ESS's own, against all-HBM)
    busy_a_without_own = busy_and_alone([e for e in kernels_a if e["name"][:160] not in own])[0] / steps
    rows = [{"name": n, "us_per_step_diff": ua.get(n, 0.0) - ub.get(n, 0.0), "us_a": ua.get(n, 0.0),
             "us_b": ub.get(n, 0.0), "alone_us_a": alone_a.get(n, 0.0), "alone_us_b": alone_b.get(n, 0.0),
             "calls_a": ca.get(n, 0) / steps, "calls_b": cb.get(n, 0) / steps}
            for n in set(ua) | set(ub)]
    rows.sort(key=lambda r: -abs(r["us_per_step_diff"]))
    return {"steps": steps, "us_per_step_a": sum(ua.values()), "us_per_step_b": sum(ub.values()),
            "busy_us_per_step_a": busy_a, "busy_us_per_step_b": busy_b,
            "own_alone_us_per_step_a": busy_a - busy_a_without_own,
            "kernels": [r for r in rows if abs(r["us_per_step_diff"]) >= least_us]}


def transition_table(trace_path: Path, tail_ms: float, least_us: float = 200.0) -> dict:
    """The last `tail_ms` of a trace, on one clock (ms from the window's start): the GPU's busy stretches (kernels
    less than 50 us apart merged; each with its longest kernels) and the idle ones between them; the host's Python
    spans in SGLang's and ESS's code and its CUDA runtime calls (synchronisations, blocking copies, graph launches)
    of at least `least_us`, with their thread."""
    events, kernels = trace_events(trace_path)
    if not kernels:
        return {"tail_ms": tail_ms, "gpu": [], "host": []}
    end = max(e["ts"] + e["dur"] for e in kernels)
    t0 = end - tail_ms * 1000
    gpu: list[dict] = []
    names: dict[str, float] = defaultdict(float)
    lo = hi = None
    for e in sorted((k for k in kernels if k["ts"] + k["dur"] >= t0), key=lambda k: k["ts"]):
        if hi is not None and e["ts"] > hi + 50:
            gpu.append(_stretch(lo, hi, names, t0))
            gpu.append({"start_ms": (hi - t0) / 1000, "ms": (e["ts"] - hi) / 1000, "busy": False})
            lo, names = None, defaultdict(float)
        lo = e["ts"] if lo is None else lo
        hi = max(hi or 0, e["ts"] + e["dur"])
        names[e["name"][:100]] += e["dur"]
    gpu.append(_stretch(lo, hi, names, t0))
    host = sorted(({"start_ms": (e["ts"] - t0) / 1000, "ms": e["dur"] / 1000, "tid": e.get("tid"),
                    "name": e["name"][:140]}
                   for e in events if "dur" in e and e["ts"] + e["dur"] >= t0 and e["dur"] >= least_us
                   and ((e.get("cat") == "python_function" and "sglang" in e["name"])
                        or e.get("cat") == "cuda_runtime")),
                  key=lambda r: r["start_ms"])
    return {"tail_ms": tail_ms, "gpu": gpu, "host": host}


def _stretch(lo: float, hi: float, names: dict, t0: float) -> dict:
    top = sorted(names.items(), key=lambda kv: -kv[1])[:3]
    return {"start_ms": (lo - t0) / 1000, "ms": (hi - lo) / 1000, "busy": True,
            "kernels": [f"{us:.0f} us {n}" for n, us in top]}


def _per_step(events: list, steps: int, top: int) -> list[dict]:
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        by_name[e["name"]].append(e["dur"])
    rows = sorted(({"name": n[:160], "calls_per_step": len(d) / steps, "us_per_step": sum(d) / steps}
                   for n, d in by_name.items()), key=lambda r: -r["us_per_step"])
    return rows[:top]


def profile_system(system: str, args) -> dict:
    setup = serving.Setup(system, system, (args.batch,), json.loads(args.ess_config) if system == "ess" else {},
                          args.hisparse_ratio, args.max_running)
    spec = serving.spec_for(setup, args.context, args)
    out = args.out
    server = Server(spec, out / f"server_profile_{system}.log", out)
    trace_dir = out / f"trace_{system}"
    trace_dir.mkdir(parents=True, exist_ok=True)
    try:
        server.start()
        run_requests(spec.url, make_prompts(1, args.context - args.output_len, seed=7), 8, 1)  # warm-up
        if args.transition:
            return profile_transition(system, spec.url, trace_dir, args)
        prompts = make_prompts(args.batch, args.context - args.output_len, seed=args.context)
        done: list = []
        sender = threading.Thread(target=lambda: done.append(run_requests(
            spec.url, prompts, args.output_len, args.batch, logprobs=serving.LOGPROBS[system])), daemon=True)
        sender.start()
        t0 = time.time()
        while time.time() - t0 < 600 and metric_sum(scrape(spec.url), "sglang:num_running_reqs") < args.batch:
            time.sleep(0.2)
        time.sleep(1.0)  # past the first decode windows (warm-up misses)
        start_profile(spec.url, trace_dir, args.steps, system)
        sender.join()
        trace = newest_trace(trace_dir, system)
        table = kernel_table(trace, args.steps)
        results = done[0][0] if done else []
        table.update(system=system, context=args.context, batch=args.batch, trace=str(trace.name),
                     errors=sum(1 for r in results if r.error))
        return table
    finally:
        server.stop()


def start_profile(url: str, trace_dir: Path, steps: int, prefix: str) -> None:
    body = json.dumps({"output_dir": str(trace_dir), "num_steps": steps, "activities": ["CPU", "GPU"],
                       "profile_prefix": prefix}).encode()
    req = urllib.request.Request(url + "/start_profile", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def newest_trace(trace_dir: Path, system: str) -> Path:
    """The trace the profiler writes after the profiled steps, in the scheduler process, once it stops growing."""
    traces: list[Path] = []
    for _ in range(120):
        traces = sorted(trace_dir.rglob("*.json*"), key=lambda p: p.stat().st_size)
        if traces and time.time() - traces[-1].stat().st_mtime > 3:
            return traces[-1]
        time.sleep(1)
    raise RuntimeError(f"{system}: no trace written under {trace_dir}")


def profile_transition(system: str, url: str, trace_dir: Path, args) -> dict:
    """One request profiled from before it is sent: its prefill, the move to decoding, its first decode steps."""
    start_profile(url, trace_dir, args.steps, f"{system}_transition")
    results = run_requests(url, make_prompts(1, args.context - args.output_len, seed=args.context), args.output_len,
                           1, logprobs=serving.LOGPROBS[system])[0]
    trace = newest_trace(trace_dir, system)
    table = transition_table(trace, args.tail_ms)
    r = results[0]
    table.update(system=system, context=args.context, trace=trace.name, error=r.error, ttft_ms=r.ttft_s * 1000,
                 chunks_ms=[(t * 1000, n) for t, n in r.chunks[:6]])
    return table


def print_transition(table: dict) -> None:
    print(f"\n{table['system']}: TTFT {table['ttft_ms']:.1f} ms; chunks (ms, tokens so far): "
          + ", ".join(f"({t:.1f}, {n})" for t, n in table["chunks_ms"]))
    print(f"  GPU, last {table['tail_ms']} ms of the trace:")
    for g in table["gpu"]:
        if g["ms"] >= 0.1:
            what = "; ".join(g["kernels"]) if g["busy"] else "idle"
            print(f"  {g['start_ms']:8.2f} +{g['ms']:7.2f} ms  {what[:150]}")
    print("  host spans and CUDA runtime calls:")
    for h in table["host"][:150]:
        print(f"  {h['start_ms']:8.2f} +{h['ms']:7.2f} ms  t{h['tid']}  {h['name'][:120]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="ess,hbm")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=4, help="requests decoding at once while profiled")
    p.add_argument("--steps", type=int, default=20, help="decode steps profiled (--transition: forward steps)")
    p.add_argument("--transition", action="store_true",
                   help="profile one request from before it is sent: its prefill and first decode steps")
    p.add_argument("--tail-ms", type=float, default=60.0, help="--transition: the trace's last milliseconds shown")
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--hbm-capacity-requests", type=int, default=12)
    p.add_argument("--hisparse-ratio", type=int, default=8)
    p.add_argument("--ess-config", default='{"sparse_memory_ratio": 0.02}')
    p.add_argument("--mem-fraction-static", type=float, default=0.80)
    p.add_argument("--max-running", type=int, default=48, help="--max-running-requests (as in the serving run)")
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/serving"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tables = {}
    if args.transition:
        for system in args.systems.split(","):
            table = profile_system(system, args)
            (args.out / f"transition_{system}.json").write_text(json.dumps(table, indent=1))
            print_transition(table)
        return 0
    for system in args.systems.split(","):
        table = tables[system] = profile_system(system, args)
        (args.out / f"profile_{system}.json").write_text(json.dumps(table, indent=1))
        print(f"\n{system}: {table['batch']} requests at {table['context']}: GPU {table['gpu_ms_per_step']} ms/step "
              f"over a window of {table['window_ms_per_step']} ms/step")
        print(f"  GPU busy {table['gpu_busy_share']} of the window; kernels per step:")
        for k in table["kernels"][:25]:
            print(f"  {k['us_per_step']:9.1f} us {k['calls_per_step']:6.1f}x  {k['name'][:110]}")
        print("  host spans per step (inclusive):")
        for k in table["host"][:30]:
            print(f"  {k['us_per_step']:9.1f} us {k['calls_per_step']:6.1f}x  {k['name'][:110]}")
    systems = list(tables)
    for other in systems[1:]:  # the first system against each other one, kernel by kernel
        a, b = systems[0], other
        diff = kernel_diff(args.out / f"trace_{a}" / tables[a]["trace"], args.out / f"trace_{b}" / tables[b]["trace"],
                           args.steps)
        (args.out / f"kernel_diff_{a}_vs_{b}.json").write_text(json.dumps(diff, indent=1))
        print(f"\n{a} - {b}: {diff['us_per_step_a'] - diff['us_per_step_b']:+.1f} us of summed kernel time a step, "
              f"{diff['busy_us_per_step_a'] - diff['busy_us_per_step_b']:+.1f} us of GPU busy time, of which "
              f"{diff['own_alone_us_per_step_a']:.1f} us kernels only {a} runs, alone")
        for k in diff["kernels"][:25]:
            print(f"  {k['us_per_step_diff']:+9.1f} us  {k['calls_a']:5.1f}x / {k['calls_b']:5.1f}x  {k['name'][:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
