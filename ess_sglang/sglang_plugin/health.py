"""ESS's self-checks inside a running SGLang server: its state between decode steps, and what is left when idle.

Two moments, one list of checks (`state_violations`):

* **running**: every ``ess_config.invariant_check_interval_steps`` decode steps (0, the default: never), at the
  coordinator's once-a-step call site (host side, outside the CUDA graph, before the step is launched). The GPU is
  synchronised first and every layer's maps are read back (not timed), so this is for soak runs and
  debugging, not for production at full speed;
* **idle**: when SGLang's scheduler is fully idle (AFTER ``Scheduler.on_idle``), once after every busy period and
  then at most every ``IDLE_RECHECK_S`` seconds. Besides the running checks, everything a request held must be back:
  no admission reservation, no host entry, no resident hot entry, no prompt awaiting staging; and SGLang's own pool
  and request-pool check, which SGLang skips when HiSparse is on (and so with ESS: its pool counters diverge while a
  HiSparse host backup is in flight, which ESS never leaves behind).

Violations are logged, one ERROR line each ("ESS invariant violated (running|idle): ..."), and counted
(``sglang:ess_invariant_violations_total``; checks in ``sglang:ess_invariant_checks_total{when}``). Nothing raises:
a server keeps serving, and a soak run (benchmarks/soak.py) reads the counters.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ess_sglang.sglang_plugin.active import active_coordinator

logger = logging.getLogger("ess_sglang.sglang_plugin")

IDLE_RECHECK_S = 10.0
"""While the scheduler stays idle, the idle check runs again after this many seconds (it runs at once after every
busy period)."""


def _caught(check, what: str) -> list[str]:
    try:
        check()
    except AssertionError as exc:
        return [f"{what}: {exc or 'assertion failed'}"]
    return []


def live_host_locations(coord: Any) -> torch.Tensor:
    """The host-pool locations every request row holds (its allocated length, page-rounded, as SGLang allocates)."""
    lens = coord.req_to_host_pool_allocated_len
    rows = torch.nonzero(lens > 0).view(-1).tolist()
    if not rows:
        return torch.empty(0, dtype=torch.int64)
    table = coord.req_to_host_pool
    return torch.cat([table[r, : int(lens[r])] for r in rows]).cpu()


def state_violations(coord: Any) -> list[str]:
    """What is inconsistent in the coordinator's state now (empty: nothing). Reads the device: synchronises."""
    out: list[str] = []
    live = live_host_locations(coord)
    out += _caught(lambda: coord.manager.check_invariants(live[live >= 0]), "hot-pool maps")
    out += _caught(coord.admission.check_invariants, "admission")
    held = int(coord.req_to_host_pool_allocated_len.sum())
    if coord.host.num_used != held:
        out.append(f"host pool: {coord.host.num_used:,} entries in use, the request rows hold {held:,}")
    if int((live < 0).sum()):
        out.append(f"host pool: {int((live < 0).sum()):,} allocated positions of request rows have no host entry")
    unreserved = sorted(rid for rid in coord._rids.values() if not coord.admission.holds(rid))
    if unreserved:
        out.append(f"admission: {len(unreserved)} decoding requests hold no reservation (e.g. {unreserved[0]})")
    return out


def idle_violations(coord: Any, scheduler: Any = None) -> list[str]:
    """`state_violations`, plus what must be 0 with no request in the server, plus SGLang's own pool checks."""
    out = state_violations(coord)
    adm = coord.admission
    if adm.running or adm.host_reserved or adm.hot_reserved:
        out.append(f"idle: admission holds {adm.running} reservations ({adm.host_reserved:,} host entries, "
                   f"{adm.hot_reserved:,} hot slots per layer)")
    if coord.host.num_used:
        out.append(f"idle: {coord.host.num_used:,} host-pool entries still in use")
    resident = [coord.manager.resident_count(layer) for layer in range(coord.num_layers)]
    if any(resident):
        out.append(f"idle: {sum(resident):,} hot-pool entries still resident (per layer: {resident})")
    for name, held in (("prompts awaiting staging", coord._staging),
                       ("staged requests not yet collected", coord._ready),
                       ("decoding rows", coord._rids)):
        if held:
            out.append(f"idle: {len(held)} {name} left")
    if scheduler is not None:
        out += sglang_pool_violations(scheduler)
    return out


