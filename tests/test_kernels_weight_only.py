"""The weight-only tensor-core kernel (kernels/weight_only.py) against the exact oracle, and where it is chosen.

Its cases: NVFP4 or MXFP4 weights (K a multiple of 32) times fp16/bf16 activations (N = 1..16, or a [K]
vector) or activations of the same FP4 format (N = 2..16), in the modes fold (NVFP4), k32 (MXFP4) and split
(either, N <= 4), through ``gemv(..., backend="triton", kernel="weight_only", config=WeightOnlyConfig(...))``.
On a CPU-only machine the pure-Triton twin (``_step_triton``) runs in Triton's interpreter; it reads the weights
and their scales through the same per-thread pointers, step offsets and tail masks as the PTX and writes the
same accumulator elements, so the interpreter exercises the kernel's indexing: the per-thread row and scale
pointers of every mode, both scale layouts, tail rows, partial last steps, odd scale-column counts, N padding,
both n-tiles, the split mode's K owners and the epilogue.  The PTX itself is checked offline by emulating its
decode (every code in every position) and its e8m0 decode (every byte), and by sm_90 compiles of what gemv
launches (tests/aot.py: fragment layout, load widths, loads at the top of the step, no local memory); ``gpu``
tests run it, including bf16 activations at both ends of the range the split and k32 modes are exact in.

The bound is the tensor-core kernels' of tests/test_kernels_hmma.py (``operands.error_bound(...,
tensor_cores=True, fold=...)``): every product enters fp32 exactly (weight_only.py's docstring), then each term
passes through at most K additions along K and the mma's, up to 15 sums over warps, 3 over K owners (split), one
``fma`` by its block's scale (k32, split) and two roundings for the global scales: n = K + 24 operations of
unit roundoff 2^-23 (truncation allowed), with the underflow term n * 2^-149 * max(1, 2^f * gs) for the kernel's
fold 2^-f (``_mma_step.fold_exponent``), half an ulp of the output and the oracle's own error.
"""

import dataclasses
import itertools
import json

import numpy as np
import pytest
import torch
from operands import (
    DEVICE,
    LAYOUTS,
    OUT_DTYPES,
    accumulator_fold,
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

from fp4gemv import FP4Tensor, dequantize, formats, gemv, ops
from fp4gemv.kernels import _mma_step, _ptx, choose_kernel, hmma_gemv
from fp4gemv.kernels.hmma_gemv import HmmaConfig
from fp4gemv.kernels.weight_only import WeightOnly, WeightOnlyConfig, weight_only_config
from fp4gemv.ops import gemv_operands
from fp4gemv.target import SM90


FORMATS = ("nvfp4", "mxfp4")


def run(a, b, out, config, backend="triton"):
    """gemv on the weight-only kernel with ``config`` into ``out``."""
    got = gemv(a, b, out=out, out_dtype=out.dtype, backend=backend, kernel="weight_only", config=config)
    assert got is out
    return out


def _fold(a, b, config):
    return accumulator_fold(ops.plan_for(a, b, backend="triton", kernel="weight_only", config=config))


def _exact(got, a, b, out_dtype, config):
    assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), out_dtype, tensor_cores=True, fold=_fold(a, b, config))


# --- every format x activation x mode x N, against the exact result (interpreter on a CPU) ---------------

# ((M, K, L), config) cycled through the cases.  Every M leaves tail rows; K is a multiple of 32, not always of
# 64 (odd MXFP4 scale-column counts: 3, 5, 15, 45); steps are warps * chunks * 128 elements.
SHAPE_CONFIGS = (
    ((40, 192, 2), WeightOnlyConfig(2, 2, 1)),  # one partial step (192 of 256): warp 1 half past K; L = 2
    ((24, 320, 1), WeightOnlyConfig(1, 2, 1)),  # a full step, then 64 elements (warp 1 idle)
    ((136, 96, 1), WeightOnlyConfig(2, 1, 1)),  # a second 128-row scale tile, tail 8 rows; 3 MXFP4 columns
    ((56, 512, 2), WeightOnlyConfig(1, 2, 2)),  # two chunks per warp: exactly one full step
    ((24, 160, 2), WeightOnlyConfig(1, 1, 1)),  # 160 = 128 + 32: 5 MXFP4 columns
    ((24, 1440, 1), WeightOnlyConfig(1, 4, 1)),  # 2 full steps of 512, a tail of 416; 45 MXFP4 columns
    ((72, 480, 1), WeightOnlyConfig(4, 2, 1)),  # 4 tiles (64 rows): tail program of 8 rows; 15 MXFP4 columns
    ((24, 2048, 1), WeightOnlyConfig(1, 16, 1)),  # 16 warps along K: one full step
)


def _ns(activation, split):
    if activation == "fp4":
        return (2, 3, 4) if split else (2, 9, 16)
    return (1, 2, 4, "vector") if split else (1, 3, 9, 16, "vector")


