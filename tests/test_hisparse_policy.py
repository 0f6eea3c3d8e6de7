"""The HiSparse emulator follows SGLang 0.5.23's kernel (kvcacheio/hisparse.cuh) on hand-made steps."""

from __future__ import annotations

import numpy as np
import pytest

from ess_sglang.hisparse_policy import HiSparseBuffer, replay_hisparse
from ess_sglang.traces import SyntheticTraceConfig, TopKTrace, synthetic_trace


def test_lru_eviction_order_and_new_order_as_the_kernel_writes_it():
    # 4 LRU slots; a 10-token prompt on a non-PD server: tokens 0..3 resident in slots 0..3, LRU order 0,1,2,3
    buf = HiSparseBuffer(4, prompt_len=10, max_len=32, warm="staged")
    assert buf.lru_tokens() == [0, 1, 2, 3]
    # seq_len 11: the newest token (10) is a hit in the extra page; 1 hits; 5 misses and takes the LRU-most
    # evictable slot (token 0's); new order: untouched evictables, then the filled slot, then the hits
    assert buf.step(np.array([5, 1, 10, -1]), seq_len=11) == (2, 1)
    assert buf.lru_tokens() == [2, 3, 5, 1]
    # seq_len 12: token 10 was backed up and left the device: a miss like 6 and 7; misses fill slots in LRU order,
    # in top-k order (10 -> token 2's slot, 6 -> 3's, 7 -> 5's), and rank older than this step's hits (none here)
    assert buf.step(np.array([10, 6, 7]), seq_len=12) == (0, 3)
    assert buf.lru_tokens() == [1, 10, 6, 7]
    assert buf.decoded_misses == 1
    # hits keep their old relative order (1 before 7) and move to the MRU end; 8 evicts 10, the LRU-most evictable
    assert buf.step(np.array([7, 8, 1]), seq_len=13) == (2, 1)
    assert buf.lru_tokens() == [6, 8, 1, 7]
    assert buf.resident() == {6, 8, 1, 7}


def test_short_sequences_take_the_fast_path():
    buf = HiSparseBuffer(8, prompt_len=5, max_len=32, warm="staged")
    before = buf.lru_tokens()
    assert buf.step(np.array([0, 3, 5]), seq_len=6) == (3, 0)  # seq_len <= buffer: all resident, order untouched
    assert buf.lru_tokens() == before
    # once longer than the buffer, the tokens decoded while short are still in their slots (0..7 resident)
    assert buf.step(np.array([7, 2, 8]), seq_len=9) == (3, 0)
    assert buf.step(np.array([8]), seq_len=10) == (0, 1)  # 8 was the newest last step: gone now


def test_pd_direct_starts_cold_for_long_prompts_and_preloads_short_ones():
    cold = HiSparseBuffer(4, prompt_len=10, max_len=32, warm="pd_direct")
    assert cold.resident() == set() and cold.warmup_entries == 0
    assert cold.step(np.array([0, 1, 2, 10]), seq_len=11) == (1, 3)
    short = HiSparseBuffer(16, prompt_len=10, max_len=32, warm="pd_direct")
    assert short.warmup_entries == 10
    assert short.step(np.array([0, 9, 10]), seq_len=11) == (3, 0)
    with pytest.raises(ValueError, match="warm"):
        HiSparseBuffer(4, 10, 32, warm="lukewarm")


def test_matches_a_plain_lru_list_model_on_a_random_trace():
    """A second, list-based reading of the kernel: same hits and misses and the same order at every step."""
    rng = np.random.default_rng(3)
    H, prompt = 16, 40
    buf = HiSparseBuffer(H, prompt, 200, warm="staged")
    lru = list(range(H))  # tokens, LRU first
    for step in range(60):
        seq_len = prompt + 1 + step
        sel = rng.choice(seq_len, 8, replace=False)
        hits = [t for t in lru if t in set(sel)]
        misses = [int(t) for t in sel if t not in set(lru) and t != seq_len - 1]
        stale = [t for t in lru if t not in set(sel)]
        expect = (len(sel) - len(misses), len(misses))
        lru = stale[len(misses):] + misses + hits
        assert buf.step(sel, seq_len) == expect
        assert buf.lru_tokens() == lru


def test_replay_counts_per_layer():
    t = synthetic_trace(SyntheticTraceConfig(batch=2, context_len=512, top_k=32, steps=10, num_layers=2,
                                             recent_window=32, warmup_windows=0))
    r = replay_hisparse(t, 64, extra_page=2)
    assert r.lookups.tolist() == t.lookups().tolist()
    assert r.slots_per_layer == 2 * 66 and r.extra["warm"] == "staged"
    assert 0 < r.hit_rate < 1
    # a trace whose requests select only their first 64 tokens hits everything after warm-up
    topk = np.tile(np.arange(32, dtype=np.int32), (5, 1, 1, 1))
    same = TopKTrace(topk=topk, seq_lens=np.arange(500, 505).reshape(5, 1))
    assert replay_hisparse(same, 64).misses.sum() == 0
