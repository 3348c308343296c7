"""``FP4Linear``: a drop-in ``nn.Linear`` whose weight is block-scaled FP4 (NVFP4 or MXFP4).

State dict (everything a checkpoint needs, and the format and scale layout recoverable from it):

* ``weight``: uint8 ``[out_features, in_features/2]``, two e2m1 codes per byte, element 2j in the low nibble (the
  checkpoint order; a module keeping its codes in another ``code_order`` converts them to and from the
  checkpoint's in ``state_dict`` / ``load_state_dict``: files never see another order);
* ``weight_scale``: ``float8_e4m3fn`` (NVFP4, one per 16 elements) or ``float8_e8m0fnu`` (MXFP4, one per 32)
  block scales, ``[out_features, in_features/bs]`` in the linear layout or ``[R_p * C_p]`` swizzled
  (``fp4gemv.layouts``): the dtype names the format, the number of dimensions the layout;
* a per-tensor weight scale, at most one of ``weight_scale_2`` (fp32, a multiplier, as NVIDIA ModelOpt
  names it) and ``weight_global_scale`` (fp32, a divisor, as compressed-tensors names it);
* for W4A4 with a static activation scale, at most one of ``input_scale`` (multiplier) and
  ``input_global_scale`` (divisor);
* ``bias`` (optional), a parameter in the activations' dtype.

Values: ``w = e2m1 * scale * weight_scale_2`` or ``w = e2m1 * scale / weight_global_scale``.  A divisor g is
applied as the fp32 multiplier ``fl32(1/g)`` (correctly rounded; vLLM does the same when it loads
compressed-tensors NVFP4: vllm-project/vllm, ``vllm/model_executor/layers/quantization/compressed_tensors/
schemes/compressed_tensors_w4a4_nvfp4.py``), because ``fp4gemv.gemv`` multiplies by global scales.  1/g is
exact for powers of two only; otherwise a weight-only result can differ from ``e2m1 * scale / g`` in the last
bit of the output dtype (never more: the two differ by less than 2^-24 relative before the one rounding).
A W4A4 activation is quantized as ``x / fl32(1/g)``; where ``x * g`` lies on a rounding boundary of e2m1 or
of its block scale, the two can pick different codes.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .. import formats, layouts
from ..formats import CODE_ORDERS, reorder_codes
from ..formats import dtype_name as _dtype_name
from .. import ops
from ..library import gemv, quantize
from ..quantize import dequantize, per_tensor_scale, prepare_quantize
from ..tensor import FP4Tensor
from .checkpoints import CheckpointLayer, read_layer

__all__ = ["FP4Linear", "ACTIVATIONS", "DECODE_MAX_TOKENS", "LINEAR_CODE_ORDER", "per_tensor_scale"]

Activations = Literal["weight-only", "w4a4"]
ScaleKind = Literal["multiplier", "divisor"]
ACTIVATIONS: tuple[str, ...] = ("weight-only", "w4a4")
SCALE_KINDS: tuple[str, ...] = ("multiplier", "divisor")
# Up to this many tokens (the GEMV kernels' largest N) every case runs through fp4gemv.gemv's GEMV kernels; more
# tokens run through gemv's GEMM kernel (kernels/gemm.py) where ``FP4Linear.fused_prefill`` says so (measured
# slower: not yet), else dequantize the weight.
DECODE_MAX_TOKENS = ops.GEMV_MAX_N
# The code order (``formats.CODE_ORDERS``) a module keeps its weight's codes in, by its activations; another order
# than the checkpoint's is repacked once when the module is built or loaded.  Weight-only: the paired order.  Every
# kernel that runs a weight-only product reads it (engine, weight_only and general with fp16 / bf16 / fp32
# activations, dequantize for prefill); the tensor-core step decodes it in 10 instructions a word against the
# checkpoint order's 13 with the activation's registers paired as loaded (sm_90 main loop a warp-step, NVFP4:
# weight_only N = 1 154 SASS against 194, the engine N = 16 631 against 791), and through the default kernel it
# was faster than the checkpoint order on all 36 rows measured (H100; six shapes, N = 1, 8, 16, NVFP4 and MXFP4
# x bf16: 0.3-6.8%; docs/performance.md, round 30).  W4A4: the checkpoint order, the only one the FP4 x FP4 kernels
# read.
LINEAR_CODE_ORDER = {"weight-only": "paired", "w4a4": "checkpoint"}
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Buffer names of the per-tensor scales, by what they scale and how they apply.
_WEIGHT_SCALE_NAMES = {"multiplier": "weight_scale_2", "divisor": "weight_global_scale"}
_INPUT_SCALE_NAMES = {"multiplier": "input_scale", "divisor": "input_global_scale"}
_FIXED_BUFFERS = ("weight", "weight_scale", *_WEIGHT_SCALE_NAMES.values(), *_INPUT_SCALE_NAMES.values())


W4A4_NO_BACKWARD = ("FP4Linear with activations='w4a4' has no backward (its input is quantized, which has no "
                    "gradient): call it under torch.no_grad(), or use activations='weight-only', whose backward "
                    "reaches x")


class FP4Linear(nn.Module):
    """``y = x @ W^T + bias`` with W block-scaled FP4; activations kept in their dtype or quantized to FP4.

    Args:
        in_features, out_features: as ``nn.Linear``; ``in_features`` a multiple of the format's block size.
        bias: whether the module has a bias (a parameter of ``bias_dtype``, zeros until loaded).
        fmt: ``"nvfp4"`` or ``"mxfp4"``.
        scale_layout: ``"swizzled"`` (the 128x4 layout the kernels are tuned on) or ``"linear"``.
        activations: ``"weight-only"`` (x stays fp16/bf16/fp32: W4A16) or ``"w4a4"`` (x is quantized to FP4
            in the weight's format on every call).
        weight_scale: the per-tensor weight scale's kind, ``"multiplier"``, ``"divisor"`` or None (none).
        input_scale: W4A4's static activation scale's kind, ``"multiplier"``, ``"divisor"`` or None: then a
            W4A4 module picks an NVFP4 per-tensor scale per call from the activation's amax
            (:func:`per_tensor_scale`, ``"pow2"``; the scale then depends on every token of the call; computed
            on the device, ``quantize``'s ``global_scale="pow2"``), and
            MXFP4 activations get none (e8m0 block scales span 2^-127 .. 2^127).
        device: where the buffers live.
        code_order: the order the module keeps the weight's codes in (``formats.CODE_ORDERS``); None:
            ``LINEAR_CODE_ORDER[activations]``.  W4A4 needs the checkpoint order.  ``weight`` holds the codes
            in this order; ``state_dict`` and ``load_state_dict`` use the checkpoint order whatever it is.

    The constructor makes placeholders (zeros, unit scales) for ``load_state_dict``; :meth:`from_linear`
    and :meth:`from_state_dict` build loaded modules.

    forward(x): x ``[..., in_features]`` in float16, bfloat16 or float32 on the weight's device (a bias in
    another dtype is rounded to x's on each call: ``module.to(dtype)`` converts it once); returns
    ``[..., out_features]`` in x's dtype.  Up to 16 tokens (the product of x's leading dimensions) run through
    ``fp4gemv.gemv``, rounded once to x's dtype, then ``+ bias`` in x's dtype.  More tokens (prefill; see
    :meth:`fused_prefill`) compute ``F.linear(x_q, fp4gemv.dequantize(W, x.dtype), bias)`` where ``x_q`` is x
    (weight-only) or its FP4 quantization dequantized to x's dtype (W4A4).
    """

    code_order: str = "checkpoint"  # what a module pickled before the attribute existed holds

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        fmt: str = "nvfp4",
        scale_layout: str = "swizzled",
        activations: Activations = "weight-only",
        weight_scale: ScaleKind | None = None,
        input_scale: ScaleKind | None = None,
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.float32,
        code_order: str | None = None,
    ) -> None:
        super().__init__()
        if fmt not in formats.FORMATS:
            raise ValueError(f"fmt: expected 'nvfp4' or 'mxfp4', got {fmt!r}")
        block = formats.FORMATS[fmt].block_size
        if not isinstance(in_features, int) or in_features < 1 or in_features % block:
            raise ValueError(f"in_features: expected a positive multiple of the {fmt} block size {block}, "
                             f"got {in_features!r}")
        if not isinstance(out_features, int) or out_features < 1:
            raise ValueError(f"out_features: expected a positive integer, got {out_features!r}")
        _check_choice("scale_layout", scale_layout, ("linear", "swizzled"))
        _check_choice("activations", activations, ACTIVATIONS)
        if weight_scale is not None:
            _check_choice("weight_scale", weight_scale, SCALE_KINDS)
        if input_scale is not None:
            _check_choice("input_scale", input_scale, SCALE_KINDS)
            if activations != "w4a4":
                raise ValueError(f"input_scale: a static activation scale needs activations='w4a4', "
                                 f"got activations={activations!r}")
        if code_order is None:
            code_order = LINEAR_CODE_ORDER[activations]
        _check_choice("code_order", code_order, CODE_ORDERS)
        if activations == "w4a4" and code_order != "checkpoint":
            raise ValueError(f"code_order: W4A4 needs the checkpoint order (the FP4 x FP4 kernels read only it), "
                             f"got {code_order!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.fmt = fmt
        self.scale_layout = scale_layout
        self.activations = activations
        self.code_order = code_order
        cols = in_features // block
        if scale_layout == "linear":
            scale_shape: tuple[int, ...] = (out_features, cols)
        else:
            rows_p, cols_p = layouts.padded_scale_shape(out_features, cols)
            scale_shape = (rows_p * cols_p,)
        scale_dtype = formats.FORMATS[fmt].scale_dtype
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        # 0x7F is e8m0's 1.0 and an e4m3 NaN; 0x38 is e4m3's 1.0: the placeholder is finite either way.
        unit = 0x38 if fmt == "nvfp4" else 0x7F
        self.register_buffer("weight_scale", torch.full(scale_shape, unit, dtype=torch.uint8, device=device)
                             .view(scale_dtype))
        if weight_scale is not None:
            self.register_buffer(_WEIGHT_SCALE_NAMES[weight_scale], torch.ones((), device=device))
        if input_scale is not None:
            self.register_buffer(_INPUT_SCALE_NAMES[input_scale], torch.ones((), device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    # --- what the module holds -------------------------------------------------------------------------------

    @property
    def format(self) -> formats.FP4Format:
        return formats.FORMATS[self.fmt]

    def weight_scale_kind(self) -> ScaleKind | None:
        """``"multiplier"``, ``"divisor"`` or None: how the per-tensor weight scale is stored."""
        return _scale_kind(self, _WEIGHT_SCALE_NAMES)

    def input_scale_kind(self) -> ScaleKind | None:
        """``"multiplier"``, ``"divisor"`` or None (weight-only, or W4A4 with a scale chosen per call)."""
        return _scale_kind(self, _INPUT_SCALE_NAMES)

    def weight_multiplier(self) -> torch.Tensor | None:
        """The fp32 multiplier applied to the weight: ``weight_scale_2``, or ``fl32(1/weight_global_scale)``."""
        return _multiplier(self, _WEIGHT_SCALE_NAMES)

    def input_multiplier(self) -> torch.Tensor | None:
        """The static fp32 activation multiplier (``input_scale`` or ``fl32(1/input_global_scale)``), or None."""
        return _multiplier(self, _INPUT_SCALE_NAMES)

    def per_tensor_scales(self) -> dict[str, torch.Tensor]:
        """The per-tensor scale buffers present, by their state-dict names (``weight_scale_2``, ``input_scale``...)."""
        return {name: self._buffers[name] for name in (*_WEIGHT_SCALE_NAMES.values(), *_INPUT_SCALE_NAMES.values())
                if self._buffers.get(name) is not None}

    def set_input_scale(self, multiplier: torch.Tensor) -> None:
        """Make ``multiplier`` (an fp32 0-d tensor) the static W4A4 activation multiplier ``input_scale``, in place
        of any stored input scale."""
        for name in _INPUT_SCALE_NAMES.values():
            self._buffers.pop(name, None)
        self.register_buffer("input_scale", multiplier)

    def quantized_weight(self) -> FP4Tensor:
        """The weight as an ``FP4Tensor`` ``[out_features, in_features]`` (views of the buffers, no copy).

        Kept between calls (a decode step is hundreds of them) until a buffer is replaced (``.to()``,
        ``load_state_dict`` of a new tensor) or the per-tensor scale changes in place (its version counter):
        the packed data and block scales are views, so in-place loads show through."""
        if torch.compiler.is_compiling():
            return FP4Tensor(self.weight, self.weight_scale, self.fmt, self.scale_layout, self.weight_multiplier(),
                             self.code_order)
        per_tensor = next((self._buffers[n] for n in _WEIGHT_SCALE_NAMES.values() if self._buffers.get(n) is not None),
                          None)
        version = None if per_tensor is None else per_tensor._version
        cached = self.__dict__.get("_quantized_weight")
        if cached is not None:
            (weight, scale, scale_2, scale_2_version), quantized = cached
            if (weight is self.weight and scale is self.weight_scale and scale_2 is per_tensor
                    and scale_2_version == version):
                return quantized
        quantized = FP4Tensor(self.weight, self.weight_scale, self.fmt, self.scale_layout, self.weight_multiplier(),
                              self.code_order)
        self.__dict__["_quantized_weight"] = ((self.weight, self.weight_scale, per_tensor, version), quantized)
        return quantized

    def checkpoint_weight(self, rows: slice = slice(None), columns: slice = slice(None)) -> torch.Tensor:
        """The packed weight ``[out_features, in_features/2]`` (or its ``[rows, columns]`` byte slice, columns on
        4-byte words: a word's codes move only within it) in the checkpoint order (a view of ``weight`` where the
        module keeps that order, else a converted copy): what checkpoints and shards are written from -- a shard
        converts only its own slice."""
        return reorder_codes(self.weight[rows, columns], self.code_order, "checkpoint")

    def _launch_tensors(self) -> tuple:
        """The tensors a kept decode launch reads (by address): weight, block scales, per-tensor scale, bias."""
        buffers = self._buffers
        per_tensor = buffers.get("weight_scale_2")
        if per_tensor is None:
            per_tensor = buffers.get("weight_global_scale")
        return buffers["weight"], buffers["weight_scale"], per_tensor, self._parameters["bias"]

    def quantize_input(self, x2d: torch.Tensor) -> FP4Tensor:
        """W4A4's activation ``[T, in_features]`` as an FP4Tensor in the weight's format (linear scales)."""
        # Unchecked (checking reads a value back: a device synchronisation per call): a NaN or infinity
        # gets its block the NaN scale byte, so the outputs it reaches are NaN, as nn.Linear's would be.
        return quantize(x2d, self.fmt, "linear", self._activation_scale(), check_values=False)

    def _activation_scale(self) -> torch.Tensor | str | None:
        """W4A4's ``global_scale`` argument of ``quantize``: the static multiplier, else for NVFP4 ``"pow2"``
        (:func:`per_tensor_scale` of the call's amax, computed on the device), else (MXFP4) None."""
        multiplier = self.input_multiplier()
        return "pow2" if multiplier is None and self.fmt == "nvfp4" else multiplier

    def extra_repr(self) -> str:
        parts = [f"in_features={self.in_features}", f"out_features={self.out_features}",
                 f"bias={self.bias is not None}", f"fmt={self.fmt!r}", f"scale_layout={self.scale_layout!r}",
                 f"activations={self.activations!r}"]
        if self.code_order != LINEAR_CODE_ORDER[self.activations]:
            parts.append(f"code_order={self.code_order!r}")
        if self.weight_scale_kind() is not None:
            parts.append(f"weight_scale={self.weight_scale_kind()!r}")
        if self.activations == "w4a4":
            parts.append(f"input_scale={self.input_scale_kind() or 'per-call'!r}")
        return ", ".join(parts)

    # --- forward ---------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        launch = self.__dict__.get("_decode_launch")
        # A kept launch records no autograd graph: a call that needs x's gradient goes through gemv.
        needs_grad = torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad
        if launch is not None and not torch.compiler.is_compiling() and not needs_grad:
            y = launch.run(self, x)
            if y is not None:
                return y
        self.check_input(x)
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)  # a copy per call: .to(dtype) on the module converts it once instead
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        if x2d.shape[0] == 0:
            return x.new_zeros((*lead, self.out_features))
        y = self.product(x2d, x.dtype, bias)
        if self.activations == "w4a4" and not torch.compiler.is_compiling():
            y = ops.without_backward(y, (x,), W4A4_NO_BACKWARD)
        if x2d.shape[0] <= DECODE_MAX_TOKENS and bias is self.bias and not torch.compiler.is_compiling():
            self.__dict__["_decode_launch"] = _DecodeLaunch.of(self, x, x2d, y)
        return y.reshape(*lead, self.out_features)

    def check_input(self, x: torch.Tensor) -> None:
        """TypeError / ValueError naming ``x`` unless it is a valid input of :meth:`forward`."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in X_DTYPES:
            raise TypeError(f"x: expected dtype float16, bfloat16 or float32, got {_dtype_name(x.dtype)}")
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected shape [..., in_features] = [..., {self.in_features}], got {tuple(x.shape)}")
        if x.device != self.weight.device:
            raise ValueError(f"x: expected device {self.weight.device} like the weight, got {x.device}")

    def product(self, x2d: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None, *,
                 out: torch.Tensor | None = None, activation: FP4Tensor | None = None) -> torch.Tensor:
        """``x2d @ W^T (+ bias)`` as ``[tokens, out_features]`` in ``out_dtype``, x2d already validated.

        The tensor-parallel layers (``fp4gemv.nn.parallel``) call it for a shard's partial product in another
        dtype than x's, into a given ``out`` (``[tokens, out_features]``, contiguous; decode only), or with an
        FP4 activation quantized with a scale the whole group agreed on.
        """
        tokens = x2d.shape[0]
        weight = self.quantized_weight()
        if activation is None:
            activation = self.quantize_input(x2d) if self.activations == "w4a4" else x2d
        if tokens <= DECODE_MAX_TOKENS or self.fused_prefill(activation):
            y = torch.empty(tokens, self.out_features, dtype=out_dtype, device=x2d.device) if out is None else out
            # gemv writes W @ x^T ([out, tokens]) straight into the transposed view.
            gemv(weight, activation, out=y.t(), out_dtype=out_dtype)
            if bias is not None:
                y.add_(bias)
            return y
        if isinstance(activation, FP4Tensor):
            activation = dequantize(activation, out_dtype)
        return F.linear(activation.to(out_dtype), dequantize(weight, out_dtype), bias)

    def fused_prefill(self, activation: FP4Tensor | torch.Tensor) -> bool:
        """Whether more than 16 tokens of ``activation`` run through ``fp4gemv.gemv`` (its GEMM kernel,
        ``kernels/gemm.py``) rather than dequantizing the weight and calling ``F.linear``: never, for now.  On the
        H200 the GEMM took 1.85-4.6x bf16 ``F.linear``'s time at T = 32, 512 and 2048 on the four decode shapes
        (docs/performance.md, the prefill GEMM), where dequantizing first took 1.3-1.8x at T = 512."""
        return False

    # --- state dict, dtype / device moves ---------------------------------------------------------------------

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_quantized_weight", None)  # views of the buffers: rebuilt on the next call
        state.pop("_decode_launch", None)
        return state

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if prefix + "weight" in destination and self.code_order != "checkpoint":  # files hold the checkpoint order
            destination[prefix + "weight"] = self.checkpoint_weight()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):  # type: ignore[override]
        # load_state_dict would convert values across dtypes (uint8 byte 56 -> e4m3 56.0): bytes must match.
        for name in ("weight", "weight_scale"):
            given = state_dict.get(prefix + name)
            expected = self._buffers[name].dtype
            if isinstance(given, torch.Tensor) and given.dtype != expected:
                error_msgs.append(f"{prefix}{name}: expected dtype {_dtype_name(expected)} ({self.fmt}), "
                                  f"got {_dtype_name(given.dtype)}")
                return
        given = state_dict.get(prefix + "weight")
        if (self.code_order != "checkpoint" and isinstance(given, torch.Tensor)
                and given.shape == self._buffers["weight"].shape):  # a wrong shape is load_state_dict's error
            state_dict = {**state_dict, prefix + "weight": reorder_codes(given, "checkpoint", self.code_order)}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        # model.to(torch.bfloat16) / .half() convert every floating-point buffer, and float8 scales and
        # fp32 per-tensor scales count as floating point: keep their dtype (and exact values), move only.
        kept = {name: self._buffers[name] for name in _FIXED_BUFFERS if self._buffers.get(name) is not None}
        self.__dict__.pop("_quantized_weight", None)
        self.__dict__.pop("_decode_launch", None)
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype != before.dtype:
                self._buffers[name] = before.to(after.device)
        return self

    # --- constructors -----------------------------------------------------------------------------------------

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        fmt: str = "nvfp4",
        *,
        activations: Activations = "weight-only",
        scale_layout: str = "swizzled",
        per_tensor: Literal["pow2", "amax"] = "pow2",
        input_scale: float | torch.Tensor | None = None,
        code_order: str | None = None,
    ) -> FP4Linear:
        """Quantize an ``nn.Linear``'s weight (``fp4gemv.quantize``); the bias is copied as it is.

        NVFP4 weights get the per-tensor multiplier :func:`per_tensor_scale` of their amax (``per_tensor``:
        ``"pow2"``, exact in every checkpoint convention, or ModelOpt's ``"amax"``); MXFP4 weights none.
        input_scale: W4A4's static activation multiplier (e.g. ``calibrate_input_scales``); None picks
        one per call.
        code_order: the order the module keeps the codes in (the constructor's argument).
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        _check_choice("activations", activations, ACTIVATIONS)
        weight = linear.weight.detach()
        if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"linear.weight: expected a float dtype, got {_dtype_name(weight.dtype)}")
        _check_choice("fmt", fmt, tuple(formats.FORMATS))
        if not bool(torch.isfinite(weight).all()):
            raise ValueError("linear.weight: expected finite values (NaN and infinity have no FP4 encoding)")
        multiplier = per_tensor_scale(weight.abs().amax(), per_tensor) if fmt == "nvfp4" else None
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, fmt=fmt,
                     scale_layout=scale_layout, activations=activations,
                     weight_scale=None if multiplier is None else "multiplier",
                     input_scale=None if input_scale is None else "multiplier",
                     device=weight.device, bias_dtype=weight.dtype if linear.bias is None else linear.bias.dtype,
                     code_order=code_order)
        q = quantize(weight, fmt, scale_layout, multiplier)
        module.weight.copy_(reorder_codes(q.data, "checkpoint", module.code_order))
        module.weight_scale.view(torch.uint8).copy_(q.scales)
        if multiplier is not None:
            module.weight_scale_2.copy_(multiplier)
        if input_scale is not None:
            module.input_scale.copy_(torch.as_tensor(input_scale, dtype=torch.float32))
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach())
        return module

    @classmethod
    def from_state_dict(
        cls,
        tensors,
        prefix: str = "",
        *,
        activations: Activations | None = None,
        scale_layout: str | None = None,
        device: torch.device | str | None = None,
        code_order: str | None = None,
    ) -> FP4Linear:
        """Build a module from one layer's checkpoint tensors; the convention is told by the key names.

        ``fp4gemv.nn.checkpoints`` documents the three conventions (compressed-tensors ``nvfp4-pack-quantized``,
        NVIDIA ModelOpt NVFP4, gpt-oss MXFP4) and this module's own state dict, and reads them
        (``checkpoints.read_layer``).
        tensors: a mapping from key to tensor (a state dict, or ``fp4gemv.nn.checkpoints.SafetensorsDirectory``).
        prefix: the layer's name (``"model.layers.0.mlp.up_proj"``), "" for a bare module's state dict.
        activations: None: W4A4 when the layer has a static input scale, else weight-only; ``"weight-only"``
            drops a stored input scale; ``"w4a4"`` without one picks the scale per call.
        scale_layout: None keeps the stored layout (no copy); "swizzled" / "linear" convert the scales.
        device: where the module lives (tensors are moved as they are; the packed codes are repacked once, on
            ``device``, where the module keeps another order than the checkpoint's).
        code_order: the order the module keeps the codes in (the constructor's argument; None:
            ``LINEAR_CODE_ORDER[activations]``).
        Raises KeyError (a missing key), TypeError / ValueError naming the key, the expected and the actual.
        """
        if activations is not None and activations not in ACTIVATIONS:
            raise ValueError(f"activations: expected None, 'weight-only' or 'w4a4', got {activations!r}")
        if scale_layout not in (None, "linear", "swizzled"):
            raise ValueError(f"scale_layout: expected None, 'linear' or 'swizzled', got {scale_layout!r}")
        return cls.from_checkpoint_layer(read_layer(tensors, prefix), activations=activations,
                                         scale_layout=scale_layout, device=device, code_order=code_order)

    @classmethod
    def from_checkpoint_layer(
        cls,
        layer: CheckpointLayer,
        *,
        activations: Activations | None = None,
        scale_layout: str | None = None,
        device: torch.device | str | None = None,
        code_order: str | None = None,
    ) -> FP4Linear:
        """A module holding a checked checkpoint layer's tensors (``from_state_dict``'s arguments)."""
        has_input_scale = layer.input_multiplier is not None or layer.input_divisor is not None
        if activations is None:
            activations = "w4a4" if has_input_scale else "weight-only"
        input_multiplier, input_divisor = layer.input_multiplier, layer.input_divisor
        if activations == "weight-only":
            input_multiplier = input_divisor = None
        device = torch.device(device) if device is not None else layer.data.device
        # Validated by FP4Tensor (shapes of swizzled scales, devices) before the module takes the tensors.
        tensor = FP4Tensor(layer.data.to(device), layer.scales.to(device), layer.fmt, layer.scale_layout)
        if scale_layout is not None:
            tensor = tensor.with_scale_layout(scale_layout)
        out_features, in_features = tensor.rows, tensor.k
        bias = layer.bias
        module = cls(
            in_features, out_features, bias is not None, fmt=layer.fmt, scale_layout=tensor.scale_layout,
            activations=activations,
            weight_scale=_kind(layer.weight_multiplier, layer.weight_divisor),
            input_scale=_kind(input_multiplier, input_divisor),
            device="meta", bias_dtype=torch.float32 if bias is None else bias.dtype, code_order=code_order,
        )
        # register_buffer replaces the meta placeholders with the loaded tensors themselves (no copy; the codes
        # in a new tensor where the module keeps another order than the checkpoint's).
        module.register_buffer("weight", reorder_codes(tensor.data, "checkpoint", module.code_order))
        module.register_buffer("weight_scale", tensor.scales.view(tensor.fmt.scale_dtype))
        for name, value in (("weight_scale_2", layer.weight_multiplier), ("weight_global_scale", layer.weight_divisor),
                            ("input_scale", input_multiplier), ("input_global_scale", input_divisor)):
            if value is not None:
                module.register_buffer(name, value.to(device))
        if bias is not None:
            module.bias = nn.Parameter(bias.to(device), requires_grad=False)
        return module