def sglang_pool_violations(scheduler: Any) -> list[str]:
    """SGLang's idle memory check (token pool and request pool), which its ``on_idle`` skips with HiSparse on."""
    out: list[str] = []
    checker = getattr(scheduler, "invariant_checker", None)
    observer = getattr(scheduler, "pool_stats_observer", None)
    if checker is not None and observer is not None:
        try:
            leak, messages = checker._check_all_pools(observer.get_pool_stats())
        except Exception as exc:  # an SGLang internal that moved: say so once a check, count nothing
            logger.warning("ESS idle check: SGLang's pool check could not run (%s: %s)", type(exc).__name__, exc)
        else:
            if leak:
                out.append("SGLang pool check: " + "; ".join(m for m in messages if m))
    pool = getattr(scheduler, "req_to_token_pool", None)
    free = getattr(pool, "free_slots", None)
    if pool is not None and free is not None:
        total = int(pool.size) + int(getattr(pool, "pre_alloc_size", 0) or 0)
        if len(free) != total:
            out.append(f"SGLang request pool: {len(free)} of {total} rows free")
    return out


def run_check(coord: Any, when: str, scheduler: Any = None) -> list[str]:
    """Run the `when` ("running" or "idle") checks now and log what they find (`count` counts them)."""
    if coord.device.type == "cuda":
        torch.cuda.synchronize(coord.device)
    found = idle_violations(coord, scheduler) if when == "idle" else state_violations(coord)
    for v in found:
        logger.error("ESS invariant violated (%s): %s", when, v)
    return found


def count(coord: Any, when: str, found: list[str]) -> None:
    """Count one check of `when` and its violations (sglang:ess_invariant_checks_total, ..._violations_total)."""
    if coord.metrics is not None:
        coord.metrics.note_invariant_check(when, len(found))


def after_step(coord: Any, step: int) -> None:
    """Called once a decode step by the coordinator (its metrics call site): the running check when it is due."""
    coord.busy_since_idle_check = True
    every = coord.config.invariant_check_interval_steps
    if every and step % every == 0:
        count(coord, "running", run_check(coord, "running"))


def _idle_check_due(coord: Any, now: float) -> bool:
    return coord.busy_since_idle_check or now - coord.last_idle_check >= IDLE_RECHECK_S


def _deferred_releases_pending(scheduler: Any) -> bool:
    """PD decode: KV slots SGLang holds until the prefill acknowledges a transfer (0.5.23); not a leak."""
    queue = getattr(scheduler, "disagg_decode_transfer_queue", None)
    pending = getattr(queue, "has_pending_deferred_releases", None)
    try:
        return bool(pending()) if callable(pending) else False
    except Exception:
        return False


def on_idle_hook(result, scheduler, *args, **kwargs):
    """AFTER Scheduler.on_idle: the idle check, when the scheduler is fully idle and one is due; the gauges are then
    published at once (a readout, synchronised), so that /metrics shows the idle values."""
    coord = active_coordinator()
    if coord is None or getattr(scheduler, "hisparse_coordinator", None) is not coord:
        return result
    now = time.monotonic()
    if not _idle_check_due(coord, now) or not scheduler.is_fully_idle() or _deferred_releases_pending(scheduler):
        return result
    coord.busy_since_idle_check = False
    coord.last_idle_check = now
    found = run_check(coord, "idle", scheduler)
    coord.note_queued(0)  # fully idle: nothing waits (a queued request may have been aborted while it waited)
    if coord.metrics is not None:
        coord.metrics.set_admitted_requests(coord.admission.running)
        coord.metrics.flush(wait=True)
    count(coord, "idle", found)  # after the gauges: a reader that sees the count grow reads the idle values
    return result
