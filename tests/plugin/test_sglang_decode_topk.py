"""The decode top-k of an ESS instance against the installed SGLang's real dispatch: where SGLang without ESS (no
HiSparse coordinator) selects a decode batch with its top-k v2 kernel and plan, ESS selects with the same kernel,
lengths, page size and plan and returns positions (SGLang 0.5.23's ``topk_transform_paged_v2`` without a page table;
0.5.17's ``topk_transform_512_v2`` with the page table SGLang passes, reading the positions from its
``out_raw_indices``); everywhere else SGLang's own call runs. The kernels cannot run on CPU: recording stand-ins take
their place (on SGLang's real kernel module, and as ``sgl_kernel`` / ``flashinfer`` modules, which do not import
without a GPU); every decision is SGLang's own code (``DSAIndexerMetadata.topk_transform``,
``DSATopKBackend.topk_transform``) or the plugin's hooks."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import sys
import types

import pytest

pytest.importorskip("sglang")  # CI installs sglang==0.5.23; this only guards machines without it

import torch  # noqa: E402

from ess_sglang.sglang_plugin import decode_topk as _decode_topk  # noqa: E402

ROWS, WIDTH, TOPK, PAGE = 3, 4096, 2048, 64
INDICES_MODE = hasattr(importlib.import_module(_decode_topk.V2_MODULE), _decode_topk.V2_FUNCTION)
"""SGLang 0.5.23: the v2 wrapper writes positions into its output when given no page table. SGLang 0.5.17 has no
such mode: its wrapper takes the page table and writes the positions into ``out_raw_indices`` too."""
V2 = _decode_topk.V2_FUNCTION if INDICES_MODE else _decode_topk.V2_FUNCTION_0517
"""The installed SGLang's top-k v2 wrapper (``topk_transform_paged_v2`` in 0.5.23, ``topk_transform_512_v2`` in
0.5.17): what SGLang without ESS calls in decode, and what ESS calls."""


class Kernels:
    """Recording stand-ins for every top-k SGLang's DSA decode can call; each returns a fresh int32 [rows, k] (or
    writes nothing into the output it is handed: the routing is under test, not a selection)."""

    def __init__(self, monkeypatch):
        from sglang.kernels.ops.attention.dsv4 import topk as v2

        self.calls: list[tuple[str, dict]] = []
        monkeypatch.setattr(v2, V2, self.paged_v2)
        if hasattr(v2, "topk_transform_ragged_v2"):  # (0.5.23)
            monkeypatch.setattr(v2, "topk_transform_ragged_v2", self.ragged_v2)
        sgl = types.ModuleType("sgl_kernel")
        sgl.fast_topk_v2 = self.fast_topk_v2
        sgl.fast_topk_transform_fused = self.fast_topk_transform_fused
        sgl.fast_topk_transform_ragged_fused = self.fast_topk_transform_ragged_fused
        monkeypatch.setitem(sys.modules, "sgl_kernel", sgl)
        fi = types.ModuleType("flashinfer")
        fi.top_k = self.flashinfer_top_k
        fi.top_k_page_table_transform = self.flashinfer_page_table
        monkeypatch.setitem(sys.modules, "flashinfer", fi)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def paged_v2(self, scores, seq_lens, page_tables, out_page_indices, page_size, metadata, out_raw_indices=None):
        self.calls.append((V2, dict(
            scores=scores, seq_lens=seq_lens, page_tables=page_tables, out=out_page_indices, page_size=page_size,
            metadata=metadata, out_raw_indices=out_raw_indices)))

    def ragged_v2(self, scores, seq_lens, *, out_offsets, out_indices, row_starts=None):
        self.calls.append(("topk_transform_ragged_v2", {}))

    def _rows(self, score, topk):
        return torch.full((score.shape[0], topk), -1, dtype=torch.int32)

    def fast_topk_v2(self, score, lengths, topk, row_starts=None):
        self.calls.append(("fast_topk_v2", dict(score=score, lengths=lengths, row_starts=row_starts)))
        return self._rows(score, topk)

    def fast_topk_transform_fused(self, score, lengths, page_table_size_1, cu_seqlens_q, topk, row_starts=None):
        self.calls.append(("fast_topk_transform_fused", {}))
        return self._rows(score, topk)

    def fast_topk_transform_ragged_fused(self, score, lengths, topk_indices_offset, topk, row_starts=None):
        self.calls.append(("fast_topk_transform_ragged_fused", {}))
        return self._rows(score, topk)

    def flashinfer_top_k(self, x, k, **kwargs):
        self.calls.append(("flashinfer.top_k", {}))
        return torch.topk(x, k)

    def flashinfer_page_table(self, logits, page_table, lengths, topk, **kwargs):
        self.calls.append(("flashinfer.top_k_page_table_transform", {}))
        return self._rows(logits, topk)


@pytest.fixture
def kernels(monkeypatch):
    return Kernels(monkeypatch)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    from ess_sglang.sglang_plugin import decode_topk, indexer_tap

    decode_topk._WARNED.clear()
    indexer_tap._WARNED.clear()
    yield
    decode_topk._WARNED.clear()
    indexer_tap._WARNED.clear()


def _attn(rows=ROWS, page_rows=None, plan=True):
    """The DSAMetadata fields SGLang's top-k dispatch reads, as init_forward_metadata fills them in decode."""
    lens = torch.tensor([WIDTH, 2500, 1000][:rows] + [7] * max(rows - 3, 0), dtype=torch.int32)
    pr = rows if page_rows is None else page_rows
    return types.SimpleNamespace(
        page_size=PAGE, dsa_seqlens_expanded=lens, real_page_table=torch.zeros((pr, WIDTH // PAGE), dtype=torch.int32),
        page_table_1=torch.zeros((pr, WIDTH), dtype=torch.int32),
        cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32), topk_indices_offset=None, token_to_batch_idx=None,
        topk_v2_plan=torch.zeros((rows + 1, 2), dtype=torch.int32) if plan else None)


def _meta(attn, force_unfused, backend="sgl-kernel", method="PAGED"):
    from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend, TopkTransformMethod

    return DSAIndexerMetadata(attn_metadata=attn, topk_transform_method=TopkTransformMethod[method],
                              topk_backend=DSATopKBackend(backend), force_unfused_topk=force_unfused)


def _original_transform():
    from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata

    return inspect.unwrap(DSAIndexerMetadata.topk_transform)  # SGLang's own, hooked or not in this process


def _logits(rows=ROWS):
    return torch.randn((rows, WIDTH), generator=torch.Generator().manual_seed(rows))


class _Coordinator:
    def __init__(self, prefetching=False, config=None, log=None):
        self.prefetching, self.config, self.log = prefetching, config, [] if log is None else log

    def prefetches(self, layer_id, batch_size):
        return self.prefetching

    def prefetch_from_logits(self, layer_id, logits, rpi, lens):
        self.log.append(("prefetch", logits))

    def note_selection(self, layer_id, logits, positions, rpi):
        self.log.append(("note", positions))


def _decode_batch(decode=True, rows=ROWS):
    return types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_decode=lambda: decode), batch_size=rows,
                                 req_pool_indices=torch.arange(rows), seq_lens=torch.full((rows,), 9))


