#!/usr/bin/env bash
# Prepare .whl/ (git-ignored) for timing SGLang 0.5.23 HiSparse's swap-in kernel on the GPU machine, which has
# Python 3.12, torch, nvcc 13.0 and no registry access (benchmarks/vs_hisparse.py --gpu, benchmarks/hisparse_kernel.py):
#
#   .whl/apache_tvm_ffi-0.1.11-cp312-abi3-*.whl   tvm-ffi: its headers, libtvm_ffi.so and the module loader. sglang
#                                                  0.5.23 pins apache-tvm-ffi==0.1.11 (checked below); its only
#                                                  dependency, typing-extensions, comes with torch. gpu_run.sh installs
#                                                  it with the other .whl/*.whl.
#   .whl/hisparse/sglang-0.5.23-cp312-*.whl        the sglang wheel trimmed to what the GPU run reads (its kernel
#                                                  sources and METADATA: the whole wheel is ~39 MB), NOT installed:
#                                                  gpu_run.sh globs only .whl/*.whl. hisparse_kernel.py extracts
#                                                  sglang/kernels/jit/include/, csrc/kvcacheio/,
#                                                  csrc/deepseek_v4/topk_v2.cuh and csrc/occupancy/cluster_probe.cuh
#                                                  from it at run time and compiles hisparse.cuh (and, for
#                                                  sglang_topk.py, topk_v2.cuh and the probe).
#
# hisparse.cuh's include closure needs nothing else: sgl_kernel/* (in the sglang wheel), tvm/ffi/* and dlpack/* (in the
# tvm-ffi wheel), and CUDA / C++ headers (the GPU machine's toolkit). The check at the end follows the includes through
# the downloaded wheels themselves. Then carry .whl to the GPU machine (carry: [".whl"]); it must stay under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG=0.5.23
TVM_FFI=0.1.11
mkdir -p .whl/hisparse
plat=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
dl=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}")
rm -f .whl/apache_tvm_ffi-*.whl .whl/hisparse/sglang-*.whl
"${dl[@]}" -d .whl "apache-tvm-ffi==$TVM_FFI"
"${dl[@]}" -d .whl/hisparse "sglang==$SGLANG"

python3 - "$SGLANG" "$TVM_FFI" <<'EOF'
import glob
import re
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, "benchmarks")
import hisparse_kernel as hk

sglang_v, tvm_v = sys.argv[1], sys.argv[2]
whl = Path(glob.glob(".whl/hisparse/sglang-*.whl")[0])
tvm_whl = Path(glob.glob(".whl/apache_tvm_ffi-*.whl")[0])
with tempfile.TemporaryDirectory() as tmp:
    src = hk.extract_wheel(whl, Path(tmp) / "src")
    if src.version != sglang_v:
        sys.exit(f"hisparse_wheels: {whl.name} says version {src.version}, expected {sglang_v}")
    if src.requires_tvm_ffi != "==" + tvm_v:
        sys.exit(f"hisparse_wheels: sglang {src.version} requires apache-tvm-ffi{src.requires_tvm_ffi}, "
                 f"downloaded {tvm_v}: change TVM_FFI in this script")
    with zipfile.ZipFile(tvm_whl) as z:
        members = [n for n in z.namelist() if re.match(r"tvm_ffi/include/", n)]
        z.extractall(Path(tmp) / "tvm", members)
    tvm_inc = Path(tmp) / "tvm" / "tvm_ffi" / "include"
    cl = hk.include_closure(src.cuh, [src.include_dir], [tvm_inc])
    if cl.missing():
        sys.exit(f"hisparse_wheels: headers of hisparse.cuh not found in the wheels: {cl.missing()}")
    print(f"hisparse_wheels: {whl.name}: sglang {src.version}, pins apache-tvm-ffi{src.requires_tvm_ffi}; "
          f"hisparse.cuh includes {len(cl.files) - 1} sglang headers and {len(cl.external)} tvm-ffi/dlpack headers, "
          f"all present; left to the toolkit: {', '.join(sorted(n for n in cl.system if '/' in n or '.h' in n))}")
    for rel in (hk.TOPK_CUH_RELPATH, hk.PROBE_CUH_RELPATH):  # SGLang's decode top-k (benchmarks/sglang_topk.py)
        cuh = src.root / rel
        if not cuh.is_file():
            sys.exit(f"hisparse_wheels: {whl.name} has no {rel}")
        cl = hk.include_closure(cuh, [src.include_dir], [tvm_inc])
        if cl.missing():
            sys.exit(f"hisparse_wheels: headers of {cuh.name} not found in the wheels: {cl.missing()}")
        print(f"hisparse_wheels: {cuh.name} includes {len(cl.files) - 1} sglang headers, all present")
# The GPU run reads only the kernel's sources and METADATA from the sglang wheel (hisparse_kernel.extract_wheel): keep
# those alone (a few hundred KB; the whole wheel, ~39 MB, crowds the 64 MiB carry), under the same name.
with zipfile.ZipFile(whl) as zin:
    keep = [zin.getinfo(n) for n in zin.namelist() if hk.wheel_member_needed(n)]
    trimmed = whl.with_name(whl.name + ".part")
    with zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in keep:
            zout.writestr(info, zin.read(info))
trimmed.replace(whl)
print(f"hisparse_wheels: kept {len(keep)} members of {whl.name} ({whl.stat().st_size // 1024} KiB)")
EOF
ls -l .whl .whl/hisparse
size=$(du -sb .whl | cut -f1)
echo "hisparse_wheels: .whl holds $((size / 1048576)) MiB (carry limit 64 MiB)"
if [ "$size" -gt $((60 * 1048576)) ]; then
    echo "hisparse_wheels: warning: .whl is close to or over the carry limit; remove what the GPU run does not need" >&2
fi
