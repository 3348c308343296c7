"""The float64 oracle as the dispatcher's last kernel spec: what runs when the reference is asked for (and,
with ``backend="auto"``, on tensors off CUDA)."""

from __future__ import annotations

import torch

from .. import formats, layouts
from ..formats import CODE_ORDERS
from ..reference import combine_reference, fp4_values, gemv_reference, route_reference, routed_gemv_reference
from ..target import Target
from .spec import GemvOperands, KernelSpec, MoeOperands

__all__ = ["Reference", "MoeReference", "RouteReference", "CombineReference", "QuantizeReference",
           "DequantizeReference"]

_ONLY_WHEN_ASKED = "the reference runs only when asked for (or off CUDA with backend 'auto')"


class _AskedReference(KernelSpec):
    """What every op's reference spec shares: no configuration, and it runs only when asked for (or where Triton
    does not run, such as CPU tensors with backend 'auto')."""

    config_type = None
    code_orders = activation_code_orders = CODE_ORDERS

    def why_not(self, case, target: Target) -> str | None:
        return _ONLY_WHEN_ASKED if target.runs_triton else None


class Reference(_AskedReference):
    """``reference.gemv_reference`` of the operands' exact values (``reference.fp4_values``), copied into the
    output: exact products and sums in float64, one rounding to the output dtype.  Any device, layout and
    alignment; no configuration."""

    name = "reference"

    def launch(self, ops: GemvOperands, config, target: Target) -> None:
        case = ops.case
        a = fp4_values(ops.a_data, ops.a_scales, case.fmt, case.a.scale_layout, ops.a_global_scale,
                       case.a.code_order)
        if case.fp4_activation:
            b = fp4_values(ops.b_data, ops.b_scales, case.fmt, case.b.scale_layout, ops.b_global_scale,
                           case.b.code_order)
        else:
            b = ops.b_data
        ops.out.copy_(gemv_reference(a, b, case.out_dtype))


class MoeReference(_AskedReference):
    """``reference.routed_gemv_reference`` of the operands, copied into the output (any device, layout and
    alignment; no configuration)."""

    name = "moe_reference"

    def launch(self, ops: MoeOperands, config, target: Target) -> None:
        d = ops.case.dense
        per_expert = ops.global_scales if ops.case.global_scales == "expert" else None
        per_tensor = ops.global_scales if ops.case.global_scales == "tensor" else None
        c = ops.case
        ops.out.copy_(routed_gemv_reference(ops.w_data, ops.w_scales, d.fmt, d.a.scale_layout, per_tensor, ops.x,
                                            ops.expert_ids, ops.bias, per_expert, d.out_dtype, c.activation, c.alpha,
                                            c.limit, ops.pair_weights, d.a.code_order))


# --- MoE routing (fp4gemv.moe_route) -----------------------------------------------------------------------------

class RouteReference(_AskedReference):
    """``reference.route_reference`` of the logits, copied into the results (any device and strides)."""

    name = "route_reference"

    def launch(self, ops, config, target: Target) -> None:
        case = ops.case
        ids, weights = route_reference(ops.logits, case.top_k, case.weights, case.out_dtype)
        ops.ids.copy_(ids)
        ops.weights.copy_(weights)


class CombineReference(_AskedReference):
    """``reference.combine_reference`` of y, copied into the result (any device and strides)."""

    name = "combine_reference"

    def launch(self, ops, config, target: Target) -> None:
        ops.out.copy_(combine_reference(ops.y, ops.case.out_dtype))


# --- quantize and dequantize (fp4gemv.quantize, fp4gemv.dequantize) ------------------------------------------------

class QuantizeReference(_AskedReference):
    """``formats.quantize`` (the definition every kernel matches bit for bit) of x, its scale bytes swizzled where
    asked, copied into the results."""

    name = "quantize_reference"

    def why_not(self, case, target: Target) -> str | None:
        if case.amax_partials:
            return "takes its global scale given (quantize computes a per-call one with torch first off Triton)"
        return super().why_not(case, target)

    def launch(self, ops, config, target: Target) -> None:
        case = ops.case
        data, scales = formats.quantize(ops.x, case.fmt, ops.global_scale)
        if case.layout == "swizzled":
            scales = layouts.swizzle_scales(scales)
        ops.data.copy_(data)
        ops.scales.copy_(scales)


class DequantizeReference(_AskedReference):
    """``formats.dequantize`` (the exact value rounded once; float64 the exact value itself) of the bytes (in the
    checkpoint order, ``formats.reorder_codes``), copied into the result."""

    name = "dequantize_reference"

    def why_not(self, case, target: Target) -> str | None:
        if case.out_dtype == torch.float64:
            return None  # the exact value: only the reference computes it
        return super().why_not(case, target)

    def launch(self, ops, config, target: Target) -> None:
        case = ops.case
        scales = ops.scales
        if case.layout == "swizzled":
            scales = layouts.unswizzle_scales(scales, case.rows, case.k // case.fmt.block_size)
        data = formats.reorder_codes(ops.data, case.code_order, "checkpoint")
        with torch.no_grad():  # the FP4 tensor is frozen: no graph to its global scale, as from the kernel
            ops.out.copy_(formats.dequantize(data, scales, case.fmt, ops.global_scale, case.out_dtype))
