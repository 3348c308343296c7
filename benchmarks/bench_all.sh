#!/usr/bin/env bash
# Every `fp4gemv bench` table of the README and docs/performance.md, one after the other (GPU machine, repo root):
#   PYTHONPATH=src bash benchmarks/bench_all.sh OUT_DIR
# Each case writes OUT_DIR/<case>/bench.json (or decode-MODEL.json) and prints its table: kernel chosen, device
# time, the best read of the same bytes and the fraction.
set -euo pipefail
out=${1:?usage: bench_all.sh OUT_DIR}
run() { local name=$1; shift; echo "== $name: fp4gemv bench $*"; python -m fp4gemv bench --out "$out/$name" "$@"; }
run host --host
run w4a4 --shapes all
run mxfp4 --shapes all --format mxfp4
run bf16-n1 --shapes every --act bf16 --n 1 --bf16
run bf16-n8 --shapes every --act bf16 --n 8
run mxfp4-bf16 --shapes every --format mxfp4 --act bf16 --n 1,8
run fp16 --shapes every --act fp16 --n 1,8
run fp4-n --shapes task --n 2,8,16
run models --model llama3-8b
run models --model llama3-70b
