"""``fp4gemv.nn``: FP4 models in PyTorch.

:class:`FP4Linear` replaces ``nn.Linear`` (NVFP4 or MXFP4 weights; activations kept in fp16/bf16/fp32 or
quantized to FP4); :func:`quantize_model` converts a float model; :func:`load_quantized` reads the
checkpoints people download (compressed-tensors ``nvfp4-pack-quantized``, NVIDIA ModelOpt NVFP4, gpt-oss
MXFP4) into a float model, :func:`from_pretrained` builds the transformers model from such a directory
directly (``fp4gemv.nn.hf_quantizer`` registers fp4gemv with transformers' quantizers), and
:func:`save_compressed_tensors`, :func:`save_modelopt`, :func:`save_mxfp4` write them.
:class:`ColumnParallelFP4Linear` and :class:`RowParallelFP4Linear` split one layer over a ``torch.distributed``
process group (``fp4gemv.nn.parallel``).  :class:`FP4Experts` runs a mixture-of-experts layer's experts
(gpt-oss, Qwen3-MoE) through ``fp4gemv.moe_gemv`` (``fp4gemv.nn.moe``: also the MoE checkpoint readers).
"""

from .checkpoints import SafetensorsDirectory, detect_convention, layer_tensors, read_layer
from .linear import DECODE_MAX_TOKENS, FP4Linear, per_tensor_scale
from .parallel import ColumnParallelFP4Linear, RowParallelFP4Linear
from .moe import ExpertWeights, FP4Experts, gpt_oss_experts, nvfp4_experts, quantize_experts
from .pretrained import from_pretrained
from .model import (
    QuantizationConfig,
    calibrate_input_scales,
    load_quantized,
    quantize_model,
    read_quantization_config,
    save_compressed_tensors,
    save_modelopt,
    save_mxfp4,
)

__all__ = [
    "FP4Linear",
    "ColumnParallelFP4Linear",
    "RowParallelFP4Linear",
    "DECODE_MAX_TOKENS",
    "per_tensor_scale",
    "quantize_model",
    "calibrate_input_scales",
    "load_quantized",
    "from_pretrained",
    "read_quantization_config",
    "QuantizationConfig",
    "save_compressed_tensors",
    "save_modelopt",
    "save_mxfp4",
    "SafetensorsDirectory",
    "detect_convention",
    "read_layer",
    "layer_tensors",
    "ExpertWeights",
    "FP4Experts",
    "gpt_oss_experts",
    "nvfp4_experts",
    "quantize_experts",
]
