"""Validation at the boundary of ``ops.task_gemv``: errors name the argument, and nothing is written."""

import pytest
import torch

from fp4gemv import ops, task


@pytest.fixture
def data():
    return task.generate_input(128, 256, 2, seed=0, device="cpu")


def _call(a, b, sfa_p, sfb_p, c, **kw):
    return ops.task_gemv(a, b, sfa_p, sfb_p, c, **kw)


def _args(data):
    a, b, _, _, sfa_p, sfb_p, c = data
    return [a, b, sfa_p, sfb_p, c]


def _expect_error(data, index, value, exc, *words, **kw):
    args = _args(data)
    c_before = args[4].clone()
    args[index] = value
    with pytest.raises(exc) as info:
        _call(*args, **kw)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"
    assert torch.equal(data[6].view(torch.int16), c_before.view(torch.int16)), "c was written on failure"


def test_valid_call_writes_c(data):
    c = data[6].fill_(float("nan"))
    _call(*_args(data))
    assert not torch.isnan(c).any()


def test_wrong_a_dtype(data):
    _expect_error(data, 0, data[0].view(torch.uint8).to(torch.float16), TypeError, "a:", "float16")


def test_wrong_a_rank(data):
    _expect_error(data, 0, data[0][:, :, 0], ValueError, "a:", "3 dims")


def test_k_not_multiple_of_64(data):
    a = data[0].view(torch.uint8)[:, :16, :]
    _expect_error(data, 0, a, ValueError, "a:", "multiple of 64", "K = 32")


def test_a_not_k_major(data):
    a = data[0].view(torch.uint8)
    a_mk = a.permute(2, 0, 1).contiguous().permute(1, 2, 0)  # same logical tensor, K-major: fine
    assert a_mk.stride(1) == 1
    strided = a.transpose(0, 1).contiguous().transpose(0, 1)  # M fastest: not K-major
    _expect_error(data, 0, strided, ValueError, "a:", "K-major")


def test_b_shape_mismatch(data):
    _expect_error(data, 1, data[1][:, :64, :], ValueError, "b:", "[N >= 1, 128, 2]")


def test_b_wrong_l(data):
    _expect_error(data, 1, data[1][:, :, :1], ValueError, "b:")


def test_c_wrong_dtype(data):
    _expect_error(data, 4, data[6].float(), TypeError, "c:", "float16", "float32")


def test_c_wrong_shape(data):
    _expect_error(data, 4, data[6][:64], ValueError, "c:", "(128, 1, 2)")


def test_scales_wrong_shape(data):
    _expect_error(data, 2, data[4][..., :1], ValueError, "sfa_permuted:", "(32, 4, 1, 4, 4, 2)")


def test_scales_wrong_dtype(data):
    _expect_error(data, 3, data[5].view(torch.uint8).to(torch.float16), TypeError, "sfb_permuted:")


def test_scales_not_the_task_view(data):
    copied = data[4].contiguous()  # same shape, but the strides of a plain contiguous tensor
    _expect_error(data, 2, copied, ValueError, "sfa_permuted:", "permute(3, 4, 1, 5, 2, 0)")


def test_device_mismatch(data):
    _expect_error(data, 1, data[1].to("meta"), ValueError, "b:", "device")


def test_unknown_backend(data):
    _expect_error(data, 0, data[0], ValueError, "backend:", "'fast'", backend="fast")


def test_not_a_tensor(data):
    _expect_error(data, 0, [1, 2], TypeError, "a:", "torch.Tensor")


def test_ptx_backend_needs_cuda(data):
    _expect_error(data, 0, data[0], ValueError, "backend:", "'triton-ptx' needs CUDA tensors", backend="triton-ptx")
