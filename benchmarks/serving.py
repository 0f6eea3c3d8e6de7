"""Serving benchmark: the same SGLang server three ways on one GPU, with the same KV-cache HBM budget.

* ``hbm``: every latent in HBM (``--dsa-prefill-backend flashmla_kv --dsa-decode-backend flashmla_kv``), its KV pool
  capped at ``--hbm-capacity-requests`` full-context requests (``--max-total-tokens``), as a capacity-bound decode
  instance is;
* ``hisparse``: SGLang's own ``--enable-hisparse`` at the same device bytes;
* ``ess``: ``--enable-ess`` with ``max_kv_cache_gb`` set to the same device bytes.

Each server gets the same requests (fixed seeds, greedy, ``ignore_eos``, token ids: the model is the DeepSeek-V3.2-
shaped config under configs/models/ with dummy weights) at every concurrency, and reports requests running at once
(SGLang's fullest decode batch, from its log), output tok/s (client: every output token over the wall time, prefills
included), decode tok/s (the server's own ``gen throughput`` at its fullest decode batch: what a decode instance
delivers), TPOT and TTFT p50/p99, the wait between each request's first and second token and the longest pause in
decoding after it (a prefill or staging beside it, a compile), the kernels any JIT compiled on the machine while the
requests were served (``compiled_while_serving``), ESS's hit rate and H2D GB/s from ``/metrics``, and
whether every request's output tokens equal the all-HBM server's at the same concurrency. A system that decodes
fewer requests than were sent at one concurrency is capacity-bound and is not sent more. Writes
``serving.json`` and ``serving.png`` under ``--out`` (benchmarks/results/serving/ by default). Runs on the GPU
machine inside scripts/sglang_site.sh.

    scripts/sglang_site.sh python3 benchmarks/serving.py --contexts 32768 --concurrency 1,2,4,8,16

``--plan FILE`` (JSON, benchmarks/plans/) runs named servers instead, each with its own concurrency list and sizing
knobs, so that one run holds each system's best configuration beside the baselines it is compared with::

    {"servers": [{"name": "hbm", "system": "hbm", "concurrency": [1, 2, 48]},
                 {"name": "ess-pool15", "system": "ess", "concurrency": [48],
                  "ess_config": {"sparse_memory_ratio": 0.15}}]}

Rows carry the server's ``name`` beside its ``system``; identity is always marked against the all-HBM rows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_server import (  # noqa: E402
    MODEL_DIR,
    PAGE_SIZE,
    SYSTEMS,
    Server,
    ServerError,
    ServerSpec,
    decode_rate,
    kv_bytes_per_token,
    make_prompts,
    metric_sum,
    model_layers,
    run_requests,
    scrape,
)

from ess_sglang.config import EssConfig, EssConfigError, validate_mapping  # noqa: E402

GIB = 1 << 30


def percentile(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


def triton_cache() -> Path:
    """Where Triton keeps the kernels it compiled on this machine (its own rule: TRITON_CACHE_DIR, else
    TRITON_HOME or the home folder, then .triton/cache); the servers this benchmark starts inherit its environment."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    return Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache"


def compiled_kernels(cache: Path) -> dict[str, str]:
    """{cache entry: kernel name} of every kernel Triton has compiled into `cache` (a folder per compiled variant
    holding ``<kernel name>.json``; ``__grp__*`` files list a variant's files)."""
    if not cache.is_dir():
        return {}
    return {meta.parent.name: meta.stem for meta in cache.glob("*/*.json") if not meta.name.startswith("__grp__")}


# What the other just-in-time compilers of a server leave: tvm-ffi, FlashInfer and DeepGEMM build shared objects or
# cubins under ~/.cache; torch.compile writes its generated code under the temporary folder.
JIT_SUFFIXES = (".so", ".cubin")


def jit_caches() -> list[Path]:
    """The folders other than Triton's where a server's just-in-time compilers write what they build."""
    user = os.environ.get("USER") or os.environ.get("LOGNAME") or "root"
    return [Path.home() / ".cache", Path(os.environ.get("TMPDIR") or "/tmp") / f"torchinductor_{user}"]


