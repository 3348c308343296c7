"""The exact oracle every kernel is tested against, on raw tensors.

Operands are dequantized to float64 (exact: see ``formats.dequantize``) and multiplied in float64.  Each
product of two dequantized NVFP4 values has at most 12 significant bits, so the only rounding before the
final cast is float64 accumulation, about 2^-53 relative to the sum of magnitudes: far below the one
rounding to fp16/bf16/fp32 that the result then takes.
"""

from __future__ import annotations

import torch

from . import layouts
from .formats import FP4Format, dequantize, reorder_codes, round_from_float64

__all__ = ["gemv_reference", "fp4_values", "quantized_gemv_reference", "routed_gemv_reference", "routed_epilogue",
           "moe_activation", "gate_up_halves", "MOE_ACTIVATIONS", "GPT_OSS_ALPHA", "GPT_OSS_LIMIT", "route_reference",
           "ROUTE_WEIGHTS", "combine_reference"]

# The activations a routed product can end in, and where gate and up lie in W's 2I rows: "gpt-oss" interleaved
# (rows 2i and 2i + 1; transformers 5.17 GptOssExperts: gate_up[..., ::2], gate_up[..., 1::2]), "silu" halves
# (rows i and I + i; Qwen3MoeExperts: gate_up.chunk(2, dim=-1)).
MOE_ACTIVATIONS = {"gpt-oss": "interleaved", "silu": "halves"}
# GptOssExperts: self.alpha = 1.702, self.limit = 7.0.
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def gemv_reference(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``a @ b^T`` per batch in float64, rounded once to ``out_dtype``.

    a: ``[..., M, K]`` real values (any float dtype; typically from ``formats.dequantize``).
    b: ``[..., N, K]`` real values with the same batch dimensions.
    Returns ``[..., M, N]``.  Runs on any device; float64 is upcast on the operands' device.
    """
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"b: expected K = {a.shape[-1]} to match a, got {b.shape[-1]}")
    return round_from_float64(torch.matmul(a.to(torch.float64), b.to(torch.float64).transpose(-1, -2)), out_dtype)


def fp4_values(data: torch.Tensor, scales: torch.Tensor, fmt: FP4Format, scale_layout: str,
               global_scale: torch.Tensor | None, code_order: str = "checkpoint") -> torch.Tensor:
    """The exact float64 values ``[..., R, K]`` of packed e2m1 ``data`` ``[..., R, K/2]`` (codes in ``code_order``,
    ``formats.reorder_codes``) with block ``scales`` in ``scale_layout`` (``"linear"`` ``[..., R, K/bs]`` or
    ``"swizzled"`` ``[..., R_p * C_p]``), times ``global_scale`` when given: an FP4Tensor's fields."""
    data = reorder_codes(data, code_order, "checkpoint")
    if scale_layout == "swizzled":
        scales = layouts.unswizzle_scales(scales, data.shape[-2], 2 * data.shape[-1] // fmt.block_size)
    return dequantize(data, scales, fmt, global_scale, torch.float64)


def quantized_gemv_reference(a, b, out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The exact result of ``fp4gemv.gemv(a, b)``: both operands in float64, then :func:`gemv_reference`.

    a: an FP4Tensor ``[L?, M, K]`` (read through its fields ``data``, ``scales``, ``fmt``, ``scale_layout``,
    ``global_scale``, ``code_order``), dequantized exactly.  b: an FP4Tensor ``[L?, N, K]`` likewise, or a float tensor
    ``[L?, N, K]`` or ``[K]`` taken as given.  Batch dimensions broadcast as in ``torch.matmul``.  Returns
    ``[L?, M, N]`` (``[L?, M]`` for a ``[K]`` vector) in ``out_dtype``, rounded once;
    ``out_dtype=torch.float64`` gives the exact value itself.
    """
    a_values = fp4_values(a.data, a.scales, a.fmt, a.scale_layout, a.global_scale, a.code_order)
    if isinstance(b, torch.Tensor):
        b_values = b.to(torch.float64)
    else:
        b_values = fp4_values(b.data, b.scales, b.fmt, b.scale_layout, b.global_scale, b.code_order)
    if b_values.dim() == 1:
        return gemv_reference(a_values, b_values[None, :], out_dtype)[..., 0]
    return gemv_reference(a_values, b_values, out_dtype)


def gate_up_halves(values: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) ``[..., I]`` of ``values`` ``[..., 2I]`` as ``MOE_ACTIVATIONS[activation]`` arranges them."""
    if MOE_ACTIVATIONS[activation] == "interleaved":
        return values[..., 0::2], values[..., 1::2]
    half = values.shape[-1] // 2
    return values[..., :half], values[..., half:]


def moe_activation(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """The gated activation in the operands' dtype: "gpt-oss" ``min(gate, limit) * sigmoid(alpha * min(gate,
    limit)) * (clamp(up, -limit, limit) + 1)`` (GptOssExperts._apply_gate), "silu" ``silu(gate) * up``."""
    if activation == "gpt-oss":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return gate * torch.sigmoid(gate * alpha) * (up + 1)
    return gate * torch.sigmoid(gate) * up


def routed_epilogue(values: torch.Tensor, expert_ids: torch.Tensor, experts: int, *, half_scales=None, bias=None,
                    activation: str | None = None, alpha: float = 0.0, limit: float = 0.0,
                    pair_weights=None) -> torch.Tensor:
    """What follows the routed product ``values`` ``[T, k, M]`` (W @ x, global scales of ``[E]`` applied), in
    ``values``' dtype: times ``half_scales`` ``[E, 2]`` (gate's rows and up's, as ``activation`` arranges them),
    plus ``bias`` ``[E, M]``, the activation (``[T, k, M / 2]``), times ``pair_weights`` ``[T, k]``; pairs with an
    id outside ``[0, E)`` give zeros."""
    valid = (expert_ids >= 0) & (expert_ids < experts)
    e = torch.where(valid, expert_ids, 0).long()
    if half_scales is not None:
        rows = values.shape[-1]
        half = torch.arange(rows, device=values.device)
        half = half % 2 if MOE_ACTIVATIONS[activation] == "interleaved" else half // (rows // 2)
        values = values * half_scales.to(values.dtype)[e][..., half]
    if bias is not None:
        values = values + bias.to(values.dtype)[e]
    values = torch.where(valid[..., None], values, 0)
    if activation is not None:
        values = moe_activation(*gate_up_halves(values, activation), activation, alpha, limit)
    if pair_weights is not None:
        values = values * pair_weights.to(values.dtype)[..., None]
    return values


def routed_gemv_reference(data: torch.Tensor, scales: torch.Tensor, fmt: FP4Format, scale_layout: str,
                          global_scale: torch.Tensor | None, x: torch.Tensor, expert_ids: torch.Tensor,
                          bias: torch.Tensor | None = None, global_scales: torch.Tensor | None = None,
                          out_dtype: torch.dtype = torch.float16, activation: str | None = None,
                          alpha: float = 0.0, limit: float = 0.0,
                          pair_weights: torch.Tensor | None = None, code_order: str = "checkpoint") -> torch.Tensor:
    """The exact result of ``fp4gemv.moe_gemv``: ``out[t, j] = W[e] @ x[t] (+ bias[e])`` for ``e = ids[t, j]``, in
    float64, then :func:`routed_epilogue` in float64 (``activation``, ``pair_weights``), rounded once to
    ``out_dtype`` (``torch.float64``: the exact value); pairs with an id outside ``[0, E)`` give zeros.

    data, scales, fmt, scale_layout, global_scale, code_order: the experts ``[E, M, K]`` as an FP4Tensor's fields
    (one global scale for all); global_scales: ``[E]``, one per expert, or ``[E, 2]`` with an activation (gate's, up's);
    x ``[T, K]``; expert_ids ``[T, k]``; bias ``[E, M]``.  Only the experts named are dequantized.  Returns
    ``[T, k, M]`` (``[T, k, M / 2]`` with an activation).
    """
    experts, rows = data.shape[0], data.shape[1]
    x64 = x.to(torch.float64)
    half_scales = global_scales if global_scales is not None and global_scales.dim() == 2 else None
    result = torch.zeros((*expert_ids.shape, rows), dtype=torch.float64, device=x.device)
    for e in torch.unique(expert_ids).tolist():
        if not 0 <= e < experts:
            continue
        tokens, slots = (expert_ids == e).nonzero(as_tuple=True)
        w_e = fp4_values(data[e], scales[e], fmt, scale_layout, global_scale, code_order)
        if global_scales is not None and half_scales is None:
            w_e = w_e * global_scales[e].to(torch.float64)
        result[tokens, slots] = x64[tokens] @ w_e.T
    result = routed_epilogue(result, expert_ids, experts, half_scales=half_scales, bias=bias, activation=activation,
                             alpha=alpha, limit=limit, pair_weights=pair_weights)
    return result if out_dtype == torch.float64 else round_from_float64(result, out_dtype)


# --- MoE routing (fp4gemv.moe_route) -----------------------------------------------------------------------------

ROUTE_WEIGHTS = ("softmax_selected", "softmax_all")


def route_reference(logits: torch.Tensor, top_k: int, weights: str = "softmax_selected",
                    out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact result of ``fp4gemv.moe_route``: (expert ids ``[T, k]`` int64, routing weights ``[T, k]`` in
    ``out_dtype``, rounded once from float64; ``torch.float64`` gives the exact value).

    logits: ``[T, E]`` any float dtype, compared as given (float64 holds every fp16/bf16/fp32 value).  Per row the
    ``top_k`` largest, in descending order; equal logits (-0.0 and +0.0 included) by lower index first; a NaN is
    larger than any number (NaNs in index order).  Weights, with ``m`` the row's first selected logit (its
    largest): ``exp(x_j - m) / sum_i exp(x_i - m)`` over i the selected logits (``"softmax_selected"``) or all E
    (``"softmax_all"``), in IEEE arithmetic: NaN across the row where the softmax holds a NaN, a +inf, or only
    -inf (as ``torch.softmax``).
    """
    if weights not in ROUTE_WEIGHTS:
        raise ValueError(f"weights: expected one of {', '.join(map(repr, ROUTE_WEIGHTS))}, got {weights!r}")
    x = logits.to(torch.float64)
    nan = torch.isnan(x)
    # Two stable sorts make the order total: by value (NaN set aside, -0.0 as +0.0), then NaN first; stability
    # keeps equal keys in index order.  Neither relies on how a sort orders NaN or signed zeros.
    by_value = torch.where(nan | (x == 0), 0.0, x).sort(dim=-1, descending=True, stable=True).indices
    nan_first = nan.gather(-1, by_value).to(torch.int8).sort(dim=-1, descending=True, stable=True).indices
    ids = by_value.gather(-1, nan_first)[:, :top_k]
    top = x.gather(-1, ids)
    largest = top[:, :1]
    terms = x if weights == "softmax_all" else top
    result = torch.exp(top - largest) / torch.exp(terms - largest).sum(dim=-1, keepdim=True)
    return ids, result if out_dtype == torch.float64 else round_from_float64(result, out_dtype)


def combine_reference(y: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The result of ``fp4gemv.moe_combine``: ``y [T, k, H]`` (float32) summed over k in IEEE fp32 in slot order,
    ``(y[:, 0] + y[:, 1]) + ...``, then rounded once to ``out_dtype`` (nearest, ties to even).  The op is defined
    by this order (not by the exact sum), so every backend gives these bits."""
    total = y[:, 0].clone()
    for j in range(1, y.shape[1]):
        total = total + y[:, j]
    return total.to(out_dtype)
