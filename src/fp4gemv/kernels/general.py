"""Batched block-scaled FP4 GEMV for every supported case: ``c[l, m, n] = sum_k a[l, m, k] * b[l, n, k]``.

The general kernel: the dispatcher runs it where the faster ones (``w4a4.py``, ``weight_only.py``,
``hmma_gemv.py``) do not apply (fp32 activations, K not a multiple of 32, rows aligned to 8 bytes only, bf16
activations below sm_90).

a is FP4 (NVFP4: e4m3 scale per 16 elements; MXFP4: e8m0 per 32).  b is either FP4 of the same format
(W4A4) or a float16/bfloat16/float32 activation (W4A16), with N = 1..16 rows.  W4A16 reads the weights' codes in
any of ``formats.CODE_ORDERS`` (``ORDER``, ``_decode.ordered_codes``), so that every case the formats allow has a
kernel whatever order a module keeps its weights in; W4A4 reads the checkpoint order.

One program computes ``ROWS`` output rows of one batch for all N activation rows, walking K in steps of
``BLOCKS`` 16-element blocks (one int64 each; an MXFP4 32-element block is two of them sharing one scale).
Each weight block is loaded once per program and used for every activation row.  Scales of either operand
are addressed through five strides that cover the linear layout and the 128x4 swizzle in one formula
(``spec.ScaleAddressing``).  The loop has the shape of ``w4a4.py``'s; for W4A4 with N = 1 it forms the same
scaled block products and per-block fp32 sums as w4a4.py at ``ksplit = 1``, but its final sum over the blocks
may run in another order, so the two agree within the error bound (tested), not necessarily bit for bit
(w4a4.py's ksplit, unroll, PDL and per-row activation loads are not ported here):

* W4A4: each block's exact integer dot product (``_decode``: doubled integers, PTX or pure Triton, equal bit
  for bit) times ``sfa * sfb`` (exact in fp32: 4-bit significands, or powers of two), accumulated in fp32.
* W4A16: weights decode to exact doubled values, are multiplied by the activation in fp32 (exact for fp16
  and bf16 activations, rounded for fp32), summed per block in fp32 and scaled by the weight scale.

The product of the global scales multiplies the result in the epilogue; c is rounded once to its dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..formats import CODE_ORDERS
from ..target import Target
from ._common import (apply_global_scales, decode_scale, load_k, pow2_at_most, scale_col_offset, scale_row_offset,
                      store_rounded)
from ._decode import (MAG_TABLE, activation_bytes, block_dot_ptx, block_dot_triton, code_order_index, doubled_e2m1,
                      unpack_block)
from .block_sum_tiles import w4a4_config
from .spec import FP4Meta, GemvCase, Src, TritonKernelSpec, TritonLaunch, check_powers_of_two, global_scale_sources
from .spec import too_many_rows

__all__ = ["GeneralConfig", "General", "gemv_kernel"]


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
    FORMAT: tl.constexpr,
    FP4_ACTIVATION: tl.constexpr,
    HAS_GSA: tl.constexpr,
    HAS_GSB: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PTX: tl.constexpr,
    ORDER: tl.constexpr,
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
        a = load_k(a_rows + j[None, :], k_ok[None, :], EVEN_K)
        sfa_col = scale_col_offset(j, sfa_stride_col_tile, FORMAT)
        sfa = decode_scale(load_k(sfa_rows[:, None] + sfa_col[None, :], k_ok[None, :], EVEN_K), FORMAT)
        if FP4_ACTIVATION:
            b = load_k(b_rows + j[None, :], k_ok[None, :], EVEN_K)
            sfb_col = scale_col_offset(j, sfb_stride_col_tile, FORMAT)
            sfb = decode_scale(load_k(sfb_rows[:, None] + sfb_col[None, :], k_ok[None, :], EVEN_K), FORMAT)
            scale = sfa[:, None, :] * sfb[None, :, :]
            # [ROWS, 1, BLOCKS] weight blocks against [1, N_PAD, BLOCKS] activation blocks.
            if USE_PTX:
                b_lo, b_hi = activation_bytes(b, tab_lo[None, :], tab_hi[None, :])
                block = block_dot_ptx(a[:, None, :], b_lo[None, :, :], b_hi[None, :, :],
                                      tab_lo[None, None, :], tab_hi[None, None, :])
            else:
                block = block_dot_triton(a[:, None, :], b[None, :, :])
            acc += block * scale
        else:
            k_idx = j[:, None] * 16 + tl.arange(0, 16)[None, :]  # [BLOCKS, 16] element indices
            x = load_k(b_rows[:, :, None] + k_idx[None, :, :] * b_stride_k, k_ok[None, :, None], EVEN_K)
            w = doubled_e2m1(unpack_block(a, ORDER)).to(tl.float32)  # [ROWS, BLOCKS, 16], exact
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


# Only W4A4 with N = 1 has been measured, on ``w4a4.py`` (docs/performance.md, encoded in ``block_sum_tiles.w4a4_config``,
# which general_config defers to for that case).  Every other case is sized, not measured: it keeps the
# per-program register tiles no larger than the measured W4A4 ones.
# fp32 accumulator elements per program for N > 1: as in the measured W4A4 tiles (8 x 128, 8 x 4 x 32).
_ACC_ELEMENTS = 1024
# Rows per program for N > 1, so that N = 16 still leaves 4 blocks per step (unmeasured).
_MAX_ROWS_N = 16
# W4A16 also holds the decoded weights times the activation, [rows, n, blocks, 16] fp32, before the block sum:
# capped at the accumulator size times 4 (unmeasured).
_W4A16_PRODUCT_ELEMENTS = 4096
_W4A16_ROWS = 8


class GeneralConfig(NamedTuple):
    """One launch of :func:`gemv_kernel`: ``rows`` outputs per program, ``blocks`` 16-element K-blocks per loop
    step (powers of two)."""

    rows: int
    blocks: int
    num_warps: int


def general_config(m: int, k: int, l: int, n: int, *, fp4_activation: bool) -> GeneralConfig:  # noqa: E741
    """The configuration for ``[l, m, k] x [l, n, k]`` (n activation rows, 1..16); no autotuning.

    W4A4, n = 1 (for callers who ask for this kernel in that case; the dispatcher runs w4a4.py): rows, warps and
    K step (ksplit x blocks) of ``block_sum_tiles.w4a4_config``; this kernel has no ksplit, unroll or PDL.  W4A4, n > 1:
    at most 16 rows, blocks such that the accumulator ``[rows, n_pad, blocks]`` stays at 1024 fp32.  W4A16: 8
    rows and blocks such that the ``[rows, n_pad, blocks, 16]`` product tile stays at 4096 fp32.  Blocks never
    exceed K/16.
    """
    nb = k // 16
    n_pad = pow2_at_most(2 * n - 1)  # next power of two >= n
    if fp4_activation:
        base = w4a4_config(m, k, l)
        num_warps = base.num_warps
        if n_pad == 1:
            rows, blocks = base.rows, base.blocks * base.ksplit
        else:
            rows = min(base.rows, _MAX_ROWS_N)
            blocks = _ACC_ELEMENTS // (rows * n_pad)
    else:
        rows, num_warps = _W4A16_ROWS, 4
        blocks = _W4A16_PRODUCT_ELEMENTS // (rows * n_pad * 16)
    return GeneralConfig(rows=rows, blocks=min(pow2_at_most(blocks), pow2_at_most(nb)), num_warps=num_warps)


class General(TritonKernelSpec):
    """Every case the formats allow, correct but untuned: FP4 weights (16-element blocks read as int64, so data
    rows 8-byte aligned) times FP4 activations of the same format or fp16/bf16/fp32 activations (any strides)."""

    name = "general"
    config_type = GeneralConfig
    code_orders = CODE_ORDERS

    def why_not(self, case: GemvCase, target: Target) -> str | None:
        if not target.runs_triton:
            return "runs Triton kernels only"
        if case.a.code_order != "checkpoint" and case.fp4_activation:
            return (f"a: {case.a.code_order}-order weights need fp16, bf16 or fp32 activations (the FP4 activation's "
                    f"block products read both operands in the checkpoint order)")
        if too_many_rows(case) is not None:
            return too_many_rows(case)
        if case.fmt.name == "nvfp4" and not target.e4m3x2_cvt:
            return f"needs e4m3 conversions (sm_89 or newer; this is {target.describe()})"
        for name, meta in (("a", case.a), ("b", case.b)):
            if isinstance(meta, FP4Meta) and meta.align < 8:
                return (f"{name}: needs data rows at multiples of 8 bytes (int64 loads), got {meta.align}-byte "
                        f"alignment")
        return None

    def default_config(self, case: GemvCase, target: Target) -> GeneralConfig:
        return general_config(case.m, case.k, case.batch, case.n, fp4_activation=case.fp4_activation)

    def check_config(self, config: GeneralConfig, case: GemvCase | None = None) -> None:
        check_powers_of_two(config, ("rows", "blocks"))

    def triton_launch(self, case: GemvCase, config: GeneralConfig, target: Target) -> TritonLaunch:
        """a: int64 blocks of 16 codes (strides in blocks); b: int64 blocks with its scale bytes (W4A4) or the
        float activation (W4A16, strides in elements)."""
        a, b = case.a, case.b
        fp4 = case.fp4_activation
        nb = case.k // 16
        if fp4:
            b_src, b_strides, sfb = Src("b_data", torch.int64), (b.batch_stride // 8, b.row_stride // 8, 1), b.scales
        else:
            b_src, b_strides, sfb = Src("b_data", b.dtype), b.strides, (0, 0, 0, 0, 0)
        gsa_ptr, gsb_ptr = global_scale_sources(case)
        args = dict(
            a_ptr=Src("a_data", torch.int64), sfa_ptr=Src("a_scales", torch.uint8), b_ptr=b_src,
            sfb_ptr=Src("b_scales" if fp4 else "a_scales", torch.uint8),
            gsa_ptr=gsa_ptr, gsb_ptr=gsb_ptr,
            c_ptr=Src("out", case.out_dtype),
            M=case.m, NB=nb,
            a_stride_l=a.batch_stride // 8, a_stride_m=a.row_stride // 8,
            sfa_stride_l=a.scales.batch, sfa_stride_row_tile=a.scales.row_tile, sfa_stride_r32=a.scales.r32,
            sfa_stride_r4=a.scales.r4, sfa_stride_col_tile=a.scales.col_tile,
            b_stride_l=b_strides[0], b_stride_n=b_strides[1], b_stride_k=b_strides[2],
            sfb_stride_l=sfb[0], sfb_stride_row_tile=sfb[1], sfb_stride_r32=sfb[2], sfb_stride_r4=sfb[3],
            sfb_stride_col_tile=sfb[4],
            c_stride_l=case.out_strides[0], c_stride_m=case.out_strides[1], c_stride_n=case.out_strides[2],
            mag_lo=MAG_TABLE[0], mag_hi=MAG_TABLE[1],
            N=case.n, N_PAD=triton.next_power_of_2(case.n), ROWS=config.rows, BLOCKS=config.blocks,
            FORMAT=case.fmt.name, FP4_ACTIVATION=fp4, HAS_GSA=a.has_global_scale, HAS_GSB=fp4 and b.has_global_scale,
            EVEN_K=nb % config.blocks == 0, USE_PTX=target.mode == "ptx", ORDER=code_order_index(a.code_order),
        )
        return TritonLaunch(gemv_kernel, (triton.cdiv(case.m, config.rows), case.batch), args,
                            dict(num_warps=config.num_warps))
