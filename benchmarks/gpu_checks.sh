#!/usr/bin/env bash
# The GPU side of the test suite and the GPU correctness scripts, in one device call (GPU machine, repo root):
#   bash benchmarks/gpu_checks.sh OUT_DIR [pytest -k expression]
# Every `gpu`-marked test (the 15 slowest listed), the task check on full-range inputs and the 16-warp hmma
# diagnosis, side by side.  Logs and times in OUT_DIR; the exit status is 1 when any of the three failed.
#
# The tests' time is Triton compiling kernel variants (ptxas and LLVM, one CPU core each; a profile on the H200
# machine: 46 s of 77 s compiling, 4 s the oracle), so they run in GPU_TEST_WORKERS pytest-xdist
# processes on its 16 cores (default: one per 16 GiB of GPU memory, at most 8), sharing Triton's on-disk cache;
# without pytest-xdist they run in one process.
set -uo pipefail
out=${1:?usage: gpu_checks.sh OUT_DIR [-k expression]}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

# Runs "$@" with its output in $out/$log, then appends its exit status and time there.
logged() {
    local log=$1 began
    shift
    began=$(date +%s)
    "$@" >"$out/$log" 2>&1
    local rc=$?
    echo "exit $rc after $(( $(date +%s) - began )) s" >>"$out/$log"
    return $rc
}

logged task_test.log python -m fp4gemv task test --full-range &
task_pid=$!
logged hmma_warps.log python benchmarks/hmma_warps_check.py &
warps_pid=$!

# Default workers: one per 16 GiB of GPU memory, at most 8 (the largest tests take up to 16.5 GiB each; 8 workers
# ran out of memory on an H100's 79 GiB, docs/performance.md round 20).
gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
default_workers=$(( ${gib:-131072} / 16384 ))
(( default_workers > 8 )) && default_workers=8
(( default_workers < 1 )) && default_workers=1
if python -c "import xdist" 2>/dev/null; then
    workers=(-n "${GPU_TEST_WORKERS:-$default_workers}")
else
    echo "pytest-xdist is not installed: the GPU tests run in one process (pip install pytest-xdist to spread them)"
    workers=()
fi
logged gpu_tests.log python -m pytest -q -m gpu -p no:cacheprovider --durations=15 ${workers[@]+"${workers[@]}"} \
    ${2:+-k "$2"} tests
tests_rc=$?
tail -40 "$out/gpu_tests.log"

wait $task_pid
task_rc=$?
wait $warps_pid
warps_rc=$?
echo "--- task test --full-range"
tail -4 "$out/task_test.log"
echo "--- hmma 16-warp diagnosis"
tail -9 "$out/hmma_warps.log"
echo "--- gpu tests exit $tests_rc, task test exit $task_rc, hmma diagnosis exit $warps_rc;" \
     "total $(( $(date +%s) - start )) s"
(( tests_rc == 0 && task_rc == 0 && warps_rc == 0 ))
