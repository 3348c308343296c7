"""fp4gemv.quantize / dequantize: the CPU path's conventions, and the Triton kernels bit for bit against it.

The CPU path (``formats.quantize``, ``formats.dequantize``) is the definition; it is checked here against
independent transcriptions of its sources (NVIDIA ModelOpt's NVFP4 recipe, the OCP MX rule, the exact value
rounded once) and on hand-made edge cases.  The kernels must then give the same bytes and bits: on a CPU-only
machine they run in Triton's interpreter (conftest sets TRITON_INTERPRET), on a GPU compiled (``gpu`` tests).
The fuzz (``quantize_fuzz.py``, shared with ``benchmarks/quantize_speed.py``) builds blocks of every
troublesome kind: zeros and negative zeros, all-equal blocks, elements exactly at the e2m1 rounding ties of
their block's scale and one ulp either side, blocks spanning many binades, the input dtype's largest and
subnormal values.
"""

import importlib
import math

import pytest
import torch
import triton
import triton.language as tl

import fp4gemv
from fp4gemv import FP4Tensor, formats
from fp4gemv.kernels.quantize import QuantizeConfig, pow2_per_tensor_scale
from fp4gemv.quantize import dequantize, nvfp4_global_scale, per_tensor_scale, quantize
from fp4gemv.formats import round_from_float64
from quantize_fuzz import E2M1_MAGNITUDES, fuzz_input

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.dtype])


def assert_same_floats(got: torch.Tensor, want: torch.Tensor):
    """Equal bit for bit, except that any NaN matches any NaN (its payload is not specified)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN positions differ"
    diff = (_bits(got) != _bits(want)) & ~nan
    assert not diff.any(), f"{int(diff.sum())} values differ, first at {diff.nonzero()[0].tolist()}"


def assert_same_quantized(got: FP4Tensor, want: FP4Tensor):
    assert (got.fmt, got.scale_layout, got.shape) == (want.fmt, want.scale_layout, want.shape)
    bad = (got.data.cpu() != want.data.cpu())
    assert not bad.any(), f"{int(bad.sum())} data bytes differ, first at {bad.nonzero()[0].tolist()}"
    bad = (got.scales.cpu() != want.scales.cpu())
    assert not bad.any(), f"{int(bad.sum())} scale bytes differ, first at {bad.nonzero()[0].tolist()}"
    if want.global_scale is None:
        assert got.global_scale is None
    else:
        assert _bits(got.global_scale.cpu()).item() == _bits(want.global_scale.cpu()).item()


# --- conventions of the CPU path -----------------------------------------------------------------------


def _modelopt_nvfp4(x: torch.Tensor, scale_2: torch.Tensor):
    """A transcription of NVIDIA ModelOpt's ``NVFP4QTensor.get_weights_scaling_factor`` and ``quantize``
    (modelopt/torch/quantization/qtensor/nvfp4_tensor.py): (packed bytes, e4m3 scale bytes)."""
    blocks = x.reshape(*x.shape[:-1], -1, 16)
    per_block_amax = blocks.abs().amax(dim=-1).float()
    per_block_scale = per_block_amax / (6.0 * scale_2)
    per_block_scale[per_block_scale == 0] = 1.0
    per_block_scale = per_block_scale.clamp_(min=2**-9).to(torch.float8_e4m3fn)
    scaled = (blocks / (per_block_scale.to(torch.float32) * scale_2).unsqueeze(-1)).reshape(x.shape)
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5])
    sign_bit = (scaled < 0).to(torch.uint8)
    weight_abs = scaled.abs()
    ordinal = torch.searchsorted(bounds, weight_abs, out_int32=True).to(torch.uint8)
    equals_odd_bounds = torch.any(weight_abs.unsqueeze(-1) == bounds[[1, 3, 5]], dim=-1).to(torch.uint8)
    q = (sign_bit << 3) + ordinal + equals_odd_bounds
    return (q[..., 1::2] << 4) | q[..., 0::2], per_block_scale.view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_matches_modelopt(dtype):
    """Same bytes as ModelOpt's recipe with its own per-tensor scale (the fuzz has -0.0 and underflows)."""
    x = fuzz_input("nvfp4", dtype, (24, 256), seed=1)
    scale_2 = x.float().abs().amax() / (6.0 * 448.0)  # get_weights_scaling_factor_2
    data, scales = _modelopt_nvfp4(x, scale_2)
    q = quantize(x, "nvfp4", global_scale="auto", backend="reference")
    assert q.global_scale.item() == scale_2.item()
    assert torch.equal(q.scales, scales)
    assert torch.equal(q.data, data)


def test_nvfp4_definition_by_hand():
    """Zero blocks get scale 1.0, tiny ones 2^-9, subnormal scales stay subnormal, ties go to the even code."""
    x = torch.zeros(1, 6 * 16)
    x[0, 16:32] = torch.tensor([6.0, 5.0, -3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -0.25, 1e-3, 4.9, 5.1, -6, 0, -0.0, 3])
    x[0, 32:48] = 1e-9  # amax / 6 below 2^-9: clamps at the smallest subnormal
    x[0, 48:64] = 6 * 3 * 2.0**-9  # a subnormal e4m3 scale, 3 * 2^-9 (byte 0x03)
    x[0, 64:80] = -7.0  # all equal: scale e4m3(7/6) = 1.125, elements -7/1.125 = -6.22 saturate to -6
    x[0, 80:96] = 2.0**20  # amax / 6 above 448 (no global scale): the scale saturates, so do the elements
    q = quantize(x, "nvfp4", backend="reference")
    assert q.scales[0].tolist() == [0x38, 0x38, 0x01, 0x03, 0x39, 0x7E]
    codes = formats.unpack_e2m1(q.data)[0]
    assert codes[:16].tolist() == [0] * 16
    # 6, 5 -> 4 (even), -3.5 -> -4, 2.5 -> 2, 1.75 -> 2, 1.25 -> 1, 0.75 -> 1, 0.25 -> 0, -0.25 -> -0, tiny,
    # 4.9 -> 4, 5.1 -> 6, -6, 0, -0 -> +0 (as ModelOpt), 3.
    assert codes[16:32].tolist() == [7, 6, 14, 4, 4, 2, 2, 0, 8, 0, 6, 7, 15, 0, 0, 5]
    assert codes[32:48].tolist() == [0] * 16  # 1e-9 / 2^-9 rounds to zero
    assert codes[48:64].tolist() == [7] * 16
    assert codes[64:80].tolist() == [15] * 16
    assert codes[80:96].tolist() == [7] * 16


