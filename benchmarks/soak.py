"""Soak: the real SGLang server with ESS under load, faults and bad input; nothing may leak or crash.

Starts an ESS server (benchmarks/sglang_server.py: the DeepSeek-V3.2-shaped model with dummy weights, requests by
token ids, greedy, ``ignore_eos``) or uses a running one (``--url``), and sends it, seeded:

* ``--requests`` Poisson arrivals at ``--arrival-rate`` per second (above what the server serves, so that it holds a
  waiting queue), each in its own worker thread: prompts log-uniform from ``--min-prompt`` to the context limit less
  the request's output, outputs (``max_new_tokens``, ``ignore_eos``) log-uniform from ``--min-output`` to
  ``--max-output``;
* of those, ``--disconnect-share`` are clients that read 1..8 streamed chunks carrying output tokens and then reset
  the connection (SO_LINGER 0): the server must abort them and give back what they held;
* ``--bursts`` moments at which ``--burst-size`` requests with prompts near the context limit arrive at once: more
  than the ESS host pool (``--host-pool-requests`` full-context requests) holds, so they must queue for host capacity
  (``sglang:ess_host_capacity_queue_reqs``), never crash;
* ``--bad-requests`` interleaved, a third of each kind: a prompt longer than the context, an empty ``input_ids``, token
  ids >= the vocabulary size; each must get an error answer (HTTP status != 200 or an ``error`` in the body or
  stream), half of them streamed.

A monitor thread scrapes ``/metrics`` every ``--monitor-interval-s`` (running, waiting, ESS queued for host, host pool
used, invariant checks and violations). Once every request is done, the soak waits until SGLang runs and queues
nothing, then until the plugin's idle self-check (``sglang:ess_invariant_checks_total{when="idle"}``) has run once
more, and reads the pools: every host entry and hot slot must be free and nothing admitted. A server process that
exited or a ``/health`` that does not answer 200 is a crash; a request that failed without being a planned
disconnect or a rejected bad request is an error. The server's log (when the soak started it) is scanned for
"memory leak detected", "Traceback", "ESS invariant" and "ESS idle check".

Every request sent ends in exactly one of: ``finished`` (all its ``max_new_tokens`` tokens), ``aborted`` (a planned
disconnect), ``rejected_bad_input``, ``bad_input_accepted`` (a bad request answered with tokens) and ``errors``. A
disconnecting client whose stream ended before it closed counts as finished (``disconnects_completed``).

``ok`` is true only when there was no crash, no error, no accepted bad input, every bad request was rejected, no host
entry or hot slot leaked, nothing stayed admitted, no invariant violation (and no "memory leak detected" in the
log), the running checks ran, the idle check was seen after the server went idle, every series read was on
``/metrics``, and the burst queued for host capacity (``max_queued_for_host > 0``). Writes ``soak.json``,
``requests.json`` (each request's outcome) and ``soak.png`` (the timeline) under ``--out``; exits 0 when ok, else 1.
Runs on the GPU machine inside scripts/sglang_site.sh. Under ten minutes with the server's start-up, at 8K context
(about 4.3M prompt tokens instead of 7.4M at 16K; the hot pool then needs a larger ratio for 32 running requests):

    scripts/sglang_site.sh python3 benchmarks/soak.py --context 8192 --ess-config '{"sparse_memory_ratio": 0.35}' \
        --arrival-rate 9 --burst-size 48 --deadline-s 120 --drain-timeout-s 150
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_server import (  # noqa: E402
    LATENT_BYTES,
    MODEL_DIR,
    PAGE_SIZE,
    Server,
    ServerError,
    ServerSpec,
    _one,
    kv_bytes_per_token,
    make_prompts,
    metric_sum,
    model_layers,
    scrape,
)

GIB = 1 << 30
VOCAB = 129280
LIMIT_MARGIN = 8
"""Tokens kept below the context limit: SGLang takes prompts shorter than context - 6 and clips max_new_tokens to
context - 2 - prompt, so a prompt of at most context - max_new_tokens - 8 tokens gets all its tokens."""
MAX_READ_CHUNKS = 8
DISCONNECT_MIN_OUTPUT = 64
"""Disconnecting clients ask for at least this many tokens (at most --max-output), so that their stream is still
going when they close it, even where the server sends several tokens in one chunk."""
BAD_KINDS = ("too_long", "empty", "out_of_vocab")
GOOD_KINDS = ("normal", "disconnect", "burst")
FIRST_ERRORS = 10
DOWN_AFTER_FAILED_SCRAPES = 30
"""With --url: this many failed scrapes in a row mark the server down (no more requests are sent)."""
LOG_PATTERNS = ("memory leak detected", "Traceback", "ESS invariant", "ESS idle check")

# /metrics series the soak reads
RUNNING, QUEUE = "sglang:num_running_reqs", "sglang:num_queue_reqs"
QUEUED_FOR_HOST = "sglang:ess_host_capacity_queue_reqs"
HOST_USED, HOST_TOTAL = "sglang:ess_host_pool_used_tokens", "sglang:ess_host_pool_tokens"
HOT_USED = "sglang:ess_hot_pool_used_slots"
ADMITTED = "sglang:ess_admitted_requests"
CHECKS = "sglang:ess_invariant_checks_total"
VIOLATIONS = "sglang:ess_invariant_violations_total"
REQUIRED_SERIES = (RUNNING, QUEUE, QUEUED_FOR_HOST, HOST_USED, HOT_USED, ADMITTED, CHECKS, VIOLATIONS)


# ---------------------------------------------------------------------------------------------- workload plan

@dataclass(frozen=True)
class Planned:
    """One request of the soak: what to send and when (seconds after the first send)."""

    index: int
    kind: str
    """normal | disconnect | burst (served requests); too_long | empty | out_of_vocab (bad input)."""
    at_s: float
    prompt_len: int
    max_new_tokens: int
    seed: int
    read_chunks: int = 0
    """disconnect: chunks with output tokens read before the client resets the connection."""
    stream: bool = True

    @property
    def bad(self) -> bool:
        return self.kind in BAD_KINDS


def log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi], log-uniform."""
    if hi <= lo:
        return lo
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def plan_workload(*, requests: int, arrival_rate: float, context: int, min_prompt: int, min_output: int,
                  max_output: int, disconnect_share: float, bursts: int, burst_size: int, bad_requests: int,
                  seed: int, span_limit_s: float | None = None) -> list[Planned]:
    """Every request of the soak, in the order of its send time. Bursts sit at equal fractions of the arrival span
    (cut to `span_limit_s`, the sending deadline, so that they are sent), bad requests uniformly within it."""
    if max_output + min_prompt + LIMIT_MARGIN > context:
        raise ValueError(f"--context {context} cannot hold --min-prompt {min_prompt} + --max-output {max_output} "
                         f"+ {LIMIT_MARGIN}")
    rng = random.Random(seed)

    def good_len(out: int) -> int:
        return log_uniform_int(rng, min_prompt, context - out - LIMIT_MARGIN)

    items = []
    t = 0.0
    disconnects = set(rng.sample(range(requests), round(requests * disconnect_share)))
    for i in range(requests):
        t += rng.expovariate(arrival_rate)
        if i in disconnects:
            out = log_uniform_int(rng, min(max_output, max(min_output, DISCONNECT_MIN_OUTPUT)), max_output)
            items.append(dict(kind="disconnect", at_s=t, prompt_len=good_len(out), max_new_tokens=out,
                              read_chunks=rng.randint(1, max(1, min(MAX_READ_CHUNKS, out - 1)))))
        else:
            out = log_uniform_int(rng, min_output, max_output)
            items.append(dict(kind="normal", at_s=t, prompt_len=good_len(out), max_new_tokens=out))
    span = t if span_limit_s is None else min(t, span_limit_s)
    for b in range(bursts):
        at = span * (b + 1) / (bursts + 1)
        for _ in range(burst_size):
            out = log_uniform_int(rng, min_output, max_output)
            top = context - out - LIMIT_MARGIN
            items.append(dict(kind="burst", at_s=at, prompt_len=max(min_prompt, top - rng.randrange(PAGE_SIZE)),
                              max_new_tokens=out))
    for k in range(bad_requests):
        kind = BAD_KINDS[k % len(BAD_KINDS)]
        length = {"too_long": context + 1 + rng.randrange(1024), "empty": 0,
                  "out_of_vocab": log_uniform_int(rng, min_prompt, max(min_prompt, (context - min_output) // 4))}[kind]
        items.append(dict(kind=kind, at_s=rng.uniform(0, span), prompt_len=length, max_new_tokens=min_output,
                          stream=(k // len(BAD_KINDS)) % 2 == 0))
    items.sort(key=lambda x: x["at_s"])
    return [Planned(index=i, seed=rng.randrange(1 << 31), **x) for i, x in enumerate(items)]


def prompt_for(p: Planned, vocab: int = VOCAB) -> list[int]:
    """The request's token ids (random, seeded per request, as make_prompts draws them); out_of_vocab: a few of them
    at or above `vocab`."""
    if p.prompt_len == 0:
        return []
    ids = make_prompts(1, p.prompt_len, seed=p.seed, vocab=vocab)[0]
    if p.kind == "out_of_vocab":
        rng = random.Random(p.seed + 1)
        positions = rng.sample(range(len(ids)), min(len(ids), 1 + rng.randrange(8)))
        for j, pos in enumerate(positions):
            ids[pos] = vocab if j == 0 else vocab + rng.randrange(1 << 16)
    return ids


# ---------------------------------------------------------------------------------------------- one request

@dataclass
class Outcome:
    index: int
    kind: str
    status: str
    """finished | aborted | rejected | accepted_bad | error"""
    tokens: int
    latency_s: float
    detail: str = ""


def _connection(url: str, timeout_s: float) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=timeout_s)


def _body(prompt: list[int], max_new_tokens: int, stream: bool) -> bytes:
    return json.dumps({"input_ids": prompt, "stream": stream,
                       "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                           "ignore_eos": True}}).encode()


def _reset(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse | None) -> None:
    """Close the connection abruptly: SO_LINGER 0 makes close() send a reset instead of a FIN."""
    sock = conn.sock
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    if resp is not None:
        resp.close()  # the response's file holds the socket open until it is closed too
    conn.close()


def _error_in(chunk) -> str | None:
    """The error a chunk (or a non-streamed answer) carries: an ``error`` key, or an abort finish reason."""
    if not isinstance(chunk, dict):
        return None
    if chunk.get("error"):
        return str(chunk["error"])[:300]
    reason = (chunk.get("meta_info") or {}).get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        return f"abort: {reason.get('message', '')}"[:300]
    return None


def disconnecting_request(url: str, prompt: list[int], max_new_tokens: int, read_chunks: int,
                          timeout_s: float = 600) -> tuple[str, int, str]:
    """A streamed request whose client resets the connection after `read_chunks` chunks carrying output tokens:
    ("aborted" | "finished" (the stream ended first) | "error", output tokens seen, detail)."""
    conn = _connection(url, timeout_s)
    resp = None
    seen = tokens = 0
    try:
        conn.request("POST", "/generate", _body(prompt, max_new_tokens, True), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return "error", 0, f"HTTP {resp.status}: {resp.read(300).decode(errors='replace')}"
        while True:
            raw = resp.readline()
            if not raw:
                return "error", tokens, f"stream closed by the server after {seen} chunks, without [DONE]"
            line = raw.decode(errors="replace").strip()
            if line == "data: [DONE]":
                if tokens == max_new_tokens:
                    return "finished", tokens, "the stream ended before the client closed it"
                return "error", tokens, f"stream ended after {tokens} of {max_new_tokens} tokens"
            if not line.startswith("data:"):
                continue
            chunk = json.loads(line[5:])
            err = _error_in(chunk)
            if err:
                return "error", tokens, f"error in stream: {err}"
            ids = chunk.get("output_ids") or []
            if ids:
                tokens = len(ids)
                seen += 1
                if seen >= read_chunks and tokens < max_new_tokens:
                    _reset(conn, resp)
                    return "aborted", tokens, ""
    except Exception as exc:
        return "error", tokens, f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def bad_request(url: str, prompt: list[int], max_new_tokens: int, stream: bool,
                timeout_s: float = 600) -> tuple[str, int, str]:
    """A request the server must refuse: ("rejected" | "accepted_bad" | "error", output tokens, detail)."""
    conn = _connection(url, timeout_s)
    try:
        conn.request("POST", "/generate", _body(prompt, max_new_tokens, stream), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
        if resp.status != 200:
            return "rejected", 0, f"HTTP {resp.status}: {text[:200]}"
        chunks = [line.strip()[5:] for line in text.splitlines() if line.strip().startswith("data:")]
        try:
            answers = [json.loads(c) for c in chunks if c.strip() != "[DONE]"] if chunks else [json.loads(text)]
        except ValueError:
            return "error", 0, f"HTTP 200 with a body that is not JSON: {text[:200]}"
        tokens = 0
        for a in answers:
            err = _error_in(a)
            if err:
                return "rejected", 0, f"HTTP 200, error: {err}"
            if isinstance(a, dict):
                tokens = max(tokens, len(a.get("output_ids") or []))
        if tokens:
            return "accepted_bad", tokens, f"HTTP 200 with {tokens} output tokens"
        return "error", 0, f"HTTP 200 without an error or tokens: {text[:200]}"
    except Exception as exc:
        return "error", 0, f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def run_one(url: str, p: Planned, vocab: int = VOCAB, timeout_s: float = 600) -> Outcome:
    """Send one planned request and classify its answer."""
    t0 = time.perf_counter()
    try:
        prompt = prompt_for(p, vocab)
        if p.bad:
            status, tokens, detail = bad_request(url, prompt, p.max_new_tokens, p.stream, timeout_s)
        elif p.kind == "disconnect":
            status, tokens, detail = disconnecting_request(url, prompt, p.max_new_tokens, p.read_chunks, timeout_s)
        else:
            r = _one(url, prompt, p.max_new_tokens, timeout_s=timeout_s, logprobs=False)
            tokens = len(r.output_ids)
            if r.error:
                status, detail = "error", r.error[:300]
            elif tokens != p.max_new_tokens:
                status, detail = "error", f"{tokens} of {p.max_new_tokens} tokens"
            else:
                status, detail = "finished", ""
    except Exception as exc:  # building the prompt, or anything the helpers did not catch
        status, tokens, detail = "error", 0, f"{type(exc).__name__}: {exc}"
    return Outcome(p.index, p.kind, status, tokens, time.perf_counter() - t0, detail)


def send_all(url: str, plan: list[Planned], *, workers: int, deadline_s: float, drain_timeout_s: float,
             vocab: int = VOCAB, request_timeout_s: float = 600, stop: threading.Event | None = None,
             log=print, progress=lambda: "") -> tuple[list[Outcome], dict]:
    """Send `plan` on schedule, each request in a worker thread, until `deadline_s` seconds of sending have passed
    or `stop` is set (the server is down); then wait up to `drain_timeout_s` for the requests sent. Requests still
    running then count as errors. Returns (outcomes of the requests sent, sending facts). `progress()`: a few words
    on the server's state for the progress lines."""
    stop = stop or threading.Event()
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="soak")
    futures = {}
    t0 = time.monotonic()
    why = "all sent"
    for p in plan:
        if p.at_s > deadline_s:
            why = f"deadline {deadline_s:.0f} s"
            break
        while (left := t0 + p.at_s - time.monotonic()) > 0 and not stop.is_set():
            stop.wait(min(left, 0.5))
        if stop.is_set():
            why = "server down"
            break
        if time.monotonic() - t0 > deadline_s:
            why = f"deadline {deadline_s:.0f} s"
            break
        futures[pool.submit(run_one, url, p, vocab, request_timeout_s)] = p
        if len(futures) % 100 == 0:
            log(f"[soak] {len(futures)} sent at {time.monotonic() - t0:.0f} s, "
                f"{sum(f.done() for f in futures)} done; {progress()}", flush=True)
    sending_s = time.monotonic() - t0
    log(f"[soak] {len(futures)} of {len(plan)} sent in {sending_s:.0f} s ({why}); waiting for them", flush=True)
    drain_end = time.monotonic() + drain_timeout_s
    while True:
        done, pending = wait_futures(futures, timeout=max(0.0, min(30.0, drain_end - time.monotonic())))
        if not pending or time.monotonic() >= drain_end:
            break
        log(f"[soak] {len(pending)} in flight at {time.monotonic() - t0:.0f} s; {progress()}", flush=True)
    outcomes = [f.result() for f in done]
    outcomes += [Outcome(futures[f].index, futures[f].kind, "error", 0, 0.0,
                         f"still running {drain_timeout_s:.0f} s after the last send") for f in pending]
    pool.shutdown(wait=False, cancel_futures=True)
    outcomes.sort(key=lambda o: o.index)
    return outcomes, {"planned": len(plan), "sent": len(futures), "sending_s": round(sending_s, 1),
                      "drain_s": round(time.monotonic() - t0 - sending_s, 1), "stopped_sending": why,
                      "unfinished_at_drain_timeout": len(pending)}


# ---------------------------------------------------------------------------------------------- /metrics

def read_state(url: str) -> dict:
    """The series the soak watches, summed over their label sets, and which of them are missing."""
    m = scrape(url)
    return {"running": metric_sum(m, RUNNING), "queue": metric_sum(m, QUEUE),
            "queued_for_host": metric_sum(m, QUEUED_FOR_HOST), "host_used": metric_sum(m, HOST_USED),
            "host_total": metric_sum(m, HOST_TOTAL), "hot_used": metric_sum(m, HOT_USED),
            "admitted": metric_sum(m, ADMITTED), "violations": metric_sum(m, VIOLATIONS),
            "checks_running": metric_sum(m, CHECKS, 'when="running"'),
            "checks_idle": metric_sum(m, CHECKS, 'when="idle"'),
            "missing": [s for s in REQUIRED_SERIES if s not in m]}


class Monitor(threading.Thread):
    """Scrapes /metrics every `interval_s`: a timeline and each series' maximum. A failed scrape is counted and
    retried at the next tick; `down` is set when `alive()` says the server process exited or, without `alive`, after
    DOWN_AFTER_FAILED_SCRAPES failures in a row."""

    KEYS = ("running", "queue", "queued_for_host", "host_used", "hot_used", "admitted", "violations")

    def __init__(self, url: str, interval_s: float = 1.0, alive=None):
        super().__init__(daemon=True, name="soak-monitor")
        self.url, self.interval_s, self.alive = url, interval_s, alive
        self.timeline: list[dict] = []
        self.maxima = dict.fromkeys(self.KEYS, 0.0)
        self.host_total = 0.0
        self.failed = self.failed_in_a_row = 0
        self.down = threading.Event()
        self._halt = threading.Event()
        self.t0 = time.monotonic()

    def tick(self) -> None:
        if self.alive is not None and not self.alive():
            self.down.set()
        try:
            s = read_state(self.url)
        except Exception:
            self.failed += 1
            self.failed_in_a_row += 1
            if self.alive is None and self.failed_in_a_row >= DOWN_AFTER_FAILED_SCRAPES:
                self.down.set()
            return
        self.failed_in_a_row = 0
        self.host_total = max(self.host_total, s["host_total"])
        row = {"t": round(time.monotonic() - self.t0, 2), **{k: s[k] for k in self.KEYS}}
        self.timeline.append(row)
        for k in self.KEYS:
            self.maxima[k] = max(self.maxima[k], s[k])

    def describe(self) -> str:
        last = self.timeline[-1] if self.timeline else None
        if last is None:
            return "no scrape yet"
        return (f"running {last['running']:.0f}, waiting {last['queue']:.0f}, queued for host "
                f"{last['queued_for_host']:.0f}, host pool used {last['host_used']:.0f}")

    def run(self) -> None:
        while not self._halt.is_set():
            self.tick()
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)


def wait_idle(url: str, timeout_s: float, poll_s: float = 1.0) -> tuple[bool, dict | None]:
    """Wait until SGLang runs and queues no request: (reached, the last state read)."""
    end = time.monotonic() + timeout_s
    last = None
    while True:
        try:
            last = read_state(url)
            if last["running"] == 0 and last["queue"] == 0:
                return True, last
        except Exception:
            pass
        if time.monotonic() >= end:
            return False, last
        time.sleep(poll_s)


def wait_idle_check(url: str, since: float, timeout_s: float = 30, poll_s: float = 0.5) -> bool:
    """Wait until the idle self-checks counter has grown past `since`."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            if read_state(url)["checks_idle"] > since:
                return True
        except Exception:
            pass
        if time.monotonic() >= end:
            return False
        time.sleep(poll_s)


def health_ok(url: str, timeout_s: float = 30) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as r:
            return r.status == 200
    except Exception:
        return False


def scan_log(text: str, patterns=LOG_PATTERNS, keep: int = 5) -> dict:
    """Lines of the server log that hold each pattern (case-insensitive): their count and the first `keep`."""
    out = {p: {"count": 0, "first": []} for p in patterns}
    regs = {p: re.compile(re.escape(p), re.IGNORECASE) for p in patterns}
    for line in text.splitlines():
        for p, rx in regs.items():
            if rx.search(line):
                out[p]["count"] += 1
                if len(out[p]["first"]) < keep:
                    out[p]["first"].append(line.strip()[:400])
    return out


# ---------------------------------------------------------------------------------------------- report

def summarize(plan_sent: list[Planned], outcomes: list[Outcome], final: dict | None, *, idle_reached: bool,
              idle_check_seen: bool, crashed: bool, maxima: dict, log_findings: dict | None) -> dict:
    """The verdict of one soak (the counts, the pools after it, ok)."""
    status = Counter(o.status for o in outcomes)
    bad_sent = sum(1 for p in plan_sent if p.bad)
    final = final or {}
    errors = [o for o in outcomes if o.status == "error"]
    leak_lines = (log_findings or {}).get("memory leak detected", {}).get("count", 0)
    doc = {
        "requests": len(plan_sent), "finished": status["finished"], "aborted": status["aborted"],
        "rejected_bad_input": sum(1 for o in outcomes if o.status == "rejected"),
        "bad_input_accepted": status["accepted_bad"], "errors": len(errors), "crashes": int(crashed),
        "bad_requests_sent": bad_sent,
        "disconnects_sent": sum(1 for p in plan_sent if p.kind == "disconnect"),
        "disconnects_completed": sum(1 for o in outcomes if o.kind == "disconnect" and o.status == "finished"),
        "burst_requests_sent": sum(1 for p in plan_sent if p.kind == "burst"),
        "leaked_host_entries": final.get("host_used"), "leaked_hot_slots": final.get("hot_used"),
        "admitted_after": final.get("admitted"), "queued_after": final.get("queued_for_host"),
        "invariant_violations": final.get("violations"), "invariant_checks_running": final.get("checks_running"),
        "invariant_checks_idle": final.get("checks_idle"), "idle_reached": idle_reached,
        "idle_check_seen": idle_check_seen, "missing_series": final.get("missing", list(REQUIRED_SERIES)),
        "max_running": maxima.get("running", 0), "max_queue": maxima.get("queue", 0),
        "max_queued_for_host": maxima.get("queued_for_host", 0), "max_host_pool_used": maxima.get("host_used", 0),
        "max_admitted": maxima.get("admitted", 0),
        "by_kind": {k: dict(Counter(o.status for o in outcomes if o.kind == k)) for k in GOOD_KINDS + BAD_KINDS},
        "first_errors": [f"{o.kind} #{o.index}: {o.detail}" for o in errors[:FIRST_ERRORS]],
        "first_accepted_bad": [f"{o.kind} #{o.index}: {o.detail}"
                               for o in outcomes if o.status == "accepted_bad"][:FIRST_ERRORS],
    }
    checks = {
        "no crash": not crashed, "no errors": not errors, "no bad input accepted": not status["accepted_bad"],
        "every bad request rejected": doc["rejected_bad_input"] == bad_sent,
        "pools read": final != {} and not doc["missing_series"], "server went idle": idle_reached,
        "no leaked host entries": doc["leaked_host_entries"] == 0, "no leaked hot slots": doc["leaked_hot_slots"] == 0,
        "nothing admitted after": doc["admitted_after"] == 0,
        "no invariant violations": doc["invariant_violations"] == 0,
        "running checks ran": (doc["invariant_checks_running"] or 0) > 0, "idle check seen": idle_check_seen,
        "burst queued for host": doc["max_queued_for_host"] > 0, "no leak in the log": leak_lines == 0,
    }
    doc["failed_checks"] = [k for k, v in checks.items() if not v]
    doc["ok"] = not doc["failed_checks"]
    return doc


def environment() -> dict:
    """commit (ESS_COMMIT: a working tree that travelled without its git history), device, UTC date."""
    commit = os.environ.get("ESS_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
        except FileNotFoundError:
            commit = "unknown (no git)"
    try:
        device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True).stdout.strip() or "unknown"
    except FileNotFoundError:
        device = "unknown (no nvidia-smi)"
    return {"commit": commit, "device": device,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def plot(timeline: list[dict], host_total: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    t = [r["t"] for r in timeline]
    for key, label in (("running", "running"), ("queue", "waiting queue"), ("queued_for_host", "ESS queued for host")):
        ax.plot(t, [r[key] for r in timeline], label=label)
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests")
    lines, labels = ax.get_legend_handles_labels()
    if host_total > 0:
        ax2 = ax.twinx()
        ax2.plot(t, [r["host_used"] / host_total for r in timeline], color="black", linestyle="--",
                 label="host pool used (share)")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("host pool used")
        more = ax2.get_legend_handles_labels()
        lines, labels = lines + more[0], labels + more[1]
    ax.legend(lines, labels, loc="upper right")
    ax.set_title("soak: SGLang with ESS")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


TABLE_KEYS = ("requests", "finished", "aborted", "rejected_bad_input", "bad_input_accepted", "errors", "crashes",
              "leaked_host_entries", "leaked_hot_slots", "admitted_after", "queued_after", "invariant_violations",
              "invariant_checks_running", "invariant_checks_idle", "idle_check_seen", "max_running", "max_queue",
              "max_queued_for_host", "max_host_pool_used", "wall_s", "ok")


def print_table(doc: dict) -> None:
    for k in TABLE_KEYS:
        print(f"{k:26} {doc.get(k)}")
    if doc.get("failed_checks"):
        print(f"{'failed':26} {', '.join(doc['failed_checks'])}")


# ---------------------------------------------------------------------------------------------- the run

def server_spec(args) -> ServerSpec:
    """The ESS server: the KV HBM of --hbm-capacity-requests full-context requests, a host pool of
    --host-pool-requests of them, the running self-checks every --invariant-interval-steps decode steps."""
    layers = model_layers(args.model)
    kv_tokens = args.hbm_capacity_requests * (args.context + PAGE_SIZE)
    spec = ServerSpec("ess", context_len=args.context, max_running_requests=args.max_running_requests,
                      kv_tokens=kv_tokens, port=args.port, model_dir=args.model,
                      mem_fraction_static=args.mem_fraction_static)
    ess = {"max_kv_cache_gb": kv_tokens * kv_bytes_per_token(args.model) / GIB,
           "memory_pool_size_gb": args.host_pool_requests * (args.context + PAGE_SIZE) * layers * LATENT_BYTES / GIB}
    if args.invariant_interval_steps > 0:
        ess["invariant_check_interval_steps"] = args.invariant_interval_steps
    spec.ess_config = {**ess, **json.loads(args.ess_config)}
    return spec


def soak(url: str, args, server: Server | None = None) -> dict:
    """Plan, send, wait for idle, read the pools, look for a crash: the soak.json document less its header."""
    plan = plan_workload(requests=args.requests, arrival_rate=args.arrival_rate, context=args.context,
                         min_prompt=args.min_prompt, min_output=args.min_output, max_output=args.max_output,
                         disconnect_share=args.disconnect_share, bursts=args.bursts, burst_size=args.burst_size,
                         bad_requests=args.bad_requests, seed=args.seed, span_limit_s=args.deadline_s)
    alive = (lambda: server.proc is not None and server.proc.poll() is None) if server is not None else None
    monitor = Monitor(url, args.monitor_interval_s, alive)
    monitor.start()
    try:
        outcomes, sending = send_all(url, plan, workers=args.workers, deadline_s=args.deadline_s,
                                     drain_timeout_s=args.drain_timeout_s, vocab=args.vocab,
                                     request_timeout_s=args.request_timeout_s, stop=monitor.down,
                                     progress=monitor.describe)
        sent = {o.index for o in outcomes}
        print(f"[soak] requests done: {dict(Counter(o.status for o in outcomes))}; waiting for the server to go idle",
              flush=True)
        idle = seen = False
        if not monitor.down.is_set():  # a server that exited never goes idle
            idle, state = wait_idle(url, args.idle_timeout_s, min(1.0, args.monitor_interval_s))
        if idle:
            seen = wait_idle_check(url, state["checks_idle"], args.idle_check_timeout_s,
                                   min(0.5, args.monitor_interval_s))
        try:
            final = read_state(url)
        except Exception as exc:
            print(f"[soak] final scrape failed: {exc}", flush=True)
            final = None
    finally:
        monitor.stop()
    exited = server is not None and (server.proc is None or server.proc.poll() is not None)
    healthy = not exited and health_ok(url)
    findings = scan_log(server.log_text()) if server is not None else None
    doc = summarize([p for p in plan if p.index in sent], outcomes, final, idle_reached=idle, idle_check_seen=seen,
                    crashed=exited or not healthy, maxima=monitor.maxima, log_findings=findings)
    doc.update(sending, health_ok=healthy, server_exited=exited, log_findings=findings,
               scrapes=len(monitor.timeline), failed_scrapes=monitor.failed, host_pool_tokens=monitor.host_total,
               final_state=final, timeline=monitor.timeline, outcomes=outcomes)
    if exited or not healthy:
        doc["server_log_tail"] = server.tail(60) if server is not None else None
    return doc


def write(doc: dict, args, argv: list[str], t0: float, server_argv: list[str] | None) -> dict:
    outcomes = doc.pop("outcomes", [])
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    doc = {**environment(), "command": shlex.join(["benchmarks/soak.py", *argv]),
           "config": {**config, "server_argv": server_argv}, **doc, "wall_s": round(time.time() - t0, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(doc, indent=1))
    (args.out / "requests.json").write_text(json.dumps([asdict(o) for o in outcomes]))
    if doc.get("timeline"):
        plot(doc["timeline"], doc.get("host_pool_tokens") or 0, args.out / "soak.png")
    return doc


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="use this running server (no start-up, no log scan; a crash is a failed /health)")
    p.add_argument("--requests", type=int, default=1000,
                   help="Poisson arrivals (normal and disconnecting); bursts and bad requests come on top")
    p.add_argument("--arrival-rate", type=float, default=6.0, help="arrivals per second (above what is served)")
    p.add_argument("--context", type=int, default=16384, help="the server's --context-length")
    p.add_argument("--min-prompt", type=int, default=1024, help="shortest prompt (longest: context - output - 8)")
    p.add_argument("--min-output", type=int, default=16, help="fewest max_new_tokens (log-uniform)")
    p.add_argument("--max-output", type=int, default=512, help="most max_new_tokens (log-uniform)")
    p.add_argument("--disconnect-share", type=float, default=0.10,
                   help="share of the arrivals that reset the connection after 1..8 streamed chunks")
    p.add_argument("--bursts", type=int, default=2, help="moments at which --burst-size requests arrive at once")
    p.add_argument("--burst-size", type=int, default=64, help="requests per burst, prompts near the context limit")
    p.add_argument("--bad-requests", type=int, default=30,
                   help="too-long, empty and out-of-vocabulary requests (a third each)")
    p.add_argument("--host-pool-requests", type=int, default=24,
                   help="the ESS host pool holds this many full-context requests (ess_config.memory_pool_size_gb)")
    p.add_argument("--hbm-capacity-requests", type=int, default=12,
                   help="KV HBM of this many full-context all-HBM requests (ess_config.max_kv_cache_gb)")
    p.add_argument("--max-running-requests", type=int, default=32, help="SGLang --max-running-requests")
    p.add_argument("--invariant-interval-steps", type=int, default=256,
                   help="ess_config.invariant_check_interval_steps (0: not passed, the plugin's default)")
    p.add_argument("--ess-config", default="{}", help="more ESS config keys (JSON), over the ones above")
    p.add_argument("--mem-fraction-static", type=float, default=0.80, help="SGLang --mem-fraction-static")
    p.add_argument("--model", type=Path, default=MODEL_DIR, help="model folder (config.json, dummy weights)")
    p.add_argument("--port", type=int, default=31000, help="server port")
    p.add_argument("--vocab", type=int, default=VOCAB, help="the model's vocabulary size")
    p.add_argument("--workers", type=int, default=512, help="client threads (requests in flight at most)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--deadline-s", type=float, default=420, help="stop sending new requests after this long")
    p.add_argument("--drain-timeout-s", type=float, default=120,
                   help="after the last send, wait this long for the requests in flight (the rest are errors)")
    p.add_argument("--idle-timeout-s", type=float, default=120,
                   help="wait this long for num_running_reqs == num_queue_reqs == 0")
    p.add_argument("--idle-check-timeout-s", type=float, default=30,
                   help="then wait this long for the plugin's idle self-check")
    p.add_argument("--request-timeout-s", type=float, default=600, help="client socket timeout per read")
    p.add_argument("--startup-timeout-s", type=float, default=400, help="server start-up limit")
    p.add_argument("--monitor-interval-s", type=float, default=1.0, help="seconds between /metrics scrapes")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/soak"), help="output folder")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    try:
        json.loads(args.ess_config)
        plan_workload(requests=1, arrival_rate=args.arrival_rate, context=args.context, min_prompt=args.min_prompt,
                      min_output=args.min_output, max_output=args.max_output, disconnect_share=0, bursts=0,
                      burst_size=0, bad_requests=0, seed=0)
    except ValueError as exc:
        p.error(str(exc))
    if args.requests < 1 or args.arrival_rate <= 0 or not 0 <= args.disconnect_share <= 1 or args.min_output < 2:
        p.error("--requests >= 1, --arrival-rate > 0, --disconnect-share in [0, 1], --min-output >= 2")
    if args.url is None:  # a bad ESS config fails here, naming the key, before a server starts
        from ess_sglang.config import EssConfig, EssConfigError, validate_mapping

        try:
            validate_mapping(EssConfig, server_spec(args).ess_config, "ess_config")
        except EssConfigError as exc:
            p.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    # a run stopped from outside (timeout, Ctrl-C) still stops its server: it runs in a process group of its own
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.time()
    server = None
    url = args.url.rstrip("/") if args.url else None
    try:
        if url is None:
            server = Server(server_spec(args), args.out / "server.log", args.out)
            try:
                up = server.start(args.startup_timeout_s)
            except ServerError as exc:
                doc = {"ok": False, "crashes": 1, "startup_error": str(exc)[-4000:], "requests": 0}
                doc = write(doc, args, argv, t0, server.argv)
                print_table(doc)
                return 1
            print(f"[soak] server up in {up:.0f} s", flush=True)
            url = server.spec.url
        doc = soak(url, args, server)
        if server is not None:
            doc["startup_s"] = round(up, 1)
    finally:
        if server is not None:
            server.stop()
    doc = write(doc, args, argv, t0, server.argv if server is not None else None)
    print_table(doc)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # requests still blocked on a server that does not answer (with --url) must not hold the exit
    os._exit(code)
