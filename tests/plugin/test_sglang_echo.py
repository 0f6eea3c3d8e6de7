"""ECHO prefetch in the SGLang plugin: what it plans per layer from ess_config, what it refuses at launch, and the
indexer tap's pass-through everywhere it must not act. (The prefetch itself, bit-identical through SGLang's real
decode seam, is in test_sglang_decode_seam.py.)"""

from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest
import yaml

from ess_sglang.config import EssConfig
from ess_sglang.overlap_policy import OverlapProfileError

pytest.importorskip("sglang")  # CI installs sglang==0.5.23; this only guards machines without it

PROFILE = str(Path(__file__).resolve().parents[2] / "configs" / "overlap" / "smollm2-135m_ratio0.2_h200-measured.yaml")
# (30 layers, prefetch / prefetch2)


def _plan(layers=30, top_k=2048, requests=64, hot=400_000, page=64, **cfg):
    from ess_sglang.sglang_plugin import echo

    return echo.plan(EssConfig(**cfg), layers, top_k, requests, hot, page)


def _profile_with(tmp_path, modes: dict[int, str]) -> str:
    data = yaml.safe_load(Path(PROFILE).read_text())
    for i, m in modes.items():
        data["layers"][i]["mode"] = m
    p = tmp_path / "profile.yaml"
    p.write_text(yaml.safe_dump(data))
    return str(p)


def test_plan_levels_and_spare_slots():
    from ess_sglang.kernels.resolve import MERGED_TAIL_MAX_ENTRIES

    off = _plan(prefetch_overlap_level="none")
    # no layer prefetches: one page of spare slots for the resolves of one or two requests, refilled every 64 steps
    assert not any(off.prefetch_layers) and off.spare_slots == 64 and off.refill_interval == 64
    assert off.spare_max_entries == MERGED_TAIL_MAX_ENTRIES == 4608
    assert "64 spare slots per layer for resolves of up to 4,608 entries" in off.note
    # the default level without a profile: no prefetch (one-chunk prefetch with spare slots measured slower than
    # this in 13 of 18 harness configurations, benchmarks/RESULTS.md), and so the same reserve
    auto = _plan()
    assert auto.prefetch_layers == off.prefetch_layers and auto.prefetch_margins == off.prefetch_margins
    assert not any(auto.prefetch_layers) and auto.spare_slots == 64 and auto.spare_max_entries == 4608
    assert "0 of 30 layers" in auto.note and "auto without an overlap_profile" in auto.note
    assert _plan(page=32).spare_slots == 32 and _plan(spare_refill_interval=8).refill_interval == 8
    none = _plan(spare_slot_fraction=0)  # 0: no spare slots at all
    assert none.spare_slots == 0 and none.spare_max_entries is None and "spare slots per layer for" not in none.note
    full = _plan(prefetch_overlap_level="full")  # every layer prefetches, 1/16 of top_k x requests spare, whole pages
    assert all(full.prefetch_layers) and len(full.prefetch_layers) == 30
    assert full.spare_slots == 8192 and "30 of 30 layers" in full.note and full.spare_max_entries is None
    assert _plan(prefetch_overlap_level="full", spare_slot_fraction=0.1).spare_slots == 13120  # 0.1 x 2048 x 64
    assert _plan(prefetch_overlap_level="none", spare_slot_fraction=0.05).spare_slots == 6592  # spares without prefetch
    assert _plan(spare_slot_fraction=0.05).spare_slots == 6592
    assert _plan(spare_slot_fraction=0.05).spare_max_entries is None  # a size given: every resolve takes them
    # refilled every 4th step: the automatic size covers 4 steps (1/4 of top_k x requests), the note says so
    every4 = _plan(prefetch_overlap_level="full", spare_refill_interval=4)
    assert every4.spare_slots == 32768 and "refilled every 4 steps" in every4.note
    for bad in (0, 1025, True):
        with pytest.raises(ValueError, match="spare_refill_interval"):
            _plan(spare_refill_interval=bad)
    assert full.refill_interval == 1 and every4.refill_interval == 4
    capped = _plan(prefetch_overlap_level="full", hot=20_000)  # at most 1/8 of the hot pool, in whole pages
    assert capped.spare_slots == 2496 and "capped" in capped.note


