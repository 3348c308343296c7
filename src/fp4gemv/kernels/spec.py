"""What every GEMV kernel shares with the op layer: the case it is asked to run, its spec, and its launch.

* :class:`GemvCase` is everything a kernel's choice and configuration may depend on: formats, sizes,
  dtypes, strides and alignments of the operands in the batched ``[L, rows, ...]`` form the kernels read.
  It holds metadata only (no tensor values), so the op layer can cache decisions per case.
* :class:`GemvOperands` are the tensors of one GEMV in that batched form with their case; the op layer builds
  them (kernels never see an ``FP4Tensor``).
* :class:`KernelSpec` is one kernel as the dispatcher sees it: a name, ``supports(case, target)``,
  ``default_config(case, target)``, its config class, its :class:`ErrorModel` and ``launch``.
  ``kernels/__init__.py`` lists them in the order the dispatcher tries them, with the cases one leaves to
  another (its ``DEFERRALS``).
* A Triton kernel describes its launch as a :class:`TritonLaunch`: the JIT function, the grid, every argument
  by name with the operands' pointers as :class:`Src` placeholders, and the launch options.  The op layer
  fills the placeholders (tensor views on the first call and in the interpreter; raw pointers on cached calls,
  through the compiled kernel's own launcher).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch
import triton
from triton import knobs
from triton.runtime.driver import driver

from .. import layouts
from ..formats import FP4Format, dtype_name
from ..target import Target

__all__ = ["FP4Meta", "FloatMeta", "GemvCase", "GemvOperands", "KernelSpec", "TritonKernelSpec", "TritonLaunch",
           "Src", "DescSrc", "AddressDescriptor", "ScaleAddressing", "linear_scale_addressing",
           "swizzled_scale_addressing", "alignment",
           "global_scale_sources", "check_powers_of_two", "ErrorModel", "fill_sources", "GEMV_MAX_N",
           "too_many_rows", "MoeCase", "MoeOperands", "launch_hooks"]

# Activation rows the GEMV kernels take: they keep every row's accumulator in registers (the GEMM takes more).
GEMV_MAX_N = 16


def alignment(t: torch.Tensor, strides: tuple[int, ...] = ()) -> int:
    """The largest power of two up to 16 dividing ``t``'s address (bytes) and ``strides`` (bytes)."""
    value = t.data_ptr()
    for s in strides:
        value |= s
    align = 16
    while align > 1 and value % align:
        align //= 2
    return align


class ScaleAddressing(NamedTuple):
    """Byte strides placing scale ``(l, row, col)`` at ``l * batch + (row // 128) * row_tile``
    ``+ (row % 32) * r32 + ((row % 128) // 32) * r4 + (col // 4) * col_tile + col % 4``: one formula for the
    linear layout and the 128x4 swizzle, so kernels never branch on the layout."""

    batch: int
    row_tile: int
    r32: int
    r4: int
    col_tile: int


def linear_scale_addressing(stride_batch: int, stride_row: int) -> ScaleAddressing:
    """Linear ``[L, rows, cols]`` scales, column stride 1: the formula reduces to ``l * stride_batch``
    ``+ row * stride_row + col``."""
    return ScaleAddressing(stride_batch, 128 * stride_row, stride_row, 32 * stride_row, 4)


def swizzled_scale_addressing(stride_batch: int, cols: int) -> ScaleAddressing:
    """The 128x4 swizzle of ``cols`` scale columns (``layouts.swizzled_offset``): 512-byte atoms of 32 lines x 16."""
    _, cols_p = layouts.padded_scale_shape(1, cols)
    return ScaleAddressing(stride_batch, layouts.ROWS_PER_ATOM * cols_p, 16, 4, 512)


@dataclass(frozen=True)
class FP4Meta:
    """One FP4 operand as the kernels read it, ``[L, rows, K/2]`` bytes (batch stride 0 when broadcast).

    align: largest power of two (<= 16) dividing the data's address and its batch and row strides;
    scale_align: the same for the scale bytes (their address and the addressing's row strides);
    scale_tile_align: the same for where a bulk copy of scales starts (the address, the batch stride, and the row
    stride (linear) or the 128-row tile's (swizzled)); code_order: the FP4Tensor's (``formats.CODE_ORDERS``)."""

    rows: int
    batch_stride: int
    row_stride: int
    align: int
    scale_layout: str
    scales: ScaleAddressing
    scale_align: int
    has_global_scale: bool
    scale_tile_align: int = 1
    code_order: str = "checkpoint"


