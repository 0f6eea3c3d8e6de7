"""Admission control: a request runs only when its host entries, indexer entries and hot-pool slots are available.

HiSparse admits against the GPU pools only and allocates host pages as requests grow, so a full host pool crashes
the server in the middle of decoding ("HiSparse host mem pool alloc failed", after ~38 long requests). ESS reserves
each request's whole lifetime when it is admitted:

* host entries and indexer entries (logical KV locations): the prompt plus ``max_new_tokens``, rounded up to whole
  pages (both pools allocate by page);
* hot-pool slots: what one decode step of the request can select, ``q_tokens x (min(top_k, tokens) + 1)`` per
  layer; the sum over running requests never exceeds ``hot_slots_per_layer``, so every step's selections fit.

A request that fits now is admitted; one that will fit once others finish waits in SGLang's queue; one that can
never fit (more tokens than the host pool or the indexer cache holds) is rejected at once with a message saying
why. Finishing, aborting or retracting a request releases everything it reserved.

``EssAdmission`` is plain Python (unit-tested without SGLang or a GPU). The hook functions below connect it to the
places where SGLang decides: ``PrefillAdder.add_one_req`` (colocated), ``DecodePreallocQueue`` (PD decode: the
per-request budget check and ``_pre_alloc``), and ``Scheduler._add_request_to_queue`` (early rejection).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum

from ess_sglang.config import round_up

logger = logging.getLogger("ess_sglang.sglang_plugin")

NEVER_FITS = 1 << 62
"""What the PD budget check is told a waiting request needs, so that SGLang's own comparison keeps it queued."""


class Decision(Enum):
    ADMIT = "admit"
    WAIT = "wait"
    REJECT = "reject"


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str = ""


@dataclass(frozen=True)
class Reservation:
    host_tokens: int
    hot_slots: int


