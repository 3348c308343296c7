"""The public op at its boundary: result shapes, out=, backends, validation (nothing written on failure),
kernel selection on each target, the metadata cache, and the torch.library ops under torch.compile.  The
kernels' numerics are tested in test_kernels_*.py."""

import os

import pytest
import torch

from fp4gemv import FP4Tensor, dequantize, gemv, ops, quantize, select_kernel, task
from fp4gemv.kernels import GEMV_KERNELS, choose_kernel, hmma_gemv
from fp4gemv.kernels.general import GeneralConfig
from fp4gemv.ops import gemv_operands
from fp4gemv.reference import gemv_reference, quantized_gemv_reference
from fp4gemv.target import SM90, Target


def _fp4(*shape, fmt="nvfp4", layout="linear", seed=0, global_scale=None):
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(shape, generator=g), fmt, layout, global_scale)


def _x(*shape, dtype=torch.float16, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- shapes and the reference backend -------------------------------------------------------------------


@pytest.mark.parametrize(
    "a_shape, b, expected",
    [
        ((2, 128, 64), ("fp4", (2, 3, 64)), (2, 128, 3)),
        ((128, 64), ("fp4", (3, 64)), (128, 3)),
        ((2, 128, 64), ("fp4", (5, 64)), (2, 128, 5)),  # b broadcast over a's batch
        ((128, 64), ("fp4", (2, 1, 64)), (2, 128, 1)),  # a broadcast over b's batch
        ((2, 128, 64), (torch.bfloat16, (2, 16, 64)), (2, 128, 16)),
        ((128, 64), (torch.float32, (1, 64)), (128, 1)),
        ((2, 128, 64), (torch.float16, (64,)), (2, 128)),
        ((128, 64), (torch.float16, (64,)), (128,)),
    ],
)
def test_result_shape_and_reference_values(a_shape, b, expected):
    a = _fp4(*a_shape, global_scale=0.5)
    kind, shape = b
    b = _fp4(*shape, seed=2, layout="swizzled") if kind == "fp4" else _x(*shape, dtype=kind)
    out = gemv(a, b, out_dtype=torch.float32)
    assert out.shape == expected and out.dtype == torch.float32
    assert torch.equal(out, quantized_gemv_reference(a, b, torch.float32))
    # The oracle, spelled out: float64 values of both operands, one rounding.
    a64 = dequantize(a, torch.float64)
    b64 = dequantize(b, torch.float64) if isinstance(b, FP4Tensor) else b.double()
    direct = a64 @ (b64.transpose(-1, -2) if b64.dim() > 1 else b64)
    torch.testing.assert_close(out.double(), direct, rtol=2.0**-24, atol=1e-12)


def test_global_scales_multiply_the_result():
    a, b = _fp4(128, 64), _fp4(2, 64, seed=2)
    plain = quantized_gemv_reference(a, b, torch.float64)
    scaled_a = FP4Tensor(a.data, a.scales, a.fmt, a.scale_layout, 0.25)
    scaled_b = FP4Tensor(b.data, b.scales, b.fmt, b.scale_layout, 3.0)
    assert torch.equal(quantized_gemv_reference(scaled_a, scaled_b, torch.float64), plain * 0.75)
    assert torch.equal(gemv(scaled_a, scaled_b, out_dtype=torch.float32), (plain * 0.75).float())


def test_out_is_written_and_returned_default_is_new():
    a, x = _fp4(2, 128, 64), _x(2, 4, 64)
    out = torch.full((2, 128, 4), float("nan"), dtype=torch.bfloat16)
    assert gemv(a, x, out=out, out_dtype=torch.bfloat16) is out
    assert not torch.isnan(out).any()
    fresh = gemv(a, x)
    assert fresh.dtype == torch.float16 and fresh.shape == (2, 128, 4)
    assert torch.equal(fresh, gemv_reference(dequantize(a, torch.float64), x, torch.float16))


def test_auto_on_cpu_is_the_reference():
    a, b = _fp4(200, 128, fmt="mxfp4"), _fp4(3, 128, fmt="mxfp4", seed=4)
    assert torch.equal(gemv(a, b), gemv(a, b, backend="reference"))


# --- validation: every error names its argument; out is untouched -------------------------------------


def _expect_error(exc, words, a=None, b=None, **kwargs):
    a = _fp4(2, 128, 64) if a is None else a
    b = _x(2, 3, 64) if b is None else b
    out = kwargs.pop("out", torch.full((2, 128, 3), float("nan"), dtype=torch.float16))
    before = out.clone() if isinstance(out, torch.Tensor) else None
    with pytest.raises(exc) as info:
        gemv(a, b, out=out, **kwargs)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"
    if before is not None and out.device.type == "cpu":
        assert torch.equal(out.view(torch.uint8), before.view(torch.uint8)), "out was written on failure"


def test_a_must_be_an_fp4_tensor():
    _expect_error(TypeError, ["a:", "FP4Tensor", "Tensor"], a=torch.zeros(2, 128, 64))


def test_b_type_dtype_and_rank():
    _expect_error(TypeError, ["b:", "FP4Tensor or a torch.Tensor", "list"], b=[1.0])
    _expect_error(TypeError, ["b:", "float16, bfloat16, float32", "float64"], b=_x(2, 3, 64).double())
    _expect_error(TypeError, ["b:", "int32"], b=torch.zeros(2, 3, 64, dtype=torch.int32))
    _expect_error(ValueError, ["b:", "[K], [N, K] or [L, N, K]", "(1, 2, 3, 64)"], b=_x(1, 2, 3, 64))


def test_b_shape_against_a():
    _expect_error(ValueError, ["b:", "K = 64 like a", "K = 32"], b=_x(2, 3, 32))
    _expect_error(ValueError, ["b:", "at least N = 1 row", "N = 0"], b=_x(2, 0, 64))
    _expect_error(ValueError, ["b:", "L = 2 like a", "L = 3"], b=_x(3, 3, 64))
    for backend in ("reference", "triton"):  # an empty batch: refused like N = 0, not a division by zero
        _expect_error(ValueError, ["b:", "batch size L >= 1", "L = 0"], a=_fp4(128, 64), b=_x(0, 3, 64),
                      out=torch.zeros(0, 128, 3, dtype=torch.float16), backend=backend)
    _expect_error(ValueError, ["b:", "format 'nvfp4' like a", "'mxfp4'"], b=_fp4(2, 3, 64, fmt="mxfp4"))
    _expect_error(ValueError, ["b:", "device cpu like a", "meta"], b=_x(2, 3, 64).to("meta"))


def test_out_and_out_dtype():
    _expect_error(TypeError, ["out_dtype:", "float16, bfloat16, float32", "float64"], out_dtype=torch.float64)
    _expect_error(TypeError, ["out:", "torch.Tensor", "list"], out=[0.0])
    _expect_error(ValueError, ["out:", "(2, 128, 3)", "(2, 128, 4)"],
                  out=torch.zeros(2, 128, 4, dtype=torch.float16))
    _expect_error(TypeError, ["out:", "torch.float32 (out_dtype)", "torch.float16"], out_dtype=torch.float32)
    _expect_error(ValueError, ["out:", "device cpu like a", "meta"],
                  out=torch.zeros(2, 128, 3, dtype=torch.float16, device="meta"))


def test_backend_kernel_and_config(monkeypatch):
    _expect_error(ValueError, ["backend:", "'auto', 'triton-ptx', 'triton', 'reference'", "'cuda'"], backend="cuda")
    _expect_error(ValueError, ["backend:", "'triton-ptx' needs CUDA tensors", "cpu"], backend="triton-ptx")
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "0")
    _expect_error(ValueError, ["backend:", "'triton' needs CUDA tensors (or TRITON_INTERPRET=1)"], backend="triton")
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "1")
    _expect_error(ValueError, ["config:", "rows a power of two", "rows=12"], backend="triton", kernel="general",
                  config=GeneralConfig(12, 8, 4))
    _expect_error(TypeError, ["config:", "GeneralConfig", "tuple"], backend="triton", kernel="general",
                  config=(8, 8, 4))
    _expect_error(TypeError, ["config:", "no config for kernel 'reference'", "GeneralConfig"],
                  config=GeneralConfig(8, 8, 4))
    known = ", ".join(repr(spec.name) for spec in GEMV_KERNELS)
    _expect_error(ValueError, ["kernel:", known, "'fast'"],
                  kernel="fast")
    _expect_error(ValueError, ["kernel: 'w4a4' cannot run", "FP4 activation with N = 1"], backend="triton",
                  kernel="w4a4")


