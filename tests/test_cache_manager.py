"""The cache manager's per-layer data path: lookup, protect, dedup, evict LRU, fetch, write-back, release."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ess_sglang.cache_manager import Counter, FetchList, HotPoolCacheManager
from ess_sglang.host_pool import HostTotalPool
from ess_sglang.request_table import RequestTable


@pytest.fixture(params=["torch", "triton"])
def impl(request):
    """Every test runs on the plain-torch path and on the fused Triton kernels (interpreted on CPU)."""
    return request.param


def make(layers=2, tokens=2048, slots=256, lengths=(300, 500), seed=0, copy_impl="auto", impl="torch", spare=0,
         refill_interval=1, decay_gamma=None, spare_max_entries=None):
    host = HostTotalPool(layers, tokens, device="cpu")
    host.entries.copy_(torch.randint(0, 256, host.entries.shape, dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(seed)))
    m = HotPoolCacheManager(host, slots, device="cpu", max_selected=1024, copy_impl=copy_impl, resolve_impl=impl,
                            spare_slots=spare, refill_interval=refill_interval, decay_gamma=decay_gamma,
                            spare_max_entries=spare_max_entries)
    table = RequestTable(8, 1024)
    rows = []
    for n in lengths:
        r = table.alloc_row()
        table.set(r, 0, host.alloc(n))
        rows.append(r)
    return m, host, table, torch.tensor(rows), torch.tensor(list(lengths))


def check_slots(m, host, layer, slots, locs):
    ok = locs >= 0
    assert torch.equal(slots >= 0, ok)
    assert torch.equal(m.hot_entries[layer][slots[ok].long()], host.entries[layer][locs[ok]])


def assert_same_state(a, b, where: str) -> None:
    """Two managers hold the same hot entries, maps, stamps, counters and spare counts (the maps' sink elements, the
    last of each, are write-only scratch: not compared)."""
    for name in ("hot_entries", "loc_to_slot", "slot_to_loc", "slot_stamp", "counters", "spare_taken"):
        x, y = getattr(a, name), getattr(b, name)
        if name in ("loc_to_slot", "slot_to_loc", "slot_stamp"):
            x, y = x[:, :-1], y[:, :-1]
        assert torch.equal(x, y), f"{where}: {name}"


def test_resolve_fetches_exactly_the_selection_then_hits(impl):
    m, host, table, rpi, sl = make(impl=impl)
    pos = torch.stack([torch.arange(64).view(1, 64), torch.arange(100, 164).view(1, 64)]).int()
    m.begin_step()
    slots = m.resolve(0, pos, table.req_to_token, rpi, sl)
    locs, _ = m.translate(pos, table.req_to_token, rpi, sl)
    check_slots(m, host, 0, slots, locs)
    c = m.counters[0]
    assert c[Counter.MISSES] == 128 and c[Counter.HITS] == 0 and c[Counter.H2D_ENTRIES] == 128
    assert m.resident_count(1) == 0, "another layer's pool was touched"
    m.begin_step()
    again = m.resolve(0, pos, table.req_to_token, rpi, sl)
    assert torch.equal(again, slots)
    assert c[Counter.HITS] == 128 and c[Counter.MISSES] == 128
    m.check_invariants()


def test_selected_entries_are_never_evicted_in_their_step(impl):
    # The pool holds exactly one step's selection: every slot is protected, and all selected entries are resident.
    m, host, table, rpi, sl = make(slots=128, impl=impl)
    for _ in range(6):
        m.begin_step()
        pos = torch.stack([torch.randperm(300)[:64], torch.randperm(500)[:64]]).view(2, 1, 64).int()
        slots = m.resolve(0, pos, table.req_to_token, rpi, sl)
        locs, _ = m.translate(pos, table.req_to_token, rpi, sl)
        check_slots(m, host, 0, slots, locs)
        assert slots[slots >= 0].unique().numel() == 128
    assert m.counters[0, Counter.OVERFLOW] == 0
    m.check_invariants()


def test_eviction_takes_the_least_recently_used(impl):
    m, host, table, rpi, sl = make(slots=64, lengths=(300,), impl=impl)
    rpi, sl = rpi[:1], sl[:1]
    table_rt = table.req_to_token

    def sel(start):
        return torch.arange(start, start + 32).view(1, 1, 32).int()

    m.begin_step()
    m.resolve(0, sel(0), table_rt, rpi, sl)  # A, step 1
    m.begin_step()
    m.resolve(0, sel(32), table_rt, rpi, sl)  # B, step 2
    m.begin_step()
    m.resolve(0, sel(0), table_rt, rpi, sl)  # A again, step 3: B is now the older
    m.begin_step()
    m.resolve(0, sel(64), table_rt, rpi, sl)  # C evicts B, not A
    a_locs = table_rt[0, 0:32].long()
    b_locs = table_rt[0, 32:64].long()
    assert (m.loc_to_slot[0, a_locs] >= 0).all()
    assert (m.loc_to_slot[0, b_locs] == -1).all()
    assert m.counters[0, Counter.EVICTIONS] == 32
    m.check_invariants()


@pytest.mark.parametrize("gamma", [None, 0.75])
def test_decayed_retention_keeps_the_often_selected_entry(impl, gamma):
    """Position 0 is selected in steps 1-3, positions 1-7 in steps 1 and 4; a miss in step 5 needs one of the 8
    slots. LRU evicts position 0 (least recently selected); decayed selection count (gamma 0.75) keeps it: its
    count, 2.31 x 0.75^2 = 1.30, beats the others' 1.42 x 0.75 = 1.07."""
    m, _, table, rpi, sl = make(layers=1, slots=8, lengths=(300,), impl=impl, decay_gamma=gamma)
    for sel in ([0, 1, 2, 3, 4, 5, 6, 7], [0], [0], [1, 2, 3, 4, 5, 6, 7], [8]):
        m.begin_step()
        m.resolve(0, torch.tensor(sel).view(1, 1, -1).int(), table.req_to_token, rpi, sl)
    loc0 = int(table.req_to_token[int(rpi[0]), 0])
    assert (int(m.loc_to_slot[0, loc0]) >= 0) == (gamma is not None)
    assert int(m.counters[0, Counter.EVICTIONS]) == 1
    m.check_invariants()


def test_decay_retention_table_and_its_bounds():
    """The bonus falls with age (an entry selected long ago gains less from a new selection), never exceeds its
    supremum, and fits above BONUS_SHIFT; a gamma whose bonus would leave the age buckets fewer than 16 steps to order
    slots by is refused, as is one outside (0, 1)."""
    from ess_sglang.kernels.resolve import AGE_BUCKETS, BONUS_SHIFT, MIN_DECAY_STEPS, decay_retention

    for gamma in (0.5, 0.75, 0.9):
        d = decay_retention(gamma)
        b = d.bonus[1:]
        assert bool((b[1:] <= b[:-1]).all()) and int(b[0]) <= d.offset + d.units - 1 and int(b[-1]) == 0
        assert d.offset + MIN_DECAY_STEPS * d.units <= AGE_BUCKETS - 1 and int(b.max()) < 2 ** (63 - BONUS_SHIFT)
    for bad in (0.95, 0.999, 1.0, 0.0):
        with pytest.raises(ValueError, match="gamma"):
            decay_retention(bad)
    with pytest.raises(ValueError, match="gamma 0.95"):  # (the manager refuses it before allocating its pools)
        HotPoolCacheManager(HostTotalPool(1, 64, device="cpu"), 32, device="cpu", decay_gamma=0.95)


def test_duplicates_across_query_tokens_and_requests_share_one_slot(impl):
    m, host, table, rpi, sl = make(lengths=(300, 300), impl=impl)
    shared = table.req_to_token[0, :300].clone()
    table.set(1, 0, shared)  # two requests on one prefix (radix-cache sharing)
    pos = torch.arange(40).view(1, 1, 40).expand(2, 2, 40).int().contiguous()  # q_tokens = 2, same positions
    m.begin_step()
    slots = m.resolve(0, pos, table.req_to_token, rpi, sl)
    assert torch.equal(slots[0, 0], slots[1, 1])
    assert m.counters[0, Counter.MISSES] == 40 and m.counters[0, Counter.LOOKUPS] == 160
    locs, _ = m.translate(pos, table.req_to_token, rpi, sl)
    check_slots(m, host, 0, slots, locs)
    m.check_invariants()