def test_plan_warns_when_the_profiles_spare_slots_were_refilled_otherwise(caplog, tmp_path):
    """The shipped SGLang-top-k profile was calibrated with spare slots refilled every 4th step: an instance with
    spare slots refilled at another interval is told that the profile's times may not apply; at 4 it is not. Unset,
    the interval is the profile's (and the automatic spare size covers its steps); without a profile, every step."""
    sglang_topk = str(Path(PROFILE).with_name("smollm2-135m_ratio0.2_h200-sglang-topk.yaml"))
    for interval, warned, used in ((1, True, 1), (4, False, 4), (None, False, 4)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ess_sglang.sglang_plugin"):
            p = _plan(overlap_profile=sglang_topk, spare_slot_fraction=0.05, spare_refill_interval=interval)
        assert p.spare_slots > 0 and p.refill_interval == used
        assert ("refilled every 4 steps; this instance refills every 1" in caplog.text) == warned, caplog.text
        assert ("refilled every 4 steps" in p.note) == (used == 4)
    assert _plan(overlap_profile=PROFILE).refill_interval == 1  # a profile that recorded none: every step
    data = yaml.safe_load(Path(sglang_topk).read_text())
    data["device"]["measured"]["spare_refill_interval"] = 5000
    odd = tmp_path / "odd.yaml"
    odd.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"odd.yaml: its spare_refill_interval 5000 is outside \[1, 1024\]"):
        _plan(overlap_profile=str(odd))
    assert _plan(overlap_profile=str(odd), spare_refill_interval=2).refill_interval == 2  # a set one is used
    assert _plan(prefetch_overlap_level="full").refill_interval == 1  # no profile: every step


def test_plan_runs_what_the_plugin_can_of_the_overlap_profile(tmp_path):
    """The profile's sync and prefetch layers run as profiled; a layer it gives DBA or prefetch in chunks (the
    decode harness's, which need SGLang's indexer call split) runs whichever of sync and one-chunk prefetch the
    profile's own times make fastest for that layer, and the start-up note says how many moved."""
    from ess_sglang.overlap_policy import load_profile

    path = _profile_with(tmp_path, {0: "sync", 1: "dba", 2: "dba"})
    profile = load_profile(path)
    want = tuple(lp.mode == "prefetch" if lp.mode in ("sync", "prefetch") else
                 lp.exposed_us.prefetch < lp.exposed_us.sync for lp in profile.layers)
    p = _plan(overlap_profile=path)
    assert p.prefetch_layers == want
    assert _plan(overlap_profile=path, prefetch_overlap_level="full") == p  # (p: the default level, auto)
    # (in this profile one-chunk prefetch measured faster than sync in every layer but 20 and 24)
    assert p.prefetch_layers[:4] == (False, True, True, True) and sum(p.prefetch_layers) == 27
    assert "2 dba -> prefetch, 24 prefetch2 -> prefetch, 2 prefetch2 -> sync" in p.note
    three = _plan(overlap_profile=_profile_with(tmp_path, {0: "prefetch3", 1: "sync"}))
    assert three.prefetch_layers[:2] == (True, False) and "1 prefetch3 -> prefetch" in three.note
    # a layer whose one-chunk prefetch measured slower than sync (layer 20: 412.8 against 397.9 us) fetches in sync
    assert profile.layers[20].exposed_us.prefetch > profile.layers[20].exposed_us.sync and not p.prefetch_layers[20]
    as_run = _plan(overlap_profile=_profile_with(tmp_path, dict.fromkeys(range(30), "prefetch")))
    assert all(as_run.prefetch_layers) and "take the fastest" not in as_run.note
    with pytest.raises(OverlapProfileError, match="lists 30 layers, the model has 61"):
        _plan(layers=61, overlap_profile=path)
    assert not any(_plan(overlap_profile=path, prefetch_overlap_level="none").prefetch_layers)


