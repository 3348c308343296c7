"""Checkpoints written here by hand in each convention (compressed-tensors nvfp4-pack-quantized, NVIDIA ModelOpt
NVFP4, gpt-oss MXFP4) load into FP4Linear and give exactly the float64 reference of the convention's stated
semantics, decoded here independently of fp4gemv.formats (nibbles by shifts, scales by torch's float8 dtypes,
e8m0 by ldexp).  Then the model-level loader and the writers: round trips and disagreements."""

import json
import math
from fractions import Fraction

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from fp4gemv import formats
from fp4gemv.nn import (
    FP4Linear,
    calibrate_input_scales,
    layer_tensors,
    load_quantized,
    quantize_model,
    read_quantization_config,
    save_compressed_tensors,
    save_modelopt,
    save_mxfp4,
)
from fp4gemv.nn.checkpoints import write_safetensors
from fp4gemv.reference import gemv_reference

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)
N, K = 48, 128


def _codes(seed, rows=N, cols=K):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)


def _pack(codes):
    """Element 2j in the low nibble (the convention of all three formats)."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _e4m3_scales(seed, rows=N, cols=K // 16):
    g = torch.Generator().manual_seed(seed)
    # Normal and subnormal e4m3 bytes, positive, never NaN (0x7F).
    return torch.randint(0x01, 0x7F, (rows, cols), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)


def _nvfp4_values(codes, scales):
    """e2m1 * e4m3 in float64 (exact), decoded with torch's float8 conversion."""
    return E2M1[codes.long()] * scales.to(torch.float64).repeat_interleave(16, dim=1)


def _fl32(value: Fraction) -> float:
    """``value`` rounded once to fp32, nearest even (an fp32 neighbour of the double nearest to it)."""
    guess = torch.tensor(float(value), dtype=torch.float32)
    candidates = {float(guess), float(torch.nextafter(guess, torch.tensor(math.inf))),
                  float(torch.nextafter(guess, torch.tensor(-math.inf)))}
    best = min(candidates, key=lambda c: (abs(Fraction(c) - value), torch.tensor(c).view(torch.int32).item() & 1))
    return best


def _ct_tensors(prefix, codes, scales, weight_divisor, input_divisor=None, bias=None):
    t = {f"{prefix}.weight_packed": _pack(codes), f"{prefix}.weight_scale": scales,
         f"{prefix}.weight_global_scale": torch.tensor([weight_divisor], dtype=torch.float32)}
    if input_divisor is not None:
        t[f"{prefix}.input_global_scale"] = torch.tensor([input_divisor], dtype=torch.float32)
    if bias is not None:
        t[f"{prefix}.bias"] = bias
    return t


def _exact(values, x):
    """The exact product rounded once to x's dtype: ``[T, N]``."""
    return gemv_reference(values, x, x.dtype).t()


# --- one layer, exact semantics ------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 5, 16, 24])
def test_compressed_tensors_weight_only_divisor_power_of_two_is_exact(tokens):
    codes, scales = _codes(0), _e4m3_scales(1)
    g = 2.0**9  # 1/g exact in fp32: the stated semantics e2m1 * scale / g hold to the last bit
    module = FP4Linear.from_state_dict(_ct_tensors("layer", codes, scales, g), "layer")
    assert (module.weight_scale_kind(), module.activations, module.fmt) == ("divisor", "weight-only", "nvfp4")
    x = torch.randn(tokens, K, dtype=torch.float32)
    values = _nvfp4_values(codes, scales) / g
    y = module(x)
    if tokens <= 16:
        torch.testing.assert_close(y, _exact(values, x), rtol=0, atol=0)
    else:
        # Prefill: F.linear in fp32 on the exactly dequantized weight: fp32 accumulation error only.
        exact = x.double() @ values.t()
        bound = K * 2.0**-24 * (x.double().abs() @ values.abs().t()) + 2.0**-24 * exact.abs()
        assert ((y.double() - exact).abs() <= bound).all()


