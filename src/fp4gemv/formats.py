"""FP4 element and scale codecs, and the NVFP4 / MXFP4 format descriptions.

Everything that turns bits into numbers (or numbers into bits) lives here, so there is exactly one
definition of e2m1, e4m3fn and e8m0 in the package.  Kernels re-derive the same mappings with bit
tricks; tests check them against these functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "E2M1_VALUES",
    "FP4Format",
    "NVFP4",
    "MXFP4",
    "FORMATS",
    "as_uint8",
    "decode_e2m1",
    "encode_e2m1",
    "pack_e2m1",
    "unpack_e2m1",
    "decode_e4m3",
    "encode_e4m3",
    "decode_e8m0",
    "encode_e8m0",
    "decode_scales",
    "dequantize",
    "quantize",
]

# e2m1 codes 0..7 (bit 3 is the sign): 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1_MAX = 6.0
_E4M3_MAX = 448.0


@dataclass(frozen=True)
class FP4Format:
    """A block-scaled FP4 format: e2m1 elements, one scale per ``block_size`` consecutive K-elements."""

    name: str
    block_size: int
    scale_dtype: torch.dtype


NVFP4 = FP4Format("nvfp4", 16, torch.float8_e4m3fn)
MXFP4 = FP4Format("mxfp4", 32, torch.float8_e8m0fnu)
FORMATS: dict[str, FP4Format] = {f.name: f for f in (NVFP4, MXFP4)}

_BYTE_VIEWABLE = (torch.uint8, torch.int8, torch.float4_e2m1fn_x2, torch.float8_e4m3fn, torch.float8_e8m0fnu)


def as_uint8(t: torch.Tensor) -> torch.Tensor:
    """View a one-byte tensor (packed fp4, fp8, int8) as uint8 without copying."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype not in _BYTE_VIEWABLE:
        raise TypeError(f"expected a one-byte dtype (uint8, float4_e2m1fn_x2, float8), got {t.dtype}")
    return t.view(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Map e2m1 codes (integers 0..15) to float32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float values to e2m1 codes (uint8 0..15): nearest, ties to even code, saturating at ±6.

    The sign bit follows the input's sign bit, so -0.0 and small negatives that round to zero give code 8.
    NaN has no e2m1 encoding and raises.
    """
    if torch.isnan(x).any():
        raise ValueError("x: NaN has no e2m1 encoding")
    mag = x.abs().to(torch.float32)
    # Midpoints between neighbouring magnitudes 0,.5,1,1.5,2,3,4,6; a tie rounds up only to an even code.
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=x.device)
    next_code_even = torch.tensor([False, True, False, True, False, True, False], device=x.device)
    above = (mag.unsqueeze(-1) > mids) | ((mag.unsqueeze(-1) == mids) & next_code_even)
    code = above.sum(-1).to(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8) << 3
    return code | sign


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack e2m1 codes ``[..., K]`` into bytes ``[..., K/2]``: element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: expected an even last dimension, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes ``[..., K/2]`` (uint8 or float4_e2m1fn_x2) into e2m1 codes ``[..., K]``."""
    p = as_uint8(packed)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def decode_e4m3(raw: torch.Tensor) -> torch.Tensor:
    """Decode e4m3fn bytes to float32 from the bit fields (bias 7, no infinities, 0x7F/0xFF are NaN)."""
    b = as_uint8(raw).to(torch.int32)
    exp, man = (b >> 3) & 0xF, (b & 7).to(torch.float32)
    normal = (1.0 + man / 8.0) * torch.exp2((exp - 7).to(torch.float32))
    subnormal = (man / 8.0) * 2.0**-6
    mag = torch.where(exp == 0, subnormal, normal)
    mag = torch.where((b & 0x7F) == 0x7F, torch.full_like(mag, float("nan")), mag)
    return torch.where((b & 0x80) != 0, -mag, mag)


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to e4m3fn bytes (nearest even), saturating at ±448 rather than producing NaN."""
    return x.to(torch.float32).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def decode_e8m0(raw: torch.Tensor) -> torch.Tensor:
    """Decode e8m0 bytes (pure powers of two, bias 127, 0xFF is NaN) to float32."""
    b = as_uint8(raw).to(torch.int32)
    val = torch.exp2((b - 127).to(torch.float32))
    return torch.where(b == 0xFF, torch.full_like(val, float("nan")), val)


def encode_e8m0(x: torch.Tensor) -> torch.Tensor:
    """Round positive values to e8m0 bytes: the nearest power of two, 2^-127 .. 2^127."""
    if (x <= 0).any() or torch.isnan(x).any():
        raise ValueError("x: e8m0 encodes positive finite values only")
    e = torch.round(torch.log2(x.to(torch.float64))).clamp(-127, 127)
    return (e + 127).to(torch.uint8)


def decode_scales(raw: torch.Tensor, fmt: FP4Format) -> torch.Tensor:
    """Decode a format's block scales (raw bytes or their float8 dtype) to float32."""
    return decode_e4m3(raw) if fmt.scale_dtype == torch.float8_e4m3fn else decode_e8m0(raw)


def dequantize(
    data: torch.Tensor,
    scales: torch.Tensor,
    fmt: FP4Format = NVFP4,
    global_scale: float | torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Dequantize packed e2m1 ``[..., K/2]`` with linear-layout scales ``[..., K/block_size]`` to ``[..., K]``.

    In float64 every value is exact: an e2m1 value times an e4m3 or e8m0 scale (times an fp32 global scale)
    needs at most 4 + 24 significant bits.
    """
    values = decode_e2m1(unpack_e2m1(data)).to(dtype)
    k = values.shape[-1]
    if scales.shape[-1] * fmt.block_size != k:
        raise ValueError(
            f"scales: expected K/{fmt.block_size} = {k // fmt.block_size} scales per row, got {scales.shape[-1]}"
        )
    s = decode_scales(scales, fmt).to(dtype).repeat_interleave(fmt.block_size, dim=-1)
    out = values * s
    if global_scale is not None:
        out = out * torch.as_tensor(global_scale, dtype=dtype, device=out.device)
    return out


def _mx_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power-of-two exponent e with ``amax <= 6 * 2^e``, clamped to e8m0's -127 .. 127.

    From ``amax = m * 2^p`` (m in [0.5, 1)): ``6 * 2^(p-3) = 0.75 * 2^p`` covers m <= 0.75, and
    ``6 * 2^(p-2)`` covers the rest; ``6 * 2^(p-4)`` is below every such amax.  Integer arithmetic on the
    exponent, so no log2 rounding can pick a power too small.
    """
    mantissa, exponent = torch.frexp(amax)
    e = torch.where(mantissa <= 0.75, exponent - 3, exponent - 2)
    return e.clamp(-127, 127)


def quantize(
    x: torch.Tensor, fmt: FP4Format = NVFP4, global_scale: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize finite floats ``[..., K]`` to packed e2m1 ``[..., K/2]`` and linear scale bytes ``[..., K/bs]``.

    Each block of ``fmt.block_size`` elements of ``x / global_scale`` gets a scale from its largest
    magnitude ``amax``, then every element is rounded to the nearest e2m1 value of ``x / (global * scale)``
    (ties to even, saturating at ±6; :func:`encode_e2m1`):

    * NVFP4: ``scale = e4m3(amax / 6)``, round to nearest, saturating at 448 (the usual NVFP4 recipe; pick
      ``global_scale = amax(x) / (6 * 448)`` so that no block saturates).  A rounded-down scale can push an
      element past 6, where it saturates: with a normal e4m3 scale (relative rounding error <= 2^-4) by at
      most ``6 / (1 - 2^-4) - 6 = 0.4`` scale units, less than half the gap between 4 and 6.  Subnormal
      scales (``amax < 6 * 2^-6``) are coarser.
    * MXFP4: ``scale = 2^ceil(log2(amax / 6))``, the smallest power of two that keeps every element within
      ±6, so no element saturates.  (The OCP MX recipe rounds the exponent down instead and clips.)

    An all-zero block (or one whose scale underflows e4m3) gets scale 0 and codes 0.  Values already of the
    form ``code * scale * global_scale`` with a ±6 in each block quantize back exactly.  Computed in float64.
    """
    if not torch.isfinite(x).all():
        raise ValueError("x: expected finite values (NaN and infinity have no FP4 encoding)")
    k = x.shape[-1]
    if k % fmt.block_size:
        raise ValueError(f"x: expected K a multiple of the {fmt.name} block size {fmt.block_size}, got K = {k}")
    values = x.to(torch.float64)
    if global_scale is not None:
        values = values / torch.as_tensor(global_scale, dtype=torch.float64, device=x.device)
    blocks = values.reshape(*values.shape[:-1], k // fmt.block_size, fmt.block_size)
    amax = blocks.abs().amax(dim=-1)
    if fmt.scale_dtype == torch.float8_e4m3fn:
        scale_bytes = encode_e4m3(amax / 6)
    else:
        scale_bytes = (_mx_scale_exponent(amax) + 127).to(torch.uint8)
    scale = decode_scales(scale_bytes, fmt).to(torch.float64).unsqueeze(-1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = torch.where(scale > 0, blocks / safe, torch.zeros_like(blocks))
    return pack_e2m1(encode_e2m1(scaled.reshape(values.shape))), scale_bytes
