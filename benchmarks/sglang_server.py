"""Start a real SGLang server, send it requests by token ids, read its /metrics: what benchmarks/serving.py and the
server GPU test (tests/gpu/test_gpu_server.py) share. Standard library only (no SGLang import: the
server runs in its own process, `python3 -m sglang.launch_server`).

The model is the DeepSeek-V3.2-shaped config under configs/models/ with dummy weights (``--load-format dummy``) and
no tokenizer (``--skip-tokenizer-init``): requests go to ``/generate`` with ``input_ids``, greedy, ``ignore_eos``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "configs" / "models" / "deepseek-v32-small"
PAGE_SIZE = 64
LATENT_BYTES = 656
INDEXER_BYTES = 132
SYSTEMS = ("hbm", "hisparse", "ess")
DECODE_LOG_INTERVAL = 16
SERVER_ENV = {
    # Without HiSparse, SGLang's DSA prefill runs a dense "MHA one-shot" kernel through FA3 for sequences up to this
    # many tokens (DeepseekSparseAttnBackend.set_dsa_prefill_impl); HiSparse and ESS never take it. 0 keeps every
    # system on the same sparse MLA prefill (the same numerics) and needs no FA3 library.
    "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0",
}


def model_layers(model_dir: Path = MODEL_DIR) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])


def kv_bytes_per_token(model_dir: Path = MODEL_DIR) -> int:
    """Device bytes a token's KV takes in the all-HBM server: a latent entry and an indexer entry per layer."""
    return model_layers(model_dir) * (LATENT_BYTES + INDEXER_BYTES)


@dataclass
class ServerSpec:
    system: str  # "hbm" | "hisparse" | "ess"
    context_len: int
    max_running_requests: int
    kv_tokens: int
    """The all-HBM server's KV capacity in tokens (--max-total-tokens); HiSparse and ESS get the same HBM bytes."""
    port: int = 31000
    model_dir: Path = MODEL_DIR
    mem_fraction_static: float = 0.80
    cuda_graph_max_bs: int | None = None
    ess_config: dict = field(default_factory=dict)
    hisparse_config: dict = field(default_factory=dict)
    hisparse_device_tokens: int | None = None
    """HiSparse's device pool in tokens (--max-total-tokens there); None: kv_tokens."""
    extra_args: list[str] = field(default_factory=lambda: ["--disable-prefill-cuda-graph",
                                                          "--decode-log-interval", str(DECODE_LOG_INTERVAL)])
    """Every system runs without SGLang's prefill CUDA graphs (capturing 42 token counts took 200 s at start-up on an
    H100, most of it JIT); decode runs in CUDA graphs as it does in production. Decode batches are logged every
    DECODE_LOG_INTERVAL steps (SGLang's default is 40), so that a few hundred output tokens give a decode rate."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self, config_dir: Path) -> list[str]:
        a = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model_dir),
             "--load-format", "dummy", "--skip-tokenizer-init", "--kv-cache-dtype", "fp8_e4m3",
             "--page-size", str(PAGE_SIZE), "--context-length", str(self.context_len),
             "--mem-fraction-static", str(self.mem_fraction_static),
             "--max-running-requests", str(self.max_running_requests),
             "--cuda-graph-max-bs", str(self.cuda_graph_max_bs or self.max_running_requests),
             "--host", "127.0.0.1", "--port", str(self.port), "--enable-metrics", "--log-level", "info"]
        if self.system == "hbm":
            a += ["--dsa-prefill-backend", "flashmla_kv", "--dsa-decode-backend", "flashmla_kv",
                  "--max-total-tokens", str(self.kv_tokens)]
        elif self.system == "hisparse":
            a += ["--enable-hisparse", "--disable-radix-cache"]
            if self.hisparse_config:
                a += ["--hisparse-config", json.dumps(self.hisparse_config)]
            a += ["--max-total-tokens", str(self.hisparse_device_tokens or self.kv_tokens)]
        elif self.system == "ess":
            import yaml

            path = config_dir / f"ess-{self.context_len}.yaml"
            path.write_text(yaml.safe_dump({"ess_config": self.ess_config}))
            a += ["--enable-ess", "--ess-config", str(path)]
        else:
            raise ValueError(f"unknown system {self.system!r}: one of {', '.join(SYSTEMS)}")
        return a + list(self.extra_args)


class ServerError(RuntimeError):
    pass


class Server:
    """One SGLang server process; its log goes to `log_path`."""

    def __init__(self, spec: ServerSpec, log_path: Path, config_dir: Path):
        self.spec = spec
        self.log_path = log_path
        self.argv = spec.argv(config_dir)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 900) -> float:
        env = dict(os.environ, **SERVER_ENV)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text(" ".join(self.argv) + "\n")
        t0 = time.time()
        with open(self.log_path, "a") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd="/tmp")  # not the source tree: the
            # installed package (ess_sglang.kernels lives in kernels/ there) must win over ./ess_sglang
        while time.time() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.spec.system} server exited with {self.proc.returncode} during start-up; "
                                  f"last lines of {self.log_path}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.spec.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.time() - t0
            except Exception:
                pass
            time.sleep(2)
        self.stop()
        raise ServerError(f"{self.spec.system} server not up after {timeout_s:.0f} s; last lines:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except Exception:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


# ---------------------------------------------------------------------------------------------- requests

def make_prompts(n: int, prompt_len: int, seed: int, vocab: int = 129280) -> list[list[int]]:
    """`n` prompts of `prompt_len` token ids, the same for every system (seeded)."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(prompt_len)] for _ in range(n)]


