"""Pieces every GEMV kernel shares: how scales are addressed, and the bf16 output rounding."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import layouts

__all__ = ["ScaleAddressing", "linear_scale_addressing", "swizzled_scale_addressing", "scale_row_offset",
           "decode_scale", "to_bfloat16_rne", "GemvOperands", "apply_global_scales", "store_rounded"]

# e8m0 byte 0 is 2^-127, an fp32 subnormal (bits 0x00400000); byte 255 is NaN.
_E8M0_ZERO_BYTE_BITS = tl.constexpr(0x00400000)
_F32_QUIET_NAN_BITS = tl.constexpr(0x7FC00000)


class ScaleAddressing(NamedTuple):
    """Byte strides placing scale ``(l, row, col)`` at ``l * batch + (row // 128) * row_tile``
    ``+ (row % 32) * r32 + ((row % 128) // 32) * r4 + (col // 4) * col_tile + col % 4``."""

    batch: int
    row_tile: int
    r32: int
    r4: int
    col_tile: int


def linear_scale_addressing(stride_batch: int, stride_row: int) -> ScaleAddressing:
    """Linear ``[L, rows, cols]`` scales, column stride 1: the formula reduces to ``l * stride_batch``
    ``+ row * stride_row + col``."""
    return ScaleAddressing(stride_batch, 128 * stride_row, stride_row, 32 * stride_row, 4)


def swizzled_scale_addressing(stride_batch: int, cols: int) -> ScaleAddressing:
    """The 128x4 swizzle of ``cols`` scale columns (``layouts.swizzled_offset``): 512-byte atoms of 32 lines x 16."""
    _, cols_p = layouts.padded_scale_shape(1, cols)
    return ScaleAddressing(stride_batch, layouts.ROWS_PER_ATOM * cols_p, 16, 4, 512)


@triton.jit
def scale_row_offset(rows, stride_row_tile, stride_r32, stride_r4):
    """Byte offset of each row's scales under :class:`ScaleAddressing` (the row part of its formula)."""
    return (rows // 128) * stride_row_tile + (rows % 32) * stride_r32 + ((rows % 128) // 32) * stride_r4


@triton.jit
def decode_scale(raw, SCALE_BLOCK: tl.constexpr):
    """Scale bytes to float32: e4m3 for 16-element blocks (NVFP4), e8m0 (2^(byte - 127), 255 = NaN) for 32
    (MXFP4)."""
    if SCALE_BLOCK == 16:
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        e = raw.to(tl.int32)
        bits = tl.where(e == 0, _E8M0_ZERO_BYTE_BITS, tl.where(e == 255, _F32_QUIET_NAN_BITS, e << 23))
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_bfloat16_rne(x):
    """fp32 to bf16, nearest even, by hand: what ``cvt.rn.bf16.f32`` does on the GPU.

    Triton's interpreter truncates fp32 -> bf16 casts (and its RTNE mode does not carry into the exponent),
    so the plain cast would make the CPU tests check a different rounding than the GPU runs.
    """
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)  # keep NaN a NaN (a carry could turn it into infinity)
    return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)


class GemvOperands(NamedTuple):
    """The tensors of one ``fp4gemv.gemv`` launch, prepared by ``gemv`` (each launcher documents the views it
    expects): weights ``a`` and their scale bytes, activation ``b`` (FP4 with scale bytes, or float with
    ``sfb = sfb_addressing = None``), output ``c`` ``[L, M, N]``, optional one-element fp32 global scales."""

    a: torch.Tensor
    sfa: torch.Tensor
    sfa_addressing: ScaleAddressing
    b: torch.Tensor
    sfb: torch.Tensor | None
    sfb_addressing: ScaleAddressing | None
    c: torch.Tensor
    global_scale_a: torch.Tensor | None = None
    global_scale_b: torch.Tensor | None = None

    def optional_pointer_args(self) -> tuple:
        """(sfb, sfb addressing, global scale a, global scale b) as kernel arguments: a tensor that is never
        read (a's scales) where one is absent."""
        sfb, sfb_addressing = self.sfb, self.sfb_addressing
        if sfb is None:
            sfb, sfb_addressing = self.sfa, ScaleAddressing(0, 0, 0, 0, 0)
        return (sfb, sfb_addressing, self.sfa if self.global_scale_a is None else self.global_scale_a,
                self.sfa if self.global_scale_b is None else self.global_scale_b)


@triton.jit
def apply_global_scales(out, gsa_ptr, gsb_ptr, HAS_GSA: tl.constexpr, HAS_GSB: tl.constexpr):
    """``out`` times the product of the global scales present (one fp32 rounding of the product)."""
    if HAS_GSA and HAS_GSB:
        out = out * (tl.load(gsa_ptr) * tl.load(gsb_ptr))
    elif HAS_GSA:
        out = out * tl.load(gsa_ptr)
    elif HAS_GSB:
        out = out * tl.load(gsb_ptr)
    return out


@triton.jit
def store_rounded(c_ptrs, out, mask):
    """Round the fp32 results once to c's dtype (bf16 nearest even, as on the GPU) and store them."""
    if c_ptrs.dtype.element_ty == tl.bfloat16:
        out = to_bfloat16_rne(out)
    tl.store(c_ptrs, out.to(c_ptrs.dtype.element_ty), mask=mask)
