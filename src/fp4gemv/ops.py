"""The public GEMV op: validate once at the boundary, pick a kernel spec, launch; decisions cached per metadata.

:func:`gemv` walks ``kernels.GEMV_KERNELS`` (the reference last) and runs the first spec that supports the
case on the target (``fp4gemv.target``) and does not leave it to a later one; :func:`select_kernel` says which
one that is.  Validation raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (shape, device, backend,
no kernel for the case) naming the argument, the expected and the actual, before anything is written.

Everything decided from metadata (shapes, strides, dtypes, devices, pointer alignment, format, layout, the
kernel and its configuration) is a :class:`GemvPlan`, kept per distinct metadata.  A call whose metadata has a
plan checks nothing more (the key holds everything the checks depend on) and launches the compiled Triton
kernel through its own launcher with the operands' pointers, skipping the JIT's argument binding.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .kernels import GEMV_KERNELS, kernel_by_name
from .kernels.spec import GemvCase, GemvOperands, KernelSpec, Src, TritonKernelSpec, fill_sources
from .target import Backend, Target, interpreting, resolve_target
from .tensor import FP4Tensor

__all__ = ["gemv", "select_kernel", "plan_for", "check_arguments", "prepared", "PreparedGemv", "SLOTS", "choose_kernel", "GemvPlan", "MAX_N", "ACTIVATION_DTYPES", "OUT_DTYPES"]

# Activation rows per launch: the kernels keep every row's accumulator in registers.
MAX_N = 16
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


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


def check_arguments(a, b, out: torch.Tensor | None, out_dtype: torch.dtype) -> tuple[int, ...]:
    """The checks of :func:`gemv` that read metadata only (operands against each other, devices, out_dtype,
    out); the result's shape.  Eager calls and ``torch.compile`` (``library.traced_gemv``) share them."""
    shape = result_shape(a, b)
    if b.device != a.device:
        raise ValueError(f"b: expected device {a.device} like a, got {b.device}")
    if out_dtype not in OUT_DTYPES:
        got = f"{type(out_dtype).__name__} {out_dtype!r}" if not isinstance(out_dtype, torch.dtype) else out_dtype
        raise TypeError(f"out_dtype: expected a torch.dtype among {_names(OUT_DTYPES)}, got {got}")
    if out is not None:
        _check_out(out, shape, out_dtype, a.device)
    return shape


def _needs_copy(b: torch.Tensor) -> bool:
    """A float activation is read from a contiguous copy unless it is contiguous along K with 16-byte aligned
    rows (the tensor-core kernel's 16-byte loads); the copy is N x K elements, small next to the weights."""
    if b.stride(-1) != 1 or b.data_ptr() % 16:
        return True
    size = b.element_size()
    return any((s * size) % 16 for s in b.stride()[:-1])


class GemvPlan(NamedTuple):
    """What :func:`gemv` runs for one distinct metadata: the kernel spec and its configuration, the target,
    the case, whether the float activation is copied first, the shape of a new result, and the device."""

    spec: KernelSpec
    config: object
    target: Target
    case: GemvCase
    copy_activation: bool
    out_shape: tuple[int, ...]
    device: torch.device


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
    case = GemvOperands.of(a, b, out).case
    spec = choose_kernel(case, target, kernel)
    if config is None:
        config = spec.default_config(case, target)
    else:
        if spec.config_type is None or not isinstance(config, spec.config_type):
            expected = "no config" if spec.config_type is None else f"a {spec.config_type.__name__}"
            raise TypeError(f"config: expected {expected} for kernel {spec.name!r}, got {type(config).__name__}")
        spec.check_config(config, case)
    return GemvPlan(spec, config, target, case, copy_activation, shape, device)


def choose_kernel(case: GemvCase, target: Target, kernel: str | None = None) -> KernelSpec:
    """The first spec of GEMV_KERNELS that supports the case and does not leave it to a later one
    (``why_not_default``), or the one named ``kernel``, if it supports the case."""
    if kernel is not None:
        spec = kernel_by_name(kernel)
        reason = spec.why_not(case, target)
        if reason is not None:
            raise ValueError(f"kernel: {kernel!r} cannot run {case.describe()} on {target.describe()}: {reason}")
        return spec
    reasons = []
    for spec in GEMV_KERNELS:
        reason = spec.why_not(case, target)
        if reason is None:
            reason = spec.why_not_default(case, target)
            if reason is None:
                return spec
        reasons.append(f"{spec.name}: {reason}")
    raise ValueError(f"no kernel runs {case.describe()} on {target.describe()} (" + "; ".join(reasons)
                     + "); backend='reference' computes it in float64")


