"""The routed expert GEMV of a mixture-of-experts decode step: validate once, launch the routed kernel.

:func:`moe_gemv` computes ``out[t, j] = W[expert_ids[t, j]] @ x[t] (+ bias[expert_ids[t, j]])`` for T tokens
and their top-k experts, reading each distinct expert's weights once (``kernels/moe_gemv.py`` groups the
pairs on the GPU).  Validation raises ``TypeError`` (type, dtype) or ``ValueError`` (shape, device, values)
naming the argument, the expected and the actual, before anything is written.
"""

from __future__ import annotations

import torch
import triton

from .kernels.moe_gemv import MAX_PAIRS, moe_gemv_config, moe_gemv_kernel
from .kernels.spec import linear_scale_addressing, swizzled_scale_addressing
from .ops import ACTIVATION_DTYPES, OUT_DTYPES, check_out
from .quantize import dequantize
from . import formats
from .formats import round_from_float64
from .target import Backend, resolve_target
from .tensor import FP4Tensor, check_device_with_values

__all__ = ["moe_gemv", "check_moe_arguments", "kernel_launch", "check_expert_ids", "ID_DTYPES", "BIAS_DTYPES"]

ID_DTYPES = (torch.int32, torch.int64)
BIAS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _check_tensor(name: str, t: object, dtypes, dims: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_names(dtypes)}, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} like w, got {t.device}")


def check_moe_arguments(w, x, expert_ids, bias, global_scales, out, out_dtype) -> tuple[tuple[int, int, int],
                                                                                         torch.dtype]:
    """The checks of :func:`moe_gemv` that read metadata only (eager calls and ``torch.compile`` share them):
    the result's shape ``(T, k, M)`` and dtype."""
    if not isinstance(w, FP4Tensor):
        raise TypeError(f"w: expected an FP4Tensor [E, M, K] (see fp4gemv.quantize), got {type(w).__name__}")
    if w.ndim != 3:
        raise ValueError(f"w: expected an FP4Tensor [E, M, K] (one matrix per expert), got shape {tuple(w.shape)}")
    experts, m, k = w.shape
    device = w.device
    check_device_with_values("w", device)
    _check_tensor("x", x, ACTIVATION_DTYPES, 2, device)
    if x.shape[1] != k:
        raise ValueError(f"x: expected [T, K] with K = {k} like w, got shape {tuple(x.shape)}")
    _check_tensor("expert_ids", expert_ids, ID_DTYPES, 2, device)
    tokens, top_k = expert_ids.shape
    if tokens != x.shape[0] or top_k < 1:
        raise ValueError(f"expert_ids: expected [T, k] with T = {x.shape[0]} tokens like x and k >= 1, got shape "
                         f"{tuple(expert_ids.shape)}")
    if not 1 <= tokens * top_k <= MAX_PAIRS:
        raise ValueError(f"expert_ids: expected 1 to {MAX_PAIRS} (token, expert) pairs T * k, got {tokens * top_k}")
    if bias is not None:
        _check_tensor("bias", bias, BIAS_DTYPES, 2, device)
        if tuple(bias.shape) != (experts, m):
            raise ValueError(f"bias: expected shape [E, M] = {(experts, m)}, got {tuple(bias.shape)}")
    if global_scales is not None:
        _check_tensor("global_scales", global_scales, (torch.float32,), 1, device)
        if global_scales.shape[0] != experts:
            raise ValueError(f"global_scales: expected one per expert, [E] = [{experts}], got "
                             f"{tuple(global_scales.shape)}")
        if w.global_scale is not None:
            raise ValueError("global_scales: expected None when w has a global scale (one or the other), got both")
    if torch.is_grad_enabled():
        for name, t in (("x", x), ("bias", bias), ("global_scales", global_scales)):
            if t is not None and t.requires_grad:
                raise ValueError(f"{name}: expected a tensor that does not require grad (moe_gemv has no backward), "
                                 f"got one that does: call it under torch.no_grad() or pass {name}.detach()")
    if out_dtype is None:
        out_dtype = x.dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected {_names(OUT_DTYPES)}, got {out_dtype}")
    shape = (tokens, top_k, m)
    if out is not None:
        check_out(out, shape, out_dtype, device, shape_name="[T, k, M] = ", owner="w",
                  inputs=(("w.data", w.data), ("w.scales", w.scales), ("w.global_scale", w.global_scale), ("x", x),
                          ("expert_ids", expert_ids), ("bias", bias), ("global_scales", global_scales)))
    return shape, out_dtype