def _kind(multiplier: torch.Tensor | None, divisor: torch.Tensor | None) -> ScaleKind | None:
    return "multiplier" if multiplier is not None else "divisor" if divisor is not None else None


class _DecodeLaunch:
    """An eager decode call's launches, kept for the next call with the same metadata: one check of x's metadata
    and of the module's tensors' identity, then the outputs' allocation and the compiled kernels' launches on
    addresses (``ops.prepare_gemv``'s kept call; for W4A4 first ``quantize.prepare_quantize``'s, the activation
    quantized with the module's static scale, or with NVFP4's scale of each call's amax: then two launches, the
    amax kernel's partial maxima and the quantize kernel, which computes the scale from them into a new fp32
    tensor that the product reads as the activation's global scale); about nn.Linear's host cost.  Every output
    and workspace is allocated per call (torch.empty on the current stream, as the ordinary call's), so calls on
    several streams or in CUDA graphs share nothing.  Only for Triton kernels already compiled, on an activation
    read in place (no copy)."""

    __slots__ = ("key", "tensors", "version", "weight", "prepared", "weight_addresses", "out_shape", "rows_shape",
                 "dtype", "device", "quantize", "input_scale", "input_version", "input_multiplier", "act_shapes",
                 "partials")

    @staticmethod
    def of(module: FP4Linear, x: torch.Tensor, x2d: torch.Tensor, y: torch.Tensor) -> _DecodeLaunch | None:
        if x2d.data_ptr() != x.data_ptr():
            return None
        weight = module.quantized_weight()
        launch = _DecodeLaunch()
        launch.quantize, launch.input_scale, launch.input_version, launch.input_multiplier = None, None, None, None
        launch.partials = 0
        activation = x2d
        if module.activations == "w4a4":
            kind = module.input_scale_kind()
            # A divisor's reciprocal is made here once and kept, remade (a new launch) when the buffer changes.
            launch.input_scale = _input_scale_buffer(module)
            launch.input_version = None if kind is None else launch.input_scale[1]._version
            scale = module._activation_scale()
            launch.input_multiplier = None if isinstance(scale, str) else scale
            launch.quantize = prepare_quantize(x2d, module.fmt, "linear", scale)
            if launch.quantize is None or not launch.quantize.launches_by_address:
                return None
            launch.partials = launch.quantize.amax_partials  # 0 unless the scale is the call's ("pow2")
            activation = quantize(x2d, module.fmt, "linear", scale, check_values=False)
            launch.act_shapes = (tuple(activation.data.shape), tuple(activation.scales.shape))
        prepared = ops.prepare_gemv(weight, activation, out=y.t(), out_dtype=x.dtype)
        if not prepared.launches_by_address:
            return None  # the reference path (CPU), a copy of x first, or a kernel launched otherwise
        launch.key = (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15,
                      torch.cuda.current_device() if x.is_cuda else None)
        launch.tensors = module._launch_tensors()
        # A divisor's reciprocal is a tensor of the kept FP4Tensor (kept alive here), remade when it changes.
        launch.version = None if launch.tensors[2] is None else launch.tensors[2]._version
        launch.weight = weight
        launch.prepared = prepared
        gs = weight.global_scale
        launch.weight_addresses = (weight.data.data_ptr(), weight.scales.data_ptr(), 0 if gs is None else gs.data_ptr())
        launch.out_shape = (*x.shape[:-1], module.out_features)
        launch.rows_shape = tuple(y.shape)
        launch.dtype, launch.device = x.dtype, x.device
        return launch

    def run(self, module: FP4Linear, x: torch.Tensor) -> torch.Tensor | None:
        """The product for an x of the kept metadata on the kept tensors, else None (the ordinary call)."""
        if type(x) is not torch.Tensor or (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15,
                                           torch.cuda.current_device() if x.is_cuda else None) != self.key:
            return None
        weight, scale, per_tensor, bias = module._launch_tensors()
        kept = self.tensors
        if (weight is not kept[0] or scale is not kept[1] or per_tensor is not kept[2] or bias is not kept[3]
                or (per_tensor is not None and per_tensor._version != self.version)):
            return None
        if self.quantize is None:
            b, b_scales, b_global = x.data_ptr(), 0, 0
        else:
            if not _same_input_scale(_input_scale_buffer(module), self.input_scale, self.input_version):
                return None
            data = torch.empty(self.act_shapes[0], dtype=torch.uint8, device=self.device)
            scales = torch.empty(self.act_shapes[1], dtype=torch.uint8, device=self.device)
            g, partials = self.input_multiplier, None
            if self.partials:  # the call's own scale: the quantize kernel writes it, from the amax kernel's partials
                g = torch.empty((), dtype=torch.float32, device=self.device)
                partials = torch.empty(self.partials, dtype=torch.int32, device=self.device)
            b, b_scales, b_global = data.data_ptr(), scales.data_ptr(), 0 if g is None else g.data_ptr()
            work = 0 if partials is None else partials.data_ptr()
            self.quantize.launch_at((x.data_ptr(), b, b_scales, b_global, work))
        y = torch.empty(self.rows_shape, dtype=self.dtype, device=self.device)
        data, scales, global_scale = self.weight_addresses
        self.prepared.launch_at(ops.GemvAddresses(data, scales, b, y.data_ptr(), b_scales, global_scale, b_global))
        if bias is not None:
            y.add_(bias)
        return y.view(self.out_shape)


