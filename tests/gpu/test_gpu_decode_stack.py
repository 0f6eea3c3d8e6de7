"""The decode-layer stack on the GPU with the Triton indexer, the fused resolve and FlashMLA (run on the H200).

- sync and prefetch (also with the indexer in batch chunks, each prefetched at once): bit-identical to the all-HBM
  stack at every layer of every step;
- dba: bit-identical to the all-HBM stack (whole-batch attention, the default), or to the all-HBM stack with its
  attention split the same way ("split");
- with spare slots (refilled beside attention, outside the layer's join): the same, in every mode and in one graph;
- the whole step (all layers, side streams, prefetch) captured in one CUDA graph and replayed gives the eager outputs
  bit for bit.
"""

import math

import pytest
import torch

from ess_sglang.cache_manager import Counter, HotPoolCacheManager
from ess_sglang.decode_stack import (
    DecodeBatch,
    EssDecodeStack,
    HbmDecodeStack,
    LayerInputs,
    StackOptions,
    latent_store_rows,
)
from ess_sglang.formats import INDEXER_ENTRY_BYTES, pack_indexer_key, pack_latent
from ess_sglang.host_pool import HostTotalPool
from ess_sglang.prefetch import EchoPrefetcher

pytestmark = pytest.mark.gpu

LAYERS, B, CTX, STEPS, TOPK = 2, 8, 12288, 10, 2048


@pytest.fixture(scope="module")
def world():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    width = CTX + STEPS
    T = B * width
    host = HostTotalPool(LAYERS, T, device=dev)
    latents = torch.zeros((LAYERS, latent_store_rows(T), 656), dtype=torch.uint8, device=dev)
    index_cache = torch.empty((LAYERS, T, INDEXER_ENTRY_BYTES), dtype=torch.uint8, device=dev)
    for layer in range(LAYERS):
        ent = pack_latent(torch.randn(T, 512, device=dev, generator=g), torch.randn(T, 64, device=dev, generator=g))
        latents[layer, :T] = ent
        host.entries[layer].copy_(ent.cpu())
        index_cache[layer] = pack_indexer_key(torch.randn(T, 128, device=dev, generator=g))
    req_to_token = torch.arange(T, device=dev, dtype=torch.int32).view(B, width)
    rows = torch.arange(B, device=dev, dtype=torch.int32)
    # per step and layer: drifting indexer queries (consecutive selections overlap), fixed attention queries
    q0 = [torch.randn(B, 1, 64, 128, device=dev, generator=g) for _ in range(LAYERS)]
    steps = []
    for _ in range(STEPS):
        for layer in range(LAYERS):
            q0[layer] = 0.995 * q0[layer] + math.sqrt(1 - 0.995 ** 2) * torch.randn(q0[layer].shape, device=dev,
                                                                                     generator=g)
        steps.append([q.bfloat16() for q in q0])
    fixed = [dict(w=torch.rand(B, 1, 64, device=dev, generator=g) / 8,
                  q=torch.randn(B, 1, 128, 576, device=dev, generator=g).bfloat16(),
                  lat=pack_latent(torch.randn(B, 512, device=dev, generator=g),
                                  torch.randn(B, 64, device=dev, generator=g)),
                  key=pack_indexer_key(torch.randn(B, 128, device=dev, generator=g))) for _ in range(LAYERS)]
    return dict(host=host, latents=latents, index_cache=index_cache, req_to_token=req_to_token, rows=rows,
                steps=steps, fixed=fixed, width=width)


def _batch(w, s, seq_lens=None, new_locs=None):
    seq = torch.full((B,), CTX + s + 1, dtype=torch.int64, device="cuda")
    loc = w["rows"].long() * w["width"] + CTX + s
    if seq_lens is not None:
        seq_lens.copy_(seq)
        new_locs.copy_(loc)
        return DecodeBatch(w["req_to_token"], w["rows"], seq_lens, new_locs)
    return DecodeBatch(w["req_to_token"], w["rows"], seq, loc)


def _inputs(w, s, q_index=None):
    out = []
    for layer in range(LAYERS):
        f = w["fixed"][layer]
        qi = w["steps"][s][layer]
        if q_index is not None:
            q_index[layer].copy_(qi)
            qi = q_index[layer]
        out.append(LayerInputs(qi, f["w"], f["q"], f["lat"], f["key"]))
    return out


