"""fp4gemv: fast FP4 (NVFP4 / MXFP4) matrix-vector products for LLM decoding on NVIDIA GPUs.

Public API: :class:`FP4Tensor` (quantized tensors, a container: ``FP4Tensor.from_task`` for the GPU MODE task's
operands), :func:`quantize` (floats to an FP4Tensor, a Triton kernel on CUDA), :func:`dequantize` (back to
floats), :func:`gemv` (FP4 weights times FP4 or float activations), :func:`select_kernel` (which kernel gemv
runs), :func:`moe_gemv` (T tokens through their routed experts) and :mod:`fp4gemv.nn` (``FP4Linear``, model quantization, checkpoint loading and saving).
:func:`moe_route` turns router logits into the top-k expert ids and their routing weights in one kernel launch;
:func:`moe_combine` sums each token's k weighted expert outputs in one.
"""

from .quantize import dequantize
from .library import gemv, moe_gemv, quantize  # after .quantize: the name fp4gemv.quantize is the public function
from .ops import select_kernel
from .tensor import FP4Tensor
from . import nn  # noqa: E402  (after gemv and FP4Tensor, which it builds on)
from .library import moe_combine, moe_route  # noqa: E402  (routing and combining, one launch each)

__all__ = ["FP4Tensor", "dequantize", "gemv", "moe_gemv", "nn", "quantize", "select_kernel", "__version__"]

__all__ += ["moe_route", "moe_combine"]

__version__ = "0.1.0"
