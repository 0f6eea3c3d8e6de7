"""Which SGLang the plugin supports, every attribute it hooks, and the checks that refuse ESS when they do not hold.

SGLang's plugin loader only logs a hook that failed to apply (``HookRegistry.apply_hooks`` catches and logs), so
the plugin checks for itself: at load time that the installed SGLang is a supported version and that every hook
target resolves, and when ESS is enabled that every hook actually wraps its target. Any failure turns into
``EssUnavailableError``, whose message names the version and the target.

This module imports nothing from SGLang at import time.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
import os
import pkgutil
from dataclasses import dataclass
from importlib import metadata

logger = logging.getLogger("ess_sglang.sglang_plugin")

SUPPORTED_SGLANG_VERSIONS = ("0.5.17", "0.5.23")
"""Versions whose source the hook targets were read from and tested against."""


PD_DECODE_REFUSAL_0517 = (
    "--disaggregation-mode decode with ESS needs SGLang 0.5.23: SGLang 0.5.17 frees an aborted request's KV "
    "destination at once, while the prefill's transfer may still write into its host-pool slots, and has no "
    "hook for ESS's PD admission (its budget check is inline in DecodePreallocQueue.pop_preallocated); "
    "serve colocated on 0.5.17, or upgrade SGLang")


class EssUnavailableError(RuntimeError):
    """ESS cannot be enabled in this installation (unsupported SGLang, or a hook target is missing)."""


class EssLaunchError(ValueError):
    """The launch arguments cannot work with ESS; the message says what to change."""


@dataclass(frozen=True)
class HookSpec:
    """One hook: the dotted path of the SGLang attribute, SGLang's hook type name, the function, and why."""

    target: str
    kind: str  # "before" | "after" | "around" | "replace" (sglang.srt.plugins.hook_registry.HookType values)
    hook: object
    purpose: str
    always: bool = False
    """Registered even when the environment check fails (the CLI hooks, so that --enable-ess can be refused with a
    message instead of 'unrecognized arguments')."""


def installed_sglang_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check_version(version: str | None = None) -> str | None:
    """A problem line when the installed SGLang is not supported, else None."""
    version = installed_sglang_version() if version is None else version
    if version is None:
        return "SGLang is not installed (pip install sglang==0.5.23, or 0.5.17 with torch 2.11)"
    if version not in SUPPORTED_SGLANG_VERSIONS:
        return (f"SGLang {version} is not supported by ess-sglang (supported: {', '.join(SUPPORTED_SGLANG_VERSIONS)}); "
                f"the hook targets were read from those versions only")
    return None


def pd_decode_supported(version: str | None = None) -> bool:
    """Whether ESS serves a PD decode instance (``--disaggregation-mode decode``) with this SGLang: not on 0.5.17
    (``PD_DECODE_REFUSAL_0517``)."""
    version = installed_sglang_version() if version is None else version
    return version != "0.5.17"


def model_config_of(server_args):
    """SGLang's ModelConfig of a ServerArgs record or a resolved view of one: SGLang 0.5.23's
    ``arg_groups.overrides.model_config_of``, else (0.5.17) the one the record built while it resolved
    (``ServerArgs.get_model_config()``), or a new one where a record has none cached: 0.5.17 refuses to cache it on
    a resolved record (only underscore attributes may be written after resolution)."""
    try:
        from sglang.srt.arg_groups.overrides import model_config_of as of
    except ImportError:
        cached = getattr(server_args, "model_config", None)
        if cached is not None:
            return cached
        if getattr(server_args, "_declarations_materialized", False):
            from sglang.srt.configs.model_config import ModelConfig

            return ModelConfig.from_server_args(server_args)
        return server_args.get_model_config()
    return of(server_args)


def hf_config_of(server_args):
    """The model's Hugging Face config from a ServerArgs record or a resolved view of one (``model_config_of``)."""
    return model_config_of(server_args).hf_config


