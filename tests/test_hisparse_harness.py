"""The harness that builds and times SGLang 0.5.23 HiSparse's swap-in kernel (benchmarks/hisparse_kernel.py and the
--gpu part of benchmarks/vs_hisparse.py).

On the CPU: locating and extracting the kernel's sources (installed sglang, a wheel), following its includes, the
translation unit and nvcc flags against the ones SGLang itself generates, the argument checks, the per-layer state
SGLang keeps, and the eager replay / checks / emulator comparison driven by `RefKernel`, a Python statement of the
kernel's semantics read from hisparse.cuh. With nvcc and tvm-ffi present (slow), the real kernel is compiled for sm_90a
and loaded. On the GPU (`-m gpu`): the real kernel against `RefKernel` slot for slot, and both timings end to end.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import hisparse_kernel as hk  # noqa: E402
import vs_hisparse  # noqa: E402

from ess_sglang.traces import SyntheticTraceConfig, synthetic_trace  # noqa: E402


def _installed():
    root = hk._installed_sglang_root()
    if root is None or not (root / hk.CUH_RELPATH).is_file():
        pytest.skip("sglang 0.5.23 is not installed")
    return hk.locate_sglang(root)


def _tvm_include():
    tvm_ffi = pytest.importorskip("tvm_ffi")
    from tvm_ffi import libinfo

    del tvm_ffi
    return [Path(libinfo.find_include_path()), Path(libinfo.find_dlpack_include_path())]


# --------------------------------------------------------------------------------------- a reference of the kernel

class RefKernel:
    """`load_cache_to_device_buffer_kernel` (IsMLA, token top-k, no miss plan) in Python, on CPU tensors, read from
    hisparse.cuh: padded blocks write -1; seq_len <= H: slot = position; else the newest token maps to slot H, LRU
    slots are scanned least recent first (a slot whose token is selected is a hit, others evictable), miss m (top-k
    order) takes the m-th evictable slot and is copied from the host, new LRU order = untaken evictables, filled
    slots, hits."""

    def __init__(self, config: hk.KernelConfig):
        self.config = config

    def __call__(self, top_k, dbt, hcl, dbl, host_cache, device_buffer, out, rpi, seq_lens, lru, num_real,
                 item_size_bytes=hk.ITEM_BYTES, page_size=1, check=True):
        if check:
            hk.check_args(top_k, dbt, hcl, dbl, host_cache, device_buffer, out, rpi, seq_lens, lru, num_real,
                          self.config, item_size_bytes)
        H, K = self.config.hot_buffer_size, self.config.num_top_k
        tk, tokens, locs, o, lr = top_k.numpy(), dbt.numpy(), dbl.numpy(), out.numpy(), lru.numpy()
        for bid in range(tk.shape[0]):
            if bid >= int(num_real[0]):
                o[bid, :K] = -1
                continue
            rid, L, sel = int(rpi[bid]), int(seq_lens[bid]), tk[bid]
            if L <= H:
                for i in range(K):
                    o[bid, i] = locs[rid, sel[i]] if (i < min(L, K) and sel[i] >= 0) else -1
                continue
            where = {}
            for i, t in enumerate(sel.tolist()):
                if t == L - 1:
                    o[bid, i] = locs[rid, H]
                elif t >= 0:
                    where[t] = i
            hits, evict, found = [], [], set()
            for slot in lr[rid].tolist():
                t = int(tokens[rid, slot])
                if t >= 0 and t in where:
                    o[bid, where[t]] = locs[rid, slot]
                    hits.append(slot)
                    found.add(t)
                else:
                    evict.append(slot)
            misses = [(i, t) for t, i in sorted(where.items(), key=lambda x: x[1]) if t not in found]
            for m, (i, t) in enumerate(misses):
                slot = evict[m]
                tokens[rid, slot] = t
                o[bid, i] = locs[rid, slot]
                device_buffer[int(locs[rid, slot])] = host_cache[int(hcl[rid, t])]
            n = len(misses)
            lr[rid] = np.array(evict[n:] + evict[:n] + hits, dtype=np.int16)


def _trace(batch=3, context=1500, top_k=128, steps=12, seed=0, spread=0.5, windows=4):
    return synthetic_trace(SyntheticTraceConfig(batch=batch, context_len=context, top_k=top_k, steps=steps,
                                                num_layers=2, recent_window=64, warmup_windows=windows,
                                                length_spread=spread, overlap=0.8, seed=seed))


# --------------------------------------------------------------------------------------- sources

def test_installed_sglang_is_located_with_its_version_and_tvm_ffi_pin():
    src = _installed()
    assert src.cuh.is_file() and src.cuh.name == "hisparse.cuh"
    assert (src.include_dir / "sgl_kernel" / "tensor.h").is_file()
    assert src.version == hk.SGLANG_VERSION
    assert src.requires_tvm_ffi == "==" + hk.TVM_FFI_VERSION
    assert "load_cache_to_device_buffer_kernel" in src.cuh.read_text()


def test_parse_includes_both_delimiters_and_conditionals():
    text = '#include <sgl_kernel/tensor.h>\n  #  include "source_location.h"\n#ifdef USE_ROCM\n#include <hip/x.h>\n' \
           '#endif\n// #include <not/a/real.h> is still matched by a line scanner only at line start\nint x;\n'
    assert hk.parse_includes(text) == [("<", "sgl_kernel/tensor.h"), ('"', "source_location.h"), ("<", "hip/x.h")]


def test_include_closure_of_the_kernel_resolves_every_sglang_and_tvm_header():
    src = _installed()
    cl = hk.include_closure(src.cuh, [src.include_dir], _tvm_include())
    assert cl.missing() == []
    for name in ("sgl_kernel/tensor.h", "sgl_kernel/utils.h", "sgl_kernel/runtime.cuh", "sgl_kernel/utils.cuh",
                 "sgl_kernel/deepseek_v4/kvcacheio.cuh"):
        assert name in cl.files, name
    assert {"dlpack/dlpack.h", "tvm/ffi/container/tensor.h"} <= set(cl.external)
    assert {"cuda_runtime.h", "cuda.h"} <= cl.system  # from the CUDA toolkit at build time
    # nothing from sglang is left unresolved
    assert not [n for n in cl.system if n.startswith("sgl_kernel")]


def test_include_closure_names_a_missing_header(tmp_path):
    (tmp_path / "inc" / "sgl_kernel").mkdir(parents=True)
    (tmp_path / "inc" / "sgl_kernel" / "a.h").write_text("#include <sgl_kernel/gone.h>\n#include <vector>\n")
    cuh = tmp_path / "k.cuh"
    cuh.write_text('#include <sgl_kernel/a.h>\n#include "local.h"\n')
    (tmp_path / "local.h").write_text("#include <tvm/ffi/x.h>\n")
    cl = hk.include_closure(cuh, [tmp_path / "inc"])
    assert set(cl.files) == {"k.cuh", "sgl_kernel/a.h", "local.h"}
    assert cl.missing() == ["sgl_kernel/gone.h", "tvm/ffi/x.h"]


def _fake_wheel(tmp_path: Path, src: hk.SglangSources, extra_member: str | None = None) -> Path:
    """A wheel-shaped zip made of the installed files the harness needs, plus an unrelated member."""
    whl = tmp_path / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for p in (src.root / hk.INCLUDE_RELDIR).rglob("*"):
            if p.is_file() and "__pycache__" not in p.parts:
                z.write(p, p.relative_to(src.root).as_posix())
        z.write(src.cuh, hk.CUH_RELPATH)
        meta = next(src.root.glob("sglang-*.dist-info/METADATA"), None)
        z.writestr("sglang-0.5.23.dist-info/METADATA", meta.read_text() if meta else "Version: 0.5.23\n")
        z.writestr("sglang/srt/unrelated.py", "x = 1\n")
        if extra_member:
            z.writestr(extra_member, "bad")
    return whl


def test_wheel_extraction_takes_only_the_kernel_sources_and_is_reused(tmp_path):
    src = _installed()
    whl = _fake_wheel(tmp_path, src)
    cache = tmp_path / "cache"
    got = hk.extract_wheel(whl, cache)
    assert got.cuh.is_file() and got.cuh.read_bytes() == src.cuh.read_bytes()
    assert got.version == "0.5.23" and got.origin == str(whl)
    assert not (got.root / "sglang/srt/unrelated.py").exists()
    cl = hk.include_closure(got.cuh, [got.include_dir], _tvm_include())
    assert cl.missing() == []
    marker = got.root / ".complete"
    t0 = marker.stat().st_mtime_ns
    again = hk.extract_wheel(whl, cache)  # reused, not re-extracted
    assert again.root == got.root and marker.stat().st_mtime_ns == t0
    # a folder holding the wheel, as .whl/hisparse/ does
    assert hk.locate_sglang(tmp_path, cache).root == got.root


def test_wheel_with_an_unsafe_member_or_without_the_kernel_is_refused(tmp_path):
    src = _installed()
    bad = _fake_wheel(tmp_path, src, extra_member="sglang/kernels/jit/include/../../../../evil.h")
    with pytest.raises(hk.HiSparseBuildError, match="unsafe"):
        hk.extract_wheel(bad, tmp_path / "c1")
    empty = tmp_path / "sglang-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("sglang/__init__.py", "")
    with pytest.raises(hk.HiSparseBuildError, match="hisparse.cuh"):
        hk.extract_wheel(empty, tmp_path / "c2")
    with pytest.raises(hk.HiSparseBuildError, match="does not exist"):
        hk.locate_sglang(tmp_path / "nowhere.whl")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(hk.HiSparseBuildError, match="sglang-\\*.whl"):
        hk.locate_sglang(tmp_path / "emptydir")


def test_default_lookup_order_uses_the_environment_variable(tmp_path, monkeypatch):
    src = _installed()
    whl = _fake_wheel(tmp_path, src)
    monkeypatch.setenv("ESS_SGLANG_WHEEL", str(whl))
    monkeypatch.setattr(hk, "DEFAULT_CACHE", tmp_path / "cache")
    assert hk.locate_sglang(None).origin == str(whl)
    monkeypatch.delenv("ESS_SGLANG_WHEEL")
    monkeypatch.setattr(hk, "DEFAULT_WHEEL_DIR", tmp_path / "none")
    assert hk.locate_sglang(None).origin.startswith("installed package")


# --------------------------------------------------------------------------------------- build recipe

def test_kernel_config_template_arguments_and_shared_memory():
    cfg = hk.KernelConfig()
    assert cfg.template_args() == "960, 2048, 4096, true, false, 1, false, false, false"
    assert hk.KernelConfig(skip_io=True).template_args().endswith("false, true")
    assert cfg.smem_bytes() == 42000 < 48 * 1024  # no dynamic shared memory opt-in needed
    with pytest.raises(ValueError, match="hot_buffer_size"):
        hk.KernelConfig(num_top_k=2048, hot_buffer_size=1024)
    with pytest.raises(ValueError, match="block_size"):
        hk.KernelConfig(block_size=1000)
    assert hk.arch_target(9, 0) == ("90a", 900)
    assert hk.arch_target(8, 0) == ("80", 800)


def test_wrapper_and_nvcc_flags_equal_what_sglang_generates():
    """Our translation unit is the text SGLang's loader writes, and our nvcc flags are its `cudaflags`."""
    src = _installed()
    try:
        from sglang.kernels.jit.utils.arch import get_default_target_flags, override_jit_cuda_arch
        from sglang.kernels.jit.utils.compile import ninja
        from sglang.kernels.jit.utils.compile import spec as spec_mod
        from sglang.kernels.jit.utils.compile.paths import DEFAULT_CFLAGS, DEFAULT_INCLUDE
    except Exception as exc:  # noqa: BLE001 - any import failure of sglang's JIT tooling skips this comparison
        pytest.skip(f"sglang's JIT tooling does not import here: {exc}")
    cfg = hk.KernelConfig()
    wrappers = (("load_cache_to_device_buffer", f"load_cache_to_device_buffer<{cfg.template_args()}>"),)
    with override_jit_cuda_arch(9, 0):
        spec = spec_mod.BuildSpec(module_args=("x",), cpp_files=(), cuda_files=spec_mod.resolve_sources(
            ["kvcacheio/hisparse.cuh"]), cpp_wrappers=(), cuda_wrappers=wrappers, cflags=tuple(DEFAULT_CFLAGS),
            cuda_cflags=tuple(get_default_target_flags()), ldflags=(), include_paths=tuple(DEFAULT_INCLUDE),
            header_only=True)
        ninja_text = ninja.generate(spec)
        theirs_unit = spec.translation_units()[0].source
    assert hk.wrapper_source(Path(spec.cuda_files[0]), cfg) == theirs_unit
    theirs = next(line for line in ninja_text.splitlines() if line.startswith("cudaflags = ")).split(" = ", 1)[1]
    tc = hk.find_toolchain()
    ours = hk.compile_commands(tc, src, Path("u.cu"), Path("m.so"), (9, 0))[0]
    ours_flags = " ".join(ours[1:ours.index("-c")])
    assert ours_flags == theirs


