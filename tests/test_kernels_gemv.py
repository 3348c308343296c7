"""The general GEMV kernel against the exact oracle, with an error bound derived from its arithmetic.

On a CPU-only machine the pure-Triton decode runs in Triton's interpreter (conftest sets TRITON_INTERPRET),
which exercises indexing, both scale layouts, masking, N padding and the epilogue.  ``gpu`` tests check the
PTX decode bit for bit against the pure-Triton one, the N = 1 NVFP4 case against ``w4a4.py``, and a fuzz.

The bound.  Every operation after the exact decode is one fp32 rounding (unit roundoff u = 2^-24) on the
path of a term t_k = a_k * b_k to the result: at most 1 for the W4A16 product, 15 in a 16-element block
sum, 1 for the scale product, NB for the K-loop additions plus the final sum over BLOCKS columns (together
<= NB + 1 for a power-of-two BLOCKS <= NB, and fewer when BLOCKS > NB), 2 for the global scales.  With
n = NB + 22 >= that depth, the fp32 result s' obeys |s' - s| <= 1.01 * n * u * sum_k |t_k| (gamma_n;
n * u < 1e-3 here), plus n * 2^-149 for fp32 underflow.  The one rounding to the output dtype adds half an
ulp of the output.  The float64 oracle itself is off by at most (K + 3) * 2^-53 * sum_k |t_k|.
``tensor_cores=True`` switches to the bound of the tensor-core kernel (kernels/hmma_gemv.py, derived in
tests/test_kernels_hmma.py): all K products in one fp32 accumulation that may truncate.
"""

import itertools

import pytest
import torch

from fp4gemv import FP4Tensor, formats, gemv, ops, task
from fp4gemv.gemv import _is_hmma_case
from fp4gemv.kernels.configs import GemvConfig, w4a4_config
from fp4gemv.kernels.gemv_configs import GemvKernelConfig, gemv_config
from fp4gemv.reference import gemv_reference, quantized_gemv_reference

# Interpreter on CPU tensors without a GPU (conftest), the compiled kernel on CUDA tensors with one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# 64 rows: M = 200 leaves a tail of 8; 8 blocks: K = 64 is one masked step, 192 ends in a partial one.
SMALL = GemvKernelConfig(rows=64, blocks=8, num_warps=4)
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
    return t.dequantize(torch.float64) if isinstance(t, FP4Tensor) else t.to(torch.float64)


def _fold_exponent(b):
    """f such that the tensor-core kernel's fp32 accumulator holds the result (before global scales) times
    2^-f: its 16-bit operands carry 2^-14 per NVFP4 operand in fp16, 2^-7 for bf16 (kernels/hmma_gemv.py)."""
    if isinstance(b, FP4Tensor):
        return 28
    return {torch.float16: 14, torch.bfloat16: 7}[b.dtype]


def _global_scale(t):
    return 1.0 if not isinstance(t, FP4Tensor) or t.global_scale is None else abs(float(t.global_scale))


def error_bound(a, b, out_dtype, got, tensor_cores=False):
    """Largest |got - exact| a correct kernel can produce (module docstring), elementwise.

    ``tensor_cores``: the bound of kernels/hmma_gemv.py instead (tests/test_kernels_hmma.py's docstring):
    depth K + 24, unit roundoff 2^-23 (truncation), the underflow term scaled up by the epilogue's fold.
    """
    b_abs = values(b).abs()
    magnitude = gemv_reference(values(a).abs(), b_abs[None, :] if b_abs.dim() == 1 else b_abs, torch.float64)
    if b_abs.dim() == 1:
        magnitude = magnitude[..., 0]
    if tensor_cores:
        n = a.k + 24
        gs = _global_scale(a) * _global_scale(b)
        fp32 = 1.01 * n * 2.0**-23 * magnitude + n * 2.0**-149 * max(1.0, 2.0 ** _fold_exponent(b) * gs)
    else:
        n = a.k // 16 + 22
        fp32 = 1.01 * n * 2.0**-24 * magnitude + n * 2.0**-149
    oracle = (a.k + 3) * 2.0**-53 * magnitude
    mantissa, exponent = torch.frexp(got.to(torch.float64).abs())
    ulp = torch.exp2((exponent - SIGNIFICAND_BITS[out_dtype]).to(torch.float64))
    ulp = torch.where(got == 0, 0.0, ulp).clamp(min=MIN_SUBNORMAL[out_dtype])
    return fp32 + oracle + ulp / 2


