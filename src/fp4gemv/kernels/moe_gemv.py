"""Routed FP4 expert GEMV on the CUDA cores (the fallback of ``moe_weight_only``: fp32 activations, more pairs or
experts, unaligned weights): ``out[t, j] = W[ids[t, j]] @ x[t]`` with each distinct expert's weights read once.

The T*k (token, slot) pairs are grouped by expert inside the kernel, with no host sync and no preprocessing
launch: the grid is static, one program per (row tile, pair, column chunk).  Every program loads the T*k
expert ids (a few hundred bytes, from L2 after the first), and the program of pair ``p`` works only when ``p``
is the first pair of its expert (its group's leader); the others exit after that load.  The leader compacts
its group's pairs into ``COLS`` columns (a prefix count over the pairs that match its id) and runs them as one
N-column W4A16 GEMV over that expert's rows, so the expert's weight tile is read once for all its tokens.  A
group larger than ``COLS`` (only when one token names an expert in several slots, or T > 16) takes several
column chunks, each re-reading the tile.

Arithmetic as ``general.py``'s W4A16 path: weights decode to exact doubled values, each product with the fp32
activation is exact (fp16/bf16 activations; rounded once for fp32), 16-element block sums in fp32 are scaled by
the block scale and accumulated in fp32; the global scale (per tensor or per expert) multiplies the result,
the bias is added in fp32, and the result is rounded once to out's dtype.

An expert id outside ``[0, E)`` (possible only where the op layer cannot check without a sync: CUDA graphs,
``torch.compile``) never addresses memory out of bounds: its group reads expert 0's weights and writes zeros.

:func:`expert_tile_dot` is the per-group inner GEMV (weight-tile decode and dot in one helper), so a
streaming weight loader can later replace its loads without touching the routing.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..reference import routed_epilogue
from ..target import Target
from ._common import decode_scale, load_k, pow2_at_most, scale_col_offset, scale_row_offset, store_rounded
from ._decode import code_order_index, doubled_e2m1, unpack_block
from .spec import (NATIVE_FIELD_ORDERS, MoeCase, MoeOperands, Src, TritonKernelSpec, TritonLaunch,
                   check_powers_of_two)

__all__ = ["MoeGemvConfig", "moe_gemv_config", "moe_gemv_kernel", "expert_tile_dot", "MAX_PAIRS", "MAX_COLS",
           "MoeGeneral"]

# Pairs (T * k) per call: every program holds all ids in registers ([P_PAD] lanes).
MAX_PAIRS = 1024
# Columns one leader computes per weight read: the accumulator [rows, COLS, blocks] stays in registers.
MAX_COLS = 16
# The W4A16 product tile [rows, COLS, blocks, 16] in fp32, as in general.py (sized, not measured).
_PRODUCT_ELEMENTS = 4096
_ROWS = 8


class MoeGemvConfig(NamedTuple):
    """One launch of :func:`moe_gemv_kernel`: ``rows`` outputs and ``cols`` pairs per program, ``blocks``
    16-element K-blocks per loop step (powers of two)."""

    rows: int
    cols: int
    blocks: int
    num_warps: int


def moe_gemv_config(k: int, tokens: int) -> MoeGemvConfig:
    """The configuration for K and T tokens (no autotuning): columns the next power of two >= T up to 16
    (top-k ids are distinct per token, so a group has at most T pairs), 8 rows, blocks such that the product
    tile stays at 4096 fp32, never more than K/16."""
    cols = min(MAX_COLS, pow2_at_most(2 * tokens - 1))
    blocks = _PRODUCT_ELEMENTS // (_ROWS * cols * 16)
    return MoeGemvConfig(rows=_ROWS, cols=cols, blocks=min(pow2_at_most(blocks), pow2_at_most(k // 16)), num_warps=4)


class MoeGeneral(TritonKernelSpec):
    """Every routed case the formats allow (fp16, bf16 or fp32 activations, any strides), untuned: weights read
    as int64 blocks (data rows 8-byte aligned)."""

    name = "moe_general"
    config_type = MoeGemvConfig
    code_orders = NATIVE_FIELD_ORDERS

    def why_not(self, case: MoeCase, target: Target) -> str | None:
        if not target.runs_triton:
            return "runs Triton kernels only"
        if case.dense.fmt.name == "nvfp4" and not target.e4m3x2_cvt:
            return f"needs e4m3 conversions (sm_89 or newer; this is {target.describe()})"
        if case.dense.a.align < 8:
            return f"w: needs data rows at multiples of 8 bytes (int64 loads), got {case.dense.a.align}-byte alignment"
        return None

    def default_config(self, case: MoeCase, target: Target) -> MoeGemvConfig:
        return moe_gemv_config(case.dense.k, case.tokens)

    def check_config(self, config: MoeGemvConfig, case: MoeCase | None = None) -> None:
        check_powers_of_two(config, ("rows", "cols", "blocks", "num_warps"))
        if config.cols > MAX_COLS:
            raise ValueError(f"config: expected cols <= {MAX_COLS}, got {config}")

    def launch(self, ops: MoeOperands, config: MoeGemvConfig, target: Target) -> None:
        """The kernel; with an epilogue (activation, pair weights, gate's and up's global scales) the kernel's
        fp32 products ``[T, k, M]`` go through ``reference.routed_epilogue`` in fp32 (torch), then one rounding."""
        case = ops.case
        if not case.has_epilogue:
            return super().launch(ops, config, target)
        halves = ops.global_scales is not None and ops.global_scales.dim() == 2
        m = case.dense.m
        scratch = torch.empty((case.tokens, case.top_k, m), dtype=torch.float32, device=ops.out.device)
        bare = dataclasses.replace(
            case, dense=dataclasses.replace(case.dense, out_dtype=torch.float32), bias_dtype=None, bias_strides=(0, 0),
            global_scales=None if halves else case.global_scales, global_scales_half_stride=0,
            out_strides=tuple(scratch.stride()), activation=None, pair_weights_dtype=None, pair_weights_strides=(0, 0))
        super().launch(ops._replace(case=bare, global_scales=None if halves else ops.global_scales, bias=None,
                                    out=scratch, pair_weights=None), config, target)
        ops.out.copy_(routed_epilogue(scratch, ops.expert_ids, case.experts,
                                      half_scales=ops.global_scales if halves else None, bias=ops.bias,
                                      activation=case.activation, alpha=case.alpha, limit=case.limit,
                                      pair_weights=ops.pair_weights))

    def triton_launch(self, case: MoeCase, config: MoeGemvConfig, target: Target) -> TritonLaunch | None:
        """Weights as int64 blocks of 16 codes (strides in blocks); scales in bytes; the rest in elements.  None
        with an epilogue (two steps: :meth:`launch`)."""
        if case.has_epilogue:
            return None
        dense = case.dense
        a, x_strides = dense.a, dense.b.strides
        nb = dense.k // 16
        placeholder = Src("w_scales", torch.uint8)
        args = dict(
            w_ptr=Src("w_data", torch.int64), sfw_ptr=placeholder,
            gs_ptr=Src("global_scales", torch.float32) if case.global_scales else placeholder,
            x_ptr=Src("x", dense.b.dtype), ids_ptr=Src("expert_ids", case.ids_dtype),
            bias_ptr=Src("bias", case.bias_dtype) if case.bias_dtype is not None else placeholder,
            out_ptr=Src("out", dense.out_dtype),
            M=dense.m, NB=nb, E=case.experts, P=case.pairs, TOP_K=case.top_k,
            w_stride_e=a.batch_stride // 8, w_stride_m=a.row_stride // 8,
            sfw_stride_e=a.scales.batch, sfw_stride_row_tile=a.scales.row_tile, sfw_stride_r32=a.scales.r32,
            sfw_stride_r4=a.scales.r4, sfw_stride_col_tile=a.scales.col_tile,
            gs_stride_e=case.global_scales_stride,
            x_stride_t=x_strides[1], x_stride_k=x_strides[2],
            ids_stride_t=case.ids_strides[0], ids_stride_j=case.ids_strides[1],
            bias_stride_e=case.bias_strides[0], bias_stride_m=case.bias_strides[1],
            out_stride_t=case.out_strides[0], out_stride_j=case.out_strides[1], out_stride_m=case.out_strides[2],
            P_PAD=triton.next_power_of_2(case.pairs), ROWS=config.rows, COLS=config.cols, BLOCKS=config.blocks,
            FORMAT=dense.fmt.name, HAS_GS=case.global_scales is not None, HAS_BIAS=case.bias_dtype is not None,
            EVEN_K=nb % config.blocks == 0, ORDER=code_order_index(a.code_order),
        )
        grid = (triton.cdiv(dense.m, config.rows), case.pairs, triton.cdiv(case.pairs, config.cols))
        return TritonLaunch(moe_gemv_kernel, grid, args, dict(num_warps=config.num_warps))


@triton.jit
def expert_tile_dot(w_rows, sfw_rows, x_cols, x_stride_k, NB, sfw_stride_col_tile,
                    ROWS: tl.constexpr, COLS: tl.constexpr, BLOCKS: tl.constexpr, FORMAT: tl.constexpr,
                    EVEN_K: tl.constexpr, ORDER: tl.constexpr = 0):
    """``[ROWS, COLS]`` fp32 sums of weight rows times activation columns (before global scales).

    w_rows: ``[ROWS, 1]`` pointers (int64 blocks of 16 codes) to the rows' data; sfw_rows: ``[ROWS]`` pointers to
    their scale rows (``scale_row_offset`` applied); x_cols: ``[COLS, 1, 1]`` pointers to each column's
    activation row; NB: 16-element blocks in K; ORDER: the codes' order (``_decode.code_order_index``).
    """
    cols = tl.arange(0, BLOCKS)
    acc = tl.zeros([ROWS, COLS, BLOCKS], dtype=tl.float32)
    for j0 in range(0, NB, BLOCKS):
        j = j0 + cols
        k_ok = j < NB
        w = load_k(w_rows + j[None, :], k_ok[None, :], EVEN_K)
        sfw_col = scale_col_offset(j, sfw_stride_col_tile, FORMAT)
        sfw = decode_scale(load_k(sfw_rows[:, None] + sfw_col[None, :], k_ok[None, :], EVEN_K), FORMAT)
        k_idx = j[:, None] * 16 + tl.arange(0, 16)[None, :]  # [BLOCKS, 16] element indices
        x = load_k(x_cols + k_idx[None, :, :] * x_stride_k, k_ok[None, :, None], EVEN_K)
        w_dbl = doubled_e2m1(unpack_block(w, ORDER)).to(tl.float32)  # [ROWS, BLOCKS, 16], exact
        block = tl.sum(w_dbl[:, None, :, :] * x.to(tl.float32)[None, :, :, :], axis=3)
        acc += block * sfw[:, None, :]
    return tl.sum(acc, axis=2) * 0.5  # the weights were doubled


@triton.jit
def moe_gemv_kernel(
    w_ptr, sfw_ptr, gs_ptr, x_ptr, ids_ptr, bias_ptr, out_ptr,
    M, NB, E, P, TOP_K,
    w_stride_e, w_stride_m,
    sfw_stride_e, sfw_stride_row_tile, sfw_stride_r32, sfw_stride_r4, sfw_stride_col_tile,
    gs_stride_e,
    x_stride_t, x_stride_k,
    ids_stride_t, ids_stride_j,
    bias_stride_e, bias_stride_m,
    out_stride_t, out_stride_j, out_stride_m,
    P_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    BLOCKS: tl.constexpr,
    FORMAT: tl.constexpr,
    HAS_GS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    ORDER: tl.constexpr,
):
    pid_m = tl.program_id(0)
    leader = tl.program_id(1)
    chunk = tl.program_id(2)
    pairs = tl.arange(0, P_PAD)
    pair_ok = pairs < P
    ids = tl.load(ids_ptr + (pairs // TOP_K) * ids_stride_t + (pairs % TOP_K) * ids_stride_j, mask=pair_ok,
                  other=0)
    my_id = tl.load(ids_ptr + (leader // TOP_K) * ids_stride_t + (leader % TOP_K) * ids_stride_j)
    same = (ids == my_id) & pair_ok
    earlier = tl.sum((same & (pairs < leader)).to(tl.int32), axis=0)
    count = tl.sum(same.to(tl.int32), axis=0)
    if (earlier == 0) & (chunk * COLS < count):
        # Column c of this chunk is the group's pair of rank chunk * COLS + c (rank: matching pairs before it).
        rank = tl.cumsum(same.to(tl.int32), axis=0) - 1
        col = chunk * COLS + tl.arange(0, COLS)
        picked = same[None, :] & (rank[None, :] == col[:, None])  # [COLS, P_PAD]
        col_ok = col < count
        col_pair = tl.where(col_ok, tl.sum(tl.where(picked, pairs[None, :], 0), axis=1), leader)
        token = (col_pair // TOP_K).to(tl.int64)
        slot = (col_pair % TOP_K).to(tl.int64)
        valid = (my_id >= 0) & (my_id < E)
        expert = tl.where(valid, my_id, 0).to(tl.int64)

        rows = pid_m * ROWS + tl.arange(0, ROWS)
        # Tail rows re-read row M-1 instead of masking every load; only the store is masked.
        rows_in = tl.minimum(rows, M - 1)
        w_rows = w_ptr + expert * w_stride_e + rows_in.to(tl.int64)[:, None] * w_stride_m
        sfw_rows = sfw_ptr + expert * sfw_stride_e + scale_row_offset(rows_in, sfw_stride_row_tile, sfw_stride_r32,
                                                                      sfw_stride_r4)
        x_cols = x_ptr + token[:, None, None] * x_stride_t
        out = expert_tile_dot(w_rows, sfw_rows, x_cols, x_stride_k, NB, sfw_stride_col_tile, ROWS, COLS, BLOCKS,
                              FORMAT, EVEN_K, ORDER)
        if HAS_GS:
            out = out * tl.load(gs_ptr + expert * gs_stride_e)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * bias_stride_e + rows_in.to(tl.int64) * bias_stride_m)
            out = out + bias.to(tl.float32)[:, None]
        out = tl.where(valid, out, 0.0)
        out_ptrs = (out_ptr + token[None, :] * out_stride_t + slot[None, :] * out_stride_j
                    + rows.to(tl.int64)[:, None] * out_stride_m)
        store_rounded(out_ptrs, out, (rows < M)[:, None] & col_ok[None, :])
