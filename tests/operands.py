"""Operands and the exact-result check shared by the kernel tests.

Random FP4 tensors and activations (all 16 codes, wide and signed scales), the cases the tests sweep, NaN-poisoned
outputs, and the error bound a correct kernel stays within, derived from its arithmetic:

The bound.  Every operation after the exact decode is one fp32 rounding (unit roundoff u = 2^-24) on the
path of a term t_k = a_k * b_k to the result: at most 1 for the W4A16 product, 15 in a 16-element block
sum, 1 for the scale product, NB for the K-loop additions plus the final sum over BLOCKS columns (together
<= NB + 1 for a power-of-two BLOCKS <= NB, and fewer when BLOCKS > NB), 2 for the global scales.  With
n = NB + 22 >= that depth, the fp32 result s' obeys |s' - s| <= 1.01 * n * u * sum_k |t_k| (gamma_n;
n * u < 1e-3 here), plus n * 2^-149 for fp32 underflow.  The one rounding to the output dtype adds half an
ulp of the output.  The float64 oracle itself is off by at most (K + 3) * 2^-53 * sum_k |t_k|.
``tensor_cores=True`` switches to the bound of the tensor-core kernels (kernels/hmma_gemv.py and
kernels/weight_only.py, derived in tests/test_kernels_hmma.py): all K products in one fp32 accumulation that may
truncate, the accumulator scaled by 2^-fold (``fold``: the kernel's, hmma's by default).  Each kernel spec says
which bound it needs (``KernelSpec.error_model``); ``bound_options`` reads it for a call of gemv.
"""

import torch

from fp4gemv import FP4Tensor, dequantize, formats, ops
from fp4gemv.reference import gemv_reference, quantized_gemv_reference

LAYOUTS = ("linear", "swizzled")
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Interpreter on CPU tensors without a GPU (conftest), the compiled kernel on CUDA tensors with one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIGNIFICAND_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24}
MIN_SUBNORMAL = {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133, torch.float32: 2.0**-149}


# --- operands ---------------------------------------------------------------------------------------------


