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


# --- the wgmma tiles of the packed weights ---------------------------------------------------------------------------

# The A operand's layout of a [64, 64] bf16 tile as Gluon computes it (Triton 3.6 and 3.9, ``gl.to_linear_layout`` of
# ``DotOperandLayout(0, NVMMADistributedLayout([3, 0], [4, 1], [16, 16, 16]), k_width=2)``): (row, K) bases of the
# registers, lanes and warps.
_A_REGISTERS = ((0, 1), (8, 0), (0, 8), (0, 16), (0, 32))
_A_LANES = ((0, 2), (0, 4), (1, 0), (2, 0), (4, 0))
_A_WARPS = ((16, 0), (32, 0))


def _a_coordinates(warp: int, lane: int, register: int) -> tuple[int, int]:
    row = col = 0
    for bits, bases in ((register, _A_REGISTERS), (lane, _A_LANES), (warp, _A_WARPS)):
        for i, (r, c) in enumerate(bases):
            if bits >> i & 1:
                row, col = row ^ r, col ^ c
    return row, col


@pytest.mark.parametrize("m, k", [(64, 64), (128, 192), (70, 100)])
def test_mma_tiles_round_trip_and_pad_with_zero_codes(m, k):
    data = torch.randint(0, 256, (2, m, k // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(m + k))
    tiles = layouts.pack_mma_tiles(data)
    assert tiles.shape == (2, -(-m // 64), -(-k // 64), 2048) and tiles.dtype == torch.uint8
    assert torch.equal(layouts.unpack_mma_tiles(tiles, m, k), data)
    ones = layouts.pack_mma_tiles(torch.full((m, k // 2), 0x22, dtype=torch.uint8))  # every code 2 (+1.0)
    values = layouts.unpack_mma_tiles(ones, -(-m // 64) * 64, -(-k // 64) * 64)
    assert (values[:m, :k // 2] == 0x22).all() and (values[m:] == 0).all() and (values[:, k // 2:] == 0).all()


def test_mma_tiles_unpack_names_the_expected_shape():
    with pytest.raises(ValueError, match=r"tiles: expected shape \[\.\.\., 2, 1, 2048\] for 70x64 weights"):
        layouts.unpack_mma_tiles(torch.zeros(1, 1, 2048, dtype=torch.uint8), 70, 64)


def test_mma_tiles_decode_into_the_a_operand_registers():
    """Each thread's 16 bytes of a tile (offset 16 (32 w + lane)), as a consumer reads them: word u, decoded by the
    engine's native bf16 decode (``_mma_step.decode_native_bf16``, run by the PTX emulator with the multipliers a
    launch passes), gives pair q as A register h8 + 2 p + 4 h + 8 t (u = h8 + 2 t, q = 2 h + p); that register's
    two bf16 values times 2^126 are the e2m1 values at the coordinates Gluon's A layout gives it -- every code, on
    every thread, register and half."""
    from ptx_emulator import emulate_ptx

    from fp4gemv.formats import decode_e2m1, unpack_e2m1
    from fp4gemv.kernels import _mma_step

    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (64, 32), dtype=torch.uint8, generator=gen)
    data[0, :8] = torch.arange(0, 256, 32, dtype=torch.uint8) + torch.arange(8, dtype=torch.uint8)  # all 16 codes
    values = decode_e2m1(unpack_e2m1(data)).float()  # [64, 64]
    tile = layouts.pack_mma_tiles(data)[0, 0]
    mul = _mma_step.multipliers("bf16", "native")
    checked = 0
    for warp in range(4):
        for lane in range(32):
            mine = tile[16 * (32 * warp + lane):16 * (32 * warp + lane + 1)].tolist()
            for u in range(4):
                regs = {"w": int.from_bytes(bytes(mine[4 * u:4 * u + 4]), "little"), **mul}
                emulate_ptx(_mma_step.decode_native_bf16("w", ("p0", "p1", "p2", "p3"), "t", "v", {k: k for k in mul}),
                            regs)
                h8, t = u % 2, u // 2
                for q in range(4):
                    h, p = q // 2, q % 2
                    register = h8 + 2 * p + 4 * h + 8 * t
                    for half in range(2):  # element 2 register + half of the thread's A operand
                        bits = (regs[f"p{q}"] >> (16 * half)) & 0xFFFF
                        got = torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
                        row, col = _a_coordinates(warp, lane, 2 * register + half)
                        assert got.item() * 2.0**126 == values[row, col].item(), (warp, lane, u, q, half)
                        checked += 1
    assert checked == 64 * 64
