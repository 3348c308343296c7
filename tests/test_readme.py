"""The README as a newcomer meets it: its API tour runs as written, and CI runs its test command."""

import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_api_tour_runs_as_written():
    tour = re.search(r"## API tour.*?```python\n(.*?)```", _readme(), re.S).group(1)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", tour], capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "True all 1024 outputs within" in done.stdout, done.stdout


def test_ci_runs_the_readme_test_command():
    command = re.search(r"Run the tests.*?\n\n    (.*?)\n", _readme(), re.S).group(1)
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert command in f.read()
