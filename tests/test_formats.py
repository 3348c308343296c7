"""Codecs checked against tables written out here and against torch's own float8 dtypes."""

import math

import pytest
import torch

from fp4gemv import formats

# The e2m1 table, written out independently of formats.E2M1_VALUES: code = sign(1) exp(2) man(1).
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
ALL_CODES = torch.arange(16, dtype=torch.uint8)
ALL_BYTES = torch.arange(256, dtype=torch.uint8)


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal including the sign of zero and NaN positions."""
    x, y = x.float(), y.float()
    return bool(torch.equal(torch.isnan(x), torch.isnan(y))) and bool(
        torch.equal(torch.nan_to_num(x).view(torch.int32), torch.nan_to_num(y).view(torch.int32))
    )


# --- e2m1 -------------------------------------------------------------------------------------------------


def test_decode_e2m1_all_codes_match_table():
    decoded = formats.decode_e2m1(ALL_CODES)
    assert decoded.dtype == torch.float32
    assert _same_bits(decoded, torch.tensor(E2M1_TABLE))


def test_encode_e2m1_round_trips_all_codes():
    assert torch.equal(formats.encode_e2m1(torch.tensor(E2M1_TABLE)), ALL_CODES)


@pytest.mark.parametrize(
    "value, code",
    [
        # each tie goes to the neighbour with the even code
        (0.25, 0),  # 0 (code 0) vs 0.5 (code 1)
        (0.75, 2),  # 0.5 (1) vs 1.0 (2)
        (1.25, 2),  # 1.0 (2) vs 1.5 (3)
        (1.75, 4),  # 1.5 (3) vs 2.0 (4)
        (2.5, 4),  # 2.0 (4) vs 3.0 (5)
        (3.5, 6),  # 3.0 (5) vs 4.0 (6)
        (5.0, 6),  # 4.0 (6) vs 6.0 (7)
    ],
)
def test_encode_e2m1_ties_to_even(value, code):
    assert formats.encode_e2m1(torch.tensor([value])).item() == code
    assert formats.encode_e2m1(torch.tensor([-value])).item() == code | 8


@pytest.mark.parametrize("value, code", [(0.26, 1), (0.74, 1), (1.24, 2), (1.26, 3), (4.9, 6), (5.1, 7)])
def test_encode_e2m1_rounds_to_nearest_off_ties(value, code):
    assert formats.encode_e2m1(torch.tensor([value])).item() == code
    assert formats.encode_e2m1(torch.tensor([-value])).item() == code | 8


def test_encode_e2m1_saturates_at_six():
    codes = formats.encode_e2m1(torch.tensor([7.0, 100.0, math.inf, -7.0, -100.0, -math.inf]))
    assert codes.tolist() == [7, 7, 7, 15, 15, 15]


def test_encode_e2m1_keeps_sign_of_zero():
    codes = formats.encode_e2m1(torch.tensor([0.0, -0.0, -0.1, 0.1]))
    assert codes.tolist() == [0, 8, 8, 0]


def test_encode_e2m1_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        formats.encode_e2m1(torch.tensor([1.0, math.nan]))


def test_pack_e2m1_puts_even_element_in_low_nibble():
    packed = formats.pack_e2m1(torch.tensor([[1, 2, 15, 8, 0, 7]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0x8F, 0x70]]


def test_unpack_e2m1_known_bytes():
    codes = formats.unpack_e2m1(torch.tensor([0x21, 0x8F, 0x70], dtype=torch.uint8))
    assert codes.tolist() == [1, 2, 15, 8, 0, 7]


def test_pack_unpack_round_trip_all_byte_values():
    assert torch.equal(formats.pack_e2m1(formats.unpack_e2m1(ALL_BYTES)), ALL_BYTES)
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(formats.unpack_e2m1(formats.pack_e2m1(codes)), codes)


def test_pack_e2m1_rejects_odd_length():
    with pytest.raises(ValueError, match="codes: expected an even last dimension, got 3"):
        formats.pack_e2m1(torch.zeros(3, dtype=torch.uint8))


def test_unpack_accepts_uint8_and_fp4_storage():
    as_fp4 = ALL_BYTES.view(torch.float4_e2m1fn_x2)
    assert torch.equal(formats.unpack_e2m1(as_fp4), formats.unpack_e2m1(ALL_BYTES))
    assert formats.as_uint8(as_fp4).data_ptr() == ALL_BYTES.data_ptr()  # a view, not a copy


def test_as_uint8_rejects_wide_dtypes():
    with pytest.raises(TypeError, match="one-byte dtype"):
        formats.as_uint8(torch.zeros(2, dtype=torch.float16))


# --- e4m3fn -----------------------------------------------------------------------------------------------


def test_decode_e4m3_matches_torch_on_all_codes():
    ours = formats.decode_e4m3(ALL_BYTES)
    torchs = ALL_BYTES.view(torch.float8_e4m3fn).float()
    assert _same_bits(ours, torchs)
    assert torch.isnan(ours).nonzero().flatten().tolist() == [0x7F, 0xFF]


def test_decode_e4m3_known_values():
    raw = torch.tensor([0x38, 0x01, 0x08, 0x7E, 0xC0, 0x41], dtype=torch.uint8)
    # 1.0, smallest subnormal 2^-9, smallest normal 2^-6, max 448, -2.0, 2 * (1 + 1/8)
    assert formats.decode_e4m3(raw).tolist() == [1.0, 2.0**-9, 2.0**-6, 448.0, -2.0, 2.25]


def test_decode_e4m3_accepts_float8_storage():
    assert _same_bits(formats.decode_e4m3(ALL_BYTES.view(torch.float8_e4m3fn)), formats.decode_e4m3(ALL_BYTES))


def test_encode_e4m3_round_trips_finite_codes():
    finite = ALL_BYTES[(ALL_BYTES & 0x7F) != 0x7F]
    assert torch.equal(formats.encode_e4m3(formats.decode_e4m3(finite)), finite)


def test_encode_e4m3_saturates_at_448():
    raw = formats.encode_e4m3(torch.tensor([448.0, 449.0, 1e6, math.inf, -448.0, -1e6, -math.inf]))
    assert raw.tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0xFE]


# --- e8m0 -------------------------------------------------------------------------------------------------


def test_decode_e8m0_matches_torch_on_all_codes():
    ours = formats.decode_e8m0(ALL_BYTES)
    torchs = ALL_BYTES.view(torch.float8_e8m0fnu).float()
    assert _same_bits(ours, torchs)
    assert torch.isnan(ours).nonzero().flatten().tolist() == [0xFF]
    assert formats.decode_e8m0(torch.tensor([127, 130, 120], dtype=torch.uint8)).tolist() == [1.0, 8.0, 2.0**-7]


def test_encode_e8m0_round_trips_finite_codes():
    finite = ALL_BYTES[:255]
    assert torch.equal(formats.encode_e8m0(formats.decode_e8m0(finite)), finite)


def test_encode_e8m0_rejects_non_positive():
    with pytest.raises(ValueError, match="positive"):
        formats.encode_e8m0(torch.tensor([1.0, 0.0]))


# --- dequantize -------------------------------------------------------------------------------------------


def _codes_to_bytes(codes: list[int]) -> torch.Tensor:
    return torch.tensor([lo | (hi << 4) for lo, hi in zip(codes[0::2], codes[1::2], strict=True)], dtype=torch.uint8)


def test_dequantize_nvfp4_by_hand():
    codes = list(range(16)) + list(reversed(range(16)))  # two 16-element blocks
    scale_bytes = torch.tensor([[0x38, 0x41]], dtype=torch.uint8)  # 1.0 and 2 * 1.125 = 2.25
    data = _codes_to_bytes(codes).view(torch.float4_e2m1fn_x2).reshape(1, 16)
    expected = [E2M1_TABLE[c] * 1.0 * 0.5 for c in codes[:16]] + [E2M1_TABLE[c] * 2.25 * 0.5 for c in codes[16:]]
    out = formats.dequantize(data, scale_bytes.view(torch.float8_e4m3fn), formats.NVFP4, global_scale=0.5)
    assert out.dtype == torch.float64
    assert out.shape == (1, 32)
    assert out.flatten().tolist() == expected


def test_dequantize_mxfp4_by_hand():
    codes = [(3 * i) % 16 for i in range(64)]  # two 32-element blocks
    scale_bytes = torch.tensor([0x81, 0x7C], dtype=torch.uint8)  # 2^2 and 2^-3
    out = formats.dequantize(_codes_to_bytes(codes), scale_bytes, formats.MXFP4, global_scale=torch.tensor(3.0))
    expected = [E2M1_TABLE[c] * 4.0 * 3.0 for c in codes[:32]] + [E2M1_TABLE[c] * 0.125 * 3.0 for c in codes[32:]]
    assert out.tolist() == expected


def test_dequantize_batched_matches_rows():
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (2, 3, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0x30, 0x48, (2, 3, 2), dtype=torch.uint8, generator=gen)
    whole = formats.dequantize(data, scales, dtype=torch.float32)
    assert whole.dtype == torch.float32
    assert torch.equal(whole[1, 2], formats.dequantize(data[1, 2], scales[1, 2], dtype=torch.float32))


def test_dequantize_names_wrong_scale_count():
    data = torch.zeros(2, 16, dtype=torch.uint8)  # K = 32
    with pytest.raises(ValueError, match=r"scales: expected K/16 = 2 scales per row, got 3"):
        formats.dequantize(data, torch.zeros(2, 3, dtype=torch.uint8), formats.NVFP4)
    with pytest.raises(ValueError, match=r"scales: expected K/32 = 1 scales per row, got 2"):
        formats.dequantize(data, torch.zeros(2, 2, dtype=torch.uint8), formats.MXFP4)
