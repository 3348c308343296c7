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
    "resolve_format",
    "as_uint8",
    "decode_e2m1",
    "encode_e2m1",
    "pack_e2m1",
    "unpack_e2m1",
    "CODE_ORDERS",
    "NATIVE_CODE_FIELDS",
    "PAIRED_SLOTS",
    "reorder_codes",
    "decode_e4m3",
    "encode_e4m3",
    "decode_e8m0",
    "encode_e8m0",
    "decode_scales",
    "dequantize",
    "NAN_SCALE_BYTE",
    "nvfp4_block_scales",
    "mx_shared_exponents",
    "quantize",
    "round_from_float64",
    "F32_SMALLEST_NORMAL",
    "check_global_scales",
    "dtype_name",
    "dtype_names",
]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how errors and descriptions name a dtype."""
    return str(dtype).replace("torch.", "")


def dtype_names(dtypes) -> str:
    """``"float16, bfloat16"``: a list of accepted dtypes, in errors."""
    return ", ".join(dtype_name(d) for d in dtypes)

# e2m1 codes 0..7 (bit 3 is the sign): 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1_MAX = 6.0
_E4M3_MAX = 448.0
# (midpoint between neighbouring e2m1 magnitudes, whether the code above it is even), in increasing order.
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


@dataclass(frozen=True)
class FP4Format:
    """A block-scaled FP4 format: e2m1 elements, one scale per ``block_size`` consecutive K-elements."""

    name: str
    block_size: int
    scale_dtype: torch.dtype


NVFP4 = FP4Format("nvfp4", 16, torch.float8_e4m3fn)
MXFP4 = FP4Format("mxfp4", 32, torch.float8_e8m0fnu)
FORMATS: dict[str, FP4Format] = {f.name: f for f in (NVFP4, MXFP4)}

def resolve_format(fmt: str | FP4Format) -> FP4Format:
    """The format named ``fmt`` (``"nvfp4"`` or ``"mxfp4"``), or ``fmt`` itself; errors name ``fmt``."""
    if isinstance(fmt, FP4Format):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"fmt: expected 'nvfp4', 'mxfp4' or an FP4Format, got {type(fmt).__name__}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected 'nvfp4' or 'mxfp4', got {fmt!r}")
    return FORMATS[fmt]


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

    Compared in ``x``'s own dtype (every midpoint is exact in each float dtype).  The sign bit follows the
    input's sign bit, so -0.0 and small negatives that round to zero give code 8.  NaN has no e2m1 encoding
    and raises.
    """
    if torch.isnan(x).any():
        raise ValueError("x: NaN has no e2m1 encoding")
    mag = x.abs()
    # Midpoints between neighbouring magnitudes 0,.5,1,1.5,2,3,4,6: a tie rounds up only to an even code,
    # so crossing a midpoint below an even code needs >=, below an odd code >.
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, next_code_even in _E2M1_MIDPOINTS:
        code += (mag >= midpoint) if next_code_even else (mag > midpoint)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


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


# The orders of the e2m1 codes in packed bytes.  "checkpoint": element 2i in the low nibble of byte i, as files and
# the GPU MODE task store them.  "native": the same bytes with the bits of each 16-bit half-word (4 codes, the
# low byte first) permuted so that the tensor-core kernels' bf16 decode takes 10 instructions a 32-bit word where
# the checkpoint's takes 13 (``kernels._mma_step.decode_native_bf16``; docs/performance.md, round 18): code j of
# a half-word keeps its magnitude (3 bits) and sign at the bits ``NATIVE_CODE_FIELDS[j]``.  Codes stay in their
# half-word, so K order, blocks and scales are the checkpoint's.  "paired": the native bit fields with each 32-bit
# word's 8 codes (K elements 8w .. 8w + 7) placed so that its low half-word holds the even elements and its high
# half-word the odd ones (``PAIRED_SLOTS``): the decode's pair i (code i of each half, one bf16x2 register) is
# then K elements 2i and 2i + 1, the pairing of the activation's registers as loaded (the mma.sync step needs no
# ``PRMT`` to pair them: docs/performance.md, round 28, item 8).  Words stay in place: blocks and scales are the
# checkpoint's; K / 2 a multiple of 4.
CODE_ORDERS = ("checkpoint", "native", "paired")
PAIRED_SLOTS = (0, 2, 4, 6, 1, 3, 5, 7)  # slot s of a "paired" word holds the word's K element PAIRED_SLOTS[s]
NATIVE_CODE_FIELDS = ((6, 15), (3, 12), (0, 14), (9, 13))  # code j: (lowest magnitude bit, sign bit)


