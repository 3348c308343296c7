"""Launch configurations for the GEMV kernels, chosen from the problem shape.

Every constant here is a measured choice; docs/performance.md has the sweeps that picked them
(``benchmarks/sweep_w4a4.py`` on the H200).
"""

from __future__ import annotations

from typing import NamedTuple


class GemvConfig(NamedTuple):
    """One launch: ``rows`` outputs per program, ``blocks`` 16-element K-blocks per loop step.

    ``ksplit``: K-chunks per step, side by side in the tile (warps along K when rows are few).
    ``unroll``: loop unroll factor.  ``pdl``: programmatic dependent launch (the kernel waits for the previous
    kernel in the stream itself, so its launch overlaps that kernel's tail); ``prefetch``: with ``pdl``, how
    many 16-element blocks of each row to prefetch into L2 while waiting.
    """

    rows: int
    blocks: int
    num_warps: int
    num_stages: int = 1
    ksplit: int = 1
    unroll: int = 1
    pdl: bool = False
    prefetch: int = 0


def w4a4_config(m: int, k: int, l: int) -> GemvConfig:  # noqa: E741
    """The configuration for an ``m x k`` GEMV over ``l`` batches (W4A4, N = 1).

    Sweep 1 (docs/performance.md): long rows (K >= 8192) or few rows (M*L <= 4096) were fastest with 8 rows
    x 128 blocks, the others with 16 rows x 64 blocks; 4 warps won everywhere; num_stages had no effect
    (Triton does not pipeline these loads).
    """
    nb = k // 16
    rows, blocks = (8, 128) if k >= 8192 or m * l <= 4096 else (16, 64)
    blocks = min(blocks, 1 << (nb.bit_length() - 1))  # a power of two no larger than K/16
    return GemvConfig(rows=rows, blocks=blocks, num_warps=4, num_stages=1)
