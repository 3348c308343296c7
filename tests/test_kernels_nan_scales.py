"""A NaN scale byte (e4m3 0x7F / 0xFF, e8m0 0xFF) through every GEMV kernel: the outputs of the rows (weight
scales) or columns (activation scales) whose blocks use it are NaN, the others exact, as in the oracle
(``quantized_gemv_reference``, which decodes those bytes as NaN: ``formats.decode_e4m3`` / ``decode_e8m0``).

``backend="triton"`` runs each kernel's pure-Triton path: in Triton's interpreter on a CPU-only machine (which
decodes e4m3 0x7F / 0xFF as +-480 unless the kernel selects NaN itself), compiled on a GPU; the ``gpu`` test runs
the PTX paths.  Outputs are poisoned with a finite value first, so a NaN that was never written is caught."""

import pytest
import torch

import operands as O
from fp4gemv import FP4Tensor, dequantize, formats, gemv, moe_gemv
from fp4gemv.kernels import GEMV_KERNELS
from fp4gemv.ops import gemv_operands
from fp4gemv.reference import quantized_gemv_reference
from fp4gemv.target import resolve_target

M, K = 64, 512
POISON = -7777.0
# (kernel, format, activation, N): each kernel with each weight format and kind of activation it takes, and
# each step mode of weight_only (fold: NVFP4 N > 2, split: N <= 2, k32: MXFP4 N > 2).
CASES = [
    ("gemm", "nvfp4", torch.bfloat16, 20), ("gemm", "mxfp4", torch.float16, 17),
    ("w4a4", "nvfp4", "fp4", 1), ("w4a4", "mxfp4", "fp4", 1),
    ("stream", "nvfp4", torch.float16, 9),
    ("weight_only", "nvfp4", torch.bfloat16, 3), ("weight_only", "nvfp4", torch.float16, 1),
    ("weight_only", "mxfp4", torch.bfloat16, 5), ("weight_only", "mxfp4", torch.float16, 2),
    ("weight_only", "nvfp4", "fp4", 4), ("weight_only", "mxfp4", "fp4", 8), ("weight_only", "nvfp4", "fp4", 2),
    ("hmma", "nvfp4", torch.bfloat16, 16), ("hmma", "nvfp4", "fp4", 3),
    ("general", "nvfp4", torch.float32, 2), ("general", "mxfp4", torch.bfloat16, 1),
    ("general", "nvfp4", "fp4", 3), ("general", "mxfp4", "fp4", 1),
]


def _nan_bytes(fmt):
    """The scale bytes that decode to NaN: e4m3 0x7F and its negative 0xFF, e8m0 0xFF."""
    return (0x7F, 0xFF) if fmt == "nvfp4" else (0xFF, 0xFF)


def _with_scale_bytes(t: FP4Tensor, where: list[tuple[int, int, int]]) -> FP4Tensor:
    """``t`` with scale byte ``value`` at (row, block) for each (row, block, value) (every batch), in t's layout."""
    linear = t.linear_scales().clone()
    for row, block, value in where:
        linear[..., row, block] = value
    return FP4Tensor(t.data, linear, t.fmt.name, "linear", t.global_scale).with_scale_layout(t.scale_layout)


def _operands(fmt, act, n, nan_in, device):
    """(a, b): batch 2; NaN scales in two weight rows (``nan_in`` "a") or in one activation row ("b")."""
    a = O.random_fp4((2, M, K), fmt, "swizzled", seed=11, device=device)
    if act == "fp4":
        b = O.random_fp4((2, n, K), fmt, "linear", seed=12, device=device)
    else:
        b = O.random_activation((2, n, K), act, seed=12, device=device)
    first, second = _nan_bytes(fmt)
    blocks = K // formats.FORMATS[fmt].block_size
    if nan_in == "a":
        a = _with_scale_bytes(a, [(5, 1, first), (M - 1, blocks - 1, second)])
    else:
        b = _with_scale_bytes(b, [(n - 1, 2, first)])
    return a, b


def _assert_nan_where_the_oracle_has_it(got, a, b, **bound):
    """NaN exactly where the oracle has NaN (there is some), every other output within the kernel's bound."""
    got, a, b = O.on_oracle_device(got, a, b)  # where within_bound computes the oracle too
    exact = quantized_gemv_reference(a, b, torch.float64)
    assert exact.isnan().any()
    assert torch.equal(got.isnan(), exact.isnan()), (got.isnan().nonzero()[:8].tolist(),
                                                     exact.isnan().nonzero()[:8].tolist())
    ok = O.within_bound(got, a, b, torch.float32, **bound) | exact.isnan()
    assert ok.all(), f"{int((~ok).sum())} finite outputs off the exact result"


