"""Measured decode-stack calibration: building it from benchmark JSON, interpolating it, and the policy reading it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ess_sglang.cli import main
from ess_sglang.overlap_policy import (
    MODES,
    DeviceTimings,
    OverlapProfileError,
    ProfileHeader,
    build_profile,
    choose_modes,
    dump_profile,
    exposed_times,
    layer_settings,
    load_profile,
    profile_stack_options,
    restrict_modes,
    save_profile,
    spare_slots_for,
    stack_settings,
)
from ess_sglang.stack_calibration import (
    CalibrationError,
    MeasuredPoint,
    PrefetchChunking,
    StackCalibration,
    calibration_from_decode_layers,
)

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION = ROOT / "configs" / "overlap" / "calibration"  # the shipped decode-stack runs (configs/overlap/README.md)
RUN_1819 = CALIBRATION / "h200_torch-topk_no-spare.json"  # 2026-11-29 18:19 UTC, H200, torch.topk
RUN_2104 = CALIBRATION / "h200_torch-topk_spare-auto.json"  # 21:04 UTC: modes without, with spare slots
# 2026-11-30 01:35 / 01:37 UTC, one H200: the whole table (no layerwise) at prefetch margin 0 and 0.01, spare 0 / 0.1
RUN_M0 = CALIBRATION / "h200_torch-topk_spare0.1_margin0.json"
RUN_M001 = CALIBRATION / "h200_torch-topk_spare0.1_margin0.01.json"
# SGLang's top-k: equal chunks by rows (2026-11-30 06:26 UTC); the shipped pair's margin-0 run (2026-12-01 02:16 UTC)
RUN_SGLANG_EQUAL = CALIBRATION / "h200_sglang-topk_equal-chunks_margin0.json"
RUN_SGLANG_M0 = CALIBRATION / "h200_sglang-topk_margin0.json"
ONE_RUN_MODES = ("sync", "dba", "prefetch", "prefetch2")  # what a run at one margin measures
RUN_MODES = tuple(m for m in MODES if not m.startswith("prefetch3"))  # what the committed pair measured (no prefetch3)


def _rows(context, batch, hit, misses, layer_us):
    """decode_layers.py rows of one configuration: hbm plus each mode's time per layer (4 layers)."""
    base = dict(context=context, batch=batch, target_hit=hit, layers=4)
    rows = [dict(base, variant="hbm", layer_us=100.0, ratio=1.0)]
    for mode, us in layer_us.items():
        rows.append(dict(base, variant=mode, layer_us=us, misses_per_layer_step=[misses] * 4))
    return rows


def _run():
    """A small grid: batches 16 and 64 at contexts 32K and 128K, two hit rates each."""
    rows = []
    for context in (32768, 131072):
        for batch in (16, 64):
            k = batch / 16 * (2 if context == 131072 else 1)
            rows += _rows(context, batch, 0.9, 400.0 * batch / 16,
                          dict(sync=100 + 40 * k, prefetch=100 + 30 * k, prefetch2=100 + 35 * k, dba=300.0))
            rows += _rows(context, batch, 0.99, 40.0 * batch / 16,
                          dict(sync=100 + 10 * k, prefetch=100 + 15 * k, prefetch2=100 + 25 * k, dba=290.0))
    # a small batch measured at one hit rate only (all resident): left out of the grid
    rows += _rows(32768, 1, 0.95, 0.0, dict(sync=120.0, prefetch=125.0, prefetch2=126.0))
    return dict(meta=dict(command="python benchmarks/decode_layers.py", date="2026-11-29", device="test"), rows=rows)


def test_a_run_with_uneven_indexer_chunks_records_them():
    """A calibration records how its runs' prefetchN modes split the indexer (a profile's layers then run that:
    `profile_stack_options`); a run from before the keys measured equal chunks by rows, every chunk prefetching."""
    run = _run()  # (no chunk keys in meta: an old run)
    assert calibration_from_decode_layers(run, "run.json").prefetch_chunking == PrefetchChunking(
        fractions=None, split="rows", indexer="serial", last_chunk_prefetch=True)
    run["meta"].update(prefetch_fractions=[0.6, 0.4], prefetch_split="positions", prefetch_indexer="serial",
                       last_chunk_prefetch=False, chunk_indexer_tiles=2)
    got = calibration_from_decode_layers(run, "run.json").prefetch_chunking
    assert got == PrefetchChunking(fractions=(0.6, 0.4), split="positions", indexer="serial",
                                   last_chunk_prefetch=False, indexer_tiles=2)
    assert got.stack_options() == dict(prefetch_split="positions", last_chunk_prefetch=False,
                                       chunk_plans={2: (0.6, 0.4)}, prefetch_indexer="serial", chunk_indexer_tiles=2)
    assert PrefetchChunking().stack_options() == dict(prefetch_split="rows", last_chunk_prefetch=True,
                                                      chunk_plans=None, chunk_indexer_tiles=None)
    # (the launch: the stack's default; the tiles, not recorded: the kernel's own, as such a run measured)
    margin = json.loads(json.dumps(run))
    margin["meta"]["prefetch_margin"] = 0.01
    assert calibration_from_decode_layers(run, "run.json", margin_run=margin).prefetch_chunking == got
    margin["meta"]["prefetch_fractions"] = [0.5, 0.5]  # the two runs must share them (COMPARABLE_META)
    with pytest.raises(CalibrationError, match=r"the two runs differ in meta\.prefetch_fractions"):
        calibration_from_decode_layers(run, "run.json", margin_run=margin)
    margin["meta"]["prefetch_fractions"] = run["meta"]["prefetch_fractions"]
    margin["meta"]["chunk_indexer_tiles"] = 1  # the chunks' launches (the margin-0 run's: 2)
    with pytest.raises(CalibrationError, match=r"the two runs differ in meta\.chunk_indexer_tiles \(2 against 1\)"):
        calibration_from_decode_layers(run, "run.json", margin_run=margin)
    # a caller that names its launches' tiles gets only runs measured with them (None: the kernel's own)
    assert calibration_from_decode_layers(run, "run.json", chunk_indexer_tiles=2).prefetch_chunking == got
    for caller in (1, None):
        with pytest.raises(CalibrationError, match=rf"run.json: its later prefetch chunks' indexer launches ran 2 "
                                                   rf"tiles a program \(meta.chunk_indexer_tiles; None: the "
                                                   rf"kernel's own\), this run's {caller}"):
            calibration_from_decode_layers(run, "run.json", chunk_indexer_tiles=caller)
    del run["meta"]["chunk_indexer_tiles"]  # a run from before the key: the kernel's own
    assert calibration_from_decode_layers(run, "run.json", chunk_indexer_tiles=None).prefetch_chunking == \
        got.model_copy(update=dict(indexer_tiles=None))
    with pytest.raises(CalibrationError, match="ran None tiles a program"):
        calibration_from_decode_layers(run, "run.json", chunk_indexer_tiles=1)


