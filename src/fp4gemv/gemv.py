"""``fp4gemv.gemv``: FP4 weights times FP4 or float activations, ``a @ b^T`` per batch.

Validation happens once, here, before anything is written: TypeError (wrong type or dtype) or ValueError
(shape, device, backend) naming the argument, the expected and the actual.  The Triton kernel
(``kernels/gemv.py``) and the float64 oracle (``reference.quantized_gemv_reference``) sit behind it.
"""

from __future__ import annotations

import torch

from .backends import Backend, resolve_backend
from .kernels.configs import GemvConfig, HmmaConfig, hmma_config, w4a4_config
from .kernels.gemv_configs import GemvKernelConfig, gemv_config
from .reference import quantized_gemv_reference
from .tensor import FP4Tensor

__all__ = ["gemv", "Backend", "MAX_N", "ACTIVATION_DTYPES", "OUT_DTYPES"]

# Activation rows per launch: the kernel keeps a [rows, N, blocks] accumulator per program.
MAX_N = 16
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _batch(t: FP4Tensor | torch.Tensor) -> int | None:
    """The batch size L of a ``[L, rows, K]`` operand, None for ``[rows, K]`` and ``[K]``."""
    return t.shape[0] if len(t.shape) == 3 else None


def _result_shape(a: FP4Tensor, b: FP4Tensor | torch.Tensor) -> tuple[int, ...]:
    """Check a and b against each other; the result's shape ``[L?, M, N?]``."""
    if isinstance(b, FP4Tensor):
        if b.fmt != a.fmt:
            raise ValueError(f"b: expected format {a.fmt.name!r} like a, got {b.fmt.name!r}")
    else:
        if b.dtype not in ACTIVATION_DTYPES:
            raise TypeError(f"b: expected an FP4Tensor or dtype {_names(ACTIVATION_DTYPES)}, got {b.dtype}")
        if b.dim() not in (1, 2, 3):
            raise ValueError(f"b: expected shape [K], [N, K] or [L, N, K], got {tuple(b.shape)}")
    if b.shape[-1] != a.k:
        raise ValueError(f"b: expected K = {a.k} like a, got K = {b.shape[-1]}")
    n = b.shape[-2] if len(b.shape) >= 2 else 1
    if not 1 <= n <= MAX_N:
        raise ValueError(f"b: expected N from 1 to {MAX_N} rows, got N = {n}")
    batch_a, batch_b = _batch(a), _batch(b)
    if batch_a is not None and batch_b is not None and batch_a != batch_b:
        raise ValueError(f"b: expected batch size L = {batch_a} like a, got L = {batch_b}")
    batch = batch_a if batch_a is not None else batch_b
    return (*(() if batch is None else (batch,)), a.rows, *((n,) if len(b.shape) >= 2 else ()))


def _check_out(out: torch.Tensor, shape: tuple[int, ...], out_dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
    if out.dtype != out_dtype:
        raise TypeError(f"out: expected dtype {out_dtype} (out_dtype), got {out.dtype}")
    if out.device != device:
        raise ValueError(f"out: expected device {device} like a, got {out.device}")


def _check_kernel_operand(name: str, t: FP4Tensor) -> None:
    """The kernel reads packed data as int64 (one 16-element block each): rows must start 8-byte aligned."""
    strides = t.data.stride()[:-1]
    if any(s % 8 for s in strides) or t.data.storage_offset() % 8:
        raise ValueError(
            f"{name}: expected data rows at multiples of 8 bytes for the Triton kernel, got strides "
            f"{tuple(t.data.stride())} and storage offset {t.data.storage_offset()}"
        )


def _is_w4a4_case(a: FP4Tensor, b: FP4Tensor | torch.Tensor) -> bool:
    """FP4 x FP4 (NVFP4 or MXFP4) with one activation row: the task's tuned kernel (kernels/w4a4.py)."""
    return isinstance(b, FP4Tensor) and b.rows == 1


def _is_hmma_case(a: FP4Tensor, b: FP4Tensor | torch.Tensor) -> bool:
    """NVFP4 weights times fp16/bf16 activations, or times NVFP4 activations with N > 1: the tensor-core
    kernel (kernels/hmma_gemv.py).  Its 16-bit operands hold e2m1 x e4m3 exactly (e8m0 scales and fp32
    activations do not fit them); it reads 16-byte rows, so K must be a multiple of 64, the packed data (of
    both FP4 operands) 16-byte aligned and their scale rows 2-byte aligned."""
    if a.fmt.block_size != 16 or a.k % 64 or not _aligned(a):
        return False
    if isinstance(b, FP4Tensor):
        return b.rows > 1 and _aligned(b)
    return b.dtype in (torch.float16, torch.bfloat16)


def _aligned(t: FP4Tensor) -> bool:
    """Packed rows 16-byte aligned (16-byte loads) and scale rows 2-byte aligned (two blocks' scales per load)."""
    data, scales = t.data, t.scales
    return (data.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in data.stride()[:-1])
            and scales.data_ptr() % 2 == 0 and all(s % 2 == 0 for s in scales.stride()[:-1]))


