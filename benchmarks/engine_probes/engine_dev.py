import sys, json, os, time, torch, triton
sys.path.insert(0, os.path.dirname(__file__))
import engine_probe as ep
from fp4gemv import FP4Tensor, gemv
from fp4gemv.bench.stream import best_read
from fp4gemv.bench.timing import device_time_us, summarize
from fp4gemv.bench.cases import Shape, _fp8_scaled_mm_us

E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
OUT = os.environ.get("OUT", "/tmp")
rows = []

def make(M, K, N, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    wq = torch.randint(0, 256, (M, K // 2), dtype=torch.uint8, device="cuda", generator=g)
    sc = torch.randint(0x18, 0x58, (M, K // 16), dtype=torch.uint8, device="cuda", generator=g)
    x = torch.randn((N, K), device="cuda", generator=g).to(torch.bfloat16)
    return wq, sc, x

def reference(wq, sc, x):
    lut = E2M1.cuda()
    v = torch.stack([lut[(wq & 15).long()], lut[(wq >> 4).long()]], -1).reshape(wq.shape[0], -1)
    s = sc.view(torch.float8_e4m3fn).float().repeat_interleave(16, 1)
    w = v * s
    return x.double() @ w.double().T, x.double().abs() @ w.double().abs().T

def launch_engine(wq, sc, x, out, W, T, S, R, C):
    args, kw, grid = ep.build(wq, sc, x, out, W=W, T=T, STAGES=S, CREGS=C)
    ep.engine_kernel[grid](*args, **kw, num_warps=4, maxnreg=R)

CONFIGS = {1: [(4, 1, 4, 128, 128), (4, 1, 4, 88, 128), (4, 2, 4, 88, 152), (4, 2, 4, 128, 168)],
           8: [(4, 1, 4, 88, 128), (4, 2, 3, 88, 152), (4, 2, 3, 128, 168)],
           16: [(4, 2, 2, 96, 168), (4, 2, 3, 128, 200), (4, 4, 2, 128, 232)]}
if __name__ != "__main__":
    pass
shapes = [(4096, 4096), (7168, 16384), (14336, 4096), (4096, 14336), (28672, 8192)]
if len(sys.argv) > 1 and sys.argv[1] == "quick":
    shapes = shapes[:2]
def main():
    global shapes
    t0 = time.time()
    # correctness first, every config, small and large shape
    for (M, K) in [(4096, 4096), (4096 + 48, 2048)]:
        for N, cfgs in CONFIGS.items():
            wq, sc, x = make(M, K, N, 1)
            ref, mag = reference(wq, sc, x)
            for cfg in cfgs:
                if K % (256 * cfg[0]):
                    continue
                out = torch.full((N, M), float("nan"), dtype=torch.bfloat16, device="cuda")
                try:
                    launch_engine(wq, sc, x, out, *cfg)
                    torch.cuda.synchronize()
                    err = ((out.double() - ref).abs() / (mag + 1e-30)).max().item()
                    bad = int((~torch.isfinite(out)).sum())
                except Exception as e:
                    err, bad = repr(e)[:200], -1
                print(f"check M={M} K={K} N={N} cfg={cfg} maxrel={err} nonfinite={bad}", flush=True)
    print("checks done", time.time() - t0, flush=True)
    for (M, K) in shapes:
        copies = max(20, -(-300_000_000 // (M * K // 2)))
        data = [make(M, K, 16, i) for i in range(copies)]
        rb_name, rb = best_read(M * K // 2 + M * K // 16)
        for N in (1, 8, 16):
            row = dict(M=M, K=K, N=N, read_us=rb)
            ins = [(wq, sc, x[:N].contiguous(), torch.empty((N, M), dtype=torch.bfloat16, device="cuda")) for wq, sc, x in data]
            for cfg in CONFIGS[N]:
                try:
                    t = summarize(device_time_us(lambda a: launch_engine(*a, *cfg), ins))["median_us"]
                except Exception as e:
                    t = repr(e)[:100]
                row[f"engine{cfg}"] = t
            # weight_only through the library, linear scales
            fins = [(FP4Tensor(wq.unsqueeze(0), sc.unsqueeze(0).view(torch.float8_e4m3fn), "nvfp4", "linear"),
                     x[:N].unsqueeze(0).contiguous(), torch.empty((1, M, N), dtype=torch.bfloat16, device="cuda")) for wq, sc, x in data]
            try:
                row["library"] = summarize(device_time_us(lambda a: gemv(a[0], a[1], out=a[2], out_dtype=torch.bfloat16), fins))["median_us"]
            except Exception as e:
                row["library"] = repr(e)[:100]
            del fins, ins
            row["fp8"] = _fp8_scaled_mm_us(Shape(M, K, 1, N))[0]
            print(json.dumps(row), flush=True)
            rows.append(row)
        del data
        torch.cuda.empty_cache()
    json.dump(rows, open(os.path.join(OUT, "engine_rows.json"), "w"), indent=1)
    print("total", time.time() - t0)

if __name__ == "__main__":
    main()
