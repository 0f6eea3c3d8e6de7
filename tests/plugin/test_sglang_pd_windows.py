"""PD disaggregation: the prefill's query-window top-k sets, captured on the prefill instance, carried by SGLang's
transfer metadata, and used by the decode instance's warm-up (ess_sglang/sglang_plugin/pd_windows.py).

Everything runs against the installed SGLang's own code on CPU (0.5.17 or 0.5.23; ESS refuses a PD decode instance on
0.5.17, so there only the prefill side runs):

* the prefill capture is the BEFORE hook of ``DeepseekSparseAttnBackend.forward_extend``, called with the
  arguments SGLang passes, on a real backend object (its ``get_topk_transform_method`` decides RAGGED / PAGED), in
  the three forms the top-k arrives in: positions (unfused), position + KV offset (fused RAGGED) and KV locations
  made by SGLang's own ``transform_index_page_table_prefill`` kernel (fused PAGED, Triton interpreter; in 0.5.17,
  whose kernel takes k = 2048 only, its torch reference ``transform_index_page_table_prefill_ref``); a prompt is
  prefilled in two chunks, the last one shorter than the window count;
* the metadata is SGLang's ``MetadataBuffers`` (hooked ``__init__``, ``get_buf_infos``, ``set_buf``,
  ``clear_slot``) filled from real ``Req`` objects; the transfer copies every registered buffer pairwise with
  SGLang's ``AuxDataCodec`` (its TCP aux path), the item length of the prefill side, as the transfer engines do;
* the decode side is SGLang's ``DecodeTransferQueue._commit_transfer_to_req`` (hooked) and the ESS coordinator
  over SGLang's HiSparse pools, whose warm-up must load the same positions as colocated warm-up of the same prompt.
"""

from __future__ import annotations

import pickle
import types

import pytest
import torch
from sglang_pools import cpu_coordinator
from sglang_versions import PD_DECODE, needs_pd_decode, resolve, set_extend_end, set_req_row

from ess_sglang.config import EssConfig

pytest.importorskip("sglang")  # CI installs sglang==0.5.23; this only guards machines without it

PAGE = 64
LAYERS = 2
TOPK = 256
WINDOWS = 32
HOT = 1280  # hot slots per layer; 4 request rows -> warm-up budget 320 per request and layer
ROWS = 4
PROMPTS = {1: 700, 2: 900, 3: 200}  # request row -> prompt length; row 3 is short (loaded whole)
CHUNK1 = {1: 680, 2: 880, 3: 200}  # first prefill chunk; rows 1 and 2 end with a 20-token chunk
BUDGET = HOT // ROWS
PD_TARGETS = ("sglang.srt.disaggregation.utils.MetadataBuffers.__init__",
              "sglang.srt.disaggregation.utils.MetadataBuffers.get_buf_infos",
              "sglang.srt.disaggregation.utils.MetadataBuffers.set_buf",
              *(("sglang.srt.disaggregation.utils.MetadataBuffers.clear_slot",) if PD_DECODE else ()),
              "sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req",
              "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_extend")
"""What the window-set transfer hooks (SGLang 0.5.17 has no MetadataBuffers.clear_slot, and no ESS PD decode)."""


# ---------------------------------------------------------------------------------------------- fixtures

@pytest.fixture
def runtime_hooks(loaded_plugins, ess_env):
    """The runtime hooks applied in this process, as enabling ESS does."""
    from ess_sglang.sglang_plugin import active, hooks, pd_windows

    hooks.install_runtime_hooks()
    pd_windows.STATS = pd_windows.PdWindowStats()
    yield loaded_plugins
    active.set_sender(None)
    pd_windows.STATS = pd_windows.PdWindowStats()


