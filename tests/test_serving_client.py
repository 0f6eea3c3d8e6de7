"""The serving benchmark's client (benchmarks/sglang_server.py) against a stand-in for SGLang's /generate and
/metrics on loopback: streamed cumulative chunks, log-probabilities, errors, and the identity marks of
benchmarks/serving.py."""

import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import serving  # noqa: E402
from sglang_server import make_prompts, run_requests  # noqa: E402

FIRST_GAP_S = 0.05
STALL_S = 0.03


class _Generate(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):  # /metrics
        body = b'sglang:num_running_reqs{model_name="m"} 2\n'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not req["input_ids"]:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "empty prompt"}')
            return
        n = req["sampling_params"]["max_new_tokens"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        ids = [t % 7 for t in req["input_ids"][:n]]
        for i in range(1, n + 1):  # cumulative chunks, as SGLang streams without incremental output
            meta = {"output_token_logprobs": [[-0.5 * j, ids[j], None] for j in range(i)]}
            self.wfile.write(f"data: {json.dumps({'output_ids': ids[:i], 'meta_info': meta})}\n\n".encode())
            self.wfile.flush()
            if i == 1:
                time.sleep(FIRST_GAP_S)  # a wait between the prefill's token and the first decode step
            if i == 3:
                time.sleep(STALL_S)  # a pause in decoding (another request's prefill, a compile)
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Generate)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_streamed_tokens_logprobs_and_errors(url):
    prompts = make_prompts(3, 8, seed=1) + [[]]
    results, wall, _ = run_requests(url, prompts, 4, concurrency=2)
    assert wall > 0
    for p, r in zip(prompts[:3], results[:3], strict=True):
        assert r.error is None and r.output_ids == [t % 7 for t in p[:4]]
        assert r.logprobs == [0.0, -0.5, -1.0, -1.5]
        # the stand-in sleeps FIRST_GAP_S between its first two chunks; the client times each chunk when it has read
        # it, so the gap it sees may come out a little shorter (the first chunk read late) but never near 0
        assert 0 < r.ttft_s <= r.second_s <= r.latency_s and r.first_gap_s >= FIRST_GAP_S / 2
        assert [n for _, n in r.chunks] == [1, 2, 3, 4] and r.chunks[0][0] == r.ttft_s and r.chunks[1][0] == r.second_s
        assert r.longest_decode_gap_s >= STALL_S / 2  # the pause before the fourth token
    assert results[3].error.startswith("HTTP 400") and results[3].output_ids == []


def test_longest_decode_gap_leaves_out_the_first_gap():
    from sglang_server import RequestResult

    r = RequestResult([1, 2, 3, 4], 1.0, 2.0, chunks=[(1.0, 1), (1.5, 2), (1.6, 3), (2.0, 4)], second_s=1.5)
    assert r.first_gap_s == 0.5 and abs(r.longest_decode_gap_s - 0.4) < 1e-9
    assert RequestResult([1, 2], 1.0, 1.5, chunks=[(1.0, 1), (1.5, 2)]).longest_decode_gap_s is None


def test_identity_marks_compare_tokens_and_logprobs():
    base = dict(context=8, concurrency=2)
    rows = [dict(base, system="hbm", outputs=[[1, 2], [3]], logprobs=[[-1.0, -2.0], [-3.0]]),
            dict(base, system="ess", outputs=[[1, 2], [3]], logprobs=[[-1.0, -2.0], [-3.0]]),
            dict(base, system="hisparse", outputs=[[1, 2], [3]], logprobs=[[-1.0, -2.5], [-3.0]]),
            dict(base, system="ess", context=16, outputs=[[1]], logprobs=[[-1.0]])]  # no all-HBM run to compare
    serving.mark_identity(rows)
    assert rows[1]["token_identical_to_hbm"] and rows[1]["logprobs_identical_to_hbm"]
    assert rows[2]["token_identical_to_hbm"] and rows[2]["logprobs_identical_to_hbm"] is False
    assert rows[3]["token_identical_to_hbm"] is None


def test_decode_rate_is_the_median_of_the_fullest_batches_after_the_first():
    from sglang_server import decode_rate

    log = "\n".join([
        "[2026-12-06 10:00:00] Prefill batch, #new-seq: 1, #new-token: 8192, #queue-req: 2",
        "[2026-12-06 10:00:01] Decode batch, #running-req: 2, #token: 16448, token usage: 0.10, cuda graph: True, "
        "gen throughput (token/s): 50.00, #queue-req: 1",
        "[2026-12-06 10:00:02] Decode batch, #running-req: 3, #token: 24640, token usage: 0.15, cuda graph: True, "
        "gen throughput (token/s): 40.00, #queue-req: 0",  # spans the prefill that admitted the third request
        *[f"[2026-12-06 10:00:0{3 + i}] Decode batch, #running-req: 3, #token: 24700, token usage: 0.15, "
          f"cuda graph: True, gen throughput (token/s): {x:.2f}, #queue-req: 0" for i, x in enumerate((600, 580, 620))],
        "[2026-12-06 10:00:09] Decode batch, #running-req: 1, #token: 8300, token usage: 0.05, cuda graph: True, "
        "gen throughput (token/s): 210.00, #queue-req: 0",
    ])
    rate = decode_rate(log)
    assert (rate.running, rate.tok_s, rate.windows) == (3, 600.0, 3)
    assert decode_rate("no decode here").tok_s is None


