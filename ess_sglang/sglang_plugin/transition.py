"""A colocated prompt's move from prefill to decode with ESS, ``prefill_to_decode: merged``: it joins the decode batch
launched right after its prefill, as it does in SGLang without HiSparse. (The default, "staged", is SGLang HiSparse's
own transition, described next; this hook then calls SGLang's method unchanged.)

SGLang's HiSparse (0.5.17 and 0.5.23, ``Scheduler.get_next_batch_to_run``) skips the overlap scheduler's merge of a
prefill batch into the running batch. A prompt is staged to host memory while its prefill's result is processed,
after its first token is out, and joins a decode batch of its own (``collect_ready_reqs``,
``_build_hisparse_decode_batch``) one scheduler iteration later. Its first decode step is then built and launched
after its first token is streamed, and runs with nothing beside it. Measured in a real 0.5.17 server on an H100
(``serving_profile.py --transition``, one 32K request, under the profiler): ESS's second token came 22.5 ms after
the first, all-HBM's 8.6 ms after it. Those 14 ms are the first decode step's whole GPU time plus the host's work
to build and launch it; unprofiled, the first gap was 10.5-12.7 ms against 0.05-2.5, 0.85 points of TPOT at one
request and 256 output tokens.

With ESS (`get_next_batch_to_run_hook`):
1. Before SGLang picks the next batch, each request of the launched prefill batch that goes on to decode is staged
   at once (``EssCoordinator.stage_at_launch``): host slots, and its prompt's copy to host memory queued behind the
   prefill on a stream of its own, which the decode stream waits for. Nothing waits on the host.
2. SGLang then picks the batch as without HiSparse (``enable_hisparse`` reads False for that call only): it merges
   the prefill batch into the running batch, and the first decode step, which takes the first token from SGLang's
   future map, is launched before the prefill's result is processed.
3. While it runs, the prefill's result is processed: ``admit_request_into_staging`` frees the prompt's device slots
   and prepares its warm-up on the host; the next call of the hook loads the warm-ups prepared, after the decode
   step in flight (so that no request of the batch makes the host wait for that step).
The first decode step runs before the warm-up: its selection misses, and is fetched from host memory (lossless).
A request that finishes at its prefill is released by ``request_finished`` with its device slots. Without the
overlap scheduler the same hook lets SGLang merge the prefill batch, whose requests were staged when its result was
processed.
"""

from __future__ import annotations

from typing import Any


def prefill_requests_joining_decode(scheduler: Any, last_batch: Any, coord: Any) -> list:
    """The requests of `last_batch` SGLang's merge keeps (``ScheduleBatch.filter_batch``: not finished, not the
    request whose prefill goes on in chunks) that ESS has not staged yet (a mixed batch's decoding requests, or
    requests staged when their result was processed, without the overlap scheduler)."""
    from ess_sglang.sglang_plugin import compat

    if last_batch is None or not last_batch.forward_mode.is_extend():
        return []
    chunked = {id(r) for r in (getattr(scheduler, "chunked_req", None), getattr(last_batch, "chunked_req", None))
               if r is not None}
    return [r for r in last_batch.reqs if id(r) not in chunked and not r.finished()
            and not getattr(r, "is_retracted", False) and compat.req_row(r) is not None
            and not coord.holds_row(compat.req_row(r))]


def get_next_batch_to_run_hook(original, scheduler, *args, **kwargs):
    """AROUND Scheduler.get_next_batch_to_run(running_batch, last_batch) on a colocated ESS instance with
    prefill_to_decode "merged": stage the launched prefill's requests, then let SGLang merge them into its decode batch
    as without HiSparse."""
    from ess_sglang.sglang_plugin.coordinator import EssCoordinator

    coord = getattr(scheduler, "hisparse_coordinator", None)
    mode = getattr(scheduler, "disaggregation_mode", None)
    if not isinstance(coord, EssCoordinator) or not coord.merges_prefills \
            or str(getattr(mode, "value", mode or "null")) != "null":
        return original(scheduler, *args, **kwargs)
    running_batch = kwargs["running_batch"] if "running_batch" in kwargs else args[0] if args else None
    last_batch = kwargs["last_batch"] if "last_batch" in kwargs else args[1] if len(args) > 1 else None
    coord.load_pending_warm_ups()  # the warm-ups of the prefill results processed since the last call
    for req in prefill_requests_joining_decode(scheduler, last_batch, coord):
        coord.stage_at_launch(req)
    for batch in (running_batch, last_batch):
        if batch is not None:
            # SGLang 0.5.17 sets a batch's coordinator only in its HiSparse branch (0.5.23 also for prefill batches):
            # without it prepare_for_decode skips map_last_loc_to_buffer, and the new tokens get no host slot
            batch.hisparse_coordinator = coord
    if running_batch is not None:
        # as SGLang's HiSparse branch does every call: a prefill that waited for room ESS frees when a result is
        # processed (the prompt's device slots) is tried again, not only when a request leaves the batch
        running_batch.batch_is_full = False
    scheduler.enable_hisparse = False
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        scheduler.enable_hisparse = True
