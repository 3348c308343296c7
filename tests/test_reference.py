"""The float64 oracle against exact rational arithmetic written out here."""

from fractions import Fraction

import pytest
import torch

from fp4gemv import formats
from fp4gemv.formats import round_from_float64
from fp4gemv.reference import gemv_reference

E2M1_MAGNITUDES = [Fraction(n, 2) for n in (0, 1, 2, 3, 4, 6, 8, 12)]  # 0, 0.5, 1, 1.5, 2, 3, 4, 6


def e2m1_exact(code: int) -> Fraction:
    return -E2M1_MAGNITUDES[code & 7] if code & 8 else E2M1_MAGNITUDES[code & 7]


def e4m3_exact(byte: int) -> Fraction:
    """e4m3fn from its bit fields: bias 7, subnormals m/8 * 2^-6 (no NaN bytes used here)."""
    exponent, mantissa = (byte >> 3) & 0xF, byte & 7
    if exponent == 0:
        magnitude = Fraction(mantissa, 8) * Fraction(1, 64)
    else:
        magnitude = (1 + Fraction(mantissa, 8)) * Fraction(2) ** (exponent - 7)
    return -magnitude if byte & 0x80 else magnitude


def _pack(codes: list[int]) -> list[int]:
    return [lo | (hi << 4) for lo, hi in zip(codes[0::2], codes[1::2], strict=True)]


# Two batches, 3 rows, K = 32 (two 16-element scale blocks).  Every row and b hold all 16 codes, negatives
# included; a's scales run from 2^-9 (e4m3's smallest subnormal) to 448 (its largest), some negative.
A_CODES = [
    [[(i * 5 + r + 3 * l) % 16 for i in range(32)] for r in range(3)] for l in range(2)  # noqa: E741
]
B_CODES = [[(i * 7 + 2 + l) % 16 for i in range(32)] for l in range(2)]  # noqa: E741
A_SCALES = [
    [[0x01, 0x7E], [0x0D, 0xB9], [0x5B, 0x03]],  # 2^-9, 448 | 1.625 * 2^-5, -1.125 | 22, 3 * 2^-9
    [[0xFE, 0x3C], [0x22, 0x11], [0x38, 0x8A]],  # -448, 1.5 | 1.25 * 2^-3, 1.125 * 2^-5 | 1, -1.25 * 2^-6
]
B_SCALES = [[0x30, 0x45], [0x41, 0x2B]]  # 0.5, 3.25 | 2.25, 1.375 * 2^-2


