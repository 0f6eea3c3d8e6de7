"""The Grafana dashboard, the Prometheus alert rules and the compose stack: static checks (no server needed).

- The dashboard JSON loads, selects its datasource through a variable, and has the panels the issue asks for.
- Every PromQL expression of every panel (and of every alert) names only series that exist: ESS series from the names
  ess_sglang.metrics registers, SGLang series from a list pinned below from SGLang 0.5.23's source.
- `promtool check rules` passes on configs/prometheus/ess-alerts.yml, every dashboard expression parses (as a recording
  rule given to promtool), and `promtool test rules` shows the alerts fire when they should and stay quiet otherwise.
- The compose file parses, mounts the dashboard and the provisioning, and the Dockerfile pins SGLang 0.5.23.
promtool comes with Debian's prometheus package; its tests are skipped only when it is missing outside CI.
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ess_sglang.metrics import sample_names

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "configs" / "grafana" / "dashboards" / "ess-sglang.json"
PROVISIONING = ROOT / "configs" / "grafana" / "provisioning"
ALERTS = ROOT / "configs" / "prometheus" / "ess-alerts.yml"
PROM_CONFIG = ROOT / "configs" / "prometheus" / "prometheus.yml"
COMPOSE = ROOT / "docker" / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"

# SGLang's own series that the dashboard shows, as SGLang 0.5.23 names them: read from
# python/sglang/srt/metrics/collector.py of sgl-project/sglang (SchedulerMetricsCollector: gauges num_running_reqs,
# num_queue_reqs, token_usage, gen_throughput, num_decode_prealloc_queue_reqs, num_decode_transfer_queue_reqs;
# TokenizerMetricsCollector: histogram inter_token_latency_seconds). Histograms are queried through their samples.
SGLANG_SERIES = {
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:gen_throughput",
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
    "sglang:inter_token_latency_seconds_bucket",
    "sglang:inter_token_latency_seconds_sum",
    "sglang:inter_token_latency_seconds_count",
}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan", "atan2"}
needs_promtool = pytest.mark.skipif(not os.path.exists(PROMTOOL) and not os.environ.get("CI"),
                                    reason="promtool is not installed (Debian: apt-get install -y prometheus)")


def metric_names(expr: str) -> set[str]:
    """Series names a PromQL expression selects (functions, keywords, labels, numbers and variables removed)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, regexes)
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range and subquery windows
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    e = re.sub(r"\$\{?\w+\}?", "0", e)  # Grafana variables
    e = re.sub(r"\b\d+(\.\d+)?([eE][+-]?\d+)?\b", "0", e)  # numbers
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group(0)
        if e[m.end():].lstrip().startswith("(") or word.lower() in PROMQL_WORDS:
            continue  # a function or aggregation, or a keyword
        names.add(word)
    return names


def test_metric_name_extractor():
    e = ('1 - sum by (layer) (rate(sglang:ess_misses_total{model_name=~"$model_name",x="a{b}"}[$__rate_interval]))'
         ' / ignoring (direction) group_left 0.9 * vector($link_gbps) > bool 1e9 unless foo')
    assert metric_names(e) == {"sglang:ess_misses_total", "foo"}


def _dashboard():
    return json.loads(DASHBOARD.read_text())


