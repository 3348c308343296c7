"""fp4gemv: fast FP4 (NVFP4 / MXFP4) matrix-vector products for LLM decoding on NVIDIA GPUs."""

__version__ = "0.1.0"
