"""SGLang 0.5.23 HiSparse's swap-in kernel, built from the sglang wheel at run time and driven on top-k traces.

What is measured: `load_cache_to_device_buffer_kernel` from ``sglang/kernels/jit/csrc/kvcacheio/hisparse.cuh``, the
kernel that SGLang's `HiSparseCoordinator._run_swap_in_kernel` launches once per layer in decode (through
`sglang.kernels.ops.kvcache.hisparse.load_cache_to_device_buffer_mla`). Its Python wrapper imports much of SGLang,
which does not run on the test GPU, so this module does what SGLang's JIT loader (`kernels/jit/utils/compile`) does,
with nothing of SGLang imported:

- `locate_sglang`: find the sglang sources -- a wheel file (extracted, only ``kernels/jit/include`` and
  ``kernels/jit/csrc/kvcacheio``, into a cache folder), an unpacked tree, or the installed package (found with
  `importlib.util.find_spec`, not imported). `include_closure` follows the header's ``#include`` lines and names any
  header that is missing.
- `build`: write OUR OWN ten-line CUDA translation unit that ``#include``s their ``hisparse.cuh`` unchanged (by
  absolute path) and exports one instantiation through ``TVM_FFI_DLL_EXPORT_TYPED_FUNC``, as SGLang's generated
  wrapper does; compile it with nvcc using SGLang's flags (``-gencode=arch=compute_90a,code=sm_90a
  -DSGL_CUDA_ARCH=900 -std=c++20 -O3 --expt-relaxed-constexpr``, tvm-ffi and sglang include folders), link it
  against ``libtvm_ffi`` and ``libcudart``, and load it with ``tvm_ffi.load_module``. The template arguments are
  SGLang's production ones for DeepSeek-V3.2: ``<BLOCK_SIZE=960, NUM_TOP_K=2048, HOT_BUFFER_SIZE=4096, IsMLA=true,
  IsDsv4Layout=false, SPARSE_BLOCK_SIZE=1, TopKIsBlocks=false, RecordMissPlan=false, SkipIO=false>`` (960 =
  `swap_in_block_size` default in ``srt/mem_cache/sparsity/factory.py``). ``SkipIO=true`` builds SGLang's own timing
  probe that moves no KV bytes (bookkeeping only).
- `HiSparseKernel.__call__`: the argument list of `load_cache_to_device_buffer_mla` (MLA: no V tensors; no miss plan),
  with dtype / shape / device checks (the C++ side checks none of them) and the tvm-ffi stream set to torch's current
  stream, so that the launch lands in a CUDA graph being captured.
- `HiSparseLayerState` / `make_layer_state` / `hisparse_swap_in`: the tensors the coordinator keeps per layer
  (``hisparse_coordinator.py:640-728``): `device_buffer_tokens` / `device_buffer_locs` int32 [rows, 4096 + 64],
  `lru_slots` int16 [rows, 4096] (initialised 0, 1, 2, ...), `req_to_host_pool` int64 [rows, max_len + 64], the
  device KV buffer (uint8 rows of 656 B, request r owning rows r x 4160 ...), `top_k_device_locs` int32 [rows, 2048],
  `num_real_reqs` int32 [1]; the host pool is a pinned CPU uint8 [tokens, 656] tensor (the kernel takes its device
  pointer with cudaHostGetDevicePointer). Warm-up as in `alloc_device_buffer` ("staged": the prompt's first 4096
  tokens resident in slots 0..4095) or a PD decode server's `admit_request_direct` ("pd_direct": long prompts start
  with every slot empty).
- `time_hisparse`: replays a `TopKTrace` (``ess_sglang.traces``) step by step through the kernel, captured once in a
  CUDA graph and replayed with each step's top-k and sequence lengths copied into its static inputs; times every
  replay with CUDA events; counts misses from the kernel's own state (a miss writes its token into an evicted slot of
  `device_buffer_tokens`, a hit changes nothing there, so misses = slots whose token changed); checks, in an eager
  pass first, that every selected token's device row (through the returned slot table) equals its host entry, and
  that the per-request miss counts equal those of the numpy emulation `ess_sglang.hisparse_policy.HiSparseBuffer`.

Nothing from SGLang is copied into this repository: its files are read from the wheel (or installation) at run time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SGLANG_VERSION = "0.5.23"
TVM_FFI_VERSION = "0.1.11"  # sglang 0.5.23 pins apache-tvm-ffi==0.1.11 (its METADATA)
JIT_DIR = "sglang/kernels/jit"
CUH_RELPATH = f"{JIT_DIR}/csrc/kvcacheio/hisparse.cuh"  # relative to the folder that holds sglang/
INCLUDE_RELDIR = f"{JIT_DIR}/include"
TOPK_CUH_RELPATH = f"{JIT_DIR}/csrc/deepseek_v4/topk_v2.cuh"  # SGLang's decode top-k (benchmarks/sglang_topk.py)
PROBE_CUH_RELPATH = f"{JIT_DIR}/csrc/occupancy/cluster_probe.cuh"  # the occupancy probe its build flags need
EXTRACT_PREFIXES = (f"{JIT_DIR}/include/", f"{JIT_DIR}/csrc/kvcacheio/", TOPK_CUH_RELPATH, PROBE_CUH_RELPATH)
KERNEL_EXPORT = "load_cache_to_device_buffer"
ITEM_BYTES = 656  # V32 latent entry (SGLang's `token_stride_size` of the MLA host pool for DeepSeek-V3.2 fp8)
TOP_K = 2048
HOT_BUFFER = 4096  # device_buffer_size = 2 x top_k
PAGE = 64  # the extra page per request (DSA page size); its first slot holds the newest token
BLOCK_SIZE = 960  # swap_in_block_size default
REPO = Path(__file__).resolve().parents[1]
DEFAULT_WHEEL_DIR = REPO / ".whl" / "hisparse"
DEFAULT_CACHE = Path(os.environ.get("ESS_HISPARSE_CACHE", "/tmp/ess_hisparse"))
# SGLang's device flags (arch.get_default_target_flags + toolchain.base_cuda_flags + target_flags)
NVCC_FLAGS = ("-Xcompiler", "-fPIC", "-std=c++20", "-O3", "--expt-relaxed-constexpr")
# What SGLang's generated wrapper includes before the kernel sources (compile/spec.py `_FFI_INCLUDES`)
FFI_INCLUDES = ("tvm/ffi/container/tensor.h", "tvm/ffi/dtype.h", "tvm/ffi/error.h", "tvm/ffi/extra/c_env_api.h",
                "tvm/ffi/function.h")


class HiSparseBuildError(RuntimeError):
    """Something the HiSparse kernel build needs is missing; the message names it and where it was looked for."""


# ------------------------------------------------------------------------------------------------ locating sources

@dataclass
class SglangSources:
    """Where the kernel's files are: `root` holds ``sglang/`` (a wheel extract, an unpacked tree or site-packages)."""

    root: Path
    origin: str  # the wheel file, folder or installed package they came from
    version: str | None = None
    requires_tvm_ffi: str | None = None  # e.g. "==0.1.11", from the wheel's METADATA

    @property
    def cuh(self) -> Path:
        return self.root / CUH_RELPATH

    @property
    def include_dir(self) -> Path:
        return self.root / INCLUDE_RELDIR