@dataclass(frozen=True)
class FloatMeta:
    """A float activation ``[L, N, K]`` (strides in elements, batch stride 0 when broadcast); align: largest power
    of two (<= 16) dividing its address and its batch and row strides in bytes, 0 unless contiguous along K."""

    dtype: torch.dtype
    strides: tuple[int, int, int]
    align: int


@dataclass(frozen=True)
class GemvCase:
    """``out[l, m, n] = sum_k a[l, m, k] * b[l, n, k]``: what a kernel may look at to decide and configure.

    fmt: the format of a (and of b when b is FP4).  b: :class:`FP4Meta` (W4A4) or :class:`FloatMeta`
    (W4A16).  out_strides: ``[L, M, N]`` in elements.  vector: b was a ``[K]`` vector (the result has no N).
    """

    fmt: FP4Format
    m: int
    k: int
    n: int
    batch: int
    a: FP4Meta
    b: FP4Meta | FloatMeta
    out_dtype: torch.dtype
    out_strides: tuple[int, int, int]
    vector: bool = False

    @property
    def fp4_activation(self) -> bool:
        return isinstance(self.b, FP4Meta)

    @property
    def activation_dtype(self) -> torch.dtype | None:
        """The float activation's dtype, None for an FP4 activation."""
        return None if isinstance(self.b, FP4Meta) else self.b.dtype

    @property
    def scale_columns(self) -> int:
        return self.k // self.fmt.block_size

    def describe(self) -> str:
        act = f"{self.fmt.name} activation" if self.fp4_activation else dtype_name(self.b.dtype)
        batch = f" x L={self.batch}" if self.batch > 1 else ""
        return f"{self.fmt.name} {self.m}x{self.k}{batch} times {act}, N={self.n}"


@dataclass(frozen=True)
class MoeCase:
    """``out[t, j] = W[ids[t, j]] @ x[t]`` (+ bias, times global scales): what a routed kernel may look at.

    dense: one expert's product as a :class:`GemvCase`: a the weights ``[E, M, K/2]`` (batch = E), b the
    activation ``x`` ``[T, K]`` (batch stride 0, N = T), out_strides unused (the routed kernels scatter into
    ``out_strides``, ``[T, k, M]`` in elements).  global_scales: None, ``"tensor"`` (w's one) or ``"expert"``
    (one per expert, ``global_scales_stride`` apart; with an activation ``[E, 2]``, gate's and up's,
    ``global_scales_half_stride`` apart, else that stride is 0); bias_dtype None when there is no bias.

    The epilogue (``reference.routed_epilogue``): ``activation`` None, or one of ``reference.MOE_ACTIVATIONS``
    (W's rows are gate and up, arranged as the activation says; out holds ``[T, k, M / 2]``) with ``alpha`` and
    ``limit``; ``pair_weights_dtype`` not None when each pair's result is multiplied by its routing weight
    (``[T, k]``, ``pair_weights_strides``).
    """

    dense: GemvCase
    experts: int
    tokens: int
    top_k: int
    ids_dtype: torch.dtype
    ids_strides: tuple[int, int]
    bias_dtype: torch.dtype | None
    bias_strides: tuple[int, int]
    global_scales: str | None
    global_scales_stride: int
    out_strides: tuple[int, int, int]
    global_scales_half_stride: int = 0
    activation: str | None = None
    alpha: float = 0.0
    limit: float = 0.0
    pair_weights_dtype: torch.dtype | None = None
    pair_weights_strides: tuple[int, int] = (0, 0)

    @property
    def pairs(self) -> int:
        return self.tokens * self.top_k

    @property
    def out_rows(self) -> int:
        """Rows of each pair's result: M, or M / 2 (one per gate and up pair) after an activation."""
        return self.dense.m // 2 if self.activation else self.dense.m

    @property
    def has_epilogue(self) -> bool:
        return self.activation is not None or self.pair_weights_dtype is not None or self.global_scales_half_stride != 0

    def describe(self) -> str:
        d = self.dense
        extra = (f", {self.activation} activation" if self.activation else "") + (
            ", pair weights" if self.pair_weights_dtype is not None else "")
        return (f"{d.fmt.name} experts E={self.experts} {d.m}x{d.k} times "
                f"{dtype_name(d.b.dtype)} T={self.tokens} top-{self.top_k}{extra}")