class EssAdmission:
    """Book-keeping of what admitted requests reserved, against three capacities."""

    def __init__(self, *, host_tokens: int, indexer_tokens: int, hot_slots_per_layer: int, top_k: int,
                 page_size: int = 64, q_tokens: int = 1, max_requests: int | None = None):
        if min(host_tokens, indexer_tokens, hot_slots_per_layer, top_k, page_size, q_tokens) <= 0:
            raise ValueError("EssAdmission needs positive capacities")
        self.host_tokens = host_tokens
        self.indexer_tokens = indexer_tokens
        self.hot_slots_per_layer = hot_slots_per_layer
        self.top_k = top_k
        self.page_size = page_size
        self.q_tokens = q_tokens
        self.max_requests = max_requests
        self._held: dict[str, Reservation] = {}
        self.host_reserved = 0
        self.hot_reserved = 0
        self.rejected = 0
        self.waits = 0

    # -------------------------------------------------------------------------------------------- needs
    def host_need(self, total_tokens: int) -> int:
        """Host entries (= indexer entries) a request of `total_tokens` (prompt + max new tokens) can come to use."""
        return round_up(max(int(total_tokens), 1), self.page_size)

    def hot_need(self, total_tokens: int) -> int:
        """Hot slots per layer one decode step of the request can need (its selections plus its new token)."""
        return self.q_tokens * (min(self.top_k, max(int(total_tokens), 1)) + 1)

    # -------------------------------------------------------------------------------------------- state
    @property
    def running(self) -> int:
        return len(self._held)

    @property
    def host_free(self) -> int:
        return self.host_tokens - self.host_reserved

    @property
    def indexer_free(self) -> int:
        return self.indexer_tokens - self.host_reserved

    @property
    def hot_free(self) -> int:
        return self.hot_slots_per_layer - self.hot_reserved

    def holds(self, rid: str) -> bool:
        return rid in self._held

    # -------------------------------------------------------------------------------------------- decisions
    def never_fits(self, total_tokens: int) -> str | None:
        """Why a request of `total_tokens` can never be admitted, or None."""
        host = self.host_need(total_tokens)
        if host > self.host_tokens:
            return (f"ESS: the request needs {host:,} host KV entries (prompt + max_new_tokens = {total_tokens:,} "
                    f"tokens) but the host pool holds {self.host_tokens:,}; lower max_new_tokens or the prompt, or "
                    f"raise ess_config.memory_pool_size_gb")
        if host > self.indexer_tokens:
            return (f"ESS: the request needs {host:,} indexer entries (prompt + max_new_tokens = {total_tokens:,} "
                    f"tokens) but the GPU indexer cache holds {self.indexer_tokens:,}; lower max_new_tokens or the "
                    f"prompt, or give the KV cache more GPU memory")
        if self.hot_need(total_tokens) > self.hot_slots_per_layer:
            return (f"ESS: one decode step of the request selects up to {self.hot_need(total_tokens):,} entries per "
                    f"layer but the hot pool has {self.hot_slots_per_layer:,} slots per layer; raise the hot pool")
        return None

    def check(self, rid: str, total_tokens: int) -> Verdict:
        """ADMIT, WAIT or REJECT a request of `total_tokens` (prompt + max new tokens); changes nothing."""
        if rid in self._held:
            return Verdict(Decision.ADMIT, "already admitted")
        why = self.never_fits(total_tokens)
        if why is not None:
            return Verdict(Decision.REJECT, why)
        if self.max_requests is not None and len(self._held) >= self.max_requests:
            return Verdict(Decision.WAIT, f"{len(self._held)} requests running (the most ESS planned for)")
        host, hot = self.host_need(total_tokens), self.hot_need(total_tokens)
        if host > self.host_free:
            return Verdict(Decision.WAIT, f"host pool: {host:,} entries needed, {self.host_free:,} free")
        if host > self.indexer_free:
            return Verdict(Decision.WAIT, f"indexer cache: {host:,} entries needed, {self.indexer_free:,} free")
        if hot > self.hot_free:
            return Verdict(Decision.WAIT, f"hot pool: {hot:,} slots per layer needed, {self.hot_free:,} free")
        return Verdict(Decision.ADMIT)

    def admit(self, rid: str, total_tokens: int) -> Verdict:
        """check(), and reserve when the answer is ADMIT."""
        v = self.check(rid, total_tokens)
        if v.decision is Decision.ADMIT and rid not in self._held:
            self._reserve(rid, total_tokens)
        elif v.decision is Decision.WAIT:
            self.waits += 1
        elif v.decision is Decision.REJECT:
            self.rejected += 1
        return v

    def force(self, rid: str, total_tokens: int) -> None:
        """Reserve for a request SGLang runs without having asked (a resumed retraction); logs an over-commit."""
        if rid in self._held:
            return
        v = self.check(rid, total_tokens)
        if v.decision is not Decision.ADMIT:
            logger.warning("ESS admission: request %s runs without a reservation (%s)", rid, v.reason)
        self._reserve(rid, total_tokens)

    def _reserve(self, rid: str, total_tokens: int) -> None:
        r = Reservation(self.host_need(total_tokens), self.hot_need(total_tokens))
        self._held[rid] = r
        self.host_reserved += r.host_tokens
        self.hot_reserved += r.hot_slots

    def release(self, rid: str) -> bool:
        """Give back everything `rid` reserved (finished, aborted or retracted); False when it held nothing."""
        r = self._held.pop(rid, None)
        if r is None:
            return False
        self.host_reserved -= r.host_tokens
        self.hot_reserved -= r.hot_slots
        return True

    def check_invariants(self) -> None:
        assert self.host_reserved == sum(r.host_tokens for r in self._held.values())
        assert self.hot_reserved == sum(r.hot_slots for r in self._held.values())
        assert 0 <= self.host_reserved <= min(self.host_tokens, self.indexer_tokens)
        assert 0 <= self.hot_reserved <= self.hot_slots_per_layer


# ------------------------------------------------------------------------------------------------ SGLang glue

