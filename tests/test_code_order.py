"""The native code order (``formats.CODE_ORDERS``, ``FP4Tensor.code_order``): the container keeps it through every
conversion, the reference and dequantize read it, the kernels whose decode is written for it (weight_only,
moe_weight_only, engine, moe_engine, general with float activations; the paired order: engine, weight_only and
general) give the checkpoint order's bits on the same values, and every other kernel refuses it by name.  The decode's PTX itself is emulated in tests/test_kernels_weight_only.py (every code in every
position); here the interpreter runs the weight-only kernels' twin on CPU tensors, and the GPU runs the PTX."""

import io

import pytest
import torch

import fp4gemv
from fp4gemv import FP4Tensor, formats, gemv, ops
from fp4gemv.kernels import GEMV_KERNELS, MOE_KERNELS, choose_kernel, engine
from fp4gemv.kernels.engine import EngineConfig
from fp4gemv.kernels.moe_engine import MoeEngineConfig
from fp4gemv.kernels.weight_only import WeightOnlyConfig
from fp4gemv.target import SM90
import operands as O
from operands import DEVICE, random_activation, random_fp4
from test_moe import random_ids

# The kernels that decode the native order; every other one must refuse it.
NATIVE_KERNELS = {"weight_only", "engine", "general", "reference", "moe_weight_only", "moe_engine", "moe_general",
                  "moe_reference"}
# The dense kernels that read every order (general: with fp16, bf16 or fp32 activations).
PAIRED_KERNELS = ("engine", "weight_only", "general", "reference")


def _native(t: FP4Tensor) -> FP4Tensor:
    n = t.with_code_order("native")
    assert n.code_order == "native" and not torch.equal(n.data, t.data)
    return n


