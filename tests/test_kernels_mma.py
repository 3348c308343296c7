"""The tensor-core kernel (kernels/mma_gemv.py) against the exact oracle, with an error bound for its arithmetic.

Its cases: NVFP4 weights times fp16/bf16 activations (N = 1..16) or NVFP4 activations (N > 1), forced with an
``MmaConfig`` (and reached by the default dispatch).  On a CPU-only machine the pure-Triton decode runs in
Triton's interpreter (conftest sets TRITON_INTERPRET and makes its bf16 dot and multiply compute with numbers),
which exercises the decode, the K order, both scale layouts, masking (tail rows, a partial last K step, N
padding) and the epilogue.  The sm_90 compile runs without a GPU; ``gpu`` tests check the PTX decode bit for
bit against the pure-Triton one, task-sized shapes against the bound, the K order and 16-element K steps
through the compiled code.

The bound (``tensor_cores=True`` in test_kernels_gemv's ``error_bound``).  The weights (and NVFP4
activations) are decoded exactly into fp16/bf16 with their scales folded in, and the tensor cores multiply
exactly, so every term t_k = a_k * b_k enters the fp32 accumulator exactly, scaled by 2^-f (f = 14 for fp16
activations, 7 for bf16, 28 for NVFP4 activations; ``_fold_exponent``).  Unlike the dp4a kernels there are no
separate 16-element block sums: all K products of an output go through one fp32 accumulation, in an order and
with an internal alignment the hardware does not document, possibly truncating rather than rounding.  So count
every addition: a term passes through at most K of them (K - 1 between the products plus the one into the zero
accumulator; fewer with ``ksplit``, whose chunks accumulate apart and are summed at the end), then the epilogue
multiplies by 2^f (exact) and by the global scales (their product and the multiplication: 2 roundings).
n = K + 24 >= K + 2 leaves 22 operations of margin for the tensor cores' internal adder.  Each operation's
relative error is below one ulp: unit roundoff u = 2^-23 (truncation; 2^-24 would be rounding to nearest), so
|s' - s| <= gamma_n * sum_k |t_k| <= 1.01 * n * u * sum_k |t_k|  (gamma_n = n u / (1 - n u) <= 1.01 n u while
n u <= 0.0099, i.e. K up to about 83000).  Underflow: each operation may also be off by one fp32 subnormal step
2^-149 in the accumulator's units, which the fold 2^f and the global scales' product gs scale to
2^(f - 149) * gs in the result's units (and 2^-149 for the epilogue's own roundings): at most
n * 2^-149 * max(1, 2^f * gs) in all.  The one rounding to the output dtype adds half an ulp of the output, and
the float64 oracle is off by at most (K + 3) * 2^-53 * sum_k |t_k|, as in test_kernels_gemv.py.

This bound is about 2 (K + 24) / (K / 16 + 22) times the dp4a kernels' (10x at K = 128, 31x at K = 16384), so a
bug confined to one small-scaled block can hide in it; ``test_mma_bound_rejects_plausible_bugs`` uses bugs that
reach every block, as a K-order bug in this kernel would.
"""

import itertools

import pytest
import torch
from test_kernels_gemv import (
    DEVICE,
    LAYOUTS,
    OUT_DTYPES,
    assert_matches_exact,
    build_case,
    poisoned,
    random_activation,
    random_fp4,
    result_shape,
    within_bound,
)

from fp4gemv import FP4Tensor, formats, gemv, task
from fp4gemv.gemv import _check_config, _is_mma_case
from fp4gemv.kernels import gemv as general_kernel
from fp4gemv.kernels import mma_gemv, w4a4
from fp4gemv.kernels.configs import GemvConfig, MmaConfig, mma_config
from fp4gemv.kernels.gemv_configs import GemvKernelConfig

