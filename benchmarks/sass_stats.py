"""Offline SASS statistics of the tensor-core kernels (no GPU): compile what ``gemv`` launches on sm_90 for one
case (tests/aot.py's Sm90Launch, specialized as the JIT would), disassemble it with Triton's bundled cuobjdump,
and count the main loop's instructions.

PYTHONPATH=src python benchmarks/sass_stats.py [--kernel weight_only|hmma] [--o3] [CASE ...]   (TRITON_INTERPRET unset)
    CASE = M,K,L,fmt,act,N[,tiles,warps,chunks,split]  e.g. 7168,16384,1,nvfp4,f16,1,2,4,1,1  (act: f16, bf16,
    fp4; split 0 or 1; without the configuration: the kernel's default)
    with no CASE: the weight-only kernel's modes on 7168 x 16384.

Per case: registers, the main loop (the body of the backward branch with the most instructions: the full
step), its instructions per weight byte, the share on the ALU pipe (integer/logic/prmt: 64 lanes per cycle
per SM on Hopper, half the FMA pipe's rate), loads per step by width, and what a thread has in flight
(weight bytes loaded at the top of a step).  The pipe assignment is by opcode and approximate.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from aot import Sm90Launch, local_memory, main_loop, registers, sass_listing  # noqa: E402

from fp4gemv import FP4Tensor  # noqa: E402
from fp4gemv.kernels.hmma_gemv import HmmaConfig  # noqa: E402
from fp4gemv.kernels.weight_only import WeightOnlyConfig  # noqa: E402

# Opcodes issued to the ALU pipe (integer and logic at half the FMA pipe's rate); IMAD/IADD.64 and the
# floating point ones go to the FMA pipes.
ALU = {"LOP3", "PRMT", "SHF", "ISETP", "IADD3", "LEA", "SEL", "FSEL", "FMNMX", "IMNMX", "VIMNMX", "PLOP3",
       "SGXT", "BMSK", "LOP", "CS2R", "MOV", "FSETP", "POPC", "FLO", "BREV"}


def _operands(m, k, batch, fmt, act, n):
    """CPU operands of the case (values do not matter for compiling)."""
    block = 16 if fmt == "nvfp4" else 32

    def fp4(rows, layout):
        scales = torch.full((batch, rows, k // block), 0x38 if block == 16 else 127, dtype=torch.uint8)
        t = FP4Tensor(torch.zeros(batch, rows, k // 2, dtype=torch.uint8), scales, fmt, "linear")
        return t.with_scale_layout(layout)

    a = fp4(m, "swizzled")
    if act == "fp4":
        return a, fp4(n, "swizzled")
    return a, torch.zeros(batch, n, k, dtype=dict(f16=torch.float16, bf16=torch.bfloat16)[act])


def loop_stats(body) -> dict:
    base = collections.Counter(op.split(".")[0] for _, op, _ in body)
    loads = collections.Counter(op for _, op, _ in body if op.startswith("LDG"))
    alu = sum(v for k, v in base.items() if k in ALU)
    first_mma = next((i for i, (_, op, _) in enumerate(body) if op.startswith("HMMA")), len(body))
    early = sum(1 for _, op, _ in body[:first_mma] if op.startswith("LDG"))
    return {"instructions": len(body), "alu": alu, "mma": base["HMMA"], "by_opcode": dict(base.most_common()),
            "loads": dict(loads), "loads_before_first_mma": early}


def _load_bytes(op: str) -> int:
    width = re.search(r"\.(128|64|U16|S16|U8|S8)\b", op)
    return {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}.get(width.group(1), 4) if width else 4


def describe(kernel: str, case: str, loads_first: bool = True) -> dict:
    parts = case.split(",")
    m, k, batch = (int(x) for x in parts[:3])
    fmt, act, n = parts[3], parts[4], int(parts[5])
    config = None
    if len(parts) > 6 and kernel == "weight_only":
        tiles, warps, chunks, split = (int(x) for x in (parts[6:10] + ["0"])[:4])
        config = WeightOnlyConfig(tiles, warps, chunks, split=bool(split), loads_first=loads_first)
    elif len(parts) > 6:
        config = HmmaConfig(int(parts[7]))
    a, b = _operands(m, k, batch, fmt, act, n)
    launch = Sm90Launch(a, b, kernel=kernel, config=config)
    if kernel == "weight_only" and config is None and not loads_first:
        launch = Sm90Launch(a, b, kernel=kernel, config=launch.config._replace(loads_first=False))
    compiled = launch.compile()
    stats = loop_stats(main_loop(sass_listing(compiled)))
    const = launch.constexprs
    if kernel == "weight_only":
        tiles, chunks = const["TILES"], const["CHUNKS"]
        weight_bytes = 2 * tiles * 16 * chunks  # per thread and step: 2 tiles rows x 32 chunks elements / 2
        label = (f"wo {('fold', 'k32', 'split')[const['MODE']]} tiles={tiles} warps={const['WARPS']} "
                 f"chunks={chunks}")
    else:
        weight_bytes = 2 * 16  # two rows x 16 bytes
        label = f"hmma warps={const['WARPS']}"
    stats.update(case=case, kernel=label, registers=registers(compiled), weight_bytes_per_step=weight_bytes,
                 per_byte=stats["instructions"] / weight_bytes, alu_per_byte=stats["alu"] / weight_bytes,
                 load_bytes_per_step=sum(_load_bytes(op) * v for op, v in stats["loads"].items()),
                 local=bool(local_memory(compiled)))
    return stats


def print_stats(s: dict) -> None:
    print(f"{s['case']:<34} {s['kernel']:<34} regs {s['registers']:>3}  loop {s['instructions']:>4} instr "
          f"({s['per_byte']:.2f}/weight byte, ALU {s['alu_per_byte']:.2f}/byte, {s['mma']} mma)  "
          f"weights {s['weight_bytes_per_step']} B/thread/step, {s['loads_before_first_mma']} of "
          f"{sum(s['loads'].values())} loads before the first mma  {s['loads']}"
          + ("  LOCAL MEMORY" if s["local"] else ""))
    print("    " + " ".join(f"{k}:{v}" for k, v in s["by_opcode"].items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", default="weight_only", choices=("weight_only", "hmma"))
    parser.add_argument("--o3", action="store_true", help="weight_only: ptxas -O3 (loads_first=False)")
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args()
    cases = args.cases or [f"7168,16384,1,{f},{a},{n},{c}" for f in ("nvfp4", "mxfp4") for a, n, c in
                           (("f16", 1, "1,8,1,1"), ("bf16", 1, "1,8,1,1"), ("fp4", 2, "2,4,1,1"), ("f16", 4, "1,8,1,0"),
                            ("f16", 8, "1,8,1,0"), ("bf16", 8, "1,8,1,0"), ("fp4", 8, "2,4,1,0"),
                            ("f16", 16, "1,8,1,0"))]
    for case in cases:
        print_stats(describe(args.kernel, case, loads_first=not args.o3))


if __name__ == "__main__":
    main()
