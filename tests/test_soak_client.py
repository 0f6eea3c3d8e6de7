"""The soak's client (benchmarks/soak.py) against a stand-in for SGLang with ESS on loopback: a streaming /generate
that admits requests against a host pool (a waiting queue and an ESS queued-for-host gauge), refuses bad input,
notices clients that reset their connection, and a /metrics with the series the soak reads, including an idle
self-check counter that grows while nothing runs. A clean stand-in passes; one whose aborted requests keep host
entries fails with the leak counted."""

import json
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import soak  # noqa: E402

CONTEXT = 256
VOCAB = 1000
CHUNK_DELAY_S = 0.02
PAGE = 64


class StandIn:
    """What the stand-in server keeps: admission against a host pool of `host_capacity` tokens, the gauges and
    counters it serves, and what it saw. `leak_on_abort`: host entries an aborted request keeps. `accept_bad`: bad
    input gets tokens like any request (a server that fails to validate)."""

    def __init__(self, host_capacity: int, leak_on_abort: int = 0, accept_bad: bool = False):
        self.capacity = host_capacity
        self.leak_on_abort = leak_on_abort
        self.accept_bad = accept_bad
        self.cond = threading.Condition()
        self.running = self.waiting = self.queued_for_host = self.host_used = 0
        self.checks_running = self.checks_idle = 0
        self.aborted = self.completed = self.rejected = 0
        self._stop = threading.Event()
        threading.Thread(target=self._idle_checks, daemon=True).start()

    def _idle_checks(self):
        while not self._stop.wait(0.02):
            with self.cond:
                if self.running == 0 and self.waiting == 0:
                    self.checks_idle += 1

    def metrics(self) -> bytes:
        with self.cond:
            m = f"""# HELP sglang:num_running_reqs running
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{model_name="m",engine_type="unified"}} {self.running}.0
sglang:num_queue_reqs{{model_name="m",engine_type="unified"}} {self.waiting}.0
sglang:ess_host_capacity_queue_reqs{{model_name="m"}} {self.queued_for_host}.0
sglang:ess_host_pool_used_tokens{{model_name="m"}} {self.host_used}.0
sglang:ess_host_pool_tokens{{model_name="m"}} {self.capacity}.0
sglang:ess_hot_pool_used_slots{{model_name="m",layer="0"}} {3 * self.running}.0
sglang:ess_hot_pool_used_slots{{model_name="m",layer="1"}} {3 * self.running}.0
sglang:ess_admitted_requests{{model_name="m"}} {self.running}.0
sglang:ess_invariant_checks_total{{model_name="m",when="running"}} {self.checks_running}.0
sglang:ess_invariant_checks_total{{model_name="m",when="idle"}} {self.checks_idle}.0
sglang:ess_invariant_violations_total{{model_name="m"}} 0.0
"""
        return m.encode()

    def stop(self):
        self._stop.set()


def handler_for(state: StandIn):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json"):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/metrics":
                self._send(200, state.metrics(), "text/plain")
            elif self.path == "/health":
                self._send(200, b"")
            else:
                self._send(404, b"")

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids, stream = req["input_ids"], req.get("stream", False)
            n = req["sampling_params"]["max_new_tokens"]
            why = ("input_ids cannot be empty" if not ids else
                   f"the input ({len(ids)} tokens) is longer than the context" if len(ids) >= CONTEXT else
                   "token ids out of the vocabulary" if max(ids) >= VOCAB else None)
            if why and not state.accept_bad:
                with state.cond:
                    state.rejected += 1
                if stream:  # as SGLang: 200, then the error in the stream
                    self._send(200, f"data: {json.dumps({'error': {'message': why}})}\n\ndata: [DONE]\n\n".encode(),
                               "text/event-stream")
                else:
                    self._send(400, json.dumps({"error": {"message": why}}).encode())
                return
            if why:
                ids = ids[:CONTEXT - n - 1] or [0]
            need = -(-(len(ids) + n) // PAGE) * PAGE
            with state.cond:  # admission: wait for host entries, as ESS does
                state.waiting += 1
                held_back = False
                while state.host_used + need > state.capacity:
                    if not held_back:
                        state.queued_for_host += 1
                        held_back = True
                    state.cond.wait(0.05)
                if held_back:
                    state.queued_for_host -= 1
                state.waiting -= 1
                state.running += 1
                state.host_used += need
            if not stream:
                out = [t % 7 for t in range(n)]
                self._send(200, json.dumps({"output_ids": out}).encode())
                self._finish(need, aborted=False)
                return
            aborted = False
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(1, n + 1):  # cumulative chunks, as SGLang streams without incremental output
                    self.wfile.write(f"data: {json.dumps({'output_ids': [t % 7 for t in range(i)]})}\n\n".encode())
                    with state.cond:
                        state.checks_running += 1
                    time.sleep(CHUNK_DELAY_S)
                self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):
                aborted = True
            self._finish(need, aborted)

        def _finish(self, need: int, aborted: bool):
            with state.cond:
                state.running -= 1
                state.host_used -= need - (state.leak_on_abort if aborted else 0)
                state.aborted += aborted
                state.completed += not aborted
                state.cond.notify_all()

    return Handler


