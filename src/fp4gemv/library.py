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

Autograd: ``torch.ops.fp4gemv.gemv`` has a backward for a float activation (``register_autograd``; the weight
is frozen), which eager calls that need a gradient also go through, so every backend and ``torch.compile``
agree; it dequantizes through ``torch.ops.fp4gemv.dequantize``, so a compiled backward traces it as one op.
"""

from __future__ import annotations

import torch

from . import formats, layouts, moe, ops
from .kernels import GEMV_KERNELS, MOE_KERNELS, kernel_by_name
from .quantize import check_quantize_arguments, dequantize, global_scale_tensor
from .quantize import quantize as eager_quantize
from .tensor import FP4Tensor

__all__ = ["gemv", "quantize", "moe_gemv"]


def gemv(a, b, *, out=None, out_dtype=torch.float16, backend="auto", kernel=None, config=None) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _traced_gemv(a, b, out=out, out_dtype=out_dtype, backend=backend, kernel=kernel, config=config)
    if _grad_flows(b, out):
        return _differentiable_gemv(a, b, out=out, out_dtype=out_dtype, backend=backend, kernel=kernel,
                                    config=config)
    return ops.gemv(a, b, out=out, out_dtype=out_dtype, backend=backend, kernel=kernel, config=config)


def quantize(x, fmt="nvfp4", scale_layout="linear", global_scale=None, *, backend="auto", check_values=True,
             config=None) -> FP4Tensor:
    if torch.compiler.is_compiling():
        return _traced_quantize(x, fmt, scale_layout, global_scale, backend, check_values, config)
    return eager_quantize(x, fmt, scale_layout, global_scale, backend=backend, check_values=check_values,
                                config=config)


# One docstring per function: the eager one's, which documents every argument, and what autograd does.
gemv.__doc__ = ops.gemv.__doc__ + """
    Autograd: when ``b`` is a float tensor that requires grad (and grad mode is on), the result is differentiable
    in ``b`` on every backend and under ``torch.compile``: ``torch.ops.fp4gemv.gemv``'s backward computes
    ``db = dy^T @ W`` in float32 with ``W = dequantize(a, float32)`` (the exact value rounded once), rounded to
    b's dtype.  ``a`` (data, scales and global scale) is a frozen weight and gets no gradient, nor does an FP4
    ``b``.  With ``out``, the result is computed first and then copied into ``out`` (differentiable as
    ``Tensor.copy_``).
"""
quantize.__doc__ = eager_quantize.__doc__


def _operands(a_data, a_scales, a_global_scale, b, b_scales, b_global_scale, fmt, a_layout, b_layout, a_order,
              b_order):
    a = FP4Tensor(a_data, a_scales, fmt, a_layout, a_global_scale, a_order)
    if b_scales is not None:
        b = FP4Tensor(b, b_scales, fmt, b_layout, b_global_scale, b_order)
    return a, b


def _config(kernel: str | None, config: list[int] | None, kernels=GEMV_KERNELS):
    """A config the custom ops carry as a list of ints, back as the named kernel's config type."""
    if config is None:
        return None
    spec = kernel_by_name(kernel, kernels)
    if spec.config_type is None:
        raise TypeError(f"config: expected no config for kernel {kernel!r}, got {config!r}")
    return spec.config_type(*config)


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
    a_order: str, b_order: str, out_dtype: torch.dtype, backend: str, kernel: str | None, config: list[int] | None,
) -> torch.Tensor:
    a, b = _operands(a_data, a_scales, a_global_scale, b, b_scales, b_global_scale, fmt, a_layout, b_layout, a_order,
                     b_order)
    return ops.gemv(a, b, out_dtype=out_dtype, backend=backend, kernel=kernel, config=_config(kernel, config))


