"""FP4Linear: decode (gemv) and prefill (gemv for fp16/bf16 weight-only, else dequantize + F.linear) paths against the float64 oracle, W4A4,
bias, validation, state dicts, torch.save / torch.load(weights_only=True), dtype moves."""

import importlib
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp4gemv import FP4Tensor, dequantize, gemv, quantize
from fp4gemv.nn import DECODE_MAX_TOKENS, FP4Linear, per_tensor_scale
from fp4gemv.nn.linear import LINEAR_CODE_ORDER
from fp4gemv.target import resolve_target
from fp4gemv.formats import round_from_float64
from fp4gemv.reference import quantized_gemv_reference

MANTISSA_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24}


def _linear(in_features=128, out_features=80, bias=True, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    lin = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    with torch.no_grad():
        # Rows spanning several binades so that block scales differ.
        lin.weight.mul_(torch.logspace(-2, 1, out_features, dtype=dtype)[:, None])
        if bias:
            lin.bias.normal_()
    return lin


def _decode_expected(module: FP4Linear, x2d: torch.Tensor, activation) -> torch.Tensor:
    """gemv's exact result rounded once to x's dtype, then + bias rounded once (the documented semantics)."""
    y = quantized_gemv_reference(module.quantized_weight(), activation, x2d.dtype).t()
    if module.bias is not None:
        y = round_from_float64(y.double() + module.bias.double(), x2d.dtype)
    return y


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_layout", ["linear", "swizzled"])
def test_decode_weight_only_is_the_exact_reference(fmt, dtype, scale_layout):
    lin = _linear()
    module = FP4Linear.from_linear(lin, fmt, scale_layout=scale_layout).to(dtype)
    for lead in [(1,), (2, 3), (DECODE_MAX_TOKENS,)]:
        x = torch.randn(*lead, 128).to(dtype)
        y = module(x)
        assert y.shape == (*lead, 80) and y.dtype == dtype
        expected = _decode_expected(module, x.reshape(-1, 128), x.reshape(-1, 128))
        torch.testing.assert_close(y.reshape(-1, 80), expected, rtol=0, atol=0)


def test_decode_vector_input_and_no_bias():
    module = FP4Linear.from_linear(_linear(bias=False))
    x = torch.randn(128)
    y = module(x)
    assert y.shape == (80,)
    expected = quantized_gemv_reference(module.quantized_weight(), x, torch.float32)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("static", [False, True])
def test_decode_w4a4_is_the_exact_reference(fmt, static):
    lin = _linear(seed=1)
    input_scale = 2.0**-7 if static else None
    module = FP4Linear.from_linear(lin, fmt, activations="w4a4", input_scale=input_scale).to(torch.bfloat16)
    x = (torch.randn(5, 128) * 3).bfloat16()
    if static:
        gs = torch.tensor(input_scale)
    elif fmt == "nvfp4":
        gs = per_tensor_scale(x.abs().amax())
    else:
        gs = None
    activation = quantize(x, fmt, "linear", gs)
    torch.testing.assert_close(module(x), _decode_expected(module, x, activation), rtol=0, atol=0)
    # W4A4 differs from W4A16: the activation really is quantized.
    w4a16 = FP4Linear.from_linear(lin, fmt).to(torch.bfloat16)
    assert not torch.equal(module(x), w4a16(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_w4a4_per_call_scale_on_the_kernels_is_the_torch_paths_product(monkeypatch, dtype):
    """NVFP4 W4A4 without a static scale quantizes its activation with ``global_scale="pow2"``: on a Triton target
    (here the interpreter, forced) the amax and quantize kernels compute the scale, and nothing computes it with
    torch; the output is the one of quantizing with ``per_tensor_scale`` of the call's amax by torch ops (the path
    before the kernels), on ordinary activations, zeros, tiny and huge ones, and the dtype's largest value."""
    q = importlib.import_module("fp4gemv.quantize")  # the module (fp4gemv.quantize is the op)
    module = FP4Linear.from_linear(_linear(seed=3), "nvfp4", activations="w4a4").to(dtype)
    monkeypatch.setattr(q, "_resolve_backend", lambda backend, device: resolve_target("triton", device))

    def torch_scale(*args, **kwargs):
        raise AssertionError("the per-call scale is the kernels' on a Triton target")

    monkeypatch.setattr(q, "per_tensor_scale", torch_scale)
    g = torch.Generator().manual_seed(4)
    largest = torch.zeros(2, 128)
    largest[1, -1] = torch.finfo(dtype).max
    for x in (torch.randn(3, 128, generator=g) * 5, torch.zeros(1, 128), torch.randn(2, 128, generator=g) * 1e-3,
              torch.randn(4, 128, generator=g) * 1e3, largest):
        x = x.to(dtype)
        activation = quantize(x, "nvfp4", "linear", per_tensor_scale(x.abs().amax()), check_values=False,
                              backend="reference")
        assert torch.equal(module(x), _decode_expected(module, x, activation))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activations", ["weight-only", "w4a4"])
def test_prefill_is_dequantize_then_f_linear_and_near_the_reference(fmt, dtype, activations):
    lin = _linear(seed=2)
    module = FP4Linear.from_linear(lin, fmt, activations=activations).to(dtype)
    x = torch.randn(3, 7, 128).to(dtype)  # 21 tokens > DECODE_MAX_TOKENS
    y = module(x)
    assert y.shape == (3, 7, 80) and y.dtype == dtype
    x2d = x.reshape(-1, 128)
    weight = module.quantized_weight()
    activation = module.quantize_input(x2d) if activations == "w4a4" else x2d
    x_values = dequantize(activation, dtype) if activations == "w4a4" else x2d
    if module.fused_prefill(activation):  # weight-only bf16: gemv (here the exact reference), then + bias
        assert activations == "weight-only" and dtype == torch.bfloat16
        expected = gemv(weight, x2d, out_dtype=dtype).t() + module.bias
    else:
        expected = F.linear(x_values, dequantize(weight, dtype), module.bias)
    torch.testing.assert_close(y.reshape(-1, 80), expected, rtol=0, atol=0)
    # Against the float64 oracle (with bias): the weight is exact in x's dtype (power-of-two per-tensor
    # scale), so the error is fp32 accumulation (K * 2^-24 of sum |w x|) plus the output rounding(s).
    w64, x64 = dequantize(weight, torch.float64), dequantize(activation, torch.float64) if activations == "w4a4" else x2d.double()
    exact = x64 @ w64.t() + module.bias.double()
    magnitude = x64.abs() @ w64.abs().t() + module.bias.double().abs()
    # Output rounding(s) relative to the magnitudes summed, so that a rounding before the bias is added is covered.
    bound = 128 * 2.0**-24 * magnitude + 2.0 ** -(MANTISSA_BITS[dtype] - 1) * magnitude + 1e-30
    assert ((y.reshape(-1, 80).double() - exact).abs() <= bound).all()


def test_decode_and_prefill_agree_per_token_within_rounding():
    module = FP4Linear.from_linear(_linear(seed=3))
    x = torch.randn(32, 128)
    decoded = torch.cat([module(x[i : i + 16]) for i in range(0, 32, 16)])
    prefilled = module(x)
    torch.testing.assert_close(decoded, prefilled, rtol=1e-5, atol=1e-5)


def test_empty_batch():
    module = FP4Linear.from_linear(_linear())
    assert module(torch.randn(0, 128)).shape == (0, 80)


def test_validation_names_the_argument():
    module = FP4Linear.from_linear(_linear())
    with pytest.raises(TypeError, match="x: expected dtype float16, bfloat16 or float32, got float64"):
        module(torch.randn(2, 128, dtype=torch.float64))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        module([1.0] * 128)
    with pytest.raises(ValueError, match=r"x: expected shape \[..., in_features\] = \[..., 128\], got \(2, 64\)"):
        module(torch.randn(2, 64))
    nan_linear = _linear()
    with torch.no_grad():
        nan_linear.weight[3, 7] = float("nan")
    with pytest.raises(ValueError, match=r"linear.weight: expected finite values"):
        FP4Linear.from_linear(nan_linear)
    with pytest.raises(ValueError, match="fmt: expected one of 'nvfp4', 'mxfp4', got 'int4'"):
        FP4Linear.from_linear(_linear(), "int4")
    with pytest.raises(ValueError, match="in_features: expected a positive multiple of the mxfp4 block size 32"):
        FP4Linear(48, 16, fmt="mxfp4")
    with pytest.raises(ValueError, match="fmt: expected 'nvfp4' or 'mxfp4'"):
        FP4Linear(64, 16, fmt="int4")
    with pytest.raises(ValueError, match="activations: expected one of"):
        FP4Linear(64, 16, activations="w8a8")
    with pytest.raises(ValueError, match="input_scale: a static activation scale needs activations='w4a4'"):
        FP4Linear(64, 16, input_scale="multiplier")
    with pytest.raises(TypeError, match="linear: expected an nn.Linear"):
        FP4Linear.from_linear(nn.Conv1d(4, 4, 1))


@pytest.mark.parametrize("tokens", [3, 40])
def test_a_bias_in_another_dtype_is_rounded_to_x_dtype(tokens):
    """from_linear(nn.Linear(...)) keeps the fp32 bias; bf16 input then works, as with the module in bf16."""
    module = FP4Linear.from_linear(_linear())
    x = torch.randn(tokens, 128).bfloat16()
    y = module(x)
    assert y.dtype == torch.bfloat16 and module.bias.dtype == torch.float32
    assert torch.equal(y, module.to(torch.bfloat16)(x))


def test_from_linear_quantizes_with_a_power_of_two_per_tensor_scale():
    lin = _linear(dtype=torch.bfloat16)
    module = FP4Linear.from_linear(lin)
    scale = module.weight_multiplier()
    amax = lin.weight.detach().float().abs().amax()
    assert float(scale) >= float(amax) / 2688 > float(scale) / 2
    assert torch.frexp(scale).mantissa == 0.5
    expected = quantize(lin.weight.detach(), "nvfp4", "swizzled", scale)
    assert torch.equal(module.checkpoint_weight(), expected.data)
    assert torch.equal(module.weight, expected.with_code_order(LINEAR_CODE_ORDER["weight-only"]).data)
    assert torch.equal(module.weight_scale.view(torch.uint8), expected.scales)
    amax_module = FP4Linear.from_linear(lin, per_tensor="amax")
    assert float(amax_module.weight_multiplier()) == float(amax / 2688)


def test_per_tensor_scale():
    amax = torch.tensor([2688.0, 2689.0, 1344.0, 1.0, 0.0])
    assert per_tensor_scale(amax).tolist() == [1.0, 2.0, 0.5, 2.0**-11, 1.0]
    assert per_tensor_scale(amax, "amax").tolist()[:3] == [1.0, float(torch.tensor(2689.0) / 2688), 0.5]
    with pytest.raises(ValueError, match="rounding: expected 'pow2' or 'amax'"):
        per_tensor_scale(amax, "max")


@pytest.mark.parametrize("fmt,scale_layout", [("nvfp4", "swizzled"), ("nvfp4", "linear"), ("mxfp4", "swizzled")])
def test_state_dict_round_trip_recovers_format_and_layout(fmt, scale_layout):
    module = FP4Linear.from_linear(_linear(), fmt, scale_layout=scale_layout, activations="w4a4", input_scale=0.25)
    sd = module.state_dict()
    expected_keys = {"weight", "weight_scale", "bias", "input_scale"} | ({"weight_scale_2"} if fmt == "nvfp4" else set())
    assert set(sd) == expected_keys
    rebuilt = FP4Linear.from_state_dict(sd)
    assert (rebuilt.fmt, rebuilt.scale_layout, rebuilt.activations) == (fmt, scale_layout, "w4a4")
    fresh = FP4Linear(128, 80, fmt=fmt, scale_layout=scale_layout, activations="w4a4",
                      weight_scale="multiplier" if fmt == "nvfp4" else None, input_scale="multiplier")
    fresh.load_state_dict(sd)
    x = torch.randn(4, 128)
    for other in (rebuilt, fresh):
        assert torch.equal(other(x), module(x))
    wrong = dict(sd, weight_scale=sd["weight_scale"].view(torch.uint8))
    with pytest.raises(RuntimeError, match="weight_scale: expected dtype float8"):
        fresh.load_state_dict(wrong)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_a_module_keeping_the_paired_order_files_the_checkpoints(fmt):
    """A weight-only module keeping its codes in the paired order (``code_order``), built from a Linear, from a
    state dict or loaded into: its products equal a checkpoint-order module's bit for bit (decode, fp32
    activations, prefill), and its state dict, checkpoint tensors and shards' sources hold the checkpoint order."""
    from fp4gemv.nn import checkpoints
    lin = _linear(seed=3)
    module = FP4Linear.from_linear(lin, fmt, code_order="paired")
    kept = FP4Linear.from_linear(lin, fmt, code_order="checkpoint")
    q = quantize(lin.weight.detach(), fmt, "swizzled", module.weight_multiplier())
    assert module.code_order == "paired" and module.quantized_weight().code_order == "paired"
    assert torch.equal(module.weight, q.with_code_order("paired").data) and not torch.equal(module.weight, q.data)
    assert torch.equal(kept.weight, q.data) and torch.equal(module.checkpoint_weight(), q.data)
    sd = module.state_dict()
    assert torch.equal(sd["weight"], q.data)  # files never see another order
    rebuilt = FP4Linear.from_state_dict(sd, code_order="paired")
    fresh = FP4Linear(128, 80, fmt=fmt, weight_scale="multiplier" if fmt == "nvfp4" else None, code_order="paired")
    fresh.load_state_dict(sd)
    for other in (rebuilt, fresh):
        assert other.code_order == "paired" and torch.equal(other.weight, module.weight)
    assert FP4Linear.from_state_dict(sd).code_order == LINEAR_CODE_ORDER["weight-only"]
    for tokens, dtype in ((1, torch.bfloat16), (3, torch.float32), (DECODE_MAX_TOKENS + 1, torch.bfloat16)):
        x = torch.randn(tokens, 128).to(dtype)
        y = module.to(dtype)(x)
        assert torch.isfinite(y).all() and torch.equal(y, kept.to(dtype)(x)) and torch.equal(y, rebuilt.to(dtype)(x))
    conventions = ("modelopt", "compressed-tensors") if fmt == "nvfp4" else ("modelopt", "gpt-oss")
    for convention in conventions:
        tensors = checkpoints.layer_tensors(module, convention)
        packed = next(v for k, v in tensors.items() if k in ("weight", "weight_packed", "weight_blocks"))
        assert torch.equal(packed.reshape(q.data.shape), q.data), convention


def test_w4a4_modules_keep_the_checkpoint_order_and_bad_orders_are_named():
    module = FP4Linear.from_linear(_linear(), "nvfp4", activations="w4a4", input_scale=0.25)
    assert module.code_order == "checkpoint" and torch.equal(module.weight, module.checkpoint_weight())
    assert FP4Linear.from_state_dict(module.state_dict()).code_order == "checkpoint"
    with pytest.raises(ValueError, match="code_order: W4A4 needs the checkpoint order .* got 'paired'"):
        FP4Linear(128, 80, activations="w4a4", code_order="paired")
    with pytest.raises(ValueError, match="code_order: expected one of 'checkpoint', 'native', 'paired', got 'nibble'"):
        FP4Linear(128, 80, code_order="nibble")
    native = FP4Linear(128, 80, code_order="native")
    assert native.code_order == "native" and "code_order='native'" in repr(native)
    assert "code_order" not in repr(FP4Linear(128, 80))  # the default, LINEAR_CODE_ORDER's
    assert FP4Linear(128, 80).code_order == LINEAR_CODE_ORDER["weight-only"]


def test_torch_save_load_weights_only():
    module = FP4Linear.from_linear(_linear(), "nvfp4", activations="w4a4", input_scale=0.5)
    x = torch.randn(3, 128)
    for obj in (module.state_dict(), module):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        rebuilt = loaded if isinstance(loaded, FP4Linear) else FP4Linear.from_state_dict(loaded)
        assert torch.equal(rebuilt(x), module(x))
    # A container needs its own class allowlisted, as torch asks for any module class.
    buffer = io.BytesIO()
    torch.save(nn.Sequential(module), buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals([nn.Sequential]):
        loaded = torch.load(buffer, weights_only=True)
    assert torch.equal(loaded(x), module(x))


@pytest.mark.parametrize("fmt,layout,gs", [("nvfp4", "swizzled", 0.375), ("mxfp4", "linear", None)])
def test_fp4tensor_torch_save_load_weights_only(fmt, layout, gs):
    t = quantize(torch.randn(3, 64), fmt, layout, gs)
    buffer = io.BytesIO()
    torch.save({"t": t}, buffer)
    buffer.seek(0)
    u = torch.load(buffer, weights_only=True)["t"]
    assert isinstance(u, FP4Tensor) and (u.fmt, u.scale_layout) == (t.fmt, t.scale_layout)
    assert torch.equal(u.data, t.data) and torch.equal(u.scales, t.scales)
    assert (u.global_scale is None) == (gs is None) and (gs is None or float(u.global_scale) == gs)


def test_dtype_moves_keep_quantized_buffers():
    module = FP4Linear.from_linear(_linear(), "nvfp4", activations="w4a4", input_scale=0.3)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    for move in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float()):
        move(module)
        for name in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            after = getattr(module, name)
            assert after.dtype == before[name].dtype
            assert torch.equal(after.reshape(-1).view(torch.uint8), before[name].reshape(-1).view(torch.uint8))
    assert module.bias.dtype == torch.float32


def test_extra_repr():
    text = repr(FP4Linear.from_linear(_linear(), "nvfp4", activations="w4a4"))
    for part in ("in_features=128", "out_features=80", "bias=True", "fmt='nvfp4'", "scale_layout='swizzled'",
                 "activations='w4a4'", "weight_scale='multiplier'", "input_scale='per-call'"):
        assert part in text


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("activations", ["weight-only", "w4a4"])
@pytest.mark.parametrize("tokens", [1, 8, 16, 40])
def test_cuda_against_the_oracle(fmt, activations, tokens):
    """On the GPU the kernels accumulate in fp32: within K * 2^-23 of sum |w x| plus the output rounding."""
    module = FP4Linear.from_linear(_linear(in_features=512, out_features=384, seed=4), fmt,
                                   activations=activations).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, 512, device="cuda").bfloat16()
    y = module(x).double().cpu()
    activation = module.quantize_input(x) if activations == "w4a4" else x
    w64 = dequantize(module.quantized_weight(), torch.float64).cpu()
    x64 = (dequantize(activation, torch.float64) if activations == "w4a4" else x.double()).cpu()
    exact = x64 @ w64.t() + module.bias.double().cpu()
    magnitude = x64.abs() @ w64.abs().t() + module.bias.double().abs().cpu()
    bound = (512 * 2.0**-23 + 2.0**-7) * magnitude + 1e-30  # two bf16 roundings (gemv, then + bias) at most
    assert ((y - exact).abs() <= bound).all()


def test_the_weight_view_is_kept_between_calls_and_follows_changes():
    """A decode step calls every layer: the FP4Tensor view of the buffers is built once, and rebuilt when a
    buffer is replaced or the per-tensor scale changes in place."""
    import copy

    from fp4gemv.nn import FP4Linear

    linear = torch.nn.Linear(64, 32, bias=False)
    layer = FP4Linear.from_linear(linear, "nvfp4")
    first = layer.quantized_weight()
    assert layer.quantized_weight() is first
    x = torch.randn(2, 64)
    before = layer(x)
    scale_name = next(n for n in ("weight_scale_2", "weight_global_scale") if layer._buffers.get(n) is not None)
    layer._buffers[scale_name].mul_(2)  # in place: same tensor, new version
    assert layer.quantized_weight() is not first
    ratio = 2.0 if scale_name == "weight_scale_2" else 0.5
    torch.testing.assert_close(layer(x), before * ratio)
    clone = copy.deepcopy(layer)
    assert "_quantized_weight" not in clone.__getstate__()
    assert clone.quantized_weight() is not layer.quantized_weight()


@pytest.mark.parametrize("activations", ["weight-only", "w4a4"])
def test_fp4linear_compiles_without_graph_breaks(activations):
    import torch._dynamo

    from fp4gemv.nn import FP4Linear

    torch.manual_seed(0)
    layer = FP4Linear.from_linear(torch.nn.Linear(64, 48), "nvfp4", activations=activations)
    x = torch.randn(3, 64)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    compiled = torch.compile(layer, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (1, 2):
            x = torch.randn(3, 64, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(compiled(x), layer(x))