def _read_metadata(root: Path) -> tuple[str | None, str | None]:
    """(Version, apache-tvm-ffi requirement) from the sglang dist-info METADATA beside `root`/sglang, if any."""
    for meta in sorted(root.glob("sglang-*.dist-info/METADATA")):
        version = req = None
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                version = line.split(":", 1)[1].strip()
            m = re.match(r"Requires-Dist:\s*apache-tvm-ffi\s*([^;\s]*)", line)
            if m:
                req = m.group(1) or ""
        return version, req
    return None, None


def wheel_member_needed(name: str) -> bool:
    """Whether a member of the sglang wheel is one the kernel build reads: its sources or the METADATA."""
    return name.startswith(EXTRACT_PREFIXES) or re.fullmatch(r"sglang-[^/]+\.dist-info/METADATA", name) is not None


def extract_wheel(wheel: Path, cache_dir: Path | None = None) -> SglangSources:
    """Extract the kernel's sources (and METADATA) from an sglang wheel into `cache_dir`; returns where they are.

    Only ``sglang/kernels/jit/include/**``, ``sglang/kernels/jit/csrc/kvcacheio/**``, the decode top-k's
    ``csrc/deepseek_v4/topk_v2.cuh`` and ``csrc/occupancy/cluster_probe.cuh`` are written (a few hundred KB); an
    extract that is already complete is reused (its folder is named by the wheel and by what is extracted, so an
    extract made for fewer files is not).
    """
    wheel = Path(wheel)
    if not wheel.is_file():
        raise HiSparseBuildError(f"sglang wheel {wheel} does not exist")
    cache_dir = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE / "src"
    stat = wheel.stat()
    kept = hashlib.sha256("\n".join(EXTRACT_PREFIXES).encode()).hexdigest()[:8]
    dest = cache_dir / f"{wheel.stem}-{stat.st_size}-{kept}"
    done = dest / ".complete"
    if not done.is_file():
        tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with zipfile.ZipFile(wheel) as z:
                names = [n for n in z.namelist() if wheel_member_needed(n)]
                if not any(n == CUH_RELPATH for n in names):
                    raise HiSparseBuildError(f"{wheel} has no {CUH_RELPATH}: not an sglang {SGLANG_VERSION} wheel?")
                for n in names:
                    if n.endswith("/"):
                        continue
                    if n.startswith("/") or ".." in Path(n).parts:
                        raise HiSparseBuildError(f"{wheel}: refusing member with an unsafe path {n!r}")
                    out = tmp / n
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(z.read(n))
        except zipfile.BadZipFile as exc:
            raise HiSparseBuildError(f"{wheel} is not a readable wheel (zip): {exc}") from exc
        (tmp / ".complete").write_text(str(wheel))
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(dest)
    version, req = _read_metadata(dest)
    return SglangSources(root=dest, origin=str(wheel), version=version, requires_tvm_ffi=req)


def _installed_sglang_root() -> Path | None:
    """The folder holding the installed ``sglang`` package (site-packages), found without importing sglang."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


def locate_sglang(source: str | Path | None = None, cache_dir: Path | None = None) -> SglangSources:
    """Find the sglang sources of the HiSparse kernel.

    source: an sglang wheel (``.whl``), a folder holding one (such as ``.whl/hisparse``), a folder that holds
    ``sglang/`` (site-packages, an unpacked wheel) or the ``sglang`` package folder itself. None: the environment
    variable ESS_SGLANG_WHEEL, then ``.whl/hisparse/sglang-*.whl`` of this repository, then the installed package.
    """
    tried: list[str] = []
    if source is None:
        env = os.environ.get("ESS_SGLANG_WHEEL")
        if env:
            return locate_sglang(env, cache_dir)
        tried.append("$ESS_SGLANG_WHEEL (unset)")
        wheels = sorted(DEFAULT_WHEEL_DIR.glob("sglang-*.whl"))
        if wheels:
            return extract_wheel(wheels[-1], cache_dir)
        tried.append(f"{DEFAULT_WHEEL_DIR}/sglang-*.whl (none; run scripts/hisparse_wheels.sh)")
        root = _installed_sglang_root()
        if root is not None and (root / CUH_RELPATH).is_file():
            version, req = _read_metadata(root)
            return SglangSources(root=root, origin=f"installed package at {root / 'sglang'}", version=version,
                                 requires_tvm_ffi=req)
        tried.append("the installed sglang package (" + ("not installed" if root is None else
                                                         f"{root / CUH_RELPATH} missing") + ")")
        raise HiSparseBuildError("cannot find SGLang's HiSparse kernel sources; looked in: " + "; ".join(tried))
    src = Path(source)
    if src.is_file():
        return extract_wheel(src, cache_dir)
    if src.is_dir():
        if (src / CUH_RELPATH).is_file():
            version, req = _read_metadata(src)
            return SglangSources(root=src.resolve(), origin=str(src), version=version, requires_tvm_ffi=req)
        if (src / "kernels/jit/csrc/kvcacheio/hisparse.cuh").is_file() and src.name == "sglang":
            return locate_sglang(src.parent, cache_dir)
        wheels = sorted(src.glob("sglang-*.whl"))
        if wheels:
            return extract_wheel(wheels[-1], cache_dir)
        raise HiSparseBuildError(f"{src} holds neither {CUH_RELPATH} nor an sglang-*.whl")
    raise HiSparseBuildError(f"sglang source {src} does not exist")


# ------------------------------------------------------------------------------------------------ includes

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)


def parse_includes(text: str) -> list[tuple[str, str]]:
    """The ``#include`` lines of a C/C++ source: [(delimiter '<' or '"', name)], in order (conditional ones too)."""
    return [(m.group(1), m.group(2).strip()) for m in _INCLUDE_RE.finditer(text)]


@dataclass
class IncludeClosure:
    files: dict[str, Path] = field(default_factory=dict)  # sglang headers followed (name -> path), the .cuh first
    external: dict[str, Path] = field(default_factory=dict)  # found in the extra include dirs (tvm-ffi, dlpack)
    system: set[str] = field(default_factory=set)  # not found anywhere given: CUDA, HIP and C++ headers

    def missing(self, prefixes: Sequence[str] = ("sgl_kernel/", "tvm/", "dlpack/")) -> list[str]:
        """Names the build needs from sglang / tvm-ffi that were not found."""
        return sorted(n for n in self.system if n.startswith(tuple(prefixes)))


