import sys, os, torch
sys.path.insert(0, os.path.dirname(__file__))
import engine_probe as ep
from engine_dev import make, launch_engine
M, K = 7168, 16384
for N, cfg in [(1, (4, 1, 4, 88, 128)), (1, (4, 2, 4, 88, 152)), (16, (4, 2, 3, 128, 200))]:
    wq, sc, x = make(M, K, N, 0)
    out = torch.empty((N, M), dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        launch_engine(wq, sc, x, out, *cfg)
    torch.cuda.synchronize()
