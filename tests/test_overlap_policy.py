"""The per-layer overlap policy (cost model, profile files, their errors) and the `ess profile` command."""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import yaml

from ess_sglang.cli import build_parser, main
from ess_sglang.overlap_policy import (
    MODES,
    DeviceTimings,
    ModeTimes,
    OverlapProfileError,
    ProfileHeader,
    best_mode,
    build_profile,
    choose_modes,
    device_timings_from_mapping,
    dump_profile,
    exposed_times,
    load_profile,
    modes_for_layers,
    profile_from_mapping,
    restrict_modes,
    save_profile,
)
from ess_sglang.profile_cmd import make_profile
from ess_sglang.traces import SyntheticTraceConfig, replay_ess, synthetic_trace

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "configs" / "overlap" / "smollm2-135m_ratio0.2.yaml"
B64, C32K = 64, 32768


# ------------------------------------------------------------------------------------------------ cost model

def test_h200_defaults():
    d = DeviceTimings()
    assert (d.dba_overhead_us, d.dba_split) == (130.0, 0.75)
    assert (d.dba_hidden_fraction, d.h2d_gbps, d.resolve_us) == (0.8, 42.0, 40.0)


def test_modes_at_batch_64_and_32k_context():
    # 0 misses, a few (1% of 64 x 2048 lookups), many (15%), huge: sync everywhere at batch 64 and 32K context
    assert choose_modes([0, 1311, 19661, 200000], B64, C32K) == ["sync"] * 4
    d = DeviceTimings()
    assert d.indexer_time_us((1 - d.dba_split) * B64, C32K) == pytest.approx(75.0)  # half B: 16 requests
    misses = list(range(0, 100001, 250)) + [3841, 3842, 11311, 26774]
    assert set(choose_modes(misses, B64, C32K)) == {"sync"}
    for m in misses:
        t = exposed_times(m, B64, C32K, d)
        # DBA hides at most 0.8 x I(16, 32K) = 60 us, less than its 130 us overhead
        assert t.dba - t.sync >= 130 - 0.8 * 75 - 1e-9
    # from T = 60 us (3,842 misses) half B's indexer window is full: dba stays exactly 70 us behind sync
    for m in (3842, 20000, 50000):
        t = exposed_times(m, B64, C32K, d)
        assert t.dba - t.sync == pytest.approx(70.0)
    t = exposed_times(3841, B64, C32K, d)
    assert t.dba - t.sync > 70
    # the old 25 us overhead would have picked dba here: the 130 us (second top-k) is what keeps it sync
    assert choose_modes([10000], B64, C32K, DeviceTimings(dba_overhead_us=25.0)) == ["dba"]
    assert choose_modes([11700], 128, 131072, d) == ["dba"]

    # DBA wins only where half B's window exceeds 130 / 0.8 = 162.5 us (B x C > 4,543,829), and then only above
    # T = 176.7 us (11,311 misses)
    assert choose_modes([11310, 11311, 100000], B64, 70997) == ["sync"] * 3
    assert choose_modes([11310, 11311, 100000], B64, 70998) == ["sync", "dba", "dba"]
    assert choose_modes([11310, 11311], 128, 35498) == ["sync"] * 2
    assert choose_modes([11310, 11311], 128, 35499) == ["sync", "dba"]
    assert choose_modes([100000], 138, C32K) == ["sync"]
    assert choose_modes([11310, 11311], 139, C32K) == ["sync", "dba"]
    for b in (305, 400, 1000, 3000):
        assert set(choose_modes([11311, 26774, 50000, 400000], b, C32K)) == {"dba"}


