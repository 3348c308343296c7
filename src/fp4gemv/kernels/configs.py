"""Launch configurations for the GEMV kernels, chosen from the problem shape.

Every constant here is a measured choice; docs/performance.md has the sweep that picked it.
"""

from __future__ import annotations

from typing import NamedTuple


class GemvConfig(NamedTuple):
    """One launch: ``rows`` outputs per program, ``blocks`` 16-element K-blocks per loop step."""

    rows: int
    blocks: int
    num_warps: int
    num_stages: int


def w4a4_config(m: int, k: int, l: int) -> GemvConfig:
    """The configuration for an ``m x k`` GEMV over ``l`` batches (W4A4, N = 1)."""
    nb = k // 16
    blocks = 256 if nb >= 256 else max(4, 1 << (nb.bit_length() - 1))
    return GemvConfig(rows=16, blocks=blocks, num_warps=4, num_stages=1)
