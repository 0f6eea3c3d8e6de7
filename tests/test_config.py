"""ess_sglang.config: validation messages, YAML loading, and the pool plan's arithmetic and checks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ess_sglang.config import (
    DEFAULT_SPARSE_MEMORY_RATIO,
    GIB,
    Deployment,
    EssConfig,
    EssConfigError,
    MetricsConfig,
    PoolPlan,
    load_config,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
ENTRY_61 = 656 * 61  # one token location across DeepSeek-V3.2's 61 layers: 40,016 B
DSV32 = {"num_layers": 61, "max_running_requests": 64, "max_context_len": 32768}


def error_of(data) -> str:
    with pytest.raises(EssConfigError) as info:
        EssConfig.from_mapping(data)
    return str(info.value)


# ----------------------------------------------------------------------------------------------- validation

def test_defaults():
    cfg = EssConfig()
    assert cfg.enabled and cfg.offload_target == "cpu_memory" and cfg.prefetch_overlap_level == "auto"
    assert (cfg.top_k, cfg.page_size, cfg.warmup_windows) == (2048, 64, 32)
    assert cfg.prefetch_ema_alpha == 0.5 and cfg.prefetch_cap_fraction == 0.01 and cfg.prefetch_cap_min_tokens == 64
    assert cfg.metrics == MetricsConfig(enabled=True, readout_interval_steps=16, per_layer=False)
    assert cfg.hot_pool_sized_by == "sparse_memory_ratio"
    assert EssConfig.from_mapping(None) == EssConfig.from_mapping({}) == cfg


def test_frozen():
    cfg = EssConfig()
    with pytest.raises(ValueError):
        cfg.top_k = 1  # type: ignore[misc]


def test_unknown_key_is_named_with_a_hint():
    assert error_of({"foo": 1}) == "ess_config.foo: unknown key"
    assert "ess_config.memory_pool_size: unknown key (did you mean 'memory_pool_size_gb'?)" in error_of(
        {"memory_pool_size": 200})
    assert "ess_config.metrics.per_layers: unknown key (did you mean 'per_layer'?)" in error_of(
        {"metrics": {"per_layers": True}})


def test_negative_size_names_the_field():
    assert error_of({"memory_pool_size_gb": -3}) == "ess_config.memory_pool_size_gb: must be > 0 (got -3)"
    assert error_of({"max_gpu_buffer_size_gb": 0}) == "ess_config.max_gpu_buffer_size_gb: must be > 0 (got 0)"
    assert "ess_config.memory_pool_size_gb: must be a finite number (got nan)" in error_of(
        {"memory_pool_size_gb": float("nan")})
    assert "ess_config.memory_pool_size_gb: must be a finite number (got inf)" in error_of(
        {"memory_pool_size_gb": float("inf")})


@pytest.mark.parametrize("key, value, expected", [
    ("sparse_memory_ratio", 0.0, "must be in (0, 1] (got 0)"),
    ("sparse_memory_ratio", 1.5, "must be in (0, 1] (got 1.5)"),
    ("prefetch_ema_alpha", 0.0, "must be in (0, 1]"),
    ("prefetch_cap_fraction", -0.1, "must be in [0, 1]"),
    ("top_k", 0, "must be > 0 (got 0)"),
    ("page_size", -64, "must be > 0 (got -64)"),
    ("hot_slots_per_layer", 0, "must be > 0"),
    ("warmup_windows", -1, "must be >= 0 (got -1)"),
    ("prefetch_cap_min_tokens", -1, "must be >= 0"),
    ("prefetch_overlap_level", "fast", "'auto', 'none' or 'full' (got 'fast')"),
    ("offload_target", "nvme", "got 'nvme'"),
    ("top_k", True, "valid integer (got True)"),
    ("top_k", "2048", "valid integer"),
    ("memory_pool_size_gb", "lots", "valid number (got 'lots')"),
    ("enabled", "maybe", "valid boolean"),
    ("overlap_profile", " ", "non-empty path"),
    ("retention", "mru", "'lru' or 'decay' (got 'mru')"),
    ("decay_gamma", 1.0, "must be in (0, 0.9] (got 1)"),
    ("decay_gamma", 0.95, "must be in (0, 0.9] (got 0.95)"),
    ("new_tokens", "later", "'on_demand' or 'insert' (got 'later')"),
])
def test_bad_values_name_the_field(key, value, expected):
    message = error_of({key: value})
    assert message.startswith(f"ess_config.{key}: ")
    assert expected in message


def test_metrics_rules():
    assert "ess_config.metrics.readout_interval_steps: must be > 0 (got 0)" in error_of(
        {"metrics": {"readout_interval_steps": 0}})
    assert "ess_config.metrics: " in error_of({"metrics": True})


def test_boundaries_accepted():
    cfg = EssConfig.from_mapping({"sparse_memory_ratio": 1, "prefetch_ema_alpha": 1.0, "prefetch_cap_fraction": 0,
                                  "warmup_windows": 0, "prefetch_cap_min_tokens": 0})
    assert cfg.sparse_memory_ratio == 1.0 and cfg.warmup_windows == 0


def test_two_sizing_knobs_are_named():
    message = error_of({"hot_slots_per_layer": 4096, "sparse_memory_ratio": 0.2})
    assert "ess_config.hot_slots_per_layer" in message and "ess_config.sparse_memory_ratio" in message
    message = error_of({"max_gpu_buffer_size_gb": 16, "sparse_memory_ratio": 0.2, "hot_slots_per_layer": 64})
    assert all(f"ess_config.{k}" in message for k in ("max_gpu_buffer_size_gb", "sparse_memory_ratio",
                                                      "hot_slots_per_layer"))


def test_all_errors_one_per_line():
    with pytest.raises(EssConfigError) as info:
        EssConfig.from_mapping({"foo": 1, "top_k": 0, "memory_pool_size_gb": -3})
    assert sorted(info.value.problems) == [
        "ess_config.foo: unknown key",
        "ess_config.memory_pool_size_gb: must be > 0 (got -3)",
        "ess_config.top_k: must be > 0 (got 0)",
    ]
    assert str(info.value).count("\n") == 2


def test_not_a_mapping():
    assert error_of([1, 2]) == "ess_config: expected a mapping, got list"


def test_deployment_errors_name_the_field():
    with pytest.raises(EssConfigError, match=r"deployment\.num_layers: must be > 0 \(got 0\)"):
        EssConfig().plan({**DSV32, "num_layers": 0})
    with pytest.raises(EssConfigError, match=r"deployment\.max_context_len: required"):
        EssConfig().plan({"num_layers": 61, "max_running_requests": 1})
    with pytest.raises(EssConfigError, match=r"deployment\.mtp: unknown key"):
        EssConfig().plan({**DSV32, "mtp": 1})


# ----------------------------------------------------------------------------------------------- loading

def test_operator_shape_loads():
    cfg = load_config(CONFIGS / "ess-deepseek-v32-pd-decode.yaml")
    assert cfg.enabled and cfg.offload_target == "cpu_memory" and cfg.prefetch_overlap_level == "auto"
    assert cfg.max_gpu_buffer_size_gb == 16 and cfg.memory_pool_size_gb == 200
    assert cfg.hot_pool_sized_by == "max_gpu_buffer_size_gb"


def test_documented_example_loads_and_plans():
    cfg = load_config(str(CONFIGS / "ess.yaml"))
    assert cfg.memory_pool_size_gb == 200 and cfg.sparse_memory_ratio == 0.2
    plan = cfg.plan(Deployment(**DSV32, q_tokens_per_step=2))
    assert plan.host_tokens == 5_366_562 and plan.hot_slots_per_layer % 64 == 0


def test_bare_mapping_and_null_section(tmp_path):
    bare = tmp_path / "bare.yaml"
    bare.write_text("top_k: 1024\nmetrics:\n  per_layer: true\n")
    cfg = load_config(bare)
    assert cfg.top_k == 1024 and cfg.metrics.per_layer
    empty_section = tmp_path / "null.yaml"
    empty_section.write_text("ess_config:\n")
    assert load_config(empty_section) == EssConfig()


def test_other_tools_keys_ignored_but_stray_ess_keys_rejected(tmp_path):
    f = tmp_path / "deploy.yaml"
    f.write_text("sglang:\n  tp: 8\ness_config:\n  top_k: 512\n")
    assert load_config(f).top_k == 512
    f.write_text("ess_config:\n  enabled: true\nmemory_pool_size_gb: 200\n")
    with pytest.raises(EssConfigError, match=r"memory_pool_size_gb: ESS key outside the ess_config: mapping"):
        load_config(f)


def test_load_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(EssConfigError, match=r"nope\.yaml: no such file"):
        load_config(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("ess_config: [unclosed\n")
    with pytest.raises(EssConfigError, match=r"bad\.yaml: not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("- 1\n- 2\n")
    with pytest.raises(EssConfigError, match=r"scalar\.yaml: expected a mapping .*got a list"):
        load_config(scalar)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(EssConfigError, match=r"empty\.yaml: expected a mapping .*got an empty file"):
        load_config(empty)
    negative = tmp_path / "neg.yaml"
    negative.write_text("ess_config:\n  memory_pool_size_gb: -3\n")
    with pytest.raises(EssConfigError) as info:
        load_config(negative)
    assert info.value.problems == [f"{negative}: ess_config.memory_pool_size_gb: must be > 0 (got -3)"]


# ----------------------------------------------------------------------------------------------- plan

def test_plan_operator_shape_by_hand():
    cfg = EssConfig.from_mapping({"max_gpu_buffer_size_gb": 16, "memory_pool_size_gb": 200})
    plan = cfg.plan(Deployment(**DSV32, q_tokens_per_step=2))
    # 200 GiB = 214,748,364,800 B / 40,016 B per token = 5,366,562.2 -> 5,366,562 tokens per layer.
    assert plan.host_tokens == 5_366_562
    assert plan.host_bytes == 5_366_562 * ENTRY_61
    # 16 GiB = 17,179,869,184 B / 40,016 = 429,324.4 -> 429,324, a budget, so rounded DOWN to pages: 429,312.
    assert plan.hot_slots_per_layer == 429_312 and plan.hot_pool_bytes == 429_312 * ENTRY_61 <= 16 * GIB
    assert plan.hot_slots_needed == 64 * 2 * (2048 + 1)
    assert plan.max_requests_at_full_context == 5_366_562 // 32768 == 163
    assert (plan.top_k, plan.page_size, plan.num_layers, plan.max_running_requests, plan.q_tokens_per_step) == (
        2048, 64, 61, 64, 2)
    assert plan.hot_pool_sized_by == "max_gpu_buffer_size_gb" and plan.host_pool_sized_by == "memory_pool_size_gb"
    assert "429,312 slots/layer" in plan.describe()


def test_plan_default_ratio_and_host_from_deployment():
    plan = EssConfig().plan(Deployment(**DSV32))
    assert plan.host_tokens == 64 * 32768
    # 0.2 x 2,097,152 = 419,430.4 -> 419,431 -> rounded up to 64: 419,456
    assert plan.hot_slots_per_layer == 419_456
    assert plan.hot_pool_sized_by == "sparse_memory_ratio" and DEFAULT_SPARSE_MEMORY_RATIO == 0.2
    assert plan.host_pool_sized_by == "max_running_requests x max_context_len"
    assert math.isclose(plan.hot_ratio, 419_456 / 2_097_152)


def test_plan_host_tokens_from_caller_and_slot_rounding():
    plan = EssConfig(hot_slots_per_layer=5000).plan(Deployment(**DSV32 | {"max_running_requests": 2},
                                                              host_tokens=100_000))
    assert plan.host_tokens == 100_000 and plan.hot_slots_per_layer == 5056  # 5000 rounded up to 64
    assert plan.host_pool_sized_by == "deployment.host_tokens"


def test_too_small_hot_pool_says_how_many_slots():
    with pytest.raises(EssConfigError) as info:
        EssConfig(hot_slots_per_layer=4096).plan(Deployment(**DSV32))
    message = str(info.value)
    needed = 64 * (2048 + 1)
    assert message.startswith("ess_config.hot_slots_per_layer: ")
    assert f"= {needed:,} slots per layer" in message  # 131,136, already a multiple of the page size
    assert "raise ess_config.hot_slots_per_layer to at least 131,136" in message

    with pytest.raises(EssConfigError) as info:
        EssConfig(max_gpu_buffer_size_gb=1).plan(Deployment(**DSV32, q_tokens_per_step=2))
    message = str(info.value)
    assert message.startswith("ess_config.max_gpu_buffer_size_gb: ") and f"{64 * 2 * 2049:,}" in message
    # 262,272 slots x 40,016 B = 9.774 GiB, rounded up; and the suggestion is enough:
    assert "raise ess_config.max_gpu_buffer_size_gb to at least 9.78 GiB" in message
    EssConfig(max_gpu_buffer_size_gb=9.78).plan(Deployment(**DSV32, q_tokens_per_step=2))

    with pytest.raises(EssConfigError, match=r"ess_config\.sparse_memory_ratio \(default 0\.2\): .*raise "
                                             r"ess_config\.sparse_memory_ratio to at least 0\.251"):
        EssConfig().plan(Deployment(num_layers=61, max_running_requests=64, max_context_len=8192))
    EssConfig(sparse_memory_ratio=0.251).plan(Deployment(num_layers=61, max_running_requests=64, max_context_len=8192))


def test_selections_larger_than_host_pool():
    with pytest.raises(EssConfigError, match="every entry would be hot"):
        EssConfig().plan(Deployment(num_layers=61, max_running_requests=8, max_context_len=2048))


def test_hot_pool_larger_than_host_pool():
    with pytest.raises(EssConfigError, match=r"ess_config\.hot_slots_per_layer: .*larger than the host pool"):
        EssConfig(hot_slots_per_layer=3_000_000).plan(Deployment(**DSV32))


def test_host_pool_smaller_than_one_request():
    with pytest.raises(EssConfigError,
                       match=r"ess_config\.memory_pool_size_gb: .*less than one request .*32,768 \(1\.23 GiB\)"):
        EssConfig(memory_pool_size_gb=1).plan(Deployment(**DSV32))


def test_host_pool_smaller_than_all_requests_is_fine():
    # 10 GiB / 40,016 B = 268,328 tokens per layer: 8 requests of 32K at once, fewer than 16 running.
    cfg = EssConfig(memory_pool_size_gb=10, max_gpu_buffer_size_gb=2)
    plan = cfg.plan(Deployment(**DSV32 | {"max_running_requests": 16}))
    assert plan.host_tokens == 268_328 and plan.max_requests_at_full_context == 8


def test_host_memory_of_the_machine():
    cfg = EssConfig(memory_pool_size_gb=200, max_gpu_buffer_size_gb=16)
    cfg.plan(Deployment(**DSV32), host_memory_bytes=256 * GIB)
    with pytest.raises(EssConfigError, match=r"^ess_config\.memory_pool_size_gb: .*200\.00 GiB .*128\.00 GiB"):
        cfg.plan(Deployment(**DSV32), host_memory_bytes=128 * GIB)
    with pytest.raises(EssConfigError, match=r"^ess_config\.memory_pool_size_gb: "):
        EssConfig().plan(Deployment(**DSV32), host_memory_bytes=16 * GIB)  # 64 x 32K x 40,016 B = 80 GiB


@given(
    layers=st.integers(1, 100), requests=st.integers(1, 256), ctx=st.integers(1, 300_000), q=st.integers(1, 4),
    top_k=st.sampled_from([64, 512, 2048]), page=st.sampled_from([1, 16, 64]),
    knob=st.sampled_from(["hot_slots_per_layer", "sparse_memory_ratio", "max_gpu_buffer_size_gb", None]),
    amount=st.floats(0.001, 1.0), pool_gb=st.one_of(st.none(), st.floats(0.5, 2000)),
)
def test_plan_invariants(layers, requests, ctx, q, top_k, page, knob, amount, pool_gb):
    sizing = {"hot_slots_per_layer": max(1, int(amount * 5_000_000)), "sparse_memory_ratio": amount,
              "max_gpu_buffer_size_gb": amount * 100}
    cfg = EssConfig(top_k=top_k, page_size=page, memory_pool_size_gb=pool_gb,
                    **({knob: sizing[knob]} if knob else {}))
    try:
        plan = cfg.plan(Deployment(num_layers=layers, max_running_requests=requests, max_context_len=ctx,
                                   q_tokens_per_step=q))
    except EssConfigError as exc:
        assert str(exc).startswith(("ess_config.", "deployment."))
        return
    assert isinstance(plan, PoolPlan)
    assert plan.hot_slots_per_layer >= plan.hot_slots_needed == requests * q * (min(top_k, ctx) + 1)
    assert plan.host_tokens >= ctx and plan.max_requests_at_full_context >= 1
    assert plan.hot_slots_per_layer < plan.host_tokens + page
    if knob != "max_gpu_buffer_size_gb":
        assert plan.hot_slots_per_layer % page == 0
    else:
        assert plan.hot_pool_bytes <= amount * 100 * GIB
    assert plan.host_bytes == plan.host_tokens * 656 * layers
    assert plan.hot_pool_bytes == plan.hot_slots_per_layer * 656 * layers
    if pool_gb is not None:
        assert plan.host_bytes <= pool_gb * GIB
