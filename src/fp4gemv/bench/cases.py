"""``fp4gemv bench``: each case timed through the public op against the best read of the same bytes.

A case is a shape (M x K, L batches, N activation rows), a weight format and an activation (FP4 in the
weights' format, or fp16 / bf16).  The task's own case (NVFP4 x NVFP4, N = 1) is timed through
``task.custom_kernel`` on the task's 7-tuples, exactly what the submission runs; every other case through
``fp4gemv.gemv(a, b, out=...)`` with the weights' codes in the order ``FP4Linear`` keeps for that activation
(``nn.linear.LINEAR_CODE_ORDER``: paired for fp16 / bf16, the checkpoint's for FP4).  Each row carries the kernel :func:`fp4gemv.ops.plan_for` chose and its
configuration, the device time (``timing.device_time_us``), the best read of the case's bytes
(``stream.best_read``, the faster Triton read) and the kernel's fraction of it, the host time of one eager call, and optionally the
same product with bf16 weights through ``torch.matmul`` (cuBLAS).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from .. import formats, layouts, ops, task
from ..library import gemv
from ..nn.linear import LINEAR_CODE_ORDER
from ..tensor import FP4Tensor
from .stream import best_read
from .timing import device_time_us, host_time_us, input_count, summarize

__all__ = ["Shape", "SHAPE_SETS", "ACTIVATIONS", "Measurements", "GPU_MEASUREMENTS", "case_bytes",
           "random_gemv_operands", "random_task_input", "bench_case", "format_table", "run"]


@dataclass(frozen=True)
class Shape:
    """One GEMV problem: M x K weights, L batches, N activation rows."""

    m: int
    k: int
    l: int = 1  # noqa: E741
    n: int = 1

    def label(self) -> str:
        return f"{self.m}x{self.k}" + (f"x{self.l}" if self.l > 1 else "")


TASK_SHAPES = (Shape(7168, 16384, 1), Shape(4096, 7168, 8), Shape(7168, 2048, 4))
DECODE_SHAPES = (Shape(4096, 4096), Shape(14336, 4096), Shape(4096, 14336), Shape(28672, 8192))
# Llama-3-8B's k/v projection and gpt-oss-20b's per-expert MLP matrices (MXFP4 in that model).
MODEL_SHAPES = (Shape(1024, 4096), Shape(5760, 2880), Shape(2880, 2880))
SHAPE_SETS = {"task": TASK_SHAPES, "decode": DECODE_SHAPES, "model": MODEL_SHAPES,
              "all": TASK_SHAPES + DECODE_SHAPES, "every": TASK_SHAPES + DECODE_SHAPES + MODEL_SHAPES}

# Activation kinds of ``fp4gemv bench --act``: an FP4 activation in the weights' format, or a float dtype.
ACTIVATIONS = {"fp4": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def case_bytes(shape: Shape, fmt: str = "nvfp4", act: str = "fp4") -> int:
    """Bytes a GEMV must move: weights + scales, the activation (FP4 + scales, or 2 bytes per element), fp16 out."""
    block = formats.FORMATS[fmt].block_size
    m, k, l, n = shape.m, shape.k, shape.l, shape.n  # noqa: E741
    act_per_element = 0.5 + 1 / block if act == "fp4" else 2
    return int(l * (m * k // 2 + m * k // block) + l * n * k * act_per_element + l * m * n * 2)


def _random_fp4(batch: int, rows: int, k: int, fmt: str, g: torch.Generator, device,
                scale_layout: str = "swizzled") -> FP4Tensor:
    """All 256 byte values (every code, both signs); scales powers of two 2^-4 .. 2^3, in ``scale_layout``."""
    f = formats.FORMATS[fmt]
    data = torch.randint(0, 256, (batch, rows, k // 2), dtype=torch.uint8, device=device, generator=g)
    rows_p, cols_p = layouts.padded_scale_shape(rows, k // f.block_size)
    powers = torch.exp2(torch.randint(-4, 4, (batch, rows_p * cols_p), device=device, generator=g).float())
    encode = formats.encode_e4m3 if f.scale_dtype == torch.float8_e4m3fn else formats.encode_e8m0
    return FP4Tensor(data, encode(powers), fmt, "swizzled").with_scale_layout(scale_layout)


def random_gemv_operands(shape: Shape, fmt: str, act: str, seed: int, device="cuda", scale_layout: str = "swizzled",
                         code_order: str | None = None):
    """``(a, b, out)`` for ``fp4gemv.gemv``: random FP4 weights ``[L, M, K]`` (scales in ``scale_layout``, codes in
    ``code_order``; None: the order ``FP4Linear`` keeps for the activation, ``nn.linear.LINEAR_CODE_ORDER``), an FP4
    or float activation ``[L, N, K]`` and the fp16 output.  For timing only (correctness is checked on the tests'
    full-range data)."""
    g = torch.Generator(device=device).manual_seed(seed)
    a = _random_fp4(shape.l, shape.m, shape.k, fmt, g, device, scale_layout)
    dtype = ACTIVATIONS[act]
    if code_order is None:
        code_order = LINEAR_CODE_ORDER["w4a4" if dtype is None else "weight-only"]
    a = a.with_code_order(code_order)
    if dtype is None:
        b = _random_fp4(shape.l, shape.n, shape.k, fmt, g, device)
    else:
        b = torch.randn((shape.l, shape.n, shape.k), generator=g, device=device).to(dtype)
    return a, b, torch.empty((shape.l, shape.m, shape.n), dtype=torch.float16, device=device)


def random_task_input(m: int, k: int, l: int, seed: int, device="cuda") -> task.TaskInput:  # noqa: E741
    """The task's 7-tuple drawn directly on ``device`` (fast): all 256 byte values, e4m3 scales 2^-4 .. 2^3.
    For timing only; correctness is checked on ``task.generate_full_range_input``."""
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randint(0, 256, (l, m, k // 2), dtype=torch.uint8, device=device, generator=g)
    b = torch.randint(0, 256, (l, task.B_ROWS, k // 2), dtype=torch.uint8, device=device, generator=g)
    # e4m3 bytes 0x18..0x57: exponent fields 3..10, every mantissa.
    sfa = torch.randint(0x18, 0x58, (l, m, k // 16), dtype=torch.uint8, device=device, generator=g)
    sfb = torch.randint(0x18, 0x58, (l, task.B_ROWS, k // 16), dtype=torch.uint8, device=device, generator=g)
    c = torch.empty((l, m, 1), dtype=torch.float16, device=device)
    e4m3 = torch.float8_e4m3fn
    return (
        a.permute(1, 2, 0).view(torch.float4_e2m1fn_x2),
        b.permute(1, 2, 0).view(torch.float4_e2m1fn_x2),
        sfa.view(e4m3).permute(1, 2, 0),
        sfb.view(e4m3).permute(1, 2, 0),
        layouts.task_permuted_view(layouts.swizzle_scales(sfa), m, k // 16).view(e4m3),
        layouts.task_permuted_view(layouts.swizzle_scales(sfb), task.B_ROWS, k // 16).view(e4m3),
        c.permute(1, 2, 0),
    )


class Measurements(NamedTuple):
    """What :func:`bench_case` measures with, and where its operands live (the GPU's timers by default)."""

    device_time_us: Callable = device_time_us
    host_time_us: Callable = host_time_us
    best_read: Callable[[int], tuple[str, float]] = best_read
    input_count: Callable[[int], int] = input_count
    device: str = "cuda"


GPU_MEASUREMENTS = Measurements()


def _describe_plan(plan: ops.GemvPlan) -> str:
    config = "" if plan.config is None else " " + ",".join(f"{k}={v}" for k, v in plan.config._asdict().items())
    return plan.spec.name + config


def bench_case(shape: Shape, fmt: str = "nvfp4", act: str = "fp4", bf16_baseline: bool = False,
               measure: Measurements = GPU_MEASUREMENTS, scale_layout: str = "swizzled") -> dict:
    """Every measurement of one case (module docstring); a row of the table.  ``scale_layout``: the weights' (the
    task's own case keeps the task's tuples)."""
    nbytes = case_bytes(shape, fmt, act)
    count = measure.input_count(nbytes)
    row = {"m": shape.m, "k": shape.k, "l": shape.l, "n": shape.n, "fmt": fmt, "act": act, "bytes": nbytes,
           "inputs": count, "scale_layout": scale_layout}
    if (fmt, act, shape.n) == ("nvfp4", "fp4", 1):
        inputs = [random_task_input(shape.m, shape.k, shape.l, seed=i, device=measure.device) for i in range(count)]
        weights, activation, out = task.task_views(inputs[0])
        row["path"] = "task.custom_kernel"
        plan = ops.plan_for(weights, activation, out=out, out_dtype=out.dtype)
        launch = task.custom_kernel
        row["host_us"] = measure.host_time_us(lambda: task.custom_kernel(inputs[0]))
    else:
        inputs = [random_gemv_operands(shape, fmt, act, seed=i, device=measure.device, scale_layout=scale_layout)
                  for i in range(count)]
        a, b, out = inputs[0]
        row["path"] = "fp4gemv.gemv"
        row["code_order"] = a.code_order
        plan = ops.plan_for(a, b, out=out)

        def launch(x):
            gemv(x[0], x[1], out=x[2])

        row["host_us"] = measure.host_time_us(lambda: gemv(a, b, out=out))
    row["kernel"] = _describe_plan(plan)
    row["time"] = summarize(measure.device_time_us(launch, inputs))
    inputs.clear()
    torch.cuda.empty_cache()
    row["best_read"], row["best_read_us"] = measure.best_read(nbytes)
    if bf16_baseline:
        row["bf16_us"] = _bf16_matmul_us(shape)
        row["fp8_us"], row["fp8_rows"] = _fp8_scaled_mm_us(shape)
    return row


def _fp8_scaled_mm_us(shape: Shape) -> tuple[float, int]:
    """The same product with e4m3 weights and activation through ``torch._scaled_mm`` (cuBLASLt, per-tensor fp32
    scales, bf16 out), one launch per batch, same protocol; and the activation rows it ran: N, or 16 where
    cuBLASLt refuses N (its FP8 path wants multiples of 16)."""
    nbytes = shape.l * shape.m * shape.k
    one = torch.ones((), device="cuda")
    weights = []
    for i in range(input_count(nbytes)):
        g = torch.Generator(device="cuda").manual_seed(i)
        w = torch.randn((shape.l, shape.m, shape.k), generator=g, device="cuda", dtype=torch.bfloat16)
        weights.append(w.to(torch.float8_e4m3fn))
    rows = shape.n
    for attempt in (shape.n, 16):
        rows = attempt
        x = torch.randn((attempt, shape.k), device="cuda").to(torch.float8_e4m3fn)
        try:
            torch._scaled_mm(x, weights[0][0].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            break
        except RuntimeError:
            if attempt == 16:
                raise

    def launch(w):
        for batch in range(shape.l):
            torch._scaled_mm(x, w[batch].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    time = summarize(device_time_us(launch, weights))["median_us"]
    weights.clear()
    torch.cuda.empty_cache()
    return time, rows


def _bf16_matmul_us(shape: Shape) -> float:
    """The same product with bf16 weights and activation through ``torch.matmul`` (cuBLAS), same protocol."""
    nbytes = shape.l * shape.m * shape.k * 2
    inputs = []
    for i in range(input_count(nbytes)):
        g = torch.Generator(device="cuda").manual_seed(i)
        w = torch.randn((shape.l, shape.m, shape.k), generator=g, device="cuda", dtype=torch.bfloat16)
        x = torch.randn((shape.l, shape.k, shape.n), generator=g, device="cuda", dtype=torch.bfloat16)
        inputs.append((w, x, torch.empty((shape.l, shape.m, shape.n), device="cuda", dtype=torch.bfloat16)))
    time = summarize(device_time_us(lambda t: torch.matmul(t[0], t[1], out=t[2]), inputs))["median_us"]
    inputs.clear()
    torch.cuda.empty_cache()
    return time


def format_table(rows: Sequence[dict]) -> str:
    head = (f"{'fmt':>5} {'act':>4} {'N':>2} {'shape':>14} {'MB':>6} {'us':>7} {'best read us':>12} "
            f"{'x read':>6} {'host us':>7} {'bf16 us':>7} {'x bf16':>6} {'fp8 us':>7} {'x fp8':>6}  kernel")
    lines = [head]
    for r in rows:
        t = r["time"]["median_us"]
        bf16 = f"{r['bf16_us']:>7.2f} {r['bf16_us'] / t:>6.2f}" if "bf16_us" in r else f"{'':>14}"
        fp8 = ""
        if "fp8_us" in r:
            padded = "*" if r["fp8_rows"] != r["n"] else " "
            fp8 = f"{r['fp8_us']:>6.2f}{padded} {r['fp8_us'] / t:>6.2f}"
        else:
            fp8 = f"{'':>14}"
        lines.append(
            f"{r['fmt']:>5} {r['act']:>4} {r['n']:>2} {Shape(r['m'], r['k'], r['l']).label():>14} "
            f"{r['bytes'] / 1e6:>6.1f} {t:>7.2f} {r['best_read_us']:>12.2f} {r['best_read_us'] / t:>6.2f} "
            f"{r['host_us']:>7.1f} {bf16} {fp8}  {r['kernel']}")
    if any(r.get("fp8_rows", r["n"]) != r["n"] for r in rows):
        lines.append("* FP8 with the activation padded to 16 rows (cuBLASLt refused N)")
    return "\n".join(lines)


def run(shapes: Sequence[Shape], out_dir: str, fmt: str = "nvfp4", act: str = "fp4", ns: Sequence[int] = (1,),
        bf16_baseline: bool = False, scale_layout: str = "swizzled") -> list[dict]:
    """Measure every shape for each N, write ``bench.json`` to ``out_dir``, print the table."""
    rows = []
    for s in shapes:
        for n in ns:
            case = Shape(s.m, s.k, s.l, n)
            print(f"measuring {case.label()} {fmt} {act} N={n} ...", flush=True)
            rows.append(bench_case(case, fmt, act, bf16_baseline, scale_layout=scale_layout))
    os.makedirs(out_dir, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"meta": meta, "shapes": [asdict(s) for s in shapes], "rows": rows}, f, indent=1)
    print(format_table(rows))
    return rows
