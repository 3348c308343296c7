"""The variants of the W4A4 N = 1 task kernel that the issue-12 scripts compare, per shape.

Shared by ``offline_task_kernel.py`` (CPU: machine code of each variant), ``sweep_task_kernel.py`` (GPU: correctness
and device time) and ``profile_task_kernel.py`` (GPU: ncu), so the three talk about the same launches.

* ``shipped``: ``configs.w4a4_config`` (``kernels/w4a4.py``), the baseline.
* ``ahead``: the shipped tile in ``kernels/w4a4_async.py`` with plain loads, weight and activation scales loaded
  one step ahead (``stages=1``): only the second DRAM round trip of each step removed.
* ``async3`` / ``async4``: the same tile, weights and activation copied into shared memory by ``cp.async`` two
  or three steps ahead (``stages=3`` / ``4``).
* ``async3-r<rows>``: ``async3`` with twice the rows per thread (half when the tile already keeps 8 or more):
  fewer instructions per byte (activation decode and addressing shared by more rows) against registers.
* ``persist3``: ``async3`` on a persistent grid (as many programs per SM as fit, at most 8), the tile and K
  loops flattened into one pipelined loop.
* ``async3-cap64`` (8-warp tiles only): ``async3`` with ptxas held to 64 registers, so that 4 programs of 256
  threads fit on an SM instead of 3 (offline: 74 -> 64 registers, no spills; 7168x16384 then runs in one wave).

Only ``shipped``, ``async3`` and ``async3-r..`` run for MXFP4 (its scale handling is the only difference).
"""

from __future__ import annotations

from fp4gemv.kernels.configs import GemvConfig, w4a4_config
from fp4gemv.kernels.w4a4_async import tile_shape

# The table (M, K, L).
SHAPES = [(7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4), (4096, 4096, 1), (14336, 4096, 1),
          (4096, 14336, 1), (28672, 8192, 1)]


def variants(m: int, k: int, l: int, fmt: str = "nvfp4") -> list[tuple[str, GemvConfig]]:  # noqa: E741
    """(name, config) of every variant for one shape, the shipped configuration first."""
    base = w4a4_config(m, k, l)
    tile = base._replace(unroll=1)
    _, _, _, rows_per_thread, _ = tile_shape(tile)
    other_rows = tile.rows * 2 if rows_per_thread < 8 else tile.rows // 2
    out = [
        ("shipped", base),
        ("ahead", tile._replace(stages=1)),
        ("async3", tile._replace(stages=3)),
        ("async4", tile._replace(stages=4)),
        (f"async3-r{other_rows}", tile._replace(rows=other_rows, stages=3)),
        ("persist3", tile._replace(stages=3, persistent=8)),
    ]
    if tile.num_warps == 8:
        out.append(("async3-cap64", tile._replace(stages=3, maxnreg=64)))
    if fmt == "mxfp4":
        out = [(name, cfg) for name, cfg in out if name in ("shipped", "async3") or name.startswith("async3-r")]
    return out
