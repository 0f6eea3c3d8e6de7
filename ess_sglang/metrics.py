"""Prometheus metrics for ESS: device counters read back asynchronously, published as `sglang:ess_*` series.

The cache manager counts events on the device (`HotPoolCacheManager.counters`, int64 [layers, Counter]) inside the
captured decode step. Nothing here runs inside the graph. `EssMetrics.on_step()` is called once per decode step,
after the graph replay, on the host:

* on most steps it does nothing, or (while a readout is in flight) one `cudaEventQuery`;
* every `readout_interval_steps` steps it enqueues a readout on the current stream: the per-layer count of used hot
  slots (one small reduction), then `pinned.copy_(counters, non_blocking=True)` and a CUDA event record. No
  `.item()`, `.cpu()` or synchronisation: the host never waits for the device;
* on a later call (or on `flush()`), once the event has completed, the snapshot is compared with the previous one and
  the differences are added to prometheus_client counters; gauges are set.

On a CPU device the copy is synchronous and the snapshot is published at once. Counters are monotonic on the device,
so publishing deltas of snapshots loses nothing: a readout that is late only publishes later. A counter that went
backwards (the manager was reset) is treated as restarted from zero, like a Prometheus counter reset.

Series follow SGLang's conventions (`sglang/srt/metrics/collector.py`, SGLang 0.5.23): names `sglang:*`, counters
ending in `_total`, gauges in multiprocess mode "mostrecent" (SGLang serves `/metrics` from several processes under
`--enable-metrics`), durations as `_seconds` histograms, and the scheduler's label set (see `sglang_labels`).
Per-layer series (label `layer`) exist only with `MetricsConfig.per_layer`; the series names do not change, so
`sum without (layer) (...)` works in both cases. docs/observability.md lists every series.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from prometheus_client import REGISTRY, CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter

from ess_sglang.cache_manager import Counter
from ess_sglang.config import MetricsConfig

PREFIX = "sglang:ess_"
DEFAULT_LINK_GBPS = 55.3  # bulk pinned copy, H2D and D2H, measured on the project's H200 (PCIe Gen5 x16)
DIRECTIONS = ("h2d", "d2h")
# SGLang 0.5.23's scheduler labels (scheduler_metrics_mixin.py / scheduler.py `init_metrics`): model_name,
# engine_type, tp_rank, pp_rank, moe_ep_rank, then dp_rank when attention DP is on, then --extra-metric-labels.
SGLANG_LABEL_NAMES = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
TRANSFER_SECONDS_BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25,
                            0.5, 1.0)


def sglang_labels(model_name: str, *, engine_type: str = "decode", tp_rank: int = 0, pp_rank: int = 0,
                  moe_ep_rank: int = 0, dp_rank: int | None = None,
                  extra: Mapping[str, object] | None = None) -> dict[str, str]:
    """The label set SGLang's scheduler puts on its own series, so ESS series join with them in PromQL.

    The plugin should pass the scheduler's own `metrics_collector.labels` instead when it can reach them.
    """
    labels = {"model_name": model_name, "engine_type": engine_type, "tp_rank": tp_rank, "pp_rank": pp_rank,
              "moe_ep_rank": moe_ep_rank}
    if dp_rank is not None:
        labels["dp_rank"] = dp_rank
    if extra:
        labels.update(extra)
    return {k: str(v) for k, v in labels.items()}


@dataclass(frozen=True)
class CounterSeries:
    """One prometheus counter fed from one column of the device counters."""

    name: str  # full series name, ends in _total
    column: str  # cache_manager.Counter member; when the member does not exist (yet) the series stays at 0
    doc: str
    bytes: bool = False  # multiply entries by manager.entry_bytes
    direction: str | None = None  # value of the `direction` label, for the transfer series


COUNTER_SERIES: tuple[CounterSeries, ...] = (
    CounterSeries(PREFIX + "lookups_total", "LOOKUPS",
                  "Selected latent entries looked up in the hot pool (valid top-k positions, after masking)."),
    CounterSeries(PREFIX + "hits_total", "HITS", "Selected latent entries that were already resident in the hot pool."),
    CounterSeries(PREFIX + "misses_total", "MISSES",
                  "Distinct selected latent entries fetched from the host pool (hit rate = 1 - misses / lookups)."),
    CounterSeries(PREFIX + "transfer_bytes_total", "H2D_ENTRIES",
                  "Bytes moved over PCIe by FlashTrans, by direction (h2d: misses and warm-up, d2h: new tokens).",
                  bytes=True, direction="h2d"),
    CounterSeries(PREFIX + "transfer_bytes_total", "D2H_ENTRIES", "", bytes=True, direction="d2h"),
    CounterSeries(PREFIX + "warmup_entries_total", "WARMUP_ENTRIES",
                  "Latent entries (one token in one layer) loaded into hot pools by LRU warm-up after prefill."),
    CounterSeries(PREFIX + "bad_indices_total", "BAD_INDICES",
                  "Selected positions masked because they were outside their request (should stay 0)."),
    CounterSeries(PREFIX + "overflow_entries_total", "OVERFLOW",
                  "Entries that found no free hot slot (0 whenever the config's sizing checks passed)."),
    CounterSeries(PREFIX + "evictions_total", "EVICTIONS", "Resident entries evicted (LRU) to make room."),
    CounterSeries(PREFIX + "new_entries_total", "NEW_TOKENS",
                  "Newly decoded entries given a hot slot of their own (new_tokens=insert; 0 with the default "
                  "on_demand, where they are only written back: see the d2h transfer bytes)."),
    CounterSeries(PREFIX + "prefetch_useful_bytes_total", "PREFETCH_USEFUL",
                  "Bytes prefetched before the exact top-k was known that the top-k then selected.", bytes=True),
    CounterSeries(PREFIX + "prefetch_wasted_bytes_total", "PREFETCH_WASTED",
                  "Bytes prefetched that the exact top-k did not select.", bytes=True),
    CounterSeries(PREFIX + "not_resident_entries_total", "NOT_RESIDENT",
                  "Entries an all-resident lookup did not find (attention skipped them): must stay 0."),
)
STEPS_TOTAL = PREFIX + "decode_steps_total"
READOUTS_DEFERRED_TOTAL = PREFIX + "readouts_deferred_total"
TRANSFER_SECONDS = PREFIX + "transfer_seconds"
TRANSFER_GBPS = PREFIX + "transfer_gb_per_second"
LINK_GBPS = PREFIX + "link_gb_per_second"
HOST_POOL_USED = PREFIX + "host_pool_used_tokens"
HOST_POOL_TOTAL = PREFIX + "host_pool_tokens"
HOT_POOL_USED = PREFIX + "hot_pool_used_slots"
HOT_POOL_TOTAL = PREFIX + "hot_pool_slots"
QUEUED_FOR_HOST = PREFIX + "host_capacity_queue_reqs"
ADMITTED = PREFIX + "admitted_requests"
INVARIANT_CHECKS_TOTAL = PREFIX + "invariant_checks_total"
INVARIANT_VIOLATIONS_TOTAL = PREFIX + "invariant_violations_total"
CHECK_WHEN = ("running", "idle")
"""When the SGLang plugin's self-checks run (ess_sglang/sglang_plugin/health.py): between decode steps, and when
the scheduler is idle."""

_GAUGE_DOCS = {
    TRANSFER_GBPS: "Achieved FlashTrans bandwidth while transferring (bytes / transfer seconds) over the last readout "
                   "interval, by direction.",
    LINK_GBPS: "The PCIe link's ceiling per direction in GB/s (configured; the alert rules compare against it).",
    HOST_POOL_USED: "Token locations held in the pinned host total pool.",
    HOST_POOL_TOTAL: "Token locations the host total pool can hold.",
    HOT_POOL_USED: "Used hot-pool slots (per layer with per-layer metrics, else summed over layers).",
    HOT_POOL_TOTAL: "Hot-pool slots (per layer with per-layer metrics, else summed over layers).",
    QUEUED_FOR_HOST: "Requests waiting for host-pool capacity before they can be admitted.",
    ADMITTED: "Requests holding an ESS admission reservation (host entries, hot slots): 0 when the server is idle.",
}


def series_names() -> dict[str, str]:
    """Every series name EssMetrics registers -> its prometheus type ("counter", "gauge" or "histogram")."""
    names = {s.name: "counter" for s in COUNTER_SERIES}
    names[STEPS_TOTAL] = names[READOUTS_DEFERRED_TOTAL] = "counter"
    names[INVARIANT_CHECKS_TOTAL] = names[INVARIANT_VIOLATIONS_TOTAL] = "counter"
    names[TRANSFER_SECONDS] = "histogram"
    names.update(dict.fromkeys(_GAUGE_DOCS, "gauge"))
    return names


def sample_names() -> set[str]:
    """Every sample name that can appear on /metrics (histograms add _bucket, _sum and _count)."""
    out = set()
    for name, kind in series_names().items():
        if kind == "histogram":
            out.update({name + "_bucket", name + "_sum", name + "_count"})
        else:
            out.add(name)
    return out


def serve_metrics(port: int, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None):
    """Serve `registry` on http://addr:port/metrics in Prometheus' text format 0.0.4, whatever the scraper asks for.

    prometheus_client's own server (start_http_server) answers a scraper that prefers OpenMetrics, as Prometheus 2.x
    does, with the colons of sample names turned into underscores (prometheus/client_python issue 1177), so
    `sglang:ess_hits_total` would be stored as `sglang_ess_hits_total`; the text format keeps the names. Returns the
    server (a daemon thread serves it; `server.server_address[1]` is the port, `server.shutdown()` stops it).
    """
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    reg = REGISTRY if registry is None else registry

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = generate_latest(reg)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # no access log on stderr
            pass

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="ess-metrics-http", daemon=True).start()
    return server


# ---------------------------------------------------------------------------------------------------- families
# Metric families are created once per registry and shared by every EssMetrics on it (several managers in one
# process, e.g. one per rank in tests); each instance owns the children with its own label values.
_lock = threading.Lock()
_families: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # registry -> {name: (metric, labelnames)}
_claimed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # registry -> {label values of live instances}


def _family(registry: CollectorRegistry, kind, name: str, doc: str, labelnames: tuple[str, ...], **kw):
    with _lock:
        fams = _families.setdefault(registry, {})
        if name in fams:
            metric, names = fams[name]
            if names != labelnames or not isinstance(metric, kind):
                raise ValueError(f"{name} is already registered in this registry with labels {names}; an EssMetrics "
                                 f"with labels {labelnames} (per_layer or label names differ) cannot share it")
            return metric
        metric = kind(name, doc, labelnames=labelnames, registry=registry, **kw)
        fams[name] = (metric, labelnames)
        return metric


class EssMetrics:
    """Publishes a cache manager's device counters and pool state through prometheus_client.

    Use from the engine (the SGLang plugin) like this::

        m = EssMetrics(manager, ess_config.metrics, labels=scheduler.metrics_collector.labels)
        ...                      # every decode step, after the CUDA graph replay:
        m.on_step()
        m.set_queued_for_host_capacity(len(waiting_for_host))   # whenever admission changes
        m.observe_transfer("h2d", seconds)                        # optional: where transfers are timed
        m.flush()                # at shutdown (waits for the last readout)

    `registry` defaults to prometheus_client's global REGISTRY (what SGLang's `/metrics` serves); tests pass their
    own CollectorRegistry. Two instances may share a registry when their label values differ.
    """

    def __init__(self, manager, config: MetricsConfig | None = None, *, labels: Mapping[str, object] | None = None,
                 registry: CollectorRegistry | None = None, link_gbps: float = DEFAULT_LINK_GBPS):
        self.config = config or MetricsConfig()
        self.enabled = self.config.enabled
        self.manager = manager
        self.registry = REGISTRY if registry is None else registry
        self.labels = {k: str(v) for k, v in (labels or sglang_labels("ess")).items()}
        self.interval = self.config.readout_interval_steps
        self.per_layer = self.config.per_layer
        self.link_gbps = link_gbps
        self.steps = 0  # on_step calls so far
        self.readouts = 0  # snapshots published
        self._closed = False
        if not self.enabled:
            return

        counters = manager.counters
        L, C = counters.shape
        self.num_layers, self.entry_bytes = L, manager.entry_bytes
        self._cuda = counters.is_cuda
        pin = self._cuda
        self._host_counters = torch.zeros((L, C), dtype=torch.int64, pin_memory=pin)
        self._host_used = torch.zeros(L, dtype=torch.int64, pin_memory=pin)
        # Used hot slots per layer. When the manager counts released slots (a RELEASED column), occupancy follows
        # from the counters alone: inserted (misses + warm-up + new tokens) - evicted - released. Otherwise one small
        # reduction over slot_to_loc is enqueued with each readout.
        cols = Counter.__members__
        derive = ("MISSES", "WARMUP_ENTRIES", "NEW_TOKENS", "EVICTIONS", "RELEASED")
        self._occupancy_cols = ([int(cols[n]) for n in derive] if all(n in cols and int(cols[n]) < C for n in derive)
                                else None)
        self._slot_map = manager.slot_to_loc[:, : manager.slots_per_layer]  # view, without the sink
        self._event = torch.cuda.Event() if self._cuda else None
        self._pending: dict | None = None  # snapshot in flight: host-side values taken when it was enqueued
        self._last = np.zeros((L, C), dtype=np.int64)  # device counters as last published
        self._last_steps = 0
        self._transfer_seconds = dict.fromkeys(DIRECTIONS, 0.0)  # accumulated by observe_transfer
        self._last_transfer_seconds = dict.fromkeys(DIRECTIONS, 0.0)
        self._layer_values = [str(i) for i in range(L)]

        with _lock:
            claimed = _claimed.setdefault(self.registry, set())
            key = tuple(sorted(self.labels.items()))
            if key in claimed:
                raise ValueError(f"an EssMetrics with labels {self.labels} already publishes to this registry; give "
                                 f"each one distinct label values (e.g. tp_rank) or close() the other first")
            claimed.add(key)
            self._claim = key
        self._owned: list = []  # (family, label values) of every child this instance created
        try:
            self._register(manager, C)
        except Exception:
            self.close()
            raise

    def _register(self, manager, C: int) -> None:
        L = self.num_layers
        base = tuple(self.labels)
        layer = ("layer",) if self.per_layer else ()
        reg = self.registry
        self._children: list[tuple[int | None, int, list]] = []  # (column, scale, children: one, or one per layer)
        for s in COUNTER_SERIES:
            names = base + (("direction",) if s.direction else ()) + layer
            doc = s.doc or next(x.doc for x in COUNTER_SERIES if x.name == s.name and x.doc)
            fam = _family(reg, PromCounter, s.name, doc, names)
            member = Counter.__members__.get(s.column)
            col = int(member) if member is not None and int(member) < C else None
            extra = {"direction": s.direction} if s.direction else {}
            self._children.append((col, self.entry_bytes if s.bytes else 1, self._kids(fam, extra)))
        self._steps_total = self._child(_family(
            reg, PromCounter, STEPS_TOTAL,
            "Decode steps covered by published readouts (misses per step = rate(misses) / rate(decode_steps)).", base))
        self._deferred = self._child(_family(
            reg, PromCounter, READOUTS_DEFERRED_TOTAL,
            "Readouts skipped because the previous counter copy had not completed (should stay near 0).", base))
        checks = _family(reg, PromCounter, INVARIANT_CHECKS_TOTAL, "Self-checks of ESS's state run (maps, pools, "
                         "reservations; at idle also the idle values), by when they ran.", base + ("when",))
        self._checks = {w: self._child(checks, when=w) for w in CHECK_WHEN}
        self._violations = self._child(_family(
            reg, PromCounter, INVARIANT_VIOLATIONS_TOTAL,
            "Violations those self-checks found (each one is logged as 'ESS invariant violated'): must stay 0.", base))
        hist = _family(reg, Histogram, TRANSFER_SECONDS, "Duration of one FlashTrans transfer (one layer's gather or "
                       "scatter), by direction, as timed by the caller of observe_transfer.", base + ("direction",),
                       buckets=TRANSFER_SECONDS_BUCKETS)
        self._hist = {d: self._child(hist, direction=d) for d in DIRECTIONS}

        def gauge(name, names):
            return _family(reg, Gauge, name, _GAUGE_DOCS[name], names, multiprocess_mode="mostrecent")

        gbps = gauge(TRANSFER_GBPS, base + ("direction",))
        self._gbps = {d: self._child(gbps, direction=d) for d in DIRECTIONS}
        self._link = self._child(gauge(LINK_GBPS, base))
        self._link.set(self.link_gbps)
        self._host_used_g = self._child(gauge(HOST_POOL_USED, base))
        self._host_total_g = self._child(gauge(HOST_POOL_TOTAL, base))
        self._hot_used_g = self._kids(gauge(HOT_POOL_USED, base + layer), {})
        self._hot_total_g = self._kids(gauge(HOT_POOL_TOTAL, base + layer), {})
        self._queued = self._child(gauge(QUEUED_FOR_HOST, base))
        self._queued.set(0)
        self._admitted = self._child(gauge(ADMITTED, base))
        self._admitted.set(0)
        for g in self._hot_total_g:
            g.set(manager.slots_per_layer * (1 if self.per_layer else L))
        self._set_host_gauges(manager.host.num_used, manager.host.num_tokens)

    def _child(self, family, **extra):
        values = {**self.labels, **extra}
        self._owned.append((family, values))
        return family.labels(**values)

    def _kids(self, family, extra: dict) -> list:
        if self.per_layer:
            return [self._child(family, **extra, layer=v) for v in self._layer_values]
        return [self._child(family, **extra)]

    # ------------------------------------------------------------------------------------------------ per step
    def on_step(self) -> None:
        """Call once per decode step, after the step was launched (outside any CUDA graph capture)."""
        if not self.enabled or self._closed:
            return
        self.steps += 1
        if self._pending is not None and self._event.query():
            self._publish()
        if self.steps % self.interval == 0:
            if self._pending is not None:  # the previous copy is still in flight: never wait for it
                self._deferred.inc()
            else:
                self._start_readout()

    def _start_readout(self) -> None:
        m = self.manager
        if self._occupancy_cols is None:
            self._host_used.copy_((self._slot_map >= 0).sum(dim=1), non_blocking=True)  # device reduction, no sync
        self._host_counters.copy_(m.counters, non_blocking=True)
        self._pending = {"steps": self.steps, "host_used": m.host.num_used, "host_total": m.host.num_tokens,
                         "seconds": dict(self._transfer_seconds)}
        if self._event is not None:
            self._event.record()
        else:  # CPU: the copies above were synchronous
            self._publish()

    def _publish(self) -> None:
        p, self._pending = self._pending, None
        cur = self._host_counters.numpy().copy()
        delta = cur - self._last
        restarted = delta < 0
        delta[restarted] = cur[restarted]
        self._last = cur
        sums = delta.sum(axis=0).tolist()
        for col, scale, kids in self._children:
            if col is None:
                continue
            if self.per_layer:
                for child, v in zip(kids, delta[:, col].tolist(), strict=True):
                    if v:
                        child.inc(v * scale)
            elif sums[col]:
                kids[0].inc(sums[col] * scale)
        self._steps_total.inc(p["steps"] - self._last_steps)
        self._last_steps = p["steps"]
        if self._occupancy_cols is None:
            used = self._host_used.tolist()
        else:
            miss, warm, new, evicted, released = (cur[:, c] for c in self._occupancy_cols)
            used = (miss + warm + new - evicted - released).tolist()
        if self.per_layer:
            for child, v in zip(self._hot_used_g, used, strict=True):
                child.set(v)
        else:
            self._hot_used_g[0].set(sum(used))
        self._set_host_gauges(p["host_used"], p["host_total"])
        for d, name in (("h2d", "H2D_ENTRIES"), ("d2h", "D2H_ENTRIES")):
            secs = p["seconds"][d] - self._last_transfer_seconds[d]
            member = Counter.__members__.get(name)
            if secs > 0 and member is not None:
                self._gbps[d].set(sums[int(member)] * self.entry_bytes / secs / 1e9)
        self._last_transfer_seconds = p["seconds"]
        self.readouts += 1

    def _set_host_gauges(self, used: int, total: int) -> None:
        self._host_used_g.set(used)
        self._host_total_g.set(total)

    # ------------------------------------------------------------------------------------------------ other inputs
    def observe_transfer(self, direction: str, seconds: float) -> None:
        """Record the measured duration of one transfer ("h2d" or "d2h"); feeds the histogram and the GB/s gauge.

        Call it for the transfers the counters count (misses and warm-up for h2d, new tokens for d2h) and before
        the `on_step()` of the step they belong to, so bytes and seconds cover the same steps.
        """
        if not self.enabled or self._closed:
            return
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        self._hist[direction].observe(seconds)
        self._transfer_seconds[direction] += seconds

    def set_queued_for_host_capacity(self, n: int) -> None:
        """Requests the engine holds back because the host pool cannot take them yet (admission control)."""
        if self.enabled and not self._closed:
            self._queued.set(n)

    def set_admitted_requests(self, n: int) -> None:
        """Requests holding an admission reservation."""
        if self.enabled and not self._closed:
            self._admitted.set(n)

    def note_invariant_check(self, when: str, violations: int) -> None:
        """One self-check ran (`when`: "running" or "idle") and found `violations` violations."""
        if not self.enabled or self._closed:
            return
        if when not in CHECK_WHEN:
            raise ValueError(f"when must be one of {CHECK_WHEN}, got {when!r}")
        self._checks[when].inc()
        if violations:
            self._violations.inc(violations)

    def flush(self, wait: bool = True) -> bool:
        """Publish everything counted so far: finish the readout in flight, then take and publish a fresh one.

        For shutdown, the end of a benchmark, or the demo: it waits for the device (with `wait`), so never call it
        from the decode step. Returns True when everything counted so far has been published.
        """
        if not self.enabled or self._closed:
            return False
        if not self._finish(wait):  # the readout in flight, if any
            return False
        self._start_readout()  # then a fresh one
        return self._finish(wait)

    def _finish(self, wait: bool) -> bool:
        if self._pending is not None:
            if not wait:
                return False
            self._event.synchronize()
            self._publish()
        return True

    def published_totals(self) -> dict[str, int]:
        """Device counters (summed over layers) as of the last published snapshot, by Counter name."""
        if not self.enabled:
            return {}
        return {c.name: int(self._last[:, int(c)].sum()) for c in Counter if int(c) < self._last.shape[1]}

    def close(self) -> None:
        """Remove this instance's series from the registry (other instances on it keep theirs)."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        with _lock:
            _claimed.get(self.registry, set()).discard(self._claim)
        for family, values in self._owned:
            with contextlib.suppress(KeyError):  # label values are in label-name order (see _kids)
                family.remove(*values.values())
        self._owned.clear()

    def __enter__(self) -> EssMetrics:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

