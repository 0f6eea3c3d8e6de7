"""Contract tests of the plugin against the installed SGLang (0.5.17 or 0.5.23): discovery, hooks, flags, pickling,
validation, the seam."""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from sglang_versions import PD_DECODE, SGLANG_VERSION, needs_pd_decode, resolve, resolved_view

from ess_sglang.config import EssConfigError

pytest.importorskip("sglang")  # CI installs sglang==0.5.23; this only guards machines without it

ESS_YAML = "ess_config:\n  memory_pool_size_gb: 100\n  sparse_memory_ratio: 0.25\n  warmup_windows: 16\n"


@pytest.fixture
def ess_yaml(tmp_path) -> str:
    p = tmp_path / "ess.yaml"
    p.write_text(ESS_YAML)
    return str(p)


def _prepare(argv):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(argv)


# ------------------------------------------------------------------------------------------------ discovery

def test_entry_point_discovered_by_load_plugins(loaded_plugins, monkeypatch):
    """SGLang's loader finds the `ess` entry point; SGLANG_PLUGINS=ess excludes every other installed plugin."""
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    import ess_sglang.sglang_plugin as plugin

    monkeypatch.setenv("SGLANG_PLUGINS", "ess")
    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert set(found) == {"ess"}
    func, dist = found["ess"]
    assert func is plugin.register and dist == "ess-sglang"
    monkeypatch.setenv("SGLANG_PLUGINS", "someone-else")
    assert "ess" not in load_plugins_by_group(GENERAL_PLUGINS_GROUP)


def test_plugin_does_nothing_unless_enabled(loaded_plugins, model_argv):
    """Loading registers only the CLI hooks; no ESS coordinator, no runtime hook until --enable-ess."""
    from ess_sglang.sglang_plugin import compat, hooks
    from ess_sglang.sglang_plugin.coordinator import active_coordinator

    assert compat.get_report() is not None and compat.get_report().ok, compat.get_report().problems
    for spec in hooks.CLI_HOOKS:
        assert compat.hook_is_applied(spec), spec.target
    assert active_coordinator() is None
    sa = _prepare(model_argv)
    assert not getattr(sa, "_ess_enabled", False) and not sa.enable_hisparse


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_every_hook_wraps_the_real_target(loaded_plugins, ess_yaml, ess_env, model_argv):
    """Enabling ESS installs the runtime hooks; each target is SGLang's wrapper whose __wrapped__ is the original,
    and one log line per applied hook is written."""
    from ess_sglang.sglang_plugin import compat, hooks

    log = logging.getLogger("ess_sglang.sglang_plugin")
    lines, level = _Lines(), log.level
    log.addHandler(lines)  # prepare_server_args resets the root logger's handlers (basicConfig(force=True))
    log.setLevel(logging.INFO)
    try:
        _prepare([*model_argv, "--enable-ess", "--ess-config", ess_yaml])
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    for spec in hooks.all_hooks():
        current = compat.resolve_target(spec.target)
        fn = current.__func__ if isinstance(current, (staticmethod, classmethod)) else current
        assert fn.__wrapped__ is loaded_plugins[spec.target], spec.target
        assert compat.hook_is_applied(spec), spec.target
    applied = [m for m in lines.lines if m.startswith("ESS hook applied")]
    assert len(applied) == len(hooks.all_hooks())
    # the patched parse_hisparse_config is what SGLang's lazy `from sglang.srt.mem_cache.sparsity import ...` sees
    import sglang.srt.mem_cache.sparsity as sparsity
    import sglang.srt.mem_cache.sparsity.factory as factory

    assert sparsity.parse_hisparse_config is factory.parse_hisparse_config


def test_version_and_target_checks_name_what_is_wrong():
    from ess_sglang.sglang_plugin import compat, hooks

    assert compat.check_version("0.5.23") is None
    msg = compat.check_version("0.5.24")
    assert "0.5.24" in msg and "0.5.23" in msg
    bogus = compat.HookSpec("sglang.srt.managers.scheduler.Scheduler.no_such_method", "after", print, "test")
    problems = compat.check_targets([bogus, *hooks.all_hooks()], "0.5.23")
    assert len(problems) == 1
    assert "sglang.srt.managers.scheduler.Scheduler.no_such_method" in problems[0] and "0.5.23" in problems[0]
    assert compat.check_targets([compat.HookSpec("sglang.srt.no_such_module.f", "after", print, "t")], "0.5.23")