def _targets(dash):
    return [(p, t) for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_loads_and_uses_the_datasource_variable():
    dash = _dashboard()
    assert dash["schemaVersion"] >= 36
    assert dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["link_gbps"]["current"]["value"] == "55.3"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert t["expr"].strip()
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0


def test_dashboard_has_the_panels_the_issue_asks_for():
    dash = _dashboard()
    by_title = {p["title"]: p for p in dash["panels"]}
    exprs = " ".join(t["expr"] for _, t in _targets(dash))
    assert by_title["Hit rate per layer"]["type"] == "heatmap"
    assert "by (layer)" in by_title["Hit rate per layer"]["targets"][0]["expr"]
    assert "sglang:ess_decode_steps_total" in json.dumps(by_title["Misses per decode step"])
    ceiling = by_title["PCIe traffic vs link ceiling"]
    assert "$link_gbps" in json.dumps(ceiling) and "sglang:ess_transfer_bytes_total" in json.dumps(ceiling)
    for needle in ("sglang:ess_host_pool_used_tokens", "sglang:ess_hot_pool_used_slots",
                   "sglang:ess_prefetch_useful_bytes_total", "sglang:ess_prefetch_wasted_bytes_total",
                   "sglang:ess_host_capacity_queue_reqs", "sglang:gen_throughput", "sglang:num_running_reqs",
                   "sglang:num_queue_reqs", "sglang:inter_token_latency_seconds_bucket"):
        assert needle in exprs, needle


def test_every_query_names_an_existing_series():
    ess = sample_names()
    seen = set()
    for p, t in _targets(_dashboard()):
        names = metric_names(t["expr"])
        for n in names:
            if n.startswith("sglang:ess_"):
                assert n in ess, f"panel {p['title']!r}: {n} is not registered by ess_sglang.metrics"
            else:
                assert n in SGLANG_SERIES, f"panel {p['title']!r}: {n} is not a (pinned) SGLang series"
        seen |= names
    for var in _dashboard()["templating"]["list"]:
        if var["type"] == "query":
            assert metric_names(re.sub(r"label_values\((.*), \w+\)", r"\1", var["definition"])) <= ess
    alerts = yaml.safe_load(ALERTS.read_text())
    for rule in alerts["groups"][0]["rules"]:
        names = metric_names(rule["expr"])
        assert names and names <= ess, (rule["alert"], names - ess)
    # the dashboard shows every ESS counter family the readout publishes, except the bookkeeping ones
    counters = {n for n in ess if n.endswith("_total")}
    assert counters - seen == set(), counters - seen


def _promtool(*args, cwd=None):
    assert os.path.exists(PROMTOOL), f"CI must install prometheus (for promtool): {PROMTOOL}"
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


@needs_promtool
def test_promtool_check_rules():
    r = _promtool("check", "rules", str(ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@needs_promtool
def test_every_dashboard_query_parses(tmp_path):
    rules = []
    for i, (p, t) in enumerate(_targets(_dashboard())):
        e = t["expr"].replace("$__rate_interval", "1m").replace("$link_gbps", "55.3")
        e = e.replace("$model_name", ".*").replace("$instance", ".*")
        assert "$" not in e, (p["title"], e)
        rules.append({"record": f"dashboard:panel{p['id']}_{i}", "expr": e})
    f = tmp_path / "dashboard-rules.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = _promtool("check", "rules", str(f))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_alerts_fire_when_they_should(tmp_path):
    rules = tmp_path / "ess-alerts.yml"
    shutil.copy(ALERTS, rules)
    a = 'model_name="m",engine_type="decode",tp_rank="0",pp_rank="0",moe_ep_rank="0",instance="a:1",job="j"'
    b = a.replace('instance="a:1"', 'instance="b:1"')
    labels = {"model_name": "m", "engine_type": "decode", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0",
              "job": "j"}
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                # instance a: hit rate 90% (two layers), PCIe h2d 50 GB/s of a 55.3 ceiling, d2h 1.7 GB/s
                {"series": f'sglang:ess_lookups_total{{{a},layer="0"}}', "values": "0+600x30"},
                {"series": f'sglang:ess_lookups_total{{{a},layer="1"}}', "values": "0+400x30"},
                {"series": f'sglang:ess_misses_total{{{a},layer="0"}}', "values": "0+90x30"},
                {"series": f'sglang:ess_misses_total{{{a},layer="1"}}', "values": "0+10x30"},
                {"series": f'sglang:ess_transfer_bytes_total{{{a},direction="h2d"}}', "values": "0+3000000000000x30"},
                {"series": f'sglang:ess_transfer_bytes_total{{{a},direction="d2h"}}', "values": "0+100000000000x30"},
                {"series": f"sglang:ess_link_gb_per_second{{{a}}}", "values": "55.3x30"},
                {"series": f"sglang:ess_overflow_entries_total{{{a}}}", "values": "0x30"},
                # instance b: hit rate 99%, PCIe 10 GB/s, one overflow at minute 20
                {"series": f"sglang:ess_lookups_total{{{b}}}", "values": "0+1000x30"},
                {"series": f"sglang:ess_misses_total{{{b}}}", "values": "0+10x30"},
                {"series": f'sglang:ess_transfer_bytes_total{{{b},direction="h2d"}}', "values": "0+600000000000x30"},
                {"series": f"sglang:ess_link_gb_per_second{{{b}}}", "values": "55.3x30"},
                {"series": f"sglang:ess_overflow_entries_total{{{b}}}", "values": "0x19 3x10"},
                # instance a: an all-resident lookup misses 2 entries at minute 10
                {"series": f"sglang:ess_not_resident_entries_total{{{a}}}", "values": "0x9 2x20"},
                {"series": f"sglang:ess_not_resident_entries_total{{{b}}}", "values": "0x30"},
                # instance b: a self-check finds one violation at minute 6
                {"series": f"sglang:ess_invariant_violations_total{{{a}}}", "values": "0x30"},
                {"series": f"sglang:ess_invariant_violations_total{{{b}}}", "values": "0x5 1x25"},
            ],
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": "EssHitRateLow", "exp_alerts": []},  # pending (for: 5m)
                {"eval_time": "4m", "alertname": "EssPcieSaturated", "exp_alerts": []},
                {"eval_time": "15m", "alertname": "EssHitRateLow", "exp_alerts": [{
                    "exp_labels": {**labels, "instance": "a:1", "severity": "warning"},
                    "exp_annotations": _annotations("EssHitRateLow", {**labels, "instance": "a:1"}, 0.9)}]},
                {"eval_time": "15m", "alertname": "EssPcieSaturated", "exp_alerts": [{
                    "exp_labels": {**labels, "instance": "a:1", "direction": "h2d", "severity": "warning"},
                    "exp_annotations": _annotations("EssPcieSaturated",
                                                    {**labels, "instance": "a:1", "direction": "h2d"}, 50.0)}]},
                {"eval_time": "15m", "alertname": "EssHotPoolOverflow", "exp_alerts": []},
                {"eval_time": "8m", "alertname": "EssNotResident", "exp_alerts": []},
                {"eval_time": "12m", "alertname": "EssNotResident", "exp_alerts": [{
                    "exp_labels": {**labels, "instance": "a:1", "severity": "critical"},
                    "exp_annotations": _annotations("EssNotResident", {**labels, "instance": "a:1"}, 2)}]},
                {"eval_time": "4m", "alertname": "EssInvariantViolated", "exp_alerts": []},
                {"eval_time": "8m", "alertname": "EssInvariantViolated", "exp_alerts": [{
                    "exp_labels": {**labels, "instance": "b:1", "severity": "critical"},
                    "exp_annotations": _annotations("EssInvariantViolated", {**labels, "instance": "b:1"}, 1)}]},
                {"eval_time": "22m", "alertname": "EssInvariantViolated", "exp_alerts": []},
                {"eval_time": "22m", "alertname": "EssHotPoolOverflow", "exp_alerts": [{
                    "exp_labels": {**labels, "instance": "b:1", "severity": "critical"},
                    "exp_annotations": _annotations("EssHotPoolOverflow", {**labels, "instance": "b:1"}, 3)}]},
            ],
        }],
    }
    f = tmp_path / "alerts-test.yml"
    f.write_text(yaml.safe_dump(tests, sort_keys=False))
    r = _promtool("test", "rules", str(f))
    assert r.returncode == 0, r.stdout + r.stderr


