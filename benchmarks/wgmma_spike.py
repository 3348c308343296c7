"""Compile-only spike (issue 27, round 28 of docs/performance.md): can the engine's decode feed ``wgmma`` from
registers with no data movement?  One warp group over 64 rows: each thread's 32-bit words of native-order codes
(one row's 8 codes: two k16 tiles, pairs c and c + 4 of each) are decoded by the engine's native decode
(``_mma_step.decode_native_bf16``) and multiplied by their bf16x2 scale in an inline-asm step (pack 4, the word
given to all four of its pairs), reshaped and permuted (register renames) into the A operand's layout
(``DotOperandLayout(0, NVMMADistributedLayout v3, k_width 2)``) and handed to ``warpgroup_mma`` with the activation
in shared memory as B.  The SASS shows the decode's registers going straight into ``HGMMA.64x16x16`` (no ``PRMT``,
``MOV`` or shared-memory trip between them).  The weights, scales and activation come from global memory by plain
loads here (the activation's scattered 16-bit loads and their ``PRMT``s are the spike's, not the design's: an engine
copies it by TMA).  Numerics are not checked (the code order is whatever the registers take).

    python benchmarks/wgmma_spike.py [KSUB] [N] [bytes | mx]   (CPU; Triton's bundled ptxas; KSUB 128 or 256, N 16)

``bytes``: each lane converts its words' two e4m3 scale bytes itself (as the mma.sync step does); without it the
scales come as ready bf16x2 pairs (converted once a block elsewhere).  In the A operand's layout a 16-element NVFP4
block of a row is spread over the four lanes c (each holds 4 of its codes), so a lane converts a scale every 4
codes, where the mma.sync step's fold ownership converts one every 16.

``mx`` (round 32): MXFP4 with the k32 step's numerics -- each 32-element block's product in a fresh accumulator
(``warpgroup_mma(..., use_acc=False)`` on the block's K slice of the activation), its rows' e8m0 scales as fp32
(byte 0 as 2^-127) multiplied in and added: the decode alone on the A registers, 8 ``FFMA`` a block a thread at
N = 16.  Synchronous wgmma here (the design keeps two blocks in flight); the count is what it gives.
"""
import collections, os, struct, sys
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from fp4gemv.kernels._mma_step import BF16_SCALE_BIAS, decode_native_bf16
from aot import sass_listing, registers, local_memory

def step_asm(scale_bytes: bool):
    """The word's decode and scale multiply: ``scale_bytes`` False, the four pairs' bf16x2 scales given ready
    (converted elsewhere, once a block); True, the word's two e4m3 scale bytes (k16 tiles h = 0, 1 of the word's
    row, the low 16 bits of the scale operand) converted here as the engine's step converts them
    (``_mma_step``'s ``scale_pairs_e4m3``: e4m3x2 -> f16x2 -> fp32 times 2^BF16_SCALE_BIAS -> bf16x2), which every
    one of the four lanes c holding the block's codes does again."""
    mul = {"mp0": "$12", "mp1": "$16", "m29": "$20", "m24": "$24"}
    lines = [".reg .b32 p<4>, t, u, h, s<2>;", ".reg .b16 raw, lo, hi;", ".reg .f32 f<2>;"]
    lines += decode_native_bf16("$4", ("p0", "p1", "p2", "p3"), "t", "u", mul)
    if scale_bytes:
        lines += ["cvt.u16.u32 raw, $8;", "cvt.rn.f16x2.e4m3x2 h, raw;", "mov.b32 {lo, hi}, h;",
                  "cvt.f32.f16 f0, lo;", "cvt.f32.f16 f1, hi;",
                  f"mul.f32 f0, f0, 0f{struct.pack('>f', 2.0 ** BF16_SCALE_BIAS).hex().upper()};",
                  f"mul.f32 f1, f1, 0f{struct.pack('>f', 2.0 ** BF16_SCALE_BIAS).hex().upper()};",
                  "cvt.rn.bf16x2.f32 s0, f0, f0;", "cvt.rn.bf16x2.f32 s1, f1, f1;"]
        scales = ["s0", "s0", "s1", "s1"]  # pair q = 2 h + p: k16 tile h's scale
    else:
        scales = [f"${8 + q}" for q in range(4)]
    for q in range(4):
        lines.append(f"mul.rn.bf16x2 ${q}, p{q}, {scales[q]};")
    return "{\n" + "\n".join(lines) + "\n}", ",".join(["=r"] * 4 + ["r"] * 24)

