"""The general GEMV kernel (kernels/general.py) against the exact oracle, within the error bound derived in
tests/operands.py.

On a CPU-only machine the pure-Triton decode runs in Triton's interpreter (conftest sets TRITON_INTERPRET),
which exercises indexing, both scale layouts, masking, N padding and the epilogue.  ``gpu`` tests check the
PTX decode bit for bit against the pure-Triton one, the N = 1 NVFP4 case against ``w4a4.py``, and a fuzz.
"""

import itertools

import pytest
import torch
from operands import (
    DEVICE,
    LAYOUTS,
    OUT_DTYPES,
    assert_matches_exact,
    bound_options,
    build_case,
    poisoned,
    random_activation,
    random_fp4,
    result_shape,
    within_bound,
)

from fp4gemv import FP4Tensor, gemv, select_kernel, task
from fp4gemv.kernels.general import GeneralConfig, general_config
from fp4gemv.kernels.w4a4 import W4A4Config, w4a4_config

# 64 rows: M = 200 leaves a tail of 8; 8 blocks: K = 64 is one masked step, 192 ends in a partial one.
SMALL = GeneralConfig(rows=64, blocks=8, num_warps=4)


# --- every format x activation x N x scale layout x out dtype -------------------------------------------

FORMATS = ("nvfp4", "mxfp4")
ACTIVATIONS = ("fp4", torch.float16, torch.bfloat16, torch.float32)
NS = (1, 3, 16, "vector")
# (M, K, L) cycled through the cases: tail rows (200), one masked step (64), a partial last step (192).
SHAPES = ((128, 64, 1), (200, 192, 2), (200, 128, 1), (128, 192, 2))
# An FP4Tensor has a row dimension: the [K] vector case is for float activations.
CASES = [
    (*case, SHAPES[i % len(SHAPES)], (i // len(SHAPES)) % 2 == 1)
    for i, case in enumerate(
        c for c in itertools.product(FORMATS, ACTIVATIONS, NS, LAYOUTS, OUT_DTYPES) if c[1:3] != ("fp4", "vector")
    )
]


@pytest.mark.parametrize(
    "fmt, activation, n, layout, out_dtype, shape, global_scales",
    CASES,
    ids=[f"{c[0]}-{str(c[1]).replace('torch.', '')}-n{c[2]}-{c[3]}-{str(c[4]).replace('torch.', '')}-"
         f"{'x'.join(map(str, c[5]))}{'-gs' if c[6] else ''}" for c in CASES],
)
def test_kernel_matches_exact_result(fmt, activation, n, layout, out_dtype, shape, global_scales):
    a, b = build_case(fmt, activation, n, layout, shape, global_scales, seed=sum(shape))
    out = poisoned(result_shape(a, b), out_dtype)
    got = gemv(a, b, out=out, out_dtype=out_dtype, backend="triton", kernel="general", config=SMALL)
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
    """The general kernel's default configuration (the dispatcher prefers other kernels for these cases)."""
    a, b = build_case(fmt, activation, n, "swizzled", (200, 192, 2), True, seed=5)
    got = gemv(a, b, out=poisoned((2, 200, n), torch.float16), backend="triton", kernel="general")
    assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), torch.float16)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy overflows where the GPU gives inf
def test_kernel_decodes_e8m0_extremes():
    """e8m0 bytes 0 (2^-127, an fp32 subnormal), 254 (2^127) and 255 (NaN)."""
    scales = torch.full((128, 2), 127, dtype=torch.uint8)
    scales[0], scales[1], scales[2, 0] = 0, 254, 255
    a = FP4Tensor(random_fp4((128, 64), "mxfp4", "linear", seed=3, device="cpu").data, scales, "mxfp4").to(DEVICE)
    x = torch.stack([torch.full((64,), 2.0**100), torch.full((64,), 2.0**-120)]).to(DEVICE)  # [2, 64] fp32
    got = gemv(a, x, out_dtype=torch.float32, backend="triton", kernel="general", config=SMALL).cpu()
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
    got = gemv(a, b, out_dtype=torch.float32, backend="triton", kernel="general", config=SMALL).cpu()
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
    got = gemv(a, b, out=poisoned((2, 200, 3), torch.float32), out_dtype=torch.float32, backend="triton", kernel="general", config=SMALL)
    assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), torch.float32)
    x = random_activation((3, 128), torch.float16, seed=3)
    a3 = random_fp4((2, 200, 128), "mxfp4", "linear", seed=4)
    got = gemv(a3, x, out=poisoned((2, 200, 3), torch.float16), backend="triton", kernel="general", config=SMALL)
    assert_matches_exact(got.cpu(), a3.to("cpu"), x.to("cpu"), torch.float16)


def test_kernel_writes_strided_out_and_reads_strided_activation():
    a = random_fp4((2, 200, 192), "mxfp4", "swizzled", seed=6)
    x = random_activation((2, 192, 5), torch.bfloat16, seed=7).transpose(1, 2)  # K not contiguous
    backing = poisoned((5, 2, 400), torch.float32)
    out = backing[:, :, ::2].permute(1, 2, 0)  # [2, 200, 5], no unit stride
    got = gemv(a, x, out=out, out_dtype=torch.float32, backend="triton", kernel="general", config=SMALL)
    assert got is out
    assert_matches_exact(got.cpu(), a.to("cpu"), x.to("cpu"), torch.float32)
    assert torch.isnan(backing[:, :, 1::2]).all(), "wrote outside out"


