"""Top-k traces: the .npz format, its validation, the synthetic generator's knobs, the demo recorder, the ESS replay."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from ess_sglang.hisparse_policy import replay_hisparse
from ess_sglang.traces import (
    SyntheticTraceConfig,
    TopKTrace,
    TraceError,
    record_demo_trace,
    replay_ess,
    synthetic_trace,
)

SMALL = dict(batch=3, context_len=1024, top_k=64, steps=24, num_layers=2, recent_window=64, warmup_windows=4,
             sink_tokens=3)


def small(**knobs) -> TopKTrace:
    return synthetic_trace(SyntheticTraceConfig(**{**SMALL, **knobs}))


def step_overlap(t: TopKTrace, layer: int, exclude_fixed: int = 0) -> float:
    """Mean fraction of a step's selection also selected at the previous step (same request and layer)."""
    fr = []
    for s in range(1, t.steps):
        for b in range(t.batch):
            a, p = t.topk[s, layer, b], t.topk[s - 1, layer, b]
            fr.append(np.intersect1d(a[a >= 0], p[p >= 0]).size / (a >= 0).sum())
    return float(np.mean(fr))


# ------------------------------------------------------------------------------------------------ format

def test_round_trip_keeps_everything(tmp_path):
    t = small()
    path = t.save(tmp_path / "t")
    assert path.suffix == ".npz"
    u = TopKTrace.load(path)
    assert np.array_equal(u.topk, t.topk) and u.topk.dtype == np.int32
    assert np.array_equal(u.seq_lens, t.seq_lens)
    assert np.array_equal(u.warmup_topk, t.warmup_topk)
    assert u.meta == json.loads(json.dumps(t.meta))
    with np.load(path) as z:  # short sequences are stored narrow
        assert z["topk"].dtype == np.int16


def test_compact_round_trip_keeps_the_sets(tmp_path):
    t = small()
    t.topk[0, 0, 0, -5:] = -1  # some padding
    u = TopKTrace.load(t.save(tmp_path / "c.npz", compact=True))
    assert u.meta["rows_sorted"] is True
    for a, b in ((t.topk, u.topk), (t.warmup_topk, u.warmup_topk)):
        ra, rb = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        assert all(set(x[x >= 0].tolist()) == set(y[y >= 0].tolist()) for x, y in zip(ra, rb, strict=True))
        valid = np.where(rb >= 0, rb, np.iinfo(np.int32).max)
        assert (np.diff(valid, axis=1) >= 0).all()  # sorted, padding last
    assert (tmp_path / "c.npz").stat().st_size < (t.save(tmp_path / "p.npz")).stat().st_size


def test_round_trip_long_sequences_stay_int32(tmp_path):
    topk = np.array([[[[40000, 3, -1]]], [[[40001, 0, 7]]]], dtype=np.int32)  # [2 steps, 1 layer, 1 req, k=3]
    t = TopKTrace(topk=topk, seq_lens=np.array([[40001], [40002]]), meta={"source": "hand"})
    u = TopKTrace.load(t.save(tmp_path / "long.npz"))
    assert np.array_equal(u.topk, topk) and u.warmup_topk is None and u.prompt_lens.tolist() == [40000]
    with np.load(tmp_path / "long.npz") as z:
        assert z["topk"].dtype == np.int32


def test_subset_is_a_valid_smaller_trace():
    t = small()
    u = t.subset(steps=5, layers=[1], requests=[0, 2])
    assert u.topk.shape == (5, 1, 2, 64) and u.warmup_topk.shape == (1, 2, 4, 64)
    assert np.array_equal(u.topk[:, 0, 1], t.topk[:5, 1, 2])
    u.validate()


def _base():
    topk = np.array([[[[0, 5, -1]]], [[[1, 6, 2]]]], dtype=np.int32)
    return dict(topk=topk, seq_lens=np.array([[7], [8]], dtype=np.int32))