def within_bound(got, a, b, out_dtype, tensor_cores=False):
    """Elementwise: got is finite and within the derived bound of the exact result of gemv(a, b)."""
    exact = quantized_gemv_reference(a, b, torch.float64)
    got64 = got.to(torch.float64)
    return torch.isfinite(got64) & ((got64 - exact).abs() <= error_bound(a, b, out_dtype, got, tensor_cores))


def assert_matches_exact(got, a, b, out_dtype, tensor_cores=False):
    ok = within_bound(got, a, b, out_dtype, tensor_cores)
    if not ok.all():
        exact = quantized_gemv_reference(a, b, torch.float64)
        bad = (~ok).nonzero()[:5].tolist()
        detail = [(i, got[tuple(i)].item(), exact[tuple(i)].item()) for i in bad]
        raise AssertionError(f"{int((~ok).sum())} of {got.numel()} outputs off the exact result; first: {detail}")


def poisoned(shape, dtype, device=DEVICE):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# --- every format x activation x N x scale layout x out dtype -------------------------------------------

FORMATS = ("nvfp4", "mxfp4")
ACTIVATIONS = ("fp4", torch.float16, torch.bfloat16, torch.float32)
NS = (1, 3, 16, "vector")
LAYOUTS = ("linear", "swizzled")
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (M, K, L) cycled through the cases: tail rows (200), one masked step (64), a partial last step (192).
SHAPES = ((128, 64, 1), (200, 192, 2), (200, 128, 1), (128, 192, 2))
# An FP4Tensor has a row dimension: the [K] vector case is for float activations.
CASES = [
    (*case, SHAPES[i % len(SHAPES)], (i // len(SHAPES)) % 2 == 1)
    for i, case in enumerate(
        c for c in itertools.product(FORMATS, ACTIVATIONS, NS, LAYOUTS, OUT_DTYPES) if c[1:3] != ("fp4", "vector")
    )
]


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
    return (*a.shape[:-1], *b.shape[:-1]) if len(b.shape) < 3 else (*a.shape[:-1], b.shape[-2])


@pytest.mark.parametrize(
    "fmt, activation, n, layout, out_dtype, shape, global_scales",
    CASES,
    ids=[f"{c[0]}-{str(c[1]).replace('torch.', '')}-n{c[2]}-{c[3]}-{str(c[4]).replace('torch.', '')}-"
         f"{'x'.join(map(str, c[5]))}{'-gs' if c[6] else ''}" for c in CASES],
)
def test_kernel_matches_exact_result(fmt, activation, n, layout, out_dtype, shape, global_scales):
    a, b = build_case(fmt, activation, n, layout, shape, global_scales, seed=sum(shape))
    out = poisoned(result_shape(a, b), out_dtype)
    got = gemv(a, b, out=out, out_dtype=out_dtype, backend="triton", config=SMALL)
    assert got is out
    assert not torch.isnan(got).any(), "some outputs were not written"
    assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), out_dtype)


def test_cases_cover_shapes_and_global_scales_for_every_format_and_activation():
    for fmt, activation in itertools.product(FORMATS, ACTIVATIONS):
        seen = {(c[5], c[6]) for c in CASES if c[0] == fmt and c[1] == activation}
        assert seen == set(itertools.product(SHAPES, (False, True)))


@pytest.mark.parametrize("fmt, activation, n", [("nvfp4", "fp4", 1), ("mxfp4", torch.bfloat16, 3),
                                                ("nvfp4", torch.float16, 16), ("mxfp4", "fp4", 16)])
def test_kernel_with_default_config(fmt, activation, n):
    a, b = build_case(fmt, activation, n, "swizzled", (200, 192, 2), True, seed=5)
    got = gemv(a, b, out=poisoned((2, 200, n), torch.float16), backend="triton")
    # ("nvfp4", float16, 16) runs the tensor-core kernel (kernels/hmma_gemv.py), with its own bound.
    assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), torch.float16, tensor_cores=_is_hmma_case(a, b))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy overflows where the GPU gives inf
