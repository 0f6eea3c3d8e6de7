"""Test set-up: Triton kernels run in Triton's CPU interpreter when no GPU is present.

TRITON_INTERPRET is read when a kernel is defined, so it is set here, before any test imports the kernels.
GPU tests (marked `gpu`) are skipped without CUDA; run them on the GPU with `pytest -m gpu`.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
