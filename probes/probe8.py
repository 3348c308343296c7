"""GPU probe 8: the prefill GEMM kernel (wt-gemm snapshot) at N = 1, 8, 16 against the shipped dispatch."""
import os, sys, json, statistics
sys.path.insert(0, ".proto/gemm_src")
import torch
import fp4gemv
from fp4gemv import ops
from fp4gemv.kernels import gemm as G
from fp4gemv.bench.cases import Shape, random_gemv_operands, case_bytes
from fp4gemv.bench.timing import device_time_us, input_count
G.MIN_N = 1
def med(launch, inputs): return round(statistics.median(device_time_us(launch, inputs)), 2)
CFGS = [G.GemmConfig(64, 64, 256, 4, 4), G.GemmConfig(128, 64, 128, 4, 4), G.GemmConfig(64, 64, 128, 4, 6),
        G.GemmConfig(32, 64, 256, 4, 4), G.GemmConfig(128, 64, 256, 4, 3), G.GemmConfig(64, 64, 512, 4, 3), G.GemmConfig(256, 64, 128, 8, 3)]
for m, k in ((7168, 16384), (28672, 8192), (4096, 4096), (14336, 4096), (4096, 14336)):
    for n in (1, 8, 16):
        shape = Shape(m, k, 1, n)
        inputs = [random_gemv_operands(shape, "nvfp4", "bf16", seed=i) for i in range(input_count(case_bytes(shape, "nvfp4", "bf16")))]
        a, b, out = inputs[0]
        ref = ops.gemv(a, b, out_dtype=torch.float16, backend="reference") if False else None
        base = ops.plan_for(a, b, out=out)
        row = dict(shape=f"{m}x{k}", n=n, shipped=base.spec.name, shipped_us=med(lambda x: ops.gemv(x[0], x[1], out=x[2]), inputs))
        exact = ops.gemv(a.to("cpu"), b.to("cpu"), out_dtype=torch.float32, backend="reference") if m * k <= 4096 * 4096 else None
        for cfg in CFGS:
            try:
                got = ops.gemv(a, b, out_dtype=torch.float32, kernel="gemm", config=cfg)
                err = None if exact is None else float(((got.cpu() - exact).abs().max() / exact.abs().max()))
                row[str(tuple(cfg))] = (med(lambda x: ops.gemv(x[0], x[1], out=x[2], kernel="gemm", config=cfg), inputs), err)
            except Exception as e:
                row[str(tuple(cfg))] = (None, str(e)[:60])
        print(json.dumps(row), flush=True)
        del inputs; torch.cuda.empty_cache()