def test_kernel_decodes_e8m0_extremes():
    """e8m0 bytes 0 (2^-127, an fp32 subnormal), 254 (2^127) and 255 (NaN)."""
    scales = torch.full((128, 2), 127, dtype=torch.uint8)
    scales[0], scales[1], scales[2, 0] = 0, 254, 255
    a = FP4Tensor(random_fp4((128, 64), "mxfp4", "linear", seed=3, device="cpu").data, scales, "mxfp4").to(DEVICE)
    x = torch.stack([torch.full((64,), 2.0**100), torch.full((64,), 2.0**-120)]).to(DEVICE)  # [2, 64] fp32
    got = gemv(a, x, out_dtype=torch.float32, backend="triton", config=SMALL).cpu()
    ok = within_bound(got, a.to("cpu"), x.to("cpu"), torch.float32)
    assert ok[0, 0] and ok[1, 1] and ok[3:].all()  # (row 0, 2^100) and (row 1, 2^-120) stay finite
    assert torch.isnan(got[2]).all()


# --- the bound cannot pass a wrong kernel ---------------------------------------------------------------


def _swap_nibbles(t, rows):
    data = t.data.clone()
    data[..., rows, :8] = (data[..., rows, :8] >> 4) | (data[..., rows, :8] << 4)
    return FP4Tensor(data, t.scales, t.fmt, t.scale_layout, t.global_scale)


def _shift_scales(t):
    """Each row's scales moved one block along K (the first block reuses its own): an off-by-one."""
    lin = t.linear_scales().clone()
    lin[..., 1:] = t.linear_scales()[..., :-1]
    return FP4Tensor(t.data, lin, t.fmt, "linear", t.global_scale)


@pytest.mark.parametrize("fmt, activation", [("nvfp4", "fp4"), ("mxfp4", torch.float32), ("nvfp4", torch.bfloat16)])
def test_bound_rejects_plausible_bugs(fmt, activation):
    """The kernel's correct output, checked against the exact result of a slightly wrong operand, fails."""
    a, b = build_case(fmt, activation, 3, "swizzled", (128, 128, 1), False, seed=9)
    got = gemv(a, b, out_dtype=torch.float32, backend="triton", config=SMALL).cpu()
    a, b = a.to("cpu"), b.to("cpu")
    assert within_bound(got, a, b, torch.float32).all()
    rows = torch.arange(0, 128, 7)
    assert not within_bound(got, _swap_nibbles(a, rows), b, torch.float32)[rows].any(), "element order"
    assert (~within_bound(got, _shift_scales(a), b, torch.float32)).float().mean() > 0.9, "scale columns"
    b_swapped = b.flip(0) if isinstance(b, torch.Tensor) else FP4Tensor(
        b.data.flip(0), b.linear_scales().flip(0), b.fmt, "linear", b.global_scale)
    assert (~within_bound(got, a, b_swapped, torch.float32)[:, [0, 2]]).float().mean() > 0.9, "activation rows"


# --- batch broadcast, strided out and activation ------------------------------------------------------


def test_kernel_broadcasts_a_missing_batch_dimension():
    a = random_fp4((200, 128), "nvfp4", "swizzled", seed=1)
    b = random_fp4((2, 3, 128), "nvfp4", "linear", seed=2)
    got = gemv(a, b, out=poisoned((2, 200, 3), torch.float32), out_dtype=torch.float32, backend="triton", config=SMALL)
    assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), torch.float32)
    x = random_activation((3, 128), torch.float16, seed=3)
    a3 = random_fp4((2, 200, 128), "mxfp4", "linear", seed=4)
    got = gemv(a3, x, out=poisoned((2, 200, 3), torch.float16), backend="triton", config=SMALL)
    assert_matches_exact(got.cpu(), a3.to("cpu"), x.to("cpu"), torch.float16)