def test_enable_refused_when_environment_check_failed(loaded_plugins, ess_env, monkeypatch):
    from ess_sglang.sglang_plugin import compat

    report = compat.EnvironmentReport("0.5.99", ["SGLang 0.5.99 is not supported by ess-sglang (supported: 0.5.23)"])
    monkeypatch.setattr(compat, "_REPORT", report)
    with pytest.raises(compat.EssUnavailableError, match=r"0\.5\.99"):
        _prepare(["--model-path", "/nonexistent", "--enable-ess"])


# ------------------------------------------------------------------------------------------------ flags

def _run(cmd, timeout=240, env_extra=None):
    env = dict(os.environ, SGLANG_PLUGINS="ess", **(env_extra or {}))
    env.pop("ESS_SGLANG_ENABLED", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_flags_in_launch_server_help():
    r = _run([sys.executable, "-m", "sglang.launch_server", "--help"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--enable-ess" in r.stdout and "--ess-config" in r.stdout
    assert "ESS (ess-sglang plugin)" in r.stdout


def test_sglang_serve_parses_the_flags(tmp_path, deepseek_dir):
    """`sglang serve` loads plugins before parsing, so it accepts the flags; a bad config stops it naming the key."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("ess_config:\n  memory_pool_size_gb: -3\n")
    r = _run([sys.executable, "-c", "import sys; from sglang.cli.main import main; sys.argv[0]='sglang'; main()",
              "serve", "--model-path", deepseek_dir, "--enable-ess", "--ess-config", str(bad)])
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "unrecognized arguments" not in out
    assert "ess_config.memory_pool_size_gb: must be > 0 (got -3)" in out


def test_server_args_round_trip_through_pickle_and_spawn(loaded_plugins, ess_yaml, ess_env, model_argv):
    """The settings live in bookkeeping attributes of the ServerArgs record (0.5.23's msgspec record, whose
    __reduce__ carries them; 0.5.17's dataclass, whose instance dict does), written after it was built."""
    from ess_sglang.sglang_plugin import settings

    sa = _prepare([*model_argv, "--enable-ess", "--ess-config", ess_yaml])
    assert sa.enable_hisparse and sa.disable_radix_cache and sa.kv_cache_dtype == "fp8_e4m3"
    copy = pickle.loads(pickle.dumps(sa))
    s = settings.read(copy)
    assert s.enabled and s.config_path == ess_yaml
    assert s.config.memory_pool_size_gb == 100.0 and s.config.sparse_memory_ratio == 0.25
    assert s.config == settings.read(sa).config
    assert os.environ.get("ESS_SGLANG_ENABLED") == "1"  # what spawned SGLang processes inherit
    # the launcher hands ServerArgs to its scheduler processes through a spawn-context multiprocessing.Process
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child_reads_settings, args=(sa, q))
    p.start()
    got = q.get(timeout=240)
    p.join(60)
    assert got == (True, ess_yaml, 100.0, 16, True)


def _child_reads_settings(server_args, q):
    from ess_sglang.sglang_plugin import settings

    s = settings.read(server_args)
    q.put((s.enabled, s.config_path, s.config.memory_pool_size_gb, s.config.warmup_windows,
           bool(server_args.enable_hisparse)))


def test_model_config_of_a_scheduler_processs_record(loaded_plugins, model_argv):
    """What the plugin reads in a scheduler process (pd_windows: the layer count and top-k of the metadata slots):
    the model config of the resolved record it received. SGLang 0.5.17's record refuses to cache one once resolved
    (ServerArgs.get_model_config would raise there), so a record without one gets a new one, left uncached."""
    import dataclasses

    from ess_sglang.sglang_plugin import compat

    sa = pickle.loads(pickle.dumps(resolve(_prepare(model_argv))))
    assert compat.hf_config_of(sa).architectures == ["DeepseekV32ForCausalLM"]
    assert compat.model_config_of(sa).hf_text_config.index_topk == 2048
    if dataclasses.is_dataclass(sa):  # SGLang 0.5.17
        object.__delattr__(sa, "model_config")
        with pytest.raises(AttributeError, match="read-only"):
            sa.get_model_config()
        assert compat.model_config_of(sa).hf_text_config.num_hidden_layers == 61
        assert "model_config" not in vars(sa)


# ------------------------------------------------------------------------------------------------ validation

def test_bad_ess_config_names_the_field(loaded_plugins, tmp_path, ess_env):
    p = tmp_path / "bad.yaml"
    p.write_text("ess_config:\n  sparse_memory_ratio: 1.5\n  warmup_window: 4\n")
    with pytest.raises(EssConfigError) as e:
        _prepare(["--model-path", "/nonexistent", "--enable-ess", "--ess-config", str(p)])
    text = str(e.value)
    assert "ess_config.sparse_memory_ratio: must be in (0, 1] (got 1.5)" in text
    assert "ess_config.warmup_window: unknown key (did you mean 'warmup_windows'?)" in text
    with pytest.raises(EssConfigError, match="no such file"):
        _prepare(["--model-path", "/nonexistent", "--enable-ess", "--ess-config", str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize("extra,expected", [
    (["--kv-cache-dtype", "bfloat16"], "use --kv-cache-dtype fp8_e4m3"),
    (["--speculative-algorithm", "EAGLE"], "drop --speculative-algorithm"),
    (["--enable-pd-role-switch"], "--enable-pd-role-switch is not supported with ESS"),
    (["--max-total-tokens", "100000"], "drop --max-total-tokens"),
    (["--enable-two-batch-overlap"], "--enable-two-batch-overlap is not supported with ESS"),
    (["--hisparse-config", '{"top_k": 2048}'], "drop --hisparse-config"),
    (["--enable-mixed-chunk"], "drop --enable-mixed-chunk"),
])
def test_incompatible_flags_fail_with_what_to_change(loaded_plugins, ess_env, extra, expected):
    import argparse

    from sglang.srt.server_args import ServerArgs

    from ess_sglang.sglang_plugin.compat import EssLaunchError

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    if not any(extra[0] in a.option_strings for a in parser._actions):
        pytest.skip(f"SGLang {SGLANG_VERSION} has no {extra[0]}")

    with pytest.raises(EssLaunchError, match=re.escape(expected)):
        _prepare(["--model-path", "/nonexistent", "--enable-ess", *extra])


@needs_pd_decode
def test_pd_decode_refuses_immediate_release_of_aborted_transfers(loaded_plugins, ess_env, monkeypatch):
    """With SGLang's deferred decode-side release off, an aborted request's host slots (the RDMA destination with
    ESS) would be reused while writes may still land: a PD decode instance refuses to start, naming the variable."""
    from ess_sglang.sglang_plugin.compat import EssLaunchError

    args = ["--model-path", "/nonexistent", "--enable-ess", "--disaggregation-mode", "decode"]
    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "false")
    with pytest.raises(EssLaunchError, match="SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE is off"):
        _prepare(args)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "true")
    from ess_sglang.sglang_plugin.cli_args import check_raw_flags

    assert not [p for p in check_raw_flags(types.SimpleNamespace(disaggregation_mode="decode"))
                if "DEFERRED_DECODE_KV_RELEASE" in p]


@pytest.mark.skipif(PD_DECODE, reason=f"SGLang {SGLANG_VERSION} serves PD decode with ESS")
def test_pd_decode_is_refused_where_unsupported(loaded_plugins, ess_env, monkeypatch):
    """SGLang 0.5.17 frees an aborted request's KV destination at once and has no hook for ESS's PD admission: a PD
    decode instance with ESS refuses to start there (whatever SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE
    says), naming the version to use; a PD prefill instance with ESS does not."""
    from ess_sglang.sglang_plugin.cli_args import check_raw_flags
    from ess_sglang.sglang_plugin.compat import PD_DECODE_REFUSAL_0517, EssLaunchError

    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "true")
    with pytest.raises(EssLaunchError, match=re.escape(PD_DECODE_REFUSAL_0517)):
        _prepare(["--model-path", "/nonexistent", "--enable-ess", "--disaggregation-mode", "decode"])
    assert "needs SGLang 0.5.23" in PD_DECODE_REFUSAL_0517
    assert check_raw_flags(types.SimpleNamespace(disaggregation_mode="decode")) == [PD_DECODE_REFUSAL_0517]
    assert check_raw_flags(types.SimpleNamespace(disaggregation_mode="prefill")) == []


def test_ess_config_without_enable_ess(loaded_plugins, ess_yaml, ess_env):
    from ess_sglang.sglang_plugin.compat import EssLaunchError

    with pytest.raises(EssLaunchError, match="without --enable-ess"):
        _prepare(["--model-path", "/nonexistent", "--ess-config", ess_yaml])


def _resolve(argv):
    """What the engine does at launch (entrypoints/engine.py): resolve, then check_server_args, where HiSparse's
    validation pass (and so ESS's) runs."""
    sa = resolve(_prepare(["--device", "cpu", "--skip-tokenizer-init", "--attention-backend", "dsa", *argv]))
    sa.check_server_args()
    return sa


def test_resolution_accepts_deepseek_v32(loaded_plugins, deepseek_dir, ess_yaml, ess_env, sm90):
    sa = _resolve(["--model-path", deepseek_dir, "--enable-ess", "--ess-config", ess_yaml])
    v = resolved_view(sa)
    assert v.enable_hisparse and v.disable_radix_cache
    assert v.kv_cache_dtype == "fp8_e4m3" and v.dsa_decode_backend == "flashmla_kv" and v.page_size == 64


def test_resolution_refuses_a_non_dsa_model(loaded_plugins, llama_dir, ess_env, sm90):
    from ess_sglang.sglang_plugin.compat import EssLaunchError

    with pytest.raises(EssLaunchError, match=r"LlamaForCausalLM\) does not use DeepSeek Sparse Attention.*drop "
                                             r"--enable-ess"):
        _resolve(["--model-path", llama_dir, "--enable-ess"])


def test_resolution_refuses_flashinfer_sparse_mla(loaded_plugins, deepseek_dir, ess_env, sm90):
    from ess_sglang.sglang_plugin.compat import EssLaunchError

    with pytest.raises(EssLaunchError, match=r"flashinfer_sparse_mla.*use --dsa-decode-backend flashmla_kv"):
        _resolve(["--model-path", deepseek_dir, "--enable-ess", "--dsa-decode-backend", "flashinfer_sparse_mla"])


def test_resolution_refuses_a_top_k_mismatch(loaded_plugins, deepseek_dir, tmp_path, ess_env, sm90):
    from ess_sglang.sglang_plugin.compat import EssLaunchError

    p = tmp_path / "k.yaml"
    p.write_text("ess_config:\n  top_k: 1024\n")
    with pytest.raises(EssLaunchError, match=r"index_topk=2048 .* set ess_config.top_k: 2048"):
        _resolve(["--model-path", deepseek_dir, "--enable-ess", "--ess-config", str(p)])


# ------------------------------------------------------------------------------------------------ coordinator API

def _sglang_src() -> Path:
    import sglang

    return Path(sglang.__file__).parent / "srt"


def test_coordinator_has_everything_sglang_calls():
    """Every attribute the installed SGLang reads from `hisparse_coordinator` (DSA paths) exists on EssCoordinator."""
    from ess_sglang.sglang_plugin.coordinator import EssCoordinator

    used = set()
    pat = re.compile(r"hisparse_coordinator\.([A-Za-z_]\w*)")
    for path in _sglang_src().rglob("*.py"):
        used |= set(pat.findall(path.read_text(encoding="utf-8", errors="replace")))
    decode_py = (_sglang_src() / "disaggregation" / "decode.py").read_text()
    used |= set(re.findall(r"\bcoordinator\.([A-Za-z_]\w*)", decode_py))
    not_dsa = {"raw_indices_buffer"}  # DeepSeek-V4's indexer only
    instance_attrs = {"mem_pool_host", "num_real_reqs", "device_buffer_size", "ack_staging_queue",
                      "req_to_host_pool", "req_to_host_pool_allocated_len", "padded_buffer_size", "spec_swap"}
    missing = sorted(a for a in used - not_dsa - instance_attrs if not hasattr(EssCoordinator, a))
    assert not missing, f"SGLang calls hisparse_coordinator.{missing} which EssCoordinator lacks"
    assert used >= {"swap_in_selected_pages", "map_last_loc_to_buffer", "request_finished", "admit_request_direct",
                    "admit_request_into_staging", "collect_ready_reqs", "num_real_reqs", "mem_pool_host"}


def test_decode_backend_calls_the_seam_with_these_arguments():
    """The call this plugin is built around, as written in SGLang's DSA backend (forward_decode)."""
    src = (_sglang_src() / "layers" / "attention" / "dsa_backend.py").read_text()
    call = re.search(r"page_table_1 = self\.hisparse_coordinator\.swap_in_selected_pages\(\s*"
                     r"forward_batch\.req_pool_indices,\s*forward_batch\.seq_lens,\s*topk_indices,\s*"
                     r"layer\.layer_id,\s*\)", src)
    assert call, "DeepseekSparseAttnBackend.forward_decode no longer calls swap_in_selected_pages as expected"
    runner = (_sglang_src() / "model_executor" / "model_runner.py").read_text()
    assert "self.hisparse_coordinator.num_real_reqs.fill_(" in runner
