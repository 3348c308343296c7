"""FP4Linear's eager decode: a kept launch for repeated calls of the same metadata (one check, then the
compiled kernel's launcher), dropped whenever the metadata or the module's tensors change; W4A4 keeps its
activation's quantization too (with a static scale, or NVFP4's scale of each call's amax: the amax kernel and the
quantize kernel), and its per-call activation quantization reads nothing back (no device synchronisation)."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import fp4gemv.nn.linear as linear_module
from fp4gemv import ops
from fp4gemv.nn import FP4Linear


class _RecordingPrepared:
    """Stands for a prepared call launched on addresses (the CPU has none): records the addresses of each."""

    launches_by_address = True

    def __init__(self):
        self.launches = []

    def launch_at(self, addresses):
        self.launches.append(addresses)


@pytest.fixture
def recording(monkeypatch):
    fake = _RecordingPrepared()
    monkeypatch.setattr(linear_module, "ops", SimpleNamespace(prepare_gemv=lambda *a, **k: fake,
                                                              GemvAddresses=ops.GemvAddresses))
    return fake


def _layer(bias=True):
    torch.manual_seed(0)
    return FP4Linear.from_linear(nn.Linear(64, 48, bias=bias), "nvfp4")


def test_a_repeated_call_launches_the_kept_plan_with_this_calls_pointers(recording):
    layer = _layer()
    x = torch.randn(1, 1, 64)
    first = layer(x)  # the ordinary call, which keeps the launch
    assert recording.launches == [] and first.shape == (1, 1, 48)
    weight = layer.quantized_weight()
    for _ in range(3):
        x = torch.randn(1, 1, 64)
        y = layer(x)
        assert y.shape == (1, 1, 48) and y.dtype == torch.float32
        addresses = recording.launches[-1]
        assert addresses == ops.GemvAddresses(weight.data.data_ptr(), weight.scales.data_ptr(), x.data_ptr(),
                                              y.data_ptr(), 0, weight.global_scale.data_ptr(), 0)
    assert len(recording.launches) == 3


@pytest.mark.parametrize("change", ["dtype", "tokens", "stride", "weight", "bias", "scale in place", "to()"])
def test_the_kept_launch_is_not_used_when_anything_it_depends_on_changes(recording, change):
    layer = _layer()
    x = torch.randn(2, 64)
    layer(x)
    layer(x)
    assert len(recording.launches) == 1
    if change == "dtype":
        x = x.bfloat16()
    elif change == "tokens":
        x = torch.randn(3, 64)
    elif change == "stride":
        x = torch.randn(2, 128)[:, :64]
    elif change == "weight":
        layer.weight = layer.weight.clone()
    elif change == "bias":
        layer.bias = nn.Parameter(layer.bias.detach().clone(), requires_grad=False)
    elif change == "scale in place":
        layer.weight_scale_2.mul_(2)
    else:
        layer.to(torch.bfloat16)
        x = x.bfloat16()
    expected = FP4Linear.from_state_dict(layer.state_dict())(x) if change != "stride" else None
    y = layer(x)
    assert len(recording.launches) == 1  # the ordinary call ran
    if expected is not None:
        assert torch.equal(y, expected)


class _RecordingQuantize:
    """Stands for a kept quantize launched on addresses: records the addresses of each (and the global scale it
    was prepared with); a per-call scale ("pow2") takes 8 partial maxima, as the real one's ``amax_partials``."""

    launches_by_address = True

    def __init__(self, calls, global_scale):
        self.calls = calls
        self.amax_partials = 8 if isinstance(global_scale, str) else 0
        calls.append(("prepared", global_scale))

    def launch_at(self, addresses):
        self.calls.append(("quantize", addresses))


@pytest.fixture
def recording_w4a4(monkeypatch):
    """Both launches of a kept W4A4 call, in order: ("quantize", its addresses), ("gemv", GemvAddresses)."""
    calls = []
    gemv = SimpleNamespace(launches_by_address=True, launch_at=lambda addresses: calls.append(("gemv", addresses)))
    monkeypatch.setattr(linear_module, "ops", SimpleNamespace(prepare_gemv=lambda *a, **k: gemv,
                                                              GemvAddresses=ops.GemvAddresses,
                                                              without_backward=ops.without_backward))
    monkeypatch.setattr(linear_module, "prepare_quantize",
                        lambda x, fmt, layout, global_scale=None: _RecordingQuantize(calls, global_scale))
    return calls


def _launches(calls):
    return [call for call in calls if call[0] != "prepared"]


