"""The exact oracle every kernel is tested against.

Operands are dequantized to float64 (exact: see ``formats.dequantize``) and multiplied in float64.  Each
product of two dequantized NVFP4 values has at most 12 significant bits, so the only rounding before the
final cast is float64 accumulation, about 2^-53 relative to the sum of magnitudes: far below the one
rounding to fp16/bf16/fp32 that the result then takes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .tensor import FP4Tensor

__all__ = ["gemv_reference", "quantized_gemv_reference", "round_from_float64"]


def gemv_reference(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``a @ b^T`` per batch in float64, rounded once to ``out_dtype``.

    a: ``[..., M, K]`` real values (any float dtype; typically from ``formats.dequantize``).
    b: ``[..., N, K]`` real values with the same batch dimensions.
    Returns ``[..., M, N]``.  Runs on any device; float64 is upcast on the operands' device.
    """
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"b: expected K = {a.shape[-1]} to match a, got {b.shape[-1]}")
    return round_from_float64(torch.matmul(a.to(torch.float64), b.to(torch.float64).transpose(-1, -2)), out_dtype)


def quantized_gemv_reference(
    a: FP4Tensor, b: FP4Tensor | torch.Tensor, out_dtype: torch.dtype = torch.float16
) -> torch.Tensor:
    """The exact result of ``fp4gemv.gemv(a, b)``: both operands in float64, then :func:`gemv_reference`.

    a: FP4Tensor ``[L?, M, K]``, dequantized exactly (global scale included).  b: FP4Tensor ``[L?, N, K]``
    likewise, or a float tensor ``[L?, N, K]`` or ``[K]`` taken as given.  Batch dimensions broadcast as in
    ``torch.matmul``.  Returns ``[L?, M, N]`` (``[L?, M]`` for a ``[K]`` vector) in ``out_dtype``, rounded
    once; ``out_dtype=torch.float64`` gives the exact value itself.
    """
    a_values = a.dequantize(torch.float64)
    if isinstance(b, torch.Tensor):
        b_values = b.to(torch.float64)
    else:
        b_values = b.dequantize(torch.float64)
    if b_values.dim() == 1:
        return gemv_reference(a_values, b_values[None, :], out_dtype)[..., 0]
    return gemv_reference(a_values, b_values, out_dtype)


def round_from_float64(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float64 ``x`` to ``dtype`` once (nearest, ties to even).

    torch converts float64 to float16 and bfloat16 through float32, rounding twice: 1 + 2^-11 + 2^-40 first
    becomes the fp16 tie 1 + 2^-11, then 1.0, where one rounding gives 1 + 2^-10.  Rounding to float32
    *to odd* instead (truncate, then set the last bit if anything was cut off) keeps what the second
    rounding needs: float32 has more than two bits beyond either 16-bit format's significand.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        return x.to(dtype)
    f32 = x.to(torch.float32)
    inexact = (f32.to(torch.float64) != x) & torch.isfinite(x)
    rounded_away = f32.to(torch.float64).abs() > x.abs()
    truncated = torch.where(rounded_away, torch.nextafter(f32, torch.zeros_like(f32)), f32)
    to_odd = (truncated.view(torch.int32) | 1).view(torch.float32)
    return torch.where(inexact, to_odd, f32).to(dtype)