def _half_word_table(to_native: bool) -> torch.Tensor:
    """The 65536 half-words mapped from the checkpoint order to the native one (or back), int64 (index: the
    half-word as an unsigned number, its low byte the first)."""
    u = torch.arange(1 << 16, dtype=torch.int64)
    checkpoint, native = u, torch.zeros_like(u)
    for j, (mag, sign) in enumerate(NATIVE_CODE_FIELDS):
        native |= ((u >> (4 * j)) & 7) << mag | ((u >> (4 * j + 3)) & 1) << sign
    table = torch.empty_like(u)
    if to_native:
        table[checkpoint] = native
    else:
        table[native] = checkpoint
    return table


_HALF_WORD_TABLES: dict[bool, torch.Tensor] = {}


def reorder_codes(data: torch.Tensor, source: str, target: str) -> torch.Tensor:
    """Packed e2m1 bytes ``[..., K/2]`` (K/2 even) in code order ``source`` as a new contiguous uint8 tensor in
    ``target`` (``CODE_ORDERS``), on data's device; ``data`` itself (as uint8) when the orders agree.  One table
    lookup per 16-bit half-word (the bytes viewed as little-endian int16, as x86, Arm and NVIDIA GPUs store them),
    in slices of 16 M half-words so that the int32 indices stay small beside the result (about 0.4 GB/s on one
    CPU core); to or from the paired order also a permutation of each 32-bit word's codes (K/2 a multiple of 4)."""
    for name, order in (("source", source), ("target", target)):
        if order not in CODE_ORDERS:
            raise ValueError(f"{name}: expected one of {CODE_ORDERS}, got {order!r}")
    d = as_uint8(data)
    if source == target:
        return d
    if d.dim() < 1 or d.shape[-1] % 2:
        raise ValueError(f"data: expected [..., K/2] bytes with K/2 even (whole 16-bit half-words), got shape "
                         f"{tuple(d.shape)}")
    if "paired" in (source, target):
        if d.shape[-1] % 4:
            raise ValueError(f"data: expected [..., K/2] bytes with K/2 a multiple of 4 (whole 32-bit words) for the "
                             f"paired order, got shape {tuple(d.shape)}")
        if source == "paired":  # its half-words back to the checkpoint fields, then the slots back to K order
            checkpoint = _permute_word_slots(reorder_codes(d, "native", "checkpoint"), PAIRED_SLOTS, inverse=True)
            return reorder_codes(checkpoint, "checkpoint", target)
        moved = _permute_word_slots(reorder_codes(d, source, "checkpoint"), PAIRED_SLOTS)
        return reorder_codes(moved, "checkpoint", "native")
    to_native = target == "native"
    if to_native not in _HALF_WORD_TABLES:
        _HALF_WORD_TABLES[to_native] = _half_word_table(to_native).to(torch.int16)  # wraps to the same 16 bits
    table = _HALF_WORD_TABLES[to_native].to(d.device)
    d = d.contiguous() if d.storage_offset() % 2 == 0 else d.clone()  # whole half-words in memory
    halves = d.view(torch.int16).reshape(-1)
    out = torch.empty_like(halves)
    step = 1 << 24
    for r in range(0, halves.numel(), step):
        torch.index_select(table, 0, halves[r:r + step].to(torch.int32) & 0xFFFF, out=out[r:r + step])
    return out.view(torch.uint8).view(d.shape)