def test_kernel_needs_8_byte_aligned_rows():
    wide = torch.zeros(128, 40, dtype=torch.uint8)
    misaligned = FP4Tensor(wide[:, 4:36], torch.full((128, 4), 0x38, dtype=torch.uint8))  # rows 40 bytes apart
    _expect_error(ValueError, ["no kernel runs", "general: a: needs data rows at multiples of 8 bytes",
                               "4-byte alignment", "backend='reference'"],
                  a=misaligned, b=_x(3, 64), out=torch.zeros(128, 3, dtype=torch.float16), backend="triton")
    # The reference reads any layout.
    assert gemv(misaligned, _x(3, 64)).abs().max() == 0


# --- out must not share memory with an input or with itself ----------------------------------------------


def _expect_overlap(words, a, b, out, **kwargs):
    """ValueError naming out and ``words``; neither out nor any input written."""
    inputs = [t for t in (a.data, a.scales, out) + ((b.data, b.scales) if isinstance(b, FP4Tensor) else (b,))]
    before = [t.clone() for t in inputs]
    with pytest.raises(ValueError) as info:
        gemv(a, b, out=out, **kwargs)
    for w in ["out:", *words]:
        assert w in str(info.value), f"{w!r} not in {info.value}"
    assert all(torch.equal(t, s) for t, s in zip(inputs, before)), "written"


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_out_sharing_memory_with_an_input_is_refused(backend):
    a = _fp4(16, 16, global_scale=0.5)
    x = _x(16, 16)  # [N, K] = [16, 16]: the result [M, N] has x's shape
    _expect_overlap(["shares memory with b"], a, x, x, backend=backend)
    buf = torch.zeros(2, 16, 16, dtype=torch.float16)  # the same bytes seen through another view
    _expect_overlap(["shares memory with b"], a, buf[0], buf[0].t(), backend=backend)
    # Each part of an FP4Tensor: its bytes inside a float16 / float32 buffer that is also out.
    owner = torch.zeros(16, 16, dtype=torch.float16)
    in_data = FP4Tensor(owner.view(torch.uint8)[:, :8], a.scales, "nvfp4")
    _expect_overlap(["shares memory with a.data"], in_data, x, owner, backend=backend)
    in_scales = FP4Tensor(a.data, owner.view(torch.uint8)[:, 8:9], "nvfp4")
    _expect_overlap(["shares memory with a.scales"], in_scales, x, owner, backend=backend)
    g = torch.ones(16, 16, dtype=torch.float32)
    in_global = FP4Tensor(a.data, a.scales, "nvfp4", "linear", g[3, 5])
    _expect_overlap(["shares memory with a.global_scale"], in_global, x.float(), g, out_dtype=torch.float32,
                    backend=backend)
    fp4_b = FP4Tensor(owner.view(torch.uint8)[:, :8], owner.view(torch.uint8)[:, 8:9], "nvfp4")
    _expect_overlap(["shares memory with b.data"], a, fp4_b, owner, backend=backend)


