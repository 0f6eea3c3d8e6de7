"""`ess` answers bad flags and impossible combinations with one line that names the flag, and exit status 2."""

import argparse
import importlib.util

import pytest

from ess_sglang import __version__
from ess_sglang.cli import build_parser, main

BAD_DEMO_FLAGS = [
    (["--batch", "-1"], "--batch"),
    (["--batch", "x"], "--batch"),
    (["--ratio", "0"], "--ratio"),
    (["--ratio", "1.5"], "--ratio"),
    (["--ratio", "nan"], "--ratio"),
    (["--layers", "0"], "--layers"),
    (["--top-k", "0"], "--top-k"),
    (["--steps", "0"], "--steps"),
    (["--context-len", "0"], "--context-len"),
    (["--device", "tpu"], "--device"),
    (["--attention", "flash"], "--attention"),
    (["--metrics-port", "-5"], "--metrics-port"),
    (["--metrics-port", "70000"], "--metrics-port"),
    (["--metrics-hold", "-1", "--metrics-port", "0"], "--metrics-hold"),
    (["--metrics-interval", "0", "--metrics-port", "0"], "--metrics-interval"),
    (["--top-k", "2048", "--context-len", "1024"], "--top-k"),  # selects every token
    (["--ratio", "0.05", "--top-k", "2048"], "--ratio"),  # hot pool smaller than one step
    (["--metrics-per-layer"], "--metrics-per-layer"),  # needs --metrics-port
    (["--attention", "flashmla", "--device", "cpu"], "--attention"),
    (["--context-len", "1"], "--context-len"),  # no top-k below it
    (["--seed", "99999999999999999999999"], "--seed"),  # beyond what torch's generators take
    (["--batch", "1000000", "--context-len", "1000000"], "--batch"),  # petabytes of pools: refused before allocating
    (["--layers", "100000000"], "--layers"),
]


def _one_line_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        rc = main(argv)
        raise SystemExit(rc)
    err = capsys.readouterr()
    assert e.value.code == 2, err
    lines = err.err.strip().splitlines()
    assert len(lines) == 1, err.err
    assert "Traceback" not in err.err and err.out == ""
    return lines[0]


@pytest.mark.parametrize("argv, flag", BAD_DEMO_FLAGS, ids=[" ".join(a) for a, _ in BAD_DEMO_FLAGS])
def test_a_bad_demo_flag_gets_one_line_naming_it(capsys, argv, flag):
    line = _one_line_error(capsys, ["demo", "--no-progress", *argv])
    assert line.startswith(f"ess demo: {flag}: "), line
    assert "ess_config" not in line and "deployment." not in line  # flags, not config keys


def test_cuda_without_a_gpu_is_refused(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _one_line_error(capsys, ["demo", "--device", "cuda"])
    assert line.startswith("ess demo: --device: cuda: ") and "--device cpu" in line


def test_flashmla_without_the_package_is_refused(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_mla" else real(name, *a))
    line = _one_line_error(capsys, ["demo", "--device", "cuda", "--attention", "flashmla"])
    assert line.startswith("ess demo: --attention: ") and "flash_mla" in line


def test_config_errors_are_named_by_their_flag(capsys, monkeypatch):
    """An error from EssConfig.plan (not caught by the demo's own checks) still names the flag."""
    from ess_sglang import demo
    from ess_sglang.config import EssConfigError

    def refuse(**_):
        raise EssConfigError("ess_config.sparse_memory_ratio: must be in (0, 1] (got 2)")

    monkeypatch.setattr(demo, "run_demo", refuse)
    line = _one_line_error(capsys, ["demo"])
    assert line == "ess demo: --ratio: must be in (0, 1] (got 2)"


def test_a_pool_larger_than_the_free_memory_names_the_size_flag(capsys, monkeypatch):
    """The check runs before anything is allocated, against the free memory of the demo's device."""
    from ess_sglang import demo

    def must_not_run(**_):
        raise AssertionError("run_demo reached")

    monkeypatch.setattr(demo, "run_demo", must_not_run)
    monkeypatch.setattr(demo, "available_memory_bytes", lambda device: 2**20)
    line = _one_line_error(capsys, ["demo", "--device", "cpu", "--context-len", "65536"])
    assert line.startswith("ess demo: --context-len: the demo needs at least ")
    assert "0.0 GiB is free; lower --batch, --context-len, --layers or --steps" in line
    monkeypatch.setattr(demo, "available_memory_bytes", lambda device: None)  # unknown: not refused up front
    with pytest.raises(AssertionError, match="run_demo reached"):
        main(["demo", "--device", "cpu", "--context-len", "65536"])


@pytest.mark.parametrize("error", ["pinned", "memory"])
def test_an_allocation_that_fails_anyway_is_one_line(capsys, monkeypatch, error):
    """Past the up-front check (a lower bound), a failed allocation still names a size flag, without a traceback."""
    from ess_sglang import demo
    from ess_sglang.host_pool import PinnedMemoryError

    def fail(**_):
        raise PinnedMemoryError("could not allocate") if error == "pinned" else MemoryError()

    monkeypatch.setattr(demo, "run_demo", fail)
    line = _one_line_error(capsys, ["demo", "--device", "cpu", "--batch", "64"])
    assert line.startswith("ess demo: --batch: the demo needs at least ") and "the allocation failed" in line
    assert ("ulimit -l" in line) == (error == "pinned")


def test_a_metrics_host_that_does_not_resolve_names_the_host(capsys, monkeypatch):
    import socket

    from ess_sglang import metrics

    def unresolvable(port, addr, registry=None):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(metrics, "serve_metrics", unresolvable)
    line = _one_line_error(capsys, ["demo", "--device", "cpu", "--metrics-port", "0", "--metrics-host", "nowhere"])
    assert line == ("ess demo: --metrics-host: nowhere: not an address of this machine (Name or service not known); "
                    "use e.g. 127.0.0.1 or 0.0.0.0")


def test_an_unknown_flag_is_one_line(capsys):
    line = _one_line_error(capsys, ["demo", "--bach", "2"])
    assert "--bach" in line


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"ess {__version__}"


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


@pytest.mark.parametrize("command", ["demo", "plan", "simulate", "profile"])
def test_every_flag_has_help_and_shows_its_default(command):
    sub = _subparsers(build_parser())[command]
    formatter = sub._get_formatter()
    for action in sub._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or "-h" in action.option_strings:
            continue
        assert action.help, f"ess {command} {action.option_strings[0]} has no help"
        shown = formatter._expand_help(action) if hasattr(formatter, "_expand_help") else action.help
        assert "default" in shown.lower(), f"ess {command} {action.option_strings[0]}: {shown}"
