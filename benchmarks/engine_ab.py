"""Device script (issue 27, round 23 of docs/performance.md): the dense decode kernels on the issue's six shapes at
N = 1, 8, 16, each variant against FP8 ``torch._scaled_mm`` (per-tensor), bf16 ``torch.matmul`` and the best read
of the same bytes, in one process.

    PYTHONPATH=src python benchmarks/engine_ab.py [VARIANT ...]   -> engine_ab.json in $OUT (or .)

``NS`` (default 1,8,16) and ``SHAPES`` (default the six below, e.g. ``SHAPES=4096x14336,4096x7168x8``: M x K [x L]) choose the rows;
``WARM=1`` times one L2-resident copy instead (the kernels' own rate, not the memory's).

A variant is ``FMT[/fp16]:LAYOUT:ORDER:KERNEL[:CONFIG]`` (``/fp16``: fp16 activations, else bf16; KERNEL
``auto`` = the library's choice; CONFIG the engine's ``tiles,stages,maxnreg,per_sm``, stages 0 for the default
ring at N), e.g. ``nvfp4:swizzled:checkpoint:auto`` (what ``FP4Linear`` runs today) or
``nvfp4:linear:native:engine:2,3,128,2``.  Timing: ``bench.timing.device_time_us`` (one CUDA
graph over >= 20 distinct weight copies and 300 MB, L2 flushed before each replay, median of 15); bf16
activations unless ``/fp16``; fp16 output.  Every variant's output on the first copy is compared with the first
variant's of the same format and activation (bit for bit where both kernels fold the same way; the largest difference is printed otherwise).
"""
import json
import os
import statistics
import sys

import torch

from fp4gemv import ops
from fp4gemv.bench.cases import Shape, _bf16_matmul_us, _fp8_scaled_mm_us, case_bytes, random_gemv_operands
from fp4gemv.bench.stream import best_read
from fp4gemv.bench.timing import device_time_us, input_count
from fp4gemv.kernels.engine import EngineConfig
from fp4gemv.library import gemv

OUT = os.environ.get("OUT", ".")
SHAPES = ((7168, 16384), (28672, 8192), (14336, 4096), (4096, 14336), (4096, 4096), (5760, 2880))
if os.environ.get("SHAPES"):  # e.g. SHAPES=4096x14336,4096x4096
    SHAPES = tuple(tuple(int(v) for v in s.split("x")) for s in os.environ["SHAPES"].split(","))
NS = tuple(int(v) for v in os.environ.get("NS", "1,8,16").split(","))
# WARM=1: the step's own rate -- one weight copy the L2 holds (pick shapes of < ~40 MB), launched 20 times a replay,
# so that the kernel is bound by its decode and MMA rather than by DRAM (round 28: on an H100 the engine is within
# 15% of the read, so its instruction count shows only where the bytes come faster, as on an H200).
WARM = os.environ.get("WARM") == "1"
DEFAULT_VARIANTS = ("nvfp4:swizzled:checkpoint:auto", "nvfp4:swizzled:native:auto", "nvfp4:linear:native:auto",
                    "nvfp4:linear:native:engine", "mxfp4:swizzled:checkpoint:auto", "mxfp4:swizzled:native:auto")


def variant_time(shape, fmt, layout, order, kernel, config=None, act="bf16"):
    nbytes = case_bytes(shape, fmt, act)
    inputs = []
    for i in range(1 if WARM else input_count(nbytes)):
        a, b, out = random_gemv_operands(shape, fmt, act, seed=i, scale_layout=layout)
        inputs.append((a.with_code_order(order), b, out))
    if WARM:  # one copy launched 20 times a replay: after the first, its bytes come from the L2
        inputs = inputs * 20
    if kernel.startswith("moe_"):  # the routed kernels on one expert: every row of x through expert 0
        return _moe_time(inputs, kernel)
    kern = None if kernel == "auto" else kernel
    a, b, out = inputs[0]
    plan = ops.plan_for(a, b, out=out, kernel=kern, config=config)
    times = device_time_us(lambda t: gemv(t[0], t[1], out=t[2], kernel=kern, config=config), inputs)
    out.fill_(float("nan"))
    gemv(a, b, out=out, kernel=kern, config=config)
    first = out.float().cpu()
    inputs.clear()
    torch.cuda.empty_cache()
    cfg = "" if plan.config is None else str(tuple(plan.config))
    return statistics.median(times), plan.spec.name + cfg, first