@torch.library.custom_op("fp4gemv::gemv_out", mutates_args=("out",))
def _gemv_out_op(
    a_data: torch.Tensor, a_scales: torch.Tensor, a_global_scale: torch.Tensor | None, b: torch.Tensor,
    b_scales: torch.Tensor | None, b_global_scale: torch.Tensor | None, fmt: str, a_layout: str, b_layout: str,
    a_order: str, b_order: str, out: torch.Tensor, backend: str, kernel: str | None, config: list[int] | None,
) -> None:
    a, b = _operands(a_data, a_scales, a_global_scale, b, b_scales, b_global_scale, fmt, a_layout, b_layout, a_order,
                     b_order)
    ops.gemv(a, b, out=out, out_dtype=out.dtype, backend=backend, kernel=kernel, config=_config(kernel, config))


def _fake_shape(a_data: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor | None) -> tuple:
    """The result's shape from the operands' shapes (b FP4 data ``[L?, N, K/2]`` or a float ``[L?, N?, K]``)."""
    batch = a_data.shape[0] if a_data.dim() == 3 else b.shape[0] if b.dim() == 3 else None
    n = () if b.dim() == 1 else (b.shape[-2],)
    return (*(() if batch is None else (batch,)), a_data.shape[-2], *n)


@_gemv_op.register_fake
def _(a_data, a_scales, a_global_scale, b, b_scales, b_global_scale, fmt, a_layout, b_layout, a_order, b_order,
      out_dtype, backend, kernel, config):
    return a_data.new_empty(_fake_shape(a_data, b, b_scales), dtype=out_dtype)


@_gemv_out_op.register_fake
def _(a_data, a_scales, a_global_scale, b, b_scales, b_global_scale, fmt, a_layout, b_layout, a_order, b_order, out,
      backend, kernel, config):
    return None


def _grad_flows(b, out) -> bool:
    """Whether autograd records this call: grad mode on, and a float b or out that requires grad (an FP4Tensor
    has no requires_grad)."""
    return torch.is_grad_enabled() and (getattr(b, "requires_grad", False) or getattr(out, "requires_grad", False))


def _custom_op_gemv(a, b, out, out_dtype, backend, kernel, config) -> torch.Tensor:
    """The custom op for checked arguments: ``fp4gemv::gemv`` (then copied into ``out``, so that autograd sees
    the copy) when there is no out or a gradient is to flow, else ``fp4gemv::gemv_out``."""
    fp4 = isinstance(b, FP4Tensor)
    args = (a.data, a.scales, a.global_scale, b.data if fp4 else b, b.scales if fp4 else None,
            b.global_scale if fp4 else None, a.fmt.name, a.scale_layout, b.scale_layout if fp4 else "",
            a.code_order, b.code_order if fp4 else "checkpoint")
    options = (backend, kernel, _config_list(kernel, config))
    if out is None:
        return torch.ops.fp4gemv.gemv(*args, out_dtype, *options)
    if _grad_flows(b, out):
        return out.copy_(torch.ops.fp4gemv.gemv(*args, out_dtype, *options))
    torch.ops.fp4gemv.gemv_out(*args, out, *options)
    return out


def _traced_gemv(a, b, *, out, out_dtype, backend, kernel, config) -> torch.Tensor:
    """:func:`gemv` under ``torch.compile``: the metadata checks, then the custom op."""
    ops.check_arguments(a, b, out, out_dtype)
    return _custom_op_gemv(a, b, out, out_dtype, backend, kernel, config)


def _differentiable_gemv(a, b, *, out, out_dtype, backend, kernel, config) -> torch.Tensor:
    """:func:`gemv` eagerly when a gradient is to flow: the checks, then the custom op, whose autograd formula
    is the one ``torch.compile`` traces."""
    ops.check_arguments(a, b, out, out_dtype)
    if config is not None and kernel is None:
        kernel = ops.select_kernel(a, b, out=out, out_dtype=out_dtype, backend=backend).name  # the op needs both
    return _custom_op_gemv(a, b, out, out_dtype, backend, kernel, config)


