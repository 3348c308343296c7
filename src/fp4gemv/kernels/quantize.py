"""Triton kernels that quantize floats to NVFP4 / MXFP4 and dequantize them back, bit for bit as ``formats``.

``quantize_kernel`` computes exactly what ``formats.quantize`` computes (its docstring is the definition);
``dequantize_kernel`` exactly what ``formats.dequantize`` rounds to.  Only IEEE float32 / float64 operations
that round to nearest even are used (``tl.div_rn`` or float64, never float32's approximate ``/``; no fused
multiply-add; no flush-to-zero), so the GPU and the CPU-side interpreter (NumPy) give the same bits; roundings
to the narrow formats are done by hand where Triton's interpreter and the GPU disagree.  Where the kernels
compute differently from ``formats`` (e2m1 and e4m3 rounding by magic-number addition, NVFP4 division through
a float64 reciprocal, dequantization from per-block rounded products), the comments give the reason the
result is the same; tests/test_quantize.py checks it bit for bit.

Both kernels read or write floats as *pairs*: a 16-bit tensor viewed as int32, a float32 one as int64, so
element 2j sits in the low half of word j (little-endian), as e2m1 element 2j sits in the low nibble of
byte j (in the checkpoint code order; ``dequantize_kernel`` reads the others' codes from whole 32-bit words of
the same bytes, ``_code_words``).  A program owns a tile of ``ROWS`` rows x ``BLOCKS`` scale blocks of
``BLOCK_SIZE`` elements, held as ``[ROWS, BLOCKS, BLOCK_SIZE / 2]`` words, so a block's maximum is a reduction
over the last axis and the packed bytes come out in the words' own layout.

NVFP4 with a global scale chosen per call (``quantize(x, global_scale="pow2")``: ``quantize.per_tensor_scale`` of
x's largest magnitude) takes two launches: ``kernels/amax.py``'s partial maxima of x's magnitude bits, then
``quantize_kernel`` with ``PARTIALS`` > 0, each of whose programs takes the maximum of the partials and computes the
scale from it (``pow2_per_tensor_scale``, the definition's twin; program 0 stores it for the result to carry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..formats import FP4Format, dtype_name
from ..target import Target
from ._common import decode_scale, scale_row_offset
from ._decode import code_order_index, ordered_codes
from .spec import ScaleAddressing, Src, TritonKernelSpec, TritonLaunch, check_powers_of_two

__all__ = ["QuantizeConfig", "quantize_config", "quantize_kernel", "dequantize_kernel", "FLOAT_CODES", "QuantizeCase",
           "QuantizeOperands", "DequantizeCase", "DequantizeOperands", "Quantize", "Dequantize", "pair_dtype",
           "pow2_per_tensor_scale"]

# How a kernel names the float dtype of its pair words.
FLOAT_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}

_F32_EXPONENT_MASK = tl.constexpr(0x7F800000)
_F32_MAGNITUDE_MASK = tl.constexpr(0x7FFFFFFF)
_F32_MANTISSA_MASK = tl.constexpr(0x007FFFFF)
_F32_SMALLEST_NORMAL_BITS = tl.constexpr(0x00800000)
_F32_ONE_BITS = tl.constexpr(0x3F800000)


class QuantizeConfig(NamedTuple):
    """One launch: ``rows`` rows x ``blocks`` scale blocks per program, ``num_warps`` warps.

    ``float64_reciprocal``: NVFP4 quantization divides each element through a float64 reciprocal of its
    block's divisor (True) or by ``tl.div_rn`` (False); the bytes are the same, the speed is not.
    """

    rows: int
    blocks: int
    num_warps: int = 4
    float64_reciprocal: bool = True


def quantize_config(block_size: int) -> QuantizeConfig:
    """The tile of both kernels: 8 rows x 512 K-elements (8 KB of bf16 input or output), 32 elements per thread
    in 4 warps, so each thread has several 16-byte loads in flight.  Not yet tuned on the GPU
    (``benchmarks/quantize_speed.py`` sweeps the alternatives)."""
    return QuantizeConfig(8, 512 // block_size)


def pair_dtype(dtype: torch.dtype) -> torch.dtype:
    """The words a float tensor of ``dtype`` is read or written as, two elements each (module docstring)."""
    return torch.int64 if dtype == torch.float32 else torch.int32


@dataclass(frozen=True)
class QuantizeCase:
    """Quantizing floats ``[L, R, K]`` of ``x_dtype`` (read as pair words, ``x_strides`` their batch and row
    strides in words) to ``fmt`` bytes ``[L, R, K/2]`` (``data_strides``) and scale bytes at ``scales``
    (``layout``), divided by a global scale where ``has_global_scale``: what a quantize kernel may look at.

    ``amax_partials``: 0 where the global scale is given (or there is none); else NVFP4's scale of this call,
    ``quantize.per_tensor_scale`` of x's largest magnitude, which the kernel computes from that many partial maxima
    of ``kernels/amax.py`` (and writes to ``global_scale``)."""

    fmt: FP4Format
    batch: int
    rows: int
    k: int
    x_dtype: torch.dtype
    x_strides: tuple[int, int]
    data_strides: tuple[int, int]
    layout: str
    scales: ScaleAddressing
    has_global_scale: bool
    amax_partials: int = 0

    def describe(self) -> str:
        per_call = " and the global scale of x's amax" if self.amax_partials else ""
        return (f"quantizing {dtype_name(self.x_dtype)} [{self.batch}, {self.rows}, {self.k}] to {self.fmt.name} "
                f"with {self.layout} scales{per_call}")


class QuantizeOperands(NamedTuple):
    """The tensors of one quantization: x as given (floats), x as pair words, the results' bytes and scale bytes,
    the fp32 global scale (or None; written by the kernel where ``case.amax_partials``), and the int32 partial
    maxima of x's magnitude (``case.amax_partials`` of them, or None)."""

    case: QuantizeCase
    x: torch.Tensor
    x_words: torch.Tensor
    data: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    partials: torch.Tensor | None = None


