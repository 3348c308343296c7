"""Pieces every GEMV kernel shares: the row part of the scale addressing, scale decode, global scales, the
rounded store, and a configuration helper."""

from __future__ import annotations

import triton
import triton.language as tl

from ..target import KERNELS_INTERPRETED

__all__ = ["scale_row_offset", "scale_col_offset", "load_k", "decode_scale", "to_bfloat16_rne", "apply_global_scales",
           "store_rounded", "pow2_at_most"]

# e8m0 byte 0 is 2^-127, an fp32 subnormal (bits 0x00400000); byte 255 is NaN.
_E8M0_ZERO_BYTE_BITS = tl.constexpr(0x00400000)
_F32_QUIET_NAN_BITS = tl.constexpr(0x7FC00000)
# The GPU converts e4m3 with cvt.rn.f16x2.e4m3x2 (sm_89 and newer), which keeps 0x7F / 0xFF NaN; Triton's
# interpreter (3.6 to 3.9) decodes them as +-480.  Only the interpreted kernels pay for the select.
_E4M3_NAN_BY_HAND = tl.constexpr(KERNELS_INTERPRETED)


@triton.jit
def scale_row_offset(rows, stride_row_tile, stride_r32, stride_r4):
    """Byte offset of each row's scales under ``spec.ScaleAddressing`` (the row part of its formula)."""
    return (rows // 128) * stride_row_tile + (rows % 32) * stride_r32 + ((rows % 128) // 32) * stride_r4


@triton.jit
def scale_col_offset(j, stride_col_tile, FORMAT: tl.constexpr):
    """Byte offset of the scales of 16-element blocks ``j`` under ``spec.ScaleAddressing`` (the column part of its
    formula, ``stride_col_tile`` its col_tile); an MXFP4 scale covers two blocks."""
    if FORMAT == "nvfp4":
        # Scale columns come in runs of 4 contiguous bytes in every supported layout.
        return tl.max_contiguous(tl.multiple_of((j // 4) * stride_col_tile + j % 4, 2), 2)
    else:
        col = j // 2
        return (col // 4) * stride_col_tile + col % 4


@triton.jit
def load_k(ptrs, k_ok, EVEN_K: tl.constexpr):
    """Load, masking K-blocks past the end (zeros) only when the last step is partial."""
    if EVEN_K:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=k_ok, other=0)


@triton.jit
def decode_scale(raw, FORMAT: tl.constexpr):
    """Scale bytes to float32: e4m3 for ``FORMAT`` "nvfp4" (0x7F, 0xFF = NaN), e8m0 (2^(byte - 127), 255 = NaN)
    for "mxfp4"; as ``formats.decode_e4m3`` / ``decode_e8m0``."""
    if FORMAT == "nvfp4":
        scale = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if _E4M3_NAN_BY_HAND:
            nan = tl.full(scale.shape, _F32_QUIET_NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
            scale = tl.where((raw & 0x7F) == 0x7F, nan, scale)
        return scale
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


def pow2_at_most(x: int) -> int:
    """The largest power of two <= x (1 for x <= 1)."""
    return 1 << (max(x, 1).bit_length() - 1)
