"""`ess demo`: decode a batch of the embedded DSA model twice, in lockstep, and check that ESS changes no output.

Run A keeps every latent entry in device memory. Run B keeps them in the host total pool with per-layer hot pools of
`ratio` x the tokens held, warmed up from the prefill's last query windows. After every layer of every step the
attention outputs of the two runs must be bit-identical (torch.equal), and so must the hidden states. Per-layer hit
rates, entries and bytes moved per direction, and the time of each run are printed at the end.

With `--metrics-port N` the ESS run's counters are exported as the `sglang:ess_*` Prometheus series (see
docs/observability.md) on http://127.0.0.1:N/metrics while the demo runs, and for `--metrics-hold` seconds after;
a final `ess metrics: hit_rate=... lookups_total=...` line gives the totals the series must reproduce.
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
             on_step=None, on_manager=None) -> DemoResult:
    """Decode `steps` steps of `batch` requests with and without ESS, in lockstep; see the module docstring.

    on_manager(manager) is called once the cache manager exists (before warm-up); on_step(step, manager) after each
    decode step (the device has finished the step). `ess demo --metrics-port` uses both to export metrics.
    """
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
    if on_manager is not None:
        on_manager(manager)
    table = RequestTable(batch, context_len + steps, device=dev)
    ref = DemoDecoder(spec, weights, DeviceCacheBackend(layers, plan.host_tokens, dev), plan.host_tokens, dev,
                      attention)
    ess = DemoDecoder(spec, weights, EssBackend(manager, cfg.new_tokens), plan.host_tokens, dev, attention)

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
    m = p.add_argument_group("metrics (Prometheus)")
    m.add_argument("--metrics-port", type=int, default=None, metavar="N",
                   help="serve the sglang:ess_* series on http://HOST:N/metrics while the demo runs (0: any free port)")
    m.add_argument("--metrics-host", default="127.0.0.1", help="address to serve /metrics on (default %(default)s)")
    m.add_argument("--metrics-hold", type=float, default=0.0, metavar="SECONDS",
                   help="keep serving /metrics this long after decoding, so a scraper can read the final values")
    m.add_argument("--metrics-interval", type=int, default=None, metavar="STEPS",
                   help="read the device counters back every this many steps (default: the config's, 16)")
    m.add_argument("--metrics-per-layer", action="store_true", help="also export per-layer series (label layer)")
    m.add_argument("--model-name", default="ess-demo", help="model_name label of the exported series")


class TransferTimer:
    """Times the cache manager's PCIe copies for the demo's `sglang:ess_transfer_seconds` histogram.

    Installed as the manager's `on_transfer` observer, which the manager calls with the direction of every H2D
    (misses, warm-up) and D2H (new tokens) copy it makes through FlashTrans; device-to-device copies are not reported.
    On CPU each copy is timed with the wall clock (it is synchronous); on CUDA with a pair of events, read by
    `drain()` once they have completed. What is measured is one call, i.e. one layer's gather or scatter, including
    the Triton launch. (The fused GPU resolve copies misses inside its own kernel: those are not timed here.)
    """

    def __init__(self, manager, metrics):
        self._manager, self._metrics = manager, metrics
        self._cuda = manager.device.type == "cuda"
        self._pending: list = []

    def __call__(self, direction: str, run) -> None:
        if self._cuda:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            self._pending.append((direction, start, end))
        else:
            t = time.perf_counter()
            run()
            self._metrics.observe_transfer(direction, time.perf_counter() - t)

    def drain(self) -> None:
        """Report the timed CUDA calls whose events have completed."""
        left = []
        for direction, start, end in self._pending:
            if end.query():
                self._metrics.observe_transfer(direction, start.elapsed_time(end) / 1e3)
            else:
                left.append((direction, start, end))
        self._pending = left

    def install(self) -> None:
        self._manager.on_transfer = self

    def uninstall(self) -> None:
        if self._manager.on_transfer is self:
            self._manager.on_transfer = None


def run(args: argparse.Namespace) -> int:
    from ess_sglang.config import EssConfigError

    demo_kwargs = dict(batch=args.batch, context_len=args.context_len, steps=args.steps, ratio=args.ratio,
                       layers=args.layers, top_k=args.top_k, seed=args.seed, device=args.device,
                       attention=args.attention, progress=not args.no_progress)
    if getattr(args, "metrics_port", None) is not None:
        return _run_with_metrics(args, demo_kwargs)
    try:
        r = run_demo(**demo_kwargs)
    except EssConfigError as e:
        print(f"ess demo: {e}")
        return 2
    print_result(r)
    return 0 if r.bit_identical else 1


def _run_with_metrics(args: argparse.Namespace, demo_kwargs: dict) -> int:
    """`ess demo --metrics-port N`: the demo, with EssMetrics publishing to /metrics while it runs."""
    from prometheus_client import CollectorRegistry

    from ess_sglang.config import EssConfigError, MetricsConfig
    from ess_sglang.metrics import EssMetrics, serve_metrics, sglang_labels

    cfg = MetricsConfig(per_layer=args.metrics_per_layer,
                        **({"readout_interval_steps": args.metrics_interval} if args.metrics_interval else {}))
    registry = CollectorRegistry()  # not the global one: only the ESS series, and in-process reruns don't collide
    server = serve_metrics(args.metrics_port, args.metrics_host, registry)  # text format: keeps the colons
    port = server.server_address[1]
    print(f"ess demo: serving metrics on http://{args.metrics_host}:{port}/metrics", flush=True)
    state: dict = {}

    def on_manager(manager):
        m = EssMetrics(manager, cfg, labels=sglang_labels(args.model_name), registry=registry)
        timer = TransferTimer(manager, m)
        timer.install()
        state.update(metrics=m, timer=timer)

    def on_step(step, manager):
        state["timer"].drain()
        state["metrics"].on_step()

    try:
        try:
            r = run_demo(**demo_kwargs, on_step=on_step, on_manager=on_manager)
        except EssConfigError as e:
            print(f"ess demo: {e}")
            return 2
        finally:
            if "timer" in state:
                state["timer"].uninstall()
        state["timer"].drain()
        m = state["metrics"]
        m.flush()
        print_result(r)
        print_metrics_line(r, m)
        if args.metrics_hold > 0:
            print(f"ess demo: holding /metrics for {args.metrics_hold:g} s", flush=True)
            time.sleep(args.metrics_hold)
        return 0 if r.bit_identical else 1
    finally:
        server.shutdown()
        server.server_close()


def print_metrics_line(r: DemoResult, m=None, entry_bytes: int = 656) -> None:
    """One machine-readable line with the numbers the exported series must reproduce (the e2e test parses it)."""
    tot = {k: sum(c[k] for c in r.counters) for k in r.counters[0]}
    published = m.published_totals() if m is not None else {}
    same = all(published.get(k) == v for k, v in tot.items()) if published else False
    print(f"ess metrics: hit_rate={r.hit_rate!r} lookups_total={tot['LOOKUPS']} hits_total={tot['HITS']} "
          f"misses_total={tot['MISSES']} h2d_bytes_total={tot['H2D_ENTRIES'] * entry_bytes} "
          f"d2h_bytes_total={tot['D2H_ENTRIES'] * entry_bytes} steps={r.steps} "
          f"published={'all' if same else 'incomplete'}", flush=True)
