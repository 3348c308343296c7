"""The 128x4 scale swizzle, checked against an independent CUTLASS-style conversion and the task's indexing."""

import pytest
import torch

from fp4gemv import layouts


def _random_scales(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _cutlass_blocked(x: torch.Tensor) -> torch.Tensor:
    """``to_blocked`` as the task's reference writes it (rows % 128 == 0, cols % 4 == 0)."""
    rows, cols = x.shape
    blocks = x.view(rows // 128, 128, cols // 4, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


@pytest.mark.parametrize("rows, cols", [(128, 4), (256, 8), (384, 12), (128, 448)])
def test_swizzle_matches_cutlass_blocked(rows, cols):
    linear = _random_scales(rows, cols)
    assert torch.equal(layouts.swizzle_scales(linear), _cutlass_blocked(linear))


def test_swizzle_keeps_float8_dtype_and_bytes():
    linear = _random_scales(256, 8, seed=1)
    as_fp8 = layouts.swizzle_scales(linear.view(torch.float8_e4m3fn))
    assert as_fp8.dtype == torch.float8_e4m3fn
    assert torch.equal(as_fp8.view(torch.uint8), layouts.swizzle_scales(linear))


@pytest.mark.parametrize("rows, cols", [(128, 4), (256, 12), (100, 3), (130, 5)])
def test_swizzle_unswizzle_round_trip(rows, cols):
    linear = _random_scales(rows, cols, seed=rows + cols)
    assert torch.equal(layouts.unswizzle_scales(layouts.swizzle_scales(linear), rows, cols), linear)


def test_swizzle_unswizzle_round_trip_batched():
    linear = _random_scales(2, 3, 256, 8, seed=2)
    swizzled = layouts.swizzle_scales(linear)
    assert swizzled.shape == (2, 3, 256 * 8)
    assert torch.equal(swizzled[1, 2], layouts.swizzle_scales(linear[1, 2]))
    assert torch.equal(layouts.unswizzle_scales(swizzled, 256, 8), linear)


@pytest.mark.parametrize("rows, cols", [(256, 12), (100, 3)])
def test_swizzled_offset_agrees_with_swizzle_everywhere(rows, cols):
    # Distinct values, so each (row, col) can be found: int32 holds rows * cols of them.
    linear = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    swizzled = layouts.swizzle_scales(linear)
    row = torch.arange(rows).unsqueeze(1).expand(rows, cols)
    col = torch.arange(cols).unsqueeze(0).expand(rows, cols)
    assert torch.equal(swizzled[layouts.swizzled_offset(row, col, cols)], linear)
    assert layouts.swizzled_offset(33, 5, cols) == int(layouts.swizzled_offset(torch.tensor(33), torch.tensor(5), cols))


def test_swizzled_offset_known_positions():
    # Rows r, r+32, r+64, r+96 share the 16-byte line r % 32; the next 4 columns start the next 512-byte atom.
    assert layouts.swizzled_offset(0, 0, 8) == 0
    assert layouts.swizzled_offset(0, 3, 8) == 3
    assert layouts.swizzled_offset(32, 0, 8) == 4
    assert layouts.swizzled_offset(96, 2, 8) == 14
    assert layouts.swizzled_offset(1, 0, 8) == 16
    assert layouts.swizzled_offset(0, 4, 8) == 512
    assert layouts.swizzled_offset(128, 0, 8) == 1024


def test_padding_is_zero_and_dropped():
    rows, cols = 100, 3
    linear = torch.randint(1, 256, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    swizzled = layouts.swizzle_scales(linear)
    assert layouts.padded_scale_shape(rows, cols) == (128, 4)
    assert swizzled.shape == (128 * 4,)
    row = torch.arange(128).unsqueeze(1).expand(128, 4)
    col = torch.arange(4).unsqueeze(0).expand(128, 4)
    padding = (row >= rows) | (col >= cols)
    offsets = layouts.swizzled_offset(row, col, cols)
    assert int(padding.sum()) == 128 * 4 - rows * cols
    assert swizzled[offsets[padding]].eq(0).all()
    assert swizzled[offsets[~padding]].ne(0).all()  # the data went where the offsets say, none lost to padding
    assert layouts.unswizzle_scales(swizzled, rows, cols).shape == (rows, cols)


def test_unswizzle_names_wrong_byte_count():
    with pytest.raises(ValueError, match=r"swizzled: expected 128\*4 = 512 bytes for 100x3 scales, got 500"):
        layouts.unswizzle_scales(torch.zeros(500, dtype=torch.uint8), 100, 3)


def _task_permuted(L: int, rows: int, cols: int, seed: int = 0):
    linear = _random_scales(L, rows, cols, seed=seed)  # batch-major [L, rows, cols]
    swizzled = layouts.swizzle_scales(linear)
    return linear, swizzled, layouts.task_permuted_view(swizzled, rows, cols)


def test_task_permuted_view_shape_and_strides():
    L, rows, cols = 2, 384, 16
    _, swizzled, permuted = _task_permuted(L, rows, cols)
    assert permuted.shape == (32, 4, rows // 128, 4, cols // 4, L)
    # permute(3, 4, 1, 5, 2, 0) of contiguous (L, rows/128, cols/4, 32, 4, 4)
    expected = torch.empty(L, rows // 128, cols // 4, 32, 4, 4).permute(3, 4, 1, 5, 2, 0).stride()
    assert permuted.stride() == expected
    assert permuted.data_ptr() == swizzled.data_ptr()


def test_task_permuted_view_indexing_every_scale():
    L, rows, cols = 2, 384, 12
    linear, _, permuted = _task_permuted(L, rows, cols, seed=4)
    m = torch.arange(rows).view(rows, 1, 1)
    j = torch.arange(cols).view(1, cols, 1)
    l = torch.arange(L).view(1, 1, L)  # noqa: E741
    picked = permuted[m % 32, (m % 128) // 32, m // 128, j % 4, j // 4, l]  # [rows, cols, L]
    assert torch.equal(picked, linear.permute(1, 2, 0))


def test_swizzled_from_task_permuted_is_a_view():
    L, rows, cols = 2, 256, 8
    _, swizzled, permuted = _task_permuted(L, rows, cols, seed=5)
    recovered = layouts.swizzled_from_task_permuted(permuted)
    assert recovered.shape == (L, rows * cols)
    assert torch.equal(recovered, swizzled)
    assert recovered.data_ptr() == swizzled.data_ptr()
    recovered[1, 7] = 0xAB  # shares storage: a write shows through the task's tensor
    assert swizzled[1, 7].item() == 0xAB
    assert permuted[7 // 16, (7 % 16) // 4, 0, 7 % 4, 0, 1].item() == 0xAB


def test_swizzled_from_task_permuted_rejects_other_shapes():
    with pytest.raises(ValueError, match="permuted: expected shape"):
        layouts.swizzled_from_task_permuted(torch.zeros(32, 4, 1, 4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="permuted: expected shape"):
        layouts.swizzled_from_task_permuted(torch.zeros(16, 4, 1, 4, 2, 1, dtype=torch.uint8))