@dataclass
class RequestResult:
    output_ids: list[int]
    ttft_s: float
    latency_s: float
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)
    """Each output token's log-probability as the server reports it (``return_logprob``): compared exactly between
    systems beside the tokens. With dummy weights the greedy tokens barely depend on the input (every request may
    decode the same short cycle), so equal tokens alone say little; equal log-probabilities say the logits matched."""

    second_s: float | None = None
    """Time to the first chunk that carries a second output token: ``second_s - ttft_s`` is the wait between the
    prefill's token and the first decode step (a prefill of another request, staging to host memory)."""

    chunks: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since the request was sent, output tokens so far) of every chunk that carried output tokens: whether
    the first chunk already holds two tokens (the server sent the prefill's token only after the first decode step)."""

    @property
    def tpot_s(self) -> float | None:
        n = len(self.output_ids)
        return (self.latency_s - self.ttft_s) / (n - 1) if n > 1 else None

    @property
    def first_gap_s(self) -> float | None:
        return None if self.second_s is None else self.second_s - self.ttft_s

    @property
    def longest_decode_gap_s(self) -> float | None:
        """The longest wait between two chunks after the one that carried the second token: a pause in decoding (another
        request's prefill or staging, a kernel compiled while serving); None with fewer than three chunks."""
        times = [t for t, _ in self.chunks[1:]]
        return max((b - a for a, b in zip(times[:-1], times[1:], strict=True)), default=None)


def _one(url: str, prompt: list[int], max_new_tokens: int, timeout_s: float = 3600,
         logprobs: bool = True) -> RequestResult:
    """One streamed /generate request; TTFT is the time to the first chunk that carries output tokens. `logprobs`:
    ask for each output token's log-probability (``return_logprob``)."""
    body = json.dumps({"input_ids": prompt, "stream": True, "return_logprob": logprobs,
                       "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                           "ignore_eos": True}}).encode()
    host, port = url.removeprefix("http://").split(":")
    t0 = time.perf_counter()
    ttft = second = None
    out: list[int] = []
    logprobs: list[float] = []
    chunks: list[tuple[float, int]] = []
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return RequestResult([], 0.0, time.perf_counter() - t0,
                                 f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:500]}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                return RequestResult(out, ttft or 0.0, time.perf_counter() - t0, str(chunk["error"]))
            ids = chunk.get("output_ids") or []
            if ids:
                now = time.perf_counter() - t0
                ttft = now if ttft is None else ttft
                out = list(ids)  # cumulative (non-incremental streaming)
                chunks.append((now, len(out)))
                if len(out) >= 2 and second is None:
                    second = now
            lp = (chunk.get("meta_info") or {}).get("output_token_logprobs")
            if lp:
                logprobs = [float(x[0]) for x in lp]  # (logprob, token id, text) each
    except Exception as exc:
        return RequestResult(out, ttft or 0.0, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}", logprobs,
                             chunks=chunks)
    finally:
        conn.close()
    return RequestResult(out, ttft or 0.0, time.perf_counter() - t0, logprobs=logprobs, second_s=second,
                         chunks=chunks)


def run_requests(url: str, prompts, max_new_tokens: int, concurrency: int, logprobs: bool = True):
    """Send `prompts` with at most `concurrency` in flight; (results, wall seconds, most requests seen running,
    read from SGLang's ``sglang:num_running_reqs`` every half second). `logprobs`: each request asks for its output
    tokens' log-probabilities."""
    running = [0]
    done = threading.Event()

    def poll():
        while not done.wait(0.5):
            with contextlib.suppress(Exception):  # a scrape that fails while the server is busy: try again
                running[0] = max(running[0], int(metric_sum(scrape(url), "sglang:num_running_reqs")))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda p: _one(url, p, max_new_tokens, logprobs=logprobs), prompts))
    wall = time.perf_counter() - t0
    done.set()
    poller.join()
    return results, wall, running[0]


# ---------------------------------------------------------------------------------------------- /metrics

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def scrape(url: str) -> dict[str, list[tuple[str, float]]]:
    """/metrics as {series name: [(labels text, value)]}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            out.setdefault(m.group(1), []).append((m.group(2) or "", float(m.group(3))))
    return out


_DECODE_LINE = re.compile(r"Decode batch.*?#running-req: (\d+),.*?gen throughput \(token/s\): ([0-9.]+)")


@dataclass
class DecodeRate:
    """The server's decode rate at its fullest batch, from its own ``Decode batch`` log lines (what SGLang reports as
    ``gen throughput`` and exports as ``sglang:gen_throughput``)."""

    running: int
    """The most requests one decode batch held."""
    tok_s: float | None
    """Median gen throughput over the log windows with that many requests running, less the first (it may span the
    prefill that admitted the last request); None when there were none."""
    windows: int


def decode_rate(log_text: str) -> DecodeRate:
    lines = [(int(m.group(1)), float(m.group(2))) for m in _DECODE_LINE.finditer(log_text)]
    if not lines:
        return DecodeRate(0, None, 0)
    peak = max(n for n, _ in lines)
    rates = sorted(x for n, x in lines if n == peak)[1:] or [x for n, x in lines if n == peak]
    rates = sorted(rates)
    return DecodeRate(peak, rates[len(rates) // 2], len(rates))


def metric_sum(metrics: dict, name: str, label: str | None = None) -> float:
    """Sum of a series over its label sets (only those containing `label`, when given)."""
    return sum(v for labels, v in metrics.get(name, []) if label is None or label in labels)