def test_plan_runs_the_profiles_threshold_margin_in_its_margin_layers(tmp_path, caplog, monkeypatch):
    """A profile calibrated with a margin run (`ess profile --calibration-margin`) sets every layer's margin: its
    *_margin layers prefetch with the calibration's margin, its other prefetch layers with none (margin 0 measured
    faster there), whatever prefetch_threshold_margin says (a warning names it); the prefetcher gets them. A profile
    without a margin calibration leaves every layer prefetch_threshold_margin."""
    from ess_sglang.cli import main
    from ess_sglang.overlap_policy import load_profile
    from ess_sglang.sglang_plugin import echo

    runs = Path(__file__).resolve().parents[2] / "configs" / "overlap" / "calibration"  # shipped calibration runs
    out = tmp_path / "p.yaml"
    assert main(["profile", "--synthetic", "--gen-layers", "3", "--gen-steps", "8", "--batch", "64", "--context",
                 "32768", "--top-k", "2048", "--calibration", str(runs / "h200_torch-topk_spare0.1_margin0.json"),
                 "--calibration-margin", str(runs / "h200_torch-topk_spare0.1_margin0.01.json"), "--calibration-spare",
                 "--out", str(out)]) == 0
    modes = load_profile(out, 3).modes()
    assert "prefetch2_margin" in modes and "prefetch2" in modes  # (the synthetic layers' misses differ)
    # the plugin runs one indexer call: each layer the faster of sync / prefetch / prefetch_margin by the profile
    modes = load_profile(out, 3).modes_within(echo.PLUGIN_MODES)
    assert set(modes) <= set(echo.PLUGIN_MODES) and "prefetch_margin" in modes
    with caplog.at_level(logging.WARNING, logger="ess_sglang.sglang_plugin"):
        p = _plan(layers=3, overlap_profile=str(out), prefetch_threshold_margin=0.002)
    assert "prefetch_threshold_margin 0.002 is not used" in caplog.text
    assert p.prefetch_layers == tuple(m != "sync" for m in modes)
    assert p.prefetch_margins == tuple(0.01 if m.endswith("_margin") else 0.0 for m in modes)
    assert "threshold margin 0.01" in p.note and "0.002" not in p.note
    every = _plan(layers=3, prefetch_overlap_level="full")  # (without a profile: every layer, no margin set)
    assert all(every.prefetch_layers) and every.prefetch_margins == (0.0,) * 3 and "margin" not in every.note
    # the 18:19 calibration (no margin run) chose prefetch / prefetch2 only: every layer runs the configured margin
    plain = _plan(overlap_profile=PROFILE, prefetch_threshold_margin=0.002)
    assert plain.prefetch_margins == (0.002,) * 30 and "threshold margin 0.002" in plain.note
    from ess_sglang.cache_manager import HotPoolCacheManager
    from ess_sglang.host_pool import HostTotalPool

    m = HotPoolCacheManager(HostTotalPool(3, 4096, device="cpu"), 1024, device="cpu", max_selected=8 * 64)
    overlap = echo.DecodeOverlap(m, p, 8, 4096, 8, EssConfig())
    assert overlap.prefetcher.margins == p.prefetch_margins
    legacy = echo.OverlapPlan(p.prefetch_layers, p.spare_slots, p.note)  # no margins: the configured one everywhere
    overlap = echo.DecodeOverlap(m, legacy, 8, 4096, 8, EssConfig(prefetch_threshold_margin=0.003))
    assert overlap.prefetcher.margins == (0.003,) * 3
    # the prefetch kernels' programmatic dependent launch follows the resolve's (off on CPU; passed through: a
    # manager that claims it makes the prefetcher refuse it here)
    assert m.pdl is False and overlap.prefetcher.pdl is False
    monkeypatch.setattr(HotPoolCacheManager, "pdl", property(lambda self: True))
    with pytest.raises(ValueError, match="prefetch pdl: programmatic dependent launch needs"):
        echo.DecodeOverlap(m, legacy, 8, 4096, 8, EssConfig())


def test_launch_checks_name_the_overlap_problem(tmp_path):
    from ess_sglang.sglang_plugin.cli_args import overlap_problems

    assert overlap_problems(EssConfig(), 61) == []
    assert overlap_problems(EssConfig(overlap_profile=PROFILE), 30) == []
    for level in ("auto", "full"):  # (both run a profile's layers; none ignores it)
        (missing,) = overlap_problems(EssConfig(overlap_profile=str(tmp_path / "nope.yaml"),
                                                prefetch_overlap_level=level), 61)
        assert missing.startswith("ess_config.overlap_profile:") and "nope.yaml: no such file" in missing
        (count,) = overlap_problems(EssConfig(overlap_profile=PROFILE, prefetch_overlap_level=level), 61)
        assert "lists 30 layers, the model has 61" in count
    assert overlap_problems(EssConfig(overlap_profile=PROFILE, prefetch_overlap_level="none"), 61) == []


class _Coordinator:
    def __init__(self, prefetching: bool):
        self.prefetching, self.calls, self.asked = prefetching, [], []

    def prefetches(self, layer_id, batch_size):
        self.asked.append((layer_id, batch_size))
        return self.prefetching

    def prefetch_from_logits(self, *args):
        self.calls.append("prefetch")

    def note_selection(self, *args):
        self.calls.append("note")


def _batch(decode: bool):
    return types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_decode=lambda: decode), batch_size=24,
                                 req_pool_indices="rpi", seq_lens="lens")


