#!/usr/bin/env bash
# The GPU side of the test suite and the GPU correctness scripts, in one device call (GPU machine, repo root):
#   PYTHONPATH=src bash benchmarks/gpu_checks.sh OUT_DIR [pytest -k expression]
# Every `gpu`-marked test (the slowest ones listed), then the task check on full-range inputs and the 16-warp
# hmma check.  Logs in OUT_DIR.
set -uo pipefail
out=${1:?usage: gpu_checks.sh OUT_DIR [-k expression]}
mkdir -p "$out"
start=$(date +%s)
python -m pytest -q -m gpu -p no:cacheprovider --durations=12 ${2:+-k "$2"} tests 2>&1 | tee "$out/gpu_tests.log" | tail -40
echo "gpu tests: $(( $(date +%s) - start )) s"
python -m fp4gemv task test --full-range 2>&1 | tee "$out/task_test.log" | tail -3
python benchmarks/hmma_warps_check.py 2>&1 | tee "$out/hmma_warps.log" | tail -8