def include_closure(cuh: Path, include_dirs: Sequence[Path], extra_dirs: Sequence[Path] = ()) -> IncludeClosure:
    """Follow `cuh`'s includes through `include_dirs` (recursively; quoted names relative to the includer first).

    Headers found in `extra_dirs` (tvm-ffi's) are recorded but not followed; names found nowhere are `system`.
    """
    out = IncludeClosure()
    cuh = Path(cuh)
    out.files[cuh.name] = cuh
    todo = [cuh]
    while todo:
        cur = todo.pop()
        for delim, name in parse_includes(cur.read_text(errors="replace")):
            if name in out.files or name in out.external or name in out.system:
                continue
            cands = ([cur.parent / name] if delim == '"' else []) + [Path(d) / name for d in include_dirs]
            hit = next((c for c in cands if c.is_file()), None)
            if hit is not None:
                out.files[name] = hit
                todo.append(hit)
                continue
            ext = next((Path(d) / name for d in extra_dirs if (Path(d) / name).is_file()), None)
            if ext is not None:
                out.external[name] = ext
            else:
                out.system.add(name)
    return out


# ------------------------------------------------------------------------------------------------ toolchain

@dataclass
class Toolchain:
    nvcc: Path
    cuda_home: Path
    cxx: str
    tvm_include: tuple[Path, ...]
    tvm_lib: Path
    tvm_version: str


def find_cuda_home() -> Path:
    """CUDA root as SGLang resolves it ($CUDA_HOME / $CUDA_PATH, then nvcc on PATH, then /usr/local/cuda), preferring
    a candidate that has both bin/nvcc and lib64/ (nvcc on PATH may be a wrapper script outside the toolkit)."""
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if env:
        return Path(env)
    cands = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands += [Path(nvcc).parent.parent, Path(os.path.realpath(nvcc)).parent.parent]
    cands.append(Path("/usr/local/cuda"))
    for c in cands:
        if (c / "bin" / "nvcc").is_file() and (c / "lib64").is_dir():
            return c
    return next((c for c in cands if (c / "bin" / "nvcc").is_file()), cands[0])


def find_toolchain() -> Toolchain:
    """nvcc, the host compiler and tvm-ffi's headers and library; HiSparseBuildError names whatever is missing."""
    missing = []
    cuda_home = find_cuda_home()
    nvcc = cuda_home / "bin" / "nvcc"
    if not nvcc.is_file():
        which = shutil.which("nvcc")
        if which:
            nvcc = Path(which)
        else:
            missing.append(f"nvcc (looked for {cuda_home / 'bin/nvcc'} and on PATH; set CUDA_HOME)")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        missing.append(f"a host C++ compiler ({cxx!r}; set CXX)")
    tvm_inc: tuple[Path, ...] = ()
    tvm_lib = Path()
    tvm_version = ""
    try:
        import tvm_ffi
        from tvm_ffi import libinfo

        tvm_version = getattr(tvm_ffi, "__version__", "")
        tvm_inc = tuple(dict.fromkeys(Path(p) for p in (libinfo.find_include_path(),
                                                        libinfo.find_dlpack_include_path())))
        tvm_lib = Path(libinfo.find_libtvm_ffi())
    except ImportError as exc:
        missing.append(f"the tvm_ffi package (apache-tvm-ffi=={TVM_FFI_VERSION}; install .whl/apache_tvm_ffi-*.whl, "
                       f"see scripts/hisparse_wheels.sh): {exc}")
    except RuntimeError as exc:
        missing.append(f"tvm-ffi's headers or libtvm_ffi.so: {exc}")
    if missing:
        raise HiSparseBuildError("cannot build SGLang's HiSparse kernel; missing: " + "; ".join(missing))
    return Toolchain(nvcc=nvcc, cuda_home=cuda_home, cxx=cxx, tvm_include=tvm_inc, tvm_lib=tvm_lib,
                     tvm_version=tvm_version)


def arch_target(major: int, minor: int) -> tuple[str, int]:
    """(gencode target such as "90a", SGL_CUDA_ARCH value) for a compute capability, following SGLang's rule:
    arch-specific "a" targets on 9.x and 10.x+ (JIT builds run on the exact GPU), plain below 9.0."""
    suffix = "a" if major >= 9 else ""
    return f"{major}{minor}{suffix}", major * 100 + minor * 10


# ------------------------------------------------------------------------------------------------ build

@dataclass(frozen=True)
class KernelConfig:
    """Template arguments of `load_cache_to_device_buffer<...>` (SGLang's `_jit_sparse_module` order)."""

    block_size: int = BLOCK_SIZE
    num_top_k: int = TOP_K
    hot_buffer_size: int = HOT_BUFFER
    is_mla: bool = True
    is_dsv4_layout: bool = False
    top_k_block_size: int = 1
    top_k_is_blocks: bool = False
    record_miss_plan: bool = False
    skip_io: bool = False

    def __post_init__(self) -> None:
        if self.hot_buffer_size < self.num_top_k:
            raise ValueError(f"hot_buffer_size ({self.hot_buffer_size}) must be >= num_top_k ({self.num_top_k})")
        if not 32 <= self.block_size <= 1024 or self.block_size % 32:
            raise ValueError(f"block_size must be a multiple of 32 in [32, 1024], got {self.block_size}")
        if self.hot_buffer_size > 32767:
            raise ValueError("hot_buffer_size must fit the kernel's int16 LRU slots (<= 32767)")

    def template_args(self) -> str:
        vals = (self.block_size, self.num_top_k, self.hot_buffer_size, self.is_mla, self.is_dsv4_layout,
                self.top_k_block_size, self.top_k_is_blocks, self.record_miss_plan, self.skip_io)
        return ", ".join(("true" if v else "false") if isinstance(v, bool) else str(v) for v in vals)

    def smem_bytes(self) -> int:
        """Dynamic shared memory per block (the kernel's `SmemLayout`): < 48 KB needs no opt-in."""
        k, h = self.num_top_k * (self.top_k_block_size if self.top_k_is_blocks else 1), self.hot_buffer_size
        chunks = (h + 31) // 32
        return (k + 2 * (chunks + 1) + 2 * k + 2) * 4 + (h + 2 * k) * 2