@torch.library.custom_op("fp4gemv::dequantize", mutates_args=())
def _dequantize_op(data: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None, fmt: str,
                   scale_layout: str, code_order: str, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(FP4Tensor(data, scales, fmt, scale_layout, global_scale, code_order), dtype)


@_dequantize_op.register_fake
def _(data, scales, global_scale, fmt, scale_layout, code_order, dtype):
    return data.new_empty((*data.shape[:-1], 2 * data.shape[-1]), dtype=dtype)


def _gemv_setup_context(ctx, inputs, output) -> None:
    a_data, a_scales, a_global_scale, b = inputs[:4]
    fmt, a_layout, a_order = inputs[6], inputs[7], inputs[9]
    ctx.save_for_backward(a_data, a_scales, a_global_scale)
    ctx.weight_format = (fmt, a_layout, a_order)
    ctx.b_dims, ctx.b_dtype = b.dim(), b.dtype


def _gemv_backward(ctx, grad: torch.Tensor):
    """db = dy^T @ W for a float b (``[L?, N, K]`` or ``[K]``), summed over a batch b was broadcast along; no
    gradient for anything else (the FP4 weight is frozen; FP4 activations have none)."""
    grads = [None] * 15
    if ctx.needs_input_grad[3]:
        a_data, a_scales, a_global_scale = ctx.saved_tensors
        weight = torch.ops.fp4gemv.dequantize(a_data, a_scales, a_global_scale, *ctx.weight_format, torch.float32)
        dy = grad.to(torch.float32)
        if ctx.b_dims == 1:  # b [K]: dy [L?, M]
            db = (dy.unsqueeze(-2) @ weight).squeeze(-2)
        else:
            db = dy.transpose(-1, -2) @ weight
        while db.dim() > ctx.b_dims:  # b broadcast over a's batch
            db = db.sum(0)
        grads[3] = db.to(ctx.b_dtype)
    return tuple(grads)


_gemv_op.register_autograd(_gemv_backward, setup_context=_gemv_setup_context)


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
    scale_layout: str, code_order: str, out_dtype: torch.dtype, backend: str, check_values: bool,
    kernel: str | None, config: list[int] | None, activation: str | None, alpha: float | None, limit: float | None,
    pair_weights: torch.Tensor | None,
) -> torch.Tensor:
    w = FP4Tensor(w_data, w_scales, fmt, scale_layout, w_global_scale, code_order)
    # No id check inside a traced graph (it would sync): ids outside [0, E) give zeros (fp4gemv.moe).  Global
    # scales are read when asked, as eagerly (a sync where the op runs).
    return moe.moe_gemv(w, x, expert_ids, bias=bias, global_scales=global_scales, out_dtype=out_dtype,
                        backend=backend, check_ids=False, check_values=check_values, kernel=kernel,
                        config=_config(kernel, config, MOE_KERNELS), activation=activation, alpha=alpha,
                        limit=limit, pair_weights=pair_weights)


@_moe_gemv_op.register_fake
def _(w_data, w_scales, w_global_scale, x, expert_ids, bias, global_scales, fmt, scale_layout, code_order, out_dtype,
      backend, check_values, kernel, config, activation, alpha, limit, pair_weights):
    rows = w_data.shape[1] // 2 if activation is not None else w_data.shape[1]
    return x.new_empty((expert_ids.shape[0], expert_ids.shape[1], rows), dtype=out_dtype)


