"""The one-launch prefetch claim (`HotPoolCacheManager.prefetch_above`, `kernels/prefetch.claim_above_triton`) against
its definition: the Triton candidates (`EchoPrefetcher.candidates`) followed by the spare-only claim
(`HotPoolCacheManager.prefetch`), state for state under TRITON_INTERPRET."""

import ess_sglang.kernels.prefetch as kp
import pytest
import torch
from ess_sglang.kernels.prefetch import TILE, new_claim_counters

from ess_sglang.cache_manager import Counter, FetchList, HotPoolCacheManager
from ess_sglang.host_pool import HostTotalPool
from ess_sglang.prefetch import EchoPrefetcher

B, Q, T, ROWS, TOKENS = 3, 2, 2600, 5, 14000


def pool(spare, seed=0, resolve_impl="triton"):
    """A one-layer pool of 512 slots: 300 random entries resident, then `spare` of them made spare slots."""
    host = HostTotalPool(1, TOKENS, device="cpu")
    host.entries.copy_(torch.randint(0, 256, host.entries.shape, dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(seed)))
    m = HotPoolCacheManager(host, 512, device="cpu", max_selected=4096, resolve_impl=resolve_impl,
                            spare_slots=spare)
    m.warm_up(0, torch.randperm(TOKENS, generator=torch.Generator().manual_seed(1))[:300])
    m.begin_step()
    m.refill_spares(0)
    return m


