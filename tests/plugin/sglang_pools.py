"""An ESS coordinator over SGLang's own HiSparse pools on CPU (fp8 latents, 656-byte V32 entries, ratio 2), as the
plugin's seam, warm-up and release tests build it."""

from __future__ import annotations

import torch

from ess_sglang.config import EssConfig


def cpu_coordinator(*, page: int, layers: int, rows: int, top_k: int, hot: int, staging: int, config: EssConfig):
    """(coordinator, allocator, request pool): a device pool of `hot` + one page of new-token slots + `staging`
    prefill slots, a logical space twice that, `rows` request rows of 1,024 tokens."""
    from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from ess_sglang.sglang_plugin.coordinator import EssCoordinator

    device_tokens = hot + page + staging
    pool = HiSparseDSATokenToKVPool(size=device_tokens, host_to_device_ratio=2, page_size=page, kv_lora_rank=512,
                                    dtype=torch.float8_e4m3fn, qk_rope_head_dim=64, layer_num=layers, device="cpu",
                                    index_head_dim=128, enable_memory_saver=False, kv_cache_dim=656)
    allocator = HiSparseTokenToKVPoolAllocator(device_tokens, page_size=page, dtype=torch.float8_e4m3fn, device="cpu",
                                               kvcache=pool, need_sort=False, host_to_device_ratio=2)
    req_pool = ReqToTokenPool(size=rows, max_context_len=1024, device="cpu", enable_memory_saver=False)
    coord = EssCoordinator(req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, config=config,
                           hot_slots_per_layer=hot, host_tokens=allocator.size_full, device="cpu", top_k=top_k,
                           max_running_requests=rows, pin_memory=False, copy_impl="torch")
    return coord, allocator, req_pool


def prefilled_request(coord, allocator, req_pool, row: int, n: int, rid: str, max_new: int = 8):
    """A stand-in request of an `n`-token prompt that ESS admitted (its reservation and prefill staging room) and
    SGLang prefilled into device slots of request row `row` (entries 7, so that a copy or a scrub shows)."""
    import types

    from sglang_versions import request_fields

    req = types.SimpleNamespace(rid=rid, **request_fields(row, n, n), origin_input_ids=[0] * n, output_ids=[],
                                sampling_params=types.SimpleNamespace(max_new_tokens=max_new), hisparse_staging=False,
                                finished=lambda: False)
    assert coord.admission.admit(rid, n + max_new).decision.value == "admit"
    coord.hold_staging(rid, n)
    zero, length = torch.tensor([0]), torch.tensor([n])
    logical = allocator.alloc_extend(zero, zero, length, length, torch.tensor([-1]), n)
    req_pool.req_to_token[row, :n] = logical.to(torch.int32)
    for layer in range(coord.num_layers):
        coord.device_kv[layer][coord.mem_pool_device.translate_loc_to_hisparse_device(logical).long()] = 7
    return req
