"""The public ``gemv`` and ``quantize``, and fp4gemv's ops registered with PyTorch (``torch.library``), so
``torch.compile`` sees each call as a single op.

Eagerly, :func:`gemv` and :func:`quantize` run the op layer's (``ops.gemv``, ``quantize.quantize``).  Under
``torch.compile`` they check their arguments' metadata (the op layer's own checks) and call the custom ops:
``torch.ops.fp4gemv.gemv`` (a new result), ``torch.ops.fp4gemv.gemv_out`` (writes ``out``, declared as its only
mutation) and ``torch.ops.fp4gemv.quantize`` (the packed data and scale bytes), which take an FP4Tensor's parts
as tensors and its format and layout as strings.  Their real implementations are the eager functions (any
device: kernels on CUDA, the reference or the interpreter on CPU); their fake implementations compute shapes
and dtypes only.  Everything that looks at data or addresses (alignment, kernel choice, the NaN check) happens
inside the op, at run time.  ``torch.ops.fp4gemv.moe_gemv`` is the routed expert GEMV
(:func:`moe_gemv`).
"""

from __future__ import annotations

import torch

from . import formats, layouts, moe, ops
from .kernels import GEMV_KERNELS, MOE_KERNELS, kernel_by_name
from .quantize import check_quantize_arguments, global_scale_tensor
from .quantize import quantize as eager_quantize
from .tensor import FP4Tensor

__all__ = ["gemv", "quantize", "moe_gemv"]


def gemv(a, b, *, out=None, out_dtype=torch.float16, backend="auto", kernel=None, config=None) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _traced_gemv(a, b, out=out, out_dtype=out_dtype, backend=backend, kernel=kernel, config=config)
    return ops.gemv(a, b, out=out, out_dtype=out_dtype, backend=backend, kernel=kernel, config=config)


def quantize(x, fmt="nvfp4", scale_layout="linear", global_scale=None, *, backend="auto", check_values=True,
             config=None) -> FP4Tensor:
    if torch.compiler.is_compiling():
        return _traced_quantize(x, fmt, scale_layout, global_scale, backend, check_values, config)
    return eager_quantize(x, fmt, scale_layout, global_scale, backend=backend, check_values=check_values,
                                config=config)


# One docstring per function: the eager one's, which documents every argument.
gemv.__doc__ = ops.gemv.__doc__
quantize.__doc__ = eager_quantize.__doc__


def _operands(a_data, a_scales, a_global_scale, b, b_scales, b_global_scale, fmt, a_layout, b_layout):
    a = FP4Tensor(a_data, a_scales, fmt, a_layout, a_global_scale)
    if b_scales is not None:
        b = FP4Tensor(b, b_scales, fmt, b_layout, b_global_scale)
    return a, b


def _config(kernel: str | None, config: list[int] | None, kernels=GEMV_KERNELS):
    """A config the custom ops carry as a list of ints, back as the named kernel's config type."""
    if config is None:
        return None
    return kernel_by_name(kernel, kernels).config_type(*config)


def _config_list(kernel: str | None, config) -> list[int] | None:
    """A config as the custom ops carry it (ints: their schema has no NamedTuple)."""
    if config is None:
        return None
    if kernel is None:
        raise ValueError("config: under torch.compile a config needs the kernel it is for (kernel=...)")
    return [int(v) for v in config]


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


def _traced_gemv(a, b, *, out, out_dtype, backend, kernel, config) -> torch.Tensor:
    """:func:`gemv` under ``torch.compile``: the metadata checks, then the custom op."""
    ops.check_arguments(a, b, out, out_dtype)
    fp4 = isinstance(b, FP4Tensor)
    args = (a.data, a.scales, a.global_scale, b.data if fp4 else b, b.scales if fp4 else None,
            b.global_scale if fp4 else None, a.fmt.name, a.scale_layout, b.scale_layout if fp4 else "")
    options = (backend, kernel, _config_list(kernel, config))
    if out is None:
        return torch.ops.fp4gemv.gemv(*args, out_dtype, *options)
    torch.ops.fp4gemv.gemv_out(*args, out, *options)
    return out


