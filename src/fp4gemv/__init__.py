"""fp4gemv: fast FP4 (NVFP4 / MXFP4) matrix-vector products for LLM decoding on NVIDIA GPUs.

Public API: :class:`FP4Tensor` (quantized tensors: ``FP4Tensor.quantize``, ``FP4Tensor.from_task``).
"""

from .tensor import FP4Tensor

__all__ = ["FP4Tensor", "__version__"]

__version__ = "0.1.0"