# The activations of the tensor-core kernel with the N they are tested at: NVFP4 needs N > 1 (N = 1 is w4a4.py's).
ACTIVATION_NS = (
    *(("fp4", n) for n in (2, 3, 16)),
    *((dtype, n) for dtype in (torch.float16, torch.bfloat16) for n in (1, 3, 16, "vector")),
)
# ((M, K, L), config) cycled through the cases.  Rows 16 / 32 leave a tail of 8 rows in every shape.
SHAPE_CONFIGS = (
    ((40, 192, 2), MmaConfig(rows=16, block_k=128, num_warps=1)),  # a partial last step (64 of 128), L = 2
    ((24, 64, 1), MmaConfig(rows=16, block_k=128, num_warps=1)),  # K < block_k: one masked step
    ((136, 128, 1), MmaConfig(rows=32, block_k=128, num_warps=2)),  # 32 rows, 2 warps; a second swizzle row tile
    ((40, 80, 2), MmaConfig(rows=16, block_k=64, num_warps=1)),  # block_k 64: a full step and 16 of the next
)
CASES = [
    (activation, n, layout, out_dtype, *SHAPE_CONFIGS[i % len(SHAPE_CONFIGS)], (i // len(SHAPE_CONFIGS)) % 2 == 1)
    for i, ((activation, n), layout, out_dtype) in enumerate(itertools.product(ACTIVATION_NS, LAYOUTS, OUT_DTYPES))
]


def _name(x):
    return str(x).replace("torch.", "")


def _case_id(c):
    activation, n, layout, out_dtype, shape, cfg, gs = c
    return (f"{_name(activation)}-n{n}-{layout}-{_name(out_dtype)}-{'x'.join(map(str, shape))}-"
            f"r{cfg.rows}k{cfg.block_k}w{cfg.num_warps}{'-gs' if gs else ''}")


@pytest.mark.parametrize("activation, n, layout, out_dtype, shape, config, global_scales", CASES,
                         ids=[_case_id(c) for c in CASES])
def test_mma_kernel_matches_exact_result(activation, n, layout, out_dtype, shape, config, global_scales):
    a, b = build_case("nvfp4", activation, n, layout, shape, global_scales, seed=sum(shape) + len(str(n)))
    assert _is_mma_case(a, b)
    out = poisoned(result_shape(a, b), out_dtype)
    got = gemv(a, b, out=out, out_dtype=out_dtype, backend="triton", config=config)
    assert got is out
    assert not torch.isnan(got).any(), "some outputs were not written"
    assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), out_dtype, tensor_cores=True)


def test_cases_cover_shapes_configs_and_global_scales_for_every_activation():
    for activation in ("fp4", torch.float16, torch.bfloat16):
        seen = {(c[4], c[5], c[6]) for c in CASES if c[0] == activation}
        assert seen == {(s, cfg, gs) for (s, cfg), gs in itertools.product(SHAPE_CONFIGS, (False, True))}
    for activation, n in ACTIVATION_NS:  # every N in both layouts and every out dtype
        assert {(c[2], c[3]) for c in CASES if c[:2] == (activation, n)} == set(itertools.product(LAYOUTS, OUT_DTYPES))


@pytest.mark.parametrize("activation, n", [(torch.float16, 16), (torch.bfloat16, "vector"), ("fp4", 3)])
def test_mma_kernel_with_default_config(activation, n):
    a, b = build_case("nvfp4", activation, n, "swizzled", (200, 192, 2), True, seed=5)
    got = gemv(a, b, out=poisoned(result_shape(a, b), torch.float16), backend="triton")
    assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), torch.float16, tensor_cores=True)


KSPLIT_SHAPE_CONFIGS = (
    ((40, 192, 2), MmaConfig(16, 32, 2, ksplit=2)),  # steps of 2 x 32: three full ones
    ((40, 80, 1), MmaConfig(16, 32, 2, ksplit=2)),  # a partial second step (16 of 64: the second chunk empty)
    ((24, 192, 1), MmaConfig(16, 64, 4, ksplit=4)),  # one step of 4 x 64 > K: the last chunk empty
    ((72, 128, 1), MmaConfig(32, 16, 4, ksplit=4)),  # 16-element chunks
)


@pytest.mark.parametrize("shape, config", KSPLIT_SHAPE_CONFIGS, ids=lambda x: "x".join(map(str, x[:3])))
@pytest.mark.parametrize("activation, n", [("fp4", 3), (torch.float16, 16), (torch.bfloat16, "vector")], ids=_name)
def test_mma_kernel_with_ksplit(activation, n, shape, config):
    """``ksplit`` chunks side by side per step (a batched dot), summed at the end."""
    a, b = build_case("nvfp4", activation, n, "swizzled", shape, True, seed=sum(shape))
    got = gemv(a, b, out=poisoned(result_shape(a, b), torch.float32), out_dtype=torch.float32, backend="triton",
               config=config)
    assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), torch.float32, tensor_cores=True)