def test_bad_indices_are_masked_and_counted(impl):
    m, host, table, rpi, sl = make(impl=impl)
    pos = torch.full((2, 1, 8), -1, dtype=torch.int32)
    pos[0, 0, :4] = torch.tensor([0, 300, 299, -2])  # 300 is past request 0's length; -2 is not padding
    pos[1, 0, :3] = torch.tensor([499, 500, 10**6])
    m.begin_step()
    slots = m.resolve(0, pos, table.req_to_token, rpi, sl)
    assert slots[0, 0].tolist()[:4] == [slots[0, 0, 0].item(), -1, slots[0, 0, 2].item(), -1]
    assert (slots[0, 0, [0, 2]] >= 0).all() and slots[1, 0, 0] >= 0 and (slots[1, 0, 1:] == -1).all()
    assert m.counters[0, Counter.BAD_INDICES] == 4
    assert m.counters[0, Counter.LOOKUPS] == 3


def test_a_corrupt_table_entry_is_never_read(impl):
    m, host, table, rpi, sl = make(impl=impl)
    table.req_to_token[0, 5] = 10**7  # a location outside the pool
    m.begin_step()
    slots = m.resolve(0, torch.tensor([[[5, 6]]]).int().expand(2, 1, 2).contiguous(), table.req_to_token, rpi, sl)
    assert slots[0, 0, 0] == -1 and slots[0, 0, 1] >= 0
    assert m.counters[0, Counter.BAD_INDICES] == 1


def test_write_new_tokens_reaches_host_and_hot_pool(impl):
    m, host, table, rpi, sl = make(impl=impl)
    new = host.alloc(2)
    entries = torch.randint(0, 256, (2, 656), dtype=torch.uint8)
    m.begin_step()
    slots = m.write_new_tokens(1, new, entries)
    assert torch.equal(host.entries[1][new], entries)
    assert torch.equal(m.hot_entries[1][slots], entries)
    assert torch.equal(m.loc_to_slot[1, new].long(), slots)
    # rewriting a resident token (e.g. a re-verified draft) updates it in place
    entries2 = torch.randint(0, 256, (2, 656), dtype=torch.uint8)
    again = m.write_new_tokens(1, new, entries2)
    assert torch.equal(again, slots) and torch.equal(m.hot_entries[1][slots], entries2)
    assert m.counters[1, Counter.D2H_ENTRIES] == 4 and m.counters[1, Counter.NEW_TOKENS] == 2
    m.check_invariants()


def test_release_frees_every_layer(impl):
    m, host, table, rpi, sl = make(impl=impl)
    pos = torch.arange(64).view(1, 1, 64).expand(2, 1, 64).int().contiguous()
    m.begin_step()
    for layer in range(2):
        m.resolve(layer, pos, table.req_to_token, rpi, sl)
    m.release(table.req_to_token[0, :300])
    for layer in range(2):
        assert m.resident_count(layer) == 64
    m.release(table.req_to_token[1, :500])
    assert m.resident_count(0) == m.resident_count(1) == 0
    m.check_invariants()


def test_warm_up_loads_and_counts(impl):
    m, host, table, rpi, sl = make(impl=impl)
    locs = table.req_to_token[0, 200:300]
    slots = m.warm_up(0, torch.cat([locs, locs[:10], torch.tensor([-1], dtype=torch.int32)]))
    assert torch.equal(m.hot_entries[0][slots[:100]], host.entries[0][locs.long()])
    assert m.counters[0, Counter.WARMUP_ENTRIES] == 100
    m.check_invariants()


def test_triton_copy_path_matches():
    results = []
    for copy_impl in ("torch", "triton"):
        m, host, table, rpi, sl = make(seed=3, copy_impl=copy_impl)
        pos = torch.stack([torch.arange(0, 48), torch.arange(200, 248)]).view(2, 1, 48).int()
        m.begin_step()
        slots = m.resolve(0, pos, table.req_to_token, rpi, sl)
        m.write_new_tokens(0, host.alloc(2), torch.full((2, 656), 9, dtype=torch.uint8))
        results.append((slots, m.hot_entries.clone(), host.entries.clone()))
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1], strict=True))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_no_input_reaches_another_requests_entries(data):
    """Whatever positions arrive, every slot returned for request b holds one of b's own tokens (< its length)."""
    lengths = data.draw(st.lists(st.integers(1, 200), min_size=1, max_size=3))
    impl = data.draw(st.sampled_from(["torch", "triton"]))
    m, host, table, rpi, sl = make(tokens=1024, slots=1024, lengths=tuple(lengths), impl=impl)
    k = data.draw(st.integers(1, 16))
    q = data.draw(st.integers(1, 2))
    raw = data.draw(st.lists(st.integers(-(2**31), 2**31 - 1) | st.integers(-3, 260),
                             min_size=len(lengths) * q * k, max_size=len(lengths) * q * k))
    pos = torch.tensor(raw, dtype=torch.int64).view(len(lengths), q, k).to(torch.int32)
    m.begin_step()
    slots = m.resolve(0, pos, table.req_to_token, rpi, sl)
    for b, n in enumerate(lengths):
        own = set(table.req_to_token[rpi[b], :n].tolist())
        for p, s in zip(pos[b].reshape(-1).tolist(), slots[b].reshape(-1).tolist(), strict=True):
            if 0 <= p < n:
                assert s >= 0 and m.slot_to_loc[0, s].item() == table.req_to_token[rpi[b], p].item()
            else:
                assert s == -1
            if s >= 0:
                assert m.slot_to_loc[0, s].item() in own
    expected_bad = sum(1 for b, n in enumerate(lengths) for p in pos[b].reshape(-1).tolist()
                       if p != -1 and not 0 <= p < n)
    assert m.counters[0, Counter.BAD_INDICES] == expected_bad
    m.check_invariants()


def test_shapes_are_checked(impl):
    m, host, table, rpi, sl = make(impl=impl)
    with pytest.raises(ValueError, match=r"\[batch, q_tokens, k\]"):
        m.resolve(0, torch.zeros(2, 8, dtype=torch.int32), table.req_to_token, rpi, sl)
    with pytest.raises(ValueError, match="seq_lens"):
        m.resolve(0, torch.zeros(2, 1, 8, dtype=torch.int32), table.req_to_token, rpi, sl[:1])


@pytest.mark.parametrize("small_blocks,spare,interval,gamma,spare_max", [
    (False, 0, 1, None, None), (True, 0, 1, None, None), (False, 24, 1, None, None), (True, 24, 1, None, None),
    (True, 120, 1, None, None), (True, 120, 3, None, None), (False, 120, 4, None, None),
    # decayed retention: the stamps carry bonuses, the scans bucket by decayed count
    (False, 0, 1, 0.75, None), (True, 24, 1, 0.75, None), (False, 120, 3, 0.6, None),
    # spare slots for small calls only: the resolves of one query token (120 entries) take them, of two (240) not
    (False, 24, 1, None, 150), (True, 120, 3, None, 150)])