def test_compressed_tensors_divisor_not_a_power_of_two():
    """g = 448 * 6 / amax (the recipe) has no exact reciprocal: the module applies fl32(1/g) (stated in
    fp4gemv.nn.linear).  Tested: equal to the exact reference of that multiplier, and within one unit in the
    last place of the divisor semantics (the two differ by < 2^-24 relative before the single rounding)."""
    codes, scales = _codes(2), _e4m3_scales(3)
    g = float(torch.tensor(2688.0) / torch.tensor(3.7))
    assert Fraction(1) / Fraction(g) != Fraction(_fl32(Fraction(1) / Fraction(g)))
    module = FP4Linear.from_state_dict(_ct_tensors("l", codes, scales, g), "l")
    assert float(module.weight_multiplier()) == _fl32(Fraction(1) / Fraction(g))
    x = torch.randn(8, K).bfloat16()
    y = module(x)
    multiplier_ref = _exact(_nvfp4_values(codes, scales) * _fl32(Fraction(1) / Fraction(g)), x)
    torch.testing.assert_close(y, multiplier_ref, rtol=0, atol=0)
    divisor_ref = _exact(_nvfp4_values(codes, scales) / g, x)
    ulp = torch.finfo(torch.bfloat16).eps * divisor_ref.float().abs().clamp_min(2.0**-126)
    assert ((y.float() - divisor_ref.float()).abs() <= ulp).all()