def compiled_now() -> dict[str, str]:
    """{cache entry: what it is} of every kernel compiled on this machine so far: Triton's by kernel name, the other
    compilers' by their file (a path under one of `jit_caches()`; pip's own cache left out)."""
    found = {f"triton:{entry}": name for entry, name in compiled_kernels(triton_cache()).items()}
    for root in jit_caches():
        if not root.is_dir():
            continue
        for path in root.rglob("*"):
            rel = path.relative_to(root)
            if rel.parts[0] != "pip" and path.suffix in JIT_SUFFIXES and path.is_file():
                found[str(path)] = f"{root.name}/{rel}"
    return found


def ess_counters(url: str) -> dict[str, float]:
    m = scrape(url)
    return {"lookups": metric_sum(m, "sglang:ess_lookups_total"), "hits": metric_sum(m, "sglang:ess_hits_total"),
            "misses": metric_sum(m, "sglang:ess_misses_total"),
            "h2d_bytes": metric_sum(m, "sglang:ess_transfer_bytes_total", 'direction="h2d"'),
            "series": float(sum(1 for k in m if k.startswith("sglang:ess_")))}


@dataclass(frozen=True)
class Setup:
    """One server of a run: a system with its sizing knobs, and the request counts sent to it at once."""

    name: str
    system: str
    concurrency: tuple[int, ...]
    ess_config: dict = field(default_factory=dict)
    hisparse_ratio: int = 8
    max_running_requests: int | None = None
    """--max-running-requests (None: the largest concurrency); it sizes ESS's layout and warm-up share, so setups
    compared at a few requests keep the one their full-load run has."""


PLAN_KEYS = {"name", "system", "concurrency", "ess_config", "hisparse_ratio", "max_running_requests"}


def load_plan(path: Path) -> list[Setup]:
    """The servers of a plan file; a bad entry fails here, naming what is wrong, before any server starts."""
    try:
        servers = json.loads(path.read_text())["servers"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--plan {path}: not a JSON object with a 'servers' list ({exc})") from None
    setups = []
    for i, s in enumerate(servers):
        where = f"--plan {path}: servers[{i}]"
        if not isinstance(s, dict) or set(s) - PLAN_KEYS or not {"name", "system", "concurrency"} <= set(s):
            raise ValueError(f"{where}: needs name, system and concurrency (optional: ess_config, hisparse_ratio, "
                             f"max_running_requests); got {s!r}")
        if s["system"] not in SYSTEMS:
            raise ValueError(f"{where}: system {s['system']!r} is not one of {', '.join(SYSTEMS)}")
        if s.get("ess_config") is not None and s["system"] != "ess":
            raise ValueError(f"{where}: ess_config on a {s['system']} server")
        try:
            validate_mapping(EssConfig, s.get("ess_config") or {}, f"{where}.ess_config")
        except EssConfigError as exc:
            raise ValueError(str(exc)) from None
        conc = s["concurrency"]
        if not conc or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in conc):
            raise ValueError(f"{where}: concurrency must be a list of positive integers, got {conc!r}")
        most = s.get("max_running_requests")
        if most is not None and (not isinstance(most, int) or isinstance(most, bool) or most < max(conc)):
            raise ValueError(f"{where}: max_running_requests must be an integer >= its largest concurrency "
                             f"{max(conc)}, got {most!r}")
        setups.append(Setup(str(s["name"]), s["system"], tuple(conc), dict(s.get("ess_config") or {}),
                            int(s.get("hisparse_ratio", 8)), most))
    names = [x.name for x in setups]
    if len(set(names)) != len(names):
        raise ValueError(f"--plan {path}: server names repeat ({', '.join(names)})")
    return setups


