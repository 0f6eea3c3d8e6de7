"""SGLang 0.5.23's DSA decode top-k (`topk_transform_paged_v2`), built from the sglang sources at run time, as the
top-k of the decode stacks.

Why: the decode stacks' default top-k is torch.topk (~106 us a layer at batch 64 / 32K on the H200), and ECHO's last
prefetch chunk hides beside it. SGLang's decode does not run torch.topk: with its defaults (``SGLANG_DSA_FUSE_TOPK``,
``SGLANG_OPT_USE_TOPK_V2``, top-k backend ``sgl-kernel``) a decode batch goes to ``dsa_topk_backend.
_topk_transform_v2_paged``, the JIT kernel ``sglang/kernels/jit/csrc/deepseek_v4/topk_v2.cuh`` (``TopKKernel<pdl>::
transform_paged``), with a per-forward routing plan (``TopKKernel<pdl>::plan``, SGLang's ``plan_topk_v2``). Timing the
stacks with it tells how much of ESS's overlap survives inside SGLang.

How (as `hisparse_kernel` builds HiSparse's kernel; nothing of SGLang imported or copied): our own translation unit
includes their header unchanged and exports the two functions SGLang's ``_jit_topk_v2_module`` exports for decode,
``TopKKernel<true>`` on sm_90+ (PDL), compiled with SGLang's nvcc flags and loaded through tvm-ffi. SGLang also passes
``-DSGL_TOPK_V2_MAX_C8_OCC2=<n>`` and ``-DSGL_TOPK_V2_MAX_C16_OCC1=<n>``, the thread-block clusters of 8 (2 blocks an
SM) and of 16 (1 an SM) the GPU holds at once, from an occupancy probe (``csrc/occupancy/cluster_probe.cuh``):
`probe_clusters` builds and runs that probe the same way, and the values become ``#define`` lines of our unit (on the
H200: 30 and 7).

The kernel's contract (read from topk_v2.cuh and its ``topk_impl.cuh``): for each row b of fp32 scores [B, L] (unit
stride, row stride a multiple of 4), the k <= 2048 largest of ``scores[b, :seq_lens[b]]`` as int32 positions in no
particular order (slots taken by shared-memory atomics), -1 in the slots past ``seq_lens[b]``. Which path runs is
chosen on the host from L and B: one 1,024-thread block a row (its register or streaming variants) is exact (an
overflowing threshold bin is resolved by exact radix passes); rows routed to thread-block clusters (long rows at small
batches: L > 32768 at B <= 15, L > 65536 at B <= 30; above 30 rows, only the rows longer than the plan's threshold)
keep at most 2,048 candidates of the threshold bin, so there the selection can differ from the exact top-k when more
than 2,048 scores share the k-th score's bin. `kernel_paths` names the path of a shape; the GPU tests and
`python benchmarks/sglang_topk.py` compare the selected scores with the k best at the harness's sizes.

For the decode stacks (`ess_sglang.decode_stack.StackOptions.topk`), `SglangTopKV2.stack_topk` gives the callable:
SGLang's decode top-k as it is, positions only (the k-th score is None: a prefetching ESS stack finds it itself, on
its side stream, from the logits and the positions). ``ordered=True``: positions sorted ascending (-1 last). Two
calls can order one selection differently, and attention sums in the table's order, so
`decode_layers.check_correctness` runs both stacks ordered to compare them bit for bit; the timed stacks run the
kernel's own order, as SGLang does.
The routing plan is made once a step, as SGLang makes it once a forward: the stacks call ``begin_step`` first (and
``prepare`` for each DBA chunk of the batch), which converts the lengths to int32 and plans before the step's first
indexer launch; every layer's top-k reuses both. The kernel reads the lengths and the plan before its PDL wait, so the
kernel just before it must not be the one that wrote them (SGLang plans in its metadata preparation for the same
reason); a call for lengths not prepared this way prepares them itself, right before the top-k.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hisparse_kernel as hk
import torch
from ess_sglang.kernels.topk import kth_of_selection
from timing import replay_us  # benchmarks/timing.py (run these files as scripts)

SGLANG_VERSION = hk.SGLANG_VERSION
MAX_K = 2048  # the kernel's bound on k (checked on its host side too)
PLAN_INTS = 2  # metadata is int32 [B + 1, 2]: row 0 {cluster threshold, cluster rows}, rows 1.. {batch id, length}
# SGLang's two cluster-capacity macros and the probe's (cluster size, blocks per SM) for each (`_jit_topk_v2_module`)
CLUSTER_MACROS = {"SGL_TOPK_V2_MAX_C8_OCC2": (8, 2), "SGL_TOPK_V2_MAX_C16_OCC1": (16, 1)}
H200_CLUSTERS = {"SGL_TOPK_V2_MAX_C8_OCC2": 30, "SGL_TOPK_V2_MAX_C16_OCC1": 7}  # the probe's answer on the H200
PERSISTENT_MAX_BATCH = 512  # kClusterMaxBatch: batches above it never use clusters
PLAN_THRESHOLDS = ((65536, 30), (98304, 45), (131072, 60), (196608, 80), (262144, 112), (393216, 128))  # Hopper
REG4_MAX_LEN = 16384  # rows up to this length: the register variant; longer: streaming (both exact)


def kernel_exports(pdl: bool) -> list[tuple[str, str]]:
    """What SGLang's loader exports for the decode path (`make_cpp_args(is_arch_support_pdl())`)."""
    kernel = f"TopKKernel<{'true' if pdl else 'false'}>"
    return [("topk_transform_paged", f"{kernel}::transform_paged"), ("topk_plan", f"{kernel}::plan")]


