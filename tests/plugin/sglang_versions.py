"""What differs between the SGLang versions the plugin supports (0.5.17, 0.5.23), where a test drives SGLang's own
objects. The plugin's own differences live in ``ess_sglang.sglang_plugin.compat``; these are the tests' (how a
record is resolved and read, how a scheduler's runtime context is installed, where a request keeps its row).
Nothing here imports SGLang at import time."""

from __future__ import annotations

import contextlib

import pytest

from ess_sglang.sglang_plugin import compat

SGLANG_VERSION = compat.installed_sglang_version()
PD_DECODE = compat.pd_decode_supported(SGLANG_VERSION)
needs_pd_decode = pytest.mark.skipif(not PD_DECODE, reason=f"SGLang {SGLANG_VERSION}: "
                                                          f"{compat.PD_DECODE_REFUSAL_0517}")
"""For tests of an ESS PD decode instance: ESS refuses one on SGLang 0.5.17 (``cli_args.check_raw_flags``)."""


def resolve(server_args):
    """Resolve a ServerArgs record as the engine does before check_server_args: ``resolve_once`` in SGLang 0.5.23;
    SGLang 0.5.17's record resolved when it was built."""
    once = getattr(server_args, "resolve_once", None)
    if once is not None:
        once()
    return server_args


def resolved_view(server_args):
    """What reads the resolved fields of a record: 0.5.23's ``resolving_view``, the record itself in 0.5.17 (its
    fields carry the resolved values once built)."""
    try:
        from sglang.srt.arg_groups.overrides import resolving_view
    except ImportError:
        return server_args
    return resolving_view(server_args)


@contextlib.contextmanager
def scheduler_context(server_args):
    """The runtime context of a scheduler process built from `server_args`, active for the block: 0.5.23 builds one
    beside the process's (``create_context`` / ``use_context``); 0.5.17 has one process-wide context, published
    here and cleared afterwards (``publish`` / ``reset_context``)."""
    from sglang.srt import runtime_context as rc

    if hasattr(rc, "use_context"):
        with rc.use_context(rc.create_context(server_args, role="scheduler")):
            yield
        return
    rc.publish(server_args, role="scheduler")
    try:
        yield
    finally:
        rc.reset_context()


def _row_in_kv() -> bool:
    """SGLang 0.5.23 keeps a request's row and its KV length in ``req.kv`` (``ReqKvInfo.req_pool_idx``) and its
    prefill end in ``req.extend_end``; 0.5.17 in ``req.req_pool_idx``, ``req.kv`` (allocated with the KV) and
    ``req.extend_range`` (a ``Range(start, end)``)."""
    import dataclasses

    from sglang.srt.managers.schedule_batch import ReqKvInfo

    return "req_pool_idx" in {f.name for f in dataclasses.fields(ReqKvInfo)}


def set_req_row(req, row: int) -> None:
    """Give a request its row of ``req_to_token``: ``req.kv.req_pool_idx`` in SGLang 0.5.23, ``req.req_pool_idx``
    in 0.5.17 (where ``req.kv`` is None until SGLang allocates its KV)."""
    if _row_in_kv():
        req.kv.req_pool_idx = row
    else:
        req.req_pool_idx = row
    assert compat.req_row(req) == row


def set_extend_end(req, end: int) -> None:
    """Where the request's prefill ends, as SGLang sets it when it schedules the last chunk: ``req.extend_end`` in
    0.5.23, ``req.extend_range`` in 0.5.17."""
    if _row_in_kv():
        req.extend_end = end
    else:
        from sglang.srt.utils.common import Range

        req.extend_range = Range(0, end)
    assert compat.req_extend_end(req) == end


def request_fields(row: int, kv_allocated_len: int, extend_end: int) -> dict:
    """A stand-in request's row, KV length and prefill end, where the installed SGLang's Req keeps them (a dict of
    attributes for ``types.SimpleNamespace``)."""
    import types

    if _row_in_kv():
        return dict(kv=types.SimpleNamespace(req_pool_idx=row, kv_allocated_len=kv_allocated_len),
                    extend_end=extend_end)
    from sglang.srt.utils.common import Range

    return dict(kv=types.SimpleNamespace(kv_allocated_len=kv_allocated_len), req_pool_idx=row,
                extend_range=Range(0, extend_end))
