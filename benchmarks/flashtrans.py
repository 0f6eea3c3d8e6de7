"""FlashTrans bandwidth on the GPU: scattered 656-B entries between a pinned host pool (>= 1 GiB) and device memory.

For each entry count (64 ... 262,144) and source pattern (random, clustered runs of 32), in one run:
  - our Triton kernel, in each variant (chunked rows / first masked version; rows per program; warps), and the
    persistent counted kernel the decode stack uses (`copy_rows_counted`: a fixed number of programs walking the
    first count rows, count read on the device);
  - one cudaMemcpyAsync per entry (captured in a CUDA graph so Python is not timed; up to 4,096 entries);
  - torch.index_select on the UVA view (gather only: into a contiguous buffer);
  - a bulk pinned copy of the same byte count: the ceiling every ratio is taken against;
  - gather and scatter at once on two streams (both directions, as decode does every step).
Times are medians of CUDA-event timings over rotating index sets (so nothing is served from L2), each after a GPU
busy-wait (the host's launch latency is not timed). Then the pool-size sweep: the default kernel over pools of
0.5 ... 12 GiB with a fresh index set per timing (a decode step's misses are new each step), against the same set
repeated: the gap is the cost of address translation for host reads, which grows with the pool.

    python benchmarks/flashtrans.py --out benchmarks/results     (prints a table; writes flashtrans.json / .png)
"""

from __future__ import annotations

import argparse
import json

import torch
from ess_sglang.kernels.flashtrans import copy_rows_counted, copy_rows_reference, copy_rows_triton
from timing import median_us, run_info  # benchmarks/timing.py (run these files as scripts)

from ess_sglang.host_pool import HostTotalPool

ENTRY = 656
SIZES = [64, 256, 1024, 2048, 4096, 16384, 65536, 262144]
VARIANTS = [("chunks", 4, 4), ("chunks", 8, 4), ("chunks", 16, 4), ("chunks", 16, 8), ("chunks", 32, 8),
            ("masked", 8, 4), ("chunks", 2, 1), ("masked", 4, 2), ("flat", 4, 4), ("flat", 8, 4), ("flat", 16, 8),
            ("flat", 32, 8)]
COUNTED = [(32, 8, 4), (132, 8, 4), (528, 4, 2)]  # programs, rows per step, warps
ROTATE = 6
_KEEP_ALIVE = []


