"""ESS's self-checks (ess_sglang/sglang_plugin/health.py) over SGLang's own HiSparse pools on CPU: a consistent
state passes, what a request holds shows at idle until it is released, each kind of damage is named, the idle hook
runs once a busy period and counts what it finds, and ``scrub_on_free`` zeroes a finished request's host entries."""

from __future__ import annotations

import types

import pytest
import torch
from sglang_pools import cpu_coordinator, prefilled_request

from ess_sglang.config import EssConfig
from ess_sglang.sglang_plugin import health
from ess_sglang.sglang_plugin.active import set_active

pytest.importorskip("sglang")  # CI installs sglang; this only guards machines without it

PAGE = 64
LAYERS = 2
TOPK = 128
HOT = 1024
ROWS = 4
STAGING = 16 * PAGE


class _Checks:
    """Stands in for EssMetrics' self-check and gauge calls."""

    def __init__(self):
        self.checks, self.admitted, self.flushed = [], [], 0

    def note_invariant_check(self, when, violations):
        self.checks.append((when, violations))

    def set_admitted_requests(self, n):
        self.admitted.append(n)

    def set_queued_for_host_capacity(self, n):
        pass

    def flush(self, wait=True):
        self.flushed += 1
        return True

    def on_step(self):
        pass


@pytest.fixture
def coord():
    c, allocator, req_pool = cpu_coordinator(page=PAGE, layers=LAYERS, rows=ROWS, top_k=TOPK, hot=HOT, staging=STAGING,
                                             config=EssConfig(top_k=TOPK, scrub_on_free=True))
    c.test_allocator, c.test_req_pool = allocator, req_pool
    yield c
    set_active(None)


def _staged(coord, row: int, n: int, rid: str = "r"):
    """A request of an `n`-token prompt admitted, prefilled into device slots and staged to host memory (warmed up
    from its most recent tokens), as the colocated path does it."""
    req = prefilled_request(coord, coord.test_allocator, coord.test_req_pool, row, n, rid)
    coord.admit_request_into_staging(req)
    assert coord.collect_ready_reqs() == [req] and coord.holds_row(row)  # SGLang's next decode batch takes it
    return req


def test_a_fresh_coordinator_is_idle_and_consistent(coord):
    assert health.state_violations(coord) == []
    assert health.idle_violations(coord) == []


def test_a_decoding_request_is_consistent_and_shows_at_idle_until_released(coord):
    req = _staged(coord, 1, 300)
    assert health.state_violations(coord) == []
    idle = " | ".join(health.idle_violations(coord))
    for what in ("admission holds 1", "host-pool entries still in use", "hot-pool entries still resident",
                 "1 decoding rows left"):
        assert what in idle, idle
    coord.request_finished(req)
    assert health.idle_violations(coord) == []


def test_each_kind_of_damage_is_named(coord):
    req = _staged(coord, 1, 300)
    coord.admission.admit("ghost", 100)  # a reservation nobody will release: consistent while running, not at idle
    assert health.state_violations(coord) == []
    leaked = coord.mem_pool_host.alloc(PAGE)  # host entries no request row holds
    assert any("host pool: " in v for v in health.state_violations(coord))
    coord.mem_pool_host.free(leaked)
    slot = int(torch.nonzero(coord.manager.slot_to_loc[0, :HOT] >= 0)[0])
    coord.manager.slot_to_loc[0, slot] = -1  # a resident token whose slot forgot it
    assert any(v.startswith("hot-pool maps: layer 0") for v in health.state_violations(coord))
    coord.manager.slot_to_loc[0, slot] = int(torch.nonzero(coord.manager.loc_to_slot[0] == slot)[0])
    coord.admission.release(req.rid)  # decoding without a reservation
    assert any("hold no reservation" in v for v in health.state_violations(coord))
    coord.request_finished(req)
    assert any("admission holds 1" in v for v in health.idle_violations(coord))