@pytest.fixture
def stand_in():
    made = []

    def start(**kw):
        state = StandIn(**kw)
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(state))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made.append((server, state))
        return f"http://127.0.0.1:{server.server_address[1]}", state

    yield start
    for server, state in made:
        state.stop()
        server.shutdown()
        server.server_close()


def soak_argv(url: str, out: Path) -> list[str]:
    return ["--url", url, "--out", str(out), "--requests", "24", "--arrival-rate", "40", "--context", str(CONTEXT),
            "--min-prompt", "16", "--min-output", "4", "--max-output", "12", "--disconnect-share", "0.25",
            "--bursts", "1", "--burst-size", "6", "--bad-requests", "6", "--vocab", str(VOCAB), "--workers", "64",
            "--seed", "3", "--deadline-s", "60", "--drain-timeout-s", "30", "--idle-timeout-s", "20",
            "--idle-check-timeout-s", "10", "--request-timeout-s", "30", "--monitor-interval-s", "0.02"]


KEYS = ("commit", "device", "date", "command", "config", "requests", "finished", "aborted", "rejected_bad_input",
        "bad_input_accepted", "errors", "crashes", "leaked_host_entries", "leaked_hot_slots", "admitted_after",
        "queued_after", "invariant_violations", "invariant_checks_running", "invariant_checks_idle",
        "idle_check_seen", "max_running", "max_queue", "max_queued_for_host", "max_host_pool_used", "wall_s",
        "first_errors", "log_findings", "ok")


def check_counts(doc: dict, state: StandIn) -> None:
    assert doc["requests"] == 24 + 6 + 6
    assert doc["finished"] + doc["aborted"] + doc["rejected_bad_input"] + doc["bad_input_accepted"] \
        + doc["errors"] == doc["requests"]
    assert doc["errors"] == 0, doc["first_errors"]
    assert doc["aborted"] == doc["disconnects_sent"] == 6 == state.aborted  # the server saw every reset
    assert doc["rejected_bad_input"] == doc["bad_requests_sent"] == 6 == state.rejected
    assert doc["finished"] == 24 - 6 + 6 == state.completed
    assert doc["by_kind"]["burst"] == {"finished": 6} and doc["by_kind"]["empty"] == {"rejected": 2}
    assert doc["crashes"] == 0 and doc["idle_check_seen"] and doc["invariant_checks_running"] > 0
    assert doc["leaked_hot_slots"] == 0 and doc["admitted_after"] == 0 and doc["missing_series"] == []


def test_clean_server_passes(stand_in, tmp_path):
    url, state = stand_in(host_capacity=2 * (CONTEXT + PAGE))
    assert soak.main(soak_argv(url, tmp_path)) == 0
    doc = json.loads((tmp_path / "soak.json").read_text())
    assert all(k in doc for k in KEYS), [k for k in KEYS if k not in doc]
    check_counts(doc, state)
    assert doc["ok"] and doc["failed_checks"] == [] and doc["leaked_host_entries"] == 0
    assert doc["max_queued_for_host"] > 0 and doc["max_running"] > 0  # the burst waited for host entries
    assert 0 < doc["max_host_pool_used"] <= 2 * (CONTEXT + PAGE)
    assert doc["config"]["server_argv"] is None and doc["config"]["burst_size"] == 6
    assert doc["log_findings"] is None and doc["timeline"]
    outcomes = json.loads((tmp_path / "requests.json").read_text())
    assert len(outcomes) == 36 and {o["status"] for o in outcomes} == {"finished", "aborted", "rejected"}
    assert (tmp_path / "soak.png").stat().st_size > 0


def test_leaked_host_entries_fail_the_soak(stand_in, tmp_path):
    url, state = stand_in(host_capacity=2 * (CONTEXT + PAGE), leak_on_abort=16)
    assert soak.main(soak_argv(url, tmp_path)) == 1
    doc = json.loads((tmp_path / "soak.json").read_text())
    check_counts(doc, state)
    assert doc["leaked_host_entries"] == 16 * 6 and not doc["ok"]
    assert doc["failed_checks"] == ["no leaked host entries"]


