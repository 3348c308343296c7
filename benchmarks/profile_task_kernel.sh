#!/usr/bin/env bash
# Nsight Compute on the task kernel's variants and the read of the same bytes (benchmarks/profile_task_kernel.py),
# one device call from the repository root on the GPU machine:
#   PYTHONPATH=src bash benchmarks/profile_task_kernel.sh [--shapes 0,5,1] [--variants shipped,ahead,async3,persist3]
# Writes to $OUT: task_kernel.ncu-rep (the report: open in ncu-ui for source-level stall sampling), raw.csv (every
# metric collected), source.csv (per-SASS-instruction metrics and warp-state samples), launches.json, summary.md.
set -uo pipefail
out=${OUT:?set OUT}
ncu --clock-control none --profile-from-start off -k 'regex:w4a4|stream_read|read_kernel' \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
    --section InstructionStats --section SourceCounters \
    -f -o "$out/task_kernel" python benchmarks/profile_task_kernel.py --launches "$out/launches.json" "$@"
ncu --import "$out/task_kernel.ncu-rep" --csv --page raw > "$out/raw.csv"
ncu --import "$out/task_kernel.ncu-rep" --csv --page source --print-source sass > "$out/source.csv"
python benchmarks/profile_task_kernel.py --summarize "$out/task_kernel.ncu-rep" --launches "$out/launches.json" \
    > "$out/summary.md" || python benchmarks/profile_task_kernel.py --summarize "$out/raw.csv" \
    --launches "$out/launches.json" > "$out/summary.md"
cat "$out/summary.md"
ls -la "$out"
