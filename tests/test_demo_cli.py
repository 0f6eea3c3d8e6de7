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


def test_ess_demo_rejects_a_pool_too_small_before_allocating(capsys):
    rc = main(["demo", "--batch", "8", "--context-len", "8192", "--top-k", "2048", "--ratio", "0.05", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 2
    assert "hot" in out and "slots" in out


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("demo", "plan", "simulate"):
        assert name in out
