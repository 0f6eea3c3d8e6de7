"""The DSA decode seam, driven exactly as the installed SGLang's DeepseekSparseAttnBackend.forward_decode drives it
(0.5.17 and 0.5.23 call it alike; the stand-in requests keep their row, KV length and prefill end where that
version's Req does).

Both runs execute the real ``DeepseekSparseAttnBackend.forward_decode`` (on an instance built without __init__, with
the attributes that method reads), with SGLang's real pools on CPU:

* without ESS: a plain ``DSATokenToKVPool`` holding every latent entry at its logical location; forward_decode
  turns the indexer's top-k positions into locations with SGLang's ``transform_index_page_table_decode`` (its
  Triton kernel, interpreted on CPU) over ``req_to_token[req_pool_indices, :max_seqlen_k]``;
* with ESS: SGLang's ``HiSparseDSATokenToKVPool`` + ``HiSparseTokenToKVPoolAllocator`` + ``ReqToTokenPool`` and
  the ESS coordinator in ``hisparse_coordinator``: forward_decode calls
  ``swap_in_selected_pages(forward_batch.req_pool_indices, forward_batch.seq_lens, topk_indices, layer_id)``.

Each step allocates the new token's location with SGLang's allocator, runs ``map_last_loc_to_buffer`` as
``ScheduleBatch.prepare_for_decode`` does, and stores the token with SGLang's own ``set_mla_kv_buffer`` (fp8
quantisation kernel, interpreted) in both pools. FlashMLA is replaced by the torch reference sparse MLA
(``ess_sglang.reference.dsa.sparse_mla_reference``) in ``_forward_flashmla_kv``; it reads the same tensor FlashMLA
would (``get_key_buffer(layer_id)``) through the same index table. The outputs must be bit-identical at every layer
of every step. Prompts reach ESS the colocated way (prefilled into device slots, staged to host by the coordinator)
or the PD way (written straight into the host pool, as the RDMA transfer does). In the PD run a request finishes
half-way and a new one decodes in its place on the host slots it freed: a hot entry left behind by the finished
request would be read for the new one's and break bit-identity (checked: without the release it breaks at once).
"""

from __future__ import annotations

import types

import pytest
import torch
from sglang_versions import needs_pd_decode, request_fields

from ess_sglang.config import EssConfig
from ess_sglang.formats import pack_latent
from ess_sglang.reference.dsa import sparse_mla_reference
from ess_sglang.sglang_plugin.compat import req_allocated_len, req_row

pytest.importorskip("sglang")  # CI installs sglang==0.5.23; this only guards machines without it

PAGE = 64
LAYERS = 2
HEADS = 8
TOPK = 2048  # FlashMLA's decode kernel requires index_topk wide tables; SGLang's fast transform kernel too
HOT = 10240  # hot slots per layer: one step needs 4 x (2048 + 1) = 8196
WINDOWS = 32


def _layer(layer_id):
    return types.SimpleNamespace(layer_id=layer_id, tp_q_head_num=HEADS, head_dim=576, v_head_dim=512,
                                 scaling=576 ** -0.5, is_cross_attention=False, logit_cap=0.0)


