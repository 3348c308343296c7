"""Offline SASS statistics of the tensor-core kernels (no GPU): compile one launch for sm_90 exactly as the JIT
specializes it, disassemble it with Triton's bundled cuobjdump, and count the main loop's instructions.

PYTHONPATH=src python benchmarks/sass_stats.py [--kernel weight_only|hmma] [CASE ...]
    CASE = M,K,L,fmt,act,N[,tiles,warps,chunks,split]  e.g. 7168,16384,1,nvfp4,f16,1,2,4,1,1  (act: f16, bf16,
    fp4; split 0 or 1)
    with no CASE: the variants of benchmarks/sweep_weight_only.py on 7168 x 16384.

Per case: registers, the main loop (the body of the backward branch with the most instructions: the full
step), its instructions per weight byte, the share on the ALU pipe (integer/logic/prmt: 64 lanes per cycle
per SM on Hopper, half the FMA pipe's rate), loads per step by width, and what a thread has in flight
(weight bytes loaded at the top of a step).  The pipe assignment is by opcode and approximate.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

from fp4gemv import FP4Tensor

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# Opcodes issued to the ALU pipe (integer and logic at half the FMA pipe's rate); IMAD/IADD.64 and the
# floating point ones go to the FMA pipes.
ALU = {"LOP3", "PRMT", "SHF", "ISETP", "IADD3", "LEA", "SEL", "FSEL", "FMNMX", "IMNMX", "VIMNMX", "PLOP3",
       "SGXT", "BMSK", "LOP", "CS2R", "MOV", "FSETP", "POPC", "FLO", "BREV"}


def jit_specialization(fn, args, kw):
    """(signature, constants, attrs) of ``fn(*args, **kw)`` as Triton's JIT specializes it on a GPU (as in
    tests/conftest.py)."""
    sig, const, marked = {}, {}, []
    for j, (name, value) in enumerate(zip(fn.arg_names, args)):
        ty, key = native_specialize_impl(CUDABackend, value, False, True, True)
        sig[name] = ty
        if ty == "constexpr":
            const[name] = value
        elif "D" in key:
            marked.append(j)
    for name in fn.arg_names[len(args):]:
        sig[name], const[name] = "constexpr", kw[name]
    return sig, const, {(j,): CUDABackend.parse_attr("D") for j in marked}


class _Recorder:
    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


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


def record(kernel: str, m, k, batch, fmt, act, n, config=None):
    """(jit function, args, kwargs) of one launch through gemv's operand views."""
    gemv_module = importlib.import_module("fp4gemv.gemv")
    from fp4gemv.kernels._common import GemvOperands

    a, b = _operands(m, k, batch, fmt, act, n)
    out = torch.empty(batch, m, n, dtype=torch.float16)
    if kernel == "hmma":
        import fp4gemv.kernels.hmma_gemv as module

        real, rec = module.hmma_gemv_kernel, _Recorder()
        module.hmma_gemv_kernel = rec
        try:
            gemv_module._launch(a, b, out, "hmma", config, use_ptx=True)
        finally:
            module.hmma_gemv_kernel = real
    else:
        import fp4gemv.kernels.weight_only as module

        real, rec = module.weight_only_gemv_kernel, _Recorder()
        module.weight_only_gemv_kernel = rec
        try:
            sfa, sfa_addressing = gemv_module._scale_operand(a, batch)
            if act == "fp4":
                sfb, sfb_addressing = gemv_module._scale_operand(b, batch)
                b_bytes = b.data
            else:
                sfb = sfb_addressing = None
                b_bytes = b.view(torch.uint8)
            ops = GemvOperands(a.data, sfa, sfa_addressing, b_bytes, sfb, sfb_addressing, out)
            cfg = config or module.default_config(m, k, batch, n, fmt, act, 132)
            module.launch(ops, scale_block=a.fmt.block_size, k=k, activation_dtype=None if act == "fp4" else b.dtype,
                          config=cfg, use_ptx=True)
        finally:
            module.weight_only_gemv_kernel = real
    (args, kw), = rec.calls
    return real, args, kw


def compile_sm90(fn, args, kw):
    sig, const, attrs = jit_specialization(fn, args, kw)
    options = dict(num_warps=kw["num_warps"], num_stages=kw.get("num_stages", 1))
    for name in ("launch_pdl", "ptx_options"):
        if kw.get(name) is not None:
            options[name] = kw[name]
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def sass_of(cubin: bytes) -> tuple[str, str]:
    """(SASS text, resource usage line) from cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                               check=True).stdout
    finally:
        os.remove(path)
    return sass, usage


_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode with modifiers, operands) of every instruction."""
    out = []
    for line in sass.splitlines():
        m = _INSTR.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(3), m.group(4).strip()))
    return out


def main_loop(instrs):
    """The instructions of the largest loop: a backward branch's target up to the branch."""
    best = []
    for i, (addr, op, rest) in enumerate(instrs):
        if op.startswith("BRA"):
            target = re.search(r"0x([0-9a-f]+)", rest)
            if target and int(target.group(1), 16) < addr:
                t = int(target.group(1), 16)
                body = [x for x in instrs[:i + 1] if t <= x[0] <= addr]
                if len(body) > len(best):
                    best = body
    return best


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
    if kernel == "weight_only" and len(parts) > 6:
        from fp4gemv.kernels.weight_only import WeightOnlyConfig

        tiles, warps, chunks, split = (int(x) for x in (parts[6:10] + ["0"])[:4])
        config = WeightOnlyConfig(tiles, warps, chunks, split=bool(split), pdl=True, loads_first=loads_first)
    fn, args, kw = record(kernel, m, k, batch, fmt, act, n, config)
    compiled = compile_sm90(fn, args, kw)
    sass, usage = sass_of(compiled.asm["cubin"])
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stats = loop_stats(main_loop(instructions(sass)))
    if kernel == "weight_only":
        tiles, chunks = kw["TILES"], kw["CHUNKS"]
        weight_bytes = 2 * tiles * 16 * chunks  # per thread and step: 2 tiles rows x 32 chunks elements / 2
        label = f"wo {('fold', 'k32', 'split')[kw['MODE']]} tiles={tiles} warps={kw['WARPS']} chunks={chunks}"
    else:
        weight_bytes = 2 * 16  # two rows x 16 bytes
        label = f"hmma warps={kw['WARPS']}"
    stats.update(case=case, kernel=label, registers=regs, weight_bytes_per_step=weight_bytes,
                 per_byte=stats["instructions"] / weight_bytes, alu_per_byte=stats["alu"] / weight_bytes,
                 load_bytes_per_step=sum(_load_bytes(op) * v for op, v in stats["loads"].items()),
                 local="LOCAL:0" not in usage or "STACK:0" not in usage)
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
                           (("f16", 1, "2,4,1,1"), ("bf16", 1, "2,4,1,1"), ("fp4", 2, "2,4,1,1"), ("f16", 4, "2,4,1,1"),
                            ("f16", 8, "2,4,1,0"), ("bf16", 8, "2,4,1,0"), ("fp4", 8, "2,4,1,0"),
                            ("f16", 16, "2,4,1,0"))]
    for case in cases:
        print_stats(describe(args.kernel, case, loads_first=not args.o3))


if __name__ == "__main__":
    main()