def test_mxfp4_follows_the_ocp_rule():
    """X = floor(log2(amax)) - 2 clamped to e8m0's range, elements x / 2^X nearest even, saturating at 6,
    against float64 ``log2`` written out here."""
    x = fuzz_input("mxfp4", torch.float32, (16, 512), seed=2).float()
    q = quantize(x, "mxfp4", backend="reference")
    blocks = x.double().reshape(16, -1, 32)
    amax = blocks.abs().amax(-1)
    expected_x = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, -127.0).clamp(-127, 127)
    assert torch.equal(q.scales.double() - 127, expected_x)
    v = blocks / torch.exp2(expected_x).unsqueeze(-1)
    grid = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    got = formats.decode_e2m1(formats.unpack_e2m1(q.data)).double().reshape(16, -1, 32)
    distance = (v.abs().clamp(max=6).unsqueeze(-1) - grid).abs()
    assert torch.all((got.abs() - v.abs().clamp(max=6)).abs() <= distance.amin(-1))  # a nearest value
    ratio = amax / torch.exp2(expected_x)
    assert torch.all((expected_x == -127) | (ratio >= 4) & (ratio < 8))
    assert (expected_x == -127).any() and (ratio > 6).any()  # the fuzz reaches the clamp and the saturation


def test_mxfp4_edges():
    x = torch.zeros(4, 64)
    x[0, :32] = torch.finfo(torch.float32).max  # X = 127 - 2
    x[1, :32] = 2.0**-140  # below 2^-125: X clamps at -127 (byte 0), x * 2^127 = 2^-13 rounds to 0
    x[1, 32:] = 2.0**-125 * 7  # floor(log2) = -123, X = -125: elements 7 -> saturate at 6
    x[2, :32] = 4.0
    x[2, 32:] = 7.99  # floor(log2) = 2 as for 4: the same scale, and 7.99 saturates
    q = quantize(x, "mxfp4", backend="reference")
    assert q.scales.tolist() == [[252, 0], [0, 2], [127, 127], [0, 0]]
    codes = formats.unpack_e2m1(q.data)
    assert codes[0, :32].unique().tolist() == [7] and codes[1, :32].unique().tolist() == [0]  # max / 2^125 -> 6
    assert codes[1, 32:].unique().tolist() == [7] and codes[2, :32].unique().tolist() == [6]
    assert codes[2, 32:].unique().tolist() == [7] and codes[3].unique().tolist() == [0]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_non_finite_values_raise_or_give_nan_blocks(fmt):
    x = torch.full((3, 64), 6.0)  # scale 1 (NVFP4) or 2^0 (MXFP4), quantized exactly
    x[1, 5] = math.nan
    x[2, 40] = -math.inf
    with pytest.raises(ValueError, match="x: expected finite values"):
        quantize(x, fmt, backend="reference")
    q = quantize(x, fmt, backend="reference", check_values=False)
    nan_byte = formats.NAN_SCALE_BYTE[fmt]
    bs = q.fmt.block_size
    nan_blocks = (q.scales == nan_byte)
    assert nan_blocks.nonzero().tolist() == [[1, 5 // bs], [2, 40 // bs]]
    values = dequantize(q, torch.float64)
    assert torch.isnan(values).reshape(3, -1, bs).all(-1).equal(nan_blocks)
    assert (values[0] == 6).all()


def test_float64_input_is_rounded_to_float32_first():
    x = torch.randn(8, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * (1 + 2.0**-40)
    for fmt in ("nvfp4", "mxfp4"):
        assert_same_quantized(quantize(x, fmt, backend="reference"), quantize(x.float(), fmt, backend="reference"))


# --- global scales ---------------------------------------------------------------------------------------


def test_auto_global_scale_is_modelopts_and_defined_at_the_edges():
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    g = nvfp4_global_scale(x)
    assert g.dtype == torch.float32 and g.shape == ()
    assert g.item() == (x.float().abs().max() / torch.tensor(2688.0)).item()
    assert nvfp4_global_scale(torch.zeros(2, 16)).item() == 2.0**-126
    assert nvfp4_global_scale(torch.tensor([[1.0, math.inf]])).item() == 1.0
    assert nvfp4_global_scale(torch.tensor([[1.0, math.nan]])).item() == 1.0
    q = quantize(x, "nvfp4", global_scale="auto")
    assert q.global_scale.item() == g.item()
    assert q.scales.view(torch.float8_e4m3fn).float().max().item() == 448.0  # the largest block maps to 448


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(
    "fmt, global_scale, exc, words",
    [
        ("mxfp4", "auto", ValueError, ["global_scale:", "MXFP4 has none"]),
        ("mxfp4", "pow2", ValueError, ["global_scale: 'pow2' is NVFP4's", "MXFP4 has none"]),
        ("nvfp4", "max", ValueError, ["global_scale: expected None, 'auto', 'pow2', a number or a tensor", "'max'"]),
        ("nvfp4", 0.0, ValueError, ["global_scale:", "positive normal float32", "0.0"]),
        ("nvfp4", -1.0, ValueError, ["global_scale:", "-1.0"]),
        ("nvfp4", math.inf, ValueError, ["global_scale:", "inf"]),
        ("nvfp4", 1e-40, ValueError, ["global_scale:", "positive normal"]),
        ("nvfp4", torch.tensor(0.0), ValueError, ["global_scale:", "positive normal"]),
        ("nvfp4", torch.tensor(1.0, dtype=torch.float64), TypeError, ["global_scale:", "float32", "float64"]),
        ("nvfp4", torch.ones(2), ValueError, ["global_scale:", "one value", "(2,)"]),
        ("nvfp4", True, TypeError, ["global_scale:", "bool"]),
    ],
)
def test_global_scale_validation(fmt, global_scale, exc, words, backend):
    with pytest.raises(exc) as info:
        quantize(torch.ones(2, 32), fmt, global_scale=global_scale, backend=backend)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"


def test_global_scale_device_and_unchecked_tensor():
    with pytest.raises(ValueError, match="global_scale: expected device cpu like x, got meta"):
        quantize(torch.ones(2, 32), global_scale=torch.ones((), device="meta"))
    # Unchecked, a tensor's value is not read (no synchronisation): the caller vouches for it.
    q = quantize(torch.ones(2, 32), global_scale=torch.tensor(0.5), check_values=False)
    assert q.global_scale.item() == 0.5


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_dequantize_is_outside_autograd_on_every_backend(backend):
    """An FP4 tensor is a frozen weight: its global scale gets no gradient through dequantize on any backend."""
    t = quantize(torch.randn(4, 32))
    g = torch.tensor(0.5, requires_grad=True)
    frozen = FP4Tensor(t.data, t.scales, "nvfp4", "linear", g)
    for dtype in (torch.float32, torch.float64):
        values = dequantize(frozen, dtype, backend=backend)
        assert not values.requires_grad
        assert torch.equal(values, dequantize(t, dtype) * 0.5)


@pytest.mark.parametrize("check_values", [True, False])
def test_a_meta_tensor_is_refused_naming_x(check_values):
    with pytest.raises(ValueError, match="x: expected a tensor with values, on cpu or cuda, got device meta"):
        quantize(torch.ones(4, 32, device="meta"), check_values=check_values)


@pytest.mark.parametrize(
    "x, kwargs, exc, message",
    [
        ([[1.0] * 16], {}, TypeError, "x: expected a torch.Tensor, got list"),
        (torch.ones(2, 16, dtype=torch.int32), {}, TypeError, "x: expected dtype float16 or bfloat16"),
        (torch.ones(16), {}, ValueError, r"x: expected shape \[R, K\] or \[L, R, K\], got \(16,\)"),
        (torch.ones(0, 16), {}, ValueError, r"x: expected sizes >= 1, got shape \(0, 16\)"),
        (torch.ones(2, 24), {}, ValueError, "x: expected K a multiple of the nvfp4 block size 16, got K = 24"),
        (torch.ones(2, 48), {"fmt": "mxfp4"}, ValueError, "block size 32, got K = 48"),
        (torch.ones(2, 16), {"scale_layout": "tiled"}, ValueError, "scale_layout: expected 'linear' or 'swizzled'"),
        (torch.ones(2, 16), {"backend": "ptx"}, ValueError, "backend: expected one of 'auto', 'triton', 'reference'"),
        (torch.ones(2, 16), {"config": (8, 32)}, TypeError, "config: expected a QuantizeConfig or None, got tuple"),
        (torch.ones(2, 16), {"config": QuantizeConfig(8, 24)}, ValueError, "config: expected powers of two rows"),
    ],
)
def test_quantize_names_the_bad_argument(x, kwargs, exc, message):
    with pytest.raises(exc, match=message):
        quantize(x, **kwargs)


def test_triton_backend_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.setitem(__import__("os").environ, "TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"backend: 'triton' needs CUDA tensors \(or TRITON_INTERPRET=1\)"):
        quantize(torch.ones(2, 16), backend="triton")
    with pytest.raises(ValueError, match="backend: 'triton' needs CUDA"):
        dequantize(quantize(torch.ones(2, 16)), backend="triton")


def test_public_api_wraps_the_eager_functions_and_fp4tensor_calls_no_op():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    assert fp4gemv.dequantize is dequantize
    assert_same_quantized(fp4gemv.quantize(x, "mxfp4", "swizzled"), quantize(x, "mxfp4", "swizzled"))
    assert not hasattr(FP4Tensor, "quantize") and not hasattr(FP4Tensor, "dequantize")


def test_division_through_a_float64_reciprocal_rounds_like_division():
    """The NVFP4 kernel's premise: for float32 x and d, x * RN64(1 / d) rounded to float32 equals RN32(x / d)
    whenever that is a normal number (an exact quotient stays 2^-49 away from every midpoint between normal
    float32 numbers; the float64 route errs by at most 2^-52).  Checked on random pairs and on pairs built to
    land within an ulp of a midpoint."""
    g = torch.Generator().manual_seed(11)
    n = 1 << 20
    d = (torch.rand(n, generator=g) + 0.5) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).float())
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).float())
    # Near-midpoints: x = RN32(m * d) for m halfway between two float32 numbers, nudged by an ulp.
    m = (torch.rand(n, generator=g) + 1).double() + 2.0**-24  # float32 in [1, 2) plus half an ulp
    near = (m * d.double()).float()
    near = torch.nextafter(near, torch.where(torch.rand(n, generator=g) < 0.5, 0.0, math.inf))
    for xs in (x, near):
        via_reciprocal = (xs.double() * (1.0 / d.double())).float()
        quotient = xs / d
        normal = quotient.abs() >= 2.0**-126
        assert normal.float().mean() > 0.9
        assert torch.equal(via_reciprocal[normal], quotient[normal])


