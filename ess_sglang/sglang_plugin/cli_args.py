"""``--enable-ess`` and ``--ess-config PATH``: the flags, what they imply, and the start-up validation.

Hooks (see ``hooks.py``):

* ``ServerArgs.add_cli_args`` (after): adds the two flags to SGLang's parser, so they appear in
  ``python -m sglang.launch_server --help`` and are accepted by ``sglang serve``.
* ``ServerArgs.from_cli_args`` (around): when ``--enable-ess`` is given, checks the installation, loads and validates
  the ESS config (``ess_sglang.config.load_config``: errors name the file and the key), refuses flags ESS cannot
  work with, and sets what ESS implies on the argparse namespace the record is built from: ``--enable-hisparse``
  (ESS reuses HiSparse's logical allocator, pinned host pool and direct-to-host PD transfer),
  ``--disable-radix-cache`` and, when the KV dtype was left at ``auto``, ``--kv-cache-dtype fp8_e4m3`` (the
  656-byte FlashMLA V32 entry). The settings go on the built record as bookkeeping attributes (``settings.py``),
  which survive pickling to the scheduler
  processes. On a PD prefill instance (``--disaggregation-mode prefill``) ESS itself stays off: the instance only
  captures and sends the query windows' top-k sets (``pd_windows.py``); it implies ``--kv-cache-dtype fp8_e4m3``
  (the decode instance's KV format) and nothing else.
* ``hisparse_hook.validate_hisparse`` (around): during resolution, before HiSparse's own checks, validates what
  depends on the model and on resolved values (DSA model, KV dtype, DSA decode backend, page size, top-k), so that
  the user reads ESS's message rather than one about flags they did not pass.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ess_sglang.config import EssConfig, load_config
from ess_sglang.sglang_plugin import compat, settings
from ess_sglang.sglang_plugin.compat import EssLaunchError

logger = logging.getLogger("ess_sglang.sglang_plugin")

ENV_ENABLED = "ESS_SGLANG_ENABLED"
"""Set to 1 in the launcher when ESS is enabled; spawned SGLang processes inherit it and register the runtime hooks
(the settings themselves travel on the pickled ServerArgs)."""

SUPPORTED_KV_DTYPES = ("fp8_e4m3",)
SUPPORTED_DECODE_BACKENDS = ("flashmla_kv",)
REFUSED_DECODE_BACKENDS = {
    "flashinfer_sparse_mla": (
        "ESS is validated only with FlashMLA's V32 sparse decode kernel; flashinfer_sparse_mla (SM120) reads the "
        "same slot table but has never been run with ESS: use --dsa-decode-backend flashmla_kv"),
}
HELP_ENABLE = ("Enable ESS (ess-sglang): keep the DSA latent KV cache in pinned host memory and only the indexer "
               "cache plus a per-layer hot pool on the GPU. Implies --enable-hisparse, --disable-radix-cache and "
               "--kv-cache-dtype fp8_e4m3. For DeepSeek Sparse Attention models (DeepSeek-V3.2, GLM-5) on PD decode "
               "instances or colocated serving. On a PD prefill instance it only sends each prompt's last query "
               "windows' top-k sets to the decode instance (for its warm-up) and implies --kv-cache-dtype fp8_e4m3.")
HELP_CONFIG = ("ESS configuration YAML (the mapping under `ess_config:`; every key is in configs/ess.yaml of "
               "ess-sglang). Without it, the defaults apply: hot pool = 0.2 x the host pool.")


# ------------------------------------------------------------------------------------------------ the flags

def add_cli_args_hook(result, parser, *args, **kwargs):
    """AFTER ServerArgs.add_cli_args(parser): register --enable-ess and --ess-config once per parser."""
    if any("--enable-ess" in a.option_strings for a in parser._actions):
        return None
    group = parser.add_argument_group("ESS (ess-sglang plugin)")
    group.add_argument("--enable-ess", action="store_true", default=False, help=HELP_ENABLE)
    group.add_argument("--ess-config", type=str, default=None, metavar="PATH", help=HELP_CONFIG)
    return None


def from_cli_args_hook(original, cls, args, *rest, **kwargs):
    """AROUND ServerArgs.from_cli_args(args): turn the flags into settings (or refuse), then build the record.

    What ESS implies is written on the argparse namespace before SGLang builds the record from it: SGLang 0.5.17's
    ServerArgs resolves inside its constructor and refuses field writes afterwards; 0.5.23 resolves later, but
    builds the record from the same namespace. The settings then go on the record as bookkeeping attributes."""
    enable = bool(getattr(args, "enable_ess", False))
    path = getattr(args, "ess_config", None)
    if not enable:
        if path:
            raise EssLaunchError(f"--ess-config {path} is given without --enable-ess: add --enable-ess to use ESS, "
                                 f"or drop --ess-config")
        return original(cls, args, *rest, **kwargs)
    s = enable_on_namespace(args, path)
    result = original(cls, args, *rest, **kwargs)
    settings.store(result, s)
    settings.current(result)
    if s.enabled or s.send_windows:
        logger.info("ESS enabled%s", f" with {s.config_path}" if s.config_path else " with the default config")
    return result


def enable_on_namespace(args: Any, config_path: str | None) -> settings.EssSettings:
    """Check the installation, load the config, refuse incompatible raw flags, set the implied ones on the raw
    arguments (an argparse namespace, or a record before resolution)."""
    report = compat.get_report()
    if report is not None and not report.ok:
        raise compat.EssUnavailableError(report.refusal())
    config = load_config(config_path) if config_path else EssConfig()
    if not config.enabled:
        logger.warning("ESS: %s sets ess_config.enabled: false; serving without ESS", config_path)
        s = settings.EssSettings(False, config, config_path)
        settings.store(args, s)
        return s
    if getattr(args, "disaggregation_mode", "null") == "prefill":
        return _enable_prefill_sender(args, config, config_path)
    problems = check_raw_flags(args)
    if problems:
        raise EssLaunchError(_format(problems))
    args.enable_hisparse = True
    args.disable_radix_cache = True
    if args.kv_cache_dtype == "auto":
        args.kv_cache_dtype = "fp8_e4m3"
    return _activate(args, settings.EssSettings(True, config, config_path))


def _activate(args: Any, s: settings.EssSettings) -> settings.EssSettings:
    """Record the settings in this process (and on the raw arguments), and mark the process, so that the processes
    SGLang spawns install the runtime hooks at plugin load. This process loaded the plugin before the flags were
    known: the registry (hooks.py) installs them here before SGLang builds the record."""
    settings.store(args, s)
    settings.current(args)
    os.environ[ENV_ENABLED] = "1"
    return s


def _enable_prefill_sender(server_args: Any, config: EssConfig, config_path: str | None) -> settings.EssSettings:
    """--enable-ess on a PD prefill instance: ESS keeps nothing there; the instance captures the prompt's last query
    windows' top-k sets and sends them to the decode instance beside the KV (``pd_windows``)."""
    problems = check_raw_prefill_flags(server_args)
    if problems:
        raise EssLaunchError(_format(problems))
    if server_args.kv_cache_dtype == "auto":  # the decode instance's ESS stores fp8_e4m3; the KV layouts must match
        server_args.kv_cache_dtype = "fp8_e4m3"
    s = _activate(server_args, settings.EssSettings(False, config, config_path, send_windows=True))
    if config.warmup_windows <= 0:
        logger.warning("ESS (PD prefill): ess_config.warmup_windows is 0: no window sets are sent; the decode "
                       "instance warms requests up from their most recent tokens")
    else:
        logger.info("ESS (PD prefill): the last %d query windows' top-k sets of each prompt are sent to the decode "
                    "instance with the KV", config.warmup_windows)
    return s