def random_fp4(shape, fmt, layout, seed, global_scale=None, device=DEVICE):
    """All 16 codes; NVFP4 scales ±(1 + m/8) 2^e, e in -9..2 (some negative), MXFP4 2^-9 .. 2^2."""
    g = torch.Generator().manual_seed(seed)
    *batch, rows, k = shape
    f = formats.FORMATS[fmt]
    data = torch.randint(0, 256, (*batch, rows, k // 2), dtype=torch.uint8, generator=g)
    scale_shape = (*batch, rows, k // f.block_size)
    if fmt == "nvfp4":
        mag = (1 + torch.randint(0, 8, scale_shape, generator=g) / 8) * torch.exp2(
            torch.randint(-9, 3, scale_shape, generator=g).float())
        sign = torch.where(torch.rand(scale_shape, generator=g) < 0.1, -1.0, 1.0)
        scales = formats.encode_e4m3(mag * sign)
    else:
        scales = torch.randint(127 - 9, 127 + 3, scale_shape, generator=g).to(torch.uint8)
    t = FP4Tensor(data, scales, fmt, "linear").with_scale_layout(layout)
    return FP4Tensor(t.data.to(device), t.scales.to(device), fmt, layout,
                     None if global_scale is None else torch.tensor(global_scale, device=device))


def random_activation(shape, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def values(t):
    return dequantize(t, torch.float64) if isinstance(t, FP4Tensor) else t.to(torch.float64)


def _fold_exponent(b):
    """f such that the tensor-core kernel's fp32 accumulator holds the result (before global scales) times
    2^-f: its 16-bit operands carry 2^-14 per NVFP4 operand in fp16, 2^-7 for bf16 (kernels/hmma_gemv.py)."""
    if isinstance(b, FP4Tensor):
        return 28
    return {torch.float16: 14, torch.bfloat16: 7}[b.dtype]


def _global_scale(t):
    return 1.0 if not isinstance(t, FP4Tensor) or t.global_scale is None else abs(float(t.global_scale))


def error_bound(a, b, out_dtype, got, tensor_cores=False, fold=None):
    """Largest |got - exact| a correct kernel can produce (module docstring), elementwise.

    ``tensor_cores``: the bound of the tensor-core kernels instead (tests/test_kernels_hmma.py's docstring):
    depth K + 24, unit roundoff 2^-23 (truncation), the underflow term scaled up by the epilogue's fold
    (``fold``, hmma's ``_fold_exponent`` when None).
    """
    b_abs = values(b).abs()
    magnitude = gemv_reference(values(a).abs(), b_abs[None, :] if b_abs.dim() == 1 else b_abs, torch.float64)
    if b_abs.dim() == 1:
        magnitude = magnitude[..., 0]
    f = (_fold_exponent(b) if fold is None else fold) if tensor_cores else 0
    fp32 = accumulation_bound(magnitude, a.k, tensor_cores, f, _global_scale(a) * _global_scale(b))
    return fp32 + oracle_bound(magnitude, a.k) + half_ulp(got, out_dtype)


def accumulation_bound(magnitude, k, tensor_cores=False, fold=0, global_scale=1.0):
    """The fp32 part of the bound (module docstring) of a sum of K products whose magnitudes sum to ``magnitude``
    (global scales included): block sums, or with ``tensor_cores`` one accumulation carrying 2^-fold until the
    global scale ``global_scale`` (a number or a tensor broadcasting with ``magnitude``) is applied."""
    if tensor_cores:
        n = k + 24
        underflow = n * 2.0**-149 * torch.clamp(torch.as_tensor(2.0**fold * global_scale, dtype=torch.float64),
                                                min=1.0)
        return 1.01 * n * 2.0**-23 * magnitude + underflow
    n = k // 16 + 22
    return 1.01 * n * 2.0**-24 * magnitude + n * 2.0**-149


def oracle_bound(magnitude, k):
    """How far the float64 oracle itself may lie from the exact sum."""
    return (k + 3) * 2.0**-53 * magnitude


def half_ulp(got, out_dtype):
    """Half an ulp of each output in ``out_dtype`` (the one rounding)."""
    mantissa, exponent = torch.frexp(got.to(torch.float64).abs())
    ulp = torch.exp2((exponent - SIGNIFICAND_BITS[out_dtype]).to(torch.float64))
    ulp = torch.where(got == 0, 0.0, ulp).clamp(min=MIN_SUBNORMAL[out_dtype])
    return ulp / 2


def on_oracle_device(*tensors):
    """The tensors on DEVICE, where the oracle runs: it is as exact on the GPU as on the CPU (module docstring),
    and a task-sized one takes seconds on the CPU (7168 x 16384: 18 s on a 2-core machine), so a test that
    moved its result to the CPU still gets its oracle on the GPU."""
    return tuple(t.to(DEVICE) for t in tensors)


def within_bound(got, a, b, out_dtype, tensor_cores=False, fold=None):
    """Elementwise: got is finite and within the derived bound of the exact result of gemv(a, b), computed on
    DEVICE."""
    got, a, b = on_oracle_device(got, a, b)
    exact = quantized_gemv_reference(a, b, torch.float64)
    got64 = got.to(torch.float64)
    return torch.isfinite(got64) & ((got64 - exact).abs() <= error_bound(a, b, out_dtype, got, tensor_cores, fold))


def assert_matches_exact(got, a, b, out_dtype, tensor_cores=False, fold=None):
    ok = within_bound(got, a, b, out_dtype, tensor_cores, fold)
    if not ok.all():
        got, a, b = on_oracle_device(got, a, b)
        exact = quantized_gemv_reference(a, b, torch.float64)
        bad = (~ok).nonzero()[:5].tolist()
        detail = [(i, got[tuple(i)].item(), exact[tuple(i)].item()) for i in bad]
        raise AssertionError(f"{int((~ok).sum())} of {got.numel()} outputs off the exact result; first: {detail}")


def dtype_name(x):
    """A dtype (or anything else) as a short test-id string: ``torch.bfloat16`` -> ``bfloat16``."""
    return str(x).replace("torch.", "")


def one_hot_activation(k, n, activation, fmt="nvfp4"):
    """[L = K / n, n, K]: batch l, row i is 1 at element n * l + i, else 0; in ``activation`` (a float dtype) or
    FP4 (``"fp4"``) of ``fmt`` with unit scales, swizzled."""
    L = k // n
    hot = torch.zeros(L, n, k)
    hot[torch.arange(L)[:, None], torch.arange(n)[None, :], n * torch.arange(L)[:, None] + torch.arange(n)] = 1
    if activation != "fp4":
        return hot.to(activation)
    block = formats.FORMATS[fmt].block_size
    encode = formats.encode_e4m3 if fmt == "nvfp4" else formats.encode_e8m0
    scales = encode(torch.ones(L, n, k // block))
    return FP4Tensor(formats.pack_e2m1(formats.encode_e2m1(hot)), scales, fmt, "linear").with_scale_layout(
        "swizzled")


def poisoned(shape, dtype, device=DEVICE):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def build_case(fmt, activation, n, layout, shape, global_scales, seed):
    """(a, b): a in ``layout``; an FP4 b in the other layout, so both mixtures are covered."""
    m, k, L = shape
    batch = (L,) if L > 1 else ()
    a = random_fp4((*batch, m, k), fmt, layout, seed, global_scale=0.75 if global_scales else None)
    b_shape = (k,) if n == "vector" else (*batch, n, k)
    if activation == "fp4":
        other = "swizzled" if layout == "linear" else "linear"
        b = random_fp4(b_shape, fmt, other, seed + 1, global_scale=1.375 * 2.0**-3 if global_scales else None)
    else:
        b = random_activation(b_shape, activation, seed + 1)
    return a, b


def result_shape(a, b):
    return ops.result_shape(a, b)


def accumulator_fold(plan) -> int:
    """The fold exponent of the accumulators of the kernel a plan runs (its spec's ``ErrorModel``)."""
    return plan.spec.error_model(plan.case, plan.config).fold


def bound_options(a, b, backend="triton", **kw) -> dict:
    """The ``assert_matches_exact`` options for what gemv(a, b, backend=backend, **kw) runs: the kernel spec's
    ``ErrorModel`` (block sums, or tensor cores with the kernel's fold)."""
    plan = ops.plan_for(a, b, backend=backend, **kw)
    return plan.spec.error_model(plan.case, plan.config)._asdict()