def _ess(w, modes, prefetch=False, dba_attention="whole", new_tokens="on_demand", prefetch_chunks=1,
         prefetch_layers=None, spare=0, prefetch_indexer="serial", threshold_update="side", resolve_pdl=None,
         last_chunk_priority="high", prefetch_pdl=None, prefetch_split="rows", last_chunk_prefetch=True,
         refill_priority="high"):
    slots = math.ceil(0.25 * B * CTX / 64) * 64
    m = HotPoolCacheManager(w["host"], slots, max_selected=B * TOPK, spare_slots=spare, resolve_pdl=resolve_pdl)
    recent = slots // B - 64
    for layer in range(LAYERS):
        m.warm_up(layer, w["req_to_token"][:, CTX - recent:CTX].reshape(-1))
    pf = EchoPrefetcher(LAYERS, B, w["width"], device="cuda", pdl=prefetch_pdl) if prefetch or prefetch_layers else None
    opts = StackOptions(modes=modes, top_k=TOPK, prefetch=prefetch, dba_attention=dba_attention,
                        new_tokens=new_tokens, prefetch_chunks=prefetch_chunks, prefetch_layers=prefetch_layers,
                        prefetch_indexer=prefetch_indexer, threshold_update=threshold_update,
                        last_chunk_priority=last_chunk_priority, prefetch_split=prefetch_split,
                        last_chunk_prefetch=last_chunk_prefetch, refill_priority=refill_priority)
    return EssDecodeStack(m, w["index_cache"], w["width"], opts, max_batch=B, prefetcher=pf)


def _hbm(w, modes, split=False):
    return HbmDecodeStack(w["latents"], w["index_cache"], w["width"], StackOptions(modes=modes, top_k=TOPK),
                          split_attention=split)


@pytest.fixture(scope="module")
def reference(world):
    """All-HBM outputs of every step: whole-batch and split attention."""
    whole, split = _hbm(world, ["sync"] * LAYERS), _hbm(world, ["dba"] * LAYERS, split=True)
    out_w, out_s = [], []
    for s in range(STEPS):
        out_w.append([o.clone() for o in whole.step(_batch(world, s), _inputs(world, s))])
        out_s.append([o.clone() for o in split.step(_batch(world, s), _inputs(world, s))])
    return out_w, out_s


@pytest.mark.parametrize("mode,prefetch,dba_attention,new_tokens", [
    ("sync", False, "whole", "insert"), ("sync", True, "whole", "insert"), ("dba", True, "whole", "insert"),
    ("dba", False, "split", "insert"),
    # new tokens written back on the side stream, then read back from the host by the resolve when selected
    ("sync", False, "whole", "on_demand"), ("dba", True, "whole", "on_demand"),
    # the indexer in 3 batch chunks, each chunk prefetched beside the next one's indexer
    ("sync", 3, "whole", "on_demand"),
    # spare slots (1,024 per layer: about a step's misses here), refilled beside attention
    ("sync", False, "whole", "spare"), ("sync", 2, "whole", "spare"), ("dba", True, "whole", "spare"),
    ("dba", False, "split", "spare"),
    # the indexer chunks before the last on a high-priority stream of their own, the last on the main stream at once
    ("sync", 3, "whole", "overlapped"), ("sync", 2, "whole", "spare, overlapped"),
    # every case above runs the defaults: the thresholds' EMA update beside attention (DBA: chunk by chunk) and the
    # resolve's kernels after its lookup with programmatic dependent launch; the alternatives:
    ("sync", 2, "whole", "spare, overlapped, main, nopdl"), ("dba", True, "whole", "main"),
    ("sync", False, "whole", "nopdl"),
    # the last chunk's prefetch at the main stream's priority
    ("sync", 2, "whole", "spare, overlapped, normal"), ("sync", 3, "whole", "normal"),
    ("dba", 2, "whole", "spare, overlapped, normal"),
    # the prefetch's candidate and claim kernels without programmatic dependent launch (on by default on the H200)
    ("sync", 2, "whole", "spare, overlapped, nopfpdl"),
    # the prefetch in segments of the positions (every request's positions lo:hi) instead of batch rows
    ("sync", 3, "whole", "positions"), ("sync", 2, "whole", "spare, overlapped, positions"),
    ("dba", 2, "whole", "spare, overlapped, positions"),
    # the calibrated plan: segments launched one after the other, the last one's misses left to the exact resolve
    ("sync", 3, "whole", "spare, positions, lastoff"), ("sync", 2, "whole", "lastoff"),
    ("sync", 3, "whole", "overlapped, lastoff"), ("dba", 2, "whole", "spare, positions, lastoff"),
    # the segments' indexer launches chained by programmatic dependent launch (the current table's plan,
    # benchmarks/RESULTS.md), by positions and by rows, and in DBA's chunks
    ("sync", 3, "whole", "spare, chained, positions, lastoff"), ("sync", 3, "whole", "chained"),
    ("dba", 2, "whole", "spare, chained, positions"),
    # the refill of the spare slots at the main stream's priority
    ("sync", 3, "whole", "spare, chained, positions, lastoff, lowrefill")])
