"""Launch configurations for the GEMV kernels, chosen from the problem shape.

Every constant here is a measured choice; docs/performance.md has the sweeps that picked them
(``benchmarks/sweep_w4a4.py`` on the H200).
"""

from __future__ import annotations

from typing import NamedTuple


class GemvConfig(NamedTuple):
    """One launch: ``rows`` outputs per program, ``blocks`` 16-element K-blocks per warp and loop step.

    The kernel (``kernels/w4a4.py``) puts 64 / blocks of the rows side by side in a warp and the rest in each
    thread's registers.
    ``ksplit``: K-chunks per step, side by side in the tile (warps along K when rows are few).
    ``unroll``: loop unroll factor.  ``pdl``: programmatic dependent launch (the kernel waits for the previous
    kernel in the stream itself, so its launch overlaps that kernel's tail); ``prefetch``: with ``pdl``, how
    many 16-element blocks of each row to prefetch into L2 while waiting.
    ``stages``: 0 runs ``kernels/w4a4.py``; >= 1 runs ``kernels/w4a4_async.py`` (scales loaded one step ahead;
    from 2 on, weights and activation copied into shared memory ``stages - 1`` steps ahead by ``cp.async``), which
    ignores ``unroll``.  ``persistent``: with ``stages >= 1``, a persistent grid of at most this many programs
    per SM (fewer when fewer fit); 0: one program per tile of ``rows`` rows.  ``maxnreg``: with ``stages >= 1``,
    a register cap per thread for ptxas (0: none), to trade registers for resident programs.
    """

    rows: int
    blocks: int
    num_warps: int
    num_stages: int = 1
    ksplit: int = 1
    unroll: int = 1
    pdl: bool = False
    prefetch: int = 0
    stages: int = 0
    persistent: int = 0
    maxnreg: int = 0


def w4a4_config(m: int, k: int, l: int) -> GemvConfig:  # noqa: E741
    """The configuration for an ``m x k`` GEMV over ``l`` batches (W4A4, N = 1).

    Chosen by the number of output rows ``m * l`` (sweep 7 in docs/performance.md, v6 kernel on the H200).
    Many rows: 64-row programs, 8 rows per thread sharing one activation decode.  Fewer rows: 16-row programs
    with 8 warps side by side along K, so enough loads are in flight.  Few rows: small programs, warps along K.
    PDL (with an L2 prefetch of the first blocks of each row) was faster on each of these except 4096 x 14336.
    """
    rows_total = m * l
    if rows_total >= 28672:
        cfg = GemvConfig(64, 32, 4, unroll=2, pdl=True, prefetch=32)
    elif rows_total >= 7168:
        cfg = GemvConfig(16, 16, 8, ksplit=8, pdl=True, prefetch=32)
    elif k >= 8192:
        cfg = GemvConfig(4, 32, 4, ksplit=4, unroll=2)
    else:
        cfg = GemvConfig(8, 32, 4, ksplit=8, unroll=2, pdl=True, prefetch=128)
    return fit_to_k(cfg, k)


def fit_to_k(cfg: GemvConfig, k: int) -> GemvConfig:
    """Shrink a configuration whose K step is longer than K: blocks, then ksplit, to powers of two that fit."""
    nb = k // 16
    blocks = min(cfg.blocks, pow2_at_most(nb))
    ksplit = min(cfg.ksplit, pow2_at_most(nb // blocks))
    return cfg._replace(blocks=blocks, ksplit=ksplit)


def pow2_at_most(x: int) -> int:
    """The largest power of two <= x (1 for x <= 1)."""
    return 1 << (max(x, 1).bit_length() - 1)


class HmmaConfig(NamedTuple):
    """One launch of the tensor-core kernel (``kernels/hmma_gemv.py``): 16 rows per program, ``warps`` warps
    side by side along K, each on 128 elements per step (a power of two, at most 8)."""

    warps: int


def hmma_config(m: int, k: int, l: int) -> HmmaConfig:  # noqa: E741
    """The tensor-core kernel's configuration for ``l`` batches of ``m x k`` weights (any N from 1 to 16).

    Sweep 10 (docs/performance.md): 4 warps along K, except 8 for few rows (M x L < 7168) and long K
    (>= 8192), where the 16-row programs alone cannot keep the GPU busy; never more than K / 128 warps.
    """
    warps = 8 if m * l < 7168 and k >= 8192 else 4
    return HmmaConfig(min(warps, pow2_at_most(k // 128)))
