"""A DeepSeek-V3.2-Exp decode simulator: capacity, throughput and bottlenecks, with and without ESS.

Modules, one job each:

    hardware.py     the node description (HBM, tensor-core rates, NVLink / NIC, PCIe, host memory) from YAML
    scenario.py     scenario files: cluster, serving setup (context, MTP, TBO), ESS, batches, reference numbers
    model.py        the decode-step cost model: per-layer rooflines and fixed kernel costs, EP network, TBO, MTP,
                    ESS exposure
    capacity.py     HBM -> largest batch without ESS; hot-pool ratio at a batch; host-memory bound with ESS
    traffic.py      ESS misses per layer (profile or miss model) -> PCIe bytes
    calibration.py  the two fitted efficiencies (compute, fp8 weight streaming), what they were fitted on, and the
                    small-kernel counts of a decode step
    simulate.py     runs a scenario: table rows, sweep, comparison with the reference; the efficiencies' fit
    validate.py     predicts the decode steps measured in a real SGLang server (``ess simulate --validate``)
    report.py       table (rich / plain) and plot
    cli.py          ``ess simulate``

Equations and assumptions: docs/simulator.md (and the docstrings of model.py, capacity.py, traffic.py).
Nothing here imports torch.
"""

from ess_sglang.simulator.calibration import KERNEL_EFFICIENCY
from ess_sglang.simulator.model import INDEXER_ENTRY_BYTES, LATENT_ENTRY_BYTES

__all__ = ["KERNEL_EFFICIENCY", "INDEXER_ENTRY_BYTES", "LATENT_ENTRY_BYTES"]
