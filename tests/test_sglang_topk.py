"""SGLang's decode top-k (topk_v2.cuh's `topk_transform_paged_v2` and its plan) as the decode stacks' top-k
(benchmarks/sglang_topk.py).

On the CPU: the torch statement of its selection against torch.topk; the stack callable over an emulated kernel that
returns its selection in a scrambled order (order, k-th score, one plan a step); the argument checks; the path rule
against topk_v2.cuh's dispatch; the translation unit against what SGLang's own loader writes; and (slow, with nvcc and
tvm-ffi) the real kernel and the occupancy probe compiled for sm_90a. On the GPU (`-m gpu`): the real kernel against
torch.topk at the harness's sizes, and a decode stack pair with it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import hisparse_kernel as hk  # noqa: E402
import sglang_topk as stk  # noqa: E402


def _scores(B, L, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, generator=g) * 3  # distinct values: no ties


def test_reference_selects_what_torch_topk_selects_below_each_length():
    B, L, k = 4, 3000, 512
    x = _scores(B, L, 0)
    lens = torch.tensor([L, 2000, 300, 0])
    pos = stk.select_reference(x, k, lens)
    for b in range(B):
        n = min(int(lens[b]), k)
        got = pos[b, :n].tolist()
        assert got == sorted(got) and (pos[b, n:] == -1).all()  # ascending, -1 last
        want = torch.topk(x[b, :lens[b]], n).indices.sort().values.tolist() if n else []
        assert got == want, b


def _as_set(pos):
    return torch.where(pos < 0, 2 ** 30, pos).sort(-1).values


class _EmulatedKernel(stk.SglangTopKV2):
    """The kernel's contract in torch (on the CPU): `transform` returns each row's selection in a scrambled order, as
    its atomics may; `plan` records its calls."""

    def __init__(self):
        super().__init__(pdl=False, clusters=dict(stk.H200_CLUSTERS), so_path=Path("unused.so"), arch=(9, 0))
        self.plans, self.transforms = [], []

    def plan(self, seq_lens, out=None):
        assert seq_lens.dtype == torch.int32
        self.plans.append(seq_lens.clone())
        return torch.zeros(seq_lens.shape[0] + 1, stk.PLAN_INTS, dtype=torch.int32)

    def transform(self, scores, seq_lens, plan, k=stk.MAX_K, out=None):
        assert seq_lens.dtype == torch.int32 and plan.shape == (scores.shape[0] + 1, 2)
        self.transforms.append(scores.data_ptr())
        pos = stk.select_reference(scores, k, seq_lens)
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(7))
        return pos[:, perm]


def test_stack_callable_orders_and_plans_once_a_step():
    k, L = 256, 1000
    x = _scores(3, L, 1).view(3, 1, L)
    lens = torch.tensor([1000, 700, 100])  # the last row has fewer than k visible positions
    kern = _EmulatedKernel()
    ordered = kern.stack_topk(ordered=True)
    ordered.begin_step(lens, L)
    assert len(kern.plans) == 1  # planned at the step's start, before any top-k
    pos, kth = ordered(x, k, lens)
    want = stk.select_reference(x[:, 0], k, lens)
    assert torch.equal(pos[:, 0], want) and pos.shape == (3, 1, k) and pos.dtype == torch.int32
    assert kth is None  # positions only, as SGLang's decode top-k gives them
    assert kern.transforms == [x[:, 0].data_ptr()]  # the score rows in place
    ordered(x, k, lens)  # a later layer of the same step: the plan is reused
    assert len(kern.plans) == 1 and kern.plans[0].tolist() == [1000, 700, 100]
    lens[1] = 701  # the lengths change in place (a new step without begin_step): planned again
    ordered(x, k, lens)
    assert [p.tolist() for p in kern.plans[1:]] == [[1000, 701, 100]]
    ordered.begin_step(lens, L)
    ordered(x, k, lens)
    assert len(kern.plans) == 3
    ordered.prepare(lens[:2], L)  # another batch of the step (a DBA chunk): a plan of its own, made ahead
    assert kern.plans[-1].tolist() == [1000, 701]
    ordered(x[:2], k, lens[:2])
    assert len(kern.plans) == 4
    ordered.begin_step(torch.tensor([5000, 10, 0]), L)  # lengths past the rows' width are clamped to it
    assert kern.plans[-1].tolist() == [L, 10, 0]
    unordered = kern.stack_topk()
    upos, _ = unordered(x, k, lens)
    assert not torch.equal(upos, pos)  # the kernel's own order ...
    assert torch.equal(_as_set(upos), _as_set(pos))  # ... the same selection
    with pytest.raises(ValueError, match=r"takes scores \[B, 1, L\]"):
        unordered(x[:, 0], k, lens)
    with pytest.raises(ValueError, match=r"seq_lens must be \[B\] = \[3\]"):
        unordered(x, k, lens[:2])


def test_transform_and_plan_name_bad_arguments_before_any_launch():
    kern = stk.SglangTopKV2(pdl=False, clusters=dict(stk.H200_CLUSTERS), so_path=Path("missing.so"), arch=(9, 0))
    lens = torch.full((2,), 100, dtype=torch.int32)
    plan = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA float32 scores"):
        kern.transform(torch.zeros(2, 128), lens, plan)  # on the CPU
    with pytest.raises(ValueError, match="seq_lens must be contiguous int32"):
        kern.plan(lens.long())
    with pytest.raises(ValueError, match="clusters must give exactly"):
        stk.unit_text(Path("x.cuh"), True, {"SGL_TOPK_V2_MAX_C8_OCC2": 30})
    with pytest.raises(ValueError, match="cluster counts must be integers >= 0"):
        stk.unit_text(Path("x.cuh"), True, dict(stk.H200_CLUSTERS, SGL_TOPK_V2_MAX_C16_OCC1=-1))


def test_path_rule_follows_the_kernels_dispatch():
    c = stk.H200_CLUSTERS
    assert stk.kernel_paths(64, 32782, c).endswith("exact")  # 32K decode: one block a row at every batch
    assert stk.kernel_paths(16, 32782, c).endswith("exact")  # (B > 15: the cluster floor is 65536)
    assert stk.kernel_paths(2, 32782, c).startswith("cluster-16")  # B <= 7, L > 32768
    assert stk.kernel_paths(15, 32782, c).startswith("cluster-8")  # 8..15 rows, L > 32768
    assert stk.kernel_paths(2, 32768, c).endswith("exact")  # not above the floor
    assert stk.kernel_paths(16, 131086, c).startswith("cluster-8")  # 128K, B <= 30
    # 128K at 64 rows, all longer than 131072: the plan's threshold is 196608, no row goes to the clusters
    assert "threshold 196608, no cluster rows" in stk.kernel_paths(64, 131086, c)
    # 40 rows above 98304 of 64: threshold 98304 (45 may go there), those 40 rows on the persistent clusters
    mixed = [100000] * 40 + [50000] * 24
    assert stk.kernel_paths(64, 131072, c, mixed).startswith("persistent clusters for 40 rows longer than 98304")
    assert stk.kernel_paths(2, 131072, dict(c, SGL_TOPK_V2_MAX_C16_OCC1=0)).startswith("cluster-8")
    no_clusters = {name: 0 for name in c}
    assert stk.kernel_paths(64, 131086, no_clusters).endswith("exact")


def _installed_sources():
    root = hk._installed_sglang_root()
    if root is None or not (root / hk.TOPK_CUH_RELPATH).is_file():
        pytest.skip("sglang 0.5.23 is not installed")
    return hk.locate_sglang(root)


def test_unit_and_exports_equal_what_sglangs_loader_writes():
    """Our exports are those `_jit_topk_v2_module` gives the decode path, our cluster macros its -D flags, and our
    translation unit is the text its loader writes for them, after our #define lines."""
    src = _installed_sources()
    loader = (src.root / "sglang/kernels/ops/attention/dsv4/topk.py").read_text()
    assert 'for cluster_size, occupancy in ((8, 2), (16, 1)):' in loader
    assert 'f"-DSGL_TOPK_V2_MAX_C{cluster_size}_OCC{occupancy}={max_active_clusters}"' in loader
    assert sorted(stk.CLUSTER_MACROS.values()) == [(8, 2), (16, 1)]
    for export, function in stk.kernel_exports(True):
        assert f'("{export}", f"{{kernel}}::{function.split("::")[1]}")' in loader
    assert 'kernel = f"TopKKernel<{args}>"' in loader and "make_cpp_args(is_arch_support_pdl())" in loader
    try:
        from sglang.kernels.jit.utils.arch import get_default_target_flags, override_jit_cuda_arch
        from sglang.kernels.jit.utils.compile import spec as spec_mod
        from sglang.kernels.jit.utils.compile.paths import DEFAULT_CFLAGS, DEFAULT_INCLUDE
    except Exception as exc:  # noqa: BLE001 - any import failure of sglang's JIT tooling skips this comparison
        pytest.skip(f"sglang's JIT tooling does not import here: {exc}")
    with override_jit_cuda_arch(9, 0):
        spec = spec_mod.BuildSpec(module_args=("x",), cpp_files=(), cuda_files=spec_mod.resolve_sources(
            ["deepseek_v4/topk_v2.cuh"]), cpp_wrappers=(), cuda_wrappers=tuple(stk.kernel_exports(True)),
            cflags=tuple(DEFAULT_CFLAGS), cuda_cflags=tuple(get_default_target_flags()), ldflags=(),
            include_paths=tuple(DEFAULT_INCLUDE), header_only=True)
        theirs = spec.translation_units()[0].source
    ours = stk.unit_text(Path(spec.cuda_files[0]), True, stk.H200_CLUSTERS)
    defines = "#define SGL_TOPK_V2_MAX_C16_OCC1 7\n#define SGL_TOPK_V2_MAX_C8_OCC2 30\n"
    assert ours == defines + theirs
    cuh = (src.root / hk.TOPK_CUH_RELPATH).read_text()
    for name in stk.CLUSTER_MACROS:  # the header reads each macro only if not defined: a #define does what -D does
        assert f"#ifndef {name}" in cuh
    for threshold, cap in stk.PLAN_THRESHOLDS:  # the plan's Hopper table, as kernel_paths uses it
        assert f"{{{threshold}, {cap}}}," in cuh
    # the other constants of the dispatch kernel_paths restates
    assert "return batch_size <= 15 ? 32768 : 65536;" in cuh  # the cluster floor on Hopper
    assert f"constexpr uint32_t kClusterMaxBatch = {stk.PERSISTENT_MAX_BATCH};" in cuh
    assert "constexpr uint32_t kClusterFloor = 32768;" in cuh  # the plan's lowest threshold
    assert f"kReg4MaxSeqLen = Register4::kMaxSeqLen;  // {stk.REG4_MAX_LEN}" in cuh
    assert "if (batch_size <= kMaxCluster16BatchSize) {" in cuh and "if (batch_size <= kNumPersistentClusters) {" in cuh
    assert "const bool use_cluster = (max_seq_len > params.static_cluster_floor) && (batch_size <= kClusterMaxBatch);" \
        in cuh


