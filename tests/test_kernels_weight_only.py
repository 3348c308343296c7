"""The weight-only tensor-core kernel (kernels/weight_only.py) against the exact oracle.

Its cases: NVFP4 or MXFP4 weights (K a multiple of 32) times fp16/bf16 activations (N = 1..16, or a [K]
vector) or activations of the same FP4 format (N = 2..16), in the modes fold (NVFP4), k32 (MXFP4) and split
(either, N <= 4).  The tests call ``weight_only.launch`` on ``GemvOperands`` built as ``fp4gemv.gemv`` builds
them (``_operands``).  On a CPU-only machine the pure-Triton twin (``_step_triton``) runs in Triton's
interpreter; it reads the weights and their scales through the same per-thread pointers, step offsets and tail
masks as the PTX and writes the same accumulator elements, so the interpreter exercises the kernel's indexing:
the per-thread row and scale pointers of every mode, both scale layouts, tail rows, partial last steps, odd
scale-column counts, N padding, both n-tiles, the split mode's K owners and the epilogue.  The PTX itself is
checked offline by emulating its decode (every code in every position) and its e8m0 decode (every byte), and by
sm_90 compiles of real launches (fragment layout, load widths, loads at the top of the step, no local memory);
``gpu`` tests run it.

The bound (``_bound``) is the tensor-core kernel's of tests/test_kernels_hmma.py: every product enters fp32
exactly (the module docstring of weight_only.py), then each term passes through at most K additions along K and
the mma's, up to 7 sums over warps, 3 over K owners (split), one ``fma`` by its block's scale (k32, split) and
two roundings for the global scales: n = K + 24 >= K + 13 operations of unit roundoff 2^-23 (truncation
allowed), with the underflow term n * 2^-149 * max(1, 2^f * gs) for the kernel's fold 2^-f
(``_mma_step.fold_exponent``), half an ulp of the output and the oracle's own error.
"""

import importlib
import itertools
import json

import numpy as np
import pytest
import torch
from test_kernels_gemv import (
    DEVICE,
    MIN_SUBNORMAL,
    SIGNIFICAND_BITS,
    build_case,
    poisoned,
    random_activation,
    random_fp4,
    result_shape,
    values,
)

from fp4gemv import FP4Tensor, formats
from fp4gemv.kernels import _mma_step, weight_only
from fp4gemv.kernels._common import GemvOperands
from fp4gemv.kernels.weight_only import WeightOnlyConfig
from fp4gemv.reference import gemv_reference, quantized_gemv_reference

gm = vars(importlib.import_module("fp4gemv.gemv"))  # the module (the package re-exports its function gemv)


def _operands(a, b, out):
    """``GemvOperands`` as ``fp4gemv.gemv`` builds them (``gemv._launch``): byte views with a batch dimension."""
    batch = gm["_batch"](a) or gm["_batch"](b) or 1
    a_data = gm["_batched"](a.data, batch, 3)
    sfa, sfa_addressing = gm["_scale_operand"](a, batch)
    if isinstance(b, FP4Tensor):
        b_data = gm["_batched"](b.data, batch, 3)
        sfb, sfb_addressing = gm["_scale_operand"](b, batch)
        gsb = b.global_scale
    else:
        b_data = gm["_batched"](b, batch, 3).contiguous().view(torch.uint8)
        sfb = sfb_addressing = gsb = None
    c = out
    if len(b.shape) == 1:
        c = c.unsqueeze(-1)
    if c.dim() == 2:
        c = c.unsqueeze(0)
    return GemvOperands(a_data, sfa, sfa_addressing, b_data, sfb, sfb_addressing, c, a.global_scale, gsb)


def _activation_dtype(b):
    return None if isinstance(b, FP4Tensor) else b.dtype


def run(a, b, out, config, use_ptx=False):
    """``weight_only.launch`` on gemv's views of (a, b) into ``out``; asserts that the kernel supports them."""
    ops = _operands(a, b, out)
    kw = dict(scale_block=a.fmt.block_size, k=a.k, activation_dtype=_activation_dtype(b))
    assert weight_only.supports(ops, **kw, split=config.split), "the case is one the kernel supports"
    weight_only.launch(ops, **kw, config=config, use_ptx=use_ptx)
    return out


