"""The decode batch SGLang builds for requests that leave HiSparse staging: what it asks the sampler for.

SGLang 0.5.17 and 0.5.23 build that batch in ``Scheduler._build_hisparse_decode_batch`` (0.5.17
managers/scheduler.py:2880-2920, 0.5.23 managers/scheduler.py:3830-3875). When any request of it asks for
log-probabilities (``return_logprob``), it sets ``batch.token_ids_logprobs = [list(r.origin_input_ids) ...]``: every
request's whole prompt as the token ids whose log-probabilities it wants, where every other batch SGLang builds takes
the request's own ``r.logprob.token_ids_logprob`` (None unless the request named token ids; 0.5.17
schedule_batch.py:2519, 0.5.23 schedule_batch.py:3100). The list rides along as the batch decodes, so every decode step
of such a request turns its prompt into a tensor on the host and gathers that many log-probabilities
(``logprob_processor.get_token_ids_logprobs_raw``): measured in a real 0.5.17 server on an H100 with a 32K prompt,
2.3 ms of host time per request per step, which made the step host-bound (8 requests: 33 ms a step against 5.5 ms for
the same server without HiSparse; benchmarks/results/serving/h100_32k_profile). The output tokens are unchanged; the
response carries those extra log-probabilities.

An ESS instance runs this SGLang code (ESS implies ``--enable-hisparse``), so the plugin sets the batch's list back to
what the requests asked for, after SGLang built it. SGLang's HiSparse without ESS keeps the behaviour.
"""

from __future__ import annotations


def build_hisparse_decode_batch_hook(batch, scheduler, reqs, *args, **kwargs):
    """AFTER Scheduler._build_hisparse_decode_batch(reqs): the batch's token-id log-probabilities are those the
    requests asked for, not their prompts."""
    from ess_sglang.sglang_plugin.coordinator import EssCoordinator

    if not isinstance(getattr(scheduler, "hisparse_coordinator", None), EssCoordinator):
        return None  # HiSparse without ESS: SGLang's own batch
    if batch is not None and getattr(batch, "return_logprob", False) and \
            getattr(batch, "token_ids_logprobs", None) is not None:
        batch.token_ids_logprobs = [r.logprob.token_ids_logprob for r in reqs]  # as SGLang's other batches
    return None
