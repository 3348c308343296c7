"""The MoE layer's combine, the k weighted expert outputs of each token summed: validate once, launch through the
table.

:func:`moe_combine` replaces ``y.sum(1).to(dtype)`` (a reduction and a cast, two launches) with one launch of
``kernels.moe_combine`` on CUDA, and no host sync, so that it can be captured in a CUDA graph and traced by
``torch.compile(fullgraph=True)`` (through ``fp4gemv.moe_combine``, the custom op ``torch.ops.fp4gemv.moe_combine``).
Off CUDA (``backend="auto"``) ``reference.combine_reference`` computes the same bits.  Validation raises
``TypeError`` (type, dtype) or ``ValueError`` (shape, device) naming the argument, the expected and the actual,
before anything is launched.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .formats import dtype_names as _names
from .kernels import COMBINE_KERNELS, choose_kernel
from .kernels.moe_combine import CombineCase, CombineOperands
from .kernels.spec import DIRECT_LAUNCH, KernelSpec
from .ops import KeptLaunch, keep_call, kept_call, without_backward
from .ops import refuse_gradients as _refuse_gradients
from .target import Backend, Target, resolve_target
from .tensor import check_device_with_values

__all__ = ["moe_combine", "check_combine_arguments", "combine_case", "CombinePlan", "PreparedCombine", "COMBINE_DTYPES"]

COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_combine_arguments(y, out_dtype) -> tuple[int, int]:
    """The checks of :func:`moe_combine` (metadata only: eager calls and ``torch.compile`` share them); the
    result's shape ``(T, H)``."""
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"y: expected a torch.Tensor [T, k, H], got {type(y).__name__}")
    if y.dtype != torch.float32:
        raise TypeError(f"y: expected dtype float32, got {y.dtype}")
    if y.dim() != 3 or y.shape[1] < 1 or y.shape[2] < 1:
        raise ValueError(f"y: expected 3 dims [T, k, H] with k >= 1 and H >= 1, got shape {tuple(y.shape)}")
    check_device_with_values("y", y.device)
    if out_dtype not in COMBINE_DTYPES:
        raise TypeError(f"out_dtype: expected {_names(COMBINE_DTYPES)}, got {out_dtype!r}")
    return y.shape[0], y.shape[2]


def combine_case(y: torch.Tensor, out_dtype: torch.dtype) -> CombineCase:
    """The :class:`kernels.moe_combine.CombineCase` of checked arguments."""
    return CombineCase(tokens=y.shape[0], top_k=y.shape[1], hidden=y.shape[2], y_strides=tuple(y.stride()),
                       out_dtype=out_dtype)


class CombinePlan(NamedTuple):
    """What a combine launches: the spec ``COMBINE_KERNELS`` chose, the case, the configuration, the target."""

    spec: KernelSpec
    case: CombineCase
    config: object
    target: Target


class PreparedCombine(KeptLaunch):
    """:func:`moe_combine` planned for one metadata (kept in ``ops``' cache of prepared calls): the kernel through
    Triton's JIT on the first call, then on CUDA (with Triton 3.6) the compiled kernel on y's and out's addresses
    (``ops.KeptLaunch``: no JIT dispatch); the reference through ``spec.launch`` on every call."""

    __slots__ = ("plan",)

    def __init__(self, plan: CombinePlan, device: torch.device):
        # The JIT launches on the current device's stream: so does the kept launch (that device is keyed).
        cuda = device.type == "cuda"
        super().__init__(plan, _FIELDS, torch.device("cuda", torch.cuda.current_device()) if cuda else device,
                         DIRECT_LAUNCH)
        self.plan = plan

    def run(self, y: torch.Tensor, out: torch.Tensor) -> None:
        if self._compiled is not None:
            self._launch((y.data_ptr(), out.data_ptr()))
            return
        plan = self.plan
        operands = CombineOperands(plan.case, y, out)
        with torch.no_grad():  # no autograd graph on any backend (inference only, moe_combine's docstring)
            if self._template is not None:
                self._launch_jit(operands)
            else:
                plan.spec.launch(operands, plan.config, plan.target)


_FIELDS = {"y": 0, "out": 1}


def moe_combine(y: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                backend: Backend = "auto") -> torch.Tensor:
    """The k weighted expert outputs of each token summed: ``[T, H]``.

    y: ``[T, k, H]`` float32, any strides, on the CPU or CUDA (``FP4Experts.weighted_down``'s result: each pair's
        down output times its routing weight); T >= 0, k >= 1, H >= 1.
    out_dtype: bfloat16 (default), float16 or float32.
    backend: ``"auto"`` (the kernel on CUDA, the reference elsewhere), ``"triton"`` (the kernel; on CPU tensors
        under ``TRITON_INTERPRET=1``), ``"reference"``; ``"triton-ptx"`` runs the kernel too (it has no PTX).

    Returns a new contiguous ``[T, H]`` tensor on y's device: per token ``(y[t, 0] + y[t, 1]) + ... + y[t, k-1]``
    in IEEE fp32 in that order, rounded once to ``out_dtype`` (nearest, ties to even).  Every backend gives the
    same bits (``reference.combine_reference``); NaN and infinities propagate as in fp32 additions.

    No host sync: CUDA-graph capture and ``torch.compile(fullgraph=True)`` work.  Inference only: in grad mode
    with a y that requires grad the result is computed, and a backward through it raises RuntimeError; under
    ``torch.compile`` such a y is refused up front (ValueError naming ``y``).  The plan is kept per metadata (the
    case, the backend, the device, y's 16-byte alignment, which Triton specializes on).
    """
    if torch.compiler.is_compiling():
        raise RuntimeError("moe_combine: under torch.compile call fp4gemv.moe_combine (fp4gemv.library.moe_combine), "
                           "which traces the custom op torch.ops.fp4gemv.moe_combine")
    shape = check_combine_arguments(y, out_dtype)
    out = torch.empty(shape, dtype=out_dtype, device=y.device)
    if shape[0] > 0:
        case = combine_case(y, out_dtype)
        cuda_index = torch.cuda.current_device() if y.device.type == "cuda" else None
        key = ("moe_combine", case, backend, y.device, cuda_index, y.data_ptr() % 16 == 0)
        call = kept_call(key)
        if call is None:
            target = resolve_target(backend, y.device)
            spec = choose_kernel(case, target, None, COMBINE_KERNELS)
            plan = CombinePlan(spec, case, spec.resolve_config(None, case, target), target)
            call = keep_call(key, PreparedCombine(plan, y.device))
        call.run(y, out)
    return without_backward(out, (y,), NO_BACKWARD)


NO_BACKWARD = ("moe_combine has no backward (inference only): y gets no gradient through the sum; call it under "
               "torch.no_grad(), or detach it")


def refuse_gradients(y) -> None:
    """``ops.refuse_gradients`` of y."""
    _refuse_gradients((("y", y),), NO_BACKWARD)
