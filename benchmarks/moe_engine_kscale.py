"""Device script (round 15 of docs/performance.md): the routed kernels against the dense ones on the same bytes as K
grows.

    PYTHONPATH=src python benchmarks/moe_engine_kscale.py   -> kscale.json in $OUT (or .)

4 NVFP4 experts of 7168 x K (K = 2048 .. 16384, linear scales, no global scale): ``moe_gemv`` with
``kernel="moe_engine"`` and ``"moe_weight_only"`` at T = 1 (ids 0..3) and T = 8 (every token on the same 4), and the
dense ``engine`` and ``weight_only`` on the same bytes viewed as one [4 * 7168, K] matrix at N = 1, against the best
read of those bytes.  Timing: ``bench.timing.device_time_us`` over 6 copies (L2 flushed, median of 15).
"""
import json, os, statistics, torch, fp4gemv
from fp4gemv.bench.stream import best_read
from fp4gemv.bench.timing import device_time_us
from fp4gemv.tensor import FP4Tensor
OUT = os.environ.get("OUT", ".")
med = statistics.median
rows = []
g = torch.Generator(device="cuda").manual_seed(0)
for K in (2048, 4096, 8192, 16384):
    E, M, C = 4, 7168, 6
    ws = []
    for c in range(C):
        d = torch.randint(0, 256, (E, M, K // 2), dtype=torch.uint8, device="cuda", generator=g)
        s = torch.randint(0x28, 0x48, (E, M, K // 16), dtype=torch.uint8, device="cuda", generator=g)
        ws.append(FP4Tensor(d, s, "nvfp4", "linear"))
    x = torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16)
    xx = torch.randn(16, K, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32, device="cuda")
    ids8 = torch.tensor([[0, 1, 2, 3]] * 8, dtype=torch.int32, device="cuda")
    nbytes = E * M * (K // 2 + K // 16)
    _, read = best_read(nbytes)
    res = dict(K=K, read_us=read)
    for name, fn in [("moe_engine", lambda c: fp4gemv.moe_gemv(ws[c], x, ids, check_ids=False, kernel="moe_engine")),
                     ("moe_weight_only", lambda c: fp4gemv.moe_gemv(ws[c], x, ids, check_ids=False, kernel="moe_weight_only")),
                     ("moe_engine_T8", lambda c: fp4gemv.moe_gemv(ws[c], xx[:8], ids8, check_ids=False, kernel="moe_engine")),
                     ("moe_weight_only_T8", lambda c: fp4gemv.moe_gemv(ws[c], xx[:8], ids8, check_ids=False, kernel="moe_weight_only")),
                     ("dense_engine_N1", lambda c: fp4gemv.gemv(FP4Tensor(ws[c].data.reshape(E * M, K // 2), ws[c].scales.reshape(E * M, K // 16), "nvfp4", "linear"), x, kernel="engine")),
                     ("dense_weight_only_N1", lambda c: fp4gemv.gemv(FP4Tensor(ws[c].data.reshape(E * M, K // 2), ws[c].scales.reshape(E * M, K // 16), "nvfp4", "linear"), x, kernel="weight_only"))]:
        try:
            res[name] = med(device_time_us(fn, range(C)))
        except Exception as exc:
            res[name] = repr(exc)[:200]
    rows.append(res)
    print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in res.items()}, flush=True)
    json.dump(rows, open(os.path.join(OUT, "kscale.json"), "w"), indent=1)
