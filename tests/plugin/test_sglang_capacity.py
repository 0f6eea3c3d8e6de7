"""Capacity with SGLang's own pool configurator, and admission against SGLang's own host pool.

1. How many 32K and 128K requests one GPU's KV budget holds for DeepSeek-V3.2 (61 layers, FP8 V32 latents):
   without ESS (SGLang's DefaultPoolConfigurator: latent + indexer per token on the GPU), with HiSparse's default
   sizing (host pool = 2 x the device pool), and with ESS (the plugin's config_from_budget hook, then its admission
   control counting requests until the first one has to wait).
2. HiSparse admits against the GPU pools only and allocates host pages as requests grow: with SGLang's own host
   pool (MLATokenToKVPoolHost) a workload that fits the GPU's logical space crashes it with "HiSparse host mem pool
   alloc failed". Under ESS admission the same workload completes and the host pool is never over-committed.
"""

from __future__ import annotations

import types

import pytest
import torch
from sglang_versions import scheduler_context

from ess_sglang.config import GIB, EssConfig
from ess_sglang.sglang_plugin import settings, sizing
from ess_sglang.sglang_plugin.admission import Decision, EssAdmission

pytest.importorskip("sglang")  # CI installs sglang==0.5.23; this only guards machines without it

BUDGET_GIB = 40  # KV budget of one H200 serving DeepSeek-V3.2 FP8 with EP8 (about 84 GB of weights per GPU)
HOST_GIB = 400.0
HOT_GIB = 8.0
NEW_TOKENS = 1024


def _server_args(deepseek_dir, extra):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(["--model-path", deepseek_dir, "--device", "cpu", "--skip-tokenizer-init",
                                "--attention-backend", "dsa", "--kv-cache-dtype", "fp8_e4m3", "--disable-radix-cache",
                                *extra])


def _kvc(sa):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from ess_sglang.sglang_plugin.compat import model_config_of

    mc = model_config_of(sa)
    layers = mc.num_hidden_layers
    return types.SimpleNamespace(
        model_config=mc, layer_info=types.SimpleNamespace(num_effective_layers=layers, start_layer=0,
                                                          end_layer=layers),
        kv_cache_dtype=torch.float8_e4m3fn, kv_cache_dtype_str="fp8_e4m3", use_mla_backend=True,
        is_draft_worker=False, spec_algorithm=SpeculativeAlgorithm.NONE, server_args=sa, pp_size=1,
        is_hybrid_swa=False, mambaish_config=None, page_size=64, device="cpu")


def _sglang_tokens(deepseek_dir, extra, budget):
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.runtime_context import get_parallel

    sa = _server_args(deepseek_dir, extra)
    with scheduler_context(sa), get_parallel().override(attn_tp_size=1, attn_dcp_size=1, attn_dcp_rank=0):
        kvc = _kvc(sa)
        conf = create_memory_pool_configurator(kvc)
        return conf, conf.calculate_pool_sizes(budget, 64).max_total_num_tokens, kvc


def _admitted(adm: EssAdmission, context: int) -> int:
    n = 0
    while adm.admit(f"r{n}", context).decision is Decision.ADMIT:
        n += 1
    return n


