"""NVFP4 GEMV on the tensor cores: weights decoded to 16-bit floats with their scales folded in, then ``tl.dot``.

For W4A16 (fp16 or bf16 activations, N = 1..16) and NVFP4 W4A4 with N > 1.  The dp4a kernels decode every
weight block once per activation row and need fp32 work per element for float activations; here each weight
element is decoded once into the operand of a matrix product whose N (padded to 16) costs the tensor cores
nothing extra, so N = 1..16 read the weights once at nearly the same speed.

Exactness.  An e2m1 value t (a multiple of 1/2, at most 6) put into fp16 bits as ``sign << 15 | code << 9``
reads as t * 2^-14 (the fp16 subnormal range holds code 1, 0.5 * 2^-14, exactly).  Times an e4m3 scale s
(a multiple of 2^-9, |s| <= 448) the fp16 product t * s * 2^-14 is exact: it is a multiple of 2^-24 (fp16's
subnormal step) with at most 2 x 4 significant bits, below 0.17.  So the folded weight is exact in fp16, and
also in bf16 (8 significant bits, far wider range), into which it converts exactly for bf16 activations.
The tensor cores multiply exactly and accumulate in fp32; the factor 2^14 per FP4 operand comes back in the
epilogue with the global scales, and c is rounded once to its dtype.  Unlike ``w4a4.py`` the 16-element
block sums are not formed separately: all products of a K step enter one fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import ScaleAddressing, scale_row_offset, to_bfloat16_rne
from .configs import MmaConfig

__all__ = ["mma_gemv_kernel", "launch_mma_gemv"]

def _pairs_ptx(mag_shift: int, mul: str) -> str:
    """PTX for 4 pairs of 16-bit floats from two int16 words: output i holds code i of each word, times the
    words' scales (input 5, one per half).

    Code i of each 16-bit half is shifted to bits 12..15 (sign at 15), then its 3 magnitude bits move down by
    ``mag_shift`` (3: fp16, to bits 9..11; 6: bf16, to bits 6..8): (x & 0x80008000) | ((x & 0x70007000) >> s).
    """
    body = "".join(
        f"shl.b32 t, $4, {12 - 4 * i};\n"
        "and.b32 m, t, 0x70007000;\n"
        f"shr.b32 m, m, {mag_shift};\n"
        "and.b32 t, t, 0x80008000;\n"
        "or.b32 t, t, m;\n"
        f"{mul} ${i}, t, $5;\n"
        for i in range(4)
    )
    return "{\n.reg .b32 t, m;\n" + body + "}"


_FP16_PAIRS_PTX = tl.constexpr(_pairs_ptx(3, "mul.rn.f16x2"))
_BF16_PAIRS_PTX = tl.constexpr(_pairs_ptx(6, "mul.rn.bf16x2"))
# What the bit placement leaves on a decoded e2m1 value: fp16 2^-14 (fp16's smallest normal), bf16 2^-126.
# bf16 scales are multiplied by 2^119 (exact, below bf16's maximum for |s| <= 448) so the product of the two,
# value * s * 2^-7, stays a normal bf16; the epilogue multiplies by FOLD.
FP16_FOLD = tl.constexpr(2.0**14)
BF16_SCALE_BIAS = tl.constexpr(2.0**119)
BF16_FOLD = tl.constexpr(2.0**7)


@triton.jit
def _scaled_codes_ptx(words, word_scales):
    """int16 words of 4 packed e2m1 codes and one scale per word (the dtype of the result) to 4 tensors:
    code i of each word in 16-bit float bits, times the scale (exact; see the module docstring), in PTX.

    Two words per call (``pack=2``, one 32-bit register): output register i is the pair (code i of word w,
    code i of word w + 1), 4-5 instructions each including the multiplication.
    """
    if word_scales.dtype == tl.float16:
        return tl.inline_asm_elementwise(
            asm=_FP16_PAIRS_PTX, constraints="=r,=r,=r,=r,r,r", args=[words, word_scales],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(
            asm=_BF16_PAIRS_PTX, constraints="=r,=r,=r,=r,r,r", args=[words, word_scales],
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)


@triton.jit
def _e2m1_bits(code, DTYPE: tl.constexpr):
    """One e2m1 code (integer 0..15) placed in DTYPE bits: sign to bit 15, magnitude to the exponent's low
    bits and the top mantissa bit."""
    c = code.to(tl.int16)
    if DTYPE == tl.float16:
        return (((c & 8) << 12) | ((c & 7) << 9)).to(tl.float16, bitcast=True)
    else:
        return (((c & 8) << 12) | ((c & 7) << 6)).to(tl.bfloat16, bitcast=True)


@triton.jit
def _scaled_codes_triton(words, word_scales):
    """``_scaled_codes_ptx`` in plain Triton (same bits)."""
    w = words.to(tl.int16)
    dt: tl.constexpr = word_scales.dtype
    return (_e2m1_bits(w & 15, dt) * word_scales, _e2m1_bits((w >> 4) & 15, dt) * word_scales,
            _e2m1_bits((w >> 8) & 15, dt) * word_scales, _e2m1_bits((w >> 12) & 15, dt) * word_scales)


@triton.jit
def _decode_scaled(words, scale_bytes, ROWS: tl.constexpr, K: tl.constexpr, DTYPE: tl.constexpr,
                   USE_PTX: tl.constexpr):
    """FP4 ``[ROWS, K]`` as int16 words ``[ROWS, K/4]`` and e4m3 scale bytes ``[ROWS, K/16]`` to DTYPE
    ``[ROWS, K]`` in the kernel's K order (``permute_k``): value * scale / FOLD, exact.

    The K order: within each 8 elements, [0, 4, 1, 5, 2, 6, 3, 7], so the pair in one register (code i of
    two neighbouring words) is a pair of neighbours along K for the tensor cores.
    """
    s = scale_bytes.to(tl.float8e4nv, bitcast=True)
    if DTYPE == tl.float16:
        s = s.to(tl.float16)
    else:
        s = (s.to(tl.float32) * BF16_SCALE_BIAS).to(tl.bfloat16)
    word_scales = tl.reshape(tl.broadcast_to(s[:, :, None], [ROWS, K // 16, 4]), [ROWS, K // 4])
    if USE_PTX:
        c0, c1, c2, c3 = _scaled_codes_ptx(words, word_scales)
    else:
        c0, c1, c2, c3 = _scaled_codes_triton(words, word_scales)
    # [ROWS, K/4, a, b] holds code a + 2b of each word.
    codes = tl.join(tl.join(c0, c1), tl.join(c2, c3))
    w = tl.reshape(codes, [ROWS, K // 8, 2, 2, 2])  # [rows, group of 8, word parity p, a, b]
    return tl.reshape(tl.permute(w, (0, 1, 4, 3, 2)), [ROWS, K])  # k = 8g + 4b + 2a + p


@triton.jit
def permute_k(x, ROWS: tl.constexpr, K: tl.constexpr):
    """A float tile ``[ROWS, K]`` in ``_decode_scaled``'s K order."""
    x = tl.reshape(x, [ROWS, K // 8, 2, 4])  # element 8g + 4p + i
    return tl.reshape(tl.permute(x, (0, 1, 3, 2)), [ROWS, K])  # at 8g + 2i + p


@triton.jit
def _load_fp4_step(row_ptrs, sf_rows, k_start, K, sf_stride_col_tile, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The int16 words ``[R, BLOCK_K/4]`` and scale bytes ``[R, BLOCK_K/16]`` of each row's step starting at
    element ``k_start`` (``[R, 1]``)."""
    kw = tl.arange(0, BLOCK_K // 4)[None, :]
    kc = tl.arange(0, BLOCK_K // 16)[None, :]
    j = k_start // 16 + kc
    # Scale columns come in runs of 4 contiguous bytes, 4-byte aligned, in every supported layout (and every
    # row's scales start 4-byte aligned): one 32-bit load per 4 blocks.
    sf_col = tl.max_contiguous(tl.multiple_of((j // 4) * sf_stride_col_tile + j % 4, [1, 4]), [1, 4])
    if EVEN_K:
        words = tl.load(row_ptrs + k_start // 4 + kw)
        sf = tl.load(sf_rows + sf_col)
    else:
        words = tl.load(row_ptrs + k_start // 4 + kw, mask=k_start + 4 * kw < K, other=0)
        sf = tl.load(sf_rows + sf_col, mask=k_start + 16 * kc < K, other=0)
    return words, sf


@triton.jit
def mma_gemv_kernel(
    a_ptr, sfa_ptr, b_ptr, sfb_ptr, gsa_ptr, gsb_ptr, c_ptr,
    M, N, K,
    a_stride_l, a_stride_m,
    sfa_stride_l, sfa_stride_row_tile, sfa_stride_r32, sfa_stride_r4, sfa_stride_col_tile,
    b_stride_l, b_stride_n, b_stride_k,
    sfb_stride_l, sfb_stride_row_tile, sfb_stride_r32, sfb_stride_r4, sfb_stride_col_tile,
    c_stride_l, c_stride_m, c_stride_n,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    N_PAD: tl.constexpr,
    FP4_ACTIVATION: tl.constexpr,
    HAS_GSA: tl.constexpr,
    HAS_GSB: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PTX: tl.constexpr,
    KSPLIT: tl.constexpr = 1,
):
    # a, b (FP4): int16 words of 4 codes, strides in words.  b (float): elements.
    # A step covers KSPLIT chunks of BLOCK_K elements side by side: with KSPLIT > 1 the tiles are
    # [KSPLIT, ROWS, BLOCK_K] (built as [KSPLIT * ROWS, ...] rows, chunk-major) and the dot is batched over
    # the chunks, which puts warps side by side along K; the chunk sums are added at the end.
    pid_m = tl.program_id(0)
    pid_l = tl.program_id(1).to(tl.int64)
    tile_rows = tl.arange(0, KSPLIT * ROWS)
    rows = pid_m * ROWS + tile_rows % ROWS
    rows_in = tl.minimum(rows, M - 1)[:, None]  # tail rows re-read row M-1; only the store is masked
    a_chunk = (tile_rows // ROWS * BLOCK_K)[:, None]  # each tile row's K offset within a step
    a_rows = a_ptr + pid_l * a_stride_l + rows_in.to(tl.int64) * a_stride_m
    sfa_rows = (sfa_ptr + pid_l * sfa_stride_l
                + tl.multiple_of(scale_row_offset(rows_in, sfa_stride_row_tile, sfa_stride_r32, sfa_stride_r4), [4, 1]))
    tile_n = tl.arange(0, KSPLIT * N_PAD)
    n_ok = (tile_n % N_PAD < N)[:, None]
    n_in = tl.minimum(tile_n % N_PAD, N - 1)[:, None]
    b_chunk = (tile_n // N_PAD * BLOCK_K)[:, None]
    b_rows = b_ptr + pid_l * b_stride_l + n_in.to(tl.int64) * b_stride_n
    if FP4_ACTIVATION:
        sfb_rows = (sfb_ptr + pid_l * sfb_stride_l
                    + tl.multiple_of(scale_row_offset(n_in, sfb_stride_row_tile, sfb_stride_r32, sfb_stride_r4), [4, 1]))
    ke = tl.arange(0, BLOCK_K)[None, :]
    # The 16-bit float type of the tensor-core operands: the activation's, fp16 for FP4 activations.
    if FP4_ACTIVATION:
        DTYPE: tl.constexpr = tl.float16
    else:
        DTYPE: tl.constexpr = b_ptr.dtype.element_ty

    if KSPLIT == 1:
        acc = tl.zeros([ROWS, N_PAD], dtype=tl.float32)
    else:
        acc = tl.zeros([KSPLIT, ROWS, N_PAD], dtype=tl.float32)
    for k0 in range(0, K, KSPLIT * BLOCK_K):
        a, sfa = _load_fp4_step(a_rows, sfa_rows, k0 + a_chunk, K, sfa_stride_col_tile, BLOCK_K, EVEN_K)
        w = _decode_scaled(a, sfa, KSPLIT * ROWS, BLOCK_K, DTYPE, USE_PTX)
        if FP4_ACTIVATION:
            b, sfb = _load_fp4_step(b_rows, sfb_rows, k0 + b_chunk, K, sfb_stride_col_tile, BLOCK_K, EVEN_K)
            x = _decode_scaled(b, sfb, KSPLIT * N_PAD, BLOCK_K, DTYPE, USE_PTX)
        else:
            k = k0 + b_chunk + ke
            x_ptrs = b_rows + k.to(tl.int64) * b_stride_k
            if EVEN_K:
                x = tl.load(x_ptrs, mask=n_ok, other=0)
            else:
                x = tl.load(x_ptrs, mask=n_ok & (k < K), other=0)
            x = permute_k(x, KSPLIT * N_PAD, BLOCK_K)
        if KSPLIT == 1:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(tl.reshape(w, [KSPLIT, ROWS, BLOCK_K]),
                         tl.trans(tl.reshape(x, [KSPLIT, N_PAD, BLOCK_K]), (0, 2, 1)), acc)
    if KSPLIT > 1:
        acc = tl.sum(acc, axis=0)
    rows = pid_m * ROWS + tl.arange(0, ROWS)
    n = tl.arange(0, N_PAD)
    # Undo the fold, once per FP4 operand.
    if DTYPE == tl.float16:
        fold = FP16_FOLD
    else:
        fold = BF16_FOLD
    if FP4_ACTIVATION:
        out = acc * fold * fold
    else:
        out = acc * fold
    if HAS_GSA and HAS_GSB:
        out = out * (tl.load(gsa_ptr) * tl.load(gsb_ptr))
    elif HAS_GSA:
        out = out * tl.load(gsa_ptr)
    elif HAS_GSB:
        out = out * tl.load(gsb_ptr)
    c_ptrs = c_ptr + pid_l * c_stride_l + rows.to(tl.int64)[:, None] * c_stride_m + n[None, :] * c_stride_n
    if c_ptr.dtype.element_ty == tl.bfloat16:
        out = to_bfloat16_rne(out)
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (n < N)[None, :])


def launch_mma_gemv(
    a_words: torch.Tensor,
    sfa: torch.Tensor,
    sfa_addressing: ScaleAddressing,
    b: torch.Tensor,
    sfb: torch.Tensor | None,
    sfb_addressing: ScaleAddressing | None,
    c: torch.Tensor,
    *,
    k: int,
    global_scale_a: torch.Tensor | None,
    global_scale_b: torch.Tensor | None,
    config: MmaConfig,
    use_ptx: bool,
) -> None:
    """Launch :func:`mma_gemv_kernel`; nothing is validated here (``fp4gemv.gemv`` does that).

    a_words: int16 ``[L, M, K/4]`` (NVFP4 data, 4 codes per word), stride 1 along K/4 (batch stride may be 0).
    sfa: e4m3 scale bytes (uint8) of a, addressed by ``sfa_addressing`` from ``sfa.data_ptr()``.
    b: int16 ``[L, N, K/4]`` NVFP4 words with scale bytes ``sfb`` / ``sfb_addressing`` (W4A4), or float16 /
        bfloat16 ``[L, N, K]`` with ``sfb = sfb_addressing = None`` (W4A16); any strides.  1 <= N <= 16.
    c: ``[L, M, N]`` float16/bfloat16/float32, any strides; written.
    global_scale_a, global_scale_b: one-element float32 tensors or None.
    """
    batch, m, _ = a_words.shape
    n = b.shape[1]
    fp4_activation = sfb is not None
    if not fp4_activation:
        sfb, sfb_addressing = sfa, ScaleAddressing(0, 0, 0, 0, 0)  # never read
    b_strides = (b.stride(0), b.stride(1), 1) if fp4_activation else b.stride()
    mma_gemv_kernel[(triton.cdiv(m, config.rows), batch)](
        a_words, sfa, b, sfb,
        sfa if global_scale_a is None else global_scale_a,
        sfa if global_scale_b is None else global_scale_b,
        c,
        m, n, k,
        a_words.stride(0), a_words.stride(1),
        *sfa_addressing,
        *b_strides,
        *sfb_addressing,
        *c.stride(),
        ROWS=config.rows, BLOCK_K=config.block_k, N_PAD=16, FP4_ACTIVATION=fp4_activation,
        HAS_GSA=global_scale_a is not None, HAS_GSB=global_scale_b is not None,
        EVEN_K=(k % (config.block_k * config.ksplit) == 0), USE_PTX=use_ptx, KSPLIT=config.ksplit,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