def spec_for(setup: Setup, context: int, args) -> ServerSpec:
    """The server of one setup at one context length; every system gets the same KV HBM bytes."""
    kv_tokens = args.hbm_capacity_requests * (context + PAGE_SIZE)
    kv_bytes = kv_tokens * kv_bytes_per_token(args.model)
    spec = ServerSpec(setup.system, context_len=context + args.output_len + PAGE_SIZE,
                      max_running_requests=setup.max_running_requests or max(setup.concurrency),
                      kv_tokens=kv_tokens, port=args.port, model_dir=args.model,
                      mem_fraction_static=args.mem_fraction_static)
    if setup.system == "ess":
        spec.ess_config = {"max_kv_cache_gb": kv_bytes / GIB, **setup.ess_config}
    elif setup.system == "hisparse":
        ratio = setup.hisparse_ratio
        # device latents of every device slot + indexer entries of ratio x as many logical locations
        per_device_token = model_layers(args.model) * (656 + ratio * 132)
        spec.hisparse_device_tokens = kv_bytes // per_device_token // PAGE_SIZE * PAGE_SIZE
        spec.hisparse_config = {"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": ratio}
    return spec


LOGPROBS = {"hbm": True, "ess": True, "hisparse": False}
"""Which systems' requests ask for their output tokens' log-probabilities (compared exactly with all-HBM's). Not
HiSparse's: SGLang's HiSparse decode batch then asks for every prompt token's log-probability at every step (2.3 ms of
host time per request per step at 32K, ess_sglang/sglang_plugin/decode_batch.py; ESS undoes it), which would measure
that bug instead of HiSparse. Its outputs are compared token by token."""


def run_setup(setup: Setup, context: int, args, out: Path) -> list[dict]:
    spec = spec_for(setup, context, args)
    server = Server(spec, out / f"server_{setup.name}_{context}.log", out)
    system, name = setup.system, setup.name
    rows = []
    try:
        up_s = server.start()
        print(f"[{name} {context}] up in {up_s:.0f} s", flush=True)
        # one full-length request first: compiles and warms what the first real batch would otherwise time
        run_requests(spec.url, make_prompts(1, context - args.output_len, seed=7), 8, 1)
        for c in setup.concurrency:
            prompts = make_prompts(c, context - args.output_len, seed=context)
            before = ess_counters(spec.url) if system == "ess" else None
            log_at = len(server.log_text())
            cached = compiled_now()
            results, wall, running = run_requests(spec.url, prompts, args.output_len, c, logprobs=LOGPROBS[system])
            compiled = sorted(name for entry, name in compiled_now().items() if entry not in cached)
            errors = [r.error for r in results if r.error]
            after = ess_counters(spec.url) if system == "ess" else None
            rate = decode_rate(server.log_text()[log_at:])
            # admitted: the fullest decode batch in SGLang's log. SGLang's num_running_reqs (polled) also counts
            # requests still staging to host memory: HiSparse showed 46 there at 32K while it decoded 36 at most.
            admitted = rate.running or running
            row = {"system": system, "name": name, "context": context, "concurrency": c, "admitted": admitted,
                   "running_polled": running, "decode_tok_s": rate.tok_s, "decode_windows": rate.windows,
                   "requests": len(results), "errors": len(errors),
                   "output_tok_s": sum(len(r.output_ids) for r in results) / wall,
                   "tpot_ms_p50": _ms(percentile([r.tpot_s for r in results], 50)),
                   "tpot_ms_p99": _ms(percentile([r.tpot_s for r in results], 99)),
                   "ttft_ms_p50": _ms(percentile([r.ttft_s for r in results], 50)),
                   "ttft_ms_p99": _ms(percentile([r.ttft_s for r in results], 99)),
                   # the wait between the prefill's token and the next one, which TPOT spreads over the request
                   "first_gap_ms_p50": _ms(percentile([r.first_gap_s for r in results], 50)),
                   "first_gap_ms_max": _ms(max((r.first_gap_s for r in results if r.first_gap_s is not None),
                                               default=None)),
                   # the longest pause after that, in any request (a prefill or staging beside it, a compile)
                   "decode_gap_ms_max": _ms(max((r.longest_decode_gap_s for r in results
                                                 if r.longest_decode_gap_s is not None), default=None)),
                   "wall_s": wall, "outputs": [r.output_ids for r in results],
                   "logprobs": [r.logprobs for r in results],
                   "hit_rate": None, "h2d_gbps": None, "ess_config": setup.ess_config or None,
                   # kernels first compiled on this machine while these requests were served, by Triton or another
                   # JIT (a compile stalls the scheduler's thread; a later server finds them cached and does not)
                   "compiled_while_serving": compiled}
            if before is not None and after is not None:
                lookups = after["lookups"] - before["lookups"]
                row["hit_rate"] = (after["hits"] - before["hits"]) / lookups if lookups else None
                row["h2d_gbps"] = (after["h2d_bytes"] - before["h2d_bytes"]) / wall / 1e9
                row["ess_series"] = int(after["series"])
            if errors:
                row["first_error"] = errors[0][:300]
            rows.append(row)
            print(f"[{name} {context}] c={c}: {row['output_tok_s']:.0f} tok/s, decode {rate.tok_s} tok/s, decoding "
                  f"{admitted} at once, tpot p50 {row['tpot_ms_p50']} ms, hit {row['hit_rate']}, errors {len(errors)}"
                  + (f", compiled while serving: {', '.join(compiled)}" if compiled else ""), flush=True)
            if admitted < c:  # capacity-bound: more requests at once only queue
                break
    except ServerError as exc:
        rows.append({"system": system, "name": name, "context": context, "concurrency": None,
                     "error": str(exc)[-2000:]})
        print(f"[{name} {context}] FAILED: {exc}", flush=True)
    finally:
        server.stop()
    return rows


