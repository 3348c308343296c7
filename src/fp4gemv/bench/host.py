"""``fp4gemv bench --host``: host time per eager call of the public entry points, next to ``x.add_(1)``.

All in one process, each the median of rounds of back-to-back calls on the same operands (so the cached
plan of a call's metadata is what is measured, after one warm-up call): ``fp4gemv.gemv(..., out=...)`` for a
few cases, ``task.custom_kernel`` on a task input, ``FP4Linear`` beside ``nn.Linear`` on a one-token input, a bare
Triton launch of a trivial kernel, and ``x.add_(1)`` on a small CUDA tensor; ratios to ``x.add_(1)``.  Device work per call is kept small (4096 x 4096) so the host
is what is timed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from .. import ops, task
from ..library import gemv
from ..tensor import FP4Tensor
from ..nn import FP4Linear
from .cases import Shape, random_gemv_operands, random_task_input
from .timing import host_time_us

__all__ = ["host_costs", "module_host_costs", "format_host_table"]


@triton.jit
def _one_store_kernel(ptr):
    tl.store(ptr, 1.0)


def host_costs() -> list[tuple[str, float]]:
    """(label, us per call) for each entry point and the references, measured together."""
    shape = Shape(4096, 4096)
    rows = []
    x = torch.zeros(16, device="cuda")
    rows.append(("x.add_(1)", host_time_us(lambda: x.add_(1))))
    rows.append(("bare Triton JIT launch", host_time_us(lambda: _one_store_kernel[(1,)](x))))
    for fmt, act, n in (("nvfp4", "bf16", 1), ("nvfp4", "fp4", 1), ("mxfp4", "bf16", 1), ("nvfp4", "fp16", 8),
                        ("nvfp4", "bf16", 16)):
        a, b, out = random_gemv_operands(Shape(shape.m, shape.k, 1, n), fmt, act, seed=0)
        a, b, out = _unbatched(a), _unbatched(b), out[0]
        name = ops.select_kernel(a, b, out=out).name
        rows.append((f"gemv(out=) {fmt} x {act} N={n} [{name}]", host_time_us(lambda: gemv(a, b, out=out))))
    data = random_task_input(shape.m, shape.k, 1, seed=0)
    rows.append(("task.custom_kernel", host_time_us(lambda: task.custom_kernel(data))))
    rows += module_host_costs(shape)
    rows.append(("x.add_(1) again", host_time_us(lambda: x.add_(1))))
    return rows


def module_host_costs(shape: Shape) -> list[tuple[str, float]]:
    """(label, us per call) of ``nn.Linear`` against ``FP4Linear`` (weight-only, W4A4 with a static and with a
    per-call activation scale) on the same one-token bf16 input, eagerly under ``torch.no_grad``."""
    torch.manual_seed(0)
    rows = []
    x = torch.randn(1, shape.k, device="cuda", dtype=torch.bfloat16)
    linear = nn.Linear(shape.k, shape.m, bias=False, device="cuda", dtype=torch.bfloat16)
    modules = [("nn.Linear bf16", linear),
               ("FP4Linear nvfp4 weight-only", FP4Linear.from_linear(linear, "nvfp4")),
               ("FP4Linear mxfp4 weight-only", FP4Linear.from_linear(linear, "mxfp4")),
               ("FP4Linear nvfp4 w4a4 static scale", FP4Linear.from_linear(linear, "nvfp4", activations="w4a4",
                                                                         input_scale=0.01)),
               ("FP4Linear nvfp4 w4a4 per-call scale", FP4Linear.from_linear(linear, "nvfp4", activations="w4a4"))]
    with torch.no_grad():
        for label, module in modules:
            rows.append((f"{label} N=1", host_time_us(lambda: module(x))))
    return rows


def _unbatched(t):
    if isinstance(t, FP4Tensor):
        return FP4Tensor(t.data[0], t.scales[0], t.fmt, t.scale_layout, t.global_scale)
    return t[0]


def format_host_table(rows: list[tuple[str, float]]) -> str:
    base = (rows[0][1] + rows[-1][1]) / 2
    lines = [f"{'call':<44} {'us/call':>8} {'x add_':>7}"]
    lines += [f"{label:<44} {us:>8.2f} {us / base:>7.2f}" for label, us in rows]
    return "\n".join(lines)