@pytest.fixture
def role(monkeypatch):
    """set(role): this process as a PD prefill instance with --enable-ess, a PD decode instance with ESS, or a
    prefill instance without ESS (what SGLang's runtime context and the ServerArgs record would say)."""
    from ess_sglang.sglang_plugin import pd_windows, settings

    config = EssConfig(top_k=TOPK, warmup_windows=WINDOWS)
    monkeypatch.setattr(pd_windows, "_hf_text_config",
                        lambda: types.SimpleNamespace(num_hidden_layers=LAYERS, index_topk=TOPK))

    def set_role(name: str):
        record = types.SimpleNamespace()
        s = {"prefill": settings.EssSettings(False, config, None, send_windows=True),
             "decode": settings.EssSettings(True, config),
             "prefill-without-ess": settings.EssSettings.disabled()}[name]
        settings.store(record, s)
        settings.current(record)
        monkeypatch.setattr(pd_windows, "_disaggregation_mode", lambda: name.split("-")[0])

    return set_role


# ---------------------------------------------------------------------------------------------- the prompts

def _true_topk(n: int, seed: int) -> dict[int, torch.Tensor]:
    """Per layer: [n, TOPK] top-k positions of every query token (causal, -1 padding), only the last 64 filled."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(LAYERS):
        base = torch.randn(n, generator=g)
        rows = torch.full((n, TOPK), -1, dtype=torch.int32)
        for p in range(n - 64, n):
            s = base[:p + 1] + 0.4 * torch.randn(p + 1, generator=g)
            s[max(p - 48, 0):] += 3.0  # recent tokens are usually selected
            k = min(TOPK, p + 1)
            rows[p, :k] = torch.topk(s, k).indices.to(torch.int32)
        out[layer] = rows
    return out


def _windows(selections: dict[int, torch.Tensor], n: int) -> list[torch.Tensor]:
    return [selections[layer][n - WINDOWS:] for layer in range(LAYERS)]


class _Prompts:
    def __init__(self):
        self.sel = {row: _true_topk(n, seed=row) for row, n in PROMPTS.items()}
        # KV locations of each prompt on the prefill instance (a permutation, as a page table row would hold)
        g = torch.Generator().manual_seed(99)
        self.locs = {row: (torch.randperm(4096, generator=g)[:n] + 64).to(torch.int32) for row, n in PROMPTS.items()}


def _backend(fused: bool, prefill_impl: str, metadata):
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    be = DeepseekSparseAttnBackend.__new__(DeepseekSparseAttnBackend)
    be.use_fused_topk = fused
    be.dsa_kv_cache_store_fp8 = True
    be.dsa_prefill_impl = prefill_impl  # flashmla_sparse: RAGGED on EXTEND batches; flashmla_kv: PAGED
    be.dsa_index_kpool = 1
    be.forward_metadata = metadata
    return be


def _layer(layer_id):
    return types.SimpleNamespace(layer_id=layer_id)


def _extend(prompts: _Prompts, batch: list[tuple[int, int, int]], fused: bool, prefill_impl: str):
    """Run the capture hook for one extend batch [(row, start, end)] at every layer, with the top-k in the form
    SGLang's backend receives it."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from ess_sglang.sglang_plugin import warmup

    lens = [e - s for _, s, e in batch]
    seq = [e for _, _, e in batch]
    rows = [r for r, _, _ in batch]
    page_table = torch.zeros((len(batch), max(seq)), dtype=torch.int32)
    for b, (row, _, end) in enumerate(batch):
        page_table[b, :end] = prompts.locs[row][:end]
    cu_k = torch.tensor([0] + seq, dtype=torch.int64).cumsum(0)
    metadata = types.SimpleNamespace(page_table_1=page_table,
                                     topk_indices_offset=torch.repeat_interleave(cu_k[:-1], torch.tensor(lens)))
    be = _backend(fused, prefill_impl, metadata)
    fb = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, extend_seq_lens_cpu=lens,
                               seq_lens_cpu=torch.tensor(seq), req_pool_indices_cpu=torch.tensor(rows),
                               req_pool_indices=None)
    method = be.get_topk_transform_method(ForwardMode.EXTEND).name if fused else "POSITIONS"
    for layer in range(LAYERS):
        pos = torch.cat([prompts.sel[row][layer][s:e] for row, s, e in batch])
        if method == "RAGGED":  # the fused kernel adds each request's offset in the concatenated KV
            topk = torch.where(pos >= 0, pos + metadata.topk_indices_offset.view(-1, 1).to(torch.int32), -1)
        elif method == "PAGED":  # the fused kernel returns page_table_1[request, position]: SGLang's transform
            topk = _sglang_prefill_transform(page_table, pos, lens)
        else:
            topk = pos
        warmup.forward_extend_hook(be, None, None, None, _layer(layer), fb, topk_indices=topk)
    return method


