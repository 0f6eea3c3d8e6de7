"""The decode-layer stack in every overlap mode against the all-in-HBM stack (CPU: torch references, no streams)."""

import contextlib

import numpy as np
import pytest
import torch

from ess_sglang.cache_manager import Counter, HotPoolCacheManager
from ess_sglang.decode_stack import (
    DecodeBatch,
    EssDecodeStack,
    HbmDecodeStack,
    LayerInputs,
    StackOptions,
    chunk_bounds,
    latent_store_rows,
    segment_bounds,
    topk_with_scores,
)
from ess_sglang.formats import INDEXER_ENTRY_BYTES, pack_indexer_key, pack_latent
from ess_sglang.host_pool import HostTotalPool
from ess_sglang.prefetch import EchoPrefetcher
from ess_sglang.request_table import RequestTable
from ess_sglang.streams import SideStream

LAYERS, HEADS, IHEADS, TOPK = 2, 8, 4, 128
LENGTHS = (700, 450, 900)


def build(modes, slots=512, prefetch=False, cap_fraction=0.1, seed=0,
          resolve_impl="torch", dba_attention="split", dba_split=0.5, spare=0, **options):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS) + 64 * len(LENGTHS)
    host = HostTotalPool(LAYERS, T, device="cpu")
    table = RequestTable(len(LENGTHS), max(LENGTHS) + 64)
    rows, locs = [], []
    for n in LENGTHS:
        r = table.alloc_row()
        loc = host.alloc(n + 32)
        table.set(r, 0, loc)
        rows.append(r)
        locs.append(loc)
    rows_t = torch.tensor(rows)
    # context: random latents (host pool and HBM store alike) and indexer keys with some structure
    latents = torch.zeros((LAYERS, latent_store_rows(T), 656), dtype=torch.uint8)
    index_cache = torch.zeros((LAYERS, T, INDEXER_ENTRY_BYTES), dtype=torch.uint8)
    for layer in range(LAYERS):
        ent = pack_latent(torch.randn(T, 512, generator=g), torch.randn(T, 64, generator=g))
        host.entries[layer] = ent
        latents[layer, :T] = ent
        index_cache[layer] = pack_indexer_key(torch.randn(T, 128, generator=g))
    m = HotPoolCacheManager(host, slots, device="cpu", max_selected=len(LENGTHS) * TOPK, resolve_impl=resolve_impl,
                            copy_impl="triton" if resolve_impl == "triton" else "auto", spare_slots=spare)
    opts = StackOptions(modes=modes, top_k=TOPK, prefetch=prefetch, indexer="torch",
                        dba_attention=dba_attention, dba_split=dba_split, **options)
    pf = EchoPrefetcher(LAYERS, table.req_to_token.shape[0], max(LENGTHS) + 64, cap_fraction=cap_fraction,
                        cap_min_tokens=8) if prefetch or any(options.get("prefetch_layers") or ()) else None
    width = table.req_to_token.shape[1]
    ess = EssDecodeStack(m, index_cache.clone(), width, opts, max_batch=len(LENGTHS), prefetcher=pf)
    # the all-HBM stack attends as the ESS stack's DBA does: CPU attention over a whole batch and over its chunks may
    # round differently (it does with torch 2.14.1)
    hbm = HbmDecodeStack(latents, index_cache.clone(), width,
                         StackOptions(modes=modes, top_k=TOPK, indexer="torch", dba_split=dba_split),
                         split_attention=dba_attention == "split")
    return ess, hbm, table, rows_t, locs


def steps(n, table, rows, locs, seed=1):
    """Per step: the batch tables and per-layer inputs; the indexer query drifts slowly, so selections overlap."""
    g = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    base = [torch.randn(B, 1, IHEADS, 128, generator=g) for _ in range(LAYERS)]
    for s in range(n):
        seq = torch.tensor([ln + s + 1 for ln in LENGTHS])
        new_locs = torch.stack([locs[b][LENGTHS[b] + s] for b in range(B)])
        batch = DecodeBatch(table.req_to_token, rows, seq, new_locs)
        inputs = []
        for layer in range(LAYERS):
            base[layer] = base[layer] + 0.15 * torch.randn(base[layer].shape, generator=g)
            inputs.append(LayerInputs(
                q_index=base[layer], w_index=torch.rand(B, 1, IHEADS, generator=g),
                q=torch.randn(B, 1, HEADS, 576, generator=g),
                new_latent=pack_latent(torch.randn(B, 512, generator=g), torch.randn(B, 64, generator=g)),
                new_index_key=pack_indexer_key(torch.randn(B, 128, generator=g))))
        yield batch, inputs


@pytest.mark.parametrize("modes,prefetch,dba_attention", [
    (("sync", "sync"), False, "split"), (("sync", "sync"), True, "split"), (("dba", "dba"), False, "split"),
    (("dba", "sync"), True, "split"), (("dba", "dba"), True, "whole"), (("dba", "dba"), False, "three chunks"),
    (("dba", "sync"), True, "fused kernels"), (("sync", "dba"), False, "fused kernels, counted copy"),
    (("sync", "sync"), True, "new tokens inserted"), (("dba", "sync"), False, "fused kernels, new tokens inserted"),
    (("dba", "sync"), True, "prefetch in chunks"), (("sync", "dba"), True, "fused kernels, prefetch in chunks"),
    (("sync", "dba"), True, "spare slots"), (("dba", "sync"), True, "fused kernels, spare slots"),
    (("sync", "sync"), False, "fused kernels, spare slots, counted copy"),
    (("dba", "sync"), True, "prefetch in position segments"),
    (("sync", "dba"), True, "fused kernels, prefetch in position segments"),
    (("sync", "sync"), True, "fused kernels, spare slots, prefetch in position segments"),
    (("dba", "sync"), True, "fused kernels, spare slots, separate claims")])
def test_exact_modes_are_bit_identical_to_all_in_hbm(modes, prefetch, dba_attention):
    # "fused kernels": the Triton resolve, prefetch candidates and counted copy (interpreted), as on the GPU
    split = (0.4, 0.3, 0.3) if dba_attention == "three chunks" else 0.5
    impl = "triton" if dba_attention.startswith("fused kernels") else "torch"
    options = dict(sync_copy="counted") if "counted copy" in dba_attention else {}
    if "inserted" in dba_attention:
        options["new_tokens"] = "insert"
    if "prefetch in chunks" in dba_attention:  # the indexer in 3 chunks of one request, each prefetched at once
        options["prefetch_chunks"] = 3
    if "position segments" in dba_attention:  # the indexer in 3 segments of the positions, each prefetched at once
        options.update(prefetch_chunks=(0.5, 0.3, 0.2), prefetch_split="positions")
    if "separate claims" in dba_attention:  # the candidate kernels, then the spare-only claim (else one launch)
        options["prefetch_claim"] = "separate"
    # "spare slots": 48 per layer, refilled beside attention (fewer than some steps' misses: both paths run)
    spare = 48 if "spare slots" in dba_attention else 0
    dba_attention = "whole" if dba_attention in ("three chunks", "new tokens inserted", "prefetch in chunks",
                                                 "spare slots", "prefetch in position segments") or impl == "triton" \
        else dba_attention
    ess, hbm, table, rows, locs = build(modes, prefetch=prefetch, dba_attention=dba_attention, dba_split=split,
                                        resolve_impl=impl, spare=spare, **options)
    if impl == "triton" and prefetch:
        ess.prefetcher.impl = "triton"  # the kernels the GPU runs
    for s, (batch, inputs) in enumerate(steps(12 if impl == "torch" else 5, table, rows, locs)):
        got, want = ess.step(batch, inputs), hbm.step(batch, inputs)
        for layer in range(LAYERS):
            assert torch.equal(got[layer], want[layer]), f"step {s} layer {layer}"
    c = ess.m.counters.sum(0)
    assert c[Counter.MISSES] > 0 and c[Counter.HITS] > c[Counter.MISSES], "the test should exercise hits and misses"
    assert c[Counter.OVERFLOW] == 0 and c[Counter.BAD_INDICES] == 0
    if prefetch:
        assert c[Counter.PREFETCHED] > 0 and c[Counter.PREFETCH_USEFUL] > 0
        assert c[Counter.PREFETCH_USEFUL] + c[Counter.PREFETCH_WASTED] == c[Counter.PREFETCHED]
    else:
        assert c[Counter.PREFETCHED] == 0
    if "new_tokens" in options:  # each new token got a hot slot of its own
        assert c[Counter.NEW_TOKENS] > 0
    else:  # written back only (the default): every new token selected later was fetched as a miss
        assert c[Counter.NEW_TOKENS] == 0 and c[Counter.D2H_ENTRIES] > 0
    if spare:  # every layer's spare slots were taken and refilled (the last refill left some free)
        assert bool((ess.m.spare_taken < spare).all())
    ess.m.check_invariants()