def unit_text(cuh: Path, pdl: bool, clusters: dict[str, int]) -> str:
    """Our translation unit: SGLang's for `_jit_topk_v2_module` (decode exports), the cluster macros as defines."""
    bad = sorted(set(clusters) ^ set(CLUSTER_MACROS))
    if bad:
        raise ValueError(f"clusters must give exactly {sorted(CLUSTER_MACROS)}, got {sorted(clusters)}")
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in clusters.values()):
        raise ValueError(f"cluster counts must be integers >= 0, got {clusters}")
    return hk.export_source(cuh, kernel_exports(pdl), defines=sorted(clusters.items()))


def kernel_paths(batch: int, width: int, clusters: dict[str, int], lengths: list[int] | None = None) -> str:
    """Which kernel path topk_transform_paged takes for B rows of width L on a Hopper GPU (its host dispatch and the
    plan's threshold rule, read from topk_v2.cuh), and whether that path is exact. lengths: the rows' seq_lens (None:
    every row the full width)."""
    lengths = [width] * batch if lengths is None else list(lengths)
    c8, c16 = clusters["SGL_TOPK_V2_MAX_C8_OCC2"], clusters["SGL_TOPK_V2_MAX_C16_OCC1"]
    floor = 32768 if batch <= 15 else 65536
    rows = "register" if width <= REG4_MAX_LEN else "streaming"
    if width > floor and batch <= PERSISTENT_MAX_BATCH:
        if c16 > 0 and batch <= c16:
            return "cluster-16 (small batch): can truncate the threshold bin"
        if c8 > 0 and batch <= c8:
            return "cluster-8 (small batch): can truncate the threshold bin"
        if c8 > 0:
            counts = [sum(n > t for n in lengths) for t, _ in PLAN_THRESHOLDS]
            chosen = PLAN_THRESHOLDS[-1][0]
            for (t, cap), n in reversed(list(zip(PLAN_THRESHOLDS, counts, strict=True))):
                if n > cap:
                    break
                chosen = t
            threshold = max(chosen, 32768)
            n = sum(x > threshold for x in lengths)
            if n:
                return f"persistent clusters for {n} rows longer than {threshold}: can truncate; the rest {rows}"
            return f"one block a row ({rows}; plan threshold {threshold}, no cluster rows): exact"
    return f"one block a row ({rows}): exact"


