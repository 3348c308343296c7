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

    Chosen by the number of output rows ``m * l`` (sweep 5 in docs/performance.md, v5 kernel on the H200):
    with many rows, 64-row programs amortise the activation over 8 rows per thread; with fewer, smaller
    programs keep enough loads in flight (about 500 or more programs for 132 SMs).  PDL with a 32-block L2
    prefetch was 0.4-0.9 us faster on every configuration it was measured on except the 8 x 128 one.
    """
    rows_total = m * l
    if rows_total >= 28672:
        cfg = GemvConfig(64, 32, 4, unroll=2, pdl=True, prefetch=32)
    elif rows_total >= 14336:
        cfg = GemvConfig(64, 32, 8, ksplit=2, unroll=2, pdl=True, prefetch=32)
    elif rows_total >= 7168:
        cfg = GemvConfig(8, 128, 4)
    else:
        cfg = GemvConfig(8, 32, 8, ksplit=4, unroll=2, pdl=True, prefetch=32)
    return fit_to_k(cfg, k)


def fit_to_k(cfg: GemvConfig, k: int) -> GemvConfig:
    """Shrink a configuration whose K step is longer than K: blocks, then ksplit, to powers of two that fit."""
    nb = k // 16
    blocks = min(cfg.blocks, 1 << (nb.bit_length() - 1))
    ksplit = min(cfg.ksplit, max(1, 1 << ((nb // blocks).bit_length() - 1)))
    return cfg._replace(blocks=blocks, ksplit=ksplit)
