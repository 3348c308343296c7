"""The W4A4 kernel against the exact reference.

On a CPU-only machine the pure-Triton decode runs in Triton's interpreter (conftest sets TRITON_INTERPRET),
which exercises the kernel's indexing, scale addressing and masking.  The PTX decode can only run on a GPU:
the ``gpu`` tests check it bit for bit against the pure-Triton decode and on a fuzz of shapes.
"""

import pytest
import torch

from operands import DEVICE, assert_matches_exact, poisoned, random_fp4

from fp4gemv import FP4Tensor, formats, gemv, layouts, select_kernel, task
from fp4gemv.kernels.w4a4 import W4A4Config, w4a4_config
from fp4gemv.reference import gemv_reference, quantized_gemv_reference


def _operands(m, k, L, seed, device="cpu"):
    """Full-range task-layout operands for any M (padded scale atoms) and their exact fp16 reference."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 256, (L, m, k // 2), dtype=torch.uint8, generator=g)
    b = torch.randint(0, 256, (L, 3, k // 2), dtype=torch.uint8, generator=g)
    # Scales spanning 2^-9 .. 2^2 with every mantissa; products stay small enough for fp16 outputs.
    sfa = formats.encode_e4m3((1 + torch.randint(0, 8, (L, m, k // 16), generator=g) / 8)
                              * torch.exp2(torch.randint(-9, 3, (L, m, k // 16), generator=g).float()))
    sfb = formats.encode_e4m3(torch.exp2(torch.randint(-9, 1, (L, 3, k // 16), generator=g).float()))
    expected = gemv_reference(formats.dequantize(a, sfa), formats.dequantize(b[:, :1], sfb[:, :1]))[:, :, 0]
    args = (
        a.permute(1, 2, 0).to(device).view(torch.float4_e2m1fn_x2),
        b.permute(1, 2, 0).to(device).view(torch.float4_e2m1fn_x2),
        layouts.task_permuted_view(layouts.swizzle_scales(sfa), m, k // 16).to(device).view(torch.float8_e4m3fn),
        layouts.task_permuted_view(layouts.swizzle_scales(sfb), 3, k // 16).to(device).view(torch.float8_e4m3fn),
        torch.full((L, m, 1), float("nan"), dtype=torch.float16, device=device).permute(1, 2, 0),
    )
    return args, expected


def _as_lm(c):
    return c[:, 0, :].permute(1, 0).float().cpu()


def _w4a4(args, backend="auto", config=None):
    """The task-layout operands ``(a, b, sfa_permuted, sfb_permuted, c)`` through gemv on their FP4Tensor views
    (what task.custom_kernel does), with a chosen configuration; returns c."""
    a, b, sfa_p, sfb_p, c = args
    weights, activation = FP4Tensor.from_task(a, sfa_p), FP4Tensor.from_task(b, sfb_p).first_rows(1)
    assert select_kernel(weights, activation, backend=backend).name == "w4a4"
    gemv(weights, activation, out=c.permute(2, 0, 1), backend=backend, config=config)
    return c


@pytest.mark.parametrize(
    "m, k, L, cfg",
    [
        (128, 256, 1, None),
        (256, 1536, 2, None),
        (128, 192, 3, W4A4Config(8, 8, 4, 1)),  # K/16 = 12: a partial last step, masked
        (200, 128, 2, W4A4Config(16, 4, 4, 1)),  # M neither a multiple of 16 nor 128: tail rows, padded atoms
        (384, 512, 1, W4A4Config(8, 8, 4, 1)),  # several K steps and three row tiles of scales
        (136, 320, 2, W4A4Config(8, 4, 4, ksplit=4, unroll=2)),  # K chunks side by side, a masked last step
        (256, 1024, 1, W4A4Config(64, 32, 4, unroll=2, pdl=True, prefetch=32)),  # PDL config (off in the interpreter)
    ],
)
def test_triton_decode_matches_reference(m, k, L, cfg):
    args, expected = _operands(m, k, L, seed=m + k + L, device=DEVICE)
    out = _w4a4(args, backend="triton", config=cfg)
    got = _as_lm(out)
    assert not torch.isnan(got).any(), "some outputs were not written"
    torch.testing.assert_close(got, expected.float(), rtol=1e-3, atol=1e-3)


def test_triton_decode_passes_task_check():
    data = task.generate_full_range_input(128, 1536, 2, seed=7, device=DEVICE)
    c = data[6].fill_(float("nan"))
    task.custom_kernel(data, backend="triton")
    ok, msg = task.check_implementation(data, c)
    assert ok, msg


def test_config_step_never_exceeds_k():
    for m, L in ((128, 1), (4096, 1), (7168, 1), (14336, 1), (4096, 8)):
        for k in (64, 128, 192, 256, 1536, 2048, 7168, 16384):
            cfg = w4a4_config(m, k, L)
            assert cfg.blocks * cfg.ksplit <= k // 16, (m, k, L, cfg)
            assert cfg.blocks & (cfg.blocks - 1) == 0 and cfg.ksplit & (cfg.ksplit - 1) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, L", [(128, 256, 1), (2432, 4608, 2), (384, 7168, 2), (200, 192, 3), (7168, 2048, 4)])
def test_ptx_and_triton_decodes_agree_bitwise(m, k, L):
    args, expected = _operands(m, k, L, seed=3, device="cuda")
    ptx = _w4a4(args, backend="triton-ptx").clone()
    args[4].fill_(float("nan"))
    pure = _w4a4(args, backend="triton")
    assert torch.equal(ptx.view(torch.int16), pure.view(torch.int16))
    torch.testing.assert_close(_as_lm(ptx), expected.float(), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_ptx_decode_on_random_shapes():
    g = torch.Generator().manual_seed(11)
    for i in range(24):
        m = 128 * int(torch.randint(1, 40, (1,), generator=g))
        k = 64 * int(torch.randint(1, 120, (1,), generator=g))
        L = int(torch.randint(1, 9, (1,), generator=g))
        args, expected = _operands(m, k, L, seed=100 + i, device="cuda")
        got = _as_lm(_w4a4(args))
        assert not torch.isnan(got).any(), (m, k, L)
        torch.testing.assert_close(got, expected.float(), rtol=1e-3, atol=1e-3, msg=f"shape {(m, k, L)}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", task.TEST_SHAPES)
def test_custom_kernel_on_gpu_full_range(shape):
    data = task.generate_full_range_input(*shape, seed=1, device="cuda")
    data[6].fill_(float("nan"))
    ok, msg = task.check_implementation(data, task.custom_kernel(data))
    assert ok, msg


# Compiles the kernel ahead of time for sm_90 down to a cubin (Triton's bundled ptxas) with the shipped
# configurations: the interpreter never builds the PTX decode, the PDL prologue or the compiled layouts.  What
# each call launches comes from the op layer for an sm_90 target and is specialized as the JIT does
# (tests/aot.py): alignment facts decide the load widths, and a compile without them once hid that the scale
# loads had become byte loads.
_AOT_SCRIPT = r"""
import re, torch
from aot import Sm90Launch
from fp4gemv import FP4Tensor
from fp4gemv.bench import random_task_input
from operands import random_fp4

