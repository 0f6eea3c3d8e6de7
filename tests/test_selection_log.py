"""decode_layers.py's correctness check says why an exact mode is not bit-identical: the recorded selections of
each stack's top-k (`SelectionLog`) and their comparison (`compare_selections`), on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_layers as dl  # noqa: E402


def _scores(B=4, T=60, seed=0):
    """Indexer-like scores: -inf past each request's length, as the indexer writes them."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.tensor([60, 40, 33, 12])
    scores = torch.randn(B, 1, T, generator=g)
    return scores.masked_fill(torch.arange(T).view(1, 1, T) >= seq.view(B, 1, 1), float("-inf")), seq


def test_a_valid_selection_is_recorded_ascending_and_valid_in_every_row():
    scores, seq = _scores()
    log = dl.SelectionLog("torch")
    pos, _ = log(scores, 8, seq)
    got, valid = log.calls[0]
    assert bool(valid.all())
    want = scores[:, 0].topk(8).indices
    assert torch.equal(got.long(), want.sort(dim=1).values)
    assert torch.equal(pos[:, 0].long().sort(dim=1).values, got.long())  # the stack still gets the top-k's own output


def test_another_selection_is_found_and_judged_row_by_row():
    scores, seq = _scores()
    exact = dl.SelectionLog("torch")
    exact(scores, 8, seq)

    def second_best(s, k, lens):  # row 1 takes its 9th best instead of its 8th: not a valid top-k there
        pos, kth = dl.topk_with_scores(s, k + 1, "torch")
        pos = pos[..., :k].clone()
        pos[1, 0, k - 1] = pos.new_tensor(int(dl.topk_with_scores(s, k + 1, "torch")[0][1, 0, k]))
        return pos, None

    other = dl.SelectionLog(second_best)
    other(scores, 8, seq)
    assert not bool(other.calls[0][1][1]) and bool(other.calls[0][1][[0, 2, 3]].all())
    assert dl.compare_selections(other, exact, 4) == dict(
        same_selection=False, rows_selected_otherwise=1, of_those_not_a_valid_topk=1, of_those_hbm_not_a_valid_topk=0)
    assert dl.compare_selections(exact, exact, 4)["same_selection"]


def test_chunked_calls_are_joined_into_whole_batch_selections():
    scores, seq = _scores()
    whole, chunks = dl.SelectionLog("torch"), dl.SelectionLog("torch")
    for _ in range(2):  # two layers: the whole batch at once, or in chunks of 3 and 1 rows (DBA)
        whole(scores, 8, seq)
        chunks(scores[:3], 8, seq[:3])
        chunks(scores[3:], 8, seq[3:])
    assert len(chunks.per_layer(4)) == 2
    assert dl.compare_selections(chunks, whole, 4)["same_selection"]


def test_too_few_repeated_or_hidden_positions_are_not_a_valid_top_k():
    scores, seq = _scores()
    exact = dl.SelectionLog("torch")
    pos, _ = exact(scores, 8, seq)

    def spoiled(s, k, lens):
        p = pos.clone()
        p[0, 0, 0] = -1  # one position short
        p[1, 0, 1] = p[1, 0, 0]  # one twice
        p[2, 0, 2] = 50  # past the request's 33 positions
        return p, None

    bad = dl.SelectionLog(spoiled)
    bad(scores, 8, seq)
    assert bad.calls[0][1].tolist() == [False, False, False, True]


def test_a_replayed_selection_gives_the_recorded_positions_call_by_call_and_chunk_by_chunk():
    scores, seq = _scores()
    other_scores, _ = _scores(seed=1)
    hbm = dl.SelectionLog("torch")
    for s in (scores, other_scores):  # two layers' whole-batch selections
        hbm(s, 8, seq)
    replay = dl.ReplayedSelection(hbm, 4)
    first, kth = replay(other_scores, 8, seq)  # whatever the scores, the first recorded selection, in its order
    assert kth is None and torch.equal(first[:, 0], hbm.given[0])
    assert torch.equal(first[:, 0].long(), dl.topk_with_scores(scores, 8, "torch")[0][:, 0].long())  # (score order)
    a, _ = replay(scores[:3], 8, seq[:3])  # then the second, in a DBA chunk of 3 rows and one of 1
    b, _ = replay(scores[3:], 8, seq[3:])
    assert torch.equal(torch.cat([a, b])[:, 0], hbm.given[1])
    with pytest.raises(RuntimeError, match="more top-k calls than the 2 recorded"):
        replay(scores, 8, seq)


@pytest.mark.parametrize("argv,expected", [
    (["--modes", "sync,prefetch", "--last-chunk-prefetch", "off"],
     "--last-chunk-prefetch off: no prefetchN mode (N >= 2) or layerwise in --modes has a last chunk to leave out"),
    (["--modes", "sync,prefetch3", "--last-chunk-prefetch", "off", "--last-chunk-margin", "0"],
     "last_chunk_margin sets the last chunk's prefetch, which last_chunk_prefetch=False drops"),
    (["--modes", "sync,prefetch2", "--last-chunk-prefetch", "off", "--last-chunk-priority", "normal"],
     "last_chunk_priority sets the last chunk's prefetch, which last_chunk_prefetch=False drops"),
    (["--overlap-copy-rows", "12"], "overlap_copy_rows must be a power of two from 1 to 64, got 12"),
    (["--chunk-indexer-tiles", "0"], "--chunk-indexer-tiles: a whole number >= 1 or 'kernel', got '0'"),
    (["--chunk-indexer-tiles", "eight"], "--chunk-indexer-tiles: a whole number >= 1 or 'kernel', got 'eight'"),
])
def test_decode_layers_refuses_a_last_chunk_setting_with_nothing_to_act_on(monkeypatch, capsys, argv, expected):
    """Checked from the command line alone, before any pool is allocated (CUDA faked present: nothing reaches it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    with pytest.raises(SystemExit) as exc:
        dl.main(argv + ["--out", "/nonexistent"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and expected in err
    assert "--last-chunk-prefetch off:" in expected or "stack options from the command line" in err or \
        "--chunk-indexer-tiles:" in expected  # (argparse's own refusal of the value)


def test_decode_layers_chunk_indexer_tiles_takes_a_count_or_the_kernels_own():
    assert dl._tiles_arg("kernel") is None and dl._tiles_arg("4") == 4
