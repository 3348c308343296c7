#!/usr/bin/env bash
# Every `fp4gemv bench` case of docs/performance.md's current tables, one after the other (GPU machine, repo root):
#   PYTHONPATH=src bash benchmarks/bench_all.sh OUT_DIR
# Each case writes OUT_DIR/<case>/bench.json and bench.png and prints its table; the baselines' torch.compile
# is skipped (--no-compile) to keep the run short.
set -euo pipefail
out=${1:?usage: bench_all.sh OUT_DIR}
run() { local name=$1; shift; echo "== $name: fp4gemv bench $*"; python -m fp4gemv bench --no-compile --out "$out/$name" "$@"; }
run w4a4 --shapes all
run fp16 --shapes all --act fp16
run bf16 --shapes task --act bf16
run fp4-n --shapes task --n 2,4,8,16
run fp16-n16 --shapes task --act fp16 --n 16
run mxfp4 --shapes task --format mxfp4
