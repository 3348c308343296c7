"""Where an eager kept launch spends its host time (round 26): cProfile over repeated ``gemv(a, b, out=out)`` calls of
the engine (N = 16, 4 and N = 1 on weight_only) on 4096 x 4096, next to ``x.add_(1)``.  From the repo root:
PYTHONPATH=src python benchmarks/host_profile.py"""
import cProfile
import pstats
import sys
import time

import torch

sys.path.insert(0, "tests")
import operands as O  # noqa: E402
from fp4gemv import gemv, select_kernel  # noqa: E402

x = torch.zeros(16, device="cuda")
for n in (16, 4, 1):
    a = O.random_fp4((4096, 4096), "nvfp4", "swizzled", seed=1, device="cuda")
    b = O.random_activation((n, 4096), torch.bfloat16, seed=2, device="cuda")
    out = torch.empty((4096, n), dtype=torch.float16, device="cuda")
    name = select_kernel(a, b, out=out).name
    for _ in range(50):
        gemv(a, b, out=out)
    torch.cuda.synchronize()
    for label, fn in (("add_", lambda: x.add_(1)), (f"gemv N={n} [{name}]", lambda: gemv(a, b, out=out))):
        t0 = time.perf_counter()
        for _ in range(2000):
            fn()
        torch.cuda.synchronize()
        print(f"{label:<28} {(time.perf_counter() - t0) / 2000 * 1e6:8.2f} us/call", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        gemv(a, b, out=out)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