def _call_indexer(forward_batch, unfused=True):
    """Indexer._get_topk_paged through the tap: one top-k inside (and a second one, which is never the tap's)."""
    import torch

    from ess_sglang.sglang_plugin import indexer_tap

    seen = []

    def topk_transform(meta, logits, topk):
        seen.append(topk)
        return torch.zeros((logits.shape[0], topk), dtype=torch.int32)

    def get_topk_paged(indexer, fb, layer_id, q, w, meta):
        logits = torch.zeros((2, 8))
        indexer_tap.topk_transform_hook(topk_transform, meta, logits, 4)
        return indexer_tap.topk_transform_hook(topk_transform, meta, logits, 3)

    meta = types.SimpleNamespace(force_unfused_topk=unfused)
    out = indexer_tap.get_topk_paged_hook(get_topk_paged, "indexer", forward_batch, 5, None, None, meta)
    assert out.shape == (2, 3) and seen == [4, 3]  # the original calls ran, with their own arguments
    assert indexer_tap.open_tap() is None  # the tap never outlives the call


@pytest.mark.parametrize("prefetching,decode,unfused,expected", [
    (True, True, True, ["prefetch", "note"]),  # a decode layer that prefetches: once, around the first top-k
    (False, True, True, []),  # a layer the plan leaves synchronous
    (True, False, True, []),  # prefill, verify: not a plain decode batch
    (True, True, False, []),  # a fused top-k (locations, not positions): not ESS's decode path
])
def test_tap_acts_only_in_decode_layers_that_prefetch(prefetching, decode, unfused, expected, caplog):
    from ess_sglang.sglang_plugin.active import set_active

    coord = _Coordinator(prefetching)
    set_active(coord)
    try:
        with caplog.at_level(logging.WARNING, logger="ess_sglang.sglang_plugin"):
            _call_indexer(_batch(decode), unfused)
    finally:
        set_active(None)
    assert coord.calls == expected
    assert coord.asked == ([(5, 24)] if decode else [])  # the layer and the graph's batch size decide


def test_small_batches_do_not_prefetch():
    """`prefetch_min_batch` (default 16): SGLang captures a graph per batch size; smaller ones stay synchronous."""
    from ess_sglang.cache_manager import HotPoolCacheManager
    from ess_sglang.host_pool import HostTotalPool
    from ess_sglang.sglang_plugin import echo

    m = HotPoolCacheManager(HostTotalPool(2, 4096), 1024, max_selected=512)
    full = dict(prefetch_overlap_level="full")
    for config, expected in ((EssConfig(**full), [False, True, True]),
                             (EssConfig(**full, prefetch_min_batch=2), [True] * 3),
                             (EssConfig(prefetch_overlap_level="none"), [False] * 3), (EssConfig(), [False] * 3)):
        overlap = echo.DecodeOverlap(m, _plan(layers=2, **config.model_dump(exclude_defaults=True)), 8, 4096, 32,
                                     config)
        assert [overlap.prefetches(1, b) for b in (15, 16, 32)] == expected
        assert not overlap.prefetches(2, 32)  # no such layer


def test_tap_passes_through_without_ess():
    from ess_sglang.sglang_plugin.active import set_active

    set_active(None)
    _call_indexer(_batch(True))


def test_a_step_cut_short_between_prefetch_and_settle_leaves_nothing_behind():
    """An exception between a layer's prefetch and its swap-in (its settle) must not break every later step: the
    next prefetch settles the stale one first (before, the cache manager refused it)."""
    import torch

    from ess_sglang.cache_manager import Counter, HotPoolCacheManager
    from ess_sglang.host_pool import HostTotalPool
    from ess_sglang.sglang_plugin import echo

    T, rows = 512, 2
    m = HotPoolCacheManager(HostTotalPool(2, rows * T), 1024, max_selected=256)
    config = EssConfig(top_k=64, prefetch_min_batch=1)
    plan = _plan(layers=2, top_k=64, requests=rows, hot=1024, prefetch_overlap_level="full")
    overlap = echo.DecodeOverlap(m, plan, rows, T, rows, config)
    table = torch.arange(rows * T, dtype=torch.int64).view(rows, T)
    rpi, lens = torch.arange(rows), torch.tensor([T, 300])
    overlap.prefetcher.threshold.fill_(0.0)  # every visible position above the threshold
    logits = torch.rand(rows, T) + 1
    m.begin_step()
    overlap.prefetch(0, logits, rpi, lens, table)  # ... and the step dies here
    m.begin_step()
    overlap.prefetch(1, logits, rpi, lens, table)  # the next step goes on
    overlap.before_resolve(1)
    m.resolve(1, torch.zeros((rows, 1, 64), dtype=torch.int32), table, rpi, lens)
    overlap.after_resolve(1)
    c = m.counters.sum(0)
    assert int(c[Counter.PREFETCHED]) > 0
    assert int(c[Counter.PREFETCH_USEFUL] + c[Counter.PREFETCH_WASTED]) == int(c[Counter.PREFETCHED])


