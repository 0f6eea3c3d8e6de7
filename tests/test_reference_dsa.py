"""The plain-torch DSA pieces the demo and the lossless tests are built on."""

import torch

from ess_sglang.formats import pack_indexer_key, pack_latent, unpack_indexer_key, unpack_latent
from ess_sglang.reference.dsa import causal_lengths, indexer_logits, sparse_mla_reference, topk_positions
from ess_sglang.warmup import warmup_positions


def test_sparse_mla_matches_a_direct_computation_and_ignores_padding():
    g = torch.Generator().manual_seed(0)
    entries = pack_latent(torch.randn(50, 512, generator=g), torch.randn(50, 64, generator=g))
    q = torch.randn(2, 1, 4, 576, generator=g)
    idx = torch.tensor([[[3, 7, 11, -1, 40]], [[0, -1, -1, 49, 1]]], dtype=torch.int32)
    out, lse = sparse_mla_reference(q, entries, idx, softmax_scale=0.05)
    kv = unpack_latent(entries)
    for b in range(2):
        rows = [int(i) for i in idx[b, 0] if i >= 0]
        k = kv[rows]
        s = (q[b, 0] @ k.T) * 0.05
        p = torch.softmax(s, dim=-1)
        assert torch.allclose(out[b, 0], p @ k[:, :512], atol=1e-5)
        assert torch.allclose(lse[b, 0], torch.logsumexp(s, dim=-1), atol=1e-5)
    # changing an entry that only padding points at changes nothing
    entries2 = entries.clone()
    entries2[2] = 0
    out2, _ = sparse_mla_reference(q, entries2, idx, softmax_scale=0.05)
    assert torch.equal(out, out2)


def test_indexer_is_causal_and_reads_only_its_own_request():
    g = torch.Generator().manual_seed(1)
    cache = pack_indexer_key(torch.randn(64, 128, generator=g))
    r2t = torch.full((2, 32), -1, dtype=torch.int32)
    r2t[0, :20] = torch.arange(0, 20)
    r2t[1, :30] = torch.arange(30, 60)
    q = torch.randn(2, 2, 3, 128, generator=g)
    w = torch.rand(2, 2, 3, generator=g)
    logits = indexer_logits(q, w, cache, r2t, torch.tensor([0, 1]), torch.tensor([20, 30]), max_len=32)
    vis = causal_lengths(torch.tensor([20, 30]), 2)
    assert vis.tolist() == [[19, 20], [29, 30]]
    for b in range(2):
        for j in range(2):
            assert torch.isinf(logits[b, j, vis[b, j]:]).all() and torch.isfinite(logits[b, j, : vis[b, j]]).all()
    keys, scale = unpack_indexer_key(cache[30:60])
    want = ((q[1, 1] @ (keys * scale[:, None]).T).relu() * w[1, 1][:, None]).sum(0)
    assert torch.allclose(logits[1, 1, :30], want, atol=1e-4)
    pos = topk_positions(logits, 25)
    assert (pos[0, 0, 19:] == -1).all() and pos[0, 0, :19].sort().values.tolist() == list(range(19))
    assert (pos[1, 1] >= 0).all() and pos[1, 1].max() < 30


def test_warmup_prefers_positions_chosen_by_more_windows_then_recent():
    windows = torch.tensor([[5, 9, 3, -1], [9, 3, 7, 1], [9, 8, 3, 2]])
    assert warmup_positions(12, 8, windows).tolist() == [1, 2, 3, 5, 7, 8, 9]  # the union, when it fits
    assert warmup_positions(10, 10, windows).tolist() == list(range(10))  # the whole prompt fits: all of it
    # budget 3: 9 and 3 (3 votes each), then 8 (one vote, most recent of the one-vote positions)
    assert warmup_positions(10, 3, windows).tolist() == [3, 8, 9]
    assert warmup_positions(10, 4, None).tolist() == [6, 7, 8, 9]  # no windows: the most recent tokens
    assert warmup_positions(7, 5, windows).tolist() == [1, 2, 3, 5]  # positions past the length are dropped
    assert warmup_positions(10, 0, windows).numel() == 0