def is_fake_transfer(req) -> bool:
    """SGLang's ``disaggregation.utils._is_fake_transfer`` for a request: ``(req)`` in 0.5.23, ``(req,
    server_args)`` in 0.5.17 (this process's published record)."""
    import inspect

    from sglang.srt.disaggregation.utils import _is_fake_transfer

    if len(inspect.signature(_is_fake_transfer).parameters) > 1:
        from sglang.srt.runtime_context import get_server_args

        return bool(_is_fake_transfer(req, get_server_args()))
    return bool(_is_fake_transfer(req))


def req_row(req) -> int | None:
    """The request's row of ``req_to_token`` (``req.kv.req_pool_idx`` in SGLang 0.5.23, ``req.req_pool_idx`` in
    0.5.17); None when it holds none."""
    kv = getattr(req, "kv", None)
    row = getattr(kv, "req_pool_idx", None) if kv is not None else None
    if row is None:
        row = getattr(req, "req_pool_idx", None)
    return None if row is None else int(row)


def req_extend_end(req) -> int:
    """The end of the request's prefill range (``req.extend_end`` in 0.5.23, ``req.extend_range.end`` in 0.5.17)."""
    end = getattr(req, "extend_end", None)
    return int(end if end is not None else req.extend_range.end)


def req_allocated_len(req) -> int:
    """KV locations allocated to the request (``req.kv.kv_allocated_len``; 0 once SGLang 0.5.17 released it)."""
    kv = getattr(req, "kv", None)
    return int(kv.kv_allocated_len) if kv is not None else 0


def make_host_pool(pool, host_tokens: int, pin_memory: bool):
    """SGLang's pinned, layer-first MLA host pool for `host_tokens` entries of the device pool's rows and layers.

    SGLang 0.5.23 takes the device pool's buffer description and a token capacity; 0.5.17 takes the device pool
    itself and a ratio to its size (rounded down to pages, then one page added)."""
    import inspect

    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    common = dict(page_size=pool.page_size, layout="layer_first", pin_memory=pin_memory,
                  override_kv_cache_dim=pool.kv_cache_dim, host_size=0)
    if "device_pool" in inspect.signature(MLATokenToKVPoolHost).parameters:
        return MLATokenToKVPoolHost(device_pool=pool, host_to_device_ratio=host_tokens / pool.size, **common)
    return MLATokenToKVPoolHost(
        buffer_info=pool.get_device_pool_infos()[0].buffer_info, host_to_device_ratio=1,
        device_capacity_tokens=pool.size, start_layer=pool.start_layer, end_layer=pool.end_layer,
        target_layer_num=pool.layer_num, host_token_capacity=host_tokens, **common)


def store_in_device_pool(pool, layer, rows, cache_k_nope, cache_k_rope):
    """What ``HiSparseDSATokenToKVPool.set_mla_kv_buffer`` does once it has translated the locations to device-pool
    rows: its parent class's store (0.5.17 and 0.5.23 alike)."""
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool

    return super(HiSparseDSATokenToKVPool, pool).set_mla_kv_buffer(layer, rows, cache_k_nope, cache_k_rope)


def resolve_target(target: str):
    """The object at a dotted path, as HookRegistry resolves it (module path, then attribute)."""
    obj_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(obj_path)
    if isinstance(owner, type) and attr in owner.__dict__:
        return owner.__dict__[attr]  # the raw staticmethod / classmethod object, not the bound descriptor
    return getattr(owner, attr)


def _module_file(parts: list[str]) -> tuple[str | None, list[str]]:
    """The source file of the longest module prefix of `parts`, found on disk (nothing is imported but the top
    package), and the remaining attribute names."""
    top = importlib.util.find_spec(parts[0])
    if top is None or not top.submodule_search_locations:
        return None, parts
    d = list(top.submodule_search_locations)[0]
    for i in range(1, len(parts)):
        sub = os.path.join(d, parts[i])
        if os.path.isfile(sub + ".py"):
            return sub + ".py", parts[i + 1:]
        if os.path.isdir(sub):  # a package (regular or namespace)
            d = sub
            continue
        return os.path.join(d, "__init__.py"), parts[i:]
    return os.path.join(d, "__init__.py"), []


