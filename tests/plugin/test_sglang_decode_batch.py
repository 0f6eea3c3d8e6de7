"""The decode batch SGLang builds for requests leaving HiSparse staging asks the sampler for the token-id
log-probabilities the requests asked for, not their prompts (decode_batch.py: an SGLang bug the plugin undoes on an ESS
instance). SGLang's own ``Req`` and ``Scheduler`` code on CPU."""

from __future__ import annotations

import inspect
import types

import pytest

pytest.importorskip("sglang")


def _reqs():
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return [Req("a", "", [7] * 300, SamplingParams(max_new_tokens=4), return_logprob=True),
            Req("b", "", [5] * 200, SamplingParams(max_new_tokens=4), return_logprob=True, token_ids_logprob=[1, 2])]


def test_sglang_still_asks_for_the_prompts_logprobs():
    """What the hook undoes is still in SGLang (when this fails, SGLang fixed it: the hook can go)."""
    from sglang.srt.managers.scheduler import Scheduler

    src = inspect.getsource(inspect.unwrap(Scheduler._build_hisparse_decode_batch))  # (hooked or not)
    assert "token_ids_logprobs = [list(r.origin_input_ids) for r in reqs]" in src


def test_hook_restores_what_each_request_asked_for():
    from ess_sglang.sglang_plugin.coordinator import EssCoordinator
    from ess_sglang.sglang_plugin.decode_batch import build_hisparse_decode_batch_hook

    reqs = _reqs()
    prompts = [list(r.origin_input_ids) for r in reqs]  # what SGLang's builder leaves in the batch
    ess = types.SimpleNamespace(hisparse_coordinator=EssCoordinator.__new__(EssCoordinator))
    batch = types.SimpleNamespace(return_logprob=True, token_ids_logprobs=list(prompts))
    assert build_hisparse_decode_batch_hook(batch, ess, reqs) is None
    assert batch.token_ids_logprobs == [None, [1, 2]]

    hisparse = types.SimpleNamespace(hisparse_coordinator=object())  # HiSparse without ESS: SGLang's batch as built
    batch = types.SimpleNamespace(return_logprob=True, token_ids_logprobs=list(prompts))
    build_hisparse_decode_batch_hook(batch, hisparse, reqs)
    assert batch.token_ids_logprobs == prompts

    batch = types.SimpleNamespace(return_logprob=False, token_ids_logprobs=None)  # no log-probabilities asked
    build_hisparse_decode_batch_hook(batch, ess, reqs)
    assert batch.token_ids_logprobs is None
