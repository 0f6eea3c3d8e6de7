"""The decode top-k of an ESS instance: the kernel and plan SGLang runs without ESS, returning positions.

ESS implies ``--enable-hisparse``, and in SGLang 0.5.23 a HiSparse coordinator changes which top-k a decode batch
runs (read from the source; file:line of 0.5.23):

* ``DeepseekSparseAttnBackend.get_indexer_metadata`` (layers/attention/dsa_backend.py:4127-4146) sets
  ``force_unfused_topk`` for decode / idle / target-verify batches whenever ``hisparse_coordinator`` is set, and
  ``DSATopKBackend.topk_transform`` (layers/attention/dsa/dsa_topk_backend.py:109-110) then runs ``topk_func``:
  with the default ``--dsa-topk-backend sgl-kernel`` that is ``sgl_kernel.fast_topk_v2`` (positions; a coarse
  histogram, then radix passes over the candidates of the threshold bin that fit in shared memory: not the exact
  top-k when that bin overflows).
* Without HiSparse (``SGLANG_DSA_FUSE_TOPK`` on, the default), the same decode batch goes to
  ``_topk_transform_v2_paged`` (dsa_topk_backend.py:123-133, 312-380) when the backend is ``sgl-kernel`` and
  ``SGLANG_OPT_USE_TOPK_V2`` is on (both defaults), the transform is PAGED, there are no row starts and no batch
  index list, 0 < k <= 2048 and the lengths, logits and ``real_page_table`` have one row each per query row:
  ``topk_transform_paged_v2(logits, lengths, real_page_table, out, page_size, attn_metadata.topk_v2_plan)`` (the
  JIT kernel of kernels/jit/csrc/deepseek_v4/topk_v2.cuh, exact on its one-block-a-row paths), which returns KV
  locations. Otherwise it runs the older fused kernels (``sgl_kernel.fast_topk_transform_fused``, whose selection
  routine is ``fast_topk_v2``'s; or FlashInfer's page-table transform with ``--dsa-topk-backend flashinfer``).
* The plan (``DSAMetadata.topk_v2_plan``) is built whenever ``should_use_topk_v2()`` holds, with or without HiSparse
  (``_build_topk_v2_plan``, dsa_backend.py:975-989, called at 1417 eagerly and 1791 at graph capture; refreshed in
  place at graph replay, ``_refresh_topk_v2_plan``, 991-1002, called at 2062 and 2152).

HiSparse's coordinator wants positions (``swap_in_selected_pages`` maps them through the request's host table),
and so does ESS's. ``topk_transform_paged_v2`` writes positions when its page table is None (its INDICES mode:
kernels/ops/attention/dsv4/topk.py:209-268, topk_v2.cuh:1229-1333; the selection is the same code in every mode,
only the write of the result differs). So in a decode batch with ESS, where SGLang without ESS would run the v2
kernel, ``select`` runs it with the same logits, lengths, page size and plan and no page table; where SGLang
without ESS would run something else, SGLang's own call runs unchanged (the same selection routine with the
default backend). The indexer tap (indexer_tap.py) calls ``select`` inside its AROUND hook on
``DSAIndexerMetadata.topk_transform``.

The setting: ``EssConfig.decode_topk``: ``"as_without_ess"`` (the above, the default) or ``"hisparse"`` (SGLang's
HiSparse top-k, unchanged).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

import torch

from ess_sglang.config import EssConfig

logger = logging.getLogger("ess_sglang.sglang_plugin")

DECODE_TOPK_AS_WITHOUT_ESS = "as_without_ess"
"""Decode selects with the top-k kernel and plan SGLang runs without ESS (the same entries, as positions)."""
DECODE_TOPK_HISPARSE = "hisparse"
"""Decode selects with SGLang's HiSparse top-k (``fast_topk_v2`` with the default backend), as HiSparse does."""
DECODE_TOPK_MODES = (DECODE_TOPK_AS_WITHOUT_ESS, DECODE_TOPK_HISPARSE)
DECODE_TOPK_DEFAULT = EssConfig.model_fields["decode_topk"].default
"""The decode top-k of an ESS instance whose settings are not known (``EssConfig.decode_topk``'s default)."""

