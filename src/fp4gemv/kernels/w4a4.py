"""Batched block-scaled NVFP4 x NVFP4 GEMV: ``c[l, m] = sum_k a[l, m, k] * b[l, 0, k]`` with e4m3 scales.

One program computes ``ROWS`` outputs of one batch, walking K in steps of ``BLOCKS`` 16-element blocks.
Weights are read as int64 (one 16-element block each, 16-byte vector loads for two neighbours); scales
are addressed through five strides that cover both the linear ``[L, rows, K/16]`` layout and the 128x4
swizzle (see ``fp4gemv.layouts``).  Each block's exact integer dot product (``_decode``) is scaled by
``sfa * sfb`` (exact in fp32: 4-bit times 4-bit significands) and accumulated in fp32.
"""

import triton
import triton.language as tl

from ._decode import activation_bytes, block_dot_ptx, block_dot_triton, doubled_e2m1, unpack_block


@triton.jit
def w4a4_gemv_kernel(
    a_ptr, b_ptr, sfa_ptr, sfb_ptr, c_ptr,
    M, NB,
    a_stride_l, a_stride_m,
    b_stride_l,
    sfa_stride_l, sfa_stride_row_tile, sfa_stride_r32, sfa_stride_r4, sfa_stride_col_tile,
    sfb_stride_l, sfb_stride_col_tile,
    c_stride_l, c_stride_m,
    ROWS: tl.constexpr,
    BLOCKS: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PTX: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_l = tl.program_id(1).to(tl.int64)
    rows = pid_m * ROWS + tl.arange(0, ROWS)
    # Tail rows re-read row M-1 instead of masking every load; only the store is masked.
    rows_in = tl.minimum(rows, M - 1)
    a_rows = a_ptr + pid_l * a_stride_l + rows_in.to(tl.int64)[:, None] * a_stride_m
    sfa_rows = (sfa_ptr + pid_l * sfa_stride_l + (rows_in // 128) * sfa_stride_row_tile
                + (rows_in % 32) * sfa_stride_r32 + ((rows_in % 128) // 32) * sfa_stride_r4)
    b_row = b_ptr + pid_l * b_stride_l
    sfb_row = sfb_ptr + pid_l * sfb_stride_l

    cols = tl.arange(0, BLOCKS)
    acc = tl.zeros([ROWS, BLOCKS], dtype=tl.float32)
    for j0 in range(0, NB, BLOCKS):
        j = j0 + cols
        # Scale columns come in runs of 4 contiguous bytes in every supported layout.
        sfa_col = tl.max_contiguous(tl.multiple_of((j // 4) * sfa_stride_col_tile + j % 4, 4), 4)
        sfb_col = tl.max_contiguous(tl.multiple_of((j // 4) * sfb_stride_col_tile + j % 4, 4), 4)
        if EVEN_K:
            a = tl.load(a_rows + j[None, :])
            sfa = tl.load(sfa_rows[:, None] + sfa_col[None, :])
            b = tl.load(b_row + j)
            sfb = tl.load(sfb_row + sfb_col)
        else:
            k_ok = j < NB
            a = tl.load(a_rows + j[None, :], mask=k_ok[None, :], other=0)
            sfa = tl.load(sfa_rows[:, None] + sfa_col[None, :], mask=k_ok[None, :], other=0)
            b = tl.load(b_row + j, mask=k_ok, other=0)
            sfb = tl.load(sfb_row + sfb_col, mask=k_ok, other=0)
        scale = (sfa.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                 * sfb.to(tl.float8e4nv, bitcast=True).to(tl.float32)[None, :])
        if USE_PTX:
            b_lo, b_hi = activation_bytes(b)
            block = block_dot_ptx(a, b_lo[None, :], b_hi[None, :])
        else:
            block = block_dot_triton(a, doubled_e2m1(unpack_block(b)).to(tl.int32))
        acc += block * scale
    # Block sums carry a factor 4 from the doubled operands.
    out = tl.sum(acc, axis=1) * 0.25
    tl.store(c_ptr + pid_l * c_stride_l + rows * c_stride_m, out.to(tl.float16), mask=rows < M)
