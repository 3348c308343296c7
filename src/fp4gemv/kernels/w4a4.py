"""Batched block-scaled FP4 x FP4 GEMV: ``c[l, m] = sum_k a[l, m, k] * b[l, 0, k]`` with e4m3 scales per 16
elements (NVFP4) or e8m0 scales per 32 (MXFP4), optional fp32 global scales, fp16/bf16/fp32 output.

One program computes ``LANE_ROWS * ROWS_PER_THREAD`` outputs of one batch, walking K in steps of
``KSPLIT * BLOCKS`` 16-element blocks (the tile is described in the kernel).  Weights are read as int64 (one
16-element block each, 16-byte vector loads for two neighbours); scales are addressed through five strides
that cover both the linear ``[L, rows, K/16]`` layout and the 128x4 swizzle (``kernels._common``).  Each
block's exact integer dot product (``_decode``) is scaled by ``sfa * sfb`` (exact in fp32: 4-bit times 4-bit
significands) and accumulated in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..target import Target
from ._common import apply_global_scales, decode_scale, pow2_at_most, scale_row_offset, store_rounded
from .block_sum_tiles import W4A4Config, w4a4_config
from ._decode import MAG_TABLE, activation_bytes, block_dot_ptx, block_dot_triton
from .spec import FP4Meta, GemvCase, Src, TritonKernelSpec, TritonLaunch, check_powers_of_two, global_scale_sources

__all__ = ["W4A4Config", "W4A4", "w4a4_gemv_kernel"]


@triton.jit
def l2_prefetch(ptrs):
    """Ask L2 for the 128-byte lines holding ``ptrs`` (no registers filled, no wait)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _scale_col(j, stride_col_tile, FORMAT: tl.constexpr):
    """Offsets of the scales of 16-element blocks ``j``: one per block (NVFP4), one per two (MXFP4)."""
    if FORMAT == "nvfp4":
        # Scale columns come in runs of 4 contiguous bytes in every supported layout; a lane's two blocks
        # (one 16-byte weight load) need two of them.
        return tl.max_contiguous(tl.multiple_of((j // 4) * stride_col_tile + j % 4, [1, 1, 1, 2]), [1, 1, 1, 2])
    else:
        # A lane's two blocks (j, j + 1 with j even) share scale column j // 2.  Both of its elements load the
        # aligned pair of columns holding it, 2 * (j // 4) and the next, as one 16-bit load; _mx_scales picks
        # the lane's own.
        col = (j // 4) * 2 + j % 2
        return tl.max_contiguous(tl.multiple_of((col // 4) * stride_col_tile + col % 4, [1, 1, 1, 2]), [1, 1, 1, 2])


@triton.jit
def _load_step(j0, cols, NB, a_rows, sfa_rows, b_row, sfb_row, sfa_stride_col_tile, sfb_stride_col_tile,
               EVEN_K: tl.constexpr, FORMAT: tl.constexpr):
    """Weights, weight scales, activation and activation scales of the K step starting at block ``j0``."""
    j = j0 + cols
    sfa_col = _scale_col(j, sfa_stride_col_tile, FORMAT)
    sfb_col = _scale_col(j, sfb_stride_col_tile, FORMAT)
    # The activation is addressed per row as well: loads of the full tile shape get the weights' layout (a
    # smaller load would get its own and a shared-memory conversion per step), and a thread's rows share one
    # load of each address.
    a_ptrs = a_rows + j
    b_ptrs = tl.broadcast_to(b_row + j, a_ptrs.shape)
    sfb_ptrs = tl.broadcast_to(sfb_row + sfb_col, a_ptrs.shape)
    if EVEN_K:
        a = tl.load(a_ptrs)
        sfa = tl.load(sfa_rows + sfa_col)
        b = tl.load(b_ptrs)
        sfb = tl.load(sfb_ptrs)
    else:
        k_ok = j < NB
        if FORMAT == "mxfp4":  # the pair's second column can lie past the row's last (it is then not used)
            s_ok = k_ok & ((j // 4) * 2 + j % 2 < NB // 2)
        else:
            s_ok = k_ok
        a = tl.load(a_ptrs, mask=k_ok, other=0)
        sfa = tl.load(sfa_rows + sfa_col, mask=s_ok, other=0)
        b = tl.load(b_ptrs, mask=k_ok, other=0)
        sfb = tl.load(sfb_ptrs, mask=s_ok, other=0)
    return a, sfa, b, sfb


@triton.jit
def _mx_scales(sfa, sfb, j):
    """MXFP4: each block's sfa * sfb from the column pairs _scale_col loads (a lane holds columns 2p, 2p + 1
    and needs column j // 2 of its blocks), decoded once per lane instead of once per block."""
    pairs: tl.constexpr = [sfa.shape[0], sfa.shape[1], sfa.shape[2], sfa.shape[3] // 2, 2]
    a0, a1 = tl.split(tl.reshape(sfa, pairs))
    b0, b1 = tl.split(tl.reshape(sfb, pairs))
    j_even, _ = tl.split(tl.reshape(tl.broadcast_to(j, sfa.shape), pairs))
    odd = (j_even // 2) % 2 == 1
    scale = decode_scale(tl.where(odd, a1, a0), "mxfp4") * decode_scale(tl.where(odd, b1, b0), "mxfp4")
    return tl.reshape(tl.join(scale, scale), sfa.shape)


@triton.jit
def _scaled_block_sums(a, sfa, b, sfb, j, tab_lo, tab_hi, USE_PTX: tl.constexpr, FORMAT: tl.constexpr):
    """4 * (block dot product) * sfa * sfb for every block ``j`` of the step (the factor 4: doubled operands)."""
    if FORMAT == "nvfp4":
        scale = decode_scale(sfa, "nvfp4") * decode_scale(sfb, "nvfp4")
    else:
        scale = _mx_scales(sfa, sfb, j)
    if USE_PTX:
        b_lo, b_hi = activation_bytes(b, tab_lo, tab_hi)
        block = block_dot_ptx(a, b_lo, b_hi, tab_lo, tab_hi)
    else:
        block = block_dot_triton(a, b)
    return block * scale


@triton.jit
def w4a4_gemv_kernel(
    a_ptr, b_ptr, sfa_ptr, sfb_ptr, gsa_ptr, gsb_ptr, c_ptr,
    M, NB,
    a_stride_l, a_stride_m,
    b_stride_l,
    sfa_stride_l, sfa_stride_row_tile, sfa_stride_r32, sfa_stride_r4, sfa_stride_col_tile,
    sfb_stride_l, sfb_stride_col_tile,
    c_stride_l, c_stride_m,
    mag_lo, mag_hi,
    LANE_ROWS: tl.constexpr,
    ROWS_PER_THREAD: tl.constexpr,
    BLOCKS: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PTX: tl.constexpr,
    HAS_GSA: tl.constexpr = False,
    HAS_GSB: tl.constexpr = False,
    KSPLIT: tl.constexpr = 1,
    UNROLL: tl.constexpr = 1,
    PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,
    FORMAT: tl.constexpr = "nvfp4",
    SCALE_ROWS_EVEN: tl.constexpr = False,
):
    # Tiles are [LANE_ROWS, KSPLIT, ROWS_PER_THREAD, BLOCKS].  Triton lays the last dimension over lanes
    # (two blocks, one 16-byte load, per lane), then the first (LANE_ROWS = 64 / BLOCKS rows side by side in
    # a warp), then KSPLIT (warps side by side along K: a step covers KSPLIT * BLOCKS consecutive blocks),
    # and keeps ROWS_PER_THREAD rows in each thread's registers, which share one activation decode.  A warp's
    # load then reads LANE_ROWS whole 128-byte lines of weights, and its scale load LANE_ROWS rows of a few
    # scale lines (rows r..r+3 of a 128x4 atom are 16 bytes apart).
    pid_m = tl.program_id(0)
    pid_l = tl.program_id(1).to(tl.int64)
    rows = (pid_m * (LANE_ROWS * ROWS_PER_THREAD) + tl.arange(0, LANE_ROWS)[:, None]
            + (tl.arange(0, ROWS_PER_THREAD) * LANE_ROWS)[None, :])  # [LANE_ROWS, ROWS_PER_THREAD]
    # Tail rows re-read row M-1 instead of masking every load; only the store is masked.
    rows_in = tl.minimum(rows, M - 1)
    a_rows = a_ptr + pid_l * a_stride_l + (rows_in.to(tl.int64) * a_stride_m)[:, None, :, None]
    sfa_row_offset = scale_row_offset(rows_in, sfa_stride_row_tile, sfa_stride_r32, sfa_stride_r4)
    if SCALE_ROWS_EVEN:
        # Every scale row starts 2-byte aligned (the launcher checked the strides), so a lane's two scale bytes
        # load as one 16-bit word.  Said by arithmetic that Triton's alignment analysis follows, not by
        # tl.multiple_of: Triton drops a hint put on the result of a call to another jit function, and the
        # loads became two byte loads each (4096x7168x8: 34.8 -> 50.8 us, docs/performance.md).
        sfa_row_offset = (sfa_row_offset // 2) * 2
    sfa_rows = (sfa_ptr + pid_l * sfa_stride_l + sfa_row_offset)[:, None, :, None]
    b_row = b_ptr + pid_l * b_stride_l
    sfb_row = sfb_ptr + pid_l * sfb_stride_l

    cols = (tl.arange(0, KSPLIT) * BLOCKS)[None, :, None, None] + tl.arange(0, BLOCKS)[None, None, None, :]
    acc = tl.zeros([LANE_ROWS, KSPLIT, ROWS_PER_THREAD, BLOCKS], dtype=tl.float32)
    # The prmt table in per-thread registers: ptxas copies a uniform value into a fresh register before
    # every prmt (+8 instructions per block).  A condition it cannot fold makes the table per thread; it only
    # fails for blocks past K, which are masked to zero anyway.
    tab_lo = tl.where(cols < NB, mag_lo, 0)
    tab_hi = tl.where(cols < NB, mag_hi, 0)
    if PDL:
        # Programmatic dependent launch: let the next kernel in the stream start its programs now.  Until the
        # previous kernel has finished (it may write b or read c) only L2 prefetches of the weights are issued:
        # they carry no data into registers, so nothing stale can be read, and they keep DRAM busy meanwhile.
        tl.extra.cuda.gdc_launch_dependents()
        if PREFETCH > 0:
            l2_prefetch(a_rows + (tl.arange(0, PREFETCH // 16) * 16)[None, None, None, :])
        tl.extra.cuda.gdc_wait()
    for j0 in tl.range(0, NB, KSPLIT * BLOCKS, loop_unroll_factor=UNROLL):
        a, sfa, b, sfb = _load_step(j0, cols, NB, a_rows, sfa_rows, b_row, sfb_row, sfa_stride_col_tile,
                                    sfb_stride_col_tile, EVEN_K, FORMAT)
        acc += _scaled_block_sums(a, sfa, b, sfb, j0 + cols, tab_lo, tab_hi, USE_PTX, FORMAT)
    # Block sums carry a factor 4 from the doubled operands; global scales (fp32) apply to the sum.
    out = tl.sum(tl.sum(acc, axis=3), axis=1) * 0.25  # [LANE_ROWS, ROWS_PER_THREAD]
    out = apply_global_scales(out, gsa_ptr, gsb_ptr, HAS_GSA, HAS_GSB)
    store_rounded(c_ptr + pid_l * c_stride_l + rows * c_stride_m, out, rows < M)


def scale_rows_even(meta: FP4Meta) -> bool:
    """Whether every row (and batch) of the scales starts at an even address, which the kernel's 16-bit scale
    loads need: true for the 128x4 swizzle, and for linear scales with even strides (an even number of scale
    columns, K/16 for NVFP4 or K/32 for MXFP4, in a contiguous tensor)."""
    return meta.scale_align >= 2


def _prefetch_blocks(config: W4A4Config, nb: int) -> int:
    """Blocks per row to prefetch into L2 under PDL: a power of two >= 16 (one 128-byte line), at most K/16."""
    if config.prefetch < 16 or nb < 16:
        return 0
    return pow2_at_most(min(config.prefetch, nb))


class W4A4(TritonKernelSpec):
    """FP4 x FP4 (NVFP4 or MXFP4) with one activation row: the task's tuned CUDA-core kernel."""

    name = "w4a4"
    config_type = W4A4Config

    def why_not(self, case: GemvCase, target: Target) -> str | None:
        if not target.runs_triton:
            return "runs Triton kernels only"
        if not case.fp4_activation or case.n != 1:
            return "needs an FP4 activation with N = 1"
        if case.fmt.name == "nvfp4" and not target.e4m3x2_cvt:
            return f"needs e4m3 conversions (sm_89 or newer; this is {target.describe()})"
        # int64 loads of 16-element blocks (two per lane: 16-byte loads when aligned).
        for name, meta in (("a", case.a), ("b", case.b)):
            if meta.align < 8:
                return f"{name}: needs data rows at multiples of 8 bytes (int64 loads), got {meta.align}-byte alignment"
        return None

    def default_config(self, case: GemvCase, target: Target) -> W4A4Config:
        return w4a4_config(case.m, case.k, case.batch)

    def check_config(self, config: W4A4Config, case: GemvCase | None = None) -> None:
        check_powers_of_two(config, ("rows", "blocks", "ksplit"))

    def triton_launch(self, case: GemvCase, config: W4A4Config, target: Target) -> TritonLaunch:
        a, b = case.a, case.b
        nb = case.k // 16
        pdl = config.pdl and target.pdl
        lane_rows = min(max(1, 64 // config.blocks), config.rows)  # rows side by side in a warp (see the kernel)
        # The activation's one row: int64 blocks [L, K/16] (row 0 of b).
        gsa_ptr, gsb_ptr = global_scale_sources(case)
        args = dict(
            a_ptr=Src("a_data", torch.int64), b_ptr=Src("b_data", torch.int64),
            sfa_ptr=Src("a_scales", torch.uint8), sfb_ptr=Src("b_scales", torch.uint8),
            gsa_ptr=gsa_ptr, gsb_ptr=gsb_ptr,
            c_ptr=Src("out", case.out_dtype),
            M=case.m, NB=nb,
            a_stride_l=a.batch_stride // 8, a_stride_m=a.row_stride // 8,
            b_stride_l=b.batch_stride // 8,
            sfa_stride_l=a.scales.batch, sfa_stride_row_tile=a.scales.row_tile, sfa_stride_r32=a.scales.r32,
            sfa_stride_r4=a.scales.r4, sfa_stride_col_tile=a.scales.col_tile,
            sfb_stride_l=b.scales.batch, sfb_stride_col_tile=b.scales.col_tile,
            c_stride_l=case.out_strides[0], c_stride_m=case.out_strides[1],
            mag_lo=MAG_TABLE[0], mag_hi=MAG_TABLE[1],
            LANE_ROWS=lane_rows, ROWS_PER_THREAD=config.rows // lane_rows, BLOCKS=config.blocks,
            EVEN_K=nb % (config.blocks * config.ksplit) == 0, USE_PTX=target.mode == "ptx",
            HAS_GSA=a.has_global_scale, HAS_GSB=b.has_global_scale,
            # The twin unrolled compiles twice the code for no use (it is the reference, not the fast path).
            KSPLIT=config.ksplit, UNROLL=config.unroll if target.mode == "ptx" else 1, PDL=pdl,
            PREFETCH=_prefetch_blocks(config, nb) if pdl else 0,
            FORMAT=case.fmt.name, SCALE_ROWS_EVEN=scale_rows_even(a),
        )
        return TritonLaunch(w4a4_gemv_kernel, (triton.cdiv(case.m, config.rows), case.batch), args,
                            dict(num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl))