# --- the kernel against the CPU path ---------------------------------------------------------------------

# (format, input dtype, global scale, scale layout, shape): every format x dtype, each global scale kind, odd
# row counts, batches, a tile boundary (K = 1024 > 512 elements per program), tails of rows and scale columns.
KERNEL_CASES = [
    ("nvfp4", torch.bfloat16, None, "linear", (37, 256)),
    ("nvfp4", torch.bfloat16, "auto", "swizzled", (2, 130, 64)),
    ("nvfp4", torch.float16, 0.37, "swizzled", (9, 1024)),
    ("nvfp4", torch.float16, "auto", "linear", (3, 5, 96)),
    ("nvfp4", torch.float32, None, "swizzled", (129, 48)),
    ("nvfp4", torch.float32, "auto", "linear", (11, 512)),
    ("nvfp4", torch.float32, 2.0**-120, "linear", (7, 128)),  # block scales clamp at 448, elements saturate
    ("nvfp4", torch.bfloat16, 3.0e30, "linear", (7, 128)),  # block scales clamp at 2^-9
    ("mxfp4", torch.bfloat16, None, "swizzled", (2, 33, 256)),
    ("mxfp4", torch.float16, None, "linear", (21, 1024)),
    ("mxfp4", torch.float32, None, "linear", (5, 160)),
    ("mxfp4", torch.float32, 0.37, "swizzled", (130, 64)),
    ("mxfp4", torch.bfloat16, 2.0**-100, "linear", (3, 2, 64)),
]


def _case_id(case):
    fmt, dtype, gs, layout, shape = case
    return f"{fmt}-{str(dtype)[6:]}-{gs}-{layout}-{'x'.join(map(str, shape))}"