@pytest.mark.slow
def test_real_kernel_compiles_for_sm90a_and_loads(tmp_path):
    src = _installed()
    _tvm_include()
    try:
        hk.find_toolchain()
    except hk.HiSparseBuildError as exc:
        pytest.skip(str(exc))
    k = hk.build(src, arch=(9, 0), build_dir=tmp_path, load=True)
    assert k.so_path.is_file() and k.so_path.parent.parent == tmp_path
    assert callable(getattr(k.module, hk.KERNEL_EXPORT))
    assert hk.build(src, arch=(9, 0), build_dir=tmp_path, load=False).so_path == k.so_path  # cached


def test_missing_toolchain_is_named(monkeypatch):
    monkeypatch.setenv("CUDA_HOME", "/nonexistent/cuda")
    monkeypatch.setattr(hk.shutil, "which", lambda name: None)
    monkeypatch.setenv("CXX", "no-such-c++")
    with pytest.raises(hk.HiSparseBuildError) as exc:
        hk.find_toolchain()
    assert "nvcc" in str(exc.value) and "no-such-c++" in str(exc.value)


# --------------------------------------------------------------------------------------- state and checks

def test_state_has_the_coordinators_shapes_dtypes_and_warm_layout():
    tr = _trace(batch=3, context=1500, top_k=128)
    th = hk.make_trace_host(tr, layer=1, device="cpu")
    assert th.trace.num_layers == 1 and th.host_cache.dtype == torch.uint8 and th.host_cache.shape[1] == 656
    H, P = hk.sizes_for(128)
    assert (H, P) == (256, 4) and hk.sizes_for(2048) == (4096, 64)
    st = hk.make_layer_state(th, 2, H, P, 128, "staged")
    assert st.device_buffer_tokens.dtype == torch.int32 and st.device_buffer_tokens.shape == (2, H + P)
    assert st.device_buffer_locs.dtype == torch.int32 and st.device_buffer_locs.shape == (2, H + P)
    assert st.lru_slots.dtype == torch.int16 and st.lru_slots.shape == (2, H)
    assert torch.equal(st.lru_slots[1], torch.arange(H, dtype=torch.int16))
    assert st.host_cache_locs.dtype == torch.int64 and st.host_cache_locs.shape[1] == th.loc.shape[1] + P
    assert st.top_k_device_locs.shape == (2, 128) and st.num_real_reqs.tolist() == [2]
    assert st.device_buffer.shape == (2 * (H + P), 656) and st.nbytes_device() == 2 * (H + P) * 656
    assert torch.equal(st.device_buffer_tokens[:, :H], torch.arange(H, dtype=torch.int32).expand(2, H))
    assert (st.device_buffer_tokens[:, H:] == -1).all()
    # warm rows hold the host entries of positions 0..H-1
    r = 1
    rows = st.device_buffer_locs[r, :H].long()
    assert torch.equal(st.device_buffer[rows], th.host_cache[torch.from_numpy(th.loc[r, :H])])
    pd = hk.make_layer_state(th, 2, H, P, 128, "pd_direct")
    assert (pd.device_buffer_tokens == -1).all()  # long prompts start with nothing resident
    with pytest.raises(ValueError, match="warm"):
        hk.make_layer_state(th, 2, H, P, 128, "cold")