def check_raw_prefill_flags(a: Any) -> list[str]:
    """Problems of a PD prefill instance started with --enable-ess; each line says what to change."""
    p = []
    if getattr(a, "kv_cache_dtype", "auto") not in ("auto",) + SUPPORTED_KV_DTYPES:
        p.append(f"--kv-cache-dtype {a.kv_cache_dtype}: the ESS decode instance stores fp8_e4m3 (FlashMLA V32) KV "
                 f"and receives this instance's KV as it is: use --kv-cache-dtype fp8_e4m3 (or leave it unset)")
    if getattr(a, "pp_size", 1) and int(getattr(a, "pp_size", 1)) > 1:
        p.append(f"--pp-size {a.pp_size}: the window sets of all layers are sent from one rank; pipeline "
                 f"parallelism is not supported on a prefill instance with ESS: use --pp-size 1 or drop --enable-ess")
    if getattr(a, "enable_pd_role_switch", False):
        p.append("--enable-pd-role-switch is not supported with ESS: drop it")
    return p


def _format(problems: list[str]) -> str:
    if len(problems) == 1:
        return f"--enable-ess: {problems[0]}"
    return "--enable-ess cannot start:\n  " + "\n  ".join(problems)


def check_raw_flags(a: Any) -> list[str]:
    """Problems visible in the raw arguments (before resolution); each line says what to change."""
    p = []
    if getattr(a, "hisparse_config", None):
        p.append("--hisparse-config is set; ESS configures HiSparse's pools itself: drop --hisparse-config and put "
                 "the sizes in --ess-config")
    if getattr(a, "kv_cache_dtype", "auto") not in ("auto",) + SUPPORTED_KV_DTYPES:
        p.append(f"--kv-cache-dtype {a.kv_cache_dtype} is not supported: ESS stores FlashMLA V32 FP8 entries "
                 f"(656 B per token per layer); use --kv-cache-dtype fp8_e4m3 (or leave it unset)")
    algo = getattr(a, "speculative_algorithm", None)
    if algo and str(algo).upper() != "NONE":
        p.append(f"--speculative-algorithm {algo} is not supported with ESS yet (MTP verify steps would need "
                 f"multi-token write-back): drop --speculative-algorithm")
    if getattr(a, "max_total_tokens", None) is not None:
        p.append("--max-total-tokens is set; ESS sizes the GPU pools from the ESS config (host pool, hot pool, "
                 "indexer cache): drop --max-total-tokens and use ess_config.max_kv_cache_gb (the GPU bytes of all "
                 "KV pools) / memory_pool_size_gb / max_gpu_buffer_size_gb")
    if getattr(a, "enable_mixed_chunk", False):
        p.append("--enable-mixed-chunk is not supported with ESS (a mixed batch cannot join the decode batch that "
                 "owns the hot pools): drop --enable-mixed-chunk")
    if getattr(a, "enable_hierarchical_cache", False):
        p.append("--enable-hierarchical-cache (HiCache) cannot be combined with ESS: ESS already keeps the latent "
                 "cache in host memory; drop --enable-hierarchical-cache")
    if getattr(a, "disaggregation_decode_enable_radix_cache", False):
        p.append("--disaggregation-decode-enable-radix-cache cannot be combined with ESS (it needs the radix "
                 "cache, which ESS disables): drop it")
    if getattr(a, "pp_size", 1) and int(getattr(a, "pp_size", 1)) > 1:
        p.append(f"--pp-size {a.pp_size}: pipeline parallelism is not supported with ESS yet: use --pp-size 1")
    for flag in ("enable_two_batch_overlap", "enable_single_batch_overlap"):
        if getattr(a, flag, False):
            p.append(f"--{flag.replace('_', '-')} is not supported with ESS yet (the hot pools advance one LRU step "
                     f"per decode step; overlapped micro-batches would evict each other's selections): drop it")
    if getattr(a, "enable_pd_role_switch", False):
        p.append("--enable-pd-role-switch is not supported with ESS: drop it")
    threshold = getattr(a, "disaggregation_decode_host_receive_threshold", 1.0)
    if threshold is not None and float(threshold) < 1:
        p.append("--disaggregation-decode-host-receive-threshold < 1 is not supported with ESS (KV already lands "
                 "in the host pool): leave it at 1")
    if getattr(a, "disaggregation_mode", "null") == "decode" and not compat.pd_decode_supported():
        p.append(compat.PD_DECODE_REFUSAL_0517)
    elif getattr(a, "disaggregation_mode", "null") == "decode" and not _deferred_decode_release():
        p.append("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE is off: an aborted request's host-pool slots "
                 "would be freed while the prefill's RDMA writes into them may still land, and a later request "
                 "reusing them would read that data: unset it (SGLang's default holds the slots until the "
                 "prefill acknowledges the transfer drained)")
    return p