def _run(kernel, fmt, act, n, nan_in, backend, device):
    a, b = _operands(fmt, act, n, nan_in, device)
    target = resolve_target(backend, torch.device(device))
    case = gemv_operands(a, b, torch.empty(2, M, n, device=device)).case
    spec = next(s for s in GEMV_KERNELS if s.name == kernel)
    reason = spec.why_not(case, target)
    if reason is not None:
        pytest.skip(f"{kernel} on {target.describe()}: {reason}")
    out = torch.full((2, M, n), POISON, device=device)
    gemv(a, b, out=out, out_dtype=torch.float32, backend=backend, kernel=kernel)
    _assert_nan_where_the_oracle_has_it(out, a, b, **O.bound_options(a, b, backend=backend, kernel=kernel,
                                                                     out_dtype=torch.float32))


# NaN scales in the weights, and for FP4 activations also in the activation.
_SITES = [(*case, nan_in) for case in CASES for nan_in in (("a", "b") if case[2] == "fp4" else ("a",))]
_SITE_IDS = [f"{k}-{f}-{O.dtype_name(act)}-n{n}-nan_in_{w}" for k, f, act, n, w in _SITES]


@pytest.mark.parametrize("kernel, fmt, act, n, nan_in", _SITES, ids=_SITE_IDS)
def test_nan_scale_gives_nan_rows_triton(kernel, fmt, act, n, nan_in):
    _run(kernel, fmt, act, n, nan_in, "triton", O.DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, fmt, act, n, nan_in", _SITES, ids=_SITE_IDS)
def test_nan_scale_gives_nan_rows_ptx(kernel, fmt, act, n, nan_in):
    _run(kernel, fmt, act, n, nan_in, "triton-ptx", "cuda")


def test_the_cases_cover_every_kernel():
    """Each kernel of the table but the reference appears in ``CASES`` with each weight format it takes."""
    target = resolve_target("triton", torch.device(O.DEVICE))
    covered = {(kernel, fmt) for kernel, fmt, _, _ in CASES}
    for fmt in ("nvfp4", "mxfp4"):
        for act, n in ((torch.bfloat16, 1), (torch.bfloat16, 9), (torch.float16, 20), (torch.float32, 2),
                       ("fp4", 1), ("fp4", 4)):
            a, b = _operands(fmt, act, n, "a", O.DEVICE)
            case = gemv_operands(a, b, torch.empty(2, M, n, device=O.DEVICE)).case
            for spec in GEMV_KERNELS:
                if spec.name != "reference" and spec.why_not(case, target) is None:
                    assert (spec.name, fmt) in covered, (spec.name, fmt, act, n)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_nan_scale_through_moe_gemv(fmt):
    """The routed kernel: the pairs routed to the expert with a NaN scale are NaN in that row only, the others
    exact (the dense oracle and block-sum bound per pair, as tests/test_moe.py)."""
    w = O.random_fp4((3, M, K), fmt, "linear", seed=13, device="cpu")
    linear = w.scales.clone()
    linear[1, 7, 2] = _nan_bytes(fmt)[0]
    experts = [FP4Tensor(w.data[e], linear[e], fmt, "linear") for e in range(3)]
    w = FP4Tensor(w.data, linear, fmt, "linear").with_scale_layout("swizzled").to(O.DEVICE)
    x = O.random_activation((2, K), torch.bfloat16, seed=14)
    ids = torch.tensor([[0, 1], [1, 2]], device=O.DEVICE)
    out = torch.full((2, 2, M), POISON, device=O.DEVICE)
    moe_gemv(w, x, ids, out=out, out_dtype=torch.float32, backend="triton")
    out = out.cpu()
    expected_nan = torch.zeros(2, 2, M, dtype=torch.bool)
    expected_nan[0, 1, 7] = expected_nan[1, 0, 7] = True
    assert torch.equal(out.isnan(), expected_nan)
    for t in range(2):
        for j in range(2):
            expert = experts[int(ids[t, j])]
            got = out[t, j][:, None]
            ok = O.within_bound(got, expert, x[t:t + 1].cpu(), torch.float32) | expected_nan[t, j][:, None]
            assert ok.all(), (t, j)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_nan_scale_through_dequantize(fmt):
    """The dequantize kernel decodes scales through the same helper: NaN in exactly the blocks of a NaN byte."""
    a = O.random_fp4((M, K), fmt, "swizzled", seed=15)
    first, second = _nan_bytes(fmt)
    a = _with_scale_bytes(a, [(3, 0, first), (40, 5, second)])
    values = dequantize(a, torch.float32, backend="triton").cpu()
    bs = formats.FORMATS[fmt].block_size
    expected = torch.zeros(M, K // bs, dtype=torch.bool)
    expected[3, 0] = expected[40, 5] = True
    assert torch.equal(values.isnan().reshape(M, -1, bs).any(-1), expected)
    assert torch.equal(values.isnan().reshape(M, -1, bs).all(-1), expected)
