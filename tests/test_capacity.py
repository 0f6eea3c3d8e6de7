"""ess_sglang.capacity: the capacity arithmetic, its limiting factors, and the `ess plan` command."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ess_sglang import capacity, cli
from ess_sglang.capacity import (
    FACTORS,
    MODEL_PRESETS,
    ModelSpec,
    parse_tokens,
    plan_capacity,
)
from ess_sglang.config import GIB, EssConfigError

ROOT = Path(__file__).resolve().parent.parent
DSV32 = MODEL_PRESETS["deepseek-v3.2-exp"]
K32 = 32 * 1024


def test_config_and_capacity_do_not_import_torch():
    code = "import sys, ess_sglang.config, ess_sglang.capacity; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_presets():
    assert (DSV32.num_layers, DSV32.latent_bytes_per_token_layer, DSV32.indexer_bytes_per_token_layer,
            DSV32.top_k) == (61, 656, 132, 2048)
    assert DSV32.latent_bytes_per_token == 40_016 and DSV32.indexer_bytes_per_token == 8_052  # docs/design.md
    assert MODEL_PRESETS["glm-5"].num_layers == 78


def test_model_spec_errors_name_the_field():
    with pytest.raises(EssConfigError, match=r"model\.num_layers: must be > 0 \(got 0\)"):
        ModelSpec.from_mapping({"name": "x", "num_layers": 0})
    with pytest.raises(EssConfigError, match=r"model\.layers: unknown key"):
        ModelSpec.from_mapping({"name": "x", "num_layers": 4, "layers": 4})


# ----------------------------------------------------------------------------------------------- arithmetic

def test_deepseek_32k_by_hand():
    r = plan_capacity(DSV32, 80 * GIB, 400 * GIB, K32, 0.2)
    # Without ESS: 32,768 tokens x 61 layers x (656 + 132) B = 1,575,092,224 B per request;
    # 80 GiB = 85,899,345,920 B holds 54 of them (54.5).
    assert r.latent_bytes_per_request + r.indexer_bytes_per_request == 32768 * 61 * 788 == 1_575_092_224
    assert r.without_ess.requests == 54 and r.without_ess.limited_by == "hbm"
    # With ESS: indexer 32,768 x 61 x 132 = 263,847,936 B + hot pool ceil(0.2 x 32,768) = 6,554 slots x 40,016 B
    # = 262,264,864 B -> 526,112,800 B per request: 163 requests (163.3). Host: 400 GiB / 1,311,244,288 B = 327.
    assert r.indexer_bytes_per_request == 263_847_936
    assert r.with_ess.bounds == {"hbm": 163, "hot_pool_min": 85_899_345_920 // (263_847_936 + 2049 * 40_016),
                                 "host_memory": 327}
    assert r.with_ess.requests == 163 and r.with_ess.limited_by == "hbm"
    assert r.gain == pytest.approx(163 / 54)
    assert r.hot_slots_min_per_request == 2049


def test_small_host_memory_becomes_the_limit():
    r = plan_capacity(DSV32, 80 * GIB, 40 * GIB, K32, 0.2)
    assert r.with_ess.limited_by == "host_memory"
    assert r.with_ess.requests == 40 * GIB // (32768 * 40_016) == 32
    assert r.with_ess.detail == "40.00 GiB host memory / 1.22 GiB latents per request"
    assert r.gain == pytest.approx(32 / 54)
    # Enough host memory: the HBM limit comes back.
    assert plan_capacity(DSV32, 80 * GIB, 1000 * GIB, K32, 0.2).with_ess.limited_by == "hbm"


def test_tiny_ratio_hits_the_hot_pool_floor():
    # ratio 0.01 x 32K = 328 slots, but each request selects 2 x 2,048 + 2 new tokens per step.
    r = plan_capacity(DSV32, 80 * GIB, 1000 * GIB, K32, 0.01, q_tokens_per_step=2)
    assert r.hot_slots_min_per_request == 4098
    assert r.with_ess.limited_by == "hot_pool_min"
    assert r.with_ess.requests == 80 * GIB // (263_847_936 + 4098 * 40_016)


def test_fixed_hot_pool():
    # 16 GiB hot pool: 429,324 slots per layer / 2,049 per request = 209; (80 - 16) GiB / 263,847,936 B = 260.
    r = plan_capacity(DSV32, 80 * GIB, 1000 * GIB, K32, None, hot_pool_bytes=16 * GIB)
    assert r.with_ess.bounds == {"indexer_cache": 260, "hot_pool_min": 209, "host_memory": 1000 * GIB // 1_311_244_288}
    assert r.with_ess.limited_by == "hot_pool_min" and r.ratio is None
    # Less HBM: the indexer cache beside the hot pool runs out first ((40 - 16) GiB -> 97).
    r = plan_capacity(DSV32, 40 * GIB, 1000 * GIB, K32, None, hot_pool_bytes=16 * GIB)
    assert r.with_ess.limited_by == "indexer_cache" and r.with_ess.requests == 97
    # Hot pool bigger than the whole budget: nothing fits.
    assert plan_capacity(DSV32, 8 * GIB, 1000 * GIB, K32, None, hot_pool_bytes=16 * GIB).with_ess.requests == 0


def test_nothing_fits_without_ess():
    r = plan_capacity(DSV32, 4 * GIB, 1000 * GIB, 128 * 1024, 0.2)
    assert r.without_ess.requests == 0 and r.gain is None and r.with_ess.requests == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"ratio": 0.0}, "ratio must be in"),
    ({"ratio": None}, "exactly one of ratio and hot_pool_bytes"),
    ({"hot_pool_bytes": GIB}, "exactly one of ratio and hot_pool_bytes"),
    ({"context_len": 0}, "context_len must be > 0"),
    ({"hbm_kv_budget_bytes": -1}, "hbm_kv_budget_bytes must be > 0"),
    ({"q_tokens_per_step": 0}, "q_tokens_per_step must be > 0"),
])
def test_bad_arguments(kwargs, message):
    args = {"model": DSV32, "hbm_kv_budget_bytes": GIB, "host_memory_bytes": GIB, "context_len": K32, "ratio": 0.2}
    with pytest.raises(ValueError, match=message):
        plan_capacity(**(args | kwargs))


# ----------------------------------------------------------------------------------------------- properties

models = st.builds(lambda layers, top_k: ModelSpec(name="m", num_layers=layers, top_k=top_k),
                   st.integers(1, 100), st.sampled_from([256, 2048]))
gib = st.integers(1, 2000).map(lambda n: n * GIB // 4)
contexts = st.integers(1, 1 << 20)
ratios = st.floats(0.001, 1.0)
qs = st.integers(1, 4)


@given(models, gib, gib, gib, contexts, ratios, qs)
def test_more_host_memory_never_reduces_requests(model, hbm, host_a, host_b, ctx, ratio, q):
    small, large = sorted((host_a, host_b))
    assert (plan_capacity(model, hbm, small, ctx, ratio, q).with_ess.requests
            <= plan_capacity(model, hbm, large, ctx, ratio, q).with_ess.requests)


@given(models, gib, gib, gib, contexts, ratios, qs)
def test_more_hbm_never_reduces_requests(model, hbm_a, hbm_b, host, ctx, ratio, q):
    small, large = (plan_capacity(model, h, host, ctx, ratio, q) for h in sorted((hbm_a, hbm_b)))
    assert small.with_ess.requests <= large.with_ess.requests
    assert small.without_ess.requests <= large.without_ess.requests


@given(models, gib, gib, contexts, ratios, ratios, qs)
def test_smaller_ratio_never_reduces_requests(model, hbm, host, ctx, ratio_a, ratio_b, q):
    low, high = sorted((ratio_a, ratio_b))
    assert (plan_capacity(model, hbm, host, ctx, high, q).with_ess.requests
            <= plan_capacity(model, hbm, host, ctx, low, q).with_ess.requests)


@given(models, gib, gib, contexts, qs)
def test_ratio_one_never_beats_no_ess(model, hbm, host, ctx, q):
    r = plan_capacity(model, hbm, host, ctx, 1.0, q)
    assert r.with_ess.requests <= r.without_ess.requests


@given(models, gib, gib, contexts, ratios, qs, st.one_of(st.none(), gib))
def test_binding_factor_is_the_smallest_bound(model, hbm, host, ctx, ratio, q, hot_pool):
    r = plan_capacity(model, hbm, host, ctx, None if hot_pool else ratio, q, hot_pool_bytes=hot_pool)
    for limit in (r.without_ess, r.with_ess):
        assert limit.limited_by in FACTORS and set(limit.bounds) <= set(FACTORS)
        assert limit.requests == limit.bounds[limit.limited_by] == min(limit.bounds.values())
    # What ESS admits fits: the host holds the latents, the GPU holds indexer + hot pool.
    n = r.with_ess.requests
    assert n * r.latent_bytes_per_request <= host
    if hot_pool is None:
        hot = max(math.ceil(ratio * ctx - 1e-9), r.hot_slots_min_per_request)
        assert n * (r.indexer_bytes_per_request + hot * model.latent_bytes_per_token) <= hbm
    else:
        assert n * r.indexer_bytes_per_request + hot_pool <= hbm or n == 0


# ----------------------------------------------------------------------------------------------- ess plan

@pytest.fixture
def ess(monkeypatch, capsys):
    """Run `ess <argv>` through ess_sglang.cli.main; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"plan": cli.SUBCOMMANDS["plan"]})  # only the command under test

    def call(*argv: str):
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:  # argparse rejects bad flags this way
            code = exc.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return call


