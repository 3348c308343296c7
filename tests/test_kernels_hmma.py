"""The tensor-core kernel (kernels/hmma_gemv.py) against the exact oracle, with an error bound for its arithmetic.

Its cases: NVFP4 weights (K a multiple of 64, 16-byte aligned packed rows) times fp16/bf16 activations
(N = 1..16, or a [K] vector) or NVFP4 activations (N > 1), named with ``kernel="hmma"`` (the default dispatch
reaches it for N > 8, or where the weight-only kernel cannot run the case).  On a CPU-only machine the kernel's
pure-Triton twin (``_step_triton``, USE_PTX=False) runs in Triton's interpreter (conftest sets TRITON_INTERPRET).
The twin is built from the same per-thread operands as the asm (word tile, scale and activation base pointers,
flags, column-tile strides) and writes the same accumulator elements, so the interpreter exercises the
kernel's indexing: the K order, both scale layouts, masking (tail rows, warps past the end of K, a partial last
step, N padding, the second n-tile for N > 8) and the epilogue.  The sm_90 compile runs without a GPU and
checks the layout the asm relies on; ``gpu`` tests run the PTX (both it and the twin within the bound: they sum
in different orders, so they need not agree bit for bit), task-sized shapes, tails, and the K order.

The bound (``tensor_cores=True`` in tests/operands.py's ``error_bound``).  The weights (and NVFP4
activations) are decoded exactly into fp16/bf16 with their scales folded in, and the tensor cores multiply
exactly, so every term t_k = a_k * b_k enters an fp32 accumulator exactly, scaled by 2^-f (f = 14 for fp16
activations, 7 for bf16, 28 for NVFP4 activations; ``_fold_exponent``).  Unlike the dp4a kernels there are no
separate 16-element block sums: all products of a warp's K chunks go through one fp32 accumulation, in an
order and with an internal alignment the hardware does not document, possibly truncating rather than
rounding; the twin sums them with an fp32 ``tl.dot``.  So count every addition: K products into WARPS
accumulators that start at zero are K additions, and the final sum over warps WARPS - 1 <= 15 more, so a term
passes through at most K + 15 of them; then the epilogue multiplies by 2^f (exact) and by the global scales
(their product and the multiplication: 2 roundings).  n = K + 24 >= K + 17 leaves 7 operations of margin.
Each operation's relative error is below one ulp: unit roundoff u = 2^-23 (truncation; 2^-24 would be rounding
to nearest), so |s' - s| <= gamma_n * sum_k |t_k| <= 1.01 * n * u * sum_k |t_k|  (gamma_n = n u / (1 - n u)
<= 1.01 n u while n u <= 0.0099, i.e. K up to about 83000).  Underflow: each operation may also be off by one
fp32 subnormal step 2^-149 in the accumulator's units, which the fold 2^f and the global scales' product gs
scale to 2^(f - 149) * gs in the result's units (and 2^-149 for the epilogue's own roundings and for the twin,
which does not fold): at most n * 2^-149 * max(1, 2^f * gs) in all.  The one rounding to the output dtype adds
half an ulp of the output, and the float64 oracle is off by at most (K + 3) * 2^-53 * sum_k |t_k|, as in
tests/operands.py.

This bound is about 2 (K + 24) / (K / 16 + 22) times the dp4a kernels' (10x at K = 128, 31x at K = 16384), so a
bug confined to one small-scaled block can hide in it; ``test_hmma_bound_rejects_plausible_bugs`` uses bugs that
reach every block, as a K-order bug in this kernel would, and the one-hot K-order tests check exactly.
"""

import dataclasses
import itertools
import json

import pytest
import torch
from operands import (
    DEVICE,
    LAYOUTS,
    OUT_DTYPES,
    assert_matches_exact,
    build_case,
    dtype_name,
    one_hot_activation,
    poisoned,
    random_activation,
    random_fp4,
    result_shape,
    within_bound,
)
from ptx_emulator import emulate_ptx

from fp4gemv import FP4Tensor, dequantize, formats, gemv, ops, task
from fp4gemv.kernels import _ptx, choose_kernel, hmma_gemv
from fp4gemv.kernels.general import GeneralConfig
from fp4gemv.kernels.hmma_gemv import Hmma, HmmaConfig, hmma_config
from fp4gemv.ops import gemv_operands
from fp4gemv.kernels.w4a4 import W4A4Config
from fp4gemv.target import SM90


