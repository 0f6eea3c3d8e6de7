"""End to end: `ess demo --metrics-port` scraped by a real Prometheus server, queried through its HTTP API.

The demo runs as a subprocess at small sizes and keeps serving /metrics after decoding (--metrics-hold). A Prometheus
server (Debian's `prometheus` package: /usr/bin/prometheus) scrapes it every second on loopback with a temporary
config and storage directory, and loads the project's alert rules. The test waits, with bounded waits, until the
final counters arrived, then checks that the hit rate PromQL computes equals the one the demo printed, that the
per-layer series and the gauges arrived, that the alert rules loaded, and that every query of the Grafana dashboard
is valid PromQL for this server. Both processes are always killed.

Skipped only when the prometheus binary is missing and the CI environment variable is not set; in CI it must run.
"""

import json
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "configs" / "grafana" / "dashboards" / "ess-sglang.json"
ALERTS = ROOT / "configs" / "prometheus" / "ess-alerts.yml"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
MODEL = "ess-e2e"
LAYERS, STEPS = 2, 48

if not os.path.exists(PROMETHEUS) and not os.environ.get("CI"):
    pytest.skip("the prometheus binary is not installed (Debian: apt-get install -y prometheus); CI must have it",
                allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Lines:
    """Reads a subprocess's stdout on a thread, so the test can wait for a line with a timeout."""

    def __init__(self, proc):
        self.q: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True).start()

    def _pump(self, stream):
        for line in stream:
            self.q.put(line.rstrip("\n"))
        self.q.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line matching {pattern!r} within {timeout} s; output:\n" +
                                     "\n".join(self.seen[-40:]))
            try:
                line = self.q.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"process ended before a line matching {pattern!r}; output:\n" +
                                     "\n".join(self.seen[-40:]))
            self.seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m


def _kill(proc):
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _query(port: int, expr: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:  # 400 / 422 carry a JSON error body
        return json.load(e)


def _scalar(port: int, expr: str) -> float | None:
    out = _query(port, expr)
    assert out["status"] == "success", (expr, out)
    res = out["data"]["result"]
    return float(res[0]["value"][1]) if res else None


def _wait(what: str, fn, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (OSError, ValueError) as e:  # server not up yet
            last = e
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard target, with the dashboard's variables given concrete values."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            e = t["expr"].replace("$__rate_interval", "15s").replace("$link_gbps", "55.3")
            e = e.replace("$model_name", ".*").replace("$instance", ".*")
            out.append((p["title"], e))
    return out


def test_demo_metrics_through_prometheus(tmp_path):
    assert os.path.exists(PROMETHEUS), f"CI must install prometheus (apt-get install -y prometheus): {PROMETHEUS}"
    demo = prom = None
    prom_log = tmp_path / "prometheus.log"
    try:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        demo = subprocess.Popen(
            [sys.executable, "-m", "ess_sglang", "demo", "--batch", "2", "--context-len", "1024", "--steps",
             str(STEPS), "--top-k", "64", "--layers", str(LAYERS), "--device", "cpu", "--no-progress",
             "--metrics-port", "0", "--metrics-per-layer", "--metrics-interval", "8", "--model-name", MODEL,
             "--metrics-hold", "120"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
        lines = _Lines(demo)
        metrics_port = int(lines.wait_for(r"serving metrics on http://127\.0\.0\.1:(\d+)/metrics", 60).group(1))

        prom_port = _free_port()
        rules = tmp_path / "ess-alerts.yml"
        shutil.copy(ALERTS, rules)
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {rules}\n"
            "scrape_configs:\n  - job_name: ess-demo\n    scrape_interval: 1s\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{metrics_port}']\n")
        with open(prom_log, "w") as log:
            prom = subprocess.Popen(
                [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)

        m = lines.wait_for(r"^ess metrics: (.*)$", 120)
        printed = dict(kv.split("=", 1) for kv in m.group(1).split())
        assert printed["published"] == "all", m.group(0)
        lookups = int(printed["lookups_total"])
        assert lookups == 2 * STEPS * 64 * LAYERS  # batch x steps x top-k x layers: every selection was valid

        sel = f'{{model_name="{MODEL}"}}'

        def final_arrived():
            assert prom.poll() is None, "prometheus exited:\n" + prom_log.read_text()[-3000:]
            return _scalar(prom_port, f"sum(sglang:ess_lookups_total{sel})") == lookups

        _wait("the final lookups_total in Prometheus", final_arrived, timeout=60)

        hit_rate = _scalar(prom_port, f"1 - sum(sglang:ess_misses_total{sel}) / sum(sglang:ess_lookups_total{sel})")
        assert abs(hit_rate - float(printed["hit_rate"])) <= 1e-6, (hit_rate, printed["hit_rate"])
        assert 0.0 < hit_rate < 1.0
        assert _scalar(prom_port, f"sum(sglang:ess_misses_total{sel})") == int(printed["misses_total"])
        assert _scalar(prom_port, f"sum(sglang:ess_hits_total{sel})") == int(printed["hits_total"])
        for d in ("h2d", "d2h"):
            got = _scalar(prom_port, f'sum(sglang:ess_transfer_bytes_total{{model_name="{MODEL}",direction="{d}"}})')
            assert got == int(printed[f"{d}_bytes_total"]), d
        assert _scalar(prom_port, f"sum(sglang:ess_decode_steps_total{sel})") == STEPS
        per_layer = _query(prom_port, f"sglang:ess_misses_total{sel}")["data"]["result"]
        assert sorted(r["metric"]["layer"] for r in per_layer) == [str(i) for i in range(LAYERS)]
        labels = per_layer[0]["metric"]
        for k, v in {"engine_type": "decode", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0",
                     "job": "ess-demo"}.items():
            assert labels.get(k) == v, (k, labels)
        assert _scalar(prom_port, f"sum(sglang:ess_host_pool_tokens{sel})") > 0
        assert _scalar(prom_port, f"sum(sglang:ess_hot_pool_used_slots{sel})") > 0
        assert _scalar(prom_port, f"sum(sglang:ess_transfer_seconds_count{sel})") > 0
        assert _scalar(prom_port, f'sglang:ess_transfer_gb_per_second{{model_name="{MODEL}",direction="h2d"}}') > 0

        # The alert rules loaded and are evaluated without errors.
        def rules_evaluated():
            with urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/rules", timeout=5) as r:
                groups = json.load(r)["data"]["groups"]
            rs = [rule for g in groups for rule in g["rules"]]
            return rs if rs and all(rule["health"] == "ok" for rule in rs) else None  # "unknown" until evaluated

        rs = _wait("the alert rules to be evaluated", rules_evaluated, timeout=30)
        assert {r["name"] for r in rs} >= {"EssHitRateLow", "EssPcieSaturated"}

        # Every dashboard query is valid PromQL for this server (syntax and types), with or without data.
        bad = [(title, e, out.get("error")) for title, e in dashboard_queries()
               if (out := _query(prom_port, e))["status"] != "success"]
        assert not bad, bad
        # and the ESS panels that need no rate window show the demo's numbers
        assert _scalar(prom_port, next(e for t, e in dashboard_queries() if t == "Hit rate over time"
                                       and "rate(" not in e)) == pytest.approx(hit_rate, abs=1e-9)
    finally:
        _kill(demo)
        _kill(prom)
