"""Offline SASS statistics of the GEMM kernel (no GPU; TRITON_INTERPRET unset): compile what ``gemv`` launches on
sm_90 for a 4096 x 4096 weight times 512 bf16/fp16 rows with each configuration, and count its main loop.

    PYTHONPATH=src python benchmarks/gemm_sass.py [M,N,K,WARPS,STAGES ...]   (default: kernels.gemm.SHIPPED_CONFIGS)

Per configuration and format: registers, local memory, the main loop's instructions (the backward branch with
the most MMA instructions) per weight a thread decodes, the ALU-pipe share of them (benchmarks/sass_stats.py's
opcode set: the decode's prmt and lop3), and the shared-memory stores and loads by width.
"""

import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))
from aot import Sm90Launch, local_memory, mma_loop, registers, sass_listing  # noqa: E402
from sass_stats import ALU  # noqa: E402

from fp4gemv import FP4Tensor  # noqa: E402
from fp4gemv.kernels.gemm import SHIPPED_CONFIGS, GemmConfig  # noqa: E402


def main() -> None:
    configs = [GemmConfig(*map(int, a.split(","))) for a in sys.argv[1:]] or list(SHIPPED_CONFIGS)
    print(f"{'config':>22} {'format':>12} {'regs':>4} {'local':>6} {'loop':>5} {'/weight':>7} {'ALU/w':>6}  shared")
    for config in configs:
        for fmt, act in (("nvfp4", torch.bfloat16), ("mxfp4", torch.bfloat16), ("nvfp4", torch.float16)):
            block = 16 if fmt == "nvfp4" else 32
            a = FP4Tensor(torch.zeros(4096, 2048, dtype=torch.uint8),
                          torch.full((4096, 4096 // block), 0x38, dtype=torch.uint8), fmt, "linear")
            compiled = Sm90Launch(a.with_scale_layout("swizzled"), torch.zeros(512, 4096, dtype=act),
                                  config=config).compile()
            body = mma_loop(sass_listing(compiled))
            per_weight = config.block_m * config.block_k / (32 * config.num_warps)
            alu = sum(1 for _, op, _ in body if op.split(".")[0] in ALU)
            shared = collections.Counter(op for _, op, _ in body if op.startswith(("LDS", "STS")))
            label = f"{fmt} x {str(act).replace('torch.', '')}"
            print(f"{','.join(map(str, config)):>22} {label:>12} {registers(compiled):>4} "
                  f"{' '.join(local_memory(compiled)) or '-':>6} {len(body):>5} {len(body) / per_weight:>7.2f} "
                  f"{alu / per_weight:>6.2f}  {dict(shared)}")


if __name__ == "__main__":
    main()
