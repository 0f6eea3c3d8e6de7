"""Several GPUs of one host pulling from host memory at once, attention-DP style: FlashTrans and the decode stack.

One worker process per GPU, each with its own pinned host pool and hot pool; a worker pins itself to the CPUs of its
GPU's NUMA node before allocating (when sysfs says which node: first-touch then places its pool there), and the node
is recorded. For 1, 2, 4 and 8 GPUs (as many as the machine has), every measurement starts on all of them at the same
wall-clock instant and runs the same number of iterations, sized from the one-GPU run to last about `--seconds`:

    bulk     one pinned cudaMemcpyAsync H2D of the same bytes as a gather (the link's ceiling)
    gather   FlashTrans H2D: `--entries` random 656-B entries of the worker's pool into random hot slots
    scatter  FlashTrans D2H: the same number of entries from the device to random host rows
    both     gather and scatter at once on two streams (decode does both every step)
    decode   (with --decode) one captured step of the decode-layer stack (4 DSA layers, sync mode, batch 64,
             32K context, hit ~0.95): its time, with every GPU decoding at once against one GPU alone

Reported: per-GPU GB/s, the aggregate over the GPUs, the aggregate against `count` x GPU 0's bulk rate measured
alone in the same run, each GPU's rate against the same GPU running alone (every GPU is also measured alone), and
the share of the shortest run during which all of them were running (workers prepare, say so, then start together).

    python benchmarks/multi_gpu.py --out benchmarks/results [--decode]     (table; multi_gpu.json / .png)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.multiprocessing as mp
from flashtrans import index_sets  # benchmarks/ (run these files as scripts)
from timing import run_info

ENTRY = 656
HERE = os.path.dirname(os.path.abspath(__file__))
COPY_OPS = ("bulk", "gather", "scatter", "both")


# ------------------------------------------------------------------------------------------- machine facts
def pci_bus_id(device: int) -> str | None:
    """sysfs PCI address ("0000:18:00.0") of a CUDA device as this process numbers it (CUDA_VISIBLE_DEVICES and
    CUDA_DEVICE_ORDER respected), from torch's device properties; None when torch does not say."""
    props = torch.cuda.get_device_properties(device)
    dom, bus, dev = (getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device"))
    if bus is None or dev is None:
        return None
    return f"{dom or 0:04x}:{bus:02x}:{dev:02x}.0"


def numa_node(bus_id: str | None) -> int:
    """The NUMA node sysfs gives for a PCI device, -1 when unknown."""
    if not bus_id:
        return -1
    try:
        with open(f"/sys/bus/pci/devices/{bus_id}/numa_node") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return -1


def parse_cpulist(text: str) -> set[int]:
    """"0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def node_cpus(node: int) -> set[int]:
    if node < 0:
        return set()
    try:
        with open(f"/sys/devices/system/node/node{node}/cpulist") as f:
            return parse_cpulist(f.read())
    except OSError:
        return set()


# ------------------------------------------------------------------------------------------- one GPU's worker
class _Ops:
    """The worker's measurements: each returns a callable running one iteration, and its bytes moved."""

    def __init__(self, args):
        from ess_sglang.host_pool import HostTotalPool

        dev = torch.device("cuda")
        self.n = args.entries
        rows = int(args.pool_gib * 2**30) // ENTRY
        self.pool = HostTotalPool(1, rows, device=dev)
        self.host = self.pool.layer(0)
        slots = max(self.n * 2, 65536)
        self.hot = torch.randint(0, 256, (slots, ENTRY), dtype=torch.uint8, device=dev)
        self.bulk_host = self.pool.entries.view(-1)[: self.n * ENTRY]
        self.bulk_dev = torch.empty(self.n * ENTRY, dtype=torch.uint8, device=dev)
        g = torch.Generator(device=dev).manual_seed(torch.cuda.current_device())
        # rotating index sets (pool rows, hot slots): 16 sets, each iteration takes the next
        self.sets = index_sets(self.n, rows, slots, "random", g, count=16)
        self.s1, self.s2 = torch.cuda.Stream(), torch.cuda.Stream()
        self.it = 0
        self.decode = _DecodeStep(args) if args.decode else None

    def run(self, op: str) -> int:
        """One iteration of `op`; returns the bytes it moved over PCIe (0 for decode)."""
        from ess_sglang.kernels.flashtrans import copy_rows_triton

        src, dst = self.sets[self.it % len(self.sets)]
        self.it += 1
        nbytes = self.n * ENTRY
        if op == "bulk":
            self.bulk_dev.copy_(self.bulk_host, non_blocking=True)
        elif op == "gather":
            copy_rows_triton(self.host, self.hot, src, dst)
        elif op == "scatter":
            copy_rows_triton(self.hot, self.host, dst, src)
        elif op == "both":
            main = torch.cuda.current_stream()
            self.s1.wait_stream(main)
            self.s2.wait_stream(main)
            with torch.cuda.stream(self.s1):
                copy_rows_triton(self.host, self.hot, src, dst)
            with torch.cuda.stream(self.s2):  # other host rows than the gather reads
                copy_rows_triton(self.hot, self.host, dst, (src + self.host.shape[0] // 2) % self.host.shape[0])
            main.wait_stream(self.s1)
            main.wait_stream(self.s2)
            nbytes *= 2
        elif op == "decode":
            self.decode.replay()
            nbytes = 0
        else:
            raise ValueError(f"unknown measurement {op!r}")
        return nbytes


class _DecodeStep:
    """The decode-layer benchmark's stack (benchmarks/decode_layers.py), sync mode, one step captured in a graph;
    each replay loads the next step's inputs first (the selection drifts, so every step has misses)."""

    def __init__(self, args):
        import decode_layers as dl

        self.dl = dl
        layers, ctx, batch = 4, args.decode_context, args.decode_batch
        self.steps = 4 + args.decode_steps
        self.pools = dl.Pools(layers, batch * (ctx + self.steps))
        self.cfg = dl.Config(self.pools, layers, ctx, batch, self.steps, seed=1)
        slots = (int(0.2 * batch * ctx) + 63) // 64 * 64
        self.queries = self.cfg.queries(0.99135)  # drift that gives ~0.95 hits at 32K (scratch calibration)
        self.stack = dl.build_ess(self.pools, self.cfg, slots, ["sync"] * layers, False)
        self.rewind()

    def rewind(self) -> None:
        self.graph = self.dl.warm_and_capture(self.stack, self.cfg, self.queries, 3, is_ess=True)
        self.s = 3

    def replay(self) -> None:
        if self.s >= self.steps:
            raise RuntimeError("decode: out of prepared steps (raise --decode-steps)")
        self.cfg.load_step(self.s, self.queries)
        self.graph.replay()
        self.s += 1


def _worker(rank: int, conn, args) -> None:
    bus = pci_bus_id(rank)
    node = numa_node(bus)
    cpus = node_cpus(node)
    if cpus:  # before any host allocation: first touch then places the pool on the GPU's node
        os.sched_setaffinity(0, cpus)
    torch.cuda.set_device(rank)
    try:
        ops = _Ops(args)
        for op in COPY_OPS + (("decode",) if args.decode else ()):  # compile and warm every path
            for _ in range(2):
                ops.run(op)
        if ops.decode is not None:
            ops.decode.rewind()
        torch.cuda.synchronize()
        conn.send(dict(rank=rank, ready=True, bus_id=bus, numa_node=node, cpus=len(os.sched_getaffinity(0)),
                       device=torch.cuda.get_device_name(rank)))
    except Exception as exc:  # noqa: BLE001 - report to the parent, which stops the run with the message
        conn.send(dict(rank=rank, ready=False, error=f"{type(exc).__name__}: {exc}"))
        return
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            return
        if cmd[0] == "prepare":  # whatever a measurement needs first, so that every worker is ready at the start
            if cmd[1] == "decode":
                ops.decode.rewind()
            torch.cuda.synchronize()
            conn.send("ready")
            continue
        _, op, iters, start_at = cmd
        if op == "decode":
            iters = min(iters, ops.decode.steps - ops.decode.s)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        while time.time() < start_at:  # every worker starts at the same instant
            pass
        t0 = time.time()
        a.record()
        nbytes = sum(ops.run(op) for _ in range(iters))
        b.record()
        b.synchronize()
        us = a.elapsed_time(b) * 1e3
        conn.send(dict(rank=rank, op=op, iters=iters, us=us, us_per_iter=us / iters, bytes=nbytes,
                       gbps=nbytes / us / 1e3 if nbytes else None, wall_start=t0, wall_end=time.time()))


# ------------------------------------------------------------------------------------------- the run
def measure(conns, op: str, iters: int, margin_s: float = 0.2) -> list[dict]:
    """Run `op` on the workers behind `conns` at once: each prepares and says so, then all start at one instant.
    Each row gets the share of the shortest run during which every worker was running (`overlap`)."""
    for c in conns:
        c.send(("prepare", op))
    for c in conns:
        if c.recv() != "ready":
            raise RuntimeError("a worker did not get ready")
    start_at = time.time() + margin_s
    for c in conns:
        c.send(("run", op, iters, start_at))
    rows = [c.recv() for c in conns]
    together = min(r["wall_end"] for r in rows) - max(r["wall_start"] for r in rows)
    shortest = min(r["wall_end"] - r["wall_start"] for r in rows)
    for r in rows:
        r["overlap"] = max(0.0, together) / shortest if shortest > 0 else 0.0
    return rows


def summarise(rows: list[dict], counts: list[int]) -> list[dict]:
    """One line per (op, GPU count): per-GPU rates, the aggregate against `count` x GPU 0's bulk rate alone, and
    each GPU against the same GPU alone (rows with gpus == 1 hold every GPU's alone run; the worst is reported)."""
    out = []
    alone = {(r["op"], r["rank"]): r for r in rows if r["gpus"] == 1}
    bulk1 = alone[("bulk", 0)]["gbps"] if ("bulk", 0) in alone else None
    for op in COPY_OPS + ("decode",):
        for c in counts:
            rs = [r for r in rows if r["op"] == op and r["gpus"] == c and (c > 1 or r["rank"] == 0)]
            if not rs:
                continue
            line = dict(op=op, gpus=c, numa_nodes=sorted({r["numa_node"] for r in rs}),
                        overlap=min(r.get("overlap", 1.0) for r in rs))
            base = [alone.get((op, r["rank"])) for r in rs]
            if op == "decode":
                line.update(step_us=[r["us_per_iter"] for r in rs], worst_vs_alone=None if None in base else min(
                    b["us_per_iter"] / r["us_per_iter"] for r, b in zip(rs, base, strict=True)))
            else:
                rates = [r["gbps"] for r in rs]
                line.update(per_gpu_gbps=rates, aggregate_gbps=sum(rates),
                            aggregate_vs_bulk=sum(rates) / (c * bulk1) if bulk1 else None,
                            worst_vs_alone=None if None in base else min(
                                r["gbps"] / b["gbps"] for r, b in zip(rs, base, strict=True)))
            out.append(line)
    return out


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(summary: list[dict]) -> None:
    print(f"\n{'op':8} {'GPUs':>4} {'per-GPU GB/s (or step us)':>34} {'aggregate':>9} {'agg / (n x bulk1)':>17} "
          f"{'worst / alone':>13} {'overlap':>7}  NUMA")
    for s in summary:
        if s["op"] == "decode":
            per, agg, vs_bulk = ", ".join(f"{x:.0f}" for x in s["step_us"]), "", ""
        else:
            per = ", ".join(f"{x:.1f}" for x in s["per_gpu_gbps"])
            agg, vs_bulk = _fmt(s["aggregate_gbps"], ".1f"), _fmt(s["aggregate_vs_bulk"], ".2f")
        print(f"{s['op']:8} {s['gpus']:>4} {per:>34} {agg:>9} {vs_bulk:>17} {_fmt(s['worst_vs_alone'], '.2f'):>13} "
              f"{s['overlap']:7.2f}  {s['numa_nodes']}")


def plot(summary: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    bulk = [s for s in summary if s["op"] == "bulk"]
    for op, style in (("bulk", "k--o"), ("gather", "-o"), ("scatter", "-s"), ("both", "-^")):
        pts = [(s["gpus"], s["aggregate_gbps"]) for s in summary if s["op"] == op]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=f"{op} (aggregate)")
    if bulk:
        one = bulk[0]["aggregate_gbps"] / bulk[0]["gpus"]
        xs = [s["gpus"] for s in bulk]
        ax.plot(xs, [x * one for x in xs], "k:", label="n x one GPU's bulk")
    ax.set_xlabel("GPUs copying at once (one process each)")
    ax.set_ylabel("GB/s, sum over GPUs")
    ax.set_title("Host memory <-> GPUs, 656-B entries")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--gpus", default="1,2,4,8", help="GPU counts to run (those above the machine's are skipped)")
    p.add_argument("--entries", type=int, default=16384, help="entries per gather / scatter")
    p.add_argument("--pool-gib", type=float, default=2.0, help="pinned host pool per GPU")
    p.add_argument("--seconds", type=float, default=1.0, help="about how long each measurement runs")
    p.add_argument("--decode", action="store_true", help="also time the decode-layer stack on every GPU at once")
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-context", type=int, default=32768)
    p.add_argument("--decode-steps", type=int, default=48, help="prepared steps per decode measurement")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("multi_gpu.py needs CUDA GPUs", file=sys.stderr)
        return 2
    have = torch.cuda.device_count()
    counts = [c for c in (int(x) for x in args.gpus.split(",")) if 1 <= c <= have]
    skipped = [int(x) for x in args.gpus.split(",") if int(x) > have]
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for rank in range(max(counts)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(rank, child, args), daemon=True)
        proc.start()
        conns.append(parent)
        procs.append(proc)
    t0 = time.time()
    workers = [c.recv() for c in conns]
    bad = [w for w in workers if not w["ready"]]
    if bad:
        print("worker failed:", bad, file=sys.stderr)
        return 1
    print(f"{len(workers)} workers ready in {time.time() - t0:.1f} s: " +
          ", ".join(f"GPU {w['rank']} {w['bus_id']} NUMA {w['numa_node']} ({w['cpus']} CPUs)" for w in workers),
          flush=True)
    rows = []
    ops = list(COPY_OPS) + (["decode"] if args.decode else [])
    for op in ops:
        probe = measure(conns[:1], op, 3)[0]  # size the loop from one GPU alone
        iters = max(3, int(args.seconds * 1e6 / probe["us_per_iter"]))
        if op == "decode":
            iters = min(iters, args.decode_steps)
        # each GPU alone (its own baseline), then 2, 4, ... at once
        runs = [(1, [conn]) for conn in conns] + [(c, conns[:c]) for c in counts if c > 1]
        for c, group in runs:
            got = measure(group, op, iters)
            for r in got:
                r.update(gpus=c, numa_node=workers[r["rank"]]["numa_node"])
            rows += got
            print(f"{op:8} x{c}: " + ", ".join(f"GPU {r['rank']} {r['gbps']:.1f} GB/s" if r["gbps"] else
                                                f"GPU {r['rank']} {r['us_per_iter']:.0f} us" for r in got) +
                  (f"  (all running together for {got[0]['overlap']:.0%} of the shortest run)" if c > 1 else ""),
                  flush=True)
            if c > 1 and got[0]["overlap"] < 0.9:
                print(f"warning: {op} x{c}: the GPUs overlapped for only {got[0]['overlap']:.0%} of the shortest "
                      "run; its rates understate the contention", flush=True)
    for c in conns:
        c.send(("stop",))
    for proc in procs:
        proc.join(timeout=30)
    summary = summarise(rows, counts)
    print_table(summary)
    if skipped:
        print(f"not run: {skipped} GPUs (the machine has {have})")
    info = run_info(gpus_on_machine=have, entries=args.entries, pool_gib_per_gpu=args.pool_gib, workers=workers,
                    not_run=skipped)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "multi_gpu.json"), "w") as f:
        json.dump(dict(info=info, rows=rows, summary=summary), f, indent=1)
    plot(summary, os.path.join(args.out, "multi_gpu.png"))
    print(f"wrote {args.out}/multi_gpu.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