def test_out_interleaved_with_an_input_without_sharing_bytes_is_accepted():
    a = _fp4(16, 16)
    buf = torch.zeros(16, 32, dtype=torch.float16)
    x, out = buf[:, 0::2], buf[:, 1::2].t()  # address ranges meet, no element does
    x.copy_(_x(16, 16))
    want = gemv(a, x.clone())
    assert gemv(a, x, out=out) is out and torch.equal(out, want)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_out_whose_elements_alias_is_refused(backend):
    a, x = _fp4(64, 64), _x(4, 64)
    _expect_overlap(["strides (1, 0)", "(64, 4)"], a, x, torch.zeros(64, 1, dtype=torch.float16).expand(64, 4),
                    backend=backend)
    _expect_overlap(["strides (1, 1)"], a, x, torch.zeros(80, dtype=torch.float16).as_strided((64, 4), (1, 1)),
                    backend=backend)


def test_a_cached_call_still_refuses_an_overlapping_out():
    a = _fp4(16, 16)
    x, out = _x(16, 16), torch.zeros(16, 16, dtype=torch.float16)
    gemv(a, x, out=out)  # the plan of this metadata is kept
    x2 = _x(16, 16, seed=4)
    _expect_overlap(["shares memory with b"], a, x2, x2)
    call = ops.prepare_gemv(a, x, out=out)
    with pytest.raises(ValueError, match="out: .*shares memory with b"):
        call(a, x2, x2)


