"""``from_pretrained``: a transformers causal LM from an FP4 checkpoint directory, its FP4 layers as FP4Linear and
its FP4 MoE experts as FP4Experts."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import torch
from torch import nn

from .model import check_agreement

__all__ = ["from_pretrained"]


def from_pretrained(
    path: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    activations: str | None = None,
    scale_layout: str | None = "swizzled",
    **kwargs,
) -> nn.Module:
    """The ``transformers.AutoModelForCausalLM`` of ``path`` (``config.json``'s architecture) with the
    checkpoint's FP4 layers as ``FP4Linear`` and its FP4 MoE experts as ``FP4Experts``.

    path: a directory with ``config.json``, ``*.safetensors`` and a quantization config in a convention
        ``fp4gemv.nn.load_quantized`` reads (compressed-tensors ``nvfp4-pack-quantized``, NVIDIA ModelOpt
        NVFP4 with ``hf_quant_config.json``, gpt-oss MXFP4: a downloaded gpt-oss checkpoint, ``quant_method``
        ``"mxfp4"``, as it is), experts included (gpt-oss's fused blocks, or one NVFP4 linear layer per expert
        as Qwen3-MoE exports store them: ``fp4gemv.nn.model.fp4_experts``).
    device: where every tensor is loaded (transformers' ``device_map``, which needs ``accelerate``: without
        it the model loads on the CPU and is then moved, with a warning; None: the CPU).
    dtype: the float tensors' dtype (embeddings, norms, lm_head, the experts' biases; an FP4Linear's bias
        stays as stored); None: the checkpoint's.
    activations, scale_layout: ``fp4gemv.nn.hf_quantizer.FP4GemvConfig``'s (experts run weight-only:
        ``activations="w4a4"`` with FP4 experts is a ValueError; ``scale_layout`` applies to them too).
    kwargs: passed to ``AutoModelForCausalLM.from_pretrained``.

    Raises ValueError naming the checkpoint tensors no module takes and the model tensors the checkpoint lacks
    (as ``load_quantized`` does), which transformers would report and load anyway; an FP4 experts module's
    missing or unknown tensors before anything is read.

    The model is built on the meta device and each FP4 tensor is read from safetensors straight into its
    FP4Linear or FP4Experts buffer on ``device``; no float copy of an FP4 layer is made, so peak memory is about
    the checkpoint's bytes (plus, for per-expert checkpoints, one experts module's bytes while they are stacked).
    Same as ``AutoModelForCausalLM.from_pretrained(path, quantization_config=FP4GemvConfig(...))`` (this calls it).
    Needs ``pip install fp4gemv[transformers]``.
    """
    # transformers is an optional dependency (seconds to import): loaded only when a model is.
    from transformers import AutoModelForCausalLM

    from .hf_quantizer import FP4GemvConfig

    if "quantization_config" in kwargs:
        raise TypeError("quantization_config: expected none (from_pretrained passes FP4GemvConfig(activations, "
                        "scale_layout) itself)")
    move_to = None
    if device is not None:
        if importlib.util.find_spec("accelerate") is not None:
            kwargs["device_map"] = device  # transformers needs accelerate for any device_map
        elif torch.device(device).type != "cpu":
            warnings.warn(f"device: loading on the CPU, then moving to {device}: transformers loads straight onto "
                          f"a device only with accelerate installed (pip install fp4gemv[transformers])",
                          stacklevel=2)
            move_to = device
    if dtype is not None:
        kwargs["dtype"] = dtype
    config = FP4GemvConfig(activations=activations, scale_layout=scale_layout)
    wants_info = kwargs.pop("output_loading_info", False)
    model, info = AutoModelForCausalLM.from_pretrained(str(path), quantization_config=config,
                                                       output_loading_info=True, **kwargs)
    # transformers reports these and goes on (a missing tensor keeps its random initial value); load_quantized
    # refuses them, and so does this.
    check_agreement(info["missing_keys"], info["unexpected_keys"], "transformers' load report above lists them")
    if move_to is not None:
        model = model.to(move_to)
    return (model, info) if wants_info else model