def _fold(a, b, config):
    act = "fp4" if isinstance(b, FP4Tensor) else {torch.float16: "f16", torch.bfloat16: "bf16"}[b.dtype]
    return _mma_step.fold_exponent(a.fmt.name, act, weight_only.mode(a.fmt.block_size, config))


def _bound(a, b, out_dtype, got, fold):
    """The module docstring's bound on |got - exact|, elementwise."""
    b_abs = values(b).abs()
    magnitude = gemv_reference(values(a).abs(), b_abs[None, :] if b_abs.dim() == 1 else b_abs, torch.float64)
    if b_abs.dim() == 1:
        magnitude = magnitude[..., 0]
    n = a.k + 24
    gs = 1.0
    for t in (a, b):
        if isinstance(t, FP4Tensor) and t.global_scale is not None:
            gs *= abs(float(t.global_scale))
    fp32 = 1.01 * n * 2.0**-23 * magnitude + n * 2.0**-149 * max(1.0, 2.0**fold * gs)
    oracle = (a.k + 3) * 2.0**-53 * magnitude
    _, exponent = torch.frexp(got.to(torch.float64).abs())
    ulp = torch.exp2((exponent - SIGNIFICAND_BITS[out_dtype]).to(torch.float64))
    ulp = torch.where(got == 0, 0.0, ulp).clamp(min=MIN_SUBNORMAL[out_dtype])
    return fp32 + oracle + ulp / 2


def _within(got, a, b, out_dtype, fold):
    exact = quantized_gemv_reference(a, b, torch.float64)
    got64 = got.to(torch.float64)
    return torch.isfinite(got64) & ((got64 - exact).abs() <= _bound(a, b, out_dtype, got, fold))


def assert_matches_exact(got, a, b, out_dtype, fold):
    ok = _within(got, a, b, out_dtype, fold)
    if not ok.all():
        exact = quantized_gemv_reference(a, b, torch.float64)
        bad = (~ok).nonzero()[:5].tolist()
        detail = [(i, got[tuple(i)].item(), exact[tuple(i)].item()) for i in bad]
        raise AssertionError(f"{int((~ok).sum())} of {got.numel()} outputs off the exact result; first: {detail}")


# --- every format x activation x mode x N, against the exact result (interpreter on a CPU) ---------------

# ((M, K, L), config) cycled through the cases.  Every M leaves tail rows; K is a multiple of 32, not always of
# 64 (odd MXFP4 scale-column counts: 3, 5, 15, 90); steps are warps * chunks * 128 elements.
SHAPE_CONFIGS = (
    ((40, 192, 2), WeightOnlyConfig(2, 2, 1)),  # one partial step (192 of 256): warp 1 half past K; L = 2
    ((24, 320, 1), WeightOnlyConfig(1, 2, 1)),  # a full step, then 64 elements (warp 1 idle)
    ((136, 96, 1), WeightOnlyConfig(2, 1, 1)),  # a second 128-row scale tile, tail 8 rows; 3 MXFP4 columns
    ((56, 512, 2), WeightOnlyConfig(1, 2, 2)),  # two chunks per warp: exactly one full step
    ((24, 160, 2), WeightOnlyConfig(1, 1, 1)),  # 160 = 128 + 32: 5 MXFP4 columns
    ((24, 2880, 1), WeightOnlyConfig(1, 4, 1)),  # gpt-oss's K: 5 full steps of 512, a tail of 320; 90 columns
    ((72, 480, 1), WeightOnlyConfig(4, 2, 1)),  # 4 tiles (64 rows): tail program of 8 rows; 15 MXFP4 columns
    ((24, 2048, 1), WeightOnlyConfig(1, 16, 1)),  # 16 warps along K: one full step
)
FORMATS = ("nvfp4", "mxfp4")
LAYOUTS = ("linear", "swizzled")
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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


