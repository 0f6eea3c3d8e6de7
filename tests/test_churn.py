"""Churn: 1,000 requests admitted, decoded, finished or aborted in random order, invariants after every step."""

import random

import torch

from ess_sglang.cache_manager import Counter, HotPoolCacheManager
from ess_sglang.host_pool import HostTotalPool, PoolFullError
from ess_sglang.request_table import RequestTable

LAYERS, TOKENS, MAX_RUNNING, TOP_K, Q = 2, 1800, 8, 48, 2
SLOTS = 896  # >= MAX_RUNNING * Q * TOP_K + MAX_RUNNING * Q, a multiple of 64


def test_thousand_requests_churn():
    rng = random.Random(1234)
    g = torch.Generator().manual_seed(1234)
    host = HostTotalPool(LAYERS, TOKENS, device="cpu")
    host.entries.copy_(torch.randint(0, 256, host.entries.shape, dtype=torch.uint8, generator=g))
    m = HotPoolCacheManager(host, SLOTS, device="cpu", max_selected=MAX_RUNNING * Q * TOP_K)
    table = RequestTable(MAX_RUNNING, 700)
    running = {}  # row -> dict(len, left)
    done = aborted = queued_full = 0
    step = 0
    while done + aborted < 1000:
        # admit: a request reserves its prompt and its new tokens in the host pool, or waits
        while len(running) < MAX_RUNNING and rng.random() < 0.7:
            prompt, new = rng.randint(1, 400), rng.randint(1, 12) * Q
            try:
                locs = host.alloc(prompt + new)
            except PoolFullError:
                queued_full += 1
                break
            row = table.alloc_row()
            table.set(row, 0, locs)
            running[row] = dict(len=prompt, left=new, locs=locs)
            for layer in range(LAYERS):
                m.warm_up(layer, locs[max(0, prompt - rng.randint(0, 64)):prompt])
        if not running:
            continue
        m.begin_step()
        rows = sorted(running)
        # this step's Q new tokens per request: write-back + insert, then select and resolve
        for r in rows:
            running[r]["len"] += Q
        seq = torch.tensor([running[r]["len"] for r in rows])
        new_locs = torch.cat([table.req_to_token[r, running[r]["len"] - Q:running[r]["len"]] for r in rows])
        pos = torch.full((len(rows), Q, TOP_K), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            n = running[r]["len"]
            for q in range(Q):
                sel = torch.randperm(n - (Q - 1 - q), generator=g)[:TOP_K]
                pos[i, q, : sel.numel()] = sel.int()
            if rng.random() < 0.1:
                pos[i, 0, 0] = n + rng.randint(0, 50)  # a bad index
        for layer in range(LAYERS):
            m.write_new_tokens(layer, new_locs, host.entries[layer][new_locs.long()])
            slots = m.resolve(layer, pos, table.req_to_token, torch.tensor(rows), seq)
            locs, _ = m.translate(pos, table.req_to_token, torch.tensor(rows), seq)
            ok = locs >= 0
            assert torch.equal(slots >= 0, ok)
            assert torch.equal(m.hot_entries[layer][slots[ok].long()], host.entries[layer][locs[ok]])
        # finish or abort in random order
        for r in rows:
            running[r]["left"] -= Q
            finish = running[r]["left"] <= 0
            abort = not finish and rng.random() < 0.05
            if finish or abort:
                locs = running.pop(r)["locs"]
                m.release(locs)
                host.free(locs)
                table.free_row(r)
                done += finish
                aborted += abort
        live = torch.cat([v["locs"] for v in running.values()]) if running else torch.empty(0, dtype=torch.int64)
        m.check_invariants(live_locs=live)
        host.check_invariants()
        step += 1
    for r in list(running):
        locs = running.pop(r)["locs"]
        m.release(locs)
        host.free(locs)
        table.free_row(r)
    m.check_invariants(live_locs=torch.empty(0, dtype=torch.int64))
    assert host.num_free == TOKENS and table.num_free == MAX_RUNNING
    for layer in range(LAYERS):
        assert m.resident_count(layer) == 0
    assert int(m.counters[:, Counter.OVERFLOW].sum()) == 0
    assert (m.loc_to_slot[:, :TOKENS] == -1).all() and (m.slot_to_loc[:, :SLOTS] == -1).all()
    hit_rate = 1 - m.counters[:, Counter.MISSES].sum().item() / m.counters[:, Counter.LOOKUPS].sum().item()
    print(f"churn: {done} finished, {aborted} aborted, {step} steps, {queued_full} admissions waited for host memory, "
          f"hit rate {hit_rate:.3f}")
    assert aborted > 10 and done > 500
