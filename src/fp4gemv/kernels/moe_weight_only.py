"""Routed FP4 expert GEMV on the tensor cores: ``out[t, j] = W[ids[t, j]] @ x[t]``, each distinct expert's
weights read once, every product through ``weight_only``'s step (its ``_mma_step`` PTX, or the pure-Triton twin).

Grouping.  Grid (row tiles, G) with G = min(T k, E + 1), static; program (r, g) takes the g-th distinct expert
id of the call (ids outside [0, E) share one extra bin E).  Each program loads the T k ids (a few hundred bytes,
from L2 after the first) and finds its id and its pairs by prefix sums, the distinct ids pair against pair up to
``PAIRWISE_PAIRS`` pairs (no CTA barrier at T k <= 4 on 2-4 warps; 0.4-1.3 us a launch less than the histogram
on an H100 at T = 1-2, the most at E = 128: docs/performance.md, round 20), else by a histogram over the E + 1
bins; programs past the number of distinct ids exit.  Against a routing launch (counts, prefix sums, sorted pair
list: ~3-5 us on Hopper before the first weight byte) this costs a few hundred instructions per program, hidden
behind its weight loads; against a leader per pair (grid row tiles x T k, non-leaders exit) it launches fewer
idle programs: gpt-oss-20b T = 16, top-4 of 32 gives 33 columns (~28 working) against 64; top-8 of 128 at
T = 16 gives 128 (~82 working) either way, at T = 1 the 4 or 8 columns all work.

The program.  ``weight_only``'s: ``16 * tiles`` rows of its expert, the thread layout, pointers, K loop and
epilogue reduction of ``kernels/weight_only.py`` (``program_lanes``, ``weight_pointers``, ``k_loop``,
``column_result``) with the matrix index set to the expert.  The step's C columns are the group's pairs
(``columns``: 2 in split, 8 otherwise, per n-tile; split takes 2 n-tiles from T = 3, also above T = 4): each
column's activation row pointer and output offset are gathered from its pair (token t reads ``x[t]``, writes
``out[t, j]``); a group with more pairs than columns (T > 8, in split T > 4, or a token naming one expert in
several slots) loops, re-reading the expert's rows from L2.

Arithmetic as ``weight_only``'s (exact products, one fp32 accumulation on the tensor cores, the fold undone in
the epilogue; bf16 in k32 and split: the 2^-70 <= |x| < 2^64 window of its module docstring), then the global
scale (per tensor or per expert), the bias added in fp32, one rounding.  An id outside [0, E) (possible only
unchecked: CUDA graphs, ``torch.compile``) reads expert 0's weights and writes zeros.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import triton
import triton.language as tl

from ..target import SM90, Target
from ._common import store_rounded
from ._decode import code_order_index
from ._mma_step import fold_exponent, multipliers, step_asm
from .spec import NATIVE_FIELD_ORDERS, ErrorModel, MoeCase, Src, TritonKernelSpec, TritonLaunch
from .weight_only import (MAX_SPLIT_N, PTXAS_LOADS_FIRST, WeightOnly, WeightOnlyConfig, ACT_CODES, MODE_CODES,
                          twin_column_row, column_result, fragment_rows, k_loop, program_lanes, step_spec, tile_rows,
                          weight_only_config, weight_pointers)

__all__ = ["MoeWeightOnly", "moe_weight_only_kernel", "MAX_PAIRS", "MAX_EXPERTS", "MAX_COLUMNS"]

# Pairs T * k per call: every program holds all ids, their bins and prefix sums in registers.
MAX_PAIRS = 256
# Experts per call: the histogram has E + 1 bins (a power of two up to 1024).
MAX_EXPERTS = 1023
# Calls of at most this many pairs (padded to a power of two) group them pair against pair (``_my_group`` with
# PAIRWISE: P^2 comparisons, whatever E) rather than by a histogram over the E + 1 experts.
PAIRWISE_PAIRS = 32
# Programmatic dependent launch by default (the kernel waits for the previous launch before reading the ids).
PDL_DEFAULT = True

# The kernel's ACTIVATION constexpr: gate and up interleaved (gpt-oss) or in halves (silu), reference.MOE_ACTIVATIONS.
ACTIVATION_CODES = {None: 0, "gpt-oss": 1, "silu": 2}

# Activation rows of one program's step: weight_only's one n-tile of fold / k32 (its measured range, N <= 8).
MAX_COLUMNS = 8


def program_case(case: MoeCase, config: WeightOnlyConfig | None = None):
    """The dense ``GemvCase`` one program runs: N the columns a group can fill in one pass (T, at most
    ``MAX_COLUMNS``; at most ``MAX_SPLIT_N`` with a split ``config``: a larger group loops, as at T > 8), the
    batch the experts that can be distinct (what ``weight_only_config`` sizes the grid by)."""
    dense = case.dense
    most = MAX_SPLIT_N if config is not None and config.split else MAX_COLUMNS
    return dataclasses.replace(dense, n=min(case.tokens, most), batch=min(case.pairs, case.experts))


def columns(case: MoeCase, config: WeightOnlyConfig) -> int:
    """Pairs per program and pass: the C columns of the step (2 per n-tile in split, 8 otherwise)."""
    spec = step_spec(program_case(case, config), config)
    return (2 if spec.mode == "split" else 8) * spec.n_tiles


class MoeWeightOnly(TritonKernelSpec):
    """``weight_only``'s step over each distinct expert's rows (``WeightOnly.why_not``'s conditions on one
    expert's product), fp16 or bf16 activations, up to ``MAX_PAIRS`` pairs and ``MAX_EXPERTS`` experts."""

    name = "moe_weight_only"
    config_type = WeightOnlyConfig
    code_orders = NATIVE_FIELD_ORDERS

    def why_not(self, case: MoeCase, target: Target) -> str | None:
        if case.pairs > MAX_PAIRS:
            return f"takes T * k <= {MAX_PAIRS} pairs (ids in registers), got {case.pairs}"
        if case.experts > MAX_EXPERTS:
            return f"takes E <= {MAX_EXPERTS} experts (a histogram bin each), got {case.experts}"
        reason = WeightOnly().why_not(program_case(case), target)
        # The dense case's a and b are the routed op's w and x.
        return None if reason is None else re.sub(r"^a:", "w:", re.sub(r"^b:", "x:", reason))

    def default_config(self, case: MoeCase, target: Target) -> WeightOnlyConfig:
        # The dense kernel's rule for the experts that can be distinct: on gpt-oss-20b's products at T = 1, 8, 16
        # it was within 0-14% of the best of 13-15 configurations (benchmarks/moe_sweep.py, docs/performance.md),
        # with programmatic dependent launch where the target has it (PDL_DEFAULT).
        config = weight_only_config(program_case(case), target.sm_count or SM90.sm_count)
        return config._replace(pdl=PDL_DEFAULT and target.pdl)

    def check_config(self, config: WeightOnlyConfig, case: MoeCase | None = None) -> None:
        WeightOnly().check_config(config, None if case is None else program_case(case, config))

    def error_model(self, case: MoeCase, config: WeightOnlyConfig) -> ErrorModel:
        return WeightOnly().error_model(program_case(case, config), config)

    def triton_launch(self, case: MoeCase, config: WeightOnlyConfig, target: Target) -> TritonLaunch:
        """Byte pointers for the weights, their scales and x (strides in bytes); ids, bias, global scales and out
        typed (strides in elements)."""
        dense = program_case(case, config)
        spec = step_spec(dense, config)
        asm_full, constraints_full = step_asm(spec)
        asm_tail, constraints_tail = step_asm(spec._replace(tail=True))
        a = dense.a
        pdl = config.pdl and target.pdl
        args = dict(
            w_ptr=Src("w_data", torch.uint8), sfw_ptr=Src("w_scales", torch.uint8),
            gs_ptr=Src("global_scales", torch.float32) if case.global_scales else Src("w_scales", torch.uint8),
            x_ptr=Src("x", torch.uint8), ids_ptr=Src("expert_ids", case.ids_dtype),
            bias_ptr=Src("bias", case.bias_dtype) if case.bias_dtype is not None else Src("w_scales", torch.uint8),
            pw_ptr=Src("pair_weights", case.pair_weights_dtype) if case.pair_weights_dtype is not None
            else Src("w_scales", torch.uint8),
            out_ptr=Src("out", dense.out_dtype),
            M=dense.m, K=dense.k, E=case.experts, P=case.pairs, TOP_K=case.top_k,
            w_stride_e=a.batch_stride, w_stride_m=a.row_stride,
            sfw_stride_e=a.scales.batch, sfw_stride_row_tile=a.scales.row_tile, sfw_stride_r32=a.scales.r32,
            sfw_stride_r4=a.scales.r4,
            gs_stride_e=case.global_scales_stride, gs_stride_h=case.global_scales_half_stride,
            x_stride_t=2 * dense.b.strides[1],
            ids_stride_t=case.ids_strides[0], ids_stride_j=case.ids_strides[1],
            bias_stride_e=case.bias_strides[0], bias_stride_m=case.bias_strides[1],
            out_stride_t=case.out_strides[0], out_stride_j=case.out_strides[1], out_stride_m=case.out_strides[2],
            pw_stride_t=case.pair_weights_strides[0], pw_stride_j=case.pair_weights_strides[1],
            alpha=case.alpha, limit=case.limit, HALF=case.out_rows,
            **multipliers(spec.act, spec.order),
            P_PAD=triton.next_power_of_2(case.pairs), BINS=triton.next_power_of_2(case.experts + 1),
            PAIRWISE=triton.next_power_of_2(case.pairs) <= PAIRWISE_PAIRS,
            COLS=columns(case, config), MODE=MODE_CODES[spec.mode], MX=dense.fmt.name == "mxfp4",
            ACT=ACT_CODES[spec.act], TILES=config.tiles, WARPS=config.warps, CHUNKS=config.chunks,
            N_TILES=spec.n_tiles, SFA_COL_TILE=spec.sfa_col_tile, HAS_GS=case.global_scales is not None,
            HAS_BIAS=case.bias_dtype is not None, HAS_PW=case.pair_weights_dtype is not None,
            ACTIVATION=ACTIVATION_CODES[case.activation], FOLD=2.0 ** fold_exponent(spec.fmt, spec.act, spec.mode),
            USE_PTX=target.mode == "ptx", PDL=pdl, ASM_FULL=asm_full, CONSTRAINTS_FULL=constraints_full,
            ASM_TAIL=asm_tail, CONSTRAINTS_TAIL=constraints_tail, ORDER=code_order_index(spec.order),
        )
        options = dict(num_warps=config.warps, num_stages=1, launch_pdl=pdl)
        if config.loads_first:
            options["ptx_options"] = PTXAS_LOADS_FIRST
        # With an activation a 16-row tile holds 8 (gate, up) pairs: 8 output rows.
        grid = (triton.cdiv(case.out_rows, (8 if case.activation else 16) * config.tiles),
                min(case.pairs, case.experts + 1))
        return TritonLaunch(moe_weight_only_kernel, grid, args, options)


# --- the kernel ---------------------------------------------------------------------------------------------


@triton.jit
def _group_pair(same, rank, pairs, col, count, fallback):
    """The pair of rank ``col`` in the group (``same``, ranks ``rank``), or ``fallback`` past its ``count``."""
    pair = tl.sum(tl.where(same & (rank == col), pairs, 0), axis=0)
    return tl.where(col < count, pair, fallback)


@triton.jit
def _my_group(ids_ptr, ids_stride_t, ids_stride_j, E, P, TOP_K, group, P_PAD: tl.constexpr, BINS: tl.constexpr,
              PAIRWISE: tl.constexpr):
    """Program column ``group``'s bin among the distinct ids (bad ids share bin E): (found, its bin, its pair
    count, the pairs in it, their ranks, the pair indices).  ``PAIRWISE`` (``PAIRWISE_PAIRS``): the distinct ids
    from the pairs alone -- a pair starts a group when no earlier pair has its key, and a group's place is the
    number of groups with smaller keys, the histogram's order (bad ids, key E, last) -- else from a histogram over
    the E + 1 bins."""
    pairs = tl.arange(0, P_PAD)
    pair_ok = pairs < P
    ids = tl.load(ids_ptr + (pairs // TOP_K) * ids_stride_t + (pairs % TOP_K) * ids_stride_j, mask=pair_ok,
                  other=0)
    key = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
    if PAIRWISE:
        key = tl.where(pair_ok, key, E + 1)  # padding: a key of its own, never a group
        kp = key[:, None]
        kq = key[None, :]
        earlier_same = (kq == kp) & (pairs[None, :] < pairs[:, None])  # [p, q]: q before p, same key
        first = pair_ok & (tl.sum(earlier_same.to(tl.int32), axis=1) == 0)
        smaller = tl.sum(((kq < kp) & first[None, :]).to(tl.int32), axis=1)  # groups with a smaller key
        mine = first & (smaller == group)
        my_key = tl.sum(tl.where(mine, key, 0), axis=0)
    else:
        present = tl.histogram(key, BINS, mask=pair_ok) > 0
        mine = present & (tl.cumsum(present.to(tl.int32), axis=0) - 1 == group)
        my_key = tl.sum(tl.where(mine, tl.arange(0, BINS), 0), axis=0)
    found = tl.sum(mine.to(tl.int32), axis=0) > 0
    same = (key == my_key) & pair_ok
    count = tl.sum(same.to(tl.int32), axis=0)
    rank = tl.cumsum(same.to(tl.int32), axis=0) - 1
    return found, my_key, count, same, rank, pairs


@triton.jit
def _gathered(n, offsets, COLS: tl.constexpr):
    """``offsets[n]`` for a tensor of column indices ``n`` (``offsets[0]`` for n >= COLS: padded columns of the
    step, computed and never stored)."""
    off = offsets[0] + 0 * n.to(tl.int64)
    for col in tl.static_range(1, COLS):
        off = tl.where(n == col, offsets[col], off)
    return off


@triton.jit
def _paired_rows(pid_m, e, g, HALF, TILES: tl.constexpr, ACTIVATION: tl.constexpr):
    """With an activation, W's rows that element e = 2 t + h of lane group g holds: pair i = 8 TILES pid_m +
    8 t + g (i <= HALF - 1: a tail re-reads the last pair), its gate (h = 0) or up (h = 1) row, interleaved
    (2 i + h, gpt-oss) or in halves (i + h HALF, silu).  Gate and up of one pair meet in one thread."""
    i = tl.minimum(pid_m * (8 * TILES) + 8 * (e // 2) + g, HALF - 1)
    if ACTIVATION == 1:
        return 2 * i + e % 2
    else:
        return i + (e % 2) * HALF


@triton.jit
def _gated(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """``reference.moe_activation`` in fp32 (a NaN stays NaN through the clamps, as in torch.clamp)."""
    if ACTIVATION == 1:
        gate = tl.where(gate > limit, limit, gate)
        up = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
        return gate * tl.sigmoid(gate * alpha) * (up + 1.0)
    else:
        return gate * tl.sigmoid(gate) * up


@triton.jit
def moe_weight_only_kernel(
    w_ptr, sfw_ptr, gs_ptr, x_ptr, ids_ptr, bias_ptr, pw_ptr, out_ptr,
    M, K, E, P, TOP_K,
    w_stride_e, w_stride_m,
    sfw_stride_e, sfw_stride_row_tile, sfw_stride_r32, sfw_stride_r4,
    gs_stride_e, gs_stride_h,
    x_stride_t,
    ids_stride_t, ids_stride_j,
    bias_stride_e, bias_stride_m,
    out_stride_t, out_stride_j, out_stride_m,
    pw_stride_t, pw_stride_j,
    alpha, limit, HALF,
    mp0, mp1, m24, m29,
    P_PAD: tl.constexpr,
    BINS: tl.constexpr,
    PAIRWISE: tl.constexpr,
    COLS: tl.constexpr,
    MODE: tl.constexpr,
    MX: tl.constexpr,
    ACT: tl.constexpr,
    TILES: tl.constexpr,
    WARPS: tl.constexpr,
    CHUNKS: tl.constexpr,
    N_TILES: tl.constexpr,
    SFA_COL_TILE: tl.constexpr,
    HAS_GS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PW: tl.constexpr,
    ACTIVATION: tl.constexpr,
    FOLD: tl.constexpr,
    USE_PTX: tl.constexpr,
    PDL: tl.constexpr,
    ASM_FULL: tl.constexpr,
    CONSTRAINTS_FULL: tl.constexpr,
    ASM_TAIL: tl.constexpr,
    CONSTRAINTS_TAIL: tl.constexpr,
    ORDER: tl.constexpr,
):
    pid_m = tl.program_id(0)
    group = tl.program_id(1)
    if PDL:  # the ids may come from the previous launch (a router): wait before the first read, not in k_loop
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    found, my_key, count, same, rank, pairs = _my_group(ids_ptr, ids_stride_t, ids_stride_j, E, P, TOP_K, group,
                                                        P_PAD, BINS, PAIRWISE)
    if found:
        valid = my_key < E
        expert = tl.where(valid, my_key, 0).to(tl.int64)
        e, warp, g, c, zero = program_lanes(TILES, WARPS)
        # Tail rows re-read row M - 1 (a pair HALF - 1); only the store is masked.
        if ACTIVATION == 0:
            rows = tl.minimum(tile_rows(pid_m, e, g, TILES), M - 1)
        else:
            rows = _paired_rows(pid_m, e, g, HALF, TILES, ACTIVATION)
        pa, ps, k_first, k_x, k_warp = weight_pointers(w_ptr, sfw_ptr, expert, rows, M, w_stride_e, w_stride_m,
                                                       sfw_stride_e, sfw_stride_row_tile, sfw_stride_r32,
                                                       sfw_stride_r4, warp, c, MODE, MX, CHUNKS, SFA_COL_TILE)
        x_rows = fragment_rows(e, g, MODE)
        xon = ((g // 2) == c).to(tl.int32) + zero
        muls = (mp0 + zero, mp1 + zero, m24 + zero, m29 + zero)
        if HAS_GS:
            gs = tl.load(gs_ptr + expert * gs_stride_e)
            gs_up = tl.load(gs_ptr + expert * gs_stride_e + gs_stride_h)  # gate's and up's ([E, 2]), else gs
        first = 0
        while first < count:
            lead = _group_pair(same, rank, pairs, first, count, 0)
            col_pairs = ()
            x_offsets = ()
            for col in tl.static_range(COLS):
                pair = _group_pair(same, rank, pairs, first + col, count, lead)
                col_pairs = col_pairs + (pair,)
                x_offsets = x_offsets + ((pair // TOP_K).to(tl.int64) * x_stride_t,)
            px = x_ptr + _gathered(x_rows, x_offsets, COLS) + 2 * k_x
            # The twin reads each C column's activation row at the warp chunk (``twin_column_row``).
            col_ptrs = ()
            for o in tl.static_range(4):
                col_ptrs = col_ptrs + (x_ptr + _gathered(twin_column_row(o, c, MODE), x_offsets, COLS) + 2 * k_warp,)
            # Float activations: the step reads no activation scales (pxs, col_scale_ptrs: placeholders).
            a0, a1, a2, a3 = k_loop(pa, ps, px, px, px, px, xon, muls, col_ptrs, col_ptrs, k_first, c, zero, K,
                                    MODE, MX, ACT, TILES, WARPS, CHUNKS, N_TILES, SFA_COL_TILE, 4, USE_PTX, False,
                                    ASM_FULL, CONSTRAINTS_FULL, ASM_TAIL, CONSTRAINTS_TAIL, ORDER)
            accumulators = (a0, a1, a2, a3)
            # The pairs (int32) rather than their int64 offsets stay live across the K loop: fewer registers.
            out_offsets = ()
            pw_offsets = ()
            for col in tl.static_range(COLS):
                t_col = (col_pairs[col] // TOP_K).to(tl.int64)
                j_col = (col_pairs[col] % TOP_K).to(tl.int64)
                out_offsets = out_offsets + (t_col * out_stride_t + j_col * out_stride_j,)
                pw_offsets = pw_offsets + (t_col * pw_stride_t + j_col * pw_stride_j,)
            filled = tl.minimum(count - first, COLS)
            for o in tl.static_range(2 * N_TILES):
                out, oe, og, n = column_result(accumulators[o], o, MODE, TILES, WARPS, FOLD, USE_PTX)
                if HAS_GS:
                    if ACTIVATION == 0:
                        out = out * gs
                    else:
                        out = out * tl.where(oe % 2 == 0, gs, gs_up)
                if ACTIVATION == 0:
                    out_rows = tile_rows(pid_m, oe, og, TILES)
                    bias_rows = tl.minimum(out_rows, M - 1)
                else:
                    bias_rows = _paired_rows(pid_m, oe, og, HALF, TILES, ACTIVATION)
                if HAS_BIAS:
                    bias = tl.load(bias_ptr + expert * bias_stride_e + bias_rows.to(tl.int64) * bias_stride_m)
                    out = out + bias.to(tl.float32)
                if ACTIVATION != 0:
                    # Element 2 t + h holds gate (h = 0) and up (h = 1) of pair 8 t + g: in the same thread.
                    gate, up = tl.split(tl.permute(tl.reshape(out, [TILES, 2, out.shape[1]]), [0, 2, 1]))
                    out = _gated(gate, up, alpha, limit, ACTIVATION)
                    out_rows = pid_m * (8 * TILES) + 8 * tl.arange(0, TILES)[:, None] + og
                    row_ok = out_rows < HALF
                else:
                    row_ok = out_rows < M
                if HAS_PW:
                    out = out * tl.load(pw_ptr + _gathered(n, pw_offsets, COLS)).to(tl.float32)
                out = tl.where(valid, out, 0.0)
                ptrs = out_ptr + _gathered(n, out_offsets, COLS) + out_rows.to(tl.int64) * out_stride_m
                store_rounded(ptrs, out, row_ok & (n < filled))
            first += COLS
