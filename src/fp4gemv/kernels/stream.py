"""NVFP4 weights times fp16/bf16 activations with N = 1..16 rows, streamed through the bulk-copy engine (TMA).

The program.  ``block_m`` weight rows of one batch over one of ``ksplit`` equal K ranges.  The packed weights
``[block_m, block_k / 2]`` bytes and their block scales come through in-kernel tensor descriptors, which Triton
turns into TMA copies into a ring of ``num_stages`` shared-memory buffers (``tl.range(num_stages=...)``): the
bytes in flight sit in shared memory, not in registers.  The activation tile ``[16, block_k]`` (rows past N
read as zero) is an ordinary load through the same pipeline.  Each weight tile is decoded in registers to the
activation's 16-bit type with its block scale multiplied in and multiplied on the tensor cores (``tl.dot``:
``mma.sync`` at these tile sizes), fp32 accumulation.  With ``ksplit`` > 1 each program writes its fp32 partial
``[block_m, 16]`` to a workspace and :func:`stream_reduce_kernel` sums the partials in K order and rounds once.

The decode (``_pairs_asm``, inline PTX; the pure-Triton twin computes the same bits).  The tile is duplicated
byte by byte (``join(w, w)``, so element ``2 i + p`` holds byte i and the register pairs of the MMA operand are
the two nibbles of one byte); a code c becomes the 16-bit pattern ``(c & 7) << m | (c & 8) << 12`` (m = 6 for
bf16: the value times 2^-126; m = 9 for fp16: times 2^-14), both nibbles of a byte with two multiplies and two
masks.

Exactness.  Every decoded value is exact, and so is its product with the scale factor: bf16, v * 2^-126 times
bf16(s * 2^119) = v * s * 2^-7, at most 6 significant bits and normal for every e4m3 scale; fp16, v * 2^-14
times s = v * s * 2^-14, a multiple of 2^-24 below 0.17.  The tensor cores multiply these exactly by the
activation and accumulate in fp32; the epilogue multiplies by 2^7 (2^14) and the global scale, then rounds once.
MXFP4 weights (e8m0 scales over 2^-127 .. 2^127) are not folded this way: they stay on ``weight_only``.

Scales: linear ``[L, M, K/16]`` rows as a 2-D descriptor; the 128x4 swizzle as the ``[L, M/128, atoms * 32, 16]``
lines of its 512-byte atoms, whole atoms per copy, the program's 64 rows picked out in registers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..target import Target
from ._common import apply_global_scales, store_rounded
from ._decode import doubled_e2m1
from .spec import GemvCase, GemvOperands, KernelSpec, check_powers_of_two

__all__ = ["StreamConfig", "Stream", "stream_config", "stream_gemv_kernel", "stream_reduce_kernel",
           "SHIPPED_CONFIGS", "decode_asm", "MIN_N"]

# The activation tile: 16 rows (tl.dot's smallest N); rows past N are zero and never stored.
BLOCK_N = 16
# Measured faster than the register-fed kernels only above this many rows (docs/performance.md, "the streaming
# skeleton"): at N <= 8 weight_only is faster.
MIN_N = 9
# Bits of 2^119 and 2^7, 2^14: the scale bias that keeps bf16 products normal, and the epilogue's factors.
_BF16_SCALE_BIAS = 2.0 ** 119
_FOLD = {torch.bfloat16: 2.0 ** 7, torch.float16: 2.0 ** 14}


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


def decode_asm(mag_shift: int) -> str:
    """PTX: ``$2`` holds bytes ``[b0, b0, b1, b1]``; ``$0``, ``$1`` the 16-bit patterns of b0's and b1's low
    (low half) and high (high half) nibbles, ``(c & 7) << mag_shift | (c & 8) << 12`` each.

    The magnitudes of a byte's nibbles sit at bits 0-2 and 12-14 of (d & 0x7007); one multiply by
    2^m + 2^(m + 4) moves them to m and m + 16 (the other two copies land on bits the mask clears).  The signs,
    bits 3 and 15 of (d & 0x8008), go to 15 and 31 with 2^12 + 2^16 likewise."""
    mags = ((7 << mag_shift) | (7 << (mag_shift + 16)))
    mul = (1 << mag_shift) + (1 << (mag_shift + 4))
    lines = ["{", ".reg .b32 d, y, z;", "mov.b32 d, $2;"]
    for out in ("$0", "$1"):
        lines += ["and.b32 y, d, 0x7007;", "and.b32 z, d, 0x8008;", f"mul.lo.u32 y, y, {mul:#x};",
                  "mul.lo.u32 z, z, 0x11000;", f"and.b32 y, y, {mags:#x};", "and.b32 z, z, 0x80008000;",
                  f"or.b32 {out}, y, z;"]
        if out == "$0":
            lines.append("shr.b32 d, d, 16;")
    lines.append("}")
    return "\n".join(lines)


_DECODE_ASM = {torch.bfloat16: decode_asm(6), torch.float16: decode_asm(9)}


class Stream(KernelSpec):
    """NVFP4 weights times fp16/bf16 activations, N = 1..16, on sm_90 (TMA), K a multiple of 256, weight rows
    16-byte aligned, activation rows contiguous along K at 16-byte aligned addresses.  Chosen by default from
    ``MIN_N`` rows on."""

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
        if case.n > BLOCK_N:
            return f"takes N <= {BLOCK_N} activation rows, got N = {case.n}"
        if case.k % 256:
            return f"needs K a multiple of 256 (16-byte scale rows per copy), got K = {case.k}"
        if case.a.align < 16:
            return f"a: needs data rows at multiples of 16 bytes (TMA), got {case.a.align}-byte alignment"
        if case.a.scale_align < 16 and case.a.scale_layout == "linear":
            return "a: needs linear scale rows at multiples of 16 bytes (TMA)"
        if case.b.align < 16:
            return "b: needs rows contiguous along K at 16-byte aligned addresses"
        return None

    def why_not_default(self, case: GemvCase, target: Target) -> str | None:
        if case.n < MIN_N:
            return f"N < {MIN_N} runs faster on the register-fed kernels (measured)"
        return None

    def default_config(self, case: GemvCase, target: Target) -> StreamConfig:
        return stream_config(case, target.sm_count or 132)

    def check_config(self, config: StreamConfig, case: GemvCase | None = None) -> None:
        check_powers_of_two(config, ("ksplit", "num_warps"))
        if config.block_m != 64 or config.block_k != 256:
            raise ValueError(f"config: expected block_m 64 and block_k 256, got {config}")
        if not isinstance(config.num_stages, int) or config.num_stages < 1:
            raise ValueError(f"config: expected num_stages an integer >= 1, got {config}")
        if case is not None and (case.k // 256) % config.ksplit:
            raise ValueError(f"config: expected ksplit to divide K / 256 = {case.k // 256} steps, got {config}")

    def launch(self, ops: GemvOperands, config: StreamConfig, target: Target) -> None:
        case = ops.case
        a = case.a
        install_scratch_allocator(target)
        m_tiles = -(-case.m // config.block_m)
        split = config.ksplit > 1
        partial = (torch.empty((config.ksplit, case.batch, m_tiles * config.block_m, BLOCK_N), dtype=torch.float32,
                               device=ops.out.device) if split else ops.out)
        dtype = case.b.dtype
        swizzled = a.scale_layout == "swizzled"
        gsa = ops.a_global_scale if a.has_global_scale else ops.a_scales
        stream_gemv_kernel[(m_tiles, config.ksplit, case.batch)](
            ops.a_data, ops.a_scales, ops.b_data, gsa, partial,
            case.m, case.n, case.k,
            a.batch_stride, a.row_stride, a.scales.batch, a.scales.row_tile if swizzled else a.scales.r32,
            case.b.strides[0], case.b.strides[1],
            case.out_strides[0], case.out_strides[1], case.out_strides[2],
            DECODE=_DECODE_ASM[dtype], BF16=dtype == torch.bfloat16, SWIZZLED=swizzled,
            FOLD=_FOLD[dtype], HAS_GSA=a.has_global_scale, USE_PTX=target.mode == "ptx", SPLIT=split,
            BLOCK_M=config.block_m, BLOCK_K=config.block_k, KSPLIT=config.ksplit, NUM_STAGES=config.num_stages,
            num_warps=config.num_warps)
        if split:
            stream_reduce_kernel[(m_tiles, case.batch)](
                partial, ops.out, gsa, case.m, case.n, case.out_strides[0], case.out_strides[1], case.out_strides[2],
                FOLD=_FOLD[dtype], HAS_GSA=a.has_global_scale, BLOCK_M=config.block_m, KSPLIT=config.ksplit,
                num_warps=4)


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, device="cuda")


def install_scratch_allocator(target: Target) -> None:
    """In-kernel descriptors need Triton's global scratch memory: give the calling thread a torch-backed
    allocator unless it has one (Triton keeps it per thread)."""
    from triton.runtime import _allocation

    if target.device_type == "cuda" and isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


# --- the kernels --------------------------------------------------------------------------------------------


@triton.jit
def _weights(packed, raw_scales, DECODE: tl.constexpr, BF16: tl.constexpr, USE_PTX: tl.constexpr):
    """``[BM, BK / 2]`` packed bytes and ``[BM, BK / 16]`` e4m3 bytes to ``[BM, BK]`` 16-bit weights times their
    scale and 2^-7 (bf16) or 2^-14 (fp16), exact (module docstring).  The PTX path decodes bit patterns and
    multiplies in 16 bits; the twin computes the same values in fp32 and converts them, exactly."""
    BM: tl.constexpr = packed.shape[0]
    BK: tl.constexpr = 2 * packed.shape[1]
    pairs = tl.reshape(tl.join(packed, packed), [BM, BK])  # element 2 i + p: byte i, nibble p
    s = raw_scales.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], [BM, BK // 16, 16]), [BM, BK])
    if USE_PTX:
        if BF16:
            v = tl.inline_asm_elementwise(DECODE, "=r,=r,r", [pairs], dtype=tl.bfloat16, is_pure=True, pack=4)
            w = v * (s * 6.646139978924579e35).to(tl.bfloat16)  # v * 2^-126 times s * 2^119
        else:
            v = tl.inline_asm_elementwise(DECODE, "=r,=r,r", [pairs], dtype=tl.float16, is_pure=True, pack=4)
            w = v * s.to(tl.float16)  # v * 2^-14 times s
    else:
        k = tl.arange(0, BK)[None, :]
        code = tl.where(k % 2 == 1, pairs >> 4, pairs & 15)
        value = doubled_e2m1(code.to(tl.int32)).to(tl.float32) * s  # 2 v s
        if BF16:
            w = (value * 0.00390625).to(tl.bfloat16)  # v * s * 2^-7
        else:
            w = (value * 3.0517578125e-05).to(tl.float16)  # v * s * 2^-14
    return w


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
    DECODE: tl.constexpr, BF16: tl.constexpr, SWIZZLED: tl.constexpr, FOLD: tl.constexpr, HAS_GSA: tl.constexpr,
    USE_PTX: tl.constexpr, SPLIT: tl.constexpr,
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
        w = _weights(packed, raw, DECODE, BF16, USE_PTX)
        if USE_PTX:
            acc = tl.dot(w, tl.trans(x), acc)
        else:  # the same exact products in fp32 (Triton 3.6's interpreter mis-multiplies bf16 dots)
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    rows = row0 + tl.arange(0, BLOCK_M)
    if SPLIT:
        # Partials [KSPLIT, L, M_tiles * BLOCK_M, BN], reduced by stream_reduce_kernel.
        ptrs = c_ptr + ((pid_k * tl.num_programs(2) + pid_l) * (tl.num_programs(0) * BLOCK_M) + rows[:, None]) * BN
        tl.store(ptrs + n[None, :], acc)
    else:
        out = apply_global_scales(acc * FOLD, gsa_ptr, gsa_ptr, HAS_GSA, False)
        ptrs = c_ptr + pid_l * c_stride_l + rows[:, None].to(tl.int64) * c_stride_m + n[None, :] * c_stride_n
        store_rounded(ptrs, out, (rows[:, None] < M) & (n[None, :] < N))


@triton.jit
def stream_reduce_kernel(p_ptr, c_ptr, gsa_ptr, M, N, c_stride_l, c_stride_m, c_stride_n,
                         FOLD: tl.constexpr, HAS_GSA: tl.constexpr, BLOCK_M: tl.constexpr, KSPLIT: tl.constexpr):
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
    out = apply_global_scales(acc * FOLD, gsa_ptr, gsa_ptr, HAS_GSA, False)
    ptrs = c_ptr + pid_l * c_stride_l + rows[:, None].to(tl.int64) * c_stride_m + n[None, :] * c_stride_n
    store_rounded(ptrs, out, (rows[:, None] < M) & (n[None, :] < N))
