"""The GPU MODE ``nvfp4_gemv`` task interface: inputs, reference, check, and our submission.

The task hands ``custom_kernel`` a 7-tuple ``(a, b, sfa, sfb, sfa_permuted, sfb_permuted, c)``:

==============  ===========================  ================  =======  =============================================
item            shape                        dtype             device   memory
==============  ===========================  ================  =======  =============================================
a               [M, K/2, L]                  float4_e2m1fn_x2  compute  permute(1,2,0) of contiguous (L, M, K/2)
b               [128, K/2, L]                float4_e2m1fn_x2  compute  as a, with 128 rows; only row 0 is used
sfa             [M, K/16, L]                 float8_e4m3fn     CPU      permute(1,2,0) of contiguous (L, M, K/16)
sfb             [128, K/16, L]               float8_e4m3fn     CPU      as sfa, with 128 rows
sfa_permuted    [32, 4, M/128, 4, K/64, L]   float8_e4m3fn     compute  ``layouts.task_permuted_view`` of the swizzle
sfb_permuted    [32, 4, 1, 4, K/64, L]       float8_e4m3fn     compute  as sfa_permuted, with 128 rows
c               [M, 1, L]                    float16           compute  permute(1,2,0) of contiguous (L, M, 1)
==============  ===========================  ================  =======  =============================================

and expects ``c[m, 0, l] = fp16(sum_k a[m, k, l] * sfa[m, k // 16, l] * b[0, k, l] * sfb[0, k // 16, l])``,
matched with ``torch.allclose`` semantics at rtol = atol = 1e-3.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import NamedTuple

import torch

from . import formats, layouts, ops, reference
from .tensor import FP4Tensor

__all__ = [
    "TaskInput",
    "TaskShape",
    "TEST_SHAPES",
    "BENCHMARK_SHAPES",
    "B_ROWS",
    "RTOL",
    "ATOL",
    "resolve_device",
    "generate_input",
    "generate_full_range_input",
    "reference_output",
    "ref_kernel",
    "Comparison",
    "compare_to_reference",
    "check_implementation",
    "custom_kernel",
    "task_views",
]

TaskInput = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

# The task stores b with 128 rows (one MMA tile of N) although only row 0 takes part in the product.
B_ROWS = 128
RTOL = 1e-3
ATOL = 1e-3


class TaskShape(NamedTuple):
    """One task problem: ``c[M, 1, L] = a[M, K, L] @ b[0, K, L]``."""

    m: int
    k: int
    l: int  # noqa: E741 -- the task's own name for the batch dimension

    def __str__(self) -> str:
        return f"m={self.m} k={self.k} l={self.l}"


def _load_shapes() -> dict[str, tuple[TaskShape, ...]]:
    text = resources.files("fp4gemv").joinpath("data/task_shapes.json").read_text()
    raw = json.loads(text)
    return {kind: tuple(TaskShape(*shape) for shape in raw[kind]) for kind in ("test", "benchmark")}


_SHAPES = _load_shapes()
TEST_SHAPES: tuple[TaskShape, ...] = _SHAPES["test"]
BENCHMARK_SHAPES: tuple[TaskShape, ...] = _SHAPES["benchmark"]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` means CUDA when a GPU is present, else the CPU (so the whole task runs on CPU-only CI); "cpu" and
    "cuda" (or "cuda:i") name themselves.  ValueError naming ``device`` for any other, or for CUDA without a GPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {str(device)!r}")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: expected 'cpu', or 'cuda' on a machine with a CUDA GPU, got {str(device)!r} "
                             f"(torch.cuda.is_available() is False)")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device: expected a CUDA device index below {torch.cuda.device_count()}, got "
                             f"{str(device)!r}")
    return resolved


def _check_task_shape(m: int, k: int, l: int) -> None:  # noqa: E741
    if m <= 0 or m % 128:
        raise ValueError(f"m: expected a positive multiple of 128, got {m}")
    if k <= 0 or k % 64:
        raise ValueError(f"k: expected a positive multiple of 64, got {k}")
    if l <= 0:
        raise ValueError(f"l: expected a positive batch count, got {l}")


def _assemble(
    a_bytes: torch.Tensor,
    b_bytes: torch.Tensor,
    sfa_linear: torch.Tensor,
    sfb_linear: torch.Tensor,
    c: torch.Tensor,
    device: torch.device,
) -> TaskInput:
    """Lay batch-major CPU tensors ``[L, rows, ...]`` out exactly as the task does."""
    L, m, k_packed = a_bytes.shape
    scale_cols = sfa_linear.shape[-1]
    # Bytes travel as uint8 and become fp4 on the device: a plain byte copy, whatever fp4 support .to() has.
    a = a_bytes.to(device).view(torch.float4_e2m1fn_x2).permute(1, 2, 0)
    b = b_bytes.to(device).view(torch.float4_e2m1fn_x2).permute(1, 2, 0)
    sfa_permuted = layouts.task_permuted_view(layouts.swizzle_scales(sfa_linear).to(device), m, scale_cols)
    sfb_permuted = layouts.task_permuted_view(layouts.swizzle_scales(sfb_linear).to(device), B_ROWS, scale_cols)
    return (
        a,
        b,
        sfa_linear.permute(1, 2, 0),
        sfb_linear.permute(1, 2, 0),
        sfa_permuted,
        sfb_permuted,
        c.to(device).permute(1, 2, 0),
    )


def generate_input(m: int, k: int, l: int, seed: int, device: str | torch.device | None = None) -> TaskInput:  # noqa: E741
    """The task's 7-tuple for shape (m, k, l), drawn from the task's public distribution.

    a and b bytes are uniform in 0..3 (codes 0..3 in the low nibble, values 0, 0.5, 1, 1.5; high nibble 0),
    scales are the numbers 0.0, 1.0, 2.0 (uniform) converted to float8_e4m3fn, c is standard normal in fp16.
    Deterministic for a given seed: everything is drawn on the CPU, then moved to ``device`` (``None``: CUDA
    when available, else CPU).  sfa and sfb stay on the CPU, as in the task.
    """
    _check_task_shape(m, k, l)
    device = resolve_device(device)
    gen = torch.Generator().manual_seed(seed)
    a_bytes = torch.randint(0, 4, (l, m, k // 2), dtype=torch.uint8, generator=gen)
    b_bytes = torch.randint(0, 4, (l, B_ROWS, k // 2), dtype=torch.uint8, generator=gen)
    sfa = torch.randint(0, 3, (l, m, k // 16), generator=gen).to(torch.float8_e4m3fn)
    sfb = torch.randint(0, 3, (l, B_ROWS, k // 16), generator=gen).to(torch.float8_e4m3fn)
    c = torch.randn((l, m, 1), generator=gen).to(torch.float16)
    return _assemble(a_bytes, b_bytes, sfa, sfb, c, device)


# Full-range scales.  Real NVFP4 weights use e4m3's whole range (the per-tensor global scale maps the
# largest block scale to 448), so both sides must see every exponent field, 2^-9 (smallest subnormal) to
# 2^8.  Products of two such scales would overflow fp16, so the two are drawn together per 16-element
# block: in most blocks ("paired") b's row-0 exponent is uniform in -9 .. 3 and a's is its negation plus a
# jitter, so their product is 2^-10 .. 2^-4; in 1 block in 16 b's exponent is uniform over the whole range
# ("b-wide"; a's follows as in paired blocks, clamped at 2^-9), and in 1 in 16 a's exponent is, per row,
# with b's at 2^-9 ("a-wide").  Products never exceed about 2^-1 and outputs are units to hundreds.  Larger
# outputs would let the fp32 rounding of a correct kernel's accumulation (about 2^-24 of the partial sums,
# times sqrt(K)) reach the task's atol = 1e-3 on outputs that cancel to near zero.  Measured on TEST_SHAPES
# (3 seeds): a strictly sequential fp32 sum is off the exact sum by at most 1.5e-4; with every block wide,
# by up to 7e-4.
_E4M3_EXPONENTS = (-9, 8)
_PAIRED_B_EXPONENTS = (-9, 3)
_FULL_RANGE_JITTER = (-10, -4)
_FULL_RANGE_WIDE = 1 / 8  # half a-wide, half b-wide
_FULL_RANGE_NEGATIVE = 1 / 8
_FULL_RANGE_ZERO = 1 / 32


def _random_e4m3(exponent: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """e4m3 values ``±(1 + m/8) * 2^exponent`` with uniform mantissa m, some negative and some zero."""
    mantissa = torch.randint(0, 8, exponent.shape, generator=gen)
    value = (1.0 + mantissa / 8.0) * torch.exp2(exponent.to(torch.float32))
    u = torch.rand(exponent.shape, generator=gen)
    value = torch.where(u < _FULL_RANGE_NEGATIVE, -value, value)
    value = torch.where(u < _FULL_RANGE_ZERO, torch.zeros_like(value), value)
    # Rounds subnormal-range values to e4m3's 2^-9 grid and saturates 1.875 * 2^8 to 448.
    return formats.encode_e4m3(value).view(torch.float8_e4m3fn)


def _full_range_exponents(m: int, k: int, l: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: E741
    """Scale exponents ``[L, M, K/16]`` for a and ``[L, 128, K/16]`` for b, drawn per block (see above)."""
    lo, hi = _E4M3_EXPONENTS
    blocks = k // 16
    kind = torch.rand((l, 1, blocks), generator=gen)
    a_wide = kind < _FULL_RANGE_WIDE / 2
    b_wide = kind >= 1 - _FULL_RANGE_WIDE / 2
    exp_b = torch.randint(lo, hi + 1, (l, B_ROWS, blocks), generator=gen)  # rows 1.. are never used
    paired_b = torch.randint(_PAIRED_B_EXPONENTS[0], _PAIRED_B_EXPONENTS[1] + 1, (l, 1, blocks), generator=gen)
    exp_b[:, :1] = torch.where(a_wide, lo, torch.where(b_wide, exp_b[:, :1], paired_b))
    jitter = torch.randint(_FULL_RANGE_JITTER[0], _FULL_RANGE_JITTER[1] + 1, (l, m, blocks), generator=gen)
    exp_a_wide = torch.randint(lo, hi + 1, (l, m, blocks), generator=gen)
    exp_a = torch.where(a_wide, exp_a_wide, (jitter - exp_b[:, :1]).clamp(lo, hi))
    return exp_a, exp_b


def generate_full_range_input(
    m: int, k: int, l: int, seed: int, device: str | torch.device | None = None  # noqa: E741
) -> TaskInput:
    """The task's 7-tuple for shape (m, k, l), with operands far wider than the task's benign distribution.

    Same shapes, dtypes, devices and strides as :func:`generate_input`, but:

    * a and b bytes are uniform over all 256 values, so both nibbles carry all 16 e2m1 codes, negative
      values and -0 included;
    * scales are ``±(1 + m/8) * 2^e`` rounded to e4m3, with exponents over e4m3's whole range 2^-9 .. 2^8
      (subnormals and 448 included) on both sides, drawn together per 16-element block so that the
      product of a's and b's scales stays at or below about 2^-1: mostly b's exponent is in -9 .. 3 and
      a's is its negation plus a uniform jitter in -10 .. -4; in 1 block in 16 b's exponent spans the
      whole range, in another 1 in 16 a's does (per row) with b's at 2^-9.  About 1 scale in 8 is
      negative and 1 in 32 is zero.

    Sums now cancel and outputs are units to hundreds, finite in fp16, where an fp32-accumulating kernel
    meets rtol = atol = 1e-3 with a wide margin.  This checks sign handling, every code, every scale
    exponent on both sides and the pairing of a's and b's scale blocks, none of which the task's
    distribution can tell from a bug.
    """
    _check_task_shape(m, k, l)
    device = resolve_device(device)
    gen = torch.Generator().manual_seed(seed)
    a_bytes = torch.randint(0, 256, (l, m, k // 2), dtype=torch.uint8, generator=gen)
    b_bytes = torch.randint(0, 256, (l, B_ROWS, k // 2), dtype=torch.uint8, generator=gen)
    exp_a, exp_b = _full_range_exponents(m, k, l, gen)
    sfa = _random_e4m3(exp_a, gen)
    sfb = _random_e4m3(exp_b, gen)
    c = torch.randn((l, m, 1), generator=gen).to(torch.float16)
    return _assemble(a_bytes, b_bytes, sfa, sfb, c, device)


def reference_output(data: TaskInput) -> torch.Tensor:
    """A fresh ``[M, 1, L]`` float16 tensor with the exact result, on a's device (``data`` is not modified).

    Uses the linear scales sfa/sfb, not the permuted ones, so a swizzle bug cannot hide in both sides.
    """
    a, b, sfa, sfb, _, _, c = data
    device = a.device
    # Batch-major views [L, rows, ...]: formats and reference work on trailing (rows, K) dimensions.
    a_values = formats.dequantize(a.permute(2, 0, 1), sfa.permute(2, 0, 1).to(device), formats.NVFP4)
    b_values = formats.dequantize(b[:1].permute(2, 0, 1), sfb[:1].permute(2, 0, 1).to(device), formats.NVFP4)
    result = reference.gemv_reference(a_values, b_values, out_dtype=c.dtype)  # [L, M, 1]
    return result.permute(1, 2, 0)


def ref_kernel(data: TaskInput) -> torch.Tensor:
    """The task's reference: writes the exact result into data's c and returns c."""
    c = data[6]
    c.copy_(reference_output(data))
    return c


class Comparison(NamedTuple):
    """Outcome of comparing an output with the reference."""

    ok: bool
    message: str
    mismatches: int
    max_abs_error: float  # nan when the output has NaN where the reference does not


def compare_to_reference(output: torch.Tensor, expected: torch.Tensor, worst: int = 5) -> Comparison:
    """``torch.allclose(output, expected, rtol=1e-3, atol=1e-3)`` (NaN never matches), with a diagnosis.

    On a mismatch the message gives the count and the ``worst`` largest errors as (m, l, got, expected).
    """
    if not isinstance(output, torch.Tensor):
        return Comparison(False, f"output: expected a torch.Tensor, got {type(output).__name__}", -1, float("nan"))
    if output.shape != expected.shape:
        msg = f"output: expected shape {tuple(expected.shape)}, got {tuple(output.shape)}"
        return Comparison(False, msg, -1, float("nan"))
    if output.dtype != expected.dtype:
        return Comparison(False, f"output: expected dtype {expected.dtype}, got {output.dtype}", -1, float("nan"))
    got = output.detach().to("cpu", torch.float32)
    want = expected.detach().to("cpu", torch.float32)
    close = torch.isclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=False)
    error = (got - want).abs()
    # Inf - inf is nan: equal infinities count as exact, as in torch.allclose.
    error = torch.where(close & torch.isnan(error), torch.zeros_like(error), error)
    max_abs_error = error.max().item()
    bad = ~close
    count = int(bad.sum())
    if count == 0:
        return Comparison(True, f"all {got.numel()} outputs within rtol=atol={RTOL:g}", 0, max_abs_error)
    # Rank mismatches by error, NaN first.
    ranked = torch.where(torch.isnan(error), torch.full_like(error, float("inf")), error)
    ranked = torch.where(bad, ranked, torch.full_like(ranked, -1.0))
    order = torch.argsort(ranked.flatten(), descending=True)[: min(worst, count)]
    details = []
    for flat in order.tolist():
        m, _, l = torch.unravel_index(torch.tensor(flat), got.shape)  # noqa: E741
        details.append(f"(m={int(m)}, l={int(l)}) got {got[m, 0, l].item():.6g} expected {want[m, 0, l].item():.6g}")
    msg = f"{count} of {got.numel()} outputs differ beyond rtol=atol={RTOL:g}; worst: " + "; ".join(details)
    return Comparison(False, msg, count, max_abs_error)


def check_implementation(data: TaskInput, output: torch.Tensor) -> tuple[bool, str]:
    """Compare ``output`` with a freshly computed reference (data's c is not trusted): ``(passed, message)``."""
    comparison = compare_to_reference(output, reference_output(data))
    return comparison.ok, comparison.message


_TASK_ITEMS = "(a, b, sfa, sfb, sfa_permuted, sfb_permuted, c)"
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def task_views(data: TaskInput):
    """FP4Tensor views of a and b's row 0 and the ``[L, M, 1]`` view of c, checked with the task's names."""
    if not isinstance(data, (tuple, list)) or len(data) != 7:
        what = f"a {type(data).__name__} of {len(data)} items" if isinstance(data, (tuple, list)) else type(data).__name__
        raise TypeError(f"data: expected the 7-tuple {_TASK_ITEMS}, got {what}")
    a, b, _sfa, _sfb, sfa_permuted, sfb_permuted, c = data
    weights = FP4Tensor.from_task(a, sfa_permuted, names=("a", "sfa_permuted"))  # [L, M, K]
    if not isinstance(b, torch.Tensor) or b.dim() != 3 or tuple(b.shape[1:]) != tuple(a.shape[1:]):
        shape = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
        raise ValueError(f"b: expected shape [rows, {a.shape[1]}, {a.shape[2]}] (K/2 and L like a), got {shape}")
    activation = FP4Tensor.from_task(b, sfb_permuted, names=("b", "sfb_permuted"))  # [L, rows, K]
    if not isinstance(c, torch.Tensor):
        raise TypeError(f"c: expected a torch.Tensor, got {type(c).__name__}")
    m, _, batch = a.shape
    if tuple(c.shape) != (m, 1, batch):
        raise ValueError(f"c: expected shape ({m}, 1, {batch}), got {tuple(c.shape)}")
    if c.dtype not in _OUT_DTYPES:
        raise TypeError(f"c: expected dtype float16 (or bfloat16, float32), got {c.dtype}")
    if c.device != weights.device:
        raise ValueError(f"c: expected device {weights.device} like a, got {c.device}")
    # Only row 0 of b takes part; c [M, 1, L] is seen as the result [L, M, 1].
    return weights, activation.first_rows(1), c.permute(2, 0, 1)


def _task_key(data, backend: str) -> tuple | None:
    """The metadata of the task's tensors (and the backend) that fixes every piece of their views' metadata
    (``ops.prepare_gemv``'s ``metadata_key``), None if it cannot be read."""
    if type(data) is not tuple or len(data) != 7:
        return None
    try:
        a, b, _, _, sfa, sfb, c = data
        return ("task", a.dtype, a.shape, a.stride(), a.data_ptr() % 16, a.device, b.dtype, b.shape, b.stride(),
                b.data_ptr() % 16, sfa.dtype, sfa.shape, sfa.stride(), sfa.data_ptr() % 16, sfb.dtype, sfb.shape,
                sfb.stride(), sfb.data_ptr() % 16, c.dtype, c.shape, c.stride(), c.data_ptr() % 16, c.device,
                torch.cuda.current_device() if a.device.type == "cuda" else None, backend)
    except AttributeError:
        return None


def custom_kernel(data: TaskInput, *, backend: str = "auto") -> torch.Tensor:
    """Our submission: ``fp4gemv.gemv`` on zero-copy FP4Tensor views of the operands, written into c.

    backend: as ``fp4gemv.gemv``'s ("auto": the kernels on CUDA, the float64 reference on the CPU; "triton"
    runs the kernels' pure-Triton paths, also on the CPU under ``TRITON_INTERPRET=1``).  Errors name the task's
    own arguments.  The prepared call (``ops.prepare_gemv``) is kept under the task tensors' metadata; once it
    launches by address, a call with that metadata launches it on the tensors' addresses directly (the views
    share them), skipping the views and the checks that metadata already passed.
    """
    key = _task_key(data, backend)
    call = ops.prepared_gemv(key) if key is not None else None
    if call is not None and call.launches_by_address:
        a, b, _, _, sfa_permuted, sfb_permuted, c = data
        call.launch_at(ops.GemvAddresses(a_data=a.data_ptr(), a_scales=sfa_permuted.data_ptr(), b_data=b.data_ptr(),
                                         out=c.data_ptr(), b_scales=sfb_permuted.data_ptr()))
        return c
    weights, activation, out = task_views(data)
    call = ops.prepare_gemv(weights, activation, out=out, out_dtype=out.dtype, backend=backend, metadata_key=key)
    call(weights, activation, out)
    return data[6]
