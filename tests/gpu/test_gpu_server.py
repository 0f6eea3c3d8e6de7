"""The plugin inside a real SGLang server on the GPU (run on the H200 inside scripts/sglang_site.sh: README, "GPU
tests"): the same DeepSeek-V3.2-shaped model (configs/models/deepseek-v32-small, dummy weights) served twice, all
latents in HBM and with ``--enable-ess --enable-metrics``; 8 requests of 8K-token prompts x 64 greedy decode steps
sent at once to each. Every request's output tokens must be equal, and ``/metrics`` must carry the ``sglang:ess_*``
series beside SGLang's own, with lookups counted; ESS's self-checks (between decode steps and when the server goes
idle) must find nothing, and once idle its gauges must show everything released.

The ESS server's hot pool is smaller than the requests' contexts (misses are fetched over PCIe during decode), and
its host pool and KV budget are capped so that it starts as fast as the all-HBM one.
"""

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                 reason="needs SGLang (scripts/sglang_site.sh)")]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from sglang_server import (  # noqa: E402
    PAGE_SIZE,
    Server,
    ServerSpec,
    make_prompts,
    metric_sum,
    run_requests,
    scrape,
)

REQUESTS = 8
PROMPT_TOKENS = 8192
DECODE_STEPS = 64
CONTEXT = PROMPT_TOKENS + DECODE_STEPS + PAGE_SIZE
ESS_CONFIG = {
    "hot_slots_per_layer": 24576,  # 8 requests x (2048 + 1) slots per step fit; the contexts hold 66K tokens
    "memory_pool_size_gb": 1.0,  # the requests' latents take 0.35 GiB over 8 layers
    "max_kv_cache_gb": 0.4,  # the GPU budget binds: hot pool ~25.6K slots a layer, host pool 204K tokens
    "invariant_check_interval_steps": 16,  # ESS's self-check between decode steps, four times a request
}
IDLE = 'when="idle"'


def _after_idle_check(url: str, before: float, timeout_s: float = 60) -> dict:
    """/metrics once ESS's idle self-check ran after the requests (its count grew past `before`)."""
    deadline = time.time() + timeout_s
    while True:
        metrics = scrape(url)
        if metric_sum(metrics, "sglang:ess_invariant_checks_total", IDLE) > before or time.time() > deadline:
            return metrics
        time.sleep(1)


def _serve(system: str, tmp_path: Path, port: int, prompts):
    spec = ServerSpec(system, context_len=CONTEXT, max_running_requests=REQUESTS, kv_tokens=REQUESTS * CONTEXT * 2,
                      port=port, ess_config=ESS_CONFIG)
    logs = Path(os.environ.get("ESS_SERVER_LOGS", tmp_path))  # where the servers' logs go (default: tmp_path)
    with Server(spec, logs / f"server_{system}.log", tmp_path) as server:
        results, wall, running = run_requests(spec.url, prompts, DECODE_STEPS, REQUESTS)
        # the idle check that follows the requests: the count grows past what it is once they are done (the next
        # check at the latest, IDLE_RECHECK_S later, if the first already ran)
        done = metric_sum(scrape(spec.url), "sglang:ess_invariant_checks_total", IDLE)
        metrics = _after_idle_check(spec.url, done) if system == "ess" else scrape(spec.url)
        print(f"\n{system}: {REQUESTS} x {DECODE_STEPS} tokens in {wall:.2f} s, at most {running} running; log "
              f"{server.log_path}")
    errors = [r.error for r in results if r.error]
    assert not errors, f"{system}: {errors[0]}"
    return results, metrics


def test_ess_server_is_token_identical_to_the_all_hbm_server(tmp_path):
    prompts = make_prompts(REQUESTS, PROMPT_TOKENS, seed=8192)
    ess, metrics = _serve("ess", tmp_path, 31101, prompts)  # first: the server more likely to fail fails fast
    hbm, _ = _serve("hbm", tmp_path, 31100, prompts)
    assert all(len(r.output_ids) == DECODE_STEPS for r in hbm + ess)
    same = [a.output_ids == b.output_ids for a, b in zip(hbm, ess, strict=True)]
    differ = [i for i, s in enumerate(same) if not s]
    # the tokens of dummy weights barely depend on the input: the log-probabilities must match exactly too
    assert all(r.logprobs for r in hbm + ess), "the servers returned no output_token_logprobs"
    differ += [i for i, (a, b) in enumerate(zip(hbm, ess, strict=True)) if a.logprobs != b.logprobs and i not in differ]
    assert not differ, f"ESS output differs from the all-HBM server's in requests {differ}"

    ess_series = sorted(name for name in metrics if name.startswith("sglang:ess_"))
    lookups = metric_sum(metrics, "sglang:ess_lookups_total")
    hits = metric_sum(metrics, "sglang:ess_hits_total")
    h2d = metric_sum(metrics, "sglang:ess_transfer_bytes_total", 'direction="h2d"')
    print(f"ess: {len(ess_series)} sglang:ess_* series; lookups {lookups:.0f}, hit rate "
          f"{hits / lookups if lookups else float('nan'):.3f}, H2D {h2d / 1e6:.1f} MB")
    assert "sglang:num_running_reqs" in metrics  # SGLang's own series, in the same /metrics
    assert {"sglang:ess_lookups_total", "sglang:ess_hits_total", "sglang:ess_misses_total"} <= set(ess_series)
    # every decode step looks up top-k entries of every request in every layer
    assert lookups >= REQUESTS * (DECODE_STEPS - 1) * 2048
    # ESS's self-checks: between decode steps, then at idle, where everything the requests held is back
    checks = {w: metric_sum(metrics, "sglang:ess_invariant_checks_total", f'when="{w}"') for w in ("running", "idle")}
    print(f"ess: self-checks {checks}, violations {metric_sum(metrics, 'sglang:ess_invariant_violations_total'):.0f}")
    assert checks["running"] >= 1 and checks["idle"] >= 2, checks  # one at start-up, one after the requests
    assert metric_sum(metrics, "sglang:ess_invariant_violations_total") == 0
    for idle_zero in ("sglang:ess_host_pool_used_tokens", "sglang:ess_hot_pool_used_slots",
                      "sglang:ess_admitted_requests", "sglang:ess_host_capacity_queue_reqs"):
        assert metric_sum(metrics, idle_zero) == 0, idle_zero
