#!/usr/bin/env bash
# Prepare .whl/ (git-ignored) for a GPU machine that has torch and triton but no registry access:
# FlashMLA, pydantic, pyyaml and prometheus-client for the cp312 interpreter there, and this package as a wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
rm -rf .whl/ess_sglang-*.whl build  # a stale build/ can put old modules into the wheel
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d .whl sgl-flash-mla==1.0.0 pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
    pyyaml==6.0.3 prometheus-client==0.26.0
python3 -m pip wheel -q --no-deps -w .whl .
ls -1 .whl
