import os, sys, time, re, collections
import torch, triton, triton.language as tl
sys.path.insert(0, "tests"); sys.path.insert(0, "src")

def _decode_asm(mag_shift, sign_shift):
    lines = ["{", ".reg .b32 t0, t1, x, y;",
             "prmt.b32 t0, $4, 0, 0x4140;", "prmt.b32 t1, $4, 0, 0x4342;"]
    mask_m = (7 << mag_shift) | (7 << (mag_shift + 16))
    mask_s = 0x80008000
    for out, t, nib in (("$0", "t0", 0), ("$1", "t1", 0), ("$2", "t0", 4), ("$3", "t1", 4)):
        ms, ss = mag_shift - nib, sign_shift - nib
        lines.append(f"shl.b32 x, {t}, {ms};" if ms >= 0 else f"shr.b32 x, {t}, {-ms};")
        lines.append(f"shl.b32 y, {t}, {ss};")
        lines.append(f"lop3.b32 {out}, x, y, {mask_m:#x}, 0xEA;".replace("lop3.b32", "and.b32") if False else
                     f"and.b32 x, x, {mask_m:#x};")
        lines.append(f"and.b32 y, y, {mask_s:#x};")
        lines.append(f"or.b32 {out}, x, y;")
    lines.append("}")
    return "\n".join(lines)


def _decode_asm_bytes():
    # $0..$3: bf16x2 bits of byte i of $4 (low nibble -> low half): ((n&7)<<6 | (n&8)<<12) per nibble
    lines = ["{", ".reg .b32 b, y, z;"]
    for i in range(4):
        lines.append(f"bfe.u32 b, $4, {8*i}, 8;" if i else "and.b32 b, $4, 0xff;")
        lines.append("mul.lo.u32 y, b, 0x40040;")
        lines.append("mul.lo.u32 z, b, 0x1001000;")
        lines.append("and.b32 y, y, 0x1c001c0;")
        lines.append("and.b32 z, z, 0x80008000;")
        lines.append(f"or.b32 ${i}, y, z;")
    lines.append("}")
    return "\n".join(lines)
DECODE_BF16 = _decode_asm_bytes()


@triton.jit
def to_logical(t, BM: tl.constexpr, BK: tl.constexpr):
    t6 = tl.reshape(t, [BM, BK // 32, 4, 2, 2, 2])
    return tl.reshape(tl.permute(t6, (0, 1, 3, 4, 2, 5)), [BM, BK])

@triton.jit
def decode_bf16_fold(wp, sc, BM: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr):
    r = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r", [wp], dtype=tl.int32, is_pure=True, pack=4)
    lo = r.to(tl.int16)
    hi = (r >> 16).to(tl.int16)
    v = tl.reshape(tl.join(lo, hi), [BM, BK]).to(tl.bfloat16, bitcast=True)
    s = (sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 6.646139978924579e+35).to(tl.bfloat16)  # s * 2^119
    s = tl.reshape(tl.broadcast_to(s[:, :, None], [BM, BK // 16, 16]), [BM, BK])
    return to_logical(v * s, BM, BK)

@triton.jit
def proto(w_desc, s_ptr, x_ptr, out_ptr, M, K, N, s_stride_m, x_stride_n, out_stride_m,
          BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr, KSPLIT: tl.constexpr, ASM: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = pid_m * BM
    rows = row0 + tl.arange(0, BM)
    n = tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    k_per = K // KSPLIT
    k_lo = pid_k * k_per
    kk = tl.arange(0, BK)
    g = kk // 32; t = (kk // 16) % 2; h = (kk // 8) % 2; c = (kk // 2) % 4; p = kk % 2
    perm = 32 * g + 8 * c + 4 * t + 2 * h + p
    for k0 in tl.range(k_lo, k_lo + k_per, BK, num_stages=STAGES):
        wp = w_desc.load([row0, k0 // 2])
        sc = tl.load(s_ptr + rows[:, None] * s_stride_m + (k0 // 16 + tl.arange(0, BK // 16))[None, :])
        x = tl.load(x_ptr + n[:, None] * x_stride_n + (k0 + perm)[None, :], mask=n[:, None] < N, other=0.0)
        w = decode_bf16_fold(wp, sc, BM, BK, ASM)
        acc = tl.dot(w, tl.trans(x), acc)
    out = acc * 128.0
    tl.store(out_ptr + rows[:, None] * out_stride_m + n[None, :], out.to(tl.bfloat16), mask=n[None, :] < N)
def compile_sm90(BM=64, BK=256, BN=16, STAGES=4, KSPLIT=1, num_warps=4):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"w_desc": f"tensordesc<u8[{BM}, {BK//2}]>", "s_ptr": "*u8", "x_ptr": "*bf16", "out_ptr": "*bf16",
           "M": "i32", "K": "i32", "N": "i32", "s_stride_m": "i32", "x_stride_n": "i32", "out_stride_m": "i32",
           "BM": "constexpr", "BK": "constexpr", "BN": "constexpr", "STAGES": "constexpr", "KSPLIT": "constexpr", "ASM": "constexpr"}
    const = dict(BM=BM, BK=BK, BN=BN, STAGES=STAGES, KSPLIT=KSPLIT, ASM=DECODE_BF16)
    attrs = {(i,): [["tt.divisibility", 16]] for i in (1, 2, 3, 4, 5, 7, 8, 9)}
    t = time.time()
    c = triton.compile(ASTSource(proto, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    return c, time.time() - t

if __name__ == "__main__":
    from aot import sass_listing, main_loop, local_memory, registers
    cfg = dict(BM=int(sys.argv[1]), BK=int(sys.argv[2]), BN=int(sys.argv[3]), STAGES=int(sys.argv[4]), num_warps=int(sys.argv[5]))
    c, dt = compile_sm90(**cfg)
    body = main_loop(sass_listing(c))
    ops = collections.Counter(op.split(".")[0] for _, op, _ in body)
    weights = cfg["BM"] * cfg["BK"]
    threads = 32 * cfg["num_warps"]
    print(cfg, f"compile {dt:.1f}s regs {registers(c)} local {local_memory(c)} loop {len(body)} instr; per weight per thread-instr: {len(body)*threads/weights:.2f}")
    print(dict(ops.most_common()))
    open("/tmp/p5.sass", "w").write("\n".join(f"{a:05x} {o} {r}" for a, o, r in body))
    open("/tmp/p5.ttgir", "w").write(c.asm["ttgir"])
