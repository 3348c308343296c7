"""Device script: launch the W4A4 kernel once per configuration, for ncu to profile.

ncu --clock-control none -k regex:w4a4 python benchmarks/profile_one.py M K L rows,blocks,warps[,ksplit,unroll] ...
"""

import sys

import torch

from fp4gemv import bench, ops
from fp4gemv.kernels.configs import GemvConfig

m, k, l = (int(x) for x in sys.argv[1:4])
x = bench.random_task_operands(m, k, l, seed=0)
for spec in sys.argv[4:]:
    rows, blocks, warps, ksplit, unroll = ([int(v) for v in spec.split(",")] + [1, 1])[:5]
    ops.task_gemv(*x, config=GemvConfig(rows, blocks, warps, ksplit=ksplit, unroll=unroll))
torch.cuda.synchronize()