def test_kernel_writes_strided_out_and_reads_strided_activation():
    a = random_fp4((2, 200, 192), "mxfp4", "swizzled", seed=6)
    x = random_activation((2, 192, 5), torch.bfloat16, seed=7).transpose(1, 2)  # K not contiguous
    backing = poisoned((5, 2, 400), torch.float32)
    out = backing[:, :, ::2].permute(1, 2, 0)  # [2, 200, 5], no unit stride
    got = gemv(a, x, out=out, out_dtype=torch.float32, backend="triton", config=SMALL)
    assert got is out
    assert_matches_exact(got.cpu(), a.to("cpu"), x.to("cpu"), torch.float32)
    assert torch.isnan(backing[:, :, 1::2]).all(), "wrote outside out"


# --- the N = 1 NVFP4 case is w4a4.py's kernel ----------------------------------------------------------


def _task_operands(m, k, L, seed, device):
    data = task.generate_full_range_input(m, k, L, seed=seed, device=device)
    a, b, _, _, sfa_p, sfb_p, c = data
    return data, FP4Tensor.from_task(a, sfa_p), FP4Tensor.from_task(b, sfb_p).first_rows(1)


@pytest.mark.parametrize("m, k, L, rows, blocks", [(128, 192, 2, 16, 8), (256, 512, 1, 8, 16)])
def test_w4a4_case_runs_the_task_kernel(m, k, L, rows, blocks):
    """NVFP4 x NVFP4, N = 1 goes to kernels/w4a4.py: bit for bit what ops.task_gemv computes."""
    data, a, b = _task_operands(m, k, L, seed=m + k, device=DEVICE)
    c = data[6].fill_(float("nan"))
    cfg = GemvConfig(rows, blocks, 4)
    ops.task_gemv(data[0], data[1], data[4], data[5], c, backend="triton", config=cfg)
    ours = gemv(a, b, backend="triton", config=cfg)
    assert torch.equal(ours.view(torch.int16), c.permute(2, 0, 1).view(torch.int16))
    # The general kernel, forced by its own config type, computes the same product (other summation order).
    general = gemv(a, b, backend="triton", config=GemvKernelConfig(rows, blocks, 4))
    assert_matches_exact(general.to("cpu"), a.to("cpu"), b.to("cpu"), torch.float16)


# --- configurations -------------------------------------------------------------------------------------


def test_configs_are_powers_of_two_within_k_and_register_budget():
    shapes = itertools.product((128, 4096, 28672), (16, 64, 192, 2048, 16384), (1, 2, 3, 9, 16), (True, False))
    for m, k, n, fp4 in shapes:
        cfg = gemv_config(m, k, 1, n, fp4_activation=fp4)
        for v in (cfg.rows, cfg.blocks):
            assert v >= 1 and v & (v - 1) == 0, cfg
        assert cfg.blocks <= k // 16
        n_pad = 1 << (n - 1).bit_length()
        if fp4 and n == 1:  # w4a4.py's measured tile, [rows, ksplit, blocks] -> [rows, 1, ksplit * blocks]
            w4a4 = w4a4_config(m, k, 1)
            assert (cfg.rows, cfg.blocks, cfg.num_warps) == (w4a4.rows, w4a4.blocks * w4a4.ksplit, w4a4.num_warps)
        elif fp4:
            assert cfg.rows * n_pad * cfg.blocks <= 1024
        else:
            assert cfg.rows * n_pad * cfg.blocks * 16 <= 4096


# --- compiled for the GPU without one ------------------------------------------------------------------

