"""FP4Tensor: construction and validation, dequantize, layouts, devices, the task views, and quantize."""

import pytest
import torch

from fp4gemv import FP4Tensor, dequantize, formats, layouts, quantize, task

E2M1_GRID = torch.tensor(formats.E2M1_VALUES, dtype=torch.float64)


def _bytes(*shape, seed=0):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _nvfp4_scales(*shape, seed=0):
    """Finite e4m3 bytes (0x7F / 0xFF are NaN)."""
    return _bytes(*shape, seed=seed) & 0x7E


def _tensor(fmt="nvfp4", layout="linear", batch=(2,), rows=200, k=128, global_scale=None, seed=0):
    bs = formats.FORMATS[fmt].block_size
    data = _bytes(*batch, rows, k // 2, seed=seed)
    scales = _nvfp4_scales(*batch, rows, k // bs, seed=seed + 1) if fmt == "nvfp4" else (
        torch.randint(100, 140, (*batch, rows, k // bs), dtype=torch.uint8))
    return FP4Tensor(data, scales, fmt, "linear", global_scale).with_scale_layout(layout)


# --- construction ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("batch", [(), (3,)])
def test_shape_and_properties(fmt, layout, batch):
    t = _tensor(fmt, layout, batch, rows=130, k=64)
    assert t.shape == torch.Size((*batch, 130, 64)) and t.ndim == len(batch) + 2
    assert (t.rows, t.k, t.device, t.fmt.name, t.scale_layout) == (130, 64, torch.device("cpu"), fmt, layout)
    bs = t.fmt.block_size
    expected = (*batch, 130, 64 // bs) if layout == "linear" else (*batch, 256 * 4)  # 130 -> 256 rows, cols -> 4
    assert tuple(t.scales.shape) == expected
    assert "FP4Tensor(shape=" in repr(t) and fmt in repr(t)


def test_keeps_given_memory_as_uint8_views():
    data = _bytes(128, 32).view(torch.float4_e2m1fn_x2)
    scales = _nvfp4_scales(128, 4).view(torch.float8_e4m3fn)
    t = FP4Tensor(data, scales, global_scale=0.5)
    assert t.data.dtype == t.scales.dtype == torch.uint8
    assert t.data.data_ptr() == data.data_ptr() and t.scales.data_ptr() == scales.data_ptr()
    assert t.global_scale.dtype == torch.float32 and t.global_scale.shape == () and t.global_scale.item() == 0.5
    mx = FP4Tensor(_bytes(128, 32), torch.full((128, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu), "mxfp4")
    assert mx.fmt is formats.MXFP4 and mx.scales.dtype == torch.uint8
    assert FP4Tensor(_bytes(128, 32), _nvfp4_scales(128, 4), formats.NVFP4).fmt is formats.NVFP4


def _data():
    return _bytes(2, 128, 32)


def _scales():
    return _nvfp4_scales(2, 128, 4)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(data=[1, 2]), TypeError, ["data:", "torch.Tensor", "list"]),
        (dict(data=_data().to(torch.float16)), TypeError, ["data:", "uint8 or float4_e2m1fn_x2", "float16"]),
        (dict(data=_data()[0, 0]), ValueError, ["data:", "[R, K/2] or [L, R, K/2]", "(32,)"]),
        (dict(data=_data()[:, :0]), ValueError, ["data:", "sizes >= 1"]),
        (dict(data=_data().transpose(1, 2).contiguous().transpose(1, 2)), ValueError, ["data:", "stride 1 along K/2"]),
        (dict(data=_data()[..., :12], scales=_scales()[..., :1]), ValueError,
         ["data:", "multiple of the nvfp4 block size 16", "K = 24"]),
        (dict(fmt="mxfp4", scales=_scales()[..., :2].view(torch.float8_e4m3fn)), TypeError,
         ["scales:", "uint8 or float8_e8m0fnu"]),
        (dict(data=_bytes(2, 128, 24), fmt="mxfp4"), ValueError, ["data:", "block size 32", "K = 48"]),
        (dict(fmt="int4"), ValueError, ["fmt:", "'nvfp4' or 'mxfp4'", "'int4'"]),
        (dict(fmt=16), TypeError, ["fmt:", "int"]),
        (dict(scale_layout="blocked"), ValueError, ["scale_layout:", "'linear' or 'swizzled'", "'blocked'"]),
        (dict(scales=_scales().view(torch.float8_e4m3fn).float()), TypeError, ["scales:", "float8_e4m3fn", "float32"]),
        (dict(scales=_scales()[:, :64]), ValueError, ["scales:", "(2, 128, 4)", "(2, 64, 4)"]),
        (dict(scale_layout="swizzled"), ValueError, ["scales:", "(2, 512)", "swizzled", "(2, 128, 4)"]),
        (dict(scales=_bytes(2, 4, 128).transpose(1, 2)), ValueError, ["scales:", "stride 1"]),
        (dict(scales=_scales().to("meta")), ValueError, ["scales:", "device cpu", "meta"]),
        (dict(global_scale=torch.tensor(2.0, dtype=torch.float64)), TypeError, ["global_scale:", "float32", "float64"]),
        (dict(global_scale=torch.ones(2)), ValueError, ["global_scale:", "one value", "(2,)"]),
        (dict(global_scale=torch.ones((), device="meta")), ValueError, ["global_scale:", "device cpu", "meta"]),
        (dict(global_scale="2"), TypeError, ["global_scale:", "None, a number or a float32 tensor", "str"]),
        (dict(global_scale=True), TypeError, ["global_scale:", "None, a number or a float32 tensor", "bool"]),
    ],
)
def test_constructor_names_the_bad_argument(kwargs, exc, words):
    args = dict(data=_data(), scales=_scales(), fmt="nvfp4", scale_layout="linear", global_scale=None) | kwargs
    with pytest.raises(exc) as info:
        FP4Tensor(**args)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"


# --- values ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_dequantize_is_formats_dequantize_in_either_layout(fmt):
    linear = _tensor(fmt, "linear", global_scale=0.375)
    want = formats.dequantize(linear.data, linear.scales, linear.fmt, 0.375)
    assert torch.equal(dequantize(linear, torch.float64), want)
    assert torch.equal(dequantize(linear.with_scale_layout("swizzled"), torch.float64), want)
    plain = FP4Tensor(linear.data, linear.scales, fmt)
    assert dequantize(plain).dtype == torch.float32
    assert torch.equal(dequantize(plain).double(), dequantize(plain, torch.float64))  # exact in fp32 without global


def test_with_scale_layout_round_trips_and_matches_layouts():
    t = _tensor("nvfp4", "linear", rows=200, k=192)
    sw = t.with_scale_layout("swizzled")
    assert torch.equal(sw.scales, layouts.swizzle_scales(t.scales))
    assert torch.equal(sw.with_scale_layout("linear").scales, t.scales)
    assert t.with_scale_layout("linear") is t
    with pytest.raises(ValueError, match="scale_layout: expected 'linear' or 'swizzled', got 'x'"):
        t.with_scale_layout("x")


@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("n", [1, 127, 129, 200])
def test_first_rows_is_a_view_of_the_first_rows(layout, n):
    t = _tensor("mxfp4", layout, rows=200, k=128)
    head = t.first_rows(n)
    assert head.shape == (2, n, 128) and head.data.data_ptr() == t.data.data_ptr()
    assert head.scales.data_ptr() == t.scales.data_ptr()
    assert torch.equal(dequantize(head), dequantize(t)[:, :n])


def test_first_rows_rejects_out_of_range():
    with pytest.raises(ValueError, match="n: expected 1 <= n <= 200 rows, got 0"):
        _tensor().first_rows(0)
    with pytest.raises(ValueError, match="got 201"):
        _tensor().first_rows(201)


def test_to_moves_every_part():
    t = _tensor(global_scale=2.0)
    assert t.to("cpu") is t
    moved = t.to("meta")
    assert moved.device.type == "meta" and moved.scales.device.type == "meta"
    assert moved.global_scale.device.type == "meta" and moved.shape == t.shape and moved.fmt is t.fmt
    assert repr(moved) == ("FP4Tensor(shape=(2, 200, 128), fmt='nvfp4', scale_layout='linear', global_scale=(meta), "
                           "device=meta)")
    with pytest.raises(ValueError, match=r"global_scale: expected values to check, got a meta tensor \(it has "
                                         r"none\): pass check_values=False"):
        FP4Tensor(moved.data, moved.scales, global_scale=moved.global_scale, check_values=True)


def test_to_names_a_device_it_cannot_reach(monkeypatch):
    t = _tensor()
    with pytest.raises(TypeError, match="device: expected a device .*fp4gemv.dequantize.*, got torch.float16"):
        t.to(torch.float16)
    with pytest.raises(ValueError, match="device: expected a torch.device or a name such as 'cpu' or 'cuda', got "
                                         "'cud'"):
        t.to("cud")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device: expected a device this machine has, got cuda "
                                         r"\(torch.cuda.is_available\(\) is False\)"):
        t.to("cuda")


@pytest.mark.gpu
def test_to_cuda_and_back_keeps_bytes():
    t = _tensor("mxfp4", "swizzled", global_scale=0.5)
    back = t.to("cuda").to("cpu")
    assert torch.equal(back.data, t.data) and torch.equal(back.scales, t.scales)
    assert torch.equal(dequantize(back), dequantize(t))


# --- the task's operands --------------------------------------------------------------------------------


def test_from_task_views_the_task_operands():
    a, b, sfa, sfb, sfa_p, sfb_p, _ = task.generate_full_range_input(256, 512, 2, seed=3, device="cpu")
    ta = FP4Tensor.from_task(a, sfa_p)
    assert ta.shape == (2, 256, 512) and ta.scale_layout == "swizzled" and ta.fmt is formats.NVFP4
    assert ta.data.data_ptr() == a.data_ptr() and ta.scales.data_ptr() == sfa_p.data_ptr()
    want = formats.dequantize(a.permute(2, 0, 1), sfa.permute(2, 0, 1))
    assert torch.equal(dequantize(ta, torch.float64), want)
    tb = FP4Tensor.from_task(b, sfb_p).first_rows(1)
    want_b = formats.dequantize(b[:1].permute(2, 0, 1), sfb[:1].permute(2, 0, 1))
    assert torch.equal(dequantize(tb, torch.float64), want_b)


def test_from_task_rejects_what_is_not_the_tasks_memory():
    a, _, _, _, sfa_p, _, _ = task.generate_input(128, 256, 2, seed=0, device="cpu")
    cases = [
        ((a[:, :, 0], sfa_p), "operand: expected 3 dims"),
        ((a.contiguous(), sfa_p), "operand: expected stride 1 along K/2"),
        ((a, sfa_p.float()), "sf_permuted: expected dtype uint8 or float8_e4m3fn"),
        ((a, sfa_p[..., :1]), "sf_permuted: expected shape (32, 4, 1, 4, 4, 2) for 128 rows, K = 256, L = 2"),
        ((a, sfa_p.contiguous()), "sf_permuted: expected the permute(3, 4, 1, 5, 2, 0) view"),
    ]
    for args, message in cases:
        with pytest.raises((TypeError, ValueError), match=message.replace("(", r"\(").replace(")", r"\)")):
            FP4Tensor.from_task(*args)


# --- quantize -------------------------------------------------------------------------------------------


def _representable(fmt, shape, seed, global_scale=None):
    """Values code * scale (* global) with a ±6 in every block: the quantizer's own choice of scale."""
    g = torch.Generator().manual_seed(seed)
    f = formats.FORMATS[fmt]
    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    codes[..., :: f.block_size] = torch.where(torch.rand(codes[..., :: f.block_size].shape, generator=g) < 0.5, 7, 15)
    scale_shape = (*shape[:-1], shape[-1] // f.block_size)
    if fmt == "nvfp4":
        scales = _nvfp4_scales(*scale_shape, seed=seed) | 0x08  # normal, positive
        scales &= 0x7E
    else:
        scales = torch.randint(127 - 30, 127 + 30, scale_shape, generator=g, dtype=torch.uint8)
    t = FP4Tensor(formats.pack_e2m1(codes), scales, fmt, global_scale=global_scale)
    return t, dequantize(t, torch.float64)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("global_scale", [None, 0.7])
def test_quantize_representable_values_is_exact(fmt, global_scale):
    t, x = _representable(fmt, (2, 130, 128), seed=1, global_scale=global_scale)
    q = quantize(x, fmt, global_scale=global_scale)
    assert torch.equal(dequantize(q, torch.float64), x)
    assert torch.equal(q.scales, t.scales)
    if global_scale is None:  # fp32 holds these values exactly
        assert torch.equal(dequantize(quantize(x.float(), fmt), torch.float64), x)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_rounds_each_element_to_the_nearest_code_of_its_scale(fmt, dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 64, 256, generator=g) * torch.exp2(torch.randint(-6, 6, (3, 64, 1), generator=g))).to(dtype)
    gs = x.float().abs().max() / (6 * 448) if fmt == "nvfp4" else None
    q = quantize(x, fmt, "swizzled", global_scale=gs)
    assert q.scale_layout == "swizzled"
    bs = q.fmt.block_size
    scale = formats.decode_scales(q.linear_scales(), q.fmt).double().repeat_interleave(bs, -1)
    scale = scale * (1.0 if gs is None else q.global_scale.double())
    v = x.double() / scale  # the value in units of its block's scale
    got = dequantize(q, torch.float64) / scale
    # Nearest e2m1 value (within the float32 rounding of v that encode_e2m1 applies).
    nearest = (v.unsqueeze(-1) - E2M1_GRID).abs().amin(-1)
    assert ((v - got).abs() <= nearest + 2.0**-20 * v.abs()).all()
    amax = x.double().reshape(3, 64, -1, bs).abs().amax(-1) / (1.0 if gs is None else q.global_scale.double())
    block_scale = formats.decode_scales(q.linear_scales(), q.fmt).double()
    if fmt == "nvfp4":
        assert torch.equal(q.linear_scales(), formats.encode_e4m3(amax / 6))
        assert (v.abs() <= 6 * 16 / 15).all()  # scales are normal here: relative rounding <= 2^-4
    else:  # OCP: 2^(floor(log2(amax)) - 2), so amax / scale lies in [4, 8) and elements above 6 saturate
        assert (amax >= 4 * block_scale).all() and (amax < 8 * block_scale).all()
        assert (amax > 6 * block_scale).any()


def test_quantize_zero_blocks_and_mx_scale_range():
    x = torch.zeros(128, 64, dtype=torch.float64)
    x[0, 32:] = 2.0**-200 * 6  # below e8m0's 2^-127: clamps, elements round to zero
    x[1, 32:] = 2.0**120
    for fmt in ("nvfp4", "mxfp4"):
        q = quantize(x, fmt)
        assert torch.equal(dequantize(q, torch.float64)[2:], x[2:])
    mx = quantize(x, "mxfp4")
    assert mx.scales[0, 1].item() == 0 and dequantize(mx, torch.float64)[0].abs().max() == 0
    assert torch.equal(dequantize(mx, torch.float64)[1], x[1])


@pytest.mark.parametrize(
    "x, kwargs, exc, message",
    [
        (torch.tensor([[1.0, float("nan")] * 8]), {}, ValueError, "x: expected finite values"),
        (torch.tensor([[1.0, float("inf")] * 8]), {}, ValueError, "x: expected finite values"),
        (torch.ones(2, 24), {}, ValueError, "x: expected K a multiple of the nvfp4 block size 16, got K = 24"),
        (torch.ones(2, 48), {"fmt": "mxfp4"}, ValueError, "block size 32, got K = 48"),
        (torch.ones(16), {}, ValueError, r"x: expected shape \[R, K\] or \[L, R, K\], got \(16,\)"),
        (torch.ones(2, 16, dtype=torch.int32), {}, TypeError, "x: expected dtype float16 or bfloat16"),
        (torch.ones(2, 16), {"fmt": "fp8"}, ValueError, "fmt: expected 'nvfp4' or 'mxfp4', got 'fp8'"),
        (torch.ones(2, 16), {"scale_layout": "tiled"}, ValueError, "scale_layout: expected 'linear' or 'swizzled'"),
        (torch.ones(2, 16), {"global_scale": torch.ones(3)}, ValueError, "global_scale: expected one value"),
    ],
)
def test_quantize_names_the_bad_argument(x, kwargs, exc, message):
    with pytest.raises(exc, match=message):
        quantize(x, **kwargs)


def test_attributes_cannot_be_rebound():
    """What the constructor checked stays true: the op layer keys cached decisions on it."""
    t = _tensor()
    with pytest.raises(AttributeError, match="FP4Tensor is immutable"):
        t.scales = t.scales[..., :1]
    with pytest.raises(AttributeError, match="immutable"):
        t.global_scale = torch.tensor(2.0)