V2_MODULE = "sglang.kernels.ops.attention.dsv4.topk"
V2_FUNCTION = "topk_transform_paged_v2"
V2_PARAMETERS = ("scores", "seq_lens", "page_tables", "out_page_indices", "page_size", "metadata")
"""SGLang 0.5.23's wrapper and its first parameters (checked before the first call): with no page table it writes
positions into ``out_page_indices``."""
V2_FUNCTION_0517 = "topk_transform_512_v2"
V2_PARAMETERS_0517 = V2_PARAMETERS + ("out_raw_indices",)
"""SGLang 0.5.17's wrapper of the same kernel (kernels/ops/attention/dsv4/topk.py:86-115): it needs a page table and
writes the selected positions, -1 padded, into ``out_raw_indices`` beside the page-table transform."""
V2_MAX_TOPK = 2048
"""k of the v2 kernel, as SGLang checks it before routing there (``0 < topk <= 2048``)."""

TRANSFORM_OPTIONAL_ARGS = ("ks", "cu_seqlens_q", "ke_offset", "batch_idx_list", "topk_indices_offset_override")
"""``DSAIndexerMetadata.topk_transform``'s parameters after (logits, topk), in SGLang 0.5.23's order."""

_WARNED: set[str] = set()
_CHECKED: tuple[Any, str | None, Any] | None = None
"""(the wrapper last looked up, why it cannot be used or None, the call that runs it)."""


def mode(config: Any) -> str:
    """The decode top-k of an ESS instance with this EssConfig (``DECODE_TOPK_DEFAULT`` without one)."""
    value = getattr(config, "decode_topk", None) if config is not None else None
    if value is None:
        return DECODE_TOPK_DEFAULT
    if value not in DECODE_TOPK_MODES:
        raise ValueError(f"ess_config.decode_topk must be one of {', '.join(DECODE_TOPK_MODES)}, got {value!r}")
    return value


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning("%s (logged once)", message)


def _lookup(module: Any, name: str, params: tuple[str, ...]) -> tuple[Any, str | None]:
    fn = getattr(module, name)
    try:
        names = tuple(inspect.signature(fn).parameters)[:len(params)]
    except (TypeError, ValueError):
        names = params  # a builtin without a signature: trust the name
    why = None if names == params else f"{V2_MODULE}.{name} takes ({', '.join(names)}), not ({', '.join(params)})"
    return fn, why


def kernel() -> tuple[Any, str | None]:
    """A function ``run(logits, lengths, attn_metadata, out)`` that writes the v2 kernel's positions into `out`,
    and None; or None and why SGLang's v2 kernel cannot be used."""
    global _CHECKED
    try:
        module = importlib.import_module(V2_MODULE)
    except Exception as exc:  # an SGLang build without the JIT kernels, or one that moved them
        return None, f"{V2_MODULE} cannot be imported ({type(exc).__name__}: {exc})"
    fn = getattr(module, V2_FUNCTION, None) or getattr(module, V2_FUNCTION_0517, None)
    if fn is None:
        return None, f"{V2_MODULE} has neither {V2_FUNCTION} nor {V2_FUNCTION_0517}"
    if _CHECKED is None or _CHECKED[0] is not fn:
        if getattr(module, V2_FUNCTION, None) is fn:
            _, why = _lookup(module, V2_FUNCTION, V2_PARAMETERS)

            def run(logits, lengths, attn, out):
                fn(logits, lengths, None, out, attn.page_size, attn.topk_v2_plan)

            run.kernel_name = V2_FUNCTION
        else:
            _, why = _lookup(module, V2_FUNCTION_0517, V2_PARAMETERS_0517)

            def run(logits, lengths, attn, out):
                pages = torch.empty_like(out)  # the page-table transform's output, not used
                fn(logits, lengths.to(torch.int32), attn.real_page_table, pages, attn.page_size, attn.topk_v2_plan,
                   out)

            run.kernel_name = V2_FUNCTION_0517
        _CHECKED = (fn, why, run)
    return (None, _CHECKED[1]) if _CHECKED[1] else (_CHECKED[2], None)


