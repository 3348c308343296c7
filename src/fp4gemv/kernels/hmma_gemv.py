"""NVFP4 GEMV on the tensor cores with warp-level ``mma.sync``: NVFP4 weights times fp16/bf16 activations
(W4A16) or NVFP4 activations (W4A4), N = 1..16 in one pass over the weights.

Why not ``tl.dot``: a first version with it (docs/performance.md, the ``tl.dot`` kernel) had Triton stage the operands through
shared memory with barriers, about 10 instructions per weight byte.  Here each thread decodes the weights it
holds straight into the registers ``mma.sync.m16n8k16`` reads; nothing moves between threads until the
final sum over warps.

The tile.  A program computes 16 output rows for all N; its ``WARPS`` warps sit side by side along K, each
on its own 128-element chunk of a step.  Every per-thread tensor is ``[8, WARPS, 2, 16]``: (g, warp, half,
word).  Triton lays the weight load of that shape out with lane = 4 * g + word // 4 (4 words = 16 bytes per
thread), warps along the second dimension and the half in registers (``tests/test_kernels_hmma.py`` checks
the compiled layout), which is the fragment layout of ``m16n8k16``: thread (g, c) holds rows g and g + 8
(the two halves) and words 4c..4c+3 of each.  The asm (``pack=8``) receives exactly those 8 words; it loads
the scales and the activation itself from per-thread base pointers, so that the words are the only loaded
tensor and fix the layout.

The K order.  The tensor cores sum over K in any order, as long as both operands agree.  A 32-bit word holds
8 codes e0..e7; ``word << (12 - 4i)`` has codes i and i + 4 at the top of each 16-bit half, so 4 logic
operations give the 16-bit pair (e_i, e_{i+4}).  The activation pairs are built to match, one ``prmt`` each
from the 8 activation values of the same word.

Exactness.  An e2m1 value t (a multiple of 1/2, at most 6) put into fp16 bits as ``sign << 15 | code << 9``
reads as t * 2^-14 (fp16's subnormal range holds code 1, 0.5 * 2^-14, exactly).  Times an e4m3 scale s (a
multiple of 2^-9, |s| <= 448) the fp16 product t * s * 2^-14 is exact: a multiple of 2^-24 (fp16's
subnormal step) with at most 2 + 4 significant bits, below 0.17.  For bf16 the code goes to bits 6..8
(t * 2^-126, bf16's subnormal range holding 0.5 * 2^-126) and the scale is multiplied by 2^119 first (exact,
below bf16's maximum), so the product t * s * 2^-7 is a normal bf16 with at most 6 significant bits.  The
tensor cores multiply exactly into fp32 accumulators; the fold (2^14 or 2^7 per FP4 operand) is undone once
in the epilogue, with the global scales, and c is rounded once to its dtype.  Unlike ``w4a4.py`` the
16-element block sums are not formed separately: all products of a K step enter one fp32 accumulation.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..target import Target

# The asm step takes its operands in the blocked layout Triton 3.6 gives them (threadsPerWarp [8, 1, 1, 4]; the
# sm_90 compile tests of tests/test_kernels_hmma.py check every variant).  Triton 3.9 lays them out as
# [4, 1, 2, 4], which would put other elements in each lane's registers: the PTX path stays off on other
# Triton versions (the pure-Triton twin has no such assumption), and dispatch moves on to the next kernel.
PTX_LAYOUT_VERIFIED = triton.__version__.startswith("3.6.")
from ._common import apply_global_scales, decode_scale, pow2_at_most, scale_row_offset, store_rounded
from ._decode import e2m1_word_values
from ._ptx import AsmOperands, PtxBlock, decode_word_f16
from .spec import (ErrorModel, FP4Meta, GemvCase, Src, TritonKernelSpec, TritonLaunch, check_powers_of_two,
                   global_scale_sources, too_many_rows)

__all__ = ["HmmaConfig", "Hmma", "hmma_gemv_kernel"]

# 16 warps gave wrong results on the H200 (every bound check of the GPU test); offline the compiled 16-warp
# kernel shows no defect (docs/performance.md, "Compile time, and the 16-warp hmma result"), so check_config
# refuses it until benchmarks/hmma_warps_check.py has located the cause on a GPU.
MAX_WARPS = 8
# The module docstring's fold: what the bit placement leaves on a decoded FP4 operand, undone in the epilogue.
FP16_FOLD = tl.constexpr(2.0**14)
BF16_FOLD = tl.constexpr(2.0**7)
_BF16_SCALE_BIAS = 2.0**119


class _HmmaStep(PtxBlock):
    """The PTX of one thread's step: load scales and activation, decode 2 rows x 4 words, 8 or 16 mma.

    Operands (``AsmOperands``, 8 elements each, element e = 4 * half + q): the 8 accumulators out, then in
    (``acc``, not tied); ``words`` the weight words; 8 b64 each: ``sfa_p`` weight-scale pointers (element 0:
    row g, 4: row g + 8; scale of block 8w + 2c, byte pointers at step 0), ``x_p`` activation pointers
    (element 0: n = g, 4: n = g + 8; the thread's 4 words at step 0), for FP4 activations ``sfb_p`` its scale
    pointers; then 8 b32 ``flags`` (element 0 / 4: activation row n < N, 1: words of K left at step 0 from the
    thread's first word), ``k0``, ``col_tile`` (the scale column-tile strides, element 0: weights, 1:
    activation).  Accumulator element (half h, word q) is C[g + 8h][8(q // 2) + 2c + q % 2].
    """

    # fragment register of the mma -> accumulator element
    ACC = {0: 0, 1: 1, 2: 4, 3: 5, 4: 2, 5: 3, 6: 6, 7: 7}

    def __init__(self, dtype: str, fp4_activation: bool, n_tiles: int):
        super().__init__()
        self.dtype, self.fp4, self.n_tiles = dtype, fp4_activation, n_tiles
        self.mag_shift, self.mul, self.mma_type = {"f16": (3, "mul.rn.f16x2", "f16"),
                                                   "bf16": (6, "mul.rn.bf16x2", "bf16")}[dtype]
        names = [("acc", "f"), ("words", "r"), ("sfa_p", "l"), ("x_p", "l")]
        names += [("sfb_p", "l")] if fp4_activation else []
        names += [("flags", "r"), ("k0", "r"), ("col_tile", "r")]
        self.op = AsmOperands(1, 8, names, tied=False)
        for kind, regs in (("pred", "pk pn"), ("b32", "t m kl st sraw"), ("b64", "ptr off"), ("b16", "h0 h1"),
                           ("f32", "f0 f1")):
            for r in regs.split():
                self.reg(kind, r)
        self.weight_pairs()
        for tile in range(n_tiles):
            if fp4_activation:
                self.fp4_activation_pairs(tile)
            else:
                self.float_activation_pairs(tile)
        self.mma_all()

    def k_left(self) -> None:
        """pk: the thread has words of K left at this step."""
        self.emit(f"shr.u32 st, {self.op('k0')}, 3;", f"sub.s32 kl, {self.op('flags', 1)}, st;",
                  "setp.gt.s32 pk, kl, 0;")

    def scale_load(self, pointer: str, tile_stride: str, dst: str) -> None:
        """dst = the 2 scale bytes (blocks 2c, 2c + 1) at pointer + (k0 / 64) * tile_stride, 0 where not pk."""
        self.emit(f"shr.u32 st, {self.op('k0')}, 6;", f"mul.wide.u32 off, st, {tile_stride};",
                  f"add.s64 ptr, {pointer}, off;", f"mov.b32 {dst}, 0;", f"@pk ld.global.u16 {dst}, [ptr];")

    def scale_pairs(self, raw: str, dst: tuple[str, str]) -> None:
        """(s, s) pairs of the two scales in the low 16 bits of ``raw``, in the step's dtype."""
        self.emit(f"mov.b32 {{h0, h1}}, {raw};", "cvt.rn.f16x2.e4m3x2 t, h0;")
        if self.dtype == "bf16":
            bias = struct.pack(">f", _BF16_SCALE_BIAS).hex().upper()
            self.emit("mov.b32 {h0, h1}, t;", "cvt.f32.f16 f0, h0;", "cvt.f32.f16 f1, h1;",
                      f"mul.f32 f0, f0, 0f{bias};", f"mul.f32 f1, f1, 0f{bias};", "cvt.rn.bf16x2.f32 t, f1, f0;")
        self.emit(f"prmt.b32 {dst[0]}, t, 0, 0x1010;", f"prmt.b32 {dst[1]}, t, 0, 0x3232;")

    def decode(self, word: str, scale: str, dsts: list[str]) -> None:
        """dsts[i] = the pair (e_i, e_{i+4}) of ``word`` times ``scale`` (fp16: byte-wise, 4 pairs at once)."""
        xe, xo = self.reg("b32", "xe"), self.reg("b32", "xo")
        self.emit(*decode_word_f16(word, ("t", "m", xe, xo), xe, xo))
        self.emit(*(f"{self.mul} {dsts[i]}, {pair}, {scale};" for i, pair in enumerate(("t", "m", xe, xo))))

    def decode_pair(self, word: str, i: int, scale: str, dst: str) -> None:
        """dst = the pair (e_i, e_{i+4}) of ``word`` times ``scale``, shifted into place (bf16's code bits
        straddle a byte boundary, so the byte-wise fp16 decode does not apply)."""
        self.emit(f"shl.b32 t, {word}, {12 - 4 * i};", "and.b32 m, t, 0x70007000;",
                  f"shr.b32 m, m, {self.mag_shift};", "and.b32 t, t, 0x80008000;", "or.b32 t, t, m;",
                  f"{self.mul} {dst}, t, {scale};")

    def weight_pairs(self) -> None:
        """a[8q + 2i + h]: (e_i, e_{i+4}) of word q of row g + 8h, times its block's scale."""
        op = self.op
        sa, a = self.regs("b32", "sa", 4), self.regs("b32", "a", 32)
        self.k_left()
        self.scale_load(op("sfa_p", 0), op("col_tile", 0), "sraw")
        self.scale_pairs("sraw", (sa[0], sa[1]))
        self.scale_load(op("sfa_p", 4), op("col_tile", 0), "sraw")
        self.scale_pairs("sraw", (sa[2], sa[3]))
        for q in range(4):
            if self.dtype == "f16":
                for h in range(2):
                    self.decode(op("words", 4 * h + q), sa[2 * h + q // 2], [a[8 * q + 2 * i + h] for i in range(4)])
            else:
                for i in range(4):
                    for h in range(2):
                        self.decode_pair(op("words", 4 * h + q), i, sa[2 * h + q // 2], a[8 * q + 2 * i + h])

    def fp4_activation_pairs(self, tile: int) -> None:
        """b[16 tile + 4q + i] for n = 8 tile + g: (x_i, x_{i+4}) of FP4 word q, times its block's scale."""
        op = self.op
        xr, bs, b = self.regs("b32", "xr", 4), self.regs("b32", "bs", 2), self.regs("b32", "b", 32)
        self.emit(f"setp.ne.s32 pn, {op('flags', 4 * tile)}, 0;", "and.pred pn, pn, pk;")
        self.emit(f"shr.u32 st, {op('k0')}, 1;", "cvt.u64.u32 off, st;", f"add.s64 ptr, {op('x_p', 4 * tile)}, off;",
                  *(f"mov.b32 {r}, 0;" for r in xr), f"@pn ld.global.v4.b32 {{{', '.join(xr)}}}, [ptr];")
        self.emit("mov.pred pk, pn;")  # the activation's scale load, masked like its words
        self.scale_load(op("sfb_p", 4 * tile), op("col_tile", 1), "sraw")
        self.scale_pairs("sraw", (bs[0], bs[1]))
        self.k_left()
        for q in range(4):
            self.decode(xr[q], bs[q // 2], [b[16 * tile + 4 * q + i] for i in range(4)])

    def float_activation_pairs(self, tile: int) -> None:
        """b[16 tile + 4q + i] for n = 8 tile + g: (x_i, x_{i+4}) of the 8 fp16/bf16 values of word q."""
        op = self.op
        xr, b = self.regs("b32", "xr", 16), self.regs("b32", "b", 32)
        self.emit(f"setp.ne.s32 pn, {op('flags', 4 * tile)}, 0;", "and.pred pn, pn, pk;")
        # 2 bytes per element of k0.
        self.emit(f"mul.wide.u32 off, {op('k0')}, 2;", f"add.s64 ptr, {op('x_p', 4 * tile)}, off;")
        self.emit(*(f"mov.b32 {r}, 0;" for r in xr))
        for v in range(4):
            self.emit(f"@pn ld.global.v4.b32 {{{', '.join(xr[4 * v:4 * v + 4])}}}, [ptr+{16 * v}];")
        for q in range(4):
            for i in range(4):
                sel = "0x5410" if i % 2 == 0 else "0x7632"
                self.emit(f"prmt.b32 {b[16 * tile + 4 * q + i]}, {xr[4 * q + i // 2]}, {xr[4 * q + 2 + i // 2]}, {sel};")

    def mma_all(self) -> None:
        """The accumulators through d (d[4t + j]: fragment register j of n-tile t), 8 mma per n-tile."""
        d = self.regs("f32", "d", 8)
        for r in range(4 * self.n_tiles):
            self.emit(f"mov.f32 {d[r]}, {self.op('acc', self.ACC[r])};")
        for tile in range(self.n_tiles):
            dt = ", ".join(d[4 * tile:4 * tile + 4])
            for q in range(4):
                for mm in range(2):
                    a = ", ".join(f"a{8 * q + 2 * i + h}" for i, h in ((2 * mm, 0), (2 * mm, 1), (2 * mm + 1, 0),
                                                                          (2 * mm + 1, 1)))
                    b = f"b{16 * tile + 4 * q + 2 * mm}, b{16 * tile + 4 * q + 2 * mm + 1}"
                    self.emit(f"mma.sync.aligned.m16n8k16.row.col.f32.{self.mma_type}.{self.mma_type}.f32 "
                              f"{{{dt}}}, {{{a}}}, {{{b}}}, {{{dt}}};")
        for r in range(8):
            out = self.op.out(self.ACC[r])
            self.emit(f"mov.f32 {out}, {d[r]};" if r < 4 * self.n_tiles else f"mov.f32 {out}, {self.op('acc', self.ACC[r])};")


def _hmma_asm(dtype: str, fp4_activation: bool, n_tiles: int) -> tuple[str, str]:
    """(asm, constraints) of ``_HmmaStep``."""
    step = _HmmaStep(dtype, fp4_activation, n_tiles)
    return step.text(), step.op.constraint_string()


_ASM_F16_1, _FLOAT_CONSTRAINTS = (tl.constexpr(x) for x in _hmma_asm("f16", False, 1))
_ASM_F16_2 = tl.constexpr(_hmma_asm("f16", False, 2)[0])
_ASM_BF16_1 = tl.constexpr(_hmma_asm("bf16", False, 1)[0])
_ASM_BF16_2 = tl.constexpr(_hmma_asm("bf16", False, 2)[0])
_ASM_FP4_1, _FP4_CONSTRAINTS = (tl.constexpr(x) for x in _hmma_asm("f16", True, 1))
_ASM_FP4_2 = tl.constexpr(_hmma_asm("f16", True, 2)[0])


@triton.jit
def _step_ptx(acc, words, sfa_p, x_p, sfb_p, flags, k0, col_tiles, FP4_ACTIVATION: tl.constexpr,
              BF16: tl.constexpr, N_TILES: tl.constexpr):
    """One step of every thread: the asm of ``_hmma_asm`` on 8 elements (2 halves x 4 words) at a time."""
    if FP4_ACTIVATION:
        if N_TILES == 1:
            asm: tl.constexpr = _ASM_FP4_1
        else:
            asm: tl.constexpr = _ASM_FP4_2
        return tl.inline_asm_elementwise(asm, _FP4_CONSTRAINTS, [acc, words, sfa_p.to(tl.int64), x_p.to(tl.int64),
                                                                 sfb_p.to(tl.int64), flags, k0, col_tiles],
                                         dtype=tl.float32, is_pure=True, pack=8)
    else:
        if BF16:
            if N_TILES == 1:
                asm: tl.constexpr = _ASM_BF16_1
            else:
                asm: tl.constexpr = _ASM_BF16_2
        else:
            if N_TILES == 1:
                asm: tl.constexpr = _ASM_F16_1
            else:
                asm: tl.constexpr = _ASM_F16_2
        return tl.inline_asm_elementwise(asm, _FLOAT_CONSTRAINTS, [acc, words, sfa_p.to(tl.int64), x_p.to(tl.int64),
                                                                   flags, k0, col_tiles],
                                         dtype=tl.float32, is_pure=True, pack=8)


@triton.jit
def _thread_value(t, Q: tl.constexpr, WARPS: tl.constexpr):
    """Element q = Q of each thread's 4 words of ``t`` ``[8, WARPS, 2, 16]``, for all 4 of them."""
    t = tl.reshape(t, [8, WARPS, 2, 4, 4])
    v = tl.sum(tl.where(tl.arange(0, 4) == Q, t, 0), axis=4)
    return tl.reshape(tl.broadcast_to(v[:, :, :, :, None], [8, WARPS, 2, 4, 4]), [8, WARPS, 2, 16])


@triton.jit
def _step_triton(acc, words, sfa_p, x_p, sfb_p, flags, k0, col_tiles, WARPS: tl.constexpr,
                 FP4_ACTIVATION: tl.constexpr, BF16: tl.constexpr):
    """``_step_ptx`` in plain Triton, from the same operands: the same products into the same accumulator
    elements, summed by ``tl.dot`` in fp32 (another order than the tensor cores': equal within rounding)."""
    q = tl.arange(0, 16)[None, None, None, :] % 4
    k_ok = (_thread_value(flags, 1, WARPS) - k0 // 8) > 0
    n_ok = _thread_value(flags, 0, WARPS) != 0  # per half = activation tile
    step_a = (k0 // 64) * _thread_value(col_tiles, 0, WARPS)
    step_b = (k0 // 64) * _thread_value(col_tiles, 1, WARPS)
    # Weights [g, warp, half, word, e], rows g + 8 * half; word q's block is 2c + q // 2.
    sfa = decode_scale(tl.load(sfa_p + step_a + q // 2, mask=k_ok, other=0), "nvfp4")
    a = e2m1_word_values(words) * sfa[:, :, :, :, None]
    a = tl.reshape(tl.permute(a, (1, 2, 0, 3, 4)), [WARPS, 16, 128])  # [warp, row, k = 8 * word + e]
    # Activation [g, warp, tile, word, e] for n = g + 8 * tile (the halves of the pointer tensors).
    x_ok = k_ok & n_ok
    if FP4_ACTIVATION:
        x_words = tl.load((x_p + k0 // 2 + 4 * q).to(tl.pointer_type(tl.int32)), mask=x_ok, other=0)
        sfb = decode_scale(tl.load(sfb_p + step_b + q // 2, mask=x_ok, other=0), "nvfp4")
        x = e2m1_word_values(x_words) * sfb[:, :, :, :, None]
    else:
        e = tl.arange(0, 8)[None, None, None, None, :]
        x_ptrs = x_p[:, :, :, :, None] + 2 * k0 + 16 * q[:, :, :, :, None] + 2 * e
        if BF16:
            x = tl.load(x_ptrs.to(tl.pointer_type(tl.bfloat16)), mask=x_ok[:, :, :, :, None], other=0).to(tl.float32)
        else:
            x = tl.load(x_ptrs.to(tl.pointer_type(tl.float16)), mask=x_ok[:, :, :, :, None], other=0).to(tl.float32)
    x = tl.reshape(tl.permute(x, (1, 2, 0, 3, 4)), [WARPS, 16, 128])  # [warp, n = 8 * tile + g, k]
    c = tl.dot(a, tl.trans(x, (0, 2, 1)), input_precision="ieee")  # [warp, row, n]
    # acc[g, warp, half, 4c + 2t + p] = C[warp][g + 8 * half][8t + 2c + p]
    c = tl.reshape(c, [WARPS, 2, 8, 2, 4, 2])  # [warp, half, g, t, c, p]
    c = tl.reshape(tl.permute(c, (2, 0, 1, 4, 3, 5)), [8, WARPS, 2, 16])
    return acc + c


@triton.jit
def hmma_gemv_kernel(
    a_ptr, sfa_ptr, b_ptr, sfb_ptr, gsa_ptr, gsb_ptr, c_ptr,
    M, N, K,
    a_stride_l, a_stride_m,
    sfa_stride_l, sfa_stride_row_tile, sfa_stride_r32, sfa_stride_r4, sfa_stride_col_tile,
    b_stride_l, b_stride_n,
    sfb_stride_l, sfb_stride_row_tile, sfb_stride_r32, sfb_stride_r4, sfb_stride_col_tile,
    c_stride_l, c_stride_m, c_stride_n,
    WARPS: tl.constexpr,
    FP4_ACTIVATION: tl.constexpr,
    BF16: tl.constexpr,
    N_TILES: tl.constexpr,
    HAS_GSA: tl.constexpr,
    HAS_GSB: tl.constexpr,
    USE_PTX: tl.constexpr,
):
    # a: int32 words of 8 codes, strides in words.  b: bytes (FP4 words or fp16/bf16), strides in bytes.
    pid_m = tl.program_id(0)
    pid_l = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, 8)[:, None, None, None]
    warp = tl.arange(0, WARPS)[None, :, None, None]
    half = tl.arange(0, 2)[None, None, :, None]
    w = tl.arange(0, 16)[None, None, None, :]
    q = w % 4
    c = w // 4
    word = warp * 16 + w  # within a step
    rows_in = tl.minimum(pid_m * 16 + g + 8 * half, M - 1)  # tail rows re-read row M-1; only the store is masked
    # Rows start 16-byte aligned (K is a multiple of 64: K/8 words, a multiple of 8, per row); written as
    # multiples of 4 words so Triton can prove it for any K, which keeps the 16-byte loads, and with them
    # the layout the asm relies on (without the proof Triton loads one word per thread).
    a_rows = a_ptr + (pid_l * (a_stride_l // 4) + rows_in.to(tl.int64) * (a_stride_m // 4)) * 4
    # Per-thread bases at step 0 (every word q of a thread gets its thread's value).
    blk = warp * 8 + 2 * c  # the thread's first 16-element block in a step
    sfa_p = (sfa_ptr + pid_l * sfa_stride_l + scale_row_offset(rows_in, sfa_stride_row_tile, sfa_stride_r32,
                                                               sfa_stride_r4)
             + (blk // 4) * sfa_stride_col_tile + blk % 4)
    n = g + 8 * half  # activation row of the thread's half (tile)
    n_in = tl.minimum(n, N - 1)
    if FP4_ACTIVATION:
        x_p = b_ptr + pid_l * b_stride_l + n_in.to(tl.int64) * b_stride_n + 4 * (warp * 16 + 4 * c)
        sfb_p = (sfb_ptr + pid_l * sfb_stride_l + scale_row_offset(n_in, sfb_stride_row_tile, sfb_stride_r32,
                                                                   sfb_stride_r4)
                 + (blk // 4) * sfb_stride_col_tile + blk % 4)
    else:
        x_p = b_ptr + pid_l * b_stride_l + n_in.to(tl.int64) * b_stride_n + 2 * (warp * 128 + 32 * c)
        sfb_p = sfa_p
    zero = tl.zeros([8, WARPS, 2, 16], dtype=tl.int32)
    flags = tl.where(q == 0, (n < N).to(tl.int32), tl.where(q == 1, K // 8 - (warp * 16 + 4 * c), 0)) + zero
    col_tiles = tl.where(q == 0, sfa_stride_col_tile, sfb_stride_col_tile) + zero
    x_p = x_p + zero
    sfa_p = sfa_p + zero
    sfb_p = sfb_p + zero
    acc = tl.zeros([8, WARPS, 2, 16], dtype=tl.float32)
    for k0 in range(0, K, WARPS * 128):
        # The mask is per thread's 4-word chunk (all in K or all out: K is a multiple of 64); a mask that could
        # change within the chunk made Triton split each 16-byte load into four 4-byte loads.
        kw = k0 // 8 + word
        words = tl.load(a_rows + kw, mask=(k0 // 8 + warp * 16 + 4 * c) * 8 < K, other=0)
        if USE_PTX:
            acc = _step_ptx(acc, words, sfa_p, x_p, sfb_p, flags, k0 + zero, col_tiles, FP4_ACTIVATION, BF16,
                            N_TILES)
        else:
            acc = _step_triton(acc, words, sfa_p, x_p, sfb_p, flags, k0, col_tiles, WARPS, FP4_ACTIVATION, BF16)
    out = tl.sum(acc, axis=1)  # [g, half, word]: C[g + 8 * half][n(word)]
    if USE_PTX:
        if FP4_ACTIVATION:
            out = out * (FP16_FOLD * FP16_FOLD)
        elif BF16:
            out = out * BF16_FOLD
        else:
            out = out * FP16_FOLD
    out = apply_global_scales(out, gsa_ptr, gsb_ptr, HAS_GSA, HAS_GSB)
    ww = tl.arange(0, 16)[None, None, :]
    n_out = 8 * ((ww % 4) // 2) + 2 * (ww // 4) + ww % 2
    out_rows = pid_m * 16 + tl.arange(0, 8)[:, None, None] + 8 * tl.arange(0, 2)[None, :, None]
    c_ptrs = c_ptr + pid_l * c_stride_l + out_rows.to(tl.int64) * c_stride_m + n_out * c_stride_n
    store_rounded(c_ptrs, out, (out_rows < M) & (n_out < N))


class HmmaConfig(NamedTuple):
    """One launch of :func:`hmma_gemv_kernel`: 16 rows per program, ``warps`` warps side by side along K, each on
    128 elements per step (a power of two, at most ``MAX_WARPS``)."""

    warps: int


def hmma_config(m: int, k: int, l: int) -> HmmaConfig:  # noqa: E741
    """The configuration for ``l`` batches of ``m x k`` weights (any N from 1 to 16), measured on the H200.

    docs/performance.md (the ``mma.sync`` kernel's sweep): 4 warps along K, except 8 for few rows (M x L < 7168) and long K
    (>= 8192), where the 16-row programs alone cannot keep the GPU busy; never more than K / 128 warps.
    """
    warps = 8 if m * l < 7168 and k >= 8192 else 4
    return HmmaConfig(min(warps, pow2_at_most(k // 128)))


def _aligned_16(meta: FP4Meta) -> bool:
    """Packed rows 16-byte aligned (16-byte loads) and scale rows 2-byte aligned (two blocks' scales per load)."""
    return meta.align >= 16 and meta.scale_align >= 2


class Hmma(TritonKernelSpec):
    """NVFP4 weights times fp16/bf16 activations (any N), or times NVFP4 activations with N > 1, on the tensor
    cores.  Its 16-bit operands hold e2m1 x e4m3 exactly (e8m0 scales and fp32 activations do not fit them);
    it reads 16-byte rows, so K must be a multiple of 64, the packed data 16-byte aligned and the scale rows
    2-byte aligned; a float activation must be contiguous along K with 16-byte aligned rows."""

    name = "hmma"
    config_type = HmmaConfig

    def why_not(self, case: GemvCase, target: Target) -> str | None:
        if not target.runs_triton:
            return "runs Triton kernels only"
        if too_many_rows(case) is not None:
            return too_many_rows(case)
        if target.mode == "ptx" and not PTX_LAYOUT_VERIFIED:
            return (f"its PTX step reads operands in Triton 3.6's register layout (verified for 3.6 only), this is "
                    f"Triton {triton.__version__}")
        if case.fmt.name != "nvfp4":
            return "needs NVFP4 (e4m3 scales fold into its 16-bit operands)"
        if case.k % 64:
            return f"needs K a multiple of 64, got K = {case.k}"
        if not target.e4m3x2_cvt:
            return f"needs cvt.rn.f16x2.e4m3x2 (sm_89 or newer; this is {target.describe()})"
        if not _aligned_16(case.a):
            return "a: needs 16-byte aligned data rows and 2-byte aligned scale rows"
        if case.fp4_activation:
            if case.n == 1:
                return "FP4 activations with N = 1 go to w4a4"
            if not _aligned_16(case.b):
                return "b: needs 16-byte aligned data rows and 2-byte aligned scale rows"
        else:
            if case.b.dtype not in (torch.float16, torch.bfloat16):
                return f"needs fp16 or bf16 activations, got {case.b.dtype}"
            if case.b.dtype == torch.bfloat16 and not target.bf16x2_mul:
                return f"needs mul.rn.bf16x2 for bf16 activations (sm_90 or newer; this is {target.describe()})"
            if case.b.align < 16:
                return "b: needs rows contiguous along K at 16-byte aligned addresses"
        return None

    def default_config(self, case: GemvCase, target: Target) -> HmmaConfig:
        return hmma_config(case.m, case.k, case.batch)

    def error_model(self, case: GemvCase, config: HmmaConfig) -> ErrorModel:
        """Every product in one fp32 accumulation; the fold is 2^-14 (fp16) or 2^-7 (bf16) per FP4 operand and
        the activation's (module docstring)."""
        if case.fp4_activation:
            return ErrorModel(tensor_cores=True, fold=28)
        return ErrorModel(tensor_cores=True, fold=14 if case.b.dtype == torch.float16 else 7)

    def check_config(self, config: HmmaConfig, case: GemvCase | None = None) -> None:
        check_powers_of_two(config, ("warps",))
        if config.warps > MAX_WARPS:
            raise ValueError(f"config: expected 1 to {MAX_WARPS} warps, got {config} (16 warps gave wrong results "
                             "on the H200; docs/performance.md, \"Compile time, and the 16-warp hmma result\")")

    def triton_launch(self, case: GemvCase, config: HmmaConfig, target: Target) -> TritonLaunch:
        """a: int32 words of 8 codes (strides in words); b: bytes (FP4 data, or the fp16/bf16 activation read as
        bytes), strides in bytes."""
        a, b = case.a, case.b
        fp4 = case.fp4_activation
        if fp4:
            b_strides = (b.batch_stride, b.row_stride)
            sfb = b.scales
        else:
            size = 2
            b_strides = (b.strides[0] * size, b.strides[1] * size)
            sfb = (0, 0, 0, 0, 0)
        gsa_ptr, gsb_ptr = global_scale_sources(case)
        args = dict(
            a_ptr=Src("a_data", torch.int32), sfa_ptr=Src("a_scales", torch.uint8),
            b_ptr=Src("b_data", torch.uint8), sfb_ptr=Src("b_scales" if fp4 else "a_scales", torch.uint8),
            gsa_ptr=gsa_ptr, gsb_ptr=gsb_ptr,
            c_ptr=Src("out", case.out_dtype),
            M=case.m, N=case.n, K=case.k,
            a_stride_l=a.batch_stride // 4, a_stride_m=a.row_stride // 4,
            sfa_stride_l=a.scales.batch, sfa_stride_row_tile=a.scales.row_tile, sfa_stride_r32=a.scales.r32,
            sfa_stride_r4=a.scales.r4, sfa_stride_col_tile=a.scales.col_tile,
            b_stride_l=b_strides[0], b_stride_n=b_strides[1],
            sfb_stride_l=sfb[0], sfb_stride_row_tile=sfb[1], sfb_stride_r32=sfb[2], sfb_stride_r4=sfb[3],
            sfb_stride_col_tile=sfb[4],
            c_stride_l=case.out_strides[0], c_stride_m=case.out_strides[1], c_stride_n=case.out_strides[2],
            WARPS=config.warps, FP4_ACTIVATION=fp4, BF16=case.activation_dtype == torch.bfloat16,
            N_TILES=1 if case.n <= 8 else 2, HAS_GSA=a.has_global_scale, HAS_GSB=fp4 and b.has_global_scale,
            USE_PTX=target.mode == "ptx",
        )
        return TritonLaunch(hmma_gemv_kernel, (triton.cdiv(case.m, 16), case.batch), args,
                            dict(num_warps=config.warps, num_stages=1))