@pytest.mark.parametrize("key,value,says", [
    ("prefetch_fractions", [0.6, 0.5], "Value error, fractions: two or more fractions in (0, 1) summing to 1, got "
                                       "[0.6, 0.5] (got [0.6, 0.5])"),
    ("prefetch_fractions", [1.0], "Input should be less than 1 (got [1.0])"),
    ("prefetch_fractions", 0.5, "expected a list of chunk fractions or null, got 0.5"),
    ("prefetch_fractions", "0.5,0.5", "expected a list of chunk fractions or null, got '0.5,0.5'"),
    ("prefetch_split", "columns", "Input should be 'rows' or 'positions' (got 'columns')"),
    ("prefetch_indexer", "parallel", "Input should be 'serial', 'overlapped' or 'chained' (got 'parallel')"),
    ("prefetch_indexer", ["serial"], "Input should be 'serial', 'overlapped' or 'chained' (got ['serial'])"),
    ("last_chunk_prefetch", "off", "Input should be a valid boolean (got 'off')"),
    ("chunk_indexer_tiles", 0, "Input should be greater than or equal to 1 (got 0)"),
    ("chunk_indexer_tiles", "1", "Input should be a valid integer (got '1')"),
])
def test_a_malformed_prefetch_chunking_in_a_runs_meta_is_named(key, value, says):
    run = _run()
    run["meta"][key] = value
    for named in (dict(), dict(prefetch_fractions=(0.5, 0.5), prefetch_indexer="serial")):  # checked or not
        with pytest.raises(CalibrationError) as info:
            calibration_from_decode_layers(run, "run.json", **named)
        assert str(info.value) == f"run.json: meta.{key}: {says}"
    plain = _run()
    run["meta"]["prefetch_margin"] = 0.01  # (a margin run's meta is read the same way)
    with pytest.raises(CalibrationError) as info:
        calibration_from_decode_layers(plain, "run.json", margin_run=run)
    assert str(info.value) == f"run.json (margin run): meta.{key}: {says}"


def test_a_run_with_another_top_k_is_refused_when_the_top_k_is_named():
    # the prefetch hides beside the top-k: a run that selected with another one measured other exposed times
    run = _run()  # (no meta.topk: an old run, torch.topk)
    calibration_from_decode_layers(run, "run.json")  # (not named: not checked)
    calibration_from_decode_layers(run, "run.json", topk="torch")
    with pytest.raises(CalibrationError, match=r"run\.json: measured with --topk torch \(meta\.topk\), this run "
                                               r"selects with --topk sglang: its exposed times do not apply"):
        calibration_from_decode_layers(run, "run.json", topk="sglang")
    run["meta"]["topk"] = "sglang"
    calibration_from_decode_layers(run, "run.json", topk="sglang")
    margin = _run()
    margin["meta"].update(topk="torch", prefetch_margin=0.01)
    with pytest.raises(CalibrationError, match=r"run\.json \(margin run\): measured with --topk torch"):
        calibration_from_decode_layers(run, "run.json", margin_run=margin, topk="sglang")


def test_prefetch3_measured_with_uneven_chunks_calibrates_a_run_with_the_same_chunks():
    # the best plan measured on the H200: the indexer in three chunks of 0.5 / 0.3 / 0.2 (benchmarks/RESULTS.md)
    run = _run()
    for r in run["rows"]:
        if r["variant"] == "prefetch2":
            run["rows"].append(dict(r, variant="prefetch3", layer_us=r["layer_us"] - 20))
    run["meta"]["prefetch_fractions"] = [0.5, 0.3, 0.2]
    cal = calibration_from_decode_layers(run, "run.json", prefetch_fractions=(0.5, 0.3, 0.2))
    assert all("prefetch3" in p.exposed_us for p in cal.points)
    with pytest.raises(CalibrationError, match=r"run\.json: measured with indexer chunks \[0\.5, 0\.3, 0\.2\] "
                                               r"\(meta\.prefetch_fractions\), this run's are None"):
        calibration_from_decode_layers(run, "run.json", prefetch_fractions=None)
    # not named: not checked, recorded
    assert calibration_from_decode_layers(run, "run.json").prefetch_chunking.fractions == (0.5, 0.3, 0.2)
    from ess_sglang.overlap_policy import PREFETCH_CHUNKS, stack_settings

    assert stack_settings(["prefetch3", "prefetch3_margin", "sync"]) == (["sync", "sync", "sync"], [3, 3, 0])
    assert PREFETCH_CHUNKS["prefetch3"] == 3


