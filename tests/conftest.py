"""Shared pytest setup: the ``gpu`` marker, and Triton's interpreter on machines without a GPU."""

import os

import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()

# Without a GPU, Triton kernels can only run in its interpreter, on CPU tensors.  Triton reads this when a
# kernel is decorated, so it must be set before any test module imports the kernels; a value already in
# the environment wins.
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped when torch.cuda.is_available() is False")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
