"""The measured tiles of the block-sum kernels (``w4a4.py``, and ``general.py`` for the W4A4 cases it is asked to
run): one module both read, so neither kernel imports the other."""

from __future__ import annotations

from typing import NamedTuple

from ._common import pow2_at_most

__all__ = ["W4A4Config", "w4a4_config", "fit_to_k"]


class W4A4Config(NamedTuple):
    """One launch of ``w4a4.w4a4_gemv_kernel``: ``rows`` outputs per program, ``blocks`` 16-element K-blocks per
    warp and loop step.

    The kernel puts 64 / blocks of the rows side by side in a warp and the rest in each thread's registers.
    ``ksplit``: K-chunks per step, side by side in the tile (warps along K when rows are few).
    ``unroll``: loop unroll factor.  ``pdl``: programmatic dependent launch (the kernel waits for the previous
    kernel in the stream itself, so its launch overlaps that kernel's tail; ignored where the target has no
    PDL); ``prefetch``: with ``pdl``, how many 16-element blocks of each row to prefetch into L2 while waiting.
    """

    rows: int
    blocks: int
    num_warps: int
    num_stages: int = 1
    ksplit: int = 1
    unroll: int = 1
    pdl: bool = False
    prefetch: int = 0


def w4a4_config(m: int, k: int, l: int) -> W4A4Config:  # noqa: E741
    """The configuration for an ``m x k`` GEMV over ``l`` batches (measured on the H200, 132 SMs).

    Chosen by the number of output rows ``m * l`` (docs/performance.md, the w4a4 kernel's configuration sweep on
    the H200).
    Many rows: 64-row programs, 8 rows per thread sharing one activation decode.  Fewer rows: 16-row programs
    with 8 warps side by side along K, so enough loads are in flight.  Few rows: small programs, warps along K.
    PDL (with an L2 prefetch of the first blocks of each row) was faster on each of these except 4096 x 14336.
    """
    rows_total = m * l
    if rows_total >= 28672:
        cfg = W4A4Config(64, 32, 4, unroll=2, pdl=True, prefetch=32)
    elif rows_total >= 7168:
        cfg = W4A4Config(16, 16, 8, ksplit=8, pdl=True, prefetch=32)
    elif k >= 8192:
        cfg = W4A4Config(4, 32, 4, ksplit=4, unroll=2)
    else:
        cfg = W4A4Config(8, 32, 4, ksplit=8, unroll=2, pdl=True, prefetch=128)
    return fit_to_k(cfg, k)


def fit_to_k(cfg: W4A4Config, k: int) -> W4A4Config:
    """Shrink a configuration whose K step is longer than K: blocks, then ksplit, to powers of two that fit."""
    nb = k // 16
    blocks = min(cfg.blocks, pow2_at_most(nb))
    ksplit = min(cfg.ksplit, pow2_at_most(nb // blocks))
    return cfg._replace(blocks=blocks, ksplit=ksplit)