# Measured decode stack (an early run of benchmarks/decode_layers.py, H200, 2026-11-29, whose results file later runs
# replaced; 4 layers, dba split 0.75, 16 copy programs, torch top-k): context, batch, target hit, per-layer us of
# sync / dba, sync's H2D MB per step (4 layers), and sync's distinct misses per layer and step. (The same run measured
# da, since removed, slower than sync in all 18.)
MEASURED = [
    (32768, 16, 0.9, 322.0, 384.9, 7.91, (2945.1, 2981.1, 3097.6, 3040.9)),
    (32768, 16, 0.95, 300.4, 377.7, 3.74, (1394.9, 1405.5, 1460.8, 1445.4)),
    (32768, 16, 0.99, 286.9, 368.6, 0.72, (273.8, 266.8, 282.9, 281.6)),
    (32768, 64, 0.9, 876.8, 861.9, 31.53, (11925.4, 11967.8, 12020.0, 12150.1)),
    (32768, 64, 0.95, 766.6, 785.8, 14.95, (5631.1, 5628.9, 5688.8, 5840.9)),
    (32768, 64, 0.99, 668.5, 755.4, 3.00, (1122.4, 1122.0, 1156.0, 1180.0)),
    (32768, 128, 0.9, 1672.3, 1539.9, 62.63, (23852.9, 24027.4, 23846.2, 23744.8)),
    (32768, 128, 0.95, 1441.2, 1337.2, 31.25, (11852.6, 11967.5, 11943.6, 11875.8)),
    (32768, 128, 0.99, 1206.7, 1272.6, 6.02, (2276.8, 2302.1, 2305.4, 2294.0)),
    (131072, 16, 0.9, 646.1, 701.5, 8.07, (3163.0, 3008.6, 3075.8, 3051.1)),
    (131072, 16, 0.95, 609.3, 693.0, 3.79, (1480.5, 1407.1, 1442.9, 1440.8)),
    (131072, 16, 0.99, 578.7, 685.5, 0.73, (285.4, 276.2, 278.1, 275.4)),
    (131072, 64, 0.9, 2113.4, 1990.2, 30.83, (11785.5, 11762.0, 11711.6, 11732.0)),
    (131072, 64, 0.95, 1944.8, 1959.4, 15.26, (5828.6, 5857.0, 5809.5, 5766.0)),
    (131072, 64, 0.99, 1810.6, 1928.0, 2.92, (1120.0, 1125.9, 1107.0, 1095.2)),
    (131072, 128, 0.9, 4128.1, 3768.1, 62.00, (23816.2, 23580.5, 23670.9, 23448.5)),
    (131072, 128, 0.95, 3769.1, 3704.6, 30.74, (11842.5, 11645.0, 11725.9, 11643.2)),
    (131072, 128, 0.99, 3480.6, 3647.5, 5.90, (2248.6, 2224.8, 2257.9, 2260.4)),
]


def test_choices_against_the_measured_decode_stack():
    picked_best, losses = 0, {}
    for context, batch, hit, sync, dba, _, misses in MEASURED:
        measured = {"sync": sync, "dba": dba}
        modes = choose_modes(misses, batch, context)
        t = sum(measured[m] for m in modes) / len(modes)
        loss = t / min(measured.values()) - 1
        picked_best += loss == 0
        losses[(context, batch, hit)] = loss
    assert picked_best == 15
    worst = max(losses, key=losses.get)
    assert worst == (32768, 128, 0.9) and losses[worst] == pytest.approx(1672.3 / 1539.9 - 1)  # 8.6%
    assert choose_modes(MEASURED[-2][-1], 128, 131072) == ["dba"] * 4