launches = []
for m, k, l in [(7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4), (14336, 4096, 1), (4096, 14336, 1),
                (4096, 4096, 1), (384, 192, 3)]:
    a, b, _, _, sfa_p, sfb_p, c = random_task_input(m, k, l, seed=0, device="cpu")
    launches.append(Sm90Launch(FP4Tensor.from_task(a, sfa_p), FP4Tensor.from_task(b, sfb_p).first_rows(1),
                               c.permute(2, 0, 1)))
for k, fmt, layout in ((2048, "mxfp4", "swizzled"), (48, "nvfp4", "linear"), (4096, "nvfp4", "linear")):
    a = random_fp4((256, k), fmt, layout, seed=1, device="cpu")
    b = random_fp4((1, k), fmt, layout, seed=2, device="cpu")
    launches.append(Sm90Launch(a, b, out_dtype=torch.bfloat16))
for launch in launches:
    assert launch.spec.name == "w4a4"
    const, opts = launch.constexprs, launch.options
    compiled = launch.compile()
    ptx, label = compiled.asm["ptx"], (const["FORMAT"], const["SCALE_ROWS_EVEN"], const["BLOCKS"], const["KSPLIT"])
    assert compiled.asm["cubin"] and "dp4a" in ptx and "prmt" in ptx, label
    assert ("griddepcontrol.wait" in ptx) == opts["launch_pdl"], label
    assert ("prefetch.global.L2" in ptx) == (const["PREFETCH"] > 0), label
    byte_loads = len(re.findall(r"ld\.global(\.nc)?\.[bu]8", ptx))
    if const["SCALE_ROWS_EVEN"] and const["EVEN_K"]:
        # each lane's two scale bytes (weights and activation; for MXFP4 the column pair holding the lane's
        # scale) as one 16-bit load (masked K tails may not be)
        assert byte_loads == 0 and "ld.global.b16" in ptx, (label, byte_loads)
    print("compiled", label, "byte loads", byte_loads)