@pytest.mark.parametrize("change, field", [
    (lambda d: d.update(topk=d["topk"][0]), "trace.topk"),
    (lambda d: d.update(topk=d["topk"].astype(np.float32)), "trace.topk"),
    (lambda d: d["topk"].__setitem__((1, 0, 0, 2), 8), "trace.topk"),  # == seq_len: outside
    (lambda d: d["topk"].__setitem__((0, 0, 0, 2), -2), "trace.topk"),
    (lambda d: d["topk"].__setitem__((1, 0, 0, 2), 6), "trace.topk"),  # selected twice
    (lambda d: d.update(seq_lens=np.array([[7], [9]])), "trace.seq_lens"),  # grows by 2
    (lambda d: d.update(seq_lens=np.array([7, 8])), "trace.seq_lens"),
    (lambda d: d.update(warmup_topk=np.array([[[[6, 0, 1]]]])), "trace.warmup_topk"),  # 6 >= prompt_len 6
    (lambda d: d.update(warmup_topk=np.zeros((1, 1, 1, 2), dtype=np.int32)), "trace.warmup_topk"),
    (lambda d: d.update(meta={"x": object()}), "trace.meta"),
])
def test_validation_errors_name_the_field(change, field):
    d = _base()
    TopKTrace(**d).validate()
    change(d)
    with pytest.raises(TraceError, match=rf"^{field}:"):
        TopKTrace(**d).validate()