def test_host_rows_are_distinct():
    e = torch.zeros((5000, 656), dtype=torch.uint8)
    hk.fill_pattern(e, chunk=1024)
    assert torch.unique(e, dim=0).shape[0] == 5000


def test_argument_checks_name_the_offending_tensor():
    tr = _trace(batch=2, top_k=128)
    th = hk.make_trace_host(tr, device="cpu")
    H, P = hk.sizes_for(128)
    st = hk.make_layer_state(th, 2, H, P, 128)
    cfg = hk.KernelConfig(num_top_k=128, hot_buffer_size=H)
    top = torch.from_numpy(np.ascontiguousarray(th.trace.topk[0, 0])).int()
    seq = torch.from_numpy(th.trace.seq_lens[0].astype(np.int64))
    rpi = torch.arange(2)
    args = [top, st.device_buffer_tokens, st.host_cache_locs, st.device_buffer_locs, st.host_cache,
            st.device_buffer, st.top_k_device_locs, rpi, seq, st.lru_slots, st.num_real_reqs]
    hk.check_args(*args, config=cfg)
    for i, bad, msg in [(0, top.long(), "top_k_tokens: must be int32"), (9, st.lru_slots.int(), "lru_slots"),
                        (2, st.host_cache_locs.int(), "host_cache_locs"), (7, rpi.float(), "req_pool_indices"),
                        (0, top[:, :64].contiguous(), "top_k_tokens must be"),
                        (4, st.host_cache.view(-1, 328), "item_size_bytes")]:
        a = list(args)
        a[i] = bad
        with pytest.raises(ValueError, match=msg):
            hk.check_args(*a, config=cfg)


