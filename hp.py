import cProfile, pstats, sys, io
import torch
from torch import nn
from fp4gemv import gemv, task
from fp4gemv.nn import FP4Linear
from fp4gemv.bench.cases import Shape, random_gemv_operands, random_task_input
from fp4gemv.bench.host import _unbatched
from fp4gemv.bench.timing import host_time_us

def prof(label, fn, n=2000):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    us = host_time_us(fn)
    p = cProfile.Profile(); p.enable()
    for _ in range(n): fn()
    p.disable(); torch.cuda.synchronize()
    s = io.StringIO(); st = pstats.Stats(p, stream=s); st.sort_stats("tottime").print_stats(18)
    print(f"===== {label}: {us:.2f} us/call", flush=True)
    print("\n".join(l for l in s.getvalue().splitlines() if l.strip())[:6000], flush=True)

x = torch.zeros(16, device="cuda")
prof("add_", lambda: x.add_(1))
for fmt, act, n in (("nvfp4", "bf16", 1), ("mxfp4", "bf16", 1), ("nvfp4", "fp16", 8)):
    a, b, out = random_gemv_operands(Shape(4096, 4096, 1, n), fmt, act, seed=0)
    a, b, out = _unbatched(a), _unbatched(b), out[0]
    prof(f"gemv {fmt} {act} N={n}", lambda: gemv(a, b, out=out))
data = random_task_input(4096, 4096, 1, seed=0)
prof("task.custom_kernel", lambda: task.custom_kernel(data))
xx = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
lin = nn.Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
m = FP4Linear.from_linear(lin, "nvfp4", activations="w4a4", input_scale=0.01)
with torch.no_grad():
    prof("FP4Linear w4a4 static", lambda: m(xx), 500)
    m2 = FP4Linear.from_linear(lin, "nvfp4", activations="w4a4")
    prof("FP4Linear w4a4 per-call", lambda: m2(xx), 500)
