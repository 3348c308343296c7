"""Block-scale layouts: linear ``[rows, K/bs]`` and the 128x4 swizzle of cuBLAS/CUTLASS; and the packed weights'
wgmma tiles (``pack_mma_tiles``), a kernel-native layout of the codes themselves.

The swizzled ("blocked") layout tiles the scale matrix into atoms of 128 rows x 4 scale columns, 512 bytes
each, atoms ordered row-tile-major.  Inside an atom, 16-byte line ``r % 32`` holds rows r, r+32, r+64,
r+96, four scale columns each.  The GPU MODE task's ``sfa_permuted`` tensor, shaped
``(32, 4, rows/128, 4, cols/4, L)``, is a strided view of exactly these bytes, one atom sequence per batch.

Kernels compute ``swizzled_offset`` inline; this module is its one Python definition.
"""

from __future__ import annotations

import torch

from .formats import pack_e2m1, reorder_codes, unpack_e2m1

__all__ = [
    "ROWS_PER_ATOM",
    "COLS_PER_ATOM",
    "padded_scale_shape",
    "SCALE_ROW_ALIGN",
    "aligned_scale_rows",
    "swizzled_offset",
    "swizzle_scales",
    "checked_task_scales",
    "unswizzle_scales",
    "task_permuted_view",
    "swizzled_from_task_permuted",
    "MMA_TILE_ROWS",
    "MMA_TILE_K",
    "pack_mma_tiles",
    "unpack_mma_tiles",
]

ROWS_PER_ATOM = 128
COLS_PER_ATOM = 4
# Bytes the rows of linear scales are aligned to where a module stores them (``aligned_scale_rows``): what a bulk
# tensor copy of the rows needs (``kernels.moe_engine.scale_copy_reason``).
SCALE_ROW_ALIGN = 16


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def padded_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """Rows rounded up to 128 and scale columns to 4: the swizzled layout always covers whole atoms."""
    return _ceil_to(rows, ROWS_PER_ATOM), _ceil_to(cols, COLS_PER_ATOM)


def aligned_scale_rows(linear: torch.Tensor, align: int = SCALE_ROW_ALIGN) -> torch.Tensor:
    """Linear scales ``[..., rows, cols]`` stored with rows ``align`` bytes apart: ``linear`` itself when its rows
    already are (contiguous, ``cols`` a multiple of ``align``), else a zero-padded copy ``[..., rows, cols_p]``
    whose ``[..., :cols]`` view holds the scales (gpt-oss's K = 2880: 90 MXFP4 scale bytes per row, stored in 96).
    A module keeps the padded tensor and views it: a copy to another device keeps the padding."""
    cols = linear.shape[-1]
    if cols % align == 0 and linear.is_contiguous():
        return linear
    padded = torch.zeros((*linear.shape[:-1], cols + (-cols) % align), dtype=linear.dtype, device=linear.device)
    padded[..., :cols] = linear
    return padded