# ------------------------------------------------------------------------------------------------ build


def probe_clusters(source=None, build_dir: Path | None = None, verbose: bool = False) -> dict[str, int]:
    """The cluster macros' values on this GPU, from SGLang's own probe (`get_max_active_clusters(size, occupancy)`:
    cudaOccupancyMaxActiveClusters on a dummy kernel); 0 where no cluster of that shape fits, as SGLang sets it."""
    src = source if isinstance(source, hk.SglangSources) else hk.locate_sglang(source)
    arch = hk.build_arch(None)
    if arch[0] < 9:
        return {name: 0 for name in CLUSTER_MACROS}  # no clusters before sm_90: SGLang passes no macros (defaults 0)
    import tvm_ffi

    cuh = src.root / hk.PROBE_CUH_RELPATH
    unit = hk.export_source(cuh, [("get_max_active_clusters", "get_max_active_clusters")])
    so, _ = hk.compile_export(src, cuh, unit, "cluster_probe", arch, build_dir, verbose)
    probe = tvm_ffi.load_module(str(so)).get_max_active_clusters
    return {name: int(probe(size, occupancy)) for name, (size, occupancy) in CLUSTER_MACROS.items()}


def build(source=None, pdl: bool | None = None, clusters: dict[str, int] | None = None,
          arch: tuple[int, int] | None = None, build_dir: Path | None = None, load: bool = True,
          verbose: bool = False) -> SglangTopKV2:
    """JIT-compile SGLang's decode top-k. pdl None: on from sm_90 (as SGLang builds it). clusters None: probed on this
    GPU (`probe_clusters`); give them (e.g. `H200_CLUSTERS`) with `arch` to compile without a GPU. source, build_dir:
    as `hisparse_kernel.build`."""
    src = source if isinstance(source, hk.SglangSources) else hk.locate_sglang(source)
    hk.warn_if_other_version(src, "sglang_topk")
    arch = hk.build_arch(arch)
    use_pdl = arch[0] >= 9 if pdl is None else bool(pdl)
    if clusters is None:
        clusters = probe_clusters(src, build_dir, verbose)
    cuh = src.root / hk.TOPK_CUH_RELPATH
    so, arch = hk.compile_export(src, cuh, unit_text(cuh, use_pdl, clusters), "topk_v2", arch, build_dir, verbose)
    kernel = SglangTopKV2(pdl=use_pdl, clusters=dict(clusters), so_path=so, arch=arch)
    if load:
        kernel.load()
    return kernel


# ------------------------------------------------------------------------------------------------ the kernel


