"""fp4gemv's ops registered with PyTorch (``torch.library``), so ``torch.compile`` sees them as single ops.

``torch.ops.fp4gemv.gemv`` (a new result) and ``torch.ops.fp4gemv.gemv_out`` (writes ``out``, declared as its
only mutation) take an FP4Tensor's parts as tensors and its format and layout as strings; their real
implementation is the eager :func:`fp4gemv.gemv` (any device: kernels on CUDA, the reference or the
interpreter on CPU) and their fake implementation computes the result's shape and dtype only.  Under
``torch.compile`` :func:`fp4gemv.gemv` checks its arguments' metadata and calls these ops (:func:`traced_gemv`);
everything that looks at data or addresses (alignment, kernel choice) happens inside the op, at run time.
"""

from __future__ import annotations

import torch

from . import ops
from .tensor import FP4Tensor

__all__ = ["traced_gemv"]


def _operands(a_data, a_scales, a_global_scale, b, b_scales, b_global_scale, fmt, a_layout, b_layout):
    a = FP4Tensor(a_data, a_scales, fmt, a_layout, a_global_scale)
    if b_scales is not None:
        b = FP4Tensor(b, b_scales, fmt, b_layout, b_global_scale)
    return a, b


def _config(kernel: str | None, config: list[int] | None):
    if config is None:
        return None
    from .kernels import kernel_by_name

    return kernel_by_name(kernel).config_type(*config)


@torch.library.custom_op("fp4gemv::gemv", mutates_args=())
def _gemv_op(
    a_data: torch.Tensor, a_scales: torch.Tensor, a_global_scale: torch.Tensor | None, b: torch.Tensor,
    b_scales: torch.Tensor | None, b_global_scale: torch.Tensor | None, fmt: str, a_layout: str, b_layout: str,
    out_dtype: torch.dtype, backend: str, kernel: str | None, config: list[int] | None,
) -> torch.Tensor:
    a, b = _operands(a_data, a_scales, a_global_scale, b, b_scales, b_global_scale, fmt, a_layout, b_layout)
    return ops.gemv(a, b, out_dtype=out_dtype, backend=backend, kernel=kernel, config=_config(kernel, config))


@torch.library.custom_op("fp4gemv::gemv_out", mutates_args=("out",))
def _gemv_out_op(
    a_data: torch.Tensor, a_scales: torch.Tensor, a_global_scale: torch.Tensor | None, b: torch.Tensor,
    b_scales: torch.Tensor | None, b_global_scale: torch.Tensor | None, fmt: str, a_layout: str, b_layout: str,
    out: torch.Tensor, backend: str, kernel: str | None, config: list[int] | None,
) -> None:
    a, b = _operands(a_data, a_scales, a_global_scale, b, b_scales, b_global_scale, fmt, a_layout, b_layout)
    ops.gemv(a, b, out=out, out_dtype=out.dtype, backend=backend, kernel=kernel, config=_config(kernel, config))


def _fake_shape(a_data: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor | None) -> tuple:
    """The result's shape from the operands' shapes (b FP4 data ``[L?, N, K/2]`` or a float ``[L?, N?, K]``)."""
    batch = a_data.shape[0] if a_data.dim() == 3 else b.shape[0] if b.dim() == 3 else None
    n = () if b.dim() == 1 else (b.shape[-2],)
    return (*(() if batch is None else (batch,)), a_data.shape[-2], *n)


@_gemv_op.register_fake
def _(a_data, a_scales, a_global_scale, b, b_scales, b_global_scale, fmt, a_layout, b_layout, out_dtype, backend,
      kernel, config):
    return a_data.new_empty(_fake_shape(a_data, b, b_scales), dtype=out_dtype)


@_gemv_out_op.register_fake
def _(a_data, a_scales, a_global_scale, b, b_scales, b_global_scale, fmt, a_layout, b_layout, out, backend,
      kernel, config):
    return None


def traced_gemv(a, b, *, out, out_dtype, backend, kernel, config) -> torch.Tensor:
    """:func:`fp4gemv.gemv` under ``torch.compile``: the metadata checks, then the custom op."""
    shape = ops.result_shape(a, b)
    if b.device != a.device:
        raise ValueError(f"b: expected device {a.device} like a, got {b.device}")
    if out_dtype not in ops.OUT_DTYPES:
        raise TypeError(f"out_dtype: expected {ops._names(ops.OUT_DTYPES)}, got {out_dtype}")
    if config is not None and kernel is None:
        raise ValueError("config: under torch.compile a config needs the kernel it is for (kernel=...)")
    fp4 = isinstance(b, FP4Tensor)
    args = (a.data, a.scales, a.global_scale, b.data if fp4 else b, b.scales if fp4 else None,
            b.global_scale if fp4 else None, a.fmt.name, a.scale_layout, b.scale_layout if fp4 else "")
    options = (backend, kernel, None if config is None else [int(v) for v in config])
    if out is None:
        return torch.ops.fp4gemv.gemv(*args, out_dtype, *options)
    ops._check_out(out, shape, out_dtype, a.device)
    torch.ops.fp4gemv.gemv_out(*args, out, *options)
    return out
