"""The README as a newcomer meets it: its API tour runs as written, and CI runs its test command."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _run_block(heading: str, cwd) -> str:
    """Run the first python block under README heading ``heading`` (a regex) in a fresh interpreter from ``cwd``,
    this checkout's src/ first on the path and TRITON_INTERPRET unset; its stdout, or the test fails."""
    block = re.search(heading + r".*?```python\n(.*?)```", _readme(), re.S).group(1)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=600, env=env,
                          cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_api_tour_runs_as_written():
    stdout = _run_block("## API tour", ROOT)
    assert "True all 1024 outputs within" in stdout, stdout


def test_nn_block_runs_as_written(tmp_path):
    pytest.importorskip("transformers")
    stdout = _run_block("## FP4 models: `fp4gemv.nn`", tmp_path)
    assert re.search(r"tensor\(\[\[\s*1,\s*2,\s*3(,\s*\d+){4}\]\]\)", stdout), stdout


def test_ci_runs_the_readme_test_command():
    command = re.search(r"Run the tests.*?\n\n    (.*?)\n", _readme(), re.S).group(1)
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert command in f.read()


def test_the_installed_package_imports_without_warnings():
    """numpy is a dependency (torch's CPU wheel warns "Failed to initialize NumPy" without it, and Triton's
    interpreter needs it): importing fp4gemv in a fresh interpreter prints nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "src")
    done = subprocess.run([sys.executable, "-W", "default", "-c", "import fp4gemv, fp4gemv.cli"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        pyproject = f.read()
    assert '"numpy<2.4"' in pyproject and '"triton>=3.6,<3.10' in pyproject


def test_bench_options_have_help_text():
    from fp4gemv import cli

    bench = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("bench"))
    for action in bench._actions:
        if action.dest != "help":
            assert action.help, action.dest