def test_modes_against_all_in_hbm(world, reference, mode, prefetch, dba_attention, new_tokens):
    variant = new_tokens  # "insert", or the case's other settings ("on_demand" new tokens)
    spare = 1024 if "spare" in variant else 0
    indexer = "overlapped" if "overlapped" in variant else "chained" if "chained" in variant else "serial"
    update = "main" if "main" in variant else "side"
    new_tokens = "insert" if variant == "insert" else "on_demand"
    ess = _ess(world, [mode] * LAYERS, bool(prefetch), dba_attention, new_tokens, prefetch_chunks=max(1, int(prefetch)),
               spare=spare, prefetch_indexer=indexer, threshold_update=update,
               resolve_pdl=False if "nopdl" in variant else None,
               last_chunk_priority="normal" if "normal" in variant else "high",
               prefetch_pdl=False if "nopfpdl" in variant else None,
               prefetch_split="positions" if "positions" in variant else "rows",
               last_chunk_prefetch="lastoff" not in variant,
               refill_priority="normal" if "lowrefill" in variant else "high")
    assert ess.m._fused.pdl == ("nopdl" not in variant)  # (the H200: on by default)
    assert ess.prefetcher is None or ess.prefetcher.pdl == ("nopfpdl" not in variant)
    assert ess.options.last_chunk_priority == ("normal" if "normal" in variant else "high")
    assert ess.options.last_chunk_prefetch == ("lastoff" not in variant)
    assert ess._chain == ("chained" in variant)  # (the H200 and the Triton indexer: chained where asked)
    for s in range(STEPS):
        got = ess.step(_batch(world, s), _inputs(world, s))
        for layer in range(LAYERS):
            want = reference[1 if dba_attention == "split" else 0][s][layer]
            assert torch.equal(got[layer], want), f"{mode} prefetch={prefetch}: step {s} layer {layer}"
    c = ess.m.counters.sum(0).cpu()
    hit = int(c[Counter.HITS]) / int(c[Counter.LOOKUPS])
    print(f"\n{mode} prefetch={prefetch} new_tokens={new_tokens} spare={spare}: hit {hit:.3f}, "
          f"misses {int(c[Counter.MISSES])}, evictions {int(c[Counter.EVICTIONS])}, "
          f"prefetched {int(c[Counter.PREFETCHED])} (useful {int(c[Counter.PREFETCH_USEFUL])})")
    assert int(c[Counter.MISSES]) > 0 and int(c[Counter.OVERFLOW]) == 0
    if spare:
        assert bool((ess.m.spare_taken < spare).all())
    if prefetch:  # useful > 0: the settle ran after the exact resolve stamped this step's selection
        assert int(c[Counter.PREFETCHED]) > 0 and int(c[Counter.PREFETCH_USEFUL]) > 0
        assert int(c[Counter.PREFETCH_USEFUL]) + int(c[Counter.PREFETCH_WASTED]) == int(c[Counter.PREFETCHED])
        rows = _batch(world, 0).req_pool_indices.long()
        assert bool(torch.isfinite(ess.prefetcher.threshold[:, rows]).all())  # every row's EMA was updated
    ess.m.check_invariants()


@pytest.mark.parametrize("modes,prefetch_chunks,spare,indexer", [
    (["sync", "dba"], 1, 0, "serial"), (["sync", "dba"], 2, 0, "serial"),
    (["sync", "sync"], (2, 0), 0, "serial"),  # a tuple: per layer (a profile's)
    (["sync", "dba"], 2, 1024, "serial"), (["dba", "sync"], (0, 2), 1024, "serial"),
    (["sync", "sync"], 3, 1024, "overlapped"), (["sync", "dba"], (2, 0), 0, "overlapped"),
    (["dba", "dba"], 2, 1024, "overlapped"),
    # the alternatives to the defaults: the thresholds' update at the layer's end, no PDL in the resolve
    (["sync", "dba"], 2, 1024, "overlapped, main, nopdl"),
    # the last chunk's prefetch at the main stream's priority
    (["sync", "sync"], 3, 1024, "overlapped, normal"), (["dba", "sync"], 2, 1024, "overlapped, normal"),
    # the prefetch's kernels without programmatic dependent launch
    (["sync", "sync"], 2, 1024, "overlapped, nopfpdl"),
    # the prefetch in segments of the positions
    (["sync", "sync"], 3, 1024, "overlapped, positions"), (["dba", "sync"], 2, 1024, "overlapped, positions"),
    # the last segment's misses left to the exact resolve
    (["sync", "sync"], 3, 1024, "serial, positions, lastoff"),
    # the segments' indexer launches chained (the current table's plan, benchmarks/RESULTS.md)
    (["sync", "sync"], 3, 1024, "chained, positions, lastoff"), (["dba", "sync"], 2, 1024, "chained")])