def test_compiled_gemv_refuses_an_overlapping_out():
    """Strides are checked while tracing; addresses by the custom op when it runs."""
    a, x = _fp4(64, 64), _x(4, 64)

    def f(a, x, out):
        return gemv(a, x, out=out)

    with pytest.raises(Exception, match=r"out: .*strides \(1, 0\)"):
        torch.compile(f, fullgraph=True)(a, x, torch.zeros(64, 1, dtype=torch.float16).expand(64, 4))
    square, x = _fp4(16, 16), _x(16, 16)
    before = x.clone()
    with pytest.raises(ValueError, match="out: .*shares memory with b"):
        torch.compile(f, fullgraph=True)(square, x, x)
    assert torch.equal(x, before)


# --- which kernel runs where ----------------------------------------------------------------------------


def test_the_reference_is_the_last_spec_and_runs_off_cuda():
    assert GEMV_KERNELS[-1].name == "reference"
    a, x = _fp4(2, 128, 64), _x(2, 3, 64)
    assert select_kernel(a, x).name == "reference"  # auto on the CPU
    assert select_kernel(a, x, backend="reference").name == "reference"
    assert select_kernel(a, x, backend="triton").name == "weight_only"
    assert select_kernel(a, _x(2, 9, 64), backend="triton").name == "hmma"
    assert select_kernel(a, _fp4(2, 1, 64, seed=3), backend="triton").name == "w4a4"


def _case(a, b):
    return gemv_operands(a, b, torch.empty(ops.result_shape(a, b))).case


def test_choice_follows_the_target():
    """sm_90 runs the tensor-core kernels; sm_80 (no e4m3x2 conversion) has no kernel for NVFP4 and says so,
    naming the capability, while MXFP4 (e8m0 scales, integer decode) runs the weight-only kernel there with fp16
    activations (its bf16 path needs sm_90's mul.bf16x2) and the general kernel with bf16."""
    nv, x = _fp4(128, 64), _x(3, 64)
    assert choose_kernel(_case(nv, x), SM90).name == "weight_only"
    hmma = "hmma" if hmma_gemv.PTX_LAYOUT_VERIFIED else "weight_only"  # hmma's PTX path: Triton 3.6 only
    assert choose_kernel(_case(nv, _x(9, 64)), SM90).name == hmma
    sm80 = Target("cuda", (8, 0), 108, "ptx")
    assert not sm80.e4m3x2_cvt and not sm80.bf16x2_mul and not sm80.native_fp4_mma and SM90.pdl
    with pytest.raises(ValueError, match="no kernel runs nvfp4 128x64 .*sm_80.*sm_89 or newer"):
        choose_kernel(_case(nv, x), sm80)
    mx = _fp4(128, 64, fmt="mxfp4")
    assert choose_kernel(_case(mx, x), sm80).name == "weight_only"
    assert choose_kernel(_case(mx, _x(3, 64, dtype=torch.bfloat16)), sm80).name == "general"
    assert choose_kernel(_case(mx, x), Target("cpu")).name == "reference"
    # sm_89 (Ada): e4m3x2 but no mul.rn.bf16x2, which both tensor-core kernels' bf16 paths use.
    sm89 = Target("cuda", (8, 9), 128, "ptx")
    assert choose_kernel(_case(nv, _x(9, 64)), sm89).name == hmma
    assert choose_kernel(_case(nv, _x(9, 64, dtype=torch.bfloat16)), sm89).name == "general"
    assert choose_kernel(_case(nv, _x(3, 64, dtype=torch.bfloat16)), sm89).name == "general"


