"""The exact oracle every kernel is tested against.

Operands are dequantized to float64 (exact: see ``formats.dequantize``) and multiplied in float64.  Each
product of two dequantized NVFP4 values has at most 12 significant bits, so the only rounding before the
final cast is float64 accumulation, about 2^-53 relative to the sum of magnitudes: far below the one
rounding to fp16/bf16/fp32 that the result then takes.
"""

from __future__ import annotations

import torch

__all__ = ["gemv_reference"]


def gemv_reference(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``a @ b^T`` per batch in float64, rounded once to ``out_dtype``.

    a: ``[..., M, K]`` real values (any float dtype; typically from ``formats.dequantize``).
    b: ``[..., N, K]`` real values with the same batch dimensions.
    Returns ``[..., M, N]``.  Runs on any device; float64 is upcast on the operands' device.
    """
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"b: expected K = {a.shape[-1]} to match a, got {b.shape[-1]}")
    return torch.matmul(a.to(torch.float64), b.to(torch.float64).transpose(-1, -2)).to(out_dtype)