@pytest.mark.parametrize("fmt, input_scale", [("nvfp4", 0.25), ("mxfp4", None), ("mxfp4", 0.5), ("nvfp4", None)])
def test_w4a4_keeps_its_quantize_and_product(recording_w4a4, fmt, input_scale):
    """The quantize writes the activation's codes and scales into new tensors that the product then reads, with
    the module's input multiplier as the activation's global scale.  NVFP4 without a static scale: the kept
    quantize is prepared with global_scale="pow2" (the amax kernel, then the quantize kernel that computes the
    scale), and each call gives it new tensors for that scale and the partial maxima too; the product reads that
    scale as the activation's global one."""
    torch.manual_seed(0)
    layer = FP4Linear.from_linear(nn.Linear(64, 48), fmt, activations="w4a4", input_scale=input_scale)
    layer(torch.randn(2, 64))  # the ordinary call, which keeps the launches
    per_call = fmt == "nvfp4" and input_scale is None
    g = layer.input_multiplier()
    assert recording_w4a4 == [("prepared", "pow2" if per_call else g)]
    weight = layer.quantized_weight()
    for _ in range(2):
        x = torch.randn(2, 64)
        y = layer(x)
        assert y.shape == (2, 48)
        (q_name, (px, pdata, pscales, pg, ppartials)), (g_name, product) = recording_w4a4[-2:]
        assert (q_name, g_name) == ("quantize", "gemv")
        assert px == x.data_ptr()
        if per_call:
            assert pg and ppartials and len({pdata, pscales, px, y.data_ptr(), pg, ppartials}) == 6
        else:
            assert pg == (0 if g is None else g.data_ptr()) and ppartials == 0
        wg = weight.global_scale
        assert product == ops.GemvAddresses(weight.data.data_ptr(), weight.scales.data_ptr(), pdata, y.data_ptr(),
                                            pscales, 0 if wg is None else wg.data_ptr(), pg)
        assert pdata and pscales and len({pdata, pscales, px, y.data_ptr()}) == 4
    assert len(_launches(recording_w4a4)) == 4


@pytest.mark.parametrize("change", ["scale replaced", "scale in place", "scale removed"])
def test_w4a4_kept_launch_follows_the_input_scale(recording_w4a4, change):
    torch.manual_seed(0)
    layer = FP4Linear.from_linear(nn.Linear(64, 48), "mxfp4", activations="w4a4", input_scale=0.5)
    x = torch.randn(2, 64)
    layer(x)
    layer(x)
    assert len(_launches(recording_w4a4)) == 2
    if change == "scale replaced":
        layer.set_input_scale(torch.tensor(0.25))
    elif change == "scale in place":
        layer.input_scale.mul_(2)
    else:
        del layer._buffers["input_scale"]
    expected = FP4Linear.from_state_dict(layer.state_dict(), activations="w4a4")(x)
    y = layer(x)
    assert len(_launches(recording_w4a4)) == 2  # the ordinary call ran
    assert torch.equal(y, expected)


def test_w4a4_per_call_kept_launch_gives_way_to_a_static_scale(recording_w4a4):
    torch.manual_seed(0)
    layer = FP4Linear.from_linear(nn.Linear(64, 48), "nvfp4", activations="w4a4")
    x = torch.randn(2, 64)
    layer(x)
    layer(x)
    assert len(_launches(recording_w4a4)) == 2
    layer.set_input_scale(torch.tensor(0.25))
    expected = FP4Linear.from_state_dict(layer.state_dict(), activations="w4a4")(x)
    y = layer(x)
    assert len(_launches(recording_w4a4)) == 2  # the ordinary call ran, and kept the static scale's launches
    assert torch.equal(y, expected) and recording_w4a4[-1][0] == "prepared"
    assert recording_w4a4[-1][1] is layer.input_scale


def test_no_kept_launch_on_the_reference_path():
    layer = _layer()
    x = torch.randn(2, 64)
    layer(x)
    assert layer.__dict__.get("_decode_launch") is None  # the float64 reference has no compiled kernel


@pytest.mark.parametrize("static", [False, True])
def test_w4a4_reads_nothing_back_per_call(monkeypatch, static):
    """Reading a tensor's value (item, bool, float) is a device synchronisation on CUDA: none per call in the
    module or the quantize op (the CPU codec, formats.py, reads values; CUDA runs the Triton kernel instead)."""
    torch.manual_seed(0)
    layer = FP4Linear.from_linear(nn.Linear(64, 48), "nvfp4", activations="w4a4",
                                  input_scale=0.25 if static else None)
    x = torch.randn(2, 64)
    layer(x)  # the first call may plan
    reads = []
    for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
        original = getattr(torch.Tensor, name)

        def recorder(self, *args, _original=original, _name=name):
            caller = sys._getframe(1).f_code.co_filename
            if caller.endswith((os.path.join("fp4gemv", "quantize.py"), os.path.join("nn", "linear.py"),
                                os.path.join("fp4gemv", "tensor.py"), os.path.join("fp4gemv", "ops.py"))):
                reads.append((_name, caller))
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, recorder)
    layer(x)
    monkeypatch.undo()
    assert reads == []


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tokens", [1, 4])
def test_cuda_kept_launch_gives_the_ordinary_calls_bits(bias, tokens):
    torch.manual_seed(0)
    layer = FP4Linear.from_linear(nn.Linear(4096, 1024, bias=bias, device="cuda", dtype=torch.bfloat16), "nvfp4")
    x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    ordinary = layer(x)
    assert layer.__dict__.get("_decode_launch") is not None
    for _ in range(2):
        x2 = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
        expected = FP4Linear.from_state_dict(layer.state_dict())(x2)
        assert torch.equal(layer(x2), expected)
    assert torch.equal(layer(x), ordinary)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, input_scale", [("nvfp4", 0.01), ("mxfp4", None), ("nvfp4", None)])
