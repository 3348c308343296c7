"""The quantize op, eager: floats to an NVFP4 / MXFP4 ``FP4Tensor`` (:func:`quantize`), and back to floats
(:func:`dequantize`).  ``fp4gemv.quantize`` (``library.py``) runs :func:`quantize` eagerly and the custom op
``torch.ops.fp4gemv.quantize`` under ``torch.compile``.

Both go through the kernel table (``kernels.QUANTIZE_KERNELS`` / ``DEQUANTIZE_KERNELS``) and a plan kept for
their metadata (``KeptQuantize``, in ``ops``' cache: on CUDA with Triton 3.6 later calls launch the compiled kernel
on the operands' addresses, without the JIT's dispatch): a Triton kernel where Triton runs (``kernels/quantize.py``)
and the exact CPU path of ``formats`` elsewhere (``kernels.reference``); the two give the same bytes (quantize) and
the same bits (dequantize) on the same input, so the CPU path is the definition: ``formats.quantize`` documents every rounding (NVFP4 per NVIDIA ModelOpt, MXFP4
per the OCP Microscaling spec), ``formats.dequantize`` the single rounding of the exact value.

The per-tensor scales are defined here with torch ops: :func:`nvfp4_global_scale` (``global_scale="auto"``) and
:func:`per_tensor_scale` (``"pow2"``, FP4Linear's per-call W4A4 scale).  On a Triton target ``"pow2"`` is computed
by the kernels instead (``kernels.QUANTIZE_AMAX_KERNELS``' partial maxima, then the quantize kernel's twin of
:func:`per_tensor_scale`), kept as one plan of two launches.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import torch

from . import formats, layouts
from .kernels import DEQUANTIZE_KERNELS, QUANTIZE_AMAX_KERNELS, QUANTIZE_KERNELS, choose_kernel
from .kernels.amax import amax_partials
from .kernels.quantize import (DequantizeCase, DequantizeOperands, QuantizeCase, QuantizeConfig, QuantizeOperands,
                               pair_dtype)
from .kernels.spec import DIRECT_LAUNCH, linear_scale_addressing, swizzled_scale_addressing
from .ops import KeptLaunch, keep_call, kept_call
from .target import Target, resolve_target
from .tensor import SCALE_LAYOUTS, FP4Tensor, ScaleLayout, check_device_with_values, checked_global_scale

__all__ = ["quantize", "dequantize", "nvfp4_global_scale", "per_tensor_scale", "global_scale_tensor",
           "scale_on_device", "check_quantize_arguments", "prepare_quantize", "QuantizeBackend", "QUANTIZE_BACKENDS"]

QuantizeBackend = Literal["auto", "triton", "reference"]
QUANTIZE_BACKENDS: tuple[str, ...] = ("auto", "triton", "reference")
_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# NVFP4's per-tensor scale divides amax(|x|) by this: e2m1's largest magnitude times e4m3's.
_E2M1_MAX_TIMES_E4M3_MAX = 6.0 * 448.0


def _resolve_backend(backend: str, device: torch.device) -> Target:
    """'auto': the Triton kernel on CUDA, the CPU path elsewhere; 'triton' off CUDA only under TRITON_INTERPRET=1
    (``target.resolve_target``, gemv's rule)."""
    if backend not in QUANTIZE_BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, QUANTIZE_BACKENDS))}, got {backend!r}")
    return resolve_target(backend, device)


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """ModelOpt's NVFP4 per-tensor scale ``amax(|x|) / (6 * 448)`` as a 0-d float32 tensor on x's device.

    ``NVFP4QTensor.get_weights_scaling_factor_2``: the largest block maximum then maps to e4m3's largest
    scale, 448.  The quotient is the IEEE float32 one (divided by a tensor: PyTorch's CUDA division by a
    Python number multiplies by its reciprocal), raised to 2^-126 when smaller (an all-zero or all-tiny x;
    ModelOpt would divide by zero), and 1 when ``x`` holds a NaN or infinity.  No device synchronisation.
    """
    amax = torch.linalg.vector_norm(x, float("inf")).to(torch.float32)
    g = amax / torch.full((), _E2M1_MAX_TIMES_E4M3_MAX, dtype=torch.float32, device=x.device)
    g = torch.clamp(g, min=formats.F32_SMALLEST_NORMAL)
    return torch.where(torch.isfinite(g), g, torch.ones_like(g))


