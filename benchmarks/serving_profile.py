"""Where a decode step's time goes inside a real SGLang server: one system at one context and batch, profiled with
SGLang's own profiler (``/start_profile``, torch profiler with CUDA activity, kernels inside CUDA graphs included)
once every request is decoding. Prints and writes (``profile_<system>.json`` under ``--out``) the decode step time,
the GPU time per step summed over kernels, and the kernels that take it, grouped by name.

    scripts/sglang_site.sh python3 benchmarks/serving_profile.py --systems ess,hbm --context 32768 --batch 4

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
    """Kernel time per decode step from a torch-profiler chrome trace, grouped by kernel name; the GPU's busy share of
    the kernels' window (the rest is the GPU waiting for the host); and the host spans (inclusive) per step."""
    events, kernels = trace_events(trace_path)
    if not kernels:
        return {"steps": steps, "gpu_ms_per_step": None, "window_ms_per_step": None, "gpu_busy_share": None,
                "kernels": [], "host": []}
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    busy, reach = 0.0, start
    for e in sorted(kernels, key=lambda e: e["ts"]):  # union of kernel intervals (streams overlap)
        lo, hi = max(e["ts"], reach), e["ts"] + e["dur"]
        if hi > lo:
            busy += hi - lo
            reach = hi
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES and "dur" in e]
    return {"steps": steps, "gpu_ms_per_step": sum(e["dur"] for e in kernels) / steps / 1000,
            "window_ms_per_step": (end - start) / steps / 1000,
            "gpu_busy_share": busy / (end - start) if end > start else None,
            "kernels": _per_step(kernels, steps, 40), "host": _per_step(host, steps, 60)}


def kernel_diff(trace_a: Path, trace_b: Path, steps: int, least_us: float = 1.0) -> dict:
    """Per decode step, the kernel time of trace A minus trace B, by kernel name (every kernel, not only the top
    ones): where one system's step spends GPU time the other's does not. Rows whose difference is under `least_us`
    are left out of the list, not of the total."""
    def per_name(path: Path) -> tuple[dict, dict]:
        us: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for e in trace_events(path)[1]:
            us[e["name"][:160]] += e["dur"] / steps
            calls[e["name"][:160]] += 1
        return us, calls

    (ua, ca), (ub, cb) = per_name(trace_a), per_name(trace_b)
    rows = [{"name": n, "us_per_step_diff": ua.get(n, 0.0) - ub.get(n, 0.0), "us_a": ua.get(n, 0.0),
             "us_b": ub.get(n, 0.0), "calls_a": ca.get(n, 0) / steps, "calls_b": cb.get(n, 0) / steps}
            for n in set(ua) | set(ub)]
    rows.sort(key=lambda r: -abs(r["us_per_step_diff"]))
    return {"steps": steps, "us_per_step_a": sum(ua.values()), "us_per_step_b": sum(ub.values()),
            "kernels": [r for r in rows if abs(r["us_per_step_diff"]) >= least_us]}


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
        prompts = make_prompts(args.batch, args.context - args.output_len, seed=args.context)
        done: list = []
        sender = threading.Thread(target=lambda: done.append(run_requests(
            spec.url, prompts, args.output_len, args.batch, logprobs=serving.LOGPROBS[system])), daemon=True)
        sender.start()
        t0 = time.time()
        while time.time() - t0 < 600 and metric_sum(scrape(spec.url), "sglang:num_running_reqs") < args.batch:
            time.sleep(0.2)
        time.sleep(1.0)  # past the first decode windows (warm-up misses)
        body = json.dumps({"output_dir": str(trace_dir), "num_steps": args.steps, "activities": ["CPU", "GPU"],
                           "profile_prefix": system}).encode()
        req = urllib.request.Request(spec.url + "/start_profile", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
        sender.join()
        traces: list[Path] = []
        for _ in range(120):  # the profiler writes its trace after the profiled steps, in the scheduler process
            traces = sorted(trace_dir.rglob("*.json*"), key=lambda p: p.stat().st_size)
            if traces and time.time() - traces[-1].stat().st_mtime > 3:
                break
            time.sleep(1)
        if not traces:
            raise RuntimeError(f"{system}: no trace written under {trace_dir}")
        table = kernel_table(traces[-1], args.steps)
        results = done[0][0] if done else []
        table.update(system=system, context=args.context, batch=args.batch, trace=str(traces[-1].name),
                     errors=sum(1 for r in results if r.error))
        return table
    finally:
        server.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="ess,hbm")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=4, help="requests decoding at once while profiled")
    p.add_argument("--steps", type=int, default=20, help="decode steps profiled")
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
        print(f"\n{a} - {b}: {diff['us_per_step_a'] - diff['us_per_step_b']:+.1f} us of kernel time a step")
        for k in diff["kernels"][:25]:
            print(f"  {k['us_per_step_diff']:+9.1f} us  {k['calls_a']:5.1f}x / {k['calls_b']:5.1f}x  {k['name'][:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
