"""Every hook the plugin puts into SGLang (0.5.17 and 0.5.23), in one table: target, type, function, purpose.

Two groups:

* CLI hooks, registered in every process whenever the plugin loads: they add ``--enable-ess`` / ``--ess-config``
  and, when ESS is requested, install the runtime hooks (the launcher loads plugins before it parses arguments).
* Runtime hooks, registered only where ESS is enabled: in the launcher once ``--enable-ess`` is parsed, and in the
  processes SGLang spawns (they inherit ``ESS_SGLANG_ENABLED=1``). Each one still checks the settings carried by the
  ServerArgs record and passes through to SGLang's own code when ESS is off.
"""

from __future__ import annotations

import logging

from ess_sglang.sglang_plugin import (
    admission,
    cli_args,
    compat,
    coordinator,
    decode_batch,
    health,
    indexer_tap,
    pd_windows,
    request_checks,
    settings,
    sizing,
    warmup,
)
from ess_sglang.sglang_plugin.compat import HookSpec

logger = logging.getLogger("ess_sglang.sglang_plugin")

SA = "sglang.srt.server_args.ServerArgs"
MB = "sglang.srt.disaggregation.utils.MetadataBuffers"


# ---------------------------------------------------------------------------------------------- checked entries
# Three hooks start ESS in a process; before each hands over to its module, the registry installs or checks the hooks
# it depends on (the modules do not import this registry, which imports them).

def from_cli_args_hook(original, cls, args, *rest, **kwargs):
    """AROUND ServerArgs.from_cli_args: cli_args' handler; where it enabled ESS, the runtime hooks are installed and
    checked before SGLang builds the record (0.5.17's constructor already calls hooked code)."""

    def build(*a, **k):
        s = settings.read(args)
        if s.enabled or s.send_windows:
            install_runtime_hooks()
            compat.verify_applied(runtime_hooks_for(compat.installed_sglang_version()) + CLI_HOOKS)
        return original(*a, **k)

    return cli_args.from_cli_args_hook(build, cls, args, *rest, **kwargs)


def maybe_init_hisparse_coordinator_hook(original, runner, *args, **kwargs):
    """AROUND ModelRunner.maybe_init_hisparse_coordinator: every ESS hook checked, then the ESS coordinator."""
    if coordinator.runs_ess(runner):
        compat.verify_applied(all_hooks())
    return coordinator.maybe_init_hisparse_coordinator_hook(original, runner, *args, **kwargs)


def metadata_buffers_init_hook(result, buffers, *args, **kwargs):
    """AFTER MetadataBuffers.__init__: the PD hooks checked (SGLang only logs a hook that failed: refuse instead),
    then the ESS window-set buffer."""
    if pd_windows.current_role() is not None:
        compat.verify_applied(pd_hooks(), log=False)
    return pd_windows.metadata_buffers_init_hook(result, buffers, *args, **kwargs)


# ---------------------------------------------------------------------------------------------- the table

CLI_HOOKS: tuple[HookSpec, ...] = (
    HookSpec(f"{SA}.add_cli_args", "after", cli_args.add_cli_args_hook,
             "adds --enable-ess and --ess-config to SGLang's parser", always=True),
    HookSpec(f"{SA}.from_cli_args", "around", from_cli_args_hook,
             "turns the flags into ESS settings on the ServerArgs record, implies --enable-hisparse", always=True),
)

RUNTIME_HOOKS: tuple[HookSpec, ...] = (
    HookSpec("sglang.srt.arg_groups.hisparse_hook.validate_hisparse", "around", cli_args.validate_hisparse_hook,
             "validates model, KV dtype and DSA backends for ESS before HiSparse's own checks"),
    HookSpec("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.config_from_budget", "around",
             sizing.config_from_budget_hook,
             "sizes the device pool (hot pools, new-token slots, staging) and the logical/indexer space"),
    HookSpec("sglang.srt.mem_cache.sparsity.factory.parse_hisparse_config", "after", sizing.parse_hisparse_config_hook,
             "gives HiSparse's pools the host-to-device ratio and top-k ESS planned"),
    HookSpec("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.resolve_max_num_reqs", "after",
             sizing.resolve_max_num_reqs_hook, "caps max_running_requests at what ESS planned new-token slots for"),
    HookSpec("sglang.srt.model_executor.model_runner.ModelRunner.maybe_init_hisparse_coordinator", "around",
             maybe_init_hisparse_coordinator_hook,
             "builds the ESS coordinator in place of HiSparse's (its swap_in_selected_pages drives the cache manager)"),
    HookSpec("sglang.srt.managers.scheduler.Scheduler.init_hisparse_coordinator", "after",
             coordinator.init_hisparse_coordinator_hook, "attaches the scheduler: metrics labels, admission"),
    HookSpec("sglang.srt.managers.scheduler.Scheduler._build_hisparse_decode_batch", "after",
             decode_batch.build_hisparse_decode_batch_hook,
             "asks the sampler for the token-id log-probabilities the requests asked for, not their prompts (an "
             "SGLang HiSparse bug that costs ~2.3 ms of host time per request per decode step with return_logprob)"),
    HookSpec("sglang.srt.managers.scheduler.Scheduler.on_idle", "after", health.on_idle_hook,
             "the idle self-check: ESS's state consistent and every request's reservation, host entries and hot "
             "entries released; SGLang's own pool check, which it skips with HiSparse; the gauges published"),
    HookSpec("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request", "before",
             request_checks.validate_one_request_hook,
             "refuses token ids outside the vocabulary with an error answer (SGLang does not check them, and one "
             "reaching the embedding on a GPU takes the scheduler down)"),
    HookSpec("sglang.srt.managers.scheduler.Scheduler._add_request_to_queue", "before",
             admission.add_request_to_queue_hook, "rejects at once a request that can never fit"),
    HookSpec("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", "around", admission.add_one_req_hook,
             "colocated admission: host entries, indexer entries, hot slots, prefill staging"),
    HookSpec("sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc", "after", admission.pre_alloc_hook,
             "PD decode admission: reserves for a request once SGLang allocated its KV destination"),
    HookSpec("sglang.srt.mem_cache.hisparse_memory_pool.HiSparseDSATokenToKVPool.set_mla_kv_buffer", "around",
             coordinator.set_mla_kv_buffer_hook,
             "translates a forward's KV-write locations once, in its first layer, rather than in every layer"),
    HookSpec("sglang.srt.layers.attention.dsa.dsa_indexer.Indexer._get_topk_paged", "around",
             indexer_tap.get_topk_paged_hook, "opens the indexer tap in decode layers (ESS top-k, ECHO prefetch)"),
    HookSpec("sglang.srt.layers.attention.dsa.dsa_indexer_metadata.DSAIndexerMetadata.topk_transform", "around",
             indexer_tap.topk_transform_hook,
             "in an open tap: selects with SGLang's top-k v2 kernel and plan as without ESS (positions); queues the "
             "layer's prefetch from the logits before it, keeps the selection for its k-th best scores after it"),
    HookSpec("sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_extend", "before",
             warmup.forward_extend_hook, "captures the prefill's last query windows' top-k sets for warm-up"),
    HookSpec(f"{MB}.__init__", "after", metadata_buffers_init_hook,
             "PD: adds the window-set buffer (one slot per metadata slot) on prefill and decode instances with ESS"),
    HookSpec(f"{MB}.get_buf_infos", "after", pd_windows.get_buf_infos_hook,
             "PD: registers the window-set buffer with the transfer engine, after SGLang's metadata buffers"),
    HookSpec(f"{MB}.set_buf", "after", pd_windows.set_buf_hook,
             "PD prefill: writes the request's ranked window sets into its metadata slot"),
    HookSpec("sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req", "after",
             pd_windows.commit_transfer_hook, "PD decode: hands the received window sets to warm-up"),
)