def export_source(cuh: Path, exports: Sequence[tuple[str, str]], defines: Sequence[tuple[str, int]] = ()) -> str:
    """Our translation unit for one of SGLang's JIT kernels: tvm-ffi headers, their header by absolute path, and
    each (export, function) pair's function (in namespace sglang) exported under its name: the text SGLang's loader
    writes. `defines` (name, value): ``#define`` lines first, in place of the ``-D`` flags SGLang adds for some
    kernels (the header reads them the same way, and they then take part in the build's cache key)."""
    lines = [f"#define {name} {value}" for name, value in defines]
    lines += [f"#include <{h}>" for h in FFI_INCLUDES]
    lines.append(f'#include "{Path(cuh).resolve()}"')
    lines.append("namespace sglang {")
    lines += [f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({export}, ({function}));" for export, function in exports]
    lines.append("}  // namespace sglang")
    return "\n".join(lines) + "\n"


def wrapper_source(cuh: Path, config: KernelConfig) -> str:
    """The HiSparse kernel's translation unit: one exported instantiation of `load_cache_to_device_buffer`."""
    return export_source(cuh, [(KERNEL_EXPORT, f"{KERNEL_EXPORT}<{config.template_args()}>")])


def compile_commands(tc: Toolchain, src: SglangSources, unit: Path, out: Path, arch: tuple[int, int]
                     ) -> list[list[str]]:
    """The nvcc compile and the link, as SGLang's generated build.ninja runs them."""
    target, sgl_arch = arch_target(*arch)
    inc = [f"-I{p}" for p in (*tc.tvm_include, src.include_dir)]
    obj = out.with_suffix(".o")
    compile_cmd = [str(tc.nvcc), *NVCC_FLAGS[:2], f"-gencode=arch=compute_{target},code=sm_{target}",
                   f"-DSGL_CUDA_ARCH={sgl_arch}", *NVCC_FLAGS[2:], *inc, "-c", str(unit), "-o", str(obj)]
    lib_dir = tc.tvm_lib.parent
    lib_name = tc.tvm_lib.stem.removeprefix("lib")
    rt_dir, rt_flag = find_cudart(tc.cuda_home)
    link_cmd = [tc.cxx, str(obj), "-shared", f"-L{lib_dir}", f"-l{lib_name}", f"-L{rt_dir}", rt_flag,
                f"-Wl,-rpath,{lib_dir}", f"-Wl,-rpath,{rt_dir}", "-o", str(out)]
    return [compile_cmd, link_cmd]


def find_cudart(cuda_home: Path) -> tuple[Path, str]:
    """(folder, linker flag) for libcudart: SGLang links `-L$CUDA_HOME/lib64 -lcudart`; toolkits laid out otherwise
    (lib/, targets/x86_64-linux/lib/, or only a versioned libcudart.so.N) get the folder and name that exist."""
    dirs = [cuda_home / "lib64", cuda_home / "lib", cuda_home / "targets" / "x86_64-linux" / "lib"]
    for d in dirs:
        if (d / "libcudart.so").exists():
            return d, "-lcudart"
    for d in dirs:
        versioned = sorted(d.glob("libcudart.so.*")) if d.is_dir() else []
        if versioned:
            return d, f"-l:{versioned[0].name}"
    return dirs[0], "-lcudart"  # as SGLang; the link names what is missing


def _prepare_tvm_ffi_import() -> None:
    """tvm-ffi JIT-builds a torch DLPack add-on at import when torch lacks the C exchange API (slow, needs ninja);
    torch >= 2.10 has it. Skip that build where torch lacks it: the plain __dlpack__ path works too."""
    try:
        import torch
    except ImportError:
        return
    if not (hasattr(torch.Tensor, "__dlpack_c_exchange_api__") or hasattr(torch.Tensor, "__c_dlpack_exchange_api__")):
        os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")


def build_arch(arch: tuple[int, int] | None) -> tuple[int, int]:
    """The (major, minor) to compile for: `arch`, or the current GPU's (an error naming the fix where there is none)."""
    if arch is not None:
        return tuple(arch)
    import torch

    if not torch.cuda.is_available():
        raise HiSparseBuildError("no CUDA GPU to build for: pass arch=(major, minor) to compile without one")
    return torch.cuda.get_device_capability()


def warn_if_other_version(src: SglangSources, who: str) -> None:
    """Print a warning where the sources are another sglang than the one the harness was read against."""
    if src.version is not None and src.version != SGLANG_VERSION:
        print(f"{who}: warning: sglang {src.version} from {src.origin}, this harness was read against "
              f"{SGLANG_VERSION}")


def compile_export(src: SglangSources, cuh: Path, unit_text: str, tag: str, arch: tuple[int, int] | None = None,
                   build_dir: Path | None = None, verbose: bool = False) -> tuple[Path, tuple[int, int]]:
    """Compile and link `unit_text` (an `export_source`) against `cuh`'s headers into a tvm-ffi module; returns
    (the .so, the arch it was built for). The .so is cached under `build_dir` (default $ESS_HISPARSE_CACHE or
    /tmp/ess_hisparse), keyed by the sources, flags and text. arch: (major, minor); None = the current GPU."""
    _prepare_tvm_ffi_import()
    tc = find_toolchain()
    want = (src.requires_tvm_ffi or "").lstrip("=")
    if want and tc.tvm_version and tc.tvm_version != want:
        print(f"hisparse_kernel: warning: tvm_ffi {tc.tvm_version} is installed, sglang {src.version} pins "
              f"apache-tvm-ffi=={want}")
    if not cuh.is_file():
        raise HiSparseBuildError(f"{cuh} is missing (sources from {src.origin})")
    closure = include_closure(cuh, [src.include_dir], tc.tvm_include)
    missing = closure.missing()
    if missing:
        raise HiSparseBuildError(f"headers included by {cuh.name} not found in {src.include_dir} or tvm-ffi's "
                                 f"include folders {[str(p) for p in tc.tvm_include]}: {missing}")
    arch = build_arch(arch)
    h = hashlib.sha256(unit_text.encode())
    for name in sorted(closure.files):
        h.update(name.encode() + closure.files[name].read_bytes())
    probe = compile_commands(tc, src, Path("unit.cu"), Path("m.so"), arch)
    h.update(repr(probe).encode() + tc.tvm_version.encode())
    key = h.hexdigest()[:16]
    out_dir = Path(build_dir) if build_dir is not None else DEFAULT_CACHE / "build"
    work = out_dir / f"{tag}_{key}"
    so = work / f"ess_{tag}_{key}.so"
    if not so.is_file():
        work.mkdir(parents=True, exist_ok=True)
        unit = work / f"{tag}_unit.cu"
        unit.write_text(unit_text)
        tmp_so = work / f"tmp{os.getpid()}_{so.name}"
        for cmd in compile_commands(tc, src, unit, tmp_so, arch):
            if verbose:
                print(f"{tag}:", " ".join(cmd), flush=True)
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise HiSparseBuildError(f"building {cuh.name} failed ({cmd[0]} exit {r.returncode}):\n"
                                         f"{' '.join(cmd)}\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}")
        tmp_so.rename(so)
    return so, tuple(arch)


def build(source: str | Path | SglangSources | None = None, config: KernelConfig | None = None,
          arch: tuple[int, int] | None = None, build_dir: Path | None = None, load: bool = True,
          verbose: bool = False) -> HiSparseKernel:
    """JIT-compile SGLang's HiSparse swap-in kernel and return it as a callable (`HiSparseKernel`).

    source: see `locate_sglang` (a wheel, a folder, or None for the defaults). config: template arguments
    (SGLang's DeepSeek-V3.2 production instantiation by default). arch: (major, minor) to compile for; None = the
    current GPU (compile-only use without a GPU: pass e.g. (9, 0) and load=False). The .so is cached under
    `build_dir` (default $ESS_HISPARSE_CACHE or /tmp/ess_hisparse), keyed by the sources, flags and arguments.
    """
    config = config or KernelConfig()
    src = source if isinstance(source, SglangSources) else locate_sglang(source)
    warn_if_other_version(src, "hisparse_kernel")
    so, arch = compile_export(src, src.cuh, wrapper_source(src.cuh, config), "hisparse", arch, build_dir, verbose)
    kernel = HiSparseKernel(config=config, so_path=so, sources=src, arch=arch)
    if load:
        kernel.load()
    return kernel


# ------------------------------------------------------------------------------------------------ the callable

_ARG_SPECS = {  # name: (dtype name, ndim) of load_cache_to_device_buffer_mla's tensors (host code checks none)
    "top_k_tokens": ("int32", 2),
    "device_buffer_tokens": ("int32", 2),
    "host_cache_locs": ("int64", 2),
    "device_buffer_locs": ("int32", 2),
    "device_buffer": ("uint8", None),
    "top_k_device_locs": ("int32", 2),
    "lru_slots": ("int16", 2),
    "num_real_reqs": ("int32", 1),
}


def check_args(top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
               top_k_device_locs, req_pool_indices, seq_lens, lru_slots, num_real_reqs, config: KernelConfig,
               item_size_bytes: int = ITEM_BYTES) -> None:
    """Raise ValueError for arguments the kernel would silently misread (it checks no dtype, shape or device)."""
    import torch

    args = dict(top_k_tokens=top_k_tokens, device_buffer_tokens=device_buffer_tokens, host_cache_locs=host_cache_locs,
                device_buffer_locs=device_buffer_locs, device_buffer=device_buffer,
                top_k_device_locs=top_k_device_locs, lru_slots=lru_slots, num_real_reqs=num_real_reqs)
    for name, (dt, nd) in _ARG_SPECS.items():
        t = args[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: must be a torch.Tensor, got {type(t).__name__}")
        if str(t.dtype) != f"torch.{dt}":
            raise ValueError(f"{name}: must be {dt}, got {t.dtype}")
        if nd is not None and t.dim() != nd:
            raise ValueError(f"{name}: must be {nd}-D, got shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: rows must be contiguous (stride(-1) == 1), got strides {t.stride()}")
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
            raise ValueError(f"{name}: must be 1-D int32 or int64, got {t.dtype} {tuple(t.shape)}")
    bs = top_k_tokens.shape[0]
    K, H = config.num_top_k, config.hot_buffer_size
    if top_k_tokens.shape[1] != K or top_k_device_locs.shape[0] < bs or top_k_device_locs.shape[1] < K:
        raise ValueError(f"top_k_tokens must be [batch, {K}] and top_k_device_locs at least as large, got "
                         f"{tuple(top_k_tokens.shape)} and {tuple(top_k_device_locs.shape)}")
    if req_pool_indices.shape[0] != bs or seq_lens.shape[0] != bs:
        raise ValueError(f"req_pool_indices and seq_lens must be [{bs}], got {tuple(req_pool_indices.shape)} and "
                         f"{tuple(seq_lens.shape)}")
    if device_buffer_tokens.shape != device_buffer_locs.shape or device_buffer_tokens.stride() != \
            device_buffer_locs.stride():
        raise ValueError("device_buffer_tokens and device_buffer_locs must have the same shape and strides (the kernel "
                         "indexes both with one stride)")
    if device_buffer_tokens.shape[1] <= H:
        raise ValueError(f"device_buffer_tokens must have hot_buffer_size + page ({H} + page) slots per row, got "
                         f"{device_buffer_tokens.shape[1]}")
    if lru_slots.shape[1] != H or lru_slots.shape[0] < device_buffer_tokens.shape[0]:
        raise ValueError(f"lru_slots must be [rows, {H}], got {tuple(lru_slots.shape)}")
    if host_cache_locs.stride(0) != host_cache_locs.shape[1]:
        raise ValueError("host_cache_locs must be contiguous (the kernel uses shape[1] as its row stride)")
    hs = host_cache.stride(0) * host_cache.element_size()
    ds = device_buffer.stride(0) * device_buffer.element_size()
    if hs != item_size_bytes or ds != item_size_bytes:
        raise ValueError(f"host_cache and device_buffer rows must be item_size_bytes={item_size_bytes} apart, got "
                         f"{hs} and {ds}")
    dev = top_k_tokens.device
    for name in ("device_buffer_tokens", "host_cache_locs", "device_buffer_locs", "device_buffer",
                 "top_k_device_locs", "lru_slots", "num_real_reqs"):
        if args[name].device != dev:
            raise ValueError(f"{name}: on {args[name].device}, top_k_tokens on {dev}")
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
        if t.device != dev:
            raise ValueError(f"{name}: on {t.device}, top_k_tokens on {dev}")
    if host_cache.device.type == "cpu" and dev.type == "cuda" and not host_cache.is_pinned():
        raise ValueError("host_cache: a CPU tensor must be pinned (the kernel reads it through its device pointer)")


@dataclass
class HiSparseKernel:
    """One built instantiation of SGLang's swap-in kernel; call it like `load_cache_to_device_buffer_mla`."""

    config: KernelConfig
    so_path: Path
    sources: SglangSources
    arch: tuple[int, int]
    module: Any = None
    _empty: dict = field(default_factory=dict)

    def load(self) -> HiSparseKernel:
        import tvm_ffi

        self.module = tvm_ffi.load_module(str(self.so_path))
        getattr(self.module, KERNEL_EXPORT)  # fail here, not at the first call, if the export is missing
        return self

    def __call__(self, top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache,
                 device_buffer, top_k_device_locs, req_pool_indices, seq_lens, lru_slots, num_real_reqs,
                 item_size_bytes: int = ITEM_BYTES, page_size: int = 1, check: bool = True) -> None:
        """One layer's swap-in for a batch (argument order and meaning of `load_cache_to_device_buffer_mla`)."""
        import torch
        import tvm_ffi

        if self.module is None:
            self.load()
        if check:
            check_args(top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache,
                       device_buffer, top_k_device_locs, req_pool_indices, seq_lens, lru_slots, num_real_reqs,
                       self.config, item_size_bytes)
        dev = top_k_tokens.device
        empty = self._empty.get(dev)
        if empty is None:
            empty = self._empty[dev] = torch.empty(0, device=dev)
        stream = torch.cuda.current_stream(dev)
        with tvm_ffi.use_raw_stream(tvm_ffi.device(f"cuda:{dev.index or 0}"), stream.cuda_stream):
            getattr(self.module, KERNEL_EXPORT)(
                top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, empty,
                device_buffer, empty, top_k_device_locs, req_pool_indices, seq_lens, lru_slots, num_real_reqs,
                page_size, item_size_bytes, empty, empty, empty)


# ------------------------------------------------------------------------------------------------ trace + host pool

@dataclass
class TraceHost:
    """One trace's token data: a pinned host pool (one layer) holding every position of every request.

    Request r's position p lives at location ``loc[r, p] = base[r] + p`` for p < prompt_len + steps, -1 beyond.
    Row contents are distinct (a pattern of the location), so comparing rows checks that the right entry moved.
    """

    trace: Any  # TopKTrace restricted to the layer being timed
    host: Any  # ess_sglang.host_pool.HostTotalPool (1 layer): .entries pinned CPU, .layer(0) device (UVA) view
    loc: np.ndarray  # int64 [batch, max_len]
    device: Any
    _loc_t: Any = None

    @property
    def host_cache(self):
        """[tokens, 656] uint8 CPU tensor (pinned on CUDA): what SGLang hands the kernel as host_cache."""
        return self.host.entries[0]

    @property
    def host_view(self):
        """[tokens, 656] uint8 tensor readable from the device (UVA view on CUDA)."""
        return self.host.layer(0)

    def loc_tensor(self):
        """`loc` as an int64 tensor on the device (made once)."""
        import torch

        if self._loc_t is None:
            self._loc_t = torch.from_numpy(self.loc).to(self.device)
        return self._loc_t


def fill_pattern(entries, chunk: int = 1 << 18) -> None:
    """Fill [tokens, bytes] uint8 rows so that every 8-byte (or 4-byte) word of every row differs: word j of row i
    holds i * words + j. Written in place, `chunk` rows at a time (2 GB in a few seconds)."""
    import torch

    T, nbytes = entries.shape
    wdt = torch.int64 if nbytes % 8 == 0 else torch.int32
    wsize = 8 if wdt == torch.int64 else 4
    if nbytes % wsize:
        raise ValueError("entry bytes must be a multiple of 4")
    words = nbytes // wsize
    view = entries.view(wdt)
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        torch.arange(s * words, e * words, dtype=wdt, out=view[s:e].view(-1))


def make_trace_host(trace, layer: int = 0, device: str = "cuda", entry_bytes: int = ITEM_BYTES,
                    page: int = PAGE) -> TraceHost:
    """Host pool and location map for `trace` (layer `layer` only), shared by the HiSparse and ESS timings."""
    from ess_sglang.host_pool import HostTotalPool

    tr = trace.subset(layers=[layer]) if trace.num_layers > 1 else trace
    S, _, B, _ = tr.topk.shape
    n = tr.prompt_lens.astype(np.int64) + S  # every position the trace can name, per request
    base = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
    max_len = int(tr.seq_lens.max()) + 1
    pos = np.arange(max_len, dtype=np.int64)
    loc = np.where(pos[None, :] < n[:, None], base[:, None] + pos[None, :], -1)
    host = HostTotalPool(1, int(n.sum()), entry_bytes=entry_bytes, device=device)
    fill_pattern(host.entries[0])
    return TraceHost(trace=tr, host=host, loc=loc, device=device)


# ------------------------------------------------------------------------------------------------ per-layer state

@dataclass
class HiSparseLayerState:
    """The coordinator's per-layer swap-in state for `rows` requests (request r in row r)."""

    device_buffer_tokens: Any  # int32 [rows, H + page]: token position held by each slot, -1 none
    device_buffer_locs: Any  # int32 [rows, H + page]: device KV row of each slot
    lru_slots: Any  # int16 [rows, H]: LRU order of slots 0..H-1, least recent first
    host_cache_locs: Any  # int64 [rows, max_len + page]: host location of each position (req_to_host_pool)
    host_cache: Any  # uint8 [tokens, item] host pool (pinned CPU on CUDA)
    host_view: Any  # the same, readable from the device (for checks)
    device_buffer: Any  # uint8 [rows * (H + page), item]: the layer's device KV rows
    top_k_device_locs: Any  # int32 [rows, K]: the kernel's output slot table (device rows)
    num_real_reqs: Any  # int32 [1]
    hot_buffer_size: int
    page: int
    _initial: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(self.device_buffer_tokens.shape[0])

    def snapshot(self) -> dict:
        return {k: getattr(self, k).clone() for k in ("device_buffer_tokens", "lru_slots", "device_buffer",
                                                      "top_k_device_locs")}

    def restore(self, snap: dict | None = None) -> None:
        for k, v in (snap or self._initial).items():
            getattr(self, k).copy_(v)

    def nbytes_device(self) -> int:
        """GPU bytes of hot entries: rows x (H + page) x item (what ESS gets as its shared pool)."""
        return int(self.device_buffer.numel())


def make_layer_state(th: TraceHost, batch: int, hot_buffer_size: int = HOT_BUFFER, page: int = PAGE,
                     top_k: int = TOP_K, warm: str = "staged", item: int = ITEM_BYTES) -> HiSparseLayerState:
    """State for the first `batch` requests of `th`, initialised as SGLang admits them (see module docstring)."""
    import torch

    if warm not in ("staged", "pd_direct"):
        raise ValueError(f"warm must be 'staged' or 'pd_direct', got {warm!r}")
    dev = torch.device(th.device)
    H, P = hot_buffer_size, page
    W = H + P
    loc = th.loc[:batch]
    prompts = th.trace.prompt_lens[:batch].astype(np.int64)
    max_len = loc.shape[1]
    r2h = np.full((batch, max_len + P), -1, dtype=np.int64)
    r2h[:, :max_len] = loc
    dlocs = (np.arange(batch, dtype=np.int64)[:, None] * W + np.arange(W)[None, :]).astype(np.int32)
    tokens = np.full((batch, W), -1, dtype=np.int32)
    resident = (prompts <= H) | (warm == "staged")  # alloc_device_buffer (staged) / short prompt preloaded (PD)
    tokens[resident, :H] = np.arange(H, dtype=np.int32)
    st = HiSparseLayerState(
        device_buffer_tokens=torch.from_numpy(tokens).to(dev),
        device_buffer_locs=torch.from_numpy(dlocs).to(dev),
        lru_slots=torch.arange(H, dtype=torch.int16, device=dev).repeat(batch, 1).contiguous(),
        host_cache_locs=torch.from_numpy(r2h).to(dev),
        host_cache=th.host_cache, host_view=th.host_view,
        device_buffer=torch.zeros((batch * W, item), dtype=torch.uint8, device=dev),
        top_k_device_locs=torch.full((batch, top_k), -1, dtype=torch.int32, device=dev),
        num_real_reqs=torch.tensor([batch], dtype=torch.int32, device=dev),
        hot_buffer_size=H, page=P)
    # the resident tokens' entries are in their device rows (the prefill wrote them; PD preloads short prompts)
    src = _pad_take(loc, tokens[:, :H])
    ok = src >= 0
    if ok.any():
        rows = torch.from_numpy(dlocs[:, :H][ok].astype(np.int64)).to(dev)
        st.device_buffer[rows] = st.host_view[torch.from_numpy(src[ok]).to(dev)]
    st._initial = st.snapshot()
    return st


def _pad_take(loc: np.ndarray, tok: np.ndarray) -> np.ndarray:
    """loc[r, tok[r, j]] with -1 where tok is -1 or past the row."""
    out = np.full(tok.shape, -1, dtype=np.int64)
    okm = (tok >= 0) & (tok < loc.shape[1])
    r, j = np.nonzero(okm)
    out[r, j] = loc[r, tok[r, j]]
    return out


def write_newest(st: HiSparseLayerState, seq_lens: np.ndarray, loc: np.ndarray) -> None:
    """The model's KV write of the token decoded this step: its entry goes to the slot SGLang reserves for it
    (`map_last_loc_to_buffer`: slot min(seq_len - 1, H)). Not part of the swap-in; done before it."""
    import torch

    b = len(seq_lens)
    pos = seq_lens.astype(np.int64) - 1
    slot = np.minimum(pos, st.hot_buffer_size)
    dev = st.device_buffer_locs.device
    rows = st.device_buffer_locs[torch.arange(b, device=dev), torch.from_numpy(slot).to(dev)].long()
    src = torch.from_numpy(loc[np.arange(b), pos]).to(dev)
    st.device_buffer[rows] = st.host_view[src]


def hisparse_swap_in(kernel: HiSparseKernel, st: HiSparseLayerState, top_k, seq_lens, req_pool_indices=None,
                     check: bool = True):
    """One layer's swap-in for the first top_k.shape[0] requests; returns the slot table (device rows) [b, K]."""
    import torch

    b = top_k.shape[0]
    if req_pool_indices is None:
        req_pool_indices = torch.arange(b, dtype=torch.int64, device=top_k.device)
    out = st.top_k_device_locs[:b]
    kernel(top_k, st.device_buffer_tokens, st.host_cache_locs, st.device_buffer_locs, st.host_cache,
           st.device_buffer, out, req_pool_indices, seq_lens, st.lru_slots, st.num_real_reqs, check=check)
    return out


def check_swap_in(st: HiSparseLayerState, top_k, seq_lens, out_locs, loc) -> dict:
    """After a swap-in: every valid selected position's device row (through `out_locs`) equals its host entry.

    Returns counts (on the host): checked entries, entries whose slot is -1, rows that differ, and duplicate device
    rows within a request (two positions sharing a row). Syncs.
    """
    import torch

    dev = top_k.device
    b, K = top_k.shape
    valid = top_k >= 0
    pos = top_k.long().clamp(min=0)
    loc_t = (loc if isinstance(loc, torch.Tensor) else torch.from_numpy(loc)).to(dev)[:b]
    host_loc = loc_t.gather(1, pos)
    out = out_locs.long()
    no_slot = int((valid & (out < 0)).sum())
    sel = valid & (out >= 0)
    dev_rows = st.device_buffer[out[sel]]
    host_rows = st.host_view[host_loc[sel]]
    differ = int((dev_rows != host_rows).any(dim=1).sum())
    srt = torch.sort(torch.where(sel, out, -1 - torch.arange(K, device=dev).expand(b, K)), dim=1).values
    dup = int(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).sum())
    return dict(checked=int(sel.sum()), no_slot=no_slot, differ=differ, duplicate_rows=dup)


def emulate_misses(trace, hot_buffer_size: int = HOT_BUFFER, warm: str = "staged", batch: int | None = None
                   ) -> np.ndarray:
    """Per-step, per-request misses [steps, batch] of layer 0 of `trace` under `ess_sglang.hisparse_policy`."""
    from ess_sglang.hisparse_policy import HiSparseBuffer

    S, _, B, _ = trace.topk.shape
    B = B if batch is None else batch
    max_len = int(trace.seq_lens.max())
    out = np.zeros((S, B), dtype=np.int64)
    for r in range(B):
        buf = HiSparseBuffer(hot_buffer_size, int(trace.prompt_lens[r]), max_len, warm)
        for s in range(S):
            out[s, r] = buf.step(trace.topk[s, 0, r], int(trace.seq_lens[s, r]))[1]
    return out


# ------------------------------------------------------------------------------------------------ timing

class GraphRunner:
    """`fn` captured once in a CUDA graph and replayed, each `timed_replay` between two CUDA events after a GPU
    busy-wait (`timing.events_around`, shared with the other benchmarks). On a CPU device (tests) `fn` is called
    directly and timed with perf_counter."""

    def __init__(self, fn, device):
        import torch

        self.fn = fn
        self.cuda = torch.device(device).type == "cuda"
        self.records: list = []
        self.graph = None
        if self.cuda:
            torch.cuda.synchronize(device)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                fn()

    def timed_replay(self) -> None:
        import time


        if not self.cuda:
            t = time.perf_counter()
            self.fn()
            self.records.append((time.perf_counter() - t) * 1e6)
            return
        from timing import events_around  # benchmarks/timing.py

        self.records.append(events_around(self.graph.replay))

    def times_us(self) -> np.ndarray:
        """Microseconds of every timed replay so far (syncs)."""
        import torch

        if not self.cuda:
            return np.array(self.records, dtype=np.float64)
        torch.cuda.synchronize()
        return np.array([a.elapsed_time(b) * 1e3 for a, b in self.records], dtype=np.float64)


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def summarize_times(times_us: np.ndarray, misses: np.ndarray, lookups: np.ndarray, item: int) -> dict:
    """times [reps, steps] us; misses / lookups [steps] (per step, all requests)."""
    steady = times_us[:, 1:] if times_us.shape[1] > 1 else times_us
    later_l = int(lookups[1:].sum())
    per_step = misses[1:].mean() if len(misses) > 1 else misses[0]  # steps >= 1, as the times
    med = np.median(steady)
    return dict(us=float(med), us_mean=float(steady.mean()), us_p10=float(np.percentile(steady, 10)),
                us_p90=float(np.percentile(steady, 90)), us_step0=float(times_us[:, 0].mean()),
                hit_rate=1.0 - float(misses.sum()) / max(int(lookups.sum()), 1),
                hit_rate_after_step0=1.0 - float(misses[1:].sum()) / max(later_l, 1),
                misses=int(misses.sum()), misses_per_step=float(per_step), miss_bytes=int(misses.sum()) * item,
                bytes_per_step=float(per_step * item), gbps=float(per_step * item / max(med, 1e-9) / 1e3),
                times_us=[[round(float(x), 2) for x in row] for row in times_us])


def sizes_for(top_k: int) -> tuple[int, int]:
    """(hot_buffer_size, page) for a trace's k: 4096 + 64 at DeepSeek's 2048, 2k + k/32 otherwise (as vs_hisparse)."""
    return (HOT_BUFFER, PAGE) if top_k == TOP_K else (2 * top_k, max(1, PAGE * top_k // TOP_K))


@dataclass
class EagerReplay:
    misses: np.ndarray  # [steps, batch] from the kernel's state
    lookups: np.ndarray  # [steps] valid selected positions (all requests)
    checks: dict | None
    state: HiSparseLayerState


def replay_eager(kernel, th: TraceHost, batch: int, warm: str = "staged", check: bool = True) -> EagerReplay:
    """Replay the first `batch` requests of `th.trace` through `kernel`, one call per step, no graph: before each
    step the newest token's entry is written to its reserved slot (`write_newest`), after it the slot table is
    checked (`check_swap_in`) and misses are counted from `device_buffer_tokens` (slots whose token changed).

    `kernel` is a `HiSparseKernel` or anything with its call signature and a `config` (the tests pass a reference
    implementation that runs on the CPU). Syncs once at the end."""
    import torch

    tr = th.trace
    S, _, B, K = tr.topk.shape
    if batch > B:
        raise ValueError(f"batch {batch} > the trace's {B} requests")
    H, P = sizes_for(K)
    if kernel.config.num_top_k != K or kernel.config.hot_buffer_size != H:
        raise ValueError(f"kernel built for top-k {kernel.config.num_top_k} / buffer {kernel.config.hot_buffer_size}, "
                         f"trace wants {K} / {H}")
    dev = torch.device(th.device)
    st = make_layer_state(th, batch, H, P, K, warm)
    topk_all = torch.from_numpy(np.ascontiguousarray(tr.topk[:, 0, :batch])).to(dev, torch.int32)
    seq_np = tr.seq_lens[:, :batch].astype(np.int64)
    seq_all = torch.from_numpy(seq_np).to(dev)
    rpi = torch.arange(batch, dtype=torch.int64, device=dev)
    before = torch.empty((batch, H), dtype=torch.int32, device=dev)
    misses = torch.zeros((S, batch), dtype=torch.int64, device=dev)
    checks = dict(checked=0, no_slot=0, differ=0, duplicate_rows=0) if check else None
    for s in range(S):
        write_newest(st, seq_np[s], th.loc)
        before.copy_(st.device_buffer_tokens[:, :H])
        out = hisparse_swap_in(kernel, st, topk_all[s], seq_all[s], rpi)
        misses[s] = (st.device_buffer_tokens[:, :H] != before).sum(dim=1)
        if check:
            for k, v in check_swap_in(st, topk_all[s], seq_all[s], out, th.loc_tensor()).items():
                checks[k] += v
    return EagerReplay(misses=misses.cpu().numpy(), lookups=(tr.topk[:, 0, :batch] >= 0).sum(axis=1).astype(np.int64),
                       checks=checks, state=st)


def time_hisparse(trace, batch: int, kernel: HiSparseKernel | None = None, th: TraceHost | None = None,
                  reps: int = 2, warm: str = "staged", check: bool = True, source=None, device: str = "cuda",
                  emulated: np.ndarray | None = None) -> dict:
    """Replay `trace` (its first `batch` requests, layer 0 of `th`) through HiSparse's kernel; time each step.

    1. `replay_eager` (checks, misses from the kernel's state), compared per step and request with the numpy
       emulation (`emulate_misses`; pass `emulated` [steps, >= batch] to reuse one computed for more requests);
    2. restore the initial state, capture one swap-in in a CUDA graph, and replay it `reps` times over all steps
       (state restored before each pass), each replay timed with CUDA events (`GraphRunner`; on a CPU device, with
       a stand-in kernel, direct calls); misses counted again from the state, which must equal the eager pass's.
    Returns time per layer (median over steps >= 1 of all passes; step 0, the cold start, apart), hit rates (the
    kernel's own count and the emulator's), misses and bytes moved, and the checks.
    """
    import torch

    th = th or make_trace_host(trace, device=device)
    tr = th.trace
    S, _, _, K = tr.topk.shape
    H, P = sizes_for(K)
    kernel = kernel or build(source, KernelConfig(num_top_k=K, hot_buffer_size=H))
    dev = torch.device(th.device)
    check = check and not kernel.config.skip_io  # SkipIO moves no KV bytes: rows cannot match
    ev = replay_eager(kernel, th, batch, warm, check)
    st = ev.state
    emu = emulated[:, :batch] if emulated is not None else emulate_misses(tr, H, warm, batch)
    topk_all = torch.from_numpy(np.ascontiguousarray(tr.topk[:, 0, :batch])).to(dev, torch.int32)
    seq_all = torch.from_numpy(tr.seq_lens[:, :batch].astype(np.int64)).to(dev)
    rpi = torch.arange(batch, dtype=torch.int64, device=dev)
    before = torch.empty((batch, H), dtype=torch.int32, device=dev)
    st.restore()
    static_topk = topk_all[0].clone()
    static_seq = seq_all[0].clone()

    def swap_in() -> None:
        hisparse_swap_in(kernel, st, static_topk, static_seq, rpi, check=False)

    host_passed = "pinned CPU tensor (as SGLang)" if dev.type == "cuda" else "CPU tensor"
    try:
        runner = GraphRunner(swap_in, dev)
    except Exception as exc:  # noqa: BLE001 - cudaHostGetDevicePointer refused in capture: hand over the UVA view
        print(f"hisparse_kernel: capture with the CPU host tensor failed ({str(exc)[:200]}); retrying with its UVA "
              f"device view", flush=True)
        sync(dev)
        st.host_cache = st.host_view
        host_passed = "UVA device view (capture with the CPU tensor failed)"
        runner = GraphRunner(swap_in, dev)
    graph_miss = torch.zeros((reps, S, batch), dtype=torch.int64, device=dev)
    for rep in range(reps):
        st.restore()
        for s in range(S):
            static_topk.copy_(topk_all[s])
            static_seq.copy_(seq_all[s])
            before.copy_(st.device_buffer_tokens[:, :H])
            runner.timed_replay()
            graph_miss[rep, s] = (st.device_buffer_tokens[:, :H] != before).sum(dim=1)
    times = runner.times_us().reshape(reps, S)
    graph_np = graph_miss.cpu().numpy()
    out = summarize_times(times, ev.misses.sum(axis=1), ev.lookups, ITEM_BYTES)
    out.update(batch=batch, steps=S, reps=reps, warm=warm, hot_buffer_size=H, page=P, slots_per_request=H + P,
               device_bytes=st.nbytes_device(), block_size=kernel.config.block_size, skip_io=kernel.config.skip_io,
               hit_rate_emulator=1.0 - float(emu.sum()) / max(int(ev.lookups.sum()), 1),
               emulator_mismatch_steps=int((emu != ev.misses).any(axis=1).sum()),
               emulator_mismatch_requests=int((emu != ev.misses).sum()),
               graph_vs_eager_mismatch=int((graph_np != ev.misses[None]).sum()),
               host_cache_passed_as=host_passed, checks=ev.checks)
    del runner
    return out
