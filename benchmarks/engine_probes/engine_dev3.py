import sys, json, os, time, torch
sys.path.insert(0, os.path.dirname(__file__))
import engine_probe as ep
from engine_dev import make, reference
from fp4gemv.bench.timing import device_time_us, summarize

def launch_p(wq, sc, x, out32, W, T, S, R, ctas, variant):
    args, kw, grid = ep.build_persistent(wq, sc, x, out32, W=W, T=T, STAGES=S, variant=variant, ctas=ctas)
    ep.persistent_kernel[grid](*args, **kw, num_warps=W, maxnreg=R)

def launch(wq, sc, x, out, W, T, S, R, variant):
    args, kw, grid = ep.build(wq, sc, x, out, W=W, T=T, STAGES=S, variant=variant)
    ep.engine_kernel[grid](*args, **kw, num_warps=W, maxnreg=R)

CFGS = [(1, (4, 1, 4, 80), 396), (1, (4, 1, 4, 128), 264), (1, (4, 2, 4, 128), 264), (1, (4, 2, 6, 128), 132),
        (16, (4, 2, 2, 128), 264), (16, (4, 2, 4, 168), 132)]
for (M, K) in [(4096, 4096), (4144, 2048)]:
    for N, cfg, ctas in CFGS:
        wq, sc, x = make(M, K, N, 1)
        ref, mag = reference(wq, sc, x)
        out = torch.zeros((N, M), dtype=torch.float32, device="cuda")
        launch_p(wq, sc, x, out, *cfg, ctas, "full")
        torch.cuda.synchronize()
        print("check", M, K, N, cfg, ctas, ((out.double() - ref).abs() / (mag + 1e-30)).max().item(), flush=True)
for (M, K) in [(7168, 16384), (28672, 8192), (4096, 4096), (14336, 4096), (4096, 14336)]:
    copies = max(20, -(-300_000_000 // (M * K // 2)))
    data = [make(M, K, 16, i) for i in range(copies)]
    for N, cfg, ctas in CFGS:
        ins = [(wq, sc, x[:N].contiguous(), torch.zeros((N, M), dtype=torch.float32, device="cuda")) for wq, sc, x in data]
        row = {}
        for v in ("full", "nodecode"):
            row["p_" + v] = round(summarize(device_time_us(lambda a: launch_p(*a, *cfg, ctas, v), ins))["median_us"], 2)
        ins = [(wq, sc, x[:N].contiguous(), torch.empty((N, M), dtype=torch.bfloat16, device="cuda")) for wq, sc, x in data]
        row["v0_full"] = round(summarize(device_time_us(lambda a: launch(*a, *cfg, "full"), ins))["median_us"], 2)
        print(M, K, N, cfg, ctas, row, flush=True)
    del data, ins
    torch.cuda.empty_cache()
