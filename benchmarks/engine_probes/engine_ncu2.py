import sys, os, torch
sys.path.insert(0, os.path.dirname(__file__))
from engine_dev6 import launch_p
from engine_dev import make
M, K = 7168, 16384
for v in ("full", "nodecode", "noconsume"):
    wq, sc, x = make(M, K, 1, 0)
    out = torch.zeros((1, M), dtype=torch.float32, device="cuda")
    for _ in range(2):
        launch_p(wq, sc, x, out, 4, 2, 4, 128, 264, False, v)
    torch.cuda.synchronize()