def check_expert_ids(expert_ids: torch.Tensor, experts: int) -> None:
    """ValueError naming ``expert_ids`` when one lies outside ``[0, experts)`` (reads the values: a sync on CUDA)."""
    bad = (expert_ids < 0) | (expert_ids >= experts)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise ValueError(f"expert_ids: expected ids in [0, {experts}), got {int(expert_ids[tuple(where)])} at "
                         f"{tuple(where)}")


def _reference(w, x, expert_ids, bias, global_scales, out) -> None:
    """The float64 oracle of the routed product, rounded once into ``out`` (ids outside [0, E) give zeros)."""
    experts = w.shape[0]
    x64 = x.to(torch.float64)
    result = torch.zeros(out.shape, dtype=torch.float64, device=out.device)
    for e in torch.unique(expert_ids).tolist():
        if not 0 <= e < experts:
            continue
        tokens, slots = (expert_ids == e).nonzero(as_tuple=True)
        w_e = dequantize(FP4Tensor(w.data[e], w.scales[e], w.fmt, w.scale_layout, w.global_scale), torch.float64)
        if global_scales is not None:
            w_e = w_e * global_scales[e].to(torch.float64)
        values = x64[tokens] @ w_e.T
        if bias is not None:
            values = values + bias[e].to(torch.float64)
        result[tokens, slots] = values
    out.copy_(round_from_float64(result, out.dtype))


def _check_data_alignment(w: FP4Tensor) -> None:
    """The kernel reads weights as int64 blocks: data rows at multiples of 8 bytes, contiguous."""
    d = w.data
    if not d.is_contiguous() or d.data_ptr() % 8:
        raise ValueError(f"w: expected contiguous data at an 8-byte aligned address (int64 loads), got strides "
                         f"{tuple(d.stride())} at address {d.data_ptr() % 8} mod 8")


