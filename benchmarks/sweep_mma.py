"""Device script: check the tensor-core kernel (kernels/mma_gemv.py) and sweep its configurations (sweep 9).

PYTHONPATH=src python benchmarks/sweep_mma.py [phase ...]   -> one line per measurement; sweep_mma.json in $OUT.
Phases: ``check`` (PTX against pure Triton bit for bit, and against the exact oracle), ``configs`` (every
configuration on every shape, fp16 activation, N = 1), ``cases`` (the best configurations of ``configs`` on
bf16, N = 2..16 and FP4 activations).  Device time as in ``fp4gemv bench``: graph replay, L2 flushed.
"""

import json
import os
import sys
import time

import torch

from fp4gemv import gemv
from fp4gemv.bench import DECODE_SHAPES, TASK_SHAPES, Shape, case_bytes, device_time_us, floor_us, input_count
from fp4gemv.bench import random_gemv_operands, summarize
from fp4gemv.kernels.configs import MmaConfig, mma_config
from fp4gemv.reference import quantized_gemv_reference

SHAPES = TASK_SHAPES + DECODE_SHAPES
CONFIGS = [MmaConfig(*c) for c in (
    (16, 256, 1, 3), (32, 256, 2, 3), (16, 128, 1, 3),  # sweep 9a's best (no ksplit)
    (16, 64, 4, 1, 4), (16, 128, 4, 1, 4), (32, 64, 4, 1, 4), (32, 128, 4, 1, 4), (64, 64, 4, 1, 4),
    (32, 64, 8, 1, 8), (16, 64, 8, 1, 8), (16, 128, 8, 1, 8), (32, 64, 4, 3, 4), (16, 64, 4, 3, 4),
    (16, 128, 4, 3, 4), (64, 64, 8, 1, 8))]
RESULTS = []


def check():
    for act, n in (("fp16", 1), ("bf16", 1), ("fp16", 16), ("bf16", 5), ("fp4", 2), ("fp4", 16)):
        for shape in (Shape(2432, 4608, 2, n), Shape(7168, 2048, 4, n), Shape(256, 192, 1, n)):
            a, b, _ = random_gemv_operands(shape, "nvfp4", act, seed=7)
            exact = quantized_gemv_reference(a, b, torch.float64)
            bv = b.dequantize(torch.float64) if act == "fp4" else b.double()
            magnitude = a.dequantize(torch.float64).abs() @ bv.abs().transpose(-1, -2)
            for cfg in (None, MmaConfig(16, 128, 1), MmaConfig(64, 128, 4), MmaConfig(32, 64, 4, 1, 4),
                        MmaConfig(16, 64, 8, 3, 8)):
                ptx = gemv(a, b, out_dtype=torch.float32, backend="triton-ptx", config=cfg)
                pure = gemv(a, b, out_dtype=torch.float32, backend="triton", config=cfg)
                same = torch.equal(ptx.view(torch.int32), pure.view(torch.int32))
                err = ((ptx.double() - exact).abs() / magnitude.clamp(min=1e-30)).max().item()
                ok = same and err <= (shape.k + 24) * 2.0**-23
                print(f"check {act} N={n} {shape.m}x{shape.k}x{shape.l} {cfg}: ptx==triton {same}, "
                      f"max err / sum|t| {err:.2e} {'OK' if ok else 'FAIL'}", flush=True)


def measure(shape, act, cfg, inputs):
    times = device_time_us(lambda x: gemv(x[0], x[1], out=x[2], config=cfg), inputs)
    t = summarize(times)["median_us"]
    nbytes = case_bytes(shape, "nvfp4", act)
    row = {"shape": [shape.m, shape.k, shape.l, shape.n], "act": act, "cfg": cfg._asdict(), "us": t,
           "floor_pct": 100 * floor_us(nbytes) / t}
    RESULTS.append(row)
    return row


def inputs_for(shape, act):
    return [random_gemv_operands(shape, "nvfp4", act, seed=i) for i in range(input_count(case_bytes(shape, "nvfp4", act)))]


def configs_phase(deadline):
    best = {}
    for s in SHAPES:
        shape = Shape(s.m, s.k, s.l, 1)
        inputs = inputs_for(shape, "fp16")
        line = []
        for cfg in CONFIGS:
            if time.time() > deadline:
                break
            r = measure(shape, "fp16", cfg, inputs)
            line.append((r["us"], cfg))
        line.sort(key=lambda x: x[0])
        best[(s.m, s.k, s.l)] = [c for _, c in line[:3]]
        print(f"{shape.m}x{shape.k}x{shape.l} fp16 N=1 floor {floor_us(case_bytes(shape, 'nvfp4', 'fp16')):.2f}: "
              + " | ".join(f"{c.rows}/{c.block_k}/{c.num_warps}/{c.num_stages}/ks{c.ksplit} {t:.2f}" for t, c in line),
              flush=True)
        del inputs
        torch.cuda.empty_cache()
    return best


def cases_phase(best, deadline):
    for s in SHAPES:
        cfgs = best.get((s.m, s.k, s.l), [mma_config(s.m, s.k, s.l)])[:2]
        for act, n in (("bf16", 1), ("fp16", 2), ("fp16", 8), ("fp16", 16), ("fp4", 2), ("fp4", 8), ("fp4", 16)):
            if time.time() > deadline:
                return
            shape = Shape(s.m, s.k, s.l, n)
            inputs = inputs_for(shape, act)
            res = [measure(shape, act, cfg, inputs) for cfg in cfgs]
            print(f"{shape.m}x{shape.k}x{shape.l} {act} N={n}: "
                  + " | ".join(f"{c.rows}/{c.block_k}/{c.num_warps}/{c.num_stages}/ks{c.ksplit} {r['us']:.2f} ({r['floor_pct']:.0f}%)"
                               for c, r in zip(cfgs, res)), flush=True)
            del inputs
            torch.cuda.empty_cache()


def main():
    phases = sys.argv[1:] or ["check", "configs", "cases"]
    start = time.time()
    budget = float(os.environ.get("SWEEP_SECONDS", "480"))
    if "check" in phases:
        check()
    best = {}
    if "configs" in phases:
        best = configs_phase(start + 0.6 * budget)
    if "cases" in phases:
        cases_phase(best, start + budget)
    with open(os.path.join(os.environ.get("OUT", "."), "sweep_mma.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    print(f"done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