@dataclass
class SglangTopKV2:
    """One build of SGLang's decode top-k: `plan` and `transform` are its two exports; `stack_topk` the decode
    stacks' callables."""

    pdl: bool
    clusters: dict[str, int]
    so_path: Path
    arch: tuple[int, int]
    module: Any = None

    def load(self) -> SglangTopKV2:
        import tvm_ffi

        self.module = tvm_ffi.load_module(str(self.so_path))
        for export, _ in kernel_exports(self.pdl):  # fail here, not at the first call, if one is missing
            getattr(self.module, export)
        return self

    def _call(self, export: str, device: torch.device, *args) -> None:
        import tvm_ffi

        if self.module is None:
            self.load()
        stream = torch.cuda.current_stream(device)  # so that the launch lands in a CUDA graph being captured
        with tvm_ffi.use_raw_stream(tvm_ffi.device(f"cuda:{device.index or 0}"), stream.cuda_stream):
            getattr(self.module, export)(*args)

    def plan(self, seq_lens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """SGLang's `plan_topk_v2`: the routing plan, int32 [B + 1, 2], for int32 seq_lens [B] (>= 0). The kernel
        writes it only for batches that use the persistent clusters (31..512 rows on the H200) and reads it only
        then; otherwise it stays as allocated."""
        _check_lengths(seq_lens, seq_lens.shape[0] if seq_lens.dim() == 1 else -1, seq_lens.device)
        B = seq_lens.shape[0]
        if out is None:
            out = torch.empty((B + 1, PLAN_INTS), dtype=torch.int32, device=seq_lens.device)
        self._call("topk_plan", seq_lens.device, seq_lens, out, -1)
        return out

    def transform(self, scores: torch.Tensor, seq_lens: torch.Tensor, plan: torch.Tensor, k: int = MAX_K,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """SGLang's `topk_transform_paged_v2` without a page table: the top-k positions, int32 [B, k], unordered,
        -1 past each row's length. scores: float32 [B, L] on the GPU, unit stride, row stride a multiple of 4;
        seq_lens: int32 [B], each in [0, L] (not checked: the kernel trusts them); plan: `plan` of those lengths."""
        if not scores.is_cuda or scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1 \
                or scores.stride(0) % 4 or scores.data_ptr() % 16:
            raise ValueError(f"SGLang's top-k takes CUDA float32 scores [B, L] with unit stride, a row stride that "
                             f"is a multiple of 4 and a 16-byte aligned start; got {scores.dtype} "
                             f"{tuple(scores.shape)} strides {scores.stride()} on {scores.device}")
        B = scores.shape[0]
        _check_lengths(seq_lens, B, scores.device)
        if plan.shape != (B + 1, PLAN_INTS) or plan.dtype != torch.int32 or plan.device != scores.device:
            raise ValueError(f"plan must be int32 [{B + 1}, {PLAN_INTS}] on {scores.device} (from `plan`), got "
                             f"{plan.dtype} {tuple(plan.shape)} on {plan.device}")
        if not 0 < k <= MAX_K:
            raise ValueError(f"SGLang's top-k selects 0 < k <= {MAX_K}, got k = {k}")
        if out is None:
            out = torch.empty((B, k), dtype=torch.int32, device=scores.device)
        elif out.shape != (B, k) or out.dtype != torch.int32 or not out.is_contiguous():
            raise ValueError(f"out must be contiguous int32 [{B}, {k}], got {out.dtype} {tuple(out.shape)}")
        self._call("topk_transform_paged", scores.device, scores, seq_lens, None, out, 1, plan, None)
        return out

    def path(self, batch: int, width: int, lengths: list[int] | None = None) -> str:
        """`kernel_paths` on the GPU this was built for (the rule is Hopper's; elsewhere: not modelled)."""
        if self.arch[0] != 9:
            return f"not modelled for sm_{self.arch[0]}{self.arch[1]} (kernel_paths states Hopper's dispatch)"
        return kernel_paths(batch, width, self.clusters, lengths)

    def stack_topk(self, ordered: bool = False) -> StackTopK:
        """A decode stack's top-k (`StackOptions.topk`); see the module docstring."""
        return StackTopK(self, ordered=bool(ordered))


def _check_lengths(seq_lens: torch.Tensor, B: int, device: torch.device) -> None:
    if seq_lens.shape != (B,) or seq_lens.dtype != torch.int32 or seq_lens.device != device \
            or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be contiguous int32 [{B}] on {device}, got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)} on {seq_lens.device}")


