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
import math
import re
import socket
import time
from dataclasses import dataclass, field

DEFAULTS = dict(batch=8, context_len=8192, steps=64, ratio=0.2, layers=4, top_k=1024, seed=0)
MAX_SEED = 2**32 - 1


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
    top_k: int | None = None

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

    # Plan the pools from an ESS config before allocating anything: a bad size fails here. The host pool holds
    # `batch` requests of the longest prompt plus their decoded tokens (the prompts drawn below are up to 1/16
    # shorter), so that any batch, 1 included, fits as EssConfig.plan requires of a serving instance.
    g = torch.Generator().manual_seed(seed + 1)
    lengths = [context_len - int(torch.randint(0, max(context_len // 16, 1), (1,), generator=g)) for _ in range(batch)]
    host_tokens = host_pool_tokens(batch, context_len, steps)
    cfg = EssConfig.from_mapping({"sparse_memory_ratio": float(ratio), "top_k": top_k})
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
                      seconds=seconds, device=str(dev), attention=attention, top_k=top_k)


def print_result(r: DemoResult, entry_bytes: int = 656) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"ESS demo: {r.steps} decode steps on {r.device} ({r.attention} attention), hot pool "
                    f"{r.hot_slots_per_layer} slots/layer for {r.host_tokens} tokens"
                    + (f", top-k {r.top_k}" if r.top_k is not None else ""))
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


def _device(text: str) -> str:
    """argparse type of --device: cpu, cuda or cuda:N (whether a GPU is there is checked in `run`)."""
    if text == "cpu" or re.fullmatch(r"cuda(:\d+)?", text):
        return text
    raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ess_sglang.cli import float_in, int_at_least, int_in

    d = DEFAULTS
    p.add_argument("--batch", type=int_at_least(1), default=d["batch"], metavar="N", help="requests decoded together")
    p.add_argument("--context-len", type=int_at_least(2), default=d["context_len"], metavar="TOKENS",
                   help="prompt tokens of the longest request (the others are up to 1/16 shorter)")
    p.add_argument("--steps", type=int_at_least(1), default=d["steps"], metavar="N", help="decode steps")
    p.add_argument("--ratio", type=float_in(0, 1, low_open=True), default=d["ratio"],
                   help="hot slots per layer / tokens the host pool holds, in (0, 1]")
    p.add_argument("--layers", type=int_at_least(1), default=d["layers"], metavar="N", help="decoder layers")
    p.add_argument("--top-k", type=int_at_least(1), default=None, metavar="K",
                   help=f"entries the indexer selects per request and layer, below --context-len (default: "
                        f"{d['top_k']}, halved until it is below --context-len and one step's selections fit the "
                        f"hot pool)")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=d["seed"], help="seed of the weights and prompts")
    p.add_argument("--device", type=_device, default=None,
                   help="cpu, cuda or cuda:N (default: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--attention", choices=["reference", "flashmla"], default=None,
                   help="attention kernel; flashmla needs a GPU and the flash_mla package (default: flashmla on "
                        "cuda, the torch reference on cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    m = p.add_argument_group("metrics (Prometheus)")
    m.add_argument("--metrics-port", type=int_in(0, 65535), default=None, metavar="N",
                   help="serve the sglang:ess_* series on http://HOST:N/metrics while the demo runs (0: any free "
                        "port; default: no metrics server)")
    m.add_argument("--metrics-host", default="127.0.0.1", help="address to serve /metrics on")
    m.add_argument("--metrics-hold", type=float_in(0), default=0.0, metavar="SECONDS",
                   help="keep serving /metrics this long after decoding, so a scraper can read the final values")
    m.add_argument("--metrics-interval", type=int_at_least(1), default=None, metavar="STEPS",
                   help="read the device counters back every this many steps (default: the config's, 16)")
    m.add_argument("--metrics-per-layer", action="store_true", help="also export per-layer series (label layer)")
    m.add_argument("--model-name", default="ess-demo", help="model_name label of the exported series")


_METRICS_ONLY = ("metrics_host", "metrics_hold", "metrics_interval", "metrics_per_layer", "model_name")


def check_args(args: argparse.Namespace) -> None:
    """Refuse impossible combinations of `ess demo` flags (FlagError names the flag) before anything is allocated.

    Ranges of single flags are argparse's (see `add_arguments`); this checks what depends on several flags or on
    the machine: the device, the attention kernel, the top-k against the context, the hot pool against one step.
    """
    import importlib.util

    from ess_sglang.cli import FlagError

    if args.top_k is None:
        args.top_k = default_top_k(args.batch, args.context_len, args.steps, args.ratio)
    if args.top_k >= args.context_len:
        raise FlagError("--top-k", f"{args.top_k} selects every one of --context-len {args.context_len} tokens, so "
                                   f"nothing could be offloaded; lower --top-k below {args.context_len} or raise "
                                   f"--context-len")
    device = args.device
    if device is not None and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise FlagError("--device", f"{device}: torch sees no CUDA GPU on this machine; use --device cpu")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise FlagError("--device", f"{device}: this machine has {torch.cuda.device_count()} GPU(s); use "
                                        f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if args.attention == "flashmla":
        if device == "cpu" or (device is None and not _cuda_available()):
            raise FlagError("--attention", "flashmla runs on a GPU only; use --attention reference on cpu")
        if importlib.util.find_spec("flash_mla") is None:
            raise FlagError("--attention", "flashmla needs the flash_mla package, which is not installed; install "
                                           "FlashMLA or use --attention reference")
    if args.metrics_port is None:
        given = [f"--{k.replace('_', '-')}" for k in _METRICS_ONLY if getattr(args, k, None) != _DEFAULT_METRICS[k]]
        if given:
            raise FlagError(given[0], "has no effect without --metrics-port; add --metrics-port N (0: any free port)")
    needed, slots = hot_pool_sizes(args.batch, args.context_len, args.steps, args.ratio, args.top_k)
    if slots < needed:
        host = host_pool_tokens(args.batch, args.context_len, args.steps)
        raise FlagError("--ratio", f"{args.ratio:g} gives a hot pool of {slots:,} slots per layer, but one decode "
                                   f"step selects up to --batch {args.batch} x (--top-k {args.top_k} + 1 new token) = "
                                   f"{needed:,}; raise --ratio to at least {math.ceil(needed / host * 1000) / 1000:.3f}"
                                   f" or lower --batch or --top-k")
    check_memory(args)


_DEFAULT_METRICS = dict(metrics_host="127.0.0.1", metrics_hold=0.0, metrics_interval=None, metrics_per_layer=False,
                        model_name="ess-demo")


def default_top_k(batch: int, context_len: int, steps: int, ratio: float) -> int:
    """`ess demo`'s top-k when --top-k is not given: DEFAULTS["top_k"], halved (down to 1) until it is below the
    context and one decode step's selections fit the hot pool `ratio` gives (a short --context-len then still runs)."""
    def fits(top_k: int) -> bool:
        needed, slots = hot_pool_sizes(batch, context_len, steps, ratio, top_k)
        return top_k < context_len and needed <= slots

    top_k = DEFAULTS["top_k"]
    while top_k > 1 and not fits(top_k):
        top_k //= 2
    return top_k


def memory_bytes(batch: int, context_len: int, steps: int, layers: int) -> int:
    """A lower bound of the memory the demo allocates: the host pool and the all-in-device reference store (one
    656-B latent entry per layer and token location each), and the prompts' hidden states (float32, 256 wide)."""
    from ess_sglang.formats import LATENT_ENTRY_BYTES

    return 2 * layers * host_pool_tokens(batch, context_len, steps) * LATENT_ENTRY_BYTES + 2 * batch * context_len \
        * 256 * 4


def available_memory_bytes(device: str) -> int | None:
    """Free memory where the demo allocates: the GPU's (torch.cuda.mem_get_info) on cuda, else the host's
    MemAvailable (/proc/meminfo); None where it cannot be read."""
    if device.startswith("cuda"):
        import torch

        try:
            return int(torch.cuda.mem_get_info(torch.device(device))[0])
        except Exception:  # no GPU to ask: nothing to compare against
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _largest_size_flag(args: argparse.Namespace) -> str:
    """The size flag furthest above its default (the one to lower first)."""
    d = DEFAULTS
    share = {"--batch": args.batch / d["batch"], "--context-len": args.context_len / d["context_len"],
             "--layers": args.layers / d["layers"], "--steps": args.steps / d["steps"]}
    return max(share, key=share.get)


def _memory_message(args: argparse.Namespace, need: int, free: int | None, where: str) -> str:
    have = f"{free / 2**30:,.1f} GiB is free" if free is not None else "the allocation failed"
    return (f"the demo needs at least {need / 2**30:,.1f} GiB of {where} memory (--layers {args.layers} x --batch "
            f"{args.batch} x (--context-len {args.context_len} + --steps {args.steps}) latent entries, twice), but "
            f"{have}; lower --batch, --context-len, --layers or --steps")


def check_memory(args: argparse.Namespace) -> None:
    """Refuse sizes whose pools cannot fit the free memory (FlagError naming the size flag furthest above its
    default), before anything is allocated."""
    from ess_sglang.cli import FlagError

    device = args.device or ("cuda" if _cuda_available() else "cpu")
    need = memory_bytes(args.batch, args.context_len, args.steps, args.layers)
    free = available_memory_bytes(device)
    if free is not None and need > free:
        where = "GPU" if device.startswith("cuda") else "host"
        raise FlagError(_largest_size_flag(args), _memory_message(args, need, free, where))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def host_pool_tokens(batch: int, context_len: int, steps: int) -> int:
    """Token locations per layer of the demo's host pool: `batch` requests at their longest (prompt + steps)."""
    return batch * (context_len + steps)


def hot_pool_sizes(batch: int, context_len: int, steps: int, ratio: float, top_k: int) -> tuple[int, int]:
    """(slots one decode step needs, slots `ratio` gives), as `EssConfig.plan` computes them for the demo."""
    from ess_sglang.config import EssConfig, round_up

    page = EssConfig.model_fields["page_size"].default
    needed = batch * (min(top_k, context_len + steps) + 1)
    slots = round_up(math.ceil(ratio * host_pool_tokens(batch, context_len, steps) - 1e-9), page)
    return needed, slots


# EssConfig / Deployment keys as `ess demo` flags, for errors raised by the config's own checks.
_CONFIG_FLAGS = [("ess_config.sparse_memory_ratio", "--ratio"), ("ess_config.top_k", "--top-k"),
                 ("deployment.max_running_requests", "--batch"), ("deployment.num_layers", "--layers"),
                 ("deployment.max_context_len", "--context-len"), ("deployment.host_tokens", "--context-len"),
                 ("max_running_requests", "--batch"), ("top_k", "--top-k"), ("max_context_len", "--context-len")]


def config_error_as_flags(exc) -> str:
    """One line from an EssConfigError, with the config keys it names replaced by the demo's flags."""
    text = "; ".join(exc.problems)
    for key, flag in _CONFIG_FLAGS:
        text = re.sub(rf"(?<![\w.-]){re.escape(key)}\b", flag, text)
    return text.replace(" (default 0.2)", "")


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
    from ess_sglang.cli import FlagError
    from ess_sglang.config import EssConfigError
    from ess_sglang.host_pool import PinnedMemoryError

    check_args(args)
    demo_kwargs = dict(batch=args.batch, context_len=args.context_len, steps=args.steps, ratio=args.ratio,
                       layers=args.layers, top_k=args.top_k, seed=args.seed, device=args.device,
                       attention=args.attention, progress=not args.no_progress)
    try:
        if getattr(args, "metrics_port", None) is not None:
            return _run_with_metrics(args, demo_kwargs)
        r = run_demo(**demo_kwargs)
    except EssConfigError as e:
        text = config_error_as_flags(e)
        flag, sep, rest = text.partition(": ")
        raise (FlagError(flag, rest) if sep and flag.startswith("--") else FlagError(None, text)) from None
    except (MemoryError, PinnedMemoryError, _out_of_memory_error()) as e:
        # more than check_memory's lower bound, or pinned memory above the locked-memory limit (ulimit -l)
        need = memory_bytes(args.batch, args.context_len, args.steps, args.layers)
        detail = " (pinned host memory: see ulimit -l)" if isinstance(e, PinnedMemoryError) else ""
        raise FlagError(_largest_size_flag(args), _memory_message(args, need, None, "host or GPU") + detail) \
            from None
    print_result(r)
    return 0 if r.bit_identical else 1


def _out_of_memory_error() -> type[BaseException]:
    import torch

    return getattr(torch, "OutOfMemoryError", MemoryError)


def _run_with_metrics(args: argparse.Namespace, demo_kwargs: dict) -> int:
    """`ess demo --metrics-port N`: the demo, with EssMetrics publishing to /metrics while it runs."""
    from prometheus_client import CollectorRegistry

    from ess_sglang.config import MetricsConfig
    from ess_sglang.metrics import EssMetrics, serve_metrics, sglang_labels

    cfg = MetricsConfig(per_layer=args.metrics_per_layer,
                        **({"readout_interval_steps": args.metrics_interval} if args.metrics_interval else {}))
    registry = CollectorRegistry()  # not the global one: only the ESS series, and in-process reruns don't collide
    try:
        server = serve_metrics(args.metrics_port, args.metrics_host, registry)  # text format: keeps the colons
    except socket.gaierror as exc:
        from ess_sglang.cli import FlagError

        raise FlagError("--metrics-host", f"{args.metrics_host}: not an address of this machine "
                                          f"({exc.strerror or exc}); use e.g. 127.0.0.1 or 0.0.0.0") from None
    except OSError as exc:
        from ess_sglang.cli import FlagError

        raise FlagError("--metrics-port", f"cannot serve on {args.metrics_host}:{args.metrics_port} "
                                          f"({exc.strerror or exc}); choose another port, or 0 for any free one, "
                                          f"or another --metrics-host") from None
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
