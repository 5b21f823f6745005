"""The GPU acceptance tests (`make gpu-check`): collected everywhere, run on a CUDA machine only;
elsewhere each skips with the reason "needs CUDA", so CI's summary counts them."""

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "distributed"))  # the process harness
sys.path.insert(0, str(HERE.parent / "training"))  # its training workers


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