def test_fused_kernels_equal_the_torch_definition_state_for_state(small_blocks, spare, interval, gamma, spare_max):
    """A random mix of every operation on both paths: every map, stamp, counter and hot entry equal, every step.

    (Triton's interpreter runs programs in order, so even the order of the miss and victim lists matches.)
    `small_blocks`: the pool scans and the lookup in many programs, as over a large pool on the GPU (blocks without
    ages or victims of their own skip the shared atomics; a resolve's scans as three launches, not the merged tail
    the other cases run (with spare slots always; without them, these selections being small), and with 24 a
    refill's victim scan, in a short grid whose programs walk several blocks), and the lookup copying only the
    first 8 misses
    (the assign kernel copies the spare-slot winners after those). `spare`: spare slots per layer, refilled after each
    layer's resolve (24: fewer than the misses of most resolves, so the rest take LRU victims; 120: most covered),
    when due (`interval`: a refill interval, so that some refills are not due although spare slots were taken, and
    others are due for want of spare slots). `spare_max`: only calls of at most this many entries take spare slots
    (and a refill follows only their resolves).
    """
    from ess_sglang.kernels.resolve import BONUS_SHIFT

    g = torch.Generator().manual_seed(7)
    pair = [make(slots=320, lengths=(300, 500, 250), seed=5, impl=impl, spare=spare, refill_interval=interval,
                 decay_gamma=gamma, spare_max_entries=spare_max) for impl in ("torch", "triton")]
    if small_blocks:
        f = pair[1][0]._fused
        f.age_block, f.victim_block, f.lookup_block = 64, 32, 16
        f.lookup_copy_cap = 8
        f.scan_programs = 3  # with spare slots, a resolve's scans walk 2 and 4 blocks a program (some past the pool)
        f.tail_programs = None  # (as three launches: the merged tail is one program under the interpreter)
        if spare == 24:  # and a refill's victim scan 5 blocks a program (its age scan one block each, the default)
            f.refill_victim_programs = 2
    state = ("hot_entries", "loc_to_slot", "slot_to_loc", "slot_stamp", "clock", "counters", "spare_taken")
    not_due = 0
    for step in range(12):
        q = 1 + step % 2
        pos = torch.randint(-2, 520, (3, q, 40), generator=g).int()
        new = torch.randint(0, 256, (3, 656), dtype=torch.uint8, generator=g)
        ahead = torch.randint(0, 250, (30,), generator=g)  # prefetched positions (request step % 3)
        outs = []
        for m, host, table, rpi, sl in pair:
            m.begin_step()
            if step == 0:
                m.warm_up(1, table.req_to_token[0, 200:300])
            locs = host.alloc(3) if step % 3 == 0 else torch.tensor([-1, -1, -1])
            o = [m.write_new_tokens(0, locs, new)]
            if step % 4 == 1:  # a prefetch, settled (useful / wasted counted) by the next resolve of its layer
                o.append(m.prefetch(1, table.req_to_token[step % 3, ahead]))
            for layer in range(2):
                o.append(m.resolve(layer, pos, table.req_to_token, rpi, sl, settle_prefetch=True))
                if step % 5 != 4:  # some steps without a refill: the next resolves start short of spare slots
                    if m is pair[0][0] and not bool(m.refill_due(layer)) and int(m.spare_taken[layer]) > 0:
                        not_due += 1  # (a refill that changes nothing although spare slots were taken)
                    m.refill_spares(layer)
            if step == 6:
                m.release(table.req_to_token[2, :250])
            outs.append(o)
        for a, b in zip(outs[0], outs[1], strict=True):
            assert torch.equal(a.long(), b.long()), f"step {step}: slot tables differ"
        for name in state:  # sink elements (the last of each map) are write-only scratch: not compared
            a, b = getattr(pair[0][0], name), getattr(pair[1][0], name)
            if name in ("loc_to_slot", "slot_to_loc", "slot_stamp"):
                a, b = a[:, :-1], b[:, :-1]
            assert torch.equal(a, b), f"step {step}: {name} differs"
        for layer in range(2):  # the free spare slots, in order (the taken ones are stale)
            taken = int(pair[0][0].spare_taken[layer])
            assert torch.equal(pair[0][0].spare[layer, taken:spare], pair[1][0].spare[layer, taken:spare])
        pair[0][0].check_invariants()
        pair[1][0].check_invariants()
    assert (not_due > 0) == (interval > 1 and spare > 0), not_due
    bonus = (pair[0][0].slot_stamp[:, :-1] >> BONUS_SHIFT).clamp(min=0)
    assert bool((bonus > 0).any()) == (gamma is not None)  # (entries selected again carry a bonus)


def test_padding_entries_are_ignored(impl):
    """A batch entry whose request row is -1 (a CUDA graph's padding row) selects nothing: its positions, however
    plausible, are neither read nor counted bad, and the real entries resolve as they would alone."""
    pair = [make(tokens=1024, slots=256, lengths=(100, 200), impl=impl) for _ in range(2)]
    pos = torch.randint(0, 100, (3, 1, 16), generator=torch.Generator().manual_seed(3)).int()
    (m, host, table, rpi, sl), (alone, *_) = pair
    m.begin_step()
    alone.begin_step()
    slots = m.resolve(0, pos, table.req_to_token, torch.cat([rpi, torch.tensor([-1])]),
                      torch.cat([sl, torch.tensor([1])]))
    want = alone.resolve(0, pos[:2], table.req_to_token, rpi, sl)
    assert bool((slots[2] == -1).all()) and torch.equal(slots[:2], want)
    assert int(m.counters[0, Counter.BAD_INDICES]) == 0 and int(m.counters[0, Counter.LOOKUPS]) == 32
    assert torch.equal(m.counters, alone.counters)
    m.check_invariants()


def test_translate_ignores_padding_entries():
    """The Triton translate and its torch definition agree on padding entries (request row -1: every location -1)
    and on rows outside the table."""
    from ess_sglang.kernels.translate import translate_positions_triton

    from ess_sglang.cache_manager import positions_to_locations

    g = torch.Generator().manual_seed(11)
    req_to_token = torch.randint(0, 3000, (6, 400), generator=g).int()
    pos = torch.randint(0, 300, (4, 2, 32), generator=g).int()
    rpi, seq = torch.tensor([5, -1, 7, 2]), torch.tensor([400, 400, 300, 200])
    want, bad = positions_to_locations(pos, req_to_token, rpi, seq, 2500)
    assert bool((want[1] == -1).all()) and not bool(bad[1].any())  # padding: nothing read, nothing bad
    assert bool((want[2] == -1).all()) and bool(bad[2].all())  # a row outside the table: every position is bad
    assert torch.equal(translate_positions_triton(pos, req_to_token, rpi, seq, 2500), want.int())


@pytest.mark.parametrize("spare", [0, 40])
def test_slot_offset_gives_the_slots_plus_the_offset(impl, spare):
    """resolve(slot_offset=o) returns slot + o where an entry has a slot and -1 elsewhere, and changes nothing else:
    two managers fed the same steps (duplicates across query tokens, a pool small enough to evict, padding and bad
    positions) keep equal state."""
    g = torch.Generator().manual_seed(4)
    pair = [make(slots=192, lengths=(300, 500, 250), seed=5, impl=impl, spare=spare) for _ in range(2)]
    for step in range(6):
        pos = torch.randint(-2, 520, (3, 2, 40), generator=g).int()
        got = []
        for i, (m, _, table, rpi, sl) in enumerate(pair):
            m.begin_step()
            got.append(m.resolve(0, pos, table.req_to_token, rpi, sl, slot_offset=1000 if i else None))
            if spare:
                m.refill_spares(0)
        assert torch.equal(got[1], torch.where(got[0] >= 0, got[0] + 1000, -1)), f"step {step}"
        assert got[1].dtype == torch.int32
        for name in ("hot_entries", "loc_to_slot", "slot_to_loc", "slot_stamp", "counters", "spare_taken"):
            assert torch.equal(getattr(pair[0][0], name), getattr(pair[1][0], name)), name
    m = pair[0][0]
    for bad in (-1, 2**31, 1.5, True):
        with pytest.raises(ValueError, match="slot_offset"):
            m.resolve(0, pos, pair[0][2].req_to_token, pair[0][3], pair[0][4], slot_offset=bad)


