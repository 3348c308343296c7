"""``fp4gemv bench --prefill``: FP4Linear (weight-only, bf16 activations) at prefill sizes against bf16 and FP8.

Shapes (out x in) 4096 x 4096, 14336 x 4096, 4096 x 14336, 28672 x 8192; T = 32 .. 8192 tokens; NVFP4 and MXFP4
weights.  Per shape and T, each of
* ``FP4Linear``, NVFP4 and MXFP4, swizzled scales: beyond 16 tokens it dequantizes and calls ``F.linear``
  unless ``FP4Linear.fused_prefill`` picks gemv's GEMM kernel (``benchmarks/gemm_sweep.py`` times that kernel's
  tiles directly; this round's GEMM numbers are in docs/performance.md);
* bf16 ``F.linear`` (cuBLAS);
* FP8 ``torch._scaled_mm`` (e4m3 weight and activation, per-tensor fp32 scales, bf16 out; the activation's
  quantization is not timed)
runs once per ``LAYERS`` distinct layers in one CUDA graph, L2 flushed before each replay; the time is the median
over ``REPLAYS`` replays per layer call (``timing.device_time_us``).  Ratios are time over bf16 time (below 1 is
faster).  Before timing, FP4Linear's output at T = 32 is checked against the float64 oracle.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from ..nn import FP4Linear
from ..reference import quantized_gemv_reference
from .timing import device_time_us

__all__ = ["PREFILL_SHAPES", "PREFILL_TOKENS", "prefill_benchmark", "format_prefill_table"]

PREFILL_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192))
PREFILL_TOKENS = (32, 64, 128, 256, 512, 2048, 8192)
FORMATS = ("nvfp4", "mxfp4")
LAYERS = 8
REPLAYS = 10


def _fp4_layers(out_f: int, in_f: int, fmt: str, device) -> list:
    """LAYERS FP4Linear modules with random bytes and scales (every code; NVFP4 scales 2^-4 .. 2^3, MXFP4 2^-8 ..
    2^-1), bf16."""
    g = torch.Generator(device=device).manual_seed(0)
    low, high = (0x18, 0x58) if fmt == "nvfp4" else (119, 127)
    layers = []
    for _ in range(LAYERS):
        m = FP4Linear(in_f, out_f, bias=False, fmt=fmt, scale_layout="swizzled", device=device)
        m.weight.copy_(torch.randint(0, 256, m.weight.shape, dtype=torch.uint8, device=device, generator=g))
        raw = torch.randint(low, high, m.weight_scale.shape, dtype=torch.uint8, device=device, generator=g)
        m.weight_scale.copy_(raw.view(m.weight_scale.dtype))
        layers.append(m.to(torch.bfloat16))
    return layers


def _check(layer, x: torch.Tensor) -> float:
    """max |y - exact| / max |exact| of the layer's output against the float64 oracle."""
    y = layer(x).double()
    exact = quantized_gemv_reference(layer.quantized_weight(), x, torch.float64).t()
    return float((y - exact).abs().max() / exact.abs().max())


def _median_us(launch, inputs) -> float:
    return statistics.median(device_time_us(launch, inputs, replays=REPLAYS))


def prefill_benchmark(shapes=PREFILL_SHAPES, tokens=PREFILL_TOKENS, formats=FORMATS) -> list[dict]:
    """Rows (shape, T, per-format FP4 us, bf16 us, fp8 us, the FP4 check at T = 32)."""
    device = "cuda"
    rows = []
    for out_f, in_f in shapes:
        g = torch.Generator(device=device).manual_seed(1)
        bf16 = [torch.randn(out_f, in_f, device=device, generator=g).bfloat16() for _ in range(LAYERS)]
        fp8 = [(w.float() / (w.abs().amax().float() / 448)).to(torch.float8_e4m3fn) for w in bf16]
        scale_w = [w.abs().amax().float() / 448 for w in bf16]
        fp4 = {fmt: _fp4_layers(out_f, in_f, fmt, device) for fmt in formats}
        for t in tokens:
            x = torch.randn(t, in_f, device=device, dtype=torch.bfloat16)
            x8 = x.to(torch.float8_e4m3fn)
            one = torch.ones((), device=device)
            row = {"shape": [out_f, in_f], "tokens": t}
            if t == tokens[0]:
                for fmt in formats:
                    row[f"{fmt}_rel_err"] = _check(fp4[fmt][0], x)
            for fmt in formats:
                row[f"{fmt}_us"] = _median_us(lambda layer: layer(x), fp4[fmt])
            row["bf16_us"] = _median_us(lambda w: F.linear(x, w), bf16)
            row["fp8_us"] = _median_us(
                lambda i: torch._scaled_mm(x8, fp8[i].t(), scale_a=one, scale_b=scale_w[i], out_dtype=torch.bfloat16),
                list(range(LAYERS)))
            rows.append(row)
            print(format_prefill_table([row], header=not rows[:-1]), flush=True)
        del bf16, fp8, fp4
        torch.cuda.empty_cache()
    return rows


def format_prefill_table(rows: list[dict], header: bool = True) -> str:
    """One line per (shape, T): times in us and the ratios to bf16 (NVFP4, MXFP4, FP8)."""
    lines = []
    if header:
        lines.append(f"{'shape':>13} {'T':>5} {'nvfp4 us':>9} {'mxfp4 us':>9} {'bf16 us':>9} {'fp8 us':>8} "
                     f"{'nv/bf16':>7} {'mx/bf16':>7} {'fp8/bf16':>8}  check")
    for r in rows:
        shape = f"{r['shape'][0]}x{r['shape'][1]}"
        nv, mx, b, f8 = (r.get(k, float("nan")) for k in ("nvfp4_us", "mxfp4_us", "bf16_us", "fp8_us"))
        check = " ".join(f"{k.split('_')[0]} {r[k]:.1e}" for k in ("nvfp4_rel_err", "mxfp4_rel_err") if k in r)
        lines.append(f"{shape:>13} {r['tokens']:>5} {nv:>9.1f} {mx:>9.1f} {b:>9.1f} {f8:>8.1f} {nv / b:>7.2f} "
                     f"{mx / b:>7.2f} {f8 / b:>8.2f}  {check}")
    return "\n".join(lines)