def test_resume_keeps_earlier_rows_with_their_outputs(tmp_path):
    rows = [{"system": "hbm", "context": 1024, "concurrency": 2, "output_tok_s": 9.0, "outputs": [[1, 2], [3, 4]],
             "logprobs": [[-1.0]] * 2},
            {"system": "ess", "context": 1024, "concurrency": None, "error": "start-up failed"}]
    args = serving.argparse.Namespace(out=tmp_path)
    serving.write(rows, args, serving.time.time())
    kept = serving.earlier_rows(tmp_path)
    assert [(r["system"], r["outputs"]) for r in kept] == [("hbm", [[1, 2], [3, 4]])]  # failed starts are retried


def test_profile_kernel_table_groups_kernels_per_step(tmp_path):
    import gzip

    from serving_profile import kernel_table

    events = [{"cat": "kernel", "name": "attn", "ts": 0, "dur": 30}, {"cat": "kernel", "name": "attn", "ts": 50,
                                                                     "dur": 30},
              {"cat": "kernel", "name": "resolve", "ts": 100, "dur": 100}, {"cat": "cpu_op", "name": "x", "ts": 0,
                                                                            "dur": 999}]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    t = kernel_table(path, steps=2)
    assert t["gpu_ms_per_step"] == 0.08 and t["window_ms_per_step"] == 0.1 and t["gpu_busy_share"] == 0.8
    assert t["host"] == [{"name": "x", "calls_per_step": 0.5, "us_per_step": 499.5}]
    assert [(k["name"], k["us_per_step"], k["calls_per_step"]) for k in t["kernels"]] == [("resolve", 50, 0.5),
                                                                                           ("attn", 30, 1.0)]


def test_profile_transition_table_shows_busy_and_idle_stretches_beside_host_spans(tmp_path):
    import gzip

    from serving_profile import transition_table

    events = [{"cat": "kernel", "name": "prefill", "ts": 0, "dur": 10_000},
              {"cat": "kernel", "name": "copy", "ts": 10_020, "dur": 1_000},  # 20 us later: the same stretch
              {"cat": "kernel", "name": "decode", "ts": 15_000, "dur": 4_000},
              {"cat": "python_function", "name": "sglang/x.py(1): build", "ts": 11_500, "dur": 3_000, "tid": 7},
              {"cat": "python_function", "name": "numpy/y.py(1): other", "ts": 11_500, "dur": 3_000, "tid": 7},
              {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 16_000, "dur": 150, "tid": 7},
              {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 14_900, "dur": 300, "tid": 7}]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    t = transition_table(path, tail_ms=9.0)  # from 10 ms: the prefill's stretch starts before the window
    assert [(g["busy"], round(g["start_ms"], 2), round(g["ms"], 2)) for g in t["gpu"]] == [
        (True, -10.0, 11.02), (False, 1.02, 3.98), (True, 5.0, 4.0)]
    assert t["gpu"][0]["kernels"] == ["10000 us prefill", "1000 us copy"]
    assert [(h["name"], h["start_ms"]) for h in t["host"]] == [("sglang/x.py(1): build", 1.5),
                                                               ("cudaGraphLaunch", 4.9)]  # 150 us: under 200


def test_profile_busy_time_counts_overlapping_kernels_once():
    """A kernel that starts while the one before it runs (programmatic dependent launch) and waits: summed durations
    count the overlap twice, busy time once; each name's time alone excludes it."""
    from serving_profile import busy_and_alone

    kernels = [{"name": "lookup", "ts": 0, "dur": 10}, {"name": "ages", "ts": 4, "dur": 12},  # ages waits 4-10
               {"name": "attn", "ts": 20, "dur": 5}, {"name": "attn", "ts": 22, "dur": 5}]  # two streams
    busy, alone = busy_and_alone(kernels)
    assert busy == 16 + 7
    assert alone == {"lookup": 4, "ages": 6, "attn": 7}


def test_profile_kernel_diff_counts_one_systems_own_kernels_alone(tmp_path):
    import gzip

    from serving_profile import kernel_diff

    def trace(name, kernels):
        path = tmp_path / f"{name}.trace.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": [dict(k, cat="kernel") for k in kernels]}, f)
        return path

    ess = trace("ess", [{"name": "attn", "ts": 0, "dur": 10}, {"name": "lookup", "ts": 10, "dur": 3},
                        {"name": "ages", "ts": 11, "dur": 4}, {"name": "attn", "ts": 14, "dur": 10}])
    hbm = trace("hbm", [{"name": "attn", "ts": 0, "dur": 10}, {"name": "attn", "ts": 10, "dur": 10}])
    d = kernel_diff(ess, hbm, steps=1)
    assert d["us_per_step_a"] - d["us_per_step_b"] == 7 and d["busy_us_per_step_a"] - d["busy_us_per_step_b"] == 4
    assert d["own_alone_us_per_step_a"] == 4  # lookup and ages (overlapping) until attention starts again