def _input_scale_buffer(module: FP4Linear) -> tuple[str, torch.Tensor] | None:
    """The W4A4 input scale's (kind, buffer), or None."""
    kind = module.input_scale_kind()
    return None if kind is None else (kind, module._buffers[_INPUT_SCALE_NAMES[kind]])


def _same_input_scale(now: tuple[str, torch.Tensor] | None, kept: tuple[str, torch.Tensor] | None,
                      version: int | None) -> bool:
    """Whether the input scale ``now`` is the ``kept`` one: the same kind, the same tensor, unchanged in place."""
    if now is None or kept is None:
        return now is kept
    return now[0] == kept[0] and now[1] is kept[1] and now[1]._version == version


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(repr(c) for c in choices)}, got {value!r}")


def _scale_kind(module: FP4Linear, names: dict[str, str]) -> ScaleKind | None:
    for kind, name in names.items():
        if module._buffers.get(name) is not None:
            return kind  # type: ignore[return-value]
    return None


def _multiplier(module: FP4Linear, names: dict[str, str]) -> torch.Tensor | None:
    kind = _scale_kind(module, names)
    if kind is None:
        return None
    scale = module._buffers[names[kind]]
    return scale if kind == "multiplier" else torch.reciprocal(scale)


torch.serialization.add_safe_globals([FP4Linear])