def _name(x):
    return str(x).replace("torch.", "")


def _case_id(case):
    fmt, activation, n, layout, out_dtype, shape, cfg, gs = case
    return (f"{fmt}-{_name(activation)}-n{n}-{layout}-{_name(out_dtype)}-{'x'.join(map(str, shape))}-"
            f"t{cfg.tiles}w{cfg.warps}c{cfg.chunks}{'-split' if cfg.split else ''}{'-gs' if gs else ''}")


@pytest.mark.parametrize("fmt, activation, n, layout, out_dtype, shape, config, global_scales", CASES,
                         ids=[_case_id(c) for c in CASES])
def test_weight_only_matches_exact_result(fmt, activation, n, layout, out_dtype, shape, config, global_scales):
    a, b = build_case(fmt, activation, n, layout, shape, global_scales, seed=sum(shape) + len(str(n)))
    out = poisoned(result_shape(a, b), out_dtype)
    got = run(a, b, out, config)
    assert not torch.isnan(got).any(), "some outputs were not written"
    assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), out_dtype, _fold(a, b, config))


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
    run(a, x, out, WeightOnlyConfig(2, 1, 1))
    assert_matches_exact(out.cpu(), a.to("cpu"), x.to("cpu"), torch.float32, _fold(a, x, WeightOnlyConfig()))
    assert torch.isnan(backing[:, :, 1::2]).all(), "wrote outside out"
    a2 = random_fp4((40, 128), "nvfp4", "linear", seed=8)
    b2 = random_fp4((2, 4, 128), "nvfp4", "swizzled", seed=9, global_scale=3.0)
    cfg = WeightOnlyConfig(1, 2, 1, split=True)
    got = run(a2, b2, poisoned((2, 40, 4), torch.float16), cfg)
    assert_matches_exact(got.cpu(), a2.to("cpu"), b2.to("cpu"), torch.float16, _fold(a2, b2, cfg))


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


