"""Admission control and pool sizing as plain Python (no SGLang objects, no GPU)."""

from __future__ import annotations

import random

import pytest
from sglang_versions import needs_pd_decode

from ess_sglang.config import GIB, EssConfig, EssConfigError
from ess_sglang.sglang_plugin.admission import Decision, EssAdmission, request_total_tokens
from ess_sglang.sglang_plugin.sizing import LATENT_BYTES, gpu_bytes, size_pools

pytest.importorskip("sglang")  # CI installs sglang==0.5.23; this only guards machines without it


def test_admit_wait_reject_release():
    a = EssAdmission(host_tokens=64 * 100, indexer_tokens=64 * 120, hot_slots_per_layer=2 * 2049 + 101, top_k=2048)
    assert a.check("x", 64 * 101).decision is Decision.REJECT  # more than the host pool, ever
    assert "memory_pool_size_gb" in a.check("x", 64 * 101).reason
    assert a.admit("a", 3000).decision is Decision.ADMIT  # 47 pages
    assert a.admit("b", 3000).decision is Decision.ADMIT
    v = a.admit("c", 3000)  # host: 94 pages held, 47 more needed, 100 exist
    assert v.decision is Decision.WAIT and "host pool" in v.reason
    assert a.admit("d", 100).decision is Decision.ADMIT  # 2 pages and the last 101 hot slots
    v = a.admit("e", 100)
    assert v.decision is Decision.WAIT and "hot pool" in v.reason
    assert a.release("a") and not a.release("a")  # idempotent
    assert a.admit("c", 3000).decision is Decision.ADMIT
    a.check_invariants()
    assert a.admit("c", 3000).decision is Decision.ADMIT and a.running == 3  # already admitted: no double charge


def test_short_requests_need_fewer_hot_slots():
    a = EssAdmission(host_tokens=1 << 20, indexer_tokens=1 << 20, hot_slots_per_layer=2049 + 101, top_k=2048)
    assert a.hot_need(100) == 101 and a.hot_need(50_000) == 2049
    assert a.admit("long", 50_000).decision is Decision.ADMIT
    assert a.admit("short", 100).decision is Decision.ADMIT
    assert a.admit("short2", 100).decision is Decision.WAIT


def test_indexer_capacity_limits_too():
    a = EssAdmission(host_tokens=1 << 20, indexer_tokens=6400, hot_slots_per_layer=1 << 20, top_k=2048)
    assert a.check("x", 6401).decision is Decision.REJECT and "indexer" in a.check("x", 6401).reason
    assert a.admit("a", 6000).decision is Decision.ADMIT
    assert a.admit("b", 500).decision is Decision.WAIT


def test_random_churn_never_overcommits():
    rng = random.Random(5)
    a = EssAdmission(host_tokens=64 * 500, indexer_tokens=64 * 450, hot_slots_per_layer=10 * 2049, top_k=2048,
                     max_requests=12)
    live = {}
    for i in range(5000):
        if live and rng.random() < 0.45:
            a.release(live.pop(rng.choice(list(live))))
        else:
            rid = f"r{i}"
            if a.admit(rid, rng.randint(10, 9000)).decision is Decision.ADMIT:
                live[rid] = rid
        a.check_invariants()
        assert a.running <= 12


def test_request_total_tokens():
    class R:
        origin_input_ids = [0] * 1000
        output_ids = [1] * 10

        class sampling_params:
            max_new_tokens = 256

    assert request_total_tokens(R) == 1256


def test_sizing_fills_the_gpu_and_respects_the_host_pool():
    cfg = EssConfig(memory_pool_size_gb=400.0, max_gpu_buffer_size_gb=8.0)
    p = size_pools(cfg, available_bytes=40 * GIB, num_layers=61, page_size=64, context_len=163840, colocated=False,
                   host_memory_bytes=1500 * GIB)
    assert p.gpu_bytes <= 40 * GIB and p.gpu_bytes == gpu_bytes(61, p.device_tokens, p.host_to_device_ratio, 64)
    assert p.logical_tokens == p.device_tokens * p.host_to_device_ratio == p.host_tokens
    assert p.host_bytes <= 400 * GIB
    assert p.hot_slots_per_layer * 61 * LATENT_BYTES >= 8 * GIB * 0.99  # at least what was asked (page rounding)
    assert p.hot_slots_per_layer >= p.max_running_requests * 2049
    assert p.device_tokens % 64 == 0 and p.hot_slots_per_layer % 64 == 0
    # a bigger host pool than the GPU can index: the GPU indexer cache is the limit, and it is nearly full
    assert "GPU" in p.limited_by and p.gpu_bytes > 39 * GIB


def test_sizing_ratio_is_a_floor_on_the_hot_share():
    p = size_pools(EssConfig(sparse_memory_ratio=0.1, memory_pool_size_gb=200.0), available_bytes=40 * GIB,
                   num_layers=61, page_size=64, context_len=131072, colocated=True, prefill_tokens=131072,
                   host_memory_bytes=1500 * GIB)
    assert p.hot_slots_per_layer / p.logical_tokens >= 0.1
    assert p.prefill_staging_tokens == 131072
    assert p.device_tokens == p.hot_slots_per_layer + p.new_token_slots + p.prefill_staging_tokens


