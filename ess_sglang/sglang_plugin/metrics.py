"""Glue to ``ess_sglang.metrics``: the ESS Prometheus series in the scheduler process.

SGLang serves ``/metrics`` (with ``--enable-metrics``) from prometheus_client's multiprocess registry; a Counter or
Gauge created in the scheduler process appears there beside SGLang's own ``sglang:*`` series. The coordinator
creates one ``EssMetrics`` per scheduler process, labelled like SGLang's scheduler series
(``scheduler.metrics_collector.labels``), and calls ``on_step()`` once per decode step from its
``_publish_metrics`` call site (host side, outside the CUDA graph).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

logger = logging.getLogger("ess_sglang.sglang_plugin")


def metrics_module():
    """``ess_sglang.metrics`` when it exists (it is developed separately), else None."""
    try:
        return importlib.import_module("ess_sglang.metrics")
    except ImportError:
        return None


def scheduler_labels(scheduler: Any) -> dict[str, str] | None:
    collector = getattr(scheduler, "metrics_collector", None)
    labels = getattr(collector, "labels", None)
    return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else None


def make_exporter(manager: Any, config: Any, labels: dict[str, str] | None) -> Any:
    """An EssMetrics publishing `manager`'s counters, or None when metrics are off or the module is missing."""
    if not config.metrics.enabled:
        return None
    mod = metrics_module()
    if mod is None or not hasattr(mod, "EssMetrics"):
        logger.info("ESS: ess_sglang.metrics is not available; no sglang:ess_* series")
        return None
    kwargs = {"labels": labels} if labels else {}
    return mod.EssMetrics(manager, config.metrics, **kwargs)