def per_tensor_scale(amax: torch.Tensor, rounding: Literal["pow2", "amax"] = "pow2") -> torch.Tensor:
    """The NVFP4 per-tensor multiplier for a tensor of largest magnitude ``amax`` (a float32 0-d tensor).

    ``"amax"``: ``amax / (6 * 448)`` in fp32, NVIDIA ModelOpt's choice (NVIDIA/Model-Optimizer,
    ``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``, ``get_weights_scaling_factor_2``): the
    largest block's e4m3 scale lands on 448.  ``"pow2"``: that value rounded up to a power of two, so that
    the largest block scale lands in (224, 448] (no block saturates; e4m3's relative precision is the same
    over its normal range) and the scale is exact both as a multiplier and as a divisor (1/s is exact), and
    in bf16.  ``amax == 0`` (an all-zero tensor) gives 1, and so do a NaN ``amax`` (``amax > 0`` is false), an
    infinite one (``frexp`` gives infinity the exponent 0) and one whose quotient underflows to zero.  The
    quotient is the IEEE float32 one on every device (divided by a tensor: PyTorch's CUDA division by a Python
    number multiplies by its reciprocal, which rounds some subnormal quotients the other way).  Tensor ops
    only: no host synchronisation.  ``quantize(x, global_scale="pow2")`` takes ``per_tensor_scale(amax(|x|))``
    (on a Triton target computed by the kernels: ``kernels.quantize.pow2_per_tensor_scale``, this function's
    twin, tested bit for bit against it).
    """
    if rounding not in ("pow2", "amax"):
        raise ValueError(f"rounding: expected 'pow2' or 'amax', got {rounding!r}")
    amax = amax.to(torch.float32)
    scale = amax / torch.full((), _E2M1_MAX_TIMES_E4M3_MAX, dtype=torch.float32, device=amax.device)
    if rounding == "pow2":
        # frexp: scale = m * 2^e with m in [0.5, 1); the power of two at or above it is 2^(e-1) when m == 0.5.
        mantissa, exponent = torch.frexp(scale)
        exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
        scale = torch.ldexp(torch.ones_like(scale), exponent)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


_GLOBAL_SCALE_NAMES = {"auto": "amax / (6 * 448)", "pow2": "per_tensor_scale(amax), a power of two"}


def _named_global_scale(global_scale: str, fmt: formats.FP4Format) -> str:
    """``global_scale`` given by name, checked: ``"auto"`` or ``"pow2"`` (NVFP4 only)."""
    if global_scale not in _GLOBAL_SCALE_NAMES:
        raise ValueError(f"global_scale: expected None, 'auto', 'pow2', a number or a tensor, got {global_scale!r}")
    if fmt.name != "nvfp4":
        raise ValueError(
            f"global_scale: {global_scale!r} is NVFP4's per-tensor scale {_GLOBAL_SCALE_NAMES[global_scale]}; "
            "MXFP4 has none (its e8m0 block scales span 2^-127..2^127): pass None or an explicit scale"
        )
    return global_scale


def scale_on_device(global_scale, fmt: formats.FP4Format, target: Target) -> bool:
    """Whether the kernels compute ``global_scale`` themselves: ``"pow2"`` on a Triton target (the amax kernel's
    partial maxima, then the quantize kernel's ``pow2_per_tensor_scale``: ``kernels/amax.py``); elsewhere
    :func:`global_scale_tensor` computes it with torch.  Raises on a bad name as quantize does."""
    return isinstance(global_scale, str) and _named_global_scale(global_scale, fmt) == "pow2" and target.runs_triton


def global_scale_tensor(global_scale, fmt: formats.FP4Format, x: torch.Tensor,
                        check_values: bool) -> torch.Tensor | None:
    """:func:`quantize`'s ``global_scale`` as a 0-d float32 tensor on x's device, or None; validated before
    anything is written (a tensor's value only with ``check_values``: reading it synchronises).  A name is
    computed from x with torch ops (``"pow2"``: :func:`per_tensor_scale`, the definition the kernels' twin
    follows)."""
    if global_scale is None:
        return None
    if isinstance(global_scale, str):
        if _named_global_scale(global_scale, fmt) == "auto":
            return nvfp4_global_scale(x)
        return per_tensor_scale(x.detach().abs().amax())
    if isinstance(global_scale, bool) or not isinstance(global_scale, (int, float, torch.Tensor)):
        raise TypeError(
            f"global_scale: expected None, 'auto', 'pow2', a number or a tensor, got {type(global_scale).__name__}"
        )
    return checked_global_scale(global_scale, x.device, check_values, owner="x")


