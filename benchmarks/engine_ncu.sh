#!/usr/bin/env bash
# ncu's view of the decode engine (issue 27, round 27 of docs/performance.md): one launch of NVFP4 x bf16, N = 16,
# on 7168 x 16384 per variant -- issue, pipes, warp stalls, shared-memory wavefronts and bank conflicts.  GPU
# machine, repo root:
#   bash benchmarks/engine_ncu.sh ["CONFIG LAYOUT [ORDER]" ...]    e.g. "default swizzled" "2,2,128 linear paired"
# CONFIG: ``default`` (the engine's own choice) or EngineConfig fields joined by commas; ORDER a code order of
# ``formats.CODE_ORDERS`` (default checkpoint).  FMT=mxfp4 for MXFP4; CONFIG ``wgmma`` (bias ``x`` by default,
# or ``wgmma:bias`` / ``wgmma:nobias``) runs the wgmma consumer prototype (``kernels/engine_wgmma.py``, MXFP4,
# linear scales) on the same shape.  Clocks as found.
set -u
export PYTHONPATH=$PWD/src
if [ $# -eq 0 ]; then set -- "default swizzled"; fi
cat > /tmp/one.py <<'PY'
import sys, torch
sys.path.insert(0, "tests")
import operands as O
from fp4gemv import gemv
import os
from fp4gemv.kernels.engine import EngineConfig
fmt = os.environ.get("FMT", "nvfp4")
a = O.random_fp4((7168, 16384), fmt, sys.argv[2], seed=1, device="cuda")
b = O.random_activation((16, 16384), torch.bfloat16, seed=2, device="cuda")
out = torch.empty((7168, 16), dtype=torch.float16, device="cuda")
if sys.argv[1].startswith("wgmma"):
    from fp4gemv import layouts
    from fp4gemv.kernels import engine_wgmma as W
    bias = {"x": "x", "bias": True, "nobias": False}[(sys.argv[1] + ":x").split(":")[1]]
    tiles = layouts.pack_mma_tiles(a.with_code_order("checkpoint").data)
    for _ in range(4):
        W.wgmma_gemv(tiles, a.scales[:7168], b, out, 7168, 16384, bias=bias)
else:
    cfg = None if sys.argv[1] == "default" else EngineConfig(*(int(v) for v in sys.argv[1].split(",")))
    a = a.with_code_order(sys.argv[3] if len(sys.argv) > 3 else "checkpoint")
    for _ in range(4):
        gemv(a, b, out=out, kernel="engine", config=cfg)
torch.cuda.synchronize()
PY
M="sm__cycles_elapsed.avg,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,\
smsp__warps_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active,\
sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,\
sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,\
sm__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_active,\
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,\
l1tex__throughput.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_misc_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,\
gpu__time_duration.sum,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,launch__registers_per_thread,sm__ctas_launched.sum"
# keep only metrics this ncu knows (base names from --query-metrics), so one unknown name does not stop the run
ncu --query-metrics > /tmp/known.txt 2>&1
M=$(python - "$M" <<'PY'
import sys
known = {line.split()[0] for line in open("/tmp/known.txt") if line.strip() and not line.startswith(("-", "Device", "Metric"))}
keep = [m for m in sys.argv[1].split(",") if m.rsplit(".", 2)[0] in known or m.split(".")[0] in known]
drop = [m for m in sys.argv[1].split(",") if m not in keep]
print("dropped:", drop, file=sys.stderr)
print(",".join(keep))
PY
)
echo "metrics: $(echo $M | tr ',' '\n' | wc -l)"
for v in "$@"; do
  echo "== $v"
  timeout 120 ncu --clock-control none --kernel-name regex:'engine|wgmma' --launch-skip 2 --launch-count 1 --metrics "$M" \
     python /tmp/one.py $v 2>&1 | grep -E "^\s+(sm__|smsp__|l1tex__|dram__|gpu__|launch__)" | sed -E 's/ +/ /g'
done