@pytest.mark.parametrize("tokens", [1, 4])
def test_cuda_w4a4_kept_launch_gives_the_ordinary_calls_bits(fmt, input_scale, tokens):
    torch.manual_seed(0)
    linear = nn.Linear(4096, 1024, device="cuda", dtype=torch.bfloat16)
    layer = FP4Linear.from_linear(linear, fmt, activations="w4a4", input_scale=input_scale)
    x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ordinary = layer(x)
        assert layer.__dict__.get("_decode_launch") is not None
        for _ in range(2):
            x2 = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
            y2 = layer(x2)
            expected = FP4Linear.from_state_dict(layer.state_dict(), activations="w4a4")(x2)
            assert torch.equal(y2, expected)
        assert torch.equal(layer(x), ordinary)


@pytest.mark.gpu
def test_cuda_w4a4_call_does_not_synchronise():
    torch.manual_seed(0)
    layer = FP4Linear.from_linear(nn.Linear(4096, 1024, device="cuda"), "nvfp4", activations="w4a4")
    x = torch.randn(1, 4096, device="cuda")
    layer(x)
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _per_call_definition(layer: FP4Linear, x: torch.Tensor) -> torch.Tensor:
    """W4A4 NVFP4 with the per-call scale as it was computed before the kernel: per_tensor_scale of x's amax by
    torch ops, then the quantize and the product, as the module's ordinary call runs them."""
    from fp4gemv import gemv, quantize
    from fp4gemv.nn import per_tensor_scale
    activation = quantize(x, "nvfp4", "linear", per_tensor_scale(x.abs().amax()), check_values=False)
    y = torch.empty(x.shape[0], layer.out_features, dtype=x.dtype, device=x.device)
    gemv(layer.quantized_weight(), activation, out=y.t(), out_dtype=x.dtype)
    return y if layer.bias is None else y.add_(layer.bias)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_cuda_w4a4_per_call_kept_launch_is_the_torch_definitions_product(tokens):
    """The kept per-call launches (amax kernel, quantize kernel, product) against the scale computed by torch ops
    (``per_tensor_scale``), on activations of several magnitudes, all zeros (scale 1) and with a NaN (scale 1,
    NaN outputs where its block reaches)."""
    torch.manual_seed(0)
    linear = nn.Linear(4096, 1024, device="cuda", dtype=torch.bfloat16)
    layer = FP4Linear.from_linear(linear, "nvfp4", activations="w4a4")
    with torch.no_grad():
        layer(torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16))
        assert layer.__dict__.get("_decode_launch") is not None
        for magnitude in (1.0, 1e-30, 3e4, 0.0, "nan"):
            x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
            if magnitude == "nan":
                x[-1, 100] = float("nan")
            else:
                x = x * magnitude
            y = layer(x)
            expected = _per_call_definition(layer, x)
            assert torch.equal(torch.isnan(y), torch.isnan(expected)), magnitude
            assert torch.equal(y.nan_to_num(), expected.nan_to_num()), magnitude
            assert layer.__dict__.get("_decode_launch") is not None


@pytest.mark.gpu
def test_cuda_w4a4_per_call_kept_launch_replays_in_a_cuda_graph():
    """Captured once, the per-call launches compute each replay's own scale (no host work, no atomics)."""
    torch.manual_seed(0)
    layer = FP4Linear.from_linear(nn.Linear(4096, 1024, device="cuda", dtype=torch.bfloat16), "nvfp4",
                                  activations="w4a4")
    static_x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer(static_x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(static_x)  # the kept launch, warmed up off the capture
        torch.cuda.current_stream().wait_stream(side)
        assert layer.__dict__.get("_decode_launch") is not None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
        for magnitude in (1.0, 1e-3, 50.0):
            x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16) * magnitude
            static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_y, _per_call_definition(layer, x)), magnitude
