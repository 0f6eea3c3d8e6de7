"""The per-layer overlap policy (cost model, profile files, their errors) and the `ess profile` command."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import numpy as np
import pytest
import yaml

from ess_sglang.cli import build_parser, main
from ess_sglang.overlap_policy import (
    MODES,
    DeviceTimings,
    OverlapProfileError,
    ProfileHeader,
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

def test_modes_at_batch_64_and_32k_context():
    # 0 misses, a few (1% of 64 x 2048 lookups), many (15%)
    assert choose_modes([0, 1311, 19661], B64, C32K) == ["sync", "da", "dba"]
    # the thresholds the module docstring states: sync below ~610 misses, da up to ~7,600, dba above
    assert choose_modes([600, 620, 7500, 7700], B64, C32K) == ["sync", "da", "da", "dba"]


def test_exposed_times_follow_the_documented_formulas():
    d = DeviceTimings()
    t = exposed_times(20000, B64, C32K, d)
    T = 20000 * 656 / 40e3  # 328 us
    A, A_half, I_half = 95.0, 42 + 53 * 16 / 48, 150.0
    assert d.attention_time_us(32) == pytest.approx(A_half)
    assert d.indexer_time_us(32, C32K) == pytest.approx(I_half)
    assert t.sync == pytest.approx(40 + T)
    assert t.da == pytest.approx(40 + (T - A) + 10)
    assert t.dba == pytest.approx(40 + (T - I_half - A_half) + 15 + (2 * A_half - A))
    # extrapolation beyond the table continues the last segment
    assert d.attention_time_us(256) == pytest.approx(181 + 86 * 2)
    # batch 1 cannot be split: dba is unavailable and never chosen
    one = exposed_times(50000, 1, C32K, d)
    assert one.dba is None and choose_modes([50000], 1, C32K, d) == ["da"]


def test_zero_misses_is_sync_even_on_a_tie():
    d = DeviceTimings(da_overhead_us=0.0)
    t = exposed_times(0, B64, C32K, d)
    assert t.sync == t.da
    assert choose_modes([0], B64, C32K, d) == ["sync"]


def test_restrict_modes_by_overlap_level():
    modes = ["sync", "da", "dba"]
    assert restrict_modes(modes, "full") == modes
    assert restrict_modes(modes, "da") == ["sync", "da", "da"]
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
    assert p.modes() == ["sync", "da", "dba", "da"]
    assert p.layers[1].hit_rate == pytest.approx(1 - 30 / 3072, abs=1e-6)
    path = save_profile(p, tmp_path / "sub" / "p.yaml")
    q = load_profile(path, num_layers=4)
    assert q == p
    assert dump_profile(q) == path.read_text()
    assert modes_for_layers(path, 4) == modes_for_layers(q, 4) == p.modes()


def _write(tmp_path, mutate) -> Path:
    """Save the small profile, let `mutate` edit its parsed YAML (or text), write it back."""
    path = save_profile(_profile(), tmp_path / "bad.yaml")
    data = yaml.safe_load(path.read_text())
    out = mutate(data)
    path.write_text(out if isinstance(out, str) else yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["layers"][3].update(mode="dab"), ["layers[3].mode (layer 3)", "unknown mode 'dab'", "sync, da, dba"]),
    (lambda d: d["layers"][2].update(mode=3), ["layers[2].mode (layer 2)", "string"]),
    (lambda d: d["layers"][1].update(layer=5), ["layers[1].layer (layer 5)", "expected layer 1"]),
    (lambda d: d["layers"][0].update(misses_mean=-1), ["layers[0].misses_mean (layer 0)", "greater than or equal"]),
    (lambda d: d["layers"][0]["exposed_us"].pop("da"), ["layers[0].exposed_us.da (layer 0)", "missing"]),
    (lambda d: d.pop("header"), ["header: required key is missing"]),
    (lambda d: d.update(extra_key=1), ["extra_key: unknown key"]),
    (lambda d: d["header"].update(source="magic"), ["header.source"]),
    (lambda d: d["device"].update(attention_us={64: 95.0}), ["device.attention_us", "two batch sizes"]),
    (lambda d: d["device"].update(h2d_gbps=0), ["device.h2d_gbps", "greater than 0"]),
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
    d = device_timings_from_mapping({"h2d_gbps": 20, "attention_us": {1: 10, 8: 30}})
    assert d.h2d_gbps == 20.0 and d.attention_us == {1: 10.0, 8: 30.0} and d.resolve_us == 40.0
    assert device_timings_from_mapping({"device": {"resolve_us": 5}}).resolve_us == 5.0
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
    assert len(modes) == 30 and set(modes) <= set(MODES) and {"da", "dba"} <= set(modes)
    prof = load_profile(EXAMPLE)
    h = prof.header
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