def test_compressed_tensors_w4a4_is_exact():
    codes, scales = _codes(4), _e4m3_scales(5)
    g_w, g_in = 2.0**10, 2.0**5
    bias = torch.randn(N).bfloat16()
    module = FP4Linear.from_state_dict(_ct_tensors("p", codes, scales, g_w, g_in, bias), "p")
    assert (module.activations, module.input_scale_kind()) == ("w4a4", "divisor")
    x = (torch.randn(3, K) * 5).bfloat16()
    # compressed-tensors quantizes x * g_in with dynamic e4m3 block scales (amax / 6), value = code * scale / g_in.
    x_codes, x_scales = formats.quantize(x.double() * g_in, formats.NVFP4)
    x_values = formats.dequantize(x_codes, x_scales, formats.NVFP4, dtype=torch.float64) / g_in
    y0 = gemv_reference(_nvfp4_values(codes, scales) / g_w, x_values, torch.bfloat16).t()
    expected = (y0.double() + bias.double()).bfloat16()
    torch.testing.assert_close(module(x), expected, rtol=0, atol=0)
    # activations="weight-only" drops the input scale and keeps x as it is.
    weight_only = FP4Linear.from_state_dict(_ct_tensors("p", codes, scales, g_w, g_in, bias), "p",
                                            activations="weight-only")
    assert weight_only.input_scale_kind() is None
    y0 = gemv_reference(_nvfp4_values(codes, scales) / g_w, x, torch.bfloat16).t()
    torch.testing.assert_close(weight_only(x), (y0.double() + bias.double()).bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("w4a4", [False, True])
def test_modelopt_multiplier_is_exact(w4a4):
    codes, scales = _codes(6), _e4m3_scales(7)
    weight_scale_2 = float(torch.tensor(3.1) / 2688)  # a multiplier: exact for any fp32 value
    input_scale = float(torch.tensor(9.0) / 2688)
    t = {"m.weight": _pack(codes), "m.weight_scale": scales, "m.weight_scale_2": torch.tensor(weight_scale_2)}
    if w4a4:
        t["m.input_scale"] = torch.tensor(input_scale)
    module = FP4Linear.from_state_dict(t, "m")
    assert (module.weight_scale_kind(), module.activations) == ("multiplier", "w4a4" if w4a4 else "weight-only")
    x = (torch.randn(4, K) * 2).half()
    if w4a4:
        # ModelOpt's activation: block scale e4m3(amax / (6 input_scale)), codes of x / (block scale * input_scale)
        # in fp32 (formats.quantize's rule, which FP4Linear's per-call quantize follows); value = code * block
        # scale * input_scale.
        x_codes, x_scales = formats.quantize(x.float(), formats.NVFP4, global_scale=input_scale)
        x_values = formats.dequantize(x_codes, x_scales, formats.NVFP4, dtype=torch.float64) * input_scale
    else:
        x_values = x
    expected = gemv_reference(_nvfp4_values(codes, scales) * weight_scale_2, x_values, torch.float16).t()
    torch.testing.assert_close(module(x), expected, rtol=0, atol=0)


def test_gpt_oss_mxfp4_is_exact():
    codes = _codes(8)
    g = torch.Generator().manual_seed(9)
    exponents = torch.randint(127 - 12, 127 + 6, (N, K // 32), generator=g, dtype=torch.uint8)
    blocks = _pack(codes).reshape(N, K // 32, 16)
    module = FP4Linear.from_state_dict({"e.weight_blocks": blocks, "e.weight_scales": exponents}, "e")
    assert (module.fmt, module.weight_scale_kind()) == ("mxfp4", None)
    assert torch.equal(module.checkpoint_weight(), blocks.reshape(N, K // 2))
    w4a4 = FP4Linear.from_state_dict({"e.weight_blocks": blocks, "e.weight_scales": exponents}, "e", activations="w4a4")
    assert w4a4.weight.data_ptr() == blocks.data_ptr()  # the checkpoint order: a view, nothing repacked
    values = torch.ldexp(E2M1[codes.long()], (exponents.long() - 127).repeat_interleave(32, dim=1))
    x = torch.randn(2, 3, K)
    expected = gemv_reference(values, x.reshape(-1, K), torch.float32).t().reshape(2, 3, N)
    torch.testing.assert_close(module(x), expected, rtol=0, atol=0)


def test_layer_errors_name_the_key():
    codes, scales = _codes(0), _e4m3_scales(1)
    good = _ct_tensors("a", codes, scales, 4.0)
    with pytest.raises(KeyError, match="b: no FP4 layer"):
        FP4Linear.from_state_dict(good, "b")
    with pytest.raises(ValueError, match=r"a.weight_scale: expected shape \(48, 8\) = \[N, K/16\]"):
        FP4Linear.from_state_dict(dict(good, **{"a.weight_scale": scales[:, :4]}), "a")
    with pytest.raises(KeyError, match="a.weight_global_scale: missing"):
        FP4Linear.from_state_dict({k: v for k, v in good.items() if "global" not in k}, "a")
    with pytest.raises(ValueError, match="a.weight_global_scale: expected a positive finite scale, got 0.0"):
        FP4Linear.from_state_dict(dict(good, **{"a.weight_global_scale": torch.zeros(1)}), "a")
    with pytest.raises(TypeError, match="a.weight_packed: expected dtype uint8, got int8"):
        FP4Linear.from_state_dict(dict(good, **{"a.weight_packed": _pack(codes).view(torch.int8)}), "a")
    with pytest.raises(ValueError, match="a.weight_zero_point: expected zeros"):
        FP4Linear.from_state_dict(dict(good, **{"a.weight_zero_point": torch.ones(N, K // 16)}), "a")
    with pytest.raises(ValueError, match=r"e.weight_scales: expected shape \(48, 4\)"):
        FP4Linear.from_state_dict({"e.weight_blocks": _pack(codes).reshape(N, 4, 16),
                                   "e.weight_scales": torch.zeros(N, 3, dtype=torch.uint8)}, "e")
    with pytest.raises(ValueError, match="m.weight_global_scale: expected either weight_scale_2"):
        FP4Linear.from_state_dict({"m.weight": _pack(codes), "m.weight_scale": scales,
                                   "m.weight_scale_2": torch.tensor(1.0), "m.weight_global_scale": torch.tensor(1.0)},
                                  "m")


# --- whole models ----------------------------------------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 64)
        self.up = nn.Linear(64, 128)
        self.norm = nn.LayerNorm(128)
        self.down = nn.Linear(128, 64, bias=False)
        self.head = nn.Linear(64, 10)  # left in float by the configs below

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + self.down(torch.relu(self.norm(self.up(h)))))


def _tiny(seed=0):
    torch.manual_seed(seed)
    return Tiny()


def _write_dir(tmp_path, tensors, config_name, config):
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / config_name).write_text(json.dumps(config))
    return tmp_path


def _float_tensors(model, skip):
    return {k: v for k, v in model.state_dict().items() if not k.startswith(skip)}


def test_load_compressed_tensors_directory(tmp_path):
    """A compressed-tensors directory written by hand: config groups, ignore, float tensors around."""
    reference = _tiny()
    up_codes, up_scales = _codes(10, 128, 64), _e4m3_scales(11, 128, 4)
    down_codes, down_scales = _codes(12, 64, 128), _e4m3_scales(13, 64, 8)
    tensors = _float_tensors(reference, ("up.", "down."))
    tensors.update(_ct_tensors("up", up_codes, up_scales, 2.0**8, bias=reference.up.bias.detach()))
    tensors.update(_ct_tensors("down", down_codes, down_scales, 2.0**6))
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
    config = {"quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                    "input_activations": None}},
                                      "ignore": ["re:he.*"]}}
    directory = _write_dir(tmp_path, tensors, "config.json", config)
    model = _tiny(seed=1)  # other weights: the loader must overwrite them
    assert load_quantized(model, directory) == ["up", "down"]
    assert isinstance(model.up, FP4Linear) and isinstance(model.head, nn.Linear)
    assert torch.equal(model.embed.weight, reference.embed.weight) and torch.equal(model.head.bias, reference.head.bias)
    reference.up.weight.data = (_nvfp4_values(up_codes, up_scales) / 2.0**8).float()
    reference.down.weight.data = (_nvfp4_values(down_codes, down_scales) / 2.0**6).float()
    ids = torch.tensor([[1, 2, 3]])
    # Both use the exact weights; prefill-free (3 tokens) so every FP4 layer is the exact gemv.
    h = reference.embed(ids)
    up = _exact(reference.up.weight.double(), h[0]) + 0  # [3, 128] without bias
    torch.testing.assert_close(model.up(h)[0], (up.double() + reference.up.bias.double()).float(), rtol=0, atol=0)
    torch.testing.assert_close(model(ids), reference(ids), rtol=1e-5, atol=1e-5)


def test_loader_finds_disagreements(tmp_path):
    reference = _tiny()
    tensors = _float_tensors(reference, ("up.", "down."))
    tensors.update(_ct_tensors("up", _codes(0, 128, 64), _e4m3_scales(1, 128, 4), 4.0, bias=reference.up.bias.detach()))
    tensors["down.weight"] = reference.down.weight.detach()
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    config = {"quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                      "config_groups": {"group_0": group}, "ignore": ["head"]}}
    directory = _write_dir(tmp_path / "a", tensors, "config.json", config)
    with pytest.raises(ValueError, match="down: the compressed-tensors config quantizes this module but"):
        load_quantized(_tiny(), directory)
    config["quantization_config"]["ignore"] = ["head", "down", "up"]
    directory = _write_dir(tmp_path / "b", tensors, "config.json", config)
    with pytest.raises(ValueError, match="up: the checkpoint has compressed-tensors FP4 tensors but"):
        load_quantized(_tiny(), directory)
    config["quantization_config"]["ignore"] = ["head", "down"]
    directory = _write_dir(tmp_path / "c", dict(tensors, extra=torch.zeros(1)), "config.json", config)
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        load_quantized(_tiny(), directory)
    assert load_quantized(_tiny(), directory, strict=False) == ["up"]
    config["quantization_config"]["format"] = "pack-quantized"
    directory = _write_dir(tmp_path / "d", tensors, "config.json", config)
    with pytest.raises(ValueError, match="format: expected 'nvfp4-pack-quantized'"):
        load_quantized(_tiny(), directory)


@pytest.mark.parametrize("writer,fmt,activations", [
    (save_compressed_tensors, "nvfp4", "weight-only"), (save_compressed_tensors, "nvfp4", "w4a4"),
    (save_modelopt, "nvfp4", "weight-only"), (save_modelopt, "nvfp4", "w4a4"),
    (save_mxfp4, "mxfp4", "weight-only"),  # gpt-oss MXFP4 checkpoints are weight-only
])
def test_writers_round_trip(tmp_path, writer, fmt, activations):
    quantized = _tiny()
    assert quantize_model(quantized, fmt, activations=activations, skip=["head"]) == ["up", "down"]
    ids = torch.randint(0, 10, (4, 5))
    if activations == "w4a4":
        with pytest.raises(ValueError, match="run fp4gemv.nn.calibrate_input_scales first"):
            writer(quantized, tmp_path / "x")
        scales = calibrate_input_scales(quantized, lambda: quantized(ids))
        assert set(scales) == {"up", "down"}
    writer(quantized, tmp_path / "ckpt", config={"model_type": "tiny"})
    config = read_quantization_config(tmp_path / "ckpt")
    assert (config.method, config.fmt) == {save_compressed_tensors: ("compressed-tensors", "nvfp4"),
                                           save_modelopt: ("modelopt", "nvfp4"), save_mxfp4: ("fp4gemv-mxfp4", "mxfp4")}[writer]
    loaded = _tiny(seed=5)
    assert load_quantized(loaded, tmp_path / "ckpt", scale_layout="swizzled") == ["up", "down"]
    assert loaded.up.activations == activations
    for t in (torch.tensor([[1, 2]]), ids):  # decode and prefill paths
        assert torch.equal(loaded(t), quantized(t))


def test_compressed_tensors_checkpoint_rewrites_identically(tmp_path):
    """A divisor that is not a power of two is kept as a divisor, so rewriting gives the same bytes; the
    ModelOpt writer stores fl32(1/g), the multiplier the module computes with, so outputs stay identical."""
    reference = _tiny()
    g = float(torch.tensor(2688.0) / torch.tensor(0.37))
    tensors = _float_tensors(reference, ("up.", "down."))
    tensors.update(_ct_tensors("up", _codes(0, 128, 64), _e4m3_scales(1, 128, 4), g, g / 3,
                               bias=reference.up.bias.detach()))
    tensors.update(_ct_tensors("down", _codes(2, 64, 128), _e4m3_scales(3, 64, 8), g * 5, g / 7))
    args = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    config = {"quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": args,
                                                                    "input_activations": args}},
                                      "ignore": ["head"]}}
    directory = _write_dir(tmp_path / "src", tensors, "config.json", config)
    model = _tiny()
    load_quantized(model, directory)
    assert model.up.activations == "w4a4" and model.up.input_scale_kind() == "divisor"
    save_compressed_tensors(model, tmp_path / "again", config={})
    from safetensors.torch import load_file
    rewritten = load_file(str(tmp_path / "again" / "model.safetensors"))
    for key, value in tensors.items():
        assert torch.equal(rewritten[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key
    save_modelopt(model, tmp_path / "modelopt", config={})
    other = _tiny()
    load_quantized(other, tmp_path / "modelopt")
    assert other.up.weight_scale_kind() == "multiplier"
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(other(ids), model(ids))


def test_compressed_tensors_writer_refuses_inexact_divisors(tmp_path):
    model = _tiny()
    quantize_model(model, skip=["head"], per_tensor="amax")
    multiplier = model.up.weight_multiplier()
    assert float(torch.reciprocal(multiplier).double() * multiplier.double()) != 1.0
    with pytest.raises(ValueError, match="up.weight_scale_2: .* has no exact fp32 reciprocal"):
        save_compressed_tensors(model, tmp_path)
    save_modelopt(model, tmp_path, config={})  # a multiplier is ModelOpt's own form


def test_modelopt_config_forms(tmp_path):
    model = _tiny()
    quantize_model(model, skip=["head"])
    save_modelopt(model, tmp_path / "a", config={})
    nested = json.loads((tmp_path / "a" / "hf_quant_config.json").read_text())
    assert nested["quantization"]["quant_algo"] == "W4A16_NVFP4"
    assert nested["quantization"]["exclude_modules"] == ["head"]
    # config.json's flat form alone, with a wildcard exclusion, is read the same way.
    (tmp_path / "a" / "hf_quant_config.json").unlink()
    flat = json.loads((tmp_path / "a" / "config.json").read_text())
    flat["quantization_config"]["exclude_modules"] = ["he*"]
    (tmp_path / "a" / "config.json").write_text(json.dumps(flat))
    loaded = _tiny(seed=3)
    assert load_quantized(loaded, tmp_path / "a") == ["up", "down"]
    ids = torch.tensor([[3, 4]])
    assert torch.equal(loaded(ids), model(ids))
    flat["quantization_config"]["quant_algo"] = "FP8"
    (tmp_path / "a" / "config.json").write_text(json.dumps(flat))
    with pytest.raises(ValueError, match="quant_algo: expected 'NVFP4' or 'W4A16_NVFP4', got 'FP8'"):
        load_quantized(_tiny(), tmp_path / "a")


def test_layer_tensors_names():
    module = FP4Linear.from_linear(nn.Linear(64, 32), "nvfp4", activations="w4a4", input_scale=0.25)
    assert set(layer_tensors(module, "modelopt", "x")) == {"x.weight", "x.weight_scale", "x.weight_scale_2",
                                                          "x.input_scale", "x.bias"}
    ct = layer_tensors(module, "compressed-tensors", "x")
    assert set(ct) == {"x.weight_packed", "x.weight_scale", "x.weight_global_scale", "x.input_global_scale", "x.bias"}
    assert float(ct["x.input_global_scale"]) == 4.0 and ct["x.weight_scale"].dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="expected mxfp4 for a gpt-oss checkpoint, got nvfp4"):
        layer_tensors(module, "gpt-oss", "x")


def test_config_matching_rules():
    """Each method's own rules for which modules it leaves in float."""
    from fp4gemv.nn import QuantizationConfig

    linear = nn.Linear(16, 16)
    ct = QuantizationConfig("compressed-tensors", {
        "format": "nvfp4-pack-quantized", "ignore": ["re:.*lm_head$", "model.layers.0.mlp.up"],
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 16},
                                "input_activations": None}}})
    assert ct.scheme("model.layers.1.mlp.up", linear) == "weight-only"
    assert ct.scheme("model.layers.0.mlp.up", linear) is None and ct.scheme("lm_head", linear) is None
    assert ct.scheme("model.layers.0.mlp.up", nn.Conv1d(1, 1, 1)) is None  # not a target ("Linear": class name)
    modelopt = QuantizationConfig("modelopt", {"quant_algo": "NVFP4", "exclude_modules": ["*self_attn*", "lm_head"]})
    assert modelopt.scheme("model.layers.3.mlp.up_proj", linear) == "w4a4"
    assert modelopt.scheme("model.layers.3.self_attn.q_proj", linear) is None
    assert modelopt.scheme("lm_head_extra", linear) == "w4a4"  # a whole-name match, not a prefix
    mxfp4 = QuantizationConfig("mxfp4", {"modules_to_not_convert": ["model.layers.*.self_attn", "lm_head", "router"]})
    assert mxfp4.scheme("model.layers.2.self_attn.o_proj", linear) is None  # regex from the start
    assert mxfp4.scheme("model.layers.2.mlp.router", linear) is None  # a suffix
    assert mxfp4.scheme("model.layers.2.mlp.experts", linear) == "weight-only"


def test_load_with_a_key_prefix(tmp_path):
    """A checkpoint saved from a wrapper (keys and config names under "model.") loads into the inner model."""
    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.model = inner

    quantized = _tiny()
    quantize_model(quantized, skip=["head"])
    save_modelopt(Wrapper(quantized), tmp_path, config={})
    assert json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"] == ["model.head"]
    loaded = _tiny(seed=4)
    assert load_quantized(loaded, tmp_path, prefix="model.") == ["up", "down"]
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(loaded(ids), quantized(ids))
    with pytest.raises(ValueError, match="up: the modelopt config quantizes this module but the checkpoint has no FP4"):
        load_quantized(_tiny(), tmp_path)  # without the prefix no key matches


def _file_offsets(path):
    """Each tensor's (file offset, size in bytes) from a safetensors file's header."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    header.pop("__metadata__", None)
    return {k: (8 + length + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
            for k, v in header.items()}


@pytest.mark.parametrize("writer", [save_compressed_tensors, save_modelopt, save_mxfp4])
def test_writers_align_every_tensor(tmp_path, writer):
    """Loaders (transformers, safe_open) use a mapped file's CPU tensors in place, and CPU matmuls round
    differently on misaligned data: every tensor starts on a 64-byte boundary, or on the largest power of two
    dividing its size when that is smaller (a 4-byte scale), so the float head here lands on 64 bytes."""
    model = _tiny()
    quantize_model(model, "mxfp4" if writer is save_mxfp4 else "nvfp4", skip=["head"])
    writer(model, tmp_path, config={"model_type": "tiny"})
    offsets = _file_offsets(tmp_path / "model.safetensors")
    assert offsets["head.weight"][0] % 64 == 0
    for key, (start, nbytes) in offsets.items():
        assert start % math.gcd(64, nbytes) == 0, (key, start, nbytes)


def test_write_safetensors_reads_back_every_dtype(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"scalar": torch.tensor(3.0), "weight": torch.randn(96, 64, generator=g), "scale": torch.tensor([2.0]),
               "bias": torch.randn(7, generator=g), "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
               "e4m3": _e4m3_scales(1, 4, 3), "e8m0": torch.randint(0, 255, (2, 5), generator=g,
                                                                    dtype=torch.uint8).view(torch.float8_e8m0fnu),
               "u8": torch.randint(0, 256, (5, 3), generator=g, dtype=torch.uint8), "empty": torch.empty(0, 4),
               "i64": torch.tensor([2, 4])}
    tensors["view"] = tensors["weight"][1:3]  # shares memory with another tensor
    path = write_safetensors(tensors, tmp_path / "t.safetensors", metadata={"format": "pt"})
    for key, (start, nbytes) in _file_offsets(path).items():
        assert start % math.gcd(64, nbytes) == 0, (key, start, nbytes)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == set(tensors)
        for key, t in tensors.items():
            got = f.get_tensor(key)
            assert got.dtype == t.dtype and got.shape == t.shape, key
            assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), key
    with pytest.raises(TypeError, match=r"c: expected a dtype among .*, got complex64"):
        write_safetensors({"c": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "c.safetensors")


def test_mxfp4_config_reads_both_layer_namings_and_checks_the_format(tmp_path):
    """gpt-oss's quant_method "mxfp4" with its layer names (weight_blocks) and save_mxfp4's "fp4gemv-mxfp4"
    with FP4Linear's own load the same; NVFP4 tensors under it are refused, as MXFP4 ones under an NVFP4
    method."""
    quantized = _tiny()
    quantize_model(quantized, "mxfp4", skip=["head"], scale_layout="linear")
    ids = torch.tensor([[1, 2, 3]])
    for method, convention in (("mxfp4", "gpt-oss"), ("fp4gemv-mxfp4", "modelopt")):
        config = {"quantization_config": {"quant_method": method, "modules_to_not_convert": ["head"]}}
        tensors = _float_tensors(quantized, ("up.", "down."))
        for name in ("up", "down"):
            tensors.update(layer_tensors(getattr(quantized, name), convention, name))
        directory = _write_dir(tmp_path / convention, tensors, "config.json", config)
        loaded = _tiny(seed=3)
        assert load_quantized(loaded, directory) == ["up", "down"]
        assert torch.equal(loaded(ids), quantized(ids)), convention
    nvfp4 = _tiny()
    quantize_model(nvfp4, "nvfp4", skip=["head"])
    tensors = _float_tensors(nvfp4, ("up.", "down."))
    for name in ("up", "down"):
        tensors.update(layer_tensors(getattr(nvfp4, name), "modelopt", name))
    directory = _write_dir(tmp_path / "nvfp4", tensors, "config.json", config)
    with pytest.raises(ValueError, match="up.weight_scale: expected mxfp4 block scales as the quantization config "
                                         "says, got nvfp4"):
        load_quantized(_tiny(), directory)
    save_mxfp4(quantized, tmp_path / "mx", config={})
    (tmp_path / "mx" / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "W4A16_NVFP4", "exclude_modules": ["head"]}}))
    with pytest.raises(ValueError, match="up.weight_scale: expected nvfp4 block scales as the quantization config "
                                         "says, got mxfp4"):
        load_quantized(_tiny(), tmp_path / "mx")


@pytest.mark.parametrize("writer,fmt", [(save_compressed_tensors, "mxfp4"), (save_modelopt, "mxfp4"),
                                        (save_mxfp4, "nvfp4")])
def test_writers_refuse_the_other_format(tmp_path, writer, fmt):
    model = _tiny()
    quantize_model(model, fmt, skip=["head"])
    other = "save_mxfp4" if fmt == "mxfp4" else "save_compressed_tensors or save_modelopt"
    with pytest.raises(ValueError, match=f"up: expected {'nvfp4' if fmt == 'mxfp4' else 'mxfp4'} modules in this "
                                         f"checkpoint, got {fmt} \\({other} writes those\\)"):
        writer(model, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