def moe_gemv(w, x, expert_ids, *, bias=None, global_scales=None, out=None, out_dtype=None, backend="auto",
             check_ids=True, check_values=False, kernel=None, config=None, activation=None, alpha=None, limit=None,
             pair_weights=None) -> torch.Tensor:
    """:func:`fp4gemv.moe.moe_gemv` (its docstring has the arguments), also under ``torch.compile``, where it is
    the custom op ``torch.ops.fp4gemv.moe_gemv`` after the metadata checks (ids unchecked: see ``check_ids``;
    ``check_values`` reads the global scales when the op runs; a ``config`` needs its ``kernel``)."""
    if not torch.compiler.is_compiling():
        return moe.moe_gemv(w, x, expert_ids, bias=bias, global_scales=global_scales, out=out, out_dtype=out_dtype,
                            backend=backend, check_ids=check_ids, check_values=check_values, kernel=kernel,
                            config=config, activation=activation, alpha=alpha, limit=limit, pair_weights=pair_weights)
    _, out_dtype, _, _ = moe.check_moe_arguments(w, x, expert_ids, bias, global_scales, out, out_dtype,
                                                 activation=activation, alpha=alpha, limit=limit,
                                                 pair_weights=pair_weights)
    moe.refuse_gradients(x, bias, global_scales, pair_weights)
    result = torch.ops.fp4gemv.moe_gemv(w.data, w.scales, w.global_scale, x, expert_ids, bias, global_scales,
                                        w.fmt.name, w.scale_layout, w.code_order, out_dtype, backend, check_values,
                                        kernel, _config_list(kernel, config), activation, alpha, limit, pair_weights)
    if out is None:
        return result
    out.copy_(result)
    return out


# --- MoE routing (fp4gemv.route) ---------------------------------------------------------------------------------

from . import route  # noqa: E402

__all__ += ["moe_route"]


@torch.library.custom_op("fp4gemv::moe_route", mutates_args=())
def _moe_route_op(logits: torch.Tensor, top_k: int, weights: str, ids_dtype: torch.dtype, out_dtype: torch.dtype,
                  backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return route.moe_route(logits, top_k, weights=weights, ids_dtype=ids_dtype, out_dtype=out_dtype,
                           backend=backend)


@_moe_route_op.register_fake
def _(logits, top_k, weights, ids_dtype, out_dtype, backend):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=ids_dtype), logits.new_empty(shape, dtype=out_dtype)


def moe_route(logits, top_k, *, weights="softmax_selected", ids_dtype=torch.int32, out_dtype=torch.float32,
              backend="auto") -> tuple[torch.Tensor, torch.Tensor]:
    if not torch.compiler.is_compiling():
        return route.moe_route(logits, top_k, weights=weights, ids_dtype=ids_dtype, out_dtype=out_dtype,
                               backend=backend)
    route.check_route_arguments(logits, top_k, weights, ids_dtype, out_dtype)
    route.refuse_gradients(logits)
    return torch.ops.fp4gemv.moe_route(logits, top_k, weights, ids_dtype, out_dtype, backend)


moe_route.__doc__ = route.moe_route.__doc__ + """
    Under ``torch.compile`` this is the custom op ``torch.ops.fp4gemv.moe_route`` after the metadata checks.
"""


# --- MoE combine (fp4gemv.combine) ---------------------------------------------------------------------------------

from . import combine  # noqa: E402

__all__ += ["moe_combine"]


@torch.library.custom_op("fp4gemv::moe_combine", mutates_args=())
def _moe_combine_op(y: torch.Tensor, out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    return combine.moe_combine(y, out_dtype=out_dtype, backend=backend)


@_moe_combine_op.register_fake
def _(y, out_dtype, backend):
    return y.new_empty((y.shape[0], y.shape[2]), dtype=out_dtype)


def moe_combine(y, *, out_dtype=torch.bfloat16, backend="auto") -> torch.Tensor:
    if not torch.compiler.is_compiling():
        return combine.moe_combine(y, out_dtype=out_dtype, backend=backend)
    combine.check_combine_arguments(y, out_dtype)
    combine.refuse_gradients(y)
    return torch.ops.fp4gemv.moe_combine(y, out_dtype, backend)


moe_combine.__doc__ = combine.moe_combine.__doc__ + """
    Under ``torch.compile`` this is the custom op ``torch.ops.fp4gemv.moe_combine`` after the metadata checks.
"""
