"""Device script (issue 27, round 33 of docs/performance.md): the wgmma consumer prototype
(``kernels/engine_wgmma.py``, MXFP4 x bf16, linear scales) against the engine on the same weights, N = 16 and 8:
its error against the exact product (float64), then µs by the protocol of ``engine_ab.py`` (CUDA-graph replay
over >= 20 distinct copies, L2 flushed, median) beside the engine (``kernel="engine"``, linear and swizzled scales),
FP8 ``_scaled_mm`` and the best read.

    PYTHONPATH=src python benchmarks/wgmma_ab.py          (GPU machine; SHAPES / NS as engine_ab.py)
"""
import os
import statistics

import torch

from fp4gemv import layouts
from fp4gemv.bench.cases import Shape, _fp8_scaled_mm_us, case_bytes, random_gemv_operands
from fp4gemv.bench.stream import best_read
from fp4gemv.bench.timing import device_time_us, input_count
from fp4gemv.formats import FORMATS
from fp4gemv.kernels import engine_wgmma as W
from fp4gemv.library import gemv
from fp4gemv.reference import fp4_values

SHAPES = ((7168, 16384), (28672, 8192), (14336, 4096), (4096, 14336), (4096, 4096))
if os.environ.get("SHAPES"):
    SHAPES = tuple(tuple(int(v) for v in s.split("x")) for s in os.environ["SHAPES"].split(","))
NS = tuple(int(v) for v in os.environ.get("NS", "16,8").split(","))
BIAS = {"x": "x", "bias": True, "nobias": False}  # the activation biased in shared memory, the weights, neither
VARIANTS = tuple(os.environ.get("VARIANTS", "x:3,bias:3,nobias:3,x:2,x:4").split(","))


def prototype_operands(shape, seed):
    a, b, out = random_gemv_operands(shape, "mxfp4", "bf16", seed=seed, scale_layout="linear")
    data = a.with_code_order("checkpoint").data[0]
    scales = a.scales[0][:shape.m]
    return a, b, out, layouts.pack_mma_tiles(data), scales


def exact(data, scales, x):
    w = fp4_values(data, scales, FORMATS["mxfp4"], "linear", None)
    return w @ x.double().T, w.abs() @ x.double().abs().T


def check(m, k, n, variant):
    """Error of the prototype against the exact product, ordinary and tiny activations (the bias window)."""
    bias = BIAS[variant]
    worst = 0.0
    for scale in (1.0, 2.0 ** -60):
        g = torch.Generator(device="cuda").manual_seed(m + n)
        data = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device="cuda", generator=g)
        scales = torch.randint(100, 150, (m, k // 32), dtype=torch.uint8, device="cuda", generator=g)
        x = (torch.randn(n, k, device="cuda", generator=g) * scale).to(torch.bfloat16)
        out = torch.full((m, n), float("nan"), device="cuda")
        W.wgmma_gemv(layouts.pack_mma_tiles(data), scales, x, out, m, k, bias=bias)
        ref, mag = exact(data.cpu(), scales.cpu(), x.cpu())
        err = ((out.double().cpu() - ref).abs() / mag.clamp_min(1e-300)).max().item()
        worst = max(worst, err)
        print(f"  check {m}x{k} N={n} {variant} x*{scale:g}: max |err| / (|W| |x|) = {err:.3g}", flush=True)
    return worst


def main():
    for m, k in SHAPES:
        for n in NS:
            shape = Shape(m, k, 1, n)
            nbytes = case_bytes(shape, "mxfp4", "bf16")
            count = input_count(nbytes)
            inputs = [prototype_operands(shape, i) for i in range(count)]
            line = [f"{m}x{k} N={n}", f"read {best_read(nbytes)[1]:.2f}", f"fp8 {_fp8_scaled_mm_us(shape)[0]:.2f}"]
            t = device_time_us(lambda v: gemv(v[0], v[1], out=v[2], kernel="engine"), inputs)
            line.append(f"engine(linear) {statistics.median(t):.2f}")
            ref = inputs[0][2].float().clone()
            for variant in VARIANTS:
                kind, stages, *split = variant.split(":")  # e.g. x:3 or x:3:1 (split-K programs)
                bias = BIAS[kind]
                outs = [torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in inputs]
                calls = [(v[3], v[4], v[1][0], o) for v, o in zip(inputs, outs)]
                try:
                    t = device_time_us(lambda c: W.wgmma_gemv(*c, m, k, stages=int(stages), bias=bias,
                                                                       split=int(split[0]) if split else None), calls)
                except Exception as e:
                    line.append(f"{variant} error {type(e).__name__}: {str(e)[:200]}")
                    continue
                diff = (outs[0].float() - ref[0]).abs().max().item()
                line.append(f"{variant} {statistics.median(t):.2f} (vs engine maxdiff {diff:.3g})")
            print("  ".join(line), flush=True)
            inputs.clear()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), flush=True)
    for m, k, n in ((4096, 4096, 16), (200, 2048, 8), (4096, 1024, 3)):
        for variant in ("x", "bias", "nobias"):
            check(m, k, n, variant)
    main()