def test_mma_kernel_broadcasts_batch_and_handles_strides():
    """A batched a times an unbatched, K-strided activation into a strided out; and the other broadcast."""
    a = random_fp4((2, 40, 192), "nvfp4", "swizzled", seed=6, global_scale=0.5)
    x = random_activation((192, 5), torch.bfloat16, seed=7).t()  # [5, 192], K not contiguous
    backing = poisoned((5, 2, 80), torch.float32)
    out = backing[:, :, ::2].permute(1, 2, 0)  # [2, 40, 5], no unit stride
    got = gemv(a, x, out=out, out_dtype=torch.float32, backend="triton", config=MmaConfig(16, 128, 1))
    assert got is out
    assert_matches_exact(got.cpu(), a.to("cpu"), x.to("cpu"), torch.float32, tensor_cores=True)
    assert torch.isnan(backing[:, :, 1::2]).all(), "wrote outside out"
    a2 = random_fp4((40, 128), "nvfp4", "linear", seed=8)
    b2 = random_fp4((2, 4, 128), "nvfp4", "swizzled", seed=9, global_scale=3.0)
    got = gemv(a2, b2, out=poisoned((2, 40, 4), torch.float16), backend="triton", config=MmaConfig(32, 64, 2))
    assert_matches_exact(got.cpu(), a2.to("cpu"), b2.to("cpu"), torch.float16, tensor_cores=True)


# --- the kernel's K order is the activation's ------------------------------------------------------------