def scores(seed=4, duplicates=False):
    g = torch.Generator().manual_seed(seed)
    req_to_token = torch.randperm(TOKENS, generator=g)[:ROWS * T].view(ROWS, T).int()
    req_to_token[0, 5:9] = -1  # table holes
    req_to_token[0, 9] = TOKENS + 5  # a location outside the pool: never read
    if duplicates:  # requests naming each other's locations (a shared prefix)
        req_to_token[1, :T // 2] = req_to_token[4, :T // 2]
        req_to_token[0, 100:110] = req_to_token[0, 200:210]
    logits = torch.randn(B, Q, T, generator=g) * 2
    return req_to_token, logits, torch.tensor([4, 1, 0]), torch.tensor([T, 900, 1500])


def state(m):
    return dict(loc_to_slot=m.loc_to_slot, slot_to_loc=m.slot_to_loc, slot_stamp=m.slot_stamp,
                spare_taken=m.spare_taken, spare=m.spare, counters=m.counters, hot=m.hot_entries[0])


def prefetcher(cap_fraction, margin=0.0, impl="triton"):
    pf = EchoPrefetcher(1, ROWS, T, cap_fraction=cap_fraction, cap_min_tokens=7, impl=impl, margin=margin)
    pf.threshold[0] = torch.tensor([1.5, 2.0, 1.0, 0.0, float("-inf")])
    return pf


@pytest.fixture
def launches(monkeypatch):
    """How many times the one-launch kernel ran."""
    calls = []
    run = kp.claim_above_triton

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(kp, "claim_above_triton", counted)
    return calls


# spare slots, cap fraction, positions [lo, hi), margin, request rows: every candidate fits / the cap binds / the spare
# slots run out / a segment / a segment of a short request / a margin / a request row outside the table
CASES = [(400, 1.0, 0, 1300, 0.0, (4, 1, 0)), (400, 0.02, 0, T, 0.0, (4, 1, 0)), (64, 0.02, 0, T, 0.0, (4, 1, 0)),
         (16, 1.0, 0, T, 0.0, (4, 1, 0)), (400, 1.0, 1024, T, 0.0, (4, 1, 0)), (400, 0.05, 0, 1300, 0.0, (3, 1, 0)),
         (400, 0.02, 0, T, 0.3, (4, 1, 0)), (200, 0.1, 0, T, 0.0, (4, ROWS + 2, -1))]


@pytest.mark.parametrize("spare,cap_fraction,lo,hi,margin,rows", CASES)
def test_one_launch_claim_equals_candidates_then_claim(spare, cap_fraction, lo, hi, margin, rows, launches):
    req_to_token, logits, _, seq = scores()
    rpi = torch.tensor(rows)
    pf = prefetcher(cap_fraction, margin)
    want_m, got_m = pool(spare), pool(spare)
    want_list, got_list = want_m.new_fetch_list(B * pf.width), got_m.new_fetch_list(B * pf.width)
    seg = logits[..., lo:hi]
    cand = pf.candidates(0, seg, req_to_token, rpi, seq, want_m.loc_to_slot[0], want_m.num_locations, first_pos=lo)
    want_m.prefetch(0, cand, want_list)
    counters = new_claim_counters(B, "cpu")
    got_m.prefetch_above(0, pf.scored(0, seg, req_to_token, rpi, seq, first_pos=lo), got_list, counters)
    assert launches == [1]
    want, got = state(want_m), state(got_m)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    n = int(want_list.count)
    assert int(got_list.count) == n and n == int(want_m.counters[0, Counter.PREFETCHED]) > 0
    assert torch.equal(got_list.src[:n], want_list.src[:n]) and torch.equal(got_list.dst[:n], want_list.dst[:n])
    assert not bool(counters.any()), "the launch leaves its counters zero for the next one"
    got_m.check_invariants()
    # the exact resolve's settle counts the same useful and wasted entries on both
    for m in (want_m, got_m):
        m.settle_prefetch(0)
    assert torch.equal(got_m.counters, want_m.counters)


def test_one_launch_claim_with_shared_locations_claims_each_once(launches):
    """Two positions naming one location (a shared prefix): one claim wins, the location is prefetched once, and the
    maps stay consistent; a location another program already prefetched is resident for the later ones."""
    req_to_token, logits, rpi, seq = scores(duplicates=True)
    pf = prefetcher(1.0)
    pf.threshold[0] = 4.5  # a few dozen candidates: all fit in the spare slots
    m = pool(200)
    cand = pf.candidates(0, logits, req_to_token, rpi, seq, m.loc_to_slot[0].clone(), m.num_locations)
    wanted = cand[cand >= 0].unique()
    assert wanted.numel() < (cand >= 0).sum() and 0 < wanted.numel() <= 200 - int(m.spare_taken[0]), \
        "the test wants shared candidates, all of which fit"
    fl = m.new_fetch_list(B * pf.width)
    m.prefetch_above(0, pf.scored(0, logits, req_to_token, rpi, seq), fl, new_claim_counters(B, "cpu"))
    assert launches == [1]
    n = int(fl.count)
    src, dst = fl.src[:n], fl.dst[:n]
    assert n == wanted.numel() and torch.equal(src.sort().values, wanted)
    assert torch.equal(m.loc_to_slot[0][src].long(), dst) and torch.equal(m.slot_to_loc[0][dst].long(), src)
    assert int(m.counters[0, Counter.PREFETCHED]) == n
    m.check_invariants()


def test_one_launch_claim_needs_spare_slots_the_fused_resolve_and_triton_candidates(launches):
    """Elsewhere prefetch_above is candidates, then prefetch: the same state, no one-launch kernel."""
    req_to_token, logits, rpi, seq = scores()
    for spare, resolve_impl, impl in ((0, "triton", "triton"), (64, "torch", "triton"), (64, "triton", "torch")):
        pf = prefetcher(0.02, impl=impl)
        want_m, got_m = pool(spare, resolve_impl=resolve_impl), pool(spare, resolve_impl=resolve_impl)
        cand = pf.candidates(0, logits, req_to_token, rpi, seq, want_m.loc_to_slot[0], want_m.num_locations)
        want_m.prefetch(0, cand, want_m.new_fetch_list(B * pf.width))
        got_m.prefetch_above(0, pf.scored(0, logits, req_to_token, rpi, seq), got_m.new_fetch_list(B * pf.width),
                             new_claim_counters(B, "cpu"))
        want, got = state(want_m), state(got_m)
        for name in want:
            assert torch.equal(got[name], want[name]), (spare, resolve_impl, impl, name)
        assert int(got_m.counters[0, Counter.PREFETCHED]) > 0 or spare == 0
    assert launches == []


def test_one_launch_claim_refuses_bad_scratch_and_short_lists_before_reading_anything(launches):
    req_to_token, logits, rpi, seq = scores()
    pf = prefetcher(0.02)
    m = pool(64)
    before = {k: v.clone() for k, v in state(m).items()}
    scored = pf.scored(0, logits, req_to_token, rpi, seq)
    with pytest.raises(ValueError, match="prefetch_above\\(layer 1\\): the scores are layer 0's"):
        m.prefetch_above(1, scored, m.new_fetch_list(B * pf.width), new_claim_counters(B, "cpu"))
    with pytest.raises(ValueError, match="claim counters for 3 requests"):
        m.prefetch_above(0, scored, m.new_fetch_list(B * pf.width), new_claim_counters(B - 1, "cpu"))
    with pytest.raises(ValueError, match="claim counters"):
        m.prefetch_above(0, scored, m.new_fetch_list(B * pf.width), torch.zeros(B + 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="prefetch_above: the fetch list holds"):
        m.prefetch_above(0, scored, m.new_fetch_list(B * pf.width - 1), new_claim_counters(B, "cpu"))
    with pytest.raises(ValueError, match="must lie within"):
        pf.scored(0, logits[..., :100], req_to_token, rpi, seq, first_pos=T - 50)
    with pytest.raises(ValueError, match="margin"):
        pf.scored(0, logits, req_to_token, rpi, seq, margin=1.5)
    after = state(m)
    for name in before:
        assert torch.equal(after[name], before[name]), name


def test_a_second_prefetch_into_an_unsettled_list_is_refused(launches):
    req_to_token, logits, rpi, seq = scores()
    pf = prefetcher(0.02)
    m = pool(256)
    fl = m.new_fetch_list(B * pf.width)
    counters = new_claim_counters(B, "cpu")
    m.prefetch_above(0, pf.scored(0, logits[..., :TILE], req_to_token, rpi, seq), fl, counters)
    with pytest.raises(ValueError, match="overlaps the list of a prefetch of this layer"):
        m.prefetch_above(0, pf.scored(0, logits[..., TILE:], req_to_token, rpi, seq, first_pos=TILE), fl, counters)
    # its own list: fine; both are settled
    m.prefetch_above(0, pf.scored(0, logits[..., TILE:], req_to_token, rpi, seq, first_pos=TILE),
                     m.new_fetch_list(B * pf.width), counters)
    assert len(launches) == 2 and len(m._unsettled_prefetch[1]) == 2


def test_the_torch_copy_and_settle_read_only_the_first_count_pairs():
    """A list whose tail past `count` holds stale pairs (the one-launch claim leaves it as it was): the torch copy
    copies none of them, and the torch settle counts none of them."""
    host = HostTotalPool(1, 256, device="cpu")
    host.entries.copy_(torch.randint(0, 256, host.entries.shape, dtype=torch.uint8))
    m = HotPoolCacheManager(host, 64, device="cpu", copy_impl="torch")
    m.begin_step()
    m.warm_up(0, torch.arange(3, 7))  # slots 0-3 hold locations 3-6, so every pair of the list would count
    fl = FetchList(torch.tensor([3, 4, 5, 6]), torch.tensor([0, 1, 2, 3]), torch.tensor([2]))
    m.hot_entries[0].zero_()
    m.fetch(0, fl)
    assert torch.equal(m.hot_entries[0][:2], host.entries[0][3:5]) and not bool(m.hot_entries[0][2:].any())
    src, dst = fl.real_pairs()
    assert src.tolist() == [3, 4, -1, -1] and dst.tolist() == [0, 1, -1, -1]
    m._mark_unsettled(0, fl)
    m.settle_prefetch(0)
    c = m.counters[0]
    assert int(c[Counter.PREFETCH_USEFUL]) + int(c[Counter.PREFETCH_WASTED]) == 2


def test_one_launch_claim_with_no_spare_slot_left_claims_nothing(launches):
    """A second prefetch after the first took every spare slot: no claim, no map change, count 0, as the separate
    kernels (whose claims are all given back)."""
    req_to_token, logits, rpi, seq = scores()
    pf = prefetcher(1.0)
    pair = [pool(32), pool(32)]
    for m in pair:
        m.prefetch_above(0, pf.scored(0, logits[..., :TILE], req_to_token, rpi, seq), m.new_fetch_list(B * pf.width),
                         new_claim_counters(B, "cpu"))
        assert int(m.spare_taken[0]) == 32
    want_m, got_m = pair
    seg = logits[..., TILE:]
    cand = pf.candidates(0, seg, req_to_token, rpi, seq, want_m.loc_to_slot[0], want_m.num_locations, first_pos=TILE)
    assert int((cand >= 0).sum()) > 0
    want_m.prefetch(0, cand, want_m.new_fetch_list(B * pf.width))
    got_list, counters = got_m.new_fetch_list(B * pf.width), new_claim_counters(B, "cpu")
    got_m.prefetch_above(0, pf.scored(0, seg, req_to_token, rpi, seq, first_pos=TILE), got_list, counters)
    assert len(launches) == 3 and int(got_list.count) == 0 and not bool(counters.any())
    want, got = state(want_m), state(got_m)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    got_m.check_invariants()


def test_one_launch_claim_counters_serve_any_batch_up_to_their_size(launches):
    """Counters made for 3 requests, used by a launch of 2 then one of 3 (and one of none): each leaves them zero,
    and each equals the separate kernels."""
    req_to_token, logits, rpi, seq = scores()
    pf = prefetcher(0.05)
    want_m, got_m = pool(400), pool(400)
    counters = new_claim_counters(B, "cpu")
    for lo, hi, rows in ((0, 1300, slice(0, 2)), (1300, T, slice(0, 3)), (0, 1300, slice(0, 0))):
        seg, r, n = logits[rows, :, lo:hi], rpi[rows], seq[rows]
        want_list, got_list = want_m.new_fetch_list(B * pf.width), got_m.new_fetch_list(B * pf.width)
        cand = pf.candidates(0, seg, req_to_token, r, n, want_m.loc_to_slot[0], want_m.num_locations, first_pos=lo)
        want_m.prefetch(0, cand, want_list)
        got_m.prefetch_above(0, pf.scored(0, seg, req_to_token, r, n, first_pos=lo), got_list, counters)
        assert not bool(counters.any()) and int(got_list.count) == int(want_list.count)
        want, got = state(want_m), state(got_m)
        for name in want:
            assert torch.equal(got[name], want[name]), (lo, name)
    assert len(launches) == 3 and int(got_m.counters[0, Counter.PREFETCHED]) > 0
