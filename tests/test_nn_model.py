"""quantize_model (which modules, skip patterns, errors) and calibrate_input_scales."""

import pytest
import torch
from torch import nn

from fp4gemv import dequantize
from fp4gemv.nn import FP4Linear, calibrate_input_scales, per_tensor_scale, quantize_model


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(),
                         nn.ModuleDict({"inner": nn.Linear(128, 64), "head": nn.Linear(128, 32)}))


def test_quantize_model_replaces_every_linear_but_skipped():
    model = _model()
    assert quantize_model(model) == ["0", "2.inner", "2.head"]
    assert all(isinstance(m, FP4Linear) for m in (model[0], model[2]["inner"], model[2]["head"]))
    model = _model()
    assert quantize_model(model, "mxfp4", skip=["2.h*"]) == ["0", "2.inner"]
    assert type(model[2]["head"]) is nn.Linear and model[0].fmt == "mxfp4"
    model = _model()
    assert quantize_model(model, skip="2") == ["0"]  # everything under a skipped module stays float


def test_quantize_model_errors():
    model = nn.Sequential(nn.Linear(48, 16), nn.Linear(16, 8))
    with pytest.raises(ValueError, match=r"1: in_features 16 is not a multiple of the mxfp4 block size 32; "
                                         r"pass skip=\['1'\]"):
        quantize_model(model, "mxfp4", skip=["0"])
    assert type(model[1]) is nn.Linear  # nothing replaced before the error
    with pytest.raises(TypeError, match="model: expected a module containing nn.Linear modules"):
        quantize_model(nn.Linear(64, 64))
    with pytest.raises(ValueError, match="activations: expected 'weight-only' or 'w4a4'"):
        quantize_model(_model(), activations="w8a8")


def test_calibrate_input_scales():
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    quantize_model(model, activations="w4a4")
    x = torch.randn(20, 64) * 7
    scales = calibrate_input_scales(model, lambda: model(x))
    # During calibration activations pass unquantized (20 tokens: the prefill path of the FP4 weights).
    with torch.no_grad():
        h = model[1](nn.functional.linear(x, dequantize(model[0].quantized_weight()), model[0].bias))
    assert scales == {"0": float(per_tensor_scale(x.abs().amax())), "2": float(per_tensor_scale(h.abs().amax()))}
    assert all(m.input_scale_kind() == "multiplier" and m.activations == "w4a4" for m in (model[0], model[2]))
    with torch.no_grad():
        expected = model[2].quantize_input(torch.randn(3, 128))
    assert float(expected.global_scale) == scales["2"]  # the static scale is what forward now uses

    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            return self.used(x)

    model = Unused()
    quantize_model(model, activations="w4a4")
    with pytest.raises(ValueError, match=r"unused: run\(\) did not call this W4A4 module"):
        calibrate_input_scales(model, lambda: model(x))
    assert model.used.activations == "w4a4"  # restored after the run