def test_parse_tokens():
    assert parse_tokens("32K") == 32768 and parse_tokens("128k") == 131072 and parse_tokens("131072") == 131072
    assert parse_tokens("1M") == 1 << 20 and parse_tokens("1.5K") == 1536
    for bad in ("", "0", "-1", "32Q", "0.5", "1.0001K"):
        with pytest.raises(Exception, match="token count"):
            parse_tokens(bad)


def test_plan_table(ess):
    code, out, err = ess("plan", "--hbm-gb", "80", "--host-gb", "400", "--context-len", "32K", "128K")
    assert code == 0 and err == ""
    assert "deepseek-v3.2-exp" in out and "without ESS" in out and "limited by" in out
    row = next(line for line in out.splitlines() if "32K" in line and "│" in line)
    cells = [c.strip() for c in row.split("│")[1:6]]
    assert cells == ["32K", "54", "163", "hbm", "3.02x"]
    assert any("128K" in line and "│" in line for line in out.splitlines())


def test_plan_json(ess):
    code, out, _ = ess("plan", "--hbm-gb", "80", "--host-gb", "40", "--context-len", "32768", "64K", "--json",
                       "--q-tokens", "2", "--ratio", "0.1")
    assert code == 0
    data = json.loads(out)
    assert data["model"]["name"] == "deepseek-v3.2-exp"
    first = data["reports"][0]
    assert first["context_len"] == 32768 and first["ratio"] == 0.1 and first["q_tokens_per_step"] == 2
    assert first["without_ess"]["requests"] == 54
    assert first["with_ess"] == {**first["with_ess"], "requests": 32, "limited_by": "host_memory"}
    assert [r["context_len"] for r in data["reports"]] == [32768, 65536]