def row_name(r: dict) -> str:
    """The server a row (or an outputs.json entry) belongs to: its name, or its system in runs before plans."""
    return r.get("name") or r["system"]


def _ms(s):
    return None if s is None else round(s * 1000, 3)


def mark_identity(rows: list[dict]) -> None:
    """token_identical_to_hbm: every request's output tokens equal the all-HBM server's at the same context and
    concurrency (the same prompts)."""
    ref = {(r["context"], r["concurrency"]): r for r in rows if r["system"] == "hbm" and r.get("outputs") is not None}
    for r in rows:
        base = ref.get((r["context"], r["concurrency"]))
        if r.get("outputs") is None or base is None:
            r["token_identical_to_hbm"] = r["logprobs_identical_to_hbm"] = None
            continue
        same = [a == b for a, b in zip(r["outputs"], base["outputs"], strict=False)]
        r["identical_requests"] = sum(same)
        r["token_identical_to_hbm"] = all(same) and len(same) == len(base["outputs"])
        mine, theirs = r.get("logprobs") or [], base.get("logprobs") or []
        r["logprobs_identical_to_hbm"] = (mine == theirs) if any(mine) and any(theirs) else None


def earlier_rows(out: Path) -> list[dict]:
    """The rows an earlier run wrote to `out` (serving.json), each with its requests' outputs (outputs.json)."""
    if not (out / "serving.json").exists():
        return []
    runs = [r for r in json.loads((out / "serving.json").read_text())["runs"] if r.get("concurrency")]
    outputs = {(row_name(o), o["context"], o["concurrency"]): o
               for o in json.loads((out / "outputs.json").read_text())} if (out / "outputs.json").exists() else {}
    for r in runs:
        r["name"] = row_name(r)
        o = outputs.get((r["name"], r["context"], r["concurrency"]), {})
        r["outputs"], r["logprobs"] = o.get("outputs"), o.get("logprobs")
    return runs


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4), squeeze=False)
    for ax, ctx in zip(axes[0], contexts, strict=False):
        names = dict.fromkeys(row_name(r) for r in rows)
        for name in names:
            pts = sorted((r["concurrency"], r["output_tok_s"]) for r in rows
                         if row_name(r) == name and r["context"] == ctx and r.get("concurrency"))
            if pts:
                ax.plot(*zip(*pts, strict=False), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"context {ctx // 1024}K")
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tok/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(rows: list[dict], args, t0: float) -> dict:
    mark_identity(rows)
    # ESS_COMMIT: the commit of a working tree that travelled without its own git history
    commit = os.environ.get("ESS_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                            capture_output=True, text=True).stdout.strip()
    try:
        device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True).stdout.strip() or "unknown"
    except FileNotFoundError:
        device = "unknown (no nvidia-smi)"
    doc = {"commit": commit, "device": device, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv), "wall_s": round(time.time() - t0),
           "runs": [{k: v for k, v in r.items() if k not in ("outputs", "logprobs")} for r in rows]}
    (args.out / "serving.json").write_text(json.dumps(doc, indent=1))
    # every request's output tokens, so that a later run on the same prompts can be checked against this one
    (args.out / "outputs.json").write_text(json.dumps(
        [{**{k: r.get(k) for k in ("system", "context", "concurrency", "outputs", "logprobs")},
          "name": row_name(r)} for r in rows
         if r.get("outputs")]))
    if any(r.get("concurrency") for r in rows):
        plot(rows, args.out / "serving.png")
    return doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="hbm,hisparse,ess", help="comma-separated: hbm, hisparse, ess")
    p.add_argument("--contexts", default="32768", help="comma-separated context lengths (prompt + output)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated request counts sent at once")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--hbm-capacity-requests", type=int, default=8,
                   help="the all-HBM KV pool holds this many full-context requests (sets every system's HBM bytes)")
    p.add_argument("--hisparse-ratio", type=int, default=8, help="HiSparse host_to_device_ratio")
    p.add_argument("--ess-config", default='{"sparse_memory_ratio": 0.05}', help="ESS config keys (JSON)")
    p.add_argument("--mem-fraction-static", type=float, default=0.80, help="SGLang --mem-fraction-static")
    p.add_argument("--model", type=Path, default=MODEL_DIR, help="model folder (config.json, dummy weights)")
    p.add_argument("--port", type=int, default=31000, help="server port")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/serving"), help="output folder")
    p.add_argument("--resume", action="store_true",
                   help="keep the servers and contexts --out already measured (with their outputs, for the identity "
                        "marks) and run only the others")
    p.add_argument("--plan", type=Path, help="JSON file of named servers, each with its own concurrency and sizing "
                                             "knobs (replaces --systems, --concurrency, --ess-config, "
                                             "--hisparse-ratio)")
    args = p.parse_args(argv)
    if args.plan is not None:
        try:
            setups = load_plan(args.plan)
        except ValueError as exc:
            p.error(str(exc))
    else:
        systems = args.systems.split(",")
        bad = [s for s in systems if s not in SYSTEMS]
        if bad:
            p.error(f"--systems: unknown {', '.join(bad)} (choose from {', '.join(SYSTEMS)})")
        conc = tuple(int(x) for x in args.concurrency.split(","))
        setups = [Setup(s, s, conc, json.loads(args.ess_config) if s == "ess" else {}, args.hisparse_ratio)
                  for s in systems]
    args.out.mkdir(parents=True, exist_ok=True)
    # a run stopped from outside (timeout, Ctrl-C) still stops its server: it runs in a process group of its own
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows: list[dict] = earlier_rows(args.out) if args.resume else []
    t0 = time.time()
    for ctx in [int(x) for x in args.contexts.split(",")]:
        for setup in setups:
            if any(row_name(r) == setup.name and r["context"] == ctx and r.get("concurrency")
                   for r in rows):
                print(f"[{setup.name} {ctx}] measured earlier in {args.out}: kept")
                continue
            rows += run_setup(setup, ctx, args, args.out)
            write(rows, args, t0)  # after every server, so that a run cut short keeps what it measured
    doc = write(rows, args, t0)
    print(f"{'server':12} {'ctx':>6} {'conc':>4} {'run':>4} {'tok/s':>8} {'decode':>8} {'tpot50':>7} {'ttft50':>8} "
          f"{'hit':>6} {'GB/s':>6} {'same':>5}")
    for r in doc["runs"]:
        if r.get("concurrency") is None:
            print(f"{row_name(r):12} {r['context']:>6} FAILED")
            continue
        hit = f"{r['hit_rate']:.3f}" if r.get("hit_rate") is not None else "-"
        gbps = f"{r['h2d_gbps']:.2f}" if r.get("h2d_gbps") is not None else "-"
        print(f"{row_name(r):12} {r['context']:>6} {r['concurrency']:>4} {r['admitted']:>4} "
              f"{r['output_tok_s']:>8.0f} {r['decode_tok_s'] or 0:>8.0f} {r['tpot_ms_p50'] or 0:>7.2f} "
              f"{r['ttft_ms_p50'] or 0:>8.0f} {hit:>6} {gbps:>6} {str(r.get('token_identical_to_hbm')):>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