@pytest.mark.parametrize("warm", ["staged", "pd_direct"])
def test_eager_replay_with_the_reference_kernel_checks_rows_and_matches_the_emulator(warm):
    tr = _trace(batch=3, context=1500, top_k=128, steps=12)
    th = hk.make_trace_host(tr, device="cpu")
    H, _ = hk.sizes_for(128)
    ref = RefKernel(hk.KernelConfig(num_top_k=128, hot_buffer_size=H))
    ev = hk.replay_eager(ref, th, 3, warm=warm, check=True)
    assert ev.checks["checked"] == int((th.trace.topk >= 0).sum())
    assert ev.checks["differ"] == ev.checks["no_slot"] == ev.checks["duplicate_rows"] == 0
    emu = hk.emulate_misses(th.trace, H, warm)
    assert np.array_equal(ev.misses, emu)
    assert ev.misses[0].sum() > ev.misses[1:].mean(axis=0).sum()  # the cold first step
    if warm == "pd_direct":
        assert ev.misses[0].sum() == int((th.trace.topk[0] >= 0).sum()) - 3  # everything but the newest tokens
    # the first two requests of the same trace replay identically (requests are independent)
    ev2 = hk.replay_eager(ref, th, 2, warm=warm, check=False)
    assert np.array_equal(ev2.misses, ev.misses[:, :2])


