"""Public operations: validate once at the boundary, pick a kernel configuration, launch.

Validation raises ``TypeError`` (wrong dtype) or ``ValueError`` (wrong shape, stride, device) naming the
argument, what was expected and what was given, before anything is written to the output.  Messages are
built only on failure: this runs on every eager call.
"""

from __future__ import annotations

import torch

from . import formats, layouts
from .backends import Backend, resolve_backend
from .kernels.configs import GemvConfig, w4a4_config
from .reference import quantized_gemv_reference
from .tensor import FP4Tensor

__all__ = ["task_gemv", "Backend"]

_FP4_STORAGE = (torch.float4_e2m1fn_x2, torch.uint8)
_E4M3_STORAGE = (torch.float8_e4m3fn, torch.uint8)


def _check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name}: expected dtype {names}, got {str(t.dtype).replace('torch.', '')}")


def _check_task_scales(name: str, sf: torch.Tensor, rows: int, k: int, l: int) -> torch.Tensor:
    """The swizzled bytes ``[L, rows_p * K/16]`` behind a task-permuted scale tensor (a view, never a copy)."""
    _check_dtype(name, sf, _E4M3_STORAGE)
    return layouts.checked_task_scales(name, formats.as_uint8(sf), rows, k, 16, l)


def task_gemv(
    a: torch.Tensor,
    b: torch.Tensor,
    sfa_permuted: torch.Tensor,
    sfb_permuted: torch.Tensor,
    c: torch.Tensor,
    *,
    backend: Backend = "auto",
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """The GPU MODE ``nvfp4_gemv`` product: ``c[m, 0, l] = sum_k a[m, k, l] sfa b[0, k, l] sfb`` in place.

    a: ``[M, K/2, L]`` float4_e2m1fn_x2 (or uint8), K-major (stride 1 along K/2); M >= 1, K a multiple of 64.
    b: ``[N, K/2, L]`` likewise, N >= 1; only row 0 is used.
    sfa_permuted, sfb_permuted: float8_e4m3fn scales in the task's ``(32, 4, rows/128, 4, K/64, L)`` view of
        the 128x4 swizzled layout (``fp4gemv.layouts``), rows = M and N.
    c: ``[M, 1, L]`` float16, any strides; written and returned.
    backend: ``"auto"`` is the Triton kernel with PTX decode on CUDA and the float64 reference on the CPU;
        ``"triton"`` uses the pure-Triton decode (runs under ``TRITON_INTERPRET=1`` on CPU tensors);
        ``"triton-ptx"`` insists on the PTX decode; ``"reference"`` computes in float64.
    All tensors on one device.  Accumulation is fp32 over exact 16-element block sums; c is rounded once.
    """
    _check_dtype("a", a, _FP4_STORAGE)
    _check_dtype("b", b, _FP4_STORAGE)
    _check_dtype("c", c, (torch.float16,))
    if a.dim() != 3:
        raise ValueError(f"a: expected 3 dims [M, K/2, L], got shape {tuple(a.shape)}")
    m, k_half, l = a.shape
    k = 2 * k_half
    if not (m >= 1 and l >= 1):
        raise ValueError(f"a: expected M >= 1 and L >= 1, got shape {tuple(a.shape)}")
    if not (k > 0 and k % 64 == 0):
        raise ValueError(f"a: expected K = 2 * a.shape[1] to be a positive multiple of 64, got K = {k}")
    if a.stride(1) != 1:
        raise ValueError(f"a: expected K-major storage (stride 1 along K/2), got strides {tuple(a.stride())}")
    if not (b.dim() == 3 and b.shape[0] >= 1 and b.shape[1:] == (k_half, l)):
        raise ValueError(f"b: expected shape [N >= 1, {k_half}, {l}] to match a's K/2 and L, got {tuple(b.shape)}")
    if b.stride(1) != 1:
        raise ValueError(f"b: expected K-major storage (stride 1 along K/2), got strides {tuple(b.stride())}")
    if tuple(c.shape) != (m, 1, l):
        raise ValueError(f"c: expected shape ({m}, 1, {l}), got {tuple(c.shape)}")
    sfa = _check_task_scales("sfa_permuted", sfa_permuted, m, k, l)
    sfb = _check_task_scales("sfb_permuted", sfb_permuted, b.shape[0], k, l)
    device = a.device
    for name, t in (("b", b), ("sfa_permuted", sfa_permuted), ("sfb_permuted", sfb_permuted), ("c", c)):
        if t.device != device:
            raise ValueError(f"{name}: expected device {device} like a, got {t.device}")
    backend = resolve_backend(backend, device)

    a_bytes = formats.as_uint8(a).permute(2, 0, 1)  # [L, M, K/2], K contiguous
    b_bytes = formats.as_uint8(b).permute(2, 0, 1)[:, 0, :]  # [L, K/2]
    c_lm = c[:, 0, :].permute(1, 0)  # [L, M]

    if backend == "reference":
        weights = FP4Tensor(a_bytes, sfa, "nvfp4", "swizzled")
        activation = FP4Tensor(formats.as_uint8(b).permute(2, 0, 1), sfb, "nvfp4", "swizzled").first_rows(1)
        c_lm.copy_(quantized_gemv_reference(weights, activation)[:, :, 0])
        return c

    cfg = config or w4a4_config(m, k, l)
    _launch_w4a4(a_bytes, b_bytes, sfa, sfb, c_lm, m, k, l, cfg, use_ptx=(backend == "triton-ptx"))
    return c


def _launch_w4a4(a_bytes, b_bytes, sfa, sfb, c_lm, m, k, l, cfg: GemvConfig, use_ptx: bool) -> None:
    from .kernels._common import swizzled_scale_addressing
    from .kernels.w4a4 import launch_w4a4

    nb = k // 16
    launch_w4a4(
        a_bytes.view(torch.int64), sfa, swizzled_scale_addressing(sfa.stride(0), nb),
        b_bytes.view(torch.int64), sfb, swizzled_scale_addressing(sfb.stride(0), nb),
        c_lm, config=cfg, use_ptx=use_ptx,
    )