def test_sizing_host_limited():
    p = size_pools(EssConfig(memory_pool_size_gb=60.0, max_gpu_buffer_size_gb=4.0), available_bytes=40 * GIB,
                   num_layers=61, page_size=64, context_len=131072, colocated=False, host_memory_bytes=1500 * GIB)
    assert p.limited_by == "memory_pool_size_gb"
    assert p.host_bytes <= 60 * GIB and p.host_bytes > 0.9 * 60 * GIB


def test_sizing_errors_name_what_to_change():
    with pytest.raises(EssConfigError, match=r"ess_config\.max_gpu_buffer_size_gb: the GPU budget"):
        size_pools(EssConfig(max_gpu_buffer_size_gb=30.0), available_bytes=20 * GIB, num_layers=61, page_size=64,
                   context_len=131072, colocated=False, host_memory_bytes=1500 * GIB)
    with pytest.raises(EssConfigError, match=r"ess_config\.page_size"):
        size_pools(EssConfig(), available_bytes=20 * GIB, num_layers=61, page_size=32, context_len=1000,
                   colocated=False)
    with pytest.raises(EssConfigError, match=r"memory_pool_size_gb.*does not fit"):
        size_pools(EssConfig(memory_pool_size_gb=900.0), available_bytes=20 * GIB, num_layers=61, page_size=64,
                   context_len=1000, colocated=False, host_memory_bytes=500 * GIB)


class _Coord:
    """What the admission hooks use of the coordinator."""

    def __init__(self, admission, staging=1 << 30):
        self.admission, self.staging, self.queued, self.held = admission, staging, None, {}

    def staging_free(self):
        return self.staging - sum(self.held.values())

    def hold_staging(self, rid, n):
        self.held[rid] = n

    def note_queued(self, n):
        self.queued = n


def _req(rid, prompt, new):
    import types

    class R(types.SimpleNamespace):
        def finished(self):
            return self.finished_reason is not None

        def set_finish_with_abort(self, msg):
            self.finished_reason = msg

    return R(rid=rid, origin_input_ids=[0] * prompt, output_ids=[], finished_reason=None, return_logprob=False,
             sampling_params=types.SimpleNamespace(max_new_tokens=new))


def test_hooks_gate_sglangs_admission_points():
    import types

    from sglang.srt.managers.schedule_policy import AddReqResult

    from ess_sglang.sglang_plugin import admission as glue
    from ess_sglang.sglang_plugin.active import set_active

    adm = EssAdmission(host_tokens=64 * 40, indexer_tokens=64 * 40, hot_slots_per_layer=4 * 2049, top_k=2048)
    coord = _Coord(adm, staging=3000)
    set_active(coord)
    adder = types.SimpleNamespace(can_run_list=[], waiting_queue_len=5)

    def original(adder, req, *a, **k):
        adder.can_run_list.append(req)
        return AddReqResult.CONTINUE

    # colocated: admitted requests reserve; the next waits (host pool), and waits do not call SGLang's code
    assert glue.add_one_req_hook(original, adder, _req("a", 1200, 300), False, None) is AddReqResult.CONTINUE
    assert glue.add_one_req_hook(original, adder, _req("b", 1200, 300), False, None) is AddReqResult.NO_TOKEN
    assert [r.rid for r in adder.can_run_list] == ["a"] and adm.holds("a") and coord.held == {"a": 1200}
    assert coord.queued == 4
    adm.release("a")
    coord.held.clear()
    # prefill staging: a prompt larger than the device room left waits even though the host pool has room
    assert glue.add_one_req_hook(original, adder, _req("c", 3100, 10), False, None) is AddReqResult.NO_TOKEN
    # never fits: rejected when queued, with the reason
    big = _req("big", 64 * 40, 64)
    glue.add_request_to_queue_hook(None, big)
    assert big.finished() and "host pool holds 2,560" in big.finished_reason
    set_active(None)


@needs_pd_decode
def test_hooks_gate_sglangs_pd_decode_admission():
    """PD decode: a waiting request is told it needs more than any budget, so SGLang keeps it queued; one that fits
    gets SGLang's own answer and reserves once SGLang allocated its KV destination; one that never fits is aborted
    with the reason."""
    import types

    from ess_sglang.sglang_plugin import admission as glue
    from ess_sglang.sglang_plugin.active import set_active

    adm = EssAdmission(host_tokens=64 * 40, indexer_tokens=64 * 40, hot_slots_per_layer=4 * 2049, top_k=2048)
    coord = _Coord(adm)
    set_active(coord)
    queue = types.SimpleNamespace(queue=[1, 2, 3])
    assert adm.admit("x", 2000).decision is Decision.ADMIT  # 32 of the 40 host pages
    assert glue.required_admission_tokens_hook(lambda q, r, *a: 7, queue, _req("y", 1000, 100), 0, 0, 0) \
        == glue.NEVER_FITS
    assert glue.required_admission_tokens_hook(lambda q, r, *a: 7, queue, _req("z", 100, 10), 0, 0, 0) == 7
    glue.pre_alloc_hook(None, queue, _req("z", 100, 10), None, 0, 0)
    assert adm.holds("z")
    r = _req("huge", 64 * 41, 0)
    assert glue.required_admission_tokens_hook(lambda q, r, *a: 7, queue, r, 0, 0, 0) == glue.NEVER_FITS
    assert r.finished_reason is not None and "memory_pool_size_gb" in r.finished_reason.message
    set_active(None)