@dataclass
class StackTopK:
    """`StackOptions.topk` callable over a `SglangTopKV2`: (scores [B, 1, L], k, seq_lens [B]) -> (positions
    [B, 1, k] int32, None: no k-th score). ``begin_step(seq_lens, width)``: a new step starts (the decode stacks call
    it first): the step's lengths, clamped to the score rows' width, in int32 and planned; ``prepare`` does the same
    for another batch of the step (a DBA chunk)."""

    kernel: SglangTopKV2
    ordered: bool = False
    _prepared: dict = field(default_factory=dict, repr=False, compare=False)

    def begin_step(self, seq_lens: torch.Tensor, width: int) -> None:
        self._prepared.clear()
        self.prepare(seq_lens, width)

    def prepare(self, seq_lens: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 lengths, plan) for these lengths, made now unless this step already has them: keyed by the
        tensor's storage, shape and version (an in-place write between calls makes a new entry)."""
        version = None if seq_lens.is_inference() else seq_lens._version  # (inference tensors have no version)
        key = (seq_lens.data_ptr(), tuple(seq_lens.shape), version, width)
        got = self._prepared.get(key)
        if got is None:
            lens = seq_lens.clamp(0, width).to(torch.int32)
            got = self._prepared[key] = (lens, self.kernel.plan(lens))
        return got

    def __call__(self, scores: torch.Tensor, k: int, seq_lens: torch.Tensor
                 ) -> tuple[torch.Tensor, None]:
        if scores.dim() != 3 or scores.shape[1] != 1:
            raise ValueError(f"SGLang's decode top-k here takes scores [B, 1, L] (one query token per request), got "
                             f"{tuple(scores.shape)}")
        B, _, L = scores.shape
        if seq_lens.shape != (B,):
            raise ValueError(f"seq_lens must be [B] = [{B}], got {tuple(seq_lens.shape)}")
        rows = scores[:, 0]
        lens, plan = self.prepare(seq_lens, L)
        pos = self.kernel.transform(rows, lens, plan, k)
        if self.ordered:
            pos = ascending(pos, L)
        return pos.view(B, 1, k), None


def ascending(pos: torch.Tensor, L: int) -> torch.Tensor:
    """Positions [B, k] (-1: none) of rows of L, sorted ascending with the -1 last."""
    s = torch.where(pos >= 0, pos, L).sort(dim=-1).values
    return torch.where(s < L, s, -1).to(torch.int32)


