"""MoE routing, router logits to (expert ids, routing weights): validate once, plan, launch through the table.

:func:`moe_route` replaces ``top, ids = torch.topk(logits, k); weights = torch.softmax(top.float(), -1)`` (several
kernels) with one launch of ``kernels.moe_route`` on CUDA, and no host sync, so that it can be captured in a CUDA
graph and traced by ``torch.compile(fullgraph=True)`` (through ``fp4gemv.moe_route``, the custom op
``torch.ops.fp4gemv.moe_route``).  Off CUDA (``backend="auto"``) the float64 oracle
``reference.route_reference`` computes it.  Validation raises ``TypeError`` (type, dtype) or ``ValueError``
(shape, value, device) naming the argument, the expected and the actual, before anything is launched.
"""

from __future__ import annotations

import torch

from .formats import dtype_names as _names
from .kernels import ROUTE_KERNELS, choose_kernel
from .kernels.moe_route import MAX_EXPERTS, RouteCase, RouteOperands
from .moe import ID_DTYPES
from .ops import refuse_gradients as _refuse_gradients
from .ops import without_backward
from .reference import ROUTE_WEIGHTS
from .target import Backend, resolve_target
from .tensor import check_device_with_values

__all__ = ["moe_route", "check_route_arguments", "route_case", "LOGIT_DTYPES", "WEIGHT_DTYPES", "ROUTE_WEIGHTS",
           "MAX_EXPERTS"]

LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_route_arguments(logits, top_k, weights, ids_dtype, out_dtype) -> tuple[int, int]:
    """The checks of :func:`moe_route` (metadata only: eager calls and ``torch.compile`` share them); the result's
    shape ``(T, k)``."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits: expected a torch.Tensor [T, E], got {type(logits).__name__}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"logits: expected dtype {_names(LOGIT_DTYPES)}, got {logits.dtype}")
    if logits.dim() != 2:
        raise ValueError(f"logits: expected 2 dims [T, E], got shape {tuple(logits.shape)}")
    tokens, experts = logits.shape
    if tokens < 1 or not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"logits: expected [T, E] with T >= 1 and 1 <= E <= {MAX_EXPERTS}, got shape "
                         f"{tuple(logits.shape)}")
    check_device_with_values("logits", logits.device)
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k: expected an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k: expected 1 <= top_k <= E = {experts}, got {top_k}")
    if weights not in ROUTE_WEIGHTS:
        raise ValueError(f"weights: expected one of {', '.join(map(repr, ROUTE_WEIGHTS))}, got {weights!r}")
    if ids_dtype not in ID_DTYPES:
        raise TypeError(f"ids_dtype: expected {_names(ID_DTYPES)}, got {ids_dtype!r}")
    if out_dtype not in WEIGHT_DTYPES:
        raise TypeError(f"out_dtype: expected {_names(WEIGHT_DTYPES)}, got {out_dtype!r}")
    return tokens, top_k


def route_case(logits: torch.Tensor, top_k: int, weights: str, ids_dtype: torch.dtype,
               out_dtype: torch.dtype) -> RouteCase:
    """The :class:`kernels.moe_route.RouteCase` of checked arguments."""
    return RouteCase(tokens=logits.shape[0], experts=logits.shape[1], top_k=top_k, weights=weights,
                     logits_dtype=logits.dtype, logits_strides=tuple(logits.stride()), ids_dtype=ids_dtype,
                     out_dtype=out_dtype)


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    *,
    weights: str = "softmax_selected",
    ids_dtype: torch.dtype = torch.int32,
    out_dtype: torch.dtype = torch.float32,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids, routing weights) of router logits: the top-k experts of each token and their weights.

    logits: ``[T, E]`` float16, bfloat16 or float32, any strides, on the CPU or CUDA; T >= 1,
        1 <= E <= 1024 (``MAX_EXPERTS``; larger is refused naming ``logits``).
    top_k: 1 <= top_k <= E.
    weights: ``"softmax_selected"``: softmax over the k selected logits (gpt-oss; Qwen3-MoE with
        ``norm_topk_prob=True``, which is the same numbers); ``"softmax_all"``: softmax over all E logits, the
        selected probabilities not renormalised (Qwen3-MoE with ``norm_topk_prob=False``).
    ids_dtype: int32 (default) or int64, as ``moe_gemv`` takes them.
    out_dtype: the weights' dtype: float32 (default), bfloat16 or float16.
    backend: ``"auto"`` (the kernel on CUDA, the float64 reference elsewhere), ``"triton"`` (the kernel; on CPU
        tensors under ``TRITON_INTERPRET=1``), ``"reference"``; ``"triton-ptx"`` runs the kernel too (it has no
        PTX of its own).

    Returns ``(ids, weights)``, both new ``[T, top_k]`` tensors on logits' device.

    Selection: per token the top_k largest logits, compared exactly as given (no rounding), in descending order
    (``ids[:, 0]`` is the largest).  Equal logits, -0.0 and +0.0 included, go by lower expert index first (a
    fixed order where ``torch.topk``'s is unspecified).  A NaN counts as larger than any number, as in
    ``torch.topk`` (NaNs by lower index first).

    Weights: with m the token's largest logit (``ids[:, 0]``'s), ``exp(x_j - m) / sum_i exp(x_i - m)``, i over the
    selected logits or all E; computed in fp32 (the kernel: within ``(6 d + n + 9) 2^-24`` relative of the exact
    value, d <= 104 the largest ``|x_i - m|`` whose exp does not underflow, n the terms summed; see
    ``kernels/moe_route.py``), then rounded once to ``out_dtype``; the reference computes in float64.  A NaN,
    +inf, or only -inf among the logits softmaxed gives that token NaN weights, as ``torch.softmax`` (the ids are
    still as above).

    No host sync on any path of the kernel: CUDA-graph capture and ``torch.compile(fullgraph=True)`` work.
    Inference only: no backward.  In grad mode with logits that require grad the results are computed, and a
    backward through the weights raises RuntimeError saying so; under ``torch.compile`` such logits are refused
    up front (ValueError naming ``logits``).
    """
    if torch.compiler.is_compiling():
        raise RuntimeError("moe_route: under torch.compile call fp4gemv.moe_route (fp4gemv.library.moe_route), "
                           "which traces the custom op torch.ops.fp4gemv.moe_route")
    shape = check_route_arguments(logits, top_k, weights, ids_dtype, out_dtype)
    target = resolve_target(backend, logits.device)
    case = route_case(logits, top_k, weights, ids_dtype, out_dtype)
    spec = choose_kernel(case, target, None, ROUTE_KERNELS)
    ids = torch.empty(shape, dtype=ids_dtype, device=logits.device)
    result = torch.empty(shape, dtype=out_dtype, device=logits.device)
    with torch.no_grad():  # no autograd graph on any backend (inference only, see above)
        spec.launch(RouteOperands(case, logits, ids, result), spec.resolve_config(None, case, target), target)
    return ids, without_backward(result, (logits,), NO_BACKWARD)


NO_BACKWARD = ("moe_route has no backward (inference only): logits get no gradient through the routing weights; "
               "call it under torch.no_grad(), or detach them")


def refuse_gradients(logits) -> None:
    """``ops.refuse_gradients`` of the logits."""
    _refuse_gradients((("logits", logits),), NO_BACKWARD)
