"""The documents and recorded measurements agree with the code: the README's test command is what CI runs, the
packaging pins what the code needs, a docstring states the behaviour a test checks, a recorded table supports
a design choice.  Text checks, kept apart from the behaviour tests (``-m docs`` selects them)."""

import json
import re
from pathlib import Path

import pytest

import fp4gemv

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_commands():
    """.ci/run reads the commands it runs from the README's "Set up and run" section (the indented lines that
    install torch): exactly the task check and the test run, so what a new user types is what CI runs."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Set up and run"):readme.index("\n## ", readme.index("## Set up and run") + 1)]
    commands = [line.strip() for line in section.splitlines() if line.startswith("    python -m pip install torch==")]
    assert len(commands) == 2, commands
    assert commands[0].endswith("fp4gemv task test") and commands[1].endswith("python -m pytest -q"), commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert "grep -E '^    python -m pip install torch=='" in ci and "README.md" in ci


def test_pyproject_declares_numpy_and_the_supported_triton():
    """numpy: torch's CPU wheel warns "Failed to initialize NumPy" without it, and Triton's interpreter needs it
    (tests/test_readme.py imports fp4gemv without warnings)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"numpy<2.4"' in pyproject and '"triton>=3.6,<3.10' in pyproject


def test_quantize_documents_nvfp4_saturation():
    """What tests/test_newcomer.py's test_nvfp4_without_a_global_scale_saturates_as_documented checks."""
    assert "2688" in fp4gemv.quantize.__doc__ and "saturat" in fp4gemv.quantize.__doc__


def test_the_bench_reads_are_within_6_percent_of_the_fastest_measured_read():
    """fp4gemv bench reports kernels against the faster of its Triton reads; the stream-ceiling table measured
    every read (Triton and CUDA C++) on the bench's shapes: on each, the faster Triton read was within 6% of the
    fastest read of all, so the baseline is (nearly) the best read there is."""
    from fp4gemv.bench.stream import TRITON_READS

    table = json.loads((ROOT / "docs" / "stream-ceiling-h200.json").read_text())
    assert len(table["rows"]) >= 7
    for row in table["rows"]:
        us = row["us"]
        assert set(TRITON_READS) <= set(us) and len(us) > len(TRITON_READS), row["shape"]
        triton_best = min(us[name] for name in TRITON_READS)
        assert triton_best <= 1.06 * min(us.values()), (row["shape"], triton_best, min(us.values()))


def test_the_readme_layout_names_every_benchmark_and_document():
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    files = [p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh")]
    files += [p.name for p in (ROOT / "docs").glob("*.md")]
    missing = [name for name in sorted(files) if name not in layout]
    assert not missing, f"README.md's Layout does not name {missing}"
