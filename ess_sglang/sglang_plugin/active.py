"""What ESS runs in this process: its coordinator (one per scheduler process) and, on a PD prefill instance, the
sender of each prompt's window sets. Set where they are built, read by the hooks that serve SGLang's calls; a module of
its own so that those hooks need not import the modules that build them."""

from __future__ import annotations

import weakref
from typing import Any

_COORDINATOR: weakref.ref | None = None
_SENDER: Any = None


def active_coordinator() -> Any:
    """The ESS coordinator of this process (a ``coordinator.EssCoordinator``), or None when ESS is off here."""
    return _COORDINATOR() if _COORDINATOR is not None else None


def set_active(coord: Any) -> None:
    global _COORDINATOR
    _COORDINATOR = weakref.ref(coord) if coord is not None else None


def active_sender() -> Any:
    """The PD prefill instance's window-set sender (a ``pd_windows.WindowSender``), or None."""
    return _SENDER


def set_sender(sender: Any) -> None:
    global _SENDER
    _SENDER = sender