def test_requests_per_gpu_with_and_without_ess(deepseek_dir, ess_env, sm90, capsys, monkeypatch):
    budget = BUDGET_GIB * GIB
    monkeypatch.setattr(sizing, "host_memory_bytes", lambda: 1536 * GIB)  # a decode node, not this CI machine
    # without ESS: SGLang's configurator, every token's latent and indexer entry on the GPU
    conf, tokens, _ = _sglang_tokens(deepseek_dir, ["--disaggregation-mode", "decode",
                                                    "--disaggregation-transfer-backend", "fake"], budget)
    assert type(conf).__name__ == "DefaultPoolConfigurator"
    assert conf._cell_size == 61 * (656 + 132)  # 48,068 B per token: DESIGN.md section 2
    # HiSparse's default sizing (host_to_device_ratio 2): logical space = 2 x device pool
    _, hisparse_device, _ = _sglang_tokens(deepseek_dir, ["--disaggregation-mode", "decode",
                                                          "--disaggregation-transfer-backend", "fake",
                                                          "--enable-hisparse"], budget)
    # with ESS: the plugin's sizing hook, given the same budget, under the same kind of context
    from sglang.srt.runtime_context import get_parallel

    sa = _server_args(deepseek_dir, ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
                                     "--enable-hisparse"])
    cfg = EssConfig(memory_pool_size_gb=HOST_GIB, max_gpu_buffer_size_gb=HOT_GIB)
    settings._CURRENT = settings.EssSettings(True, cfg)
    sizing.set_current_pools(None)
    with scheduler_context(sa), get_parallel().override(attn_tp_size=1, attn_dcp_size=1, attn_dcp_rank=0):
        kvc = _kvc(sa)
        mpc = sizing.config_from_budget_hook(None, kvc, budget)
    pools = sizing.current_pools()
    assert mpc.max_total_num_tokens == pools.device_tokens
    assert pools.gpu_bytes <= budget and pools.host_bytes <= HOST_GIB * GIB

    rows = []
    for context in (32 * 1024, 128 * 1024):
        without = tokens // context
        hisparse = 2 * hisparse_device // context
        adm = EssAdmission(host_tokens=pools.host_tokens, indexer_tokens=pools.logical_tokens,
                           hot_slots_per_layer=pools.hot_slots_per_layer, top_k=2048,
                           max_requests=pools.max_running_requests)
        with_ess = _admitted(adm, context)
        adm.check_invariants()
        assert adm.host_reserved <= pools.host_tokens
        rows.append((context, without, hisparse, with_ess))
        assert with_ess >= 3 * without, (context, without, with_ess)
    with capsys.disabled():
        print(f"\nDeepSeek-V3.2, one GPU, KV budget {BUDGET_GIB} GiB; ESS: host pool {HOST_GIB:.0f} GiB, hot pool "
              f"{HOT_GIB:.0f} GiB ({pools.describe()})")
        print(f"{'context':>8} {'without ESS':>12} {'HiSparse (logical)':>19} {'with ESS':>9}")
        for context, without, hisparse, with_ess in rows:
            print(f"{context // 1024:>7}K {without:>12} {hisparse:>19} {with_ess:>9}")


def _host_pool(parallel_tokens: int, host_tokens: int):
    """SGLang's host pool (MLATokenToKVPoolHost, layer-first) of `host_tokens` entries, built as the ESS coordinator
    builds it (``compat.make_host_pool``: SGLang 0.5.17 rounds the size to pages and adds one page)."""
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool

    from ess_sglang.sglang_plugin.compat import make_host_pool

    pool = HiSparseDSATokenToKVPool(size=parallel_tokens, page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn,
                                    qk_rope_head_dim=64, layer_num=1, device="cpu", index_head_dim=128,
                                    enable_memory_saver=False, kv_cache_dim=656, host_to_device_ratio=8)
    host = make_host_pool(pool, host_tokens, pin_memory=False)
    assert host_tokens <= host.size <= host_tokens + 64 and tuple(host.kv_buffer.shape[:2]) == (1, host.size)
    return host


def _serve(host, admission: EssAdmission | None, n_requests=48, prompt=128, new=320, logical=16384):
    """Decode a stream of requests; host pages are allocated as SGLang's HiSparse path does (prompt at admission,
    then one token per step). Without `admission`, requests are admitted while the GPU's logical space has room
    (HiSparse's only check). Returns (completed, max running, host failure message or None)."""
    rows = 64
    table = torch.full((rows, 4096), -1, dtype=torch.int64)
    allocated = torch.zeros(rows, dtype=torch.int64)
    free_rows = list(range(1, rows))
    queue = list(range(n_requests))
    running: dict[int, tuple[int, int]] = {}  # rid -> (row, tokens so far)
    logical_used, completed, peak = 0, 0, 0
    total = prompt + new
    try:
        while queue or running:
            while queue and free_rows:  # admission, in arrival order
                rid = queue[0]
                if admission is None:
                    if logical_used + total > logical:
                        break
                elif admission.admit(str(rid), total).decision is not Decision.ADMIT:
                    break
                queue.pop(0)
                row = free_rows.pop()
                host.alloc_paged_token_slots(table, allocated, row, 0, prompt)
                running[rid] = (row, prompt)
                logical_used += total
                peak = max(peak, len(running))
            for rid, (row, n) in list(running.items()):  # one decode step: a host slot for each new token
                host.alloc_paged_token_slots(table, allocated, row, n, 1)
                running[rid] = (row, n + 1)
                if n + 1 - prompt == new:  # finished: release everything at once
                    host.free(host.allocated_host_indices(table, row, allocated[row]))
                    table[row] = -1
                    allocated[row] = 0
                    free_rows.append(row)
                    del running[rid]
                    logical_used -= total
                    completed += 1
                    if admission is not None:
                        admission.release(str(rid))
            assert 0 <= host.available_size() <= host.size
    except RuntimeError as exc:
        return completed, peak, str(exc)
    return completed, peak, None


