"""The benchmark's CPU-side pieces: byte counts and the random operands it times (timing itself needs a GPU)."""

import pytest
import torch

from fp4gemv import bench, formats, layouts


def test_case_bytes_of_the_task_case_is_task_bytes():
    for m, k, L in ((7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4)):
        assert bench.case_bytes(bench.Shape(m, k, L), "nvfp4", "fp4") == bench.task_bytes(m, k, L)


def test_case_bytes_counts_each_part():
    m, k, L, n = 256, 1024, 2, 4
    weights = L * (m * k // 2 + m * k // 32)  # MXFP4: one scale byte per 32 elements
    assert bench.case_bytes(bench.Shape(m, k, L, n), "mxfp4", "bf16") == weights + L * n * k * 2 + L * m * n * 2


@pytest.mark.parametrize("fmt, act", [("nvfp4", "fp4"), ("mxfp4", "fp4"), ("nvfp4", "bf16"), ("mxfp4", "fp16")])
def test_random_gemv_operands_are_valid_and_span_all_codes(fmt, act):
    shape = bench.Shape(256, 512, 2, 3)
    a, b, out = bench.random_gemv_operands(shape, fmt, act, seed=0, device="cpu")
    assert a.shape == (2, 256, 512) and a.fmt.name == fmt and a.scale_layout == "swizzled"
    assert out.shape == (2, 256, 3) and out.dtype == torch.float16
    codes = formats.unpack_e2m1(a.data)
    assert set(codes.unique().tolist()) == set(range(16))
    # Scales are powers of two 2^-4 .. 2^3 in the used (unpadded) region.
    scales = formats.decode_scales(layouts.unswizzle_scales(a.scales, 256, 512 // a.fmt.block_size), a.fmt)
    assert torch.all(torch.log2(scales) == torch.log2(scales).round())
    assert scales.min() >= 2.0 ** -4 and scales.max() <= 2.0 ** 3
    if act == "fp4":
        assert b.shape == (2, 3, 512) and b.fmt.name == fmt
    else:
        assert b.shape == (2, 3, 512) and b.dtype == bench.ACTIVATIONS[act]