# --- the N = 1 NVFP4 case is w4a4.py's kernel ----------------------------------------------------------


def _task_operands(m, k, L, seed, device):
    data = task.generate_full_range_input(m, k, L, seed=seed, device=device)
    a, b, _, _, sfa_p, sfb_p, c = data
    return data, FP4Tensor.from_task(a, sfa_p), FP4Tensor.from_task(b, sfb_p).first_rows(1)


@pytest.mark.parametrize("m, k, L, rows, blocks", [(128, 192, 2, 16, 8), (256, 512, 1, 8, 16)])
def test_general_kernel_computes_the_w4a4_case(m, k, L, rows, blocks):
    """NVFP4 x NVFP4, N = 1 goes to kernels/w4a4.py; the general kernel, asked for by name, computes the same
    product (another summation order)."""
    data, a, b = _task_operands(m, k, L, seed=m + k, device=DEVICE)
    assert select_kernel(a, b, backend="triton").name == "w4a4"
    ours = gemv(a, b, backend="triton", config=W4A4Config(rows, blocks, 4))
    assert_matches_exact(ours.to("cpu"), a.to("cpu"), b.to("cpu"), torch.float16)
    general = gemv(a, b, backend="triton", kernel="general", config=GeneralConfig(rows, blocks, 4))
    assert_matches_exact(general.to("cpu"), a.to("cpu"), b.to("cpu"), torch.float16)


# --- configurations -------------------------------------------------------------------------------------


def test_configs_are_powers_of_two_within_k_and_register_budget():
    shapes = itertools.product((128, 4096, 28672), (16, 64, 192, 2048, 16384), (1, 2, 3, 9, 16), (True, False))
    for m, k, n, fp4 in shapes:
        cfg = general_config(m, k, 1, n, fp4_activation=fp4)
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

# Compiles gemv_kernel ahead of time for sm_90 down to a cubin (Triton's bundled ptxas), as the JIT specializes
# real calls (tests/aot.py): the interpreter never builds the PTX decode or the compiled dtype paths, and accepts
# Python globals that compiled Triton rejects.
_AOT_SCRIPT = """
import torch
from aot import Sm90Launch
from operands import random_activation, random_fp4
cases = [  # format, activation, out dtype, n, K (K = 48 and 80: a partial last step), global scales, PTX
    ("nvfp4", "fp4", torch.float16, 1, 4096, False), ("mxfp4", "fp4", torch.bfloat16, 3, 4000 // 32 * 32, True),
    ("nvfp4", "fp4", torch.float32, 16, 4096, True), ("mxfp4", "fp4", torch.float16, 5, 96, False),
    ("nvfp4", torch.float16, torch.float16, 1, 48, False), ("mxfp4", torch.bfloat16, torch.bfloat16, 3, 4096, True),
    ("nvfp4", torch.float32, torch.float32, 16, 80, True),
]
for fmt, act, out, n, k, gs in cases:
    a = random_fp4((256, k), fmt, "swizzled", seed=1, global_scale=0.5 if gs else None, device="cpu")
    b = (random_fp4((n, k), fmt, "linear", seed=2, global_scale=2.0 if gs else None, device="cpu") if act == "fp4"
         else random_activation((n, k), act, seed=2, device="cpu"))
    launch = Sm90Launch(a, b, out_dtype=out, kernel="general")
    kernel = launch.compile()
    assert kernel.asm["cubin"] and ("dp4a" in kernel.asm["ptx"]) == (act == "fp4"), (fmt, act, n, k)
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
    # The general kernel by name: NVFP4 with N > 1 would otherwise run the tensor-core kernel, whose twin sums
    # in another order.
    ptx = gemv(a, b, out_dtype=torch.float32, backend="triton-ptx", kernel="general")
    pure = gemv(a, b, out_dtype=torch.float32, backend="triton", kernel="general")
    assert torch.equal(ptx.view(torch.int32), pure.view(torch.int32))
    assert_matches_exact(ptx.to("cpu"), a.to("cpu"), b.to("cpu"), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, L", [(128, 256, 1), (2432, 4608, 2), (7168, 2048, 4), (384, 192, 3)])
def test_w4a4_case_on_gpu(m, k, L):  # (the task's generator needs M % 128 == 0)
    data, a, b = _task_operands(m, k, L, seed=1, device="cuda")
    for backend in ("triton-ptx", "triton"):
        c = data[6].fill_(float("nan"))
        task.custom_kernel(data, backend=backend)
        ours = gemv(a, b, backend=backend)
        assert select_kernel(a, b, backend=backend).name == "w4a4"
        assert torch.equal(ours.view(torch.int16), c.permute(2, 0, 1).view(torch.int16)), backend
        assert_matches_exact(ours.cpu(), a.to("cpu"), b.to("cpu"), torch.float16)
        general = gemv(a, b, backend=backend, kernel="general")
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
        # The bound of the kernel the default dispatch runs (the tensor-core kernels' for hmma and weight_only).
        assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), out_dtype, **bound_options(a, b, backend="auto"))
