"""``FP4Tensor``: a block-scaled FP4 tensor ``[L?, R, K]`` as the kernels read it.

The container holds bytes exactly as they sit in memory (nothing is repacked on construction), so a
tensor built from another library's buffers, or from the GPU MODE task's operands, costs no copy:

* ``data``: uint8 ``[L?, R, K/2]``, two e2m1 codes per byte, element 2i in the low nibble, stride 1 along K.
* ``scales``: one byte per block of ``fmt.block_size`` K-elements (NVFP4: e4m3 per 16; MXFP4: e8m0 per 32),
  in one of two layouts (``fp4gemv.layouts``): ``"linear"`` ``[L?, R, K/bs]``, or ``"swizzled"``
  ``[L?, R_p * C_p]``, the 128x4 cuBLAS/CUTLASS swizzle with rows padded to 128 and scale columns to 4.
* ``global_scale``: an optional fp32 scalar that multiplies every value (NVFP4's per-tensor scale).
* ``code_order``: how the codes sit in the bytes (``formats.CODE_ORDERS``): ``"checkpoint"`` as above;
  ``"native"``, the bits of each 16-bit half-word permuted for the tensor-core kernels' shorter decode; or
  ``"paired"``, the native bits with each 32-bit word's even K elements in its low half-word and odd ones in its
  high half-word (the mma.sync step then pairs the activation as loaded; the dense kernels of that step,
  engine and weight_only, the general kernel with fp16, bf16 or fp32 activations, and the references read it)
  (``formats.reorder_codes``; ``with_code_order`` converts).  Kernels that do not decode an order refuse it by
  name.

Value of element ``(l, r, k)``: ``e2m1(code) * scale(l, r, k // bs) * global_scale``.  The container calls
no op: ``fp4gemv.quantize`` makes one from floats, ``fp4gemv.dequantize`` turns one back into floats.
"""

from __future__ import annotations

from typing import Literal

import torch

from . import formats, layouts
from .formats import dtype_name as _dtype_name

__all__ = ["FP4Tensor", "ScaleLayout", "SCALE_LAYOUTS", "checked_global_scale", "check_device_with_values"]

ScaleLayout = Literal["linear", "swizzled"]
SCALE_LAYOUTS: tuple[str, ...] = ("linear", "swizzled")
_DATA_DTYPES = (torch.uint8, torch.float4_e2m1fn_x2)


def _check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = " or ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {names}, got {_dtype_name(t.dtype)}")


