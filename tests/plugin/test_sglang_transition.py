"""A colocated prompt's move from prefill to decode with prefill_to_decode "merged"
(ess_sglang/sglang_plugin/transition.py): the requests of a launched prefill batch are staged at once and SGLang
merges them into its decode batch as without HiSparse; their device slots go when the prefill's result is processed,
or when they finish first. Over SGLang's own HiSparse pools on CPU, and against the installed SGLang's own
``get_next_batch_to_run`` source."""

from __future__ import annotations

import inspect
import types

import pytest
from sglang_pools import cpu_coordinator, prefilled_request

from ess_sglang.config import EssConfig
from ess_sglang.sglang_plugin import health, transition
from ess_sglang.sglang_plugin.active import set_active

pytest.importorskip("sglang")  # CI installs sglang; this only guards machines without it

PAGE = 64


@pytest.fixture
def pools():
    """Two layers, six request rows, top-k 128, a 1,024-slot hot pool and 16 pages of prefill staging; prompts merged
    into the decode batch launched after their prefill."""
    coord, allocator, req_pool = cpu_coordinator(page=PAGE, layers=2, rows=6, top_k=128, hot=1024, staging=16 * PAGE,
                                                 config=EssConfig(top_k=128, prefill_to_decode="merged"))
    yield coord, allocator, req_pool
    set_active(None)


def _batch(reqs, chunked=None, extend=True):
    return types.SimpleNamespace(reqs=reqs, chunked_req=chunked,
                                 forward_mode=types.SimpleNamespace(is_extend=lambda: extend))


def _scheduler(coord, mode="null", chunked=None):
    return types.SimpleNamespace(hisparse_coordinator=coord, enable_hisparse=True, chunked_req=chunked,
                                 disaggregation_mode=types.SimpleNamespace(value=mode))


def test_a_launched_prefill_is_staged_then_merged_by_sglang_as_without_hisparse(pools):
    coord, allocator, req_pool = pools
    free = allocator.hisparse_attn_allocator.available_size()
    joining = prefilled_request(coord, allocator, req_pool, 1, 300, "joins")
    chunked = prefilled_request(coord, allocator, req_pool, 2, 200, "chunked")  # its prefill goes on
    done = prefilled_request(coord, allocator, req_pool, 3, 100, "finished")  # aborted before its result
    done.finished = lambda: True
    scheduler = _scheduler(coord, chunked=chunked)
    seen = []

    def get_next_batch_to_run(s, running_batch, last_batch):  # SGLang's, as far as the hook can tell
        seen.append(s.enable_hisparse)
        return "plan"

    batch = _batch([joining, chunked, done])
    running = types.SimpleNamespace(batch_is_full=True, hisparse_coordinator=None)
    assert transition.get_next_batch_to_run_hook(get_next_batch_to_run, scheduler, running, batch) == "plan"
    assert seen == [False] and scheduler.enable_hisparse  # SGLang merged it as without HiSparse, for that call only
    assert not running.batch_is_full  # prefills are tried again every call, as SGLang's HiSparse branch does
    # both batches name the coordinator: SGLang 0.5.17's prepare_for_decode calls map_last_loc_to_buffer through it
    assert running.hisparse_coordinator is coord and batch.hisparse_coordinator is coord
    assert coord.holds_row(1) and not coord.holds_row(2) and not coord.holds_row(3)
    host = coord.req_to_host_pool[1, :300]
    assert bool((host >= 0).all())  # host slots, and the prompt's entries copied there
    assert bool((coord.mem_pool_host.kv_buffer[0][host] == 7).all())
    held = allocator.hisparse_attn_allocator.available_size()
    assert held == free - 5 * PAGE - 4 * PAGE - 2 * PAGE  # device slots still held: the prefill's result is to come

    coord.admit_request_into_staging(joining)  # its result processed while its first decode step runs
    assert allocator.hisparse_attn_allocator.available_size() == held + 5 * PAGE
    assert coord.collect_ready_reqs() == [] and not coord.has_ongoing_staging()
    assert coord.manager.resident_count(0) == 0  # the warm-up is prepared on the host, not loaded yet

    # the next call loads it; nothing is staged twice, and the chunked request's last chunk was a later batch's
    assert transition.get_next_batch_to_run_hook(get_next_batch_to_run, scheduler, None, batch) == "plan"
    assert coord.manager.resident_count(0) > 0 and health.state_violations(coord) == []
    assert coord.req_to_host_pool_allocated_len[1] == 320 and not coord.holds_row(2)


def test_a_warm_up_never_loads_once_its_request_is_gone(pools):
    """Finished between its result and the next scheduler iteration: its prepared warm-up names freed host slots."""
    coord, allocator, req_pool = pools
    req = prefilled_request(coord, allocator, req_pool, 1, 300, "short")
    coord.admit_request_into_staging(req)
    coord.request_finished(req)
    coord.load_pending_warm_ups()
    assert coord.manager.resident_count(0) == 0 and health.state_violations(coord) == []


def test_a_request_finished_at_prefill_after_staging_gives_everything_back(pools):
    """Staged at its prefill's launch, finished by its first token: request_finished frees its device slots too."""
    coord, allocator, req_pool = pools
    free = (allocator.hisparse_attn_allocator.available_size(), coord.mem_pool_host.available_size())
    req = prefilled_request(coord, allocator, req_pool, 1, 300, "one-token", max_new=1)
    transition.get_next_batch_to_run_hook(lambda *a: None, _scheduler(coord), None, _batch([req]))
    assert coord.holds_row(1)
    coord.request_finished(req)
    allocator.free(req_pool.req_to_token[1, :300].long())  # SGLang's release_kv_cache: the logical locations
    assert (allocator.hisparse_attn_allocator.available_size(), coord.mem_pool_host.available_size()) == free
    assert health.idle_violations(coord) == []


@pytest.mark.parametrize("case", ["pd", "no_ess", "decode_batch", "staged"])
def test_the_hook_leaves_other_schedulers_and_batches_alone(pools, case):
    coord, allocator, req_pool = pools
    req = prefilled_request(coord, allocator, req_pool, 1, 300, "r")
    scheduler = _scheduler(coord, mode="decode" if case == "pd" else "null")
    if case == "no_ess":
        scheduler.hisparse_coordinator = object()
    if case == "staged":  # the default: SGLang HiSparse's own transition
        coord.merges_prefills = False
    seen = []
    transition.get_next_batch_to_run_hook(lambda s, *a: seen.append(s.enable_hisparse), scheduler, None,
                                          _batch([req], extend=case != "decode_batch"))
    assert not coord.holds_row(1)  # nothing staged
    assert seen == [case != "decode_batch"]  # the flag lowered only where ESS merges colocated prefills


def test_sglangs_merge_is_what_enable_hisparse_turns_off():
    """The hook's premise, read from the installed SGLang: get_next_batch_to_run takes the HiSparse queue when
    ``self.enable_hisparse`` and merges the last prefill batch into the running batch when not."""
    from sglang.srt.managers.scheduler import Scheduler

    src = inspect.getsource(inspect.unwrap(Scheduler.get_next_batch_to_run))
    assert list(inspect.signature(inspect.unwrap(Scheduler.get_next_batch_to_run)).parameters)[:3] == [
        "self", "running_batch", "last_batch"]
    assert "if self.enable_hisparse:" in src and "collect_ready_reqs()" in src
    merge = src[src.index("not self.enable_hisparse"):]
    assert "last_batch.forward_mode.is_extend()" in merge[:200] and "running_batch.merge_batch(last_batch)" in merge
    assert src.count("enable_hisparse") == 2  # nothing else in it reads the flag the hook lowers