def test_write_new_tokens_reads_rows_of_a_table_in_place(impl):
    """write_new_tokens(entry_rows=...) stores row entry_rows[j] of a larger table for location j, as if those rows
    had been gathered first; a row outside the table skips its entry (nothing read, written or counted)."""
    g = torch.Generator().manual_seed(8)
    pair = [make(slots=256, impl=impl) for _ in range(2)]
    big = torch.randint(0, 256, (10, 656), dtype=torch.uint8, generator=g)
    rows = torch.tensor([3, 9, -1, 10, 0])
    for m, _, table, *_ in pair:
        m.begin_step()
        m.warm_up(0, table.req_to_token[0, :4])  # two locations resident: their hot slots are written too
    locs = torch.cat([pair[0][2].req_to_token[0, :2], pair[0][1].alloc(3)]).long()
    inside = (rows >= 0) & (rows < 10)
    got = pair[0][0].write_new_tokens(0, locs, big, insert=False, entry_rows=rows)
    want = pair[1][0].write_new_tokens(0, torch.where(inside, locs, -1), big[torch.where(inside, rows, 0)],
                                       insert=False)
    assert torch.equal(got, want) and bool((got[:2] >= 0).all()) and bool((got[2:] == -1).all())
    for name in ("hot_entries", "slot_stamp", "counters"):
        assert torch.equal(getattr(pair[0][0], name), getattr(pair[1][0], name)), name
    assert torch.equal(pair[0][1].entries, pair[1][1].entries)
    assert torch.equal(pair[0][1].entries[0][locs[1]], big[9])
    assert torch.equal(pair[0][0].hot_entries[0][got[1]], big[9])
    assert int(pair[0][0].counters[0, Counter.D2H_ENTRIES]) == 3
    for bad in (rows[:2], rows > 0, rows.float()):  # a length other than the locations', a mask, floats
        with pytest.raises(ValueError, match="entry_rows"):
            pair[0][0].write_new_tokens(0, locs, big, insert=False, entry_rows=bad)


@pytest.mark.parametrize("spare", [0, 40])
def test_resolve_writes_new_tokens_back_after_the_selection(impl, spare):
    """resolve(new_tokens=...) is the resolve, then write_new_tokens(insert=False) of the step's tokens, then the
    prefetch's settle: same slot tables and state. The tokens' host rows hold stale bytes until then, and the
    selection often names the token (its newest position), some steps after a prefetch made it resident with the
    stale bytes: the token's slot holds its entry after the resolve either way. A padding row (location -1) and a
    row outside the entry table are skipped. With spare slots, the write-back (the finish kernel's first programs, in
    order under the interpreter) meets selected tokens whose spare slot the entry programs have not mapped yet."""
    from ess_sglang.cache_manager import NewTokens

    g = torch.Generator().manual_seed(12)
    pair = [make(slots=192, lengths=(300, 500, 250, 300), seed=5, impl=i, spare=spare) for i in (impl, "torch")]
    big = torch.randint(0, 256, (12, 656), dtype=torch.uint8, generator=g)
    rows = torch.tensor([3, 9, 11, 12])  # the last one outside the table: skipped
    lens = torch.tensor([260, 450, 200, 280])
    named = 0
    for step in range(8):
        lens = lens + 1
        pos = torch.randint(-2, 300, (4, 1, 40), generator=g).int()
        pos[:3, 0, step % 40] = torch.where(torch.rand(3, generator=g) < 0.8, lens[:3] - 1, pos[:3, 0, step % 40])
        rpi = pair[0][3].clone()
        got = []
        for i, (m, _, table, _, _) in enumerate(pair):
            locs = table.req_to_token[rpi, lens - 1].long()
            locs[3 if step % 2 else 2] = -1  # (a padding row)
            m.begin_step()
            if step % 3 == 1:  # the tokens prefetched first: resident with their stale host bytes
                m.prefetch(0, locs[:2].clone())
            if i == 0:
                got.append(m.resolve(0, pos, table.req_to_token, rpi, lens, settle_prefetch=True,
                                     new_tokens=NewTokens(locs, big, rows)))
            else:  # (the write-back protects a resident token before the settle counts the prefetch)
                got.append(m.resolve(0, pos, table.req_to_token, rpi, lens))
                m.write_new_tokens(0, locs, big, insert=False, entry_rows=rows)
                m.settle_prefetch(0)
            if spare:
                m.refill_spares(0)
        assert torch.equal(got[0], got[1]), f"step {step}"
        assert_same_state(pair[0][0], pair[1][0], f"step {step}")
        assert torch.equal(pair[0][1].entries, pair[1][1].entries)
        m, host, table = pair[0][:3]
        for b in range(3):  # the tokens the selection names read their entry (not the stale host bytes)
            hit = (pos[b, 0] == lens[b] - 1) & (got[0][b, 0] >= 0)
            if bool(hit.any()) and int(locs[b]) >= 0:
                named += 1
                assert torch.equal(m.hot_entries[0][got[0][b, 0][hit][0].long()], big[rows[b]]), (step, b)
                assert torch.equal(host.entries[0][locs[b]], big[rows[b]])
        m.check_invariants()
    assert named >= 8, named
    m = pair[0][0]
    with pytest.raises(ValueError, match="one token per batch entry"):
        m.resolve(0, pos, pair[0][2].req_to_token, rpi, lens, new_tokens=NewTokens(locs[:2], big, rows[:2]))
    with pytest.raises(ValueError, match="entry_rows"):
        m.resolve(0, pos, pair[0][2].req_to_token, rpi, lens, new_tokens=NewTokens(locs, big, rows.float()))
    with pytest.raises(ValueError, match="entries must be uint8"):
        m.resolve(0, pos, pair[0][2].req_to_token, rpi, lens, new_tokens=NewTokens(locs, big.short(), rows))


@pytest.mark.parametrize("spare", [0, 40])
def test_resolve_inserts_this_steps_tokens(impl, spare):
    """NewTokens(insert=True): each step's token takes a hot slot in the resolve itself (no copy: the write-back
    fills it), so it is resident from the step that computes it. Same state on both paths; a selection naming its
    own token reads the token's entry and counts a hit, never a fetch."""
    from ess_sglang.cache_manager import NewTokens

    g = torch.Generator().manual_seed(21)
    ms = [make(slots=160, lengths=(300, 500, 250, 300), seed=5, impl=i, spare=spare) for i in (impl, "torch")]
    big = torch.randint(0, 256, (12, 656), dtype=torch.uint8, generator=g)
    rows = torch.tensor([3, 9, 11, 12])  # the last one outside the table: its token is inserted, never written
    lens = torch.tensor([260, 450, 200, 280])
    for step in range(10):
        lens = lens + 1
        pos = torch.randint(-2, 300, (4, 1, 30), generator=g).int()
        pos[:3, 0, step % 30] = torch.where(torch.rand(3, generator=g) < 0.7, lens[:3] - 1, pos[:3, 0, step % 30])
        got = []
        for m, _, table, rpi, _ in ms:
            locs = table.req_to_token[rpi, lens - 1].long()
            locs[3 if step % 2 else 2] = -1  # (a padding row)
            m.begin_step()
            before = m.counters[0].clone()
            got.append(m.resolve(0, pos, table.req_to_token, rpi, lens,
                                 new_tokens=NewTokens(locs, big, rows, insert=True)))
            if spare:
                m.refill_spares(0)
        assert torch.equal(got[0], got[1]), f"step {step}"
        assert_same_state(ms[0][0], ms[1][0], f"step {step}")
        m, host, table, rpi, _ = ms[0]
        m.check_invariants()
        step_counts = m.counters[0] - before
        locs = table.req_to_token[rpi, lens - 1].long()
        live = ((pos >= 0) & (pos < lens.view(4, 1, 1))).view(4, -1)
        distinct = sum(int(torch.unique(pos[b, 0][live[b]]).numel()) for b in range(4))
        named_own = sum(int((pos[b, 0] == lens[b] - 1).sum()) for b in range(4) if b != (3 if step % 2 else 2))
        assert int(step_counts[Counter.LOOKUPS]) == int(live.sum())
        assert int(step_counts[Counter.HITS]) >= named_own  # (the token itself is never a fetch)
        assert int(step_counts[Counter.MISSES]) <= distinct - min(named_own, 1)
        for b in range(4):
            if b == (3 if step % 2 else 2):
                continue
            slot = int(m.loc_to_slot[0, locs[b]])
            assert slot >= 0, (step, b)  # resident from its own step
            if b < 3:
                assert torch.equal(m.hot_entries[0][slot], big[rows[b]]) and torch.equal(host.entries[0][locs[b]],
                                                                                         big[rows[b]])
                named = pos[b, 0] == lens[b] - 1
                assert bool((got[0][b, 0][named] == slot).all()), (step, b)
    assert int(ms[0][0].counters[0, Counter.NEW_TOKENS]) > 0