def test_exposed_times_follow_the_documented_formulas():
    d = DeviceTimings()
    assert d.indexer_time_us(32, C32K) == pytest.approx(150.0)
    assert d.indexer_time_us(16, C32K) == pytest.approx(75.0)

    # H200 defaults: half B's window (I(16, 32K) = 75 us) not full, then full
    T = 2000 * 656 / 42e3  # 31.2 us: f (T + R) = 53.4 < 75
    t = exposed_times(2000, B64, C32K, d)
    assert t.sync == pytest.approx(40 + T)
    assert t.dba == pytest.approx(40 + T - 0.8 * 0.75 * (T + 40) + 130)
    T = 20000 * 656 / 42e3  # 312.4 us
    t = exposed_times(20000, B64, C32K, d)
    assert t.sync == pytest.approx(40 + T)
    assert t.dba == pytest.approx(40 + T - 0.8 * 75 + 130)

    # other constants, an uneven split: half A (f = 0.25) hides, half B's indexer (0.75 B, not rounded) is the window
    o = DeviceTimings(resolve_us=10.0, dba_hidden_fraction=0.5, dba_split=0.25, dba_overhead_us=3.0)
    T = 10000 * 656 / 42e3  # 156.2 us
    t = exposed_times(10000, B64, C32K / 2, o)
    assert o.indexer_time_us(48, C32K / 2) == pytest.approx(112.5)
    assert t.dba == pytest.approx(10 + T - 0.5 * 0.25 * (T + 10) + 3)  # f (T + R) = 41.5 < 112.5
    t = exposed_times(10000, 10, C32K / 2, o)
    window = 300 * 7.5 * (C32K / 2) / (64 * C32K)  # I(7.5, 16K) = 17.6 us
    assert t.dba == pytest.approx(10 + T - 0.5 * window + 3)

    # batch 1 cannot be split: dba is unavailable and never chosen
    one = exposed_times(50000, 1, C32K, d)
    assert one.dba is None and choose_modes([50000], 1, C32K, d) == ["sync"]


def test_zero_misses_is_sync_even_where_dba_predicts_less():
    # dba hides part of half A's resolve, so with no overhead it predicts less than sync: still sync with no misses
    d = DeviceTimings(dba_overhead_us=0.0)
    t = exposed_times(0, B64, C32K, d)
    assert t.dba == pytest.approx(40 - 0.8 * 0.75 * 40) and t.dba < t.sync
    assert choose_modes([0, 1], B64, C32K, d) == ["sync", "dba"]


def test_best_mode_among_some_modes_and_a_profile_within_them():
    """A runtime that runs only some modes (the SGLang plugin: sync, one-chunk prefetch) takes, in a layer profiled
    with another, the fastest of its own by the layer's times; sync always counts, ties go to the earlier mode."""
    t = ModeTimes(sync=100.0, dba=60.0, prefetch=90.0, prefetch2=40.0, prefetch_margin=95.0)
    assert best_mode(t, 10) == "prefetch2"
    assert best_mode(t, 10, among=("prefetch", "prefetch_margin")) == "prefetch"
    assert best_mode(t, 10, among=()) == "sync" and best_mode(t, 0, among=("prefetch",)) == "sync"
    assert best_mode(ModeTimes(sync=90.0, dba=None, prefetch=90.0), 10, among=("prefetch",)) == "sync"
    profile = load_profile(ROOT / "configs" / "overlap" / "smollm2-135m_ratio0.2_h200-measured.yaml")
    within = profile.modes_within(("sync", "prefetch"))
    for lp, mode in zip(profile.layers, within, strict=True):
        t = lp.exposed_us
        assert mode == (lp.mode if lp.mode in ("sync", "prefetch") else "prefetch" if t.prefetch < t.sync else "sync")
    assert set(within) == {"sync", "prefetch"} and "prefetch2" in profile.modes()
    assert profile.prefetch_margins(within) == [0.0] * len(within)
    # a margin mode's time where the calibration measured no margin (a hand-edited file) is never chosen
    assert profile.device.measured.prefetch_margin is None
    edited = profile.model_copy(update={"layers": [lp.model_copy(update={
        "mode": "prefetch2", "exposed_us": lp.exposed_us.model_copy(update={"prefetch_margin": 0.5})})
        for lp in profile.layers]})
    assert edited.modes_within(("sync", "prefetch", "prefetch_margin")) == \
        profile.model_copy(update={"layers": [lp.model_copy(update={"mode": "prefetch2"}) for lp in profile.layers]}) \
        .modes_within(("sync", "prefetch"))
    assert edited.prefetch_margins(["prefetch_margin"] * len(within)) == [0.0] * len(within)