@pytest.mark.parametrize("case", KERNEL_CASES, ids=_case_id)
def test_kernel_matches_cpu_path_bit_for_bit(case):
    fmt, dtype, gs, layout, shape = case
    x = fuzz_input(fmt, dtype, shape, seed=len(shape) * 1000 + shape[-1])
    # MXFP4 divides x by g first, which overflows on the fuzz's largest values: NaN blocks, left unchecked.
    check = not (fmt == "mxfp4" and gs is not None)
    want = quantize(x, fmt, layout, gs, backend="reference", check_values=check)
    got = quantize(x.to(DEVICE), fmt, layout, gs, backend="triton", check_values=check)
    assert_same_quantized(got, want)


@pytest.mark.parametrize("config, shape", [(QuantizeConfig(1, 1, 1), (2, 3, 32)),
                                           (QuantizeConfig(16, 8, 2), (2, 19, 192)),
                                           (QuantizeConfig(4, 64, 8, float64_reciprocal=False), (2, 19, 192))])
def test_kernels_with_other_tiles(config, shape):
    """Tiles smaller and larger than the shape (one row and block per program; a partial last program), and
    the per-element division."""
    x = fuzz_input("nvfp4", torch.bfloat16, shape, seed=12)
    want = quantize(x, "nvfp4", "swizzled", "auto", backend="reference")
    got = quantize(x.to(DEVICE), "nvfp4", "swizzled", "auto", backend="triton", config=config)
    assert_same_quantized(got, want)
    for out_dtype in OUT_DTYPES:
        assert_same_floats(dequantize(got, out_dtype, backend="triton", config=config).cpu(),
                           dequantize(want, out_dtype))


def test_kernel_reads_strided_inputs():
    """Rows at any stride (a column slice), an odd stride that forbids the pair view (copied), K-strided input
    (copied), float64 (rounded to float32 first)."""
    base = fuzz_input("nvfp4", torch.bfloat16, (40, 320), seed=6)
    for x in (base[:, 32:288], base[::3, 16:80], base.t().contiguous().t()[:, :64]):
        want = quantize(x, "nvfp4", "swizzled", "auto", backend="reference")
        got = quantize(x.to(DEVICE), "nvfp4", "swizzled", "auto", backend="triton")
        assert_same_quantized(got, want)
    odd = torch.empty(8, 97, dtype=torch.bfloat16)[:, 1:97].copy_(base[:8, :96])  # row stride 97, offset 1
    want = quantize(odd, "mxfp4", backend="reference")
    assert_same_quantized(quantize(odd.to(DEVICE), "mxfp4", backend="triton"), want)
    x64 = base[:8, :64].double() * (1 + 2.0**-30)
    assert_same_quantized(quantize(x64.to(DEVICE), backend="triton"), quantize(x64, backend="reference"))


def test_kernel_reports_non_finite_blocks_like_the_cpu_path():
    x = fuzz_input("nvfp4", torch.float32, (6, 64), seed=7)
    x[2, 3], x[4, 60] = math.nan, math.inf
    with pytest.raises(ValueError, match="x: expected finite values"):
        quantize(x.to(DEVICE), backend="triton")
    for fmt in ("nvfp4", "mxfp4"):
        want = quantize(x, fmt, backend="reference", check_values=False)
        assert_same_quantized(quantize(x.to(DEVICE), fmt, backend="triton", check_values=False), want)


# --- a global scale chosen per call: "pow2" ---------------------------------------------------------------
# On a Triton target the amax kernel (kernels/amax.py) writes partial maxima of x's magnitude bits and the quantize
# kernel computes the scale from them (``pow2_per_tensor_scale``): the twin of ``per_tensor_scale``, the definition.


@triton.jit
def _twin_kernel(bits_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, pow2_per_tensor_scale(tl.load(bits_ptr + i, mask=i < n, other=0)), mask=i < n)


def _twin(amax_bits: torch.Tensor) -> torch.Tensor:
    """The kernels' scale for each float32 magnitude bit pattern (int32) in ``amax_bits``, as int32 bits."""
    out = torch.empty(amax_bits.shape, dtype=torch.float32, device=amax_bits.device)
    _twin_kernel[(triton.cdiv(amax_bits.numel(), 8192),)](amax_bits, out, amax_bits.numel(), BLOCK=8192)
    return out.view(torch.int32)


def _f32_bits(values: torch.Tensor) -> torch.Tensor:
    return values.float().view(torch.int32)


def _amax_edges() -> torch.Tensor:
    """float32 magnitude bits (int32) where the per-tensor scale can go wrong: zero, the smallest subnormals, every
    amax = 2688 * 2^k (the quotient exactly a power of two) from the subnormal amaxes to the largest, and 4 ulps
    either side of each; the quotient's rounding ties in the subnormal range (amax = 21 m 2^-143, m odd: the
    quotient m 2^-150, halfway between two subnormals; next to 2^k they decide the power of two, and there a
    division and a multiplication by the reciprocal round apart) and an ulp either side, down to the quotient's
    underflow to zero; the largest finite value, infinity and NaNs; random bits over the whole range and over the
    amaxes with a subnormal quotient."""
    g = torch.Generator().manual_seed(14)
    k = torch.arange(-156, 117, dtype=torch.float64)
    powers = _f32_bits(2688.0 * torch.exp2(k))
    m = torch.tensor([2**j + d for j in range(0, 19) for d in (-1, 1)] + list(range(1, 400, 2)), dtype=torch.float64)
    ties = _f32_bits(21.0 * m * 2.0**-143)
    near = torch.cat([powers + d for d in range(-4, 5)] + [ties + d for d in (-1, 0, 1)])
    special = torch.tensor([0, 1, 2, 3, 0x7FFFFF, 0x800000, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000,
                            0x7FFFFFFF], dtype=torch.int32)
    wide = torch.randint(0, 0x7FFFFFFF, (1 << 17,), generator=g, dtype=torch.int32)
    subnormal_quotient = torch.randint(0, 0x0A800000, (1 << 15,), generator=g, dtype=torch.int32)  # amax < 2688 * 2^-126
    return torch.cat([special, near.int().clamp(0, 0x7FFFFFFF), wide, subnormal_quotient])