# Compiles gemv_kernel ahead of time for sm_90 down to a cubin (Triton's bundled ptxas): the interpreter
# never builds the PTX decode or the compiled dtype paths, and accepts Python globals that compiled Triton
# rejects.  Run in a fresh interpreter because TRITON_INTERPRET=1 (conftest) changes what @triton.jit makes.
_AOT_SCRIPT = """
import itertools, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp4gemv.kernels.gemv import gemv_kernel
from fp4gemv.kernels.gemv_configs import gemv_config
cases = [  # fp4 activation, activation dtype, out dtype, n, scale block, ptx, global scales, even k
    (True, "i64", "fp16", 1, 16, True, False, True), (True, "i64", "bf16", 3, 32, True, True, False),
    (True, "i64", "fp32", 16, 16, True, True, True), (True, "i64", "fp16", 5, 32, False, False, False),
    (False, "fp16", "fp16", 1, 16, True, False, True), (False, "bf16", "bf16", 3, 32, False, True, False),
    (False, "fp32", "fp32", 16, 16, True, True, True),
]
for fp4, act, out, n, sb, ptx, gs, even in cases:
    cfg = gemv_config(4096, 4096, 1, n, fp4_activation=fp4)
    const = dict(N=n, N_PAD=triton.next_power_of_2(n), ROWS=cfg.rows, BLOCKS=cfg.blocks, SCALE_BLOCK=sb,
                 FP4_ACTIVATION=fp4, HAS_GSA=gs, HAS_GSB=gs and fp4, EVEN_K=even, USE_PTX=ptx)
    ptrs = dict(a_ptr="*i64", sfa_ptr="*u8", b_ptr="*" + act, sfb_ptr="*u8", gsa_ptr="*fp32", gsb_ptr="*fp32",
                c_ptr="*" + out)
    sig = {a: ptrs.get(a, "constexpr" if a in const else "i32") for a in gemv_kernel.arg_names}
    kernel = triton.compile(ASTSource(gemv_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=cfg.num_warps))
    assert kernel.asm["cubin"] and ("dp4a" in kernel.asm["ptx"]) == (fp4 and ptx)
print("compiled", len(cases))
"""


def test_kernel_compiles_for_sm90_without_a_gpu(compile_for_sm90):
    assert "compiled 7" in compile_for_sm90(_AOT_SCRIPT)


# --- GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", (1, 3, 16))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ptx_and_triton_decodes_agree_bitwise(fmt, n, layout):
    a, b = build_case(fmt, "fp4", n, layout, (2432, 4608, 2), True, seed=n)
    # The general kernel (its config type forces it): NVFP4 with N > 1 would otherwise run the tensor-core
    # kernel, whose twin sums in another order.
    cfg = gemv_config(2432, 4608, 2, n, fp4_activation=True)
    ptx = gemv(a, b, out_dtype=torch.float32, backend="triton-ptx", config=cfg)
    pure = gemv(a, b, out_dtype=torch.float32, backend="triton", config=cfg)
    assert torch.equal(ptx.view(torch.int32), pure.view(torch.int32))
    assert_matches_exact(ptx.to("cpu"), a.to("cpu"), b.to("cpu"), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, L", [(128, 256, 1), (2432, 4608, 2), (7168, 2048, 4), (384, 192, 3)])
def test_w4a4_case_runs_the_task_kernel_on_gpu(m, k, L):  # (the task's generator needs M % 128 == 0)
    data, a, b = _task_operands(m, k, L, seed=1, device="cuda")
    for backend in ("triton-ptx", "triton"):
        c = data[6].fill_(float("nan"))
        ops.task_gemv(data[0], data[1], data[4], data[5], c, backend=backend)
        ours = gemv(a, b, backend=backend)
        assert torch.equal(ours.view(torch.int16), c.permute(2, 0, 1).view(torch.int16)), backend
        general = gemv(a, b, backend=backend, config=gemv_config(m, k, L, 1, fp4_activation=True))
        assert_matches_exact(general.cpu(), a.to("cpu"), b.to("cpu"), torch.float16)


@pytest.mark.gpu
def test_fuzz_on_gpu():
    g = torch.Generator().manual_seed(12)
    for i in range(48):
        fmt, activation, n, layout, out_dtype, _, _ = CASES[int(torch.randint(0, len(CASES), (1,), generator=g))]
        m = int(torch.randint(1, 3000, (1,), generator=g))
        k = 64 * int(torch.randint(1, 80, (1,), generator=g))
        L = int(torch.randint(1, 5, (1,), generator=g))
        a, b = build_case(fmt, activation, n, layout, (m, k, L), bool(i % 2), seed=100 + i)
        got = gemv(a, b, out=poisoned(result_shape(a, b), out_dtype), out_dtype=out_dtype)
        # The default dispatch sends NVFP4 x fp16/bf16 and NVFP4 x NVFP4 with N > 1 to the tensor-core kernel.
        assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), out_dtype, tensor_cores=_is_hmma_case(a, b))