def _backend(pool, coordinator, record):
    """A DeepseekSparseAttnBackend whose forward_decode is SGLang's, with FlashMLA replaced by the reference."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    be = DeepseekSparseAttnBackend.__new__(DeepseekSparseAttnBackend)
    be.dsa_decode_impl = "flashmla_kv"
    be.dsa_index_kpool = 1
    be.dsa_kv_cache_store_fp8 = True
    be.device_sm_major = 9
    be.use_fused_topk = False
    be.token_to_kv_pool = pool
    be.hisparse_coordinator = coordinator

    def flashmla_reference(q_all, kv_cache, sm_scale, v_head_dim, layer, metadata, page_table_1):
        assert page_table_1.dtype == torch.int32 and page_table_1.shape[-1] == TOPK
        entries = kv_cache.view(torch.uint8).view(-1, 656)
        b = q_all.shape[0]
        out, lse = sparse_mla_reference(q_all.view(b, 1, HEADS, 576), entries, page_table_1.view(b, 1, TOPK),
                                        sm_scale)
        record.append(lse)
        return out.view(b, 1, HEADS, 512)

    be._forward_flashmla_kv = flashmla_reference
    return be


class Selections:
    """Top-k positions that drift slowly from step to step, like DSA's (heavy overlap, some churn, recency)."""

    def __init__(self, max_len: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.base = torch.randn((LAYERS, 8, max_len), generator=g)
        self.g = g

    def scores(self, layer: int, lens: list[int]) -> torch.Tensor:
        """Indexer-like logits [B, max(lens)]; past a request's length whatever a kernel left there (noise)."""
        out = torch.randn((len(lens), max(lens)), generator=self.g)
        for b, n in enumerate(lens):
            out[b, :n] = self.base[layer, b, :n] + 0.35 * torch.randn(n, generator=self.g)
            out[b, max(n - 96, 0):n] += 4.0  # the most recent tokens are usually selected
        return out

    @staticmethod
    def select(scores: torch.Tensor, lens: list[int]) -> torch.Tensor:
        rows = []
        for b, n in enumerate(lens):
            k = min(TOPK, n)
            pos = torch.topk(scores[b, :n], k).indices.to(torch.int32)
            rows.append(torch.cat([pos, pos.new_full((TOPK - k,), -1)]))
        return torch.stack(rows)

    def topk(self, layer: int, lens: list[int]) -> torch.Tensor:
        return self.select(self.scores(layer, lens), lens)


def _indexer_through_tap(sel, layer, seq, fb):
    """What SGLang's Indexer._get_topk_paged does in a decode step (logits, then metadata.topk_transform), called
    through the plugin's two hooks as HookRegistry wraps them."""
    from ess_sglang.sglang_plugin import indexer_tap

    metadata = types.SimpleNamespace(force_unfused_topk=True)  # what the DSA backend sets with a HiSparse coordinator

    def topk_transform(meta, logits, topk):
        return sel.select(logits, seq.tolist())

    def get_topk_paged(indexer, forward_batch, layer_id, q_fp8, weights, meta):
        logits = sel.scores(layer_id, seq.tolist())
        return indexer_tap.topk_transform_hook(topk_transform, meta, logits, TOPK)

    return indexer_tap.get_topk_paged_hook(get_topk_paged, None, fb, layer, None, None, metadata)


def _entries(g, n):
    return pack_latent(torch.randn((n, 512), generator=g) * 2, torch.randn((n, 64), generator=g))


def _run(mode: str, steps: int, new_tokens: str = "on_demand", resolve_impl: str = "torch",
         replace_at: int | None = None, level: str = "none", refill_interval: int = 1, retention: str = "lru"):
    """`replace_at` (PD mode): at that step request 1 finishes (ESS releases it, SGLang frees its locations) and a
    new request takes its row and batch entry, its prompt written into the host slots the finished one freed."""
    from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool

    from ess_sglang.sglang_plugin import coordinator as coordinator_mod
    from ess_sglang.sglang_plugin import warmup
    from ess_sglang.sglang_plugin.active import active_coordinator, set_active
    from ess_sglang.sglang_plugin.coordinator import EssCoordinator
    from ess_sglang.sglang_plugin.warmup import rank_window_sets

    lens = [9000, 1500, 12000, 5000]  # one request shorter than top-k: -1 padding
    B = len(lens)
    max_ctx = -(-(max(lens) + steps + 1) // PAGE) * PAGE
    staging = -(-max(lens) // PAGE) * PAGE if mode == "colocated" else 0
    device_tokens = HOT + PAGE + staging
    ratio = 2 if mode == "colocated" else 3
    fp8 = torch.float8_e4m3fn
    kw = dict(page_size=PAGE, kv_lora_rank=512, dtype=fp8, qk_rope_head_dim=64, layer_num=LAYERS, device="cpu",
              index_head_dim=128, enable_memory_saver=False, kv_cache_dim=656)
    ess_pool = HiSparseDSATokenToKVPool(size=device_tokens, host_to_device_ratio=ratio, **kw)
    allocator = HiSparseTokenToKVPoolAllocator(device_tokens, page_size=PAGE, dtype=fp8, device="cpu",
                                               kvcache=ess_pool, need_sort=False, host_to_device_ratio=ratio)
    base_pool = DSATokenToKVPool(size=allocator.size_full, **kw)
    req_pool = ReqToTokenPool(size=B, max_context_len=max_ctx, device="cpu", enable_memory_saver=False)
    config = EssConfig(top_k=TOPK, warmup_windows=WINDOWS, new_tokens=new_tokens, prefetch_overlap_level=level,
                       prefetch_min_batch=B,  # (4 requests here; the default 16 would leave them synchronous)
                       spare_refill_interval=refill_interval, retention=retention)
    coord = EssCoordinator(req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, config=config,
                           hot_slots_per_layer=HOT, host_tokens=allocator.size_full, device="cpu", top_k=TOPK,
                           max_running_requests=B, pin_memory=False, copy_impl="torch", resolve_impl=resolve_impl)
    assert active_coordinator() is coord
    assert coord.staging_capacity == staging
    if resolve_impl == "triton" and coord.overlap.prefetcher is not None:
        coord.overlap.prefetcher.impl = "triton"  # the GPU's candidate and threshold kernels too (interpreted)

    g = torch.Generator().manual_seed(7)
    sel = Selections(max_ctx, seed=11)
    rows = list(range(1, B + 1))  # row 0 is ReqToTokenPool's padding row
    reqs = []

    def admit(i, row, n, rid, max_new):
        req = types.SimpleNamespace(rid=rid, **request_fields(row, n, n), origin_input_ids=[0] * n, output_ids=[],
                                    sampling_params=types.SimpleNamespace(max_new_tokens=max_new),
                                    hisparse_staging=False)
        assert coord.admission.admit(req.rid, n + max_new).decision.value == "admit"
        one = torch.tensor([0])
        if mode == "colocated":  # prefill into device slots with SGLang's allocator, then stage to host
            logical = allocator.alloc_extend(one, one, torch.tensor([n]), torch.tensor([n]), torch.tensor([-1]), n)
        else:  # PD decode: logical locations only; the transfer writes the host pool directly
            logical = allocator.alloc_logical_only(one, one, torch.tensor([n]), torch.tensor([n]),
                                                   torch.tensor([-1]), n)
            host = coord.mem_pool_host.alloc_paged_token_slots(coord.req_to_host_pool,
                                                               coord.req_to_host_pool_allocated_len, row, 0, n)
        req_pool.req_to_token[row, :n] = logical.to(torch.int32)
        windows = []
        for layer in range(LAYERS):
            e = _entries(g, n)
            base_pool.kv_buffer[layer].view(torch.uint8)[logical, 0] = e
            if mode == "colocated":
                ess_pool.kv_buffer[layer].view(torch.uint8)[ess_pool.translate_loc_to_hisparse_device(logical), 0] = e
            else:
                coord.mem_pool_host.kv_buffer[layer][host, 0] = e
            # the prompt's last query windows, as the indexer selected them during prefill (the last chunk)
            win = torch.stack([sel.topk(layer, [n - WINDOWS + w + 1] * B)[i] for w in range(WINDOWS)])
            windows.append(win)
        if mode == "colocated":
            for layer in range(LAYERS):  # the capture hook, called as forward_extend is on the last chunk
                fb = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_extend=lambda: True),
                                           extend_seq_lens_cpu=[WINDOWS],
                                           req_pool_indices_cpu=torch.tensor([row]), req_pool_indices=None)
                warmup.forward_extend_hook(types.SimpleNamespace(use_fused_topk=False), None, None, None,
                                           _layer(layer), fb, topk_indices=windows[layer])
            free_before = allocator.hisparse_attn_allocator.available_size()
            coord.admit_request_into_staging(req)  # its prefill's result processed
            assert coord.holds_row(row) and coord.collect_ready_reqs() == [req]  # SGLang's next decode batch
            assert allocator.hisparse_attn_allocator.available_size() == free_before + -(-n // PAGE) * PAGE  # freed
        else:
            # what the PD transfer hands over (pd_windows): the ranked union for request 0, nothing for 1 and 3 (a
            # prefill without ESS), per-window sets for request 2
            if i == 0:
                req.ess_warmup_ranked = rank_window_sets(windows, n, 2 * TOPK)[0]
            req.ess_window_topk = windows if i == 2 else None
            coord.admit_request_direct(req)
            assert getattr(req, "ess_warmup_ranked", None) is None  # dropped once warmed up
        return req, (None if mode == "colocated" else host)

    for i, (row, n) in enumerate(zip(rows, lens, strict=True)):
        reqs.append(admit(i, row, n, f"r{i}", steps)[0])
    warm = coord.manager.counters[:, 7].clone()  # Counter.WARMUP_ENTRIES
    assert bool((warm > 0).all())
    assert coord.staging_free() == staging

    lse_ref, lse_ess = [], []
    ref = _backend(base_pool, None, lse_ref)
    ess = _backend(ess_pool, coord, lse_ess)
    rpi = torch.tensor(rows, dtype=torch.int64)
    seq = torch.tensor(lens, dtype=torch.int64)
    identical = 0
    previous_rows = None
    for step in range(steps):
        if step == replace_at:  # request 1 finishes; a new one takes its row, on the host slots it freed
            old = reqs[1]
            freed = coord.req_to_host_pool[rows[1], : int(seq[1])].clone()
            coord.request_finished(old)
            allocator.free(req_pool.req_to_token[rows[1], : req_allocated_len(old)].long())
            assert int((coord.manager.loc_to_slot[:, freed] >= 0).sum()) == 0  # nothing of it stays resident
            n_new = 4000
            reqs[1], host_new = admit(1, rows[1], n_new, "r1-next", steps - step)
            assert bool(torch.isin(host_new, freed).any())  # the new prompt lives where the finished one did
            seq = seq.clone()
            seq[1] = n_new
        # ScheduleBatch.prepare_for_decode: allocate, write req_to_token, seq_lens + 1, map_last_loc_to_buffer
        last = req_pool.req_to_token[rpi, seq - 1].long()
        out_loc = allocator.alloc_decode(seq + 1, seq + 1, last)  # as alloc_for_decode: the lengths after
        req_pool.req_to_token[rpi, seq] = out_loc.to(torch.int32)
        for req in reqs:
            req.kv.kv_allocated_len += 1
        seq.add_(1)  # in place: the step's tensors are the same objects every step (as static graph buffers are), so
        # only the step's start can tell the layers' shared rows from the previous step's
        coord.map_last_loc_to_buffer(seq, out_loc, rpi, seq.clone(), rpi.clone())
        coord.num_real_reqs.fill_(B)  # what ModelRunner does before every decode forward
        max_len = int(seq.max())
        meta = types.SimpleNamespace(page_table_1=req_pool.req_to_token[rpi, :max_len],
                                     dsa_cache_seqlens_int32=seq.clamp(max=TOPK).to(torch.int32))
        ref.forward_metadata = ess.forward_metadata = meta
        fb = types.SimpleNamespace(req_pool_indices=rpi, seq_lens=seq, out_cache_loc=out_loc, batch_size=B,
                                   forward_mode=types.SimpleNamespace(is_decode=lambda: True))
        step_ok = True
        shared = []  # the step's per-request tensors each layer saw: computed once a step, by its first hook
        for layer in range(LAYERS):
            lyr = _layer(layer)
            k_nope = torch.randn((B, 1, 512), generator=g).to(torch.bfloat16)
            k_rope = torch.randn((B, 1, 64), generator=g).to(torch.bfloat16)
            base_pool.set_mla_kv_buffer(lyr, out_loc, k_nope, k_rope)
            # lands in the request's new-token slot; through the plugin's hook as HookRegistry wraps the method (the
            # rows translated by the first layer, reused by the others)
            coordinator_mod.set_mla_kv_buffer_hook(HiSparseDSATokenToKVPool.set_mla_kv_buffer, ess_pool, lyr, out_loc,
                                                   k_nope, k_rope)
            # the indexer: through the plugin's tap (ECHO prefetch with level "full"; a pass-through with "none")
            topk = _indexer_through_tap(sel, layer, seq, fb)
            q = torch.randn((B, HEADS * 576), generator=g)
            o_ref = ref.forward_decode(q, None, None, lyr, fb, save_kv_cache=False, topk_indices=topk)
            o_ess = ess.forward_decode(q, None, None, lyr, fb, save_kv_cache=False, topk_indices=topk)
            same = torch.equal(o_ref.view(torch.int32), o_ess.view(torch.int32)) and torch.equal(
                lse_ref[-1].view(torch.int32), lse_ess[-1].view(torch.int32))
            assert same, f"{mode}: step {step} layer {layer} differs"
            step_ok &= same
            shared.append(coord._step_rows)
        assert all(r is shared[0] for r in shared) and shared[0] is not previous_rows, f"step {step}"
        previous_rows = shared[0]
        identical += step_ok
    m = coord.manager
    assert int(m.clock) == steps  # one clock step per decode step (at layer 0's tap when it prefetches, else swap-in)
    live = torch.cat([coord.req_to_host_pool[r, : int(seq[i])] for i, r in enumerate(rows)])
    m.check_invariants(live_locs=live)
    counts = m.counters.sum(0)
    _check_cuda_graph_padding(coord, rpi, seq, sel, B)
    stats = {"misses": int(counts[2]), "evictions": int(counts[8]), "lookups": int(counts[0]),
             "new": int(counts[9]), "written_back": int(counts[4]), "bad": int(counts[5]),
             "overflow": int(counts[6]), "prefetched": int(counts[10]), "useful": int(counts[11]),
             "wasted": int(counts[12]), "spare_slots": m.num_spare, "refill_interval": m.refill_interval,
             "bonus_slots": int((m.slot_stamp[:, :-1] >> 48 > 0).sum())}  # (decayed retention's bonus bits)

    # finishing releases everything: hot slots, host slots, admission, the new-token mapping
    host_free_before = coord.mem_pool_host.available_size()
    for req in reqs:
        coord.request_finished(req)
    assert m.resident_count(0) == 0 and m.resident_count(1) == 0
    assert coord.mem_pool_host.available_size() == coord.mem_pool_host.size
    assert coord.mem_pool_host.available_size() > host_free_before
    assert coord.admission.running == 0 and coord.admission.host_reserved == 0
    mapping = allocator.full_to_hisparse_device_index_mapping
    assert int((mapping[:-1] >= coord.new_token_base).sum()) == 0
    # SGLang's flush_cache clears the allocator: the ESS regions are reserved again, the hot pools emptied
    for req in reqs:
        allocator.free(req_pool.req_to_token[req_row(req), : req_allocated_len(req)].long())
    allocator.clear()
    assert allocator.hisparse_attn_allocator.available_size() == staging
    assert int((m.slot_to_loc >= 0).sum()) == 0
    set_active(None)
    return identical, stats


def _check_cuda_graph_padding(coord, rpi, seq, sel, B):
    """Batch entries past num_real_reqs (CUDA-graph padding: row 0, seq_len 1, whatever top-k the indexer left) are
    not live: no write-back, no lookup, every returned row -1; the real entries beside them are served as usual."""
    m = coord.manager
    coord.num_real_reqs.fill_(0)
    pad_rows, pad_seq = torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64)
    junk = torch.arange(2 * TOPK, dtype=torch.int32).view(2, TOPK)  # positions a padded row must never read
    # twice: the first step's spare-slot refill beside the resolve (two entries' resolve takes the one-page reserve,
    # echo.plan) may evict for itself; the second finds the reserve full, so every change would be the padding's
    assert bool((coord.swap_in_selected_pages(pad_rows, pad_seq, junk, coord.start_layer) == -1).all())
    maps = [t.clone() for t in (m.loc_to_slot, m.slot_to_loc, m.counters)]
    host = coord.mem_pool_host.kv_buffer[0].clone()
    out = coord.swap_in_selected_pages(pad_rows, pad_seq, junk, coord.start_layer)
    assert bool((out == -1).all())
    assert all(torch.equal(a, b) for a, b in zip(maps, (m.loc_to_slot, m.slot_to_loc, m.counters), strict=True))
    assert torch.equal(host, coord.mem_pool_host.kv_buffer[0])
    # B real entries then one padded entry, in the last layer (no new step begins)
    coord.num_real_reqs.fill_(B)
    before = m.counters[LAYERS - 1].clone()
    topk = torch.cat([sel.topk(LAYERS - 1, seq.tolist()), junk[:1]])
    out = coord.swap_in_selected_pages(torch.cat([rpi, pad_rows[:1]]), torch.cat([seq, pad_seq[:1]]), topk,
                                       coord.start_layer + LAYERS - 1)
    delta = m.counters[LAYERS - 1] - before
    assert bool((out[B] == -1).all()) and bool((out[:B] >= 0).any())
    assert int(delta[4]) == B  # Counter.D2H_ENTRIES: one write-back per real request, none for the padding
    assert int(delta[0]) == int((topk[:B] >= 0).sum())  # Counter.LOOKUPS: the real entries' valid positions only


@pytest.mark.parametrize("mode,steps,new_tokens,resolve_impl,replace_at,level", [
    ("colocated", 64, "on_demand", "torch", None, "none"), ("colocated", 16, "insert", "torch", None, "none"),
    # a request finishes at step 8 and a new one decodes on the host slots it freed: nothing stale may be read
    pytest.param("pd", 16, "on_demand", "torch", 8, "none", marks=needs_pd_decode),
    # the GPU's code path (fused resolve, one-launch new-token store; Triton interpreted) through the same seam
    ("colocated", 8, "on_demand", "triton", None, "none"),
    # ECHO prefetch from the indexer tap, with spare slots: still bit-identical, also across a request replaced
    # mid-run (the new token may be prefetched from its stale host row: the write-back at swap-in overwrites the slot)
    ("colocated", 24, "on_demand", "torch", None, "full"),
    pytest.param("pd", 16, "on_demand", "torch", 8, "full", marks=needs_pd_decode),
    ("colocated", 12, "insert", "torch", None, "full"), ("colocated", 6, "on_demand", "triton", None, "full"),
    # the token inserted by the fused resolve itself (Triton interpreted), beside the ECHO prefetch
    ("colocated", 6, "insert", "triton", None, "full")])
def test_decode_seam_bit_identical(mode, steps, new_tokens, resolve_impl, replace_at, level, parallel1):
    identical, stats = _run(mode, steps, new_tokens, resolve_impl, replace_at, level)
    assert identical == steps
    # the run exercised the interesting paths: misses fetched from the host pool, evictions, new tokens
    assert stats["misses"] > stats["written_back"] and stats["evictions"] > 0  # more than re-fetched new tokens
    assert stats["written_back"] == steps * 4 * LAYERS  # every decoded token reached the host pool
    if new_tokens == "on_demand":
        assert stats["new"] == 0
    elif level == "none":
        assert stats["new"] == steps * 4 * LAYERS  # a hot slot of its own
    else:  # except those the prefetch had already given one
        assert 0 < stats["new"] < steps * 4 * LAYERS
    assert stats["overflow"] == 0 and stats["bad"] == 0
    if level == "none":  # no prefetch; one page of spare slots for these small resolves (echo.plan)
        assert stats["prefetched"] == 0 and stats["spare_slots"] == PAGE
    else:  # prefetched entries were selected, every one counted useful or wasted, from spare slots only
        assert stats["spare_slots"] > 0 and stats["useful"] > 0
        assert stats["useful"] + stats["wasted"] == stats["prefetched"]


@pytest.mark.parametrize("resolve_impl", ["torch", "triton"])
def test_decode_seam_bit_identical_with_decayed_retention(resolve_impl, parallel1):
    """retention: decay through the seam (the token inserted, ECHO prefetch): every output stays bit-identical, and
    the manager evicts by decayed count (the stamps of slots selected again carry a bonus)."""
    identical, stats = _run("colocated", 8, "insert", resolve_impl, level="full", retention="decay")
    assert identical == 8 and stats["evictions"] > 0 and stats["bonus_slots"] > 0


def test_decode_seam_bit_identical_with_a_refill_interval(parallel1):
    """spare_refill_interval 3: the manager refills each layer's spare slots every third step (the layers in turn);
    the automatic spare size covers three steps; every output stays bit-identical."""
    identical, stats = _run("colocated", 12, level="full", refill_interval=3)
    assert identical == 12 and stats["refill_interval"] == 3 and stats["spare_slots"] > 0
    assert stats["useful"] > 0 and stats["useful"] + stats["wasted"] == stats["prefetched"]


class _Coord:
    def __init__(self):
        from ess_sglang.sglang_plugin.warmup import WindowCapture

        self.capture, self.start_layer, self.notes = WindowCapture(2, 4), 0, []

    def note_capture_unavailable(self, why):
        self.notes.append(why)


def test_capture_keeps_last_windows_and_skips_compressed_indexer_pool():
    from ess_sglang.sglang_plugin import warmup
    from ess_sglang.sglang_plugin.active import set_active

    coord = _Coord()
    set_active(coord)
    topk = torch.arange(10 * 3, dtype=torch.int32).view(10, 3)  # two requests: 6 and 4 extend tokens
    fb = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_extend=lambda: True), extend_seq_lens_cpu=[6, 4],
                               req_pool_indices_cpu=torch.tensor([3, 5]), req_pool_indices=None)
    warmup.forward_extend_hook(types.SimpleNamespace(use_fused_topk=False), None, None, None, _layer(1), fb,
                               topk_indices=topk)
    got3, got5 = coord.capture.take(3), coord.capture.take(5)
    assert got3[0] is None and torch.equal(got3[1], topk[2:6]) and torch.equal(got5[1], topk[6:10])
    # SGLang's compressed indexer pool appends tail tokens to the top-k rows: nothing captured, noted
    warmup.forward_extend_hook(types.SimpleNamespace(use_fused_topk=False, dsa_index_kpool=4), None, None, None,
                               _layer(0), fb, topk_indices=topk)
    assert coord.capture.take(3) is None and "index_kpool" in coord.notes[0]
    # (fused top-k, RAGGED and PAGED, is turned back into positions: tests/plugin/test_sglang_pd_windows.py)