def _deferred_decode_release() -> bool:
    """SGLang's switch for holding an aborted PD request's KV destination until the transfer drained (default on;
    SGLang 0.5.17 has no such switch and no deferral: see compat.PD_DECODE_REFUSAL_0517)."""
    from sglang.srt.environ import envs

    switch = getattr(envs, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", None)
    return switch is not None and bool(switch.get())


# ------------------------------------------------------------------------------------------------ resolution

def _not_dsa(hf_config: Any) -> str | None:
    """The problem when the model does not use DeepSeek Sparse Attention, else None."""
    from sglang.srt.configs.model_config import is_deepseek_dsa

    if is_deepseek_dsa(hf_config):
        return None
    arch = list(getattr(hf_config, "architectures", None) or ["unknown"])[0]
    return (f"the model ({arch}) does not use DeepSeek Sparse Attention; ESS works only for DSA models "
            f"(DeepSeek-V3.2, GLM-5): drop --enable-ess for this model")


def check_resolved(view: Any, config: EssConfig, hf_config: Any) -> list[str]:
    """Problems that need the model and resolved values. `view` reads resolved fields; `hf_config` is the model's."""
    not_dsa = _not_dsa(hf_config)
    if not_dsa is not None:
        return [not_dsa]  # nothing below applies
    p = []
    dtype = getattr(view, "kv_cache_dtype", None)
    if dtype not in SUPPORTED_KV_DTYPES:
        p.append(f"the KV cache dtype resolved to {dtype}; ESS needs FlashMLA V32 FP8 entries: use "
                 f"--kv-cache-dtype fp8_e4m3")
    decode = getattr(view, "dsa_decode_backend", None)
    if decode in REFUSED_DECODE_BACKENDS:
        p.append(f"--dsa-decode-backend {decode}: {REFUSED_DECODE_BACKENDS[decode]}")
    elif decode is not None and decode not in SUPPORTED_DECODE_BACKENDS:
        p.append(f"--dsa-decode-backend {decode} is not supported with ESS: use --dsa-decode-backend flashmla_kv")
    for name in ("attention_backend", "decode_attention_backend"):
        backend = getattr(view, name, None)
        if backend is not None and backend != "dsa":
            p.append(f"--{name.replace('_', '-')} {backend}: ESS plugs into SGLang's DSA attention backend; use "
                     f"--{name.replace('_', '-')} dsa (or leave it unset)")
    page = getattr(view, "page_size", None)
    if page is not None and page != config.page_size:
        p.append(f"the KV page size resolved to {page} but ess_config.page_size is {config.page_size}: set "
                 f"ess_config.page_size: {page}")
    topk = getattr(hf_config, "index_topk", None)
    if topk is not None and topk != config.top_k:
        p.append(f"the model selects index_topk={topk} entries but ess_config.top_k is {config.top_k}: set "
                 f"ess_config.top_k: {topk}")
    p.extend(overlap_problems(config, getattr(hf_config, "num_hidden_layers", None)))
    return p


def overlap_problems(config: EssConfig, num_layers: int | None) -> list[str]:
    """What the plugin cannot run of the overlap settings (echo.py plans what it can)."""
    from ess_sglang.overlap_policy import OverlapProfileError, load_profile

    p = []
    if config.overlap_profile is not None and config.prefetch_overlap_level in ("auto", "full"):
        try:
            load_profile(config.overlap_profile, num_layers if isinstance(num_layers, int) else None)
        except OverlapProfileError as exc:
            p.append(f"ess_config.overlap_profile: {exc}")
    return p


def validate_hisparse_hook(original, view, *args, **kwargs):
    """AROUND hisparse_hook.validate_hisparse(view): ESS's checks first, then HiSparse's own."""
    s = settings.read(view)
    if s.send_windows or s.enabled:
        hf_config = compat.hf_config_of(view)
        problems = check_resolved(view, s.config, hf_config) if s.enabled else [p for p in [_not_dsa(hf_config)] if p]
        if problems:
            raise EssLaunchError(_format(problems))
    return original(view, *args, **kwargs)
