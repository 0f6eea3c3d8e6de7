"""Where the ESS launch settings live, and how every SGLang process finds them.

``ServerArgs`` is a msgspec Struct built at import (``dict=True``): a new field cannot be added, but attributes
whose names start with ``_`` and are not fields are "bookkeeping" that SGLang allows to be set at any time and that
``ServerArgs.__reduce__`` carries through pickling (the launcher hands the record to its spawned scheduler
processes by pickling it). ESS keeps its settings there:

    server_args._ess_enabled      bool
    server_args._ess_config_path  str | None   (the --ess-config path, as given)
    server_args._ess_config       dict         (the validated EssConfig, as a plain mapping)
    server_args._ess_send_windows bool         (a PD prefill instance with --enable-ess: it only sends the query
                                                windows' top-k sets to the decode instance; ESS itself is off there)

A process reads them from the record it was handed (``ModelRunner.server_args``, ``Scheduler.server_args``) or
from the runtime context's published record; ``current()`` caches the answer for the process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ess_sglang.config import EssConfig

ENABLED_ATTR = "_ess_enabled"
PATH_ATTR = "_ess_config_path"
CONFIG_ATTR = "_ess_config"
SEND_WINDOWS_ATTR = "_ess_send_windows"


@dataclass(frozen=True)
class EssSettings:
    enabled: bool
    """ESS serves this instance (PD decode or colocated): pools, coordinator, admission."""
    config: EssConfig
    config_path: str | None = None
    send_windows: bool = False
    """PD prefill instance with --enable-ess: capture the query windows' top-k sets and send them with the KV."""

    @classmethod
    def disabled(cls) -> EssSettings:
        return cls(False, EssConfig())


def store(server_args: Any, settings: EssSettings) -> None:
    """Put the settings on a ServerArgs record (bookkeeping attributes; allowed before and after resolution)."""
    setattr(server_args, ENABLED_ATTR, bool(settings.enabled))
    setattr(server_args, PATH_ATTR, settings.config_path)
    setattr(server_args, CONFIG_ATTR, settings.config.model_dump(mode="json"))
    setattr(server_args, SEND_WINDOWS_ATTR, bool(settings.send_windows))


def read(server_args: Any) -> EssSettings:
    """The settings stored on a record (or on a view of one); disabled when none are stored."""
    if server_args is None:
        return EssSettings.disabled()
    enabled = bool(getattr(server_args, ENABLED_ATTR, False))
    send = bool(getattr(server_args, SEND_WINDOWS_ATTR, False))
    if not enabled and not send:
        return EssSettings.disabled()
    data = getattr(server_args, CONFIG_ATTR, None) or {}
    return EssSettings(enabled, EssConfig.from_mapping(data), getattr(server_args, PATH_ATTR, None), send)


_CURRENT: EssSettings | None = None


def current(server_args: Any = None) -> EssSettings:
    """This process's settings: from `server_args` when given (and remembered), else the published record."""
    global _CURRENT
    if server_args is not None:
        _CURRENT = read(server_args)
        return _CURRENT
    if _CURRENT is not None:
        return _CURRENT
    try:
        from sglang.srt.runtime_context import get_server_args

        record = get_server_args()
    except Exception:  # nothing published in this process (the launcher before resolution, the tokenizer, tests)
        return EssSettings.disabled()
    if record is None:
        return EssSettings.disabled()
    _CURRENT = read(record)
    return _CURRENT


def reset() -> None:
    """Forget the cached settings (tests)."""
    global _CURRENT
    _CURRENT = None
