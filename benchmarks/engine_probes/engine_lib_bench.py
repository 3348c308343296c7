"""The engine through fp4gemv.gemv against the streaming kernel (the previous default for 9 <= N <= 16 with linear
scales) and weight_only, same protocol as fp4gemv bench; host time of one eager call against x.add_(1)."""
import json, os, sys, torch
from fp4gemv import FP4Tensor, gemv
from fp4gemv.bench.timing import device_time_us, summarize, host_time_us

def fp4(m, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    data = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device="cuda", generator=g)
    sc = torch.randint(0x18, 0x58, (m, k // 16), dtype=torch.uint8, device="cuda", generator=g)
    return FP4Tensor(data, sc, "nvfp4", "linear")

rows = []
for m, k in [(7168, 16384), (28672, 8192), (14336, 4096), (4096, 14336), (4096, 4096)]:
    copies = max(20, -(-300_000_000 // (m * k // 2)))
    ws = [fp4(m, k, i) for i in range(copies)]
    for n in (8, 9, 12, 16):
        x = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        row = dict(M=m, K=k, N=n)
        for kernel in (("engine", "stream") if n > 8 else ("engine", "weight_only")):
            ins = [(w, x, torch.empty(m, n, dtype=torch.bfloat16, device="cuda")) for w in ws]
            row[kernel] = round(summarize(device_time_us(
                lambda a: gemv(a[0], a[1], out=a[2], out_dtype=torch.bfloat16, kernel=kernel), ins))["median_us"], 2)
        print("ROW", json.dumps(row), flush=True)
        rows.append(row)
    del ws
    torch.cuda.empty_cache()
w, x = fp4(4096, 4096, 0), torch.randn(16, 4096, device="cuda").to(torch.bfloat16)
out = torch.empty(4096, 16, dtype=torch.bfloat16, device="cuda")
t = torch.zeros(1, device="cuda")
host = {"add_": host_time_us(lambda: t.add_(1))}
for kernel in ("engine", "stream"):
    host[kernel] = host_time_us(lambda: gemv(w, x, out=out, out_dtype=torch.bfloat16, kernel=kernel))
host["add_ again"] = host_time_us(lambda: t.add_(1))
print("HOST", json.dumps({k: round(v, 2) for k, v in host.items()}), flush=True)
json.dump(dict(rows=rows, host=host), open(os.path.join(os.environ.get("OUT", "/tmp"), "engine_lib.json"), "w"), indent=1)
