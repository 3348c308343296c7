"""The decode engine's wgmma consumer (issue 27, round 33 of docs/performance.md): MXFP4 weights times bf16
activations, N = 1..16, on Hopper -- a prototype measured against the engine, not yet in the kernel table.

The program.  64 weight rows (one warp group's ``wgmma.m64nNk16``) over all of K, in steps of ``STEP_K`` elements:

* a producer warp copies each step's weights (the rows' wgmma tiles, ``layouts.pack_mma_tiles``: one contiguous
  ``STEP_K / 64 * 2048`` bytes) and the activation's slice (``[STEP_K / 64, NR, 64]`` bf16, 128-byte swizzle: the
  B operand as ``wgmma`` reads it) by bulk tensor copies into a ring of ``STAGES`` slots, each guarded by a "ready"
  and an "empty" mbarrier, as the engine's producer does;
* four consumer warps (one warp group) load each 64-K tile's 16 bytes a thread (its A fragments for two 32-element
  blocks, ``pack_mma_tiles``' layout), decode them with the engine's native decode straight into the A registers
  (the four decoded registers of a word are four of the A operand's: no data moves), and per 32-element block run
  ``warpgroup_mma`` into a fresh fp32 accumulator (``use_acc=False``), which the block's e8m0 scales (one a row, as
  fp32 ``2^(e - 127)``, byte 0 as 2^-127, byte 255 NaN) multiply into the running accumulator -- the k32 step's numerics.  Two
  blocks are in flight: block j's product is scaled after block j + 1's wgmma is issued
  (``warpgroup_mma_wait(1)``).  The activation is read by the tensor cores from the ring's slot: no fragment loads,
  no conversion.

Numerics (``BIAS``): the decode gives each code as ``v * 2^-126`` (code 1 a bf16 subnormal), so a product with a
small activation would fall below fp32's normals inside the MMA.  ``BIAS`` multiplies each decoded pair by 2^64
(``mul.rn.bf16x2``, exact: 4 instructions a word) so that products are exact for ``|x| >= 2^-70`` -- the k32
step's window, which there comes from biasing the activation's registers.  ``BIAS=False`` is the timing of the
decode alone (products exact only for larger activations; not for use).

Scales: linear e8m0 ``[M, K/32]`` bytes, loaded by the consumer (16 bytes a row a step of 512, one step ahead).
"""

from __future__ import annotations

import functools
import struct

import torch

from ._gluon import (TensorDescriptor, async_copy, gl, gluon, mbarrier, ring_barriers, shared_view, thread_barrier,
                     tma_load)
from ._mma_step import decode_native_bf16, multipliers
from .engine import fixup_counters
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

__all__ = ["STEP_K", "wgmma_gemv", "wgmma_arguments", "decode_asm"]

STEP_K = 512
TILE_ROWS = 64
PRODUCER_REGS = 40
BIAS_EXP = 64
_BF16_BIAS = 0x5F805F80  # 2^64 in both bf16 halves


@functools.lru_cache(maxsize=None)
def decode_asm(bias: bool) -> tuple[str, str]:
    """PTX decoding one native-order word (``$4``) into its four bf16x2 pairs (``$0 .. $3``), each times 2^64
    where ``bias`` (``$9``); multipliers in ``$5 .. $8`` (mp0, mp1, m24, m29)."""
    mul = {"mp0": "$5", "mp1": "$6", "m24": "$7", "m29": "$8"}
    lines = [".reg .b32 t, u;"] + decode_native_bf16("$4", ("$0", "$1", "$2", "$3"), "t", "u", mul)
    if bias:
        lines += [f"mul.rn.bf16x2 ${q}, ${q}, $9;" for q in range(4)]
    return "{\n" + "\n".join(lines) + "\n}", ",".join(["=r"] * 4 + ["r"] * (6 if bias else 5))


