"""Launch configurations for the general GEMV kernel (``kernels/gemv.py``), chosen from the shape; no autotuning.

Only W4A4 with N = 1 has been measured, on ``w4a4.py`` (docs/performance.md, encoded in
``configs.w4a4_config``, which this module defers to for that case).  Every other case is sized, not
measured: it keeps the per-program register tiles no larger than the measured W4A4 ones.
"""

from __future__ import annotations

from typing import NamedTuple

from .configs import pow2_at_most, w4a4_config

__all__ = ["GemvKernelConfig", "gemv_config"]

# fp32 accumulator elements per program for N > 1: as in the measured W4A4 tiles (8 x 128, 8 x 4 x 32).
_ACC_ELEMENTS = 1024
# Rows per program for N > 1, so that N = 16 still leaves 4 blocks per step (unmeasured).
_MAX_ROWS_N = 16
# W4A16 also holds the decoded weights times the activation, [rows, n, blocks, 16] fp32, before the block sum:
# capped at the accumulator size times 4 (unmeasured).
_W4A16_PRODUCT_ELEMENTS = 4096
_W4A16_ROWS = 8


class GemvKernelConfig(NamedTuple):
    """One launch: ``rows`` outputs per program, ``blocks`` 16-element K-blocks per loop step (powers of two)."""

    rows: int
    blocks: int
    num_warps: int


def gemv_config(m: int, k: int, l: int, n: int, *, fp4_activation: bool) -> GemvKernelConfig:  # noqa: E741
    """The configuration for ``[l, m, k] x [l, n, k]`` (n activation rows, 1..16).

    W4A4, n = 1 (for callers who want the general kernel for this case; ``gemv`` itself runs w4a4.py):
    rows, warps and K step (ksplit x blocks) of ``configs.w4a4_config``; this kernel has no ksplit, unroll or
    PDL.  W4A4, n > 1: at most 16 rows, blocks such that the accumulator ``[rows, n_pad, blocks]`` stays at
    1024 fp32.  W4A16: 8 rows and blocks such that the ``[rows, n_pad, blocks, 16]`` product tile stays at
    4096 fp32.  Blocks never exceed K/16.
    """
    nb = k // 16
    n_pad = pow2_at_most(2 * n - 1)  # next power of two >= n
    if fp4_activation:
        base = w4a4_config(m, k, l)
        num_warps = base.num_warps
        if n_pad == 1:
            rows, blocks = base.rows, base.blocks * base.ksplit
        else:
            rows = min(base.rows, _MAX_ROWS_N)
            blocks = _ACC_ELEMENTS // (rows * n_pad)
    else:
        rows, num_warps = _W4A16_ROWS, 4
        blocks = _W4A16_PRODUCT_ELEMENTS // (rows * n_pad * 16)
    return GemvKernelConfig(rows=rows, blocks=min(pow2_at_most(blocks), pow2_at_most(nb)), num_warps=num_warps)