def _one_hot_activation(k, n, activation, fmt):
    """[L = K / n, n, K]: batch l, row i is 1 at element n * l + i, else 0."""
    L = k // n
    hot = torch.zeros(L, n, k)
    hot[torch.arange(L)[:, None], torch.arange(n)[None, :], n * torch.arange(L)[:, None] + torch.arange(n)] = 1
    if activation != "fp4":
        return hot.to(activation)
    block = formats.FORMATS[fmt].block_size
    encode = formats.encode_e4m3 if fmt == "nvfp4" else formats.encode_e8m0
    scales = encode(torch.ones(L, n, k // block))
    return FP4Tensor(formats.pack_e2m1(formats.encode_e2m1(hot)), scales, fmt, "linear").with_scale_layout(
        "swizzled")


@pytest.mark.parametrize("fmt, activation, n, config", [
    ("nvfp4", torch.float16, 16, WeightOnlyConfig(2, 2, 1)),
    ("nvfp4", "fp4", 16, WeightOnlyConfig(1, 1, 1)),
    ("nvfp4", torch.bfloat16, 4, WeightOnlyConfig(1, 1, 1, split=True)),
    ("mxfp4", torch.bfloat16, 16, WeightOnlyConfig(2, 1, 1)),
    ("mxfp4", "fp4", 16, WeightOnlyConfig(1, 2, 1)),
    ("mxfp4", torch.float16, 4, WeightOnlyConfig(2, 1, 1, split=True)),
    ("mxfp4", "fp4", 4, WeightOnlyConfig(1, 1, 1, split=True)),
], ids=lambda x: x if isinstance(x, str) else _name(x) if not isinstance(x, tuple) else
   f"t{x.tiles}w{x.warps}{'s' if x.split else ''}")
def test_weight_only_k_order_matches_the_activation(fmt, activation, n, config):
    """One-hot activation rows pick single weights: output (l, m, i) is weight (m, n l + i), exactly (a K order
    that differs between weights and activation, a wrong block's scale or a wrong K owner picks another)."""
    m, k = 16 * config.tiles, 128
    a = _distinct_weights(m, k, fmt, seed=k).with_scale_layout("swizzled")
    x = _one_hot_activation(k, n, activation, fmt)
    got = run(a.to(DEVICE), x.to(DEVICE), poisoned((k // n, m, n), torch.float32), config).cpu()
    expected = a.dequantize(torch.float32).reshape(m, k // n, n).permute(1, 0, 2)
    wrong = (got != expected).nonzero()[:5].tolist()
    assert not wrong, [(i, got[tuple(i)].item(), expected[tuple(i)].item()) for i in wrong]


def test_distinct_weights_tell_every_two_positions_apart():
    for fmt in FORMATS:
        w = _distinct_weights(32, 128, fmt, seed=128).dequantize(torch.float64)
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
    assert _within(got, a, b, torch.float32, fold).all()
    data = a.data.clone()
    rows = torch.arange(0, 128, 7)
    data[rows] = (data[rows] >> 4) | (data[rows] << 4)  # neighbouring elements swapped along whole rows
    assert not _within(got, FP4Tensor(data, a.scales, "mxfp4", "swizzled"), b, torch.float32, fold)[rows].any()
    lin = a.linear_scales().clone()
    lin[:, 1:] = a.linear_scales()[:, :-1]  # scales one block off
    assert (~_within(got, FP4Tensor(a.data, lin, "mxfp4"), b, torch.float32, fold)).float().mean() > 0.9
    assert (~_within(got, a, b.flip(0), torch.float32, fold)[:, [0, 2]]).float().mean() > 0.9, "activation rows"


# --- what the kernel supports, and its configurations -----------------------------------------------------


def _supports(a, b, split=False):
    out = torch.empty(result_shape(a, b))
    return weight_only.supports(_operands(a, b, out), scale_block=a.fmt.block_size, k=a.k,
                                activation_dtype=_activation_dtype(b), split=split)


def test_supports_states_formats_ns_and_alignment():
    for fmt in FORMATS:
        a = random_fp4((48, 96), fmt, "linear", seed=1, device="cpu")
        assert _supports(a, random_activation((16, 96), torch.float16, seed=2, device="cpu"))
        assert _supports(a, random_activation((96,), torch.bfloat16, seed=2, device="cpu"))
        assert not _supports(a, random_activation((3, 96), torch.float32, seed=2, device="cpu"))  # fp32
        assert _supports(a, random_activation((4, 96), torch.float16, seed=2, device="cpu"), split=True)
        assert not _supports(a, random_activation((5, 96), torch.float16, seed=2, device="cpu"), split=True)
        assert _supports(a, random_fp4((2, 96), fmt, "swizzled", seed=3, device="cpu"))
        assert not _supports(a, random_fp4((1, 96), fmt, "swizzled", seed=3, device="cpu"))  # N = 1: w4a4.py's
    nv = random_fp4((48, 48), "nvfp4", "linear", seed=1, device="cpu")  # K = 48: not a multiple of 32
    assert not _supports(nv, random_activation((2, 48), torch.float16, seed=2, device="cpu"))
    # packed rows 8 (not 16) bytes apart: MXFP4's k32 mode (4-byte loads) takes them, 16-byte loads do not
    for fmt, k32_ok in (("nvfp4", False), ("mxfp4", True)):
        a = random_fp4((48, 96), fmt, "linear", seed=1, device="cpu")
        data = torch.zeros(48, 48 + 8, dtype=torch.uint8)[:, :48]
        data.copy_(a.data)
        skewed = FP4Tensor(data, a.scales, fmt, "linear")
        x = random_activation((2, 96), torch.float16, seed=2, device="cpu")
        assert _supports(skewed, x) == k32_ok and not _supports(skewed, x, split=True)
    # a float activation whose rows are not 16-byte aligned
    a = random_fp4((48, 96), "nvfp4", "linear", seed=1, device="cpu")
    x = torch.zeros(2, 96 + 4, dtype=torch.float16)[:, 4:]
    ops = GemvOperands(a.data[None], *gm["_scale_operand"](a, 1), x.view(torch.uint8)[None], None, None,
                       torch.empty(1, 48, 2))
    assert not weight_only.supports(ops, scale_block=16, k=96, activation_dtype=torch.float16)


def test_default_config_is_valid_for_every_shape():
    for m, k, L, n, fmt in itertools.product((16, 200, 1024, 2880, 4096, 7168, 28672), (32, 96, 2880, 4096, 16384),
                                             (1, 8), (1, 2, 3, 8, 16), FORMATS):
        cfg = weight_only.default_config(m, k, L, n, fmt, "f16", 132)
        weight_only.check_config(cfg, n)
        assert cfg.warps * cfg.chunks * 128 <= max(128, k) or cfg.chunks == 1, (m, k, cfg)  # no idle warps
        assert cfg.warps * 128 <= max(128, k), (m, k, cfg)


@pytest.mark.parametrize("config, n", [(WeightOnlyConfig(3, 4, 1), 1), (WeightOnlyConfig(2, 32, 1), 1),
                                       (WeightOnlyConfig(2, 6, 1), 1), (WeightOnlyConfig(2, 4, 4), 1),
                                       (WeightOnlyConfig(2, 4, 1, split=True), 5)], ids=str)
def test_check_config_names_what_is_wrong(config, n):
    with pytest.raises(ValueError, match="config"):
        weight_only.check_config(config, n)


# --- the PTX, emulated ------------------------------------------------------------------------------------


def _emulate(lines, regs):
    """Run the integer PTX of the decoders (shl, shr, and, or, prmt, mul.hi, mad.lo, mov on .b32/.u32)."""
    def value(x):
        return regs[x] if x in regs else int(x, 0)

    for line in lines:
        op, args = line.rstrip(";").split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        v = [value(a) for a in src]
        if op == "shl.b32":
            regs[dst] = (v[0] << v[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[dst] = v[0] >> v[1]
        elif op == "and.b32":
            regs[dst] = v[0] & v[1]
        elif op == "or.b32":
            regs[dst] = v[0] | v[1]
        elif op == "mov.b32":
            regs[dst] = v[0]
        elif op == "mul.hi.u32":
            regs[dst] = (v[0] * v[1]) >> 32
        elif op == "mad.lo.u32":
            regs[dst] = (v[0] * v[1] + v[2]) & 0xFFFFFFFF
        elif op == "prmt.b32":  # bytes of {b, a}, selected by the four low nibbles of c (no sign mode used)
            pool = (v[1] << 32 | v[0]).to_bytes(8, "little")
            assert all((v[2] >> (4 * i)) & 8 == 0 for i in range(4))
            regs[dst] = int.from_bytes(bytes(pool[(v[2] >> (4 * i)) & 7] for i in range(4)), "little")
        else:
            raise AssertionError(op)
    return regs


def _words():
    g = torch.Generator().manual_seed(0)
    words = [int(w) & 0xFFFFFFFF for w in torch.randint(-2**31, 2**31, (200,), generator=g)]
    words += [sum(c << (4 * i) for i in range(8)) for c in range(16)]  # every code in every position
    return words + [0x76543210, 0xFEDCBA98, 0x89ABCDEF]


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=_name)
def test_decode_ptx_places_every_code(dtype):
    """The decoders on words covering every code in every position: pair i of a word is (e_i, e_{i+4}), each
    half the 16-bit float of the e2m1 value times 2^-14 (fp16) or 2^-126 (bf16), what the exactness argument
    and the K order rely on."""
    mul = dict(_mma_step.MULTIPLIERS)
    for w in _words():
        regs = {"w": w, **mul}
        pairs = ("p0", "p1", "p2", "p3")
        if dtype == torch.float16:
            _emulate(_mma_step.decode_word_f16("w", pairs, "t", "u", "m29"), regs)
            fold = 2.0**-14
        else:
            _emulate(_mma_step.decode_word_bf16("w", pairs, "t", "u", {m: m for m in mul}), regs)
            fold = 2.0**-126
        for i, reg in enumerate(pairs):
            halves = torch.tensor([regs[reg] & 0xFFFF, regs[reg] >> 16], dtype=torch.int32).to(torch.int16)
            got = halves.view(dtype).double()
            codes = [(w >> (4 * i)) & 15, (w >> (4 * (i + 4))) & 15]
            expected = formats.decode_e2m1(torch.tensor(codes)).double() * fold
            assert torch.equal(got, expected), (hex(w), i, got, expected)


def test_e8m0_ptx_decodes_every_byte():
    """``_Step.e8m0`` (shift into the exponent, max with 2^-127, inf * 0 + inf) on all 256 bytes, in float32
    as the GPU computes it: 2^(byte - 127), byte 0 the subnormal 2^-127, byte 255 NaN."""
    step = _mma_step._Step(_mma_step.StepSpec("mxfp4", "f16", "k32", 1, 1, 1, 4, 4, False),
                           _mma_step._Operands(2, 2, [(m, "r") for m in _mma_step.MULTIPLIERS]))
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


# --- compiled for the GPU without one ---------------------------------------------------------------------

# Compiles real launches ahead of time for sm_90 (Triton's bundled ptxas) as the JIT specializes them
# (conftest's jit_specialization), and checks what the asm relies on: its operands are [2 tiles, 32 warps]
# tensors with element e in registers and thread t = lane + 32 warp on dimension 1 (the asm computes the
# fragment layout from that), the step's loads have the widths the design needs, every load of a full step is
# issued before its first mma (what puts a step's bytes in flight), and no local memory.
_AOT = r'''
import importlib, os, re, subprocess, sys, tempfile, json
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp4gemv import FP4Tensor
import fp4gemv.kernels.weight_only as wo
gm = importlib.import_module("fp4gemv.gemv")
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
real = wo.weight_only_gemv_kernel
calls = []


class Recorder:
    def __getitem__(self, grid):
        return lambda *args, **kw: calls.append((args, kw))


def fp4(fmt, *shape, layout="swizzled"):
    *batch, rows, k = shape
    block = 16 if fmt == "nvfp4" else 32
    scales = torch.full((*batch, rows, k // block), 0x38 if block == 16 else 127, dtype=torch.uint8)
    t = FP4Tensor(torch.zeros(*batch, rows, k // 2, dtype=torch.uint8), scales, fmt, "linear")
    return t.with_scale_layout(layout)


wo.weight_only_gemv_kernel = Recorder()
report, failures = {}, []
for label, fmt, m, k, L, act, n, cfg in CASES:
    a = fp4(fmt, *((L,) if L > 1 else ()), m, k)
    if act == "fp4":
        b = fp4(fmt, *((L,) if L > 1 else ()), n, k, layout="linear")
        sfb, sfb_ad = gm._scale_operand(b, L)
        b_bytes, dtype = gm._batched(b.data, L, 3), None
    else:
        dtype = dict(f16=torch.float16, bf16=torch.bfloat16)[act]
        b = torch.zeros(L, n, k, dtype=dtype)
        sfb = sfb_ad = None
        b_bytes = b.view(torch.uint8)
    sfa, sfa_ad = gm._scale_operand(a, L)
    from fp4gemv.kernels._common import GemvOperands
    ops = GemvOperands(gm._batched(a.data, L, 3), sfa, sfa_ad, b_bytes, sfb, sfb_ad, torch.empty(L, m, n))
    config = wo.WeightOnlyConfig(*cfg)
    assert wo.supports(ops, scale_block=a.fmt.block_size, k=k, activation_dtype=dtype, split=config.split), label
    calls.clear()
    wo.launch(ops, scale_block=a.fmt.block_size, k=k, activation_dtype=dtype, config=config, use_ptx=True)
    (args, kw), = calls
    sig, const, attrs, marked = jit_specialization(real, args, kw)
    kernel = triton.compile(ASTSource(real, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=kw["num_warps"], num_stages=1, launch_pdl=kw["launch_pdl"],
                                         ptx_options=kw["ptx_options"]))
    bad = []
    ttgir = kernel.asm["ttgir"]
    asm_lines = [l for l in ttgir.splitlines() if "tt.elementwise_inline_asm" in l and "mma.sync" in l]
    warps, tiles = kw["WARPS"], kw["TILES"]
    want = ("#ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [1, 32], warpsPerCTA = [1, %d], "
            "order = [1, 0]}>" % warps)
    aliases = dict(re.findall(r"^(#[\w.]+) = (.*)$", ttgir, re.M))
    for line in asm_lines:  # the full and the tail step
        for shape, layout in re.findall(r"tensor<(\w+?)x(?:f32|i64|i32), (#[\w.]+)>", line):
            if shape != "%dx%d" % (2 * tiles, 32 * warps) or aliases.get(layout) != want:
                bad.append("asm operand %s %s" % (shape, aliases.get(layout)))
    if len(asm_lines) != 2:
        bad.append("%d asm steps" % len(asm_lines))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    os.remove(f.name)
    if "LOCAL:0" not in usage or "STACK:0" not in usage:
        bad.append("local memory: " + usage.strip().splitlines()[-1])
    instrs = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)
    targets = [(int(t.group(1), 16), int(a, 16)) for a, op, r in instrs if op == "BRA"
               for t in [re.search(r"0x([0-9a-f]+)", r)] if t]
    loops = [(t, a) for t, a in targets if t < a]
    lo, hi = max(loops, key=lambda x: x[1] - x[0])
    body = [(op, r) for a, op, r in instrs if lo <= int(a, 16) <= hi]
    loads = [op for op, _ in body if op.startswith("LDG")]
    first_mma = next(i for i, (op, _) in enumerate(body) if op.startswith("HMMA"))
    early = [op for op, _ in body[:first_mma] if op.startswith("LDG")]
    early = {op: early.count(op) for op in set(early)}
    mma = sum(1 for op, _ in body if op.startswith("HMMA"))
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    report[label] = dict(loads={op: loads.count(op) for op in set(loads)}, n_loads=len(loads), early=early, mma=mma,
                         regs=regs, marked=marked)
    failures += ["FAIL %s: %s" % (label, x) for x in bad]
print("\n".join(failures))
print("REPORT " + json.dumps(report))
'''

# (label, fmt, M, K, L, activation, N, (tiles, warps, chunks, split)): every mode and activation, K = 16384
# (every stride divisible by 16) and K = 2880 / 96 (not), both n-tiles.
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
        assert r["regs"] <= 168, (label, r)
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


def _both_within_bound(a, b, config, out_dtype=torch.float32):
    """PTX and the twin, each within the bound of the exact result (they sum in different orders)."""
    for use_ptx in (True, False):
        got = run(a, b, poisoned(result_shape(a, b), out_dtype), config, use_ptx=use_ptx)
        assert not torch.isnan(got).any(), use_ptx
        assert_matches_exact(got, a, b, out_dtype, _fold(a, b, config))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, activation, n, config", [
    (fmt, act, n, cfg) for fmt in FORMATS for act in (torch.float16, torch.bfloat16, "fp4")
    for n, cfg in (((2 if act == "fp4" else 1), WeightOnlyConfig(2, 4, 1, split=True)),
                   (4, WeightOnlyConfig(4, 4, 2, split=True)), (3, WeightOnlyConfig(1, 8, 1)),
                   (16, WeightOnlyConfig(2, 4, 1)), (9, WeightOnlyConfig(4, 2, 2)))
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
        x = _one_hot_activation(k, n, activation, fmt).to("cuda")
        if n not in expected:
            expected[n] = a.to("cpu").dequantize(torch.float32).reshape(m, k // n, n).permute(1, 0, 2).cuda()
        for use_ptx in (True, False):
            got = run(a, x, poisoned((k // n, m, n), torch.float32), config, use_ptx=use_ptx)
            assert torch.equal(got, expected[n]), (activation, n, config, use_ptx)