def _pool_state(m):
    """Which locations are resident in each layer, their slots' stamps, and every counter."""
    l2s = m.loc_to_slot.long()
    stamps = torch.where(l2s >= 0, torch.gather(m.slot_stamp, 1, l2s.clamp(min=0)), -1)
    return l2s >= 0, stamps, m.counters.clone()


def _assert_same_states(runs):
    """Every run's pool states equal the first run's after every step (which prefetched, wasted and missed, with no
    eviction)."""
    c = runs[0][-1][2].sum(0)
    assert c[Counter.PREFETCHED] > 0 and c[Counter.PREFETCH_WASTED] > 0 and c[Counter.MISSES] > 0
    assert c[Counter.EVICTIONS] == 0
    for other in runs[1:]:
        for s, (want, got) in enumerate(zip(runs[0], other, strict=True)):
            assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), f"step {s}"


def test_prefetch_in_chunks_fetches_what_one_prefetch_over_the_batch_fetches():
    # In a pool that holds every selection and prefetch (no evictions), prefetching chunk by chunk takes the same
    # candidates as one prefetch over the whole batch: after every step the same locations are resident in every
    # layer, with the same stamps, and every counter (prefetched, useful, wasted, misses) agrees; each chunk wrote its
    # own slice of the prefetch list and all of them were settled. (With evictions the two may differ and both be
    # right: a chunk's prefetch can evict an entry that a later chunk then finds missing and prefetches again.)
    runs = []
    for chunks in (1, 2, 3, (0.7, 0.3)):
        ess, hbm, table, rows, locs = build(("sync", "sync"), prefetch=True, slots=1024, prefetch_chunks=chunks)
        calls = []  # the batch rows of each prefetch: one prefetch per chunk and layer
        prefetch = ess.m.prefetch
        ess.m.prefetch = lambda layer, locs_, record, calls=calls, prefetch=prefetch, **kw: (
            calls.append(record.src.numel()), prefetch(layer, locs_, record, **kw))[1]
        states = []
        for batch, inputs in steps(8, table, rows, locs):
            calls.clear()
            ess.step(batch, inputs)
            want = [hi - lo for lo, hi in chunk_bounds(len(LENGTHS), ess.options.prefetch_fractions)] * LAYERS
            assert calls == [n * ess.prefetcher.width for n in want], (chunks, calls)
            states.append(_pool_state(ess.m))
        runs.append(states)
    _assert_same_states(runs)


def test_prefetch_in_position_segments_fetches_what_one_prefetch_over_the_positions_fetches():
    # As above, by segments of the positions: where no cap binds (cap_fraction 1) and nothing is evicted, each
    # segment's candidates are the whole logits' candidates in its positions, so every layer ends every step with the
    # same entries resident, the same stamps and counters as one prefetch over all positions; each segment wrote a
    # whole list of its own (every request's rows) with its first position passed on.
    runs = []
    for chunks, split in ((1, "rows"), (2, "positions"), ((0.5, 0.3, 0.2), "positions")):
        ess, hbm, table, rows, locs = build(("sync", "sync"), prefetch=True, slots=1024, prefetch_chunks=chunks,
                                            prefetch_split=split, cap_fraction=1.0)
        calls = []
        candidates = ess.prefetcher.candidates
        ess.prefetcher.candidates = lambda layer, logits, *a, calls=calls, candidates=candidates, **kw: (
            calls.append((logits.shape[-1], kw.get("first_pos", 0))), candidates(layer, logits, *a, **kw))[1]
        states = []
        for batch, inputs in steps(8, table, rows, locs):
            calls.clear()
            ess.step(batch, inputs)
            width = table.req_to_token.shape[1]
            want = [(width, 0)] if chunks == 1 else [(hi - lo, lo) for lo, hi in segment_bounds(
                width, ess.options.prefetch_fractions)]
            assert calls == want * LAYERS and len(want) == len(ess.options.prefetch_fractions), (chunks, calls)
            states.append(_pool_state(ess.m))
        runs.append(states)
    _assert_same_states(runs)


def test_segment_bounds_are_whole_tiles_and_checked():
    assert segment_bounds(964, (0.5, 0.5)) == [(0, 512), (512, 964)]
    assert segment_bounds(4096, (0.5, 0.3, 0.2)) == [(0, 2048), (2048, 3264), (3264, 4096)]
    assert segment_bounds(100, (0.1, 0.9)) == [(0, 100)]  # a segment rounded to nothing is dropped
    pf = EchoPrefetcher(1, 3, 964)
    loc_to_slot = torch.full((100,), -1, dtype=torch.int32)
    args = (torch.zeros(3, 964, dtype=torch.int32), torch.arange(3), torch.full((3,), 900), loc_to_slot, 99)
    for first_pos, width in ((-1, 10), (900, 100)):  # before the table, past its end: refused on both paths
        for impl in ("torch", "triton"):
            with pytest.raises(ValueError, match="must lie within the request table's 964 positions"):
                pf.candidates(0, torch.zeros(3, 1, width), *args, impl=impl, first_pos=first_pos)
    with pytest.raises(ValueError, match="prefetch_split must be 'rows' or 'positions', got 'cols'"):
        StackOptions(modes=["sync"], prefetch=True, prefetch_chunks=2, prefetch_split="cols")
    ess, *_ = build(("sync", "sync"), prefetch=True, prefetch_chunks=2)
    with pytest.raises(ValueError, match="score hook"):
        EssDecodeStack(ess.m, ess.index_cache, 964, StackOptions(modes=["sync", "sync"], prefetch=True,
                                                                 prefetch_chunks=2, prefetch_split="positions"),
                       max_batch=3, prefetcher=ess.prefetcher, score_hook=lambda layer, logits, batch: logits)


def test_the_last_chunks_copy_takes_its_own_program_count():
    ess, hbm, table, rows, locs = build(("sync", "sync"), prefetch=True, prefetch_chunks=3, last_chunk_programs=5)
    programs = []
    prefetch = ess.m.prefetch
    ess.m.prefetch = lambda layer, locs_, record, programs_=programs, prefetch=prefetch, **kw: (
        programs_.append(kw["programs"]), prefetch(layer, locs_, record, **kw))[1]
    batch, inputs = next(steps(1, table, rows, locs))
    ess.step(batch, inputs)
    assert programs == [32, 32, 5] * LAYERS  # (overlap_programs' default for the others)
    with pytest.raises(ValueError, match="last_chunk_programs must be >= 1 or None, got 0"):
        StackOptions(modes=["sync"], prefetch=True, prefetch_chunks=2, last_chunk_programs=0)


@pytest.mark.parametrize("split", ["positions", "rows"])
def test_chunk_indexer_tiles_reach_the_launches_after_the_first_chunk(split):
    # the launches beside an earlier chunk's prefetch take the option's tiles a program (default 1), by positions or
    # by rows; the first (and a layer's whole-logits launch) the kernel's default. (The torch indexer here ignores
    # them: the Triton kernel's logits across tile counts are test_indexer's.)
    assert StackOptions(modes=["sync"]).chunk_indexer_tiles == 1
    chunks = (0.5, 0.3, 0.2) if split == "positions" else 3  # (by rows: one request each of the three)
    ess, hbm, table, rows, locs = build(("sync", "sync"), prefetch=True, prefetch_chunks=chunks,
                                        prefetch_split=split, chunk_indexer_tiles=np.int64(2))
    tiles = []
    run = ess.run_indexer
    ess.run_indexer = lambda *a, run=run: (tiles.append(a[-1]), run(*a))[1]
    batch, inputs = next(steps(1, table, rows, locs))
    got, want = ess.step(batch, inputs), hbm.step(batch, inputs)
    assert tiles == [None, 2, 2] * LAYERS
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(ValueError, match=f"chunk_indexer_tiles must be an integer >= 1 or None, got {bad!r}"):
            StackOptions(modes=["sync"], prefetch=True, prefetch_chunks=2, chunk_indexer_tiles=bad)