def kernel_launch(w, x, expert_ids, bias, global_scales, out) -> tuple[tuple[int, ...], list, dict]:
    """(grid, positional arguments, keyword arguments) of the ``moe_gemv_kernel`` launch for checked operands
    (also what tests/aot.py compiles for sm_90)."""
    experts, m, k = w.shape
    tokens, top_k = expert_ids.shape
    pairs = tokens * top_k
    config = moe_gemv_config(k, tokens)
    if w.scale_layout == "linear":
        sf = linear_scale_addressing(w.scales.stride(0), w.scales.stride(1))
    else:
        sf = swizzled_scale_addressing(w.scales.stride(0), k // w.fmt.block_size)
    data = w.data.view(torch.int64)
    if global_scales is not None:
        gs, gs_stride, has_gs = global_scales, global_scales.stride(0), True
    elif w.global_scale is not None:
        gs, gs_stride, has_gs = w.global_scale.reshape(1), 0, True
    else:
        gs, gs_stride, has_gs = w.scales, 0, False  # never read
    nb = k // 16
    grid = (triton.cdiv(m, config.rows), pairs, triton.cdiv(pairs, config.cols))
    args = [
        data, w.scales, gs, x, expert_ids, bias if bias is not None else w.scales, out,
        m, nb, experts, pairs, top_k,
        w.data.stride(0) // 8, w.data.stride(1) // 8,
        sf.batch, sf.row_tile, sf.r32, sf.r4, sf.col_tile,
        gs_stride,
        x.stride(0), x.stride(1),
        expert_ids.stride(0), expert_ids.stride(1),
        *((bias.stride(0), bias.stride(1)) if bias is not None else (0, 0)),
        out.stride(0), out.stride(1), out.stride(2),
    ]
    kwargs = dict(
        P_PAD=triton.next_power_of_2(pairs), ROWS=config.rows, COLS=config.cols, BLOCKS=config.blocks,
        FORMAT=w.fmt.name, HAS_GS=has_gs, HAS_BIAS=bias is not None, EVEN_K=nb % config.blocks == 0,
        num_warps=config.num_warps,
    )
    return grid, args, kwargs


def moe_gemv(
    w: FP4Tensor,
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    global_scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: Backend = "auto",
    check_ids: bool = True,
    check_values: bool = False,
) -> torch.Tensor:
    """``out[t, j] = W[expert_ids[t, j]] @ x[t] (+ bias[expert_ids[t, j]])``: T tokens through their k experts.

    w: FP4Tensor ``[E, M, K]`` (NVFP4 or MXFP4, either scale layout), data rows contiguous; its global scale,
        when it has one, is one for all experts.
    x: ``[T, K]`` float16, bfloat16 or float32, any strides.
    expert_ids: ``[T, k]`` int32 or int64, any strides; 1 <= T * k <= 1024.  Each distinct expert's weights are
        read once per call when every group has at most 16 pairs (top-k ids are distinct per token, so T <= 16).
    bias: optional ``[E, M]`` float16, bfloat16 or float32, added in fp32 before the one rounding.
    global_scales: optional ``[E]`` float32, one global scale per expert (NVFP4 MoE checkpoints); not together
        with w's own global scale.
    out: written and returned when given: ``[T, k, M]``, ``out_dtype``, w's device, any strides that give each
        element memory of its own, sharing none with an input.
    out_dtype: float16, bfloat16 or float32; None: x's dtype.
    backend: as :func:`fp4gemv.gemv` (``"auto"``: the Triton kernel on CUDA, the float64 reference elsewhere;
        ``"triton"`` runs the kernel in the interpreter on CPU tensors).
    check_ids: read the ids and raise ValueError naming ``expert_ids`` when one lies outside ``[0, E)``, before
        anything is written (on CUDA a sync; skipped while a CUDA graph is captured).  With False, or under
        CUDA-graph capture and ``torch.compile``, such a pair's output is zeros and no memory outside the
        operands is touched.
    check_values: read ``global_scales`` and raise ValueError naming it unless each is a positive normal float32
        (``formats.check_global_scales``, the check of ``FP4Tensor`` and ``quantize``), before anything is
        written.  Off by default, like ``FP4Tensor``'s check of a tensor global scale: reading the values
        synchronises the device, and per-expert scales are weights, best checked once when loaded.  Unchecked,
        a 0, negative, NaN or infinite scale multiplies that expert's outputs as it is.

    Inference only: no backward; ValueError naming ``x``, ``bias`` or ``global_scales`` when one requires grad
    in grad mode (on every backend and under ``torch.compile``).

    Arithmetic: exact weight-activation products (fp16/bf16), fp32 block sums and accumulation, the global scale
    and the bias applied in fp32, one rounding to ``out_dtype`` (the bound of ``gemv``'s block-sum kernels, one
    fp32 addition more for the bias).
    """
    if torch.compiler.is_compiling():
        raise RuntimeError("moe_gemv: under torch.compile call fp4gemv.moe_gemv (fp4gemv.library.moe_gemv), "
                           "which traces the custom op torch.ops.fp4gemv.moe_gemv")
    shape, out_dtype = check_moe_arguments(w, x, expert_ids, bias, global_scales, out, out_dtype)
    device = w.device
    target = resolve_target(backend, device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if check_ids and not capturing:
        check_expert_ids(expert_ids, w.shape[0])
    if check_values and global_scales is not None:
        formats.check_global_scales(global_scales, "global_scales")
    if target.runs_triton:
        if w.fmt.name == "nvfp4" and not target.e4m3x2_cvt:
            raise ValueError(f"w: NVFP4 needs e4m3 conversions (sm_89 or newer), got {target.describe()}")
        _check_data_alignment(w)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=device)
    if target.runs_triton:
        grid, args, kwargs = kernel_launch(w, x, expert_ids, bias, global_scales, out)
        moe_gemv_kernel[grid](*args, **kwargs)
    else:
        with torch.no_grad():  # torch ops, but no autograd graph: as for the kernel
            _reference(w, x, expert_ids, bias, global_scales, out)
    return out