def _through_hooks(meta, logits, topk=TOPK, *, fused=True, coordinator=None, decode=True, extra=()):
    """One decode layer's Indexer._get_topk_paged (logits, then metadata.topk_transform) through the plugin's two
    AROUND hooks, as HookRegistry calls them, inside the forward context SGLang publishes for a forward."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from ess_sglang.sglang_plugin import indexer_tap
    from ess_sglang.sglang_plugin.active import set_active

    original = _original_transform()

    def get_topk_paged(indexer, forward_batch, layer_id, q_fp8, weights, metadata):
        return indexer_tap.topk_transform_hook(original, metadata, logits, topk, *extra)

    coordinator = _Coordinator() if coordinator is None else coordinator
    set_active(coordinator)  # (held weakly: the local keeps it alive)
    backend = types.SimpleNamespace(use_fused_topk=fused)
    try:
        with forward_context(ForwardContext(attn_backend=backend)):
            return indexer_tap.get_topk_paged_hook(get_topk_paged, None, _decode_batch(decode, logits.shape[0]), 7,
                                                   None, None, meta)
    finally:
        set_active(None)


# ------------------------------------------------------------------------------------------------ the problem

def test_with_hisparse_sglang_selects_decode_with_another_kernel(kernels):
    """SGLang's own dispatch: a decode batch without HiSparse goes to the v2 kernel with a page table (locations);
    the same batch with HiSparse's forced unfused top-k goes to sgl_kernel.fast_topk_v2. Without the plugin, an ESS
    instance would select with the second."""
    attn, logits = _attn(), _logits()
    plain = _original_transform()(_meta(attn, force_unfused=False), logits, TOPK)
    hisparse = _original_transform()(_meta(attn, force_unfused=True), logits, TOPK)
    assert kernels.names() == [V2, "fast_topk_v2"]
    assert kernels.calls[0][1]["page_tables"] is attn.real_page_table and plain.shape == (ROWS, TOPK)
    assert hisparse.shape == (ROWS, TOPK)


def test_ess_decode_selects_with_the_kernel_and_plan_of_sglang_without_ess(kernels):
    """Through the hooks, an ESS decode layer calls the v2 kernel with the very tensors SGLang without ESS passes it
    (logits, lengths from the metadata, page size, the forward's plan) and returns the kernel's positions: 0.5.23's
    wrapper without a page table writes them into its output; 0.5.17's gets SGLang's page table and writes them
    into out_raw_indices beside the page-table transform, whose output ESS drops."""
    attn, logits = _attn(), _logits()
    _original_transform()(_meta(attn, force_unfused=False), logits, TOPK)  # SGLang without ESS
    result = _through_hooks(_meta(attn, force_unfused=True), logits)  # ESS (HiSparse coordinator set)
    assert kernels.names() == [V2, V2]
    plain, ess = kernels.calls[0][1], kernels.calls[1][1]
    for name in ("scores", "seq_lens", "metadata"):
        assert ess[name] is plain[name], name
    assert ess["seq_lens"] is attn.dsa_seqlens_expanded and ess["metadata"] is attn.topk_v2_plan
    assert ess["page_size"] == plain["page_size"] == PAGE
    assert plain["page_tables"] is attn.real_page_table and plain["out_raw_indices"] is None
    if INDICES_MODE:
        assert ess["page_tables"] is None and ess["out_raw_indices"] is None
        assert result is ess["out"]
    else:
        assert ess["page_tables"] is attn.real_page_table
        assert result is ess["out_raw_indices"] and ess["out"] is not result and ess["out"].shape == result.shape
    assert result.dtype == torch.int32 and result.shape == (ROWS, TOPK)


def test_prefetch_before_and_note_after_the_ess_selection(kernels, monkeypatch):
    """The ECHO tap still brackets the selection: the logits go to the prefetch before the kernel, the kernel's
    positions to note_selection after it."""
    log = []
    coord = _Coordinator(prefetching=True, log=log)
    real = kernels.paged_v2

    def paged_v2(scores, seq_lens, page_tables, out_page_indices, page_size, metadata, out_raw_indices=None):
        log.append(("kernel", out_page_indices if INDICES_MODE else out_raw_indices))  # where the positions go
        return real(scores, seq_lens, page_tables, out_page_indices, page_size, metadata, out_raw_indices)

    from sglang.kernels.ops.attention.dsv4 import topk as v2

    monkeypatch.setattr(v2, V2, paged_v2)
    logits = _logits()
    result = _through_hooks(_meta(_attn(), force_unfused=True), logits, coordinator=coord)
    assert [name for name, _ in log] == ["prefetch", "kernel", "note"]
    assert log[0][1] is logits and log[1][1] is result and log[2][1] is result


# ------------------------------------------------------------------------- the same decision as SGLang's dispatch

CASES = {  # name: (env, backend, method, attn overrides, extra args, topk, use_fused_topk)
    "defaults": ({}, "sgl-kernel", "PAGED", {}, (), TOPK, True),
    "topk v2 off": ({"SGLANG_OPT_USE_TOPK_V2": "false"}, "sgl-kernel", "PAGED", {}, (), TOPK, True),
    "fusion off": ({"SGLANG_DSA_FUSE_TOPK": "false"}, "sgl-kernel", "PAGED", {}, (), TOPK, False),
    "backend unfused (PD IndexShare)": ({}, "sgl-kernel", "PAGED", {}, (), TOPK, False),
    "flashinfer": ({}, "flashinfer", "PAGED", {}, (), TOPK, True),
    "ragged": ({}, "sgl-kernel", "RAGGED", {"topk_indices_offset": torch.zeros(ROWS, dtype=torch.int32)}, (), TOPK,
               True),
    "page table rows differ": ({}, "sgl-kernel", "PAGED", {"page_rows": ROWS + 1}, (), TOPK, True),
    "row starts": ({}, "sgl-kernel", "PAGED", {}, (torch.zeros(ROWS, dtype=torch.int32),), TOPK, True),
    "k above 2048": ({}, "sgl-kernel", "PAGED", {}, (), 4096, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ess_runs_v2_exactly_where_sglang_without_ess_does(case, kernels, monkeypatch):
    """For each setting, SGLang's own dispatch without HiSparse (force_unfused_topk = not use_fused_topk) is run and
    recorded; the ESS decode layer (through the hooks) runs the v2 kernel without a page table exactly where that
    dispatch ran the v2 kernel, and SGLang's own HiSparse call everywhere else."""
    env, backend, method, overrides, extra, topk, fused = CASES[case]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    overrides = dict(overrides)
    attn = _attn(page_rows=overrides.pop("page_rows", None))
    for k, v in overrides.items():
        setattr(attn, k, v)
    logits = _logits()
    try:
        _original_transform()(_meta(attn, not fused, backend, method), logits, topk, *extra)
    except (RuntimeError, AssertionError):  # (SGLang's legacy kernels refuse some of these shapes themselves)
        kernels.calls.append(("refused", {}))
    plain = kernels.names()
    kernels.calls.clear()
    _original_transform()(_meta(attn, True, backend, method), logits, topk, *extra)  # SGLang with HiSparse
    hisparse = kernels.names()
    kernels.calls.clear()
    _through_hooks(_meta(attn, True, backend, method), logits, topk, fused=fused, extra=extra)
    ess = kernels.calls
    if plain == [V2]:  # the v2 kernel, writing positions (module docstring)
        assert [n for n, _ in ess] == [V2]
        if INDICES_MODE:
            assert ess[0][1]["page_tables"] is None
        else:
            assert ess[0][1]["page_tables"] is attn.real_page_table and ess[0][1]["out_raw_indices"] is not None
    else:
        assert [n for n, _ in ess] == hisparse
    assert (case in ("defaults",)) == (plain == [V2])


# --------------------------------------------------------------------------------------------- pass-through

@pytest.mark.parametrize("why", ["prefill", "no ESS", "decode_topk hisparse", "fused top-k"])
def test_other_paths_pass_through_untouched(why, kernels, caplog):
    """Prefill and verify batches, processes without ESS, an ESS instance set to HiSparse's top-k, and a top-k that
    is not forced unfused run SGLang's own call with its own arguments."""
    from ess_sglang.sglang_plugin import indexer_tap
    from ess_sglang.sglang_plugin.active import set_active

    attn, logits = _attn(), _logits()
    meta = _meta(attn, force_unfused=why != "fused top-k")
    seen = []

    def original(metadata, lg, k, *args, **kwargs):
        seen.append((metadata, lg, k, args, kwargs))
        return "sglang's"

    def get_topk_paged(indexer, forward_batch, layer_id, q_fp8, weights, metadata):
        return indexer_tap.topk_transform_hook(original, metadata, logits, TOPK, ks=None)

    coord = None if why == "no ESS" else _Coordinator(
        config=types.SimpleNamespace(decode_topk="hisparse") if why == "decode_topk hisparse" else None)
    set_active(coord)
    try:
        with caplog.at_level(logging.WARNING, logger="ess_sglang.sglang_plugin"):
            out = indexer_tap.get_topk_paged_hook(get_topk_paged, None, _decode_batch(why != "prefill"), 7, None,
                                                  None, meta)
    finally:
        set_active(None)
    assert out == "sglang's" and seen == [(meta, logits, TOPK, (), {"ks": None})]
    assert kernels.calls == []
    assert ("no ESS top-k there" in caplog.text) == (why == "fused top-k")
    assert indexer_tap.open_tap() is None


def test_only_the_first_top_k_of_a_layer_is_the_decode_selection(kernels):
    """A second top-k inside the same indexer call (none in 0.5.23's decode) is not the layer's selection."""
    from ess_sglang.sglang_plugin import indexer_tap

    logits, original = _logits(), _original_transform()
    meta = _meta(_attn(), force_unfused=True)

    def twice(indexer, forward_batch, layer_id, q_fp8, weights, metadata):
        indexer_tap.topk_transform_hook(original, metadata, logits, TOPK)
        return indexer_tap.topk_transform_hook(original, metadata, logits, TOPK)

    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from ess_sglang.sglang_plugin.active import set_active

    coord = _Coordinator()
    set_active(coord)
    try:
        with forward_context(ForwardContext(attn_backend=types.SimpleNamespace(use_fused_topk=True))):
            indexer_tap.get_topk_paged_hook(twice, None, _decode_batch(), 7, None, None, meta)
    finally:
        set_active(None)
    assert kernels.names() == [V2, "fast_topk_v2"]


# ------------------------------------------------------------------------------------------------- fallbacks

def _module_without_kernel(monkeypatch):
    from sglang.kernels.ops.attention.dsv4 import topk as v2

    monkeypatch.delattr(v2, "topk_transform_paged_v2", raising=False)  # (0.5.23's)
    monkeypatch.delattr(v2, "topk_transform_512_v2", raising=False)  # (0.5.17's)
    assert not hasattr(v2, V2)


def _kernel_with_other_arguments(monkeypatch):
    from sglang.kernels.ops.attention.dsv4 import topk as v2

    monkeypatch.setattr(v2, V2, lambda scores, seq_lens, page_table, out, page_size, plan: None)


FALLBACKS = {
    "no plan": (lambda mp: None, {"plan": False}, True, "topk_v2_plan is missing"),
    "no kernel": (_module_without_kernel, {}, True, "has neither topk_transform_paged_v2"),
    "other signature": (_kernel_with_other_arguments, {}, True, "takes (scores, seq_lens, page_table, out"),
    "no forward context": (lambda mp: None, {}, None, "cannot read use_fused_topk"),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_fallback_to_sglangs_own_top_k_warns_once_naming_why(case, kernels, monkeypatch, caplog):
    """Where SGLang without ESS would run the v2 kernel but ESS cannot (no plan, no kernel, a kernel that takes
    other arguments, no forward context to read use_fused_topk from), SGLang's own HiSparse call runs and one
    warning names why."""
    from ess_sglang.sglang_plugin import indexer_tap
    from ess_sglang.sglang_plugin.active import set_active

    patch, attn_kwargs, fused, message = FALLBACKS[case]
    patch(monkeypatch)
    logits, meta, original = _logits(), _meta(_attn(**attn_kwargs), force_unfused=True), _original_transform()

    def get_topk_paged(indexer, forward_batch, layer_id, q_fp8, weights, metadata):
        return indexer_tap.topk_transform_hook(original, metadata, logits, TOPK)

    with caplog.at_level(logging.WARNING, logger="ess_sglang.sglang_plugin"):
        for _ in range(2):
            if fused is None:  # no forward context published
                coord = _Coordinator()
                set_active(coord)
                try:
                    indexer_tap.get_topk_paged_hook(get_topk_paged, None, _decode_batch(), 7, None, None, meta)
                finally:
                    set_active(None)
            else:
                _through_hooks(meta, logits, fused=fused)
    assert kernels.names() == ["fast_topk_v2", "fast_topk_v2"]  # SGLang's HiSparse call, both times
    warnings = [r.getMessage() for r in caplog.records if "ESS decode top-k" in r.getMessage()]
    assert len(warnings) == 1 and message in warnings[0] and "logged once" in warnings[0]


# ------------------------------------------------------------------------------------------- start-up line

@pytest.mark.parametrize("env,backend,config,warn,words", [
    ({}, "sgl-kernel", None, False, f"top-k v2 kernel ({V2}) with the forward's plan"),
    ({"SGLANG_OPT_USE_TOPK_V2": "0"}, "sgl-kernel", None, False, "the same selection routine"),
    ({"SGLANG_DSA_FUSE_TOPK": "0"}, "sgl-kernel", None, False, "unfused sgl-kernel top-k (SGLANG_DSA_FUSE_TOPK"),
    ({}, "flashinfer", None, True, "not checked to select the same entries"),
    ({}, "sgl-kernel", types.SimpleNamespace(decode_topk="hisparse"), True, "HiSparse top-k"),
])
def test_start_up_line_names_the_decode_top_k(env, backend, config, warn, words, monkeypatch, caplog):
    from ess_sglang.sglang_plugin import decode_topk

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    runner = types.SimpleNamespace(server_args=types.SimpleNamespace(dsa_topk_backend=backend))
    with caplog.at_level(logging.INFO, logger="ess_sglang.sglang_plugin"):
        decode_topk.log_startup(runner, config)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("ESS decode top-k:")]
    assert words in record.getMessage()
    assert record.levelno == (logging.WARNING if warn else logging.INFO)


@pytest.mark.parametrize("attn,warn,words", [
    (types.SimpleNamespace(use_fused_topk=True), False, f"top-k v2 kernel ({V2})"),
    (types.SimpleNamespace(use_fused_topk=False), False, "SGLang's unfused top-k (the attention backend does not fuse"),
    (types.SimpleNamespace(), True, "use_fused_topk cannot be read"),  # e.g. a wrapper that does not forward it
])
def test_start_up_line_follows_the_attention_backend(attn, warn, words, caplog):
    """What `select` decides per forward from the backend's use_fused_topk, the start-up line says too."""
    from ess_sglang.sglang_plugin import decode_topk

    runner = types.SimpleNamespace(server_args=types.SimpleNamespace(dsa_topk_backend="sgl-kernel"), attn_backend=attn)
    with caplog.at_level(logging.INFO, logger="ess_sglang.sglang_plugin"):
        decode_topk.log_startup(runner, None)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("ESS decode top-k:")]
    assert words in record.getMessage()
    assert record.levelno == (logging.WARNING if warn else logging.INFO)