@gluon.jit
def _producer(w_desc, x_desc, wbuf, xbuf, ready, empty, s0, s1, STAGES: gl.constexpr, KT: gl.constexpr):
    tile = gl.program_id(0)
    for i in range(s0, s1):
        slot = (i - s0) % STAGES
        mbarrier.wait(empty.index(slot), (((i - s0) // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes + x_desc.block_type.nbytes)
        tma_load(w_desc, [tile, i * (KT * 8), 0], ready.index(slot), wbuf.index(slot))
        tma_load(x_desc, [i * KT, 0, 0], ready.index(slot), xbuf.index(slot))


@gluon.jit
def _a_operand(words, zero, mp0, mp1, m24, m29, bias, ASM: gl.constexpr, CONS: gl.constexpr, BIAS: gl.constexpr,
               DOT: gl.constexpr):
    """A 32-element block's A operand ``[64, 32]`` bf16 in ``DOT`` from its words ``[4 w, 8 g, 4 c, 2 h8]`` (row
    16 w + 8 h8 + g; pair q = 2 h + p of a word is K elements 16 h + 8 p + 2 c + (0, 1))."""
    if BIAS:
        p0, p1, p2, p3 = gl.inline_asm_elementwise(ASM, CONS, [words, zero + mp0, zero + mp1, zero + m24,
                                                               zero + m29, zero + bias],
                                                   dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                                   pack=1)
    else:
        p0, p1, p2, p3 = gl.inline_asm_elementwise(ASM, CONS, [words, zero + mp0, zero + mp1, zero + m24,
                                                               zero + m29],
                                                   dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                                   pack=1)
    x = gl.join(gl.join(p0, p1), gl.join(p2, p3))  # [w, g, c, h8, p, h]
    lo = (x & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (x >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    a = gl.permute(gl.join(lo, hi), [0, 3, 1, 5, 4, 2, 6])  # [w, h8, g, h, p, c, e]
    return gl.convert_layout(gl.reshape(a, [64, 32]), DOT)


@gluon.jit
def _block_scales(s8, j: gl.constexpr, ROWS_L: gl.constexpr):
    """Block ``j``'s e8m0 scales of the program's rows as fp32 ``[64]`` in ``ROWS_L`` (byte 0 as 2^-127, byte 255
    as NaN: the format's values, as the k32 step's)."""
    col = gl.arange(0, 16, layout=gl.SliceLayout(0, s8.type.layout))[None, :]
    e = gl.sum(gl.where(col == j, s8, 0), axis=1)
    e = gl.convert_layout(e, ROWS_L)
    f = gl.maximum(e << 23, 1 << 22).to(gl.float32, bitcast=True)
    # byte 255 shifted is infinity: f * 0 + f makes it NaN and leaves every finite f as it is (one FFMA)
    return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, 0f00000000, $1;", "=r,r", [f], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _consumer(wbuf, xbuf, ready, empty, out_ptr, sp_ptr, ws_ptr, count_ptr, M, N, s0, s1, s_row, out_stride_m,
              out_stride_n,
              mp0, mp1, m24, m29, bias, STAGES: gl.constexpr, KT: gl.constexpr, NR: gl.constexpr,
              ASM: gl.constexpr, CONS: gl.constexpr, BIAS: gl.constexpr, FOLD: gl.constexpr, LWS: gl.constexpr,
              LWB: gl.constexpr, MMA: gl.constexpr, DOT: gl.constexpr, LS: gl.constexpr, XBIAS: gl.constexpr,
              LXB: gl.constexpr, SPLIT: gl.constexpr):
    tile = gl.program_id(0)
    acc = gl.zeros([64, NR], gl.float32, MMA)
    zacc = gl.zeros([64, NR], gl.float32, MMA)
    zero = gl.zeros([4, 8, 4, 2], gl.int32, LWB)
    ROWS_L: gl.constexpr = gl.SliceLayout(1, MMA)
    # the step's scale bytes of the program's rows: [64, 16] (16 bytes a row: STEP_K / 32 blocks)
    sr = tile * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, LS))[:, None]
    sc = gl.arange(0, 16, layout=gl.SliceLayout(0, LS))[None, :]
    s_ptrs = sp_ptr + sr.to(gl.int64) * s_row + sc
    s_mask = (sr < M) & (sc >= 0)
    s_next = gl.load(s_ptrs + s0 * 16, mask=s_mask, other=0).to(gl.int32)
    WV: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    XV: gl.constexpr = gl.NVMMASharedLayout(128, 16, rank=2)
    for i in range(s0, s1):
        slot = (i - s0) % STAGES
        s8 = s_next
        ahead = gl.minimum(i + 1, s1 - 1)
        s_next = gl.load(s_ptrs + ahead * 16, mask=s_mask, other=0).to(gl.int32)
        mbarrier.wait(ready.index(slot), ((i - s0) // STAGES) & 1)
        words_all = shared_view(wbuf.index(slot), gl.int32, [KT * 128, 4], WV)  # [128 b + 32 w + 4 g + c, u]
        xs = shared_view(xbuf.index(slot), gl.bfloat16, [KT * NR, 64], XV)  # [NR b + row, 64]
        if XBIAS:  # the activation times 2^64 in place (exact for |x| < 2^64), then visible to the tensor cores
            xv = xs.load(LXB)
            xs.store(xv * 18446744073709551616.0)
            fence_async_shared()
            thread_barrier()
        for b in gl.static_range(KT):
            w4 = gl.reshape(words_all.slice(128 * b, 128, dim=0).load(LWS), [4, 8, 4, 4])  # [w, g, c, u]: u = h8 + 2 t
            w_t0, w_t1 = gl.split(gl.permute(gl.reshape(w4, [4, 8, 4, 2, 2]), [0, 1, 2, 4, 3]))
            for t in gl.static_range(2):
                if t == 0:
                    wt = gl.convert_layout(w_t0, LWB)
                else:
                    wt = gl.convert_layout(w_t1, LWB)
                a = _a_operand(wt, zero, mp0, mp1, m24, m29, bias, ASM, CONS, BIAS, DOT)
                xb = xs.slice(NR * b, NR, dim=0).slice(32 * t, 32, dim=1).permute((1, 0))
                part = warpgroup_mma(a, xb, zacc, use_acc=False, is_async=True)
                if 2 * b + t > 0:
                    done = warpgroup_mma_wait(1, deps=[prev])
                    acc = acc + done * gl.expand_dims(f_prev, 1)
                prev = part
                f_prev = _block_scales(s8, 2 * b + t, ROWS_L)
        done = warpgroup_mma_wait(0, deps=[prev])
        acc = acc + done * gl.expand_dims(f_prev, 1)
        async_copy.mbarrier_arrive(empty.index(slot), increment_count=False)
    rr = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))[:, None]
    n = gl.arange(0, NR, layout=gl.SliceLayout(0, MMA))[None, :]
    r = tile * 64 + rr
    if SPLIT > 1:  # each split's partial stored; the last to arrive sums them in split order (deterministic)
        part_at = ws_ptr + (tile * SPLIT).to(gl.int64) * (64 * NR) + rr * NR + n
        gl.store(part_at + gl.program_id(1) * (64 * NR), acc)
        thread_barrier()
        arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = gl.zeros([64, NR], gl.float32, MMA)
            for q in gl.static_range(SPLIT):
                total += gl.load(part_at + q * (64 * NR), cache_modifier=".cg")
            gl.store(out_ptr + r.to(gl.int64) * out_stride_m + n * out_stride_n,
                     (total * FOLD).to(out_ptr.dtype.element_ty), mask=(r < M) & (n < N))
            gl.store(count_ptr + tile, 0)
    else:
        gl.store(out_ptr + r.to(gl.int64) * out_stride_m + n * out_stride_n,
                 (acc * FOLD).to(out_ptr.dtype.element_ty), mask=(r < M) & (n < N))


@gluon.jit
def wgmma_gemv_kernel(w_desc, x_desc, out_ptr, sp_ptr, ws_ptr, count_ptr, M, N, K, s_row, out_stride_m, out_stride_n, mp0, mp1, m24,
                      m29, bias, STAGES: gl.constexpr, KT: gl.constexpr, NR: gl.constexpr, ASM: gl.constexpr,
                      CONS: gl.constexpr, BIAS: gl.constexpr, FOLD: gl.constexpr, LWS: gl.constexpr,
                      LWB: gl.constexpr, MMA: gl.constexpr, DOT: gl.constexpr, LS: gl.constexpr,
                      PRODUCER_REGS: gl.constexpr, XBIAS: gl.constexpr, LXB: gl.constexpr, SPLIT: gl.constexpr):
    n_steps = (K + KT * 64 - 1) // (KT * 64)
    s0 = gl.program_id(1) * n_steps // SPLIT  # this program's steps (split-K over program_id(1))
    s1 = (gl.program_id(1) + 1) * n_steps // SPLIT
    wbuf = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    xbuf = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    ready, empty = ring_barriers(STAGES, 1, 128)
    gl.warp_specialize([
        (_consumer, (wbuf, xbuf, ready, empty, out_ptr, sp_ptr, ws_ptr, count_ptr, M, N, s0, s1, s_row,
                     out_stride_m, out_stride_n, mp0, mp1, m24, m29, bias, STAGES, KT, NR, ASM, CONS, BIAS, FOLD, LWS,
                     LWB, MMA, DOT, LS, XBIAS, LXB, SPLIT)),
        (_producer, (w_desc, x_desc, wbuf, xbuf, ready, empty, s0, s1, STAGES, KT)),
    ], [1], [PRODUCER_REGS])


@functools.lru_cache(maxsize=None)
def _layouts(nr: int):
    lws = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2]], lane_bases=[[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]],
                                     warp_bases=[[32, 0], [64, 0]], block_bases=[], shape=[128, 4])
    lwb = gl.DistributedLinearLayout(reg_bases=[[0, 0, 0, 1]],
                                     lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0],
                                                 [0, 4, 0, 0]],
                                     warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[4, 8, 4, 2])
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, nr, 16])
    dot = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    # scale bytes [64 rows, 16]: rows as the accumulator's (lane g, register +8, warps 16), the 16 bytes in registers
    ls = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
                                    lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
                                    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16])
    lxb = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])  # the activation slot [KT NR, 64]: 16 bytes a thread
    return lws, lwb, mma, dot, ls, lxb