def test_restrict_modes_by_overlap_level():
    modes = ["sync", "prefetch", "dba"]
    assert restrict_modes(modes, "full") == restrict_modes(modes, "auto") == modes
    assert restrict_modes(modes, "none") == ["sync"] * 3
    with pytest.raises(OverlapProfileError, match="prefetch_overlap_level: 'fast'"):
        restrict_modes(modes, "fast")


# ------------------------------------------------------------------------------------------------ files

def _header(**kw) -> ProfileHeader:
    base = dict(command="ess profile --synthetic", date="2026-11-29T00:00:00Z", source="synthetic", trace="t",
                trace_batch=4, trace_top_k=256, trace_context_mean=4000.0, steps=3, slots_per_layer=2048, ratio=0.2,
                warmup="auto", batch=B64, context=C32K, top_k=2048, miss_scale=128.0, chosen_by="mean")
    return ProfileHeader(**{**base, **kw})


def _profile():
    misses = np.array([[0, 10, 100, 5], [0, 12, 140, 7], [0, 8, 120, 6]])  # [steps, layers]
    return build_profile(misses, np.full_like(misses, 1024), _header())


def test_build_save_load_round_trip(tmp_path):
    p = _profile()
    assert [lp.misses_mean for lp in p.layers] == [0.0, 10.0, 120.0, 6.0]
    assert p.layers[2].misses_p95 == pytest.approx(float(np.percentile([100, 140, 120], 95)))
    assert [lp.model_misses for lp in p.layers] == [0.0, 1280.0, 15360.0, 768.0]
    assert p.modes() == ["sync"] * 4  # batch 64, 32K: sync at every miss count (15,360 misses here)
    assert build_profile(np.array([[0, 150]]), np.full((1, 2), 1024), _header(context=65536)).modes() == [
        "sync", "sync"]  # 19,200 misses at 64K context: half B's window I(16, 64K) = 150 us hides 120 < 130 us
    assert build_profile(np.array([[0, 150]]), np.full((1, 2), 1024), _header(context=131072)).modes() == [
        "sync", "dba"]  # at 128K context half B's window (300 us) pays DBA's 130 us
    assert p.layers[1].hit_rate == pytest.approx(1 - 30 / 3072, abs=1e-6)
    path = save_profile(p, tmp_path / "sub" / "p.yaml")
    q = load_profile(path, num_layers=4)
    assert q == p
    assert dump_profile(q) == path.read_text()
    assert modes_for_layers(path, 4) == modes_for_layers(q, 4) == p.modes()
    # a profile without prefetch3 times names no prefetch3 key: code from before those modes reads it too
    assert "prefetch3" not in path.read_text()


def _write(tmp_path, mutate) -> Path:
    """Save the small profile, let `mutate` edit its parsed YAML (or text), write it back."""
    path = save_profile(_profile(), tmp_path / "bad.yaml")
    data = yaml.safe_load(path.read_text())
    out = mutate(data)
    path.write_text(out if isinstance(out, str) else yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["layers"][3].update(mode="dab"), ["layers[3].mode (layer 3)", "unknown mode 'dab'", "sync, dba"]),
    (lambda d: d["layers"][2].update(mode=3), ["layers[2].mode (layer 2)", "string"]),
    (lambda d: d["layers"][1].update(layer=5), ["layers[1].layer (layer 5)", "expected layer 1"]),
    (lambda d: d["layers"][0].update(misses_mean=-1), ["layers[0].misses_mean (layer 0)", "greater than or equal"]),
    (lambda d: d["layers"][0]["exposed_us"].pop("dba"), ["layers[0].exposed_us.dba (layer 0)", "missing"]),
    (lambda d: d.pop("header"), ["header: required key is missing"]),
    (lambda d: d.update(extra_key=1), ["extra_key: unknown key"]),
    (lambda d: d["header"].update(source="magic"), ["header.source"]),
    (lambda d: d["device"].update(h2d_gbps=0), ["device.h2d_gbps", "greater than 0"]),
    (lambda d: d["device"].update(dba_split=1.0), ["device.dba_split", "less than 1"]),
    (lambda d: d["device"].update(dba_hidden_fraction=1.5), ["device.dba_hidden_fraction", "less than or equal to 1"]),
    (lambda d: d.update(layers=[]), ["layers: the profile lists no layers"]),
    (lambda d: d.update(format_version=2), ["format_version: 2 is not supported"]),
    (lambda d: "header: [unclosed\n", ["malformed YAML at line", "column"]),
    (lambda d: "- a\n- b\n", ["expected a mapping", "got list"]),
])
def test_every_file_error_names_file_key_and_layer(tmp_path, mutate, expected):
    path = _write(tmp_path, mutate)
    with pytest.raises(OverlapProfileError) as e:
        load_profile(path)
    msg = str(e.value)
    assert str(path) in msg
    for part in expected:
        assert part in msg, msg


