#!/usr/bin/env bash
# Build what a real SGLang server needs on the GPU test machine, which has Python 3.12, torch 2.11 (cu130) and
# triton 3.6 but no SGLang and no registry access (docs/sglang.md, "Serving on the H200 test machine").
#
#   scripts/sglang_bundle.sh            -> .bundle/site.tar.xz.part-00, -01, ... (git-ignored)
#
# SGLang 0.5.17 is the newest release that pins the machine's torch (2.11.0). The bundle holds SGLang 0.5.17 and
# every cp312 package it imports at server start that the machine's image lacks, unpacked as one site folder, less
# what the DSA path never loads (FA3's flash_ops library, sm100 kernels, multimodal generation, gRPC, tests, static
# libraries), compressed with xz and cut into 46-MiB parts, so that each part with the working tree fits a copy of at
# most 64 MiB. scripts/sglang_site.sh joins and unpacks them on the machine. This package is not in the bundle: it is
# built from the working tree there.
set -euo pipefail
cd "$(dirname "$0")/.."
PART_MIB=${PART_MIB:-46}
cache=${ESS_BUNDLE_CACHE:-/tmp/ess-bundle-wheels}
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
mkdir -p "$cache" .bundle

# Pinned by SGLang 0.5.17 (its METADATA), or by what its pins accept on the machine's image (transformers 5.12.1
# refuses the image's tokenizers 0.23.2: it needs <= 0.23.0).
pinned=(
  sglang==0.5.17 sglang-kernel==0.4.5 sgl-deep-gemm==0.1.5.post1 flashinfer-python==0.6.15.post1
  apache-tvm-ffi==0.1.11 transformers==5.12.1 tokenizers==0.22.2 soundfile==0.13.1 openai==2.6.1 xgrammar==0.2.1
  pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.8.0 typing-inspection==0.4.5
)
# Imported at server start and missing on the image: newest release for cp312.
unpinned=(
  cffi compressed-tensors dill distro fastapi gguf ipython jsonschema jsonschema-specifications
  loguru msgspec opentelemetry-api orjson partial-json-parser pybase64 pydantic-extra-types
  python-multipart pyzmq referencing rpds-py setproctitle sniffio starlette torch_memory_saver traitlets
  uvicorn watchfiles zstandard pyyaml
)
plat=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --abi abi3 --abi none "${plat[@]}" -d "$cache" "${pinned[@]}" "${unpinned[@]}"

# Keep one version of each distribution (the newest downloaded, or the pinned one).
python3 - "$cache" "$site" "${pinned[@]}" -- "${unpinned[@]}" <<'EOF'
import re
import sys
import zipfile
from pathlib import Path

cache, site = Path(sys.argv[1]), Path(sys.argv[2])
cut = sys.argv.index("--")
pins, names = sys.argv[3:cut], sys.argv[cut + 1:]
norm = lambda n: re.sub(r"[-_.]+", "_", n).lower()
pinned = {norm(p.split("==")[0]): p.split("==")[1] for p in pins}
wanted = set(pinned) | {norm(n) for n in names}
chosen = {}
for whl in sorted(cache.glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    key = norm(name)
    if key not in wanted or (key in pinned and version != pinned[key]):
        continue
    chosen[key] = whl  # sorted: a later (newer-sorting) version of an unpinned name wins
drop = re.compile(r"^(sgl_kernel/(flash_ops[^/]*\.so|sm100/.*)|sglang/multimodal_gen/.*|sglang/srt/grpc/.*|"
                  r"sglang/test/.*|zstandard/_cffi[^/]*\.so|.*\.a|.*\.cpython-3(?!12)\d+-[^/]*\.so|"
                  r"torch_memory_saver_[^/]*_cu12\.abi3\.so|"
                  r".*/__pycache__/.*)$")
for key, whl in sorted(chosen.items()):
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            name = re.sub(r"^[^/]+\.data/(purelib|platlib)/", "", info.filename)
            if name.endswith("/") or drop.match(name) or re.match(r"^[^/]+\.data/", name):
                continue
            dest = site / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(z.read(info))
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                dest.chmod(mode)
    print(f"sglang_bundle: {whl.name}")
EOF
rm -f .bundle/site.tar.xz.part-*
tar -C "$site" -cf - . | xz -9 -T2 | split -b "${PART_MIB}M" -d - .bundle/site.tar.xz.part-
ls .bundle/site.tar.xz.part-* | wc -l > .bundle/site.count
du -sh "$site"
ls -l .bundle
