import pytest

from ess_sglang.cli import main
from ess_sglang.demo import run_demo


def test_demo_small_is_bit_identical_and_counts_traffic():
    r = run_demo(batch=3, context_len=1500, steps=12, ratio=0.3, layers=2, top_k=128, progress=False)
    assert r.bit_identical
    for c in r.counters:
        assert c["LOOKUPS"] == 3 * 12 * 128
        assert c["D2H_ENTRIES"] == 3 * 12  # one new token per request and step, written back
        assert c["WARMUP_ENTRIES"] > 0
    assert 0.0 < r.hit_rate <= 1.0


def test_ess_demo_command(capsys):
    rc = main(["demo", "--batch", "2", "--context-len", "1024", "--steps", "4", "--top-k", "64", "--layers", "2",
               "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "bit-identical" in out and "hit rate" in out


def test_ess_demo_rejects_a_pool_too_small_before_allocating(capsys, monkeypatch):
    import ess_sglang.demo as demo

    def must_not_run(**_):
        raise AssertionError("run_demo reached")

    monkeypatch.setattr(demo, "run_demo", must_not_run)
    rc = main(["demo", "--batch", "8", "--context-len", "8192", "--top-k", "2048", "--ratio", "0.05", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("ess demo: --ratio: ") and "hot pool" in err and "slots" in err


@pytest.mark.parametrize("batch", [1, 2])
def test_ess_demo_runs_at_any_batch(capsys, batch):
    """The host pool holds `batch` requests at their full length, so one request fits (it did not once)."""
    rc = main(["demo", "--batch", str(batch), "--context-len", "512", "--steps", "3", "--top-k", "32", "--layers", "1",
               "--no-progress"])
    assert rc == 0, capsys.readouterr()
    assert "bit-identical" in capsys.readouterr().out


def test_ess_demo_at_a_short_context_lowers_the_default_top_k(capsys):
    """Without --top-k, a short --context-len still runs: the default top-k (1024) is halved until it is below the
    context and one step's selections fit the hot pool (here 448 slots: top-k 256)."""
    rc = main(["demo", "--batch", "1", "--steps", "2", "--context-len", "2048", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "top-k 256" in captured.out and "bit-identical" in captured.out and captured.err == ""


def test_the_default_top_k_fits_the_context_and_the_hot_pool():
    from ess_sglang.demo import DEFAULTS, default_top_k, hot_pool_sizes

    assert default_top_k(8, 8192, 64, 0.2) == DEFAULTS["top_k"]  # the defaults fit as they are
    for batch, context, steps, ratio in [(1, 2048, 2, 0.2), (8, 512, 64, 0.2), (64, 64, 1, 0.2), (1, 2, 1, 0.01)]:
        k = default_top_k(batch, context, steps, ratio)
        needed, slots = hot_pool_sizes(batch, context, steps, ratio, k)
        assert 1 <= k < context and needed <= slots, (batch, context, k)
        assert k == DEFAULTS["top_k"] or 2 * k >= context or hot_pool_sizes(batch, context, steps, ratio, 2 * k)[0] \
            > slots  # the largest halving that fits


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("demo", "plan", "simulate"):
        assert name in out