def index_sets(n, pool_rows, slots, pattern, gen, count=ROTATE):
    """`count` (host rows, hot slots) pairs of n entries each: random rows, or runs of 32 ("clustered")."""
    out = []
    for _ in range(count):
        if pattern == "random":
            src = torch.randint(0, pool_rows, (n,), device="cuda", generator=gen)
        else:  # clustered: runs of 32 consecutive host entries at random starts
            runs = (n + 31) // 32
            starts = torch.randint(0, pool_rows - 32, (runs,), device="cuda", generator=gen)
            src = (starts.view(-1, 1) + torch.arange(32, device="cuda").view(1, -1)).view(-1)[:n]
        dst = torch.randperm(slots, device="cuda", generator=gen)[:n]
        out.append((src, dst))
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--pool-gib", type=float, default=1.5)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--padded-strides", type=lambda s: [int(x) for x in s.split(",") if x], default=[672, 768],
                   help="also gather from host pools whose rows are padded to these strides (bytes)")
    p.add_argument("--hugepage", action="store_true", help="also gather from a pool in transparent huge pages")
    p.add_argument("--pool-sizes", default="0.5,1.5,4,12",
                   help="GiB: gather from pools of these sizes with fresh index sets (address translation reach)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    dev = torch.device("cuda")
    pool_rows = int(args.pool_gib * 2**30) // ENTRY
    host = HostTotalPool(1, pool_rows, device=dev)
    host.entries.random_(0, 256)
    host_uva = host.layer(0)
    slots = max(sizes)
    hot = torch.randint(0, 256, (slots, ENTRY), dtype=torch.uint8, device=dev)
    bulk_dev = torch.empty(slots * ENTRY, dtype=torch.uint8, device=dev)
    bulk_host = host.entries.view(-1)[: slots * ENTRY]
    gen = torch.Generator(device=dev).manual_seed(0)
    padded_pools = {}
    if args.hugepage:  # experiment: the same pool in 2 MiB transparent huge pages, registered with CUDA
        padded_pools["thp"] = hugepage_pinned(pool_rows * ENTRY).view(pool_rows, ENTRY)
    for stride in args.padded_strides:
        pool = HostTotalPool(1, pool_rows, entry_bytes=stride, device=dev)
        padded_pools[stride] = pool.layer(0)[:, :ENTRY]
        _KEEP_ALIVE.append(pool)  # the view must not outlive its pinned pool
    rows = []
    info = run_info(pool_gib=args.pool_gib)

    # correctness first, at the largest size, every variant, both directions
    src, dst = index_sets(slots, pool_rows, slots, "random", gen)[0]
    src[::13] = -1
    want = hot.clone()
    copy_rows_reference(host_uva, want, src, dst)
    for variant, rpp, warps in VARIANTS:
        got = hot.clone()
        copy_rows_triton(host_uva, got, src, dst, rows_per_program=rpp, num_warps=warps, variant=variant)
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"gather {variant}/{rpp}/{warps} wrong"
    for programs, rpp, warps in COUNTED:
        got = hot.clone()
        count = torch.tensor([src.shape[0]], device="cuda")
        copy_rows_counted(host_uva, got, src, dst, count, programs, rows_per_program=rpp, num_warps=warps)
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"gather counted/{programs}/{rpp}/{warps} wrong"
    print("correctness: every variant equals the torch reference (gather, 262,144 entries, 1/13 padding)")

    def record(direction, pattern, n, method, us, bulk_us):
        gbps = n * ENTRY / us / 1e3
        rows.append(dict(direction=direction, pattern=pattern, entries=n, method=method, us=us, gbps=gbps,
                         ratio_to_bulk=bulk_us / us))

    for n in sizes:
        nbytes = n * ENTRY
        bulk_h2d = median_us(lambda k=nbytes: bulk_dev[:k].copy_(bulk_host[:k], non_blocking=True), [()])
        bulk_d2h = median_us(lambda k=nbytes: bulk_host[:k].copy_(bulk_dev[:k], non_blocking=True), [()])
        for pattern in ("random", "clustered"):
            sets = index_sets(n, pool_rows, slots, pattern, gen)
            record("h2d", pattern, n, "bulk", bulk_h2d, bulk_h2d)
            record("d2h", pattern, n, "bulk", bulk_d2h, bulk_d2h)
            for variant, rpp, warps in VARIANTS:
                name = f"triton-{variant}-r{rpp}-w{warps}"
                us = median_us(lambda s, d, v=variant, r=rpp, w=warps: copy_rows_triton(
                    host_uva, hot, s, d, rows_per_program=r, num_warps=w, variant=v), sets)
                record("h2d", pattern, n, name, us, bulk_h2d)
                us = median_us(lambda s, d, v=variant, r=rpp, w=warps: copy_rows_triton(
                    hot, host_uva, d, s, rows_per_program=r, num_warps=w, variant=v), sets)
                record("d2h", pattern, n, name, us, bulk_d2h)
            count = torch.tensor([n], device="cuda")
            for programs, rpp, warps in COUNTED:
                name = f"triton-counted-p{programs}-r{rpp}-w{warps}"
                us = median_us(lambda s, d, p=programs, r=rpp, w=warps, c=count: copy_rows_counted(
                    host_uva, hot, s, d, c, p, rows_per_program=r, num_warps=w), sets)
                record("h2d", pattern, n, name, us, bulk_h2d)
                us = median_us(lambda s, d, p=programs, r=rpp, w=warps, c=count: copy_rows_counted(
                    hot, host_uva, d, s, c, p, rows_per_program=r, num_warps=w), sets)
                record("d2h", pattern, n, name, us, bulk_d2h)
            us = median_us(lambda s, d: torch.index_select(host_uva, 0, s), sets)
            record("h2d", pattern, n, "torch-index_select-uva", us, bulk_h2d)
            if n <= 4096:  # one cudaMemcpyAsync per entry, replayed from a graph
                s_cpu, d_cpu = (t.cpu().tolist() for t in sets[0])
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for a, b in zip(s_cpu, d_cpu, strict=True):
                        hot[b].copy_(host.entries[0, a], non_blocking=True)
                us = median_us(g.replay, [()])
                record("h2d", pattern, n, "memcpy-per-entry", us, bulk_h2d)
                del g
            # both directions at once: gather on one stream, scatter (to other host rows) on another
            s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

            def both(s, d, s1=s1, s2=s2):
                main = torch.cuda.current_stream()
                s1.wait_stream(main)
                s2.wait_stream(main)
                with torch.cuda.stream(s1):
                    copy_rows_triton(host_uva, hot, s, d, rows_per_program=16, num_warps=4)
                with torch.cuda.stream(s2):
                    copy_rows_triton(hot, host_uva, d, (s + pool_rows // 2) % pool_rows, rows_per_program=16,
                                     num_warps=4)
                main.wait_stream(s1)
                main.wait_stream(s2)

            us = median_us(both, sets)
            record("both", pattern, n, "triton-chunks-r16-w4 (sum of both)", us / 2, (bulk_h2d + bulk_d2h) / 2)
            # layout experiment: the same 656-B entries stored at a padded host stride (sector / line aligned)
            for stride, padded in padded_pools.items():
                for variant, rpp, warps in (("chunks", 8, 4), ("masked", 8, 4)):
                    us = median_us(lambda s, d, v=variant, r=rpp, w=warps, src=padded: copy_rows_triton(
                        src, hot, s, d, rows_per_program=r, num_warps=w, variant=v), sets)
                    layout = "thp" if stride == "thp" else f"stride{stride}"
                    record("h2d", pattern, n, f"{layout}-{variant}-r{rpp}-w{warps}", us, bulk_h2d)
        torch.cuda.synchronize()
    pool_rows_out = pool_size_sweep([float(x) for x in args.pool_sizes.split(",") if x], hot, bulk_dev, bulk_host, gen)

    import os

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "flashtrans.json"), "w") as f:
        json.dump(dict(info=info, rows=rows, pool_size_rows=pool_rows_out), f, indent=1)
    plot(rows, os.path.join(args.out, "flashtrans.png"))
    summary(rows)
    if pool_rows_out:
        plot_pools(pool_rows_out, os.path.join(args.out, "flashtrans_pools.png"))


