"""Measuring fp4gemv on a GPU (``fp4gemv bench``): device time by CUDA-graph replay with L2 flushed
(``timing``), the best read of the same bytes (``stream``), the cases through the public op (``cases``), host
time per eager call (``host``) and one decode token of a model's linear layers (``model``).  The CUDA C++ reads
and the tensor-parallel torchrun harness are benchmark scripts (``benchmarks/``)."""

from .cases import (ACTIVATIONS, GPU_MEASUREMENTS, SHAPE_SETS, Measurements, Shape, bench_case, case_bytes,
                    format_table, random_gemv_operands, random_task_input, run)
from .timing import device_time_us, host_time_us, input_count, summarize

__all__ = ["ACTIVATIONS", "GPU_MEASUREMENTS", "Measurements", "SHAPE_SETS", "Shape", "bench_case", "case_bytes",
           "format_table", "random_gemv_operands", "random_task_input", "run", "device_time_us", "host_time_us",
           "input_count", "summarize"]
