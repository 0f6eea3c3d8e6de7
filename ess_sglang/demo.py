"""`ess demo`: decode a batch of the embedded DSA model twice, in lockstep, and check that ESS changes no output.

Run A keeps every latent entry in device memory. Run B keeps them in the host total pool with per-layer hot pools of
`ratio` x the tokens held, warmed up from the prefill's last query windows. After every layer of every step the
attention outputs of the two runs must be bit-identical (torch.equal), and so must the hidden states. Per-layer hit
rates, entries and bytes moved per direction, and the time of each run are printed at the end.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

DEFAULTS = dict(batch=8, context_len=8192, steps=64, ratio=0.2, layers=4, top_k=1024, seed=0)


@dataclass
class DemoResult:
    steps: int
    identical_steps: int
    first_mismatch: tuple[int, int] | None  # (step, layer)
    hit_rate_per_layer: list[float]
    counters: list[dict[str, int]]
    hot_slots_per_layer: int
    host_tokens: int
    seconds: dict[str, float] = field(default_factory=dict)
    device: str = "cpu"
    attention: str = "reference"

    @property
    def bit_identical(self) -> bool:
        return self.first_mismatch is None and self.identical_steps == self.steps

    @property
    def hit_rate(self) -> float:
        look = sum(c["LOOKUPS"] for c in self.counters)
        miss = sum(c["MISSES"] for c in self.counters)
        return 1.0 - miss / look if look else 1.0


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_demo(batch: int = 8, context_len: int = 8192, steps: int = 64, ratio: float = 0.2, layers: int = 4,
             top_k: int = 1024, seed: int = 0, device: str | None = None, attention: str | None = None,
             num_heads: int | None = None, progress: bool = True, check_every_step: bool = True,
             on_step=None) -> DemoResult:
    import torch

    from ess_sglang.cache_manager import Counter, HotPoolCacheManager
    from ess_sglang.config import Deployment, EssConfig
    from ess_sglang.host_pool import HostTotalPool
    from ess_sglang.reference.model import (
        DemoDecoder,
        DemoModelSpec,
        DemoWeights,
        DeviceCacheBackend,
        EssBackend,
        context_hidden,
        drift,
    )
    from ess_sglang.request_table import RequestTable
    from ess_sglang.warmup import warmup_positions

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if attention is None:
        attention = "flashmla" if dev.type == "cuda" else "reference"
    heads = num_heads or (128 if attention == "flashmla" else 16)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    spec = DemoModelSpec(num_layers=layers, num_heads=heads, top_k=top_k, seed=seed)

    # Plan the pools from an ESS config before allocating anything: a bad size fails here.
    g = torch.Generator().manual_seed(seed + 1)
    lengths = [context_len - int(torch.randint(0, max(context_len // 16, 1), (1,), generator=g)) for _ in range(batch)]
    host_tokens = sum(lengths) + batch * steps
    cfg = EssConfig(sparse_memory_ratio=ratio, top_k=top_k)
    plan = cfg.plan(Deployment(num_layers=layers, max_running_requests=batch, max_context_len=context_len + steps,
                               host_tokens=host_tokens))

    weights = DemoWeights(spec, dev, dtype)
    host = HostTotalPool(layers, plan.host_tokens, device=dev, scrub_on_free=cfg.scrub_on_free)
    manager = HotPoolCacheManager(host, plan.hot_slots_per_layer, device=dev, max_selected=batch * top_k)
    table = RequestTable(batch, context_len + steps, device=dev)
    ref = DemoDecoder(spec, weights, DeviceCacheBackend(layers, plan.host_tokens, dev), plan.host_tokens, dev,
                      attention)
    ess = DemoDecoder(spec, weights, EssBackend(manager), plan.host_tokens, dev, attention)

    hidden = context_hidden(spec, lengths, seed + 2, dev, dtype)
    rows = []
    for b, n in enumerate(lengths):
        row = table.alloc_row()
        locs = host.alloc(n)
        table.set(row, 0, locs)
        for dec in (ref, ess):
            dec.load_context(hidden[b], locs.to(dev))
        rows.append(row)
    req_pool_indices = torch.tensor(rows, device=dev)
    seq_lens = torch.tensor(lengths, device=dev)

    # Warm-up: per layer and request, the union of the top-k sets of the prefill's last query windows.
    t0 = time.perf_counter()
    budget = plan.hot_slots_per_layer // batch
    for layer in range(layers):
        for b, n in enumerate(lengths):
            win = ess.window_topk(layer, hidden[b][-cfg.warmup_windows:], table.req_to_token, rows[b], n)
            pos = warmup_positions(n, budget, win if cfg.warmup_windows else None)
            manager.warm_up(layer, table.req_to_token[rows[b], pos.to(dev)])
    _sync(dev)
    seconds = {"warm_up": time.perf_counter() - t0, "all_in_device": 0.0, "ess": 0.0}

    x_ref = torch.stack([h[-1] for h in hidden])
    x_ess = x_ref.clone()
    identical, mismatch = 0, None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc="decode", unit="step")
    for s in range(steps):
        new_locs = host.alloc(batch).to(dev)
        for b in range(batch):
            table.req_to_token[rows[b], seq_lens[b]] = new_locs[b].to(torch.int32)
        seq_lens = seq_lens + 1
        t = time.perf_counter()
        y_ref, outs_ref = ref.step(x_ref, new_locs, table.req_to_token, req_pool_indices, seq_lens)
        _sync(dev)
        seconds["all_in_device"] += time.perf_counter() - t
        t = time.perf_counter()
        manager.begin_step()
        y_ess, outs_ess = ess.step(x_ess, new_locs, table.req_to_token, req_pool_indices, seq_lens)
        _sync(dev)
        seconds["ess"] += time.perf_counter() - t
        if check_every_step and mismatch is None:
            bad = [i for i, (a, c) in enumerate(zip(outs_ref, outs_ess, strict=True)) if not torch.equal(a, c)]
            if bad or not torch.equal(y_ref, y_ess):
                mismatch = (s, bad[0] if bad else layers)
            else:
                identical += 1
        if on_step is not None:
            on_step(s, manager)
        x_ref, x_ess = drift(spec, x_ref, y_ref, s, seed), drift(spec, x_ess, y_ess, s, seed)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    counts = manager.counters.cpu()
    per_layer = [{c.name: int(counts[layer, c]) for c in Counter} for layer in range(layers)]
    rates = [1.0 - c["MISSES"] / c["LOOKUPS"] if c["LOOKUPS"] else 1.0 for c in per_layer]
    return DemoResult(steps=steps, identical_steps=identical, first_mismatch=mismatch, hit_rate_per_layer=rates,
                      counters=per_layer, hot_slots_per_layer=plan.hot_slots_per_layer, host_tokens=plan.host_tokens,
                      seconds=seconds, device=str(dev), attention=attention)


def print_result(r: DemoResult, entry_bytes: int = 656) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"ESS demo: {r.steps} decode steps on {r.device} ({r.attention} attention), hot pool "
                    f"{r.hot_slots_per_layer} slots/layer for {r.host_tokens} tokens")
    for col in ("layer", "hit rate", "lookups", "misses", "warm-up entries", "H2D MB", "D2H MB", "evictions"):
        t.add_column(col, justify="right")
    for i, c in enumerate(r.counters):
        t.add_row(str(i), f"{r.hit_rate_per_layer[i]:.4f}", str(c["LOOKUPS"]), str(c["MISSES"]),
                  str(c["WARMUP_ENTRIES"]), f"{c['H2D_ENTRIES'] * entry_bytes / 1e6:.2f}",
                  f"{c['D2H_ENTRIES'] * entry_bytes / 1e6:.2f}", str(c["EVICTIONS"]))
    console.print(t)
    s = r.seconds
    console.print(f"time: all-in-device {s['all_in_device']:.2f} s, ESS {s['ess']:.2f} s "
                  f"(ratio {s['ess'] / max(s['all_in_device'], 1e-9):.2f}), warm-up {s['warm_up']:.2f} s")
    if r.bit_identical:
        console.print(f"[bold green]bit-identical[/]: all {r.steps} steps, every layer's attention output and hidden "
                      f"state equal; overall hit rate {r.hit_rate:.4f}")
    else:
        console.print(f"[bold red]MISMATCH[/] at step {r.first_mismatch[0]}, layer {r.first_mismatch[1]} "
                      f"({r.identical_steps} identical steps before it)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--batch", type=int, default=d["batch"], help="requests decoded together (default %(default)s)")
    p.add_argument("--context-len", type=int, default=d["context_len"], help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=d["steps"], help="decode steps")
    p.add_argument("--ratio", type=float, default=d["ratio"], help="hot slots per layer / tokens held (default 0.2)")
    p.add_argument("--layers", type=int, default=d["layers"])
    p.add_argument("--top-k", type=int, default=d["top_k"])
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--attention", choices=["reference", "flashmla"], default=None,
                   help="attention kernel (default: flashmla on cuda, the torch reference on cpu)")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from ess_sglang.config import EssConfigError

    try:
        r = run_demo(batch=args.batch, context_len=args.context_len, steps=args.steps, ratio=args.ratio,
                     layers=args.layers, top_k=args.top_k, seed=args.seed, device=args.device,
                     attention=args.attention, progress=not args.no_progress)
    except EssConfigError as e:
        print(f"ess demo: {e}")
        return 2
    print_result(r)
    return 0 if r.bit_identical else 1