def test_a_run_whose_chunks_were_launched_otherwise_is_refused_when_the_launch_is_named():
    run = _run()  # (no meta.prefetch_indexer: a run from before the key, whose chunks launched one after the other)
    calibration_from_decode_layers(run, "run.json", prefetch_indexer="serial")
    with pytest.raises(CalibrationError, match=r"launched serial \(meta\.prefetch_indexer\), this run's chained"):
        calibration_from_decode_layers(run, "run.json", prefetch_indexer="chained")
    run["meta"]["prefetch_indexer"] = "overlapped"
    calibration_from_decode_layers(run, "run.json", prefetch_indexer="overlapped")
    with pytest.raises(CalibrationError, match=r"run\.json: its prefetch chunks were launched overlapped "
                                               r"\(meta\.prefetch_indexer\), this run's serial"):
        calibration_from_decode_layers(run, "run.json", prefetch_indexer="serial")
    run["meta"]["prefetch_indexer"] = "split"  # (the former name of serial launches)
    assert calibration_from_decode_layers(run, "run.json", prefetch_indexer="serial").prefetch_chunking.indexer == \
        "serial"
    with pytest.raises(CalibrationError, match=r"launched serial \(meta\.prefetch_indexer\), this run's overlapped"):
        calibration_from_decode_layers(run, "run.json", prefetch_indexer="overlapped")
    margin = json.loads(json.dumps(run))  # a margin run that names the same launch by its current name
    margin["meta"].update(prefetch_indexer="serial", prefetch_margin=0.01)
    assert calibration_from_decode_layers(run, "run.json", margin_run=margin).prefetch_chunking.indexer == "serial"
    margin["meta"]["prefetch_indexer"] = "chained"
    with pytest.raises(CalibrationError, match=r"the two runs differ in meta\.prefetch_indexer \('split' against "
                                               r"'chained'\)"):
        calibration_from_decode_layers(run, "run.json", margin_run=margin)


def test_a_run_whose_last_chunk_prefetched_otherwise_is_refused_when_named():
    run = _run()  # (no meta.last_chunk_prefetch: it prefetched, as every run before the key)
    calibration_from_decode_layers(run, "run.json", last_chunk_prefetch=True)
    with pytest.raises(CalibrationError, match=r"run\.json: its last prefetch chunk prefetched: True "
                                               r"\(meta\.last_chunk_prefetch\), this caller's: False"):
        calibration_from_decode_layers(run, "run.json", last_chunk_prefetch=False)
    run["meta"]["last_chunk_prefetch"] = False
    calibration_from_decode_layers(run, "run.json", last_chunk_prefetch=False)
    calibration_from_decode_layers(run, "run.json")  # not named: not checked


def test_a_run_whose_prefetch_chunks_split_otherwise_is_refused_when_the_split_is_named():
    run = _run()  # (no meta.prefetch_split: chunks of batch rows)
    calibration_from_decode_layers(run, "run.json", prefetch_split="rows")
    with pytest.raises(CalibrationError, match=r"run\.json: its prefetch chunks split rows \(meta\.prefetch_split\), "
                                               r"this run's split positions: its exposed times do not apply"):
        calibration_from_decode_layers(run, "run.json", prefetch_split="positions")
    run["meta"]["prefetch_split"] = "positions"
    calibration_from_decode_layers(run, "run.json", prefetch_split="positions")
    margin = _run()
    margin["meta"].update(prefetch_margin=0.01)
    with pytest.raises(CalibrationError, match=r"\(margin run\): its prefetch chunks split rows"):
        calibration_from_decode_layers(run, "run.json", margin_run=margin, prefetch_split="positions")
    # a run from before the key (rows) pairs with one that records "rows"
    old, new = _run(), _run()
    new["meta"].update(prefetch_margin=0.01, prefetch_split="rows", new_tokens_per_step=False)
    calibration_from_decode_layers(old, "run.json", margin_run=new, prefetch_split="rows")


def test_points_from_benchmark_rows_and_exact_at_measured_points():
    cal = calibration_from_decode_layers(_run(), "run.json")
    assert cal.batches == [16, 64] and cal.contexts == [32768, 131072]  # batch 1 has one miss count only
    assert cal.modes == ("sync", "dba", "prefetch", "prefetch2")
    # an older run's rows of the removed mode da (and of layerwise) are not read
    older = _run()
    older["rows"] += [dict(r, variant=v) for r in older["rows"] if r["variant"] == "sync" for v in ("da", "layerwise")]
    assert calibration_from_decode_layers(older, "run.json") == cal
    assert "run.json" in cal.source and "python benchmarks/decode_layers.py" in cal.source
    p = next(p for p in cal.points if (p.batch, p.context, p.misses) == (64, 131072, 1600.0))
    assert p.exposed_us == dict(sync=320.0, dba=200.0, prefetch=240.0, prefetch2=280.0)
    for q in cal.points:  # at a measured point: the measured values, exactly
        assert cal.exposed(q.misses, q.batch, q.context) == pytest.approx(q.exposed_us)


def test_interpolation_in_misses_batch_and_context():
    cal = calibration_from_decode_layers(_run())
    # along misses at one grid point: linear between the points, the end slopes beyond them, never below zero
    mid = cal.exposed(220.0, 16, 32768)
    assert mid["sync"] == pytest.approx(25.0) and mid["prefetch"] == pytest.approx(22.5)
    beyond = cal.exposed(760.0, 16, 32768)
    assert beyond["sync"] == pytest.approx(40 + 30 * 360 / 360)
    assert cal.exposed(0.0, 16, 32768)["sync"] == pytest.approx(10 - 30 * 40 / 360)
    assert cal.exposed(0.0, 16, 32768)["prefetch2"] == pytest.approx(25 - 10 * 40 / 360)
    # between batches: each corner at the same misses per request, weights linear in log batch
    b32 = cal.exposed(800.0, 32, 32768)  # 25 misses per request: the 0.9 point of both batches
    assert b32["sync"] == pytest.approx(0.5 * 40 + 0.5 * 160)
    # between contexts: linear in log context (64K is half-way between 32K and 128K)
    c64 = cal.exposed(400.0, 16, 65536)
    assert c64["sync"] == pytest.approx(0.5 * 40 + 0.5 * 80)
    # outside the grid: None (the policy falls back to the analytic model)
    assert cal.exposed(400.0, 8, 32768) is None and cal.exposed(400.0, 16, 262144) is None
    assert cal.covers(64, 131072) and not cal.covers(128, 32768)
    with pytest.raises(CalibrationError, match="misses: must be a finite number >= 0"):
        cal.exposed(math.nan, 16, 32768)