"""Hooks every supported version takes."""

RUNTIME_HOOKS_BY_VERSION: dict[str, tuple[HookSpec, ...]] = {
    "0.5.23": (
        HookSpec("sglang.srt.disaggregation.decode.DecodePreallocQueue._required_admission_tokens", "around",
                 admission.required_admission_tokens_hook,
                 "PD decode admission: keeps a request queued until it fits"),
        HookSpec(f"{MB}.clear_slot", "after", pd_windows.clear_slot_hook,
                 "PD decode: invalidates a freed slot's window sets"),
    ),
    "0.5.17": (
        HookSpec("sglang.srt.mem_cache.common.release_kv_cache", "before", coordinator.release_kv_cache_hook,
                 "releases ESS's host slots, hot entries and reservation of a request that finished at prefill or "
                 "was aborted while waiting (0.5.17 calls no request_finished there)"),
    ),
}
"""Hooks whose targets exist in one version only (each set read from that version's source). SGLang 0.5.17 has no
``_required_admission_tokens`` (its PD decode budget check is inline in ``pop_preallocated``) and no
``MetadataBuffers.clear_slot``: ESS refuses PD decode instances there (``cli_args.check_raw_flags``)."""


def runtime_hooks_for(version: str | None) -> tuple[HookSpec, ...]:
    """The runtime hooks for an SGLang version (the newest supported set for an unknown one, so that its targets
    are checked and named)."""
    extra = RUNTIME_HOOKS_BY_VERSION.get(version or "", RUNTIME_HOOKS_BY_VERSION["0.5.23"])
    return RUNTIME_HOOKS + extra


def _installed_version() -> str | None:
    from ess_sglang.sglang_plugin.compat import installed_sglang_version

    return installed_sglang_version()


def pd_hooks(version: str | None = None) -> tuple[HookSpec, ...]:
    """What the PD window-set transfer needs (checked when the window-set buffer is created)."""
    wanted = (warmup.forward_extend_hook, metadata_buffers_init_hook, pd_windows.get_buf_infos_hook,
              pd_windows.set_buf_hook, pd_windows.clear_slot_hook, pd_windows.commit_transfer_hook)
    version = _installed_version() if version is None else version
    return tuple(h for h in runtime_hooks_for(version) if h.hook in wanted)


def all_hooks(version: str | None = None) -> tuple[HookSpec, ...]:
    """The CLI hooks and the runtime hooks of the installed SGLang (or of `version`)."""
    version = _installed_version() if version is None else version
    return CLI_HOOKS + runtime_hooks_for(version)


def _hook_type(kind: str):
    from sglang.srt.plugins.hook_registry import HookType

    return HookType(kind)


_REGISTERED: set[str] = set()


def _register(specs) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource

    source = HookSource(plugin_name="ess", dist_name="ess-sglang")  # also when registered outside load_plugins()
    for spec in specs:
        if spec.target in _REGISTERED:
            continue
        HookRegistry.register(spec.target, spec.hook, _hook_type(spec.kind), source=source)
        _REGISTERED.add(spec.target)


def register_cli_hooks() -> None:
    _register(CLI_HOOKS)


def install_runtime_hooks(apply: bool = True) -> None:
    """Register the runtime hooks; with `apply`, apply them now (the plugin loader already ran in this process)."""
    _register(runtime_hooks_for(_installed_version()))
    if apply:
        from sglang.srt.plugins.hook_registry import HookRegistry

        HookRegistry.apply_hooks()  # idempotent: targets already patched are skipped