def test_load_rejects_other_versions_and_other_files(tmp_path):
    path = small().save(tmp_path / "t.npz")
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["format_version"] = np.int32(99)
    np.savez_compressed(tmp_path / "v99.npz", **arrays)
    with pytest.raises(TraceError, match="trace.format_version"):
        TopKTrace.load(tmp_path / "v99.npz")
    np.savez_compressed(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(TraceError, match="missing"):
        TopKTrace.load(tmp_path / "other.npz")


# ------------------------------------------------------------------------------------------------ generator

def test_config_forbids_unknown_knobs_and_checks_them():
    with pytest.raises(ValidationError, match="overlapp"):
        SyntheticTraceConfig(overlapp=0.5)
    with pytest.raises(ValidationError, match="overlap"):
        SyntheticTraceConfig(num_layers=3, overlap=[0.9, 0.8])
    with pytest.raises(ValidationError, match="overlap"):
        SyntheticTraceConfig(overlap=1.5)
    with pytest.raises(ValidationError, match="recency"):
        SyntheticTraceConfig(recency=-0.1)


def test_generator_is_deterministic_for_a_seed():
    a, b, c = small(seed=7), small(seed=7), small(seed=8)
    assert np.array_equal(a.topk, b.topk) and np.array_equal(a.warmup_topk, b.warmup_topk)
    assert not np.array_equal(a.topk, c.topk)


def test_shapes_lengths_and_growth():
    t = small()
    assert t.topk.shape == (24, 2, 3, 64)
    assert len(set(t.prompt_lens.tolist())) == 3 and t.prompt_lens[0] == 1024  # requests of different lengths
    assert (np.diff(t.seq_lens, axis=0) == 1).all()
    assert (t.topk >= 0).all()  # contexts are longer than k: full rows


def test_sink_tokens_and_newest_are_always_selected():
    t = small(sink_tokens=5, overlap=0.3, burst_prob=0.3)
    for s in range(t.steps):
        for layer in range(t.num_layers):
            for b in range(t.batch):
                row = set(t.topk[s, layer, b].tolist())
                assert set(range(5)) <= row
                assert int(t.seq_lens[s, b]) - 1 in row
    without = small(sink_tokens=0, newest_always=False, recency=0.0)
    assert not all(0 in set(without.topk[s, 0, 0].tolist()) for s in range(without.steps))


def test_overlap_knob_sets_the_step_to_step_overlap():
    fixed = 3 + 1  # sinks + newest: always shared
    for ov in (0.5, 0.8, 0.95):
        measured = step_overlap(small(overlap=ov), 0)
        expected = (fixed + ov * (64 - fixed)) / 64
        assert abs(measured - expected) < 0.03, (ov, measured, expected)


def test_per_layer_overlap():
    t = small(overlap=[0.95, 0.5])
    assert step_overlap(t, 0) > step_overlap(t, 1) + 0.3


def test_recency_knob_moves_picks_to_the_recent_window():
    def recent_share(t):
        fr = []
        for s in range(t.steps):
            for b in range(t.batch):
                row = t.topk[s, 0, b]
                fr.append(((row >= t.seq_lens[s, b] - 64) & (row >= 3)).mean())
        return float(np.mean(fr))

    lo, hi = recent_share(small(recency=0.0)), recent_share(small(recency=0.8))
    assert hi > lo + 0.2, (lo, hi)


def test_bursts_replace_a_large_fraction():
    calm = step_overlap(small(overlap=0.95), 0)
    stormy = step_overlap(small(overlap=0.95, burst_prob=1.0, burst_fraction=0.7), 0)
    assert calm > 0.9 and stormy < 0.4, (calm, stormy)


def test_higher_overlap_gives_higher_hit_rates_in_both_pools():
    slots = SMALL["batch"] * (2 * 64 + 2)
    rates = []
    for ov in (0.6, 0.9, 0.98):
        t = small(overlap=ov)
        rates.append((replay_ess(t, slots).hit_rate, replay_hisparse(t, 128, extra_page=2).hit_rate))
    ess, hs = zip(*rates, strict=True)
    assert ess[0] < ess[1] < ess[2] and hs[0] < hs[1] < hs[2], rates


# ------------------------------------------------------------------------------------------------ replay, demo

def test_ess_replay_counts_every_lookup_and_warm_up():
    t = small()
    slots = 3 * 130
    r = replay_ess(t, slots)
    assert r.lookups.tolist() == t.lookups().tolist()
    assert (r.misses > 0).all() and (r.misses < r.lookups).all()
    assert ((r.warmup_entries > 0) & (r.warmup_entries <= slots)).all()
    assert r.miss_bytes == int(r.misses.sum()) * 656
    cold = replay_ess(t, slots, warmup="none")
    assert cold.warmup_entries.sum() == 0 and cold.misses.sum() > r.misses.sum()
    assert replay_hisparse(t, 128).lookups.tolist() == t.lookups().tolist()
    with pytest.raises(RuntimeError, match="too small"):
        replay_ess(t, 3 * 60)  # cannot hold one step's selections


def test_ess_replay_stores_new_tokens_as_the_runtime_does():
    # default (EssConfig.new_tokens, "insert"): a hot slot; "on_demand": written back only, a selected one is a miss
    t = small()
    slots = 3 * 130
    on_demand, insert = replay_ess(t, slots, new_tokens="on_demand"), replay_ess(t, slots)
    assert insert.extra["new_tokens_mode"] == "insert"
    assert on_demand.extra["new_tokens_mode"] == "on_demand" and on_demand.extra["new_tokens"] == 0
    assert insert.extra["new_tokens"] == t.steps * t.batch * t.num_layers
    assert on_demand.lookups.tolist() == insert.lookups.tolist()
    with pytest.raises(ValueError, match="new_tokens must be 'insert' or 'on_demand', got 'later'"):
        replay_ess(t, slots, new_tokens="later")


def test_demo_recorder_captures_the_indexer_selection():
    t = record_demo_trace(batch=2, context_len=256, steps=3, layers=2, top_k=32, warmup_windows=4, num_heads=2)
    assert t.topk.shape == (3, 2, 2, 32) and t.warmup_topk.shape == (2, 2, 4, 32)
    assert (t.topk >= 0).all() and t.meta["source"] == "demo"
    # same seed, same trace; the layers select differently
    u = record_demo_trace(batch=2, context_len=256, steps=3, layers=2, top_k=32, warmup_windows=4, num_heads=2)
    assert np.array_equal(t.topk, u.topk)
    assert not np.array_equal(t.topk[:, 0], t.topk[:, 1])


@pytest.mark.parametrize("name, text", [("smollm2-135m_sample.npz", "pydoc_data.topics"),
                                        ("smollm2-135m_code_sample.npz", "the source of argparse")])
def test_committed_real_model_samples_are_valid(name, text):
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "traces" / name
    assert path.stat().st_size < 2_000_000
    t = TopKTrace.load(path)
    assert t.meta["source"] == "real" and t.num_layers == 30 and t.top_k == 256 and t.warmup_windows == 32
    assert t.prompt_lens.tolist() == t.meta["prompt_lens"] and t.meta["text"].startswith(text)
