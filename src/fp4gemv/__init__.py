"""fp4gemv: fast FP4 (NVFP4 / MXFP4) matrix-vector products for LLM decoding on NVIDIA GPUs.

Public API: :class:`FP4Tensor` (quantized tensors: ``FP4Tensor.quantize``, ``FP4Tensor.from_task``),
:func:`quantize` (floats to an FP4Tensor, a Triton kernel on CUDA), :func:`gemv` (FP4 weights times FP4 or float
activations), :func:`select_kernel` (which kernel gemv runs), :func:`moe_gemv` (T tokens through their routed experts)
and :mod:`fp4gemv.nn` (``FP4Linear``, model quantization, checkpoint loading and saving).
"""

from . import library  # noqa: F401 -- registers torch.ops.fp4gemv.*
from .library import moe_gemv
from .ops import gemv, select_kernel
from .quantize import quantize
from .tensor import FP4Tensor
from . import nn  # noqa: E402  (after gemv and FP4Tensor, which it builds on)

__all__ = ["FP4Tensor", "gemv", "moe_gemv", "nn", "quantize", "select_kernel", "__version__"]

__version__ = "0.1.0"