@pytest.mark.parametrize("points,expected", [
    ([], "holds no points"),
    ([dict(batch=16, context=32768, misses=1.0, exposed_us=dict(sync=1.0)),
      dict(batch=16, context=32768, misses=2.0, exposed_us=dict(sync=2.0)),
      dict(batch=64, context=131072, misses=1.0, exposed_us=dict(sync=1.0)),
      dict(batch=64, context=131072, misses=2.0, exposed_us=dict(sync=1.0))], "batch 16 at context 131072 is missing"),
    ([dict(batch=16, context=32768, misses=1.0, exposed_us=dict(sync=1.0))], "two or more points with distinct"),
    ([dict(batch=16, context=32768, misses=1.0, exposed_us=dict(sync=1.0, fast=0.0))], "unknown mode 'fast'"),
    ([dict(batch=16, context=32768, misses=1.0, exposed_us=dict(prefetch=1.0))], "needs the sync mode"),
])
def test_bad_calibrations_name_what_is_wrong(points, expected):
    with pytest.raises(ValueError, match=expected):
        StackCalibration(source="t", points=[MeasuredPoint(**p) if not isinstance(p, MeasuredPoint) else p
                                             for p in points])


def test_bad_benchmark_json_is_refused():
    with pytest.raises(CalibrationError, match="x.json: expected the JSON of benchmarks/decode_layers.py"):
        calibration_from_decode_layers([], "x.json")
    with pytest.raises(CalibrationError, match=r"x.json: rows\[0\]: not a decode-stack row"):
        calibration_from_decode_layers(dict(rows=[dict(variant="sync")]), "x.json")
    one_hit = dict(rows=_rows(32768, 64, 0.95, 100.0, dict(sync=150.0)))
    with pytest.raises(CalibrationError, match="no configuration was measured at two or more hit rates"):
        calibration_from_decode_layers(one_hit, "x.json")


# ------------------------------------------------------------------------------------------------ the policy

def test_policy_takes_prefetch_modes_from_a_calibration_inside_its_grid_only():
    d = DeviceTimings(measured=calibration_from_decode_layers(_run()))
    t = exposed_times(1600.0, 64, 32768, d)  # the measured 0.9 point at batch 64: prefetch hides most
    assert (t.sync, t.prefetch, t.prefetch2, t.dba, t.prefetch3) == (160.0, 120.0, 140.0, 200.0, None)
    assert choose_modes([1600.0, 160.0], 64, 32768, d) == ["prefetch", "sync"]
    # outside the grid: the analytic model, which offers no prefetch mode
    t = exposed_times(1600.0, 128, 32768, d)
    assert t == exposed_times(1600.0, 128, 32768, DeviceTimings()) and t.prefetch is None and t.prefetch2 is None
    assert set(choose_modes([0, 1000, 20000], 128, 32768, d)) <= {"sync", "dba"}


def test_restrict_and_stack_settings_of_prefetch_modes():
    modes = ["sync", "dba", "prefetch", "prefetch2", "prefetch3", "prefetch_margin", "prefetch2_margin",
             "prefetch3_margin"]
    assert tuple(modes) == MODES
    assert restrict_modes(modes, "full") == modes
    assert restrict_modes(modes, "none") == ["sync"] * 8
    assert stack_settings(modes) == (["sync", "dba"] + ["sync"] * 6, [0, 0, 1, 2, 3, 1, 2, 3])
    with pytest.raises(ValueError, match="mode 'prefetch4' is not one of"):
        stack_settings(["prefetch4"])


def test_calibrated_profile_round_trip_and_layer_settings(tmp_path):
    d = DeviceTimings(measured=calibration_from_decode_layers(_run()))
    header = ProfileHeader(command="t", date="2026-11-29T00:00:00Z", source="synthetic", trace="t", trace_batch=64,
                           trace_top_k=2048, trace_context_mean=32768.0, steps=1, slots_per_layer=4096, warmup="recent",
                           batch=64, context=32768, top_k=2048, miss_scale=1.0, chosen_by="mean")
    misses = np.array([[1600.0, 160.0, 0.0]])
    prof = build_profile(misses, np.full_like(misses, 64 * 2048), header, d)
    assert prof.modes() == ["prefetch", "sync", "sync"]
    path = save_profile(prof, tmp_path / "p.yaml")
    again = load_profile(path, num_layers=3)
    assert again == prof and again.device.measured == d.measured
    assert layer_settings(path, 3) == (["sync"] * 3, [1, 0, 0])
    assert layer_settings(path, 3, "none") == (["sync"] * 3, [0, 0, 0])


