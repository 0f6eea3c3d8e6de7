"""A colocated prompt staged at its prefill's launch (ess_sglang/sglang_plugin/transition.py) on a GPU, over SGLang's
own HiSparse pools: the copy to host memory waits for the prefill still running on the decode stream, the next
forward on that stream sees the copied entries, the host never synchronises while staging (torch's sync debug mode
set to "error"), and the device slots and warm-up follow when the result is processed.

Runs inside the SGLang bundle (README, "GPU tests"):
    bash scripts/sglang_site.sh bash -c 'cd /tmp && python3 -m pytest -m gpu -q --rootdir=$OLDPWD \\
        $OLDPWD/tests/gpu/test_gpu_transition.py'
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugin"))

pytestmark = pytest.mark.gpu
pytest.importorskip("sglang")

PAGE = 64


def test_a_prompt_staged_at_launch_is_copied_behind_its_prefill_and_before_the_next_forward():
    from sglang_pools import cpu_coordinator, prefilled_request

    from ess_sglang.config import EssConfig
    from ess_sglang.sglang_plugin import health
    from ess_sglang.sglang_plugin.active import set_active

    coord, allocator, req_pool = cpu_coordinator(page=PAGE, layers=2, rows=6, top_k=128, hot=1024, staging=16 * PAGE,
                                                 config=EssConfig(top_k=128, prefill_to_decode="merged"),
                                                 device="cuda")
    try:
        forward = torch.cuda.Stream()
        coord.set_decode_producer_stream(forward)
        n = 700
        req = prefilled_request(coord, allocator, req_pool, 1, n, "r")  # device entries 7
        rows = coord.mem_pool_device.translate_loc_to_hisparse_device(req_pool.req_to_token[1, :n].long()).long()
        torch.cuda.synchronize()
        with torch.cuda.stream(forward):  # the prefill, still running when the scheduler stages its requests
            torch.cuda._sleep(200_000_000)  # ~0.1 s
            for layer in range(coord.num_layers):
                coord.device_kv[layer][rows] = 9
        torch.cuda.set_sync_debug_mode("error")
        try:
            coord.stage_at_launch(req)  # host slots and the copy queued: no host synchronisation
        finally:
            torch.cuda.set_sync_debug_mode(0)
        host = coord.req_to_host_pool[1, :n].clone()
        seen = torch.empty(coord.num_layers, n, coord.entry_bytes, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(forward):  # the first decode step reads the host pool through UVA
            for layer in range(coord.num_layers):
                seen[layer] = coord.host.layer(layer)[host]
        forward.synchronize()
        assert bool((seen == 9).all())  # the copy ran after the prefill's writes, and before the next forward
        free = allocator.hisparse_attn_allocator.available_size()
        coord.admit_request_into_staging(req)  # the prefill's result
        assert allocator.hisparse_attn_allocator.available_size() == free + -(-n // PAGE) * PAGE
        coord.load_pending_warm_ups()
        torch.cuda.synchronize()
        assert coord.manager.resident_count(0) > 0 and health.state_violations(coord) == []
        coord.request_finished(req)
        allocator.free(req_pool.req_to_token[1, :n].long())
        torch.cuda.synchronize()
        assert health.idle_violations(coord) == []
    finally:
        set_active(None)