POOL_SIZES_N = (4096, 16384, 65536)
FRESH_SETS = 16


def pool_size_sweep(pool_gibs, hot, bulk_dev, bulk_host, gen) -> list[dict]:
    """Gather rate against the size of the pinned pool the random positions fall in, each timed index set used once
    (as each decode step's misses are new): the GPU reads host memory through address translation whose reach is
    a few GiB, so larger pools turn more reads into translation misses. "repeated" times one set over and over
    (its translations stay cached) with the same kernel, to tell the translation cost from the kernel's."""
    out = []
    if not pool_gibs:
        return out
    print(f"\n{'pool GiB':>8} {'entries':>8} {'bulk GB/s':>9} {'fresh GB/s':>10} {'x bulk':>6} {'repeated':>8} "
          f"{'x bulk':>6} {'index_sel fresh':>15}")
    for gib in pool_gibs:
        rows = int(gib * 2**30) // ENTRY
        pool = HostTotalPool(1, rows, device=torch.device("cuda"))
        src_pool = pool.layer(0)
        for n in POOL_SIZES_N:
            nbytes = n * ENTRY
            bulk = median_us(lambda k=nbytes: bulk_dev[:k].copy_(bulk_host[:k], non_blocking=True), [()])
            sets = index_sets(n, rows, hot.shape[0], "random", gen, count=FRESH_SETS + 1)

            def kernel(s, d, src=src_pool):
                copy_rows_triton(src, hot, s, d)

            def index_select(s, d, src=src_pool):
                torch.index_select(src, 0, s)

            res = {}
            for name, fn in (("fresh", kernel), ("index_select", index_select)):
                fn(*sets[0])  # compile / warm the code path on a set that is not timed
                torch.cuda.synchronize()
                res[name] = median_us(fn, sets[1:], reps=FRESH_SETS, warmup=0)
            res["repeated"] = median_us(kernel, sets[:1], reps=FRESH_SETS, warmup=3)
            for name, us in res.items():
                out.append(dict(direction="h2d", pattern="random", entries=n, method=f"pool-{name}", pool_gib=gib,
                                us=us, gbps=nbytes / us / 1e3, ratio_to_bulk=bulk / us))
            print(f"{gib:8.1f} {n:8d} {nbytes / bulk / 1e3:9.1f} {nbytes / res['fresh'] / 1e3:10.1f} "
                  f"{bulk / res['fresh']:6.2f} {nbytes / res['repeated'] / 1e3:8.1f} {bulk / res['repeated']:6.2f} "
                  f"{nbytes / res['index_select'] / 1e3:15.1f}", flush=True)
        torch.cuda.synchronize()
        del pool, src_pool
    return out


