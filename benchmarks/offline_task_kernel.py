"""CPU script (no GPU): every variant of the task kernel compiled for sm_90 as the JIT specializes it on the
issue's shapes, and what its machine code says about the memory system.

    PYTHONPATH=src python benchmarks/offline_task_kernel.py [--fmt nvfp4,mxfp4] [--json FILE]

Variants: ``benchmarks/task_kernel_variants.py``.  The launch arguments are recorded from ``ops.task_gemv``
(NVFP4, the task layout) or ``fp4gemv.gemv`` (MXFP4, swizzled scales) on CPU operands, specialized with
Triton's own rules (``jit_specialization`` from tests/conftest.py) and compiled with Triton's bundled ptxas;
the SASS comes from its cuobjdump.  Per variant and shape:

* ``regs``, ``smem`` (dynamic shared bytes), ``spill`` (local-memory instructions in the SASS);
* ``loop``: SASS instructions of the main loop (the longest backward branch; for the persistent variant that
  body also holds the per-tile set-up and epilogue, behind branches), ``path``: the shortest path through it
  (every forward branch inside taken: a step that neither starts nor ends a tile), ``B/thr``: weight bytes one
  thread consumes per loop iteration, ``ins/B``: ``path`` per weight byte per thread;
* ``ld16``: 16-byte weight and activation loads (``LDG.E.128``, or ``LDGSTS`` copies) per thread and iteration;
* ``res``: programs resident per SM (registers: 64 K per SM in 256-register units per warp; shared memory:
  228 KB per SM, 1 KB reserved per program; 2048 threads); ``waves``: grid / (132 SMs x res);
* ``inflight``: weight and activation bytes per SM that can be in flight at once: plain loads, every resident
  thread's 16-byte loads of one iteration; cp.async, ``stages - 1`` iterations of every resident program;
* ``issue@read``: the fraction of an SM's issue slots (4 per cycle at 1.95 GHz, the clock ncu reported) the
  loop needs to consume weights at the rate of the best read of the shape's bytes (docs/performance.md).
  A model, not a measurement: ``benchmarks/profile_task_kernel.py`` measures the issue activity.
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("offline_task_kernel.py compiles for sm_90: unset TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import fp4gemv  # noqa: E402
from fp4gemv import layouts, ops  # noqa: E402
from fp4gemv.kernels import w4a4, w4a4_async  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from task_kernel_variants import SHAPES, variants  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SMS, SM_CLOCK_HZ = 132, 1.95e9
# Best read of each shape's NVFP4 bytes, us (docs/performance.md, the issue's table): the rate the kernel must keep.
BEST_READ_US = {(7168, 16384, 1): 16.49, (4096, 7168, 8): 30.81, (7168, 2048, 4): 9.30, (4096, 4096, 1): 4.09,
                (14336, 4096, 1): 9.29, (4096, 14336, 1): 9.27, (28672, 8192, 1): 30.82}


def _jit_specialization():
    """tests/conftest.py's ``jit_specialization`` (its ``_AOT_PRELUDE``), without importing conftest (which would
    switch on Triton's interpreter on a machine without a GPU)."""
    tree = ast.parse(open(os.path.join(HERE, "..", "tests", "conftest.py")).read())
    prelude = next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                   and getattr(node.targets[0], "id", None) == "_AOT_PRELUDE")
    scope: dict = {}
    exec(prelude, scope)
    return scope["jit_specialization"]


jit_specialization = _jit_specialization()