# The activations of the tensor-core kernel with the N they are tested at: NVFP4 needs N > 1 (N = 1 is
# w4a4.py's); N > 8 uses the second n-tile (N_TILES = 2).
ACTIVATION_NS = (
    *(("fp4", n) for n in (2, 3, 9, 16)),
    *((dtype, n) for dtype in (torch.float16, torch.bfloat16) for n in (1, 3, 16, "vector")),
)
# ((M, K, L), config) cycled through the cases.  Every M leaves tail rows (not a multiple of 16); a step is
# warps * 128 elements of K.
SHAPE_CONFIGS = (
    ((40, 192, 2), HmmaConfig(2)),  # two steps of 256, the second partial (64: warp 1 idle), L = 2
    ((24, 64, 1), HmmaConfig(1)),  # K < 128: one step, half of the warp's words masked
    ((8, 64, 4), HmmaConfig(4)),  # M < 16; K = 64 with 4 warps: warps 1-3 wholly past K; L = 4
    ((136, 128, 1), HmmaConfig(1)),  # a second 128-row tile of swizzled scales, a tail of 8 rows
    ((56, 320, 2), HmmaConfig(2)),  # 320 = 256 + 64: a full step, then one of 64
)
CASES = [
    (activation, n, layout, out_dtype, *SHAPE_CONFIGS[i % len(SHAPE_CONFIGS)], (i // len(SHAPE_CONFIGS)) % 2 == 1)
    for i, ((activation, n), layout, out_dtype) in enumerate(itertools.product(ACTIVATION_NS, LAYOUTS, OUT_DTYPES))
]


def _case_id(c):
    activation, n, layout, out_dtype, shape, cfg, gs = c
    return (f"{dtype_name(activation)}-n{n}-{layout}-{dtype_name(out_dtype)}-{'x'.join(map(str, shape))}-"
            f"w{cfg.warps}{'-gs' if gs else ''}")


@pytest.mark.parametrize("activation, n, layout, out_dtype, shape, config, global_scales", CASES,
                         ids=[_case_id(c) for c in CASES])
def test_hmma_kernel_matches_exact_result(activation, n, layout, out_dtype, shape, config, global_scales):
    a, b = build_case("nvfp4", activation, n, layout, shape, global_scales, seed=sum(shape) + len(str(n)))
    out = poisoned(result_shape(a, b), out_dtype)
    got = gemv(a, b, out=out, out_dtype=out_dtype, backend="triton", kernel="hmma", config=config)
    assert got is out
    assert not torch.isnan(got).any(), "some outputs were not written"
    assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), out_dtype, tensor_cores=True)


def test_cases_cover_shapes_configs_and_global_scales_for_every_activation():
    for activation in ("fp4", torch.float16, torch.bfloat16):
        seen = {(c[4], c[5], c[6]) for c in CASES if c[0] == activation}
        assert seen == {(s, cfg, gs) for (s, cfg), gs in itertools.product(SHAPE_CONFIGS, (False, True))}
    for activation, n in ACTIVATION_NS:  # every N in both layouts and every out dtype
        assert {(c[2], c[3]) for c in CASES if c[:2] == (activation, n)} == set(itertools.product(LAYOUTS, OUT_DTYPES))
    for (m, k, L), cfg in SHAPE_CONFIGS:
        assert k % 64 == 0 and m % 16
    assert {k % (cfg.warps * 128) for (_, k, _), cfg in SHAPE_CONFIGS} >= {0, 64}  # full and partial last steps
    assert {cfg.warps for _, cfg in SHAPE_CONFIGS} == {1, 2, 4} and {s[2] for s, _ in SHAPE_CONFIGS} >= {1, 2}


@pytest.mark.parametrize("activation, n, shape, warps", [
    (torch.float16, 16, (200, 192, 2), 1),
    (torch.bfloat16, "vector", (200, 192, 2), 1),
    ("fp4", 3, (200, 192, 2), 1),
    (torch.float16, 5, (40, 1024, 1), 4),
    ("fp4", 9, (24, 8192, 1), 8),  # few rows, long K: 8 warps
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else dtype_name(x))
def test_hmma_kernel_with_default_config(activation, n, shape, warps):
    a, b = build_case("nvfp4", activation, n, "swizzled", shape, True, seed=5)
    assert hmma_config(*shape) == HmmaConfig(warps)  # the configuration this case runs
    got = gemv(a, b, out=poisoned(result_shape(a, b), torch.float16), backend="triton", kernel="hmma")
    assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), torch.float16, tensor_cores=True)


def test_hmma_kernel_broadcasts_batch_and_handles_strides():
    """A batched a times an unbatched, K-strided activation into a strided out; and the other broadcast."""
    a = random_fp4((2, 40, 192), "nvfp4", "swizzled", seed=6, global_scale=0.5)
    x = random_activation((192, 5), torch.bfloat16, seed=7).t()  # [5, 192], K not contiguous: copied
    backing = poisoned((5, 2, 80), torch.float32)
    out = backing[:, :, ::2].permute(1, 2, 0)  # [2, 40, 5], no unit stride
    got = gemv(a, x, out=out, out_dtype=torch.float32, backend="triton", kernel="hmma", config=HmmaConfig(1))
    assert got is out
    assert_matches_exact(got.cpu(), a.to("cpu"), x.to("cpu"), torch.float32, tensor_cores=True)
    assert torch.isnan(backing[:, :, 1::2]).all(), "wrote outside out"
    a2 = random_fp4((40, 128), "nvfp4", "linear", seed=8)
    b2 = random_fp4((2, 4, 128), "nvfp4", "swizzled", seed=9, global_scale=3.0)
    got = gemv(a2, b2, out=poisoned((2, 40, 4), torch.float16), backend="triton", kernel="hmma", config=HmmaConfig(2))
    assert_matches_exact(got.cpu(), a2.to("cpu"), b2.to("cpu"), torch.float16, tensor_cores=True)
    v = random_activation((192,), torch.float16, seed=10)  # a [K] vector over a batched a
    got = gemv(a, v, out=poisoned((2, 40), torch.bfloat16), out_dtype=torch.bfloat16, backend="triton",
               kernel="hmma", config=HmmaConfig(2))
    assert_matches_exact(got.cpu(), a.to("cpu"), v.to("cpu"), torch.bfloat16, tensor_cores=True)


