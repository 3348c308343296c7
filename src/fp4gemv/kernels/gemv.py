"""Batched block-scaled FP4 GEMV for every supported case: ``c[l, m, n] = sum_k a[l, m, k] * b[l, n, k]``.

The general kernel: ``fp4gemv.gemv`` runs it where the faster ones (``w4a4.py``, ``hmma_gemv.py``) do not
apply (MXFP4 with float activations or N > 1, fp32 activations, K not a multiple of 64, unaligned rows).

a is FP4 (NVFP4: e4m3 scale per 16 elements; MXFP4: e8m0 per 32).  b is either FP4 of the same format
(W4A4) or a float16/bfloat16/float32 activation (W4A16), with N = 1..16 rows.

One program computes ``ROWS`` output rows of one batch for all N activation rows, walking K in steps of
``BLOCKS`` 16-element blocks (one int64 each; an MXFP4 32-element block is two of them sharing one scale).
Each weight block is loaded once per program and used for every activation row.  Scales of either operand
are addressed through five strides that cover the linear layout and the 128x4 swizzle in one formula
(:class:`ScaleAddressing`).  The loop has the shape of ``w4a4.py``'s; for W4A4 NVFP4 with N = 1 it computes
what w4a4.py computes, bit for bit at ``ksplit = 1`` (tested; w4a4.py's ksplit, unroll, PDL and per-row
activation loads are not ported here):

* W4A4: each block's exact integer dot product (``_decode``: doubled integers, PTX or pure Triton, equal bit
  for bit) times ``sfa * sfb`` (exact in fp32: 4-bit significands, or powers of two), accumulated in fp32.
* W4A16: weights decode to exact doubled values, are multiplied by the activation in fp32 (exact for fp16
  and bf16 activations, rounded for fp32), summed per block in fp32 and scaled by the weight scale.

The product of the global scales multiplies the result in the epilogue; c is rounded once to its dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import GemvOperands, apply_global_scales, decode_scale, scale_row_offset, store_rounded
from ._decode import MAG_TABLE, activation_bytes, block_dot_ptx, block_dot_triton, doubled_e2m1, unpack_block
from .gemv_configs import GemvKernelConfig

__all__ = ["gemv_kernel", "launch_gemv"]


@triton.jit
def _scale_cols(j, stride_col_tile, SCALE_BLOCK: tl.constexpr):
    """Offsets of the scales of 16-element blocks ``j``; an MXFP4 scale covers two of them."""
    if SCALE_BLOCK == 16:
        # Scale columns come in runs of 4 contiguous bytes in every supported layout.
        return tl.max_contiguous(tl.multiple_of((j // 4) * stride_col_tile + j % 4, 2), 2)
    else:
        col = j // 2
        return (col // 4) * stride_col_tile + col % 4


@triton.jit
def _load_k(ptrs, k_ok, EVEN_K: tl.constexpr):
    """Load, masking K-blocks past the end (zeros) only when the last step is partial."""
    if EVEN_K:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=k_ok, other=0)


@triton.jit
def gemv_kernel(
    a_ptr, sfa_ptr, b_ptr, sfb_ptr, gsa_ptr, gsb_ptr, c_ptr,
    M, NB,
    a_stride_l, a_stride_m,
    sfa_stride_l, sfa_stride_row_tile, sfa_stride_r32, sfa_stride_r4, sfa_stride_col_tile,
    b_stride_l, b_stride_n, b_stride_k,
    sfb_stride_l, sfb_stride_row_tile, sfb_stride_r32, sfb_stride_r4, sfb_stride_col_tile,
    c_stride_l, c_stride_m, c_stride_n,
    mag_lo, mag_hi,
    N: tl.constexpr,
    N_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCKS: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    FP4_ACTIVATION: tl.constexpr,
    HAS_GSA: tl.constexpr,
    HAS_GSB: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PTX: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_l = tl.program_id(1).to(tl.int64)
    rows = pid_m * ROWS + tl.arange(0, ROWS)
    # Tail rows re-read row M-1 (and padding activation rows re-read row N-1) instead of masking every
    # load; only the store is masked.
    rows_in = tl.minimum(rows, M - 1)
    a_rows = a_ptr + pid_l * a_stride_l + rows_in.to(tl.int64)[:, None] * a_stride_m
    sfa_rows = sfa_ptr + pid_l * sfa_stride_l + scale_row_offset(rows_in, sfa_stride_row_tile, sfa_stride_r32,
                                                                 sfa_stride_r4)
    n = tl.arange(0, N_PAD)
    n_in = tl.minimum(n, N - 1)
    b_rows = b_ptr + pid_l * b_stride_l + n_in.to(tl.int64)[:, None] * b_stride_n  # [N_PAD, 1]
    sfb_rows = sfb_ptr + pid_l * sfb_stride_l + scale_row_offset(n_in, sfb_stride_row_tile, sfb_stride_r32,
                                                                 sfb_stride_r4)

    cols = tl.arange(0, BLOCKS)
    acc = tl.zeros([ROWS, N_PAD, BLOCKS], dtype=tl.float32)
    # The prmt table in per-thread registers, as in w4a4.py: a condition ptxas cannot fold keeps it from
    # copying a uniform value into a fresh register before every prmt.  It only fails for blocks past K,
    # which are masked to zero anyway.
    tab_lo = tl.where(cols < NB, mag_lo, 0)
    tab_hi = tl.where(cols < NB, mag_hi, 0)
    for j0 in range(0, NB, BLOCKS):
        j = j0 + cols
        k_ok = j < NB
        a = _load_k(a_rows + j[None, :], k_ok[None, :], EVEN_K)
        sfa_col = _scale_cols(j, sfa_stride_col_tile, SCALE_BLOCK)
        sfa = decode_scale(_load_k(sfa_rows[:, None] + sfa_col[None, :], k_ok[None, :], EVEN_K), SCALE_BLOCK)
        if FP4_ACTIVATION:
            b = _load_k(b_rows + j[None, :], k_ok[None, :], EVEN_K)
            sfb_col = _scale_cols(j, sfb_stride_col_tile, SCALE_BLOCK)
            sfb = decode_scale(_load_k(sfb_rows[:, None] + sfb_col[None, :], k_ok[None, :], EVEN_K), SCALE_BLOCK)
            scale = sfa[:, None, :] * sfb[None, :, :]
            # [ROWS, 1, BLOCKS] weight blocks against [1, N_PAD, BLOCKS] activation blocks.
            if USE_PTX:
                b_lo, b_hi = activation_bytes(b, tab_lo[None, :], tab_hi[None, :])
                block = block_dot_ptx(a[:, None, :], b_lo[None, :, :], b_hi[None, :, :],
                                      tab_lo[None, None, :], tab_hi[None, None, :])
            else:
                block = block_dot_triton(a[:, None, :], doubled_e2m1(unpack_block(b)).to(tl.int32)[None, :, :, :])
            acc += block * scale
        else:
            k_idx = j[:, None] * 16 + tl.arange(0, 16)[None, :]  # [BLOCKS, 16] element indices
            x = _load_k(b_rows[:, :, None] + k_idx[None, :, :] * b_stride_k, k_ok[None, :, None], EVEN_K)
            w = doubled_e2m1(unpack_block(a)).to(tl.float32)  # [ROWS, BLOCKS, 16], exact
            block = tl.sum(w[:, None, :, :] * x.to(tl.float32)[None, :, :, :], axis=3)
            acc += block * sfa[:, None, :]
    # Block sums carry a factor 4 (W4A4: both operands doubled) or 2 (W4A16: weights doubled).
    if FP4_ACTIVATION:
        out = tl.sum(acc, axis=2) * 0.25
    else:
        out = tl.sum(acc, axis=2) * 0.5
    out = apply_global_scales(out, gsa_ptr, gsb_ptr, HAS_GSA, HAS_GSB)
    c_ptrs = c_ptr + pid_l * c_stride_l + rows.to(tl.int64)[:, None] * c_stride_m + n[None, :] * c_stride_n
    store_rounded(c_ptrs, out, (rows < M)[:, None] & (n < N)[None, :])


def launch_gemv(ops: GemvOperands, *, scale_block: int, config: GemvKernelConfig, use_ptx: bool) -> None:
    """Launch :func:`gemv_kernel`; nothing is validated here (``fp4gemv.gemv`` does that).

    ops.a: int64 ``[L, M, K/16]``, one 16-element block per element, stride 1 along K/16 (batch stride may
        be 0); ops.sfa: its scale bytes (uint8), addressed by ``ops.sfa_addressing`` from their data pointer.
    ops.b: int64 ``[L, N, K/16]`` with uint8 scales ``ops.sfb`` (W4A4, same format as a), or
        float16/bfloat16/float32 ``[L, N, K]`` (W4A16); any strides.
    ops.c: ``[L, M, N]`` float16/bfloat16/float32, any strides; written.
    scale_block: 16 (NVFP4: e4m3 scales) or 32 (MXFP4: e8m0 scales).
    """
    a, b, c = ops.a, ops.b, ops.c
    batch, m, nb = a.shape
    n = b.shape[1]
    fp4_activation = ops.sfb is not None
    sfb, sfb_addressing, gsa, gsb = ops.optional_pointer_args()
    b_strides = (b.stride(0), b.stride(1), 1) if fp4_activation else b.stride()
    grid = (triton.cdiv(m, config.rows), batch)
    gemv_kernel[grid](
        a, ops.sfa, b, sfb, gsa, gsb, c,
        m, nb,
        a.stride(0), a.stride(1),
        *ops.sfa_addressing,
        *b_strides,
        *sfb_addressing,
        *c.stride(),
        *MAG_TABLE,
        N=n, N_PAD=triton.next_power_of_2(n), ROWS=config.rows, BLOCKS=config.blocks, SCALE_BLOCK=scale_block,
        FP4_ACTIVATION=fp4_activation, HAS_GSA=ops.global_scale_a is not None,
        HAS_GSB=ops.global_scale_b is not None, EVEN_K=(nb % config.blocks == 0), USE_PTX=use_ptx,
        num_warps=config.num_warps,
    )