class _Recorder:
    """Stands in for a kernel: records the launch instead of running it."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, args, kw))


def _record(m, k, l, fmt, config):  # noqa: E741
    """(kernel, grid, args, kwargs) of the launch ``ops.task_gemv`` / ``gemv`` makes for this case."""
    shipped, other = _Recorder(w4a4.w4a4_gemv_kernel), _Recorder(w4a4_async.w4a4_async_kernel)
    saved = (w4a4.w4a4_gemv_kernel, w4a4_async.w4a4_async_kernel, w4a4.interpreting, w4a4_async.interpreting,
             w4a4_async._resident_programs, torch.cuda.get_device_properties, ops.resolve_backend)
    w4a4.w4a4_gemv_kernel, w4a4_async.w4a4_async_kernel = shipped, other
    ops.resolve_backend = lambda backend, device: backend
    w4a4.interpreting = w4a4_async.interpreting = lambda: False
    w4a4_async._resident_programs = lambda args, kwargs: 1  # the grid is worked out below, from the cubin
    torch.cuda.get_device_properties = lambda device: type("Props", (), {"multi_processor_count": 1})
    try:
        if fmt == "nvfp4":
            ops.task_gemv(*_task_operands(m, k, l), backend="triton-ptx", config=config)
        else:
            gemv_module = importlib.import_module("fp4gemv.gemv")
            a, b = _fp4_zeros(l, m, k, fmt), _fp4_zeros(l, 1, k, fmt)
            out = torch.empty((l, m, 1), dtype=torch.float16)
            gemv_module._launch(a, b, out, "w4a4", config, use_ptx=True)
    finally:
        (w4a4.w4a4_gemv_kernel, w4a4_async.w4a4_async_kernel, w4a4.interpreting, w4a4_async.interpreting,
         w4a4_async._resident_programs, torch.cuda.get_device_properties, ops.resolve_backend) = saved
    recorder = shipped if shipped.calls else other
    (grid, args, kw), = recorder.calls
    return recorder.kernel, grid, args, kw


def _task_operands(m, k, l):  # noqa: E741
    """Zero task-layout operands (what bench.random_task_operands makes, without drawing random bytes)."""
    a = torch.zeros((l, m, k // 2), dtype=torch.uint8)
    b = torch.zeros((l, 128, k // 2), dtype=torch.uint8)
    sfa = torch.zeros((l, m, k // 16), dtype=torch.uint8)
    sfb = torch.zeros((l, 128, k // 16), dtype=torch.uint8)
    return (a.permute(1, 2, 0).view(torch.float4_e2m1fn_x2), b.permute(1, 2, 0).view(torch.float4_e2m1fn_x2),
            layouts.task_permuted_view(layouts.swizzle_scales(sfa), m, k // 16).view(torch.float8_e4m3fn),
            layouts.task_permuted_view(layouts.swizzle_scales(sfb), 128, k // 16).view(torch.float8_e4m3fn),
            torch.zeros((l, m, 1), dtype=torch.float16).permute(1, 2, 0))


def _fp4_zeros(l, rows, k, fmt):  # noqa: E741
    cols = k // fmt_block(fmt)
    rows_p, cols_p = layouts.padded_scale_shape(rows, cols)
    return fp4gemv.FP4Tensor(torch.zeros((l, rows, k // 2), dtype=torch.uint8),
                             torch.zeros((l, rows_p * cols_p), dtype=torch.uint8), fmt, "swizzled")


def fmt_block(fmt):
    return 16 if fmt == "nvfp4" else 32


def compile_recorded(kernel, args, kw):
    """The launch compiled for sm_90 as the JIT would compile it on a GPU."""
    sig, const, attrs, _ = jit_specialization(kernel, args, kw)
    options = dict(num_warps=kw["num_warps"], num_stages=kw["num_stages"], launch_pdl=kw["launch_pdl"])
    if "maxnreg" in kw:
        options["maxnreg"] = kw["maxnreg"]
    return triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def sass_of(compiled) -> tuple[str, str]:
    """(SASS text, resource usage text) of a compiled kernel, from Triton's bundled cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    finally:
        os.remove(f.name)
    return sass, usage


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text without predicate) of every SASS instruction."""
    out = []
    for line in sass.splitlines():
        found = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if found:
            out.append((int(found.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", found.group(2))))
    return out


def main_loop(sass: str) -> tuple[list[str], int]:
    """The instructions of the longest backward branch's body (the K loop), and the length of the shortest path
    through it (every forward branch inside it taken: the flattened persistent loop's per-tile set-up and
    epilogue sit behind such branches; the other loops have none, and the two counts agree)."""
    raw = []
    for line in sass.splitlines():
        found = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if found:
            raw.append((int(found.group(1), 16), found.group(2)))
    best = (0, -1)
    for addr, text in raw:
        target = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr and addr - int(target.group(1), 16) > best[1] - best[0]:
            best = (int(target.group(1), 16), addr)
    body = [(addr, text) for addr, text in raw if best[0] <= addr <= best[1]]
    position = {addr: i for i, (addr, _) in enumerate(body)}
    i, path = 0, 0
    while i < len(body) and path <= len(body):
        path += 1
        target = re.search(r"\bBRA (0x[0-9a-f]+)", body[i][1])
        if target and int(target.group(1), 16) in position and int(target.group(1), 16) > body[i][0]:
            i = position[int(target.group(1), 16)]
        else:
            i += 1
    return [re.sub(r"^@!?U?P\w+\s+", "", text) for _, text in body], path


def analyze(kernel, grid, args, kw, compiled, shape, fmt) -> dict:
    """The numbers of the module docstring for one compiled launch."""
    sass, usage = sass_of(compiled)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    smem = compiled.metadata.shared
    loop, path = main_loop(sass)
    ops_count = collections.Counter(t.split()[0] for t in loop)
    c = {name: kw[name] for name in kw if name.isupper()}
    warps = kw["num_warps"]
    threads = 32 * warps
    if kernel is w4a4_async.w4a4_async_kernel:
        rows = c["LANE_ROWS"] * c["WARP_ROWS"] * c["ROWS_PER_THREAD"]
        per_iteration = rows * c["KSPLIT"] * c["BLOCKS"] * 8
        stages = c["STAGES"]
    else:
        rows = c["LANE_ROWS"] * c["ROWS_PER_THREAD"]
        per_iteration = rows * c["KSPLIT"] * c["BLOCKS"] * 8 * c["UNROLL"]
        stages = 0
    bytes_per_thread = per_iteration / threads
    ld16 = sum(v for op, v in ops_count.items() if op.startswith(("LDG.E.128", "LDGSTS")) and "128" in op)
    spills = sum(v for op, v in collections.Counter(t.split()[0] for _, t in instructions(sass)).items()
                 if op.startswith(("LDL", "STL")))
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    resident = min((65536 // regs_per_warp) // warps, (233472 + 1024) // (smem + 1024), 2048 // threads, 32)
    n_tiles = grid[0] * (grid[1] if len(grid) > 1 else 1)
    if c.get("PERSISTENT"):
        n_tiles = args[10]  # n_tiles argument of w4a4_async_kernel
        programs = min(n_tiles, SMS * resident)
    else:
        programs = n_tiles
    if stages >= 2:
        # stage = weights + activation copy of one iteration (the activation tile spans LANE_ROWS x KSPLIT x
        # WARP_ROWS x BLOCKS int64)
        act = c["LANE_ROWS"] * c["KSPLIT"] * c["WARP_ROWS"] * c["BLOCKS"] * 8
        inflight = resident * (stages - 1) * (per_iteration + act)
    else:
        inflight = resident * threads * ld16 * 16
    row = dict(fmt=fmt, shape=shape, regs=regs, smem=smem, spill=spills, loop=len(loop), path=path,
               bytes_per_thread=bytes_per_thread, ins_per_byte=path / bytes_per_thread, ld16=ld16,
               resident=resident, grid=programs, waves=programs / (SMS * resident), inflight_kb=inflight / 1024,
               barriers=ops_count.get("BAR.SYNC.DEFER_BLOCKING", 0),
               byte_loads=sum(v for op, v in ops_count.items() if op.startswith("LDG") and op.endswith(("U8", "S8"))),
               scale_loads16=ops_count.get("LDG.E.U16", 0))
    m, k, l = shape
    if fmt == "nvfp4" and shape in BEST_READ_US:
        weight_bytes = l * m * k // 2
        per_sm = weight_bytes / (BEST_READ_US[shape] * 1e-6) / SMS  # weight bytes per second per SM
        row["issue_at_read"] = (path / (bytes_per_thread * 32)) * per_sm / (4 * SM_CLOCK_HZ)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fmt", default="nvfp4,mxfp4")
    parser.add_argument("--json", default=None, help="write every row to this file")
    opts = parser.parse_args()
    rows = []
    header = ("fmt", "shape", "variant", "regs", "smem", "spill", "loop", "path", "B/thr", "ins/B", "ld16", "res",
              "grid", "waves", "inflight KB/SM", "bar", "u16", "u8", "issue@read")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for fmt in opts.fmt.split(","):
        for shape in SHAPES:
            for name, config in variants(*shape, fmt=fmt):
                kernel, grid, args, kw = _record(*shape, fmt, config)
                row = analyze(kernel, grid, args, kw, compile_recorded(kernel, args, kw), shape, fmt)
                row["variant"], row["config"] = name, config._asdict()
                rows.append(row)
                issue = f"{row['issue_at_read']:.0%}" if "issue_at_read" in row else "-"
                print(f"| {fmt} | {'x'.join(map(str, shape))} | {name} | {row['regs']} | {row['smem']} | "
                      f"{row['spill']} | {row['loop']} | {row['path']} | {row['bytes_per_thread']:.0f} | "
                      f"{row['ins_per_byte']:.2f} | "
                      f"{row['ld16']} | {row['resident']} | {row['grid']} | {row['waves']:.2f} | "
                      f"{row['inflight_kb']:.0f} | {row['barriers']} | {row['scale_loads16']} | {row['byte_loads']} | "
                      f"{issue} |", flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