def test_the_1819_run_picks_its_fastest_mode_at_every_measured_point():
    # the committed decode-stack run of 18:19 UTC (H200): prefetch2 at batch 64 / 32K / hit 0.95, and at every
    # configuration it measured the policy picks the mode that run measured fastest
    data = json.loads(RUN_1819.read_text())
    d = DeviceTimings(measured=calibration_from_decode_layers(data, str(RUN_1819)))
    assert d.measured.batches == [16, 64, 128] and d.measured.contexts == [32768, 131072]
    assert d.measured.modes == ONE_RUN_MODES and len(d.measured.points) == 18
    for p in d.measured.points:
        best = min(p.exposed_us, key=lambda m: (p.exposed_us[m], MODES.index(m)))
        assert choose_modes([p.misses], p.batch, p.context, d) == [best]
    p = next(p for p in d.measured.points if (p.batch, p.context) == (64, 32768) and 5000 < p.misses < 6000)
    assert choose_modes([p.misses], 64, 32768, d) == ["prefetch2"]


def test_the_runs_with_spare_slots_make_a_calibration_of_their_own():
    """The 21:04 run measured every mode again with spare slots ("mode+spare" rows): read as a calibration of its own,
    its times are those rows' (minus all-HBM), its misses the sync run's, and the policy picks the mode with spare
    slots that run measured fastest, e.g. prefetch2 at 128K / 128 / 0.9 (where that run's layer-wise rows, choosing
    from the 18:19 calibration, ran DBA)."""
    data = json.loads(RUN_2104.read_text())
    plain = calibration_from_decode_layers(data, "run")
    spare = calibration_from_decode_layers(data, "run", spare_slots=True)
    assert "spare slots" in spare.source and "spare slots" not in plain.source
    # a run from before the refill interval refilled every step; times without spare slots record none
    assert spare.spare_refill_interval == 1 and plain.spare_refill_interval is None
    assert len(spare.points) == len(plain.points) == 18 and spare.modes == plain.modes == ONE_RUN_MODES
    rows = {(r["context"], r["batch"], r["target_hit"], r["variant"]): r for r in data["rows"]}
    d = DeviceTimings(measured=spare)
    for p, q in zip(spare.points, plain.points, strict=True):
        assert p.misses == q.misses  # the sync run's, without spare slots
        key = next(k for k in rows if k[:2] == (p.context, p.batch) and k[3] == "sync"
                   and math.isclose(sum(rows[k]["misses_per_layer_step"]) / 4, p.misses, abs_tol=1e-3))
        hbm = rows[(*key[:3], "hbm")]["layer_us"]
        assert p.exposed_us["prefetch2"] == pytest.approx(rows[(*key[:3], "prefetch2+spare")]["layer_us"] - hbm,
                                                          abs=1e-3)
        best = min(p.exposed_us, key=lambda m: (p.exposed_us[m], MODES.index(m)))
        assert choose_modes([p.misses], p.batch, p.context, d) == [best]
    p = next(p for p in spare.points if (p.batch, p.context) == (128, 131072) and p.misses > 20000)
    assert choose_modes([p.misses], 128, 131072, d) == ["prefetch2"]


def test_a_run_without_spare_slots_is_no_spare_calibration(tmp_path, capsys):
    with pytest.raises(CalibrationError, match="x.json: no runs with spare slots"):
        calibration_from_decode_layers(json.loads(RUN_1819.read_text()), "x.json", spare_slots=True)
    assert main(["profile", "--synthetic", "--calibration", str(RUN_1819), "--calibration-spare"]) == 2
    assert "no runs with spare slots" in capsys.readouterr().err
    assert main(["profile", "--synthetic", "--calibration-spare"]) == 2
    assert "--calibration-spare: needs --calibration" in capsys.readouterr().err


def test_ess_profile_with_a_calibration_measured_with_sglangs_top_k_says_nothing_of_it(tmp_path, capsys):
    run = RUN_SGLANG_EQUAL
    argv = ["profile", "--synthetic", "--gen-layers", "2", "--gen-steps", "8", "--batch", "64", "--context", "32768",
            "--top-k", "2048", "--calibration", str(run), "--out", str(tmp_path / "p.yaml")]
    assert main(argv) == 0
    capsys.readouterr()
    assert load_profile(tmp_path / "p.yaml", num_layers=2).device.measured.topk == "sglang"
    assert main(argv) == 0 and "the calibration selected with --topk" not in capsys.readouterr().out


def test_ess_profile_records_a_calibration_whose_last_chunk_did_not_prefetch(tmp_path, capsys):
    """A run that left its last chunk's misses to the resolve measured the prefetchN modes so: the profile records
    it, and the harness's layers run it (`profile_stack_options`); the plugin runs one-chunk prefetch, which has no
    last chunk to leave out."""
    run = json.loads(RUN_SGLANG_EQUAL.read_text())
    run["meta"]["last_chunk_prefetch"] = False
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(run))
    assert main(["profile", "--synthetic", "--gen-layers", "2", "--gen-steps", "8", "--batch", "64", "--context",
                 "32768", "--top-k", "2048", "--calibration", str(path), "--out", str(tmp_path / "p.yaml")]) == 0
    out = capsys.readouterr().out
    assert "the SGLang plugin (one indexer launch and one attention launch per layer) runs: 2 " in out
    prof = load_profile(tmp_path / "p.yaml", num_layers=2)
    assert prof.device.measured.prefetch_chunking.last_chunk_prefetch is False
    assert profile_stack_options(prof, 2)["last_chunk_prefetch"] is False


def test_ess_profile_with_a_spare_slot_calibration(tmp_path, capsys):
    out = tmp_path / "p.yaml"
    argv = ["profile", "--synthetic", "--gen-layers", "2", "--gen-steps", "8", "--batch", "64", "--context", "32768",
            "--top-k", "2048", "--calibration", str(RUN_2104), "--calibration-spare", "--out", str(out)]
    assert main(argv) == 0
    prof = load_profile(out, num_layers=2)
    assert "--calibration-spare" in prof.header.command and "spare slots" in prof.device.measured.source
    # the size to keep: 1.25 x the busiest layer's cost-model misses per step, whole pages
    want = math.ceil(1.25 * max(lp.model_misses for lp in prof.layers) / 64) * 64
    assert prof.spare_slots() == spare_slots_for([lp.model_misses for lp in prof.layers]) == want > 0
    assert f"{want:,} per layer" in capsys.readouterr().out