def backend_fuses_topk() -> bool | None:
    """``use_fused_topk`` of the attention backend of the forward in progress: whether SGLang without HiSparse would
    run a fused top-k in decode (``force_unfused_topk = not use_fused_topk`` there); None when it cannot be read."""
    try:
        from sglang.srt.model_executor.forward_context import get_attn_backend, has_forward_context

        if not has_forward_context():
            return None
        value = getattr(get_attn_backend(), "use_fused_topk", None)
    except Exception:
        return None
    return value if isinstance(value, bool) else None


def plain_route(metadata: Any, logits: Any, topk: int, extra: dict, fused: bool) -> str | None:
    """None when SGLang without HiSparse would select this call with ``_topk_transform_v2_paged`` (the conditions of
    ``DSATopKBackend.topk_transform`` with ``force_unfused_topk = not fused``), else what it would run instead."""
    from sglang.srt.environ import envs
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod

    if not envs.SGLANG_DSA_FUSE_TOPK.get() or not fused:
        return "its unfused top-k (SGLANG_DSA_FUSE_TOPK is off)"
    backend = metadata.topk_backend
    if not backend.should_use_topk_v2():
        return (f"the {backend.value} fused top-k (SGLANG_OPT_USE_TOPK_V2 is off)" if backend.is_sgl_kernel()
                else f"the {backend.value} fused top-k (--dsa-topk-backend {backend.value})")
    if metadata.topk_transform_method != TopkTransformMethod.PAGED:
        return "the RAGGED transform"
    if extra.get("ks") is not None or extra.get("batch_idx_list") is not None:
        return "the legacy fused top-k (row starts or a batch index list)"
    if not 0 < topk <= V2_MAX_TOPK:
        return f"the legacy fused top-k (k = {topk})"
    lengths = _lengths(metadata, extra)
    page_table = metadata.attn_metadata.real_page_table
    if not (lengths.shape[0] == logits.shape[0] == page_table.shape[0]):
        return "the legacy fused top-k (lengths, logits and page table differ in rows)"
    return None


def _lengths(metadata: Any, extra: dict) -> Any:
    ke_offset = extra.get("ke_offset")
    return ke_offset if ke_offset is not None else metadata.get_seqlens_expanded()


def _unusable(logits: Any, attn_metadata: Any) -> str | None:
    """What ``_topk_transform_v2_paged`` asserts before its call, as a reason (None when it holds)."""
    plan = getattr(attn_metadata, "topk_v2_plan", None)
    if plan is None or plan.shape[0] != logits.shape[0] + 1:
        return "the forward's topk_v2_plan is missing or not one row per query row + 1"
    if not (logits.dtype == torch.float32 and logits.stride(1) == 1 and logits.stride(0) % 4 == 0):
        return f"the logits are not fp32 with unit and 16-byte aligned strides ({logits.dtype}, {logits.stride()})"
    return None


