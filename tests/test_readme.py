"""The README as a newcomer meets it: its code blocks run as written (the text's checks: tests/test_docs.py)."""

import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _run_block(fresh_python, heading: str, cwd) -> str:
    """Run the first python block under README heading ``heading`` (a regex) in a fresh interpreter from ``cwd``;
    its stdout, or the test fails."""
    block = re.search(heading + r".*?```python\n(.*?)```", _readme(), re.S).group(1)
    done = fresh_python(block, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_api_tour_runs_as_written(fresh_python):
    stdout = _run_block(fresh_python, "## API tour", ROOT)
    assert "True all 1024 outputs within" in stdout, stdout


def test_nn_block_runs_as_written(fresh_python, tmp_path):
    pytest.importorskip("transformers")
    stdout = _run_block(fresh_python, "## FP4 models: `fp4gemv.nn`", tmp_path)
    assert re.search(r"tensor\(\[\[\s*1,\s*2,\s*3(,\s*\d+){4}\]\]\)", stdout), stdout


def test_the_installed_package_imports_without_warnings(fresh_python):
    """numpy is a dependency (torch's CPU wheel warns "Failed to initialize NumPy" without it, and Triton's
    interpreter needs it): importing fp4gemv in a fresh interpreter prints nothing."""
    done = fresh_python("import fp4gemv, fp4gemv.cli", args=("-W", "default"), timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]


def test_bench_options_have_help_text():
    from fp4gemv import cli

    bench = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("bench"))
    for action in bench._actions:
        if action.dest != "help":
            assert action.help, action.dest