def test_da_level_and_da_layers_are_refused_older_da_times_are_left_out(tmp_path, caplog):
    """DA (dual attention) was removed: a config level "da" or a profile layer that chose da fails at load, in one line
    naming the key (docs/design.md); a profile or device-timings file written before the removal, which carries da's
    times and constants beside the other modes', loads without them and keeps every choice."""
    from ess_sglang.config import EssConfigError, load_config

    removed = "'da' was removed (dual attention was slower than sync in every measured configuration"
    cfg = tmp_path / "ess.yaml"
    cfg.write_text("ess_config:\n  prefetch_overlap_level: da\n")
    with pytest.raises(EssConfigError) as e:
        load_config(cfg)
    assert str(e.value) == f"{cfg}: ess_config.prefetch_overlap_level: {removed}: docs/design.md, \"Overlap " \
        f"modes\"); use none, auto or full"
    with pytest.raises(OverlapProfileError, match=re.escape(f"prefetch_overlap_level: {removed}")):
        restrict_modes(["sync"], "da")
    path = _write(tmp_path, lambda d: d["layers"][2].update(mode="da"))
    with pytest.raises(OverlapProfileError) as e:
        load_profile(path)
    assert str(e.value).count("\n") == 0
    assert str(e.value).startswith(f"overlap profile {path}: layers[2].mode (layer 2): {removed}")
    assert "regenerate the profile with `ess profile`" in str(e.value)

    current = load_profile(_write(tmp_path, lambda d: None))

    def older(d):
        for lp in d["layers"]:
            lp["exposed_us"]["da"] = 300.0
        d["device"].update(da_overhead_us=184.0, da_hidden_fraction=0.44, attention_us={1: 22.0, 64: 95.0})

    loaded = load_profile(_write(tmp_path, older))
    assert loaded.modes() == current.modes() and loaded == current
    # a calibrated profile (the shipped H200 one) with DA times in its calibration points too
    shipped = Path(__file__).resolve().parents[1] / "configs/overlap/smollm2-135m_ratio0.2_h200-sglang-topk.yaml"
    data = yaml.safe_load(shipped.read_text())
    assert data["device"]["measured"]["points"]
    older(data)
    for point in data["device"]["measured"]["points"]:
        point["exposed_us"]["da"] = 900.0
    (tmp_path / "calibrated.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    assert load_profile(tmp_path / "calibrated.yaml") == load_profile(shipped)
    with caplog.at_level("WARNING", logger="ess_sglang.overlap_policy"):
        assert device_timings_from_mapping({"device": {"da_hidden_fraction": 0.44}}, "gpu.yaml") == \
            device_timings_from_mapping({"device": {}}, "gpu.yaml")
    assert "gpu.yaml: device.da_hidden_fraction left out" in caplog.text


def test_wrong_layer_count_missing_file_and_bad_arguments(tmp_path):
    path = save_profile(_profile(), tmp_path / "p.yaml")
    with pytest.raises(OverlapProfileError, match=r"p\.yaml: layers: the profile lists 4 layers, the model has 61"):
        modes_for_layers(path, 61)
    with pytest.raises(OverlapProfileError, match=r"overlap profile .*nope\.yaml: no such file"):
        modes_for_layers(tmp_path / "nope.yaml", 4)
    with pytest.raises(OverlapProfileError, match="num_layers: must be a positive integer, got 0"):
        modes_for_layers(path, 0)
    with pytest.raises(OverlapProfileError, match="expected a path or an OverlapProfile, got dict"):
        modes_for_layers({"layers": []}, 4)
    with pytest.raises(OverlapProfileError, match="the model has 3"):
        modes_for_layers(_profile(), 3)


def test_device_timings_overrides_keep_the_other_defaults():
    d = device_timings_from_mapping({"h2d_gbps": 20, "indexer_topk_us": 200})
    assert d.h2d_gbps == 20.0 and d.indexer_topk_us == 200.0 and d.resolve_us == 40.0
    assert device_timings_from_mapping({"device": {"resolve_us": 5}}).resolve_us == 5.0
    e = device_timings_from_mapping({"dba_split": 0.25})
    assert (e.dba_split, e.dba_hidden_fraction, e.h2d_gbps, e.dba_overhead_us) == (0.25, 0.8, 42.0, 130.0)
    assert device_timings_from_mapping({"h2d_gbps": 20}).dba_split == 0.75
    with pytest.raises(OverlapProfileError, match=r"my\.yaml: device\.resolv_us: unknown key"):
        device_timings_from_mapping({"device": {"resolv_us": 5}}, "my.yaml")


# ------------------------------------------------------------------------------------------------ ess profile

TINY = dict(batch=2, context_len=512, top_k=32, steps=10, num_layers=3, recent_window=64, warmup_windows=4,
            overlap=[0.95, 0.8, 0.5], burst_prob=0.1, seed=3)


def _per_step_misses(trace, slots: int) -> np.ndarray:
    """Independent per-step count: replay_ess on every prefix of the trace, differences of the cumulative misses."""
    cum = [np.zeros(trace.num_layers, dtype=np.int64)]
    cum += [replay_ess(trace.subset(steps=s), slots).misses for s in range(1, trace.steps + 1)]
    return np.diff(np.stack(cum), axis=0)


def test_ess_profile_counts_equal_an_independent_replay(tmp_path, capsys):
    trace = synthetic_trace(SyntheticTraceConfig(**TINY))
    npz = trace.save(tmp_path / "tiny.npz")
    out = tmp_path / "overlap" / "tiny.yaml"
    slots = 128
    rc = main(["profile", "--trace", str(npz), "--slots-per-layer", str(slots), "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "misses/step" in printed and f"wrote {out}" in printed
    prof = load_profile(out, num_layers=3)

    per_step = _per_step_misses(trace, slots)
    full = replay_ess(trace, slots)
    assert (per_step.sum(axis=0) == full.misses).all()
    assert per_step.std(axis=0).min() > 0 and full.misses.min() > 0  # the comparison below is not trivial
    for layer, lp in enumerate(prof.layers):
        assert lp.misses_mean == round(float(per_step[:, layer].mean()), 3)
        assert lp.misses_p95 == round(float(np.percentile(per_step[:, layer], 95)), 3)
        assert lp.lookups_mean == round(trace.lookups()[layer] / trace.steps, 3)
        assert lp.hit_rate == pytest.approx(full.hit_rate_per_layer()[layer], abs=1e-6)
    h = prof.header
    assert (h.source, h.trace, h.slots_per_layer, h.ratio, h.steps) == ("trace", str(npz), slots, None, 10)
    assert (h.batch, h.top_k, h.miss_scale) == (2, 32, 1.0)
    assert h.context == round(float(trace.seq_lens.mean()))
    assert h.command == f"ess profile --trace {npz} --slots-per-layer {slots} --out {out}"
    assert prof.modes() == choose_modes([lp.model_misses for lp in prof.layers], h.batch, h.context, prof.device)


def test_ess_profile_synthetic_scales_misses_and_prints_yaml(capsys):
    rc = main(["profile", "--synthetic", "--gen-batch", "2", "--gen-context", "512", "--gen-layers", "2",
               "--gen-steps", "6", "--gen-top-k", "32", "--overlap", "0.9:0.5", "--ratio", "0.3",
               "--batch", "64", "--context", "32768", "--top-k", "2048", "--by", "p95"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "modes:" in cap.err  # the table goes to stderr when the YAML goes to stdout
    prof = profile_from_mapping(yaml.safe_load(cap.out))
    h = prof.header
    assert h.source == "synthetic" and h.chosen_by == "p95" and h.miss_scale == 32 * 64
    tokens = sum(SyntheticTraceConfig(batch=2, context_len=512).prompt_lengths()) + 6 * 2
    assert h.slots_per_layer == math.ceil(math.ceil(0.3 * tokens) / 64) * 64
    for lp in prof.layers:
        assert lp.model_misses == pytest.approx(lp.misses_p95 * 32 * 64, abs=1e-3)
    assert prof.layers[1].misses_mean > prof.layers[0].misses_mean  # overlap 0.5 misses more than 0.9


@pytest.mark.parametrize("argv, expected", [
    (["--trace", "nowhere.npz"], "--trace nowhere.npz: no such file"),
    (["--synthetic", "--gen-batch", "2", "--gen-top-k", "64", "--gen-context", "512", "--slots-per-layer", "64"],
     "--slots-per-layer 64: one step needs batch 2 x (top-k 64 + 1 new token) = 130"),
    (["--synthetic", "--gen-layers", "2", "--overlap", "0.9,0.8,0.7"], "--overlap: 3 values given for num_layers=2"),
    (["--trace", "x.npz", "--gen-batch", "3"], "--gen-batch: only for --synthetic / --demo"),
])
def test_ess_profile_rejects_bad_flags(capsys, argv, expected):
    assert main(["profile", *argv]) == 2
    assert expected in capsys.readouterr().err


def test_ess_profile_bad_device_timings_file(tmp_path, capsys):
    bad = tmp_path / "gpu.yaml"
    bad.write_text("h2d_gbps: fast\n")
    assert main(["profile", "--synthetic", "--device-timings", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"--device-timings {bad}: h2d_gbps:" in err and "'fast'" in err


# ------------------------------------------------------------------------------------------------ the example

def test_committed_example_is_valid_and_reproducible():
    modes = modes_for_layers(EXAMPLE, 30)
    assert len(modes) == 30 and set(modes) <= set(MODES)
    prof = load_profile(EXAMPLE)
    h = prof.header
    assert prof.device == DeviceTimings()  # written with the current H200 constants
    # batch 64, 32K context: DBA wins at no miss count, so every layer is sync
    assert (h.batch, h.context) == (B64, C32K)
    assert modes == ["sync"] * 30
    assert max(lp.model_misses for lp in prof.layers) > 3842  # some layers fill DBA's window and still stay sync
    for lp in prof.layers:
        t = lp.exposed_us
        assert t.sync < t.dba and t.dba - t.sync >= 70 - 1e-3
    assert prof.modes() == modes
    assert modes == choose_modes([lp.model_misses for lp in prof.layers], h.batch, h.context, prof.device)
    with pytest.raises(OverlapProfileError, match="the model has 61"):
        modes_for_layers(EXAMPLE, 61)
    # the command in the header regenerates the same layers
    argv = shlex.split(h.command)
    assert argv[:4] == ["ess", "profile", "--trace", "benchmarks/traces/smollm2-135m_sample.npz"]
    assert argv[-2:] == ["--out", "configs/overlap/smollm2-135m_ratio0.2.yaml"]
    args = build_parser().parse_args(argv[1:])
    args.trace = str(ROOT / args.trace)
    again = make_profile(args)
    assert again.layers == prof.layers and again.device == prof.device