def _pow2_at_or_above(amax: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """per_tensor_scale's last steps on a given quotient (for its near misses below)."""
    mantissa, exponent = torch.frexp(scale)
    scale = torch.ldexp(torch.ones_like(scale), torch.where(mantissa == 0.5, exponent - 1, exponent))
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _near_misses(amax: torch.Tensor) -> dict[str, torch.Tensor]:
    """Scales a slightly wrong kernel would compute: the edges must tell each from the definition."""
    quotient = amax / torch.tensor(2688.0)
    one = torch.ones_like(amax)
    return {
        # PyTorch's CUDA division by a Python number: the product with the float32 reciprocal.
        "reciprocal": _pow2_at_or_above(amax, amax * (torch.tensor(1.0) / torch.tensor(2688.0))),
        "always the next binade": torch.where(amax > 0, torch.ldexp(one, torch.frexp(quotient).exponent), one),
        "at or below": torch.where(amax > 0, torch.ldexp(one, torch.frexp(quotient).exponent - 1), one),
        "subnormal quotients flushed": _pow2_at_or_above(amax, torch.where(quotient < 2.0**-126, 0.0, quotient)),
        "infinity unclamped": torch.where(amax == math.inf, amax, per_tensor_scale(amax)),
    }


def test_the_amax_edges_tell_the_definition_from_its_near_misses():
    """Each way of getting the scale slightly wrong differs from ``per_tensor_scale`` on the edges (so the twin's
    test below would catch it); the definition itself divides by a tensor, which is the IEEE quotient on CPU and
    CUDA alike, and a division by the Python number 2688 on CUDA would be the "reciprocal" miss."""
    amax = _amax_edges().view(torch.float32)
    want = per_tensor_scale(amax).view(torch.int32)
    for name, miss in _near_misses(amax).items():
        assert (miss.view(torch.int32) != want).any(), name
    tie = torch.tensor(21 * 1025 * 2.0**-143)  # quotient 2^-140 + 2^-150: even 2^-140, the reciprocal's one above
    assert per_tensor_scale(tie).item() == 2.0**-140
    assert _near_misses(tie)["reciprocal"].item() == 2.0**-139


def test_the_kernels_scale_is_per_tensor_scale_bit_for_bit():
    """``pow2_per_tensor_scale`` (the quantize kernel's, in a one-line kernel here) on every edge and ~160K random
    magnitudes, against the definition."""
    bits = _amax_edges()
    want = per_tensor_scale(bits.view(torch.float32)).view(torch.int32)
    got = _twin(bits.to(DEVICE)).cpu()
    bad = (got != want).nonzero()
    assert bad.numel() == 0, [(hex(bits[i].item()), got[i].view(torch.float32).item(),
                               want[i].view(torch.float32).item()) for i in bad[:5, 0].tolist()]


def _pow2_input(dtype, shape, content, seed=15) -> torch.Tensor:
    """x of ``shape`` whose amax is of the kind ``content`` names, placed in the last row and column (the tails
    of both tilings)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    big = {"boundary": 336.0, "above the boundary": math.nextafter(336.0, math.inf) if dtype == torch.float32
           else 338.0, "largest": torch.finfo(dtype).max, "inf": math.inf, "-inf": -math.inf, "nan": math.nan,
           "negative": -1000.0}
    if content == "zeros":
        x.zero_()
        x[..., ::3] = -0.0
    elif content == "subnormal":  # the dtype's subnormals (float16's are float32 normals)
        x = (x.float() * (2.0**-20 if dtype == torch.float16 else 2.0**-130)).to(dtype)
    elif content == "tie":  # float32: the quotient halfway between two subnormals next to 2^-140
        x = (x.float() * 2.0**-140).to(dtype)
        x[..., -1, -1] = 21 * 1025 * 2.0**-143
    elif content == "underflow":  # float32: the quotient rounds to zero, so the scale is 1
        x = (x.float() * 2.0**-150).to(dtype)
        x[..., -1, -1] = 21 * 2.0**-143
    elif content in big:
        x[..., -1, -1] = big[content]
    return x


POW2_CONTENTS = ["random", "zeros", "subnormal", "boundary", "above the boundary", "largest", "inf", "-inf", "nan",
                 "negative"]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("content", POW2_CONTENTS + ["tie", "underflow"])
def test_pow2_global_scale_is_per_tensor_scale_of_the_amax(dtype, content):
    """``global_scale="pow2"``: the kernels' scale is ``per_tensor_scale(amax(|x|))`` bit for bit, and the bytes
    those of quantizing with that scale given; the CPU path (torch) gives the same.  K = 1040 is 520 pair words,
    not a whole number of the amax kernel's 512-word tiles."""
    if content in ("tie", "underflow") and dtype != torch.float32:
        pytest.skip("that amax is a float32 only")
    x = _pow2_input(dtype, (5, 1040), content)
    want_g = per_tensor_scale(x.abs().amax())
    if content == "subnormal" and dtype != torch.float16:
        assert 0 < want_g.item() < 2.0**-126
    if content in ("zeros", "inf", "-inf", "nan", "underflow"):
        assert want_g.item() == 1
    got = quantize(x.to(DEVICE), "nvfp4", "linear", "pow2", backend="triton", check_values=False)
    assert _bits(got.global_scale.cpu()).item() == _bits(want_g).item()
    given = quantize(x.to(DEVICE), "nvfp4", "linear", want_g.to(DEVICE), backend="triton", check_values=False)
    assert_same_quantized(got, given)
    assert_same_quantized(quantize(x, "nvfp4", "linear", "pow2", backend="reference", check_values=False), given)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", [(1, 16), (1, 1040), (9, 64), (2, 3, 96), (17, 2064)])
def test_pow2_global_scale_over_shapes(dtype, shape, monkeypatch):
    """One row (decode), K tails, batches, fewer tiles than programs (3 tiles, 4 programs: one writes +0), and two
    programs for many tiles (each takes every other one), the amax in the last."""
    from fp4gemv.kernels import amax

    if shape[-2] == 17:
        monkeypatch.setattr(amax, "MAX_PARTIALS", 2)
    for content in ("random", "largest"):
        x = _pow2_input(dtype, shape, content, seed=sum(shape))
        want = quantize(x.to(DEVICE), "nvfp4", "swizzled", per_tensor_scale(x.abs().amax()).to(DEVICE),
                        backend="triton")
        got = quantize(x.to(DEVICE), "nvfp4", "swizzled", "pow2", backend="triton")
        assert_same_quantized(got, want)


def test_pow2_global_scale_checks_values_like_the_others():
    x = torch.ones(2, 64)
    x[1, 7] = math.nan
    with pytest.raises(ValueError, match="x: expected finite values"):
        quantize(x.to(DEVICE), global_scale="pow2", backend="triton")
    assert quantize(x.to(DEVICE), global_scale="pow2", backend="triton", check_values=False).global_scale.item() == 1


@pytest.mark.gpu
def test_gpu_per_tensor_scale_is_the_cpus_on_the_amax_edges():
    """The definition gives the same bits on CUDA as on the CPU (its division by a tensor is IEEE on both; frexp and
    ldexp of subnormals alike), so the kernels' twin matches it on either device."""
    amax = _amax_edges().view(torch.float32)
    assert torch.equal(per_tensor_scale(amax.cuda()).cpu().view(torch.int32), per_tensor_scale(amax).view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", [(1, 16384), (16, 7168), (2048, 4096)])
def test_gpu_pow2_global_scale_on_real_sizes(dtype, shape):
    """Decode rows and a prefill activation (more tiles than the amax kernel's 128 programs): the scale and the
    bytes of the definition's scale given, and of the CPU path."""
    for content in ("random", "largest", "nan"):
        x = _pow2_input(dtype, shape, content, seed=shape[0])
        got = quantize(x.cuda(), "nvfp4", "linear", "pow2", check_values=False)
        want_g = per_tensor_scale(x.abs().amax())
        assert _bits(got.global_scale.cpu()).item() == _bits(want_g).item(), content
        assert_same_quantized(got, quantize(x.cuda(), "nvfp4", "linear", want_g.cuda(), check_values=False))
        assert_same_quantized(got, quantize(x, "nvfp4", "linear", "pow2", check_values=False))


# --- dequantize ------------------------------------------------------------------------------------------


def _double_rounding_global_scale():
    """A float32 g in [1, 2) for which 1.5 * 1.125 * g (exact in float64) rounded to float32 first and then
    to bf16 differs from rounding it once: found by trying every float32 in [1, 2)."""
    g = torch.arange(2**23, 2**24, dtype=torch.float64) * 2.0**-23
    exact = g * (1.5 * 1.125)
    twice = exact.float().bfloat16()
    once = round_from_float64(exact, torch.bfloat16)
    return g[(twice != once).nonzero()[0, 0]].item()


def test_dequantize_rounds_the_exact_value_once():
    g = _double_rounding_global_scale()
    t = FP4Tensor(torch.tensor([[0x03] * 8], dtype=torch.uint8), torch.tensor([[0x39]], dtype=torch.uint8),
                  "nvfp4", global_scale=g)  # code 3 (1.5) times scale 0x39 (1.125) times g
    exact = 1.5 * 1.125 * g
    assert dequantize(t, torch.float64)[0, 0].item() == exact
    via_float32 = torch.tensor(exact, dtype=torch.float32).to(torch.bfloat16)
    once = round_from_float64(torch.tensor(exact, dtype=torch.float64), torch.bfloat16)
    assert via_float32.item() != once.item(), "the search above must find a double-rounding case"
    assert dequantize(t, torch.bfloat16)[0, 0].item() == once.item()
    assert dequantize(t.to(DEVICE), torch.bfloat16, backend="triton")[0, 0].item() == once.item()


def _random_fp4(fmt, layout, shape, global_scale, seed, scale_bytes=None):
    g = torch.Generator().manual_seed(seed)
    *outer, k = shape
    bs = formats.FORMATS[fmt].block_size
    data = torch.randint(0, 256, (*outer, k // 2), dtype=torch.uint8, generator=g)
    if scale_bytes is None:  # every byte, NaN included
        scale_bytes = torch.randint(0, 256, (*outer, k // bs), dtype=torch.uint8, generator=g)
    return FP4Tensor(data, scale_bytes, fmt, "linear", global_scale).with_scale_layout(layout)


# (format, layout, shape, global scale, scale-byte range or None for all 256): the tile-wide fast path of the
# global-scale case (in range), its exact fallback (NaN scales, fp16 subnormals, overflow), and no global scale.
DEQUANT_CASES = [
    ("nvfp4", "linear", (37, 256), None, None),
    ("nvfp4", "swizzled", (2, 130, 96), 0.37, (0x08, 0x7E)),
    ("nvfp4", "linear", (9, 1024), 1.3e-4, (0x01, 0x7E)),
    ("nvfp4", "swizzled", (2, 5, 64), 0.37, None),
    ("nvfp4", "linear", (7, 64), 3.0e33, (0x00, 0x7E)),
    ("mxfp4", "swizzled", (2, 33, 256), None, None),
    ("mxfp4", "linear", (21, 512), 0.37, (110, 140)),
    ("mxfp4", "linear", (5, 64), 1.5, None),
]


def _dequant_case_id(case) -> str:
    return f"{case[0]}-{case[1]}-{'x'.join(map(str, case[2]))}-{case[3]}"


def _dequant_case_tensor(case) -> FP4Tensor:
    """The FP4 tensor (checkpoint order, on the CPU) of a ``DEQUANT_CASES`` row."""
    fmt, layout, shape, gs, byte_range = case
    scale_bytes = None
    if byte_range is not None:
        bs = formats.FORMATS[fmt].block_size
        scale_bytes = torch.randint(byte_range[0], byte_range[1] + 1, (*shape[:-1], shape[-1] // bs),
                                    dtype=torch.uint8, generator=torch.Generator().manual_seed(shape[-1]))
    return _random_fp4(fmt, layout, shape, gs, seed=sum(shape), scale_bytes=scale_bytes)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", DEQUANT_CASES, ids=_dequant_case_id)
def test_dequantize_kernel_matches_cpu_path_bit_for_bit(case, out_dtype):
    t = _dequant_case_tensor(case)
    want = round_from_float64(dequantize(t, torch.float64), out_dtype)
    assert_same_floats(formats.dequantize(t.data, t.linear_scales(), t.fmt, t.global_scale, out_dtype), want)
    got = dequantize(t.to(DEVICE), out_dtype, backend="triton").cpu()
    assert_same_floats(got, want)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", DEQUANT_CASES, ids=_dequant_case_id)
def test_dequantize_kernel_reads_every_code_order(case, out_dtype):
    """The kernel decodes the native and paired orders where they lie (``ORDER``; no copy to the checkpoint order):
    the bits of the same tensor in the checkpoint order, where reading the moved bytes as checkpoint codes gives
    other values.  Each order's launch follows the checkpoint's with the same metadata, so a kept launch that
    shared their compiled kernel would fail here too.  The CPU path (and float64) reads every order as well."""
    t = _dequant_case_tensor(case)
    want = dequantize(t.to(DEVICE), out_dtype, backend="triton").cpu()
    exact = dequantize(t, torch.float64)
    for order in ("native", "paired"):
        moved = t.with_code_order(order)
        assert not torch.equal(moved.data, t.data), order
        misread = FP4Tensor(moved.data, t.scales, t.fmt, t.scale_layout, t.global_scale)  # as checkpoint codes
        assert not torch.equal(dequantize(misread, torch.float64).nan_to_num(), exact.nan_to_num()), order
        assert_same_floats(dequantize(moved.to(DEVICE), out_dtype, backend="triton").cpu(), want)
        assert_same_floats(dequantize(moved, out_dtype, backend="reference"), want)
        assert_same_floats(dequantize(moved, torch.float64), exact)


def test_dequantize_kernel_reads_views():
    """The first rows of swizzled scales (a view), and the task's operands (data strided across batches)."""
    from fp4gemv import task

    head = _random_fp4("nvfp4", "swizzled", (3, 200, 128), 0.5, seed=8).first_rows(130)
    want = round_from_float64(dequantize(head, torch.float64), torch.bfloat16)
    assert_same_floats(dequantize(head.to(DEVICE), torch.bfloat16, backend="triton").cpu(), want)
    a, _, _, _, sfa_p, _, _ = task.generate_full_range_input(256, 512, 2, seed=3, device="cpu")
    want = round_from_float64(dequantize(FP4Tensor.from_task(a, sfa_p), torch.float64), torch.float16)
    view = FP4Tensor.from_task(a.to(DEVICE), sfa_p.to(DEVICE))
    assert_same_floats(dequantize(view, torch.float16, backend="triton").cpu(), want)


def test_dequantize_validation():
    t = quantize(torch.ones(2, 32))
    with pytest.raises(TypeError, match="dtype: expected float32, float16, bfloat16 or float64, got torch.int8"):
        dequantize(t, torch.int8)
    with pytest.raises(TypeError, match="t: expected an FP4Tensor, got Tensor"):
        dequantize(torch.ones(2, 32))


def test_quantize_dequantize_round_trip_is_exact_on_representable_values():
    """Values that are e2m1 times an e4m3 scale with a 6 in each block survive quantize + dequantize."""
    g = torch.Generator().manual_seed(9)
    codes = torch.randint(0, 16, (64, 128), dtype=torch.uint8, generator=g)
    codes[:, ::16] = 7
    codes[codes == 8] = 0  # -0 quantizes to +0
    scales = (torch.randint(0x08, 0x76, (64, 8), dtype=torch.uint8, generator=g))
    x = dequantize(FP4Tensor(formats.pack_e2m1(codes), scales), torch.float32)
    for backend in ("reference", "triton"):
        q = quantize(x.to(DEVICE), backend=backend)
        assert torch.equal(q.scales.cpu(), scales) and torch.equal(q.data.cpu(), formats.pack_e2m1(codes))
        assert torch.equal(dequantize(q, torch.float32, backend=backend).cpu(), x)


# --- sm_90 compile (no GPU needed) ----------------------------------------------------------------------

_AOT_SCRIPT = r'''
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.backends.nvidia.compiler import CUDABackend
from fp4gemv.kernels.amax import amax_partials_kernel
from fp4gemv.kernels.quantize import quantize_kernel, dequantize_kernel

D = CUDABackend.parse_attr("D")
BYTES = dict(data_ptr="*u8", scales_ptr="*u8", gs_ptr="*fp32", partials_ptr="*i32")
BAD = (".ftz", "div.full", "div.approx", "rcp.approx", "ld.local", "st.local", "fma.rn.f32", "fma.rn.f64")
count = 0


def compile_variant(kernel, code, const, label):
    words = "*i64" if code == 0 else "*i32"
    sig = {n: ("constexpr" if n in const else BYTES.get(n, words if n in ("x_ptr", "out_ptr") else "i32"))
           for n in kernel.arg_names if n in const or not n.isupper()}
    aligned = [n for n in kernel.arg_names if n not in const and n not in ("gs_ptr", "rows")]
    attrs = {(kernel.arg_names.index(n),): D for n in aligned}
    k = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, num_stages=1))
    ptx = k.asm["ptx"]
    bad = [w for w in BAD if w in ptx]
    loads = set(re.findall(r"ld\.global(?:\.\w+)*\.(v\d)\.b(\d+)", ptx))
    if kernel is not dequantize_kernel and (("v4", "32") if code else ("v2", "64")) not in loads:
        bad.append("no 16-byte input loads: %s" % loads)
    if kernel is dequantize_kernel and not re.search(r"st\.global(?:\.\w+)*\.v(4\.b32|2\.b64)", ptx):
        bad.append("no 16-byte output stores")
    print(("FAIL " if bad else "ok ") + label, bad)
    global count
    count += 1


for kernel, order in [(quantize_kernel, None)] + [(dequantize_kernel, order) for order in (0, 1, 2)]:
    for code in (0, 1, 2):
        for bs in (16, 32):
            for has_global in (False, True):
                const = dict(FLOAT_CODE=code, FORMAT="nvfp4" if bs == 16 else "mxfp4", HAS_GLOBAL=has_global,
                             ROWS=8, BLOCKS=512 // bs)
                if kernel is quantize_kernel:
                    const["FLOAT64_RECIPROCAL"] = code != 2  # the fp16 variants divide element by element
                    const["PARTIALS"] = 0
                else:
                    const["ORDER"] = order
                compile_variant(kernel, code, const,
                                f"{kernel.__name__} code={code} bs={bs} global={has_global} order={order}")
for code in (0, 1, 2):
    # global_scale="pow2": the amax kernel, and the quantize kernel computing its scale from 128 partials.
    compile_variant(amax_partials_kernel, code, dict(FLOAT_CODE=code, ROWS=4, WORDS=512), f"amax code={code}")
    compile_variant(quantize_kernel, code, dict(FLOAT_CODE=code, FORMAT="nvfp4", HAS_GLOBAL=True, ROWS=8, BLOCKS=32,
                                                FLOAT64_RECIPROCAL=code != 2, PARTIALS=128),
                    f"quantize_kernel code={code} pow2")
print("compiled", count)
'''


def test_kernels_compile_for_sm90_with_exact_arithmetic(compile_for_sm90):
    """Every variant compiles for sm_90: no flush-to-zero, no approximate division or reciprocal, no fused
    multiply-add (the compiler contracts a product and a following addition: the interpreter rounds twice,
    and an underflowing ``a * b + 0.0`` keeps its sign), no local memory, 16-byte loads (quantize, amax) and
    stores (dequantize, in every code order); the per-call scale's variants too (the amax kernel, and the
    quantize kernel computing ``pow2_per_tensor_scale``)."""
    out = compile_for_sm90(_AOT_SCRIPT)
    assert "FAIL" not in out, out
    assert "compiled 54" in out, out


# --- GPU --------------------------------------------------------------------------------------------------


def check_large_fuzz(fmt, dtype, device):
    """The kernel on ``device`` against the CPU path on three larger fuzzes (the ``gpu`` tests' body)."""
    for seed, shape, gs, layout in ((0, (515, 2048), None, "swizzled"), (1, (3, 300, 1024), 0.37, "linear"),
                                    (2, (1024, 4096), "auto" if fmt == "nvfp4" else None, "swizzled")):
        x = fuzz_input(fmt, dtype, shape, seed=seed)
        check = not (fmt == "mxfp4" and gs is not None)  # x / g overflows on the fuzz's largest values
        want = quantize(x, fmt, layout, gs, backend="reference", check_values=check)
        got = quantize(x.to(device), fmt, layout, gs, backend="triton", check_values=check)
        assert_same_quantized(got, want)
        for out_dtype in OUT_DTYPES:
            assert_same_floats(dequantize(got, out_dtype, backend="triton").cpu(), dequantize(want, out_dtype))


def check_real_sized_weight(device, shape=(4096, 7168)):
    """A weight-like bf16 tensor: kernel == CPU path for both formats, and dequantized to every float."""
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(10)) * 0.02).bfloat16()
    for fmt, gs in (("nvfp4", "auto"), ("mxfp4", None)):
        want = quantize(w, fmt, "swizzled", gs, backend="reference")
        got = quantize(w.to(device), fmt, "swizzled", gs, backend="triton")
        assert_same_quantized(got, want)
        for out_dtype in OUT_DTYPES:
            assert_same_floats(dequantize(got, out_dtype, backend="triton").cpu(), dequantize(want, out_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_gpu_quantize_matches_cpu_on_a_large_fuzz(fmt, dtype):
    check_large_fuzz(fmt, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_reference_backend_matches_the_cpu(fmt):
    """The CPU path's torch ops on CUDA tensors give the same bytes (no reciprocal-multiply division)."""
    x = fuzz_input(fmt, torch.bfloat16, (300, 1024), seed=13)
    for gs in (None, "auto") if fmt == "nvfp4" else (None,):
        assert_same_quantized(quantize(x.cuda(), fmt, "swizzled", gs, backend="reference"),
                              quantize(x, fmt, "swizzled", gs, backend="reference"))


@pytest.mark.gpu
def test_gpu_quantize_and_dequantize_a_real_sized_weight():
    check_real_sized_weight("cuda")


@pytest.mark.parametrize("op", ["quantize", "dequantize"])
@pytest.mark.parametrize("layout, global_scale", [("linear", None), ("swizzled", 0.5)])
def test_kept_launch_addresses_are_the_operands_the_kernel_reads(monkeypatch, op, layout, global_scale):
    """A kept (de)quantize launch fills each pointer argument from the call's addresses by operand name (``ops
    .KeptLaunch``, CUDA with Triton 3.6): for the table's kernel on an sm_90 target, every pointer the JIT call
    would pass (``fill_sources``) is the address the kept launch puts in its place."""
    q = importlib.import_module("fp4gemv.quantize")  # the module (fp4gemv.quantize is the op)
    from fp4gemv.target import SM90
    x = torch.randn(2, 200, 256, dtype=torch.bfloat16)
    g = None if global_scale is None else torch.tensor(global_scale)
    t = quantize(x, "mxfp4", layout, g)
    seen = []
    monkeypatch.setattr(q.KeptQuantize, "run", lambda self, operands, addresses: seen.append((self, operands,
                                                                                              addresses)))
    if op == "quantize":
        q._quantize_into(x, formats.resolve_format("nvfp4"), layout, g, None, SM90)
    else:
        monkeypatch.setattr(q, "_resolve_backend", lambda backend, device: SM90)
        dequantize(t, torch.float16)
    kept, operands, addresses = seen[-1]
    assert kept.plan.spec.name == op and kept.first is None
    _check_kept_addresses(kept, operands, addresses, 5 if op == "quantize" else 4)


def _check_kept_addresses(kept, operands, addresses, count):
    """Each of the ``count`` pointer arguments of ``kept``'s template is filled with the address of the operand the
    JIT call would pass (``fill_sources``)."""
    from fp4gemv.kernels.spec import Src, fill_sources
    filled = fill_sources(kept._template.args, operands)
    pointers = [name for name, v in kept._template.args.items() if isinstance(v, Src)]
    assert len(pointers) == count
    for name in pointers:
        assert addresses[kept._fields[kept._template.args[name].name]] == filled[name].data_ptr(), name


@pytest.mark.parametrize("shape", [(1, 64), (2, 40, 1040)])
def test_kept_pow2_quantize_launches_the_amax_kernel_first_on_the_same_addresses(monkeypatch, shape):
    """With global_scale="pow2" on a Triton target the kept plan is two launches: the amax kernel's (x, the
    partials) and the quantize kernel's (x, data, scales, the global scale it writes, the partials), every pointer
    of each filled from the call's addresses by operand name; the partials and the scale are new tensors."""
    q = importlib.import_module("fp4gemv.quantize")
    from fp4gemv.kernels.amax import amax_partials, amax_partials_kernel
    from fp4gemv.target import SM90
    x = torch.randn(shape, dtype=torch.bfloat16)
    seen = []
    monkeypatch.setattr(q.KeptQuantize, "run", lambda self, operands, addresses: seen.append((self, operands,
                                                                                              addresses)))
    q._quantize_into(x, formats.resolve_format("nvfp4"), "linear", "pow2", None, SM90)
    kept, operands, addresses = seen[-1]
    assert kept.plan.spec.name == "quantize" and kept.first._template.kernel is amax_partials_kernel
    partials = amax_partials(1 if len(shape) == 2 else shape[0], shape[-2], shape[-1] // 2)
    assert kept.amax_partials == partials == operands.partials.numel() and operands.partials.dtype == torch.int32
    assert operands.global_scale.dtype == torch.float32 and operands.global_scale.numel() == 1
    assert len(set(addresses)) == 5 and 0 not in addresses
    _check_kept_addresses(kept, operands, addresses, 5)
    _check_kept_addresses(kept.first, operands, addresses, 2)
    assert not kept.launches_by_address  # nothing compiled on the CPU
    with pytest.raises(RuntimeError, match="addresses: this call cannot launch on addresses alone"):
        kept.launch_at(addresses)
