"""DSA indexer decode logits on the GPU: our Triton kernel against the byte floor, the torch reference and DeepGEMM.

DeepSeek-V3.2 shapes: 64 index heads x 128, one query token per request (Q=1), fp8 e4m3 q with its per-(token, head)
scale folded into the head weights (as SGLang feeds DeepGEMM's fp8_paged_mqa_logits), 132-B indexer K entries
(128 fp8 + an fp32 scale) in one flat [locations, 132] cache, read through req_to_token with SGLang's page size of 64
(each request's pages at random places in the cache). In one run:
  1. correctness first: the kernel (every q dtype / dot mode and tile configuration) against the torch reference on the
     GPU at small sizes and at the smallest timed size; max relative error and top-2048 agreement are recorded;
  2. a large device-to-device torch copy: the achieved HBM bandwidth (read + write bytes) every ratio is taken against;
  3. for batch 16 / 64 / 128 at context 32K and 128K: kernel time (CUDA events, median, rotating request tables over
     disjoint cache regions and rotating queries, so nothing is served from L2), achieved GB/s, and the byte floor:
     keys (B x ctx x 132 B) + request-table reads (B x ctx x 4 B) + the fp32 logits written (B x ctx x 4 B), at the
     measured copy bandwidth; the torch reference's time as the baseline (it materialises fp32 keys and per-head dots,
     so it is skipped where it would not fit);
  4. DeepGEMM's fp8_paged_mqa_logits, where `deep_gemm` imports (on the test GPU it does not: the reason is recorded);
     where it runs, its logits and top-k are compared with ours.

    python benchmarks/indexer.py --out benchmarks/results      (prints a table last; writes indexer.json / .png)
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from ess_sglang.kernels.indexer import (
    BLOCK_T,
    NUM_WARPS,
    STAGES,
    TILES,
    indexer_logits_reference,
    indexer_logits_triton,
    indexer_topk,
    quantize_index_q,
)
from timing import median_us, run_info  # benchmarks/timing.py (run these files as scripts)

from ess_sglang.formats import FP8, FP8_MAX, INDEXER_ENTRY_BYTES

H, D, PAGE, TOPK = 64, 128, 64, 2048
BATCHES = [16, 64, 128]
CONTEXTS = [32768, 131072]
# (positions per tile, warps, tiles per program, stages); first = the kernel's default (one tile a program since
# 4860304, 2026-12-01: with bf16 queries, which the decode stacks run, 294.9 / 1,136.3 us against 8 tiles' 307.1 /
# 1,159.5 at batch 64, 32K / 128K, benchmarks/RESULTS.md), then others for comparison: the one-tile kernel of 64
# positions the 8-tile one replaced (2026-11-30: 0.75-0.79 x its time at batch 64-128), and EIGHT_TILES, the default
# before, timed with bf16 queries too
EIGHT_TILES = (BLOCK_T, NUM_WARPS, 8, STAGES)
CONFIGS = [(BLOCK_T, NUM_WARPS, TILES, STAGES), (64, 4, 1, 1), (128, 4, 4, 2), (128, 4, 16, 2), (64, 4, 8, 2),
           EIGHT_TILES]
DEV = "cuda"  # the CPU smoke check of the helpers sets "cpu"
REF_LIMIT_GIB = 60.0  # skip the reference where its intermediates would exceed this
CHECK_BATCH, CHECK_CTX = 8, 4096  # the first correctness check's size


def random_cache(rows, gen, chunk=1 << 20):
    """[rows, 132] uint8 indexer entries: fp8 keys of N(0, 1) values (no NaN bytes), scales around 1/448."""
    dev = torch.device(DEV)
    cache = torch.empty(rows, INDEXER_ENTRY_BYTES, dtype=torch.uint8, device=dev)
    for s in range(0, rows, chunk):
        n = min(chunk, rows - s)
        cache[s:s + n, :D] = (torch.randn(n, D, device=dev, generator=gen) * 64).clamp(-FP8_MAX, FP8_MAX).to(
            FP8).view(torch.uint8)
        scale = (torch.rand(n, 1, device=dev, generator=gen) + 0.5) / FP8_MAX
        cache[s:s + n, D:] = scale.view(torch.uint8)
    return cache


def paged_tables(batch, ctx, sets, gen):
    """`sets` request tables [batch, ctx] over disjoint cache regions; each request's 64-token pages at random places.

    Returns (req_to_token [sets * batch, ctx] int32, page tables [sets, batch, ctx / 64] int32, cache rows)."""
    dev = torch.device(DEV)
    pages_per_req = ctx // PAGE
    total_pages = sets * batch * pages_per_req
    perm = torch.randperm(total_pages, device=dev, generator=gen).to(torch.int32)
    page_tables = perm.view(sets, batch, pages_per_req)
    tok = (page_tables.view(sets * batch, pages_per_req, 1) * PAGE
           + torch.arange(PAGE, device=dev, dtype=torch.int32).view(1, 1, -1))
    return tok.view(sets * batch, ctx).contiguous(), page_tables, total_pages * PAGE


def make_queries(batch, q_tokens, gen, n):
    dev = torch.device(DEV)
    out = []
    for _ in range(n):
        q = torch.randn(batch, q_tokens, H, D, device=dev, generator=gen)
        w = torch.randn(batch, q_tokens, H, device=dev, generator=gen) * H ** -0.5 * D ** -0.5
        out.append((q, w) + quantize_index_q(q, w))
    return out


def rel_error(got, want):
    fin = torch.isfinite(want)
    if not torch.equal(fin, torch.isfinite(got)):
        return float("inf")
    if not fin.any():
        return 0.0
    # relative to each row's largest |logit|: single logits can cancel (signed weights); see tests/test_indexer.py
    row_max = want.masked_fill(~fin, 0).abs().amax(-1, keepdim=True).expand_as(want)
    return ((got - want).abs()[fin] / row_max[fin].clamp_min(1e-30)).max().item()


def topk_agreement(got, want, k=TOPK):
    """Fraction of the reference's top-k positions the kernel's top-k also holds (1.0 without boundary near-ties)."""
    a, b = indexer_topk(got, k), indexer_topk(want, k)
    hits = total = 0
    for ra, rb in zip(a.view(-1, k), b.view(-1, k), strict=True):
        sa, sb = set(ra[ra >= 0].tolist()), set(rb[rb >= 0].tolist())
        hits += len(sa & sb)
        total += len(sb)
    return hits / max(total, 1)


def variants():
    return [("fp8-q fp8-dot", "fp8", True), ("fp8-q bf16-dot", "fp8", False), ("bf16-q", "bf16", True),
            ("fp32-q ieee", "fp32", True)]


def config_name(config):
    block_t, warps, tiles, stages = config
    return f"t{block_t} w{warps} x{tiles} s{stages}"


def run_kernel(q_kind, fp8_dot, qs, cache, r2t, rpi, seq, max_len, config=CONFIGS[0], out=None):
    block_t, warps, tiles, stages = config
    q, w, q8, wf = qs
    if q_kind == "fp8":
        q_in, w_in = q8, wf
    else:
        q_in, w_in = (q.to(torch.bfloat16) if q_kind == "bf16" else q), w
    return indexer_logits_triton(q_in, w_in, cache, r2t, rpi, seq, max_len, out=out, block_t=block_t,
                                 num_warps=warps, fp8_dot=fp8_dot, tiles=tiles, stages=stages)


def reference_inputs(q_kind, qs):
    q, w, q8, wf = qs
    if q_kind == "fp8":
        return q8, wf
    return (q.to(torch.bfloat16) if q_kind == "bf16" else q), w


def correctness(gen, info):
    """Every variant and tile configuration against the torch reference at small sizes (Q = 1 and 2)."""
    checks = []
    for q_tokens in (1, 2):
        batch, ctx = CHECK_BATCH, CHECK_CTX
        r2t, _, rows = paged_tables(batch, ctx, 1, gen)
        cache = random_cache(rows + 7, gen)
        seq = torch.randint(ctx // 2, ctx + 1, (batch,), device=DEV, generator=gen)
        rpi = torch.randperm(batch, device=DEV, generator=gen)
        r2t[rpi[1], 5] = -1  # an out-of-range entry must give -inf, not a fault
        r2t[rpi[2], 9] = rows + 1000
        qs = make_queries(batch, q_tokens, gen, 1)[0]
        for name, q_kind, fp8_dot in variants():
            qi, wi = reference_inputs(q_kind, qs)
            want = indexer_logits_reference(qi, wi, cache, r2t, rpi, seq, ctx)
            for config in list(CONFIGS):
                out = torch.full_like(want, float("nan"))
                try:
                    got = run_kernel(q_kind, fp8_dot, qs, cache, r2t, rpi, seq, ctx, config, out=out)
                except Exception as e:  # noqa: BLE001 - a tile configuration that does not compile is dropped
                    if config == CONFIGS[0]:
                        raise
                    print(f"tile {config_name(config)} dropped ({name}): {type(e).__name__}: {str(e)[:200]}")
                    info.setdefault("dropped_configs", []).append(dict(config=config_name(config), variant=name,
                                                                        error=str(e)[:500]))
                    CONFIGS.remove(config)
                    continue
                err, agree = rel_error(got, want), topk_agreement(got, want)
                checks.append(dict(q_tokens=q_tokens, variant=name, config=config_name(config), max_rel_err=err,
                                   topk_agreement=agree))
                # the opt-in fp8 tensor-core dot does not accumulate in full fp32 (kernels/indexer.py): looser bound
                tol, min_agree = (2e-3, 0.99) if fp8_dot and q_kind == "fp8" else (1e-5, 0.999)
                what = f"{name} Q={q_tokens} {config_name(config)}"
                assert err <= tol, f"{what}: max relative error {err:.3e}"
                assert agree >= min_agree, f"{what}: top-k agreement {agree:.4f}"
    worst = max(c["max_rel_err"] for c in checks)
    print(f"correctness: {len(checks)} kernel runs equal the torch reference (max relative error {worst:.2e}, "
          f"relative to each row's largest logit; bad table entries give -inf)")
    info["correctness"] = checks
    return worst


def copy_bandwidth(gib=4.0):
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    us = median_us(dst.copy_, [(src,)], reps=10)
    return 2 * n / us / 1e3  # GB/s, read + write


def to_deepgemm_layout(cache, rows):
    """Our flat [N, 132] entries (page-contiguous locations) -> SGLang's paged index-K buffer as DeepGEMM reads it:
    per page of 64 tokens, 64 x 128 fp8 values then 64 fp32 scales; viewed [pages, 64, 1, 132]."""
    pages = cache[:rows].view(-1, PAGE, INDEXER_ENTRY_BYTES)
    paged = torch.cat([pages[:, :, :D].reshape(pages.shape[0], -1), pages[:, :, D:].reshape(pages.shape[0], -1)], 1)
    return paged.view(-1, PAGE, 1, INDEXER_ENTRY_BYTES)


def try_deepgemm(batch, ctx, qs, cache, rows, page_table, seq, ours):
    """DeepGEMM's fp8_paged_mqa_logits on the same data; returns (status, us or None)."""
    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001 - any import failure is a result here (torch ABI on the test GPU)
        return f"not available: import deep_gemm failed: {type(e).__name__}: {str(e)[:200]}", None
    try:
        _, _, q8, wf = qs
        kv = to_deepgemm_layout(cache, rows)
        ctx_lens = seq.to(torch.int32).view(-1, 1).contiguous()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        meta = deep_gemm.get_paged_mqa_logits_metadata(ctx_lens, PAGE, sms)
        w2 = wf.view(batch, H).contiguous()

        def call():
            return deep_gemm.fp8_paged_mqa_logits(q8.contiguous(), kv, w2, ctx_lens, page_table, meta, ctx,
                                                  clean_logits=True)

        logits = call().view(batch, 1, ctx)
        agree = topk_agreement(logits.float(), ours)
        us = median_us(call, [()])
        return f"ran: top-{TOPK} agreement with ours {agree:.4f}, max rel err {rel_error(logits.float(), ours):.2e}", us
    except Exception as e:  # noqa: BLE001
        return f"not available: {type(e).__name__}: {str(e)[:200]}", None


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"B{r['batch']}\n{r['context'] // 1024}K" for r in rows]
    x = range(len(rows))
    ax = axes[0]
    ax.bar([i - 0.3 for i in x], [r["floor_us"] for r in rows], 0.2, label="byte floor")
    ax.bar([i - 0.1 for i in x], [r["triton_us"] for r in rows], 0.2, label="Triton (fp8 q, best dot and tile)")
    ax.bar([i + 0.1 for i in x], [r["triton_default_us"] for r in rows], 0.2, label="Triton (default: fp8 q, bf16 dot)")
    ax.bar([i + 0.3 for i in x], [r["reference_us"] or 0 for r in rows], 0.2, label="torch reference")
    ax.set_yscale("log")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("us per layer")
    ax.set_title("DSA indexer decode logits (64 x 128 heads, Q=1)")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar(list(x), [r["triton_gbps"] for r in rows], 0.5, label="Triton achieved")
    ax.axhline(rows[0]["copy_gbps"], color="k", ls="--", label="D2D copy bandwidth")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("GB/s (floor bytes / time)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def bench_one(batch, ctx, gen, copy_gbps, reps):
    """One (batch, context): correctness at this size, then every variant's time, the reference, DeepGEMM."""
    set_bytes = batch * ctx * INDEXER_ENTRY_BYTES
    sets = 4 if set_bytes < 2**28 else 2
    r2t, page_tables, n_rows = paged_tables(batch, ctx, sets, gen)
    cache = random_cache(n_rows, gen)
    seq = torch.full((batch,), ctx, dtype=torch.int64, device=DEV)
    rpis = [torch.arange(batch, device=DEV) + s * batch for s in range(sets)]
    qsets = make_queries(batch, 1, gen, sets)
    inputs = [(qsets[s], rpis[s]) for s in range(sets)]
    out = torch.empty(batch, 1, ctx, device=DEV)
    qi, wi = reference_inputs("fp8", qsets[0])

    def reference():
        return indexer_logits_reference(qi, wi, cache, r2t, rpis[0], seq, ctx)

    # correctness at this size too (first set), the default (exact) fp8-q path against the reference where it fits
    ref_gib = batch * ctx * (H * 4 * 3 + D * 4 + INDEXER_ENTRY_BYTES) / 2**30
    want = None
    if ref_gib <= REF_LIMIT_GIB:
        try:
            want = reference()
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
    got = run_kernel("fp8", False, qsets[0], cache, r2t, rpis[0], seq, ctx).clone()
    check = None
    if want is not None:
        check = dict(max_rel_err=rel_error(got, want), topk_agreement=topk_agreement(got, want))
        assert check["max_rel_err"] <= 1e-5, check

    def timed(q_kind, fp8_dot, config):
        return median_us(lambda qs, rpi: run_kernel(q_kind, fp8_dot, qs, cache, r2t, rpi, seq, ctx, config, out=out),
                         inputs, reps=reps)

    times = {}
    for name, q_kind, fp8_dot in variants():
        if q_kind == "fp32" and batch * ctx > 64 * 32768:
            continue  # the exact fp32 dot is for tests; too slow to matter here
        # (fp8 q: SGLang's, both dots, every tile; bf16 q: the decode stacks', the default and 8 tiles a program)
        for config in CONFIGS if q_kind == "fp8" else [CONFIGS[0], EIGHT_TILES] if q_kind == "bf16" else CONFIGS[:1]:
            times[f"{name} {config_name(config)}"] = timed(q_kind, fp8_dot, config)
    ref_us = None
    if want is not None:
        del want
        try:
            ref_us = median_us(reference, [()], reps=3, warmup=1)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
    dg_status, dg_us = try_deepgemm(batch, ctx, qsets[0], cache, n_rows, page_tables[0], seq, got)

    floor_bytes = batch * ctx * (INDEXER_ENTRY_BYTES + 4 + 4)
    floor_us = floor_bytes / copy_gbps / 1e3
    fp8_times = {k: v for k, v in times.items() if k.startswith("fp8-q")}
    best_name = min(fp8_times, key=fp8_times.get)
    best = fp8_times[best_name]
    default = times[f"fp8-q bf16-dot {config_name(CONFIGS[0])}"]  # the exact default path
    row = dict(batch=batch, context=ctx, floor_bytes=floor_bytes, floor_us=floor_us, copy_gbps=copy_gbps,
               triton_us=best, triton_best_config=best_name, triton_default_us=default,
               triton_gbps=floor_bytes / best / 1e3, fraction_of_floor=floor_us / best,
               reference_us=ref_us, reference_note=None if ref_us else f"skipped (~{ref_gib:.0f} GiB or OOM)",
               deepgemm_us=dg_us, deepgemm=dg_status, times=times, check=check)
    print(f"B={batch} ctx={ctx}: best {best:.1f} us ({best_name}), floor {floor_us:.1f} us, "
          f"{row['triton_gbps']:.0f} GB/s; reference {ref_us and round(ref_us)} us; deep_gemm: {dg_status}")
    return row


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    batches = [int(s) for s in args.batches.split(",")]
    contexts = [int(s) for s in args.contexts.split(",")]
    gen = torch.Generator(device=DEV).manual_seed(0)
    info = run_info(heads=H, head_dim=D, q_tokens=1, page=PAGE)
    import triton
    info["triton"] = triton.__version__

    info["max_rel_err"] = correctness(gen, info)
    copy_gbps = copy_bandwidth()
    info["copy_gbps"] = copy_gbps
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write bytes)")

    rows = []
    for ctx in contexts:
        for batch in batches:
            rows.append(bench_one(batch, ctx, gen, copy_gbps, args.reps))
            torch.cuda.empty_cache()

    info["rows"] = rows
    os.makedirs(args.out, exist_ok=True)
    with open(f"{args.out}/indexer.json", "w") as f:
        json.dump(info, f, indent=1)
    try:
        plot(rows, f"{args.out}/indexer.png")
    except Exception as e:  # noqa: BLE001 - the table and JSON matter more than the plot
        print(f"plot failed: {e}")

    print(f"\nDSA indexer decode logits, {H} heads x {D}, Q=1, fp8 q (scale in weights), page {PAGE}; "
          f"{info['device']}; D2D copy {copy_gbps:.0f} GB/s; GPU check max rel err {info['max_rel_err']:.1e}")
    print(f"{'batch':>5} {'ctx':>7} {'floor us':>9} {'triton us':>10} {'GB/s':>6} {'of floor':>8} "
          f"{'default us':>10} {'bf16-q us':>9} {'bf16-q x8':>9} {'torch ref us':>12} {'ref/triton':>10}  "
          f"best (either dot) and tile")
    for r in rows:
        bf16 = r["times"].get(f"bf16-q {config_name(CONFIGS[0])}")
        bf16_eight = r["times"].get(f"bf16-q {config_name(EIGHT_TILES)}")
        ref = f"{r['reference_us']:.0f}" if r["reference_us"] else "skipped"
        ratio = f"{r['reference_us'] / r['triton_us']:.1f}x" if r["reference_us"] else "-"
        print(f"{r['batch']:>5} {r['context']:>7} {r['floor_us']:>9.1f} {r['triton_us']:>10.1f} "
              f"{r['triton_gbps']:>6.0f} {r['fraction_of_floor']:>8.2f} {r['triton_default_us']:>10.1f} "
              f"{bf16:>9.1f} {bf16_eight:>9.1f} {ref:>12} {ratio:>10}  {r['triton_best_config']}")
    print(f"deep_gemm.fp8_paged_mqa_logits: {rows[0]['deepgemm'] if rows else '-'}")


if __name__ == "__main__":
    main()
