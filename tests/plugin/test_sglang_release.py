"""Release of what ESS holds for a request whose KV SGLang releases without telling the coordinator.

SGLang 0.5.17 calls ``hisparse_coordinator.request_finished`` only for requests that decoded; a request that
finishes at prefill (one new token), or is aborted before its prefill completed, has its KV released by
``mem_cache.common.release_kv_cache`` alone. ESS holds an admission reservation and prefill staging room for such a
request from the moment it is admitted: the plugin's BEFORE hook on ``release_kv_cache`` (SGLang 0.5.17 only,
``hooks.RUNTIME_HOOKS_BY_VERSION``) releases them. Without it every such request would leak its reservation until
admission stops admitting anything.

Everything here is SGLang's own code on CPU: its ``Req``, ``ReqToTokenPool``, HiSparse pools and allocator,
``ChunkCache`` (the tree cache with the radix cache off, as ESS runs) and ``release_kv_cache`` as the plugin loader
hooks it.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from sglang_pools import cpu_coordinator
from sglang_versions import SGLANG_VERSION, scheduler_context, set_extend_end

from ess_sglang.config import EssConfig
from ess_sglang.sglang_plugin.compat import req_row

pytest.importorskip("sglang")  # CI installs sglang==0.5.23; this only guards machines without it

PAGE = 64
LAYERS = 2
TOPK = 256
HOT = 1280
ROWS = 4
STAGING = 16 * PAGE


def _release_hooked(version) -> bool:
    from ess_sglang.sglang_plugin import coordinator, hooks

    return any(s.hook is coordinator.release_kv_cache_hook for s in hooks.runtime_hooks_for(version))


pytestmark = pytest.mark.skipif(not _release_hooked(SGLANG_VERSION), reason=(
    f"SGLang {SGLANG_VERSION}: the plugin hooks release_kv_cache on SGLang 0.5.17 only (0.5.23 calls the HiSparse "
    f"coordinator's request_finished where it releases such a request's KV)"))


@pytest.fixture
def served(loaded_plugins, ess_env, model_argv, parallel1):
    """The runtime hooks applied as in an ESS scheduler process, with a scheduler's runtime context published (SGLang's
    release path reads it) and an ESS coordinator over SGLang's HiSparse pools; yields (coordinator, allocator,
    request pool, tree cache)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.chunk_cache import ChunkCache
    from sglang.srt.server_args import prepare_server_args

    from ess_sglang.sglang_plugin import hooks
    from ess_sglang.sglang_plugin.active import set_active

    hooks.install_runtime_hooks()
    coord, allocator, req_pool = cpu_coordinator(page=PAGE, layers=LAYERS, rows=ROWS, top_k=TOPK, hot=HOT,
                                                 staging=STAGING, config=EssConfig(top_k=TOPK, warmup_windows=0))
    assert coord.staging_capacity == STAGING
    tree = ChunkCache(CacheInitParams(disable=True, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator,
                                      page_size=PAGE))
    with scheduler_context(prepare_server_args(model_argv)):
        yield coord, allocator, req_pool, tree
    set_active(None)


def _prefilled(coord, allocator, req_pool, rid: str, n: int, max_new: int, done: int | None = None):
    """A request of an `n`-token prompt admitted by ESS (its reservation and prefill staging room, as the admission
    hook takes them), whose first `done` tokens (all by default) SGLang prefilled into device slots."""
    from sglang.srt.managers.schedule_batch import Req, ReqKvInfo
    from sglang.srt.sampling.sampling_params import SamplingParams

    from ess_sglang.sglang_plugin.admission import Decision

    req = Req(rid, "", [7] * n, SamplingParams(max_new_tokens=max_new))
    assert coord.admission.admit(rid, n + max_new).decision is Decision.ADMIT
    coord.hold_staging(rid, n)
    (row,) = req_pool.alloc([req])
    m = n if done is None else done
    zero = torch.tensor([0])
    logical = allocator.alloc_extend(zero, zero, torch.tensor([m]), torch.tensor([m]), torch.tensor([-1]), m)
    req_pool.req_to_token[row, :m] = logical.to(torch.int32)
    req.kv = ReqKvInfo(kv_allocated_len=m, swa_evicted_seqlen=0)
    req.kv_committed_len = m
    set_extend_end(req, m)
    return req


def _free(coord, allocator):
    return (coord.admission.running, coord.staging_free(), int(allocator.hisparse_attn_allocator.available_size()),
            int(allocator.logical_attn_allocator.available_size()), int(coord.mem_pool_host.available_size()))


def test_a_request_finished_at_prefill_releases_what_ess_holds(served):
    """A one-token request finishes at its prefill: SGLang releases its KV with release_kv_cache only; ESS's
    reservation and staging room go with it, as its device slots and row do."""
    from sglang.srt.mem_cache import common

    coord, allocator, req_pool, tree = served
    idle = _free(coord, allocator)
    req = _prefilled(coord, allocator, req_pool, "one-token", 700, 1)
    assert _free(coord, allocator)[:4] != idle[:4]
    common.release_kv_cache(req, tree)
    assert req.req_pool_idx is None and req.kv is None
    assert _free(coord, allocator) == idle


def test_a_request_aborted_in_chunked_prefill_releases_what_ess_holds(served):
    """Aborted after its first 512-token chunk (SGLang's abort path calls release_kv_cache, not the coordinator)."""
    from sglang.srt.mem_cache import common

    coord, allocator, req_pool, tree = served
    idle = _free(coord, allocator)
    req = _prefilled(coord, allocator, req_pool, "aborted", 900, 64, done=512)
    assert coord.staging_free() == STAGING - 960  # the whole prompt's room, held since admission
    common.release_kv_cache(req, tree)
    assert _free(coord, allocator) == idle


def test_a_decoded_request_is_released_once(served):
    """A request that was staged to host memory and decoded is released by the coordinator (SGLang calls
    request_finished), then by release_kv_cache: the hook's second release frees nothing twice."""
    from sglang.srt.mem_cache import common

    coord, allocator, req_pool, tree = served
    idle = _free(coord, allocator)
    req = _prefilled(coord, allocator, req_pool, "decoded", 700, 16)
    coord.admit_request_into_staging(req)
    assert coord.collect_ready_reqs() == [req] and coord.holds_row(req_row(req))
    assert coord.mem_pool_host.available_size() < idle[4]
    coord.request_finished(req)  # SGLang's finish path, then its release_kv_cache
    common.release_kv_cache(req, tree)
    assert _free(coord, allocator) == idle


def test_without_the_hook_the_reservation_would_leak(served):
    """SGLang's own release_kv_cache (the hook unwrapped) frees the KV and the row, and nothing of ESS's: the
    reservation and the staging room stay held, which is what the hook is for."""
    from sglang.srt.mem_cache import common

    coord, allocator, req_pool, tree = served
    idle = _free(coord, allocator)
    original = inspect.unwrap(common.release_kv_cache)
    assert original is not common.release_kv_cache
    req = _prefilled(coord, allocator, req_pool, "leaks", 700, 1)
    original(req, tree)
    assert req.req_pool_idx is None
    assert coord.admission.running == 1 and coord.staging_free() == STAGING - 704
    assert _free(coord, allocator)[2:4] == idle[2:4]  # (SGLang freed its own)