# --- cached calls -----------------------------------------------------------------------------------------


def test_calls_with_the_same_metadata_share_one_plan():
    a, x = _fp4(2, 128, 64), _x(2, 3, 64)
    out = torch.empty(2, 128, 3, dtype=torch.float16)

    def prepared(a, x, out=None):
        return ops.prepare_gemv(a, x, out=out)

    first = prepared(a, x, out)
    assert prepared(_fp4(2, 128, 64, seed=5), _x(2, 3, 64, seed=6), torch.empty_like(out)) is first
    assert prepared(a, x) is not first  # a new result tensor: another plan
    assert prepared(a, x[:, :2], out[:, :, :2]) is not first


def test_a_prepared_call_runs_new_operands_like_gemv():
    a, x = _fp4(2, 128, 64), _x(2, 3, 64)
    call = ops.prepare_gemv(a, x, out=torch.empty(2, 128, 3, dtype=torch.float16))
    a2, x2 = _fp4(2, 128, 64, seed=7), _x(2, 3, 64, seed=8)
    out = torch.full((2, 128, 3), float("nan"), dtype=torch.float16)
    assert call(a2, x2, out) is out and torch.equal(out, gemv(a2, x2))
    assert not call.launches_by_address  # the reference on CPU tensors compiles no kernel
    with pytest.raises(RuntimeError, match="addresses: this call cannot launch on addresses alone"):
        call.launch_at(ops.GemvAddresses(a2.data.data_ptr(), a2.scales.data_ptr(), x2.data_ptr(), out.data_ptr()))
    assert ops.prepare_gemv(a, x, out=out, metadata_key=("mine", 1)) is call
    assert ops.prepared_gemv(("mine", 1)) is call and ops.prepared_gemv(("mine", 2)) is None


def test_direct_launch_only_on_the_triton_it_was_written_for():
    """The cached launch calls Triton 3.6's compiled-kernel launcher; any other version launches through the JIT."""
    assert ops.direct_launch_supported("3.6.0") and ops.direct_launch_supported("3.6.1+git1234")
    for version in ("3.5.1", "3.7.0", "4.6.0", "3.60.0"):
        assert not ops.direct_launch_supported(version), version
    import triton

    # Prepared calls take the choice for the Triton installed here.
    assert ops.PreparedGemv.__init__.__defaults__ == (ops.direct_launch_supported(triton.__version__),)


def test_launch_hooks_are_none_unless_registered():
    """Kept launches hand Triton's launcher no hooks while none is registered (an empty chain would make it build the
    launch metadata every call), and the registered chain while one is."""
    from triton import knobs

    from fp4gemv.kernels.spec import launch_hooks

    runtime = knobs.runtime
    if getattr(runtime.launch_enter_hook, "calls", None):
        pytest.skip("a launch hook is registered in this process")
    assert launch_hooks() == (None, None)
    seen = []

    def hook(metadata):
        seen.append(metadata)

    if hasattr(runtime.launch_enter_hook, "add"):  # Triton 3.6+: hook chains
        runtime.launch_enter_hook.add(hook)
        try:
            enter, leave = launch_hooks()
            assert enter is runtime.launch_enter_hook and leave is None
            enter("meta")
            assert seen == ["meta"]
        finally:
            runtime.launch_enter_hook.remove(hook)
        assert launch_hooks() == (None, None)


