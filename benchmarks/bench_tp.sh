#!/usr/bin/env bash
# benchmarks/tp_layers.py --tp N: tensor-parallel 28672x8192 (column) and 8192x28672 (row) decode layers on N GPUs of one
# machine against one GPU, activations bf16 then fp16, N = 1 and 8 tokens; one process per GPU (torchrun).
# NVLink multicast stays off (NCCL's NVLS, torch symmetric memory's multimem); tp_layers.py sets the same.
#
#   PYTHONPATH=src bash benchmarks/bench_tp.sh N OUT [more tp_layers.py options, e.g. --format mxfp4]
set -euo pipefail
N=${1:?usage: bench_tp.sh N OUT [options]}
OUT=${2:?usage: bench_tp.sh N OUT [options]}
shift 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p "$OUT"
for act in bf16 fp16; do
    python -m torch.distributed.run --standalone --nproc-per-node "$N" "$(dirname "$0")/tp_layers.py" --tp "$N" --act "$act" \
        --out "$OUT/tp$N-$act" "$@" 2>&1 | tee "$OUT/tp$N-$act.txt"
done