def decode_asm():
    """The word's decode alone (MXFP4: its e8m0 scale is applied to the block's fp32 product instead)."""
    mul = {"mp0": "$8", "mp1": "$12", "m29": "$16", "m24": "$20"}
    lines = [".reg .b32 t, u;"] + decode_native_bf16("$4", ("$0", "$1", "$2", "$3"), "t", "u", mul)
    return "{\n" + "\n".join(lines) + "\n}", ",".join(["=r"] * 4 + ["r"] * 20)

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))
DOT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))

@gluon.jit
def spike(w_ptr, s_ptr, x_ptr, out_ptr, K, mp0, mp1, m29, m24, KSUB: gl.constexpr, ASM: gl.constexpr,
          CONS: gl.constexpr, LW: gl.constexpr, L3: gl.constexpr, N: gl.constexpr):
    # words [64, KSUB/8]: thread (w, g, c): rows 16w+g, +8; word 4t + c (registers: row+8, t)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, LW))[:, None]
    jj = gl.arange(0, KSUB // 8, layout=gl.SliceLayout(0, LW))[None, :]
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])
    XS: gl.constexpr = gl.NVMMASharedLayout(128, 16, rank=2)
    xs = gl.allocate_shared_memory(gl.bfloat16, [N, KSUB], XS)
    acc = gl.zeros([64, N], gl.float32, MMA)
    zero3 = gl.zeros([64, KSUB // 8, 4], gl.int32, L3)
    for k0 in range(0, K, KSUB):
        xn = gl.arange(0, N, layout=gl.SliceLayout(1, XL))[:, None]
        xk = gl.arange(0, KSUB, layout=gl.SliceLayout(0, XL))[None, :]
        xs.store(gl.load(x_ptr + xn * K + k0 + xk))
        w = gl.load(w_ptr + rows * (K // 8) + k0 // 8 + jj)
        s = gl.load(s_ptr + rows * (K // 8) + k0 // 8 + jj)
        w3 = gl.expand_dims(gl.convert_layout(w, gl.SliceLayout(2, L3)), 2)
        s3 = gl.expand_dims(gl.convert_layout(s, gl.SliceLayout(2, L3)), 2)
        w3 = w3 + zero3
        s3 = s3 + zero3
        p = gl.inline_asm_elementwise(ASM, CONS, [w3, s3, zero3 + mp0, zero3 + mp1, zero3 + m29, zero3 + m24],
                                      dtype=gl.int32, is_pure=True, pack=4)
        # [64, KSUB/32 (t), 4 (c), 2 (tile bit), 2 (+4 bit)] -> [64, t, tile bit, +4, c] -> pairs j
        p = gl.permute(gl.reshape(p, [64, KSUB // 32, 4, 2, 2]), [0, 1, 3, 4, 2])
        p = gl.reshape(p, [64, KSUB // 2])
        lo = (p & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (p >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        a = gl.convert_layout(gl.reshape(gl.join(lo, hi), [64, KSUB]), DOT)
        acc = warpgroup_mma(a, xs.permute((1, 0)), acc)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))[:, None]
    n = gl.arange(0, N, layout=gl.SliceLayout(0, MMA))[None, :]
    gl.store(out_ptr + r * N + n, acc)

@gluon.jit
def spike_mx(w_ptr, s_ptr, x_ptr, out_ptr, K, mp0, mp1, m29, m24, KSUB: gl.constexpr, ASM: gl.constexpr,
             CONS: gl.constexpr, LW: gl.constexpr, L3: gl.constexpr, N: gl.constexpr):
    # MXFP4: each 32-element block's product in a fresh accumulator (a wgmma pair), scaled by the rows' e8m0
    # scales in fp32 and added -- the k32 step's numerics on wgmma.  words [64, 4] a block: thread (w, g, c)
    # rows 16w+g (+8: the register), word c.
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, LW))[:, None]
    cc = gl.arange(0, 4, layout=gl.SliceLayout(0, LW))[None, :]
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])
    XS: gl.constexpr = gl.NVMMASharedLayout(128, 16, rank=2)
    xs = gl.allocate_shared_memory(gl.bfloat16, [N, KSUB], XS)
    acc = gl.zeros([64, N], gl.float32, MMA)
    zacc = gl.zeros([64, N], gl.float32, MMA)
    zero3 = gl.zeros([64, 4, 4], gl.int32, L3)
    srow = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    for k0 in range(0, K, KSUB):
        xn = gl.arange(0, N, layout=gl.SliceLayout(1, XL))[:, None]
        xk = gl.arange(0, KSUB, layout=gl.SliceLayout(0, XL))[None, :]
        xs.store(gl.load(x_ptr + xn * K + k0 + xk))
        for t in gl.static_range(KSUB // 32):
            w = gl.load(w_ptr + rows * (K // 8) + (k0 + 32 * t) // 8 + cc)
            w3 = gl.expand_dims(gl.convert_layout(w, gl.SliceLayout(2, L3)), 2) + zero3
            p = gl.inline_asm_elementwise(ASM, CONS, [w3, zero3 + mp0, zero3 + mp1, zero3 + m29, zero3 + m24],
                                          dtype=gl.int32, is_pure=True, pack=4)
            p = gl.permute(gl.reshape(p, [64, 1, 4, 2, 2]), [0, 1, 3, 4, 2])
            p = gl.reshape(p, [64, 16])
            lo = (p & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
            hi = (p >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
            a = gl.convert_layout(gl.reshape(gl.join(lo, hi), [64, 32]), DOT)
            part = warpgroup_mma(a, xs.slice(32 * t, 32, dim=1).permute((1, 0)), zacc, use_acc=False)
            # the rows' e8m0 bytes as fp32 2^(e - 127) (byte 0: 2^-127, as the k32 step)
            e = gl.load(s_ptr + srow * (K // 32) + (k0 + 32 * t) // 32).to(gl.int32)
            f = gl.maximum(e << 23, 1 << 22).to(gl.float32, bitcast=True)
            acc = acc + part * f[:, None]
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))[:, None]
    n = gl.arange(0, N, layout=gl.SliceLayout(0, MMA))[None, :]
    gl.store(out_ptr + r * N + n, acc)

def layouts(ksub):
    t_bits = (ksub // 32).bit_length() - 1
    lw = gl.DistributedLinearLayout(reg_bases=[[8, 0]] + [[0, 4 << i] for i in range(t_bits)],
                                    lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, ksub // 8])
    l3 = gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]] + [[0, 4 << i, 0] for i in range(t_bits)],
                                    lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                    warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, ksub // 8, 4])
    return lw, l3

ksub = int(sys.argv[1]) if len(sys.argv) > 1 else 256
n = int(sys.argv[2]) if len(sys.argv) > 2 else 16
scale_bytes = len(sys.argv) > 3 and sys.argv[3] == "bytes"
mx = len(sys.argv) > 3 and sys.argv[3] == "mx"
ASM, CONS = decode_asm() if mx else step_asm(scale_bytes)
lw, l3 = layouts(32 if mx else ksub)
sig = {"w_ptr": "*i32", "s_ptr": "*u8" if mx else "*i32", "x_ptr": "*bf16", "out_ptr": "*fp32", "K": "i32",
       "mp0": "i32", "mp1": "i32", "m29": "i32", "m24": "i32"}
const = {"KSUB": ksub, "ASM": ASM, "CONS": CONS, "LW": lw, "L3": l3, "N": n}
c = triton.compile(GluonASTSource(spike_mx if mx else spike, sig, const, {}), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=4))
listing = sass_listing(c)
mix = collections.Counter(op.split(".")[0] for _, op, _ in listing)
print("regs", registers(c), "local", local_memory(c), "shared", c.metadata.shared)
print("SASS of the kernel (one pass of K / KSUB chunks):", sorted(mix.items(), key=lambda x: -x[1]))
if mx:  # no scale multiply on the A registers: the block's fp32 product is scaled instead
    sys.exit(0)
# between the last decode multiply and the first HGMMA of a chunk: what moves the A registers, if anything
last_mul = max(i for i, (_, op, _) in enumerate(listing) if op.startswith("HMUL2"))
first_mma = min(i for i, (_, op, _) in enumerate(listing) if op.startswith("HGMMA") and i > last_mul)
between = collections.Counter(op.split(".")[0] for _, op, _ in listing[last_mul + 1:first_mma])
print("between the decode's last HMUL2 and the first HGMMA:", dict(between))