def _permute_word_slots(d: torch.Tensor, slots: tuple[int, ...], inverse: bool = False) -> torch.Tensor:
    """Checkpoint-field bytes ``[..., K/2]`` with each 32-bit word's code slot s given K element ``slots[s]`` (or,
    ``inverse``, back)."""
    codes = unpack_e2m1(d)
    words = codes.reshape(*codes.shape[:-1], -1, 8)
    index = torch.tensor(slots, device=d.device)
    if inverse:
        index = torch.argsort(index)
    return pack_e2m1(words.index_select(-1, index).reshape(codes.shape))


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

    The exact value ``e2m1 * scale (* global_scale)`` is formed in float64 (at most 2 + 4 + 24 significant
    bits, and float64's range holds every e8m0 scale), then rounded once to ``dtype``, nearest even
    (:func:`round_from_float64`): float64 is the exact value itself.  A NaN scale byte (e4m3 0x7F /
    0xFF, e8m0 0xFF) gives NaN for its whole block.
    """
    values = decode_e2m1(unpack_e2m1(data)).to(torch.float64)
    k = values.shape[-1]
    if scales.shape[-1] * fmt.block_size != k:
        raise ValueError(
            f"scales: expected K/{fmt.block_size} = {k // fmt.block_size} scales per row, got {scales.shape[-1]}"
        )
    s = decode_scales(scales, fmt).to(torch.float64).repeat_interleave(fmt.block_size, dim=-1)
    out = values * s
    if global_scale is not None:
        out = out * torch.as_tensor(global_scale, dtype=torch.float64, device=out.device)
    return round_from_float64(out, dtype)


def round_from_float64(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float64 ``x`` to ``dtype`` once (nearest, ties to even).

    torch converts float64 to float16 and bfloat16 through float32, rounding twice: 1 + 2^-11 + 2^-40 first
    becomes the fp16 tie 1 + 2^-11, then 1.0, where one rounding gives 1 + 2^-10.  Rounding to float32
    *to odd* instead (truncate, then set the last bit if anything was cut off) keeps what the second
    rounding needs: float32 has more than two bits beyond either 16-bit format's significand.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        return x.to(dtype)
    f32 = x.to(torch.float32)
    inexact = (f32.to(torch.float64) != x) & torch.isfinite(x)
    rounded_away = f32.to(torch.float64).abs() > x.abs()
    truncated = torch.where(rounded_away, torch.nextafter(f32, torch.zeros_like(f32)), f32)
    to_odd = (truncated.view(torch.int32) | 1).view(torch.float32)
    return torch.where(inexact, to_odd, f32).to(dtype)


F32_SMALLEST_NORMAL = 2.0**-126


def check_global_scales(values: torch.Tensor, name: str = "global_scale") -> None:
    """ValueError naming ``name`` unless every value of the float32 tensor ``values`` is a usable global scale:
    a positive normal float32 (0 zeroes every product, NaN and infinity poison them, a negative one flips their
    sign, a subnormal one may be flushed to zero by the kernels' fp32 arithmetic).  Reads the values: on CUDA a
    device synchronisation, so callers check a tensor only when asked (``check_values``)."""
    if values.device.type == "meta":
        raise ValueError(f"{name}: expected values to check, got a meta tensor (it has none): pass "
                         f"check_values=False")
    bad = ~((values >= F32_SMALLEST_NORMAL) & (values < float("inf")))  # NaN compares False
    if bool(bad.any()):
        where = tuple(bad.nonzero()[0].tolist())
        at = f" at {where}" if where else ""
        raise ValueError(f"{name}: expected a positive normal float32 (2^-126 or more, finite), got "
                         f"{values[where].item()}{at}")


# Scale bytes of a block that holds a NaN or an infinity: each scale format's NaN.
NAN_SCALE_BYTE = {"nvfp4": 0x7F, "mxfp4": 0xFF}
_E4M3_MIN = 2.0**-9  # e4m3's smallest subnormal: ModelOpt's lower clamp, so no block scale is 0
_E2M1_EMAX = 2  # 6 = 1.5 * 2^2


def nvfp4_block_scales(amax: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """NVFP4 scale bytes from float32 block maxima, as NVIDIA ModelOpt computes them.

    ``NVFP4QTensor.get_weights_scaling_factor`` (modelopt/torch/quantization/qtensor/nvfp4_tensor.py):
    ``s = amax / (6 * g)`` in float32 (``6 * g`` rounded, then the quotient), ``s = 1`` where it is 0 (an
    all-zero block), clamped below at 2^-9, cast to e4m3 (nearest even).  Here also clamped above at 448,
    so a block scale saturates where ``g`` is too small instead of becoming NaN; ``g = 1`` when None.
    """
    # A tensor divisor: PyTorch's CUDA division by a Python number multiplies by its rounded reciprocal.
    six_g = torch.full((), 6.0, device=amax.device) if global_scale is None else 6.0 * global_scale
    s = amax / six_g
    s = torch.where(s == 0, torch.ones_like(s), s).clamp(_E4M3_MIN, _E4M3_MAX)
    return s.to(torch.float8_e4m3fn).view(torch.uint8)


def mx_shared_exponents(amax: torch.Tensor) -> torch.Tensor:
    """OCP MX shared exponents (int32) from float32 block maxima: ``floor(log2(amax)) - 2``, clamped to -127..127.

    OCP Microscaling Formats v1.0, section 6.3: the scale is the largest power of two not above ``amax``
    divided by the largest power of two of the element format (e2m1's emax is 2), so ``amax / 2^X`` lies in
    [4, 8) and elements above 6 saturate.  Zero (and every amax below 2^-125) gives -127, e8m0's smallest.
    """
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1): floor(log2(amax)) = exponent - 1
    return torch.where(amax > 0, exponent - 1 - _E2M1_EMAX, -127).clamp(-127, 127).to(torch.int32)


def quantize(
    x: torch.Tensor, fmt: FP4Format = NVFP4, global_scale: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize floats ``[..., K]`` to packed e2m1 ``[..., K/2]`` and linear scale bytes ``[..., K/bs]``.

    The reference of ``fp4gemv.quantize``, whose Triton kernel computes the same bytes.  Every step is a
    float32 IEEE operation rounded to nearest even (``x`` is rounded to float32 first: exact for fp16 and
    bf16), with ``amax`` a block's largest magnitude and ``g`` the global scale:

    * NVFP4, per NVIDIA ModelOpt (``NVFP4QTensor.quantize``): scale byte ``e4m3(amax / (6 g))`` as
      :func:`nvfp4_block_scales` details; elements ``q = x / (scale * g)`` (the product rounded, then the
      quotient).  ``g = None`` computes as ``g = 1``.
    * MXFP4, per the OCP Microscaling spec (:func:`mx_shared_exponents`): ``v = x / g`` (``v = x`` without
      a global scale, which MX itself does not have), shared exponent ``X`` of the block's ``amax(|v|)``,
      scale byte ``X + 127``, elements ``q = v * 2^-X`` (exact unless it underflows).

    Then each code is the nearest e2m1 value of ``q``, ties to the even code, saturating at ±6
    (:func:`encode_e2m1`); a zero quotient, -0.0 included, gets code 0 and negatives that round to zero
    code 8, both as in ModelOpt.  A block holding a NaN or an infinity (of ``v`` for MXFP4) gets the NaN
    scale byte (:data:`NAN_SCALE_BYTE`) and codes 0, so it dequantizes to NaN; ``fp4gemv.quantize`` raises
    on it by default.

    global_scale: None or a positive normal float32 (a Python number is rounded to float32).
    """
    k = x.shape[-1]
    if k % fmt.block_size:
        raise ValueError(f"x: expected K a multiple of the {fmt.name} block size {fmt.block_size}, got K = {k}")
    g = None if global_scale is None else torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], k // fmt.block_size, fmt.block_size)
    if fmt.name == "nvfp4":
        amax = blocks.abs().amax(dim=-1)
        scale_bytes = nvfp4_block_scales(amax, g)
        scale = scale_bytes.view(torch.float8_e4m3fn).to(torch.float32)  # exact; as decode_e4m3, but faster
        divisor = scale if g is None else scale * g
        q = blocks / divisor.unsqueeze(-1)
    else:
        if g is not None:
            blocks = blocks / g
        amax = blocks.abs().amax(dim=-1)
        exponent = mx_shared_exponents(amax)
        scale_bytes = (exponent + 127).to(torch.uint8)
        # 2^-X from its float32 exponent field: -X is in -125..127 for every float32 amax, a normal number.
        inverse_scale = ((127 - exponent).clamp(1, 254) << 23).view(torch.float32)
        q = blocks * inverse_scale.unsqueeze(-1)
    finite = torch.isfinite(amax)
    scale_bytes = torch.where(finite, scale_bytes, NAN_SCALE_BYTE[fmt.name])
    # + 0.0 turns -0.0 into +0.0 (and changes nothing else): a zero gets code 0 whatever its sign, as
    # ModelOpt's sign bit is ``q < 0``; negatives that round to zero keep theirs (code 8).
    q = torch.where(finite.unsqueeze(-1), q + 0.0, 0.0)
    return pack_e2m1(encode_e2m1(q.reshape(x.shape))), scale_bytes