def _check_config(config: GemvKernelConfig | GemvConfig | HmmaConfig, w4a4_case: bool, hmma_case: bool) -> None:
    if isinstance(config, GemvConfig):
        if not w4a4_case:
            raise TypeError("config: a GemvConfig (kernels/w4a4.py) only applies to FP4 x FP4 with N = 1; "
                            "expected a GemvKernelConfig" + (" or HmmaConfig" if hmma_case else ""))
        values = (config.rows, config.blocks, config.ksplit)
    elif isinstance(config, HmmaConfig):
        if not hmma_case:
            raise TypeError("config: an HmmaConfig (kernels/hmma_gemv.py) only applies to NVFP4 weights with K a "
                            "multiple of 64 and 16-byte aligned rows times fp16/bf16 activations or NVFP4 "
                            "activations with N > 1; expected a GemvKernelConfig" + (" or GemvConfig" if w4a4_case else ""))
        # 16 warps gave wrong results on the H200 (GPU tests, not investigated); 8 is the most any shape uses.
        if not 1 <= config.warps <= 8:
            raise ValueError(f"config: expected 1 to 8 warps, got {config}")
        values = (config.warps,)
    elif isinstance(config, GemvKernelConfig):
        values = (config.rows, config.blocks)
    else:
        raise TypeError(f"config: expected a GemvKernelConfig, GemvConfig or HmmaConfig, got {type(config).__name__}")
    if any(v < 1 or v & (v - 1) for v in values):
        raise ValueError(f"config: expected powers of two for rows, blocks, ksplit or warps, got {config}")


def gemv(
    a: FP4Tensor,
    b: FP4Tensor | torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
    backend: Backend = "auto",
    config: GemvKernelConfig | GemvConfig | HmmaConfig | None = None,
) -> torch.Tensor:
    """``a @ b^T`` per batch: FP4 weights times FP4 (W4A4) or float (W4A16) activations.

    a: FP4Tensor ``[L, M, K]`` or ``[M, K]`` (NVFP4 or MXFP4, either scale layout).
    b: FP4Tensor ``[L, N, K]`` or ``[N, K]`` of a's format (any scale layout), or a float16, bfloat16 or
        float32 tensor ``[L, N, K]``, ``[N, K]`` or ``[K]`` (any strides); 1 <= N <= 16.  A batch dimension
        on one operand only is broadcast over the other.
    out: written and returned when given: exactly the result's shape, ``out_dtype`` and a's device, any
        strides.  Otherwise a new tensor.
    out_dtype: float16, bfloat16 or float32.
    backend: ``"auto"``: the Triton kernel with PTX decode on CUDA, the float64 reference elsewhere.
        ``"triton"``: pure-Triton decode (on CPU tensors too, under ``TRITON_INTERPRET=1``).
        ``"triton-ptx"``: PTX decode (CUDA only; the general kernel's W4A16 path has no PTX part).
        ``"reference"``: float64.
    config: the launch configuration; which kernel runs depends on the case:

        * FP4 x FP4 with N = 1 (NVFP4 or MXFP4): the task's tuned kernel (``kernels/w4a4.py``;
          ``kernels.configs.w4a4_config`` or a ``GemvConfig``);
        * NVFP4 x fp16/bf16 (any N), NVFP4 x NVFP4 with N > 1, K a multiple of 64 and 16-byte aligned rows of
          packed data: the tensor-core kernel (``kernels/hmma_gemv.py``; ``kernels.configs.hmma_config`` or an
          ``HmmaConfig``).  It reads the float activation as a contiguous copy when b is not contiguous along
          K with 16-byte aligned rows (N x K x 2 bytes);
        * everything else (MXFP4 with float activations or N > 1, fp32 activations, K not a multiple of 64,
          unaligned rows) or any case given a ``GemvKernelConfig``: the general kernel
          (``kernels/gemv.py``; ``kernels.gemv_configs.gemv_config``), which is correct but not tuned
          (docs/performance.md).
    Returns ``[L?, M, N]``: L when either operand has it, N unless b is a ``[K]`` vector.

    Both operands' global scales multiply the result (their fp32 product).  The w4a4 and general kernels
    accumulate exact 16-element block sums (W4A4) or fp32 block sums (W4A16) in fp32; the tensor-core kernel
    multiplies exactly and accumulates every product in fp32 (on the tensor cores).  The result is rounded once
    to ``out_dtype``.
    """
    if not isinstance(a, FP4Tensor):
        raise TypeError(f"a: expected an FP4Tensor (see FP4Tensor.quantize), got {type(a).__name__}")
    if not isinstance(b, (FP4Tensor, torch.Tensor)):
        raise TypeError(f"b: expected an FP4Tensor or a torch.Tensor, got {type(b).__name__}")
    shape = _result_shape(a, b)
    device = a.device
    if b.device != device:
        raise ValueError(f"b: expected device {device} like a, got {b.device}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected {_names(OUT_DTYPES)}, got {out_dtype}")
    if out is not None:
        _check_out(out, shape, out_dtype, device)
    backend = resolve_backend(backend, device)
    if backend != "reference":
        _check_kernel_operand("a", a)
        if isinstance(b, FP4Tensor):
            _check_kernel_operand("b", b)
    w4a4_case, hmma_case = _is_w4a4_case(a, b), _is_hmma_case(a, b)
    if config is not None:
        _check_config(config, w4a4_case, hmma_case)

    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=device)
    if backend == "reference":
        out.copy_(quantized_gemv_reference(a, b, out_dtype))
    else:
        # A GemvKernelConfig asks for the general kernel in every case.
        if isinstance(config, GemvKernelConfig):
            kernel = "general"
        else:
            kernel = "w4a4" if w4a4_case else "hmma" if hmma_case else "general"
        _launch(a, b, out, kernel, config, use_ptx=(backend == "triton-ptx"))
    return out