print("compiled", len(launches))
"""


def test_shipped_configs_compile_for_sm90_without_a_gpu(compile_for_sm90):
    """Every shipped configuration as the JIT would specialize it; with even scale rows there is no byte load."""
    out = compile_for_sm90(_AOT_SCRIPT)
    assert "compiled 10" in out, out
    assert "compiled ('nvfp4', False" in out, out  # linear scales of odd row stride (K = 48): no 16-bit hint


# --- MXFP4 (e8m0 scale per 32 elements) through fp4gemv.gemv, which sends FP4 x FP4 with N = 1 here -------


def _mxfp4_case(m, k, L, seed, layout_a, layout_b):
    a = random_fp4((L, m, k), "mxfp4", layout_a, seed, global_scale=0.75, device=DEVICE)
    b = random_fp4((L, 1, k), "mxfp4", layout_b, seed + 1, device=DEVICE)
    return a, b


@pytest.mark.parametrize(
    "m, k, L, cfg, layouts_ab",
    [
        (200, 192, 2, W4A4Config(16, 8, 4), ("swizzled", "linear")),  # tail rows, a partial last step
        (128, 256, 1, W4A4Config(8, 4, 4, ksplit=2, unroll=2), ("linear", "swizzled")),  # K chunks side by side
        (64, 64, 1, None, ("linear", "linear")),  # the shipped config, shrunk to K = 64
        (256, 1024, 1, W4A4Config(64, 32, 4, unroll=2, pdl=True, prefetch=32), ("swizzled", "swizzled")),
        # odd numbers of scale columns (3, 5): the last lane's column pair reaches past the row (masked)
        (130, 96, 1, W4A4Config(8, 4, 4), ("linear", "linear")),
        (72, 160, 2, W4A4Config(8, 8, 4, ksplit=2), ("linear", "swizzled")),
    ],
)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_mxfp4_matches_exact_result(m, k, L, cfg, layouts_ab, out_dtype):
    a, b = _mxfp4_case(m, k, L, m + k, *layouts_ab)
    got = gemv(a, b, out=poisoned((L, m, 1), out_dtype, device=DEVICE), out_dtype=out_dtype, backend="triton",
               config=cfg)
    assert not torch.isnan(got).any(), "some outputs were not written"
    assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), out_dtype)


@pytest.mark.parametrize("k, column", [(128, 0), (128, 1), (128, 2), (128, 3), (96, 2)])
def test_mxfp4_scale_per_two_blocks_is_read(k, column):
    """Each 32-element block's scale multiplies both of its 16-element halves: doubling the scale of one
    block changes the result by exactly that block's contribution (lanes load their scale as part of an
    aligned column pair; even and odd columns, and the last of an odd count)."""
    a, b = _mxfp4_case(128, k, 1, 3, "linear", "linear")
    base = gemv(a, b, out_dtype=torch.float32, backend="triton", config=W4A4Config(8, 8, 4))
    scales = a.scales.clone()
    scales[:, :, column] += 1  # that 32-element block times 2
    bumped = FP4Tensor(a.data, scales, "mxfp4", "linear", a.global_scale)
    got = gemv(bumped, b, out_dtype=torch.float32, backend="triton", config=W4A4Config(8, 8, 4))
    expected = quantized_gemv_reference(bumped.to("cpu"), b.to("cpu"), torch.float64)
    assert not torch.allclose(base.cpu(), got.cpu())
    torch.testing.assert_close(got.cpu().double(), expected, rtol=1e-6, atol=1e-6)


def test_scale_rows_even_decides_the_16_bit_scale_loads():
    """The launch's alignment fact: every scale row at an even address (swizzled, or linear with even K/16 and
    an even start), else byte loads."""
    from fp4gemv.ops import gemv_operands
    from fp4gemv.kernels.w4a4 import scale_rows_even

    def even(a):
        return scale_rows_even(gemv_operands(a, a.first_rows(1), torch.empty(a.rows, 1)).case.a)

    assert even(random_fp4((128, 128), "nvfp4", "swizzled", seed=0, device="cpu"))
    assert even(random_fp4((128, 96), "nvfp4", "linear", seed=0, device="cpu"))  # 6 scales per row
    odd = random_fp4((128, 48), "nvfp4", "linear", seed=0, device="cpu")  # K = 48: 3 scales per row
    assert not even(odd)
    shifted = torch.zeros(128 * 6 + 1, dtype=torch.uint8)[1:].view(128, 6)  # odd start
    assert not even(FP4Tensor(random_fp4((128, 96), "nvfp4", "linear", seed=0, device="cpu").data, shifted))


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, L", [(2432, 4608, 2), (7168, 2048, 4), (4096, 7168, 8), (200, 192, 3)])
def test_mxfp4_ptx_and_triton_agree_bitwise(m, k, L):
    a, b = _mxfp4_case(m, k, L, 5, "swizzled", "linear")
    ptx = gemv(a, b, out_dtype=torch.float32, backend="triton-ptx")
    pure = gemv(a, b, out_dtype=torch.float32, backend="triton")
    assert torch.equal(ptx.view(torch.int32), pure.view(torch.int32))
    assert_matches_exact(ptx.cpu(), a.to("cpu"), b.to("cpu"), torch.float32)