def test_the_container_keeps_the_order():
    t = random_fp4((2, 40, 128), "nvfp4", "linear", seed=1, global_scale=0.5, device="cpu")
    assert t.code_order == "checkpoint" and t.with_code_order("checkpoint") is t
    n = _native(t)
    assert torch.equal(n.with_code_order("checkpoint").data, t.data) and n.scales is t.scales
    assert "code_order='native'" in repr(n) and "code_order" not in repr(t)
    for other in (n.with_scale_layout("swizzled"), n.first_rows(3), n.to("cpu")):
        assert other.code_order == "native"
    buffer = io.BytesIO()
    torch.save(n, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded.code_order == "native" and torch.equal(loaded.data, n.data)
    with pytest.raises(ValueError, match="code_order: expected one of"):
        FP4Tensor(t.data, t.scales, "nvfp4", "linear", None, "kernel")
    with pytest.raises(ValueError, match="code_order: expected one of"):
        t.with_code_order("swizzled")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
def test_reference_and_dequantize_read_the_native_order(fmt, layout):
    a = random_fp4((2, 24, 256), fmt, layout, seed=2, device=DEVICE)
    n = _native(a)
    x = random_activation((2, 3, 256), torch.bfloat16, seed=3, device=DEVICE)
    assert torch.equal(gemv(n, x, backend="reference"), gemv(a, x, backend="reference"))
    b = random_fp4((2, 3, 256), fmt, layout, seed=4, device=DEVICE)
    assert torch.equal(gemv(a, _native(b), backend="reference", out_dtype=torch.float32),
                       gemv(a, b, backend="reference", out_dtype=torch.float32))
    for backend in ("reference", "triton"):  # triton: the interpreter on a CPU, the kernel on a GPU
        assert torch.equal(fp4gemv.dequantize(n, torch.bfloat16, backend=backend),
                           fp4gemv.dequantize(a, torch.bfloat16, backend=backend))
    w = random_fp4((4, 32, 256), fmt, layout, seed=5, device=DEVICE)
    ids = torch.tensor([[0, 3], [3, 1]], dtype=torch.int32, device=DEVICE)
    xs = random_activation((2, 256), torch.bfloat16, seed=6, device=DEVICE)
    assert torch.equal(fp4gemv.moe_gemv(_native(w), xs, ids, backend="reference", activation="silu"),
                       fp4gemv.moe_gemv(w, xs, ids, backend="reference", activation="silu"))


def test_kernels_without_the_native_decode_refuse_it_by_name():
    """On the H200's target every GEMV and routed kernel outside ``NATIVE_KERNELS`` refuses native weights, and
    FP4 activations in the native order go only to the reference; the default choice stays a tensor-core kernel."""
    a = random_fp4((64, 2048), "nvfp4", "linear", seed=7, device="cpu")
    x = random_activation((4, 2048), torch.bfloat16, seed=8, device="cpu")
    native = _native(a)
    case = ops.gemv_operands(native, x, torch.empty(64, 4, dtype=torch.bfloat16)).case
    for spec in GEMV_KERNELS:
        reason = spec.refusal(case, SM90)
        if spec.name in NATIVE_KERNELS:
            assert reason is None or "code order" not in reason, (spec.name, reason)
        else:
            assert reason == "a in code order 'native' (it decodes checkpoint)", (spec.name, reason)
    assert choose_kernel(case, SM90).name == "engine"  # N = 4, one wave: the engine (round 26)
    with pytest.raises(ValueError, match="'hmma' cannot run .* a in code order 'native'"):
        choose_kernel(case, SM90, "hmma")
    b = random_fp4((4, 2048), "nvfp4", "linear", seed=9, device="cpu")
    fp4_case = ops.gemv_operands(a, _native(b), torch.empty(64, 4)).case
    assert [s.name for s in GEMV_KERNELS if s.refusal(fp4_case, SM90) is None] == []
    assert "b in code order 'native'" in GEMV_KERNELS[[s.name for s in GEMV_KERNELS].index("weight_only")].refusal(
        fp4_case, SM90)
    general = GEMV_KERNELS[[s.name for s in GEMV_KERNELS].index("general")]
    assert general.refusal(fp4_case, SM90) == "b in code order 'native' (it decodes checkpoint)"
    native_fp4 = ops.gemv_operands(native, b, torch.empty(64, 4)).case
    assert general.refusal(native_fp4, SM90).startswith("a: native-order weights need fp16, bf16 or fp32 activations")
    w = random_fp4((8, 64, 2048), "mxfp4", "linear", seed=10, device="cpu")
    ids = torch.zeros((4, 2), dtype=torch.int32)
    moe_case = fp4gemv.moe.plan_moe(_native(w), x, ids, None, None, torch.empty(4, 2, 64, dtype=torch.bfloat16),
                                    torch.bfloat16, SM90, None, None).case
    for spec in MOE_KERNELS:
        reason = spec.refusal(moe_case, SM90)
        assert (reason is None or "code order" not in reason) == (spec.name in NATIVE_KERNELS), (spec.name, reason)


def test_the_paired_order_round_trips_and_its_pairs_are_consecutive_elements():
    """``formats.reorder_codes`` between every two orders gives the checkpoint bytes back; in the paired order the
    native decode (``_mma_step.decode_native_bf16``, run by the PTX emulator with the native multipliers) gives a
    word's pair i as K elements 2i and 2i + 1, every code in every position; K / 2 must be whole 32-bit words."""
    from ptx_emulator import emulate_ptx
    from fp4gemv.kernels import _mma_step

    g = torch.Generator().manual_seed(24)
    words = [int(w) & 0xFFFFFFFF for w in torch.randint(-2**31, 2**31, (200,), generator=g)]
    words += [sum(c << (4 * i) for i in range(8)) for c in range(16)] + [0x76543210, 0xFEDCBA98]
    packed = torch.tensor([[(w >> (8 * j)) & 0xFF for j in range(4)] for w in words], dtype=torch.uint8)
    for source in formats.CODE_ORDERS:
        for target in formats.CODE_ORDERS:
            there = formats.reorder_codes(formats.reorder_codes(packed, "checkpoint", source), source, target)
            assert torch.equal(formats.reorder_codes(there, target, "checkpoint"), packed), (source, target)
    paired = formats.reorder_codes(packed, "checkpoint", "paired")
    mul = _mma_step.multipliers("bf16", "paired")
    for w, pw in zip(words, paired.tolist()):
        regs = {"w": int.from_bytes(bytes(pw), "little"), **mul}
        emulate_ptx(_mma_step.decode_native_bf16("w", ("p0", "p1", "p2", "p3"), "t", "u", {m: m for m in mul}),
                    regs)
        for i in range(4):
            halves = torch.tensor([regs[f"p{i}"] & 0xFFFF, regs[f"p{i}"] >> 16], dtype=torch.int32).to(torch.int16)
            codes = torch.tensor([(w >> (8 * i)) & 15, (w >> (8 * i + 4)) & 15])  # elements 2i, 2i + 1
            assert torch.equal(halves.view(torch.bfloat16).double() * 2.0**126,
                               formats.decode_e2m1(codes).double()), (hex(w), i)
    with pytest.raises(ValueError, match="K/2 a multiple of 4 .* for the paired order, got shape \\(3, 6\\)"):
        formats.reorder_codes(torch.zeros(3, 6, dtype=torch.uint8), "checkpoint", "paired")


def test_only_the_dense_step_kernels_and_the_references_take_the_paired_order():
    """The paired order's pairing is written in the mma.sync step (``_Step.matched_pairs``), which the engine and
    weight_only run: on the H200's target every other GEMV and routed kernel refuses it by name (the references
    read any order, when asked), weight_only refuses it with FP4 activations (their decode pairs codes i and
    i + 4), and a routed case is an error naming each kernel's reason, not a slower kernel; the reference's product
    on it is the checkpoint's."""
    a = random_fp4((64, 2048), "nvfp4", "linear", seed=25, device="cpu")
    x = random_activation((16, 2048), torch.bfloat16, seed=26, device="cpu")
    paired = a.with_code_order("paired")
    assert paired.code_order == "paired" and torch.equal(paired.with_code_order("checkpoint").data, a.data)
    assert torch.equal(gemv(paired, x, backend="reference"), gemv(a, x, backend="reference"))
    case = ops.gemv_operands(paired, x, torch.empty(64, 16, dtype=torch.bfloat16)).case
    for spec in GEMV_KERNELS:
        reason = spec.refusal(case, SM90)
        if spec.name in PAIRED_KERNELS:
            assert reason is None or "code order" not in reason, (spec.name, reason)
        else:
            assert reason is not None and reason.startswith("a in code order 'paired' (it decodes checkpoint"), \
                (spec.name, reason)
    assert choose_kernel(case, SM90).name == "engine"
    small = ops.gemv_operands(paired, x[:1], torch.empty(64, 1, dtype=torch.bfloat16)).case
    assert choose_kernel(small, SM90).name == "weight_only"  # N = 1: the choice the checkpoint order gets
    assert choose_kernel(ops.gemv_operands(a, x[:1], torch.empty(64, 1, dtype=torch.bfloat16)).case,
                         SM90).name == "weight_only"
    b4 = random_fp4((4, 2048), "nvfp4", "linear", seed=30, device="cpu")
    fp4_case = ops.gemv_operands(paired, b4, torch.empty(64, 4, dtype=torch.bfloat16)).case
    weight_only = GEMV_KERNELS[[s.name for s in GEMV_KERNELS].index("weight_only")]
    assert weight_only.refusal(fp4_case, SM90).startswith("a: paired-order weights need fp16 or bf16 activations")
    w = random_fp4((8, 64, 2048), "mxfp4", "linear", seed=27, device="cpu")
    ids = torch.zeros((4, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match="no kernel runs .*\\(moe_engine: w in code order 'paired' "
                                         "\\(it decodes checkpoint and native\\)"):
        fp4gemv.moe.plan_moe(w.with_code_order("paired"), x[:4], ids, None, None,
                             torch.empty(4, 2, 64, dtype=torch.bfloat16), torch.bfloat16, SM90, None, None)


# (fmt, activation, config, N): fold, k32 and split, float and FP4 activations, tails in M and K.
WEIGHT_ONLY_CASES = [
    ("nvfp4", torch.bfloat16, WeightOnlyConfig(2, 2, 1), 3),
    ("nvfp4", torch.float16, WeightOnlyConfig(1, 2, 2), 9),
    ("mxfp4", torch.bfloat16, WeightOnlyConfig(2, 2, 1), 16),
    ("mxfp4", torch.float16, WeightOnlyConfig(1, 4, 1), 1),
    ("nvfp4", torch.bfloat16, WeightOnlyConfig(2, 2, 1, split=True), 2),
    ("mxfp4", torch.float16, WeightOnlyConfig(1, 2, 1, split=True), 1),
    ("nvfp4", "fp4", WeightOnlyConfig(2, 2, 1), 4),
    ("mxfp4", "fp4", WeightOnlyConfig(1, 2, 1, split=True), 2),
]


@pytest.mark.parametrize("order", ["native", "paired"])
@pytest.mark.parametrize("fmt,act,config,n", WEIGHT_ONLY_CASES, ids=str)
def test_weight_only_gives_the_checkpoint_orders_bits(fmt, act, config, n, order):
    """weight_only on native and paired weights: the same bits as on the checkpoint's (the same values in the same
    sums), in the interpreter's twin on a CPU and in the PTX on a GPU (paired: fp16 and bf16 activations)."""
    if order == "paired" and act == "fp4":
        pytest.skip("paired weights take fp16 and bf16 activations (refused above)")
    a = random_fp4((40, 320), fmt, "linear", seed=11, device=DEVICE)
    if act == "fp4":
        b = random_fp4((n, 320), fmt, "swizzled", seed=12, device=DEVICE)
    else:
        b = random_activation((n, 320), act, seed=12, device=DEVICE)
    want = gemv(a, b, backend="triton", kernel="weight_only", config=config, out_dtype=torch.float32)
    reordered = a.with_code_order(order)
    assert not torch.equal(reordered.data, a.data)
    got = gemv(reordered, b, backend="triton", kernel="weight_only", config=config, out_dtype=torch.float32)
    assert torch.isfinite(want).all() and torch.equal(got, want)


# (fmt, activation dtype, N, K): K % 32 != 0 (no tensor-core kernel), fp32 activations, tails in M.
GENERAL_CASES = [("nvfp4", torch.float32, 3, 336), ("nvfp4", torch.bfloat16, 16, 336), ("nvfp4", torch.float16, 1, 512),
                 ("mxfp4", torch.float32, 5, 352), ("mxfp4", torch.bfloat16, 2, 352)]


@pytest.mark.parametrize("order", ["native", "paired"])
@pytest.mark.parametrize("fmt,dtype,n,k", GENERAL_CASES, ids=str)
def test_general_gives_the_checkpoint_orders_bits(fmt, dtype, n, k, order):
    """general on native and paired weights (fp16, bf16 and fp32 activations, K past a multiple of 32): the same
    bits as on the checkpoint's, and the dispatcher's choice for such a case (none took it before: a module keeping
    its weights paired must have a kernel for every activation dtype and K)."""
    a = random_fp4((37, k), fmt, "swizzled", seed=31, device=DEVICE)
    b = random_activation((n, k), dtype, seed=32, device=DEVICE)
    reordered = a.with_code_order(order)
    assert not torch.equal(reordered.data, a.data)
    want = gemv(a, b, backend="triton", kernel="general", out_dtype=torch.float32)
    got = gemv(reordered, b, backend="triton", kernel="general", out_dtype=torch.float32)
    assert torch.isfinite(want).all() and torch.equal(got, want)
    case = ops.gemv_operands(reordered, b, torch.empty(37, n, dtype=dtype)).case
    if dtype == torch.float32 or k % 32:
        assert choose_kernel(case, SM90).name == "general"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("kernel,dtype", [("moe_weight_only", torch.bfloat16), ("moe_general", torch.float32)])
def test_routed_kernels_give_the_checkpoint_orders_bits(fmt, tokens, kernel, dtype):
    w = random_fp4((6, 48, 256), fmt, "linear", seed=13, device=DEVICE)
    x = random_activation((tokens, 256), dtype, seed=14, device=DEVICE)
    ids = random_ids(tokens, 2, 6, seed=15)
    kw = dict(backend="triton", kernel=kernel, activation="gpt-oss", check_ids=False)
    want = fp4gemv.moe_gemv(w, x, ids, **kw)
    assert torch.equal(fp4gemv.moe_gemv(_native(w), x, ids, **kw), want)


def test_native_order_under_torch_compile():
    """The custom ops carry the order: a compiled gemv and moe_gemv on native weights give the eager bits."""
    a = random_fp4((32, 256), "mxfp4", "linear", seed=16, device="cpu")
    x = random_activation((2, 256), torch.bfloat16, seed=17, device="cpu")
    n = _native(a)
    compiled = torch.compile(lambda w, v: gemv(w, v, backend="reference"), fullgraph=True)
    assert torch.equal(compiled(n, x), gemv(a, x, backend="reference"))
    w = random_fp4((4, 32, 256), "nvfp4", "linear", seed=18, device="cpu")
    ids = torch.tensor([[1, 2], [0, 1]], dtype=torch.int32)
    moe_compiled = torch.compile(lambda ww, v, i: fp4gemv.moe_gemv(ww, v, i, backend="reference"), fullgraph=True)
    assert torch.equal(moe_compiled(_native(w), x, ids), fp4gemv.moe_gemv(w, x, ids, backend="reference"))


# --- GPU: the engines -------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 16])
def test_engine_gives_the_checkpoint_orders_bits(n):
    a = random_fp4((300, 4096), "nvfp4", "linear", seed=19)
    x = random_activation((n, 4096), torch.bfloat16, seed=20)
    want = gemv(a, x, kernel="engine", out_dtype=torch.float32)
    assert torch.isfinite(want).all() and torch.equal(gemv(_native(a), x, kernel="engine", out_dtype=torch.float32),
                                                      want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("n, config", [(4, None), (9, None), (16, None), (16, EngineConfig(1, 3, 128, 3)),
                                       (16, EngineConfig(4, 3, 168, 0, 2))])
def test_engine_on_the_paired_order_is_exact(fmt, layout, n, config):
    """The engine's step on paired weights takes the activation's registers as loaded (no pairing ``PRMT``):
    exact within the tensor-core bound at N = 4, 9, 16, K past a multiple of 1024, a persistent split grid and
    the 64-row programs (linear scales)."""
    if config is not None and config.groups > 1 and layout == "swizzled":
        pytest.skip("64-row programs take linear scales")
    # K = 5632: past a multiple of 1024, and linear MXFP4 scale rows of 176 bytes (16-byte aligned, as bulk copies need)
    a = random_fp4((300, 4096 + 1024 + 512), fmt, layout, seed=28, device="cuda").with_code_order("paired")
    x = random_activation((n, a.shape[1]), torch.bfloat16, seed=29, device="cuda")
    out = O.poisoned((300, n), torch.float32, device="cuda")
    gemv(a, x, out=out, out_dtype=torch.float32, kernel="engine", config=config)
    O.assert_matches_exact(out, a, x, torch.float32, tensor_cores=True, fold=engine.step_fold_exponent(fmt))


def _padded(w: FP4Tensor, pad: int) -> FP4Tensor:
    """w with linear scale rows ``pad`` bytes longer (what FP4Experts stores for gpt-oss's 90-byte rows)."""
    s = w.scales
    padded = torch.full((*s.shape[:-1], s.shape[-1] + pad), 0x7F, dtype=torch.uint8, device=s.device)
    padded[..., :s.shape[-1]] = s
    return FP4Tensor(w.data, padded[..., :s.shape[-1]], w.fmt, "linear", w.global_scale, w.code_order)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("config", [None, MoeEngineConfig(4, 2, 4, 2, 128)])
def test_moe_engine_gives_the_checkpoint_orders_bits(fmt, config):
    w = _padded(random_fp4((16, 512, 2880), fmt, "linear", seed=21), 6)
    x = random_activation((8, 2880), torch.bfloat16, seed=22)
    ids = random_ids(8, 4, 16, seed=23)
    kw = dict(kernel="moe_engine", config=config, activation="gpt-oss", check_ids=False)
    want = fp4gemv.moe_gemv(w, x, ids, **kw)
    native = _native(w)
    assert native.scales.data_ptr() == w.scales.data_ptr()
    assert torch.isfinite(want).all() and torch.equal(fp4gemv.moe_gemv(native, x, ids, **kw), want)
