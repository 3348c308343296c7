"""Device script: FP4Linear on the GPU, correctness and time against bf16 ``F.linear``.

    PYTHONPATH=src python benchmarks/fp4linear_prefill.py   -> a table; fp4linear_prefill.json in $OUT

Issue 14's prefill bar: FP4Linear at 512 tokens (dequantize the weight to bf16, then ``F.linear``) within 1.5x of
bf16 ``F.linear`` on the same shape.  Also the decode path (N = 1 and 8 tokens through ``fp4gemv.gemv``) for
reference, eager.  Times: CUDA events around 50 calls after 10 warm-up calls, median of 5 such runs, L2
not flushed (the weights of these shapes, 8-117 MB in bf16, mostly exceed the 60 MB L2 anyway).
Correctness first: every path against the float64 oracle (``fp4gemv.reference``).
"""

import json
import os
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from fp4gemv.nn import FP4Linear
from fp4gemv.reference import quantized_gemv_reference

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)]  # (out_features, in_features)


def time_us(fn, calls: int = 50, runs: int = 5) -> float:
    for _ in range(10):
        fn()
    samples = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def check(module: FP4Linear, x: torch.Tensor) -> float:
    """max |y - exact| / max |exact| for FP4Linear's output against the oracle of its own semantics."""
    y = module(x).double()
    activation = module.quantize_input(x) if module.activations == "w4a4" else x
    exact = quantized_gemv_reference(module.quantized_weight(), activation, torch.float64).t()
    return float((y - exact).abs().max() / exact.abs().max())


def main() -> None:
    torch.manual_seed(0)
    rows = []
    for out_features, in_features in SHAPES:
        linear = nn.Linear(in_features, out_features, bias=False, device="cuda", dtype=torch.bfloat16)
        for fmt, activations in (("nvfp4", "weight-only"), ("mxfp4", "weight-only"), ("nvfp4", "w4a4")):
            module = FP4Linear.from_linear(linear, fmt, activations=activations)
            row = {"shape": [out_features, in_features], "fmt": fmt, "activations": activations}
            for tokens in (1, 8, 512):
                x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
                if out_features * in_features <= 4096 * 14336:
                    row[f"rel_err_{tokens}"] = check(module, x)
                fp4 = time_us(lambda: module(x))
                bf16 = time_us(lambda: F.linear(x, linear.weight))
                row[f"fp4_us_{tokens}"], row[f"bf16_us_{tokens}"] = fp4, bf16
                row[f"ratio_{tokens}"] = fp4 / bf16
            rows.append(row)
            print(f"{out_features:6d} x {in_features:6d} {fmt} {activations:11s} "
                  + "  ".join(f"N={t}: {row[f'fp4_us_{t}']:8.1f} us vs bf16 {row[f'bf16_us_{t}']:8.1f} "
                              f"({row[f'ratio_{t}']:.2f}x)" for t in (1, 8, 512))
                  + "  rel err " + " ".join(f"{row.get(f'rel_err_{t}', float('nan')):.2e}" for t in (1, 8, 512)))
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "fp4linear_prefill.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