def test_whole_step_in_one_cuda_graph(world, reference, modes, prefetch_chunks, spare, indexer):
    """Capture a step with prefetch and mixed modes; replaying it over later steps gives what the all-HBM stack and
    the same steps run eagerly give, bit for bit; every prefetched entry replayed is counted useful or wasted exactly
    once."""
    seq_lens = torch.zeros(B, dtype=torch.int64, device="cuda")
    new_locs = torch.zeros(B, dtype=torch.int64, device="cuda")
    q_index = [torch.zeros(B, 1, 64, 128, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    per_layer = isinstance(prefetch_chunks, tuple)
    eager, graphed = (_ess(world, modes, prefetch=not per_layer, prefetch_chunks=1 if per_layer else prefetch_chunks,
                           prefetch_layers=prefetch_chunks if per_layer else None, spare=spare,
                           prefetch_indexer=indexer.split(",")[0],
                           threshold_update="main" if "main" in indexer else "side",
                           resolve_pdl=False if "nopdl" in indexer else None,
                           last_chunk_priority="normal" if "normal" in indexer else "high",
                           prefetch_pdl=False if "nopfpdl" in indexer else None,
                           prefetch_split="positions" if "positions" in indexer else "rows",
                           last_chunk_prefetch="lastoff" not in indexer) for _ in range(2))
    for s in range(3):  # warm-up (Triton compiles) on both
        for st in (eager, graphed):
            st.step(_batch(world, s), _inputs(world, s))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    batch, inputs = _batch(world, 3, seq_lens, new_locs), _inputs(world, 3, q_index)
    with torch.cuda.graph(graph):
        outs = graphed.step(batch, inputs)
    for s in range(3, STEPS):
        _batch(world, s, seq_lens, new_locs)
        _inputs(world, s, q_index)
        graph.replay()
        want = eager.step(_batch(world, s), _inputs(world, s))
        for layer in range(LAYERS):
            exact = reference[0][s][layer]
            assert torch.equal(outs[layer], exact) and torch.equal(want[layer], exact), f"step {s} layer {layer}"
    # the thresholds moved in the graph as in the eager run (the update is in the capture, wherever it is queued)
    assert torch.equal(graphed.prefetcher.threshold, eager.prefetcher.threshold)
    assert bool(torch.isfinite(graphed.prefetcher.threshold).any())
    c = graphed.m.counters.sum(0).cpu()
    assert int(c[Counter.PREFETCHED]) > 0 and int(c[Counter.PREFETCH_USEFUL]) > 0  # settled after the exact resolve
    assert int(c[Counter.PREFETCH_USEFUL]) + int(c[Counter.PREFETCH_WASTED]) == int(c[Counter.PREFETCHED])
    if per_layer:  # only the profile's prefetch layers prefetched
        per = graphed.m.counters[:, Counter.PREFETCHED].cpu()
        assert all((int(per[layer]) > 0) == bool(n) for layer, n in enumerate(prefetch_chunks)), per
    if spare:  # the replays took spare slots and refilled them
        assert bool((graphed.m.spare_taken < spare).all()) and int(c[Counter.EVICTIONS]) > 0
    graphed.m.check_invariants()


def test_all_resident_batch_is_bit_identical_and_moves_nothing(world, reference):
    """Every token loaded and every future token's slot reserved: one lookup per layer, no H2D traffic."""
    slots = math.ceil(B * world["width"] / 64) * 64
    m = HotPoolCacheManager(world["host"], slots, max_selected=B * TOPK)
    for layer in range(LAYERS):
        m.warm_up(layer, world["req_to_token"][:, :CTX].reshape(-1))
        m.reserve(layer, world["req_to_token"][:, CTX:].reshape(-1))
    m.counters.zero_()
    ess = EssDecodeStack(m, world["index_cache"], world["width"], StackOptions(modes=["sync"] * LAYERS, top_k=TOPK),
                         max_batch=B)
    for s in range(STEPS):
        got = ess.step(_batch(world, s), _inputs(world, s), all_resident=True)
        for layer in range(LAYERS):
            assert torch.equal(got[layer], reference[0][s][layer]), f"step {s} layer {layer}"
    c = m.counters.sum(0).cpu()
    assert int(c[Counter.NOT_RESIDENT]) == 0 and int(c[Counter.H2D_ENTRIES]) == 0 and int(c[Counter.EVICTIONS]) == 0
    assert int(c[Counter.HITS]) == int(c[Counter.LOOKUPS]) > 0
