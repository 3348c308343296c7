#!/usr/bin/env bash
# Every `fp4gemv bench` case of docs/performance.md's current tables, one after the other (GPU machine, repo root):
#   PYTHONPATH=src bash benchmarks/bench_all.sh OUT_DIR
# Each case writes OUT_DIR/<case>/bench.json and prints its table (kernel, time, best read of the same bytes).
set -euo pipefail
out=${1:?usage: bench_all.sh OUT_DIR}
run() { local name=$1; shift; echo "== $name: fp4gemv bench $*"; python -m fp4gemv bench --out "$out/$name" "$@"; }
run w4a4 --shapes all
run fp16 --shapes all --act fp16
run bf16 --shapes all --act bf16 --n 1,4,8,16
run fp4-n --shapes task --n 2,4,8,16
run mxfp4 --shapes task --format mxfp4
run mxfp4-bf16 --shapes every --format mxfp4 --act bf16 --n 1,8,16