def _sglang_prefill_transform(page_table, pos, lens):
    """SGLang's prefill page-table transform: its Triton kernel in 0.5.23 (any k); in 0.5.17 the kernel takes k = 2048
    only (keyword arguments), and its torch reference any k."""
    from sglang.kernels.ops.attention.dsa import transform_index as ti

    if hasattr(ti, "transform_index_page_table_prefill_ref") and pos.shape[1] != 2048:  # (0.5.17)
        return ti.transform_index_page_table_prefill_ref(page_table=page_table, topk_indices=pos,
                                                         extend_lens_cpu=lens, page_size=1)
    return ti.transform_index_page_table_prefill(page_table=page_table, topk_indices=pos, extend_lens_cpu=lens,
                                                 page_size=1)


def _prefill_all(prompts: _Prompts, fused: bool) -> list[str]:
    """Chunk 1 of every prompt in one batch (RAGGED when fused), then the final chunks (PAGED when fused)."""
    m1 = _extend(prompts, [(r, 0, CHUNK1[r]) for r in PROMPTS], fused, "flashmla_sparse")
    rest = [(r, CHUNK1[r], PROMPTS[r]) for r in PROMPTS if CHUNK1[r] < PROMPTS[r]]
    m2 = _extend(prompts, rest, fused, "flashmla_kv")
    return [m1, m2]


# ---------------------------------------------------------------------------------------------- SGLang objects

def _metadata_buffers():
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(8, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=16)


def _req(row: int, room: int, host: str):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    r = Req(f"r{row}", "", [7] * PROMPTS[row], SamplingParams(max_new_tokens=16), bootstrap_room=room,
            bootstrap_host=host)
    set_req_row(r, row)
    return r


def _transfer(src, src_idx: int, dst, dst_idx: int) -> None:
    """What the transfer engine does with the metadata of one request (mooncake's TCP aux path, which shares the
    RDMA path's rule): buffer i of the prefill to buffer i of the decode, for the shorter list, the prefill's item
    length, with SGLang's AuxDataCodec."""
    from sglang.srt.disaggregation.common.utils import AuxDataCodec

    sp, _, si = src.get_buf_infos()
    dp, _, di = dst.get_buf_infos()
    kv_args = types.SimpleNamespace(aux_data_ptrs=dp, aux_item_lens=di)
    for i in range(min(len(sp), len(dp))):
        data = AuxDataCodec.serialize_data_from_buffer(sp[i] + si[i] * src_idx, si[i])
        AuxDataCodec.deserialize_data_to_buffer(kv_args, i, dst_idx, data)


def _transfer_queue(buffers):
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    q = DecodeTransferQueue.__new__(DecodeTransferQueue)
    q.metadata_buffers = buffers
    q.spec_algorithm = SpeculativeAlgorithm.NONE
    q.scheduler = types.SimpleNamespace(
        kv_checksum_computer=None,
        batch_result_processor=types.SimpleNamespace(_maybe_update_reasoning_tokens=lambda req, token: None))
    return q


def _commit(queue, req, idx: int) -> None:
    from sglang.srt.disaggregation.decode import DecodeRequest

    queue._commit_transfer_to_req(DecodeRequest(req=req, kv_receiver=types.SimpleNamespace(clear=lambda: None),
                                                metadata_buffer_index=idx))


