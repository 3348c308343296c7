import sys, os, torch
sys.path.insert(0, os.path.dirname(__file__))
import engine_probe as ep
from engine_dev import make
from fp4gemv.bench.timing import device_time_us, summarize

def launch_p(wq, sc, x, out32, W, T, S, R, ctas, variant, epi):
    args, kw, grid = ep.build_persistent(wq, sc, x, out32, W=W, T=T, STAGES=S, variant=variant, ctas=ctas, epi=epi)
    ep.persistent_kernel[grid](*args, **kw, num_warps=W, maxnreg=R)

CFGS = [((4, 1, 4, 80), 396), ((4, 1, 8, 80), 264), ((4, 2, 4, 128), 264), ((4, 2, 8, 128), 132), ((4, 4, 4, 168), 132)]
for (M, K) in [(7168, 16384), (28672, 8192), (4096, 4096)]:
    copies = max(20, -(-300_000_000 // (M * K // 2)))
    data = [make(M, K, 1, i) for i in range(copies)]
    ins = [(wq, sc, x, torch.zeros((1, M), dtype=torch.float32, device="cuda")) for wq, sc, x in data]
    for cfg, ctas in CFGS:
        row = {}
        for v in ("noconsume", "nodecode", "full"):
            for epi in (False, True):
                try:
                    row[f"{v}{'+epi' if epi else ''}"] = round(summarize(device_time_us(lambda a: launch_p(*a, *cfg, ctas, v, epi), ins))["median_us"], 2)
                except Exception as e:
                    row[v] = repr(e)[:80]
        print("ROW", M, K, cfg, ctas, row, flush=True)
    del data, ins
    torch.cuda.empty_cache()