@functools.cache
def _parsed(path: str) -> ast.Module:
    """The syntax tree of an installed module's source, parsed once per process (18 hook targets live in 10 files)."""
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def _defined_in_source(target: str) -> str | None:
    """Check that `target` (package.module[.Class].attr) is defined, by reading the module's source, without
    importing it (the plugin is loaded in every SGLang process; importing the scheduler or the attention backend
    there would cost seconds). Returns a reason when it is not, else None."""
    path, rest = _module_file(target.split("."))
    if path is None or not os.path.isfile(path):
        return f"no module file for {target}"
    if not rest:
        return f"{target} names a module, not an attribute"
    try:
        tree = _parsed(path)
    except (OSError, SyntaxError) as exc:
        return f"cannot read {path}: {exc}"
    body = tree.body
    for i, name in enumerate(rest):
        found = None
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found = node
        if found is None:
            return f"{name} is not defined in {'.'.join(rest[:i]) or 'the module'} ({path})"
        body = found.body
    return None


def check_targets(specs, version: str | None = None) -> list[str]:
    """One problem line for every hook target that is not defined (checked in the source, nothing imported)."""
    version = installed_sglang_version() if version is None else version
    problems = []
    for spec in specs:
        reason = _defined_in_source(spec.target)
        if reason is not None:
            problems.append(f"hook target {spec.target} is missing in SGLang {version}: {reason}")
    return problems


def _unwrap_chain(obj):
    fn = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    seen = []
    while fn is not None and len(seen) < 32:
        seen.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return seen


def hook_is_applied(spec: HookSpec) -> bool:
    """True when the attribute at `spec.target` is SGLang's wrapper around our hook (found through __wrapped__)."""
    try:
        current = resolve_target(spec.target)
    except Exception:
        return False
    chain = _unwrap_chain(current)
    if len(chain) < 2:
        return False
    # HookRegistry's wrappers close over the hook; a REPLACE of a class would be the class itself (not used here).
    for fn in chain[:-1]:
        cells = getattr(fn, "__closure__", None) or ()
        for cell in cells:
            try:
                if cell.cell_contents is spec.hook:
                    return True
            except ValueError:  # empty cell
                continue
    return False


class EnvironmentReport:
    """The outcome of the load-time checks, kept for the lifetime of the process."""

    def __init__(self, version: str | None, problems: list[str]):
        self.version = version
        self.problems = problems

    @property
    def ok(self) -> bool:
        return not self.problems

    def refusal(self) -> str:
        lines = "\n  ".join(self.problems)
        return f"--enable-ess cannot be used with this installation:\n  {lines}"


_REPORT: EnvironmentReport | None = None


def set_report(report: EnvironmentReport) -> None:
    global _REPORT
    _REPORT = report


def get_report() -> EnvironmentReport | None:
    return _REPORT


def verify_applied(specs, *, log: bool = True) -> None:
    """Raise EssUnavailableError unless every hook wraps its target; log one line per applied hook."""
    report = get_report()
    if report is not None and not report.ok:
        raise EssUnavailableError(report.refusal())
    version = installed_sglang_version()
    missing = [s for s in specs if not hook_is_applied(s)]
    if missing:
        names = ", ".join(s.target for s in missing)
        raise EssUnavailableError(
            f"--enable-ess cannot be used: the ESS hook(s) on {names} did not apply in SGLang {version} (SGLang logs "
            f"the reason as 'Failed to apply hooks to ...'; is SGLANG_PLUGINS excluding 'ess'?)")
    if log:
        for s in specs:
            logger.info("ESS hook applied: %s %s (%s)", s.kind, s.target, s.purpose)