def default_split(m: int, k: int, sm_count: int = 132) -> int:
    """Programs along K so that the 64-row tiles fill about two programs an SM (at most the steps)."""
    tiles, steps = -(-m // 64), -(-k // STEP_K)
    split = 1
    while tiles * split * 2 <= 2 * sm_count and split * 2 <= steps:
        split *= 2
    return split


def wgmma_arguments(tiles: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, out: torch.Tensor, m: int, k: int,
                    stages: int = 3, bias: bool | str = True, split: int | None = None):
    """(kernel, grid, args, options) of one call: ``tiles`` = ``pack_mma_tiles`` of the packed MXFP4 weights
    ``[M, K/2]``, ``scales`` e8m0 ``[M, K/32]`` (row stride a multiple of 16 bytes), ``x`` bf16 ``[N, K]`` (K % 512
    == 0), ``out`` ``[M, N]``."""
    n = x.shape[0]
    if k % STEP_K or n > 16 or scales.stride(0) % 16 or scales.stride(1) != 1:
        raise ValueError(f"wgmma prototype: K % {STEP_K} == 0, N <= 16 and 16-byte scale rows, got K={k}, N={n}, "
                         f"scale strides {scales.stride()}")
    tiles_shape = (-(-m // 64), k // 64, 2048)
    if tuple(tiles.shape) != tiles_shape or tiles.dtype != torch.uint8:
        raise ValueError(f"tiles: expected uint8 {tiles_shape} (layouts.pack_mma_tiles of {m}x{k} weights), got "
                         f"{tiles.dtype} {tuple(tiles.shape)}")
    if scales.dtype != torch.uint8 or scales.shape[0] < m or scales.shape[1] != k // 32:
        raise ValueError(f"scales: expected uint8 [>= {m}, {k // 32}], got {scales.dtype} {tuple(scales.shape)}")
    if x.dtype != torch.bfloat16 or tuple(x.shape) != (n, k) or tuple(out.shape) != (m, n):
        raise ValueError(f"x, out: expected bf16 x [N, {k}] and out [{m}, N], got x {x.dtype} {tuple(x.shape)}, "
                         f"out {tuple(out.shape)}")
    nr = 8 if n <= 8 else 16
    kt = STEP_K // 64
    mt, ktiles = tiles.shape[0], tiles.shape[1]
    w_view = tiles.view(mt, ktiles * 8, 256)
    w_desc = TensorDescriptor(w_view, list(w_view.shape), list(w_view.stride()), [1, kt * 8, 256],
                              gl.NVMMASharedLayout(0, 8, rank=3))
    x3 = x.as_strided((k // 64, n, 64), (64, x.stride(0), 1))
    x_desc = TensorDescriptor(x3, [k // 64, n, 64], [64, x.stride(0), 1], [kt, nr, 64],
                              gl.NVMMASharedLayout(128, 16, rank=3))
    lws, lwb, mma, dot, ls, lxb = _layouts(nr)
    xbias = bias == "x"
    bias = bias is True
    asm, cons = decode_asm(bias)
    mul = multipliers("bf16", "native")
    fold = 2.0 ** (126 - (BIAS_EXP if bias or xbias else 0))
    split = default_split(m, k) if split is None else split
    if split > 1:
        ws = torch.empty(mt * split * 64 * nr, dtype=torch.float32, device=out.device)
        count = fixup_counters(out.device, mt)  # the engine's: kept zero per device and stream
    else:
        ws, count = out, out
    args = (w_desc, x_desc, out, scales, ws, count, m, n, k, scales.stride(0), out.stride(0), out.stride(1), mul["mp0"],
            mul["mp1"], mul["m24"], mul["m29"], _BF16_BIAS)
    options = dict(STAGES=stages, KT=kt, NR=nr, ASM=asm, CONS=cons, BIAS=bias, FOLD=fold, LWS=lws, LWB=lwb, MMA=mma,
                   DOT=dot, LS=ls, PRODUCER_REGS=PRODUCER_REGS, XBIAS=xbias, LXB=lxb, SPLIT=split, num_warps=4, maxnreg=168)
    return wgmma_gemv_kernel, (mt, split), args, options


def wgmma_gemv(tiles, scales, x, out, m, k, stages=3, bias=True, split=None):
    kernel, grid, args, options = wgmma_arguments(tiles, scales, x, out, m, k, stages, bias, split)
    kernel[grid](*args, **options)
    return out
