"""Mixture-of-experts expert MLPs on FP4 weights, and the MoE checkpoint conventions that hold them.

:class:`FP4Experts` is a drop-in for transformers 5's expert modules (``forward(hidden_states, top_k_index,
top_k_weights)``; transformers 5.17, ``models/gpt_oss/modeling_gpt_oss.py`` ``GptOssExperts`` and
``models/qwen3_moe/modeling_qwen3_moe.py`` ``Qwen3MoeExperts``): each token's k experts run gate_up, the
activation and down through :func:`fp4gemv.moe_gemv` (each distinct expert's weights read once per call), and
the k outputs are summed with the routing weights.

* ``activation="gpt-oss"``: gate and up interleaved in gate_up's rows (``gate_up[..., ::2]``,
  ``gate_up[..., 1::2]``), both with bias; gate clamped above at ``limit`` 7.0, up to ``±limit``,
  ``gate * sigmoid(alpha * gate) * (up + 1)`` with alpha 1.702; down with bias (``GptOssExperts._apply_gate``).
* ``activation="silu"``: ``silu(gate) * up``, gate the first half of gate_up's rows (``.chunk(2, dim=-1)``,
  ``Qwen3MoeExperts``), or gate and up as two projections (per-expert NVFP4 checkpoints: stacked into halves
  once, their global scales becoming moe_gemv's ``[E, 2]``); no bias.

gate_up and the activation are computed in fp32 inside moe_gemv's launch (``reference.moe_activation``), the
activation rounded once to the hidden dtype for down; down's result plus bias times the routing weight in fp32
(the same launch), summed over the k experts in fp32 (in slot order by ``fp4gemv.moe_combine``; under
``torch.compile`` by inductor's fused sum), then rounded to the hidden dtype.

Checkpoints, read without repacking where the layout allows (``FP4Experts`` then keeps one copy of the data in its
code order, ``EXPERT_CODE_ORDER``):

* gpt-oss (openai/gpt-oss ``gpt_oss/torch/weights.py``; transformers ``integrations/mxfp4.py``
  ``_convert_moe_packed_tensors``: ``sub[:, 0::2] = lut[blk & 0x0F]``, ``ldexp(value, scales - 127)``):
  ``<prefix>.gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]``, ``gate_up_proj_scales`` uint8 e8m0
  ``[E, 2I, H/32]``, ``gate_up_proj_bias`` ``[E, 2I]``, ``down_proj_blocks`` ``[E, H, I/32, 16]``,
  ``down_proj_scales``, ``down_proj_bias`` ``[E, H]``: the blocks are viewed as FP4Tensor data
  ``[E, rows, K/2]`` (same bytes) and the scales as linear e8m0 scales (:func:`gpt_oss_experts`); ``FP4Experts``
  then keeps the blocks in its code order (the native one: one reordered copy, the view let go) and linear
  scale rows 16 bytes apart (``layouts.aligned_scale_rows``: a copy where K/32 is not a multiple of 16, as
  gpt-oss's 90 bytes a row), which the routed engine's bulk copies need.
* NVFP4 experts stored one linear layer per expert, ``<prefix>.<e>.gate_proj`` / ``up_proj`` / ``down_proj``,
  in compressed-tensors (``weight_packed``, ``weight_scale``, ``weight_global_scale`` a divisor) or ModelOpt
  form (``weight``, ``weight_scale``, ``weight_scale_2`` a multiplier), each layer read by
  ``FP4Linear.from_state_dict`` (``checkpoints`` cites both conventions): the E experts' bytes are stacked
  into ``[E, rows, K/2]`` once at load (they are separate tensors in the file) and the per-tensor scales become
  moe_gemv's per-expert ``global_scales`` (:func:`nvfp4_experts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, NamedTuple

import torch
from torch import nn

from .. import layouts, library
from ..formats import check_global_scales, reorder_codes
from ..kernels.spec import NATIVE_FIELD_ORDERS
from ..reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT
from ..tensor import FP4Tensor
from .linear import FP4Linear, per_tensor_scale

__all__ = ["ExpertWeights", "FP4Experts", "gpt_oss_experts", "nvfp4_experts", "quantize_experts", "expert_kind",
           "GPT_OSS_ALPHA", "GPT_OSS_LIMIT", "EXPERT_SCALE_LAYOUT", "EXPERT_CODE_ORDER"]

Activation = Literal["gpt-oss", "silu"]
# The block-scale layout the model-level entry points (``quantize_model``, ``load_quantized``, ``from_pretrained``)
# give MoE experts, whatever their ``scale_layout`` gives the FP4Linear layers: linear, rows 16 bytes apart, the
# layout the routed engine copies (``kernels.moe_engine.scale_copy_reason``; swizzled experts stay on moe_weight_only,
# which took 1.17-1.32x the engine's time at T = 8-16 on gpt-oss's shapes: docs/performance.md, rounds 16-17) and
# every MoE benchmark measures.
EXPERT_SCALE_LAYOUT = "linear"
# The code order FP4Experts keeps its weights in (``FP4Tensor.code_order``): the native one, whose bf16 decode takes
# 10 instructions a word against the checkpoint order's 13 in the routed kernels' step (docs/performance.md, rounds
# 18-19).  Its state_dict holds the checkpoint order, and load_state_dict takes it: files never see the native one.
EXPERT_CODE_ORDER = "native"


class ExpertWeights(NamedTuple):
    """One projection of all experts: ``weight`` FP4Tensor ``[E, rows, K]``, optional ``bias`` ``[E, rows]``,
    optional per-expert fp32 ``global_scales`` ``[E]`` (instead of the weight's own global scale)."""

    weight: FP4Tensor
    bias: torch.Tensor | None = None
    global_scales: torch.Tensor | None = None


def _check_weights(name: str, w: object, experts: int | None = None) -> ExpertWeights:
    if not isinstance(w, ExpertWeights):
        raise TypeError(f"{name}: expected an ExpertWeights, got {type(w).__name__}")
    if not isinstance(w.weight, FP4Tensor) or w.weight.ndim != 3:
        raise ValueError(f"{name}: expected an FP4Tensor [E, rows, K], got {w.weight!r}")
    if experts is not None and w.weight.shape[0] != experts:
        raise ValueError(f"{name}: expected E = {experts} experts like gate_up, got {w.weight.shape[0]}")
    if w.global_scales is not None and w.global_scales.device.type != "meta":
        # Once, here: moe_gemv reads per-expert scales only when asked (a sync per call).
        check_global_scales(w.global_scales, f"{name}.global_scales")
    return w


def _stacked_gate_up(gate: ExpertWeights, up: ExpertWeights) -> ExpertWeights:
    """gate and up ``[E, I, H]`` as one gate_up ``[E, 2I, H]`` in halves (gate's rows, then up's), the layout
    ``moe_gemv``'s "silu" activation reads: data and scales concatenated (scales in gate's layout), biases
    likewise (zeros for a missing one), the global scales as ``[E, 2]`` (gate's, up's: each the projection's
    per-expert scale, or its tensor's one, or 1)."""
    layout = gate.weight.scale_layout
    g = gate.weight.with_scale_layout("linear")
    u = up.weight.with_scale_layout("linear").with_code_order(g.code_order)
    weight = FP4Tensor(torch.cat([g.data, u.data], dim=1), torch.cat([g.scales, u.scales], dim=1), g.fmt.name,
                       "linear", None, g.code_order).with_scale_layout(layout)
    bias = None
    if gate.bias is not None or up.bias is not None:
        zeros = (gate.bias if gate.bias is not None else up.bias).new_zeros(g.shape[:2])
        bias = torch.cat([zeros if p.bias is None else p.bias for p in (gate, up)], dim=1)
    global_scales = None
    halves = []
    for p in (gate, up):
        if p.global_scales is not None:
            halves.append(p.global_scales.to(torch.float32))
        elif p.weight.global_scale is not None:
            halves.append(p.weight.global_scale.to(torch.float32).reshape(1).expand(g.shape[0]))
        else:
            halves.append(None)
    if any(h is not None for h in halves):
        ones = torch.ones(g.shape[0], dtype=torch.float32, device=g.device)
        global_scales = torch.stack([ones if h is None else h for h in halves], dim=1).contiguous()
    return ExpertWeights(weight, bias, global_scales)


class FP4Experts(nn.Module):
    """The expert MLPs of one MoE layer on FP4 weights (module docstring: activations, rounding).

    gate_up: ExpertWeights ``[E, 2I, H]`` (fused: interleaved rows for "gpt-oss", halves for "silu"), or a
        pair ``(gate, up)`` of ExpertWeights ``[E, I, H]`` (stacked here into halves, once: a copy).
    down: ExpertWeights ``[E, H, I]``.
    activation: ``"gpt-oss"`` (clamped SwiGLU, ``alpha``, ``limit``) or ``"silu"``.
    code_order: the order the weights' codes are kept in (``EXPERT_CODE_ORDER``; given weights in another order
        are copied into it once).  ``state_dict`` and ``load_state_dict`` use the checkpoint order whatever it is.
    backend: moe_gemv's backend (``"auto"``: the Triton kernel on CUDA, the float64 reference on CPU).
    Expert ids come from the router's top-k and are not checked (no sync per step): an id outside [0, E)
    contributes zeros (``fp4gemv.moe``).

    A step is three launches: two ``moe_gemv`` (gate_up with the activation in its epilogue, ``activated``; down
    with the routing weights in its epilogue, ``weighted_down``) and ``moe_combine`` (the k outputs summed,
    ``combine``).
    """

    def __init__(self, gate_up, down: ExpertWeights, *, activation: Activation = "gpt-oss",
                 alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT, backend: str = "auto",
                 code_order: str = EXPERT_CODE_ORDER) -> None:
        super().__init__()
        if activation not in ("gpt-oss", "silu"):
            raise ValueError(f"activation: expected 'gpt-oss' or 'silu', got {activation!r}")
        if code_order not in NATIVE_FIELD_ORDERS:  # the routed kernels' ("paired" is the dense kernels' only)
            raise ValueError(f"code_order: expected one of {NATIVE_FIELD_ORDERS} (the routed kernels' orders), got "
                             f"{code_order!r}")
        projections = list(gate_up) if isinstance(gate_up, tuple) and not isinstance(gate_up, ExpertWeights) \
            else [gate_up]
        if len(projections) not in (1, 2):
            raise ValueError(f"gate_up: expected one fused ExpertWeights or a (gate, up) pair, got {len(projections)}")
        first = _check_weights("gate_up", projections[0])
        experts, rows, hidden = first.weight.shape
        for i, p in enumerate(projections[1:], 1):
            _check_weights("gate_up", p, experts)
            if p.weight.shape != first.weight.shape:
                raise ValueError(f"gate_up: expected up of gate's shape {tuple(first.weight.shape)}, got "
                                 f"{tuple(p.weight.shape)}")
            if p.weight.fmt != first.weight.fmt:
                raise ValueError(f"gate_up: expected up in gate's format {first.weight.fmt.name}, got "
                                 f"{p.weight.fmt.name}")
        intermediate = rows if len(projections) == 2 else rows // 2
        if len(projections) == 1 and rows % 2:
            raise ValueError(f"gate_up: expected an even number of rows (gate and up), got {rows}")
        if len(projections) == 2 and activation != "silu":
            raise ValueError(f"gate_up: a (gate, up) pair is stacked in halves, which the 'silu' activation reads; "
                             f"got activation {activation!r}")
        down = _check_weights("down", down, experts)
        if tuple(down.weight.shape[1:]) != (hidden, intermediate):
            raise ValueError(f"down: expected [E, H, I] = {(experts, hidden, intermediate)}, got "
                             f"{tuple(down.weight.shape)}")
        fused = projections[0] if len(projections) == 1 else _stacked_gate_up(*projections)
        self.num_experts, self.hidden_size, self.intermediate_size = experts, hidden, intermediate
        self.activation, self.alpha, self.limit, self.backend = activation, alpha, limit, backend
        self.code_order = code_order
        self._formats = {}
        for name, p in (("gate_up", fused), ("down", down)):
            scales = p.weight.scales
            if p.weight.scale_layout == "linear":  # rows 16 bytes apart: the routed engine copies them in bulk
                scales = layouts.aligned_scale_rows(scales)
            self.register_buffer(f"{name}_data", reorder_codes(p.weight.data, p.weight.code_order, code_order))
            self.register_buffer(f"{name}_scales", scales)
            self.register_buffer(f"{name}_weight_global_scale", p.weight.global_scale)
            self.register_buffer(f"{name}_bias", p.bias)
            self.register_buffer(f"{name}_global_scales", p.global_scales)
            self._formats[name] = (p.weight.fmt.name, p.weight.scale_layout, p.weight.scales.shape[-1])

    def projection(self, name: str) -> ExpertWeights:
        """The ExpertWeights ``name`` ("gate_up": ``[E, 2I, H]``, gate and up as the activation reads them;
        "down") as stored (linear scales as a view of their 16-byte aligned rows)."""
        fmt, layout, cols = self._formats[name]
        b = self._buffers
        scales = b[f"{name}_scales"][..., :cols] if layout == "linear" else b[f"{name}_scales"]
        weight = FP4Tensor(b[f"{name}_data"], scales, fmt, layout, b[f"{name}_weight_global_scale"], self.code_order)
        return ExpertWeights(weight, b[f"{name}_bias"], b[f"{name}_global_scales"])

    # The packed data in the state dict is in the checkpoint order, whatever order the module keeps.
    _DATA = ("gate_up_data", "down_data")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in self._DATA:
            if prefix + name in destination:
                destination[prefix + name] = reorder_codes(destination[prefix + name], self.code_order, "checkpoint")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        state_dict = dict(state_dict)
        for name in self._DATA:
            given = state_dict.get(prefix + name)
            mine = self._buffers[name]
            if isinstance(given, torch.Tensor) and given.dtype == torch.uint8 and given.shape == mine.shape:
                state_dict[prefix + name] = reorder_codes(given, "checkpoint", self.code_order)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def activation_arguments(self) -> dict:
        """The activation's keyword arguments of ``moe_gemv`` (activation, alpha, limit)."""
        gpt_oss = self.activation == "gpt-oss"
        return dict(activation=self.activation, alpha=self.alpha if gpt_oss else None,
                    limit=self.limit if gpt_oss else None)

    def activated(self, x: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
        """gate_up and the activation of each (token, expert) pair, in one ``moe_gemv``: x ``[T, H]``,
        top_k_index ``[T, k]``; returns ``[T, k, I]`` in x's dtype (rounded once)."""
        p = self.projection("gate_up")
        return library.moe_gemv(p.weight, x, top_k_index, bias=p.bias, global_scales=p.global_scales,
                                backend=self.backend, check_ids=False, **self.activation_arguments())

    def weighted_down(self, h: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                      ) -> torch.Tensor:
        """down (with its bias) of each pair's activation ``h`` ``[T, k, I]``, times the pair's routing weight, in
        one ``moe_gemv``: ``[T, k, H]`` float32."""
        tokens, top_k = top_k_index.shape
        p = self.projection("down")
        y = library.moe_gemv(p.weight, h.reshape(tokens * top_k, self.intermediate_size),
                             top_k_index.reshape(tokens * top_k, 1), bias=p.bias, global_scales=p.global_scales,
                             out_dtype=torch.float32, backend=self.backend, check_ids=False,
                             pair_weights=top_k_weights.reshape(tokens * top_k, 1))
        return y.reshape(tokens, top_k, self.hidden_size)

    def combine(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The k weighted expert outputs ``y`` ``[T, k, H]`` (float32) summed in fp32, rounded once to ``dtype``:
        ``fp4gemv.moe_combine`` (slot order, one launch where torch's sum and cast take two).  Under
        ``torch.compile`` torch's sum and cast instead, which inductor fuses with the ops around them (such as the
        decoder layer's residual add) into one kernel, where the custom op would stay a launch of its own; the fp32
        sum's order is then inductor's."""
        if torch.compiler.is_compiling():
            return y.sum(dim=1).to(dtype)
        return library.moe_combine(y, out_dtype=dtype, backend=self.backend)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        """hidden_states ``[T, H]``; top_k_index ``[T, k]`` expert ids; top_k_weights ``[T, k]``. Returns ``[T, H]``
        in hidden_states' dtype: ``combine(weighted_down(activated(...)))``."""
        x = hidden_states.reshape(-1, self.hidden_size)
        h = self.activated(x, top_k_index)
        return self.combine(self.weighted_down(h, top_k_index, top_k_weights), hidden_states.dtype)

    def extra_repr(self) -> str:
        fmt = self._formats["down"][0]
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"fmt={fmt!r}, activation={self.activation!r}")


# --- from float modules ------------------------------------------------------------------------------------------


def _quantized(weight: torch.Tensor, bias, fmt: str, scale_layout: str, per_tensor: str = "pow2") -> ExpertWeights:
    """``weight`` ``[E, rows, K]`` quantized (NVFP4: per-expert global scales, ``per_tensor_scale`` of each amax)."""
    weight = weight.detach().contiguous()
    global_scales = None
    if fmt == "nvfp4":
        global_scales = per_tensor_scale(weight.abs().amax(dim=(1, 2)), per_tensor)
        scaled = weight.to(torch.float64) / global_scales.to(torch.float64)[:, None, None]
        w = library.quantize(scaled.to(torch.float32), fmt, scale_layout)
    else:
        w = library.quantize(weight.to(torch.float32), fmt, scale_layout)
    return ExpertWeights(w, None if bias is None else bias.detach(), global_scales)


def expert_kind(module: nn.Module) -> Activation | None:
    """``"gpt-oss"`` for transformers 5's ``GptOssExperts`` (gate_up_proj ``[E, H, 2I]``, down_proj ``[E, I, H]``,
    both transposed, with biases), ``"silu"`` for ``Qwen3MoeExperts`` and its look-alikes (gate_up_proj
    ``[E, 2I, H]``, down_proj ``[E, H, I]``, no bias), None for any other module: by the 3-D expert parameters."""
    params = dict(module.named_parameters(recurse=False))
    if not all(n in params and params[n].dim() == 3 for n in ("gate_up_proj", "down_proj")):
        return None
    return "gpt-oss" if "gate_up_proj_bias" in params else "silu"


def quantize_experts(module: nn.Module, fmt: str = "mxfp4", scale_layout: str = "linear",
                     backend: str = "auto", per_tensor: str = "pow2") -> FP4Experts:
    """An FP4Experts holding ``module``'s quantized weights (:func:`expert_kind` says which modules);
    ``per_tensor``: how NVFP4's per-expert global scales are picked (``per_tensor_scale``'s rounding)."""
    kind = expert_kind(module)
    if kind == "gpt-oss":
        gate_up = _quantized(module.gate_up_proj.transpose(1, 2), module.gate_up_proj_bias, fmt, scale_layout,
                             per_tensor)
        down = _quantized(module.down_proj.transpose(1, 2), module.down_proj_bias, fmt, scale_layout, per_tensor)
        return FP4Experts(gate_up, down, activation="gpt-oss", alpha=float(module.alpha), limit=float(module.limit),
                          backend=backend)
    if kind == "silu":
        act = getattr(module, "act_fn", None)
        # transformers' ACT2FN["silu"] is its own SiLUActivation class, not nn.SiLU.
        if act is not None and not (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"):
            raise ValueError(f"module: expected SiLU experts (act_fn nn.SiLU or SiLUActivation), got "
                             f"{type(act).__name__}")
        gate_up = _quantized(module.gate_up_proj, None, fmt, scale_layout, per_tensor)
        down = _quantized(module.down_proj, None, fmt, scale_layout, per_tensor)
        return FP4Experts(gate_up, down, activation="silu", backend=backend)
    raise TypeError(f"module: expected a transformers GptOssExperts or Qwen3MoeExperts, got {type(module).__name__}")


# --- from checkpoints --------------------------------------------------------------------------------------------


def _get(tensors: Mapping[str, torch.Tensor], key: str, required: bool = True):
    if key in tensors:
        return tensors[key]
    if required:
        raise KeyError(f"{key}: missing")
    return None


def _gpt_oss_projection(tensors, prefix: str, name: str, device) -> ExpertWeights:
    blocks_key, scales_key = f"{prefix}.{name}_blocks", f"{prefix}.{name}_scales"
    blocks, scales = _get(tensors, blocks_key), _get(tensors, scales_key)
    if blocks.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16:
        raise ValueError(f"{blocks_key}: expected uint8 [E, rows, K/32, 16], got {blocks.dtype} {tuple(blocks.shape)}")
    if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu) or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(f"{scales_key}: expected uint8 e8m0 {tuple(blocks.shape[:3])} (one per block of "
                         f"{blocks_key}), got {scales.dtype} {tuple(scales.shape)}")
    experts, rows = blocks.shape[:2]
    bias = _get(tensors, f"{prefix}.{name}_bias", required=False)
    if bias is not None and tuple(bias.shape) != (experts, rows):
        raise ValueError(f"{prefix}.{name}_bias: expected shape {(experts, rows)}, got {tuple(bias.shape)}")
    data = blocks.reshape(experts, rows, -1)  # a view: 16 bytes per 32-element block, low nibble first
    device = blocks.device if device is None else torch.device(device)
    weight = FP4Tensor(data.to(device), scales.to(device), "mxfp4", "linear")
    return ExpertWeights(weight, None if bias is None else bias.to(device))


def _in_layout(p: ExpertWeights, scale_layout: str) -> ExpertWeights:
    return p._replace(weight=p.weight.with_scale_layout(scale_layout))


def gpt_oss_experts(tensors: Mapping[str, torch.Tensor], prefix: str, *, device=None,
                    backend: str = "auto", alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT,
                    scale_layout: str = "linear") -> FP4Experts:
    """The FP4Experts of one gpt-oss MoE layer, ``prefix`` e.g. ``"model.layers.0.mlp.experts"`` (module
    docstring: the keys), the checkpoint's bytes used as they are (``device`` moves them); ``alpha``, ``limit``:
    the clamped SwiGLU's (``GptOssExperts``' own); ``scale_layout="swizzled"`` re-lays the block scales (a copy
    of the scales)."""
    gate_up = _gpt_oss_projection(tensors, prefix, "gate_up_proj", device)
    down = _gpt_oss_projection(tensors, prefix, "down_proj", device)
    return FP4Experts(_in_layout(gate_up, scale_layout), _in_layout(down, scale_layout), activation="gpt-oss",
                      alpha=alpha, limit=limit, backend=backend)


def _stacked_nvfp4(tensors, prefix: str, experts: int, name: str, device) -> ExpertWeights:
    layers = [FP4Linear.from_state_dict(tensors, f"{prefix}.{e}.{name}", activations="weight-only", device=device)
              for e in range(experts)]
    weights = [layer.quantized_weight().with_scale_layout("linear") for layer in layers]
    if any(w.fmt.name != "nvfp4" for w in weights):
        raise ValueError(f"{prefix}.*.{name}: expected NVFP4 experts, got {sorted({w.fmt.name for w in weights})}")
    multipliers = [layer.weight_multiplier() for layer in layers]
    global_scales = None
    if any(m is not None for m in multipliers):
        global_scales = torch.stack([torch.ones((), device=weights[0].device) if m is None else m.reshape(())
                                     for m in multipliers]).to(torch.float32)
    data = torch.stack([w.data for w in weights])
    scales = torch.stack([w.scales for w in weights])
    biases = [layer.bias for layer in layers]
    bias = None if all(b is None for b in biases) else torch.stack([b.detach() for b in biases])
    return ExpertWeights(FP4Tensor(data, scales, "nvfp4", "linear", code_order=weights[0].code_order), bias,
                         global_scales)


def nvfp4_experts(tensors: Mapping[str, torch.Tensor], prefix: str, num_experts: int, *,
                  names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), device=None,
                  backend: str = "auto", scale_layout: str = "linear") -> FP4Experts:
    """SiLU-gated FP4Experts from per-expert NVFP4 linear layers ``<prefix>.<e>.<name>`` in compressed-tensors or
    ModelOpt form (Qwen3-MoE / DeepSeek exports; module docstring), ``names``: the gate, up and down layers;
    ``scale_layout``: the stacked block scales' layout.  A stored input scale (W4A4 checkpoints) is read and
    dropped: FP4Experts run weight-only."""
    gate, up, down = (_stacked_nvfp4(tensors, prefix, num_experts, name, device) for name in names)
    # gate and up stacked into halves here, in the stored (linear) layout, then re-laid once with down.
    gate_up = _stacked_gate_up(gate, up)
    return FP4Experts(_in_layout(gate_up, scale_layout), _in_layout(down, scale_layout), activation="silu",
                      backend=backend)