def test_plan_mixes_arrivals_disconnects_bursts_and_bad_input():
    kw = dict(requests=200, arrival_rate=5.0, context=4096, min_prompt=128, min_output=16, max_output=512,
              disconnect_share=0.1, bursts=2, burst_size=10, bad_requests=9, seed=1)
    plan = soak.plan_workload(**kw)
    assert plan == soak.plan_workload(**kw)  # seeded
    assert [p.index for p in plan] == list(range(len(plan))) == list(range(200 + 20 + 9))
    assert all(a.at_s <= b.at_s for a, b in zip(plan, plan[1:], strict=False))
    kinds = [p.kind for p in plan]
    assert kinds.count("disconnect") == 20 and kinds.count("burst") == 20
    assert all(kinds.count(k) == 3 for k in soak.BAD_KINDS)
    good = [p for p in plan if not p.bad]
    assert all(p.prompt_len >= 128 and p.prompt_len + p.max_new_tokens <= 4096 - soak.LIMIT_MARGIN for p in good)
    assert all(16 <= p.max_new_tokens <= 512 for p in good)
    assert all(1 <= p.read_chunks <= 8 and p.max_new_tokens >= 64 for p in plan if p.kind == "disconnect")
    bursts = sorted({p.at_s for p in plan if p.kind == "burst"})
    assert len(bursts) == 2  # each burst arrives at once, with prompts near the context limit
    assert all(p.prompt_len + p.max_new_tokens > 4096 - soak.LIMIT_MARGIN - PAGE for p in plan if p.kind == "burst")
    assert all(p.prompt_len > 4096 for p in plan if p.kind == "too_long")
    assert {p.prompt_len for p in plan if p.kind == "empty"} == {0}
    assert {p.stream for p in plan if p.bad} == {True, False}
    lens = sorted(p.prompt_len for p in plan if p.kind == "normal")
    assert lens[len(lens) // 2] < 1500  # log-uniform: the median is far below the middle of the range
    cut = soak.plan_workload(**{**kw, "arrival_rate": 1.0}, span_limit_s=30)  # bursts fall within the deadline
    assert max(p.at_s for p in cut if p.kind == "burst" or p.bad) <= 30


def test_prompts_of_bad_requests():
    plan = soak.plan_workload(requests=1, arrival_rate=5.0, context=512, min_prompt=16, min_output=4, max_output=12,
                              disconnect_share=0, bursts=0, burst_size=0, bad_requests=3, seed=2)
    by_kind = {p.kind: soak.prompt_for(p, VOCAB) for p in plan}
    assert by_kind["empty"] == [] and len(by_kind["too_long"]) > 512
    assert max(by_kind["out_of_vocab"]) >= VOCAB and VOCAB in by_kind["out_of_vocab"]
    assert max(by_kind["normal"]) < VOCAB and by_kind["normal"] == soak.prompt_for(plan[[p.kind for p in plan]
                                                                                         .index("normal")], VOCAB)


def test_accepted_bad_input_and_connection_errors_are_counted(stand_in):
    url, _ = stand_in(host_capacity=4 * (CONTEXT + PAGE), accept_bad=True)
    rng = random.Random(0)
    bad = soak.Planned(index=0, kind="out_of_vocab", at_s=0.0, prompt_len=20, max_new_tokens=4, seed=rng.randrange(9))
    o = soak.run_one(url, bad, VOCAB, timeout_s=10)
    assert o.status == "accepted_bad" and o.tokens == 4
    o = soak.run_one(url, soak.Planned(1, "empty", 0.0, 0, 4, 5, stream=False), VOCAB, timeout_s=10)
    assert o.status == "accepted_bad"
    free = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = free.server_address[1]
    free.server_close()  # nothing listens there now
    o = soak.run_one(f"http://127.0.0.1:{port}", soak.Planned(2, "normal", 0.0, 8, 4, 1), VOCAB, timeout_s=5)
    assert o.status == "error" and "Connection" in o.detail
    doc = soak.summarize([bad], [soak.Outcome(0, "out_of_vocab", "accepted_bad", 4, 0.1)], None, idle_reached=True,
                         idle_check_seen=True, crashed=False, maxima={}, log_findings=None)
    assert not doc["ok"] and doc["bad_input_accepted"] == 1
    assert {"no bad input accepted", "every bad request rejected", "pools read"} <= set(doc["failed_checks"])


def test_log_scan_counts_each_pattern():
    log = "\n".join(["INFO ESS idle check: ok", "Traceback (most recent call last):", "  File x",
                     "ERROR ESS invariant violated: host pool", "RuntimeError: Memory leak detected! 5 tokens"])
    f = soak.scan_log(log)
    assert {k: v["count"] for k, v in f.items()} == {"memory leak detected": 1, "Traceback": 1, "ESS invariant": 1,
                                                     "ESS idle check": 1}
    assert f["ESS invariant"]["first"] == ["ERROR ESS invariant violated: host pool"]


def test_the_started_server_is_sized_by_the_knobs():
    args = soak.parser().parse_args(["--host-pool-requests", "24", "--context", "16384", "--ess-config",
                                     '{"sparse_memory_ratio": 0.3}'])
    spec = soak.server_spec(args)
    layers = soak.model_layers(args.model)
    assert spec.context_len == 16384 and spec.max_running_requests == 32
    assert spec.ess_config["memory_pool_size_gb"] * 2**30 == 24 * (16384 + 64) * layers * 656
    assert spec.ess_config["invariant_check_interval_steps"] == 256 and spec.ess_config["sparse_memory_ratio"] == 0.3
    assert spec.ess_config["max_kv_cache_gb"] * 2**30 == 12 * (16384 + 64) * soak.kv_bytes_per_token(args.model)
    off = soak.server_spec(soak.parser().parse_args(["--invariant-interval-steps", "0"]))
    assert "invariant_check_interval_steps" not in off.ess_config