class _DeviceRows:
    """A request-row tensor on the device: each read back to the host is counted (each one waits for the GPU)."""

    def __init__(self, rows):
        self.rows, self.reads = list(rows), 0

    def tolist(self):
        self.reads += 1
        return list(self.rows)


class _ExtendBatch:
    """What the capture hook reads of an extend ForwardBatch without a host copy of its request rows (SGLang
    0.5.17's has no req_pool_indices_cpu)."""

    def __init__(self, rows, lens):
        self.forward_mode = types.SimpleNamespace(is_extend=lambda: True)
        self.extend_seq_lens_cpu = lens
        self.req_pool_indices = _DeviceRows(rows)


def test_capture_reads_device_request_rows_once_per_forward():
    """Without a host copy of the request rows, the capture reads the device rows back once per forward batch, not
    once per layer, and records what it records with a host copy; a new batch reads its own rows."""
    from ess_sglang.sglang_plugin import warmup
    from ess_sglang.sglang_plugin.active import set_active

    coord = _Coord()
    set_active(coord)
    backend = types.SimpleNamespace(use_fused_topk=False)
    topk = torch.arange(10 * 3, dtype=torch.int32).view(10, 3)  # two requests: 6 and 4 extend tokens
    fb = _ExtendBatch([3, 5], [6, 4])
    for layer in (0, 1):
        warmup.forward_extend_hook(backend, None, None, None, _layer(layer), fb, topk_indices=topk)
    assert fb.req_pool_indices.reads == 1
    got3, got5 = coord.capture.take(3), coord.capture.take(5)
    assert all(torch.equal(w, topk[2:6]) for w in got3) and all(torch.equal(w, topk[6:10]) for w in got5)
    nxt = _ExtendBatch([5], [4])
    warmup.forward_extend_hook(backend, None, None, None, _layer(0), nxt, topk_indices=topk[:4])
    assert nxt.req_pool_indices.reads == 1 and fb.req_pool_indices.reads == 1
    got5 = coord.capture.take(5)
    assert torch.equal(got5[0], topk[:4]) and got5[1] is None
    set_active(None)


