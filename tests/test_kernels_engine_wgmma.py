"""The wgmma consumer prototype (``kernels/engine_wgmma.py``; issue 27, round 33 of docs/performance.md): its sm_90
machine code (compile-only, CPU) and, on a GPU, its products against the exact oracle."""

import textwrap

import pytest
import torch

import operands as O
from fp4gemv import formats, layouts
from fp4gemv.kernels import engine_wgmma as W
from fp4gemv.reference import fp4_values

_COMPILE = textwrap.dedent("""
    import collections, torch
    from aot import compile_gluon_sm90, sass_listing, registers, local_memory
    from fp4gemv import formats, layouts
    from fp4gemv.kernels import engine_wgmma as W
    for n, bias, split in ((16, "x", 1), (16, True, 1), (8, "x", 4), (3, False, 2)):
        m, k = 256, 4096
        tiles = layouts.pack_mma_tiles(torch.zeros((m, k // 2), dtype=torch.uint8))
        kernel, grid, args, options = W.wgmma_arguments(tiles, torch.zeros((m, k // 32), dtype=torch.uint8),
                                                        torch.zeros((n, k), dtype=torch.bfloat16),
                                                        torch.empty((m, n), dtype=torch.bfloat16), m, k, bias=bias,
                                                        split=split)
        c = compile_gluon_sm90(kernel, args, options)
        ops = collections.Counter(op.split(".")[0] for _, op, _ in sass_listing(c))
        print(n, bias, split, registers(c), len(local_memory(c)), c.metadata.shared, ops["HGMMA"], ops["UTMALDG"],
              ops["HMUL2"])
""")


def test_default_split_fills_two_programs_an_sm():
    assert W.default_split(7168, 16384) == 2 and W.default_split(28672, 8192) == 1
    assert W.default_split(4096, 4096) == 4 and W.default_split(4096, 512) == 1  # one step: no split


def test_refuses_what_it_cannot_run():
    tiles = layouts.pack_mma_tiles(torch.zeros((64, 512), dtype=torch.uint8))
    with pytest.raises(ValueError, match="K % 512"):
        W.wgmma_arguments(tiles, torch.zeros((64, 32), dtype=torch.uint8), torch.zeros((17, 1024)),
                          torch.empty(64, 17), 64, 1024)
    scales, x, out = torch.zeros((64, 32), dtype=torch.uint8), torch.zeros((4, 1024), dtype=torch.bfloat16), \
        torch.empty(64, 4)
    with pytest.raises(ValueError, match="tiles: expected uint8"):  # tiles of fewer rows than M
        W.wgmma_arguments(tiles, torch.zeros((128, 32), dtype=torch.uint8), x, torch.empty(128, 4), 128, 1024)
    with pytest.raises(ValueError, match="scales: expected"):
        W.wgmma_arguments(tiles, scales[:32], x, out, 64, 1024)
    with pytest.raises(ValueError, match="x, out: expected bf16"):
        W.wgmma_arguments(tiles, scales, x.half(), out, 64, 1024)


def test_compiles_for_sm90_with_two_wgmma_a_block_and_no_local_memory(compile_for_sm90):
    lines = compile_for_sm90(_COMPILE).strip().splitlines()
    assert len(lines) == 4
    for line in lines:
        n, bias, split, regs, local, shared, hgmma, tma, hmul2 = line.split()
        assert int(regs) <= 168 and int(local) == 0, line
        assert int(shared) <= 233472 // 2 - 1024, line  # two programs an SM
        # a step's 16 blocks of 32, two k16 wgmma each (the loop body once: the step loop is not unrolled)
        assert int(hgmma) == 2 * W.STEP_K // 32, line
        assert int(tma) == 2, line  # the weights' and the activation's copies
        # the bias: 4 HMUL2 a word (32 a step) on the weights, or the activation's 16 KB / 128 threads in place
        assert int(hmul2) == {"True": 128, "x": 32 * (16 if int(n) > 8 else 8) // 16, "False": 0}[bias], line


def _exact(data, scales, x):
    """The exact product and the magnitudes' (|W| |x|), from the oracle's values of the weights."""
    w = fp4_values(data, scales, formats.FORMATS["mxfp4"], "linear", None)
    return w @ x.double().T, w.abs() @ x.double().abs().T


@pytest.mark.gpu
@pytest.mark.parametrize("bias", ["x", True])
@pytest.mark.parametrize("m, k, n, split", [(256, 4096, 16, 1), (200, 2048, 9, 4), (4096, 1024, 3, 2),
                                             (7168 + 48, 512, 1, 1), (520, 3072, 8, 3)])
@pytest.mark.parametrize("x_scale", [1.0, 2.0 ** -60, 2.0 ** 40])
def test_exact_within_fp32_accumulation(bias, m, k, n, split, x_scale):
    """All 256 byte values, e8m0 scales 2^-27 .. 2^22, byte 0 (2^-127) and in two rows byte 255 (NaN), activations
    in the bias window."""
    g = torch.Generator().manual_seed(m + n + split)
    data = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (m, k // 32), dtype=torch.uint8, generator=g)
    scales[::7, ::5] = 0
    scales[m // 3, -1] = scales[m - 1, 0] = 255
    x = (torch.randn(n, k, generator=g) * x_scale).to(torch.bfloat16)
    out = O.poisoned((m, n), torch.float32, device="cuda")
    W.wgmma_gemv(layouts.pack_mma_tiles(data).cuda(), scales.cuda(), x.cuda(), out, m, k, bias=bias, split=split)
    ref, mag = _exact(data, scales, x)
    got = out.double().cpu()
    nan_rows = (scales == 255).any(1)
    assert got[nan_rows].isnan().all() and not got[~nan_rows].isnan().any()
    err = (got - ref).abs()[~nan_rows]
    # fp32 accumulation: each block's sum and each scaled addition round once (2^-23 relative to the magnitudes)
    assert (err <= mag[~nan_rows] * 2.0 ** -20 + 1e-300).all(), (err / mag[~nan_rows].clamp_min(1e-300)).max()