@pytest.mark.slow
def test_real_kernel_and_probe_compile_for_sm90a_and_load(tmp_path):
    src = _installed_sources()
    pytest.importorskip("tvm_ffi")
    try:
        hk.find_toolchain()
    except hk.HiSparseBuildError as exc:
        pytest.skip(str(exc))
    k = stk.build(src, clusters=stk.H200_CLUSTERS, arch=(9, 0), build_dir=tmp_path, load=True)
    assert k.pdl is True and k.so_path.is_file()
    assert all(callable(getattr(k.module, e)) for e, _ in stk.kernel_exports(True))
    cuh = src.root / hk.PROBE_CUH_RELPATH
    so, _ = hk.compile_export(src, cuh, hk.export_source(cuh, [("get_max_active_clusters",
                                                                   "get_max_active_clusters")]),
                              "cluster_probe", (9, 0), tmp_path)
    assert so.is_file()


# --------------------------------------------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def built():
    return stk.build()


@pytest.mark.gpu
@pytest.mark.parametrize("B,L", [(1, 32832), (16, 32832), (64, 32832), (64, 131136), (128, 131136)])
def test_gpu_selection_equals_the_exact_top_k_where_the_path_is_exact(built, B, L):
    """The selected scores, as a multiset, are the k best of each row (which of several equal scores is taken is
    the kernel's choice); exact wherever `kernel_paths` says so; two calls select the same positions above the k-th
    score (at it, equal scores may be taken differently: once, on the H200, two calls at 64 / 131,136 did)."""
    path = stk.kernel_paths(B, L, built.clusters)
    scores = stk.indexer_like_scores(B, L, seed=B + L, device="cuda")
    lens = torch.full((B,), L - 14, dtype=torch.int32, device="cuda")  # (the harness: a table in whole pages)
    lens[0] = L - 5000  # one shorter row: nothing past its length is selected
    plan = built.plan(lens)
    got, again = built.transform(scores, lens, plan), built.transform(scores, lens, plan)
    want = stk.select_reference(scores, stk.MAX_K, lens)
    assert ((got >= 0) & (got < lens.view(B, 1))).all()
    picked = torch.gather(scores, 1, got.long()).sort(-1).values
    best = torch.gather(scores, 1, want.long()).sort(-1).values
    same = (picked == best).all(dim=1)
    print(f"B={B} L={L}: {int(same.sum())}/{B} rows select the k best scores [{path}]")
    if path.endswith("exact"):
        assert bool(same.all())
        assert torch.equal(torch.gather(scores, 1, again.long()).sort(-1).values, best), "the second call differs"
        kth = best[:, 0]  # each row's k-th best score (best is sorted ascending)
        for r in range(B):  # the two calls may differ only among positions scoring exactly the k-th score
            moved = got[r][~torch.isin(got[r], again[r])]
            assert bool((scores[r, moved.long()] == kth[r]).all()), f"row {r}: the calls differ above the k-th score"


@pytest.mark.gpu
def test_gpu_decode_stacks_with_sglangs_top_k_stay_bit_identical(built):
    """decode_layers' correctness check with SGLang's top-k in every stack (positions only; prefetching ESS stacks
    find the k-th scores themselves), ordered: every mode bit-identical to the all-HBM stack."""
    import decode_layers as dl

    pools = dl.Pools(2, 16 * dl.table_width(32768, 6))
    cfg = dl.Config(pools, 2, 32768, 16, 6, seed=3)
    slots = math.ceil(0.2 * cfg.batch * cfg.context / 64) * 64  # (whole FlashMLA pages)
    res = dl.check_correctness(pools, cfg, slots, cfg.queries(0.99205), warm=2, topk=built)
    for name, r in res.items():
        assert r["bit_identical"], (name, r)