class MoeOperands(NamedTuple):
    """The tensors of one routed GEMV with their case: w's data ``[E, M, K/2]`` and scales, the global scales
    (``[E]`` or ``[E, 2]``, or w's one as ``[1]``; None without), x ``[T, K]``, expert_ids ``[T, k]``, bias
    ``[E, M]`` or None, out ``[T, k, case.out_rows]``, pair_weights ``[T, k]`` or None."""

    case: MoeCase
    w_data: torch.Tensor
    w_scales: torch.Tensor
    global_scales: torch.Tensor | None
    x: torch.Tensor
    expert_ids: torch.Tensor
    bias: torch.Tensor | None
    out: torch.Tensor
    pair_weights: torch.Tensor | None = None


class GemvOperands(NamedTuple):
    """The tensors of one GEMV in the batched form kernels read, with the case describing them.

    a_data ``[L, M, K/2]`` and b_data (FP4 ``[L, N, K/2]`` bytes or float ``[L, N, K]``): batch stride 0 when
    broadcast.  a_scales / b_scales: the scale bytes, ``[L, rows, cols]`` (linear) or ``[L, rows_p * cols_p]``
    (swizzled).  out: ``[L, M, N]`` (size-1 dimensions for what the result shape leaves out).
    """

    case: GemvCase
    a_data: torch.Tensor
    a_scales: torch.Tensor
    a_global_scale: torch.Tensor | None
    b_data: torch.Tensor
    b_scales: torch.Tensor | None
    b_global_scale: torch.Tensor | None
    out: torch.Tensor


class Src(NamedTuple):
    """A pointer argument of a launch: operand ``name`` (a field of :class:`GemvOperands` or
    :class:`MoeOperands`) read as ``dtype``."""

    name: str
    dtype: torch.dtype


class DescSrc(NamedTuple):
    """A bulk-copy (TMA) descriptor argument of a launch over operand ``name``'s memory read as ``dtype``: the
    viewed tensor's ``shape`` and ``strides`` (elements), the copy's ``block`` and its shared-memory ``layout``
    (Gluon's ``TensorDescriptor`` fields; the operand gives only the address)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    block: tuple[int, ...]
    layout: Any


class _Address:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class AddressDescriptor:
    """A :class:`DescSrc` at an operand's address for a kept launch (``ops.KeptLaunch``): what Triton 3.6's launcher
    reads of a host tensor descriptor to encode it (``base.data_ptr()``, ``shape``, ``strides``, ``padding``; its
    block and layout are the compiled kernel's), without the construction's validation each call -- the first
    launch built and checked the real descriptor from the same metadata."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, ptr: int, src: DescSrc):
        self.base = _Address(ptr)
        self.shape = list(src.shape)  # lists, as the JIT call's descriptor gives the encoder
        self.strides = list(src.strides)
        self.padding = "zero"


@dataclass
class TritonLaunch:
    """One Triton kernel launch: ``kernel[grid](**args, **options)`` with :class:`Src` placeholders filled."""

    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)


def global_scale_sources(case: GemvCase) -> tuple[Src, Src]:
    """The ``gsa_ptr`` / ``gsb_ptr`` arguments: each operand's fp32 global scale, or, where it has none (the kernel
    then never reads it: HAS_GSA / HAS_GSB false), a's scale bytes as a placeholder pointer."""
    placeholder = Src("a_scales", torch.uint8)
    gsa = Src("a_global_scale", torch.float32) if case.a.has_global_scale else placeholder
    gsb = Src("b_global_scale", torch.float32) if case.fp4_activation and case.b.has_global_scale else placeholder
    return gsa, gsb


def check_powers_of_two(config: NamedTuple, fields: tuple[str, ...]) -> None:
    """ValueError naming ``config`` unless each of ``fields`` is a power of two >= 1."""
    for name in fields:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"config: expected {name} a power of two >= 1, got {config}")