def test_start_up_line_warns_when_the_kernel_is_missing(monkeypatch):
    from ess_sglang.sglang_plugin import decode_topk

    _module_without_kernel(monkeypatch)
    warn, line = decode_topk.startup_line("sgl-kernel", None)
    assert warn and "has neither topk_transform_paged_v2 nor topk_transform_512_v2" in line and "HiSparse top-k" in line
    with pytest.raises(ValueError, match="decode_topk must be one of as_without_ess, hisparse"):
        decode_topk.mode(types.SimpleNamespace(decode_topk="exact"))


# ------------------------------------------------------------------ the installed SGLang's names, as the hooks use them

def _params(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(inspect.unwrap(fn)).parameters)


def test_the_hooks_match_sglangs_real_signatures():
    """Every SGLang name and argument the decode top-k relies on, read from the installed SGLang: an upgrade that
    renames or reorders one of them fails here."""
    from sglang.kernels.ops.attention.dsv4 import topk as v2
    from sglang.srt.environ import envs
    from sglang.srt.layers.attention import dsa_backend
    from sglang.srt.layers.attention.dsa import dsa_topk_backend
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
    from sglang.srt.model_executor import forward_context

    from ess_sglang.sglang_plugin import decode_topk

    # the two hooked methods: the tap reads forward_batch, layer_id (positions 0, 1) and metadata (4) of the first,
    # and binds the second's optional arguments by name and position
    assert _params(Indexer._get_topk_paged) == ("self", "forward_batch", "layer_id", "q_fp8", "weights", "metadata")
    assert _params(DSAIndexerMetadata.topk_transform) == ("self", "logits", "topk",
                                                          *decode_topk.TRANSFORM_OPTIONAL_ARGS)
    fields = {f.name for f in dataclasses.fields(DSAIndexerMetadata)}
    assert {"attn_metadata", "topk_transform_method", "topk_backend", "force_unfused_topk"} <= fields
    assert callable(DSAIndexerMetadata.get_seqlens_expanded)
    assert {"real_page_table", "topk_v2_plan", "page_size", "dsa_seqlens_expanded"} <= {
        f.name for f in dataclasses.fields(dsa_backend.DSAMetadata)}
    # SGLang's dispatch and the kernel it calls in decode without HiSparse
    assert _params(dsa_topk_backend.DSATopKBackend.topk_transform)[-1] == "force_unfused_topk"
    assert _params(dsa_topk_backend._topk_transform_v2_paged) == ("logits", "lengths", "topk", "attn_metadata")
    source = inspect.getsource(dsa_topk_backend._topk_transform_v2_paged)
    sig = inspect.signature(getattr(v2, V2))
    if INDICES_MODE:  # 0.5.23
        assert "topk_transform_paged_v2(logits, lengths, page_table, out, page_size, plan)" in source
        assert tuple(sig.parameters)[:6] == decode_topk.V2_PARAMETERS
        assert "Optional" in str(sig.parameters["page_tables"].annotation)  # None: raw positions (INDICES mode)
    else:  # 0.5.17: the page table is required; the positions come out of the optional out_raw_indices
        assert "topk_transform_512_v2(logits, lengths_i32, page_table, out, page_size, plan)" in source
        assert "lengths_i32 = lengths.to(torch.int32)" in source  # (what the plugin passes too)
        assert tuple(sig.parameters)[:7] == decode_topk.V2_PARAMETERS_0517
        assert "Optional" not in str(sig.parameters["page_tables"].annotation)
        assert "Optional" in str(sig.parameters["out_raw_indices"].annotation)
    run, why = decode_topk.kernel()
    assert why is None and callable(run)
    assert dsa_topk_backend.DSATopKBackend.SGL_KERNEL.should_use_topk_v2() is True  # (defaults)
    assert dsa_topk_backend.TopkTransformMethod.PAGED and envs.SGLANG_DSA_FUSE_TOPK.get() is True
    # where use_fused_topk is read from, and that HiSparse is what forces the unfused top-k in decode
    assert callable(forward_context.get_attn_backend) and callable(forward_context.has_forward_context)
    assert "self.use_fused_topk = " in inspect.getsource(dsa_backend.DeepseekSparseAttnBackend.__init__)
    source = inspect.getsource(dsa_backend.DeepseekSparseAttnBackend.get_indexer_metadata)
    assert "force_unfused = not self.use_fused_topk or (" in source
    assert "self.hisparse_coordinator is not None" in source
    # the plan is built whenever v2 is on, HiSparse or not
    source = inspect.getsource(dsa_backend.DeepseekSparseAttnBackend._build_topk_v2_plan)
    assert "hisparse" not in source and "should_use_topk_v2" in source


def test_the_setting_is_an_ess_config_key():
    import pydantic

    from ess_sglang.config import EssConfig
    from ess_sglang.sglang_plugin import decode_topk

    assert decode_topk.mode(EssConfig()) == decode_topk.DECODE_TOPK_AS_WITHOUT_ESS == decode_topk.DECODE_TOPK_DEFAULT
    assert decode_topk.mode(EssConfig(decode_topk="hisparse")) == decode_topk.DECODE_TOPK_HISPARSE
    assert set(decode_topk.DECODE_TOPK_MODES) == {"as_without_ess", "hisparse"}
    with pytest.raises(pydantic.ValidationError, match="decode_topk"):
        EssConfig(decode_topk="exact")
