"""The GPU MODE task interface: input layout and distribution, reference, check, custom_kernel, CLI."""

import pytest
import torch

from fp4gemv import cli, formats, layouts, task

GENERATORS = [task.generate_input, task.generate_full_range_input]
ITEMS = ("a", "b", "sfa", "sfb", "sfa_permuted", "sfb_permuted", "c")


def _permute_of_contiguous(shape, order):
    return torch.empty(shape).permute(*order).stride()


def _expected_layout(m, k, L):
    """(shape, dtype, device type, strides) of each item, from TASK.md's table."""
    fp4, e4m3 = torch.float4_e2m1fn_x2, torch.float8_e4m3fn
    swizzle_order = (3, 4, 1, 5, 2, 0)
    return {
        "a": ((m, k // 2, L), fp4, "cpu", _permute_of_contiguous((L, m, k // 2), (1, 2, 0))),
        "b": ((128, k // 2, L), fp4, "cpu", _permute_of_contiguous((L, 128, k // 2), (1, 2, 0))),
        "sfa": ((m, k // 16, L), e4m3, "cpu", _permute_of_contiguous((L, m, k // 16), (1, 2, 0))),
        "sfb": ((128, k // 16, L), e4m3, "cpu", _permute_of_contiguous((L, 128, k // 16), (1, 2, 0))),
        "sfa_permuted": (
            (32, 4, m // 128, 4, k // 64, L),
            e4m3,
            "cpu",
            _permute_of_contiguous((L, m // 128, k // 64, 32, 4, 4), swizzle_order),
        ),
        "sfb_permuted": (
            (32, 4, 1, 4, k // 64, L),
            e4m3,
            "cpu",
            _permute_of_contiguous((L, 1, k // 64, 32, 4, 4), swizzle_order),
        ),
        "c": ((m, 1, L), torch.float16, "cpu", _permute_of_contiguous((L, m, 1), (1, 2, 0))),
    }


# --- shape lists ------------------------------------------------------------------------------------------


def test_shape_lists_are_the_tasks():
    assert [tuple(s) for s in task.TEST_SHAPES] == [
        (128, 256, 1), (128, 1536, 1), (128, 3072, 1), (256, 7168, 1), (256, 7168, 1),
        (2432, 4608, 2), (384, 7168, 2), (512, 512, 2), (512, 4096, 2), (512, 1536, 2),
    ]  # fmt: skip
    assert [tuple(s) for s in task.BENCHMARK_SHAPES] == [(7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4)]
    assert all(s.m % 128 == 0 and s.k % 64 == 0 for s in task.TEST_SHAPES + task.BENCHMARK_SHAPES)
    assert str(task.TEST_SHAPES[0]) == "m=128 k=256 l=1"


# --- generators -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("generate", GENERATORS)
@pytest.mark.parametrize("m, k, L", [(128, 256, 1), (384, 448, 2)])
def test_generated_layout_is_the_tasks(generate, m, k, L):
    data = generate(m, k, L, seed=1, device="cpu")
    assert len(data) == 7
    expected = _expected_layout(m, k, L)
    for name, tensor, (shape, dtype, device, strides) in zip(ITEMS, data, expected.values(), strict=True):
        assert tuple(tensor.shape) == shape, name
        assert tensor.dtype == dtype, name
        assert tensor.device.type == device, name
        assert tensor.stride() == strides, name
        assert tensor.storage_offset() == 0, name


@pytest.mark.parametrize("generate", GENERATORS)
def test_permuted_scales_hold_the_linear_scales(generate):
    m, k, L = 384, 448, 2
    a, b, sfa, sfb, sfa_permuted, sfb_permuted, c = generate(m, k, L, seed=2, device="cpu")
    for linear, permuted, rows in ((sfa, sfa_permuted, m), (sfb, sfb_permuted, 128)):
        r = torch.arange(rows).view(rows, 1, 1)
        j = torch.arange(k // 16).view(1, k // 16, 1)
        l = torch.arange(L).view(1, 1, L)  # noqa: E741
        picked = permuted.view(torch.uint8)[r % 32, (r % 128) // 32, r // 128, j % 4, j // 4, l]
        assert torch.equal(picked, linear.view(torch.uint8))
        # ops reads the swizzled bytes through a view: the generated tensors must allow one.
        assert layouts.swizzled_from_task_permuted(permuted).data_ptr() == permuted.data_ptr()


def test_generate_input_distribution():
    a, b, sfa, sfb, _, _, c = task.generate_input(512, 1024, 2, seed=3, device="cpu")
    for operand in (a, b):
        assert sorted(formats.as_uint8(operand).unique().tolist()) == [0, 1, 2, 3]
    for scales in (sfa, sfb):
        # Numeric 0.0, 1.0, 2.0 (e4m3 bytes 0x00, 0x38, 0x40), not the bytes 0, 1, 2.
        assert sorted(formats.as_uint8(scales).unique().tolist()) == [0x00, 0x38, 0x40]
    share_of_ones = (sfa.float() == 1.0).float().mean().item()
    assert 0.3 < share_of_ones < 0.37
    assert torch.isfinite(c).all() and c.float().std().item() > 0.5


@pytest.mark.parametrize("generate", GENERATORS)
def test_generators_are_deterministic_by_seed(generate):
    first = generate(128, 256, 2, seed=11, device="cpu")
    again = generate(128, 256, 2, seed=11, device="cpu")
    other = generate(128, 256, 2, seed=12, device="cpu")
    for x, y in zip(first, again, strict=True):
        # Bytewise (float8 and fp4 have no equality); c's fp16 through a contiguous copy.
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
    assert not torch.equal(formats.as_uint8(first[0]), formats.as_uint8(other[0]))


def _binades(scales: torch.Tensor) -> set[int]:
    """The power-of-two exponents of the non-zero scales (e4m3 subnormals count as 2^-9 .. 2^-7)."""
    values = formats.decode_e4m3(scales).abs()
    return set(torch.floor(torch.log2(values[values != 0])).int().tolist())


def test_full_range_generator_covers_codes_signs_and_binades():
    data = task.generate_full_range_input(256, 7168, 1, seed=4, device="cpu")
    a, b, sfa, sfb, _, _, _ = data
    for operand in (a, b):
        codes = formats.unpack_e2m1(operand)
        assert codes.unique().tolist() == list(range(16))
        assert (codes >= 8).float().mean().item() > 0.4  # negative half (and -0) as often as positive
    # Every e4m3 exponent, 2^-9 (smallest subnormal) to 2^8 (448), on a and on the row of b that is used.
    assert _binades(sfa) == set(range(-9, 9))
    assert {-9, 8} <= _binades(sfb[:1]) and len(_binades(sfb[:1])) >= 15
    for scales in (sfa, sfb[:1]):
        values = formats.decode_e4m3(scales)
        assert not torch.isnan(values).any()
        assert 0.05 < (values < 0).float().mean().item() < 0.15
        assert (values == 0).any()
    magnitude = task.reference_output(data).float().abs()
    assert torch.isfinite(magnitude).all()
    assert magnitude.max().item() < 2048 and magnitude.median().item() > 8  # within fp16, well above atol


@pytest.mark.parametrize("generate", GENERATORS)
def test_generators_reject_shapes_outside_the_task(generate):
    with pytest.raises(ValueError, match="m: expected a positive multiple of 128, got 100"):
        generate(100, 256, 1, seed=0, device="cpu")
    with pytest.raises(ValueError, match="k: expected a positive multiple of 64, got 96"):
        generate(128, 96, 1, seed=0, device="cpu")
    with pytest.raises(ValueError, match="l: expected a positive batch count, got 0"):
        generate(128, 256, 0, seed=0, device="cpu")


def test_default_device_is_cuda_only_when_present():
    assert task.resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert task.generate_input(128, 256, 1, seed=0)[0].device.type == task.resolve_device(None).type


@pytest.mark.parametrize("generate", GENERATORS)
def test_generators_name_a_device_this_machine_lacks(generate, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device: expected 'cpu', or 'cuda' on a machine with a CUDA GPU, got "
                                         r"'cuda' \(torch.cuda.is_available\(\) is False\)"):
        generate(128, 256, 1, seed=0, device="cuda")
    with pytest.raises(ValueError, match="device: expected 'cpu' or 'cuda', got 'cud'"):
        generate(128, 256, 1, seed=0, device="cud")
    with pytest.raises(ValueError, match="device: expected 'cpu' or 'cuda', got 'meta'"):
        generate(128, 256, 1, seed=0, device="meta")


# --- reference and check ----------------------------------------------------------------------------------


def test_ref_kernel_writes_c_and_matches_a_direct_computation():
    data = task.generate_full_range_input(128, 512, 2, seed=5, device="cpu")
    a, b, sfa, sfb, _, _, c = data
    c.fill_(float("nan"))
    out = task.ref_kernel(data)
    assert out is c and torch.isfinite(c).all()
    for l in range(2):  # noqa: E741
        a_values = formats.dequantize(a[:, :, l], sfa[:, :, l])  # [M, K]
        b_values = formats.dequantize(b[0, :, l], sfb[0, :, l])  # [K]
        direct = (a_values @ b_values).to(torch.float16)
        assert torch.allclose(c[:, 0, l].float(), direct.float(), rtol=2.0**-10, atol=0)


def _checked_data():
    data = task.generate_full_range_input(256, 1024, 2, seed=6, device="cpu")
    return data, task.reference_output(data)


def test_check_accepts_reference_and_ignores_data_c():
    data, expected = _checked_data()
    data[6].fill_(12345.0)  # a stale c must not be the yardstick
    ok, message = task.check_implementation(data, expected.clone())
    assert ok, message
    assert "within" in message
    assert not task.check_implementation(data, data[6])[0]


def test_check_reports_count_and_worst_mismatches():
    data, expected = _checked_data()
    output = expected.clone()
    output[5, 0, 1] += 3.0
    output[17, 0, 0] = -output[17, 0, 0] - 1
    ok, message = task.check_implementation(data, output)
    assert not ok
    assert message.startswith("2 of 512 outputs differ")
    assert "(m=5, l=1)" in message and "(m=17, l=0)" in message
    assert f"expected {expected[5, 0, 1].item():.6g}" in message


def test_check_fails_on_nan_and_names_it_first():
    data, expected = _checked_data()
    output = expected.clone()
    output[3, 0, 0] = float("nan")
    output[4, 0, 0] += 100
    comparison = task.compare_to_reference(output, expected)
    assert not comparison.ok and comparison.mismatches == 2
    assert "worst: (m=3, l=0) got nan" in comparison.message
    assert comparison.max_abs_error != comparison.max_abs_error  # nan


def test_check_tolerance_is_rtol_atol_1e_3():
    data, expected = _checked_data()
    idx = (expected.abs() >= 4).nonzero()[0].tolist()
    bits = expected.view(torch.int16)
    one_ulp, two_ulps = bits.clone(), bits.clone()
    one_ulp[tuple(idx)] += 1  # at most 2^-10 relative: inside rtol = 1e-3
    two_ulps[tuple(idx)] += 2  # 2^-9 relative, and |y| >= 4 puts it past atol + rtol*|y|
    assert task.check_implementation(data, one_ulp.view(torch.float16))[0]
    assert not task.check_implementation(data, two_ulps.view(torch.float16))[0]


def test_check_rejects_wrong_shape_and_dtype():
    data, expected = _checked_data()
    ok, message = task.check_implementation(data, expected[:, :, :1])
    assert not ok and message == "output: expected shape (256, 1, 2), got (256, 1, 1)"
    ok, message = task.check_implementation(data, expected.float())
    assert not ok and message == "output: expected dtype torch.float16, got torch.float32"


# --- custom_kernel on every test shape (on the CPU: gemv's float64 reference) ---------------------------------


@pytest.mark.parametrize("generate", GENERATORS, ids=["task", "full_range"])
@pytest.mark.parametrize("shape", task.TEST_SHAPES, ids=[f"{s.m}x{s.k}x{s.l}" for s in task.TEST_SHAPES])
def test_custom_kernel_passes_every_test_shape(shape, generate):
    data = generate(*shape, seed=shape.m + shape.k + shape.l, device="cpu")
    data[6].fill_(float("nan"))
    output = task.custom_kernel(data)
    assert output.data_ptr() == data[6].data_ptr()  # written into c
    ok, message = task.check_implementation(data, output)
    assert ok, message


def test_custom_kernel_is_gemv_on_the_task_views():
    from fp4gemv import FP4Tensor, gemv

    data = task.generate_full_range_input(256, 512, 2, seed=8, device="cpu")
    c = data[6].fill_(float("nan"))
    assert task.custom_kernel(data) is c
    a, b, _, _, sfa_p, sfb_p, _ = data
    want = gemv(FP4Tensor.from_task(a, sfa_p), FP4Tensor.from_task(b, sfb_p).first_rows(1), backend="reference")
    assert torch.equal(c.permute(2, 0, 1).view(torch.int16), want.view(torch.int16))


def test_custom_kernel_triton_backend_passes_the_check():
    data = task.generate_full_range_input(128, 1536, 2, seed=7, device="cpu")
    data[6].fill_(float("nan"))
    ok, message = task.check_implementation(data, task.custom_kernel(data, backend="triton"))
    assert ok, message


# --- custom_kernel's errors name the task's arguments; c is untouched ---------------------------------------


@pytest.fixture
def small():
    return task.generate_input(128, 256, 2, seed=0, device="cpu")


def _expect_task_error(data, index, value, exc, *words):
    items = list(data)
    c_before = items[6].clone()
    items[index] = value
    with pytest.raises(exc) as info:
        task.custom_kernel(tuple(items))
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"
    assert torch.equal(data[6].view(torch.int16), c_before.view(torch.int16)), "c was written on failure"


def test_custom_kernel_wants_the_7_tuple(small):
    for bad, got in ((small[:6], "a tuple of 6 items"), ({"a": small[0]}, "dict"), (list(small) + [0], "a list of 8")):
        with pytest.raises(TypeError, match=r"data: expected the 7-tuple \(a, b, sfa, sfb, sfa_permuted, "
                                            r"sfb_permuted, c\), got " + got):
            task.custom_kernel(bad)


def test_custom_kernel_names_a(small):
    _expect_task_error(small, 0, small[0].view(torch.uint8).to(torch.float16), TypeError, "a:", "float16")
    _expect_task_error(small, 0, small[0][:, :, 0], ValueError, "a:", "3 dims")
    strided = small[0].view(torch.uint8).transpose(0, 1).contiguous().transpose(0, 1)  # M fastest: not K-major
    _expect_task_error(small, 0, strided, ValueError, "a:", "stride 1 along K/2")
    _expect_task_error(small, 0, [1, 2], TypeError, "a:", "torch.Tensor", "list")


def test_custom_kernel_names_b(small):
    _expect_task_error(small, 1, small[1][:, :64, :], ValueError, "b:", "[rows, 128, 2]", "(128, 64, 2)")
    _expect_task_error(small, 1, small[1][:, :, :1], ValueError, "b:", "(128, 128, 1)")
    _expect_task_error(small, 1, small[1].view(torch.uint8).to(torch.int16), TypeError, "b:", "int16")


def test_custom_kernel_names_the_permuted_scales(small):
    _expect_task_error(small, 4, small[4][..., :1], ValueError, "sfa_permuted:", "(32, 4, 1, 4, 4, 2)")
    _expect_task_error(small, 5, small[5].view(torch.uint8).to(torch.float16), TypeError, "sfb_permuted:")
    copied = small[4].contiguous()  # same shape, but the strides of a plain contiguous tensor
    _expect_task_error(small, 4, copied, ValueError, "sfa_permuted:", "permute(3, 4, 1, 5, 2, 0)")


def test_custom_kernel_names_c(small):
    _expect_task_error(small, 6, small[6][:64], ValueError, "c:", "(128, 1, 2)", "(64, 1, 2)")
    _expect_task_error(small, 6, small[6].to(torch.int32), TypeError, "c:", "float16", "int32")
    _expect_task_error(small, 6, small[6].to("meta"), ValueError, "c:", "device cpu like a", "meta")
    _expect_task_error(small, 6, 0.0, TypeError, "c:", "torch.Tensor", "float")


# --- command line -----------------------------------------------------------------------------------------


def test_cli_version(capsys):
    import fp4gemv

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"fp4gemv {fp4gemv.__version__}"


def test_cli_task_test_with_the_triton_backend(capsys, monkeypatch):
    monkeypatch.setattr(task, "TEST_SHAPES", task.TEST_SHAPES[:2])
    assert cli.main(["task", "test", "--device", "cpu", "--backend", "triton"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[:2] == ["running on the CPU (--device cpu)", "backend triton"]
    assert out[-1] == "2 passed, 0 failed"


def test_cli_task_test_with_the_ptx_backend_on_a_cpu_refuses_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(task, "generate_input", lambda *a, **kw: pytest.fail("generated inputs"))
    assert cli.main(["task", "test", "--backend", "triton-ptx"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("error: --backend triton-ptx: needs a CUDA GPU (its decode is PTX), got device cpu")


def test_cli_task_benchmark_without_a_gpu_exits_at_once(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(task, "generate_input", lambda *a, **kw: pytest.fail("generated inputs"))
    assert cli.main(["task", "benchmark"]) == 2
    assert "no CUDA GPU found" in capsys.readouterr().err


def test_cli_task_test_passes_on_cpu(capsys):
    assert cli.main(["task", "test", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "10 passed, 0 failed"
    assert sum(" PASS " in line for line in lines) == 10
    assert lines[1] == "backend auto (the float64 reference on the CPU)"
    assert lines[2].startswith("m=128 k=256 l=1") and "max abs err" in lines[2]


def test_cli_says_when_no_gpu_is_found(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(task, "TEST_SHAPES", task.TEST_SHAPES[:1])
    assert cli.main(["task", "test", "--full-range"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == cli.NO_GPU_NOTICE
    assert out[-1] == "1 passed, 0 failed"
    assert cli.main(["task", "test", "--device", "cuda"]) == 2
    assert "no CUDA GPU found" in capsys.readouterr().err


def test_cli_task_test_fails_when_kernel_is_wrong(capsys, monkeypatch):
    monkeypatch.setattr(task, "TEST_SHAPES", task.TEST_SHAPES[:2])
    # A kernel that writes nothing leaves the NaN poison in c.
    monkeypatch.setattr(task, "custom_kernel", lambda data: data[6])
    assert cli.main(["task", "test", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert out.count(" FAIL ") == 2 and "got nan" in out
    assert out.strip().splitlines()[-1] == "0 passed, 2 failed"


def test_cli_task_test_reports_kernel_errors(capsys, monkeypatch):
    monkeypatch.setattr(task, "TEST_SHAPES", task.TEST_SHAPES[:1])

    def refuses(data):
        raise ValueError("a: expected something else")

    monkeypatch.setattr(task, "custom_kernel", refuses)
    assert cli.main(["task", "test", "--device", "cpu"]) == 1
    assert "custom_kernel raised ValueError: a: expected something else" in capsys.readouterr().out


def test_cli_task_benchmark_on_cpu(capsys, monkeypatch):
    monkeypatch.setattr(task, "BENCHMARK_SHAPES", (task.TaskShape(256, 512, 2), task.TaskShape(128, 1024, 1)))
    assert cli.main(["task", "benchmark", "--device", "cpu", "--repeats", "2"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert lines[1].startswith("m=256 k=512 l=2") and "median" in lines[1] and "(2 calls, 1 input(s), cpu)" in lines[1]
    assert lines[-1].startswith("geometric mean of medians:")
    assert "[2/2] m=128 k=1024 l=1: timing 2 calls" in captured.err


def test_cli_rejects_unknown_commands_and_bad_counts():
    with pytest.raises(SystemExit):
        cli.main(["task", "nonsense"])
    with pytest.raises(SystemExit):
        cli.main(["task", "benchmark", "--repeats", "0"])


@pytest.mark.parametrize("n_arg", ["0", "17", "1,x"])
def test_cli_bench_rejects_bad_n(capsys, n_arg):
    assert cli.main(["bench", "--n", n_arg]) == 2
    assert "--n" in capsys.readouterr().err
