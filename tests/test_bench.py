"""The benchmark's CPU-side pieces: byte counts and the random operands it times (timing itself needs a GPU)."""

import pytest
import torch

from fp4gemv import bench, formats, layouts


def test_task_bytes_counts_weights_scales_activation_and_output():
    for m, k, L in ((7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4)):
        weights_and_scales = L * (m * k // 2 + m * k // 16)
        activation = L * (k // 2 + k // 16)
        assert bench.task_bytes(m, k, L) == weights_and_scales + activation + L * m * 2


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


@pytest.mark.parametrize("fmt, act", [("nvfp4", "fp4"), ("mxfp4", "bf16")])
def test_eager_baseline_computes_the_product(fmt, act):
    from fp4gemv.reference import quantized_gemv_reference

    a, b, _ = bench.random_gemv_operands(bench.Shape(128, 256, 2, 3), fmt, act, seed=1, device="cpu")
    b_args = (b.data, b.linear_scales()) if act == "fp4" else (b, None)
    got = bench.dequant_matmul_eager(a.data, a.linear_scales(), *b_args, a.fmt)
    want = quantized_gemv_reference(a, b, torch.float64)
    # fp32 products are exact and the sums of 256 terms round in fp32; then one fp16 rounding.
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=1e-3)


def test_bench_rows_on_cpu_with_timing_stubbed(monkeypatch):
    """bench_shape and bench_case wiring: every timed callable runs (kernel, host call, eager and compiled
    baselines) and the rows carry every column of the table.

    The timers need a GPU, so they are replaced by ones that call what they are given once and return 1 us.
    """
    def run_once(launch, inputs, *_):
        launch(inputs[0])
        return [1.0]

    monkeypatch.setattr(bench, "device_time_us", run_once)
    monkeypatch.setattr(bench, "host_overhead_us", lambda call: (call(), 1.0)[1])
    monkeypatch.setattr(bench, "stream_read_time_us", lambda nbytes: [1.0])
    monkeypatch.setattr(bench, "_event_time_us", lambda call: (call(), 1.0)[1])
    monkeypatch.setattr(bench, "input_count", lambda nbytes: 2)
    real_task, real_gemv = bench.random_task_operands, bench.random_gemv_operands
    monkeypatch.setattr(bench, "random_task_operands", lambda *a, **kw: real_task(*a, **kw, device="cpu"))
    monkeypatch.setattr(bench, "random_gemv_operands", lambda *a, **kw: real_gemv(*a, **kw, device="cpu"))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)

    task_row = bench.bench_shape(bench.Shape(128, 256, 2), compile_baseline=True)
    case_row = bench.bench_case(bench.Shape(128, 256, 2, 3), "mxfp4", "fp16", compile_baseline=True)
    for row in (task_row, case_row):
        assert row["inputs"] == 2 and row["kernel"]["median_us"] == 1.0 and row["compile_us"] == 1.0
    assert task_row["bytes"] == bench.task_bytes(128, 256, 2)
    assert case_row["bytes"] == bench.case_bytes(bench.Shape(128, 256, 2, 3), "mxfp4", "fp16")
    table = bench.format_table([task_row, case_row]).splitlines()
    assert len(table) == 3 and table[1].split()[:3] == ["nvfp4", "fp4", "1"]
    assert table[2].split()[:3] == ["mxfp4", "fp16", "3"]