def test_short_prompts_take_the_fast_path_and_a_wrong_slot_is_caught():
    tr = _trace(batch=2, context=200, top_k=128, steps=8, windows=0, spread=0.2)  # prompts shorter than H = 256
    th = hk.make_trace_host(tr, device="cpu")
    H, _ = hk.sizes_for(128)
    ref = RefKernel(hk.KernelConfig(num_top_k=128, hot_buffer_size=H))
    ev = hk.replay_eager(ref, th, 2)
    assert ev.misses.sum() == 0 and ev.checks["differ"] == 0 and ev.checks["checked"] > 0

    class Broken(RefKernel):  # maps every selected token one slot off
        def __call__(self, top_k, *a, **kw):
            super().__call__(top_k, *a, **kw)
            out = a[5]
            out[: top_k.shape[0]] = torch.where(out[: top_k.shape[0]] >= 0, out[: top_k.shape[0]] + 1, -1)

    bad = hk.replay_eager(Broken(ref.config), th, 2)
    assert bad.checks["differ"] > 0


def test_summary_excludes_step_zero_from_the_median():
    t = np.array([[100.0, 10, 12, 11], [90.0, 11, 10, 12]])
    s = hk.summarize_times(t, misses=np.array([400, 10, 20, 30]), lookups=np.array([1000] * 4), item=656)
    assert s["us"] == pytest.approx(11.0) and s["us_step0"] == pytest.approx(95.0)
    assert s["hit_rate"] == pytest.approx(1 - 460 / 4000)
    assert s["hit_rate_after_step0"] == pytest.approx(1 - 60 / 3000)
    assert s["miss_bytes"] == 460 * 656 and s["bytes_per_step"] == pytest.approx(20 * 656)