def test_kv_write_rows_translated_once_per_forward(parallel1):
    """The plugin's set_mla_kv_buffer hook stores what SGLang's HiSparse pool stores, translating a forward's
    locations in its first layer only: later layers reuse them while the tensor and the mapping are unchanged; a
    changed mapping (the next decode step's) or another tensor translates again, and only the first layer's rows are
    kept for the others."""
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
    from sglang_pools import cpu_coordinator

    from ess_sglang.sglang_plugin.active import set_active
    from ess_sglang.sglang_plugin.coordinator import set_mla_kv_buffer_hook

    layers = 3
    coord, allocator, req_pool = cpu_coordinator(page=PAGE, layers=layers, rows=4, top_k=TOPK, hot=4 * PAGE,
                                                 staging=2 * PAGE, config=EssConfig(top_k=TOPK, warmup_windows=0))
    pool = coord.mem_pool_device
    translated = []
    translate = pool.translate_loc_to_hisparse_device
    pool.translate_loc_to_hisparse_device = lambda loc: translated.append(loc) or translate(loc)
    one = torch.tensor([0])
    loc = allocator.alloc_extend(one, one, torch.tensor([3]), torch.tensor([3]), torch.tensor([-1]), 3)
    g = torch.Generator().manual_seed(3)

    def store(layer, where, through_hook):
        k_nope = torch.randn((where.shape[0], 1, 512), generator=g).to(torch.bfloat16)
        k_rope = torch.randn((where.shape[0], 1, 64), generator=g).to(torch.bfloat16)
        pool.kv_buffer[layer].zero_()
        args = (_layer(coord.start_layer + layer), where, k_nope, k_rope)
        if through_hook:
            set_mla_kv_buffer_hook(HiSparseDSATokenToKVPool.set_mla_kv_buffer, pool, *args)
        else:
            HiSparseDSATokenToKVPool.set_mla_kv_buffer(pool, *args)
        return pool.kv_buffer[layer].clone()

    for layer in range(layers):  # the same bytes in the same rows as SGLang's own method
        state = g.get_state()
        want = store(layer, loc, False)
        g.set_state(state)
        assert torch.equal(store(layer, loc, True), want) and bool(want.view(torch.uint8).any())
    assert len(translated) == layers + 1  # layers x SGLang's own, once through the hook
    translated.clear()
    other = loc[:2].clone()
    store(1, other, True)  # another tensor in a later layer: translated, not kept
    store(2, loc, True)
    assert len(translated) == 1
    allocator.full_to_hisparse_device_index_mapping[loc[:1]] = coord.new_token_base  # the next step's mapping
    store(1, loc, True)
    assert len(translated) == 2
    set_active(None)