def _annotations(alert: str, labels: dict, value) -> dict:
    """The annotations promtool will render for `alert` (its templates, with labels and value filled in)."""
    rule = next(r for r in yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"] if r.get("alert") == alert)
    out = {}
    for k, tmpl in rule["annotations"].items():
        s = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], tmpl)
        s = s.replace("{{ $value | humanizePercentage }}", f"{value * 100:.4g}%")
        s = re.sub(r'\{\{ \$value \| printf "%\.(\d)f" \}\}', lambda m: f"{value:.{m.group(1)}f}", s)
        out[k] = s
    return out


def test_compose_and_provisioning():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"sglang-decode", "prometheus", "grafana"} <= set(services)
    decode = services["sglang-decode"]
    assert "--enable-ess" in decode["command"] and "--enable-metrics" in decode["command"]
    assert decode["build"]["dockerfile"] == "docker/Dockerfile"
    grafana_mounts = {v.split(":")[0]: v.split(":")[1] for v in services["grafana"]["volumes"] if v.startswith(".")}
    assert grafana_mounts["../configs/grafana/dashboards"] == "/var/lib/grafana/dashboards/ess"
    assert grafana_mounts["../configs/grafana/provisioning"] == "/etc/grafana/provisioning"
    for host_path in grafana_mounts:
        assert (COMPOSE.parent / host_path).resolve().is_dir(), host_path
    assert services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"].endswith(DASHBOARD.name)
    prom_mounts = {v.split(":")[0]: v.split(":")[1] for v in services["prometheus"]["volumes"] if v.startswith(".")}
    assert prom_mounts["../configs/prometheus/ess-alerts.yml"] == "/etc/prometheus/ess-alerts.yml"
    assert (COMPOSE.parent / "../configs/prometheus/prometheus.yml").resolve() == PROM_CONFIG

    provider = yaml.safe_load((PROVISIONING / "dashboards" / "ess.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/ess"
    ds = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"

    prom = yaml.safe_load(PROM_CONFIG.read_text())
    assert prom["rule_files"] == ["/etc/prometheus/ess-alerts.yml"]
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert "sglang-decode:30000" in targets and "ess-demo:9400" in targets
    assert prom["global"]["scrape_protocols"] == ["PrometheusText0.0.4"]

    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG SGLANG_IMAGE=lmsysorg/sglang:v0\.5\.23$", text, re.M)
    assert "FROM ${SGLANG_IMAGE}" in text and "pip install" in text