def select(config: Any, metadata: Any, logits: Any, topk: int, args: tuple, kwargs: dict) -> Any | None:
    """The decode selection of an ESS instance for ``metadata.topk_transform(logits, topk, *args, **kwargs)``: int32
    positions [rows, topk] (-1 padded) from the v2 kernel with SGLang's plan and no page table, where SGLang without
    ESS would run that kernel; None where SGLang's own call must run (``mode`` is ``hisparse``, SGLang without ESS
    would run another top-k, or the kernel or plan is unavailable: then a warning, once per reason)."""
    if mode(config) != DECODE_TOPK_AS_WITHOUT_ESS or not getattr(metadata, "force_unfused_topk", False):
        return None
    fused = backend_fuses_topk()
    if fused is None:
        _warn_once("fused?", "ESS decode top-k: cannot read use_fused_topk of SGLang's attention backend, so not "
                             "known which top-k SGLang without ESS runs; decode selects with SGLang's HiSparse "
                             "top-k, which can select other entries than SGLang without ESS")
        return None
    if len(args) > len(TRANSFORM_OPTIONAL_ARGS):
        _warn_once("args", f"ESS decode top-k: DSAIndexerMetadata.topk_transform was called with {len(args) + 2} "
                           f"positional arguments, more than SGLang 0.5.23 takes; decode selects with SGLang's "
                           f"HiSparse top-k, which can select other entries than SGLang without ESS")
        return None
    extra = dict(zip(TRANSFORM_OPTIONAL_ARGS, args, strict=False))
    extra.update(kwargs)
    try:
        if plain_route(metadata, logits, topk, extra, fused) is not None:
            return None  # SGLang without ESS runs another top-k here: SGLang's own call runs (see startup_line)
        attn = metadata.attn_metadata
        why = _unusable(logits, attn)
    except Exception as exc:  # an SGLang whose metadata differs from 0.5.23's
        why = f"SGLang's top-k metadata is not what 0.5.23 has ({type(exc).__name__}: {exc})"
    run = None
    if why is None:
        run, why = kernel()
    if why is not None:
        _warn_once(why, f"ESS decode top-k: {why}; decode selects with SGLang's HiSparse top-k, which can select "
                        f"other entries than SGLang without ESS")
        return None
    out = logits.new_empty((logits.shape[0], topk), dtype=torch.int32)
    run(logits, _lengths(metadata, extra), attn, out)
    return out


def startup_line(topk_backend: str, config: Any, fused: bool | None = True) -> tuple[bool, str]:
    """(warn, line): which top-k an ESS instance's decode runs with these launch settings, for the start-up log.
    `fused`: the attention backend's ``use_fused_topk`` (None: not readable, then decode falls back, see ``select``)."""
    from sglang.srt.environ import envs
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend

    m = mode(config)
    if m == DECODE_TOPK_HISPARSE:
        return True, ("ESS decode top-k: SGLang's HiSparse top-k (ess decode_topk: hisparse); it can select other "
                      "entries than SGLang without ESS")
    backend = DSATopKBackend(topk_backend)
    if fused is None:
        return True, ("ESS decode top-k: the attention backend's use_fused_topk cannot be read, so decode selects with "
                      "SGLang's HiSparse top-k, which can select other entries than SGLang without ESS")
    if not fused:
        return False, ("ESS decode top-k: SGLang's unfused top-k (the attention backend does not fuse it), as SGLang "
                       "without ESS runs it")
    if not envs.SGLANG_DSA_FUSE_TOPK.get():
        return False, (f"ESS decode top-k: SGLang's unfused {backend.value} top-k (SGLANG_DSA_FUSE_TOPK is off), as "
                       f"SGLang without ESS runs it")
    if not backend.should_use_topk_v2():
        same = "the same selection routine" if backend.is_sgl_kernel() else "not checked to select the same entries"
        return not backend.is_sgl_kernel(), (
            f"ESS decode top-k: SGLang's unfused {backend.value} top-k (positions); SGLang without ESS runs its fused "
            f"{backend.value} top-k ({same})")
    fn, why = kernel()
    if why is not None:
        return True, (f"ESS decode top-k: {why}; decode selects with SGLang's HiSparse top-k, which can select other "
                      f"entries than SGLang without ESS")
    return False, (f"ESS decode top-k: SGLang's top-k v2 kernel ({fn.kernel_name}) with the forward's plan, as "
                   f"positions, as SGLang without ESS selects in decode")


def log_startup(runner: Any, config: Any) -> None:
    """Log, once per process at start-up, which top-k the decode of this ESS instance runs."""
    topk_backend = getattr(getattr(runner, "server_args", None), "dsa_topk_backend", None) or "sgl-kernel"
    attn = getattr(runner, "attn_backend", None)
    fused = getattr(attn, "use_fused_topk", None) if attn is not None else True  # (no backend yet: as configured)
    try:
        warn, line = startup_line(topk_backend, config, fused if isinstance(fused, bool) else None)
    except Exception as exc:
        warn, line = True, f"ESS decode top-k: cannot tell which top-k decode runs ({type(exc).__name__}: {exc})"
    (logger.warning if warn else logger.info)("%s", line)
