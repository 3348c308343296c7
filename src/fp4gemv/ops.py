"""The GEMV op, eager: validate once at the boundary, pick a kernel spec, launch; decisions kept per metadata.

:func:`gemv` builds the kernels' operands (:func:`gemv_operands`: batched views and the :class:`GemvCase` they
make), asks ``kernels.choose_kernel`` which spec runs the case on the target (``fp4gemv.target``) and launches
it; :func:`select_kernel` says which one that is.  Validation raises ``TypeError`` (wrong type or dtype) or
``ValueError`` (shape, device, backend, no kernel for the case) naming the argument, the expected and the
actual, before anything is written.  The public ``fp4gemv.gemv`` (``library.py``) runs :func:`gemv` eagerly
and the custom op ``torch.ops.fp4gemv.gemv`` under ``torch.compile``.

The prepared call.  Everything decided from metadata (shapes, strides, dtypes, devices, pointer alignment,
format, layout, the kernel and its configuration) is a :class:`GemvPlan`; :func:`prepare_gemv` returns the
:class:`PreparedGemv` of the arguments' metadata (made and validated once, then kept), which is called with
new operands of that metadata.  :func:`gemv` is that call.  Once a call has compiled its Triton kernel on
CUDA, later calls launch it through the compiled kernel's own launcher with the operands' addresses, skipping
the JIT's argument binding (Triton 3.6's launcher; other Triton versions launch through the JIT every time).
That launch is :class:`KeptLaunch`, which ``moe.PreparedMoe`` (``moe_gemv``'s prepared call) shares, with the one
cache of prepared calls (:func:`kept_call`, :func:`keep_call`, :func:`clear_cache`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from triton.runtime.driver import driver

from .formats import dtype_names as _names
from .kernels import choose_kernel
from .kernels.spec import (DIRECT_LAUNCH, GEMV_MAX_N, AddressDescriptor, DescSrc, FloatMeta, FP4Meta, GemvCase,
                           GemvOperands, KernelSpec, Src, TritonKernelSpec, alignment, bound_arguments,
                           direct_launch_supported, fill_sources, launch_hooks, linear_scale_addressing,
                           swizzled_scale_addressing)
from .target import Backend, Target, interpreting, resolve_target
from .tensor import FP4Tensor

__all__ = ["gemv", "select_kernel", "prepare_gemv", "prepared_gemv", "PreparedGemv", "GemvAddresses", "GemvPlan",
           "plan_for", "gemv_operands", "check_arguments", "check_out", "check_apart", "gemv_inputs", "result_shape",
           "clear_cache", "without_backward", "refuse_gradients", "KeptLaunch", "kept_call", "keep_call",
           "direct_launch_supported",
           "ACTIVATION_DTYPES", "OUT_DTYPES", "GEMV_MAX_N"]

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _batch(t: FP4Tensor | torch.Tensor) -> int | None:
    """The batch size L of a ``[L, rows, K]`` operand, None for ``[rows, K]`` and ``[K]``."""
    return t.shape[0] if len(t.shape) == 3 else None


def result_shape(a: FP4Tensor, b: FP4Tensor | torch.Tensor) -> tuple[int, ...]:
    """Check a and b against each other (metadata only); the result's shape ``[L?, M, N?]``."""
    if not isinstance(a, FP4Tensor):
        raise TypeError(f"a: expected an FP4Tensor (see fp4gemv.quantize), got {type(a).__name__}")
    if isinstance(b, FP4Tensor):
        if b.fmt != a.fmt:
            raise ValueError(f"b: expected format {a.fmt.name!r} like a, got {b.fmt.name!r}")
    elif isinstance(b, torch.Tensor):
        if b.dtype not in ACTIVATION_DTYPES:
            raise TypeError(f"b: expected an FP4Tensor or dtype {_names(ACTIVATION_DTYPES)}, got {b.dtype}")
        if b.dim() not in (1, 2, 3):
            raise ValueError(f"b: expected shape [K], [N, K] or [L, N, K], got {tuple(b.shape)}")
    else:
        raise TypeError(f"b: expected an FP4Tensor or a torch.Tensor, got {type(b).__name__}")
    if b.shape[-1] != a.k:
        raise ValueError(f"b: expected K = {a.k} like a, got K = {b.shape[-1]}")
    n = b.shape[-2] if len(b.shape) >= 2 else 1
    if n < 1:
        raise ValueError(f"b: expected at least N = 1 row, got N = {n}")
    batch_a, batch_b = _batch(a), _batch(b)
    if batch_b == 0:
        raise ValueError(f"b: expected batch size L >= 1, got L = 0 (shape {tuple(b.shape)})")
    if batch_a is not None and batch_b is not None and batch_a != batch_b:
        raise ValueError(f"b: expected batch size L = {batch_a} like a, got L = {batch_b}")
    batch = batch_a if batch_a is not None else batch_b
    return (*(() if batch is None else (batch,)), a.rows, *((n,) if len(b.shape) >= 2 else ()))


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last (strides are never negative)."""
    if t.numel() == 0:
        return 0
    return (sum(stride * (size - 1) for size, stride in zip(t.shape, t.stride())) + 1) * t.element_size()


def _elements_distinct(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` can share memory: with the dimensions of size > 1 ordered by stride, each
    stride passes every offset the smaller ones reach.  Every view made by slicing, transposing and reshaping
    has this; a stride 0 (``expand``) or overlapping ``as_strided`` strides have not."""
    dims = [(stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1]
    for i, (stride, _) in enumerate(dims):  # no sort: torch.compile traces this with symbolic sizes
        reach = sum(s * (n - 1) for j, (s, n) in enumerate(dims) if s < stride or (s == stride and j < i))
        if stride <= reach:
            return False
    return True


def _byte_offsets(t: torch.Tensor) -> torch.Tensor:
    """The offset of every byte of every element of ``t`` from its first byte (int64, on the CPU)."""
    size = t.element_size()
    offsets = torch.zeros((), dtype=torch.int64)
    for n, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n) * (stride * size)
    return (offsets.reshape(-1, 1) + torch.arange(size)).reshape(-1)


