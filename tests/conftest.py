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


@pytest.fixture
def compile_for_sm90():
    """Run a Python script that compiles kernels ahead of time for sm_90 (Triton's bundled ptxas, no GPU).

    A fresh interpreter without TRITON_INTERPRET (which changes what @triton.jit makes); returns its stdout,
    fails the test with its stderr, skips when this Triton has no ptxas.
    """
    import subprocess
    import sys

    import triton

    def run(script: str) -> str:
        if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
            pytest.skip("Triton's bundled ptxas is missing")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        src = os.path.join(os.path.dirname(__file__), "..", "src")
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    return run