def test_the_thresholds_move_beside_attention_after_the_resolve(monkeypatch):
    """The selection noted after the top-k moves the layer's thresholds in after_resolve (on the side stream, behind
    the layer's candidate reads), not before the resolve; its k-th best scores are found there too, not on the main
    stream between the top-k and the resolve; a layer's note is used once."""
    import torch

    from ess_sglang.cache_manager import HotPoolCacheManager
    from ess_sglang.host_pool import HostTotalPool
    from ess_sglang.sglang_plugin import echo

    T, rows = 512, 2
    m = HotPoolCacheManager(HostTotalPool(2, rows * T), 1024, max_selected=256)
    config = EssConfig(top_k=64, prefetch_min_batch=1, prefetch_ema_alpha=0.5)
    plan = _plan(layers=2, top_k=64, requests=rows, hot=1024, prefetch_overlap_level="full")
    overlap = echo.DecodeOverlap(m, plan, rows, T, rows, config)
    table = torch.arange(rows * T, dtype=torch.int64).view(rows, T)
    rpi, lens = torch.tensor([1, 0]), torch.tensor([T, 300])
    logits = torch.arange(rows * T, dtype=torch.float32).view(rows, T)
    positions = torch.tensor([[5, 9, -1], [7, 3, 2]])
    found = []  # where the k-th scores are found: in after_resolve only
    kth = echo.kth_of_selection_any
    monkeypatch.setattr(echo, "kth_of_selection_any", lambda *a, **k: found.append(a[1]) or kth(*a, **k))
    m.begin_step()
    overlap.prefetch(0, logits, rpi, lens, table)
    overlap.note_selection(0, logits, positions, rpi)
    overlap.before_resolve(0)
    assert bool(torch.isinf(overlap.prefetcher.threshold).all())  # not moved before the resolve
    m.resolve(0, torch.zeros((rows, 1, 64), dtype=torch.int32), table, rpi, lens)
    assert not found  # nothing found between the top-k and the resolve
    overlap.after_resolve(0)
    assert len(found) == 1 and found[0] is not None and torch.equal(found[0], positions)
    # row 1 (batch entry 0): the lowest selected logit 5; row 0 (batch entry 1): T + 2
    assert overlap.prefetcher.threshold[0].tolist() == [T + 2.0, 5.0]
    assert bool(torch.isinf(overlap.prefetcher.threshold[1]).all())
    assert not overlap._pending and overlap._folding is None  # the note was used
    overlap.before_resolve(0)
    overlap.after_resolve(0)  # no new note: the thresholds stay
    assert overlap.prefetcher.threshold[0].tolist() == [T + 2.0, 5.0]
    overlap.note_selection(0, logits, torch.tensor([[1, 9, -1], [7, 3, 4]]), rpi)  # k-th scores 1 and T + 3
    overlap.before_resolve(0)
    overlap.after_resolve(0)
    assert overlap.prefetcher.threshold[0].tolist() == [(T + 2.0 + T + 3.0) / 2, 3.0]  # EMA, alpha 0.5
    # a note whose resolve never ran (the step was cut short) is dropped at the step's end, not folded later
    overlap.note_selection(0, logits, torch.tensor([[0, 0, 0], [0, 0, 0]]), rpi)
    overlap.before_resolve(1)
    overlap.after_resolve(1)  # the last layer: joins the side stream, drops stale notes
    overlap.before_resolve(0)
    overlap.after_resolve(0)
    assert overlap.prefetcher.threshold[0].tolist() == [(T + 2.0 + T + 3.0) / 2, 3.0]


def test_resolve_pdl_off_sm90_is_refused_before_any_pool_is_touched():
    """ess_config.resolve_pdl true where it cannot run (here: on CPU) fails first thing: the coordinator gets None
    for SGLang's pools, so any allocation or read of them would raise something else."""
    import pytest

    from ess_sglang.sglang_plugin.coordinator import EssCoordinator

    with pytest.raises(ValueError, match="resolve_pdl: programmatic dependent launch needs the Triton resolve on a "
                                         "CUDA GPU of compute capability 9.0 or newer"):
        EssCoordinator(req_to_token_pool=None, token_to_kv_pool_allocator=None, config=EssConfig(resolve_pdl=True),
                       hot_slots_per_layer=64, host_tokens=64, device="cpu", top_k=64)
    with pytest.raises(ValueError, match="resolve_pdl"):
        EssConfig(resolve_pdl="yes")
