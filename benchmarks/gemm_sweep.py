"""Device script: time a handful of the GEMM kernel's tile configurations per T on the four prefill shapes.

    PYTHONPATH=src python benchmarks/gemm_sweep.py [--fmt nvfp4|mxfp4] [--tokens 32,64,...]   -> gemm_sweep.json in $OUT

NVFP4 (default) weights, bf16 activations, swizzled scales, through ``fp4gemv.gemv(..., config=...)`` exactly as
FP4Linear calls it (the output written into a transposed view).  Each configuration is timed as
``fp4gemv bench --prefill`` times FP4Linear: one launch per distinct weight (8) in a CUDA graph, L2 flushed
before each replay, median of 10 replays; bf16 ``F.linear`` on the same shape is the reference.  A
configuration that fails to compile or launch is reported, not fatal.  Ends with the best configuration per
(shape, T) and the default's time next to it.  About 3 minutes on an H200.
"""

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F

from fp4gemv import FP4Tensor, gemv, ops
from fp4gemv.bench.prefill import PREFILL_SHAPES, PREFILL_TOKENS
from fp4gemv.bench.timing import device_time_us
from fp4gemv.kernels.gemm import GemmConfig, gemm_config

LAYERS = 8
SMALL_T = [GemmConfig(64, 64, 256, 4, 4), GemmConfig(128, 64, 128, 4, 4), GemmConfig(128, 64, 128, 4, 6),
           GemmConfig(256, 64, 128, 8, 3), GemmConfig(64, 64, 128, 4, 6),
           GemmConfig(32, 64, 256, 4, 4)]  # 32 weight rows: twice the programs on 4096 rows, no split-K yet
MID_T = [GemmConfig(128, 128, 128, 8, 4), GemmConfig(256, 128, 64, 8, 4), GemmConfig(256, 64, 128, 8, 3),
         GemmConfig(128, 256, 64, 8, 3), GemmConfig(128, 128, 64, 8, 6)]
LARGE_T = [GemmConfig(256, 128, 64, 8, 4), GemmConfig(128, 256, 64, 8, 4), GemmConfig(128, 128, 128, 8, 4),
           GemmConfig(256, 128, 128, 8, 3)]


def candidates(t: int) -> list[GemmConfig]:
    return SMALL_T if t <= 64 else MID_T if t <= 256 else LARGE_T


def weights(out_f: int, in_f: int, fmt: str) -> list[FP4Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    block = 16 if fmt == "nvfp4" else 32
    low, high = (0x18, 0x58) if fmt == "nvfp4" else (119, 127)
    out = []
    for _ in range(LAYERS):
        data = torch.randint(0, 256, (out_f, in_f // 2), dtype=torch.uint8, device="cuda", generator=g)
        scales = torch.randint(low, high, (out_f, in_f // block), dtype=torch.uint8, device="cuda", generator=g)
        out.append(FP4Tensor(data, scales, fmt, "linear").with_scale_layout("swizzled"))
    return out


def median_us(launch, inputs) -> float:
    return statistics.median(device_time_us(launch, inputs, replays=10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fmt", choices=("nvfp4", "mxfp4"), default="nvfp4")
    parser.add_argument("--tokens", default=",".join(map(str, PREFILL_TOKENS)))
    args = parser.parse_args()
    tokens = [int(v) for v in args.tokens.split(",")]
    rows = []
    for out_f, in_f in PREFILL_SHAPES:
        ws = weights(out_f, in_f, args.fmt)
        bf16 = [torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        for t in tokens:
            x = torch.randn(t, in_f, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(t, out_f, device="cuda", dtype=torch.bfloat16)
            default = gemm_config(ops.plan_for(ws[0], x, out=y.t(), out_dtype=torch.bfloat16).case)
            row = {"shape": [out_f, in_f], "tokens": t, "default": list(default),
                   "bf16_us": median_us(lambda w: F.linear(x, w), bf16), "configs": {}}
            for config in dict.fromkeys(candidates(t) + [default]):
                try:
                    us = median_us(lambda w: gemv(w, x, out=y.t(), out_dtype=torch.bfloat16, config=config), ws)
                except Exception as exc:  # a configuration that does not compile or launch: reported
                    row["configs"][",".join(map(str, config))] = f"failed: {type(exc).__name__}: {exc}"[:200]
                    print(out_f, in_f, t, config, "failed:", exc, flush=True)
                    continue
                row["configs"][",".join(map(str, config))] = us
                print(f"{out_f:6d}x{in_f:<6d} T={t:5d} {config} {us:9.1f} us  bf16 {row['bf16_us']:9.1f} us",
                      flush=True)
            rows.append(row)
        del ws, bf16
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "gemm_sweep.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "fmt": args.fmt, "rows": rows}, f, indent=1)
    print(f"\n{'shape':>13} {'T':>5} {'best config (m, n, k, warps, stages)':>38} {'us':>8} {'default us':>10} "
          f"{'bf16 us':>8} {'best/bf16':>9}")
    for r in rows:
        timed = {k: v for k, v in r["configs"].items() if isinstance(v, float)}
        if not timed:
            print(f"{r['shape'][0]}x{r['shape'][1]:<6} {r['tokens']:>5} every configuration failed")
            continue
        best = min(timed, key=timed.get)
        d = r["configs"].get(",".join(map(str, r["default"])), float("nan"))
        d = d if isinstance(d, float) else float("nan")
        print(f"{r['shape'][0]:>6}x{r['shape'][1]:<6} {r['tokens']:>5} {best:>38} {timed[best]:>8.1f} {d:>10.1f} "
              f"{r['bf16_us']:>8.1f} {timed[best] / r['bf16_us']:>9.2f}")


if __name__ == "__main__":
    main()
