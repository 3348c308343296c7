"""The first launch of an NVFP4 quantization whose global scale is chosen per call (``quantize(x,
global_scale="pow2")``): the largest magnitude of x as partial maxima, which ``quantize_kernel`` then reduces
(``QuantizeCase.amax_partials``; ``kernels/quantize.py``'s module docstring).

``amax_partials_kernel`` runs a fixed number P of programs (a power of two, ``amax_partials``; a function of x's
shape only, so a kept launch's workspace size is part of its metadata).  Program p takes the tiles p, p + P, ... of
``TILE_ROWS`` rows x ``TILE_WORDS`` pair words of x (``kernels/quantize.py``'s pair words, every input dtype), keeps
the elementwise maximum of their float32 magnitude bits, and writes its maximum as int32 to ``partials[p]`` (0, the
bits of +0, where it has no tile).  As magnitude bits, NaN sorts above infinity, which sorts above every finite
value (``_nvfp4_block_scales`` compares block maxima the same way), so the largest partial is NaN's bits where x
holds a NaN: integer maxima in a fixed order, no atomics, the same bits on every run, in CUDA graphs too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import dtype_name
from ..target import Target
from .quantize import _F32_MAGNITUDE_MASK, FLOAT_CODES, QuantizeCase, _unpack_pairs, pair_dtype
from .spec import Src, TritonKernelSpec, TritonLaunch

__all__ = ["QuantizeAmax", "amax_partials_kernel", "amax_partials", "TILE_ROWS", "TILE_WORDS", "MAX_PARTIALS"]

# A tile: 4 rows x 512 words (8 KB of bf16 or fp16, 16 KB of fp32), 16 words per thread in 4 warps.  Not tuned
# on the GPU: decode activations are a few rows of 2-16K elements, a few tiles.
TILE_ROWS = 4
TILE_WORDS = 512
# At most this many programs (partials), so that every quantize program's read of them stays small.
MAX_PARTIALS = 128


def _tiles(batch: int, rows: int, words: int) -> int:
    return batch * triton.cdiv(rows, TILE_ROWS) * triton.cdiv(words, TILE_WORDS)


def amax_partials(batch: int, rows: int, words: int) -> int:
    """The programs (and partial maxima) for x ``[batch, rows, words]`` pair words: one per tile, as a power of
    two, at most ``MAX_PARTIALS``."""
    return min(MAX_PARTIALS, triton.next_power_of_2(_tiles(batch, rows, words)))


@triton.jit
def amax_partials_kernel(x_ptr, partials_ptr, rows, words, x_stride_l, x_stride_r, n_tiles,
                         FLOAT_CODE: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """``partials[p]``: the largest float32 magnitude bits (int32) of the tiles p, p + P, ... of pair words ``x``
    ``[L, rows, words]`` (strides in words; tiles row-tile-major within a batch, word tiles fastest)."""
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(rows, ROWS)
    word_tiles = tl.cdiv(words, WORDS)
    acc = tl.zeros([ROWS, WORDS], tl.int32)
    for t in range(pid, n_tiles, tl.num_programs(0)):
        rest = t // word_tiles
        r = (rest % row_tiles) * ROWS + tl.arange(0, ROWS)
        col = (t % word_tiles) * WORDS + tl.arange(0, WORDS)
        batch = (rest // row_tiles).to(tl.int64)
        mask = (r[:, None] < rows) & (col[None, :] < words)
        loaded = tl.load(x_ptr + batch * x_stride_l + r[:, None] * x_stride_r + col[None, :], mask=mask, other=0)
        lo_bits, hi_bits = _unpack_pairs(loaded, FLOAT_CODE)
        acc = tl.maximum(acc, tl.maximum(lo_bits & _F32_MAGNITUDE_MASK, hi_bits & _F32_MAGNITUDE_MASK))
    tl.store(partials_ptr + pid, tl.max(tl.max(acc, axis=1), axis=0))


class QuantizeAmax(TritonKernelSpec):
    """``amax_partials_kernel`` for a ``QuantizeCase`` with ``amax_partials`` programs: the launch before the quantize
    kernel's where the global scale is chosen per call.  Triton targets only (elsewhere ``quantize`` computes the
    scale with torch: ``quantize.per_tensor_scale``)."""

    name = "quantize_amax"
    config_type = None

    def why_not(self, case: QuantizeCase, target: Target) -> str | None:
        if not case.amax_partials:
            return "computes the partial maxima of a per-call global scale (amax_partials is 0)"
        return None if target.runs_triton else "runs Triton kernels only"

    def triton_launch(self, case: QuantizeCase, config, target: Target) -> TritonLaunch:
        words = case.k // 2
        args = dict(x_ptr=Src("x_words", pair_dtype(case.x_dtype)), partials_ptr=Src("partials", torch.int32),
                    rows=case.rows, words=words, x_stride_l=case.x_strides[0], x_stride_r=case.x_strides[1],
                    n_tiles=_tiles(case.batch, case.rows, words), FLOAT_CODE=FLOAT_CODES[dtype_name(case.x_dtype)],
                    ROWS=TILE_ROWS, WORDS=TILE_WORDS)
        return TritonLaunch(amax_partials_kernel, (case.amax_partials,), args, dict(num_warps=4))