def test_hmma_kernel_reads_padded_rows():
    """Row strides longer than a row (multiples of 16 bytes): weights, NVFP4 and fp16 activations, read in place
    (a 16-byte aligned float activation is not copied, ``test_aligned_strided_activation_is_not_copied``)."""
    m, k = 40, 192
    w = random_fp4((2, m, k), "nvfp4", "linear", seed=11, global_scale=0.25)
    data = torch.zeros(2, m, k // 2 + 32, dtype=torch.uint8, device=DEVICE)[:, :, 16:16 + k // 2]
    data.copy_(w.data)
    # (an even scale row stride: the asm loads a thread's two scale bytes as one u16)
    scales = torch.zeros(2, m, k // 16 + 4, dtype=torch.uint8, device=DEVICE)[:, :, 2:2 + k // 16]
    scales.copy_(w.scales)
    a = FP4Tensor(data, scales, "nvfp4", "linear", w.global_scale)
    sm90_triton = dataclasses.replace(SM90, mode="triton")  # the support checks, without the PTX path's Triton guard
    assert Hmma().supports(_case(a, random_activation((3, k), torch.float16, seed=0)), sm90_triton)
    xb = random_fp4((2, 3, k), "nvfp4", "swizzled", seed=12)
    x_data = torch.zeros(2, 3, k // 2 + 16, dtype=torch.uint8, device=DEVICE)[:, :, :k // 2]
    x_data.copy_(xb.data)
    x = FP4Tensor(x_data, xb.scales, "nvfp4", "swizzled")
    got = gemv(a, x, out=poisoned((2, m, 3), torch.float32), out_dtype=torch.float32, backend="triton",
               kernel="hmma", config=HmmaConfig(1))
    assert_matches_exact(got.cpu(), a.to("cpu"), x.to("cpu"), torch.float32, tensor_cores=True)
    y = torch.zeros(2, 6, k + 16, dtype=torch.float16, device=DEVICE)[:, :, 8:8 + k]  # 16-byte offset and stride
    y.copy_(random_activation((2, 6, k), torch.float16, seed=13))
    got = gemv(a, y, out=poisoned((2, m, 6), torch.float16), backend="triton", kernel="hmma", config=HmmaConfig(2))
    assert_matches_exact(got.cpu(), a.to("cpu"), y.to("cpu"), torch.float16, tensor_cores=True)


# --- the kernel's K order is the activation's ------------------------------------------------------------


def _distinct_weights(m, k, seed):
    """NVFP4 [m, k]: row r holds code (j + 3 * (j // 16) + r) % 16 at position j, so the 16 codes of each
    block of a row are all different (equal values only for the pair of zeros, codes 0 and 8); random scales,
    which tell blocks apart (``test_distinct_weights_tell_every_two_positions_apart``)."""
    j = torch.arange(k)
    codes = (j[None, :] + 3 * (j[None, :] // 16) + torch.arange(m)[:, None]) % 16
    scales = random_fp4((m, k), "nvfp4", "linear", seed=seed, device="cpu").scales
    return FP4Tensor(formats.pack_e2m1(codes), scales, "nvfp4", "linear")


def _one_hot_expected(a, m, k):
    weights = dequantize(a, torch.float32)  # exact: e2m1 x e4m3, no global scale
    return weights.reshape(m, k // 16, 16).permute(1, 0, 2)  # [l, m, n] = weight (m, 16 l + n)


@pytest.mark.parametrize("activation", (torch.float16, torch.bfloat16, "fp4"), ids=dtype_name)
@pytest.mark.parametrize("k, config", [(192, HmmaConfig(2)), (64, HmmaConfig(1)), (64, HmmaConfig(4)),
                                       (128, HmmaConfig(1)), (384, HmmaConfig(2))],
                         ids=["k192-w2", "k64-w1", "k64-w4", "k128-w1", "k384-w2"])
def test_hmma_kernel_k_order_matches_the_activation(activation, k, config):
    """One-hot activation rows pick single weights: output (l, m, n) is weight (m, 16 l + n), exactly.

    The kernel pairs codes i and i + 4 of each word for the tensor cores (and the activation to match), puts
    rows g and g + 8 in a thread's two halves, and one scale on each pair of words; any mismatch between the
    weights' order and the activation's, or a scale applied to the wrong block, picks another weight, and every
    other weight of a row has another value (``_distinct_weights``).  N = 16 covers both n-tiles."""
    m = 32
    a = _distinct_weights(m, k, seed=k).with_scale_layout("swizzled")
    x = one_hot_activation(k, 16, activation)
    got = gemv(a.to(DEVICE), x.to(DEVICE), out=poisoned((k // 16, m, 16), torch.float32), out_dtype=torch.float32,
               backend="triton", kernel="hmma", config=config).cpu()
    expected = _one_hot_expected(a, m, k)
    wrong = (got != expected).nonzero()[:5].tolist()
    assert not wrong, [(i, got[tuple(i)].item(), expected[tuple(i)].item()) for i in wrong]


@pytest.mark.parametrize("m, k, seed", [(32, 192, 192), (32, 64, 64), (32, 384, 384), (256, 512, 2)])
def test_distinct_weights_tell_every_two_positions_apart(m, k, seed):
    """The premise of the K-order tests: for any two positions along K, some row holds different values, so
    reading one in place of the other changes an output."""
    w = dequantize(_distinct_weights(m, k, seed=seed), torch.float64)
    differ = (w[:, :, None] != w[:, None, :]).any(0)
    assert (differ | torch.eye(k, dtype=torch.bool)).all()


# --- the bound cannot pass a wrong kernel ---------------------------------------------------------------


def _swap_nibbles(t, rows):
    """Neighbouring elements swapped along the whole of some rows.  (Swapping them in one block only, as the
    block-sum bound of tests/operands.py does, can stay within this looser bound when that block's scales are
    small.)"""
    data = t.data.clone()
    data[..., rows, :] = (data[..., rows, :] >> 4) | (data[..., rows, :] << 4)
    return FP4Tensor(data, t.scales, t.fmt, t.scale_layout, t.global_scale)


def _shift_scales(t):
    """Each row's scales moved one block along K (the first block reuses its own): an off-by-one."""
    lin = t.linear_scales().clone()
    lin[..., 1:] = t.linear_scales()[..., :-1]
    return FP4Tensor(t.data, lin, t.fmt, "linear", t.global_scale)


@pytest.mark.parametrize("activation", ("fp4", torch.float16, torch.bfloat16), ids=dtype_name)
def test_hmma_bound_rejects_plausible_bugs(activation):
    """The kernel's correct output, checked against the exact result of a slightly wrong operand, fails."""
    a, b = build_case("nvfp4", activation, 3, "swizzled", (128, 128, 1), False, seed=9)
    got = gemv(a, b, out_dtype=torch.float32, backend="triton", kernel="hmma", config=HmmaConfig(1)).cpu()
    a, b = a.to("cpu"), b.to("cpu")

    def ok(a_, b_):
        return within_bound(got, a_, b_, torch.float32, tensor_cores=True)

    assert ok(a, b).all()
    rows = torch.arange(0, 128, 7)
    assert not ok(_swap_nibbles(a, rows), b)[rows].any(), "element order"
    assert (~ok(_shift_scales(a), b)).float().mean() > 0.9, "scale columns"
    b_swapped = b.flip(0) if isinstance(b, torch.Tensor) else FP4Tensor(
        b.data.flip(0), b.linear_scales().flip(0), b.fmt, "linear", b.global_scale)
    assert (~ok(a, b_swapped)[:, [0, 2]]).float().mean() > 0.9, "activation rows"


# --- which kernel runs, and config validation -----------------------------------------------------------


def _operands(kind, n=3, m=48, k=128):
    a = random_fp4((m, k), "mxfp4" if kind.startswith("mx") else "nvfp4", "linear", seed=1)
    if kind.endswith("fp4"):
        return a, random_fp4((n, k), a.fmt.name, "linear", seed=2)
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[kind.split("-")[1]]
    return a, random_activation((k,) if n == "vector" else (n, k), dtype, seed=2)


def _unaligned_rows(t):
    """``t`` with its packed rows 8 (not 16) bytes apart beyond their length: still valid for the kernels."""
    *batch, rows, half_k = t.data.shape
    data = torch.zeros(*batch, rows, half_k + 8, dtype=torch.uint8, device=t.data.device)[..., :half_k]
    data.copy_(t.data)
    return FP4Tensor(data, t.scales, t.fmt, t.scale_layout, t.global_scale)


def _plan(a, b, **kw):
    return ops.plan_for(a, b, backend="triton", **kw)


def _case(a, b):
    return gemv_operands(a, b, torch.empty(result_shape(a, b), device=a.device)).case


# The default dispatch (kernels.GEMV_KERNELS: w4a4, weight_only, hmma, general): NVFP4 goes to hmma with N > 8
# (weight_only takes N <= 8, test_kernels_weight_only.py), or where weight_only cannot run it.
@pytest.mark.parametrize("kind, n, k, expected", [
    ("nv-f16", 9, 128, "hmma"), ("nv-bf16", 16, 192, "hmma"), ("nv-fp4", 16, 64, "hmma"), ("nv-fp4", 9, 128, "hmma"),
    ("nv-f16", 1, 128, "weight_only"), ("nv-f16", "vector", 64, "weight_only"), ("nv-fp4", 2, 128, "weight_only"),
    ("nv-fp4", 1, 128, "w4a4"), ("nv-f32", 3, 128, "general"), ("mx-f16", 3, 128, "weight_only"),
    ("mx-bf16", 1, 128, "weight_only"), ("mx-fp4", 3, 128, "weight_only"), ("mx-fp4", 1, 128, "w4a4"),
    # K not a multiple of 64: weight_only where K is a multiple of 32, else the general kernel (or w4a4, N = 1 FP4)
    ("nv-f16", 16, 96, "weight_only"), ("nv-f16", 3, 48, "general"), ("nv-bf16", "vector", 80, "general"),
    ("nv-fp4", 3, 80, "general"), ("nv-fp4", 9, 48, "general"), ("nv-fp4", 1, 48, "w4a4"),
], ids=str)
def test_default_dispatch(kind, n, k, expected):
    a, b = _operands(kind, n, k=k)
    plan = _plan(a, b)
    assert plan.spec.name == expected == ops.select_kernel(a, b, backend="triton").name
    if expected == "hmma":
        assert plan.config == hmma_config(48, k, 1)


@pytest.mark.parametrize("kind, n", [("nv-f16", 3), ("nv-fp4", 3)])
def test_unaligned_packed_rows_go_to_the_general_kernel(kind, n):
    """Packed rows 8 but not 16 bytes apart (weights or NVFP4 activations) cannot take the 16-byte loads."""
    a, b = _operands(kind, n)
    assert _plan(a, b, kernel="hmma").spec.name == "hmma"
    assert _plan(_unaligned_rows(a), b).spec.name == "general"
    with pytest.raises(ValueError, match="kernel: 'hmma' cannot run .*a: needs 16-byte aligned data rows"):
        gemv(_unaligned_rows(a), b, backend="triton", kernel="hmma")
    if kind == "nv-fp4":
        assert _plan(a, _unaligned_rows(b)).spec.name == "general"


def test_aligned_strided_activation_is_not_copied():
    """A float activation read in place when its rows are 16-byte aligned, copied otherwise (and when K-strided)."""
    a, _ = _operands("nv-f16")
    backing = random_activation((3, 160), torch.float16, seed=3)
    for x, in_place in ((backing[:, 16:144], True), (backing[:, 4:132], False), (backing[:, :128], True),
                        (random_activation((128, 3), torch.float16, seed=4).t(), False)):
        plan = _plan(a, x, kernel="hmma")
        assert plan.copy_activation == (not in_place), (x.stride(), x.storage_offset())
        assert_matches_exact(gemv(a, x, backend="triton", kernel="hmma", out_dtype=torch.float32).cpu(), a.to("cpu"),
                             x.to("cpu"), torch.float32, tensor_cores=True)


@pytest.mark.parametrize("kind, n", [("nv-f16", 1), ("nv-bf16", 16), ("nv-f16", "vector"), ("nv-fp4", 2)])
def test_kernel_name_picks_the_kernel(kind, n):
    a, b = _operands(kind, n)
    assert _plan(a, b, kernel="hmma", config=HmmaConfig(2)).spec.name == "hmma"
    general = _plan(a, b, kernel="general", config=GeneralConfig(64, 8, 4))
    assert (general.spec.name, general.config) == ("general", GeneralConfig(64, 8, 4))
    with pytest.raises(TypeError, match="config: expected a GeneralConfig for kernel 'general', got HmmaConfig"):
        gemv(a, b, backend="triton", kernel="general", config=HmmaConfig(2))


@pytest.mark.parametrize("kind, n, k", [("mx-f16", 3, 128), ("mx-fp4", 3, 128), ("nv-f32", 3, 128),
                                        ("nv-fp4", 1, 128), ("nv-f16", 3, 80), ("nv-fp4", 3, 48)], ids=str)
def test_hmma_config_for_another_case_is_a_type_error(kind, n, k):
    a, b = _operands(kind, n, k=k)
    out = poisoned(result_shape(a, b), torch.float16)
    kernels = "(general|w4a4|weight_only)"
    with pytest.raises(TypeError, match=f"config: expected a .*Config for kernel '{kernels}', got HmmaConfig"):
        gemv(a, b, out=out, backend="triton", config=HmmaConfig(1))
    assert torch.isnan(out).all()


@pytest.mark.parametrize("config", [HmmaConfig(3), HmmaConfig(0), HmmaConfig(16), HmmaConfig(32), HmmaConfig(6),
                                    HmmaConfig(-1)],
                         ids=str)
def test_hmma_config_out_of_range_is_a_value_error(config):
    a, b = _operands("nv-f16")
    out = poisoned(result_shape(a, b), torch.float16)
    with pytest.raises(ValueError, match="config"):
        gemv(a, b, out=out, backend="triton", kernel="hmma", config=config)
    assert torch.isnan(out).all()


def test_hmma_refuses_16_warps_and_never_chooses_them():
    """16 warps gave wrong results on the H200 (benchmarks/hmma_warps_check.py diagnoses it on a GPU): an explicit
    HmmaConfig(16) is refused before anything is written, and no default configuration reaches it."""
    a, b = _operands("nv-f16")
    out = poisoned(result_shape(a, b), torch.float16)
    with pytest.raises(ValueError, match="16 warps gave wrong results"):
        gemv(a, b, out=out, backend="triton", kernel="hmma", config=HmmaConfig(16))
    assert torch.isnan(out).all()
    for m, k, l in ((128, 65536, 1), (64, 16384, 1), (7168, 16384, 1), (256, 1 << 20, 1)):
        assert hmma_config(m, k, l).warps <= 8


@pytest.mark.parametrize("warps", (1, 2, 4, 8))
def test_hmma_config_in_range_is_accepted(warps):
    a, b = _operands("nv-bf16", 5)
    plan = _plan(a, b, kernel="hmma", config=HmmaConfig(warps))
    assert (plan.spec.name, plan.config) == ("hmma", HmmaConfig(warps))


def test_hmma_config_is_valid_for_every_shape():
    ms = (1, 16, 128, 200, 4096, 7168, 28672)
    ks = (16, 48, 64, 128, 192, 256, 320, 512, 1024, 2048, 7168, 8192, 16384)
    for m, k, L in itertools.product(ms, ks, (1, 2, 4, 8)):
        cfg = hmma_config(m, k, L)
        assert isinstance(cfg, HmmaConfig)
        assert cfg.warps >= 1 and cfg.warps & (cfg.warps - 1) == 0, (m, k, L, cfg)
        assert cfg.warps * 128 <= max(128, k), (m, k, L, cfg)
        Hmma().check_config(cfg)  # what gemv accepts from a user


def test_w4a4_configs_are_not_hmma_configs():
    a, b = _operands("nv-fp4", 2)
    with pytest.raises(TypeError, match="config"):
        gemv(a, b, backend="triton", config=W4A4Config(16, 8, 4))


# --- the fp16 decode's PTX, emulated -------------------------------------------------------------------

def test_fp16_decode_ptx_places_every_code_as_value_times_2_to_the_minus_14():
    """decode_word_f16 on words covering every code in every position: pair i of a word is (e_i, e_{i+4}),
    each half the fp16 of the e2m1 value times 2^-14 (what the exactness argument and the K order rely on)."""
    g = torch.Generator().manual_seed(0)
    words = [int(w) & 0xFFFFFFFF for w in torch.randint(-2**31, 2**31, (200,), generator=g)]
    words += [sum(c << (4 * i) for i in range(8)) for c in range(16)]  # every code in every position
    words += [0x76543210, 0xFEDCBA98, 0x89ABCDEF]
    for w in words:
        regs = emulate_ptx(_ptx.decode_word_f16("w", ("p0", "p1", "xe", "xo"), "xe", "xo"), {"w": w})
        for i, reg in enumerate(("p0", "p1", "xe", "xo")):
            halves = torch.tensor([regs[reg] & 0xFFFF, regs[reg] >> 16], dtype=torch.int32).to(torch.int16)
            got = halves.view(torch.float16).double()
            codes = [(w >> (4 * i)) & 15, (w >> (4 * (i + 4))) & 15]
            expected = formats.decode_e2m1(torch.tensor(codes)).double() * 2.0**-14
            assert torch.equal(got, expected), (hex(w), i, got, expected)


# --- compiled for the GPU without one ------------------------------------------------------------------

# Compiles hmma_gemv_kernel ahead of time for sm_90 down to a cubin (Triton's bundled ptxas) in a fresh
# interpreter (see test_kernels_general.py), and checks what the asm relies on: the layout of its operands.  The
# asm (pack=8) gets each thread's 8 elements of the [8, WARPS, 2, 16] tile; they are the mma fragment only when
# lane = 4 g + word // 4, warps along dimension 1, 4 words per thread and the half in registers.  Triton picks
# that layout from the 16-byte weight load, so it depends on what Triton can prove about alignment: the JIT
# marks arguments divisible by 16 (``tt.divisibility``) when they are, so the same kernel compiles differently
# for K = 16384 (everything divisible) and K = 192 (row stride 24 words).  Each variant is compiled both ways.
_AOT_COMMON = r'''
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from aot import local_memory
from fp4gemv.kernels.hmma_gemv import hmma_gemv_kernel

NAMES = hmma_gemv_kernel.arg_names


def asm_layout(ttgir):
    """(shape, layout definition) of the inline asm's result in the TTGIR."""
    lines = [line for line in ttgir.splitlines() if "tt.elementwise_inline_asm" in line and "mma.sync" in line]
    assert len(lines) == 1, len(lines)
    result = lines[0].rsplit("->", 1)[1]
    m = re.match(r"\s*tensor<(\w+?)xf32, (#[\w.]+)>", result)
    assert m, result
    aliases = dict(re.findall(r"^(#[\w.]+) = (.*)$", ttgir, re.M))
    return m.group(1), aliases.get(m.group(2))


def expected_layout(warps):
    return ("#ttg.blocked<{sizePerThread = [1, 1, 1, 4], threadsPerWarp = [8, 1, 1, 4], "
            f"warpsPerCTA = [1, {warps}, 1, 1], order = [3, 0, 1, 2]}}>")


def compile_kernel(sig, const, attrs, warps):
    return triton.compile(ASTSource(hmma_gemv_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=1))




def check(kernel, label, warps, n_tiles, ptx, global_scales=0):
    """Failure messages for one compiled variant (``global_scales``: how many it loads, 32 bits each)."""
    bad = []
    if not kernel.asm["cubin"]:
        bad.append("no cubin")
    text = kernel.asm["ptx"]
    if ptx:
        shape, layout = asm_layout(kernel.asm["ttgir"])
        if shape != "8x%dx2x16" % warps or layout != expected_layout(warps):
            bad.append("asm layout %s %s" % (shape, layout))
        # 16-byte weight loads (a per-word mask once split them into 4-byte loads); the asm's own are 16-bit
        # scale loads and 16-byte activation loads; the only 32-bit loads are the global scales'
        scalar = re.findall(r"ld\.global(?:\.nc)?\.(?:b32|u32|s32) ", text)
        if len(scalar) != global_scales:
            bad.append("%d scalar 32-bit loads" % len(scalar))
        mma = text.count("mma.sync.aligned.m16n8k16")
        if mma == 0 or mma % (8 * n_tiles):
            bad.append("%d mma.sync.aligned.m16n8k16" % mma)
        bad += local_memory(kernel)
    else:  # the reference twin may use local memory (it does: a stack for its 5-d reshapes); only reported
        if "0x70007000" in text or "mma.sync" in kernel.asm["ttgir"]:
            bad.append("the asm in the Triton variant")
        print("local memory of %s: %s" % (label, local_memory(kernel) or "none"))
    return ["FAIL %s: %s" % (label, b) for b in bad]
'''

_AOT_VARIANTS = r'''
POINTERS = dict(a_ptr="*i32", sfa_ptr="*u8", b_ptr="*u8", sfb_ptr="*u8", gsa_ptr="*fp32", gsb_ptr="*fp32")
failures, done = [], 0
for i, (act, n_tiles, warps, ptx) in enumerate(VARIANTS):
    fp4 = act == "fp4"
    out = ("fp16", "bf16", "fp32")[i % 3]
    gs = i % 2 == 0
    const = dict(WARPS=warps, FP4_ACTIVATION=fp4, BF16=act == "bf16", N_TILES=n_tiles, HAS_GSA=gs,
                 HAS_GSB=gs and fp4, USE_PTX=ptx)
    assert set(const) == {p.name for p in hmma_gemv_kernel.params if p.is_constexpr}
    ptrs = dict(POINTERS, c_ptr="*" + out)
    sig = {a: ptrs.get(a, "constexpr" if a in const else "i64" if a.endswith("_stride_l") else "i32") for a in NAMES}
    for divisible in (True, False):
        # True: pointers, M, K and every stride marked divisible by 16; False: the pointers only.
        marked = [j for j, a in enumerate(NAMES)
                  if a in ptrs or (divisible and (a in ("M", "K") or "_stride_" in a))]
        attrs = {(j,): [["tt.divisibility", 16]] for j in marked}
        kernel = compile_kernel(sig, const, attrs, warps)
        label = "%s n_tiles=%d warps=%d ptx=%s out=%s divisible=%s" % (act, n_tiles, warps, ptx, out, divisible)
        failures += check(kernel, label, warps, n_tiles, ptx, int(const["HAS_GSA"]) + int(const["HAS_GSB"]))
        done += 1
print("\n".join(failures))
print("compiled", done)
'''


def _aot_variants_script(variants):
    return f"VARIANTS = {variants!r}\n" + _AOT_COMMON + _AOT_VARIANTS


@pytest.mark.skipif(not hmma_gemv.PTX_LAYOUT_VERIFIED, reason="the PTX path runs on Triton 3.6 only (its operand "
                    "layout differs on others; test_ptx_path_is_refused_off_triton_36 checks the refusal)")
@pytest.mark.parametrize("activation", ("fp16", "bf16", "fp4"))
def test_hmma_kernel_compiles_for_sm90_with_the_fragment_layout(compile_for_sm90, activation):
    """Every PTX variant (N_TILES 1 / 2, 1 / 2 / 4 / 8 warps), with and without divisibility: a cubin,
    m16n8k16 mma.sync, no local memory, and the asm's operands in exactly the fragment layout."""
    variants = [(activation, n_tiles, warps, True) for n_tiles in (1, 2) for warps in (1, 2, 4, 8)]
    out = compile_for_sm90(_aot_variants_script(variants))
    assert "FAIL" not in out, out
    assert f"compiled {2 * len(variants)}" in out, out


def test_hmma_triton_twin_compiles_for_sm90(compile_for_sm90):
    """USE_PTX=False (backend="triton" on a GPU): the pure-Triton step compiles too, without the asm.  (Its
    local memory, a stack of a few KB in Triton 3.6, is not checked: it is the reference, not the fast path.)"""
    out = compile_for_sm90(_aot_variants_script([("bf16", 2, 4, False), ("fp4", 1, 2, False)]))
    assert "FAIL" not in out, out
    assert "compiled 4" in out, out


# The JIT's own specialization of real calls: what the op layer launches on sm_90 for gemv's arguments
# (tests/aot.py), typed and marked by Triton's specialize_impl as the JIT does, integers equal to 1 made
# constants; then compiled and checked like the variants above.
_AOT_JIT_CALLS = r'''
import json
import torch
from aot import Sm90Launch
from operands import random_activation, random_fp4

failures, report = [], {}
for label, m, k, L, act, n in CALLS:
    batch = (L,) if L > 1 else ()
    a = random_fp4((*batch, m, k), "nvfp4", "swizzled", seed=1, device="cpu")
    if act == "fp4":
        b = random_fp4((*batch, n, k), "nvfp4", "linear", seed=2, device="cpu")
    else:
        dtype = dict(fp16=torch.float16, bf16=torch.bfloat16)[act]
        b = random_activation((k,) if n == "vector" else (n, k), dtype, seed=2, device="cpu")
    launch = Sm90Launch(a, b, kernel="hmma")
    const = launch.constexprs
    _, spec_const, _, marked = launch.specialization()
    kernel = launch.compile()
    failures += check(kernel, label, const["WARPS"], const["N_TILES"], True)
    report[label] = dict(marked=marked, constants=sorted(c for c in spec_const if c not in const))
print("\n".join(failures))
print("REPORT " + json.dumps(report))
'''

_JIT_CALLS = [  # label, M, K, L, activation, N
    ("k16384-fp16-n3", 256, 16384, 1, "fp16", 3),
    ("k192-fp16-n1", 40, 192, 1, "fp16", 1),
    ("k192-bf16-vector-l2", 40, 192, 2, "bf16", "vector"),
    ("k192-fp4-n9-l2", 40, 192, 2, "fp4", 9),
    ("k320-fp4-n16", 24, 320, 1, "fp4", 16),
]


@pytest.mark.skipif(not hmma_gemv.PTX_LAYOUT_VERIFIED, reason="the PTX path runs on Triton 3.6 only (its operand "
                    "layout differs on others; test_ptx_path_is_refused_off_triton_36 checks the refusal)")
def test_hmma_kernel_compiles_with_the_jits_specialization(compile_for_sm90):
    """What the JIT compiles for real calls (K = 16384: every stride divisible; K = 192: a row stride of 24
    words and 16-byte aligned pointers only) has the fragment layout, mma.sync and no local memory."""
    out = compile_for_sm90(f"CALLS = {_JIT_CALLS!r}\n" + _AOT_COMMON + _AOT_JIT_CALLS)
    assert "FAIL" not in out, out
    report = json.loads(out.split("REPORT ", 1)[1])
    assert set(report) == {c[0] for c in _JIT_CALLS}
    assert {"a_ptr", "b_ptr", "K", "a_stride_m"} <= set(report["k16384-fp16-n3"]["marked"])
    for label in ("k192-fp16-n1", "k192-bf16-vector-l2", "k192-fp4-n9-l2"):
        assert "a_ptr" in report[label]["marked"] and "a_stride_m" not in report[label]["marked"], report[label]
    assert {"N", "c_stride_n"} <= set(report["k192-fp16-n1"]["constants"])  # N = 1, contiguous out


# --- GPU ------------------------------------------------------------------------------------------------

GPU_CONFIGS = (None, HmmaConfig(1), HmmaConfig(2), HmmaConfig(4), HmmaConfig(8))


def _config_id(c):
    return "default" if c is None else f"w{c.warps}"


def _both_backends_within_bound(a, b, config=None, out_dtype=torch.float32):
    """PTX and the pure-Triton twin, each within the bound of the exact result (not bit for bit: they sum in
    different orders); returns the PTX result."""
    results = {}
    for backend in ("triton-ptx", "triton"):
        got = gemv(a, b, out=poisoned(result_shape(a, b), out_dtype), out_dtype=out_dtype, backend=backend,
                   kernel="hmma", config=config)
        assert not torch.isnan(got).any(), backend
        assert_matches_exact(got, a, b, out_dtype, tensor_cores=True)
        results[backend] = got
    return results["triton-ptx"]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=_config_id)
@pytest.mark.parametrize("activation, n", [(torch.float16, 16), (torch.float16, 1), (torch.bfloat16, 5),
                                           (torch.bfloat16, "vector"), ("fp4", 3), ("fp4", 9), ("fp4", 16)],
                         ids=dtype_name)
def test_hmma_ptx_and_triton_within_bound(activation, n, config):
    a, b = build_case("nvfp4", activation, n, "swizzled", (2432, 4608, 2), True, seed=len(str(n)))
    _both_backends_within_bound(a, b, config)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(s.m, s.k, s.l) for s in task.BENCHMARK_SHAPES] + [(2432, 4608, 2)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", (torch.float16, torch.bfloat16, "fp4"), ids=dtype_name)
def test_hmma_matches_exact_on_task_shapes(shape, activation):
    """The default configuration on the task's shapes, N = 1, 2, 8, 16 (2, 8, 16 for NVFP4: N = 1 is w4a4's),
    both backends, both out dtypes."""
    m, k, L = shape
    a = random_fp4((L, m, k), "nvfp4", "swizzled", seed=sum(shape))
    for n in (1, 2, 8, 16) if activation != "fp4" else (2, 8, 16):
        if activation == "fp4":  # the other scale layout; global scales on both for even n
            gs = n % 2 == 0
            b = random_fp4((L, n, k), "nvfp4", "linear", seed=n, global_scale=0.375 if gs else None)
            a = FP4Tensor(a.data, a.scales, "nvfp4", "swizzled", 1.5 if gs else None)
        else:
            b = random_activation((L, n, k), activation, seed=n)
        for out_dtype in (torch.float32, torch.bfloat16 if activation == torch.bfloat16 else torch.float16):
            _both_backends_within_bound(a, b, out_dtype=out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("activation, n", [(torch.float16, 16), (torch.bfloat16, 1), ("fp4", 3), ("fp4", 9)],
                         ids=dtype_name)
@pytest.mark.parametrize("shape, config", [((208, 320, 3), None), ((208, 320, 3), HmmaConfig(2)),
                                           ((208, 320, 3), HmmaConfig(4)), ((256, 192, 1), None),
                                           ((256, 192, 1), HmmaConfig(1)), ((256, 192, 1), HmmaConfig(8))],
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else _config_id(x))
def test_hmma_tails_on_gpu(activation, n, shape, config):
    """Tail rows (208 = 13 x 16, a last swizzle tile of 80 rows), partial last steps and idle warps (K = 320,
    192) through the compiled code, both layouts mixed."""
    for layout in LAYOUTS:
        a, b = build_case("nvfp4", activation, n, layout, shape, layout == "linear", seed=shape[1] + len(str(n)))
        _both_backends_within_bound(a, b, config)


@pytest.mark.gpu
def test_hmma_reads_a_k_strided_activation_on_gpu():
    """An activation strided along K (copied to a contiguous one before the launch), batched a."""
    a = random_fp4((2, 2432, 4608), "nvfp4", "swizzled", seed=3)
    x = random_activation((4608, 6), torch.float16, seed=4).t()
    got = _both_backends_within_bound(a, x)
    assert torch.equal(got, gemv(a, x.contiguous(), out_dtype=torch.float32, kernel="hmma"))


@pytest.mark.gpu
def test_hmma_one_hot_k_order_on_gpu():
    """The K-order check of test_hmma_kernel_k_order_matches_the_activation through the compiled PTX."""
    m, k = 256, 512
    a = _distinct_weights(m, k, seed=2).with_scale_layout("swizzled").to("cuda")
    expected = _one_hot_expected(a.to("cpu"), m, k).to("cuda")
    for activation, config in itertools.product((torch.float16, torch.bfloat16, "fp4"), GPU_CONFIGS):
        x = one_hot_activation(k, 16, activation).to("cuda")
        for backend in ("triton-ptx", "triton"):
            got = gemv(a, x, out_dtype=torch.float32, backend=backend, kernel="hmma", config=config)
            assert torch.equal(got, expected), (activation, config, backend)


def test_ptx_path_is_refused_off_triton_36(monkeypatch):
    """On a Triton whose asm operand layout is not the verified one, dispatch skips hmma's PTX path with the
    reason (the next kernel runs), naming it refuses, and the pure-Triton twin still runs."""
    monkeypatch.setattr(hmma_gemv, "PTX_LAYOUT_VERIFIED", False)
    a = random_fp4((128, 64), "nvfp4", "swizzled", seed=1, device="cpu")
    x = torch.randn(9, 64, dtype=torch.float16)
    case = ops.gemv_operands(a, x, torch.empty(128, 9)).case
    assert choose_kernel(case, SM90).name == "weight_only"  # which leaves N > 8 to hmma where hmma runs
    with pytest.raises(ValueError, match=r"kernel: 'hmma' cannot run .*: its PTX step reads operands in Triton "
                                         r"3.6's register layout \(verified for 3.6 only\)"):
        choose_kernel(case, SM90, "hmma")
    assert choose_kernel(case, dataclasses.replace(SM90, mode="triton")).name == "hmma"