def select_kernel(
    a: FP4Tensor,
    b: FP4Tensor | torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
    backend: Backend = "auto",
    kernel: str | None = None,
) -> KernelSpec:
    """The kernel spec :func:`gemv` would run on these arguments (``.name``: "w4a4", "weight_only", "hmma",
    "general", "reference").  Raises as gemv does."""
    return plan_for(a, b, out=out, out_dtype=out_dtype, backend=backend, kernel=kernel).spec


# --- cached calls ----------------------------------------------------------------------------------------------

# The operands whose addresses a launch takes, in the order of a pointer tuple (``kernels.spec.GemvOperands``'s
# names); absent ones (no global scale, a float activation's scales) are 0.
SLOTS = ("a_data", "a_scales", "a_global_scale", "b_data", "b_scales", "b_global_scale", "out")


def _key_and_pointers(a, b, out, out_dtype, backend, kernel, config) -> tuple[tuple | None, tuple | None]:
    """Everything validation and dispatch depend on (shapes, strides, dtypes, devices, formats, layouts, the
    alignment of every address, the arguments, the current device), and the operands' addresses in SLOTS
    order; (None, None) for arguments that validation must look at (and reject).

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
        bk = (b.fmt, b.scale_layout, bd.shape, bd.stride(), bs.stride(), bg is None,
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
    key = (a.fmt, a.scale_layout, ad.shape, ad.stride(), asc.stride(), ag is None, device, bk, ok, align,
           out_dtype, backend, kernel, config, where)
    return key, (pa, ps, pg, pb, pbs, pbg, po)


_triton_runtime = None


def _runtime():
    """(Triton's current-stream lookup, the stream it would launch on; its runtime knobs), resolved once."""
    global _triton_runtime
    if _triton_runtime is None:
        from triton import knobs
        from triton.runtime.driver import driver

        _triton_runtime = (driver.active.get_current_stream, knobs.runtime)
    return _triton_runtime


class PreparedGemv:
    """A plan with its launch: the compiled Triton kernel once the first call has compiled it, then every
    later call fills the pointer slots of the argument list and calls the kernel's launcher directly."""

    __slots__ = ("plan", "template", "compiled", "argv", "slots", "grid", "_launcher")

    def __init__(self, plan: GemvPlan):
        self.plan = plan
        self.template = None
        if isinstance(plan.spec, TritonKernelSpec):
            self.template = plan.spec.triton_launch(plan.case, plan.config, plan.target)
        self.compiled = None

    def run(self, a, b, out, pointers: tuple | None = None):
        """``gemv(a, b, out=out)`` for operands of this plan's metadata; ``pointers``: their addresses in SLOTS
        order, when the caller has them."""
        plan = self.plan
        if self.compiled is not None and pointers is not None and out is not None and not plan.copy_activation:
            self.launch(pointers)
            return out
        if out is None:
            out = torch.empty(plan.out_shape, dtype=plan.case.out_dtype, device=plan.device)
        if plan.copy_activation:
            b = b.contiguous()
        if self.compiled is not None:
            fp4_b = type(b) is FP4Tensor
            gs_a, gs_b = a.global_scale, b.global_scale if fp4_b else None
            self.launch((a.data.data_ptr(), a.scales.data_ptr(), 0 if gs_a is None else gs_a.data_ptr(),
                         (b.data if fp4_b else b).data_ptr(), b.scales.data_ptr() if fp4_b else 0,
                         0 if gs_b is None else gs_b.data_ptr(), out.data_ptr()))
            return out
        ops = GemvOperands.of(a, b, out)
        if self.template is None:
            plan.spec.launch(ops, plan.config, plan.target)
            return out
        t = self.template
        compiled = t.kernel[t.grid](**fill_sources(t.args, ops), **t.options)
        if plan.target.device_type == "cuda" and hasattr(compiled, "packed_metadata"):
            self._prepare_compiled(compiled)
        return out

    def _prepare_compiled(self, compiled) -> None:
        kernel, args = self.template.kernel, self.template.args
        argv, slots = [], []
        for i, param in enumerate(kernel.params):
            value = args[param.name] if param.name in args else param.default
            if isinstance(value, Src):
                slots.append((i, SLOTS.index(value.name)))
            argv.append(value)
        self.argv, self.slots = argv, tuple(slots)
        grid = self.template.grid
        self.grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        launcher = compiled.run  # loads the module now, not on the first timed call
        # The launcher's own C entry point when the kernel needs no scratch memory (Triton 3.6's CudaLauncher
        # only allocates scratch in Python before calling it), else the launcher itself.
        if (getattr(launcher, "global_scratch_size", 1) == 0 and getattr(launcher, "profile_scratch_size", 1) == 0
                and hasattr(launcher, "launch")):
            self._launcher = functools.partial(_launch_c, launcher)
        else:
            self._launcher = launcher
        self.compiled = compiled

    def launch(self, pointers: tuple) -> None:
        """Launch the compiled kernel on operands at ``pointers`` (addresses in SLOTS order).  Only after a first
        call has compiled the kernel (``compiled`` is set), and only for operands of this plan's metadata."""
        current_stream, knobs = _triton_runtime or _runtime()
        argv = self.argv.copy()
        for i, j in self.slots:
            argv[i] = pointers[j]
        k = self.compiled
        stream = current_stream(self.plan.device.index)
        enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
        meta = k.launch_metadata(self.grid, stream, *argv) if enter is not None else None
        self._launcher(*self.grid, stream, k.function, k.packed_metadata, meta, enter, leave, *argv)


def _launch_c(launcher, grid_x, grid_y, grid_z, stream, function, *args):
    launcher.launch(grid_x, grid_y, grid_z, stream, function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                    None, None, *args)


_CACHE: dict[tuple, PreparedGemv] = {}


def prepared(a, b, out, out_dtype, backend, kernel, config) -> tuple[PreparedGemv, tuple | None]:
    """The (cached) :class:`PreparedGemv` that :func:`gemv` runs for these arguments (same meaning, all given),
    validating them when their metadata is new, and the operands' addresses (None when not cached)."""
    key, pointers = _key_and_pointers(a, b, out, out_dtype, backend, kernel, config)
    cached = None
    if key is not None:
        try:
            cached = _CACHE.get(key)
        except TypeError:  # an unhashable argument (a config that is not a NamedTuple): no caching
            key = None
    if cached is None:
        cached = PreparedGemv(plan_for(a, b, out=out, out_dtype=out_dtype, backend=backend, kernel=kernel,
                                       config=config))
        if key is not None:
            _CACHE[key] = cached
    return cached, pointers


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
        unless it is contiguous along K with 16-byte aligned rows); 1 <= N <= 16.  A batch dimension on one
        operand only is broadcast over the other.
    out: written and returned when given: exactly the result's shape, ``out_dtype`` and a's device, any
        strides.  Otherwise a new tensor.
    out_dtype: float16, bfloat16 or float32.
    backend: ``"auto"``: Triton kernels with their PTX paths on CUDA, the float64 reference elsewhere.
        ``"triton"``: the kernels' pure-Triton paths (on CPU tensors too, under ``TRITON_INTERPRET=1``).
        ``"triton-ptx"``: PTX paths (CUDA only).  ``"reference"``: float64 (``fp4gemv.reference``).
    kernel: None (the first of ``kernels.GEMV_KERNELS`` that supports the case: :func:`select_kernel` says
        which) or a kernel's name ("w4a4", "weight_only", "hmma", "general", "reference"), which must support the
        case.
    config: None (the kernel's measured default) or an instance of the chosen kernel's config class
        (``kernels.w4a4.W4A4Config``, ``kernels.weight_only.WeightOnlyConfig``, ``kernels.hmma_gemv.HmmaConfig``,
        ``kernels.general.GeneralConfig``).
    Returns ``[L?, M, N]``: L when either operand has it, N unless b is a ``[K]`` vector.

    Both operands' global scales multiply the result (their fp32 product).  The w4a4 and general kernels
    accumulate exact 16-element block sums (W4A4) or fp32 block sums (W4A16) in fp32; the tensor-core kernels
    (weight_only, hmma) multiply exactly and accumulate every product in fp32 (on the tensor cores).  The result
    is rounded once to ``out_dtype``.  Under ``torch.compile`` the call is the custom op ``torch.ops.fp4gemv.gemv``.

    Range: with bf16 activations the weight-only kernel (the default for N <= 8, and for MXFP4 weights at any N)
    multiplies the activation by 2^64 when it runs MXFP4 weights or the split mode (N <= 2), which is exact only
    for 2^-77 <= |x| < 2^64: an activation of magnitude 2^64 or more gives inf or NaN, and nonzero ones below
    2^-77 may lose precision (``kernels/weight_only.py``).  fp16, fp32 and FP4 activations have no such limit;
    ``kernel="hmma"`` or ``kernel="general"`` avoid it for NVFP4 (and general for MXFP4) weights.
    """
    if torch.compiler.is_compiling():
        from . import library

        return library.traced_gemv(a, b, out=out, out_dtype=out_dtype, backend=backend, kernel=kernel, config=config)
    cached, pointers = prepared(a, b, out, out_dtype, backend, kernel, config)
    return cached.run(a, b, out, pointers)


def clear_cache() -> None:
    """Forget every cached plan (they hold compiled kernels, not tensors)."""
    _CACHE.clear()