def _check_config(config: QuantizeConfig | None) -> None:
    if config is None:
        return
    if not isinstance(config, QuantizeConfig):
        raise TypeError(f"config: expected a QuantizeConfig or None, got {type(config).__name__}")
    if any(v < 1 or v & (v - 1) for v in (config.rows, config.blocks, config.num_warps)):
        raise ValueError(f"config: expected powers of two rows, blocks and num_warps, got {config}")


def _pairs(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float, stride 1 along an even last dimension) viewed as words holding two elements each."""
    return t.view(torch.int64 if t.dtype == torch.float32 else torch.int32)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 3 else t.unsqueeze(0)


def _scale_addressing(scales: torch.Tensor, layout: str, cols: int):
    """The kernels' scale addressing of linear ``[L?, R, cols]`` or swizzled ``[L?, R_p * C_p]`` scale bytes."""
    if layout == "linear":
        s3 = _as_3d(scales)
        return linear_scale_addressing(s3.stride(0), s3.stride(1))
    return swizzled_scale_addressing(scales.stride(0) if scales.dim() == 2 else 0, cols)


class QuantizePlan(NamedTuple):
    """One quantize or dequantize launch as the table chose it: the spec, its case, configuration and target."""

    spec: Any
    case: QuantizeCase | DequantizeCase
    config: QuantizeConfig | None
    target: Target


class KeptQuantize(KeptLaunch):
    """A quantize or dequantize plan kept for its metadata (``ops``' cache): the first call launches through
    Triton's JIT; on CUDA (Triton 3.6) later calls launch the compiled kernel on the operands' addresses
    (``ops.KeptLaunch``).  The reference runs ``spec.launch`` on every call.

    ``first``: the amax kernel's launch (``kernels/amax.py``), kept the same way and run before this one, where
    the quantization takes a global scale chosen per call (``QuantizeCase.amax_partials``); else None."""

    __slots__ = ("plan", "first")

    def __init__(self, plan: QuantizePlan, fields: dict[str, int], device: torch.device,
                 first: QuantizePlan | None = None):
        # The JIT launches on the current device's stream: so does the kept launch (that device is keyed).
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(plan, fields, device, DIRECT_LAUNCH)
        self.plan = plan
        self.first = None if first is None else KeptLaunch(first, fields, device, DIRECT_LAUNCH)

    @property
    def amax_partials(self) -> int:
        """The int32 partial maxima the launches take (``partials``, the addresses' last), 0 for none."""
        return getattr(self.plan.case, "amax_partials", 0)

    @property
    def launches_by_address(self) -> bool:
        """Whether :meth:`launch_at` can run this call: every kernel of it compiled and launched directly."""
        return self._compiled is not None and (self.first is None or self.first._compiled is not None)

    def _launch(self, addresses: tuple) -> None:
        """Both compiled kernels in order (``launch_at``'s), on the current stream."""
        if self.first is not None:
            self.first._launch(addresses)
        super()._launch(addresses)

    def run(self, operands: QuantizeOperands | DequantizeOperands, addresses: tuple[int, ...]) -> None:
        if self._template is None:
            self.plan.spec.launch(operands, self.plan.config, self.plan.target)
        elif self.launches_by_address:
            self._launch(addresses)
        else:
            for launch in (self.first, self):
                if launch is not None:
                    launch._launch_jit(operands)


# Operand name -> index in the addresses a kept launch is given.
_QUANTIZE_FIELDS = {"x_words": 0, "data": 1, "scales": 2, "global_scale": 3, "partials": 4}
_DEQUANTIZE_FIELDS = {"data": 0, "scales": 1, "global_scale": 2, "out_words": 3}


def _kept(op: str, case, target: Target, config: QuantizeConfig | None, aligned: tuple[int, ...],
          kernels: tuple, fields: dict[str, int], device: torch.device) -> KeptQuantize:
    """The kept plan of ``case`` (the table's choice, ``config`` resolved), made on the first call of its metadata:
    the case, target, configuration and operands' address alignments (what the JIT specializes on)."""
    where = torch.cuda.current_device() if device.type == "cuda" else None
    key = (op, case, target, type(config), config, aligned, device, where)
    kept = kept_call(key)
    if kept is None:
        spec = choose_kernel(case, target, None, kernels)
        # A tile configures the kernels; the reference (no configuration) computes the same bytes without one.
        plan = QuantizePlan(spec, case, spec.resolve_config(config if spec.config_type else None, case, target),
                            target)
        first = None
        if getattr(case, "amax_partials", 0):  # a per-call global scale: the amax kernel's launch first
            first = QuantizePlan(choose_kernel(case, target, None, QUANTIZE_AMAX_KERNELS), case, None, target)
        kept = keep_call(key, KeptQuantize(plan, fields, device, first))
    return kept


