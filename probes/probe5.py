"""GPU probe 5: L2 prefetch AHEAD steps in the shipped w4a4 (task) and weight_only kernels."""
import os, sys, json, statistics, time
sys.path.insert(0, "src")
import torch
from fp4gemv import ops, select_kernel
from fp4gemv.bench.cases import Shape, random_gemv_operands, case_bytes
from fp4gemv.bench.timing import device_time_us, input_count
from fp4gemv.bench.stream import stream_read

def med(launch, inputs): return round(statistics.median(device_time_us(launch, inputs)), 2)
rows = []
SH = [Shape(7168, 16384), Shape(4096, 7168, 8), Shape(7168, 2048, 4), Shape(4096, 4096), Shape(14336, 4096), Shape(4096, 14336), Shape(28672, 8192)]
CASES = [("nvfp4", "fp4", 1), ("nvfp4", "bf16", 1), ("mxfp4", "bf16", 1), ("nvfp4", "bf16", 8)]
AHEADS = [int(a) for a in os.environ.get("AHEADS", "0,2,4,8").split(",")]
t0 = time.time()
for shape0 in SH:
    nb = case_bytes(shape0, "nvfp4", "fp4")
    bufs = [torch.empty(nb // 8 * 8, dtype=torch.uint8, device="cuda") for _ in range(input_count(nb))]
    o = torch.empty(1 << 16, dtype=torch.int64, device="cuda")
    read = med(lambda b: stream_read(b, o, pdl=True), bufs); del bufs
    for fmt, act, n in CASES:
        shape = Shape(shape0.m, shape0.k, shape0.l, n)
        nbytes = case_bytes(shape, fmt, act)
        inputs = [random_gemv_operands(shape, fmt, act, seed=i) for i in range(input_count(nbytes))]
        a, b, out = inputs[0]
        plan = ops.plan_for(a, b, out=out)
        row = dict(shape=shape0.label(), fmt=fmt, act=act, n=n, kernel=plan.spec.name, triton_read_nvfp4_w4a4_bytes=read)
        ref = ops.gemv(a, b, out_dtype=torch.float16).clone()
        for ahead in AHEADS:
            cfg = plan.config._replace(ahead=ahead)
            got = ops.gemv(a, b, out_dtype=torch.float16, config=cfg, kernel=plan.spec.name)
            same = bool(torch.equal(got, ref))
            row[f"ahead{ahead}"] = (med(lambda x: ops.gemv(x[0], x[1], out=x[2], config=cfg, kernel=plan.spec.name), inputs), same)
        rows.append(row); print(json.dumps(row), flush=True)
        del inputs; torch.cuda.empty_cache()
    print("elapsed", round(time.time() - t0), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe5.json"), "w"), indent=1)
