"""tests/gpu: the CUDA paths, run by scripts/gpu-check on a GPU machine.

Every test here is skipped, with the reason in the summary, where CUDA is not available: the
CPU suite covers the same loops (LocalRing, tests/test_local_ring.py) and the CUDA kernel
adapter's calls (tests/test_kernels.py).
"""

from __future__ import annotations

import pytest
import torch

CUDA_SKIP = pytest.mark.skip(reason="CUDA is not available: tests/gpu needs a GPU")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/"):
            item.add_marker(CUDA_SKIP)