def _moe_time(inputs, kernel):
    """``moe_gemv(w, x, ids, kernel=...)`` with w the weights as one expert ``[1, M, K]``, x the activation
    ``[N, K]`` and every id 0: the dense product through the routed kernel (its routing launch included);
    the result ``[M, N]`` as the dense variants give it."""
    from fp4gemv.moe import moe_gemv
    n = inputs[0][1].shape[-2]
    ids = torch.zeros((n, 1), dtype=torch.int32, device="cuda")
    calls = [(a, b[0], torch.empty((n, 1, a.shape[-2]), dtype=torch.float16, device="cuda")) for a, b, _ in inputs]
    times = device_time_us(lambda t: moe_gemv(t[0], t[1], ids, out=t[2], out_dtype=torch.float16, kernel=kernel,
                                              check_ids=False), calls)
    a, x, out = calls[0]
    out.fill_(float("nan"))
    moe_gemv(a, x, ids, out=out, out_dtype=torch.float16, kernel=kernel, check_ids=False)
    first = out[:, 0, :].T.reshape(1, -1, n).float().cpu()
    calls.clear()
    inputs.clear()
    torch.cuda.empty_cache()
    return statistics.median(times), kernel, first


def main(variants):
    rows = []
    for m, k, *batch in SHAPES:
        for n in NS:
            shape = Shape(m, k, batch[0] if batch else 1, n)
            row = {"m": m, "k": k, "l": shape.l, "n": n}
            lx = f"x{shape.l}" if batch else ""
            row["read_us"] = best_read(case_bytes(shape, "nvfp4", "bf16"))[1]
            row["read_mx_us"] = best_read(case_bytes(shape, "mxfp4", "bf16"))[1]
            row["fp8_us"], row["fp8_rows"] = _fp8_scaled_mm_us(shape)
            row["bf16_us"] = _bf16_matmul_us(shape)
            refs = {}
            for v in variants:
                fmt, layout, order, kernel, *config = v.split(":")
                fmt, _, act = fmt.partition("/")  # e.g. nvfp4/fp16: fp16 activations
                if config:  # the engine's configuration: tiles, stages, maxnreg, per_sm
                    config = EngineConfig(*(int(c) for c in config[0].split(",")))
                    if config.stages == 0:  # the default ring for N
                        config = config._replace(stages=2 if n > 8 else 3)
                try:
                    us, chosen, result = variant_time(shape, fmt, layout, order, kernel, config or None, act or "bf16")
                except Exception as e:  # a kernel that refuses the case: recorded, not fatal
                    row[v] = {"error": f"{type(e).__name__}: {e}"[:300]}
                    print(f"{m}x{k}{lx} N={n} {v}: {row[v]['error']}", flush=True)
                    continue
                ref = refs.setdefault((fmt, act), result)
                diff = (result - ref).abs()
                same = bool(torch.equal(result, ref))
                row[v] = {"us": us, "kernel": chosen, "same_bits": same, "max_abs_diff": float(diff.max()),
                          "x_read": row["read_us" if fmt == "nvfp4" else "read_mx_us"] / us,
                          "x_fp8": row["fp8_us"] / us}
                print(f"{m}x{k}{lx} N={n} {v:<34} {us:8.2f} us  x read {row[v]['x_read']:.2f}  x fp8 "
                      f"{row[v]['x_fp8']:.2f}  {chosen}  same={same} maxdiff={row[v]['max_abs_diff']:.3g}", flush=True)
            print(f"{m}x{k}{lx} N={n} read {row['read_us']:.2f} / {row['read_mx_us']:.2f} fp8 {row['fp8_us']:.2f} "
                  f"bf16 {row['bf16_us']:.2f}", flush=True)
            rows.append(row)
            meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": list(variants),
                    "warm": WARM}
            with open(os.path.join(OUT, "engine_ab.json"), "w") as f:  # after every row: a cut-off run keeps its rows
                json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(tuple(sys.argv[1:]) or DEFAULT_VARIANTS)