def select_reference(scores: torch.Tensor, k: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """The kernel's selection in torch, for tests: positions [B, k] int32 ascending, -1 last: the k best of each row's
    first seq_lens[b] scores (ties to the lower position; the kernel may take any of the tied ones)."""
    B, L = scores.shape
    visible = torch.arange(L, device=scores.device).view(1, L) < seq_lens.view(B, 1).clamp(0, L)
    masked = torch.where(visible, scores.float(), float("-inf"))
    order = torch.sort(-masked, dim=-1, stable=True).indices[:, :k]
    pos = torch.where(torch.gather(visible, 1, order), order, -1)
    if pos.shape[1] < k:
        pos = torch.cat([pos, pos.new_full((B, k - pos.shape[1]), -1)], dim=1)
    return ascending(pos, L)


# ------------------------------------------------------------------------------------------------ GPU benchmark


def indexer_like_scores(B: int, L: int, seed: int, device) -> torch.Tensor:
    """Scores shaped like the DSA indexer's: per token, a weighted sum over 64 heads of ReLU(q . k) (here Gaussian
    dot products), float32 [B, L]. Sparse-ish, right-skewed, with few exact ties."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(B, L, device=device)
    w = torch.rand(64, generator=g, device=device)
    for lo in range(0, L, 16384):
        hi = min(L, lo + 16384)
        dots = torch.randn(B, hi - lo, 64, generator=g, device=device)
        out[:, lo:hi] = (dots.relu() * w).sum(-1)
    return out


def _time(fn, reps: int) -> float:
    """us per call: `reps` calls captured in one CUDA graph, median of 5 replays (`timing.replay_us`). Back to back,
    a PDL kernel's prologue may overlap the previous call's tail: a lower bound for one call after other work."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return statistics.median(replay_us(g) for _ in range(5)) / reps


def measure(kernel: SglangTopKV2, B: int, L: int, k: int = MAX_K, reps: int = 20) -> dict:
    """One (batch, context): SGLang's top-k (transform, plan; and the Triton kernel that finds the k-th score from
    its positions, as a prefetching ESS stack runs it) against torch.topk, in us, on indexer-like scores; and its
    selection against the exact top-k (rows whose selected scores are the k best, as a multiset: ties may be taken
    either way), and two of its calls against each other (same positions; same order)."""
    scores = indexer_like_scores(B, L, seed=B * 7 + L, device=torch.device("cuda"))
    lens = torch.full((B,), L, dtype=torch.int32, device=scores.device)
    plan = kernel.plan(lens)
    got = kernel.transform(scores, lens, plan, k)
    again = kernel.transform(scores, lens, plan, k)
    best = torch.topk(scores, k, dim=-1).values.sort(-1).values
    picked = torch.gather(scores, 1, got.long()).sort(-1).values
    srt = got.sort(dim=-1).values
    row = dict(batch=B, context=L, path=kernel.path(B, L), rows=B,
               torch_topk_us=_time(lambda: torch.topk(scores, k, dim=-1), reps),
               sglang_transform_us=_time(lambda: kernel.transform(scores, lens, plan, k), reps),
               sglang_plan_us=_time(lambda: kernel.plan(lens, out=plan), reps),
               kth_of_selection_us=_time(lambda: kth_of_selection(scores, got), reps),
               rows_selecting_the_k_best=int((picked == best).all(dim=1).sum()),
               rows_same_positions_twice=int((srt == again.sort(dim=-1).values).all(dim=1).sum()),
               rows_same_order_twice=int((got == again).all(dim=1).sum()))
    row["speedup_vs_torch"] = row["torch_topk_us"] / row["sglang_transform_us"]
    return row


def bench(kernel: SglangTopKV2, batches, contexts, k: int = MAX_K, reps: int = 20) -> list[dict]:
    """`measure` at every (batch, context), printed as it goes."""
    rows = []
    for L in contexts:
        for B in batches:
            r = measure(kernel, B, L, k, reps)
            rows.append(r)
            print(f"B={B:4d} L={L:6d}  torch.topk {r['torch_topk_us']:7.1f} us  sglang {r['sglang_transform_us']:6.1f} "
                  f"us (plan {r['sglang_plan_us']:4.1f}, k-th score {r['kth_of_selection_us']:4.1f})  "
                  f"x{r['speedup_vs_torch']:5.2f}  k best {r['rows_selecting_the_k_best']}/{B}  same positions "
                  f"{r['rows_same_positions_twice']}/{B}  same order {r['rows_same_order_twice']}/{B}  [{r['path']}]",
                  flush=True)
    return rows


def plot(rows: list[dict], path: str | Path) -> None:
    """Bars per (context, batch): torch.topk, SGLang's transform, and the k-th score kernel, in us."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4), squeeze=False)
    for ax, L in zip(axes[0], contexts, strict=True):
        sel = [r for r in rows if r["context"] == L]
        xs = range(len(sel))
        for i, (key, label) in enumerate((("torch_topk_us", "torch.topk"), ("sglang_transform_us", "SGLang topk_v2"),
                                          ("kth_of_selection_us", "k-th score kernel (ESS)"))):
            ax.bar([x + (i - 1) * 0.27 for x in xs], [r[key] for r in sel], width=0.27, label=label)
        ax.set_xticks(list(xs), [str(r["batch"]) for r in sel])
        ax.set_xlabel("batch")
        ax.set_ylabel("us (one CUDA graph of 20 calls, per call)")
        ax.set_title(f"top-2048 of {L // 1024}K scores")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,2,16,64,128")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--out", default="benchmarks/results/sglang_topk")
    p.add_argument("--build-dir", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sglang_topk: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    clusters = probe_clusters(build_dir=args.build_dir)
    kernel = build(clusters=clusters, build_dir=args.build_dir)
    print(f"sglang_topk: built in {time.time() - t0:.0f} s, pdl={kernel.pdl}, clusters={clusters}", flush=True)
    rows = bench(kernel, [int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(command=" ".join(sys.argv), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                device=torch.cuda.get_device_name(), clusters=clusters, pdl=kernel.pdl, sglang=SGLANG_VERSION)
    (out / "sglang_topk.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    plot(rows, out / "sglang_topk.png")
    print(f"wrote {out}/sglang_topk.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