def plot_pools(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in POOL_SIZES_N:
        for method, style in (("pool-fresh", "-o"), ("pool-repeated", ":s")):
            pts = sorted((r["pool_gib"], r["ratio_to_bulk"]) for r in rows
                         if r["entries"] == n and r["method"] == method)
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=f"{n} entries, {method[5:]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pinned pool size (GiB), random positions")
    ax.set_ylabel("gather rate / bulk copy rate")
    ax.set_title("FlashTrans gather vs pool size (fresh index sets: translation misses)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def hugepage_pinned(nbytes):
    """A UVA view of `nbytes` of anonymous memory in 2 MiB transparent huge pages, registered with CUDA."""
    import ctypes
    import mmap

    huge = 2 << 20
    size = (nbytes + huge - 1) // huge * huge
    buf = mmap.mmap(-1, size + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    aligned = (base + huge - 1) // huge * huge
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    print("madvise(MADV_HUGEPAGE) ->", libc.madvise(aligned, size, 14))
    host = torch.frombuffer(buf, dtype=torch.uint8)[aligned - base: aligned - base + size]
    host.fill_(1)
    rc = torch.cuda.cudart().cudaHostRegister(aligned, size, 0)
    print("cudaHostRegister ->", rc, "pinned:", host.is_pinned())
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            print("THP:", f.read().strip())
        with open("/proc/meminfo") as f:
            print([line.strip() for line in f if "AnonHugePages" in line])
    except OSError as e:
        print("THP status unreadable:", e)
    from ess_sglang.uva import device_view

    _KEEP_ALIVE.append((buf, host))  # the mapping must outlive every view of it
    return device_view(host[:nbytes], "cuda")


def best(rows, direction, pattern, n, prefix="triton"):
    cand = [r for r in rows if r["direction"] == direction and r["pattern"] == pattern and r["entries"] == n
            and r["method"].startswith(prefix)]
    return max(cand, key=lambda r: r["gbps"]) if cand else None


def summary(rows):
    sizes = sorted({r["entries"] for r in rows})
    print(f"\n{'dir':5} {'pattern':9} {'entries':>8} {'bulk GB/s':>9} {'triton GB/s':>11} {'x bulk':>6}  best variant"
          f"{'':14} {'index_sel':>9} {'memcpy/entry':>12}")
    for direction in ("h2d", "d2h", "both"):
        for pattern in ("random", "clustered"):
            for n in sizes:
                t = best(rows, direction, pattern, n)
                if t is None:
                    continue
                ix = best(rows, direction, pattern, n, "torch-index_select")
                mc = best(rows, direction, pattern, n, "memcpy")
                bulk_gbps = n * ENTRY / (t["us"] * t["ratio_to_bulk"]) / 1e3
                print(f"{direction:5} {pattern:9} {n:8d} {bulk_gbps:9.1f} {t['gbps']:11.1f} {t['ratio_to_bulk']:6.2f}  "
                      f"{t['method']:26} {ix['gbps'] if ix else float('nan'):9.1f} "
                      f"{mc['gbps'] if mc else float('nan'):12.2f}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5), sharey=True)
    for ax, direction in zip(axes, ("h2d", "d2h", "both"), strict=True):
        methods = sorted({r["method"] for r in rows if r["direction"] == direction})
        for m in methods:
            pts = sorted((r["entries"], r["gbps"]) for r in rows
                         if r["direction"] == direction and r["method"] == m and r["pattern"] == "random")
            if pts:
                style = "k--" if m == "bulk" else "-o"
                ax.plot(*zip(*pts, strict=True), style, label=m, markersize=3)
        if direction == "both":
            pts = sorted((r["entries"], r["gbps"] / r["ratio_to_bulk"]) for r in rows
                         if r["direction"] == "both" and r["pattern"] == "random")
            ax.plot(*zip(*pts, strict=True), "k--", label="bulk (mean of H2D, D2H)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("entries (656 B each), random positions")
        ax.set_title({"h2d": "gather H2D", "d2h": "scatter D2H", "both": "both at once (per direction)"}[direction])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