def _exact_results() -> list[list[Fraction]]:
    """``[L][M]`` exact sums."""
    out = []
    for l in range(2):  # noqa: E741
        rows = []
        for r in range(3):
            total = Fraction(0)
            for i in range(32):
                total += (
                    e2m1_exact(A_CODES[l][r][i])
                    * e4m3_exact(A_SCALES[l][r][i // 16])
                    * e2m1_exact(B_CODES[l][i])
                    * e4m3_exact(B_SCALES[l][i // 16])
                )
            rows.append(total)
        out.append(rows)
    return out


def _dequantized_operands() -> tuple[torch.Tensor, torch.Tensor]:
    a_bytes = torch.tensor([[_pack(row) for row in batch] for batch in A_CODES], dtype=torch.uint8)  # [2, 3, 16]
    b_bytes = torch.tensor([[_pack(row)] for row in B_CODES], dtype=torch.uint8)  # [2, 1, 16]
    a_scales = torch.tensor(A_SCALES, dtype=torch.uint8).view(torch.float8_e4m3fn)
    b_scales = torch.tensor(B_SCALES, dtype=torch.uint8).view(torch.float8_e4m3fn).unsqueeze(1)
    return formats.dequantize(a_bytes, a_scales), formats.dequantize(b_bytes, b_scales)


def test_case_covers_all_codes_signs_and_binades():
    for batch in A_CODES:
        for row in batch:
            assert sorted(set(row)) == list(range(16))
    scales = [e4m3_exact(s) for batch in A_SCALES for row in batch for s in row]
    assert min(abs(s) for s in scales) == Fraction(1, 512) and max(abs(s) for s in scales) == 448
    assert any(s < 0 for s in scales)
    assert any(r < 0 for row in _exact_results() for r in row) and any(r > 0 for row in _exact_results() for r in row)


def test_gemv_reference_is_exact_in_float64():
    a, b = _dequantized_operands()
    out = gemv_reference(a, b, out_dtype=torch.float64)
    assert out.shape == (2, 3, 1)
    exact = _exact_results()
    for l in range(2):  # noqa: E741
        for r in range(3):
            assert Fraction(out[l, r, 0].item()) == exact[l][r]


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gemv_reference_rounds_exact_sum_to_out_dtype(out_dtype):
    a, b = _dequantized_operands()
    out = gemv_reference(a, b, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    expected = torch.tensor([[[float(x)] for x in row] for row in _exact_results()], dtype=torch.float64).to(out_dtype)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("out_dtype, half_ulp", [(torch.float16, 2.0**-11), (torch.bfloat16, 2.0**-8)])
def test_gemv_reference_rounds_only_once(out_dtype, half_ulp):
    # 1 + half_ulp + 2^-40 lies just above the midpoint between 1 and the next 16-bit value.  Through fp32
    # (as torch's own float64 -> 16-bit cast goes) the 2^-40 is lost and the tie goes to 1.0.
    a = torch.tensor([[1.0, half_ulp, 2.0**-40]], dtype=torch.float64)
    b = torch.ones(1, 3, dtype=torch.float64)
    assert gemv_reference(a, b, out_dtype=out_dtype).item() == 1 + 2 * half_ulp
    assert (a.float() @ b.float().T).to(out_dtype).item() == 1.0  # the double rounding the oracle avoids


def _correctly_rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Nearest-even rounding of finite float64 ``x`` by search in the table of every finite value of ``dtype``."""
    max_bits = {torch.float16: 0x7BFF, torch.bfloat16: 0x7F7F}[dtype]
    table = torch.arange(max_bits + 1, dtype=torch.int32).to(torch.int16).view(dtype).to(torch.float64)
    # One step past the largest finite value stands for infinity: its spacing decides overflow.
    table = torch.cat([table, (2 * table[-1] - table[-2]).reshape(1)])
    mag = x.abs()
    hi = torch.searchsorted(table, mag).clamp(max=len(table) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - table[lo], table[hi] - mag
    pick = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    pick = torch.where(table[hi] == mag, hi, pick)
    value = torch.where(pick == len(table) - 1, torch.full_like(mag, float("inf")), table[pick])
    return torch.where(torch.signbit(x), -value, value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_from_float64_matches_exact_rounding_near_midpoints(dtype):
    gen = torch.Generator().manual_seed(7)
    # Midpoints between neighbouring 16-bit values (finite, both signs, subnormals included), nudged by
    # amounts float32 cannot hold and by none: where double rounding goes wrong.
    bits = torch.randint(0, 0x7B00 if dtype == torch.float16 else 0x7F00, (4000,), generator=gen, dtype=torch.int32)
    lo = bits.to(torch.int16).view(dtype).to(torch.float64)
    hi = (bits + 1).to(torch.int16).view(dtype).to(torch.float64)
    mid = (lo + hi) / 2
    nudge = torch.tensor([0.0, 2.0**-30, -(2.0**-30), 2.0**-45, -(2.0**-45)], dtype=torch.float64)
    x = (mid.unsqueeze(1) * (1 + nudge)).flatten()
    x = torch.cat([x, -x, torch.tensor([0.0, -0.0, 65519.99, 65520.0, -65520.0, 1e300, 2.0**-30])])
    got = round_from_float64(x, dtype)
    assert got.dtype == dtype
    want = _correctly_rounded(x, dtype)
    assert torch.equal(got.to(torch.float64), want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


def test_round_from_float64_passes_specials_and_other_dtypes():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=torch.float64)
    got = round_from_float64(x, torch.float16)
    assert torch.isnan(got[0]) and got[1:3].tolist() == [float("inf"), -float("inf")] and torch.signbit(got[3])
    y = torch.tensor([1 + 2.0**-40], dtype=torch.float64)
    assert round_from_float64(y, torch.float32).dtype == torch.float32
    assert torch.equal(round_from_float64(y, torch.float64), y)


def test_gemv_reference_batch_dims_and_several_columns():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, 5, 32, generator=gen, dtype=torch.float64)
    b = torch.randn(2, 3, 2, 32, generator=gen, dtype=torch.float64)
    out = gemv_reference(a, b, out_dtype=torch.float64)
    assert out.shape == (2, 3, 5, 2)
    for i in range(2):
        for j in range(3):
            for n in range(2):
                assert torch.allclose(out[i, j, :, n], (a[i, j] * b[i, j, n]).sum(-1), rtol=1e-12, atol=0)


def test_gemv_reference_accepts_low_precision_operands():
    a = torch.tensor([[0.5, -1.5]], dtype=torch.float16)
    b = torch.tensor([[6.0, 2.0]], dtype=torch.bfloat16)
    assert gemv_reference(a, b, out_dtype=torch.float32).item() == 0.0


def test_gemv_reference_names_k_mismatch():
    with pytest.raises(ValueError, match="b: expected K = 32 to match a, got 16"):
        gemv_reference(torch.zeros(3, 32), torch.zeros(1, 16))
