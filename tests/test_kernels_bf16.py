"""bf16 activations through every kernel that takes them, with ``backend="triton"`` on CPU tensors: Triton's
interpreter as a user gets it (no test fixture patching its bf16 arithmetic), against the exact oracle.

Triton's interpreter (3.6 to 3.9) hands bf16 tensors to NumPy as their uint16 bit patterns, so a bf16 product or
``tl.dot`` multiplies integers (``Target.bf16_arithmetic``): a kernel that computes in bf16 there returns garbage
with no error.  moe_gemv's bf16 path is checked the same way by tests/test_moe.py."""

import pytest
import torch

import operands as O
from fp4gemv import gemv
from fp4gemv.kernels import GEMV_KERNELS, choose_kernel
from fp4gemv.ops import gemv_operands
from fp4gemv.target import resolve_target

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter on CPU tensors")

M, K = 64, 512
# (kernel, format, activation rows): every kernel that takes bf16 activations, and each step mode of
# weight_only (fold, split, k32).
CASES = [("gemm", "nvfp4", 20), ("gemm", "mxfp4", 17), ("stream", "nvfp4", 9), ("weight_only", "nvfp4", 3),
         ("weight_only", "nvfp4", 1), ("weight_only", "mxfp4", 5), ("hmma", "nvfp4", 16), ("general", "nvfp4", 2),
         ("general", "mxfp4", 3)]


def _operands(fmt, n, seed=0):
    a = O.random_fp4((2, M, K), fmt, "swizzled", seed=seed, global_scale=0.75 if fmt == "nvfp4" else None,
                     device="cpu")
    return a, O.random_activation((2, n, K), torch.bfloat16, seed=seed + 1, device="cpu")


@pytest.mark.parametrize("kernel, fmt, n", CASES, ids=[f"{k}-{f}-n{n}" for k, f, n in CASES])
def test_bf16_activations_match_the_exact_result(kernel, fmt, n):
    a, b = _operands(fmt, n)
    out = O.poisoned((2, M, n), torch.bfloat16, device="cpu")
    gemv(a, b, out=out, out_dtype=torch.bfloat16, backend="triton", kernel=kernel)
    O.assert_matches_exact(out, a, b, torch.bfloat16, **O.bound_options(a, b, kernel=kernel,
                                                                          out_dtype=torch.bfloat16))


def test_the_cases_cover_every_kernel_that_takes_bf16():
    """A kernel that runs some bf16 case on the interpreter's target is in ``CASES``."""
    target = resolve_target("triton", torch.device("cpu"))
    covered = {kernel for kernel, _, _ in CASES}
    for fmt in ("nvfp4", "mxfp4"):
        for n in (1, 2, 9, 16, 17):
            a, b = _operands(fmt, n)
            case = gemv_operands(a, b, torch.empty(2, M, n, dtype=torch.bfloat16)).case
            for spec in GEMV_KERNELS:
                if spec.name != "reference" and spec.why_not(case, target) is None:
                    assert spec.name in covered, (spec.name, fmt, n)
    assert choose_kernel(case, target).name == "gemm"

