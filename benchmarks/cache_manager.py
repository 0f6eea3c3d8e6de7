"""Per-layer resolve time on the GPU: lookup, protect, dedup, evict, allocate, slot table, with and without the copy.

For batch 1 ... 128, top-k 2048, q_tokens 1 and 2, target hit rates 0.5 / 0.9 / 0.95 / 0.99: one layer's resolve is
captured in a CUDA graph and replayed over a rotating sequence of selections. Each selection keeps a fraction of the
previous one (the target hit rate) and replaces the rest with fresh positions of a 32K context; the pool holds
1.25 steps' selections, so older entries are evicted and the hit rate holds from replay to replay (the rotation's
wrap-around costs one step in 64). The achieved hit rate is read from the manager's counters and reported.

    python benchmarks/cache_manager.py --out benchmarks/results     (table; cache_manager.json / .png)
    python benchmarks/cache_manager.py --profile --batches 64 --pool-slots 163840,419840,1703936,3407872
                                                                    (per-kernel times over pools of these sizes)
    python benchmarks/cache_manager.py --new-tokens on_demand,insert --batches 1,2,48 --hits 0.99 --q-tokens 1
        (the resolve that also writes each request's token back, as the SGLang plugin's does; "insert" gives the
         token a hot slot in the same launches; a new token location every step)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from timing import replay_us, run_info  # benchmarks/timing.py (run these files as scripts)

from ess_sglang.cache_manager import Counter, HotPoolCacheManager, NewTokens
from ess_sglang.host_pool import HostTotalPool

ENTRY, TOP_K, CONTEXT = 656, 2048, 32768
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]
HIT_RATES = [0.5, 0.9, 0.95, 0.99]
SEQUENCE = 64  # selections replayed in rotation


def selections(batch, q_tokens, hit, gen, context=CONTEXT):
    """SEQUENCE selections [batch, q_tokens, TOP_K]; consecutive ones share about `hit` of their positions."""
    cur = torch.stack([torch.randperm(context, device="cuda", generator=gen)[:TOP_K] for _ in range(batch)])
    out = []
    for _ in range(SEQUENCE):
        fresh = torch.randint(0, context, (batch, TOP_K), device="cuda", generator=gen)
        keep = torch.rand((batch, TOP_K), device="cuda", generator=gen) < hit
        cur = torch.where(keep, cur, fresh)
        sel = cur.view(batch, 1, TOP_K).expand(batch, q_tokens, TOP_K).clone()
        if q_tokens > 1:  # a draft token selects mostly the same positions, some others
            other = torch.randint(0, context, (batch, TOP_K), device="cuda", generator=gen)
            swap = torch.rand((batch, TOP_K), device="cuda", generator=gen) < 0.1
            sel[:, 1] = torch.where(swap, other, sel[:, 1])
        out.append(sel.int().contiguous())
    return out


def bench_one(host, batch, q_tokens, hit, copy_impl, gen, reps=2, new_tokens=None, decay_gamma=None, slots=None,
              tail="auto"):
    """`slots`: the hot pool (default 1.25 selections); `tail`: the launches after the lookup without spare slots:
    "auto" as shipped (merged into one up to `MERGED_TAIL_MAX_ENTRIES` entries, else three), "three" or "merged"."""
    dev = torch.device("cuda")
    tokens = batch * CONTEXT
    slots = slots or (batch * q_tokens * TOP_K * 5 // 4 + 63) // 64 * 64
    m = HotPoolCacheManager(host, slots, device=dev, max_selected=batch * (q_tokens * TOP_K + 1), copy_impl=copy_impl,
                            decay_gamma=decay_gamma)
    if tail == "three":
        m._fused.tail_programs = None
    elif tail == "merged":
        m._fused.merged_tail_max_entries = 1 << 30
    req_to_token = torch.arange(tokens, device=dev, dtype=torch.int32).view(batch, CONTEXT)
    rpi = torch.arange(batch, device=dev)
    seq = torch.full((batch,), CONTEXT, device=dev)
    sels = selections(batch, q_tokens, hit, gen)
    static = sels[0].clone()
    # this step's token of each request (new_tokens): a location of its own every step, its entry in a device table
    new_locs = [rpi * CONTEXT + CONTEXT - 1 - s for s in range(SEQUENCE)]
    static_new = new_locs[0].clone()
    entries = torch.randint(0, 256, (batch, ENTRY), device=dev, dtype=torch.uint8)

    def step():
        m.begin_step()
        new = None if new_tokens is None else NewTokens(static_new, entries, rpi, insert=new_tokens == "insert")
        return m.resolve(0, static, req_to_token, rpi, seq, new_tokens=new)

    # eager warm-up: compiles kernels and fills the pool to its steady state
    for s, nl in zip(sels, new_locs, strict=True):
        static.copy_(s)
        static_new.copy_(nl)
        step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    m.counters.zero_()
    times = []
    for _ in range(reps):
        for s, nl in zip(sels, new_locs, strict=True):
            static.copy_(s)
            static_new.copy_(nl)
            times.append(replay_us(g))
    c = m.counters[0].cpu()
    hit_rate = 1 - c[Counter.MISSES].item() / max(c[Counter.LOOKUPS].item(), 1)
    misses_per_step = c[Counter.MISSES].item() / len(times)
    us = statistics.median(times)
    torch.cuda.empty_cache()
    return dict(batch=batch, q_tokens=q_tokens, target_hit=hit, copy=copy_impl != "none", new_tokens=new_tokens,
                decay_gamma=decay_gamma, tail=tail, us=us,
                hit_rate=hit_rate, misses_per_step=misses_per_step, slots=slots,
                gbps=misses_per_step * ENTRY / us / 1e3)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--hits", default=",".join(map(str, HIT_RATES)))
    p.add_argument("--q-tokens", default="1,2")
    p.add_argument("--profile", action="store_true", help="per-kernel times of one resolve (torch.profiler), then exit")
    p.add_argument("--new-tokens", default="",
                   help="comma-separated on_demand, insert: time the resolve that writes each request's token back "
                        "(with the copy only), in the same run")
    p.add_argument("--decay-gamma", type=float, default=None,
                   help="with --new-tokens: also time each mode with decayed retention (this gamma)")
    p.add_argument("--pool-slots", default="",
                   help="with --profile: hot-pool sizes (slots) to profile instead of 1.25 selections, pools filled; "
                        "with --new-tokens: one size, the pool of every row")
    p.add_argument("--tail", default="auto",
                   help="with --new-tokens: comma-separated auto, three, merged: the launches after the lookup without "
                        "spare slots (auto: as shipped, merged into one for one or two requests; three; merged), timed "
                        "in the same run")
    args = p.parse_args(argv)
    if args.profile:
        return profile([int(x) for x in args.batches.split(",")],
                       pool_slots=[int(x) for x in args.pool_slots.split(",") if x])
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [int(x) for x in args.batches.split(",")]
    host = HostTotalPool(1, max(batches) * CONTEXT, device="cuda")  # one pinned pool (2.7 GiB at batch 128)
    host.entries.random_(0, 256)
    rows = []
    modes = [x for x in args.new_tokens.split(",") if x]
    if modes:
        bad = [x for x in modes if x not in ("on_demand", "insert")]
        if bad:
            p.error(f"--new-tokens: {', '.join(bad)} (choose from on_demand, insert)")
        tails = [x for x in args.tail.split(",") if x]
        if not tails or any(x not in ("auto", "three", "merged") for x in tails):
            p.error(f"--tail: {args.tail!r} (comma-separated auto, three, merged)")
        slots = int(args.pool_slots) if args.pool_slots else None
        for q in [int(x) for x in args.q_tokens.split(",")]:
            for batch in batches:
                for hit in [float(x) for x in args.hits.split(",")]:
                    for mode in modes:
                        for gamma in (None, args.decay_gamma) if args.decay_gamma is not None else (None,):
                            for tail in tails:
                                rows.append(bench_one(host, batch, q, hit, "auto", gen, new_tokens=mode,
                                                      decay_gamma=gamma, slots=slots, tail=tail))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cache_manager_new_tokens.json"), "w") as f:
            json.dump(dict(info=run_info(), rows=rows), f, indent=1)
        print(f"\n{'q':>2} {'batch':>5} {'target':>6} {'new tokens':>10} {'retention':>10} {'tail':>6} {'hit':>6} "
              f"{'misses':>8} {'us':>8}")
        for r in rows:
            ret = "lru" if r["decay_gamma"] is None else f"decay {r['decay_gamma']:g}"
            print(f"{r['q_tokens']:>2} {r['batch']:>5} {r['target_hit']:>6} {r['new_tokens']:>10} {ret:>10} "
                  f"{r['tail']:>6} {r['hit_rate']:>6.3f} {r['misses_per_step']:>8.0f} {r['us']:>8.1f}")
        return 0
    for q in [int(x) for x in args.q_tokens.split(",")]:
        for batch in batches:
            for hit in [float(x) for x in args.hits.split(",")]:
                for impl in ("none", "auto"):
                    rows.append(bench_one(host, batch, q, hit, impl, gen))
    info = run_info()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cache_manager.json"), "w") as f:
        json.dump(dict(info=info, rows=rows), f, indent=1)
    plot(rows, os.path.join(args.out, "cache_manager.png"))
    print(f"\n{'q':>2} {'batch':>5} {'target':>6} {'hit':>6} {'misses':>8} {'no-copy us':>10} {'with-copy us':>12} "
          f"{'GB/s':>6}")
    for r in rows:
        if r["copy"]:
            nc = next(x for x in rows if not x["copy"] and x["batch"] == r["batch"] and x["q_tokens"] == r["q_tokens"]
                      and x["target_hit"] == r["target_hit"])
            print(f"{r['q_tokens']:>2} {r['batch']:>5} {r['target_hit']:>6} {r['hit_rate']:>6.3f} "
                  f"{r['misses_per_step']:>8.0f} {nc['us']:>10.1f} {r['us']:>12.1f} {r['gbps']:>6.1f}")


def profile(batches, hit=0.95, pool_slots=()):
    """Per-kernel device time of the resolve of one layer, eager (the graph replays the same kernels), and the graph
    replay's time. `pool_slots`: profile these pool sizes (filled first, ages spread over the filling steps) instead
    of 1.25 selections: the age histogram and the victim scan read every slot."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = max(max(batches) * CONTEXT, 2 * max(pool_slots, default=0))
    host = HostTotalPool(1, tokens, device="cuda")
    for batch in batches:
        context = tokens // batch
        n = batch * TOP_K
        r2t = torch.arange(batch * context, device="cuda", dtype=torch.int32).view(batch, context)
        rpi, seq = torch.arange(batch, device="cuda"), torch.full((batch,), context, device="cuda")
        sels = selections(batch, 1, hit, gen, context)
        for slots in pool_slots or [(n * 5 // 4 + 63) // 64 * 64]:
            m = HotPoolCacheManager(host, slots, device="cuda", max_selected=n, copy_impl="none")
            perm = torch.randperm(batch * context, device="cuda", generator=gen)
            for c in range(0, slots if pool_slots else 0, n):  # fill the pool
                m.begin_step()
                m.reserve(0, perm[c:min(c + n, slots)])
            for s in sels[:16]:
                m.begin_step()
                m.resolve(0, s, r2t, rpi, seq)
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for s in sels[16:32]:
                    m.begin_step()
                    m.resolve(0, s, r2t, rpi, seq)
                torch.cuda.synchronize()
            static = sels[0].clone()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                m.begin_step()
                m.resolve(0, static, r2t, rpi, seq)
            times = []
            for s in sels[32:48]:
                static.copy_(s)
                times.append(replay_us(g))
            print(f"\nbatch {batch}, hit {hit}, {slots:,} slots (resolve only): graph replay "
                  f"{statistics.median(times):.1f} us; device time per resolve, by kernel")
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
                print(f"  {e.device_time_total / 16:8.1f} us  x{e.count / 16:4.1f}  {e.key[:90]}")
            del m, g
            torch.cuda.empty_cache()


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for copy in (False, True):
        for hit in sorted({r["target_hit"] for r in rows}):
            pts = sorted((r["batch"], r["us"]) for r in rows
                         if r["copy"] == copy and r["target_hit"] == hit and r["q_tokens"] == 1)
            if pts:
                ax.plot(*zip(*pts, strict=True), "-o" if copy else ":x", markersize=3,
                        label=f"hit {hit} {'resolve + copy' if copy else 'resolve only'}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (top-k 2048, q_tokens 1)")
    ax.set_ylabel("us per layer (CUDA graph replay)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
