"""The one fitted constant of the simulator, and how it was fitted.

``KERNEL_EFFICIENCY`` (eta) is the share of the roofline that every GPU kernel reaches: a kernel takes
``max(flops / (peak x eta), bytes / (hbm_bw x eta))``. Network (DeepEP's measured rates and latency) and
PCIe (measured fetch rates) are not scaled by it. It is fitted once, on the baseline row of the ESS paper's
table (batch 52, pool ratio 1.0, 23.19 tokens/s per request, configs/scenarios/paper-32k.yaml), by bisection
on the per-request rate, which falls monotonically as eta falls. Every scenario uses it unchanged.

Cross-check, not used in the fit: FlashMLA sparse decode measured on the project's H200 (the design brief's figures,
docs/design.md) takes 95 us at 64 and 181 us at 128 query tokens per layer, i.e. 0.39-0.41 of the bf16 peak
(570 MFLOP per token); the fitted eta is a little lower because it also absorbs launch gaps and the small-M GEMMs
of decode.

The issue allows two constants; one suffices (tests/test_simulator.py pins the paper's five rows within 10%).
"""

from __future__ import annotations

KERNEL_EFFICIENCY = 0.3244
"""Fitted by ``simulate.fit_kernel_efficiency(load_scenario("configs/scenarios/paper-32k.yaml"))``, rounded to 4
digits (the fit lives beside the simulator it runs, so that this module imports nothing)."""

FIT_BATCH = 52
FIT_PER_REQUEST = 23.19  # tokens/s, ESS paper, batch 52, ratio 1.0 (baseline, no ESS)