@torch.library.custom_op("fp4gemv::quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, fmt: str, scale_layout: str, global_scale: torch.Tensor | None, backend: str,
                 check_values: bool) -> tuple[torch.Tensor, torch.Tensor]:
    t = eager_quantize(x, fmt, scale_layout, global_scale, backend=backend, check_values=check_values)
    return t.data, t.scales


@_quantize_op.register_fake
def _(x, fmt, scale_layout, global_scale, backend, check_values):
    *batch, rows, k = x.shape
    cols = k // formats.FORMATS[fmt].block_size
    if scale_layout == "linear":
        scales = (*batch, rows, cols)
    else:
        rows_p, cols_p = layouts.padded_scale_shape(rows, cols)
        scales = (*batch, rows_p * cols_p)
    return x.new_empty((*batch, rows, k // 2), dtype=torch.uint8), x.new_empty(scales, dtype=torch.uint8)


def _traced_quantize(x, fmt, scale_layout, global_scale, backend, check_values, config) -> FP4Tensor:
    """:func:`quantize` under ``torch.compile``: the metadata checks, then the custom op."""
    fmt = check_quantize_arguments(x, fmt, scale_layout, backend, config)
    if config is not None:
        raise ValueError("config: a QuantizeConfig is not supported under torch.compile (pass None)")
    g = global_scale_tensor(global_scale, fmt, x, False)
    data, scales = torch.ops.fp4gemv.quantize(x, fmt.name, scale_layout, g, backend, check_values)
    return FP4Tensor(data, scales, fmt, scale_layout, g)


# --- routed expert GEMV (fp4gemv.moe) ----------------------------------------------------------------------------


@torch.library.custom_op("fp4gemv::moe_gemv", mutates_args=())
def _moe_gemv_op(
    w_data: torch.Tensor, w_scales: torch.Tensor, w_global_scale: torch.Tensor | None, x: torch.Tensor,
    expert_ids: torch.Tensor, bias: torch.Tensor | None, global_scales: torch.Tensor | None, fmt: str,
    scale_layout: str, out_dtype: torch.dtype, backend: str, kernel: str | None, config: list[int] | None,
) -> torch.Tensor:
    w = FP4Tensor(w_data, w_scales, fmt, scale_layout, w_global_scale)
    # No id check inside a traced graph (it would sync): ids outside [0, E) give zeros (fp4gemv.moe).
    return moe.moe_gemv(w, x, expert_ids, bias=bias, global_scales=global_scales, out_dtype=out_dtype,
                        backend=backend, check_ids=False, kernel=kernel, config=_config(kernel, config, MOE_KERNELS))


@_moe_gemv_op.register_fake
def _(w_data, w_scales, w_global_scale, x, expert_ids, bias, global_scales, fmt, scale_layout, out_dtype, backend,
      kernel, config):
    return x.new_empty((expert_ids.shape[0], expert_ids.shape[1], w_data.shape[1]), dtype=out_dtype)


def moe_gemv(w, x, expert_ids, *, bias=None, global_scales=None, out=None, out_dtype=None, backend="auto",
             check_ids=True, kernel=None, config=None) -> torch.Tensor:
    """:func:`fp4gemv.moe.moe_gemv` (its docstring has the arguments), also under ``torch.compile``, where it is
    the custom op ``torch.ops.fp4gemv.moe_gemv`` after the metadata checks (ids unchecked: see ``check_ids``; a
    ``config`` needs its ``kernel``)."""
    if not torch.compiler.is_compiling():
        return moe.moe_gemv(w, x, expert_ids, bias=bias, global_scales=global_scales, out=out, out_dtype=out_dtype,
                            backend=backend, check_ids=check_ids, kernel=kernel, config=config)
    _, out_dtype = moe.check_moe_arguments(w, x, expert_ids, bias, global_scales, out, out_dtype)
    result = torch.ops.fp4gemv.moe_gemv(w.data, w.scales, w.global_scale, x, expert_ids, bias, global_scales,
                                        w.fmt.name, w.scale_layout, out_dtype, backend, kernel,
                                        _config_list(kernel, config))
    if out is None:
        return result
    out.copy_(result)
    return out