def test_admission_never_overcommits_sglangs_host_pool(parallel1):
    host_tokens = 64 * 150  # 150 host pages; a request grows to 448 tokens = 7 pages: 21 fit at once
    host = _host_pool(2048, host_tokens)
    done, peak, failure = _serve(host, None)
    # HiSparse-style admission (the GPU's logical space: 16384 / 448 = 36 requests) let in more requests than the
    # host pool can hold; their prompts fit, and decoding crashes the server once they grow
    assert failure is not None and "HiSparse host mem pool alloc failed" in failure
    assert done == 0 and peak == 36

    host = _host_pool(2048, host_tokens)
    adm = EssAdmission(host_tokens=host.size, indexer_tokens=16384, hot_slots_per_layer=1 << 20, top_k=2048)
    done, peak, failure = _serve(host, adm)
    assert failure is None and done == 48
    assert peak == 21 and adm.running == 0 and adm.host_reserved == 0
    assert host.available_size() == host.size


@pytest.mark.parametrize("context", [32 * 1024, 128 * 1024])
def test_never_fitting_request_is_rejected_not_queued(context):
    pools = sizing.size_pools(EssConfig(memory_pool_size_gb=8.0, max_gpu_buffer_size_gb=0.2),
                              available_bytes=4 * GIB, num_layers=61, page_size=64, context_len=context,
                              colocated=False, host_memory_bytes=1500 * GIB)
    adm = EssAdmission(host_tokens=pools.host_tokens, indexer_tokens=pools.logical_tokens,
                       hot_slots_per_layer=pools.hot_slots_per_layer, top_k=2048)
    v = adm.admit("huge", pools.host_tokens + 1)
    assert v.decision is Decision.REJECT and "raise ess_config.memory_pool_size_gb" in v.reason


def test_the_schedulers_token_capacity_is_the_logical_locations(monkeypatch):
    """With ESS the allocator reports free logical locations (indexer entries backed by the host pool) to SGLang; the
    model runner's max_total_num_tokens, which SGLang's pool statistics divide that by and which caps a request's
    length, must count the same locations, not the device slots the pool configurator sized. A real SGLang 0.5.17
    server otherwise asserted on a negative token usage at its first idle step."""
    from ess_sglang.sglang_plugin import coordinator, decode_topk

    enabled = settings.EssSettings(True, EssConfig(), None)
    monkeypatch.setattr(coordinator.settings_mod, "current", lambda *a: enabled)
    monkeypatch.setattr(coordinator.compat, "verify_applied", lambda *a: None)
    monkeypatch.setattr(coordinator.EssCoordinator, "from_model_runner", classmethod(lambda cls, *a: "coordinator"))
    monkeypatch.setattr(decode_topk, "log_startup", lambda *a: None)
    allocator = types.SimpleNamespace(size=10 * 17_472)  # logical locations: ratio 10 over the device slots
    runner = types.SimpleNamespace(server_args=None, enable_hisparse=True, max_total_num_tokens=17_472,
                                   token_to_kv_pool_allocator=allocator)
    assert coordinator.maybe_init_hisparse_coordinator_hook(lambda *a: None, runner) is None
    assert runner.hisparse_coordinator == "coordinator"
    assert runner.max_total_num_tokens == 174_720