def check_device_with_values(name: str, device: torch.device) -> None:
    """ValueError naming ``name`` unless ``device`` is one whose tensors the ops compute on and read back: the
    CPU or CUDA (a meta tensor has no values; other devices have no kernels and no float64 reference)."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a tensor with values, on cpu or cuda, got device {device}")


def checked_global_scale(global_scale: float | torch.Tensor | None, device: torch.device, check_values: bool,
                         owner: str = "data") -> torch.Tensor | None:
    """A global scale as a 0-d float32 tensor on ``device`` (where ``owner`` lies), or None: a Python number is
    rounded to float32 and checked (``formats.check_global_scales``); a one-element float32 tensor is kept as it
    is (reshaped) and its value checked only with ``check_values`` (reading it synchronises the device)."""
    if global_scale is None:
        return None
    if isinstance(global_scale, bool) or not isinstance(global_scale, (int, float, torch.Tensor)):
        raise TypeError(f"global_scale: expected None, a number or a float32 tensor, got "
                        f"{type(global_scale).__name__}")
    if not isinstance(global_scale, torch.Tensor):
        g = torch.tensor(float(global_scale), dtype=torch.float32)
        formats.check_global_scales(g)
        return g.to(device)
    _check_tensor("global_scale", global_scale, (torch.float32,))
    if global_scale.numel() != 1:
        raise ValueError(f"global_scale: expected one value, got shape {tuple(global_scale.shape)}")
    if global_scale.device != device:
        raise ValueError(f"global_scale: expected device {device} like {owner}, got {global_scale.device}")
    if check_values:
        formats.check_global_scales(global_scale)
    return global_scale.reshape(())


class FP4Tensor:
    """A quantized tensor ``[L?, R, K]``: packed e2m1 data, block scales, optional fp32 global scale.

    Args:
        data: uint8 (or float4_e2m1fn_x2) ``[R, K/2]`` or ``[L, R, K/2]``, stride 1 along K/2; R, L >= 1.
        scales: uint8 (or the format's float8 dtype) block scales on data's device, stride 1 along the last
            dimension: ``[L?, R, K/bs]`` for ``"linear"``, ``[L?, R_p * C_p]`` for ``"swizzled"`` (R_p = R
            rounded up to 128, C_p = K/bs rounded up to 4; see ``layouts.swizzle_scales``).
        fmt: ``"nvfp4"`` (e4m3 scale per 16 elements) or ``"mxfp4"`` (e8m0 scale per 32); K must be a
            multiple of the block size.
        scale_layout: ``"linear"`` or ``"swizzled"``.
        global_scale: None, a Python number (stored as fp32) or a one-element float32 tensor on data's device;
            a positive normal float32 (as ``quantize`` requires): a number is always checked, a tensor's value
            only with ``check_values=True`` (reading it synchronises the device, and the op layer builds
            FP4Tensors on every call).
        code_order: ``"checkpoint"`` (element 2i in the low nibble of byte i) or ``"native"``
            (``formats.reorder_codes``): what the bytes of ``data`` hold.

    Tensors are kept as given (viewed as uint8, never copied); the attributes cannot be rebound afterwards.
    Raises TypeError / ValueError naming the argument, the expected and the actual.
    """

    __slots__ = ("data", "scales", "fmt", "scale_layout", "global_scale", "code_order")

    def __init__(
        self,
        data: torch.Tensor,
        scales: torch.Tensor,
        fmt: str | formats.FP4Format = "nvfp4",
        scale_layout: ScaleLayout = "linear",
        global_scale: float | torch.Tensor | None = None,
        code_order: str = "checkpoint",
        *,
        check_values: bool = False,
    ) -> None:
        fmt = formats.resolve_format(fmt)
        _check_tensor("data", data, _DATA_DTYPES)
        if data.dim() not in (2, 3) or min(data.shape) < 1:
            raise ValueError(f"data: expected shape [R, K/2] or [L, R, K/2] with sizes >= 1, got {tuple(data.shape)}")
        if data.stride(-1) != 1:
            raise ValueError(f"data: expected stride 1 along K/2 (packed along K), got strides {tuple(data.stride())}")
        k = 2 * data.shape[-1]
        if k % fmt.block_size:
            raise ValueError(
                f"data: expected K = 2 * data.shape[-1] to be a multiple of the {fmt.name} block size "
                f"{fmt.block_size}, got K = {k}"
            )
        if scale_layout not in SCALE_LAYOUTS:
            raise ValueError(f"scale_layout: expected 'linear' or 'swizzled', got {scale_layout!r}")
        if code_order not in formats.CODE_ORDERS:
            raise ValueError(f"code_order: expected one of {formats.CODE_ORDERS}, got {code_order!r}")
        _check_tensor("scales", scales, (torch.uint8, fmt.scale_dtype))
        *batch, rows, _ = data.shape
        cols = k // fmt.block_size
        if scale_layout == "linear":
            expected = (*batch, rows, cols)
        else:
            rows_p, cols_p = layouts.padded_scale_shape(rows, cols)
            expected = (*batch, rows_p * cols_p)
        if tuple(scales.shape) != expected:
            raise ValueError(
                f"scales: expected shape {expected} for {scale_layout} {fmt.name} scales of {rows} rows, K = {k}, "
                f"got {tuple(scales.shape)}"
            )
        if scales.stride(-1) != 1:
            raise ValueError(
                f"scales: expected stride 1 along the last dimension, got strides {tuple(scales.stride())}"
            )
        if scales.device != data.device:
            raise ValueError(f"scales: expected device {data.device} like data, got {scales.device}")
        # Attributes are set once: what was checked here stays true (the op layer's cache relies on it).
        init = object.__setattr__
        init(self, "data", formats.as_uint8(data))
        init(self, "scales", formats.as_uint8(scales))
        init(self, "fmt", fmt)
        init(self, "scale_layout", scale_layout)
        init(self, "global_scale", checked_global_scale(global_scale, data.device, check_values))
        init(self, "code_order", code_order)

    def __setattr__(self, name, value):
        raise AttributeError(f"FP4Tensor is immutable: make a new one instead of setting {name!r}")

    # --- shape ---------------------------------------------------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        """The logical shape ``[L?, R, K]`` (K counts elements, not bytes)."""
        return torch.Size((*self.data.shape[:-1], 2 * self.data.shape[-1]))

    @property
    def ndim(self) -> int:
        return self.data.dim()

    @property
    def rows(self) -> int:
        return self.data.shape[-2]

    @property
    def k(self) -> int:
        return 2 * self.data.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __reduce__(self) -> tuple:
        # Rebuilt through the constructor from plain tensors and strings, so that
        # ``torch.load(weights_only=True)`` can load it once the class is allowlisted (below) and a
        # loaded tensor is validated like a constructed one.
        return (FP4Tensor, (self.data, self.scales, self.fmt.name, self.scale_layout, self.global_scale,
                            self.code_order))

    def __repr__(self) -> str:
        g = self.global_scale
        gs = "None" if g is None else "(meta)" if g.device.type == "meta" else f"{g.item():g}"
        return (
            f"FP4Tensor(shape={tuple(self.shape)}, fmt={self.fmt.name!r}, scale_layout={self.scale_layout!r}, "
            f"global_scale={gs}, device={self.device}"
            + (f", code_order={self.code_order!r})" if self.code_order != "checkpoint" else ")")
        )

    # --- conversions ---------------------------------------------------------------------------------------

    def linear_scales(self) -> torch.Tensor:
        """Scale bytes ``[L?, R, K/bs]`` (the stored tensor when linear, an unswizzled copy otherwise)."""
        if self.scale_layout == "linear":
            return self.scales
        return layouts.unswizzle_scales(self.scales, self.rows, self.k // self.fmt.block_size)

    def with_scale_layout(self, scale_layout: ScaleLayout) -> FP4Tensor:
        """The same values with scales in ``scale_layout`` (this tensor when already so; else a scale copy)."""
        if scale_layout not in SCALE_LAYOUTS:
            raise ValueError(f"scale_layout: expected 'linear' or 'swizzled', got {scale_layout!r}")
        if scale_layout == self.scale_layout:
            return self
        scales = layouts.swizzle_scales(self.scales) if scale_layout == "swizzled" else self.linear_scales()
        return FP4Tensor(self.data, scales, self.fmt, scale_layout, self.global_scale, self.code_order)

    def with_code_order(self, code_order: str) -> FP4Tensor:
        """The same values with codes in ``code_order`` (``formats.CODE_ORDERS``): this tensor when already so,
        else one with a reordered copy of the data (``formats.reorder_codes``) and the same scales."""
        if code_order not in formats.CODE_ORDERS:
            raise ValueError(f"code_order: expected one of {formats.CODE_ORDERS}, got {code_order!r}")
        if code_order == self.code_order:
            return self
        data = formats.reorder_codes(self.data, self.code_order, code_order)
        return FP4Tensor(data, self.scales, self.fmt, self.scale_layout, self.global_scale, code_order)

    def to(self, device: str | torch.device) -> FP4Tensor:
        """A copy on ``device`` (or this tensor when already there); bytes are copied as they are.  ValueError /
        TypeError naming ``device`` for a device this machine lacks or a dtype (``fp4gemv.dequantize`` gives
        floats)."""
        if isinstance(device, torch.dtype):
            raise TypeError(f"device: expected a device (the bytes move as they are; fp4gemv.dequantize(t, dtype) "
                            f"gives floats), got {device}")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device: expected a torch.device or a name such as 'cpu' or 'cuda', got {device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: expected a device this machine has, got {device} "
                             f"(torch.cuda.is_available() is False)")
        if device == self.device:
            return self
        gs = None if self.global_scale is None else self.global_scale.to(device)
        return FP4Tensor(self.data.to(device), self.scales.to(device), self.fmt, self.scale_layout, gs,
                         self.code_order)

    def first_rows(self, n: int) -> FP4Tensor:
        """The first ``n`` rows, without a copy.

        Swizzled scales keep their whole first ``ceil(n / 128)`` row tiles: row tiles are outermost in the
        swizzle, so those bytes are exactly the swizzled scales of an ``n``-row tensor.
        """
        if not 1 <= n <= self.rows:
            raise ValueError(f"n: expected 1 <= n <= {self.rows} rows, got {n}")
        if self.scale_layout == "linear":
            scales = self.scales[..., :n, :]
        else:
            rows_p, cols_p = layouts.padded_scale_shape(n, self.k // self.fmt.block_size)
            scales = self.scales[..., : rows_p * cols_p]
        return FP4Tensor(self.data[..., :n, :], scales, self.fmt, self.scale_layout, self.global_scale,
                         self.code_order)

    # --- constructors --------------------------------------------------------------------------------------

    @classmethod
    def from_task(
        cls,
        operand: torch.Tensor,
        sf_permuted: torch.Tensor,
        fmt: str | formats.FP4Format = "nvfp4",
        *,
        names: tuple[str, str] = ("operand", "sf_permuted"),
    ) -> FP4Tensor:
        """Zero-copy views of a GPU MODE task operand: ``a`` (or ``b``) with its ``sfa`` (``sfb``) permuted scales.

        operand: ``[R, K/2, L]`` float4_e2m1fn_x2 or uint8, stride 1 along K/2 (the task's
            ``permute(1, 2, 0)`` of a contiguous ``[L, R, K/2]``); becomes data ``[L, R, K/2]``.
        sf_permuted: the task's ``(32, 4, R_p/128, 4, C_p/4, L)`` view of swizzled scale bytes
            (``layouts.task_permuted_view``); becomes the swizzled scales ``[L, R_p * C_p]`` behind it.
        names: what errors call the two arguments (the task's own names, e.g. ``("a", "sfa_permuted")``).
        Raises ValueError when either is not a view of the expected memory (a copy per call would hide a
        slow path).
        """
        name, sf_name = names
        _check_tensor(name, operand, _DATA_DTYPES)
        if operand.dim() != 3:
            raise ValueError(f"{name}: expected 3 dims [R, K/2, L], got shape {tuple(operand.shape)}")
        if operand.stride(1) != 1:
            raise ValueError(f"{name}: expected stride 1 along K/2, got strides {tuple(operand.stride())}")
        fmt = formats.resolve_format(fmt)
        _check_tensor(sf_name, sf_permuted, (torch.uint8, fmt.scale_dtype))
        rows, k_half, batch = operand.shape
        if (2 * k_half) % fmt.block_size:
            raise ValueError(f"{name}: expected K = 2 * {name}.shape[1] a multiple of the {fmt.name} block size "
                             f"{fmt.block_size}, got K = {2 * k_half}")
        swizzled = layouts.checked_task_scales(
            sf_name, formats.as_uint8(sf_permuted), rows, 2 * k_half, fmt.block_size, batch
        )
        return cls(formats.as_uint8(operand).permute(2, 0, 1), swizzled, fmt, "swizzled")


# torch.load(weights_only=True) calls only allowlisted classes; FP4Tensor.__reduce__ hands it plain tensors.
torch.serialization.add_safe_globals([FP4Tensor])