def test_plan_with_operator_config(ess):
    code, out, _ = ess("plan", "--hbm-gb", "80", "--config", str(ROOT / "configs/ess-deepseek-v32-pd-decode.yaml"),
                       "--context-len", "32K", "--json")
    assert code == 0
    r = json.loads(out)["reports"][0]
    assert r["host_memory_bytes"] == 200 * GIB and r["hot_pool_bytes"] == 16 * GIB and r["ratio"] is None
    assert r["with_ess"]["bounds"] == {"indexer_cache": 260, "hot_pool_min": 209, "host_memory": 163}
    assert r["with_ess"]["limited_by"] == "host_memory"


def test_plan_custom_and_yaml_models(ess, tmp_path):
    code, out, _ = ess("plan", "--model", "tiny", "--num-layers", "4", "--top-k", "64", "--hbm-gb", "1",
                       "--host-gb", "4", "--context-len", "4K", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["model"] == {"name": "tiny", "num_layers": 4, "latent_bytes_per_token_layer": 656,
                             "indexer_bytes_per_token_layer": 132, "weights_bytes_per_gpu": None, "top_k": 64}
    spec = tmp_path / "mini.yaml"
    spec.write_text("model:\n  num_layers: 8\n  top_k: 128\n  weights_bytes_per_gpu: 1073741824\n")
    code, out, _ = ess("plan", "--model", str(spec), "--gpu-gb", "10", "--mem-fraction", "0.5", "--host-gb", "4",
                       "--json", "--context-len", "8K")
    assert code == 0
    r = json.loads(out)
    assert r["model"]["name"] == "mini" and r["reports"][0]["hbm_kv_budget_bytes"] == 4 * GIB  # 10 x 0.5 - 1


@pytest.mark.parametrize("argv, flag", [
    (["--hbm-gb", "-1", "--host-gb", "4"], "--hbm-gb"),
    (["--hbm-gb", "80", "--host-gb", "4", "--context-len", "32Q"], "--context-len"),
    (["--hbm-gb", "80", "--host-gb", "4", "--ratio", "1.5"], "--ratio"),
    (["--hbm-gb", "80", "--host-gb", "nan"], "--host-gb"),
    (["--host-gb", "4"], "--hbm-gb"),
    (["--hbm-gb", "80", "--host-gb", "4", "--model", "nope"], "--model"),
    (["--hbm-gb", "80"], "--host-gb"),
    (["--gpu-gb", "141", "--host-gb", "4"], "--gpu-gb"),
    (["--gpu-gb", "100", "--weights-gb", "95", "--host-gb", "4"], "--gpu-gb"),
    (["--hbm-gb", "80", "--host-gb", "4", "--model", "x", "--num-layers", "0"], "--num-layers"),
])
def test_plan_bad_input_names_the_flag(ess, argv, flag):
    code, out, err = ess("plan", *argv)
    assert code == 2 and out == ""
    assert flag in err


def test_plan_bad_config_names_the_key(ess, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ess_config:\n  memory_pool_size_gb: -3\n")
    code, _, err = ess("plan", "--hbm-gb", "80", "--config", str(bad))
    assert code == 2 and "--config" in err and "ess_config.memory_pool_size_gb: must be > 0 (got -3)" in err
    code, _, err = ess("plan", "--hbm-gb", "80", "--host-gb", "4", "--config", str(tmp_path / "missing.yaml"))
    assert code == 2 and "no such file" in err


def test_run_is_the_cli_contract():
    assert callable(capacity.add_arguments) and callable(capacity.run)