@pytest.mark.parametrize("misses,headroom,want", [
    ([0.0], 1.25, 0), ([1.0], 1.25, 64), ([100, 5800.5, 3000], 1.25, 7296), ([512], 1.0, 512), ([513], 1.0, 576)])
def test_spare_slots_for_the_busiest_layer_in_whole_pages(misses, headroom, want):
    assert spare_slots_for(misses, headroom) == want


@pytest.mark.parametrize("misses,headroom", [([], 1.25), ([-1.0], 1.25), ([math.nan], 1.25), ([5.0], 0.0)])
def test_spare_slots_for_refuses_bad_input(misses, headroom):
    with pytest.raises(OverlapProfileError, match="misses per layer|headroom"):
        spare_slots_for(misses, headroom)


def test_ess_profile_with_a_calibration(tmp_path, capsys):
    out = tmp_path / "p.yaml"
    argv = ["profile", "--synthetic", "--gen-layers", "3", "--gen-steps", "8", "--batch", "64", "--context", "32768",
            "--top-k", "2048", "--calibration", str(RUN_1819), "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "prefetch2" in printed and "is inside its grid" in printed
    # that run selected with torch.topk (no meta.topk): the plugin selects with SGLang's kernel, so a warning
    assert "the calibration selected with --topk torch" in printed
    prof = load_profile(out, num_layers=3)
    assert prof.device.measured is not None and "--calibration" in prof.header.command
    assert prof.device.measured.topk == "torch"
    for lp in prof.layers:  # every mode's time came from the calibration; the choice is the fastest of them
        assert lp.exposed_us.prefetch is not None and lp.exposed_us.prefetch2 is not None
        times = {m: v for m, v in lp.exposed_us.as_dict().items() if v is not None}
        assert lp.mode == min(times, key=lambda m: (times[m], MODES.index(m))) or lp.model_misses == 0


@pytest.mark.parametrize("content,expected", [
    (None, "no such file"), ("{not json", "cannot read JSON"), ("[]", "expected the JSON of benchmarks/decode_layers"),
])
def test_ess_profile_bad_calibration_file(tmp_path, capsys, content, expected):
    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content)
    assert main(["profile", "--synthetic", "--calibration", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--calibration {path}" in err and expected in err


def test_committed_calibrated_example_is_valid_and_reproducible():
    import shlex

    from ess_sglang.cli import build_parser
    from ess_sglang.profile_cmd import make_profile

    path = ROOT / "configs" / "overlap" / "smollm2-135m_ratio0.2_h200-measured.yaml"
    prof = load_profile(path, num_layers=30)
    assert prof.device.measured is not None and RUN_1819.name in prof.device.measured.source
    assert prof.modes().count("prefetch") == 4 and prof.modes().count("prefetch2") == 26
    argv = shlex.split(prof.header.command)
    assert "--calibration" in argv
    assert argv[-2:] == ["--out", "configs/overlap/smollm2-135m_ratio0.2_h200-measured.yaml"]
    args = build_parser().parse_args(argv[1:])
    args.trace, args.calibration = str(ROOT / args.trace), str(ROOT / args.calibration)
    again = make_profile(args)
    assert again.layers == prof.layers


def test_committed_sglang_topk_profile_records_its_chunks_and_is_reproducible(tmp_path):
    """The profile from the shipped SGLang-top-k calibration pair (SGLang's top-k, spare slots, the indexer in
    segments of 0.5 / 0.3 / 0.2 by positions, chained launches of 1 tile a program after the first, the last segment
    left to the resolve): every layer prefetches in chunks as measured, and the SGLang plugin, which runs one-chunk
    prefetch or none, runs sync in every layer (one-chunk prefetch measured slower than sync at this profile's
    misses)."""
    import shlex

    from ess_sglang.cli import build_parser
    from ess_sglang.decode_stack import StackOptions
    from ess_sglang.profile_cmd import make_profile

    name = "smollm2-135m_ratio0.2_h200-sglang-topk.yaml"
    prof = load_profile(ROOT / "configs" / "overlap" / name, num_layers=30)
    m = prof.device.measured
    assert m.topk == "sglang" and m.prefetch_margin == 0.01 and "h200_sglang-topk_margin0.01.json" in m.source
    assert m.spare_refill_interval == 4  # (its runs with spare slots refilled every 4th step)
    assert m.prefetch_chunking == PrefetchChunking(fractions=(0.5, 0.3, 0.2), split="positions", indexer="chained",
                                                   last_chunk_prefetch=False, indexer_tiles=1)
    assert set(prof.modes()) <= {"prefetch2", "prefetch3", "prefetch2_margin", "prefetch3_margin"}
    assert prof.modes_within(("sync", "prefetch", "prefetch_margin")) == ["sync"] * 30
    modes, chunks = layer_settings(prof, 30)
    opts = StackOptions(modes=modes, prefetch_layers=chunks, **profile_stack_options(prof, 30))
    assert opts.prefetch_split == "positions" and opts.prefetch_indexer == "chained" and not opts.last_chunk_prefetch
    assert opts.chunk_indexer_tiles == 1
    assert {opts.layer_prefetch_fractions[i] for i, c in enumerate(chunks) if c == 3} == {(0.5, 0.3, 0.2)}
    assert {opts.layer_prefetch_fractions[i] for i, c in enumerate(chunks) if c == 2} == {(0.5, 0.5)}
    argv = shlex.split(prof.header.command)
    assert argv[-2:] == ["--out", f"configs/overlap/{name}"]
    args = build_parser().parse_args(argv[1:])
    args.trace = str(ROOT / args.trace)
    args.calibration, args.calibration_margin = str(ROOT / args.calibration), str(ROOT / args.calibration_margin)
    again = make_profile(args)
    assert again.layers == prof.layers  # (the source names the paths as given: here absolute)
    assert again.device.measured.model_copy(update=dict(source=m.source)) == m
    # a chunking without the tiles key (a run from before it) writes none: code from before the key reads it too
    older = m.model_copy(update=dict(prefetch_chunking=m.prefetch_chunking.model_copy(update=dict(indexer_tiles=None))))
    text = dump_profile(prof.model_copy(update=dict(device=prof.device.model_copy(update=dict(measured=older)))))
    assert "indexer_tiles" not in text and "indexer_tiles: 1" in dump_profile(prof)
    # ... and runs its later segments with the kernel's own tiles, as such a run measured
    (tmp_path / "older.yaml").write_text(text)
    older_prof = load_profile(tmp_path / "older.yaml", num_layers=30)
    assert profile_stack_options(older_prof, 30)["chunk_indexer_tiles"] is None


def test_a_profile_without_a_recorded_chunking_runs_the_stacks_defaults(tmp_path):
    """A profile written before the key (the 18:19 one, whose runs measured equal chunks by rows, less the key its
    regeneration now records): no chunk options."""
    import yaml

    doc = yaml.safe_load((ROOT / "configs" / "overlap" / "smollm2-135m_ratio0.2_h200-measured.yaml").read_text())
    del doc["device"]["measured"]["prefetch_chunking"]
    old = tmp_path / "before_the_key.yaml"
    old.write_text(yaml.safe_dump(doc))
    prof = load_profile(old, num_layers=30)
    assert prof.device.measured.prefetch_chunking is None and profile_stack_options(prof, 30) == {}
    with pytest.raises(OverlapProfileError, match="lists 30 layers, the model has 4"):
        profile_stack_options(prof, 4)


def test_a_run_at_a_margin_adds_the_margin_modes():
    """Two runs of one call (margin 0, then 0.01; spare 0 and 0.1): the margin run's prefetch modes join as the
    *_margin modes, against its own all-HBM rows; everything else (sync, dba, the misses that place a point) is
    the first run's. The policy then picks prefetch2 with the margin at batch 64 / 32K / 0.95 (1.085 against 1.113 x
    all-HBM with spare slots, benchmarks/RESULTS.md) and without it at 0.9 (1.160 against 1.204)."""
    from ess_sglang.stack_calibration import load_calibration

    m0, m1 = json.loads(RUN_M0.read_text()), json.loads(RUN_M001.read_text())
    assert m0["meta"]["prefetch_margin"] == 0 and m1["meta"]["prefetch_margin"] == 0.01
    plain = calibration_from_decode_layers(m0, "m0", spare_slots=True)
    cal = load_calibration([RUN_M0, RUN_M001], spare_slots=True)
    assert cal.modes == RUN_MODES and cal.prefetch_margin == 0.01 and plain.prefetch_margin is None
    assert "prefetch margin 0.01" in cal.source and str(RUN_M001) in cal.source
    rows1 = {(r["context"], r["batch"], r["target_hit"], r["variant"]): r for r in m1["rows"]}
    for p, q in zip(cal.points, plain.points, strict=True):
        assert p.misses == q.misses and all(p.exposed_us[m] == q.exposed_us[m] for m in ONE_RUN_MODES)
        hit = next(k[2] for k in rows1 if k[:2] == (p.context, p.batch) and k[3] == "sync" and math.isclose(
            sum(next(r for r in m0["rows"] if (r["context"], r["batch"], r["target_hit"], r["variant"]) ==
                     (p.context, p.batch, k[2], "sync"))["misses_per_layer_step"]) / 4, p.misses, abs_tol=1e-3))
        hbm = rows1[(p.context, p.batch, hit, "hbm")]["layer_us"]
        for mode, measured_as in (("prefetch_margin", "prefetch"), ("prefetch2_margin", "prefetch2")):
            want = rows1[(p.context, p.batch, hit, f"{measured_as}+spare")]["layer_us"] - hbm
            assert p.exposed_us[mode] == pytest.approx(want, abs=1e-3)
    d = DeviceTimings(measured=cal)
    near = lambda b, c, h: min((p for p in cal.points if (p.batch, p.context) == (b, c)),  # noqa: E731
                               key=lambda p: abs(p.misses - (1 - h) * b * 2048))
    assert choose_modes([near(64, 32768, 0.95).misses], 64, 32768, d) == ["prefetch2_margin"]
    assert choose_modes([near(64, 32768, 0.9).misses], 64, 32768, d) == ["prefetch2"]


def test_margin_runs_are_checked(tmp_path):
    from ess_sglang.stack_calibration import load_calibration

    m0, m1 = json.loads(RUN_M0.read_text()), json.loads(RUN_M001.read_text())
    # a run at a margin alone, or first: its prefetch modes would run at margin 0
    with pytest.raises(CalibrationError, match=r"measured at prefetch margin 0.01 .* give a run at margin 0, and this "
                                               r"one as the margin run"):
        load_calibration(RUN_M001)
    with pytest.raises(CalibrationError, match="measured at prefetch margin 0.01"):
        load_calibration([RUN_M001, RUN_M0])
    with pytest.raises(CalibrationError, match=r"the margin run must be at a prefetch margin in \(0, 1\)"):
        load_calibration([RUN_M0, RUN_M0])
    with pytest.raises(CalibrationError, match="one decode-stack run, or two"):
        load_calibration([RUN_M0, RUN_M001, RUN_M001])
    with pytest.raises(CalibrationError, match=r"^nope\.json: no such file|/nope\.json: no such file"):
        load_calibration([RUN_M0, tmp_path / "nope.json"])

    def margin_run(**changes):
        run = json.loads(json.dumps(m1))
        for k, v in changes.items():
            if k == "rows":
                run["rows"] = v(run["rows"])
            else:
                run["meta"][k] = v
        return run

    # the two runs must share every setting but the margin
    with pytest.raises(CalibrationError, match=r"the two runs differ in meta.overlap_programs \(16 against 32\)"):
        calibration_from_decode_layers(m0, "cal", margin_run=margin_run(overlap_programs=32))
    with pytest.raises(CalibrationError, match=r"meta.prefetch_margin: expected a number in \[0, 1\), got 'x'"):
        calibration_from_decode_layers(m0, "cal", margin_run=margin_run(prefetch_margin="x"))
    with pytest.raises(CalibrationError, match="meta: expected a mapping, got list"):
        calibration_from_decode_layers(dict(m0, meta=[]), "cal")
    # a margin run that leaves out a point: refused, naming it (no silent fall-back to the margin-0 modes)
    drop = lambda rows: [r for r in rows if (r["context"], r["batch"], r["target_hit"]) != (32768, 64, 0.95)]  # noqa
    with pytest.raises(CalibrationError, match=r"measured neither prefetch, prefetch2 nor prefetch3 with spare "
                                               r"slots at every point of the first run; missing at "
                                               r"\(context, batch, hit\) \(32768, 64, 0.95\)"):
        calibration_from_decode_layers(m0, "cal", spare_slots=True, margin_run=margin_run(rows=drop))
    # its sync rows are not needed (the misses are the first run's): a run of the prefetch modes alone will do
    only_prefetch = margin_run(rows=lambda rows: [r for r in rows
                                                  if not r["variant"].startswith(("sync", "dba"))])
    cal = calibration_from_decode_layers(m0, "cal", spare_slots=True, margin_run=only_prefetch)
    assert cal.modes == RUN_MODES and cal.prefetch_margin == 0.01
    assert cal == calibration_from_decode_layers(m0, "cal", spare_slots=True, margin_run=m1)
    with pytest.raises(ValueError, match="prefetch_margin: the points measure 'prefetch_margin'"):
        StackCalibration(source="s", points=[
            MeasuredPoint(batch=1, context=1, misses=m, exposed_us=dict(sync=1.0, prefetch_margin=1.0))
            for m in (0.0, 1.0)])


def test_a_profile_from_a_margin_calibration_runs_the_margin_in_its_layers(tmp_path, capsys):
    from ess_sglang.overlap_policy import layer_prefetch_margins, profile_from_mapping

    out = tmp_path / "p.yaml"
    argv = ["profile", "--synthetic", "--gen-layers", "3", "--gen-steps", "8", "--batch", "64", "--context", "32768",
            "--top-k", "2048", "--calibration", str(RUN_M0), "--calibration-margin", str(RUN_M001),
            "--calibration-spare", "--by", "mean", "--out", str(out)]
    assert main(argv) == 0
    prof = load_profile(out, num_layers=3)
    assert "--calibration-margin" in prof.header.command and prof.device.measured.prefetch_margin == 0.01
    for lp in prof.layers:  # every layer's choice is the fastest of the seven measured modes' times
        times = {m: v for m, v in lp.exposed_us.as_dict().items() if v is not None}
        assert set(times) == set(RUN_MODES)
        assert lp.mode == min(times, key=lambda m: (times[m], MODES.index(m))) or lp.model_misses == 0
    assert any(m.endswith("_margin") for m in prof.modes()) and not all(m.endswith("_margin") for m in prof.modes())
    want = [0.01 if lp.mode.endswith("_margin") else 0.0 for lp in prof.layers]
    assert layer_prefetch_margins(out, 3) == prof.prefetch_margins() == want
    modes, chunks = layer_settings(out, 3)
    assert chunks == [{"prefetch": 1, "prefetch_margin": 1, "prefetch2": 2, "prefetch2_margin": 2}.get(m, 0)
                      for m in prof.modes()]
    # a *_margin layer in a profile whose calibration gives no margin is refused, naming the layer
    data = prof.model_dump(mode="python")
    for i, lp in enumerate(data["layers"]):
        lp["mode"] = "prefetch2_margin" if i == 1 else "sync"
    data["device"]["measured"] = None
    with pytest.raises(OverlapProfileError, match=r"layers\[1\]\.mode \(layer 1\): 'prefetch2_margin' runs the "
                                                  r"calibration's threshold margin"):
        profile_from_mapping(data, "p.yaml")
    assert main(["profile", "--synthetic", "--calibration-margin", str(RUN_M001)]) == 2
    assert "--calibration-margin: needs --calibration" in capsys.readouterr().err


def test_a_calibration_refilled_at_another_interval_is_refused():
    """A caller that refills its spare slots every K steps refuses runs that refilled at another interval
    (`meta.refill_interval`, 1 where absent); without `refill_interval` nothing is checked."""
    from ess_sglang.stack_calibration import load_calibration

    every4 = RUN_SGLANG_M0
    assert load_calibration(every4, spare_slots=True, refill_interval=4).spare_refill_interval == 4
    assert load_calibration(RUN_M0, spare_slots=True, refill_interval=1).spare_refill_interval == 1
    with pytest.raises(CalibrationError, match=r"refilled every 1 steps \(meta.refill_interval\), this run's every 4"):
        load_calibration(RUN_M0, spare_slots=True, refill_interval=4)
    with pytest.raises(CalibrationError, match=r"refilled every 4 steps \(meta.refill_interval\), this run's every 1"):
        load_calibration(every4, refill_interval=1)
    assert load_calibration(every4).spare_refill_interval is None  # (times without spare slots, nothing checked)