def _quantize_into(x: torch.Tensor, fmt: formats.FP4Format, layout: str, g: torch.Tensor | str | None,
                   config: QuantizeConfig | None, target: Target) -> tuple[torch.Tensor, torch.Tensor,
                                                                           torch.Tensor | None]:
    """(packed bytes, scale bytes, global scale) of checked ``x``, through the table's kept plan."""
    kept, operands, addresses = _quantize_call(x, fmt, layout, g, config, target)
    kept.run(operands, addresses)
    return operands.data, operands.scales, operands.global_scale


def _quantize_call(x: torch.Tensor, fmt: formats.FP4Format, layout: str, g: torch.Tensor | str | None,
                   config: QuantizeConfig | None, target: Target) -> tuple[KeptQuantize, QuantizeOperands, tuple]:
    """The kept plan that quantizes checked ``x`` into new packed bytes and scale bytes, its operands and their
    addresses (``_QUANTIZE_FIELDS``' order).  ``g``: the global scale tensor, None, or ``"pow2"`` where the
    kernels compute it (:func:`scale_on_device`) into a new fp32 tensor, through new int32 partials."""
    *batch, rows, k = x.shape
    cols = k // fmt.block_size
    words = x  # what the kernel reads: x as pair words (the reference reads x)
    if target.runs_triton:
        if x.stride(-1) != 1:
            x = x.contiguous()
        if x.dtype == torch.float64:
            x = x.to(torch.float32)  # formats.quantize rounds float64 to float32 first too
        try:
            words = _pairs(x)
        except RuntimeError:  # an odd row stride or offset: the pairs need an even-aligned copy
            x = x.contiguous()
            words = _pairs(x)
    data = torch.empty((*batch, rows, k // 2), dtype=torch.uint8, device=x.device)
    if layout == "linear":
        scales = torch.empty((*batch, rows, cols), dtype=torch.uint8, device=x.device)
    else:
        rows_p, cols_p = layouts.padded_scale_shape(rows, cols)
        padded = rows_p != rows or cols_p != cols
        # Padding scales must be zero; the kernel writes only the real ones.
        scales = (torch.zeros if padded else torch.empty)((*batch, rows_p * cols_p), dtype=torch.uint8,
                                                          device=x.device)
    w3, d3 = _as_3d(words), _as_3d(data)
    partials = None
    if isinstance(g, str):
        partials = torch.empty(amax_partials(w3.shape[0], rows, k // 2), dtype=torch.int32, device=x.device)
        g = torch.empty((), dtype=torch.float32, device=x.device)
    case = QuantizeCase(fmt, w3.shape[0], rows, k, x.dtype, (w3.stride(0), w3.stride(1)), (d3.stride(0), d3.stride(1)),
                        layout, _scale_addressing(scales, layout, cols), g is not None,
                        0 if partials is None else partials.numel())
    addresses = (words.data_ptr(), data.data_ptr(), scales.data_ptr(), 0 if g is None else g.data_ptr(),
                 0 if partials is None else partials.data_ptr())
    kept = _kept("quantize", case, target, config, tuple(a & 15 for a in addresses), QUANTIZE_KERNELS,
                 _QUANTIZE_FIELDS, x.device)
    return kept, QuantizeOperands(case, x, words, data, scales, g, partials), addresses


def prepare_quantize(x: torch.Tensor, fmt: str | formats.FP4Format, scale_layout: ScaleLayout = "linear",
                     global_scale: torch.Tensor | Literal["pow2"] | None = None) -> KeptQuantize | None:
    """The kept launch that ``quantize(x, fmt, scale_layout, global_scale, check_values=False)`` runs for x's
    metadata (validated and planned when new), for callers that launch it on addresses: its
    :meth:`~KeptQuantize.launch_at` takes ``(x, data, scales, global_scale, partials)`` addresses, ``data`` and
    ``scales`` new contiguous uint8 tensors of the result's shapes (:func:`quantize`'s).  With a global scale
    tensor, its address; with none, 0; with ``"pow2"``, the address of a new 0-d float32 tensor that the kernels
    write the scale into (the result's global scale), and ``partials`` that of a new int32 tensor of
    :attr:`~KeptQuantize.amax_partials` elements (the amax kernel's partial maxima; 0 where that is 0).  Two
    launches then, the amax kernel's and the quantize kernel's, both on addresses.  None where x is not read in
    place (float64, a stride along K, an odd row offset: quantize copies it first).  Raises as quantize does."""
    resolved = check_quantize_arguments(x, fmt, scale_layout, "auto", None)
    target = _resolve_backend("auto", x.device)
    g = "pow2" if scale_on_device(global_scale, resolved, target) else global_scale_tensor(global_scale, resolved,
                                                                                             x, False)
    kept, operands, _ = _quantize_call(x, resolved, scale_layout, g, None, target)
    if operands.x is not x or operands.x_words.data_ptr() != x.data_ptr():
        return None
    return kept


def check_quantize_arguments(x, fmt, scale_layout: str, backend: str, config) -> formats.FP4Format:
    """The checks of :func:`quantize` that read metadata only (eager calls and ``torch.compile`` share them);
    the resolved format."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x: expected dtype float16 or bfloat16 or float32 or float64, got {x.dtype}")
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected shape [R, K] or [L, R, K], got {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"x: expected sizes >= 1, got shape {tuple(x.shape)}")
    check_device_with_values("x", x.device)
    fmt = formats.resolve_format(fmt)
    if x.shape[-1] % fmt.block_size:
        raise ValueError(
            f"x: expected K a multiple of the {fmt.name} block size {fmt.block_size}, got K = {x.shape[-1]}"
        )
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout: expected 'linear' or 'swizzled', got {scale_layout!r}")
    _resolve_backend(backend, x.device)
    _check_config(config)
    return fmt


def quantize(
    x: torch.Tensor,
    fmt: str | formats.FP4Format = "nvfp4",
    scale_layout: ScaleLayout = "linear",
    global_scale: float | torch.Tensor | Literal["auto", "pow2"] | None = None,
    *,
    backend: QuantizeBackend = "auto",
    check_values: bool = True,
    config: QuantizeConfig | None = None,
) -> FP4Tensor:
    """Quantize floats ``[R, K]`` or ``[L, R, K]`` to an :class:`FP4Tensor` (NVFP4: e4m3 scale per 16 elements;
    MXFP4: e8m0 per 32).

    The bytes are ``formats.quantize``'s, which documents each rounding: NVFP4 as NVIDIA ModelOpt's
    ``NVFP4QTensor`` computes it (block scale ``e4m3(amax / (6 g))``, elements ``x / (scale * g)`` rounded
    to nearest-even e2m1, saturating at ±6), MXFP4 per the OCP Microscaling spec v1.0 (shared exponent
    ``floor(log2(amax)) - 2``, elements ``x / 2^X`` likewise).  compressed-tensors' NVFP4 recipe stores the
    reciprocal, ``weight_global_scale = 6 * 448 / amax`` (a divisor), multiplies by it rather than dividing
    by ``g`` and gives all-zero blocks scale 0.125, so its bytes can differ from these in rare roundings.

    Args:
        x: float32, float16, bfloat16 (or float64, rounded to float32 first: a copy), any strides with stride 1
            along K (otherwise copied); K a multiple of the block size.  Rows and batches are independent.
        fmt: ``"nvfp4"`` or ``"mxfp4"`` (or an ``FP4Format``).
        scale_layout: ``"linear"`` ``[L?, R, K/bs]`` or ``"swizzled"`` (the 128x4 layout, written directly
            by the kernel; padding zero).
        global_scale: None; ``"auto"`` (NVFP4 only: ModelOpt's ``amax(|x|) / (6 * 448)``, see
            :func:`nvfp4_global_scale`; one extra read of ``x``); ``"pow2"`` (NVFP4 only:
            ``per_tensor_scale(amax(|x|))``, that quotient rounded up to a power of two, see
            :func:`per_tensor_scale`: 1 where x is all zeros or holds a NaN or infinity, subnormal for a tiny
            amax; on a Triton target computed on the device by one extra kernel, ``kernels/amax.py``'s partial
            maxima, which the quantize kernel reduces: no torch ops, no synchronisation, CUDA graphs alike; the
            CPU path computes it with torch); a Python number (rounded to float32); or a one-element float32
            tensor on x's device.  A number or tensor must be a positive normal float32.  NVFP4 divides by
            ``scale * g``; MXFP4 divides ``x`` by ``g`` before choosing its exponents.  The result carries it.
            NVFP4 without one saturates silently: its e4m3 block scales reach 448 at most and 2^-9 at least,
            so magnitudes above 6 * 448 = 2688 become ±2688 and blocks whose largest magnitude is below
            about 6 * 2^-9 lose precision, down to zero (1e-6 becomes 0).  Pass ``"auto"`` (or a scale
            near ``amax / 2688``) for data outside that range, such as activations.
        backend: ``"auto"`` (the Triton kernel on CUDA, ``formats.quantize`` elsewhere), ``"triton"`` (also on
            CPU tensors under ``TRITON_INTERPRET=1``) or ``"reference"``.
        check_values: raise ValueError when ``x`` holds a NaN or infinity, and check a tensor global scale's
            value.  Each costs a device synchronisation (the finiteness is read back from the scale bytes after
            the kernel, no extra pass over ``x``); pass False inside CUDA graphs.  Unchecked, a block holding
            a NaN or infinity gets the NaN scale byte and dequantizes to NaN.
        config: the kernel's tile (``kernels.quantize.QuantizeConfig``); None picks one.

    Returns a new FP4Tensor on x's device (data uint8 ``[L?, R, K/2]``, element 2i in the low nibble).
    Raises TypeError / ValueError naming the argument, the expected and the actual.
    """
    fmt = check_quantize_arguments(x, fmt, scale_layout, backend, config)
    target = _resolve_backend(backend, x.device)
    g = "pow2" if scale_on_device(global_scale, fmt, target) else global_scale_tensor(global_scale, fmt, x,
                                                                                        check_values)
    with torch.no_grad():  # quantized bytes carry no gradient on any backend
        data, scales, g = _quantize_into(x, fmt, scale_layout, g, config, target)
    if check_values and bool((scales == formats.NAN_SCALE_BYTE[fmt.name]).any()):
        where = "x / global_scale" if fmt.name == "mxfp4" and g is not None else "x"
        raise ValueError(f"{where}: expected finite values (NaN and infinity have no FP4 encoding)")
    return FP4Tensor(data, scales, fmt, scale_layout, g)


def dequantize(
    t: FP4Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    backend: QuantizeBackend = "auto",
    config: QuantizeConfig | None = None,
) -> torch.Tensor:
    """Values ``[L?, R, K]`` of ``t`` in ``dtype``: each exact value ``e2m1 * scale (* global)`` rounded once.

    float64 is the exact value itself (the CPU path on any device).  For float32, float16 and bfloat16,
    ``backend="auto"`` runs the Triton kernel on CUDA (for prefill: dequantize, then ``F.linear``) and
    ``formats.dequantize`` elsewhere; both give the same bits (nearest even, ``formats.round_from_float64``).
    ``"triton"`` also runs on CPU tensors under ``TRITON_INTERPRET=1``; ``config``: the kernel's tile (None
    picks one).  Returns a new contiguous tensor, outside autograd on every backend (an FP4 tensor is frozen).
    Codes in any order (``FP4Tensor.code_order``) are read as they lie by the kernel; the CPU path first puts
    them back in the checkpoint's (``formats.reorder_codes``: a copy of the packed bytes).
    """
    if not isinstance(t, FP4Tensor):
        raise TypeError(f"t: expected an FP4Tensor, got {type(t).__name__}")
    if dtype not in (*_OUTPUT_DTYPES, torch.float64):
        raise TypeError(f"dtype: expected float32, float16, bfloat16 or float64, got {dtype}")
    target = _resolve_backend(backend, t.device)
    _check_config(config)
    cols = t.k // t.fmt.block_size
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    out_words = out if dtype == torch.float64 else _pairs(out)  # the kernel writes pair words
    o3, d3 = _as_3d(out_words), _as_3d(t.data)
    g = t.global_scale
    case = DequantizeCase(t.fmt, d3.shape[0], t.rows, t.k, (d3.stride(0), d3.stride(1)), t.scale_layout,
                          _scale_addressing(t.scales, t.scale_layout, cols), g is not None, dtype,
                          (o3.stride(0), o3.stride(1)), t.code_order)
    addresses = (t.data.data_ptr(), t.scales.data_ptr(), 0 if g is None else g.data_ptr(), out_words.data_ptr())
    kept = _kept("dequantize", case, target, config, tuple(a & 15 for a in addresses), DEQUANTIZE_KERNELS,
                 _DEQUANTIZE_FIELDS, t.device)
    with torch.no_grad():  # the FP4 tensor is frozen: no graph to its global scale, as from the kernel
        kept.run(DequantizeOperands(case, t.data, t.scales, g, out, out_words), addresses)
    return out
