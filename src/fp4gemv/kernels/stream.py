"""NVFP4 weights times fp16/bf16 activations with N = 1..16 rows, streamed through the bulk-copy engine (TMA).

The program.  ``block_m`` weight rows of one batch over one of ``ksplit`` equal K ranges.  The packed weights
``[block_m, block_k / 2]`` bytes and their block scales come through in-kernel tensor descriptors, which Triton
turns into TMA copies into a ring of ``num_stages`` shared-memory buffers (``tl.range(num_stages=...)``): the
bytes in flight sit in shared memory, not in registers.  The activation tile ``[16, block_k]`` (rows past N
read as zero) is an ordinary load through the same pipeline.  Each weight tile is decoded in registers to the
activation's 16-bit type with its block scale multiplied in and multiplied on the tensor cores (``tl.dot``:
``mma.sync`` at these tile sizes), fp32 accumulation.  With ``ksplit`` > 1 each program writes its fp32 partial
``[block_m, 16]`` to a workspace and :func:`stream_reduce_kernel` sums the partials in K order and rounds once.

The decode (``decode_asm``, inline PTX; the pure-Triton twin computes the same values).  The tile is duplicated
byte by byte (``join(w, w)``: element ``2 i + p`` holds byte i, so each register pair of the MMA operand holds the
two nibbles of one byte); prmt byte tables give the exact e2m1 values in the activation's 16-bit type, 17
instructions per 8 weights (15 for fp16), and one 16-bit multiply per pair applies the block scale.

Exactness.  An e4m3 scale s (|s| in [2^-9, 448]) is exact in bf16 and fp16, and v * s has at most 6
significant bits in [2^-10, 2688]: exact and normal in both.  The tensor cores multiply these exactly by the
activation and accumulate in fp32; the epilogue multiplies by the global scale and rounds once.  MXFP4 weights
(e8m0 scales over 2^-127 .. 2^127) do not fit 16 bits this way: they stay on ``weight_only``.

Scales: linear ``[L, M, K/16]`` rows as a 2-D descriptor; the 128x4 swizzle as the ``[L, M/128, atoms * 32, 16]``
lines of its 512-byte atoms, whole atoms per copy, the program's 64 rows picked out in registers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..target import SM90, TRITON_VERSION, Target
from ._common import apply_global_scales, decode_scale, store_rounded
from ._decode import doubled_e2m1
from ._ptx import E2M1_BYTE_TABLES, E2M1_LOOKUP_REGISTERS, e2m1_pair, e2m1_table_lookup
from ._scratch import install_scratch_allocator
from .spec import (ErrorModel, GemvCase, GemvOperands, Src, TritonKernelSpec, TritonLaunch, check_powers_of_two,
                   fill_sources, global_scale_sources, too_many_rows)

__all__ = ["StreamConfig", "Stream", "stream_config", "stream_gemv_kernel", "stream_reduce_kernel",
           "SHIPPED_CONFIGS", "decode_asm", "MIN_N"]

# The activation tile: 16 rows (tl.dot's smallest N, and spec.GEMV_MAX_N); rows past N are zero, never stored.
BLOCK_N = 16
# From this many rows on it is faster than the register-fed kernels (docs/performance.md, "the streaming
# skeleton"); kernels.DEFERRALS leaves fewer to weight_only.
MIN_N = 9


class StreamConfig(NamedTuple):
    """One launch: ``block_m`` weight rows per program (64: the swizzled scales' half atom), ``block_k`` K
    elements per pipeline step (256: the scale copies need 16-byte rows), ``ksplit`` K ranges, ``num_warps``,
    ``num_stages`` steps in flight."""

    block_m: int = 64
    block_k: int = 256
    ksplit: int = 4
    num_warps: int = 2
    num_stages: int = 4


# The configurations stream_config can return (the CPU tests run each against the exact oracle).
SHIPPED_CONFIGS: tuple[StreamConfig, ...] = (
    StreamConfig(64, 256, 1, 2, 4),
    StreamConfig(64, 256, 2, 2, 4),
    StreamConfig(64, 256, 4, 2, 4),
    StreamConfig(64, 256, 8, 2, 3),
)


def stream_config(case: GemvCase, sm_count: int) -> StreamConfig:
    """The largest ``ksplit`` (1, 2, 4, 8; dividing K into 256-element steps) that keeps the programs within
    four per SM: the H200 sweep's best or within 4% of it on the eight measured shapes (docs/performance.md,
    "the streaming skeleton")."""
    tiles = -(-case.m // 64) * case.batch
    steps = case.k // 256
    best = SHIPPED_CONFIGS[0]
    for cfg in SHIPPED_CONFIGS:
        if steps % cfg.ksplit == 0 and tiles * cfg.ksplit <= 4 * sm_count:
            best = cfg
    return best


def decode_asm(dtype: torch.dtype) -> str:
    """PTX: ``$4``, ``$5`` hold bytes ``[b0, b0, b1, b1]``, ``[b2, b2, b3, b3]``; ``$0``..``$3`` the 16-bit values
    of byte j's low (low half) and high (high half) nibble, exact e2m1 values in ``dtype``.

    One prmt gathers the word of the four bytes (element i in nibble i), ``_ptx.e2m1_table_lookup`` looks the
    values up, and a prmt per byte interleaves their low and high bytes into its pair: 17 instructions for 8
    weights (15 for fp16, whose low bytes are zero), besides the two table words ptxas keeps across the loop."""
    kind = "bf16" if dtype == torch.bfloat16 else "fp16"
    (high0, _), (low0, _) = E2M1_BYTE_TABLES[kind]
    lines = ["{", f".reg .b32 w, {E2M1_LOOKUP_REGISTERS}, t0, t1;", f"mov.b32 t0, {high0:#010x};",
             f"mov.b32 t1, {low0:#010x};", "prmt.b32 w, $4, $5, 0x6420;",
             *e2m1_table_lookup("w", "t0", "t1" if kind == "bf16" else None, kind),
             *(e2m1_pair(j, f"${j}") for j in range(4)), "}"]
    return "\n".join(lines)


_DECODE_ASM = {torch.bfloat16: decode_asm(torch.bfloat16), torch.float16: decode_asm(torch.float16)}
_CONSTRAINTS = "=r,=r,=r,=r,r,r"

# Consecutive K elements per thread in the 16-bit MMA operands (the dot operand's kWidth), which Triton derives
# from the narrowest load feeding them.  Triton 3.6 and 3.7 halve it once more for the join that pairs each
# weight byte with itself: 8, so a thread holds 4 whole packed bytes (one decode word) of one scale block.
# From 3.8 on the join no longer counts: 4, which spreads a thread's weights over twice the scale blocks (twice
# the scale conversions; under 3.9 a 64-byte stack of spilled registers).  The kernel then regroups K in both
# operands (``_k_in_thread_order``) so each thread again holds 8 consecutive weights (sm_90 compiles measured
# with 3.6.0, 3.7.1, 3.8.0 and 3.9.0; docs/performance.md, "Triton 3.9").
MMA_K_WIDTH = 8 if TRITON_VERSION < (3, 8) else 4


class Stream(TritonKernelSpec):
    """NVFP4 weights times fp16/bf16 activations, N = 1..16, on sm_90 (TMA), K a multiple of 256, weight rows and
    scale rows 16-byte aligned, activation rows contiguous along K at 16-byte aligned addresses.  Below ``MIN_N``
    rows it defers to weight_only (``kernels.DEFERRALS``)."""

    name = "stream"
    config_type = StreamConfig

    def why_not(self, case: GemvCase, target: Target) -> str | None:
        if not target.runs_triton:
            return "runs Triton kernels only"
        if target.device_type == "cuda" and not (target.capability and target.capability >= (9, 0)):
            return f"needs TMA (sm_90 or newer; this is {target.describe()})"
        if case.fmt.name != "nvfp4":
            return "takes NVFP4 weights (MXFP4 scales do not fold into 16-bit weights exactly)"
        if case.fp4_activation or case.b.dtype not in (torch.float16, torch.bfloat16):
            return f"needs fp16 or bf16 activations, got {case.describe()}"
        if too_many_rows(case) is not None:
            return too_many_rows(case)
        if case.k % 256:
            return f"needs K a multiple of 256 (16-byte scale rows per copy), got K = {case.k}"
        if case.a.align < 16:
            return f"a: needs data rows at multiples of 16 bytes (TMA), got {case.a.align}-byte alignment"
        if case.a.scale_tile_align < 16:
            return (f"a: needs the scale copies' rows (tiles) at multiples of 16 bytes (TMA), got "
                    f"{case.a.scale_tile_align}-byte alignment")
        if case.b.align < 16:
            return "b: needs rows contiguous along K at 16-byte aligned addresses"
        return None

    def error_model(self, case: GemvCase, config: StreamConfig) -> ErrorModel:
        """Every product exact, all K of a split in one fp32 tensor-core accumulation, partials summed in fp32; no
        fold (module docstring)."""
        return ErrorModel(tensor_cores=True, fold=0)

    def default_config(self, case: GemvCase, target: Target) -> StreamConfig:
        # The interpreter has no SMs: the H200's count, where the configurations were measured.
        return stream_config(case, target.sm_count or SM90.sm_count)

    def check_config(self, config: StreamConfig, case: GemvCase | None = None) -> None:
        check_powers_of_two(config, ("ksplit", "num_warps"))
        if config.block_m != 64 or config.block_k != 256:
            raise ValueError(f"config: expected block_m 64 and block_k 256, got {config}")
        if not isinstance(config.num_stages, int) or config.num_stages < 1:
            raise ValueError(f"config: expected num_stages an integer >= 1, got {config}")
        if case is not None and (case.k // 256) % config.ksplit:
            raise ValueError(f"config: expected ksplit to divide K / 256 = {case.k // 256} steps, got {config}")

    def triton_launch(self, case: GemvCase, config: StreamConfig, target: Target) -> TritonLaunch | None:
        """The one launch of an unsplit K (``ksplit`` 1), which the op layer keeps and launches on addresses;
        None for a split K (two kernels and a partial buffer per call: :meth:`launch`)."""
        if config.ksplit > 1:
            return None
        if target.device_type == "cuda":
            install_scratch_allocator()
        return TritonLaunch(stream_gemv_kernel, _grid(case, config), _kernel_args(case, config, target),
                            dict(num_warps=config.num_warps))

    def launch(self, ops: GemvOperands, config: StreamConfig, target: Target) -> None:
        if config.ksplit == 1:
            super().launch(ops, config, target)
            return
        case = ops.case
        if target.device_type == "cuda":
            install_scratch_allocator()
        grid = _grid(case, config)
        partial = torch.empty((config.ksplit, case.batch, grid[0] * config.block_m, BLOCK_N), dtype=torch.float32,
                              device=ops.out.device)
        args = fill_sources(_kernel_args(case, config, target), ops)
        args["c_ptr"] = partial
        stream_gemv_kernel[grid](**args, num_warps=config.num_warps)
        stream_reduce_kernel[(grid[0], case.batch)](
            partial, ops.out, args["gsa_ptr"], case.m, case.n, *case.out_strides, HAS_GSA=case.a.has_global_scale,
            BLOCK_M=config.block_m, KSPLIT=config.ksplit, num_warps=4)


def _grid(case: GemvCase, config: StreamConfig) -> tuple[int, int, int]:
    return -(-case.m // config.block_m), config.ksplit, case.batch


def _kernel_args(case: GemvCase, config: StreamConfig, target: Target) -> dict:
    """Every argument of :func:`stream_gemv_kernel`, the operands as :class:`Src` placeholders (``c_ptr`` the
    output; a split K's launch puts its partial buffer there)."""
    a, dtype = case.a, case.b.dtype
    swizzled = a.scale_layout == "swizzled"
    gsa_ptr, _ = global_scale_sources(case)
    return dict(
        a_ptr=Src("a_data", torch.uint8), sfa_ptr=Src("a_scales", torch.uint8), b_ptr=Src("b_data", dtype),
        gsa_ptr=gsa_ptr, c_ptr=Src("out", case.out_dtype),
        M=case.m, N=case.n, K=case.k,
        a_stride_l=a.batch_stride, a_stride_m=a.row_stride, sfa_stride_l=a.scales.batch,
        sfa_stride_rows=a.scales.row_tile if swizzled else a.scales.r32,
        b_stride_l=case.b.strides[0], b_stride_n=case.b.strides[1],
        c_stride_l=case.out_strides[0], c_stride_m=case.out_strides[1], c_stride_n=case.out_strides[2],
        DECODE=_DECODE_ASM[dtype], CONSTRAINTS=_CONSTRAINTS, BF16=dtype == torch.bfloat16, SWIZZLED=swizzled,
        HAS_GSA=a.has_global_scale, USE_PTX=target.mode == "ptx", SPLIT=config.ksplit > 1, K_WIDTH=MMA_K_WIDTH,
        BLOCK_M=config.block_m, BLOCK_K=config.block_k, KSPLIT=config.ksplit, NUM_STAGES=config.num_stages,
    )


# --- the kernels --------------------------------------------------------------------------------------------


@triton.jit
def _weights(packed, raw_scales, DECODE: tl.constexpr, CONSTRAINTS: tl.constexpr,
             BF16: tl.constexpr, USE_PTX: tl.constexpr):
    """``[BM, BK / 2]`` packed bytes and ``[BM, BK / 16]`` e4m3 bytes to ``[BM, BK]`` 16-bit weights times their
    scale, exact (module docstring).  The PTX path looks the values up (``decode_asm``) and multiplies in 16 bits;
    the twin computes the same values in fp32 and converts them, exactly."""
    BM: tl.constexpr = packed.shape[0]
    BK: tl.constexpr = 2 * packed.shape[1]
    pairs = tl.reshape(tl.join(packed, packed), [BM, BK])  # element 2 i + p: byte i, nibble p
    s = decode_scale(raw_scales, "nvfp4")
    s = tl.reshape(tl.broadcast_to(s[:, :, None], [BM, BK // 16, 16]), [BM, BK])
    if USE_PTX:
        if BF16:
            v = tl.inline_asm_elementwise(DECODE, CONSTRAINTS, [pairs], dtype=tl.bfloat16, is_pure=True, pack=8)
            w = v * s.to(tl.bfloat16)
        else:
            v = tl.inline_asm_elementwise(DECODE, CONSTRAINTS, [pairs], dtype=tl.float16, is_pure=True, pack=8)
            w = v * s.to(tl.float16)
    else:
        k = tl.arange(0, BK)[None, :]
        code = tl.where(k % 2 == 1, pairs >> 4, pairs & 15)
        value = doubled_e2m1(code.to(tl.int32)).to(tl.float32) * 0.5 * s
        if BF16:
            w = value.to(tl.bfloat16)
        else:
            w = value.to(tl.float16)
    return w


@triton.jit
def _k_in_thread_order(t):
    """``t [R, K]`` with K regrouped in chunks of 32: element ``32 c + 16 j + 4 q + e`` of the result is element
    ``32 c + 8 q + 4 j + e`` of ``t``.  A 4-wide MMA operand gives lane q of a quad the elements 4 q + e and
    16 + 4 q + e of each chunk, which are then ``t``'s 8 consecutive elements 8 q .. 8 q + 7 (``MMA_K_WIDTH``).
    Both operands regrouped alike leave the dot's sum unchanged."""
    R: tl.constexpr = t.shape[0]
    K: tl.constexpr = t.shape[1]
    return tl.reshape(tl.permute(tl.reshape(t, [R, K // 32, 4, 2, 4]), (0, 1, 3, 2, 4)), [R, K])


@triton.jit
def _swizzled_rows(atoms, half, BM: tl.constexpr, COLS: tl.constexpr):
    """The ``[BM = 64, COLS]`` scales of half ``half`` of a 128-row tile from its atoms' lines ``[COLS * 8, 16]``
    (atom a, line r32, byte 4 r4 + c4: row 32 r4 + r32, column 4 a + c4)."""
    t = tl.reshape(atoms, [COLS // 4, 32, 2, 2, 4])  # atom, r32, half, r4 % 2, c4
    lo, hi = tl.split(tl.permute(t, (0, 1, 3, 4, 2)))
    t = tl.where(half == 0, lo, hi)  # [atom, r32, r4 % 2, c4]
    return tl.reshape(tl.permute(t, (2, 1, 0, 3)), [BM, COLS])


@triton.jit
def stream_gemv_kernel(
    a_ptr, sfa_ptr, b_ptr, gsa_ptr, c_ptr,
    M, N, K,
    a_stride_l, a_stride_m, sfa_stride_l, sfa_stride_rows,
    b_stride_l, b_stride_n,
    c_stride_l, c_stride_m, c_stride_n,
    DECODE: tl.constexpr, CONSTRAINTS: tl.constexpr, BF16: tl.constexpr, SWIZZLED: tl.constexpr,
    HAS_GSA: tl.constexpr,
    USE_PTX: tl.constexpr, SPLIT: tl.constexpr, K_WIDTH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, KSPLIT: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    # sfa_stride_rows: a linear scale row's stride, or the swizzle's row-tile stride (bytes).
    BN: tl.constexpr = 16
    COLS: tl.constexpr = BLOCK_K // 16
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_l = tl.program_id(2).to(tl.int64)
    row0 = pid_m * BLOCK_M
    w_desc = tl.make_tensor_descriptor(a_ptr + pid_l * a_stride_l, shape=[M, K // 2], strides=[a_stride_m, 1],
                                       block_shape=[BLOCK_M, BLOCK_K // 2])
    if SWIZZLED:
        # Lines of 16 bytes (32 per atom, atoms of a row tile consecutive); one copy holds whole atoms.
        tiles = (M + 127) // 128
        lines = (K // 64) * 32
        s_desc = tl.make_tensor_descriptor(sfa_ptr + pid_l * sfa_stride_l, shape=[tiles, lines, 16],
                                           strides=[sfa_stride_rows, 16, 1], block_shape=[1, COLS * 8, 16])
    else:
        s_desc = tl.make_tensor_descriptor(sfa_ptr + pid_l * sfa_stride_l, shape=[M, K // 16],
                                           strides=[sfa_stride_rows, 1], block_shape=[BLOCK_M, COLS])
    n = tl.arange(0, BN)
    kk = tl.arange(0, BLOCK_K)
    x_rows = b_ptr + pid_l * b_stride_l + tl.minimum(n, N - 1)[:, None].to(tl.int64) * b_stride_n
    acc = tl.zeros([BLOCK_M, BN], dtype=tl.float32)
    k_len = K // KSPLIT
    k_first = pid_k * k_len
    for k0 in tl.range(k_first, k_first + k_len, BLOCK_K, num_stages=NUM_STAGES):
        packed = w_desc.load([row0, k0 // 2])
        if SWIZZLED:
            atoms = s_desc.load([row0 // 128, (k0 // 64) * 32, 0])
            raw = _swizzled_rows(tl.reshape(atoms, [COLS * 8, 16]), (row0 // 64) % 2, BLOCK_M, COLS)
        else:
            raw = s_desc.load([row0, k0 // 16])
        x = tl.load(x_rows + (k0 + kk)[None, :], mask=n[:, None] < N, other=0.0)
        w = _weights(packed, raw, DECODE, CONSTRAINTS, BF16, USE_PTX)
        if K_WIDTH == 4:
            w = _k_in_thread_order(w)
            x = _k_in_thread_order(x)
        if USE_PTX:
            acc = tl.dot(w, tl.trans(x), acc)
        else:  # the same exact products in fp32 (the interpreter multiplies bf16 as integers: Target.bf16_arithmetic)
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    rows = row0 + tl.arange(0, BLOCK_M)
    if SPLIT:
        # Partials [KSPLIT, L, M_tiles * BLOCK_M, BN], reduced by stream_reduce_kernel.
        ptrs = c_ptr + ((pid_k * tl.num_programs(2) + pid_l) * (tl.num_programs(0) * BLOCK_M) + rows[:, None]) * BN
        tl.store(ptrs + n[None, :], acc)
    else:
        out = apply_global_scales(acc, gsa_ptr, gsa_ptr, HAS_GSA, False)
        ptrs = c_ptr + pid_l * c_stride_l + rows[:, None].to(tl.int64) * c_stride_m + n[None, :] * c_stride_n
        store_rounded(ptrs, out, (rows[:, None] < M) & (n[None, :] < N))


@triton.jit
def stream_reduce_kernel(p_ptr, c_ptr, gsa_ptr, M, N, c_stride_l, c_stride_m, c_stride_n,
                         HAS_GSA: tl.constexpr, BLOCK_M: tl.constexpr, KSPLIT: tl.constexpr):
    """Sum the ``KSPLIT`` partials of one row tile in K order, then the epilogue and the one rounding."""
    BN: tl.constexpr = 16
    pid_m = tl.program_id(0)
    pid_l = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.arange(0, BN)
    tile = (rows[:, None] * BN + n[None, :])
    acc = tl.zeros([BLOCK_M, BN], dtype=tl.float32)
    for k in tl.static_range(KSPLIT):
        acc += tl.load(p_ptr + (k * tl.num_programs(1) + pid_l) * (tl.num_programs(0) * BLOCK_M * BN) + tile)
    out = apply_global_scales(acc, gsa_ptr, gsa_ptr, HAS_GSA, False)
    ptrs = c_ptr + pid_l * c_stride_l + rows[:, None].to(tl.int64) * c_stride_m + n[None, :] * c_stride_n
    store_rounded(ptrs, out, (rows[:, None] < M) & (n[None, :] < N))