def request_total_tokens(req) -> int:
    """Prompt plus the most tokens the request may still generate (SGLang clips max_new_tokens the same way)."""
    prompt = len(getattr(req, "origin_input_ids", ()) or ())
    done = len(getattr(req, "output_ids", ()) or ())
    sp = getattr(req, "sampling_params", None)
    max_new = getattr(sp, "max_new_tokens", None)
    if max_new is None:
        max_new = 0
    return prompt + done + max(int(max_new) - done, 0)


def _admission():
    from ess_sglang.sglang_plugin.active import active_coordinator

    coord = active_coordinator()
    return coord, (coord.admission if coord is not None else None)


def add_request_to_queue_hook(scheduler, req, *args, **kwargs):
    """BEFORE Scheduler._add_request_to_queue(req): reject at once a request that can never fit."""
    coord, adm = _admission()
    if adm is None or req.finished():
        return None
    why = adm.never_fits(request_total_tokens(req))
    if why is not None:
        adm.rejected += 1
        req.set_finish_with_abort(why)
    return None


def add_one_req_hook(original, adder, req, *args, **kwargs):
    """AROUND PrefillAdder.add_one_req(req, ...): colocated admission (host, indexer, hot pool, prefill staging)."""
    coord, adm = _admission()
    if adm is None or adm.holds(req.rid) or getattr(req, "to_finish", None) is not None:
        # (SGLang 0.5.17 prefills a request refused at the queue as a one-token prompt that then finishes: it
        # holds nothing of ESS's)
        return original(adder, req, *args, **kwargs)
    from sglang.srt.managers.schedule_policy import AddReqResult

    total = request_total_tokens(req)
    verdict = adm.check(req.rid, total)
    if verdict.decision is Decision.ADMIT:
        # The prompt sits in device slots until it is staged to host memory: it must fit the staging room now.
        prompt = len(req.origin_input_ids)
        staging_free = coord.staging_free()
        if prompt > staging_free:
            verdict = Verdict(Decision.WAIT, f"prefill staging: {prompt:,} device slots needed, {staging_free:,} "
                                             f"free")
    if verdict.decision is not Decision.ADMIT:
        if verdict.decision is Decision.REJECT:
            logger.error("ESS admission: request %s cannot fit: %s", req.rid, verdict.reason)
        adm.waits += 1
        coord.note_queued(max(getattr(adder, "waiting_queue_len", 1) - len(adder.can_run_list), 1))
        logger.debug("ESS admission: request %s waits (%s)", req.rid, verdict.reason)
        return AddReqResult.NO_TOKEN
    result = original(adder, req, *args, **kwargs)
    if any(r is req for r in adder.can_run_list):
        adm.admit(req.rid, total)
        coord.hold_staging(req.rid, len(req.origin_input_ids))
        coord.note_queued(0)
    return result


def required_admission_tokens_hook(original, queue, req, *args, **kwargs):
    """AROUND DecodePreallocQueue._required_admission_tokens(req, ...): PD decode admission."""
    coord, adm = _admission()
    if adm is None:
        return original(queue, req, *args, **kwargs)
    verdict = adm.check(req.rid, request_total_tokens(req))
    if verdict.decision is Decision.REJECT:
        from http import HTTPStatus

        from sglang.srt.disaggregation.utils import prepare_abort

        adm.rejected += 1
        prepare_abort(req, verdict.reason, status_code=HTTPStatus.BAD_REQUEST)
        return NEVER_FITS
    if verdict.decision is Decision.WAIT:
        adm.waits += 1
        coord.note_queued(len(getattr(queue, "queue", ())))
        return NEVER_FITS
    return original(queue, req, *args, **kwargs)


def pre_alloc_hook(result, queue, req, *args, **kwargs):
    """AFTER DecodePreallocQueue._pre_alloc(req, ...): the request got its KV destination; reserve for it."""
    coord, adm = _admission()
    if adm is not None:
        adm.admit(req.rid, request_total_tokens(req))
        coord.note_queued(0)
    return None