class ErrorModel(NamedTuple):
    """How a kernel's fp32 arithmetic may move its result from the exact one, as its module docstring derives it
    (``tests/operands.py`` turns it into the bound the tests check).

    tensor_cores: False for exact 16-element block sums accumulated in fp32 (depth K/16 + 22 roundings to
    nearest); True for all K products in one fp32 accumulation on the tensor cores (depth K + 24, which may
    truncate).  fold: the exponent f of the 2^-f the tensor-core accumulator carries until the epilogue (its
    underflow term scales by 2^f)."""

    tensor_cores: bool = False
    fold: int = 0


def too_many_rows(case: GemvCase) -> str | None:
    """The reason a GEMV kernel refuses ``case`` for its N, None when N <= ``GEMV_MAX_N``."""
    if case.n > GEMV_MAX_N:
        return f"takes N <= {GEMV_MAX_N} activation rows (register accumulators), got N = {case.n}"
    return None


def _fp4_operands(case, spec: KernelSpec) -> list[tuple[str, FP4Meta, tuple[str, ...]]]:
    """The FP4 operands of a GEMV or routed case, by the names errors give them, with the code orders ``spec``
    decodes for each (none for the other ops' cases)."""
    dense = case.dense if isinstance(case, MoeCase) else case
    if not isinstance(dense, GemvCase):
        return []
    operands = [("w" if dense is not case else "a", dense.a, spec.code_orders)]
    if isinstance(dense.b, FP4Meta):
        operands.append(("b", dense.b, spec.activation_code_orders))
    return operands


# The code orders of the kernels whose decode reads the native bit fields with the checkpoint's pairing (weight_only,
# the routed kernels); the "paired" order's pairing is the mma.sync step's (``_Step.matched_pairs``), which only the
# dense kernels declare (engine, weight_only with fp16 / bf16 activations).
NATIVE_FIELD_ORDERS = ("checkpoint", "native")


class KernelSpec:
    """One GEMV implementation as the dispatcher sees it.  Subclasses set ``name`` and ``config_type`` and
    implement :meth:`why_not`, :meth:`default_config` and :meth:`launch`."""

    name: ClassVar[str]
    config_type: ClassVar[type | None] = None
    # The code orders (``formats.CODE_ORDERS``) this kernel decodes, of the weights (a, the experts) and of FP4
    # activations (b): the native and paired orders only where their decode is written and tested (``refusal``
    # checks them).
    code_orders: ClassVar[tuple[str, ...]] = ("checkpoint",)
    activation_code_orders: ClassVar[tuple[str, ...]] = ("checkpoint",)

    def why_not(self, case: GemvCase, target: Target) -> str | None:
        """None when this kernel runs ``case`` on ``target``; else the reason, naming the argument at fault.  The
        code orders are ``refusal``'s: ``why_not`` need not look at them."""
        raise NotImplementedError

    def refusal(self, case, target: Target) -> str | None:
        """Why this kernel does not run ``case`` on ``target`` (an operand's code order it does not decode, then
        ``why_not``), or None: what the dispatcher asks, so that no kernel reads codes in an order it was not
        written for."""
        for name, meta, orders in _fp4_operands(case, self):
            if meta.code_order not in orders:
                return f"{name} in code order {meta.code_order!r} (it decodes {' and '.join(orders)})"
        return self.why_not(case, target)

    def supports(self, case: GemvCase, target: Target) -> bool:
        return self.refusal(case, target) is None

    def default_config(self, case: GemvCase, target: Target):
        """The measured default launch configuration (None for an implementation without one)."""
        return None

    def check_config(self, config, case: GemvCase | None = None) -> None:
        """ValueError unless ``config`` (an instance of ``config_type``) is one this kernel can launch (for
        ``case``, when given)."""

    def resolve_config(self, config, case: GemvCase, target: Target):
        """The configuration a call launches: the default for ``config=None``, else ``config`` once checked
        (TypeError naming ``config`` unless it is of this kernel's ``config_type``)."""
        if config is None:
            return self.default_config(case, target)
        if self.config_type is None or not isinstance(config, self.config_type):
            expected = "no config" if self.config_type is None else f"a {self.config_type.__name__}"
            raise TypeError(f"config: expected {expected} for kernel {self.name!r}, got {type(config).__name__}")
        self.check_config(config, case)
        return config

    def error_model(self, case: GemvCase, config) -> ErrorModel:
        """How far this kernel's result may lie from the exact one (:class:`ErrorModel`); block sums unless
        overridden."""
        return ErrorModel()

    def launch(self, ops: GemvOperands, config, target: Target) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<kernel {self.name}>"