def test_the_refill_at_normal_priority_changes_no_output():
    # (on CPU the streams are program order: this runs the option's path; its timing is the GPU's)
    ess, hbm, table, rows, locs = build(("sync", "sync"), prefetch=True, spare=48, refill_priority="normal")
    for batch, inputs in steps(4, table, rows, locs):
        got, want = ess.step(batch, inputs), hbm.step(batch, inputs)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert bool((ess.m.spare_taken < 48).all())  # refilled
    with pytest.raises(ValueError, match="refill_priority must be 'high' or 'normal', got 'low'"):
        StackOptions(modes=["sync"], refill_priority="low")


def test_prefetch_indexer_is_checked():
    assert StackOptions(modes=["sync"], prefetch=True, prefetch_chunks=2).prefetch_indexer == "overlapped"
    assert StackOptions(modes=["sync"], prefetch=True, prefetch_chunks=2, prefetch_indexer="serial").prefetch_indexer \
        == "serial"
    with pytest.raises(ValueError, match="prefetch_indexer must be one of serial, overlapped, chained, got 'split'"):
        StackOptions(modes=["sync"], prefetch=True, prefetch_chunks=2, prefetch_indexer="split")


@pytest.mark.parametrize("split", ["rows", "positions"])
def test_chained_indexer_launches_head_then_links_and_serial_where_it_cannot_chain(split):
    """prefetch_indexer "chained": a layer's chunks launch one after the other on the main stream, the first as the
    chain's head and the others as its links (programmatic dependent launch on sm_90+); where the stack cannot chain
    (here: CPU, the torch indexer) every launch is plain, as with "serial". The outputs stay the all-HBM stack's."""
    def record(ess):
        seen, run = [], ess.run_indexer
        ess.run_indexer = lambda *a: (seen.append(a[7]), run(*a[:7], "off"))[1]
        return seen

    ess, hbm, table, rows, locs = build(("sync", "sync"), prefetch=True, prefetch_chunks=(0.5, 0.3, 0.2),
                                        prefetch_split=split, prefetch_indexer="chained")
    assert not ess._chain
    fr = ess.options.layer_prefetch_fractions[0]
    n = len(chunk_bounds(len(LENGTHS), fr) if split == "rows" else segment_bounds(ess.max_len, fr))
    assert n >= 2
    seen = record(ess)
    _candidate_calls(ess, hbm, table, rows, locs)
    assert seen == ["off"] * n * LAYERS * 2
    ess, hbm, table, rows, locs = build(("sync", "sync"), prefetch=True, prefetch_chunks=(0.5, 0.3, 0.2),
                                        prefetch_split=split, prefetch_indexer="chained")
    ess._chain = True  # (what a GPU of compute capability 9.0+ with the Triton indexer sets)
    seen = record(ess)
    _candidate_calls(ess, hbm, table, rows, locs)
    assert seen == (["head"] + ["link"] * (n - 1)) * LAYERS * 2


def test_prefetch_chunks_are_a_positive_count_or_fractions_summing_to_one():
    assert StackOptions(modes=["sync"], prefetch_chunks=2).prefetch_fractions == (0.5, 0.5)
    assert StackOptions(modes=["sync"], prefetch_chunks=np.int64(2)).prefetch_fractions == (0.5, 0.5)
    assert StackOptions(modes=["sync"], prefetch_chunks=(0.6, 0.4)).prefetch_fractions == (0.6, 0.4)
    for bad in (0, -1, True, 2.0, "2", (0.6, 0.6), (0.0, 1.0), (), (True, False)):
        with pytest.raises(ValueError, match=r"prefetch_chunks must be an integer >= 1 or fractions of the batch"):
            StackOptions(modes=["sync"], prefetch=True, prefetch_chunks=bad)


@pytest.mark.parametrize("modes,prefetch_layers", [(("sync", "sync"), (2, 0)), (("dba", "sync"), (1, 0)),
                                                         (("dba", "sync"), (0, 1))])
def test_prefetch_in_some_layers_only(modes, prefetch_layers):
    # what an overlap profile with prefetch / prefetch2 layers runs: those layers prefetch (in their chunks), the
    # others never do, and every output stays bit-identical to all-HBM
    ess, hbm, table, rows, locs = build(modes, prefetch_layers=prefetch_layers, dba_attention="whole")
    assert ess.options.layer_prefetch_fractions == tuple((1 / n,) * n if n else None for n in prefetch_layers)
    calls = []
    prefetch = ess.m.prefetch
    ess.m.prefetch = lambda layer, locs_, record, calls=calls, prefetch=prefetch, **kw: (
        calls.append(layer), prefetch(layer, locs_, record, **kw))[1]
    for s, (batch, inputs) in enumerate(steps(10, table, rows, locs)):
        got, want = ess.step(batch, inputs), hbm.step(batch, inputs)
        for layer in range(LAYERS):
            assert torch.equal(got[layer], want[layer]), f"step {s} layer {layer}"
    on = [layer for layer, n in enumerate(prefetch_layers) if n]
    per_step = [layer for layer in on for _ in range(prefetch_layers[layer] * (2 if modes[layer] == "dba" else 1))]
    assert calls == per_step * 10  # a DBA layer prefetches in each of its two halves
    c = ess.m.counters
    for layer, n in enumerate(prefetch_layers):
        if n:
            assert c[layer, Counter.PREFETCH_USEFUL] > 0
            assert c[layer, Counter.PREFETCH_USEFUL] + c[layer, Counter.PREFETCH_WASTED] == c[layer, Counter.PREFETCHED]
            assert bool(torch.isfinite(ess.prefetcher.threshold[layer, rows]).all())  # its EMA follows the k-th score
        else:
            assert c[layer, Counter.PREFETCHED] == 0 and c[layer, Counter.PREFETCH_WASTED] == 0
            assert bool(torch.isinf(ess.prefetcher.threshold[layer, rows]).all())  # never updated
    ess.m.check_invariants()


def test_chunk_plans_give_a_profiles_prefetchN_layers_their_fractions():
    opts = StackOptions(modes=["sync"] * 3, prefetch_layers=[0, 3, 2], chunk_plans={3: (0.5, 0.3, 0.2)})
    assert opts.layer_prefetch_fractions == (None, (0.5, 0.3, 0.2), (0.5, 0.5))  # (2 chunks: no plan, equal)
    for bad in ({3: (0.5, 0.5)}, {2: (0.7, 0.7)}, {True: (1.0,)}):
        with pytest.raises(ValueError, match="chunk_plans"):
            StackOptions(modes=["sync"] * 3, prefetch_layers=[0, 3, 2], chunk_plans=bad)
    with pytest.raises(ValueError, match="chunk_plans give prefetch_layers"):  # (not silently ignored)
        StackOptions(modes=["sync"], prefetch=True, prefetch_chunks=3, chunk_plans={3: (0.5, 0.3, 0.2)})


def test_prefetch_layers_are_checked():
    assert StackOptions(modes=["sync"] * 3, prefetch_layers=[0, 1, 2]).layer_prefetch_fractions == (
        None, (1.0,), (0.5, 0.5))
    assert not StackOptions(modes=["sync"], prefetch_layers=[0]).any_prefetch
    assert StackOptions(modes=["sync"] * 2, prefetch=True, prefetch_chunks=2).layer_prefetch_fractions == (
        (0.5, 0.5), (0.5, 0.5))
    with pytest.raises(ValueError, match="prefetch_layers: 1 values for 2 layers"):
        StackOptions(modes=["sync"] * 2, prefetch_layers=[1])
    with pytest.raises(ValueError, match="are exclusive"):
        StackOptions(modes=["sync"], prefetch=True, prefetch_layers=[1])
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="prefetch_layers: each layer's value must be 0"):
            StackOptions(modes=["sync"], prefetch_layers=[bad])
    ess = build(("sync", "sync"), prefetch_layers=(1, 0))[0]
    with pytest.raises(ValueError, match="need an EchoPrefetcher"):
        EssDecodeStack(ess.m, ess.index_cache, ess.max_len, ess.options, max_batch=len(LENGTHS))


def test_a_score_hook_of_the_wrong_shape_is_refused_with_chunks():
    ess, hbm, table, rows, locs = build(("sync", "sync"), prefetch=True, prefetch_chunks=2)
    ess.score_hook = lambda layer, logits, batch: logits[:, :, :-1]
    batch, inputs = next(steps(1, table, rows, locs))
    with pytest.raises(ValueError, match="score hook: returned scores of shape"):
        ess.step(batch, inputs)


