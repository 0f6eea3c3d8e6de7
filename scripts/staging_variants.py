"""Which Triton kernel variants the ESS coordinator launches while it stages and warms up each new request.

Triton compiles a kernel again for every new specialisation of its arguments (an integer equal to 1 or divisible by
16, a pointer aligned to 16 bytes, a constexpr's value); outside CUDA graphs such a compile stalls the server's
scheduler. This replays the plugin's decode-seam test harness (tests/plugin/test_sglang_decode_seam.py: SGLang's
own HiSparse pools on CPU, four requests of 9,000 / 1,500 / 12,000 / 5,000 tokens staged one after the other, then
three decode steps) with the fused Triton resolve under Triton's interpreter, records the specialisation key of every
launch with Triton's own function (`triton.runtime.jit.native_specialize_impl`), and prints how many variants each
admission adds to those seen before it: a request after the first should add none.

    TRITON_INTERPRET=1 python3 scripts/staging_variants.py      (needs SGLang installed; about 2 minutes)
"""

from __future__ import annotations

import collections
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "plugin"), str(ROOT / "tests")]


def main() -> int:
    import test_sglang_decode_seam as seam
    import triton.language as tl
    from sglang.srt.runtime_context import get_parallel
    from triton.backends.compiler import BaseBackend
    from triton.runtime import interpreter
    from triton.runtime.jit import native_specialize_impl

    from ess_sglang.sglang_plugin.coordinator import EssCoordinator

    phase = ["before the first request"]
    seen: dict[str, set] = collections.defaultdict(set)

    def key_of(fn, args, kwargs) -> tuple:
        dns = set(fn.kwargs.get("do_not_specialize") or [])
        dnsa = set(fn.kwargs.get("do_not_specialize_on_alignment") or [])
        bound = {**dict(zip(fn.arg_names, args, strict=False)),
                 **{k: v for k, v in kwargs.items() if k in fn.arg_names}}
        key = []
        for i, (name, p) in enumerate(inspect.signature(fn.fn).parameters.items()):
            v = bound.get(name, p.default)
            if p.annotation is tl.constexpr or str(p.annotation).endswith("constexpr"):
                key.append((name, repr(v)))
            else:
                key.append((name, str(native_specialize_impl(BaseBackend, v, False, not ({i, name} & dns),
                                                             not ({i, name} & dnsa)))))
        return tuple(key) + tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in fn.arg_names))

    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        seen[phase[0]].add((self.fn.__name__, key_of(self, args, kwargs)))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    admit = EssCoordinator.admit_request_into_staging
    admissions = []

    def phased_admit(self, req):
        phase[0] = f"request {len(admissions)}: staging and warm-up"
        admissions.append(phase[0])
        try:
            return admit(self, req)
        finally:
            phase[0] = "decode steps"

    interpreter.InterpretedFunction.run = recording_run
    EssCoordinator.admit_request_into_staging = phased_admit
    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1, attn_dcp_rank=0):
        identical, _ = seam._run("colocated", 3, new_tokens="insert", resolve_impl="triton")
    print(f"decode steps bit-identical to the all-HBM pool: {identical} of 3")
    before: set = set()
    late = 0
    for name in admissions:
        new = seen[name] - before
        print(f"{name}: {len(seen[name])} variants launched, {len(new)} not launched before")
        for kernel, key in sorted(new, key=str):
            print(f"    {kernel} {key}")
        late += len(new) if name != admissions[0] else 0
        before |= seen[name]
    return 1 if late else 0


if __name__ == "__main__":
    sys.exit(main())
