"""``fp4gemv.gemv`` at its boundary: result shapes, out=, backends, validation (nothing written on failure), and
the task adapter.  The kernel's numerics are tested in test_kernels_gemv.py."""

import os

import pytest
import torch

from fp4gemv import FP4Tensor, gemv, ops, task
from fp4gemv.kernels.gemv_configs import GemvKernelConfig
from fp4gemv.reference import gemv_reference, quantized_gemv_reference


def _fp4(*shape, fmt="nvfp4", layout="linear", seed=0, global_scale=None):
    g = torch.Generator().manual_seed(seed)
    return FP4Tensor.quantize(torch.randn(shape, generator=g), fmt, layout, global_scale)


def _x(*shape, dtype=torch.float16, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- shapes and the reference backend -------------------------------------------------------------------


@pytest.mark.parametrize(
    "a_shape, b, expected",
    [
        ((2, 128, 64), ("fp4", (2, 3, 64)), (2, 128, 3)),
        ((128, 64), ("fp4", (3, 64)), (128, 3)),
        ((2, 128, 64), ("fp4", (5, 64)), (2, 128, 5)),  # b broadcast over a's batch
        ((128, 64), ("fp4", (2, 1, 64)), (2, 128, 1)),  # a broadcast over b's batch
        ((2, 128, 64), (torch.bfloat16, (2, 16, 64)), (2, 128, 16)),
        ((128, 64), (torch.float32, (1, 64)), (128, 1)),
        ((2, 128, 64), (torch.float16, (64,)), (2, 128)),
        ((128, 64), (torch.float16, (64,)), (128,)),
    ],
)
def test_result_shape_and_reference_values(a_shape, b, expected):
    a = _fp4(*a_shape, global_scale=0.5)
    kind, shape = b
    b = _fp4(*shape, seed=2, layout="swizzled") if kind == "fp4" else _x(*shape, dtype=kind)
    out = gemv(a, b, out_dtype=torch.float32)
    assert out.shape == expected and out.dtype == torch.float32
    assert torch.equal(out, quantized_gemv_reference(a, b, torch.float32))
    # The oracle, spelled out: float64 values of both operands, one rounding.
    a64 = a.dequantize(torch.float64)
    b64 = b.dequantize(torch.float64) if isinstance(b, FP4Tensor) else b.double()
    direct = a64 @ (b64.transpose(-1, -2) if b64.dim() > 1 else b64)
    torch.testing.assert_close(out.double(), direct, rtol=2.0**-24, atol=1e-12)


def test_global_scales_multiply_the_result():
    a, b = _fp4(128, 64), _fp4(2, 64, seed=2)
    plain = quantized_gemv_reference(a, b, torch.float64)
    scaled_a = FP4Tensor(a.data, a.scales, a.fmt, a.scale_layout, 0.25)
    scaled_b = FP4Tensor(b.data, b.scales, b.fmt, b.scale_layout, 3.0)
    assert torch.equal(quantized_gemv_reference(scaled_a, scaled_b, torch.float64), plain * 0.75)
    assert torch.equal(gemv(scaled_a, scaled_b, out_dtype=torch.float32), (plain * 0.75).float())


def test_out_is_written_and_returned_default_is_new():
    a, x = _fp4(2, 128, 64), _x(2, 4, 64)
    out = torch.full((2, 128, 4), float("nan"), dtype=torch.bfloat16)
    assert gemv(a, x, out=out, out_dtype=torch.bfloat16) is out
    assert not torch.isnan(out).any()
    fresh = gemv(a, x)
    assert fresh.dtype == torch.float16 and fresh.shape == (2, 128, 4)
    assert torch.equal(fresh, gemv_reference(a.dequantize(torch.float64), x, torch.float16))


def test_auto_on_cpu_is_the_reference():
    a, b = _fp4(200, 128, fmt="mxfp4"), _fp4(3, 128, fmt="mxfp4", seed=4)
    assert torch.equal(gemv(a, b), gemv(a, b, backend="reference"))


# --- validation: every error names its argument; out is untouched -------------------------------------


def _expect_error(exc, words, a=None, b=None, **kwargs):
    a = _fp4(2, 128, 64) if a is None else a
    b = _x(2, 3, 64) if b is None else b
    out = kwargs.pop("out", torch.full((2, 128, 3), float("nan"), dtype=torch.float16))
    before = out.clone() if isinstance(out, torch.Tensor) else None
    with pytest.raises(exc) as info:
        gemv(a, b, out=out, **kwargs)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"
    if before is not None and out.device.type == "cpu":
        assert torch.equal(out.view(torch.uint8), before.view(torch.uint8)), "out was written on failure"


def test_a_must_be_an_fp4_tensor():
    _expect_error(TypeError, ["a:", "FP4Tensor", "Tensor"], a=torch.zeros(2, 128, 64))


def test_b_type_dtype_and_rank():
    _expect_error(TypeError, ["b:", "FP4Tensor or a torch.Tensor", "list"], b=[1.0])
    _expect_error(TypeError, ["b:", "float16, bfloat16, float32", "float64"], b=_x(2, 3, 64).double())
    _expect_error(TypeError, ["b:", "int32"], b=torch.zeros(2, 3, 64, dtype=torch.int32))
    _expect_error(ValueError, ["b:", "[K], [N, K] or [L, N, K]", "(1, 2, 3, 64)"], b=_x(1, 2, 3, 64))


def test_b_shape_against_a():
    _expect_error(ValueError, ["b:", "K = 64 like a", "K = 32"], b=_x(2, 3, 32))
    _expect_error(ValueError, ["b:", "N from 1 to 16", "N = 17"], b=_x(2, 17, 64))
    _expect_error(ValueError, ["b:", "N from 1 to 16", "N = 0"], b=_x(2, 0, 64))
    _expect_error(ValueError, ["b:", "L = 2 like a", "L = 3"], b=_x(3, 3, 64))
    _expect_error(ValueError, ["b:", "format 'nvfp4' like a", "'mxfp4'"], b=_fp4(2, 3, 64, fmt="mxfp4"))
    _expect_error(ValueError, ["b:", "device cpu like a", "meta"], b=_x(2, 3, 64).to("meta"))


def test_out_and_out_dtype():
    _expect_error(TypeError, ["out_dtype:", "float16, bfloat16, float32", "float64"], out_dtype=torch.float64)
    _expect_error(TypeError, ["out:", "torch.Tensor", "list"], out=[0.0])
    _expect_error(ValueError, ["out:", "(2, 128, 3)", "(2, 128, 4)"],
                  out=torch.zeros(2, 128, 4, dtype=torch.float16))
    _expect_error(TypeError, ["out:", "torch.float32 (out_dtype)", "torch.float16"], out_dtype=torch.float32)
    _expect_error(ValueError, ["out:", "device cpu like a", "meta"],
                  out=torch.zeros(2, 128, 3, dtype=torch.float16, device="meta"))


def test_backend_and_config(monkeypatch):
    _expect_error(ValueError, ["backend:", "'auto', 'triton-ptx', 'triton', 'reference'", "'cuda'"], backend="cuda")
    _expect_error(ValueError, ["backend:", "'triton-ptx' needs CUDA tensors", "cpu"], backend="triton-ptx")
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "0")
    _expect_error(ValueError, ["backend:", "'triton' needs CUDA tensors (or TRITON_INTERPRET=1)"], backend="triton")
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "1")
    _expect_error(ValueError, ["config:", "powers of two", "rows=12"], backend="triton",
                  config=GemvKernelConfig(12, 8, 4))
    _expect_error(TypeError, ["config:", "GemvKernelConfig", "tuple"], backend="triton", config=(8, 8, 4))


def test_kernel_needs_8_byte_aligned_rows():
    wide = torch.zeros(128, 40, dtype=torch.uint8)
    misaligned = FP4Tensor(wide[:, 4:36], torch.full((128, 4), 0x38, dtype=torch.uint8))  # rows 40 bytes apart
    _expect_error(ValueError, ["a:", "multiples of 8 bytes", "(40, 1)", "storage offset 4"],
                  a=misaligned, b=_x(3, 64), out=torch.zeros(128, 3, dtype=torch.float16), backend="triton")
    # The reference reads any layout.
    assert gemv(misaligned, _x(3, 64)).abs().max() == 0


# --- the task adapter -----------------------------------------------------------------------------------


def test_custom_kernel_is_gemv_on_the_task_views():
    data = task.generate_full_range_input(256, 512, 2, seed=8, device="cpu")
    c = data[6].fill_(float("nan"))
    assert task.custom_kernel(data) is c
    want = data[6].clone().fill_(float("nan"))
    ops.task_gemv(data[0], data[1], data[4], data[5], want, backend="reference")
    assert torch.equal(c.view(torch.int16), want.view(torch.int16))