def _batched(t: torch.Tensor, batch: int, dims: int) -> torch.Tensor:
    """``t`` with a leading batch dimension of size ``batch`` (stride 0 when broadcast), ``dims`` dims in all."""
    while t.dim() < dims:
        t = t.unsqueeze(0)
    return t.expand(batch, *t.shape[1:])


def _scale_operand(t: FP4Tensor, batch: int):
    """Scale bytes (with a batch dimension) and their addressing for the kernel."""
    from .kernels._common import linear_scale_addressing, swizzled_scale_addressing

    if t.scale_layout == "linear":
        scales = _batched(t.scales, batch, 3)
        return scales, linear_scale_addressing(scales.stride(0), scales.stride(1))
    scales = _batched(t.scales, batch, 2)
    return scales, swizzled_scale_addressing(scales.stride(0), t.k // t.fmt.block_size)


def _launch(a: FP4Tensor, b: FP4Tensor | torch.Tensor, out: torch.Tensor, kernel: str, config,
            use_ptx: bool) -> None:
    """Launch ``kernel`` ("w4a4", "hmma" or "general", chosen by ``gemv``) on views of the operands."""
    # Imported here so that building tensors and the reference never needs Triton.
    from .kernels._common import GemvOperands

    batch = _batch(a) or _batch(b) or 1
    a_data = _batched(a.data, batch, 3)  # packed bytes; each kernel reads them in its own word size
    sfa, sfa_addressing = _scale_operand(a, batch)
    fp4_activation = isinstance(b, FP4Tensor)
    if fp4_activation:
        b_data = _batched(b.data, batch, 3)
        sfb, sfb_addressing = _scale_operand(b, batch)
        global_scale_b = b.global_scale
    else:
        b_data, sfb, sfb_addressing, global_scale_b = _batched(b, batch, 3), None, None, None
    # out as [L, M, N]: size-1 dimensions for what the result shape leaves out.
    c = out
    if len(b.shape) == 1:
        c = c.unsqueeze(-1)
    if c.dim() == 2:
        c = c.unsqueeze(0)
    m, n = a.rows, b_data.shape[1]
    if kernel == "w4a4":
        # FP4 x FP4 with one activation row: the tuned kernel of the task (kernels/w4a4.py).
        from .kernels.w4a4 import launch_w4a4

        launch_w4a4(
            a_data.view(torch.int64), sfa, sfa_addressing, b_data.view(torch.int64)[:, 0], sfb, sfb_addressing,
            c[:, :, 0], config=config or w4a4_config(m, a.k, batch), use_ptx=use_ptx,
            global_scale_a=a.global_scale, global_scale_b=global_scale_b, scale_block=a.fmt.block_size,
        )
    elif kernel == "hmma":
        from .kernels.hmma_gemv import launch_hmma_gemv

        if not fp4_activation:
            if b_data.stride(-1) != 1 or b_data.data_ptr() % 16 or any(s % 8 for s in b_data.stride()[:-1]):
                b_data = b_data.contiguous()
            b_data = b_data.view(torch.uint8)
        ops = GemvOperands(a_data.view(torch.int32), sfa, sfa_addressing, b_data, sfb, sfb_addressing, c,
                           a.global_scale, global_scale_b)
        launch_hmma_gemv(ops, k=a.k, activation_dtype=None if fp4_activation else b.dtype,
                         config=config or hmma_config(m, a.k, batch), use_ptx=use_ptx)
    else:
        from .kernels.gemv import launch_gemv

        b_values = b_data.view(torch.int64) if fp4_activation else b_data
        ops = GemvOperands(a_data.view(torch.int64), sfa, sfa_addressing, b_values, sfb, sfb_addressing, c,
                           a.global_scale, global_scale_b)
        launch_gemv(ops, scale_block=a.fmt.block_size,
                    config=config or gemv_config(m, a.k, batch, n, fp4_activation=fp4_activation),
                    use_ptx=use_ptx)
