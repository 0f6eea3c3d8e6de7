"""Contract tests against the real SGLang code (CPU), of either version the plugin supports (0.5.17 with torch
2.11, 0.5.23 with torch 2.14; CI installs sglang==0.5.23); each module's ``pytest.importorskip("sglang")`` only
guards machines without it.

Helpers shared by the modules: a fake DeepSeek-V3.2 checkpoint directory (config.json only, no weights), a fake
Llama one, resolution of ServerArgs on CPU (SGLang's DSA resolution asks for the GPU's compute capability, which is
answered as SM90 here), the parallel-context values SGLang's pools read, and what differs between the two SGLang
versions where a test drives SGLang's own objects (where ServerArgs resolves, how a scheduler's runtime context is
installed, where a request keeps its row: ``sglang_versions.py``). A test of a feature the plugin refuses on the
installed version skips with the plugin's own refusal as the reason (``sglang_versions.needs_pd_decode``).
"""

from __future__ import annotations

import json
import logging
import os

import pytest

DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 7168,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_topk": 2048,
    "index_head_dim": 128, "index_n_heads": 64, "vocab_size": 129280, "max_position_embeddings": 163840,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "torch_dtype": "bfloat16", "rope_theta": 10000,
    "rms_norm_eps": 1e-6,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 1024, "vocab_size": 32000,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
}


def _model_dir(tmp_path_factory, name: str, config: dict) -> str:
    d = tmp_path_factory.mktemp(name)
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


@pytest.fixture(scope="session")
def deepseek_dir(tmp_path_factory) -> str:
    return _model_dir(tmp_path_factory, "deepseek-v32", DEEPSEEK_V32)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return _model_dir(tmp_path_factory, "llama", LLAMA)


@pytest.fixture(scope="session")
def loaded_plugins():
    """SGLang's plugin loader, restricted to ours (SGLANG_PLUGINS=ess), run once in this process.

    Returns the original (unhooked) targets captured before loading, for the __wrapped__ comparisons.
    """
    from ess_sglang.sglang_plugin import compat, hooks

    for spec in hooks.all_hooks():  # import every target module first, so the originals can be captured
        compat.resolve_target(spec.target)
    originals = {}
    for spec in hooks.all_hooks():
        obj = compat.resolve_target(spec.target)
        originals[spec.target] = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    old = os.environ.get("SGLANG_PLUGINS")
    os.environ["SGLANG_PLUGINS"] = "ess"
    try:
        from sglang.srt.plugins import load_plugins

        load_plugins()
    finally:
        if old is None:
            os.environ.pop("SGLANG_PLUGINS", None)
        else:
            os.environ["SGLANG_PLUGINS"] = old
    return originals


@pytest.fixture
def ess_env(monkeypatch):
    """Undo what enabling ESS leaves in the process (the env switch, the cached settings)."""
    from ess_sglang.sglang_plugin import settings, sizing

    monkeypatch.delenv("ESS_SGLANG_ENABLED", raising=False)
    yield
    os.environ.pop("ESS_SGLANG_ENABLED", None)
    settings.reset()
    sizing.set_current_pools(None)


@pytest.fixture
def sm90(monkeypatch):
    """SGLang's DSA resolution reads the GPU's compute capability; answer as an H200 would."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))


@pytest.fixture
def parallel1():
    """The parallel-context values SGLang's KV pools read, as on a single-GPU rank."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1, attn_dcp_rank=0):
        yield


@pytest.fixture(autouse=True)
def _drop_sglang_log_handlers():
    """prepare_server_args calls logging.basicConfig(force=True), binding a root handler to the stream pytest
    captures for that test; drop handlers added during a test so later log records do not hit a closed stream."""
    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for h in list(root.handlers):
        if h not in before:
            root.removeHandler(h)
    for h in before:
        if h not in root.handlers:
            root.addHandler(h)


@pytest.fixture(autouse=True)
def _no_active_coordinator():
    yield
    from ess_sglang.sglang_plugin.active import set_active

    set_active(None)


@pytest.fixture
def model_argv(deepseek_dir, sm90) -> list[str]:
    """Launch arguments for a DeepSeek-V3.2 server on CPU. SGLang 0.5.23 parses ServerArgs without reading the
    model (it resolves later, ``resolve_once``); SGLang 0.5.17 resolves inside the ServerArgs constructor, which
    reads the model's config and the device: the same arguments serve both."""
    return ["--model-path", deepseek_dir, "--device", "cpu", "--skip-tokenizer-init", "--attention-backend", "dsa"]