class TritonKernelSpec(KernelSpec):
    """A Triton kernel: :meth:`triton_launch` describes the launch, which the op layer executes (and caches);
    None where a configuration takes more than one kernel, which :meth:`launch` then runs on every call."""

    def triton_launch(self, case: GemvCase, config, target: Target) -> TritonLaunch | None:
        raise NotImplementedError

    def launch(self, ops: GemvOperands, config, target: Target) -> None:
        launch = self.triton_launch(ops.case, config, target)
        launch.kernel[launch.grid](**fill_sources(launch.args, ops), **launch.options)


def fill_sources(args: dict[str, Any], ops: GemvOperands | MoeOperands) -> dict[str, Any]:
    """``args`` with every :class:`Src` replaced by the operand tensor it names, viewed as its dtype, and every
    :class:`DescSrc` by a Gluon tensor descriptor over that tensor's memory."""
    filled = {}
    for name, v in args.items():
        if isinstance(v, Src):
            v = getattr(ops, v.name).view(v.dtype)
        elif isinstance(v, DescSrc):
            from ._gluon import TensorDescriptor  # Gluon only for the kernels that copy by descriptor
            v = TensorDescriptor(getattr(ops, v.name).view(v.dtype), list(v.shape), list(v.strides), list(v.block),
                                 v.layout)
        filled[name] = v
    return filled


# --- compiled kernels launched again without the JIT ----------------------------------------------------------------


def direct_launch_supported(triton_version: str) -> bool:
    """Whether a Triton of this version has the compiled-kernel launcher the kept launches call directly (3.6's
    ``CompiledKernel.run`` signature: ``ops.KeptLaunch``, ``moe_engine``'s kept kernels); any other version launches
    through the public JIT call."""
    return triton_version.split(".")[:2] == ["3", "6"]


DIRECT_LAUNCH = direct_launch_supported(triton.__version__)


def bound_arguments(kernel, args: tuple, options: dict) -> list:
    """Every parameter of the JIT function ``kernel`` in its order, as its JIT call ``kernel[grid](*args,
    **options)`` binds them: ``args`` first, then ``options`` by name, else the parameter's default (launch options
    that are not parameters, such as ``num_warps``, are not arguments)."""
    values = list(args)
    for param in kernel.params[len(args):]:
        values.append(options[param.name] if param.name in options else param.default)
    return values


def launch_hooks() -> tuple:
    """(enter, exit): Triton's launch hooks as a compiled kernel's launcher takes them, None where none is
    registered.  Since Triton 3.6 the knobs are hook chains, never None, and a launcher handed an empty chain still
    builds the launch metadata and calls it (round 26 of docs/performance.md: a kept launch paid for that every
    call); an empty chain is handed as None, so the launcher skips both."""
    runtime = knobs.runtime
    return _registered(runtime.launch_enter_hook), _registered(runtime.launch_exit_hook)


def _registered(hook):
    """``hook`` unless it is None or an empty hook chain (``calls`` empty)."""
    if hook is None or getattr(hook, "calls", True) == []:
        return None
    return hook


def run_compiled(compiled, grid: tuple, argv: list, device_index: int) -> None:
    """``compiled`` (what a JIT call returned) on ``argv`` (``bound_arguments``) over ``grid``, on the current stream
    of CUDA device ``device_index``: what the JIT call does after its dispatch, without the dispatch (so a launch
    inside ``torch.cuda.graph`` is captured like the JIT's)."""
    stream = driver.active.get_current_stream(device_index)
    enter, leave = launch_hooks()
    meta = compiled.launch_metadata(grid, stream, *argv) if enter is not None else None
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, compiled.function,
                 compiled.packed_metadata, meta, enter, leave, *argv)