def test_a_bad_call_after_a_cached_one_still_raises_before_writing():
    a, x = _fp4(2, 128, 64), _x(2, 3, 64)
    out = torch.full((2, 128, 3), float("nan"), dtype=torch.float16)
    gemv(a, x, out=out)
    assert not torch.isnan(out).any()
    _expect_error(ValueError, ["out:", "(2, 128, 3)", "(2, 128, 4)"], a=a, b=x,
                  out=torch.full((2, 128, 4), float("nan"), dtype=torch.float16))
    _expect_error(TypeError, ["out:", "torch.float16 (out_dtype)", "torch.float32"], a=a, b=x,
                  out=torch.full((2, 128, 3), float("nan"), dtype=torch.float32))
    _expect_error(ValueError, ["b:", "K = 64 like a", "K = 32"], a=a, b=_x(2, 3, 32))
    _expect_error(TypeError, ["b:", "float64"], a=a, b=x.double())
    _expect_error(ValueError, ["b:", "format 'nvfp4' like a"], a=a, b=_fp4(2, 3, 64, fmt="mxfp4"))
    _expect_error(ValueError, ["backend:"], a=a, b=x, backend="fast")


# --- torch.library ops and torch.compile ---------------------------------------------------------------------


def _decode_step(x, w):
    """What a compiled decode step does: quantize the activation (NVFP4, its own global scale), then the W4A4
    and the W4A16 product."""
    import fp4gemv

    xq = fp4gemv.quantize(x.float(), "nvfp4", global_scale="auto")
    return gemv(w, xq, out_dtype=torch.float32), gemv(w, x, out_dtype=torch.bfloat16)


def test_compiled_decode_step_has_no_graph_break_and_matches_eager():
    import torch._dynamo

    w = _fp4(128, 64, layout="swizzled", global_scale=0.5)
    x = _x(1, 64, dtype=torch.bfloat16, seed=3)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_decode_step)(x, w)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    compiled = torch.compile(_decode_step, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (3, 4, 5):  # new values, same metadata: no recompilation
            x = _x(1, 64, dtype=torch.bfloat16, seed=seed)
            got, want = compiled(x, w), _decode_step(x, w)
            assert all(torch.equal(g, e) for g, e in zip(got, want))


def test_compiled_gemv_writes_out():
    w, x = _fp4(2, 128, 64), _x(2, 3, 64)
    out = torch.full((2, 128, 3), float("nan"), dtype=torch.float16)

    def f(w, x, out):
        return gemv(w, x, out=out)

    got = torch.compile(f, fullgraph=True)(w, x, out)
    assert got is out and torch.equal(out, gemv(w, x))


def test_custom_ops_pass_opcheck():
    from torch.library import opcheck

    w, x = _fp4(2, 128, 64, global_scale=0.5), _x(2, 3, 64)
    b = _fp4(2, 1, 64, seed=2, layout="swizzled")
    orders = ("checkpoint", "checkpoint")
    float_args = (w.data, w.scales, w.global_scale, x, None, None, "nvfp4", "linear", "", *orders)
    fp4_args = (w.data, w.scales, w.global_scale, b.data, b.scales, None, "nvfp4", "linear", "swizzled", *orders)
    grad_args = (w.data, w.scales, w.global_scale, x.clone().requires_grad_(), None, None, "nvfp4", "linear", "",
                 *orders)
    native = w.with_code_order("native")
    native_args = (native.data, native.scales, native.global_scale, x.clone().requires_grad_(), None, None, "nvfp4",
                   "linear", "", "native", "checkpoint")
    for args in (float_args, fp4_args, grad_args, native_args):
        result = opcheck(torch.ops.fp4gemv.gemv.default, (*args, torch.float32, "auto", None, None))
        assert set(result.values()) == {"SUCCESS"}, result
    result = opcheck(torch.ops.fp4gemv.dequantize.default, (b.data, b.scales, None, "nvfp4", "swizzled",
                                                            "checkpoint", torch.bfloat16))
    assert set(result.values()) == {"SUCCESS"}, result
    out = torch.empty(2, 128, 3, dtype=torch.float16)
    result = opcheck(torch.ops.fp4gemv.gemv_out.default, (*float_args, out, "auto", None, None))
    assert set(result.values()) == {"SUCCESS"}, result
    for fmt, layout, g in (("nvfp4", "swizzled", torch.tensor(0.25)), ("mxfp4", "linear", None)):
        result = opcheck(torch.ops.fp4gemv.quantize.default, (_x(3, 130, 64, dtype=torch.float32), fmt, layout, g,
                                                              "auto", True))
        assert set(result.values()) == {"SUCCESS"}, result


# --- autograd: a gradient for the float activation, none for the FP4 weight -----------------------------------


def _exact_activation_grad(a, x, dy):
    """(the float64 gradient of the dequantized product with respect to x, its bound for a correct fp32
    backward): autograd of ``dequantize(a) @ x^T`` in float64, and of the magnitudes for the bound."""
    w64 = dequantize(a, torch.float64)

    def grad(w, upstream):
        x64 = torch.zeros(x.shape, dtype=torch.float64, requires_grad=True)
        product = w @ x64.transpose(-1, -2) if x64.dim() > 1 else w @ x64
        product.backward(upstream)
        return x64.grad

    exact = grad(w64, dy.double())
    magnitude = grad(w64.abs(), dy.double().abs())
    depth = a.rows * (a.shape[0] if a.ndim == 3 else 1) + 2  # fp32 sums over M (and L) terms
    size = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}[x.dtype]
    bound = 1.01 * depth * 2.0**-24 * magnitude + size * exact.abs() + 2.0**-126
    return exact, bound


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("a_shape, x_shape", [((48, 64), (3, 64)), ((48, 64), (64,)), ((2, 48, 64), (3, 64)),
                                              ((48, 64), (2, 3, 64)), ((2, 48, 64), (2, 9, 64))])