def _distinct_weights(m, k, seed):
    """NVFP4 [m, k]: row r holds code (j + 3 * (j // 16) + r) % 16 at position j, so the 16 codes of each
    block of a row are all different (equal values only for the pair of zeros, codes 0 and 8); random scales,
    which tell blocks apart (``test_distinct_weights_tell_every_two_positions_apart``)."""
    j = torch.arange(k)
    codes = (j[None, :] + 3 * (j[None, :] // 16) + torch.arange(m)[:, None]) % 16
    scales = random_fp4((m, k), "nvfp4", "linear", seed=seed, device="cpu").scales
    return FP4Tensor(formats.pack_e2m1(codes), scales, "nvfp4", "linear")


def _one_hot_activation(k, activation):
    """[L = K / 16, 16, K]: batch l, row n is 1 at element 16 l + n, else 0."""
    L = k // 16
    hot = torch.zeros(L, 16, k)
    hot[torch.arange(L)[:, None], torch.arange(16)[None, :], 16 * torch.arange(L)[:, None] + torch.arange(16)] = 1
    if activation != "fp4":
        return hot.to(activation)
    codes = formats.encode_e2m1(hot)  # 1.0 is code 2
    scales = formats.encode_e4m3(torch.ones(L, 16, k // 16))
    return FP4Tensor(formats.pack_e2m1(codes), scales, "nvfp4", "linear").with_scale_layout("swizzled")


@pytest.mark.parametrize("activation", (torch.float16, torch.bfloat16, "fp4"), ids=_name)
@pytest.mark.parametrize("k, config", [(192, MmaConfig(16, 128, 1)), (64, MmaConfig(16, 32, 1)),
                                       (128, MmaConfig(32, 64, 2)), (192, MmaConfig(16, 32, 2, ksplit=2))],
                         ids=["k192-bk128", "k64-bk32", "k128-bk64", "k192-bk32-ks2"])
def test_mma_kernel_k_order_matches_the_activation(activation, k, config):
    """One-hot activation rows pick single weights: output (l, m, n) is weight (m, 16 l + n), exactly.

    The kernel reorders K within each group of 8 for the tensor cores (``_decode_scaled`` / ``permute_k``);
    any mismatch between the weights' order and the activation's, or a scale applied to the wrong block,
    picks another weight, and every other weight of a row has another value (``_distinct_weights``)."""
    m = 32
    a = _distinct_weights(m, k, seed=k).with_scale_layout("swizzled")  # seeds as in the premise's test
    x = _one_hot_activation(k, activation)
    got = gemv(a.to(DEVICE), x.to(DEVICE), out=poisoned((k // 16, m, 16), torch.float32), out_dtype=torch.float32,
               backend="triton", config=config).cpu()
    weights = a.dequantize(torch.float32)  # exact: e2m1 x e4m3, no global scale
    expected = weights.reshape(m, k // 16, 16).permute(1, 0, 2)  # [l, m, n] = weight (m, 16 l + n)
    wrong = (got != expected).nonzero()[:5].tolist()
    assert not wrong, [(i, got[tuple(i)].item(), expected[tuple(i)].item()) for i in wrong]


@pytest.mark.parametrize("m, k, seed", [(32, 192, 192), (32, 64, 64), (32, 128, 128), (256, 512, 2)])
def test_distinct_weights_tell_every_two_positions_apart(m, k, seed):
    """The premise of the K-order tests: for any two positions along K, some row holds different values, so
    reading one in place of the other changes an output."""
    w = _distinct_weights(m, k, seed=seed).dequantize(torch.float64)
    differ = (w[:, :, None] != w[:, None, :]).any(0)
    assert (differ | torch.eye(k, dtype=torch.bool)).all()


# --- the bound cannot pass a wrong kernel ---------------------------------------------------------------


def _swap_nibbles(t, rows):
    """Neighbouring elements swapped along the whole of some rows.  (Swapping them in one block only, as
    test_kernels_gemv does, can stay within this looser bound when that block's scales are small.)"""
    data = t.data.clone()
    data[..., rows, :] = (data[..., rows, :] >> 4) | (data[..., rows, :] << 4)
    return FP4Tensor(data, t.scales, t.fmt, t.scale_layout, t.global_scale)


def _shift_scales(t):
    """Each row's scales moved one block along K (the first block reuses its own): an off-by-one."""
    lin = t.linear_scales().clone()
    lin[..., 1:] = t.linear_scales()[..., :-1]
    return FP4Tensor(t.data, lin, t.fmt, "linear", t.global_scale)


@pytest.mark.parametrize("activation", ("fp4", torch.float16, torch.bfloat16), ids=_name)
def test_mma_bound_rejects_plausible_bugs(activation):
    """The kernel's correct output, checked against the exact result of a slightly wrong operand, fails."""
    a, b = build_case("nvfp4", activation, 3, "swizzled", (128, 128, 1), False, seed=9)
    got = gemv(a, b, out_dtype=torch.float32, backend="triton", config=MmaConfig(16, 128, 1)).cpu()
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


@pytest.fixture
def launches(monkeypatch):
    """Stub the three kernels' launches; returns the list of (kernel, config) they were called with."""
    calls = []
    for module, name, key in ((mma_gemv, "launch_mma_gemv", "mma"), (general_kernel, "launch_gemv", "general"),
                              (w4a4, "launch_w4a4", "w4a4")):
        monkeypatch.setattr(module, name, lambda *args, _key=key, **kw: calls.append((_key, kw["config"])))
    return calls


def _operands(kind, n=3, m=48, k=128):
    a = random_fp4((m, k), "mxfp4" if kind.startswith("mx") else "nvfp4", "linear", seed=1)
    if kind.endswith("fp4"):
        return a, random_fp4((n, k), a.fmt.name, "linear", seed=2)
    return a, random_activation((n, k), {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[
        kind.split("-")[1]], seed=2)


@pytest.mark.parametrize("kind, n, expected", [
    ("nv-f16", 1, "mma"), ("nv-bf16", 16, "mma"), ("nv-fp4", 2, "mma"), ("nv-fp4", 1, "w4a4"),
    ("nv-f32", 3, "general"), ("mx-f16", 3, "general"), ("mx-bf16", 1, "general"), ("mx-fp4", 3, "general"),
])
def test_default_dispatch(launches, kind, n, expected):
    a, b = _operands(kind, n)
    assert _is_mma_case(a, b) == (expected == "mma")
    gemv(a, b, backend="triton")
    assert [c[0] for c in launches] == [expected]
    if expected == "mma":
        assert launches[0][1] == mma_config(48, 128, 1)


@pytest.mark.parametrize("kind, n", [("nv-f16", 1), ("nv-bf16", 16), ("nv-fp4", 2)])
def test_config_type_picks_the_kernel(launches, kind, n):
    a, b = _operands(kind, n)
    gemv(a, b, backend="triton", config=MmaConfig(32, 64, 2))
    gemv(a, b, backend="triton", config=GemvKernelConfig(64, 8, 4))
    assert launches == [("mma", MmaConfig(32, 64, 2)), ("general", GemvKernelConfig(64, 8, 4))]


@pytest.mark.parametrize("kind, n", [("mx-f16", 3), ("mx-fp4", 3), ("nv-f32", 3), ("nv-fp4", 1)])
def test_mma_config_for_another_case_is_a_type_error(launches, kind, n):
    a, b = _operands(kind, n)
    with pytest.raises(TypeError, match="config"):
        gemv(a, b, backend="triton", config=MmaConfig(16, 128, 1))
    assert not launches


@pytest.mark.parametrize("config", [MmaConfig(8, 128, 1), MmaConfig(256, 128, 8), MmaConfig(48, 128, 2),
                                    MmaConfig(0, 128, 1), MmaConfig(16, 8, 1), MmaConfig(16, 96, 1),
                                    MmaConfig(16, 0, 1)], ids=str)
def test_mma_config_out_of_range_is_a_value_error(launches, config):
    a, b = _operands("nv-f16")
    with pytest.raises(ValueError, match="config"):
        gemv(a, b, backend="triton", config=config)
    assert not launches


def test_mma_config_is_valid_for_every_shape():
    for m, k, L in itertools.product((1, 16, 128, 200, 4096, 7168, 28672), (16, 32, 48, 64, 192, 2048, 16384),
                                     (1, 2, 4, 8)):
        cfg = mma_config(m, k, L)
        for v in (cfg.rows, cfg.block_k, cfg.num_warps):
            assert v >= 1 and v & (v - 1) == 0, (m, k, L, cfg)
        assert 16 <= cfg.rows <= 128 and 16 <= cfg.block_k <= max(16, k), (m, k, L, cfg)
        assert cfg.num_stages >= 1
        _check_config(cfg, w4a4_case=False, mma_case=True)  # what gemv accepts from a user


def test_w4a4_configs_are_not_mma_configs():
    a, b = _operands("nv-fp4", 2)
    with pytest.raises(TypeError, match="config"):
        gemv(a, b, backend="triton", config=GemvConfig(16, 8, 4))


# --- compiled for the GPU without one ------------------------------------------------------------------

# Compiles mma_gemv_kernel ahead of time for sm_90 down to a cubin (Triton's bundled ptxas) in a fresh
# interpreter (see test_kernels_gemv.py).  Arguments equal to 1 are specialized by Triton's JIT as constants:
# a K-contiguous float activation's b_stride_k and a contiguous out's c_stride_n, so they are here too.
_AOT_SCRIPT = """
import itertools, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp4gemv.kernels.mma_gemv import mma_gemv_kernel
STRIDE_K_ONE = {stride_k_one}
REPORT_PASS_FAILURES = {report}
cases = [  # activation, ptx decode, out dtype, global scales, rows, warps, ksplit, even K
    (act, ptx, out, gs, rows, warps, ksplit, even)
    for (act, ptx, out, gs) in {decodes}
    for rows, warps, ksplit in {tiles}
    for even in {evens}
]
done = 0
for act, ptx, out, gs, rows, warps, ksplit, even in cases:
    fp4 = act == "i16"
    const = dict(ROWS=rows, BLOCK_K=128 // ksplit, N_PAD=16, FP4_ACTIVATION=fp4, HAS_GSA=gs, HAS_GSB=gs and fp4,
                 EVEN_K=even, USE_PTX=ptx, KSPLIT=ksplit, c_stride_n=1)
    if STRIDE_K_ONE and not fp4:
        const["b_stride_k"] = 1
    for p in mma_gemv_kernel.params:  # other constexpr parameters at their defaults
        if p.is_constexpr and p.name not in const and p.has_default:
            const[p.name] = p.default
    ptrs = dict(a_ptr="*i16", sfa_ptr="*u8", b_ptr="*" + act, sfb_ptr="*u8", gsa_ptr="*fp32", gsb_ptr="*fp32",
                c_ptr="*" + out)
    sig = {{a: ptrs.get(a, "constexpr" if a in const else "i32") for a in mma_gemv_kernel.arg_names}}
    try:
        kernel = triton.compile(ASTSource(mma_gemv_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=warps, num_stages=1))
    except RuntimeError as e:
        if not REPORT_PASS_FAILURES or "PassManager::run failed" not in str(e):
            raise
        print("pass manager failed:", act, rows, warps, ksplit)
        continue
    done += 1
    ptx_text = kernel.asm["ptx"]
    mma = sorted(set(re.findall(r"\\b(wgmma\\.mma_async|mma\\.sync)\\.", ptx_text)))
    assert kernel.asm["cubin"], (act, rows)
    # Hopper's warpgroup MMA needs a warpgroup (4 warps) of 64 rows and no ksplit (a batched dot); the rest
    # use mma.sync.
    wgmma = rows >= 64 and warps >= 4 and ksplit == 1
    assert mma == (["wgmma.mma_async"] if wgmma else ["mma.sync"]), (act, rows, warps, ksplit, mma)
    # The inline-PTX decode's mask of the two halves' magnitude bits appears only with the PTX decode.
    assert ("0x70007000" in ptx_text) == ptx, (act, ptx)
print("compiled", done, "of", len(cases))
"""
_DECODES = [("fp16", True, "fp16", True), ("bf16", True, "bf16", False), ("i16", True, "fp32", True),
            ("fp16", False, "bf16", True)]
_TILES = [(16, 1, 1), (64, 4, 1), (128, 8, 1), (16, 4, 4), (64, 8, 8)]  # rows, warps, ksplit


def test_mma_kernel_compiles_for_sm90_without_a_gpu(compile_for_sm90):
    script = _AOT_SCRIPT.format(stride_k_one=True, report=False, decodes=_DECODES, tiles=_TILES, evens=(True, False))
    n = len(_DECODES) * len(_TILES) * 2
    assert f"compiled {n} of {n}" in compile_for_sm90(script)


def test_mma_kernel_compiles_for_sm90_with_a_k_strided_activation_and_few_rows(compile_for_sm90):
    """b_stride_k not 1 (a K-strided activation), tiles on mma.sync."""
    script = _AOT_SCRIPT.format(stride_k_one=False, report=False, decodes=_DECODES[:2],
                                tiles=[(16, 1, 1), (32, 2, 1), (16, 4, 4)], evens=(False,))
    assert "compiled 6 of 6" in compile_for_sm90(script)


def test_mma_kernel_compiles_for_sm90_with_a_k_strided_activation_on_wgmma(compile_for_sm90):
    """b_stride_k not 1 with 64-row, 4-warp tiles (warpgroup MMA; mma_config's choice for m * l >= 28672)."""
    script = _AOT_SCRIPT.format(stride_k_one=False, report=True, decodes=_DECODES[:2], tiles=[(64, 4, 1)],
                                evens=(True,))
    out = compile_for_sm90(script)
    if "pass manager failed" in out:
        pytest.xfail("known: Triton 3.6 fails ('Illegal shared layout' in TritonGPUOptimizeDotOperands) to compile "
                     "the wgmma tile of a float activation whose K stride is not 1: " + out.strip())
    assert "compiled 2 of 2" in out


# --- GPU ------------------------------------------------------------------------------------------------

GPU_CONFIGS = (None, MmaConfig(64, 128, 4), MmaConfig(128, 128, 8), MmaConfig(32, 64, 4, ksplit=4))


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS,
                         ids=lambda c: "default" if c is None else f"r{c.rows}k{c.block_k}w{c.num_warps}s{c.ksplit}")
@pytest.mark.parametrize("activation, n", [(torch.float16, 16), (torch.float16, 1), (torch.bfloat16, 5),
                                           ("fp4", 3), ("fp4", 16)], ids=_name)
def test_mma_ptx_and_triton_decodes_agree_bitwise(activation, n, config):
    a, b = build_case("nvfp4", activation, n, "swizzled", (2432, 4608, 2), True, seed=n)
    ptx = gemv(a, b, out_dtype=torch.float32, backend="triton-ptx", config=config)
    pure = gemv(a, b, out_dtype=torch.float32, backend="triton", config=config)
    assert torch.equal(ptx.view(torch.int32), pure.view(torch.int32))
    assert_matches_exact(ptx, a, b, torch.float32, tensor_cores=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(s.m, s.k, s.l) for s in task.BENCHMARK_SHAPES] + [(2432, 4608, 2)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", (torch.float16, torch.bfloat16, "fp4"), ids=_name)
def test_mma_matches_exact_on_task_shapes(shape, activation):
    """The default dispatch and configuration on the task's shapes, N = 1, 2, 8, 16 (2, 8, 16 for NVFP4)."""
    m, k, L = shape
    a = random_fp4((L, m, k), "nvfp4", "swizzled", seed=sum(shape))
    for n in (1, 2, 8, 16) if activation != "fp4" else (2, 8, 16):
        if activation == "fp4":  # the other scale layout; global scales on both for even n
            gs = n % 2 == 0
            b = random_fp4((L, n, k), "nvfp4", "linear", seed=n, global_scale=0.375 if gs else None)
            a = FP4Tensor(a.data, a.scales, "nvfp4", "swizzled", 1.5 if gs else None)
        else:
            b = random_activation((L, n, k), activation, seed=n)
        assert _is_mma_case(a, b)
        for out_dtype in (torch.float32, torch.bfloat16 if activation == torch.bfloat16 else torch.float16):
            got = gemv(a, b, out=poisoned(result_shape(a, b), out_dtype), out_dtype=out_dtype)
            assert not torch.isnan(got).any()
            assert_matches_exact(got, a, b, out_dtype, tensor_cores=True)


@pytest.mark.gpu
@pytest.mark.parametrize("activation, n", [(torch.float16, 16), (torch.bfloat16, 1), ("fp4", 3)], ids=_name)
@pytest.mark.parametrize("k, config", [(16, None), (48, None), (128, MmaConfig(16, 16, 1)),
                                       (256, MmaConfig(32, 16, 4, ksplit=4)), (256, MmaConfig(64, 16, 4))],
                         ids=["k16-default", "k48-default", "bk16", "bk16-ks4", "bk16-r64"])
def test_mma_small_k_steps_on_gpu(activation, n, k, config):
    """16-element K steps, which ``mma_config`` picks for K < 32, on the compiled kernel."""
    a, b = build_case("nvfp4", activation, n, "swizzled", (256, k, 2), False, seed=k)
    for backend in ("triton-ptx", "triton"):
        got = gemv(a, b, out=poisoned(result_shape(a, b), torch.float32), out_dtype=torch.float32, backend=backend,
                   config=config)
        assert_matches_exact(got, a, b, torch.float32, tensor_cores=True)


@pytest.mark.gpu
def test_mma_reads_a_k_strided_activation_on_gpu():
    """The default configuration of a small shape (16-row tiles, mma.sync) with an activation strided along K."""
    a = random_fp4((2, 2432, 4608), "nvfp4", "swizzled", seed=3)
    x = random_activation((4608, 6), torch.float16, seed=4).t()
    assert mma_config(2432, 4608, 2).rows < 64
    got = gemv(a, x, out_dtype=torch.float32)
    assert_matches_exact(got, a, x, torch.float32, tensor_cores=True)
    assert torch.equal(got, gemv(a, x.contiguous(), out_dtype=torch.float32))


@pytest.mark.gpu
def test_mma_one_hot_k_order_on_gpu():
    """The K-order check of test_mma_kernel_k_order_matches_the_activation through the compiled PTX decode."""
    m, k = 256, 512
    a = _distinct_weights(m, k, seed=2).with_scale_layout("swizzled").to("cuda")
    expected = a.dequantize(torch.float32).reshape(m, k // 16, 16).permute(1, 0, 2)
    for activation, config in itertools.product((torch.float16, torch.bfloat16, "fp4"), GPU_CONFIGS[1:]):
        x = _one_hot_activation(k, activation).to("cuda")
        got = gemv(a, x, out_dtype=torch.float32, config=config)
        assert torch.equal(got, expected), (activation, config)