def _record_calls(ess):
    """A list that collects, in call order, "update" (a threshold update), "attend" and each layer's index as the
    layer starts."""
    events = []
    update, attend, forward = ess.prefetcher.update, ess._attend, ess.forward_layer
    ess.prefetcher.update = lambda layer, *a: (events.append("update"), update(layer, *a))[1]
    ess._attend = lambda *a: (events.append("attend"), attend(*a))[1]
    ess.forward_layer = lambda layer, *a: (events.append(layer), forward(layer, *a))[1]
    return events


@pytest.mark.parametrize("modes,chunks", [(("sync", "sync"), 1), (("dba", "sync"), 2), (("sync", "dba"), (0.7, 0.3))])
def test_threshold_update_beside_attention_equals_the_update_at_the_layer_end(modes, chunks):
    # "side" folds each top-k's k-th best scores into the thresholds after the settle (in DBA, chunk by chunk)
    # instead of at the layer's end: the same thresholds, prefetches, counters and outputs after every step
    runs = []
    for where in ("main", "side"):
        ess, hbm, table, rows, locs = build(modes, prefetch=True, prefetch_chunks=chunks, threshold_update=where,
                                            dba_attention="whole")
        events = _record_calls(ess)  # in program order (the CPU runs the streams' work in the order it is queued)
        states = []
        for batch, inputs in steps(6, table, rows, locs):
            events.clear()
            out = ess.step(batch, inputs)
            assert not ess._pending_thresholds
            states.append((out, ess.prefetcher.threshold.clone(), ess.m.counters.clone()))
            # per layer: each top-k folded once, "side" before the layer's last attention, "main" after it
            starts = [events.index(layer) for layer in range(LAYERS)] + [len(events)]
            for layer in range(LAYERS):
                seq = events[starts[layer] + 1:starts[layer + 1]]
                assert seq.count("update") == (2 if modes[layer] == "dba" else 1), (where, layer, seq)
                last_attend = len(seq) - 1 - seq[::-1].index("attend")
                before = [i < last_attend for i, e in enumerate(seq) if e == "update"]
                assert all(before) if where == "side" else not any(before), (where, layer, seq)
        runs.append(states)
    assert runs[0][-1][2].sum(0)[Counter.PREFETCHED] > 0
    for s, (want, got) in enumerate(zip(*runs, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(want[0], got[0], strict=True)), f"step {s}: outputs"
        assert torch.equal(want[1], got[1]) and torch.equal(want[2], got[2]), f"step {s}: thresholds, counters"
    with pytest.raises(ValueError, match="threshold_update must be 'main' or 'side', got 'attention'"):
        StackOptions(modes=["sync"], prefetch=True, threshold_update="attention")


def test_prefetch_waste_stays_under_the_cap_and_the_threshold_follows_the_kth_score():
    ess, hbm, table, rows, locs = build(("sync", "sync"), prefetch=True, cap_fraction=0.02)
    pf = ess.prefetcher
    caps = 0
    for batch, inputs in steps(8, table, rows, locs):
        ess.step(batch, inputs)
        caps += int(pf.caps(batch.seq_lens).sum()) * LAYERS
    c = ess.m.counters.sum(0)
    assert 0 < c[Counter.PREFETCH_WASTED] <= c[Counter.PREFETCHED] <= caps
    assert bool(torch.isfinite(pf.threshold[:, rows]).all())


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_prefetch_threshold_is_an_ema_of_the_kth_score(impl):
    pf = EchoPrefetcher(1, 4, 1000, alpha=0.5, impl=impl)
    rows = torch.tensor([2, 0])
    pf.update(0, torch.tensor([[4.0], [1.0]]), rows)
    assert pf.threshold[0].tolist()[:3] == [1.0, float("inf"), 4.0]
    pf.update(0, torch.tensor([[2.0, 3.0], [3.0, 5.0]]), rows)  # the lower of two query tokens counts
    assert pf.threshold[0, 2] == 3.0 and pf.threshold[0, 0] == 2.0
    pf.reset_rows(torch.tensor([2]))
    assert pf.threshold[0, 2] == float("inf")


def test_prefetch_caps_equal_on_both_paths_where_float32_would_round_up():
    # 0.1 x a multiple of 10 is exact in float64 and one more in float32 (0.1f > 0.1): the kernel reads float64
    pf = EchoPrefetcher(1, 2, 400, cap_fraction=0.1, cap_min_tokens=1)
    req_to_token = torch.arange(800).view(2, 400).int()
    logits = torch.ones((2, 1, 400))
    pf.threshold[0] = 0.0
    args = (0, logits, req_to_token, torch.tensor([0, 1]), torch.tensor([100, 230]),
            torch.full((801,), -1, dtype=torch.int32), 800)
    want = pf.candidates(*args, impl="torch")
    assert (want.view(2, -1) >= 0).sum(1).tolist() == [10, 23]
    assert torch.equal(pf.candidates(*args, impl="triton"), want)


def test_threshold_update_kernel_equals_the_torch_definition():
    g = torch.Generator().manual_seed(4)
    a, b = (EchoPrefetcher(2, 9, 1000, alpha=0.3, impl=impl) for impl in ("torch", "triton"))
    for step in range(4):
        rows = torch.randperm(9, generator=g)[:5]
        kth = torch.randn(5, 2, generator=g)
        for pf in (a, b):
            pf.update(1, kth, rows)
        if step == 1:
            for pf in (a, b):
                pf.reset_rows(rows[:2])
    # one launch may fuse the multiply-add (one rounding fewer): equal up to the last bit
    assert torch.isfinite(a.threshold[1]).sum() == torch.isfinite(b.threshold[1]).sum() > 0
    assert torch.allclose(a.threshold, b.threshold, rtol=1e-6, atol=0)
    # the kernel never writes a request row outside the table (the torch path raises an IndexError there)
    before = b.threshold.clone()
    b.update(1, torch.randn(2, 1, generator=g), torch.tensor([-1, 9]))
    assert torch.equal(b.threshold, before)


def test_prefetch_candidates_are_above_threshold_missing_recent_first_and_capped():
    pf = EchoPrefetcher(1, 2, 256, cap_fraction=0.0, cap_min_tokens=3)
    req_to_token = torch.arange(512).view(2, 256).int()
    logits = torch.full((2, 1, 256), -1.0)
    logits[0, 0, [5, 6, 7, 8, 200]] = 2.0  # 5 candidates for request 0 (cap 3), 200 beyond its length
    logits[1, 0, [1, 2]] = 2.0
    loc_to_slot = torch.full((513,), -1, dtype=torch.int32)
    loc_to_slot[7] = 3  # resident: not a candidate
    pf.threshold[0] = 0.0
    c = pf.candidates(0, logits, req_to_token, torch.tensor([0, 1]), torch.tensor([100, 100]), loc_to_slot, 512)
    assert c.view(2, -1).tolist() == [[8, 6, 5], [258, 257, -1]]


def test_options_are_checked():
    with pytest.raises(ValueError, match="overlap modes"):
        StackOptions(modes=["sync", "fast"])
    with pytest.raises(ValueError, match="overlap mode 'da': 'da' was removed"):
        StackOptions(modes=["sync", "da"])
    with pytest.raises(ValueError, match="new_tokens must be 'insert' or 'on_demand', got 'later'"):
        StackOptions(modes=["sync"], new_tokens="later")
    with pytest.raises(ValueError, match="2 overlap modes for 3 layers"):
        HbmDecodeStack(torch.zeros(3, 64, 656, dtype=torch.uint8), torch.zeros(3, 64, 132, dtype=torch.uint8), 64,
                       StackOptions(modes=["sync", "sync"]))


def test_translate_kernel_equals_the_torch_definition():
    from ess_sglang.kernels.translate import translate_positions_triton

    from ess_sglang.cache_manager import positions_to_locations

    g = torch.Generator().manual_seed(5)
    req_to_token = torch.randint(-2, 3000, (6, 400), generator=g).int()  # some entries out of range on purpose
    pos = torch.randint(-1, 450, (4, 2, 96), generator=g).int()
    rpi, seq = torch.tensor([5, 0, 7, 2]), torch.tensor([400, 10, 300, 1])  # row 7 does not exist: all -1
    want, _ = positions_to_locations(pos, req_to_token, rpi, seq, 2500)
    assert bool((want[2] == -1).all())
    got = translate_positions_triton(pos, req_to_token, rpi, seq, 2500)
    assert torch.equal(got, want.int())


def test_all_resident_lookup_is_bit_identical_when_everything_fits():
    ess, hbm, table, rows, locs = build(("sync", "sync"), slots=2304)
    m = ess.m
    for layer in range(LAYERS):  # load every token each request has; reserve slots for the ones to come
        m.warm_up(layer, torch.cat([loc[:ln] for loc, ln in zip(locs, LENGTHS, strict=True)]))
        m.reserve(layer, torch.cat([loc[ln:ln + 8] for loc, ln in zip(locs, LENGTHS, strict=True)]))
    m.counters.zero_()
    for s, (batch, inputs) in enumerate(steps(6, table, rows, locs)):
        got, want = ess.step(batch, inputs, all_resident=True), hbm.step(batch, inputs)
        for layer in range(LAYERS):
            assert torch.equal(got[layer], want[layer]), f"step {s} layer {layer}"
    c = m.counters.sum(0)
    assert c[Counter.LOOKUPS] == c[Counter.HITS] > 0 and c[Counter.NOT_RESIDENT] == 0 and c[Counter.H2D_ENTRIES] == 0
    assert c[Counter.EVICTIONS] == 0 and c[Counter.D2H_ENTRIES] == 6 * len(LENGTHS) * LAYERS
    # a broken promise is counted, never read out of range
    m.reset()
    batch, inputs = next(steps(1, table, rows, locs))
    ess.step(batch, inputs, all_resident=True)
    assert m.counters[:, Counter.NOT_RESIDENT].sum() > 0


def test_translate_kernel_through_slots_counts_like_the_torch_lookup():
    from ess_sglang.kernels.translate import translate_positions_triton

    m = HotPoolCacheManager(HostTotalPool(1, 3000, device="cpu"), 512, device="cpu", max_selected=768)
    g = torch.Generator().manual_seed(2)
    m.warm_up(0, torch.randperm(3000, generator=g)[:400])
    req_to_token = torch.randint(-2, 3100, (6, 400), generator=g).int()
    pos = torch.randint(-1, 450, (4, 2, 96), generator=g).int()
    rpi, seq = torch.tensor([5, 0, 3, 2]), torch.tensor([400, 10, 300, 1])
    m.counters.zero_()
    want = m.lookup_resident(0, pos, req_to_token, rpi, seq)
    counted = m.counters[0].clone()
    m.counters.zero_()
    ids = (int(Counter.LOOKUPS), int(Counter.HITS), int(Counter.NOT_RESIDENT))
    got = translate_positions_triton(pos, req_to_token, rpi, seq, 3000, loc_to_slot=m.loc_to_slot[0], num_slots=512,
                                     counters=m.counters[0], counter_ids=ids)
    assert torch.equal(got, want) and torch.equal(m.counters[0], counted)
    assert counted[Counter.HITS] > 0 and counted[Counter.NOT_RESIDENT] > 0


def test_prefetch_candidate_kernels_equal_the_torch_definition():
    g = torch.Generator().manual_seed(4)
    B, Q, T, rows = 3, 2, 2600, 5
    pf = EchoPrefetcher(1, rows, T, cap_fraction=0.02, cap_min_tokens=7)
    pf.threshold[0] = torch.randn(rows, generator=g)
    pf.threshold[0, 1] = float("-inf")  # a short request: everything visible passes
    req_to_token = torch.randint(-1, 9000, (rows, T), generator=g).int()
    logits = torch.randn(B, Q, T, generator=g) * 2
    rpi, seq = torch.tensor([4, 1, 0]), torch.tensor([T, 900, 1500])
    loc_to_slot = torch.full((8001,), -1, dtype=torch.int32)
    loc_to_slot[torch.randint(0, 8000, (3000,), generator=g)] = 5  # some entries are resident
    args = (0, logits, req_to_token, rpi, seq, loc_to_slot, 8000)
    want = pf.candidates(*args, impl="torch")
    got = pf.candidates(*args, impl="triton")
    assert torch.equal(got, want)
    assert int((want >= 0).sum()) > 0 and int((want.view(B, -1) >= 0).sum(1).max()) == pf.width
    # thresholds that leave some tiles (of TILE positions) without candidates and others with many, up to all
    from ess_sglang.kernels.prefetch import TILE

    pf.threshold[0] = torch.tensor([0.0, 2.0, 4.0, 0.0, 4.5])
    want = pf.candidates(*args, impl="torch")
    assert torch.equal(pf.candidates(*args, impl="triton"), want)
    above = (logits > pf.threshold[0, rpi].view(B, 1, 1)).any(1)
    locs = req_to_token[rpi, :T].long()
    visible = (torch.arange(T).view(1, T) < seq.view(B, 1)) & (locs >= 0) & (locs < 8000)
    cand = above & visible & (loc_to_slot[torch.where(visible, locs, 8000)] < 0)
    per_tile = torch.nn.functional.pad(cand, (0, -T % TILE)).view(B, -1, TILE).sum(-1)
    assert bool((per_tile == 0).any()) and bool((per_tile > 128).any()), per_tile
    assert int((want >= 0).sum()) > 0
    # rows wider than one padding block (1,024 entries), padded by the tile-0 program in several stores (the output
    # is allocated empty, so a padding entry left unwritten would show here)
    wide = EchoPrefetcher(1, rows, T, cap_fraction=0.5, cap_min_tokens=7)
    wide.threshold[0] = pf.threshold[0]
    assert wide.width > 1024
    want_wide = wide.candidates(*args, impl="torch")
    assert torch.equal(wide.candidates(*args, impl="triton"), want_wide) and int((want_wide == -1).sum()) > 1024
    # request rows outside the table (past its end, or -1) are never read and give no candidates
    bad = (0, logits, req_to_token, torch.tensor([4, rows + 2, -1]), seq, loc_to_slot, 8000)
    want_bad = pf.candidates(*bad, impl="torch")
    assert torch.equal(pf.candidates(*bad, impl="triton"), want_bad)
    assert torch.equal(want_bad.view(B, -1)[0], want.view(B, -1)[0]) and bool((want_bad.view(B, -1)[1:] == -1).all())


def test_prefetch_candidates_of_position_segments():
    """Logits of a segment of the positions: the same candidates as the whole logits give there, on both paths, at
    most the segment's share of the cap each (ceil(cap x seen / seq_len)); segments that tile the positions find every
    candidate of the whole where no cap binds."""
    g = torch.Generator().manual_seed(9)
    B, Q, T, rows = 3, 2, 2600, 5
    req_to_token = torch.randint(-1, 9000, (rows, T), generator=g).int()
    logits = torch.randn(B, Q, T, generator=g) * 2
    rpi, seq = torch.tensor([4, 1, 0]), torch.tensor([T, 900, 1500])
    loc_to_slot = torch.full((8001,), -1, dtype=torch.int32)
    loc_to_slot[torch.randint(0, 8000, (3000,), generator=g)] = 5
    for cap_fraction in (0.02, 1.0):  # a binding cap, and none
        pf = EchoPrefetcher(1, rows, T, cap_fraction=cap_fraction, cap_min_tokens=7)
        pf.threshold[0] = torch.tensor([0.0, 2.0, 1.0, 0.0, 1.5])
        whole = pf.candidates(0, logits, req_to_token, rpi, seq, loc_to_slot, 8000, impl="torch").view(B, -1)
        found = [set() for _ in range(B)]
        for lo, hi in ((0, 1024), (1024, 1300), (1300, T)):
            args = (0, logits[..., lo:hi], req_to_token, rpi, seq, loc_to_slot, 8000)
            want = pf.candidates(*args, impl="torch", first_pos=lo)
            assert torch.equal(pf.candidates(*args, impl="triton", first_pos=lo), want), (cap_fraction, lo)
            seen = (seq - lo).clamp(0, hi - lo)
            caps = pf.caps(seq, lo, hi - lo)
            full = pf.caps(seq)
            assert torch.equal(caps, torch.where(seen > 0, -(-full * seen // seq), 0))
            per_row = want.view(B, -1)
            assert torch.equal((per_row >= 0).sum(1) <= caps, torch.ones(B, dtype=torch.bool))
            # what the segment holds is what the whole logits hold there (most recent first, as many as its cap)
            pos = torch.arange(lo, hi)
            locs = req_to_token[rpi, lo:hi].long()
            for b in range(B):
                mine = set(per_row[b][per_row[b] >= 0].tolist())
                assert mine <= set(locs[b][pos < seq[b]].tolist())
                found[b] |= mine
        if cap_fraction == 0.02:  # the shares by hand: caps 52 / 18 / 30 (seq 2600 / 900 / 1500, at least 7)
            assert pf.caps(seq).tolist() == [52, 18, 30]
            # ceil(52 x 1024 / 2600), all 18 of the 900-long request, ceil(30 x 1024 / 1500)
            assert pf.caps(seq, 0, 1024).tolist() == [21, 18, 21]
            assert pf.caps(seq, 1024, 276).tolist() == [6, 0, 6]  # the 900-long request has nothing there
            assert pf.caps(seq, 1300, 1300).tolist() == [26, 0, 4]
        if cap_fraction == 1.0:  # no cap binds: the segments together find exactly the whole's candidates
            for b in range(B):
                assert found[b] == set(whole[b][whole[b] >= 0].tolist()), b
            assert sum(len(f) for f in found) > 0


@pytest.mark.parametrize("tile", [64, 1024])
def test_candidate_write_kernels_place_per_tile_candidates_for_any_tile_size(tile):
    # K2 + K3 alone, from per-tile counts and compacted locations made here in torch, with several tiles per write
    # program (tile 64: 16 a program) or one (1,024, what the count kernel writes): the same list as the definition
    from ess_sglang.kernels.prefetch import candidates_from_tiles, new_tile_candidates

    g = torch.Generator().manual_seed(7)
    B, T, W = 3, 2600, 400
    cand = torch.rand(B, T, generator=g) < torch.tensor([0.02, 0.3, 0.9]).view(B, 1)  # caps bind for two requests
    locs = torch.randperm(B * T, generator=g).view(B, T)
    seq = torch.tensor([T, 1800, 2100])
    cand &= torch.arange(T).view(1, T) < seq.view(B, 1)
    rank = cand.flip(-1).cumsum(-1).flip(-1) - 1
    cap_fraction = torch.tensor([0.05], dtype=torch.float64)
    caps = torch.ceil(seq.double() * 0.05).long().clamp(min=9, max=W)
    want = torch.full((B, W + 1), -1, dtype=torch.int64)
    take = cand & (rank < caps.view(B, 1))
    want.scatter_(1, torch.where(take, rank, W), torch.where(take, locs, -1))
    tc = new_tile_candidates(B, T, tile, B * T, torch.device("cpu"))
    padded = torch.nn.functional.pad(cand, (0, -T % tile)).view(B, -1, tile)
    tc.counts.copy_(padded.sum(-1))
    tc.kept.fill_(-7)  # past each tile's count: never read
    for b in range(B):
        for t in range(padded.shape[1]):
            pos = t * tile + torch.nonzero(padded[b, t]).view(-1)
            tc.kept[b, t, :pos.numel()] = locs[b, pos].int()
    got = candidates_from_tiles(tc, seq, cap_fraction, 9, W)
    assert torch.equal(got, want[:, :W].reshape(-1))
    assert bool((want[1] >= 0).sum() == caps[1]) and bool((want[0] == -1).any())


def test_candidate_scratch_is_checked():
    from ess_sglang.kernels.prefetch import new_tile_candidates

    for tile in (0, 48, 2048):
        with pytest.raises(ValueError, match="power of two"):
            new_tile_candidates(2, 100, tile, 1000, torch.device("cpu"))
    with pytest.raises(ValueError, match="kept as int32"):
        new_tile_candidates(2, 100, 1024, 1 << 31, torch.device("cpu"))


def test_prefetch_margin_lowers_the_bar_in_both_implementations():
    """`margin` m: candidates are the positions above threshold - m x |threshold| (finite thresholds; +-inf stay as
    they are): a superset of the margin-0 candidates, equal between the torch definition and the kernel."""
    g = torch.Generator().manual_seed(9)
    B, Q, T, rows = 3, 1, 1500, 4
    req_to_token = torch.randint(0, 6000, (rows, T), generator=g).int()
    logits = torch.randn(B, Q, T, generator=g) + 3
    rpi, seq = torch.tensor([0, 2, 3]), torch.tensor([T, 1200, 700])
    loc_to_slot = torch.full((6001,), -1, dtype=torch.int32)
    args = (0, logits, req_to_token, rpi, seq, loc_to_slot, 6000)
    counts = []
    for margin in (0.0, 0.1):
        pf = EchoPrefetcher(1, rows, T, cap_fraction=1.0, cap_min_tokens=0, margin=margin)
        pf.threshold[0] = torch.tensor([4.5, 0.0, -2.0, float("inf")])  # row 3 has no threshold yet
        want = pf.candidates(*args, impl="torch")
        assert torch.equal(pf.candidates(*args, impl="triton"), want)
        n = (want.view(B, -1) >= 0).sum(1)
        bar = torch.tensor([4.5 * (1 - margin), -2.0 * (1 + margin)])  # rows 0 and 2: the bar a position must pass
        assert n[:2].tolist() == [int((logits[0, 0, :T] > bar[0]).sum()), int((logits[1, 0, :1200] > bar[1]).sum())]
        assert n[2] == 0  # +inf: nothing passes, with or without a margin
        counts.append(n)
    assert int(counts[1][0]) > int(counts[0][0]) > 0
    with pytest.raises(ValueError, match=r"margin must be in \[0, 1\)"):
        EchoPrefetcher(1, rows, T, margin=1.0)


def test_a_calls_margin_overrides_the_layers_in_both_implementations():
    g = torch.Generator().manual_seed(4)
    B, T, rows = 2, 900, 3
    req_to_token = torch.randint(0, 4000, (rows, T), generator=g).int()
    logits = torch.randn(B, 1, T, generator=g) + 3
    args = (0, logits, req_to_token, torch.tensor([0, 2]), torch.tensor([T, 600]),
            torch.full((4001,), -1, dtype=torch.int32), 4000)
    with_margin = EchoPrefetcher(1, rows, T, cap_fraction=1.0, cap_min_tokens=0, margin=0.2)
    plain = EchoPrefetcher(1, rows, T, cap_fraction=1.0, cap_min_tokens=0)
    for pf in (with_margin, plain):
        pf.threshold[0] = torch.tensor([4.0, 0.0, 3.5])
    for impl in ("torch", "triton"):
        assert torch.equal(with_margin.candidates(*args, impl=impl, margin=0.0), plain.candidates(*args, impl=impl))
        assert torch.equal(plain.candidates(*args, impl=impl, margin=0.2), with_margin.candidates(*args, impl=impl))
    assert not torch.equal(plain.candidates(*args), with_margin.candidates(*args))  # (the margin matters here)
    for bad in (1.0, -0.1, True, "0"):
        with pytest.raises(ValueError, match="prefetch margin must be in"):
            plain.candidates(*args, margin=bad)


def _candidate_calls(ess, hbm, table, rows, locs) -> list[dict]:
    """Two steps of both stacks (ESS bit-identical to all-HBM); the keyword arguments of every candidates call."""
    calls = []
    candidates = ess.prefetcher.candidates
    ess.prefetcher.candidates = lambda *a, **kw: (calls.append(kw), candidates(*a, **kw))[1]
    for batch, inputs in steps(2, table, rows, locs):
        got, want = ess.step(batch, inputs), hbm.step(batch, inputs)
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    return calls


def test_the_last_chunk_takes_its_own_margin():
    ess, hbm, table, rows, locs = build(("sync", "sync"), prefetch=True, prefetch_chunks=3, last_chunk_margin=0.0)
    ess.prefetcher.margins = (0.25,) * LAYERS
    margins = [kw.get("margin") for kw in _candidate_calls(ess, hbm, table, rows, locs)]
    assert margins == [0.25, 0.25, 0.0] * LAYERS * 2  # the layer's margin, but 0 for the chunk beside the top-k
    for bad in (1.0, -0.5, True):
        with pytest.raises(ValueError, match="last_chunk_margin must be in"):
            StackOptions(modes=["sync"], prefetch=True, prefetch_chunks=2, last_chunk_margin=bad)


@pytest.mark.parametrize("split", ["rows", "positions"])
def test_the_last_chunk_can_leave_its_misses_to_the_exact_resolve(split):
    """last_chunk_prefetch False: every chunk's indexer still runs (the logits are whole), but only the chunks before
    the last look for candidates; the outputs stay those of the all-HBM stack and the resolve fetches the rest."""
    ess, hbm, table, rows, locs = build(("sync", "sync"), prefetch=True, prefetch_chunks=3, prefetch_split=split,
                                        last_chunk_prefetch=False)
    first_positions = [kw.get("first_pos") for kw in _candidate_calls(ess, hbm, table, rows, locs)]
    assert len(first_positions) == 2 * LAYERS * 2  # two of the three chunks, in each layer and step
    if split == "positions":
        bounds = segment_bounds(ess.max_len, ess.options.layer_prefetch_fractions[0])
        assert first_positions[:2] == [bounds[0][0], bounds[1][0]]
    counters = ess.m.counters.sum(0)
    assert int(counters[Counter.PREFETCHED]) > 0 and int(counters[Counter.MISSES]) > 0
    with pytest.raises(ValueError, match="last_chunk_prefetch must be True or False, got 'off'"):
        StackOptions(modes=["sync"], prefetch=True, prefetch_chunks=2, last_chunk_prefetch="off")
    for idle in (dict(last_chunk_programs=8), dict(last_chunk_margin=0.0), dict(last_chunk_priority="normal")):
        with pytest.raises(ValueError, match=f"{next(iter(idle))} sets the last chunk's prefetch, which "
                                             f"last_chunk_prefetch=False drops"):
            StackOptions(modes=["sync"], prefetch=True, prefetch_chunks=2, last_chunk_prefetch=False, **idle)


def test_a_layer_of_one_chunk_prefetches_whatever_last_chunk_prefetch_says():
    ess, hbm, table, rows, locs = build(("sync", "sync"), prefetch=True, prefetch_chunks=1, last_chunk_prefetch=False)
    assert len(_candidate_calls(ess, hbm, table, rows, locs)) == LAYERS * 2


def test_overlapping_copies_take_their_rows_per_program():
    """overlap_copy_rows reaches every copy that overlaps compute (the prefetch chunks', DBA's halves'), and only
    those; the fused path hands it to the counted copy kernel, which copies the same rows."""
    for modes in (("sync", "sync"), ("dba", "sync")):
        ess, hbm, table, rows, locs = build(modes, prefetch=True, prefetch_chunks=2, overlap_copy_rows=16,
                                            sync_copy="counted")
        seen = []  # (programs, rows_per_program) of every copy
        fetch = ess.m.fetch
        ess.m.fetch = lambda layer, fl, programs=None, rows=None, rec=seen, f=fetch: (
            rec.append((programs, rows)), f(layer, fl, programs, rows))[1]
        for batch, inputs in steps(2, table, rows, locs):
            got, want = ess.step(batch, inputs), hbm.step(batch, inputs)
            for layer in range(LAYERS):
                assert torch.equal(got[layer], want[layer])
        overlapping = [args for args in seen if args[0] == ess.options.overlap_programs]
        assert overlapping and all(args[1] == 16 for args in overlapping)
        assert all(args[1] is None for args in seen if args[0] is None)  # sync's counted copy: the whole GPU
    from ess_sglang import cache_manager as cm

    src = torch.randint(0, 255, (40, 656), dtype=torch.uint8)
    host = HostTotalPool(1, 40, device="cpu")
    host.entries[0] = src
    m = HotPoolCacheManager(host, 64, device="cpu", copy_impl="triton")
    fl = m.new_fetch_list(32)
    fl.src[:5] = torch.tensor([3, 7, 1, 30, 12])
    fl.dst[:5] = torch.tensor([0, 9, 4, 2, 63])
    fl.count.fill_(5)
    calls = []
    real = cm.copy_rows_counted
    cm.copy_rows_counted = lambda *a, **kw: (calls.append(kw), real(*a, **kw))[1]
    try:
        m.fetch(0, fl, programs=2, rows_per_program=16)
    finally:
        cm.copy_rows_counted = real
    assert calls == [dict(rows_per_program=16)]
    assert torch.equal(m.hot_entries[0][fl.dst[:5]], src[fl.src[:5]])
    for bad in (0, 3, 128, True):
        with pytest.raises(ValueError, match="overlap_copy_rows must be a power of two from 1 to 64"):
            StackOptions(modes=["sync"], overlap_copy_rows=bad)


def test_the_last_chunk_runs_at_its_own_priority():
    """last_chunk_priority "normal": the chunk beside the top-k queues its candidate, claim and copy launches in
    `SideStream.on_normal` (the other chunks on the side stream), and the outputs stay those of the all-HBM stack."""
    for priority, want in (("high", [False] * 3), ("normal", [False, False, True])):
        ess, hbm, table, rows, locs = build(("sync", "sync"), prefetch=True, prefetch_chunks=3,
                                            last_chunk_priority=priority)
        blocks, in_normal = [], [False]
        on_normal, prefetch = ess.streams.on_normal, ess.m.prefetch

        @contextlib.contextmanager
        def recording(on_normal=on_normal, flag=in_normal):
            flag[0] = True
            with on_normal():
                yield
            flag[0] = False

        ess.streams.on_normal = recording
        ess.m.prefetch = lambda *a, prefetch=prefetch, flag=in_normal, seen=blocks, **kw: (seen.append(flag[0]),
                                                                                           prefetch(*a, **kw))[1]
        for batch, inputs in steps(2, table, rows, locs):
            got, expected = ess.step(batch, inputs), hbm.step(batch, inputs)
            assert all(torch.equal(x, y) for x, y in zip(got, expected, strict=True))
        assert blocks == want * LAYERS * 2, priority
    with pytest.raises(ValueError, match="last_chunk_priority must be 'high' or 'normal', got 'low'"):
        StackOptions(modes=["sync"], prefetch=True, prefetch_chunks=2, last_chunk_priority="low")


def test_the_one_launch_prefetch_claim_leaves_the_state_the_separate_kernels_leave(monkeypatch):
    """Prefetch in three position segments with spare slots, every kernel the GPU runs (interpreted): one launch a
    segment for its candidates and claims, or the candidate kernels then the spare-only claim, give the same outputs
    and the same pools, maps and counters after every step."""
    import ess_sglang.kernels.prefetch as kp

    runs, launches = [], []
    run_claim = kp.claim_above_triton
    monkeypatch.setattr(kp, "claim_above_triton", lambda *a, **kw: (launches.append(1), run_claim(*a, **kw))[1])
    for claim in ("one_launch", "separate"):
        ess, _, table, rows, locs = build(("sync", "sync"), prefetch=True, resolve_impl="triton", spare=48,
                                          prefetch_chunks=(0.5, 0.3, 0.2), prefetch_split="positions",
                                          prefetch_claim=claim)
        ess.prefetcher.impl = "triton"
        states = []
        for batch, inputs in steps(4, table, rows, locs):
            out = ess.step(batch, inputs)
            m = ess.m
            states.append([*out, m.loc_to_slot.clone(), m.slot_to_loc.clone(), m.slot_stamp.clone(), m.spare.clone(),
                           m.spare_taken.clone(), m.counters.clone(), *[e.clone() for e in m.hot_entries]])
        runs.append(states)
        assert int(ess.m.counters[:, Counter.PREFETCHED].sum()) > 0
        # one launch a segment, in each layer and step (three segments of two layers, four steps); none separately
        assert len(launches) == 3 * LAYERS * 4, (claim, len(launches))
    for step, (a, b) in enumerate(zip(*runs, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {step}"
    with pytest.raises(ValueError, match="prefetch_claim must be 'one_launch' or 'separate', got 'fused'"):
        StackOptions(modes=["sync"], prefetch=True, prefetch_claim="fused")


def test_a_callers_top_k_serves_both_stacks():
    """StackOptions.topk as a callable (e.g. SGLang's own decode top-k): both stacks select with it, given each batch's
    sequence lengths; ESS stays bit-identical to the all-HBM stack, and ECHO's thresholds follow the k-th scores it
    returns."""
    calls = []

    def ascending_topk(scores, k, seq_lens, seen=calls):
        T = scores.shape[-1]
        visible = torch.arange(T) < seq_lens.view(-1, 1, 1)
        pos, kth = topk_with_scores(torch.where(visible, scores, float("-inf")), k)
        pos = torch.where(pos < 0, T, pos).sort(-1).values  # another order than torch.topk's
        kth = kth - 0.5  # (a k-th score of its own: the thresholds must come from here)
        seen.append((seq_lens.clone(), kth))
        return torch.where(pos == T, -1, pos).to(torch.int32), kth

    ess, hbm, table, rows, locs = build(("sync", "sync"), prefetch=True, prefetch_chunks=2, topk=ascending_topk)
    hbm = HbmDecodeStack(hbm.latents, hbm.index_cache, hbm.max_len,
                         StackOptions(modes=("sync", "sync"), top_k=TOPK, indexer="torch", topk=ascending_topk))
    for s, (batch, inputs) in enumerate(steps(2, table, rows, locs)):
        got, want = ess.step(batch, inputs), hbm.step(batch, inputs)
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
        if s == 0:  # the first step's k-th scores (ESS's calls come first) are the thresholds now
            for layer in range(LAYERS):
                assert torch.equal(ess.prefetcher.threshold[layer, rows], calls[layer][1][:, 0])
    assert len(calls) == 2 * 2 * LAYERS  # ESS (one top-k over both chunks' logits) and HBM, each layer and step
    assert all(torch.equal(c, batch.seq_lens) for c, _ in calls[-2 * LAYERS:])
    with pytest.raises(ValueError, match="topk must be 'auto', 'triton', 'torch' or a callable, got 'fast'"):
        StackOptions(modes=["sync"], topk="fast")



@pytest.mark.parametrize("modes,update", [(("sync", "sync"), "side"), (("dba", "sync"), "main")])
def test_a_top_k_with_a_step_hook_and_no_kth_score(modes, update):
    """A caller's top-k with `begin_step` hears of every step of both stacks before its first layer (and `prepare` of
    the DBA chunks an ESS stack will select for). One that gives positions only (SGLang's decode top-k) serves both
    stacks, bit-identical; a prefetching ESS stack then finds each row's k-th score itself (the lowest selected
    logit), and ECHO's thresholds follow it, folded beside attention or at the layer's end."""
    events = []

    class PositionsOnly:
        def begin_step(self, seq_lens, width):
            events.append(("step", seq_lens.clone(), width))

        def prepare(self, seq_lens, width):
            events.append(("prepare", seq_lens.clone(), width))

        def __call__(self, scores, k, seq_lens):
            T = scores.shape[-1]
            visible = torch.arange(T) < seq_lens.view(-1, 1, 1)
            pos = topk_with_scores(torch.where(visible, scores, float("-inf")), k)[0]
            events.append(("topk", scores.clone(), pos))
            return pos.flip(-1), None  # (an order of its own)

    dba = "dba" in modes
    for prefetch in (False, True):
        ess, hbm, table, rows, locs = build(modes, prefetch=prefetch, topk=PositionsOnly(), threshold_update=update,
                                            dba_attention="whole")
        hbm = HbmDecodeStack(hbm.latents, hbm.index_cache, hbm.max_len,
                             StackOptions(modes=("sync", "sync"), top_k=TOPK, indexer="torch", topk=PositionsOnly()))
        for s, (batch, inputs) in enumerate(steps(2, table, rows, locs)):
            del events[:]
            got = ess.step(batch, inputs)
            n_ess = len(events)
            want = hbm.step(batch, inputs)
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
            # each stack: the hook (ESS: and the DBA chunks), then its layers' top-ks (a DBA layer: one per chunk)
            ess_topks = LAYERS + (1 if dba else 0)
            assert [e[0] for e in events[:n_ess]] == ["step"] + ["prepare"] * (2 if dba else 0) + ["topk"] * ess_topks
            assert [e[0] for e in events[n_ess:]] == ["step"] + ["topk"] * LAYERS
            assert torch.equal(events[0][1], batch.seq_lens) and events[0][2] == ess.max_len
            if dba:  # the chunks, as the DBA layer will slice the batch
                bounds = chunk_bounds(len(LENGTHS), ess.options.dba_fractions)
                assert [e[1].tolist() for e in events[1:3]] == [batch.seq_lens[lo:hi].tolist() for lo, hi in bounds]
            if prefetch and s == 0:  # the first step's k-th scores are the thresholds now (from infinity)
                picks = [e for e in events[:n_ess] if e[0] == "topk"]
                for layer in range(LAYERS):
                    got_thr = ess.prefetcher.threshold[layer, rows]
                    mine = picks[:2] if dba and layer == 0 else [picks[layer + (1 if dba else 0)]]
                    lowest = torch.cat([torch.gather(sc[:, 0], 1, p[:, 0].long()).amin(dim=1) for _, sc, p in mine])
                    assert torch.equal(got_thr, lowest), (layer, got_thr, lowest)

def test_prefetch_pdl_is_off_on_cpu_and_refused_there():
    assert EchoPrefetcher(1, 2, 64).pdl is False  # (auto: sm_90+ only)
    assert EchoPrefetcher(1, 2, 64, pdl=False).pdl is False
    with pytest.raises(ValueError, match="prefetch pdl: programmatic dependent launch needs the Triton candidate "
                                         "kernels on a CUDA GPU of compute capability 9.0 or newer, got impl 'auto' on "
                                         "cpu"):
        EchoPrefetcher(1, 2, 64, pdl=True)
    with pytest.raises(ValueError, match="prefetch pdl must be true, false or unset"):
        EchoPrefetcher(1, 2, 64, pdl="yes")


def test_side_streams_are_no_ops_on_cpu():
    streams = SideStream(torch.device("cpu"))
    assert streams.side is None and streams.normal is None
    with streams.on_normal(), streams.on_side():
        pass
    assert streams.mark() is None


def test_prefetch_margins_per_layer():
    """An overlap profile's *_margin layers prefetch with its margin, the others without: each layer's candidates
    are those of a prefetcher with that layer's margin everywhere (both implementations)."""
    g = torch.Generator().manual_seed(4)
    B, T, rows = 2, 900, 3
    req_to_token = torch.randint(0, 4000, (rows, T), generator=g).int()
    logits = torch.randn(B, 1, T, generator=g) + 3
    rpi, seq = torch.tensor([0, 2]), torch.tensor([T, 640])
    loc_to_slot = torch.full((4001,), -1, dtype=torch.int32)
    per_layer = EchoPrefetcher(2, rows, T, cap_fraction=1.0, cap_min_tokens=0, margin=[0.0, 0.2])
    assert per_layer.margins == (0.0, 0.2)
    per_layer.threshold.fill_(4.0)
    for layer, margin in enumerate((0.0, 0.2)):
        alone = EchoPrefetcher(2, rows, T, cap_fraction=1.0, cap_min_tokens=0, margin=margin)
        alone.threshold.fill_(4.0)
        args = (layer, logits, req_to_token, rpi, seq, loc_to_slot, 4000)
        for impl in ("torch", "triton"):
            assert torch.equal(per_layer.candidates(*args, impl=impl), alone.candidates(*args, impl="torch"))
    assert int((per_layer.candidates(1, *args[1:]) >= 0).sum()) > int((per_layer.candidates(0, *args[1:]) >= 0).sum())
    with pytest.raises(ValueError, match=r"one number or one per layer \(2\), got 3"):
        EchoPrefetcher(2, rows, T, margin=[0.0, 0.1, 0.1])
    for bad in ([0.0, -0.1], [0.0, True], [0.0, "0.1"], np.bool_(True), torch.tensor(1.5)):
        with pytest.raises(ValueError, match=r"margin must be in \[0, 1\)"):
            EchoPrefetcher(2, rows, T, margin=bad)
    with pytest.raises(ValueError, match=r"a number in \[0, 1\) or one per layer, got '0.1'"):
        EchoPrefetcher(2, rows, T, margin="0.1")
    for one in (np.float32(0.25), np.array(0.25), torch.tensor(0.25)):  # one number for every layer
        assert EchoPrefetcher(2, rows, T, margin=one).margins == (0.25, 0.25)


def test_prefetch_candidates_read_row_padded_logits_in_place():
    """DeepGEMM's logits are a view of a buffer with padded rows: the kernels read it through its row stride (no
    copy), and find what they find in a contiguous copy; the torch definition agrees."""
    g = torch.Generator().manual_seed(11)
    B, T, rows = 3, 1000, 4
    padded = torch.randn(B, T + 24, generator=g) + 3
    logits = padded[:, :T].unsqueeze(1)  # [B, 1, T], row stride T + 24
    assert logits.stride(0) == T + 24 and not logits.is_contiguous()
    req_to_token = torch.randint(0, 5000, (rows, T), generator=g).int()
    rpi, seq = torch.tensor([0, 3, 1]), torch.tensor([T, 700, 900])
    loc_to_slot = torch.full((5001,), -1, dtype=torch.int32)
    pf = EchoPrefetcher(1, rows, T, cap_fraction=1.0, cap_min_tokens=0)
    pf.threshold[0] = torch.tensor([4.0, 3.5, 0.0, 4.2])
    args = (req_to_token, rpi, seq, loc_to_slot, 5000)
    want = pf.candidates(0, logits.contiguous(), *args, impl="torch")
    assert int((want >= 0).sum()) > 0
    assert torch.equal(pf.candidates(0, logits, *args, impl="triton"), want)
    assert torch.equal(pf.candidates(0, logits, *args, impl="torch"), want)