def _coordinator(mode: str):
    """An ESS coordinator over SGLang's HiSparse pools (CPU), as the decode seam test builds it."""
    staging = -(-max(PROMPTS.values()) // PAGE) * PAGE * len(PROMPTS) if mode == "colocated" else 0
    coord, allocator, req_pool = cpu_coordinator(page=PAGE, layers=LAYERS, rows=ROWS, top_k=TOPK, hot=HOT,
                                                 staging=staging, config=EssConfig(top_k=TOPK, warmup_windows=WINDOWS))
    assert coord.warmup_budget(10 ** 6) == BUDGET
    return coord, allocator, req_pool


def _admit(coord, allocator, req_pool, mode: str, req) -> None:
    from ess_sglang.sglang_plugin.compat import req_row

    row, n = req_row(req), len(req.origin_input_ids)
    one = torch.tensor([0])
    if mode == "colocated":  # prefilled into device slots, then staged to host by the coordinator
        logical = allocator.alloc_extend(one, one, torch.tensor([n]), torch.tensor([n]), torch.tensor([-1]), n)
        req_pool.req_to_token[row, :n] = logical.to(torch.int32)
        set_extend_end(req, n)
        coord.admit_request_into_staging(req)
        assert coord.collect_ready_reqs() == [req] and coord.holds_row(row)
    else:  # PD: the transfer wrote the host pool directly
        logical = allocator.alloc_logical_only(one, one, torch.tensor([n]), torch.tensor([n]), torch.tensor([-1]), n)
        req_pool.req_to_token[row, :n] = logical.to(torch.int32)
        coord.mem_pool_host.alloc_paged_token_slots(coord.req_to_host_pool, coord.req_to_host_pool_allocated_len,
                                                    row, 0, n)
        req.kv.kv_allocated_len = n
        coord.admit_request_direct(req)


def _resident_positions(coord, row: int, n: int, layer: int) -> torch.Tensor:
    """Positions of request `row` whose latent entry is in the layer's hot pool."""
    locs = coord.req_to_host_pool[row, :n]
    return torch.nonzero(coord.manager.loc_to_slot[layer, locs] >= 0).view(-1)


# ---------------------------------------------------------------------------------------------- tests

def test_pd_hooks_wrap_the_real_targets(runtime_hooks, role, monkeypatch):
    from ess_sglang.sglang_plugin import compat, hooks

    specs = {s.target: s for s in hooks.all_hooks()}
    assert {s.target for s in hooks.pd_hooks()} == set(PD_TARGETS)
    for target in PD_TARGETS:
        current = compat.resolve_target(target)
        assert current.__wrapped__ is runtime_hooks[target], target
        assert compat.hook_is_applied(specs[target]), target
    # a target missing from SGLang refuses ESS at load time, naming it
    gone = compat.HookSpec("sglang.srt.disaggregation.utils.MetadataBuffers.set_buf_v2", "after", print, "t")
    assert "MetadataBuffers.set_buf_v2" in compat.check_targets([gone], "0.5.23")[0]
    # a hook SGLang failed to apply (it only logs that) refuses the window-set buffer, naming the target
    unapplied = compat.HookSpec("sglang.srt.disaggregation.utils.MetadataBuffers.get_buf", "after", print, "t")
    monkeypatch.setattr(hooks, "pd_hooks", lambda version=None, _orig=hooks.pd_hooks: _orig(version) + (unapplied,))
    role("decode" if PD_DECODE else "prefill")
    with pytest.raises(compat.EssUnavailableError, match=r"MetadataBuffers\.get_buf did not apply"):
        _metadata_buffers()


ROOMS = {1: (1 << 62) + 12345, 2: 987654321, 3: (1 << 40) + 7}
P_IDX = {1: 0, 2: 5, 3: 2}  # each request's metadata slot on the prefill instance


def _prefill_instance_sends(role, prompts: _Prompts, fused: bool):
    """The prefill instance with --enable-ess: its metadata buffers, the capture of every prompt's prefill, and
    SGLang's set_buf for each request (the ESS hook writes its slot). Returns the metadata buffers."""
    from ess_sglang.sglang_plugin import active, pd_windows

    layout = pd_windows.WireLayout(LAYERS, 2 * TOPK)
    role("prefill")
    mb_p = _metadata_buffers()
    sender = active.active_sender()
    assert sender is not None and mb_p.ess_sender is sender and mb_p.ess_windows.shape == (8, layout.row_ints)
    methods = _prefill_all(prompts, fused)
    assert methods == (["RAGGED", "PAGED"] if fused else ["POSITIONS", "POSITIONS"])
    for row in PROMPTS:
        req = _req(row, ROOMS[row], "10.0.0.1")
        req.metadata_buffer_index = P_IDX[row]
        req.output_ids.append(1000 + row)
        mb_p.set_buf(req)  # SGLang's set_buf (+ the ESS hook), as _send_kv_chunk calls it on the last chunk
    assert sender.capture.nbytes == 0  # taken when sent
    assert pd_windows.STATS.sent == 2 and pd_windows.STATS.unsent == 0
    return mb_p


@pytest.mark.parametrize("fused", [True, False], ids=["fused-topk", "unfused-topk"])
def test_prefill_writes_each_requests_ranked_window_sets_into_its_metadata_slot(runtime_hooks, role, fused,
                                                                               parallel1):
    """The prefill side alone (what a prefill instance with --enable-ess runs on every supported SGLang): each
    request's metadata slot holds the ranked union of the windows the prefill's indexer selected, for its
    bootstrap_room and prompt length; a short prompt's slot says it is loaded whole; SGLang's own metadata is
    written beside it."""
    from ess_sglang.sglang_plugin import pd_windows
    from ess_sglang.sglang_plugin.warmup import rank_window_sets

    prompts = _Prompts()
    mb_p = _prefill_instance_sends(role, prompts, fused)
    layout = mb_p.ess_layout
    for row in (1, 2):
        n = PROMPTS[row]
        ranked, union, truncated = pd_windows.decode_row(mb_p.ess_windows[P_IDX[row]], layout, room=ROOMS[row],
                                                         seq_len=n)
        expected, expected_union = rank_window_sets(_windows(prompts.sel[row], n), n, layout.cap)
        assert torch.equal(ranked, expected) and torch.equal(union, expected_union), row
        assert truncated == int((expected_union > layout.cap).sum())
        assert int(mb_p.output_ids[P_IDX[row]][0]) == 1000 + row  # SGLang's own field of the same slot
    ranked, union, truncated = pd_windows.decode_row(mb_p.ess_windows[P_IDX[3]], layout, room=ROOMS[3],
                                                     seq_len=PROMPTS[3])
    assert ranked is None and int(union.sum()) == 0 and truncated == 0  # short prompt: loaded whole
    assert "another request" in pd_windows.decode_row(mb_p.ess_windows[P_IDX[1]], layout, room=ROOMS[2],
                                                      seq_len=PROMPTS[1])
    unused = next(i for i in range(8) if i not in P_IDX.values())
    assert "no window sets" in pd_windows.decode_row(mb_p.ess_windows[unused], layout, room=0, seq_len=1)


@needs_pd_decode
@pytest.mark.parametrize("fused", [True, False], ids=["fused-topk", "unfused-topk"])
def test_window_sets_round_trip_through_sglang_metadata(runtime_hooks, role, fused, parallel1):
    """Prefill capture -> MetadataBuffers slot -> transfer -> decode commit gives the decode side exactly the ranked
    union of the windows the prefill's indexer selected; the PD warm-up then loads the same positions as colocated
    warm-up of the same prompt, which are the positions ess_sglang.warmup.warmup_positions chooses."""
    from ess_sglang.sglang_plugin import pd_windows
    from ess_sglang.sglang_plugin.active import set_active
    from ess_sglang.sglang_plugin.warmup import rank_window_sets
    from ess_sglang.warmup import warmup_positions

    prompts = _Prompts()
    layout = pd_windows.WireLayout(LAYERS, 2 * TOPK)
    rooms, p_idx, d_idx = ROOMS, P_IDX, {1: 3, 2: 1, 3: 6}

    # ---- prefill instance
    mb_p = _prefill_instance_sends(role, prompts, fused)

    # ---- decode instance: its metadata buffers, the transfer, SGLang's commit
    role("decode")
    mb_d = _metadata_buffers()
    pp, _, pi = mb_p.get_buf_infos()
    dp, _, di = mb_d.get_buf_infos()
    assert len(pp) == len(dp) and pi == di and pi[-1] == layout.row_bytes == mb_d.ess_windows[0].nbytes
    assert dp[-1] == mb_d.ess_windows.data_ptr()  # the ESS buffer is the last one
    queue = _transfer_queue(mb_d)
    dreqs = {}
    for row in PROMPTS:
        _transfer(mb_p, p_idx[row], mb_d, d_idx[row])
        dreqs[row] = _req(row, rooms[row], "10.0.0.1")
        _commit(queue, dreqs[row], d_idx[row])
        assert list(dreqs[row].output_ids) == [1000 + row]  # SGLang's own metadata made the trip too
    truncated = 0
    for row in (1, 2):
        n = PROMPTS[row]
        expected, union = rank_window_sets(_windows(prompts.sel[row], n), n, layout.cap)
        assert torch.equal(dreqs[row].ess_warmup_ranked, expected), row
        assert bool((union > BUDGET).all())  # the windows' union exceeds the budget: votes decide
        truncated += int((union > layout.cap).sum())
    assert dreqs[3].ess_warmup_ranked is None  # short prompt: loaded whole, no sets needed
    assert pd_windows.STATS.received == 3 and pd_windows.STATS.missing == 0
    # unions beyond cap (2 x top-k) were truncated by priority, and counted on both sides
    assert truncated > 0 and pd_windows.STATS.truncated_layers == 2 * truncated
    # a freed slot no longer validates for the next request that gets it (SGLang clears its own fields too)
    mb_d.clear_slot(d_idx[1])
    assert int(mb_d.ess_windows[d_idx[1], :pd_windows.HEADER_INTS].abs().sum()) == 0
    reason = pd_windows.decode_row(mb_d.ess_windows[d_idx[1]], layout, room=rooms[1], seq_len=PROMPTS[1])
    assert isinstance(reason, str) and "no window sets" in reason
    # a slot that belongs to another request, or to another prompt length, is refused
    assert "another request" in pd_windows.decode_row(mb_d.ess_windows[d_idx[2]], layout, room=rooms[1],
                                                      seq_len=PROMPTS[2])
    assert "prompt" in pd_windows.decode_row(mb_d.ess_windows[d_idx[2]], layout, room=rooms[2], seq_len=5)

    # ---- warm-up: PD decode (the received sets) against colocated (the same prompts prefilled locally)
    pd, pd_alloc, pd_pool = _coordinator("pd")
    for row in PROMPTS:
        _admit(pd, pd_alloc, pd_pool, "pd", dreqs[row])
        assert getattr(dreqs[row], "ess_warmup_ranked", None) is None  # not kept while decoding
    set_active(None)
    colo, co_alloc, co_pool = _coordinator("colocated")
    _prefill_all(prompts, fused)  # the capture hook now feeds the coordinator (the active capture sink)
    for row in PROMPTS:
        _admit(colo, co_alloc, co_pool, "colocated", _req(row, None, None))
    for row, n in PROMPTS.items():
        for layer in range(LAYERS):
            ref = warmup_positions(n, min(n, BUDGET), prompts.sel[row][layer][n - WINDOWS:])
            got_pd = _resident_positions(pd, row, n, layer)
            got_colo = _resident_positions(colo, row, n, layer)
            assert torch.equal(got_pd, got_colo), (row, layer)
            assert torch.equal(got_pd, ref), (row, layer)
            if n > BUDGET:  # not simply the most recent tokens
                assert not torch.equal(got_pd, torch.arange(n - BUDGET, n))
    set_active(None)


@needs_pd_decode
def test_prefill_without_ess_sends_nothing_and_decode_warms_up_recent(runtime_hooks, role, parallel1, caplog):
    """A prefill instance without ESS registers SGLang's buffers only: the ESS slot is not transferred, the decode
    side falls back to the most recent tokens and says so once."""
    from ess_sglang.sglang_plugin import active, pd_windows
    from ess_sglang.sglang_plugin.active import set_active

    role("prefill-without-ess")
    mb_p = _metadata_buffers()
    assert getattr(mb_p, "ess_windows", None) is None and active.active_sender() is None
    role("decode")
    mb_d = _metadata_buffers()
    assert len(mb_d.get_buf_infos()[0]) == len(mb_p.get_buf_infos()[0]) + 1
    queue = _transfer_queue(mb_d)
    pd, alloc, pool = _coordinator("pd")
    caplog.set_level("WARNING", logger="ess_sglang.sglang_plugin")
    for i, row in enumerate((1, 2)):
        req = _req(row, 4242 + row, "10.0.0.1")
        req.metadata_buffer_index = i
        req.output_ids.append(5)
        mb_p.set_buf(req)
        _transfer(mb_p, i, mb_d, i + 4)
        dreq = _req(row, 4242 + row, "10.0.0.1")
        _commit(queue, dreq, i + 4)
        assert list(dreq.output_ids) == [5] and getattr(dreq, "ess_warmup_ranked", None) is None
        _admit(pd, alloc, pool, "pd", dreq)
        n = PROMPTS[row]
        for layer in range(LAYERS):
            assert torch.equal(_resident_positions(pd, row, n, layer), torch.arange(n - BUDGET, n))
    assert pd_windows.STATS.missing == 2
    notes = [r.getMessage() for r in caplog.records if "carries no window sets" in r.getMessage()]
    assert len(notes) == 1 and "--enable-ess" in notes[0]
    set_active(None)


def test_window_capture_rules():
    """Continuation of a short last chunk, stale captures, short prompts and the byte bound."""
    from ess_sglang.sglang_plugin.warmup import WindowCapture

    c = WindowCapture(2, 4, min_seq_len=10)
    a = torch.arange(24, dtype=torch.int32).view(6, 4)
    c.record(1, 0, a, seq_end=20)
    c.record(1, 0, a[:2] + 100, seq_end=22)  # a 2-token chunk right after: completed with the previous 2 rows
    assert torch.equal(c.take(1, seq_len=22)[0], torch.cat([a[4:6], a[:2] + 100]))
    c.record(1, 0, a, seq_end=20)
    c.record(1, 0, a[:2] + 100, seq_end=30)  # not contiguous: replaced
    got = c.take(1, seq_len=30)
    assert torch.equal(got[0], a[:2] + 100) and got[1] is None
    c.record(2, 0, a, seq_end=20)
    assert c.take(2, seq_len=25) is None  # ends elsewhere: an earlier request's windows
    c.record(3, 0, a, seq_end=10)  # short prompt: not recorded
    assert c.take(3) is None
    small = WindowCapture(2, 4, max_bytes=2 * 4 * 4 * 4)  # one row's worth
    small.record(1, 0, a, seq_end=20)
    small.record(2, 0, a, seq_end=20)
    assert small.take(2) is None and small.skipped_rows == 1 and small.take(1) is not None


def test_prefill_instance_with_enable_ess(loaded_plugins, ess_env, deepseek_dir, llama_dir, model_argv):
    """--enable-ess on a PD prefill instance: ESS stays off (no HiSparse, radix cache kept), the window sender is
    on, the KV dtype is the decode's; pipeline parallelism and non-DSA models are refused."""
    from sglang.srt.server_args import prepare_server_args

    from ess_sglang.sglang_plugin import settings
    from ess_sglang.sglang_plugin.compat import EssLaunchError

    sa = prepare_server_args([*model_argv, "--disaggregation-mode", "prefill", "--enable-ess"])
    s = settings.read(pickle.loads(pickle.dumps(sa)))  # what the scheduler processes read
    assert s.send_windows and not s.enabled and s.config.warmup_windows == WINDOWS
    assert not sa.enable_hisparse and not sa.disable_radix_cache and sa.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(EssLaunchError, match="--pp-size 2"):
        prepare_server_args(["--model-path", "/nonexistent", "--disaggregation-mode", "prefill", "--enable-ess",
                             "--pp-size", "2"])
    with pytest.raises(EssLaunchError, match="use --kv-cache-dtype fp8_e4m3"):
        prepare_server_args(["--model-path", "/nonexistent", "--disaggregation-mode", "prefill", "--enable-ess",
                             "--kv-cache-dtype", "bfloat16"])
    for model, ok in ((deepseek_dir, True), (llama_dir, False)):
        sa = prepare_server_args(["--model-path", model, "--device", "cpu", "--skip-tokenizer-init",
                                  "--attention-backend", "dsa", "--disaggregation-mode", "prefill", "--enable-ess"])
        resolve(sa)
        if ok:
            sa.check_server_args()
        else:
            with pytest.raises(EssLaunchError, match="does not use DeepSeek Sparse Attention"):
                sa.check_server_args()