# --------------------------------------------------------------------------------------- vs_hisparse --gpu (CPU part)

def test_gpu_traces_are_one_layer_of_top_k_2048():
    tr = vs_hisparse.gpu_trace("syn-sticky", 3, 8192, 4)
    assert tr.topk.shape == (4, 1, 3, 2048) and tr.warmup_topk.shape[2] == 8
    assert int(tr.prompt_lens.min()) >= 4096 and int(tr.prompt_lens.max()) == 8192
    sub = tr.subset(requests=[0, 1])
    assert np.array_equal(sub.topk, tr.topk[:, :, :2])


def test_time_hisparse_and_time_ess_run_their_graph_loops_on_the_cpu():
    """The timed loops (restore, static inputs, replay, misses from the state) with RefKernel and ESS's torch path:
    the replayed passes see the same misses as the eager pass, and both policies' rows check out."""
    tr = _trace(batch=3, context=1500, top_k=128, steps=6)
    th = hk.make_trace_host(tr, device="cpu")
    H, _ = hk.sizes_for(128)
    res = hk.time_hisparse(th.trace, 3, RefKernel(hk.KernelConfig(num_top_k=128, hot_buffer_size=H)), th=th,
                           reps=2, device="cpu")
    assert res["graph_vs_eager_mismatch"] == 0 and res["emulator_mismatch_requests"] == 0
    assert res["checks"]["differ"] == 0 and len(res["times_us"]) == 2 and len(res["times_us"][0]) == 6
    assert res["slots_per_request"] == H + 4 and res["device_bytes"] == 3 * (H + 4) * 656
    es = vs_hisparse.time_ess(th, 3, reps=2, resolve_impl="torch")
    assert es["checks"]["differ"] == es["checks"]["no_slot"] == 0 and es["checks"]["checked"] > 0
    assert es["graph_vs_eager_mismatch_steps"] == 0 and es["overflow"] == 0
    assert es["device_bytes"] == res["device_bytes"]  # equal GPU memory for hot entries
    assert 0.3 < es["hit_rate"] <= 1 and 0.3 < res["hit_rate"] <= 1


def test_gpu_pipeline_dry_run_on_the_cpu(tmp_path, capsys):
    """`gpu_timing` end to end at DeepSeek's sizes (top-k 2048, 4096 + 64 slots) on a tiny batch, with RefKernel in
    place of the compiled kernel: traces, host pool, emulation, both timings, bookkeeping pass, table and plot."""
    doc = vs_hisparse.gpu_timing(batches=[1, 2], families=["syn-steady"], context=8192, steps=3, reps=1,
                                 device="cpu", make_kernel=RefKernel, resolve_impl="torch", bookkeeping=True)
    assert [r["batch"] for r in doc["rows"]] == [1, 2]
    for r in doc["rows"]:
        h, e = r["hisparse"], r["ess"]
        assert h["checks"]["differ"] == h["checks"]["no_slot"] == h["checks"]["duplicate_rows"] == 0
        assert h["emulator_mismatch_requests"] == 0 and h["graph_vs_eager_mismatch"] == 0
        assert e["checks"]["differ"] == 0 and e["overflow"] == 0
        assert h["slots_per_request"] == 4160 and e["slots_per_layer"] == 4160 * r["batch"]
        assert "hisparse_noio" in r and "ess_noio" in r
    assert doc["sglang"]["kernel"] == "load_cache_to_device_buffer<960, 2048, 4096, true, false, 1, false, false, " \
                                      "false>"
    vs_hisparse.print_gpu_table(doc)
    assert "| syn-steady | 2 |" in capsys.readouterr().out
    vs_hisparse.plot_gpu(doc, tmp_path / "dry.png")
    assert (tmp_path / "dry.png").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_gpu_flag_refuses_without_a_gpu_and_checks_family_names(capsys):
    with pytest.raises(SystemExit, match="unknown family"):
        vs_hisparse.main(["--gpu", "--gpu-families", "syn-nope"])
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        vs_hisparse.main(["--gpu", "--quick", "--out", "/tmp/unused"])


