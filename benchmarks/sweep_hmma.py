"""Device script: the warp-level tensor-core kernel (kernels/hmma_gemv.py) checked and timed (sweep 10).

PYTHONPATH=src python benchmarks/sweep_hmma.py [check] [time]   -> correctness lines, then one timing line per case
(4 and 8 warps; the PTX path and the pure-Triton twin against the exact oracle, outputs poisoned).
"""

import sys

import torch

from fp4gemv.bench import Shape, case_bytes, device_time_us, floor_us, input_count, random_gemv_operands, summarize
from fp4gemv.kernels._common import GemvOperands, linear_scale_addressing, swizzled_scale_addressing
from fp4gemv.kernels.configs import HmmaConfig
from fp4gemv.kernels.hmma_gemv import launch_hmma_gemv
from fp4gemv.reference import quantized_gemv_reference


def addressing(t):
    if t.scale_layout == "linear":
        return linear_scale_addressing(t.scales.stride(0), t.scales.stride(1))
    return swizzled_scale_addressing(t.scales.stride(0), t.k // 16)


def launch(a, b, c, warps, ptx=True):
    fp4 = not isinstance(b, torch.Tensor)
    ops = GemvOperands(a.data.view(torch.int32), a.scales, addressing(a), b.data if fp4 else b.view(torch.uint8),
                       b.scales if fp4 else None, addressing(b) if fp4 else None, c)
    launch_hmma_gemv(ops, k=a.k, activation_dtype=None if fp4 else b.dtype, config=HmmaConfig(warps), use_ptx=ptx)


def check():
    for act, n in (("fp16", 1), ("bf16", 1), ("fp16", 16), ("bf16", 9), ("fp4", 2), ("fp4", 16), ("fp16", 5)):
        for shape in (Shape(2432, 4608, 2, n), Shape(7168, 2048, 4, n), Shape(256, 192, 1, n), Shape(208, 320, 3, n)):
            a, b, _ = random_gemv_operands(shape, "nvfp4", act, seed=7)
            exact = quantized_gemv_reference(a, b, torch.float64)
            bv = b.dequantize(torch.float64) if act == "fp4" else b.double()
            magnitude = a.dequantize(torch.float64).abs() @ bv.abs().transpose(-1, -2)
            for warps in (1, 4, 8):
                res = {}
                for ptx in (True, False):
                    c = torch.full((shape.l, shape.m, n), float("nan"), device="cuda")
                    launch(a, b, c, warps, ptx)
                    res[ptx] = c
                unwritten = int(torch.isnan(res[True]).sum())
                err = ((res[True].double() - exact).abs() / magnitude.clamp(min=1e-30)).max().item()
                err_t = ((res[False].double() - exact).abs() / magnitude.clamp(min=1e-30)).max().item()
                ok = unwritten == 0 and err <= (shape.k + 24) * 2.0**-23 and err_t <= (shape.k + 24) * 2.0**-23
                print(f"check {act} N={n} {shape.m}x{shape.k}x{shape.l} warps={warps}: unwritten {unwritten}, "
                      f"err/sum|t| ptx {err:.2e} triton {err_t:.2e} {'OK' if ok else 'FAIL'}", flush=True)


def timing():
    from fp4gemv.bench import DECODE_SHAPES, TASK_SHAPES
    for s in TASK_SHAPES + DECODE_SHAPES:
        for act, n in (("fp16", 1), ("bf16", 1), ("fp16", 16), ("fp4", 2), ("fp4", 8), ("fp4", 16)):
            shape = Shape(s.m, s.k, s.l, n)
            nbytes = case_bytes(shape, "nvfp4", act)
            inputs = [random_gemv_operands(shape, "nvfp4", act, seed=i) for i in range(input_count(nbytes))]
            line = []
            for warps in (4, 8):
                t = summarize(device_time_us(lambda x, w=warps: launch(x[0], x[1], x[2], w), inputs))["median_us"]
                line.append(f"w{warps} {t:.2f} ({100 * floor_us(nbytes) / t:.0f}%)")
            print(f"time {s.m}x{s.k}x{s.l} {act} N={n} floor {floor_us(nbytes):.2f}: " + " | ".join(line), flush=True)
            del inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    if "check" in sys.argv[1:] or len(sys.argv) == 1:
        check()
    if "time" in sys.argv[1:] or len(sys.argv) == 1:
        timing()