def test_plan_files_name_servers_with_their_own_concurrency_and_knobs(tmp_path):
    plans = sorted((ROOT / "benchmarks" / "plans").glob("serving_*.json"))
    assert plans
    for path in plans:
        setups = serving.load_plan(path)
        assert "hbm" in [s.system for s in setups]  # identity and ratios need the all-HBM baseline in the same run
    s32 = {s.name: s for s in serving.load_plan(ROOT / "benchmarks" / "plans" / "serving_32k.json")}
    assert s32["ess-pool15"].ess_config == {"sparse_memory_ratio": 0.15} and s32["ess-pool15"].concurrency == (48,)
    args = serving.argparse.Namespace(hbm_capacity_requests=12, model=serving.MODEL_DIR, output_len=256, port=1,
                                      mem_fraction_static=0.8)
    spec = serving.spec_for(s32["ess-pool15"], 32768, args)
    assert spec.max_running_requests == 48 and spec.ess_config["sparse_memory_ratio"] == 0.15
    assert spec.ess_config["max_kv_cache_gb"] > 2
    few = tmp_path / "few.json"  # a few requests against the layout of 48
    few.write_text(json.dumps({"servers": [{"name": "e", "system": "ess", "concurrency": [1, 2],
                                            "max_running_requests": 48}]}))
    assert serving.spec_for(serving.load_plan(few)[0], 32768, args).max_running_requests == 48


@pytest.mark.parametrize("server, says", [
    ({"name": "x", "system": "vllm", "concurrency": [1]}, "system 'vllm'"),
    ({"name": "x", "system": "ess", "concurrency": [0]}, "positive integers"),
    ({"name": "x", "system": "ess", "concurrency": [1], "ess_config": {"sparse_memory_ratio": 7}},
     "sparse_memory_ratio"),
    ({"name": "x", "system": "hbm", "concurrency": [1], "ess_config": {}}, "ess_config on a hbm server"),
    ({"name": "x", "system": "hbm"}, "needs name, system and concurrency"),
    ({"name": "x", "system": "ess", "concurrency": [4], "max_running_requests": 2}, "max_running_requests must"),
])
def test_a_bad_plan_entry_fails_before_any_server_starts(tmp_path, server, says):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"servers": [server]}))
    with pytest.raises(ValueError, match=re.escape(says)):
        serving.load_plan(path)
    with pytest.raises(SystemExit):
        serving.main(["--plan", str(path), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_kernels_compiled_while_serving_are_read_from_tritons_cache(tmp_path, monkeypatch):
    """A variant is a folder of Triton's cache holding ``<kernel>.json`` beside its group file; the folder follows
    TRITON_CACHE_DIR, else TRITON_HOME, as Triton's own lookup does."""
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    cache = serving.triton_cache()
    assert cache == tmp_path / ".triton" / "cache" and serving.compiled_kernels(cache) == {}
    for entry, name in (("A1", "_lookup_kernel"), ("B2", "_copy_rows_masked_kernel"), ("C3", "_lookup_kernel")):
        (cache / entry).mkdir(parents=True)
        (cache / entry / f"{name}.json").write_text("{}")
        (cache / entry / f"__grp__{name}.json").write_text("{}")
        (cache / entry / f"{name}.cubin").write_bytes(b"")
    before = {"A1": "_lookup_kernel"}
    new = sorted(n for e, n in serving.compiled_kernels(cache).items() if e not in before)
    assert new == ["_copy_rows_masked_kernel", "_lookup_kernel"]
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert serving.triton_cache() == tmp_path / "elsewhere"


def test_other_jit_compilers_outputs_count_as_compiled_while_serving(tmp_path, monkeypatch):
    """A shared object or cubin that tvm-ffi, FlashInfer, DeepGEMM (under ~/.cache) or torch.compile (its temporary
    folder) writes is listed by path beside Triton's kernels; pip's cache and other files are not."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setenv("USER", "ess")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_HOME", raising=False)
    assert serving.compiled_now() == {}
    written = ["home/.cache/tvm-ffi/hisparse_abc/lib.so", "home/.cache/deep_gemm/cache/kernel.cubin",
               "tmp/torchinductor_ess/xy/cxy.so", "home/.triton/cache/A1/_lookup_kernel.json",
               "home/.cache/pip/wheels/x.so", "home/.cache/tvm-ffi/hisparse_abc/build.ninja"]
    for rel in written:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert sorted(serving.compiled_now().values()) == [
        ".cache/deep_gemm/cache/kernel.cubin", ".cache/tvm-ffi/hisparse_abc/lib.so", "_lookup_kernel",
        "torchinductor_ess/xy/cxy.so"]
