"""Device script for Nsight Compute: the task kernel's variants next to a read of the same bytes, one launch each,
on a few representative shapes; then a summary of what each launch waits on.

One device call (about 1-3 minutes), from the repository root, with the exact ncu command lines in
``benchmarks/profile_task_kernel.sh``:

    PYTHONPATH=src bash benchmarks/profile_task_kernel.sh [--shapes 0,5,1] [--variants shipped,ahead,async3,persist3]

which runs, under ``ncu --clock-control none --profile-from-start off -k 'regex:w4a4|stream_read|read_kernel'`` with
the SpeedOfLight, MemoryWorkloadAnalysis, ComputeWorkloadAnalysis, Occupancy, LaunchStats, SchedulerStats,
WarpStateStats, InstructionStats and SourceCounters sections, ``python benchmarks/profile_task_kernel.py``; then
exports the raw metrics and the per-SASS-instruction source view (warp-state samples per instruction) as CSV and
prints ``--summarize``'s table.  Files in $OUT: task_kernel.ncu-rep, raw.csv, source.csv, launches.json,
summary.md.

Shapes (default ``0,5,1``): 7168x16384x1 (L = 1, long K, 0.75 of the best read), 4096x14336x1 (the farthest,
0.66), 4096x7168x8 (many rows, 0.87).  Variants (default ``shipped,ahead,async3,persist3``, from
``benchmarks/task_kernel_variants.py``) and the Triton stream read of the same bytes with PDL (ncu serializes
kernels, so PDL's overlap does not show).  ``--cuda-read`` adds the CUDA C++ reads of
``benchmarks/stream_ceiling.py`` that were best (32 KB chunks, persistent grid; an nvcc build of ~1 minute).

Per shape, every launch runs once outside the profiled range (compilation), then once inside
``cudaProfilerStart/Stop`` on random operands; only one shape's buffers are allocated at a time, since ncu saves
and restores device memory around each replay pass, and it flushes the caches before each pass, as the bench
does.  The launch order goes to ``--launches`` (JSON), which ``--summarize`` uses to name the kernels.

``--summarize`` prints, per launch: duration, DRAM throughput and bytes, issue activity, warp instructions executed
per weight byte, achieved and theoretical occupancy, registers, grid and waves, L1 / L2 throughput and L2 bytes,
and the warp stall reasons (cycles per issued instruction): long scoreboard (waiting on global memory), barrier,
short scoreboard (shared memory), wait, math / MIO / LG throttles, not selected, ...; the columns that name the
limiter.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPE_DEFAULT = "0,5,1"
VARIANT_DEFAULT = "shipped,ahead,async3,persist3"

# (label, metric names in ncu's raw page, the first present is used); missing metrics print as "-".
METRICS = [
    ("us", ["gpu__time_duration.sum"]),
    ("DRAM %", ["dram__throughput.avg.pct_of_peak_sustained_elapsed"]),
    ("DRAM MB", ["dram__bytes_read.sum"]),
    ("issue %", ["smsp__issue_active.avg.pct_of_peak_sustained_active",
                 "sm__inst_issued.avg.pct_of_peak_sustained_active"]),
    ("inst", ["smsp__inst_executed.sum", "sm__inst_executed.sum"]),
    ("occ %", ["sm__warps_active.avg.pct_of_peak_sustained_active"]),
    ("theo occ %", ["sm__maximum_warps_per_active_cycle_pct"]),
    ("regs", ["launch__registers_per_thread"]),
    ("smem/blk", ["launch__shared_mem_per_block_dynamic", "launch__shared_mem_per_block"]),
    ("grid", ["launch__grid_size"]),
    ("waves", ["launch__waves_per_multiprocessor"]),
    ("L1 %", ["l1tex__throughput.avg.pct_of_peak_sustained_active"]),
    ("L2 %", ["lts__throughput.avg.pct_of_peak_sustained_elapsed"]),
    ("L2 MB", ["lts__t_bytes.sum"]),
]
# Warp stall reasons, cycles per issued instruction (WarpStateStats): the columns found in the CSV under either
# naming, in this order first (long scoreboard: waiting on global memory; barrier; short scoreboard: shared
# memory), then any others.
STALL_PATTERNS = [r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio",
                  r"smsp__average_warp_latency_issue_stalled_(\w+?)\.ratio"]
STALL_ORDER = ["long_scoreboard", "barrier", "short_scoreboard", "wait", "math_pipe_throttle", "mio_throttle",
               "lg_throttle", "not_selected", "selected", "no_instruction", "branch_resolving", "dispatch_stall"]


def run(opts):
    """Per shape: allocate its operands, launch every variant once outside the profiled range (compilation), then
    once each inside it; free everything before the next shape (ncu saves and restores all allocated device
    memory around each replay pass, so only one shape's buffers are alive at a time)."""
    import torch

    from fp4gemv import bench, ops
    from task_kernel_variants import SHAPES, variants

    shapes = [SHAPES[int(i)] for i in opts.shapes.split(",")]
    wanted = opts.variants.split(",")
    cuda_read = _cuda_read() if opts.cuda_read else None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    launches = []
    for shape in shapes:
        named = dict(variants(*shape))
        missing = [name for name in wanted if name not in named]
        if missing:
            raise SystemExit(f"--variants: {missing} not variants of {shape}: {sorted(named)}")
        x = bench.random_task_operands(*shape, seed=0)
        nbytes = bench.task_bytes(*shape)
        buf = torch.empty(nbytes // 16 * 16, dtype=torch.uint8, device="cuda").random_(0, 255)
        out = torch.empty(bench.stream_read_programs(nbytes) + (1 << 20), dtype=torch.int64, device="cuda")
        plan = [(name, lambda cfg=named[name]: ops.task_gemv(*x, config=cfg)) for name in wanted]
        plan.append(("read pdl", lambda: bench.stream_read(buf, out, pdl=True)))
        if cuda_read is not None:
            n16 = nbytes // 16
            plan.append(("cuda chunk32K pdl",
                         lambda: cuda_read.stream_read_cuda(buf, out, -(-n16 // 2048), 256, 2048, 8, False, True)))
            plan.append(("cuda persist pdl",
                         lambda: cuda_read.stream_read_cuda(buf, out, 4 * sms, 512, 0, 4, False, True)))
        for _, launch in plan:  # compile and load outside the profiled range
            launch()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for name, launch in plan:
            launch()
            torch.cuda.synchronize()
            launches.append({"id": len(launches), "shape": list(shape), "variant": name})
            print(launches[-1]["id"], shape, name, flush=True)
        torch.cuda.cudart().cudaProfilerStop()
        del x, buf, out, plan
        torch.cuda.empty_cache()
    with open(opts.launches, "w") as f:
        json.dump(launches, f, indent=1)


def _cuda_read():
    from torch.utils.cpp_extension import load_inline

    from stream_ceiling import CUDA, DECLARATION

    return load_inline("fp4gemv_stream_ceiling", cpp_sources=DECLARATION, cuda_sources=CUDA,
                       functions=["stream_read_cuda"],
                       extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"], verbose=False)


def _metrics_from_report(path):
    """[(kernel name, {metric: value in base units})] of an .ncu-rep, through ncu's own Python module."""
    import shutil

    ncu = shutil.which("ncu")
    if ncu is None:
        raise SystemExit("--summarize of an .ncu-rep needs ncu on PATH (its extras/python/ncu_report)")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.realpath(ncu)), "extras", "python"))
    import ncu_report

    out = []
    context = ncu_report.load_report(path)
    for r in range(context.num_ranges()):
        profiled = context.range_by_idx(r)
        for a in range(profiled.num_actions()):
            action = profiled.action_by_idx(a)
            values = {}
            for name in action.metric_names():
                metric = action.metric_by_name(name)
                try:
                    values[name] = metric.as_double()
                except Exception:  # strings and instanced metrics: not needed here
                    continue
            out.append((action.name(), values))
    return out


def _metrics_from_csv(path):
    """The same from ncu's ``--csv --page raw`` output (header, optional units row, one row per kernel); times
    converted to ns and byte counts to bytes."""
    with open(path, newline="") as f:
        rows = [row for row in csv.reader(f) if row]
    header = rows[0]
    has_units = len(rows) > 1 and rows[1] and rows[1][header.index("ID") if "ID" in header else 0] == ""
    units = rows[1] if has_units else [""] * len(header)
    scale = {"usecond": 1e3, "msecond": 1e6, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}
    out = []
    for row in rows[2 if has_units else 1:]:
        values = {}
        for i, name in enumerate(header):
            try:
                values[name] = float(row[i].replace(",", "")) * scale.get(units[i], 1.0)
            except (ValueError, IndexError):
                continue
        kernel = row[header.index("Kernel Name")] if "Kernel Name" in header else "?"
        out.append((kernel, values))
    return out


def summarize(opts):
    """A markdown table from the report (``.ncu-rep``, read with ncu's Python module) or its raw CSV, named by
    the launch order ``run`` wrote."""
    import re

    kernels = (_metrics_from_report if opts.summarize.endswith(".ncu-rep") else _metrics_from_csv)(opts.summarize)
    launches = json.load(open(opts.launches))
    if len(kernels) != len(launches):
        print(f"note: {len(kernels)} profiled kernels, {len(launches)} launches planned; matched in order\n")
    names = set().union(*(values for _, values in kernels)) if kernels else set()
    stalls = {}
    for pattern in STALL_PATTERNS:
        for name in sorted(names):
            found = re.fullmatch(pattern, name)
            if found and found.group(1) not in stalls:
                stalls[found.group(1)] = name
    reasons = [r for r in STALL_ORDER if r in stalls] + sorted(r for r in stalls if r not in STALL_ORDER)

    def value(values, candidates):
        return next((values[n] for n in candidates if n in values), None)

    def fmt(v, digits=1):
        return "-" if v is None else f"{v:.{digits}f}"

    print("| # | shape | launch | kernel | " + " | ".join(label for label, _ in METRICS) + " | inst/B | "
          + " | ".join(reasons) + " |")
    print("|---|---|---|---|" + "---|" * (len(METRICS) + 1 + len(reasons)))
    for (kernel, values), launch in zip(kernels, launches):
        m, k, l = launch["shape"]
        cells = []
        for label, candidates in METRICS:
            v = value(values, candidates)
            if v is not None and label == "us":
                v *= 1e-3  # ns
            elif v is not None and label.endswith("MB"):
                v *= 1e-6  # bytes
            cells.append(fmt(v, 2 if label == "us" else 1))
        inst = value(values, dict(METRICS)["inst"])
        is_gemv = not launch["variant"].startswith(("read", "cuda"))
        per_byte = inst / (l * m * k / 2) if inst is not None and is_gemv else None
        cells_stall = [fmt(values.get(stalls[r]), 2) for r in reasons]
        print(f"| {launch['id']} | {m}x{k}x{l} | {launch['variant']} | {kernel[:24]} | " + " | ".join(cells)
              + f" | {fmt(per_byte, 3)} | " + " | ".join(cells_stall) + " |")
    print("\ninst/B: warp instructions executed per weight byte.  Stall columns: cycles per issued instruction "
          f"({len(reasons)} reasons found).")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=SHAPE_DEFAULT, help="indices into task_kernel_variants.SHAPES")
    parser.add_argument("--variants", default=VARIANT_DEFAULT)
    parser.add_argument("--cuda-read", action="store_true", help="also the CUDA C++ reads (nvcc build)")
    parser.add_argument("--launches", default=os.path.join(os.environ.get("OUT", "."), "launches.json"))
    parser.add_argument("--summarize", default=None, metavar="REPORT",
                        help="summarize an .ncu-rep (or its --page raw CSV) instead of launching")
    opts = parser.parse_args()
    if opts.summarize:
        summarize(opts)
    else:
        run(opts)


if __name__ == "__main__":
    main()
