"""GPU probe 9: kernels/stream.py through fp4gemv.gemv: exactness on full-range operands, then time per ksplit."""
import os, sys, json, statistics
sys.path.insert(0, "src"); sys.path.insert(0, "tests")
import torch
import operands as O
from fp4gemv import ops
from fp4gemv.kernels.stream import StreamConfig
from fp4gemv.bench.cases import Shape, random_gemv_operands, case_bytes
from fp4gemv.bench.timing import device_time_us, input_count
def med(launch, inputs): return round(statistics.median(device_time_us(launch, inputs)), 2)
# exactness: full-range operands (all codes, wide scales), both layouts, both dtypes, tails, global scale
bad = 0
for layout in ("swizzled", "linear"):
    for dtype in (torch.bfloat16, torch.float16):
        for (m, k, n, L, gs) in ((4096, 4096, 16, 1, None), (1000, 2048, 9, 2, 0.375), (7168, 1024, 13, 1, None)):
            a = O.random_fp4((L, m, k) if L > 1 else (m, k), "nvfp4", layout, seed=m, global_scale=gs, device="cuda")
            b = O.random_activation((n, k), dtype, seed=k, device="cuda")
            for ks in (1, 2, 4):
                if (k // 256) % ks: continue
                out = O.poisoned(O.result_shape(a, b), torch.bfloat16, device="cuda")
                ops.gemv(a, b, out=out, out_dtype=torch.bfloat16, kernel="stream", config=StreamConfig(64, 256, ks, 2, 4))
                ok = O.within_bound(out.cpu(), a.to("cpu"), b.cpu(), torch.bfloat16, tensor_cores=True, fold=7 if dtype == torch.bfloat16 else 14)
                bad += int((~ok).sum())
print("exactness: outputs off the bound:", bad, flush=True)
for m, k, l in ((7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4), (4096, 4096, 1), (14336, 4096, 1), (4096, 14336, 1), (28672, 8192, 1), (1024, 4096, 1)):
    for n in (1, 8, 16):
        shape = Shape(m, k, l, n)
        inputs = [random_gemv_operands(shape, "nvfp4", "bf16", seed=i) for i in range(input_count(case_bytes(shape, "nvfp4", "bf16")))]
        a, b, out = inputs[0]
        plan = ops.plan_for(a, b, out=out)
        row = dict(shape=shape.label(), n=n, shipped=plan.spec.name, us=med(lambda x: ops.gemv(x[0], x[1], out=x[2]), inputs))
        if plan.spec.name != "stream":
            for ks in (1, 2, 4, 8):
                if (k // 256) % ks: continue
                cfg = StreamConfig(64, 256, ks, 2, 4 if ks < 8 else 3)
                row[f"ks{ks}"] = med(lambda x: ops.gemv(x[0], x[1], out=x[2], kernel="stream", config=cfg), inputs)
        else:
            row["cfg"] = tuple(plan.config)
            for ks in (1, 2, 4, 8):
                if (k // 256) % ks: continue
                cfg = StreamConfig(64, 256, ks, 2, 4 if ks < 8 else 3)
                row[f"ks{ks}"] = med(lambda x: ops.gemv(x[0], x[1], out=x[2], kernel="stream", config=cfg), inputs)
        print(json.dumps(row), flush=True)
        del inputs; torch.cuda.empty_cache()