def test_gpu_table_and_plot_from_a_result_document(tmp_path, capsys):
    def side(us, hit, miss):
        return dict(us=us, us_p10=us * 0.9, us_p90=us * 1.1, us_step0=us * 5, hit_rate=hit, hit_rate_after_step0=hit,
                    hit_rate_emulator=hit, bytes_per_step=miss * 656.0, miss_bytes=miss * 656 * 10,
                    emulator_mismatch_requests=0, graph_vs_eager_mismatch=0, graph_vs_eager_mismatch_steps=0,
                    checks=dict(checked=10, no_slot=0, differ=0, duplicate_rows=0))

    rows = [dict(family="syn-steady", batch=b, hisparse=side(20.0 * b, 0.91, 180 * b),
                 ess=side(15.0 * b, 0.92, 170 * b), ratio=0.75) for b in (1, 8, 64)]
    doc = dict(device="cpu", rows=rows, bookkeeping=False)
    vs_hisparse.print_gpu_table(doc)
    out = capsys.readouterr().out
    assert "| syn-steady | 64 | 1280.0 | 960.0 | 0.75 |" in out and "rows ok; emulator = kernel |" in out
    vs_hisparse.plot_gpu(doc, tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 10_000


# --------------------------------------------------------------------------------------- on the GPU

@pytest.mark.gpu
def test_real_kernel_equals_the_reference_slot_for_slot_and_times_in_a_graph():
    """The compiled SGLang kernel against RefKernel (CPU) on the same trace: identical slot tables, misses and LRU
    state every step; rows checked against the host pool; then the timed graph replay and ESS's timing run."""
    kernel = hk.build(None)
    tr = vs_hisparse.gpu_trace("syn-steady", 4, 12288, 6)
    th = hk.make_trace_host(tr, device="cuda")
    th_cpu = hk.make_trace_host(tr, device="cpu")
    ev = hk.replay_eager(kernel, th, 4, check=True)
    ref = hk.replay_eager(RefKernel(kernel.config), th_cpu, 4, check=True)
    assert ev.checks["differ"] == ev.checks["no_slot"] == ev.checks["duplicate_rows"] == 0
    assert ev.checks["checked"] == int((tr.topk[:, 0, :4] >= 0).sum())
    assert np.array_equal(ev.misses, ref.misses)
    assert np.array_equal(ev.misses, hk.emulate_misses(th.trace, 4096, "staged"))
    assert torch.equal(ev.state.lru_slots.cpu(), ref.state.lru_slots)
    assert torch.equal(ev.state.device_buffer_tokens.cpu(), ref.state.device_buffer_tokens)
    assert torch.equal(ev.state.top_k_device_locs.cpu(), ref.state.top_k_device_locs)
    res = hk.time_hisparse(th.trace, 4, kernel, th=th, reps=1)
    assert res["graph_vs_eager_mismatch"] == 0 and res["emulator_mismatch_requests"] == 0
    assert 0 < res["us"] < 5000 and 0.5 < res["hit_rate"] <= 1.0
    es = vs_hisparse.time_ess(th, 4, reps=1)
    assert es["checks"]["differ"] == es["checks"]["no_slot"] == 0 and es["overflow"] == 0
    assert 0 < es["us"] < 5000 and 0.5 < es["hit_rate"] <= 1.0
    print(f"\nbatch 4: HiSparse {res['us']:.1f} us (hit {res['hit_rate']:.4f}), ESS {es['us']:.1f} us "
          f"(hit {es['hit_rate']:.4f}); HiSparse host tensor passed as {res['host_cache_passed_as']}")
