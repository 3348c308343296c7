import sys, os, json, torch
sys.path.insert(0, os.path.dirname(__file__))
import engine_probe as ep
from engine_dev import make, reference
from fp4gemv.bench.timing import device_time_us, summarize

def launch_p(wq, sc, x, out32, W, T, S, R, ctas, epi, variant="full"):
    args, kw, grid = ep.build_persistent(wq, sc, x, out32, W=W, T=T, STAGES=S, variant=variant, ctas=ctas, epi=epi)
    ep.persistent_kernel[grid](*args, **kw, num_warps=W, maxnreg=R)

CFGS = {1: [((4, 1, 4, 80), 396), ((4, 2, 4, 128), 264), ((4, 4, 3, 168), 132)],
        8: [((4, 1, 3, 80), 396), ((4, 2, 3, 128), 264), ((4, 4, 3, 168), 132)],
        16: [((4, 2, 2, 128), 264), ((4, 2, 3, 168), 132), ((4, 4, 3, 168), 132)]}
def main():
    for N, cfgs in CFGS.items():
        for cfg, ctas in cfgs:
            M, K = 4144, 2048
            wq, sc, x = make(M, K, N, 1)
            ref, mag = reference(wq, sc, x)
            out = torch.zeros((N, M), dtype=torch.float32, device="cuda")
            launch_p(wq, sc, x, out, *cfg, ctas, True)
            torch.cuda.synchronize()
            print("check", N, cfg, ctas, ((out.double() - ref).abs() / (mag + 1e-30)).max().item(), flush=True)
    rows = []
    for (M, K) in [(7168, 16384), (28672, 8192), (14336, 4096), (4096, 14336), (4096, 4096)]:
        copies = max(20, -(-300_000_000 // (M * K // 2)))
        data = [make(M, K, 16, i) for i in range(copies)]
        for N, cfgs in CFGS.items():
            ins = [(wq, sc, x[:N].contiguous(), torch.zeros((N, M), dtype=torch.float32, device="cuda")) for wq, sc, x in data]
            row = dict(M=M, K=K, N=N)
            for cfg, ctas in cfgs:
                row[str(cfg)] = round(summarize(device_time_us(lambda a: launch_p(*a, *cfg, ctas, False), ins))["median_us"], 2)
            print("ROW", json.dumps(row), flush=True)
            rows.append(row)
        del data, ins
        torch.cuda.empty_cache()
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "persistent_rows.json"), "w"), indent=1)

if __name__ == "__main__":
    main()