def _share_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` and ``y`` (one device) have a byte in common: their address ranges meet, and then an element
    of one covers a byte of the other (strided views of one buffer can interleave without sharing)."""
    px, py = x.data_ptr(), y.data_ptr()
    ex, ey = _extent(x), _extent(y)
    if not (px < py + ey and py < px + ex):
        return False
    low = min(px, py)
    covered = torch.zeros(max(px + ex, py + ey) - low, dtype=torch.bool)
    covered[_byte_offsets(x) + (px - low)] = True
    return bool(covered[_byte_offsets(y) + (py - low)].any())


def check_apart(out: torch.Tensor, inputs) -> None:
    """ValueError naming ``out`` and the first of ``inputs`` (``(name, tensor or None)`` pairs, on out's device)
    that shares memory with it: kernels read the inputs while they write ``out``."""
    if out.device.type == "meta":  # no memory
        return
    for name, t in inputs:
        if t is not None and _share_bytes(out, t):
            raise ValueError(f"out: expected memory apart from every input (the kernel reads them while writing "
                             f"out), got a tensor that shares memory with {name}")


class _NoBackward(torch.autograd.Function):
    """The result of an op with no backward, joined to the inputs that require grad: the forward is free (a
    view), a backward through it raises the op's message instead of letting their gradient silently stop."""

    @staticmethod
    def forward(ctx, message: str, result: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
        ctx.message = message
        return result.view_as(result)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def without_backward(result: torch.Tensor, inputs, message: str) -> torch.Tensor:
    """``result`` as it is when grad mode is off or no tensor of ``inputs`` requires grad; else a view whose
    backward raises RuntimeError(``message``).  Eager calls only: under ``torch.compile`` the caller refuses such
    inputs up front (the compiler traces the backward while compiling)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return _NoBackward.apply(message, result, *inputs)
    return result


def refuse_gradients(inputs, message: str) -> None:
    """Under ``torch.compile``, where a backward that raises (:func:`without_backward`) would fail the compile:
    ValueError naming the first of ``inputs`` (``(name, tensor or None)`` pairs) that requires grad, in grad mode
    (``message``: why the op has no backward)."""
    if torch.is_grad_enabled():
        for name, t in inputs:
            if t is not None and t.requires_grad:
                raise ValueError(f"{name}: expected a tensor that does not require grad under torch.compile "
                                 f"({message}), got one that does")


def check_out(out: torch.Tensor, shape: tuple[int, ...], out_dtype: torch.dtype, device: torch.device,
              shape_name: str = "", owner: str = "a", inputs=()) -> None:
    """An ``out`` argument exactly of the result's shape (``shape_name``, e.g. ``"[T, k, M] = "``, says what it
    is), ``out_dtype`` and the device of operand ``owner``, each element in memory of its own and none shared
    with ``inputs`` (``(name, tensor or None)`` pairs); TypeError / ValueError naming ``out`` otherwise.

    Under ``torch.compile`` addresses are not known while tracing: the custom op checks them when it runs."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise ValueError(f"out: expected shape {shape_name}{shape}, got {tuple(out.shape)}")
    if out.dtype != out_dtype:
        raise TypeError(f"out: expected dtype {out_dtype} (out_dtype), got {out.dtype}")
    if out.device != device:
        raise ValueError(f"out: expected device {device} like {owner}, got {out.device}")
    if not _elements_distinct(out):
        raise ValueError(f"out: expected a tensor whose elements do not share memory, got strides "
                         f"{tuple(out.stride())} for shape {tuple(out.shape)} (a stride 0, or overlapping strides: "
                         f"pass a tensor from torch.empty)")
    if not torch.compiler.is_compiling():
        check_apart(out, inputs)


def gemv_inputs(a: FP4Tensor, b: FP4Tensor | torch.Tensor) -> tuple[tuple[str, torch.Tensor | None], ...]:
    """The tensors :func:`gemv` reads, by the names errors give them."""
    named = (("a.data", a.data), ("a.scales", a.scales), ("a.global_scale", a.global_scale))
    if isinstance(b, FP4Tensor):
        return (*named, ("b.data", b.data), ("b.scales", b.scales), ("b.global_scale", b.global_scale))
    return (*named, ("b", b))


def check_arguments(a, b, out: torch.Tensor | None, out_dtype: torch.dtype) -> tuple[int, ...]:
    """The checks of :func:`gemv` that read metadata only (operands against each other, devices, out_dtype,
    out); the result's shape.  Eager calls and ``torch.compile`` (``fp4gemv.gemv``, ``library.py``) share them."""
    shape = result_shape(a, b)
    if b.device != a.device:
        raise ValueError(f"b: expected device {a.device} like a, got {b.device}")
    if out_dtype not in OUT_DTYPES:
        got = f"{type(out_dtype).__name__} {out_dtype!r}" if not isinstance(out_dtype, torch.dtype) else out_dtype
        raise TypeError(f"out_dtype: expected a torch.dtype among {_names(OUT_DTYPES)}, got {got}")
    if out is not None:
        check_out(out, shape, out_dtype, a.device, inputs=gemv_inputs(a, b))
    return shape


def _fp4_meta(t, data: torch.Tensor, scales: torch.Tensor) -> FP4Meta:
    """Metadata of FP4Tensor ``t`` whose batched views are ``data`` ``[L, rows, K/2]`` and ``scales``."""
    if t.scale_layout == "linear":  # [L, rows, cols]
        addressing = linear_scale_addressing(scales.stride(0), scales.stride(1))
    else:  # [L, rows_p * cols_p]
        addressing = swizzled_scale_addressing(scales.stride(0), t.k // t.fmt.block_size)
    return FP4Meta(
        rows=data.shape[1], batch_stride=data.stride(0), row_stride=data.stride(1),
        align=alignment(data, data.stride()[:2]), scale_layout=t.scale_layout, scales=addressing,
        scale_align=alignment(scales, tuple(addressing[:4])), has_global_scale=t.global_scale is not None,
        scale_tile_align=alignment(scales, (addressing.batch, addressing.r32 if t.scale_layout == "linear"
                                            else addressing.row_tile)),
        code_order=t.code_order,
    )


def _batched(t: torch.Tensor, batch: int, dims: int) -> torch.Tensor:
    """``t`` with a leading batch dimension of size ``batch`` (stride 0 when broadcast), ``dims`` dims in all."""
    while t.dim() < dims:
        t = t.unsqueeze(0)
    return t.expand(batch, *t.shape[1:])


def gemv_operands(a: FP4Tensor, b: FP4Tensor | torch.Tensor, out: torch.Tensor) -> GemvOperands:
    """Batched views of FP4Tensor ``a``, activation ``b`` (FP4Tensor or float tensor, already checked
    against ``a``) and the result tensor ``out``, and the case they make."""
    batch = next((t.shape[0] for t in (a, b) if len(t.shape) == 3), 1)
    a_data = _batched(a.data, batch, 3)
    a_scales = _batched(a.scales, batch, 3 if a.scale_layout == "linear" else 2)
    c = out
    if len(b.shape) == 1:
        c = c.unsqueeze(-1)
    if c.dim() == 2:
        c = c.unsqueeze(0)
    if isinstance(b, FP4Tensor):
        b_data = _batched(b.data, batch, 3)
        b_scales = _batched(b.scales, batch, 3 if b.scale_layout == "linear" else 2)
        b_meta = _fp4_meta(b, b_data, b_scales)
        b_gs = b.global_scale
    else:
        b_data, b_scales, b_gs = _batched(b, batch, 3), None, None
        contiguous_k = b_data.stride(-1) == 1
        size = b_data.element_size()
        b_meta = FloatMeta(b_data.dtype, tuple(b_data.stride()),
                           alignment(b_data, tuple(s * size for s in b_data.stride()[:2])) if contiguous_k else 0)
    case = GemvCase(
        fmt=a.fmt, m=a.rows, k=a.k, n=b_data.shape[1], batch=batch, a=_fp4_meta(a, a_data, a_scales),
        b=b_meta, out_dtype=out.dtype, out_strides=tuple(c.stride()), vector=len(b.shape) == 1,
    )
    return GemvOperands(case, a_data, a_scales, a.global_scale, b_data, b_scales, b_gs, c)


def _needs_copy(b: torch.Tensor) -> bool:
    """A float activation is read from a contiguous copy unless it is contiguous along K with 16-byte aligned
    rows (the tensor-core kernel's 16-byte loads); the copy is N x K elements, small next to the weights."""
    if b.stride(-1) != 1 or b.data_ptr() % 16:
        return True
    size = b.element_size()
    return any((s * size) % 16 for s in b.stride()[:-1])


class GemvPlan(NamedTuple):
    """What :func:`gemv` runs for one distinct metadata: the kernel spec and its configuration, the target,
    the case, whether the float activation is copied first, the shape of a new result, the device, and each
    operand's extent in bytes (:class:`GemvAddresses`' order, 0 where absent; out's is the result's)."""

    spec: KernelSpec
    config: object
    target: Target
    case: GemvCase
    copy_activation: bool
    out_shape: tuple[int, ...]
    device: torch.device
    extents: tuple[int, ...]


def plan_for(
    a: FP4Tensor,
    b: FP4Tensor | torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
    backend: Backend = "auto",
    kernel: str | None = None,
    config=None,
) -> GemvPlan:
    """Validate the arguments of :func:`gemv` (same meaning) and decide what it runs; raises as gemv does."""
    shape = check_arguments(a, b, out, out_dtype)
    device = a.device
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        raise ValueError(f"a: expected tensors on the current CUDA device (cuda:{torch.cuda.current_device()}), "
                         f"got {device}; select it with torch.cuda.device({device.index})")
    target = resolve_target(backend, device)
    copy_activation = not isinstance(b, FP4Tensor) and target.runs_triton and _needs_copy(b)
    if copy_activation:
        b = b.contiguous()
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device="meta")
    case = gemv_operands(a, b, out).case
    spec = choose_kernel(case, target, kernel)
    config = spec.resolve_config(config, case, target)
    fp4_b = isinstance(b, FP4Tensor)
    parts = (a.data, a.scales, b.data if fp4_b else b, out, b.scales if fp4_b else None, a.global_scale,
             b.global_scale if fp4_b else None)
    extents = tuple(0 if t is None else _extent(t) for t in parts)
    return GemvPlan(spec, config, target, case, copy_activation, shape, device, extents)


def select_kernel(
    a: FP4Tensor,
    b: FP4Tensor | torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
    backend: Backend = "auto",
    kernel: str | None = None,
) -> KernelSpec:
    """The kernel spec :func:`gemv` would run on these arguments (``.name``: "gemm", "w4a4", "weight_only",
    "hmma", "general", "reference").  Raises as gemv does."""
    return plan_for(a, b, out=out, out_dtype=out_dtype, backend=backend, kernel=kernel).spec


# --- prepared calls --------------------------------------------------------------------------------------------


class GemvAddresses(NamedTuple):
    """The addresses of one GEMV's operands (``data_ptr()`` of each tensor, 0 where absent): what
    :meth:`PreparedGemv.launch_at` launches on.  Views share their tensor's address."""

    a_data: int
    a_scales: int
    b_data: int
    out: int
    b_scales: int = 0
    a_global_scale: int = 0
    b_global_scale: int = 0


# GemvAddresses fields by the GemvOperands name a launch's pointer argument (kernels.spec.Src) reads.
_ADDRESS_INDEX = {name: GemvAddresses._fields.index(name) for name in GemvAddresses._fields}


def _addresses(a, b, out) -> tuple:
    """The operands' addresses in :class:`GemvAddresses`' order, as a plain tuple."""
    fp4_b = type(b) is FP4Tensor
    gs_a, gs_b = a.global_scale, b.global_scale if fp4_b else None
    return (a.data.data_ptr(), a.scales.data_ptr(), (b.data if fp4_b else b).data_ptr(), out.data_ptr(),
            b.scales.data_ptr() if fp4_b else 0, 0 if gs_a is None else gs_a.data_ptr(),
            0 if gs_b is None else gs_b.data_ptr())


def _key_and_addresses(a, b, out, out_dtype, backend, kernel, config) -> tuple[tuple | None, tuple | None]:
    """Everything validation and dispatch depend on (shapes, strides, dtypes, devices, formats, layouts, the
    alignment of every address, the arguments, config's type too (a plain tuple equal to a config is refused),
    the current device), and the operands' addresses; (None, None) for arguments that validation must look at
    (and reject).

    An FP4Tensor's scale shape follows from its data shape, format and layout (checked when it was made; its
    attributes cannot be rebound), so only the scales' strides are keyed.  On CUDA, b's and out's device index
    equal to a's means the same device; elsewhere their whole device is keyed."""
    if type(a) is not FP4Tensor:
        return None, None
    ad, asc, ag = a.data, a.scales, a.global_scale
    pa, ps, pg = ad.data_ptr(), asc.data_ptr(), 0 if ag is None else ag.data_ptr()
    device = ad.device
    cuda = device.type == "cuda"
    if type(b) is FP4Tensor:
        bd, bs, bg = b.data, b.scales, b.global_scale
        pb, pbs, pbg = bd.data_ptr(), bs.data_ptr(), 0 if bg is None else bg.data_ptr()
        bk = (b.fmt, b.scale_layout, b.code_order, bd.shape, bd.stride(), bs.stride(), bg is None,
              bd.get_device() if cuda else bd.device)
    elif isinstance(b, torch.Tensor):
        pb, pbs, pbg = b.data_ptr(), 0, 0
        bk = (b.dtype, b.shape, b.stride(), b.get_device() if cuda else b.device)
    else:
        return None, None
    if out is None:
        po, ok = 0, None
    elif isinstance(out, torch.Tensor):
        po, ok = out.data_ptr(), (out.dtype, out.shape, out.stride(), out.get_device() if cuda else out.device)
    else:
        return None, None
    where = torch.cuda.current_device() if cuda else interpreting()
    align = (pa & 15, ps & 15, pg & 15, pb & 15, pbs & 15, pbg & 15, po & 15)
    key = (a.fmt, a.scale_layout, a.code_order, ad.shape, ad.stride(), asc.stride(), ag is None, device, bk, ok, align,
           out_dtype, backend, kernel, type(config), config, where)
    return key, (pa, ps, pb, po, pbs, pg, pbg)  # GemvAddresses' order; a plain tuple is faster to make


def _may_share(addresses: tuple, extents: tuple, out_index: int) -> bool:
    """Whether out's address range (``addresses[out_index]`` and its extent) meets an input's: only then can they
    share a byte (:func:`check_apart` says whether they do).  0 addresses (absent operands) meet nothing."""
    start = addresses[out_index]
    end = start + extents[out_index]
    for i, p in enumerate(addresses):
        if p and i != out_index and p < end and start < p + extents[i]:
            return True
    return False


class KeptLaunch:
    """One planned Triton launch, kept with a prepared call (:class:`PreparedGemv`, ``moe.PreparedMoe``).

    Its template is the ``TritonLaunch`` of ``plan``'s spec (a GemvPlan or MoePlan: spec, case, config, target; None
    for specs that launch otherwise, or take more than one kernel: the caller runs ``spec.launch``). The first
    :meth:`_launch_jit` goes through Triton's JIT, which compiles the kernel. On CUDA (with Triton 3.6) the compiled
    kernel is then kept with the argument list: :meth:`_launch` fills its pointer arguments (the template's
    :class:`Src` placeholders, by ``fields``: operand name -> index in the addresses the caller gives) and calls the
    compiled kernel's launcher directly, on the current stream of the device the JIT launched on (so a launch inside
    ``torch.cuda.graph`` is captured like the JIT's)."""

    __slots__ = ("_template", "_fields", "_device_index", "_compiled", "_argv", "_slots", "_descriptors", "_grid",
                 "_launcher", "_direct_launch", "_current_stream", "_encoded")

    def __init__(self, plan, fields: dict[str, int], device: torch.device, direct_launch: bool):
        template = None
        if isinstance(plan.spec, TritonKernelSpec):
            template = plan.spec.triton_launch(plan.case, plan.config, plan.target)
        self._template = template
        self._fields = fields
        self._device_index = device.index if device.type == "cuda" else None
        self._compiled = None
        self._direct_launch = direct_launch and device.type == "cuda"

    def _launch_jit(self, operands) -> None:
        """The template's launch through the JIT on ``operands`` (GemvOperands or MoeOperands); on CUDA keeps
        the compiled kernel for :meth:`_launch`."""
        t = self._template
        compiled = t.kernel[t.grid](**fill_sources(t.args, operands), **t.options)
        if self._direct_launch and hasattr(compiled, "packed_metadata"):
            self._prepare_compiled(compiled)

    def _prepare_compiled(self, compiled) -> None:
        t = self._template
        argv = bound_arguments(t.kernel, (), {**t.args, **t.options})  # as the JIT call of _launch_jit binds them
        self._argv = argv
        self._slots = tuple((i, self._fields[v.name]) for i, v in enumerate(argv) if isinstance(v, Src))
        self._descriptors = tuple((i, self._fields[v.name], v) for i, v in enumerate(argv) if isinstance(v, DescSrc))
        grid = self._template.grid
        self._grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        launcher = compiled.run  # loads the module now, not on the first timed call
        # The launcher's own C entry point when the kernel needs no scratch memory (Triton 3.6's CudaLauncher
        # only allocates scratch in Python before calling it), else the launcher itself.
        if (getattr(launcher, "global_scratch_size", 1) == 0 and getattr(launcher, "profile_scratch_size", 1) == 0
                and hasattr(launcher, "launch")):
            self._launcher = functools.partial(_launch_c, launcher)
        else:
            self._launcher = launcher
        self._current_stream = driver.active.get_current_stream
        self._encoded = None
        raw = _raw_launch(getattr(launcher, "launch", None)) if self._descriptors else None
        metas = getattr(compiled.metadata, "tensordesc_meta", None)
        if raw is not None and metas and len(metas) == len(self._descriptors) and self._launcher is not launcher:
            # no scratch to allocate (the C launch is called directly): the descriptors encoded once per address
            self._encoded = EncodedDescriptors(raw, launcher, argv, self._slots, self._descriptors, metas)
        self._compiled = compiled

    @property
    def launches_by_address(self) -> bool:
        """Whether :meth:`launch_at` can run this call: its kernel compiled and its launcher called directly."""
        return self._compiled is not None

    def launch_at(self, addresses: tuple) -> None:
        """Launch on operands of this plan's metadata at ``addresses`` (the order of ``fields``); only where
        :attr:`launches_by_address`.  Nothing is checked, not even that an output shares no memory with an input:
        the caller vouches for the operands."""
        if not self.launches_by_address:
            raise RuntimeError("addresses: this call cannot launch on addresses alone (launches_by_address is False: "
                               "call it with the operands)")
        self._launch(addresses)

    def _launch(self, addresses: tuple) -> None:
        """The compiled kernel on operands at ``addresses`` (the order of ``fields``); only once compiled."""
        k = self._compiled
        stream = self._current_stream(self._device_index)
        enter, leave = launch_hooks()
        if self._encoded is not None and enter is None:  # builds its own argument list
            self._encoded.launch(self._grid, stream, k, addresses)
            return
        argv = self._argv.copy()
        for i, j in self._slots:
            argv[i] = addresses[j]
        for i, j, src in self._descriptors:
            argv[i] = AddressDescriptor(addresses[j], src)
        meta = k.launch_metadata(self._grid, stream, *argv) if enter is not None else None
        self._launcher(*self._grid, stream, k.function, k.packed_metadata, meta, enter, leave, *argv)


def _raw_launch(launch):
    """The C launch that Triton 3.6's tensor-descriptor wrapper (``wrap_handle_tensordesc``'s ``inner``: it encodes
    each descriptor argument, then calls this) closes over, or None where ``launch`` is not that wrapper."""
    code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
    if code is None or closure is None:
        return None
    cells = dict(zip(code.co_freevars, closure))
    if "launcher" not in cells or "tensordesc_indices" not in cells:
        return None
    return cells["launcher"].cell_contents


class EncodedDescriptors:
    """A kept launch's bulk-copy arguments encoded once per address: the argument list as the C launch takes it
    (each descriptor expanded into its encoded tensor map, shape and strides, as Triton 3.6's wrapper expands it),
    each descriptor's expansion kept with the address it was encoded at and encoded again only when that address
    changes.  The encoding depends on nothing else that varies (shape, strides, box and swizzle are the launch's
    metadata), so a kept expansion is the one the wrapper would make (``tests/test_kernels_engine.py``); decode
    calls the same weights each step, so there only the activation's descriptor is encoded again."""

    __slots__ = ("_raw", "_launcher", "_encode", "_flat", "_slots", "_descs", "_kept")

    def __init__(self, raw, launcher, argv, slots, descriptors, metas):
        from triton.backends.nvidia.driver import make_tensordesc_arg
        self._raw, self._launcher, self._encode = raw, launcher, make_tensordesc_arg
        at = {i for i, _, _ in descriptors}
        where, flat = {}, []
        for i, v in enumerate(argv):  # argv's positions in the expanded list
            where[i] = len(flat)
            flat.extend([None] * (1 + 2 * len(v.shape)) if i in at else [v])  # descriptor: map, shape, strides
        self._flat = flat
        self._slots = tuple((where[i], j) for i, j in slots)
        self._descs = tuple((where[i], 1 + 2 * len(src.shape), j, src, meta)
                            for (i, j, src), meta in zip(descriptors, metas))
        self._kept = [None] * len(descriptors)

    def launch(self, grid, stream, compiled, addresses) -> None:
        """``compiled`` on operands at ``addresses`` over ``grid`` on ``stream`` (no launch hooks)."""
        flat = self._flat.copy()
        for p, j in self._slots:
            flat[p] = addresses[j]
        kept, encode = self._kept, self._encode
        for n, (p, width, j, src, meta) in enumerate(self._descs):
            address = addresses[j]
            got = kept[n]
            if got is None or got[0] != address:
                got = kept[n] = (address, encode(AddressDescriptor(address, src), meta))
            flat[p:p + width] = got[1]
        launcher = self._launcher
        self._raw(*grid, stream, compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None,
                  None, compiled.packed_metadata, None, None, None, *flat)


def _launch_c(launcher, grid_x, grid_y, grid_z, stream, function, *args):
    launcher.launch(grid_x, grid_y, grid_z, stream, function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                    None, None, *args)


class PreparedGemv(KeptLaunch):
    """:func:`gemv` planned for one metadata: call it with new operands of that metadata (``prepare_gemv``
    for those operands returns this object; nothing is checked again).

    The first call launches through Triton's JIT, which compiles the kernel.  On CUDA (with Triton 3.6) every
    later call fills the pointer arguments of the kept argument list with the operands' addresses and calls
    the compiled kernel's launcher directly (:class:`KeptLaunch`): :attr:`launches_by_address` is then True, and
    :meth:`launch_at` launches on addresses alone."""

    __slots__ = ("plan",)

    def __init__(self, plan: GemvPlan, direct_launch: bool = DIRECT_LAUNCH):
        super().__init__(plan, _ADDRESS_INDEX, plan.device, direct_launch)
        self.plan = plan

    @property
    def launches_by_address(self) -> bool:
        """Whether :meth:`launch_at` can run this call: its kernel compiled and its launcher called directly, and
        no copy of the activation to make first."""
        return self._compiled is not None and not self.plan.copy_activation

    def __call__(self, a: FP4Tensor, b: FP4Tensor | torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``gemv(a, b, out=out)`` with this plan, for operands of its metadata; returns the result."""
        return self._run(a, b, out, None if out is None else _addresses(a, b, out))

    def _run(self, a, b, out, addresses: tuple | None) -> torch.Tensor:
        plan = self.plan
        if out is not None:
            # The kept plan checked metadata only, and these are new tensors.
            if addresses is None or _may_share(addresses, plan.extents, 3):
                check_apart(out, gemv_inputs(a, b))
        if self._compiled is not None and addresses is not None and out is not None and not plan.copy_activation:
            self._launch(addresses)
            return out
        if out is None:
            out = torch.empty(plan.out_shape, dtype=plan.case.out_dtype, device=plan.device)
        if plan.copy_activation:
            b = b.contiguous()
        if self._compiled is not None:
            self._launch(_addresses(a, b, out))
            return out
        ops = gemv_operands(a, b, out)
        if self._template is None:
            # The reference computes with torch ops: no autograd graph here, as none for a kernel; gradients are
            # the custom op's (library.py), the same on every backend.
            with torch.no_grad():
                plan.spec.launch(ops, plan.config, plan.target)
            return out
        self._launch_jit(ops)
        return out


# The one cache of prepared calls (gemv's, moe_gemv's): by the key of their arguments' metadata, and by keys
# callers give (``prepare_gemv(metadata_key=...)``).
_CACHE: dict[object, object] = {}


def kept_call(key):
    """The prepared call kept under ``key`` (a metadata key; None: none), or None (also for an unhashable key:
    an argument such as a config that is not a NamedTuple, which is then never kept)."""
    if key is None:
        return None
    try:
        return _CACHE.get(key)
    except TypeError:
        return None


def keep_call(key, call):
    """Keep ``call`` under ``key`` (not when None or unhashable); returns ``call``."""
    if key is not None:
        try:
            _CACHE[key] = call
        except TypeError:
            pass
    return call


def _prepared(a, b, out, out_dtype, backend, kernel, config) -> tuple[PreparedGemv, tuple | None]:
    key, addresses = _key_and_addresses(a, b, out, out_dtype, backend, kernel, config)
    cached = kept_call(key)
    if cached is None:
        cached = keep_call(key, PreparedGemv(plan_for(a, b, out=out, out_dtype=out_dtype, backend=backend,
                                                      kernel=kernel, config=config)))
    return cached, addresses


def prepare_gemv(
    a: FP4Tensor,
    b: FP4Tensor | torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
    backend: Backend = "auto",
    kernel: str | None = None,
    config=None,
    metadata_key=None,
) -> PreparedGemv:
    """The :class:`PreparedGemv` of these arguments (same meaning as :func:`gemv`'s), validated and planned when
    their metadata is new, else the one kept for it; raises as gemv does.

    metadata_key: a hashable key of the caller's own from which every piece of metadata of ``a``, ``b`` and
    ``out`` follows (``task.custom_kernel``'s: the task tensors' shapes, strides, dtypes, devices and
    alignments, which fix their views'); the call is also kept under it, for :func:`prepared_gemv`."""
    call, _ = _prepared(a, b, out, out_dtype, backend, kernel, config)
    if metadata_key is not None:
        _CACHE[("caller", metadata_key)] = call
    return call


def prepared_gemv(metadata_key) -> PreparedGemv | None:
    """The call ``prepare_gemv(..., metadata_key=metadata_key)`` kept, or None."""
    return _CACHE.get(("caller", metadata_key))


def gemv(
    a: FP4Tensor,
    b: FP4Tensor | torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
    backend: Backend = "auto",
    kernel: str | None = None,
    config=None,
) -> torch.Tensor:
    """``a @ b^T`` per batch: FP4 weights times FP4 (W4A4) or float (W4A16) activations.

    a: FP4Tensor ``[L, M, K]`` or ``[M, K]`` (NVFP4 or MXFP4, either scale layout).
    b: FP4Tensor ``[L, N, K]`` or ``[N, K]`` of a's format (any scale layout), or a float16, bfloat16 or
        float32 tensor ``[L, N, K]``, ``[N, K]`` or ``[K]`` (any strides: Triton kernels read a contiguous copy
        unless it is contiguous along K with 16-byte aligned rows); any N >= 1 (N > 16: the GEMM kernel,
        ``kernels/gemm.py``, for fp16/bf16 activations; the reference any).  A batch dimension on one
        operand only is broadcast over the other.
    out: written and returned when given: exactly the result's shape, ``out_dtype`` and a's device, any
        strides that give each element memory of its own, sharing no byte with an input (ValueError otherwise).
        Otherwise a new tensor.
    out_dtype: float16, bfloat16 or float32.
    backend: ``"auto"``: Triton kernels with their PTX paths on CUDA, the float64 reference elsewhere.
        ``"triton"``: the kernels' pure-Triton paths (on CPU tensors too, under ``TRITON_INTERPRET=1``).
        ``"triton-ptx"``: PTX paths (CUDA only).  ``"reference"``: float64 (``fp4gemv.reference``).
    kernel: None (the first of ``kernels.GEMV_KERNELS`` that supports the case: :func:`select_kernel` says
        which) or a kernel's name ("gemm", "w4a4", "weight_only", "hmma", "general", "reference"), which must
        support the case.
    config: None (the kernel's measured default) or an instance of the chosen kernel's config class
        (``kernels.w4a4.W4A4Config``, ``kernels.weight_only.WeightOnlyConfig``, ``kernels.hmma_gemv.HmmaConfig``,
        ``kernels.general.GeneralConfig``, ``kernels.gemm.GemmConfig``).
    Returns ``[L?, M, N]``: L when either operand has it, N unless b is a ``[K]`` vector.

    Both operands' global scales multiply the result (their fp32 product).  The w4a4 and general kernels
    accumulate exact 16-element block sums (W4A4) or fp32 block sums (W4A16) in fp32; the tensor-core kernels
    (weight_only, hmma) multiply exactly and accumulate every product in fp32 (on the tensor cores).  The result
    is rounded once to ``out_dtype``.  Under ``torch.compile`` ``fp4gemv.gemv`` is the custom op
    ``torch.ops.fp4gemv.gemv`` (``library.py``); this function is its eager path.

    Range: with bf16 activations the weight-only kernel (the default for N <= 8, and for MXFP4 weights at any N)
    multiplies the activation by 2^64 when it runs MXFP4 weights or the split mode (N <= 2), which is exact only
    for 2^-70 <= |x| < 2^64: an activation of magnitude 2^64 or more gives inf or NaN, and nonzero ones below
    2^-70 may lose precision (``kernels/weight_only.py``).  fp16, fp32 and FP4 activations have no such limit;
    ``kernel="hmma"`` or ``kernel="general"`` avoid it for NVFP4 (and general for MXFP4) weights.
    The GEMM kernel (N > 16) is exact for NVFP4; for MXFP4 while the block scales stay within 2^-125 .. 2^125
    (bf16 activations) or 2^-23 .. 2^13 (fp16), beyond which weights overflow or round (``kernels/gemm.py``).
    """
    call, addresses = _prepared(a, b, out, out_dtype, backend, kernel, config)
    return call._run(a, b, out, addresses)


def clear_cache() -> None:
    """Forget every prepared call, gemv's and moe_gemv's (they hold compiled kernels, not tensors)."""
    _CACHE.clear()

