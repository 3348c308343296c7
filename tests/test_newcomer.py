"""What a new user meets first: argument checks that name the real argument, values refused before they give
silent zeros or NaNs, and the messages of the CPU-only machine."""

import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import fp4gemv
from fp4gemv import FP4Tensor, gemv
from fp4gemv.nn import quantize_model

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _operands():
    w = fp4gemv.quantize(torch.randn(32, 64), "nvfp4")
    return w.data, w.scales


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf, -math.inf, 1e-45, 2.0**-127])
def test_fp4tensor_refuses_a_global_scale_quantize_refuses(value):
    data, scales = _operands()
    with pytest.raises(ValueError, match=r"global_scale: expected a positive normal float32 \(2\^-126 or more, "
                                         r"finite\), got"):
        FP4Tensor(data, scales, "nvfp4", "linear", global_scale=value)
    with pytest.raises(ValueError, match=r"global_scale: expected a positive normal float32"):
        fp4gemv.quantize(torch.randn(32, 64), "nvfp4", global_scale=value)
    # A tensor's value is read only when asked (reading it synchronises the device).
    tensor = torch.tensor(value, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"global_scale: expected a positive normal float32"):
        FP4Tensor(data, scales, "nvfp4", "linear", global_scale=tensor, check_values=True)
    assert FP4Tensor(data, scales, "nvfp4", "linear", global_scale=tensor).global_scale is not None


def test_fp4tensor_accepts_the_smallest_normal_global_scale():
    data, scales = _operands()
    t = FP4Tensor(data, scales, "nvfp4", "linear", global_scale=2.0**-126)
    assert float(t.global_scale) == 2.0**-126


def test_nvfp4_without_a_global_scale_saturates_as_documented():
    """Block scales are e4m3 (largest 448, smallest 2^-9): without a global scale NVFP4 holds magnitudes up to
    6 * 448 = 2688 and flushes those below 2^-11 to zero; global_scale="auto" keeps both."""
    big, small = torch.full((1, 16), 1e6), torch.full((1, 16), 1e-6)
    assert torch.equal(fp4gemv.dequantize(fp4gemv.quantize(big)), torch.full((1, 16), 2688.0))
    assert torch.equal(fp4gemv.dequantize(fp4gemv.quantize(small)), torch.zeros(1, 16))
    for x in (big, small):
        torch.testing.assert_close(fp4gemv.dequantize(fp4gemv.quantize(x, global_scale="auto")), x, rtol=0.1, atol=0)


def test_out_dtype_as_a_string_names_its_type():
    w = fp4gemv.quantize(torch.randn(32, 64), "nvfp4")
    with pytest.raises(TypeError, match=r"out_dtype: expected a torch.dtype among float16, bfloat16, float32, "
                                        r"got str 'float16'"):
        gemv(w, torch.randn(64), out_dtype="float16")


def test_quantize_model_rejects_the_format_first():
    model = nn.Sequential(nn.Linear(48, 16))  # 48 is no multiple of either block size
    with pytest.raises(ValueError, match="fmt: expected 'nvfp4' or 'mxfp4', got 'int4'"):
        quantize_model(model, "int4")


def test_interpreter_switched_on_after_import_says_so():
    """Triton reads TRITON_INTERPRET when the kernels are defined (at import): switching it on later is refused
    with a message saying when to set it, not Triton's "0 active drivers"."""
    script = (
        "import os, torch, fp4gemv\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "w = fp4gemv.quantize(torch.randn(32, 64))\n"
        "try:\n"
        "    fp4gemv.gemv(w, torch.randn(64), backend='triton')\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("backend: 'triton' on device cpu needs TRITON_INTERPRET=1 set before fp4gemv is "
                                  "imported"), done.stdout


def _adapter_step(device):
    """An adapter trained on a frozen FP4 base, as a fine-tuning user writes it: the gradient reaches the adapter
    through FP4Linear (x @ W^T of the dequantized weight), the base gets none."""
    from fp4gemv.nn import FP4Linear

    torch.manual_seed(0)
    base = FP4Linear.from_linear(nn.Linear(64, 32).to(device=device, dtype=torch.bfloat16), "nvfp4")
    adapter = nn.Linear(64, 64, bias=False).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(3, 64, device=device, dtype=torch.bfloat16)
    with torch.no_grad():  # a decode call first: on CUDA, FP4Linear keeps its launch, which records no graph
        base(adapter(x))
    y = base(adapter(x))
    assert y.grad_fn is not None
    y.float().square().sum().backward()
    # float64: the same step with the dequantized weight.
    h = adapter(x).detach().double().requires_grad_()
    w = fp4gemv.dequantize(base.quantized_weight(), torch.float64)
    (h @ w.T + base.bias.double()).square().sum().backward()
    want = h.grad.T @ x.double()
    # bf16 roundings on the way (y, dy, db, the adapter's own product): a few bf16 ulps of the largest entry.
    torch.testing.assert_close(adapter.weight.grad.double().cpu(), want.cpu(), rtol=2**-6,
                               atol=2**-6 * want.abs().max().item())
    assert all(p.grad is None for p in base.parameters())


def test_an_adapter_trains_on_a_frozen_fp4_base():
    _adapter_step("cpu")


@pytest.mark.gpu
def test_an_adapter_trains_on_a_frozen_fp4_base_on_gpu():
    _adapter_step("cuda")


def test_w4a4_fp4linear_runs_in_grad_mode_and_its_backward_says_it_has_none():
    """Inference outside torch.no_grad() works (a model's hidden states require grad there); a backward through
    W4A4 raises its own message instead of PyTorch's "does not require grad"."""
    from fp4gemv.nn import FP4Linear

    layer = FP4Linear.from_linear(nn.Linear(64, 32), "nvfp4", activations="w4a4")
    x = torch.randn(2, 64, requires_grad=True)
    y = layer(x)
    with torch.no_grad():
        assert torch.equal(y, layer(x))
    with pytest.raises(RuntimeError, match=r"FP4Linear with activations='w4a4' has no backward"):
        y.sum().backward()