def test_scrub_on_free_zeroes_the_finished_requests_host_entries(coord):
    req = _staged(coord, 2, 200)
    host = coord.mem_pool_host.allocated_host_indices(coord.req_to_host_pool, 2,
                                                      coord.req_to_host_pool_allocated_len[2]).long()
    assert bool((coord.host.entries[:, host[:200]] == 7).all())
    coord.request_finished(req)
    assert int(coord.host.entries[:, host].abs().sum()) == 0


def _scheduler(coord, idle=True, leak=False):
    checker = types.SimpleNamespace(_check_all_pools=lambda stats: (leak, ["[full] total=1, available=0"]))
    return types.SimpleNamespace(hisparse_coordinator=coord, is_fully_idle=lambda: idle, invariant_checker=checker,
                                 pool_stats_observer=types.SimpleNamespace(get_pool_stats=lambda: None),
                                 req_to_token_pool=coord.test_req_pool)


def test_the_idle_hook_runs_once_a_busy_period_and_counts(coord):
    coord.metrics = m = _Checks()
    health.on_idle_hook(None, _scheduler(coord, idle=False))
    assert m.checks == []  # not idle
    health.on_idle_hook(None, _scheduler(coord))
    assert m.checks == [("idle", 0)] and m.admitted == [0] and m.flushed == 1
    health.on_idle_hook(None, _scheduler(coord))
    assert m.checks == [("idle", 0)]  # still idle, checked less than IDLE_RECHECK_S ago
    health.after_step(coord, 1)  # a decode step: busy again
    health.on_idle_hook(None, _scheduler(coord, leak=True))
    assert m.checks == [("idle", 0), ("idle", 1)]  # SGLang's own pool check, which it skips with HiSparse


def test_the_running_check_follows_its_interval(coord):
    coord.metrics = m = _Checks()
    health.after_step(coord, 3)
    assert m.checks == []  # interval 0: never
    coord.config = coord.config.model_copy(update={"invariant_check_interval_steps": 2})
    health.after_step(coord, 3)
    health.after_step(coord, 4)
    assert m.checks == [("running", 0)]


def test_a_host_pool_that_cannot_be_allocated_is_one_clear_error(monkeypatch):
    """A pinned allocation that fails (the locked-memory limit) names the pool's size and what to change."""
    from ess_sglang.sglang_plugin import compat

    def fail(pool, tokens, pin):
        raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")

    monkeypatch.setattr(compat, "make_host_pool", fail)
    with pytest.raises(compat.EssLaunchError) as err:
        cpu_coordinator(page=PAGE, layers=LAYERS, rows=ROWS, top_k=TOPK, hot=HOT, staging=STAGING,
                        config=EssConfig(top_k=TOPK))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("ESS: could not allocate the host pool of ") and "CUDA error: out of memory;" in msg
    assert "ess_config.memory_pool_size_gb" in msg and "ulimit -l" in msg
    set_active(None)


def test_admission_leaves_the_small_batch_spare_reserve_out():
    """The one-page spare reserve (echo.plan, where nothing prefetches) serves only resolves of one or two requests:
    a larger batch cannot take those slots, so admission counts the hot pool without them, and a full admission's
    selections still fit what the larger resolve can evict. Without the reserve, the whole pool."""
    for config, reserve in ((EssConfig(top_k=TOPK, warmup_windows=0), PAGE),
                            (EssConfig(top_k=TOPK, warmup_windows=0, spare_slot_fraction=0), 0)):
        coord, _, _ = cpu_coordinator(page=PAGE, layers=LAYERS, rows=ROWS, top_k=TOPK, hot=HOT, staging=STAGING,
                                      config=config)
        try:
            assert coord.overlap_plan.spare_slots == reserve
            assert coord.admission.hot_slots_per_layer == HOT - reserve
        finally:
            coord.destroy()
            set_active(None)