@dataclass(frozen=True)
class DequantizeCase:
    """``fmt`` bytes ``[L, R, K/2]`` (``data_strides``; codes in ``code_order``, ``formats.CODE_ORDERS``) with
    ``layout`` scales at ``scales`` (and a global scale where ``has_global_scale``) to floats of ``out_dtype``
    (written as pair words, ``out_strides`` in words)."""

    fmt: FP4Format
    batch: int
    rows: int
    k: int
    data_strides: tuple[int, int]
    layout: str
    scales: ScaleAddressing
    has_global_scale: bool
    out_dtype: torch.dtype
    out_strides: tuple[int, int]
    code_order: str = "checkpoint"

    def describe(self) -> str:
        order = "" if self.code_order == "checkpoint" else f" (codes in the {self.code_order} order)"
        return (f"dequantizing {self.fmt.name} [{self.batch}, {self.rows}, {self.k}]{order} with {self.layout} "
                f"scales to {dtype_name(self.out_dtype)}")


class DequantizeOperands(NamedTuple):
    """The tensors of one dequantization: packed bytes, scale bytes, the global scale (or None), the result (and
    it as pair words)."""

    case: DequantizeCase
    data: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    out: torch.Tensor
    out_words: torch.Tensor


def _grid(rows: int, k: int, batch: int, block_size: int, config: QuantizeConfig) -> tuple[int, int, int]:
    return triton.cdiv(rows, config.rows), triton.cdiv(k // block_size, config.blocks), batch


class _Tiled(TritonKernelSpec):
    """What both kernels' specs share: a tile of ``rows`` x ``blocks`` (``QuantizeConfig``), Triton targets only."""

    config_type = QuantizeConfig

    def why_not(self, case, target: Target) -> str | None:
        return None if target.runs_triton else "runs Triton kernels only"

    def default_config(self, case, target: Target) -> QuantizeConfig:
        return quantize_config(case.fmt.block_size)

    def check_config(self, config: QuantizeConfig, case=None) -> None:
        check_powers_of_two(config, ("rows", "blocks", "num_warps"))


class Quantize(_Tiled):
    """``quantize_kernel``: any float input read as pair words, either scale layout, bit for bit as
    ``formats.quantize``."""

    name = "quantize"

    def triton_launch(self, case: QuantizeCase, config: QuantizeConfig, target: Target) -> TritonLaunch:
        gs = Src("global_scale", torch.float32) if case.has_global_scale else Src("data", torch.uint8)  # not read
        partials = Src("partials", torch.int32) if case.amax_partials else Src("data", torch.uint8)  # not read
        args = dict(x_ptr=Src("x_words", pair_dtype(case.x_dtype)), data_ptr=Src("data", torch.uint8),
                    scales_ptr=Src("scales", torch.uint8), gs_ptr=gs, partials_ptr=partials, rows=case.rows,
                    n_blocks=case.k // case.fmt.block_size, x_stride_l=case.x_strides[0],
                    x_stride_r=case.x_strides[1], data_stride_l=case.data_strides[0],
                    data_stride_r=case.data_strides[1], sf_stride_l=case.scales.batch,
                    sf_row_tile=case.scales.row_tile, sf_r32=case.scales.r32, sf_r4=case.scales.r4,
                    sf_col_tile=case.scales.col_tile, FLOAT_CODE=FLOAT_CODES[dtype_name(case.x_dtype)],
                    FORMAT=case.fmt.name, HAS_GLOBAL=case.has_global_scale, ROWS=config.rows,
                    BLOCKS=config.blocks, FLOAT64_RECIPROCAL=config.float64_reciprocal,
                    PARTIALS=case.amax_partials)
        return TritonLaunch(quantize_kernel, _grid(case.rows, case.k, case.batch, case.fmt.block_size, config), args,
                            dict(num_warps=config.num_warps))


class Dequantize(_Tiled):
    """``dequantize_kernel``: float32, float16 and bfloat16 results, each value rounded once, bit for bit as
    ``formats.dequantize``; codes in any order (``formats.CODE_ORDERS``), read where they lie."""

    name = "dequantize"

    def why_not(self, case: DequantizeCase, target: Target) -> str | None:
        if case.out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return f"writes float32, float16 or bfloat16 (the reference computes {dtype_name(case.out_dtype)})"
        return super().why_not(case, target)

    def triton_launch(self, case: DequantizeCase, config: QuantizeConfig, target: Target) -> TritonLaunch:
        gs = Src("global_scale", torch.float32) if case.has_global_scale else Src("data", torch.uint8)  # not read
        args = dict(data_ptr=Src("data", torch.uint8), scales_ptr=Src("scales", torch.uint8), gs_ptr=gs,
                    out_ptr=Src("out_words", pair_dtype(case.out_dtype)), rows=case.rows,
                    n_blocks=case.k // case.fmt.block_size, data_stride_l=case.data_strides[0],
                    data_stride_r=case.data_strides[1], sf_stride_l=case.scales.batch,
                    sf_row_tile=case.scales.row_tile, sf_r32=case.scales.r32, sf_r4=case.scales.r4,
                    sf_col_tile=case.scales.col_tile, out_stride_l=case.out_strides[0],
                    out_stride_r=case.out_strides[1], FLOAT_CODE=FLOAT_CODES[dtype_name(case.out_dtype)],
                    FORMAT=case.fmt.name, HAS_GLOBAL=case.has_global_scale, ROWS=config.rows, BLOCKS=config.blocks,
                    ORDER=code_order_index(case.code_order))
        return TritonLaunch(dequantize_kernel, _grid(case.rows, case.k, case.batch, case.fmt.block_size, config),
                            args, dict(num_warps=config.num_warps))


@triton.jit
def _unpack_pairs(words, FLOAT_CODE: tl.constexpr):
    """(float32 bits of element 2j, of element 2j + 1) from pair words, as int32; widening is exact."""
    if FLOAT_CODE == 0:  # float32 pairs in int64
        return words.to(tl.int32), (words >> 32).to(tl.int32)
    elif FLOAT_CODE == 1:  # bf16 is the top half of a float32
        return words << 16, words & -65536
    else:
        lo = (words & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (words >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo.to(tl.int32, bitcast=True), hi.to(tl.int32, bitcast=True)


@triton.jit
def _e2m1_codes(q):
    """e2m1 codes (int32 0..15) of float32 ``q``: nearest, ties to even code, saturating at ±6; sign kept.

    Adding C = 2^22, 2^23 or 2^24 (by the binade E of the magnitude: below 2, below 4, up to 6) rounds it,
    nearest even, to a multiple of the e2m1 step there (0.5, 1, 2), and an even multiple is an even code;
    the sum's bits less C's are then the code less 2 (E - 127).  (NaN only reaches here from blocks the
    caller overwrites.)  The sign bit is ``q < 0``, so a zero of either sign gets code 0 (``formats.quantize``),
    tested on the bits: negative nonzero floats are the unsigned integers above 0x80000000.  (Not ``q + 0.0``,
    which the compiler may fuse into the multiplication that made ``q``, keeping the sign of an underflowing
    product; nor ``q < 0.0``, which it hoists above a float64 -> float32 conversion into a float64 compare.)
    """
    negative = q.to(tl.uint32, bitcast=True) > 0x80000000
    mag = tl.minimum(tl.abs(q), 6.0)
    binade = tl.maximum(mag.to(tl.int32, bitcast=True) >> 23, 127)
    c = ((binade + 22) << 23).to(tl.float32, bitcast=True)
    rounded = (mag + c).to(tl.int32, bitcast=True)
    return (rounded - (binade * ((1 << 23) - 2) + ((22 << 23) + 254))) | tl.where(negative, 8, 0)


@triton.jit
def _e4m3_round(s):
    """``s`` in [2^-9, 448] rounded to e4m3 (nearest even): (its byte, its value as float32).

    Adding C = 2^(e + 20) (e: s's binade; 2^14 below e4m3's normal range, where the step is 2^-9 throughout)
    leaves float32 a step of 2^(e - 3), e4m3's, so ``(s + C) - C`` is the rounded value, a carry into the next
    binade included.
    """
    c_bits = tl.maximum((s.to(tl.int32, bitcast=True) & _F32_EXPONENT_MASK) + (20 << 23), 0x46800000)
    c = c_bits.to(tl.float32, bitcast=True)
    value = (s + c) - c
    value_bits = value.to(tl.int32, bitcast=True)
    # Normal: e4m3 exponent = float32 exponent - 120, and the top 3 mantissa bits; subnormal: value * 2^9.
    byte = tl.where(value >= 0.015625, (value_bits >> 20) - (120 << 3), (value * 512.0).to(tl.int32))
    return byte, value


@triton.jit
def _tile(rows, n_blocks, FORMAT: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr):
    """This program's tile: (batch, rows ``r`` [ROWS], scale blocks ``b`` [BLOCKS], ``r3`` = r[:, None, None], the
    word columns ``col`` [1, BLOCKS, pairs per block], the mask).  The mask depends on the row and the block only,
    so it is constant along each block's words."""
    if FORMAT == "nvfp4":
        PAIRS: tl.constexpr = 8
    else:
        PAIRS: tl.constexpr = 16
    pid_l = tl.program_id(2).to(tl.int64)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    r3 = r[:, None, None]
    col = b[None, :, None] * PAIRS + tl.arange(0, PAIRS)[None, None, :]
    mask = (r3 < rows) & (b[None, :, None] < n_blocks)
    return pid_l, r, b, r3, col, mask


@triton.jit
def _nvfp4_block_scales(lo_bits, hi_bits, lo, hi, g, HAS_GLOBAL: tl.constexpr, FLOAT64_RECIPROCAL: tl.constexpr):
    """NVFP4: each block's e4m3 scale byte (0x7F where the block holds NaN or infinity) and the block's values
    divided by its scale (times the global scale ``g`` when HAS_GLOBAL), ready for the e2m1 rounding:
    (lo, hi, scale byte, finite)."""
    # The largest magnitude as the largest integer of magnitude bits: NaN and infinity sort above it.
    amax_bits = tl.max(tl.maximum(lo_bits & _F32_MAGNITUDE_MASK, hi_bits & _F32_MAGNITUDE_MASK), axis=2)
    finite = amax_bits < _F32_EXPONENT_MASK
    amax = tl.where(finite, amax_bits, 0).to(tl.float32, bitcast=True)
    if HAS_GLOBAL:
        s = tl.div_rn(amax, 6.0 * g)
    else:
        s = tl.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
    s = tl.where(s == 0.0, 1.0, s)
    s = tl.minimum(tl.maximum(s, 0.001953125), 448.0)
    scale_byte, scale = _e4m3_round(s)
    if HAS_GLOBAL:
        scale = scale * g
    # x / scale rounded to float32 through float64: with R = 1 / scale (float64, rounded once per block),
    # x * R is within 2^-52 (relative) of x / scale, and an exact quotient of two float32 numbers is
    # at least 2^-49 away from every midpoint between normal float32 numbers.  So rounding x * R to
    # float32 decides every comparison the e2m1 rounding makes as rounding x / scale would (below
    # 2^-126, where a tie is possible, the code is 0 either way), without a division per element.
    if FLOAT64_RECIPROCAL:
        inverse = (1.0 / scale.to(tl.float64))[:, :, None]
        lo = (lo.to(tl.float64) * inverse).to(tl.float32)
        hi = (hi.to(tl.float64) * inverse).to(tl.float32)
    else:
        lo = tl.div_rn(lo, scale[:, :, None])
        hi = tl.div_rn(hi, scale[:, :, None])
    scale_byte = tl.where(finite, scale_byte, 0x7F)
    return lo, hi, scale_byte, finite


@triton.jit
def _mxfp4_block_scales(lo_bits, hi_bits, lo, hi, g, HAS_GLOBAL: tl.constexpr):
    """MXFP4: each block's e8m0 scale byte (0xFF where the block holds NaN or infinity) and the block's values
    (divided by the global scale ``g`` first when HAS_GLOBAL) times 1 / scale: (lo, hi, scale byte, finite)."""
    if HAS_GLOBAL:
        lo = tl.div_rn(lo, g)
        hi = tl.div_rn(hi, g)
        lo_bits = lo.to(tl.int32, bitcast=True)
        hi_bits = hi.to(tl.int32, bitcast=True)
    amax_bits = tl.max(tl.maximum(lo_bits & _F32_MAGNITUDE_MASK, hi_bits & _F32_MAGNITUDE_MASK), axis=2)
    finite = amax_bits < _F32_EXPONENT_MASK
    # floor(log2(amax)) - 2 from the biased exponent (0 for zero and subnormals: clamps to -127 anyway).
    exponent = tl.minimum(tl.maximum((amax_bits >> 23) - 129, -127), 127)
    inverse_scale = (tl.minimum(tl.maximum(127 - exponent, 1), 254) << 23).to(tl.float32, bitcast=True)
    lo = lo * inverse_scale[:, :, None]
    hi = hi * inverse_scale[:, :, None]
    scale_byte = tl.where(finite, exponent + 127, 0xFF)
    return lo, hi, scale_byte, finite


@triton.jit
def _pow2_at_or_above(bits):
    """The bits of the power of two at or above the positive normal float32 of bits ``bits`` (int32): itself when
    its mantissa is zero, else the next binade's."""
    return tl.where((bits & _F32_MANTISSA_MASK) == 0, bits, (bits & _F32_EXPONENT_MASK) + _F32_SMALLEST_NORMAL_BITS)


@triton.jit
def pow2_per_tensor_scale(amax_bits):
    """``quantize.per_tensor_scale(amax, "pow2")`` (float32) bit for bit, for the float32 magnitude bits
    ``amax_bits`` (int32 >= 0; NaN's above infinity's): the twin of that definition, checked against it in
    tests/test_quantize.py.

    q = amax / 2688 rounded once (``tl.div_rn``: the definition divides by a tensor, IEEE on every device), then
    the power of two at or above q.  A normal q's is read from its bits.  A subnormal q is m * 2^-149 with m its
    bits, so the power of two at or above it is 2^c * 2^-149 with 2^c the power of two at or above the integer m:
    m as a float32 (exact, m < 2^23) rounded up the same way, back to an integer (2^23 is 2^-126's bits, the
    smallest normal).  1 where the definition's ``amax > 0`` is false (zero, NaN), for an infinite amax (frexp
    gives infinity the exponent 0 on the CPU and on CUDA: ldexp(1, 0)) and where q rounds to zero (frexp(0) too).
    Integer operations and one division, so the GPU and the interpreter agree bit for bit."""
    finite = amax_bits < _F32_EXPONENT_MASK
    amax = tl.where(finite, amax_bits, 0).to(tl.float32, bitcast=True)  # no arithmetic on NaN or infinity
    q_bits = tl.div_rn(amax, 2688.0).to(tl.int32, bitcast=True)
    m = tl.minimum(q_bits, _F32_SMALLEST_NORMAL_BITS).to(tl.float32)  # the subnormal case's integer, exactly
    subnormal = _pow2_at_or_above(m.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True).to(tl.int32)
    bits = tl.where(q_bits < _F32_SMALLEST_NORMAL_BITS, subnormal, _pow2_at_or_above(q_bits))
    defined = finite & (q_bits > 0)  # q_bits > 0: amax > 0, and q did not round to zero
    return tl.where(defined, bits, _F32_ONE_BITS).to(tl.float32, bitcast=True)


@triton.jit
def quantize_kernel(
    x_ptr,
    data_ptr,
    scales_ptr,
    gs_ptr,
    partials_ptr,
    rows,
    n_blocks,
    x_stride_l,
    x_stride_r,
    data_stride_l,
    data_stride_r,
    sf_stride_l,
    sf_row_tile,
    sf_r32,
    sf_r4,
    sf_col_tile,
    FLOAT_CODE: tl.constexpr,
    FORMAT: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCKS: tl.constexpr,
    FLOAT64_RECIPROCAL: tl.constexpr = True,
    PARTIALS: tl.constexpr = 0,
):
    """Quantize pair words ``x`` ``[L, rows, K/2]`` into packed bytes ``[L, rows, K/2]`` and scale bytes
    (addressed by ``ScaleAddressing``) of ``FORMAT`` ("nvfp4" or "mxfp4"); ``gs_ptr``: the fp32 global scale,
    read when HAS_GLOBAL.  PARTIALS > 0 (NVFP4, HAS_GLOBAL): the global scale is instead
    ``pow2_per_tensor_scale`` of the largest of the PARTIALS int32 magnitude bits at ``partials_ptr``
    (``kernels/amax.py``), which program 0 writes to ``gs_ptr``."""
    pid_l, r, b, r3, col, mask = _tile(rows, n_blocks, FORMAT, ROWS, BLOCKS)
    words = tl.load(x_ptr + pid_l * x_stride_l + r3 * x_stride_r + col, mask=mask, other=0)
    lo_bits, hi_bits = _unpack_pairs(words, FLOAT_CODE)
    lo = lo_bits.to(tl.float32, bitcast=True)
    hi = hi_bits.to(tl.float32, bitcast=True)
    if PARTIALS > 0:
        g = pow2_per_tensor_scale(tl.max(tl.load(partials_ptr + tl.arange(0, PARTIALS)), axis=0))
        first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0)
        tl.store(gs_ptr, g, mask=first)
    elif HAS_GLOBAL:
        g = tl.load(gs_ptr)
    else:
        g = 1.0  # not read
    if FORMAT == "nvfp4":
        lo, hi, scale_byte, finite = _nvfp4_block_scales(lo_bits, hi_bits, lo, hi, g, HAS_GLOBAL, FLOAT64_RECIPROCAL)
    else:
        lo, hi, scale_byte, finite = _mxfp4_block_scales(lo_bits, hi_bits, lo, hi, g, HAS_GLOBAL)
    packed = _e2m1_codes(lo) | (_e2m1_codes(hi) << 4)
    packed = tl.where(finite[:, :, None], packed, 0).to(tl.uint8)
    tl.store(data_ptr + pid_l * data_stride_l + r3 * data_stride_r + col, packed, mask=mask)
    sf_offset = (pid_l * sf_stride_l + scale_row_offset(r, sf_row_tile, sf_r32, sf_r4)[:, None]
                 + (b // 4 * sf_col_tile + b % 4)[None, :])
    tl.store(scales_ptr + sf_offset, scale_byte.to(tl.uint8), mask=(r[:, None] < rows) & (b[None, :] < n_blocks))


@triton.jit
def _e2m1_values(codes):
    """float32 values of e2m1 codes (int32, low 4 bits; higher bits ignored).

    The code's exponent and mantissa bits placed at float32's bits 24..22 read as e2m1 * 2^-126 (code 1, 0.5,
    as the subnormal 2^-127, which is how e2m1 encodes it too); the multiplication by 2^126 is exact.
    """
    shifted = codes << 22
    bits = (shifted & 0x01C00000) | ((shifted << 6) & -2147483648)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


@triton.jit
def _scaled_e2m1(codes, base_one, base_three_halves):
    """e2m1 codes times a block's scale, given the scale times 1 and times 1.5 already rounded to the output
    float: every e2m1 magnitude is 0, or 1 or 1.5 times 2^k (k = -1..2), and scaling by 2^k is exact (the
    caller keeps every product in the normal range).  As float32, 1.5 * 2^k is the only e2m1 value with
    mantissa bit 22 set; clearing it leaves 2^k (or 0, 0.5).  The product carries both signs."""
    bits = _e2m1_values(codes).to(tl.int32, bitcast=True)
    power = (bits & ~0x00400000).to(tl.float32, bitcast=True)
    return power * tl.where((bits & 0x00400000) != 0, base_three_halves, base_one)


@triton.jit
def _round_to_odd_f32(exact):
    """float64 ``exact`` rounded to float32 *to odd*: truncated, the last bit set when anything was cut.

    float32 keeps more than two bits beyond bf16's and fp16's significands, so rounding this once more to
    either (nearest even) equals rounding ``exact`` to it directly (``formats.round_from_float64``).
    """
    nearest = exact.to(tl.float32)
    back = nearest.to(tl.float64)
    bits = nearest.to(tl.int32, bitcast=True)
    bits = tl.where(tl.abs(back) > tl.abs(exact), bits - 1, bits)  # toward zero: magnitude bits down one
    bits = tl.where(back != exact, bits | 1, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_to_output(exact, FLOAT_CODE: tl.constexpr):
    """float64 ``exact`` rounded once (nearest even) to the output float, returned as the float32 that holds
    it exactly.  bf16 by hand: Triton's interpreter truncates fp32 -> bf16 casts."""
    if FLOAT_CODE == 0:
        return exact.to(tl.float32)
    odd = _round_to_odd_f32(exact)
    if FLOAT_CODE == 1:
        bits = odd.to(tl.int32, bitcast=True)
        rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) << 16
        return tl.where(odd != odd, odd, rounded.to(tl.float32, bitcast=True))  # a carry could make NaN infinite
    else:
        return odd.to(tl.float16).to(tl.float32)


@triton.jit
def _pack_pair(lo, hi, FLOAT_CODE: tl.constexpr):
    """Output words of element pairs given as float32: exact for float32; bf16 takes the top half (the callers
    pass values bf16 holds exactly, or NaN); fp16 rounds once, nearest even (exact or single rounding)."""
    if FLOAT_CODE == 0:
        lo_bits = lo.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        return lo_bits | (hi.to(tl.int32, bitcast=True).to(tl.int64) << 32)
    elif FLOAT_CODE == 1:
        lo_bits = (lo.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
        return lo_bits | (hi.to(tl.int32, bitcast=True) & -65536)
    else:
        lo_bits = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return lo_bits | (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _code_words(packed, ORDER: tl.constexpr):
    """Packed bytes ``[ROWS, BLOCKS, PAIRS]`` (int32; PAIRS a multiple of 4, so a block's bytes are whole 32-bit
    words) as ``_element_codes`` reads their codes in order ``ORDER`` (``_decode.ordered_codes``): in the checkpoint
    order the bytes themselves (element 2j in byte j's low nibble, 2j + 1 in its high one); in the others, which
    move a word's codes anywhere inside the word, the words ``[ROWS, BLOCKS, PAIRS / 4, 1]`` (bytes 4w .. 4w + 3,
    little-endian)."""
    if ORDER == 0:
        return packed
    else:
        byte = tl.arange(0, 4)
        quads = tl.reshape(packed, [packed.shape[0], packed.shape[1], packed.shape[2] // 4, 4])
        return tl.expand_dims(tl.reduce_or(quads << (8 * byte), axis=3), 3)


@triton.jit
def _element_codes(words, ODD: tl.constexpr, ORDER: tl.constexpr):
    """The codes (int32 0..15) of elements 2j + ODD ``[ROWS, BLOCKS, PAIRS]``, from ``_code_words``' ``words``."""
    if ORDER == 0:
        if ODD:
            return words >> 4
        else:
            return words & 0xF
    else:
        codes = ordered_codes(words, 2 * tl.arange(0, 4) + ODD, ORDER)  # [ROWS, BLOCKS, PAIRS / 4, 4]
        return tl.reshape(codes, [words.shape[0], words.shape[1], 4 * words.shape[2]])


@triton.jit
def dequantize_kernel(
    data_ptr,
    scales_ptr,
    gs_ptr,
    out_ptr,
    rows,
    n_blocks,
    data_stride_l,
    data_stride_r,
    sf_stride_l,
    sf_row_tile,
    sf_r32,
    sf_r4,
    sf_col_tile,
    out_stride_l,
    out_stride_r,
    FLOAT_CODE: tl.constexpr,
    FORMAT: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCKS: tl.constexpr,
    ORDER: tl.constexpr,
):
    """Dequantize packed bytes ``[L, rows, K/2]`` (codes in order ``ORDER``, ``_decode.code_order_index``) with
    their ``FORMAT`` scale bytes into pair words ``out`` ``[L, rows, K/2]``: each value the exact
    ``e2m1 * scale (* global)`` rounded once to the output float."""
    pid_l, r, b, r3, col, mask = _tile(rows, n_blocks, FORMAT, ROWS, BLOCKS)
    packed = tl.load(data_ptr + pid_l * data_stride_l + r3 * data_stride_r + col, mask=mask, other=0).to(tl.int32)
    code_words = _code_words(packed, ORDER)
    sf_offset = (pid_l * sf_stride_l + scale_row_offset(r, sf_row_tile, sf_r32, sf_r4)[:, None]
                 + (b // 4 * sf_col_tile + b % 4)[None, :])
    raw = tl.load(scales_ptr + sf_offset, mask=(r[:, None] < rows) & (b[None, :] < n_blocks), other=0)
    scale = decode_scale(raw, FORMAT)[:, :, None]
    if HAS_GLOBAL:
        # scale * g is exact in float64 (4 + 24 significant bits); rounded once to the output float for the
        # magnitudes 1 and 1.5, it gives every other by an exact power of two, while all products stay in
        # the output's normal range (then rounding commutes with the power of two).  Otherwise, and for NaN
        # scales, the tile takes the exact product per element.
        scale_g = scale.to(tl.float64) * tl.load(gs_ptr).to(tl.float64)
        base_one = _round_to_output(scale_g, FLOAT_CODE)
        base_three_halves = _round_to_output(scale_g * 1.5, FLOAT_CODE)
        if FLOAT_CODE == 2:
            in_range = (base_one >= 0.000244140625) & (base_three_halves <= 8192.0)  # 2^-12, 2^13
        else:
            in_range = (base_one >= 4.70197740328915e-38) & (base_three_halves <= 4.253529586511731e37)  # 2^-124, 2^125
        fast = tl.min(tl.where((scale == 0.0) | in_range, 1, 0)) == 1
        if fast:
            lo = _scaled_e2m1(_element_codes(code_words, 0, ORDER), base_one, base_three_halves)
            hi = _scaled_e2m1(_element_codes(code_words, 1, ORDER), base_one, base_three_halves)
        else:
            lo = _round_to_output(_e2m1_values(_element_codes(code_words, 0, ORDER)).to(tl.float64) * scale_g,
                                  FLOAT_CODE)
            hi = _round_to_output(_e2m1_values(_element_codes(code_words, 1, ORDER)).to(tl.float64) * scale_g,
                                  FLOAT_CODE)
    else:
        # Exact in float32 (at most 6 significant bits; an e8m0 product that overflows float32 overflows
        # every output), and bf16 holds each exactly too (2^-128 as a subnormal).
        lo = _e2m1_values(_element_codes(code_words, 0, ORDER)) * scale
        hi = _e2m1_values(_element_codes(code_words, 1, ORDER)) * scale
    words = _pack_pair(lo, hi, FLOAT_CODE)
    tl.store(out_ptr + pid_l * out_stride_l + r3 * out_stride_r + col, words, mask=mask)