def test_new_tokens_with_an_empty_selection_or_a_misaligned_table(impl):
    """An empty selection (k = 0) still writes the tokens back, on both paths alike. An entry table that does not
    start on a 4-byte word is refused before anything runs: no state changes."""
    from ess_sglang.cache_manager import NewTokens

    pair = [make(slots=64, impl=i, spare=8) for i in (impl, "torch")]
    big = torch.randint(0, 256, (4, 656), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    rows = torch.tensor([1, 3])
    for m, host, table, rpi, sl in pair:
        m.begin_step()
        locs = table.req_to_token[rpi, sl - 1].long()
        out = m.resolve(0, torch.zeros(2, 1, 0, dtype=torch.int32), table.req_to_token, rpi, sl,
                        new_tokens=NewTokens(locs, big, rows))
        assert out.shape == (2, 1, 0)
        assert torch.equal(host.entries[0][locs], big[rows]) and int(m.counters[0, Counter.D2H_ENTRIES]) == 2
    m, host, table, rpi, sl = pair[0]
    before = {name: getattr(m, name).clone() for name in ("loc_to_slot", "slot_stamp", "counters", "spare_taken")}
    entries_before = host.entries.clone()
    skewed = torch.zeros(4 * 656 + 1, dtype=torch.uint8)[1:].view(4, 656)
    with pytest.raises(ValueError, match="4-byte words"):
        m.resolve(0, torch.arange(8).view(1, 1, 8).expand(2, 1, 8).int(), table.req_to_token, rpi, sl,
                  new_tokens=NewTokens(locs, skewed, rows))
    for name, t in before.items():
        assert torch.equal(getattr(m, name), t), name
    assert torch.equal(host.entries, entries_before)
    if m._fused is not None:
        assert int(m._fused.scratch.abs().sum()) == 0


def test_engine_provided_hot_pool_storage(impl):
    host = HostTotalPool(2, 512, device="cpu")
    host.entries.random_(0, 256)
    backing = torch.zeros(2, 200, 656, dtype=torch.uint8)  # e.g. regions of an engine's own KV pool
    views = [backing[0, 8:72], backing[1, 100:164]]
    m = HotPoolCacheManager(host, 64, device="cpu", max_selected=64, resolve_impl=impl, hot_entries=views)
    table = RequestTable(1, 512)
    table.set(0, 0, host.alloc(300))
    m.begin_step()
    slots = m.resolve(1, torch.arange(40).view(1, 1, 40).int(), table.req_to_token, torch.tensor([0]),
                      torch.tensor([300]))
    assert torch.equal(backing[1, 100:164][slots[0, 0].long()], host.entries[1][table.req_to_token[0, :40].long()])
    assert m.hot_pool_bytes == 2 * 64 * 656 and (backing[0] == 0).all()
    with pytest.raises(ValueError, match=r"hot_entries\[1\]"):
        HotPoolCacheManager(host, 64, device="cpu", hot_entries=[views[0], backing[1, :63]])
    with pytest.raises(ValueError, match="1 layers given"):
        HotPoolCacheManager(host, 64, device="cpu", hot_entries=views[:1])


def test_deferred_fetch_assigns_slots_first_and_copies_on_fetch(impl):
    m, host, table, rpi, sl = make(impl=impl)
    pos = torch.stack([torch.arange(64).view(1, 64), torch.arange(100, 164).view(1, 64)]).int()
    pos[1, 0, 5] = pos[1, 0, 4]  # a duplicate within a request shares the slot and is fetched once
    m.begin_step()
    fl = m.new_fetch_list()
    slots = m.resolve(0, pos, table.req_to_token, rpi, sl, fetch_list=fl)
    locs, _ = m.translate(pos, table.req_to_token, rpi, sl)
    assert bool((slots >= 0).all())
    assert not bool((m.hot_entries[0] != 0).any()), "a deferred resolve copied data"
    pend = fl.dst >= 0
    assert int(pend.sum()) == int(m.counters[0, Counter.MISSES]) == 127
    assert torch.equal(fl.src[pend].sort().values, locs.reshape(-1).unique())
    assert set(fl.dst[pend].tolist()) == set(slots.reshape(-1).tolist())
    assert bool((fl.src[~pend] == -1).all())
    m.fetch(0, fl)
    check_slots(m, host, 0, slots, locs)
    # the next step: everything hits, and the list says there is nothing to copy
    m.begin_step()
    again = m.resolve(0, pos, table.req_to_token, rpi, sl, fetch_list=fl)
    assert torch.equal(again, slots) and not bool((fl.dst >= 0).any())
    m.check_invariants()


def test_prefetch_counts_useful_and_wasted_entries(impl):
    m, host, table, rpi, sl = make(impl=impl)
    req_to_token = table.req_to_token
    m.begin_step()
    # prefetch 40 entries of request 0: positions 0..39; the exact selection then names positions 20..83
    pre = req_to_token[rpi[0], :40].long()
    m.prefetch(0, torch.cat([pre, torch.tensor([-1, 10**9])]))
    c = m.counters[0]
    assert c[Counter.PREFETCHED] == 40 and c[Counter.H2D_ENTRIES] == 40 and c[Counter.BAD_INDICES] == 0
    pos = torch.stack([torch.arange(20, 84).view(1, 64), torch.full((1, 64), -1)]).int()
    slots = m.resolve(0, pos, req_to_token, rpi, sl, settle_prefetch=True)
    locs, _ = m.translate(pos, req_to_token, rpi, sl)
    check_slots(m, host, 0, slots, locs)
    assert c[Counter.HITS] == 20 and c[Counter.MISSES] == 44
    assert c[Counter.PREFETCH_USEFUL] == 20 and c[Counter.PREFETCH_WASTED] == 20
    # a prefetch is settled once: a second settling resolve without a prefetch counts nothing
    m.begin_step()
    m.resolve(0, pos, req_to_token, rpi, sl, settle_prefetch=True)
    assert c[Counter.PREFETCH_USEFUL] == 20 and c[Counter.PREFETCH_WASTED] == 20
    # prefetching resident entries fetches nothing, so nothing is useful or wasted
    m.begin_step()
    m.prefetch(0, pre[20:])
    m.resolve(0, pos, req_to_token, rpi, sl, settle_prefetch=True)
    assert c[Counter.PREFETCHED] == 40 and c[Counter.PREFETCH_USEFUL] + c[Counter.PREFETCH_WASTED] == 40
    m.check_invariants()


def test_one_prefetch_at_a_time_is_counted(impl):
    # the settle reads the prefetch's fetch list: it must not be reused or overwritten before then
    m, host, table, rpi, sl = make(impl=impl)
    pos = torch.stack([torch.arange(20, 84).view(1, 64), torch.full((1, 64), -1)]).int()
    m.begin_step()
    own = m.new_fetch_list(128)
    m.prefetch(0, table.req_to_token[rpi[0], :40].long(), own)
    with pytest.raises(ValueError, match="the prefetch of layer 0 is not settled yet"):
        m.prefetch(1, table.req_to_token[rpi[0], :40].long())
    with pytest.raises(ValueError, match="the fetch list is the unsettled prefetch's own list"):
        m.resolve(0, pos, table.req_to_token, rpi, sl, fetch_list=own, settle_prefetch=True)
    m.resolve(1, pos, table.req_to_token, rpi, sl, settle_prefetch=True)  # another layer: layer 0's stays pending
    m.resolve(0, pos, table.req_to_token, rpi, sl, settle_prefetch=True)
    c = m.counters[0]
    assert c[Counter.PREFETCH_USEFUL] == 20 and c[Counter.PREFETCH_WASTED] == 20
    m.prefetch(1, table.req_to_token[rpi[0], :40].long())  # settled: the next prefetch may start
    m.check_invariants()


def test_list_overlap_check_sees_views_of_one_buffer():
    from ess_sglang.cache_manager import _shares_memory

    buf = torch.arange(100)
    assert _shares_memory(buf[:50], buf[49:]) and not _shares_memory(buf[:50], buf[50:])
    assert not _shares_memory(buf[:50], torch.arange(50)) and not _shares_memory(buf[:0], buf)
    assert _shares_memory(buf[0:100:10], buf[50:60])  # a strided view reaches into the slice
    assert _shares_memory(buf[0::2], buf[1::2])  # interleaved views: refused (conservative)
    assert _shares_memory(buf.view(10, 10)[:, 0], buf[90:])  # column 0 reaches element 90


def test_prefetches_of_one_layer_in_lists_of_their_own_are_all_counted(impl):
    # the decode stack prefetches each batch chunk as soon as its logits exist: several prefetches of one layer,
    # in disjoint slices of one list, settled together by the layer's exact resolve
    m, host, table, rpi, sl = make(impl=impl)
    pos = torch.stack([torch.arange(20, 84).view(1, 64), torch.full((1, 64), -1)]).int()
    m.begin_step()
    whole = m.new_fetch_list(128)
    counts = torch.zeros(3, dtype=torch.int64)
    first = FetchList(whole.src[:64], whole.dst[:64], counts[0:1])
    second = FetchList(whole.src[64:], whole.dst[64:], counts[1:2])
    m.prefetch(0, table.req_to_token[rpi[0], :30].long(), first)
    with pytest.raises(ValueError, match="overlaps the list of a prefetch of this layer that is not settled yet"):
        m.prefetch(0, table.req_to_token[rpi[0], 30:40].long(), FetchList(whole.src[32:96], whole.dst[32:96],
                                                                          counts[2:3]))
    with pytest.raises(ValueError, match="the prefetch of layer 0 is not settled yet"):
        m.prefetch(1, table.req_to_token[rpi[0], 30:40].long(), second)
    with pytest.raises(ValueError, match="overlaps the list of a prefetch"):  # a destination shared with the first
        m.prefetch(0, table.req_to_token[rpi[0], 30:40].long(), FetchList(whole.src[64:], whole.dst[:64],
                                                                          counts[2:3]))
    m.prefetch(0, table.req_to_token[rpi[0], 30:40].long(), second)
    with pytest.raises(ValueError, match="the fetch list is the unsettled prefetch's own list"):
        m.resolve(0, pos, table.req_to_token, rpi, sl, fetch_list=whole, settle_prefetch=True)
    slots = m.resolve(0, pos, table.req_to_token, rpi, sl, settle_prefetch=True)
    locs, _ = m.translate(pos, table.req_to_token, rpi, sl)
    check_slots(m, host, 0, slots, locs)
    c = m.counters[0]  # positions 0..39 prefetched, 20..83 selected: 20 useful, 20 wasted, as in one prefetch
    assert c[Counter.PREFETCHED] == 40 and c[Counter.HITS] == 20 and c[Counter.MISSES] == 44
    assert c[Counter.PREFETCH_USEFUL] == 20 and c[Counter.PREFETCH_WASTED] == 20
    m.prefetch(1, table.req_to_token[rpi[0], :40].long(), first)  # settled: the lists may be reused
    m.check_invariants()


def test_prefetch_never_changes_what_attention_reads(impl):
    # The same selections with and without prefetching arbitrary entries give slots naming the same entries.
    a = make(slots=160, impl=impl)
    b = make(slots=160, impl=impl)
    g = torch.Generator().manual_seed(3)
    for step in range(8):
        pos = torch.randint(0, 300, (2, 1, 64), generator=g).int()
        outs = []
        for k, (m, _host, table, rpi, sl) in enumerate((a, b)):
            m.begin_step()
            if k == 1:
                m.prefetch(0, torch.randint(0, 800, (48,), generator=g))
            slots = m.resolve(0, pos, table.req_to_token, rpi, sl, settle_prefetch=k == 1)
            outs.append(m.hot_entries[0][slots.reshape(-1).long()])
        assert torch.equal(outs[0], outs[1]), f"step {step}"
    b[0].check_invariants()


def test_prefetch_can_never_make_the_exact_resolve_overflow(impl):
    # The pool holds exactly one step's selection; a prefetch fills it with other entries first. The exact resolve
    # evicts the prefetched entries (never protected) and every selected entry is resident: wasted, not wrong.
    m, host, table, rpi, sl = make(slots=128, impl=impl)
    pos = torch.stack([torch.arange(64).view(1, 64), torch.arange(100, 164).view(1, 64)]).int()
    for step in range(3):
        m.begin_step()
        m.prefetch(0, table.req_to_token[rpi[1], 200:328].long())
        slots = m.resolve(0, pos + step, table.req_to_token, rpi, sl, settle_prefetch=True)
        locs, _ = m.translate(pos + step, table.req_to_token, rpi, sl)
        check_slots(m, host, 0, slots, locs)
    c = m.counters[0]
    assert c[Counter.OVERFLOW] == 0 and c[Counter.PREFETCH_WASTED] > 0 and c[Counter.PREFETCH_USEFUL] == 0
    m.check_invariants()


def test_reserved_slots_take_new_tokens_without_eviction(impl):
    m, host, table, rpi, sl = make(impl=impl)
    future = host.alloc(4).long()  # locations of tokens still to come
    m.begin_step()
    slots = m.reserve(0, future)
    assert bool((slots >= 0).all()) and m.counters[0, Counter.H2D_ENTRIES] == 0
    entries = torch.randint(0, 256, (4, 656), dtype=torch.uint8)
    got = m.write_new_tokens(0, torch.cat([future[:2], torch.tensor([-1])]), entries[:3], reserved=True)
    assert torch.equal(got[:2], slots[:2]) and got[2] == -1
    assert torch.equal(m.hot_entries[0][slots[:2]], entries[:2])
    assert torch.equal(host.entries[0][future[:2]], entries[:2])
    # a location without a reserved slot: the host copy is written, the hot pool is not, and it is counted
    other = host.alloc(1).long()
    assert m.write_new_tokens(0, other, entries[3:], reserved=True)[0] == -1
    assert torch.equal(host.entries[0][other], entries[3:]) and m.counters[0, Counter.NOT_RESIDENT] == 1
    assert m.counters[0, Counter.EVICTIONS] == 0
    m.check_invariants()


def test_reserved_store_kernel_equals_the_torch_path():
    # kernels/new_tokens.py does in one launch what the torch path does in ~15: same slots, stamps, counters, bytes;
    # locations outside [0, num_locations) are skipped (never read or written), -1 is padding
    runs = []
    for impl in ("torch", "triton"):
        m, host, table, rpi, sl = make(impl=impl)
        future = host.alloc(6).long()
        m.begin_step()
        m.reserve(0, future[:4])
        m.begin_step()
        locs = torch.cat([future, torch.tensor([-1, -7, m.num_locations, m.num_locations + 40])])
        entries = torch.randint(0, 256, (locs.shape[0], 656), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(3))
        got = m.write_new_tokens(0, locs, entries, reserved=True)
        stamps = m.slot_stamp[:, :-1].clone()  # the last entry is a sink the torch path scatters into
        runs.append((got, m.hot_entries.clone(), host.entries.clone(), stamps, m.counters.clone()))
        m.check_invariants()
    for a, b in zip(runs[0], runs[1], strict=True):
        assert torch.equal(a, b)
    got, counters = runs[1][0], runs[1][4]
    assert bool((got[:4] >= 0).all()) and bool((got[4:] == -1).all())
    assert counters[0, Counter.D2H_ENTRIES] == 6 and counters[0, Counter.NOT_RESIDENT] == 2


def test_a_request_row_outside_the_table_is_never_read(impl):
    m, host, table, rpi, sl = make(impl=impl)
    pos = torch.arange(32).view(1, 1, 32).expand(2, 1, 32).int().contiguous()
    bad_rows = torch.tensor([rpi[0].item(), table.req_to_token.shape[0] + 3])  # the second row does not exist
    m.begin_step()
    slots = m.resolve(0, pos, table.req_to_token, bad_rows, sl)
    assert bool((slots[0] >= 0).all()) and bool((slots[1] == -1).all())
    assert m.counters[0, Counter.BAD_INDICES] == 32 and m.counters[0, Counter.MISSES] == 32
    m.check_invariants()


def test_prefetch_refuses_a_fetch_list_too_short(impl):
    m, host, table, rpi, sl = make(impl=impl)
    with pytest.raises(ValueError, match="fetch list holds 4 entries, the candidates 40"):
        m.prefetch(0, torch.arange(40), m.new_fetch_list(4))
    assert not bool((m.slot_to_loc >= 0).any()), "nothing may be assigned before the check"


def test_new_tokens_written_back_only_are_fetched_when_selected(impl):
    # insert=False: the write-back, nothing inserted; a later resolve that selects the token fetches it from the
    # host copy just written (bit for bit); a location that already had a slot gets its slot rewritten too
    m, host, table, rpi, sl = make(impl=impl)
    row = int(rpi[0])
    new_loc = host.alloc(1).long()
    table.set(row, int(sl[0]), new_loc)
    sl = sl.clone()
    sl[0] += 1
    m.begin_step()
    resident = table.req_to_token[row, :1].long()
    m.warm_up(0, resident)
    entries = torch.randint(0, 256, (2, 656), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    got = m.write_new_tokens(0, torch.cat([new_loc, resident]), entries, insert=False)
    assert got[0] == -1 and got[1] >= 0
    assert torch.equal(host.entries[0][new_loc[0]], entries[0]) and torch.equal(m.hot_entries[0][got[1]], entries[1])
    c = m.counters[0]
    assert c[Counter.NEW_TOKENS] == 0 and c[Counter.D2H_ENTRIES] == 2 and c[Counter.NOT_RESIDENT] == 0
    m.begin_step()
    pos = torch.tensor([[[int(sl[0]) - 1, 0]], [[0, 1]]], dtype=torch.int32)
    slots = m.resolve(0, pos, table.req_to_token, rpi, sl)
    assert torch.equal(m.hot_entries[0][slots[0, 0, 0].long()], entries[0])
    assert torch.equal(m.hot_entries[0][slots[0, 0, 1].long()], entries[1])
    m.check_invariants()


@pytest.mark.parametrize("small_blocks", [False, True])
def test_a_selection_larger_than_the_pool_overflows_the_same_on_both_paths(small_blocks):
    """More distinct entries than slots in every step (config checks prevent it; the kernels must not break): every
    slot is filled, the rest overflow (-1, counted, their claims undone), the duplicate of an overflowed entry gets
    -1 too, and the next steps evict; the fused kernels match the torch path state for state (`small_blocks`: every
    launch in several programs, run one after another by the interpreter)."""
    pair = [make(slots=48, lengths=(300, 500), seed=3, impl=impl) for impl in ("torch", "triton")]
    if small_blocks:
        f = pair[1][0]._fused
        f.age_block, f.victim_block, f.lookup_block, f.assign_programs = 16, 16, 16, (2, 2)
    g = torch.Generator().manual_seed(11)
    overflow_before = evictions_before = 0
    for step in range(3):
        pos = torch.randint(0, 300, (2, 1, 40), generator=g).int().expand(2, 2, 40).contiguous()  # duplicates
        outs = []
        for m, _, table, rpi, sl in pair:
            m.begin_step()
            outs.append(m.resolve(0, pos, table.req_to_token, rpi, sl))
            m.check_invariants()
        assert torch.equal(outs[0], outs[1]), f"step {step}"
        for name in ("loc_to_slot", "slot_to_loc", "slot_stamp", "counters"):
            a, b = getattr(pair[0][0], name), getattr(pair[1][0], name)
            assert torch.equal(a[:, :-1] if name != "counters" else a, b[:, :-1] if name != "counters" else b), name
        c = pair[1][0].counters[0]
        assert pair[1][0].resident_count(0) == 48 and int(c[Counter.OVERFLOW]) > overflow_before
        assert step == 0 or int(c[Counter.EVICTIONS]) > evictions_before
        overflow_before, evictions_before = int(c[Counter.OVERFLOW]), int(c[Counter.EVICTIONS])
        # an entry and its duplicate (the other query token) get the same answer, slot or -1
        assert torch.equal(outs[1][:, 0], outs[1][:, 1]) and int((outs[1] >= 0).sum()) > 0


def _positions(row_pos, B=2, row=1):
    """A [B, 1, k] selection naming `row_pos` in request `row` and padding elsewhere."""
    pos = torch.full((B, 1, len(row_pos)), -1, dtype=torch.int32)
    pos[row, 0] = torch.as_tensor(row_pos, dtype=torch.int32)
    return pos


def test_spare_slots_take_misses_first_and_the_refill_evicts_the_lru(impl):
    """Misses take the spare slots in list order before any LRU scan; a refill replaces the spare slots taken with
    the least-recently-used ones (free slots first), evicting and counting them; nothing is evicted at a resolve
    while spare slots cover its misses."""
    m, host, table, rpi, sl = make(slots=128, impl=impl, spare=16)
    locs = table.req_to_token[rpi[1]].long()

    def step(first, last):
        m.begin_step()
        slots = m.resolve(0, _positions(range(first, last)), table.req_to_token, rpi, sl)
        check_slots(m, host, 0, slots[1, 0], locs[first:last])
        m.check_invariants()
        return slots[1, 0].long()

    assert int(m.spare_taken[0]) == 16  # none until the first refill
    assert torch.equal(step(0, 64), torch.arange(64))  # cold: the first free slots, by index
    m.refill_spares(0)  # the 16 oldest are free slots
    assert int(m.spare_taken[0]) == 0 and torch.equal(m.spare[0, :16].long(), torch.arange(64, 80))
    # 48 misses: the 16 spare slots in list order, then the LRU scan (the free slots 80..111)
    assert torch.equal(step(64, 112), torch.arange(64, 112))
    m.refill_spares(0)
    assert torch.equal(m.spare[0, :16].long(), torch.arange(112, 128))
    assert torch.equal(step(112, 128), torch.arange(112, 128))  # covered by spare slots
    assert int(m.counters[0, Counter.EVICTIONS]) == 0
    m.refill_spares(0)  # the pool is full: the 16 least recently used (positions 0..15, selected two steps ago)
    assert int(m.counters[0, Counter.EVICTIONS]) == 16
    assert torch.equal(m.spare[0, :16].long(), torch.arange(16))
    assert bool((m.loc_to_slot[0, locs[:16]] == -1).all()) and bool((m.loc_to_slot[0, locs[16:128]] >= 0).all())
    assert torch.equal(step(0, 8), torch.arange(8))  # misses again: spare slots 0..7, no eviction at the resolve
    assert int(m.counters[0, Counter.EVICTIONS]) == 16 and int(m.spare_taken[0]) == 8


def test_a_refill_never_evicts_the_current_selection(impl):
    """A refill that finds fewer evictable slots than it wants takes what there is (this step's selection is
    protected) and takes the rest at the next refill."""
    m, host, table, rpi, sl = make(slots=128, impl=impl, spare=64)
    locs = table.req_to_token[rpi[1]].long()
    m.begin_step()
    slots = m.resolve(0, _positions(range(100)), table.req_to_token, rpi, sl)
    m.refill_spares(0)  # wants 64; only the 28 free slots are evictable
    assert int(m.spare_taken[0]) == 64 - 28 and int(m.counters[0, Counter.EVICTIONS]) == 0
    check_slots(m, host, 0, slots[1, 0], locs[:100])
    m.check_invariants()
    m.begin_step()
    m.refill_spares(0)  # the selection is a step old now: 36 of it evicted
    assert int(m.spare_taken[0]) == 0 and int(m.counters[0, Counter.EVICTIONS]) == 36
    assert m.resident_count(0) == 128 - 64
    m.check_invariants()


def test_spare_slots_run_out_and_the_resolve_scans_for_the_rest(impl):
    """More misses than spare slots: the spare slots, then LRU victims evicted at the resolve; every entry
    resident and exact, duplicates across query tokens share one slot."""
    m, host, table, rpi, sl = make(slots=128, impl=impl, spare=8)
    locs = table.req_to_token[rpi[1]].long()
    m.begin_step()
    m.resolve(0, _positions(range(120)), table.req_to_token, rpi, sl)
    m.refill_spares(0)
    m.begin_step()
    pos = _positions(range(200, 240)).expand(2, 2, 40).contiguous()  # both query tokens name the same 40
    pos[0] = -1
    slots = m.resolve(0, pos, table.req_to_token, rpi, sl)
    check_slots(m, host, 0, slots[1, 0], locs[200:240])
    assert torch.equal(slots[1, 0], slots[1, 1])
    c = m.counters[0]
    assert int(c[Counter.MISSES]) == 120 + 40 and int(c[Counter.EVICTIONS]) == 40 - 8 and int(c[Counter.OVERFLOW]) == 0
    m.check_invariants()


def test_a_refill_interval_refills_each_layer_in_its_turn_or_when_few_spare_slots_are_left(impl):
    """With refill interval 3, layer l refills in the steps where clock + l is a multiple of 3 (nothing changes in
    the others), and in any step where fewer than a third of its spare slots are left."""
    m, host, table, rpi, sl = make(layers=2, slots=128, impl=impl, spare=12, refill_interval=3)
    assert bool((m.spare_taken == 12).all())  # none until a refill: every layer is short of spare slots, so due
    first = 0
    for clock in range(1, 8):
        m.begin_step()
        for layer in range(2):
            m.resolve(layer, _positions(range(first, first + 2)), table.req_to_token, rpi, sl)  # 2 misses a step
        first += 2
        before = m.spare_taken.clone()
        due = [bool(m.refill_due(layer)) for layer in range(2)]
        for layer in range(2):
            m.refill_spares(layer)
        for layer in range(2):
            in_turn = (clock + layer) % 3 == 0
            assert due[layer] == (in_turn or int(before[layer]) * 3 > 12 * 2), (clock, layer)
            assert int(m.spare_taken[layer]) == (0 if due[layer] else int(before[layer])), (clock, layer)
        m.check_invariants()
    # layer 0: refilled at clock 1 (none left), 3 and 6; layer 1: at clock 1, 2 and 5 (in turn, 2 taken a step)
    assert [int(t) for t in m.spare_taken] == [2, 4]
    m.begin_step()  # clock 8: layer 0 is not in turn
    m.resolve(0, _positions(range(first, first + 6)), table.req_to_token, rpi, sl)  # 6 misses: 8 taken, 4 left
    assert int(m.spare_taken[0]) == 8 and not bool(m.refill_due(0))  # 4 left: not fewer than a third
    m.resolve(0, _positions(range(first + 6, first + 7)), table.req_to_token, rpi, sl)  # one more: 3 left
    assert bool(m.refill_due(0))
    m.refill_spares(0)
    assert int(m.spare_taken[0]) == 0
    m.check_invariants()


@pytest.mark.parametrize("bad", [0, -2, 1025, 93_368_890, True, 1.5, "2"])
def test_bad_refill_interval_fails_before_any_allocation(bad):
    host = HostTotalPool(1, 64, device="cpu")
    with pytest.raises(ValueError, match=r"refill_interval must be an integer in \[1, 1024\]"):
        HotPoolCacheManager(host, 256, device="cpu", spare_slots=8, refill_interval=bad)


@pytest.mark.parametrize("bad", [-1, 256, 300, True, 2.5, "8"])
def test_bad_spare_slots_fail_before_any_allocation(bad):
    host = HostTotalPool(1, 64, device="cpu")
    with pytest.raises(ValueError, match="spare_slots"):
        HotPoolCacheManager(host, 256, device="cpu", spare_slots=bad)


@pytest.mark.parametrize("resolve_impl", ["torch", "triton", "auto"])
def test_resolve_pdl_needs_the_triton_resolve_on_a_cuda_gpu(resolve_impl):
    host = HostTotalPool(1, 64, device="cpu")
    with pytest.raises(ValueError, match="resolve_pdl: programmatic dependent launch needs the Triton resolve on a "
                                         "CUDA GPU"):
        HotPoolCacheManager(host, 256, device="cpu", resolve_impl=resolve_impl, resolve_pdl=True)


def test_a_prefetch_with_spare_slots_takes_only_those(impl):
    """With spare slots a prefetch never scans or evicts: its first misses take the spare slots, the rest are not
    prefetched (-1, no overflow counted, their claims given back); the exact resolve fetches what it selects."""
    m, host, table, rpi, sl = make(slots=128, impl=impl, spare=16)
    locs = table.req_to_token[rpi[1]].long()
    m.begin_step()
    m.resolve(0, _positions(range(120)), table.req_to_token, rpi, sl)  # the pool full but for 8 free slots
    m.begin_step()
    m.refill_spares(0)  # the 8 free slots, then 8 evicted (positions 0..7, in slots 0..7)
    assert torch.equal(m.spare[0, :16].long(), torch.cat([torch.arange(120, 128), torch.arange(8)]))
    evictions = int(m.counters[0, Counter.EVICTIONS])
    assert evictions == 8
    got = m.prefetch(0, locs[200:240])
    assert torch.equal(got[:16].long(), m.spare[0, :16].long()) and bool((got[16:] == -1).all())
    c = m.counters[0]
    assert int(c[Counter.PREFETCHED]) == 16 and int(c[Counter.OVERFLOW]) == 0
    assert int(c[Counter.EVICTIONS]) == evictions and int(m.spare_taken[0]) == 16
    assert bool((m.loc_to_slot[0, locs[216:240]] == -1).all())  # claims given back
    m.check_invariants()
    slots = m.resolve(0, _positions(range(200, 230)), table.req_to_token, rpi, sl, settle_prefetch=True)
    check_slots(m, host, 0, slots[1, 0], locs[200:230])
    assert int(c[Counter.PREFETCH_USEFUL]) == 16 and int(c[Counter.PREFETCH_WASTED]) == 0
    m.check_invariants()


def test_a_spare_only_resolve_without_spare_slots_gives_no_slot_on_both_paths():
    """The definition (`_insert(spare_only=True)`) with no spare slots: nothing gets a slot, no map changes; the fused
    kernels do the same (they do not fall back to a scan on their own)."""
    pair = [make(impl=impl) for impl in ("torch", "triton")]
    outs = []
    for m, _, table, rpi, _ in pair:
        m.begin_step()
        flat = table.req_to_token[rpi[1], :40].long()
        if m._fused is None:
            slots = m._make_resident(0, flat, copy=False, protect=False, spare_only=True)[0]
        else:
            slots = m._fused_run(0, flat, 1, count=False, fetch=(-1, -1), copy_from=None, protect=False,
                                 spare_only=True)
        outs.append(slots.long())
        assert bool((m.loc_to_slot[0] == -1).all()) and m.resident_count(0) == 0
        assert int(m.counters[0, Counter.OVERFLOW]) == 0
        m.check_invariants()
    assert torch.equal(outs[0], outs[1]) and bool((outs[0] == -1).all())


def test_spare_slots_for_small_calls_only(impl):
    """`spare_max_entries`: a resolve of more entries leaves the spare slots alone (LRU victims, as without spare
    slots) and no refill follows it; one of at most that many takes them, and its refill runs."""
    m, host, table, rpi, sl = make(slots=128, impl=impl, spare=16, spare_max_entries=60)
    locs = table.req_to_token[rpi[1]].long()
    m.begin_step()
    m.resolve(0, _positions(range(40)), table.req_to_token, rpi, sl)  # 2 x 40 entries (one row padding): > 60
    assert not m.refill_follows(0) and not m.uses_spare(80) and m.uses_spare(60)
    m.refill_spares(0)  # follows a resolve that left them alone: nothing happens
    assert int(m.spare_taken[0]) == 16 and bool((m.spare[0] == -1).all())
    m.begin_step()
    pos = _positions(range(40, 70))[1:]  # one batch entry: 30 entries
    slots = m.resolve(0, pos, table.req_to_token, rpi[1:], sl[1:])
    check_slots(m, host, 0, slots[0, 0], locs[40:70])
    assert m.refill_follows(0)
    m.refill_spares(0)  # now it runs: 16 free slots set aside
    assert int(m.spare_taken[0]) == 0
    spare = m.spare[0, :16].long().clone()
    m.begin_step()
    big = m.resolve(0, _positions(range(70, 105)), table.req_to_token, rpi, sl)  # 70 entries: LRU only
    check_slots(m, host, 0, big[1, 0], locs[70:105])
    assert int(m.spare_taken[0]) == 0 and torch.equal(m.spare[0, :16].long(), spare)
    assert not set(big[1, 0].long().tolist()) & set(spare.tolist())
    m.begin_step()
    small = m.resolve(0, _positions(range(105, 125)), table.req_to_token, rpi, sl)  # 40 entries: spare first
    check_slots(m, host, 0, small[1, 0], locs[105:125])
    assert torch.equal(small[1, 0, :16].long(), spare) and int(m.spare_taken[0]) == 16
    m.check_invariants()
