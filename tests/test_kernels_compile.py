"""Every Triton kernel compiles for sm_90 (the H200), checked without a GPU by Triton's own ptxas.

The other CPU tests run the kernels in Triton's interpreter, which accepts some programs the compiler rejects; this
runs scripts/compile_kernels.py in a process with the interpreter off.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_compiles_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_kernels.py")], capture_output=True, text=True,
                       env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout and r.stdout.count("ok ") >= 20, r.stdout


REQUEST_SIZED = {
    "flashtrans": {"_copy_rows_kernel": {"n_rows"}, "_copy_rows_masked_kernel": {"n_rows"},
                   "_copy_rows_flat_kernel": {"n_rows"}, "_copy_rows_counted_kernel": {"n_rows"}},
    "resolve": {"_lookup_kernel": {"n", "n_sel", "per_batch", "width"}, "_tail_kernel": {"n", "n_sel"},
                "_assign_kernel": {"n", "n_sel"}, "_finish_kernel": {"n", "n_sel"}},
    "translate": {"_translate_kernel": {"n", "per_batch"}},
    "new_tokens": {"_store_reserved_kernel": {"n"}},
}
"""Kernels a request's staging, warm-up and release launch outside CUDA graphs, and their arguments that each request
sizes. Triton compiles a kernel again for every new (== 1, divisible by 16, neither) pattern of its integer arguments
unless told not to; a compile in the middle of serving stalled a request by about a second (docs/design.md)."""


def test_request_sized_arguments_are_not_specialised():
    code = ("import importlib, json\n"
            "out = {}\n"
            f"for mod, kernels in {({m: sorted(k) for m, k in REQUEST_SIZED.items()})!r}.items():\n"
            "    m = importlib.import_module('ess_sglang.kernels.' + mod)\n"
            "    for name in kernels:\n"
            "        out[name] = [p.name for p in getattr(m, name).params if p.do_not_specialize]\n"
            "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, TRITON_INTERPRET="0"), timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    unspecialised = {k: set(v) for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}
    for kernels in REQUEST_SIZED.values():
        for name, args in kernels.items():
            assert args <= unspecialised[name], f"{name}: {sorted(args - unspecialised[name])} specialised"
