"""Glue to ``ess_sglang.metrics``: the ESS Prometheus series in the scheduler process.

SGLang serves ``/metrics`` (with ``--enable-metrics``) from prometheus_client's multiprocess registry; a Counter or
Gauge created in the scheduler process appears there beside SGLang's own ``sglang:*`` series. The coordinator
creates one ``EssMetrics`` per scheduler process, labelled like SGLang's scheduler series
(``scheduler.metrics_collector.labels``), and calls ``on_step()`` once per decode step from its
``_publish_metrics`` call site (host side, outside the CUDA graph).
"""

from __future__ import annotations

from typing import Any


def scheduler_labels(scheduler: Any) -> dict[str, str] | None:
    collector = getattr(scheduler, "metrics_collector", None)
    labels = getattr(collector, "labels", None)
    return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else None


def make_exporter(manager: Any, config: Any, labels: dict[str, str] | None) -> Any:
    """An EssMetrics publishing `manager`'s counters, or None when metrics are off."""
    if not config.metrics.enabled:
        return None
    from ess_sglang.metrics import EssMetrics  # prometheus_client: imported only where metrics are on

    kwargs = {"labels": labels} if labels else {}
    return EssMetrics(manager, config.metrics, **kwargs)
