"""Offline retention-policy replays (ess_sglang/retention.py) against the runtime's own replay and the optimum."""

import pytest

from ess_sglang.retention import POLICIES, replay_policy
from ess_sglang.traces import SyntheticTraceConfig, replay_ess, synthetic_trace


def _trace(seed: int = 0, **knobs):
    base = dict(batch=2, context_len=1024, top_k=64, steps=20, num_layers=2, recent_window=64, warmup_windows=4,
                seed=seed)
    return synthetic_trace(SyntheticTraceConfig(**{**base, **knobs}))


@pytest.mark.parametrize("slots", [160, 256])
def test_lru_replays_like_the_runtime_pool(slots):
    """The numpy LRU is ESS's cache manager up to the order in which equally old entries are evicted: "lru_newest"
    is the runtime's default (new_tokens: insert), "lru" its on_demand mode."""
    t = _trace()
    runtime = replay_ess(t, slots, new_tokens="on_demand")
    mine = replay_policy(t, slots, "lru")
    assert mine.lookups.tolist() == runtime.lookups.tolist()
    assert abs(mine.hit_rate - runtime.hit_rate) < 0.005
    assert abs(replay_policy(t, slots, "lru_newest").hit_rate - replay_ess(t, slots).hit_rate) < 0.01


@pytest.mark.parametrize("seed, knobs", [(0, {}), (1, dict(overlap=0.7)), (2, dict(recency=0.7)),
                                         (3, dict(burst_prob=0.2))])
def test_belady_is_the_ceiling_of_every_policy(seed, knobs):
    t = _trace(seed, **knobs)
    for slots in (136, 192):
        rates = {p: replay_policy(t, slots, p).hit_rate for p in POLICIES}
        assert rates["belady"] >= max(rates.values()) - 1e-12, rates
        assert rates["lru_newest"] >= rates["lru"] - 0.002  # the decoded token is selected in its own step


def test_a_short_memory_decay_is_lru():
    t = _trace(4, overlap=0.8)
    assert abs(replay_policy(t, 160, "decay", gamma=0.01).hit_rate - replay_policy(t, 160, "lru_newest").hit_rate) \
        < 0.003


def test_bad_input_is_refused_by_name():
    t = _trace()
    with pytest.raises(ValueError, match="policy must be one of"):
        replay_policy(t, 160, "fifo")
    with pytest.raises(ValueError, match="gamma must be in"):
        replay_policy(t, 160, "decay", gamma=1.0)
    with pytest.raises(ValueError, match="cannot hold one step's selection"):
        replay_policy(t, 100, "lru_newest")  # 2 requests x 64 selected + 2 new tokens > 100


def test_hit_rate_benchmark_writes_every_policy_per_pool_size(tmp_path):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import hit_rate

    assert hit_rate.main(["--quick", "--families", "cycle", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "hit_rate.json").read_text())
    assert (tmp_path / "hit_rate.png").stat().st_size > 0
    [fam] = doc["families"]
    assert fam["name"] == "cycle" and len(fam["rows"]) == 2
    for row in fam["rows"]:
        rates = row["hit_rate"]
        assert set(rates) == {"ess", "ess_on_demand", "ess_decay", "hisparse", *POLICIES}
        assert rates["belady"] >= max(v for v in rates.values() if v is not None) - 1e-12