def swizzled_offset(row: torch.Tensor | int, col: torch.Tensor | int, cols: int):
    """Byte offset of scale ``(row, col)`` in the swizzled layout of a matrix with ``cols`` scale columns."""
    atoms_per_row_tile = (cols + COLS_PER_ATOM - 1) // COLS_PER_ATOM
    atom = (row // 128) * atoms_per_row_tile + col // 4
    return atom * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4


def swizzle_scales(linear: torch.Tensor) -> torch.Tensor:
    """Linear scales ``[..., rows, cols]`` to swizzled bytes ``[..., rows_p * cols_p]``.

    Rows are zero-padded to a multiple of 128 and columns to a multiple of 4 (padding scales are zero,
    so they contribute nothing to a product).  Returns a new contiguous tensor of the input's dtype.
    """
    *batch, rows, cols = linear.shape
    rows_p, cols_p = padded_scale_shape(rows, cols)
    padded = linear.new_zeros(*batch, rows_p, cols_p)
    padded[..., :rows, :cols] = linear
    # [.., row_tile, r4, r32, col_tile, c4] -> [.., row_tile, col_tile, r32, r4, c4]
    tiles = padded.reshape(*batch, rows_p // 128, 4, 32, cols_p // 4, 4)
    nb = len(batch)
    perm = list(range(nb)) + [nb + 0, nb + 3, nb + 2, nb + 1, nb + 4]
    return tiles.permute(perm).reshape(*batch, rows_p * cols_p).contiguous()


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Swizzled bytes ``[..., rows_p * cols_p]`` back to linear ``[..., rows, cols]`` (padding dropped)."""
    *batch, n = swizzled.shape
    rows_p, cols_p = padded_scale_shape(rows, cols)
    if n != rows_p * cols_p:
        raise ValueError(
            f"swizzled: expected {rows_p}*{cols_p} = {rows_p * cols_p} bytes for {rows}x{cols} scales, got {n}"
        )
    tiles = swizzled.reshape(*batch, rows_p // 128, cols_p // 4, 32, 4, 4)
    nb = len(batch)
    perm = list(range(nb)) + [nb + 0, nb + 3, nb + 2, nb + 1, nb + 4]
    linear = tiles.permute(perm).reshape(*batch, rows_p, cols_p)
    return linear[..., :rows, :cols].contiguous()


def task_permuted_view(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The task's ``(32, 4, rows_p/128, 4, cols_p/4, L)`` view of swizzled bytes ``[L, rows_p * cols_p]``."""
    L = swizzled.shape[0]
    rows_p, cols_p = padded_scale_shape(rows, cols)
    six = swizzled.reshape(L, rows_p // 128, cols_p // 4, 32, 4, 4)
    return six.permute(3, 4, 1, 5, 2, 0)


def checked_task_scales(
    name: str, permuted: torch.Tensor, rows: int, k: int, block_size: int, batch: int
) -> torch.Tensor:
    """The swizzled bytes ``[L, rows_p * cols_p]`` behind the task's permuted view of ``rows`` rows of scales.

    ``permuted``: uint8, shaped ``(32, 4, rows_p/128, 4, cols_p/4, L)`` for ``batch`` = L batches of K-element
    rows with one scale per ``block_size``.  Raises ValueError naming ``name`` for another shape, or when ``permuted`` is not that
    view of contiguous bytes: the reshape would copy, and a copy per call would hide a slow path.
    """
    rows_p, cols_p = padded_scale_shape(rows, -(-k // block_size))
    expected = (32, 4, rows_p // 128, 4, cols_p // 4, batch)
    if tuple(permuted.shape) != expected:
        raise ValueError(
            f"{name}: expected shape {expected} for {rows} rows, K = {k}, L = {batch}, got {tuple(permuted.shape)}"
        )
    swizzled = swizzled_from_task_permuted(permuted)
    if swizzled.data_ptr() != permuted.data_ptr() or not swizzled.is_contiguous():
        raise ValueError(
            f"{name}: expected the permute(3, 4, 1, 5, 2, 0) view of a contiguous "
            f"(L, rows_p/128, cols_p/4, 32, 4, 4) tensor, got strides {tuple(permuted.stride())}"
        )
    return swizzled


def swizzled_from_task_permuted(permuted: torch.Tensor) -> torch.Tensor:
    """Swizzled bytes ``[L, rows_p * cols_p]`` behind a task-permuted scale tensor (a view when possible)."""
    if permuted.dim() != 6 or tuple(permuted.shape[:2]) != (32, 4) or permuted.shape[3] != 4:
        raise ValueError(f"permuted: expected shape (32, 4, rows/128, 4, cols/4, L), got {tuple(permuted.shape)}")
    six = permuted.permute(5, 2, 4, 0, 1, 3)
    return six.reshape(six.shape[0], -1)


# --- the wgmma tiles of the packed weights ------------------------------------------------------------------------
#
# A kernel-native layout for a consumer that decodes straight into ``wgmma``'s A registers (issue 27; docs/
# performance.md, round 28, item 7: the decode's registers feed HGMMA with no data movement).  Not yet read by a
# kernel.  A tile is 64 rows (a warp group's) by 64 K elements, 2048 bytes: thread (warp w, lane 4 g + c) holds the
# 16 bytes at offset 16 (32 w + 4 g + c) -- one 16-byte shared load, a warp's 32 loads one contiguous 512 bytes --
# as four 32-bit words u = h8 + 2 t: the codes of row 16 w + 8 h8 + g in the tile's K elements 32 t .. 32 t + 31
# that the A operand gives lane c: pairs (2 c, 2 c + 1) and (2 c + 8, 2 c + 9) of k16 tiles 2 t and 2 t + 1.  In a
# word, pair q = 2 h + p (k16 tile h of the two, p = 1 for the pair at + 8) is code slots q (its even K element) and
# q + 4 (its odd one), slot s at bits 4 s, in the native code order (``formats.reorder_codes``: the engine's native
# decode gives pair q as one bf16x2 register, low half the even element).  So the word's four decoded registers are
# the A operand's registers h8 + 2 p + 4 h + 8 t of the tile's 16 (``DotOperandLayout(0, NVMMADistributedLayout v3,
# k_width 2)``: registers k0, row + 8, k + 8, k16, k32; lanes c on k 2 and 4, g on rows 1, 2, 4; warps on rows 16,
# 32), and a tile row-major over K: a step's tiles are one contiguous run.

MMA_TILE_ROWS = 64
MMA_TILE_K = 64
# The codes [tiles T, w, h8, g, K tiles b, t, h, p, c, e] (row 64 T + 16 w + 8 h8 + g, K element 64 b + 32 t + 16 h
# + 8 p + 2 c + e) in the tiles' byte order [T, b, w, g, c, t, h8 | e, h, p]: the last three the word's code slot
# s = 4 e + 2 h + p.
_MMA_TILE_ORDER = (0, 4, 1, 3, 8, 5, 2, 9, 6, 7)


def pack_mma_tiles(data: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 bytes ``[..., M, K/2]`` (checkpoint order) as wgmma tiles ``[..., M_p / 64, K_p / 64, 2048]``
    uint8 (layout above), rows padded to 64 and K to 64 with code 0 (+0.0).  A new contiguous tensor on data's
    device."""
    codes = unpack_e2m1(data)
    *batch, m, k = codes.shape
    m_p, k_p = _ceil_to(m, MMA_TILE_ROWS), _ceil_to(k, MMA_TILE_K)
    if (m_p, k_p) != (m, k):
        codes = torch.nn.functional.pad(codes, (0, k_p - k, 0, m_p - m))
    nb = len(batch)
    tiles = codes.reshape(*batch, m_p // 64, 4, 2, 8, k_p // 64, 2, 2, 2, 4, 2)
    tiles = tiles.permute(*range(nb), *(nb + d for d in _MMA_TILE_ORDER))
    words = pack_e2m1(tiles.reshape(*batch, m_p // 64, k_p // 64, 2048 * 2))
    return reorder_codes(words, "checkpoint", "native")


def unpack_mma_tiles(tiles: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """wgmma tiles ``[..., M_p / 64, K_p / 64, 2048]`` back to packed e2m1 bytes ``[..., m, k/2]`` in the
    checkpoint order (padding dropped)."""
    *batch, rt, kt, n = tiles.shape
    m_p, k_p = _ceil_to(m, MMA_TILE_ROWS), _ceil_to(k, MMA_TILE_K)
    if (rt * MMA_TILE_ROWS, kt * MMA_TILE_K, n) != (m_p, k_p, 2048):
        raise ValueError(f"tiles: expected shape [..., {m_p // 64}, {k_p // 64}, 2048] for {m}x{k} weights, got "
                         f"{tuple(tiles.shape)}")
    codes = unpack_e2m1(reorder_codes(tiles, "native", "checkpoint"))
    nb = len(batch)
    shape = (rt, kt, 4, 8, 4, 2, 2, 2, 2, 2)  # [T, b, w, g, c, t, h8, e, h, p]
    inverse = [_MMA_TILE_ORDER.index(d) for d in range(10)]
    codes = codes.reshape(*batch, *shape).permute(*range(nb), *(nb + d for d in inverse))
    return pack_e2m1(codes.reshape(*batch, m_p, k_p)[..., :m, :k])