def test_gemv_is_differentiable_in_the_float_activation(backend, a_shape, x_shape):
    """One behaviour on every backend: the result carries a grad_fn (torch.ops.fp4gemv.gemv's autograd), the
    values are those of the plain call, and dx = dy @ W agrees with the float64 dequantized product."""
    a = _fp4(*a_shape, global_scale=0.75)
    x = _x(*x_shape).requires_grad_()
    y = gemv(a, x, out_dtype=torch.float32, backend=backend)
    assert y.grad_fn is not None
    assert torch.equal(y.detach(), gemv(a, x.detach(), out_dtype=torch.float32, backend=backend))
    dy = _x(*y.shape, dtype=torch.float32, seed=7)
    y.backward(dy)
    assert x.grad.dtype == x.dtype and x.grad.shape == x.shape
    exact, bound = _exact_activation_grad(a, x, dy)
    assert ((x.grad.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_gemv_into_out_is_differentiable_and_the_weight_gets_no_grad(backend):
    g = torch.tensor(0.75, requires_grad=True)
    base = _fp4(48, 64)
    a = FP4Tensor(base.data, base.scales, "nvfp4", "linear", g)
    x = _x(3, 64).requires_grad_()
    out = torch.empty(3, 48, dtype=torch.float16).t()
    assert gemv(a, x, out=out, backend=backend) is out and out.grad_fn is not None
    assert torch.equal(out.detach(), gemv(a, x.detach(), backend=backend))
    out.sum().backward()
    exact, bound = _exact_activation_grad(FP4Tensor(base.data, base.scales, "nvfp4", "linear", 0.75), x,
                                          torch.ones(48, 3))
    assert ((x.grad.double() - exact).abs() <= bound).all()
    assert g.grad is None  # the FP4 weight, global scale included, is frozen
    # An out that is a leaf requiring grad cannot be written in place, on any backend (PyTorch's rule).
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        gemv(a, x.detach(), out=torch.zeros(3, 48, dtype=torch.float16, requires_grad=True).t(), backend=backend)
    # Nothing to differentiate (no_grad, or an FP4 activation): a plain result.
    with torch.no_grad():
        assert gemv(a, x, backend=backend).grad_fn is None
    assert not gemv(a, _fp4(2, 64, seed=3), backend=backend).requires_grad


def test_compiled_gemv_backward_matches_eager():
    a = _fp4(48, 64, layout="swizzled", global_scale=0.5)

    def f(x):
        return gemv(a, x, out_dtype=torch.float32).square().sum()

    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        x = _x(3, 64, dtype=torch.bfloat16).requires_grad_()
        fn(x).backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


# --- GPU: graphs and compiled code ---------------------------------------------------------------------------


def _gpu_layers(count=32):
    """``count`` weight matrices of mixed formats and shapes with one activation each (W4A16 and W4A4)."""
    from operands import random_activation, random_fp4

    layers = []
    for i in range(count):
        fmt = "nvfp4" if i % 3 else "mxfp4"
        m, k = (512, 1024) if i % 2 else (384, 2048)
        a = random_fp4((m, k), fmt, "swizzled", seed=i, global_scale=0.5 if i % 4 == 0 else None, device="cuda")
        b = (random_fp4((1 + i % 4, k), fmt, "linear", seed=100 + i, device="cuda") if i % 5 == 0
             else random_activation((1 + i % 9, k), torch.bfloat16, seed=100 + i, device="cuda"))
        layers.append((a, b))
    return layers


@pytest.mark.gpu
def test_cuda_graph_of_32_gemv_calls_replays_like_eager():
    layers = _gpu_layers()
    outs = [torch.full(ops.result_shape(a, b), float("nan"), dtype=torch.float32, device="cuda") for a, b in layers]
    eager = [gemv(a, b, out_dtype=torch.float32) for a, b in layers]  # also compiles and caches every plan
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for (a, b), out in zip(layers, outs):
            gemv(a, b, out=out, out_dtype=torch.float32)
    torch.cuda.current_stream().wait_stream(stream)
    for out in outs:
        out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for (a, b), out in zip(layers, outs):
            gemv(a, b, out=out, out_dtype=torch.float32)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, eager):
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_reduce_overhead_compile_of_32_gemv_calls_matches_eager():
    layers = _gpu_layers()

    def step(layers):
        return [gemv(a, b, out_dtype=torch.float32) for a, b in layers]

    eager = step(layers)
    compiled = torch.compile(step, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay
        got = compiled(layers)
    torch.cuda.synchronize()
    for g, w in zip(got, eager):
        assert torch.equal(g, w)


@pytest.mark.gpu
def test_cached_launches_on_gpu_match_the_first_call():
    """The first call of a metadata goes through Triton's JIT; later ones through the compiled kernel's
    launcher with new pointers: same results as fresh JIT launches on the same operands."""
    from operands import random_activation, random_fp4

    for i in range(3):
        a = random_fp4((2, 640, 4096), "nvfp4", "swizzled", seed=10 + i, device="cuda")
        x = random_activation((2, 5, 4096), torch.float16, seed=20 + i, device="cuda")
        out = torch.full((2, 640, 5), float("nan"), dtype=torch.float16, device="cuda")
        assert ops.prepare_gemv(a, x, out=out).launches_by_address or i == 0
        gemv(a, x, out=out)
        ops.clear_cache()
        assert torch.equal(out, gemv(a, x, out=torch.empty_like(out)))


@pytest.mark.gpu
def test_gemv_backward_on_gpu_matches_the_float64_gradient():
    from operands import random_activation, random_fp4

    a = random_fp4((512, 1024), "nvfp4", "swizzled", seed=3, global_scale=0.5, device="cuda")
    for n in (1, 5, 16, 40):
        x = random_activation((n, 1024), torch.bfloat16, seed=4 + n, device="cuda").requires_grad_()
        y = gemv(a, x, out_dtype=torch.float32)
        assert y.grad_fn is not None
        dy = random_activation(tuple(y.shape), torch.float32, seed=5, device="cuda")
        y.backward(dy)
        exact, bound = _exact_activation_grad(a.to("cpu"), x.detach().cpu(), dy.cpu())
        assert ((x.grad.cpu().double() - exact).abs() <= bound).all()