CASES = []
for fmt, activation, split in itertools.product(FORMATS, ("fp4", torch.float16, torch.bfloat16), (False, True)):
    for n in _ns(activation, split):
        i = len(CASES)
        shape, cfg = SHAPE_CONFIGS[i % len(SHAPE_CONFIGS)]
        CASES.append((fmt, activation, n, LAYOUTS[i % 2], OUT_DTYPES[i % 3], shape, cfg._replace(split=split),
                      (i // 2) % 2 == 1))


def _case_id(case):
    fmt, activation, n, layout, out_dtype, shape, cfg, gs = case
    return (f"{fmt}-{dtype_name(activation)}-n{n}-{layout}-{dtype_name(out_dtype)}-{'x'.join(map(str, shape))}-"
            f"t{cfg.tiles}w{cfg.warps}c{cfg.chunks}{'-split' if cfg.split else ''}{'-gs' if gs else ''}")


@pytest.mark.parametrize("fmt, activation, n, layout, out_dtype, shape, config, global_scales", CASES,
                         ids=[_case_id(c) for c in CASES])
def test_weight_only_matches_exact_result(fmt, activation, n, layout, out_dtype, shape, config, global_scales):
    a, b = build_case(fmt, activation, n, layout, shape, global_scales, seed=sum(shape) + len(str(n)))
    got = run(a, b, poisoned(result_shape(a, b), out_dtype), config)
    assert not torch.isnan(got).any(), "some outputs were not written"
    _exact(got, a, b, out_dtype, config)


def test_cases_cover_every_mode_shape_and_layout():
    for fmt, activation in itertools.product(FORMATS, ("fp4", torch.float16, torch.bfloat16)):
        mine = [c for c in CASES if c[:2] == (fmt, activation)]
        assert {c[6].split for c in mine} == {False, True}
        assert {c[3] for c in mine} == set(LAYOUTS) and {c[7] for c in mine} == {False, True}
    assert {(c[5], c[6]._replace(split=False)) for c in CASES} == set(SHAPE_CONFIGS)
    assert {c[2] for c in CASES} >= {1, 2, 3, 4, 9, 16, "vector"}
    for (m, k, L), cfg in SHAPE_CONFIGS:
        assert k % 32 == 0 and m % (16 * cfg.tiles)
    steps = {k % (cfg.warps * cfg.chunks * 128) for (_, k, _), cfg in SHAPE_CONFIGS}
    assert 0 in steps and len(steps) > 2  # full steps only, and partial last steps of several lengths
    assert {k // 32 % 2 for (_, k, _), _ in SHAPE_CONFIGS} == {0, 1}  # odd MXFP4 scale-column counts


def test_weight_only_broadcasts_batch_and_writes_strided_out():
    """A batched a times an unbatched activation into a strided out, and the other broadcast."""
    a = random_fp4((2, 40, 192), "mxfp4", "swizzled", seed=6, global_scale=0.5)
    x = random_activation((5, 192), torch.bfloat16, seed=7)
    backing = poisoned((5, 2, 80), torch.float32)
    out = backing[:, :, ::2].permute(1, 2, 0)  # [2, 40, 5], no unit stride
    cfg = WeightOnlyConfig(2, 1, 1)
    run(a, x, out, cfg)
    _exact(out, a, x, torch.float32, cfg)
    assert torch.isnan(backing[:, :, 1::2]).all(), "wrote outside out"
    a2 = random_fp4((40, 128), "nvfp4", "linear", seed=8)
    b2 = random_fp4((2, 4, 128), "nvfp4", "swizzled", seed=9, global_scale=3.0)
    cfg = WeightOnlyConfig(1, 2, 1, split=True)
    _exact(run(a2, b2, poisoned((2, 40, 4), torch.float16), cfg), a2, b2, torch.float16, cfg)


# --- the K order and the scales' blocks, exactly ---------------------------------------------------------


def _distinct_weights(m, k, fmt, seed):
    """[m, k]: row r holds code (j + r * (2 * (j // 16) + 1)) % 16 at position j: each position runs through all
    16 codes over the rows, and two positions differ in some row (within 16 elements in every row; else the
    difference changes with r), so do their values (equal only for the two zeros, codes 0 and 8); random
    scales tell blocks apart too (``test_distinct_weights_tell_every_two_positions_apart``)."""
    j = torch.arange(k)
    codes = (j[None, :] + torch.arange(m)[:, None] * (2 * (j[None, :] // 16) + 1)) % 16
    scales = random_fp4((m, k), fmt, "linear", seed=seed, device="cpu").scales
    return FP4Tensor(formats.pack_e2m1(codes), scales, fmt, "linear")


@pytest.mark.parametrize("fmt, activation, n, config", [
    ("nvfp4", torch.float16, 16, WeightOnlyConfig(2, 2, 1)),
    ("nvfp4", "fp4", 16, WeightOnlyConfig(1, 1, 1)),
    ("nvfp4", torch.bfloat16, 4, WeightOnlyConfig(1, 1, 1, split=True)),
    ("mxfp4", torch.bfloat16, 16, WeightOnlyConfig(2, 1, 1)),
    ("mxfp4", "fp4", 16, WeightOnlyConfig(1, 2, 1)),
    ("mxfp4", torch.float16, 4, WeightOnlyConfig(2, 1, 1, split=True)),
    ("mxfp4", "fp4", 4, WeightOnlyConfig(1, 1, 1, split=True)),
], ids=lambda x: x if isinstance(x, str) else dtype_name(x) if not isinstance(x, tuple) else
   f"t{x.tiles}w{x.warps}{'s' if x.split else ''}")
def test_weight_only_k_order_matches_the_activation(fmt, activation, n, config):
    """One-hot activation rows pick single weights: output (l, m, i) is weight (m, n l + i), exactly (a K order
    that differs between weights and activation, a wrong block's scale or a wrong K owner picks another)."""
    m, k = 16 * config.tiles, 128
    a = _distinct_weights(m, k, fmt, seed=k).with_scale_layout("swizzled")
    x = one_hot_activation(k, n, activation, fmt)
    got = run(a.to(DEVICE), x.to(DEVICE), poisoned((k // n, m, n), torch.float32), config).cpu()
    expected = dequantize(a, torch.float32).reshape(m, k // n, n).permute(1, 0, 2)
    wrong = (got != expected).nonzero()[:5].tolist()
    assert not wrong, [(i, got[tuple(i)].item(), expected[tuple(i)].item()) for i in wrong]


def test_distinct_weights_tell_every_two_positions_apart():
    for fmt in FORMATS:
        w = dequantize(_distinct_weights(32, 128, fmt, seed=128), torch.float64)
        differ = (w[:, :, None] != w[:, None, :]).any(0)
        assert (differ | torch.eye(128, dtype=torch.bool)).all(), fmt


# --- the bound cannot pass a wrong kernel ---------------------------------------------------------------


def test_bound_rejects_plausible_bugs():
    """The kernel's correct output, checked against the exact result of a slightly wrong operand, fails."""
    a, b = build_case("mxfp4", torch.float16, 3, "swizzled", (128, 128, 1), False, seed=9)
    cfg = WeightOnlyConfig(1, 1, 1)
    got = run(a, b, poisoned((128, 3), torch.float32), cfg).cpu()
    a, b = a.to("cpu"), b.to("cpu")
    fold = _fold(a, b, cfg)

    def ok(a, b):
        return within_bound(got, a, b, torch.float32, tensor_cores=True, fold=fold)

    assert ok(a, b).all()
    data = a.data.clone()
    rows = torch.arange(0, 128, 7)
    data[rows] = (data[rows] >> 4) | (data[rows] << 4)  # neighbouring elements swapped along whole rows
    assert not ok(FP4Tensor(data, a.scales, "mxfp4", "swizzled"), b)[rows].any()
    lin = a.linear_scales().clone()
    lin[:, 1:] = a.linear_scales()[:, :-1]  # scales one block off
    assert (~ok(FP4Tensor(a.data, lin, "mxfp4"), b)).float().mean() > 0.9
    assert (~ok(a, b.flip(0))[:, [0, 2]]).float().mean() > 0.9, "activation rows"


# --- what the kernel runs, where the dispatcher chooses it, and its configurations ------------------------


def _why_not(a, b):
    return WeightOnly().why_not(gemv_operands(a, b, torch.empty(result_shape(a, b))).case, SM90)


def _skewed(t):
    """``t`` with its packed rows 8 (not 16) bytes apart beyond their length."""
    data = torch.zeros(t.data.shape[0], t.data.shape[1] + 8, dtype=torch.uint8)[:, :t.data.shape[1]]
    data.copy_(t.data)
    return FP4Tensor(data, t.scales, t.fmt, t.scale_layout)


def test_why_not_states_formats_ns_and_alignment():
    for fmt in FORMATS:
        a = random_fp4((48, 96), fmt, "linear", seed=1, device="cpu")
        for b in (random_activation((16, 96), torch.float16, seed=2, device="cpu"),
                  random_activation((96,), torch.bfloat16, seed=2, device="cpu"),
                  random_fp4((2, 96), fmt, "swizzled", seed=3, device="cpu")):
            assert _why_not(a, b) is None
        assert "fp16 or bf16" in _why_not(a, random_activation((3, 96), torch.float32, seed=2, device="cpu"))
        assert "N = 1 go to w4a4" in _why_not(a, random_fp4((1, 96), fmt, "swizzled", seed=3, device="cpu"))
    nv = random_fp4((48, 48), "nvfp4", "linear", seed=1, device="cpu")
    assert "K a multiple of 32, got K = 48" in _why_not(nv, random_activation((2, 48), torch.float16, seed=2,
                                                                                device="cpu"))
    # packed rows 8 (not 16) bytes apart: MXFP4's k32 mode (4-byte loads) takes them, but not split
    x = random_activation((2, 96), torch.float16, seed=2, device="cpu")
    nv, mx = (_skewed(random_fp4((48, 96), fmt, "linear", seed=1, device="cpu")) for fmt in FORMATS)
    assert "a: needs data rows at multiples of 16 bytes, got 8-byte" in _why_not(nv, x)
    assert _why_not(mx, x) is None
    plan = ops.plan_for(mx, x, backend="triton")
    assert (plan.spec.name, plan.config.split) == ("weight_only", False)  # k32, not the default split
    with pytest.raises(ValueError, match="config: split reads 16-byte rows"):
        gemv(mx, x, backend="triton", kernel="weight_only", config=WeightOnlyConfig(split=True))
    # a float activation whose rows are not 16-byte aligned is read from an aligned copy
    a = random_fp4((48, 96), "nvfp4", "linear", seed=1, device="cpu")
    x = torch.zeros(2, 96 + 4, dtype=torch.float16)[:, 4:]
    assert "b: needs rows contiguous along K at 16-byte" in _why_not(a, x)
    plan = ops.plan_for(a, x, backend="triton")
    assert plan.spec.name == "weight_only" and plan.copy_activation


def _kind(kind, n, k=128, m=48):
    fmt = {"nv": "nvfp4", "mx": "mxfp4"}[kind.split("-")[0]]
    a = random_fp4((m, k), fmt, "swizzled", seed=1, device="cpu")
    if kind.endswith("fp4"):
        return a, random_fp4((n, k), fmt, "linear", seed=2, device="cpu")
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[kind.split("-")[1]]
    return a, random_activation((k,) if n == "vector" else (n, k), dtype, seed=2, device="cpu")


# The dispatch the measurements ask for (docs/performance.md, v9): weight_only for fp16/bf16 activations with
# N <= 8 and FP4 activations with 2 <= N <= 8, for MXFP4 at every N (the general kernel is the only other);
# NVFP4 with N > 8 on hmma.  K = 96 (not a multiple of 64): hmma cannot run it, so weight_only keeps N > 8.
DISPATCH = [
    *((f"{fmt}-{act}", n, 128, "weight_only") for fmt in ("nv", "mx") for act in ("f16", "bf16")
      for n in (1, 2, 5, 8, "vector")),
    *((f"{fmt}-fp4", n, 128, "weight_only") for fmt in ("nv", "mx") for n in (2, 3, 8)),
    *((f"mx-{act}", n, 128, "weight_only") for act in ("f16", "bf16", "fp4") for n in (9, 16)),
    *((f"nv-{act}", n, 128, "hmma") for act in ("f16", "bf16", "fp4") for n in (9, 16)),
    ("nv-f16", 16, 96, "weight_only"), ("nv-fp4", 9, 96, "weight_only"),
    ("nv-fp4", 1, 128, "w4a4"), ("mx-fp4", 1, 128, "w4a4"), ("nv-f32", 3, 128, "general"),
    ("mx-f32", 1, 128, "general"), ("nv-bf16", 3, 48, "general"),
]


@pytest.mark.parametrize("kind, n, k, expected", DISPATCH, ids=str)
def test_dispatch_follows_the_measurements(kind, n, k, expected):
    a, b = _kind(kind, n, k)
    case = gemv_operands(a, b, torch.empty(result_shape(a, b))).case
    # hmma's PTX path runs on Triton 3.6 only (hmma_gemv.PTX_LAYOUT_VERIFIED); its twin runs everywhere.
    on_ptx = "weight_only" if expected == "hmma" and not hmma_gemv.PTX_LAYOUT_VERIFIED else expected
    assert choose_kernel(case, SM90).name == on_ptx
    assert ops.select_kernel(a, b, backend="triton").name == expected  # the interpreter target chooses alike
    if expected == "hmma":  # still runs them when named
        assert ops.plan_for(a, b, backend="triton", kernel="weight_only").spec.name == "weight_only"


# Measured best configurations (docs/performance.md, v9; bf16, H200, 132 SMs): (M, K, L, N) -> (tiles, warps,
# chunks) that the rule must give.  Where the best was within 3% of another configuration the rule's choice
# may be that one (7168 x 16384, N = 1: 4 tiles x 16 warps 29.0 us, 1 x 8 29.4 us; 28672 x 8192, N = 1:
# 2 x 8 48.0 us, 4 x 4 48.9 us).
MEASURED_BEST = {
    (7168, 16384, 1, 1): (1, 8, 1), (4096, 7168, 8, 1): (4, 4, 1), (4096, 4096, 1, 1): (1, 8, 2),
    (14336, 4096, 1, 1): (1, 4, 1), (28672, 8192, 1, 1): (4, 4, 1), (1024, 4096, 1, 1): (1, 16, 2),
    (4096, 14336, 1, 1): (1, 16, 1), (5760, 2880, 1, 1): (1, 8, 1), (2880, 2880, 1, 1): (1, 8, 2),
    (7168, 16384, 1, 8): (1, 8, 1), (4096, 7168, 8, 8): (1, 2, 1), (4096, 4096, 1, 8): (1, 8, 2),
    (14336, 4096, 1, 8): (1, 4, 1), (28672, 8192, 1, 8): (1, 2, 1), (1024, 4096, 1, 8): (1, 8, 2),
    (4096, 14336, 1, 8): (1, 16, 1), (5760, 2880, 1, 8): (1, 8, 1), (2880, 2880, 1, 8): (1, 8, 2),
}


def _case_like(m, k, L, n, fmt="nvfp4", act=torch.bfloat16):
    """A GemvCase of these sizes (metadata only: built small, then resized)."""
    a = random_fp4((48, 128), fmt, "swizzled", seed=1, device="cpu")
    b = random_fp4((2, 128), fmt, "swizzled", seed=2, device="cpu") if act == "fp4" else \
        random_activation((2, 128), act, seed=2, device="cpu")
    return dataclasses.replace(gemv_operands(a, b, torch.empty(48, 2)).case, m=m, k=k, batch=L, n=n)


@pytest.mark.parametrize("shape", sorted(MEASURED_BEST), ids=lambda s: "x".join(map(str, s)))
def test_default_config_is_the_measured_best(shape):
    for fmt in FORMATS:
        cfg = weight_only_config(_case_like(*shape, fmt=fmt), SM90.sm_count)
        assert (cfg.tiles, cfg.warps, cfg.chunks) == MEASURED_BEST[shape], (fmt, cfg)
        assert cfg.split == (shape[3] <= 2) and not cfg.pdl and cfg.loads_first


def test_default_config_is_valid_for_every_shape():
    for m, k, L, n, fmt, act in itertools.product((16, 200, 1024, 2880, 4096, 7168, 28672),
                                                  (32, 96, 2880, 4096, 16384), (1, 8), (1, 2, 3, 8, 16), FORMATS,
                                                  (torch.float16, "fp4")):
        if act == "fp4" and n == 1:
            continue
        case = _case_like(m, k, L, n, fmt, act)
        cfg = weight_only_config(case, SM90.sm_count)
        WeightOnly().check_config(cfg, case)
        assert cfg.warps * 128 <= max(128, k), (m, k, cfg)  # no warp wholly past K
        assert cfg.chunks == 1 or cfg.warps * 256 <= k, (m, k, cfg)  # two chunks only with a full step


@pytest.mark.parametrize("config, n", [(WeightOnlyConfig(3, 4, 1), 1), (WeightOnlyConfig(2, 32, 1), 1),
                                       (WeightOnlyConfig(2, 6, 1), 1), (WeightOnlyConfig(2, 4, 4), 1),
                                       (WeightOnlyConfig(2, 4, 1, split=True), 5)], ids=str)
def test_bad_config_is_a_value_error_before_writing(config, n):
    a, b = _kind("nv-f16", n)
    out = poisoned(result_shape(a, b), torch.float16, device="cpu")
    with pytest.raises(ValueError, match="config"):
        gemv(a, b, out=out, backend="triton", kernel="weight_only", config=config)
    assert torch.isnan(out).all()


def test_another_kernels_config_is_a_type_error():
    a, b = _kind("nv-bf16", 3)
    with pytest.raises(TypeError, match="config: expected a WeightOnlyConfig for kernel 'weight_only', got Hmma"):
        gemv(a, b, backend="triton", config=HmmaConfig(2))


# --- the PTX, emulated ------------------------------------------------------------------------------------


def _words():
    g = torch.Generator().manual_seed(0)
    words = [int(w) & 0xFFFFFFFF for w in torch.randint(-2**31, 2**31, (200,), generator=g)]
    words += [sum(c << (4 * i) for i in range(8)) for c in range(16)]  # every code in every position
    return words + [0x76543210, 0xFEDCBA98, 0x89ABCDEF]


def _assert_pairs(regs, pairs, w, dtype, fold):
    """Each register of ``pairs`` holds (e_i, e_{i+4}) of checkpoint word ``w`` in ``dtype``, times ``fold``."""
    for i, reg in enumerate(pairs):
        halves = torch.tensor([regs[reg] & 0xFFFF, regs[reg] >> 16], dtype=torch.int32).to(torch.int16)
        got = halves.view(dtype).double()
        codes = [(w >> (4 * i)) & 15, (w >> (4 * (i + 4))) & 15]
        expected = formats.decode_e2m1(torch.tensor(codes)).double() * fold
        assert torch.equal(got, expected), (hex(w), i, got, expected)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=dtype_name)
def test_decode_ptx_places_every_code(dtype):
    """The decoders on words covering every code in every position: pair i of a word is (e_i, e_{i+4}), each
    half the 16-bit float of the e2m1 value times 2^-14 (fp16) or 2^-126 (bf16), what the exactness argument
    and the K order rely on."""
    mul = dict(_mma_step.MULTIPLIERS)
    for w in _words():
        regs = {"w": w, **mul}
        pairs = ("p0", "p1", "p2", "p3")
        if dtype == torch.float16:
            emulate_ptx(_ptx.decode_word_f16("w", pairs, "t", "u", "m29"), regs)
            fold = 2.0**-14
        else:
            emulate_ptx(_mma_step.decode_word_bf16("w", pairs, "t", "u", {m: m for m in mul}), regs)
            fold = 2.0**-126
        _assert_pairs(regs, pairs, w, dtype, fold)


@pytest.mark.parametrize("act", ("f16", "bf16", "fp4"))
def test_native_decode_ptx_places_every_code(act):
    """The native-order decoders (``_mma_step.decode_native_bf16`` / ``_f16``) on the words of
    ``test_decode_ptx_places_every_code`` reordered by ``formats.reorder_codes``, with the multipliers a launch
    passes (``_mma_step.multipliers``): the same pairs (e_i, e_{i+4}) as the checkpoint order's decoders give."""
    values = _mma_step.multipliers(act, "native")
    assert values != _mma_step.multipliers(act, "checkpoint")
    decode = _mma_step.decode_native_bf16 if act == "bf16" else _mma_step.decode_native_f16
    dtype, fold = (torch.bfloat16, 2.0**-126) if act == "bf16" else (torch.float16, 2.0**-14)
    words = _words()
    packed = torch.tensor([[(w >> (8 * j)) & 0xFF for j in range(4)] for w in words], dtype=torch.uint8)
    native = formats.reorder_codes(packed, "checkpoint", "native")
    assert torch.equal(formats.reorder_codes(native, "native", "checkpoint"), packed)
    for w, nb in zip(words, native.tolist()):
        regs = {"w": int.from_bytes(bytes(nb), "little"), **values}
        pairs = ("p0", "p1", "p2", "p3")
        emulate_ptx(decode("w", pairs, "t", "u", {m: m for m in values}), regs)
        _assert_pairs(regs, pairs, w, dtype, fold)


def test_native_code_order_fields():
    """``formats.reorder_codes`` puts code j of each half-word at ``NATIVE_CODE_FIELDS[j]`` (the definition
    spelled out on one half-word per code and position), keeps K order across half-words, and refuses an odd
    number of bytes or an unknown order."""
    for j, (mag, sign) in enumerate(formats.NATIVE_CODE_FIELDS):
        for code in range(16):
            half = torch.tensor([[(code << (4 * j)) & 0xFF, (code << (4 * j)) >> 8]], dtype=torch.uint8)
            got = formats.reorder_codes(half, "checkpoint", "native")
            value = int(got[0, 0]) | int(got[0, 1]) << 8
            assert value == (code & 7) << mag | (code >> 3) << sign, (j, code, hex(value))
    data = torch.arange(256, dtype=torch.uint8).reshape(2, 2, 64)
    assert formats.reorder_codes(data[:, :, :32], "native", "native").data_ptr() == data.data_ptr()
    # A non-contiguous view converts like its copy.
    assert torch.equal(formats.reorder_codes(data[:, :, 8:40], "checkpoint", "native"),
                       formats.reorder_codes(data[:, :, 8:40].contiguous(), "checkpoint", "native"))
    with pytest.raises(ValueError, match="K/2 even"):
        formats.reorder_codes(data[..., :3], "checkpoint", "native")
    with pytest.raises(ValueError, match="target: expected one of"):
        formats.reorder_codes(data, "checkpoint", "kernel")


def test_e8m0_ptx_decodes_every_byte():
    """``_Step.e8m0`` (shift into the exponent, max with 2^-127, inf * 0 + inf) on all 256 bytes, in float32
    as the GPU computes it: 2^(byte - 127), byte 0 the subnormal 2^-127, byte 255 NaN."""
    step = _mma_step._Step(_mma_step.StepSpec("mxfp4", "f16", "k32", 1, 1, 1, 4, 4, False),
                           _ptx.AsmOperands(2, 2, [(m, "r") for m in _mma_step.MULTIPLIERS]))
    step.e8m0("raw", "f")
    lines = step.code
    assert lines[0].startswith("shl.b32") and lines[1].startswith("mov.b32") and lines[2].startswith("max.f32")
    assert lines[3].startswith("fma.rn.f32") and len(lines) == 4
    with np.errstate(invalid="ignore", over="ignore"):
        raw = np.arange(256, dtype=np.uint32)
        f = (raw << 23).view(np.float32)
        f = np.maximum(f, np.float32(2.0**-127))  # max.f32 with the constant of line 2
        assert lines[2].endswith("0f00400000;")
        f = f * np.float32(0) + f  # fma.rn.f32 f, f, 0, f (exact here: one of the terms is 0 or NaN)
    expected = formats.decode_e8m0(torch.arange(256, dtype=torch.uint8)).numpy()
    assert np.array_equal(f, expected, equal_nan=True)


def test_bf16_bias_is_exact_inside_its_window_and_overflows_at_2_to_64():
    """The split and k32 modes multiply bf16 activations by the pair ``_Step.bias_bf16`` loads: 2^64 in both
    halves.  In bf16 that product is exact for 2^-70 <= |x| < 2^64 (its smallest and largest bf16 values here)
    and infinite from 2^64 on: the range gemv documents for bf16 activations on this kernel."""
    step = _mma_step._Step(_mma_step.StepSpec("mxfp4", "bf16", "k32", 1, 1, 1, 4, 4, False),
                           _ptx.AsmOperands(2, 2, [(m, "r") for m in _mma_step.MULTIPLIERS]))
    step.bias_bf16(["p"])
    constant = int(step.code[0].split(",")[1].rstrip(";"), 16)
    halves = torch.tensor([constant & 0xFFFF, constant >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    register = step.code[0].split()[1].rstrip(",")
    assert halves.tolist() == [2.0**64, 2.0**64] and step.code[1] == f"mul.rn.bf16x2 p, p, {register};"
    inside = torch.tensor([2.0**-70, -(2.0**-70) * 1.5, 1.0, -(2.0**64 - 2.0**56), 2.0**63 * 1.9921875],
                          dtype=torch.bfloat16)
    biased = inside * torch.tensor(2.0**64, dtype=torch.bfloat16)
    assert torch.equal(biased.double(), inside.double() * 2.0**64)
    assert torch.isinf(torch.tensor([2.0**64, -(2.0**70)], dtype=torch.bfloat16) * 2.0**64).all()
    assert _mma_step.BF16_ACTIVATION_BIAS == 64


# --- compiled for the GPU without one ---------------------------------------------------------------------

# Compiles what gemv launches on sm_90 (tests/aot.py's Sm90Launch, specialized as the JIT does) and checks what
# the asm relies on: its operands are [2 tiles, 32 warps] tensors with element e in registers and thread
# t = lane + 32 warp on dimension 1 (the asm computes the fragment layout from that), the step's loads have the
# widths the design needs, every load of a full step is issued before its first mma (what puts a step's bytes
# in flight), and no local memory.
_AOT = r'''
import json, re
import torch
from aot import Sm90Launch, local_memory, main_loop, registers, sass_listing
from fp4gemv import FP4Tensor
from fp4gemv.kernels.weight_only import WeightOnlyConfig


def fp4(fmt, *shape, layout="swizzled"):
    *batch, rows, k = shape
    block = 16 if fmt == "nvfp4" else 32
    scales = torch.full((*batch, rows, k // block), 0x38 if block == 16 else 127, dtype=torch.uint8)
    t = FP4Tensor(torch.zeros(*batch, rows, k // 2, dtype=torch.uint8), scales, fmt, "linear")
    return t.with_scale_layout(layout)


report, failures = {}, []
for label, fmt, m, k, L, act, n, cfg in CASES:
    batch = (L,) if L > 1 else ()
    a = fp4(fmt, *batch, m, k)
    if act == "fp4":
        b = fp4(fmt, *batch, n, k, layout="linear")
    else:
        b = torch.zeros(*batch, n, k, dtype=dict(f16=torch.float16, bf16=torch.bfloat16)[act])
    launch = Sm90Launch(a, b, out_dtype=torch.float32, kernel="weight_only", config=WeightOnlyConfig(*cfg))
    kernel = launch.compile()
    marked = launch.specialization()[3]
    bad = ["local memory: " + x for x in local_memory(kernel)]
    ttgir = kernel.asm["ttgir"]
    asm_lines = [l for l in ttgir.splitlines() if "tt.elementwise_inline_asm" in l and "mma.sync" in l]
    warps, tiles = launch.constexprs["WARPS"], launch.constexprs["TILES"]
    want = ("#ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [1, 32], warpsPerCTA = [1, %d], "
            "order = [1, 0]}>" % warps)
    aliases = dict(re.findall(r"^(#[\w.]+) = (.*)$", ttgir, re.M))
    for line in asm_lines:  # the full and the tail step
        for shape, layout in re.findall(r"tensor<(\w+?)x(?:f32|i64|i32), (#[\w.]+)>", line):
            if shape != "%dx%d" % (2 * tiles, 32 * warps) or aliases.get(layout) != want:
                bad.append("asm operand %s %s" % (shape, aliases.get(layout)))
    if len(asm_lines) != 2:
        bad.append("%d asm steps" % len(asm_lines))
    body = [op for _, op, _ in main_loop(sass_listing(kernel))]
    loads = [op for op in body if op.startswith("LDG")]
    first_mma = next(i for i, op in enumerate(body) if op.startswith("HMMA"))
    early = [op for op in body[:first_mma] if op.startswith("LDG")]
    report[label] = dict(loads={op: loads.count(op) for op in set(loads)}, early={op: early.count(op) for op in
                         set(early)}, mma=sum(op.startswith("HMMA") for op in body), regs=registers(kernel),
                         marked=marked, options=launch.options)
    failures += ["FAIL %s: %s" % (label, x) for x in bad]
print("\n".join(failures))
print("REPORT " + json.dumps(report))
'''

_AOT_CASES = [
    ("fold-f16-k16384", "nvfp4", 256, 16384, 1, "f16", 3, (2, 4, 1, False)),
    ("fold-bf16-n16-k96", "nvfp4", 40, 96, 2, "bf16", 16, (1, 1, 1, False)),
    ("fold-fp4-k16384", "nvfp4", 256, 16384, 1, "fp4", 8, (2, 4, 1, False)),
    ("split-f16-k16384-c2", "nvfp4", 256, 16384, 1, "f16", 1, (2, 4, 2, True)),
    ("split-bf16-n4", "nvfp4", 256, 4096, 1, "bf16", 4, (4, 4, 1, True)),
    ("split-fp4-mx", "mxfp4", 256, 2880, 1, "fp4", 2, (1, 4, 1, True)),
    ("k32-f16-k2880", "mxfp4", 256, 2880, 1, "f16", 1, (2, 4, 1, False)),
    ("k32-bf16-n16", "mxfp4", 256, 4096, 1, "bf16", 16, (1, 4, 1, False)),
    ("k32-fp4", "mxfp4", 40, 96, 2, "fp4", 9, (1, 1, 1, False)),
    ("split-f16-mx", "mxfp4", 256, 16384, 1, "f16", 2, (2, 4, 1, True)),
    ("split-f16-w16", "nvfp4", 1024, 4096, 1, "f16", 1, (1, 16, 2, True)),
]
# The widths of a full step's loads: 16 bytes (weights, fp16/bf16 activation, FP4 activation outside k32),
# 4 bytes (k32's weight words and FP4 activation words), 2 bytes (NVFP4 scale pairs), 1 byte (e8m0 scales).
_WIDTHS = {"LDG.E.128.CONSTANT": 16, "LDG.E.CONSTANT": 4, "LDG.E.U16.CONSTANT": 2, "LDG.E.U8.CONSTANT": 1}


def test_weight_only_compiles_for_sm90_with_its_operand_layout(compile_for_sm90):
    out = compile_for_sm90(f"CASES = {_AOT_CASES!r}\n" + _AOT)
    assert "FAIL" not in out, out
    report = json.loads(out.split("REPORT ", 1)[1])
    assert set(report) == {c[0] for c in _AOT_CASES}
    for label, fmt, m, k, L, act, n, (tiles, warps, chunks, split) in _AOT_CASES:
        r = report[label]
        step_mode = "split" if split else "fold" if fmt == "nvfp4" else "k32"
        n_tiles = (1 if n <= 2 else 2) if split else (1 if n <= 8 else 2)
        # mma per full step: 8 per tile, chunk and n-tile
        assert r["mma"] == 8 * tiles * chunks * n_tiles, (label, r)
        assert set(r["loads"]) <= set(_WIDTHS), (label, r)
        if step_mode == "k32":  # a 4-byte word per row and block, 8 rows x 16 bytes per warp load
            weights = "LDG.E.CONSTANT"
            assert r["loads"].get(weights, 0) >= 8 * tiles * chunks, (label, r)
        else:  # one 16-byte load per row and chunk (a narrower weight load would show as another width)
            weights = "LDG.E.128.CONSTANT"
            assert r["loads"].get(weights, 0) >= 2 * tiles * chunks, (label, r)
            assert "LDG.E.CONSTANT" not in r["loads"], (label, r)
        # every weight load of the step (and in fold and split every load) before its first mma
        assert r["early"].get(weights) == r["loads"][weights], (label, r)
        if step_mode != "k32":
            assert r["early"] == r["loads"], (label, r)
        # split at N = 4 (not a default: split runs N <= 2) is the largest: 173 since the multiplying decode
        # (decode_word_bf16), 168 before it, while split at N = 1 and 2 went from 120 and 129 to 114 and 126.
        assert r["regs"] <= 176, (label, r)
        assert r["options"] == dict(num_warps=warps, num_stages=1, launch_pdl=False, ptx_options="-O1"), (label, r)
    assert {"a_ptr", "b_ptr", "K", "a_stride_m"} <= set(report["fold-f16-k16384"]["marked"])


_PACK_PROBE = r'''
import triton, triton.language as tl

ASM = tl.constexpr("{\nmov.b32 $0, $8;\nmov.b32 $1, $9;\nmov.b32 $2, $10;\nmov.b32 $3, $11;\n}")


@triton.jit
def probe(out_ptr, P: tl.constexpr, W: tl.constexpr):
    e = tl.arange(0, P)[:, None]
    tid = tl.arange(0, 32 * W)[None, :]
    v = (e * 1000 + 7 + 0 * tid).to(tl.float32)
    r = tl.inline_asm_elementwise(ASM, "=f,=f,=f,=f,0,1,2,3,f,f,f,f", [tl.zeros([P, 32 * W], tl.float32), v],
                                  dtype=tl.float32, is_pure=True, pack=P)
    tl.store(out_ptr + e * (32 * W) + tid, r)
'''

# A @triton.jit function needs a source file: the script writes the probe to one and compiles it.
_AOT_PACK_ORDER = f"PROBE = {_PACK_PROBE!r}\n" + r'''
import importlib.util, os, re, struct, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

path = os.path.join(tempfile.mkdtemp(), "pack_probe.py")
with open(path, "w") as f:
    f.write(PROBE)
spec = importlib.util.spec_from_file_location("pack_probe", path)
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)
ptx = triton.compile(ASTSource(probe.probe, {"out_ptr": "*fp32", "P": "constexpr", "W": "constexpr"},
                               {"P": 4, "W": 4}), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
consts = dict(re.findall(r"mov\.b32\s+(%r\d+), (\d+);", ptx))
asm = ptx[ptx.index("// begin inline asm"):]
inputs = re.findall(r"mov\.b32 %r\d+, (%r\d+);", asm)[:4]
print("ORDER", [struct.unpack("f", struct.pack("I", int(consts[r])))[0] for r in inputs])
'''


def test_asm_pack_is_the_registers_dimension_in_order(compile_for_sm90):
    """The asm's pack of P elements per thread is element e = 0 .. P - 1 of the [P, 32 warps] operand, in order
    (what ``_mma_step`` numbers its operands by): a probe kernel passes e * 1000 + 7 through such an asm."""
    out = compile_for_sm90(_AOT_PACK_ORDER)
    assert "ORDER [7.0, 1007.0, 2007.0, 3007.0]" in out, out


# --- GPU ----------------------------------------------------------------------------------------------------


def _both_within_bound(a, b, config=None, out_dtype=torch.float32):
    """PTX and the twin, each within the bound of the exact result (they sum in different orders)."""
    for backend in ("triton-ptx", "triton"):
        got = gemv(a, b, out=poisoned(result_shape(a, b), out_dtype), out_dtype=out_dtype, backend=backend,
                   kernel="weight_only", config=config)
        assert not torch.isnan(got).any(), backend
        plan = ops.plan_for(a, b, backend=backend, kernel="weight_only", config=config)
        assert_matches_exact(got, a, b, out_dtype, tensor_cores=True, fold=accumulator_fold(plan))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, activation, n, config", [
    (fmt, act, n, cfg) for fmt in FORMATS for act in (torch.float16, torch.bfloat16, "fp4")
    for n, cfg in (((2 if act == "fp4" else 1), WeightOnlyConfig(2, 4, 1, split=True)),
                   (4, WeightOnlyConfig(4, 4, 2, split=True)), (3, WeightOnlyConfig(1, 8, 1)),
                   (16, WeightOnlyConfig(2, 4, 1)), (9, WeightOnlyConfig(4, 2, 2)), (5, None))
], ids=str)
def test_weight_only_ptx_and_twin_within_bound(fmt, activation, n, config):
    for shape, layout in (((2432, 4608, 2), "swizzled"), ((208, 2880, 3), "linear"), ((200, 320, 1), "swizzled")):
        a, b = build_case(fmt, activation, n, layout, shape, layout == "linear", seed=len(str(n)))
        _both_within_bound(a, b, config)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_weight_only_k_order_on_gpu(fmt):
    m, k = 256, 512
    a = _distinct_weights(m, k, fmt, seed=2).with_scale_layout("swizzled").to("cuda")
    expected = {}
    for activation, n, config in itertools.product((torch.float16, torch.bfloat16, "fp4"), (4, 16),
                                                   (WeightOnlyConfig(2, 2, 1), WeightOnlyConfig(1, 4, 1, split=True))):
        if config.split and n > 4:
            continue
        x = one_hot_activation(k, n, activation, fmt).to("cuda")
        if n not in expected:
            expected[n] = dequantize(a.to("cpu"), torch.float32).reshape(m, k // n, n).permute(1, 0, 2).cuda()
        for backend in ("triton-ptx", "triton"):
            got = run(a, x, poisoned((k // n, m, n), torch.float32), config, backend=backend)
            assert torch.equal(got, expected[n]), (activation, n, config, backend)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, config", [("nvfp4", WeightOnlyConfig(1, 4, 1, split=True)),
                                         ("mxfp4", WeightOnlyConfig(1, 4, 1, split=True)),
                                         ("mxfp4", WeightOnlyConfig(2, 2, 1))], ids=str)
def test_bf16_activations_at_the_ends_of_the_window_are_exact_on_gpu(fmt, config):
    """bf16 activations biased by 2^64 (split, k32): one-hot rows whose one value lies in each binade of the
    documented window 2^-70 <= |x| < 2^64, with 1, 2, 8 significant bits, pick weight x value exactly through
    the PTX (below 2^-70 the tensor cores round subnormal products: 2^-71 * 1.5 was off on the H200); a value
    of 2^64 is outside the window and gives no finite result."""
    m, k, n = 64, 512, 4
    a = _distinct_weights(m, k, fmt, seed=3).with_scale_layout("swizzled").to("cuda")
    w = dequantize(a.to("cpu"), torch.float64).reshape(m, k // n, n).permute(1, 0, 2)
    for e in range(-70, 64):
        ends = torch.tensor([2.0**e, -(2.0**e) * 1.5, 2.0**e * 1.9921875, -(2.0**e) * 1.0078125],
                            dtype=torch.bfloat16)
        x = one_hot_activation(k, n, torch.bfloat16, fmt) * ends[None, :, None]  # row i scaled by ends[i]
        got = run(a, x.to("cuda"), poisoned((k // n, m, n), torch.float32), config, backend="triton-ptx").cpu()
        assert torch.equal(got.double(), w * ends.double()[None, None, :]), e
    over = x.clone()
    over[0, 0, 0] = 2.0**64
    got = run(a, over.to("cuda"), poisoned((k // n, m, n), torch.float32), config, backend="triton-ptx").cpu()
    assert not torch.isfinite(got[0, :, 0]).all()


def test_bench_mxfp4_bf16_cases_run_the_weight_only_kernel():
    """``fp4gemv bench --act bf16 --format mxfp4 --n 1,8`` times gemv on the bench's operands, which sm_90
    dispatches to this kernel (the sizes do not enter the choice)."""
    from fp4gemv import bench
    from fp4gemv.bench.cases import _describe_plan

    for n in (1, 8):
        a, b, out = bench.random_gemv_operands(bench.Shape(256, 512, 2, n), "mxfp4", "bf16", seed=0, device="cpu")
        case = gemv_operands(a, b, out).case
        assert choose_kernel(case, SM90).name == "weight_only"
        plan = ops.plan_for(a, b, out=out, backend="triton")
        assert _describe_plan(plan).startswith("weight_only tiles=1,warps=")


_TWIN_AOT = r"""
import dataclasses, torch
from aot import Sm90Launch
from operands import random_activation, random_fp4
from fp4gemv.target import SM90

twin = dataclasses.replace(SM90, mode="triton")
done = 0
for fmt in ("nvfp4", "mxfp4"):
    for act, n in ((torch.float16, 1), (torch.bfloat16, 3), (torch.bfloat16, 16), ("fp4", 2), ("fp4", 8)):
        a = random_fp4((256, 512), fmt, "swizzled", seed=1, device="cpu")
        b = (random_fp4((n, 512), fmt, "linear", seed=2, device="cpu") if act == "fp4"
             else random_activation((n, 512), act, seed=2, device="cpu"))
        launch = Sm90Launch(a, b, kernel="weight_only", target=twin)
        assert launch.constexprs["USE_PTX"] is False
        assert launch.compile().asm["cubin"]
        done += 1
print("compiled", done)
"""


def test_pure_triton_twin_compiles_for_sm90(compile_for_sm90):
    """backend="triton" on a GPU compiles the twin (the interpreter accepts Python that compiled Triton rejects:
    a None in a returned tuple, returns of different types in constexpr branches)."""
    assert "compiled 10" in compile_for_sm90(_TWIN_AOT)
