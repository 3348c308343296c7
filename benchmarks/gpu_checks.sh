#!/usr/bin/env bash
# The GPU side of the test suite and the GPU correctness scripts, in one device call (GPU machine, repo root):
#   PYTHONPATH=src bash benchmarks/gpu_checks.sh OUT_DIR [pytest -k expression]
# The `gpu`-marked tests of the op layer, the task, FP4Linear, the quantizer and every kernel, then the task
# check on full-range inputs.  Logs in OUT_DIR.
set -uo pipefail
out=${1:?usage: gpu_checks.sh OUT_DIR [-k expression]}
mkdir -p "$out"
python -m pytest -q -m gpu -p no:cacheprovider ${2:+-k "$2"} tests/test_ops.py tests/test_task.py tests/test_nn_linear.py \
    tests/test_quantize.py tests/test_kernels_weight_only.py tests/test_kernels_w4a4.py tests/test_kernels_hmma.py \
    tests/test_kernels_general.py tests/test_kernels_gemm.py 2>&1 | tee "$out/gpu_tests.log" | tail -25
python -m fp4gemv task test --full-range 2>&1 | tee "$out/task_test.log" | tail -3
