"""The decode engine (kernels/engine.py): its index maps replayed in torch against the exact result (CPU), its
refusals and dispatch, its sm_90 machine code under the installed Triton (bulk copies, mbarriers, tensor cores, no
local memory), and on a GPU its result against the exact oracle (tail rows, N from 1 to 16, a global scale, NaN
scales, every output dtype)."""

import itertools
import textwrap
from typing import NamedTuple

import pytest
import torch

import operands as O
from fp4gemv import FP4Tensor, gemv, select_kernel
from fp4gemv.formats import decode_e2m1, decode_e4m3, decode_e8m0, unpack_e2m1
from fp4gemv.kernels import _mma_step, choose_kernel, engine, hmma_gemv
from fp4gemv.kernels.engine import (STEP_K, Engine, EngineConfig, engine_config, engine_twin, grid_size,
                                    max_contributors, persistent_ranges, swizzled_scales_twin,
                                    tile_contributors)
from fp4gemv.layouts import aligned_scale_rows, swizzle_scales, swizzled_offset
from fp4gemv.ops import gemv_operands
from fp4gemv.reference import quantized_gemv_reference
from fp4gemv.target import SM90, Target, device_target


def _exact(a_data, a_scales, b, fmt="nvfp4"):
    block, decode = (16, decode_e4m3) if fmt == "nvfp4" else (32, decode_e8m0)
    w = decode_e2m1(unpack_e2m1(a_data)).double() * decode(a_scales).double().repeat_interleave(block, 1)
    return w @ b.double().T


def _raw(m, k, n, seed, fmt="nvfp4"):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, generator=g)
    if fmt == "nvfp4":
        s = torch.randint(0x18, 0x58, (m, k // 16), dtype=torch.uint8, generator=g)
    else:  # e8m0 2^-12 .. 2^12
        s = torch.randint(115, 140, (m, k // 32), dtype=torch.uint8, generator=g)
    return a, s, torch.randn(n, k, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("tiles", [1, 2, 4])
@pytest.mark.parametrize("m, k, n", [(70, 2048, 1), (64, 1024, 2), (48, 1024, 3), (40, 1024, 5), (33, 2048, 8),
                                     (96, 1024, 9), (32, 1024, 16), (40, 2880, 16), (33, 1088, 8), (17, 1344, 1)])
def test_twin_matches_exact_result(fmt, tiles, m, k, n):
    """The fold step's maps (NVFP4) and the k32 step's (MXFP4: the words' split, the activation's permutation,
    each block's scale byte) replayed in torch give the exact result (K past a multiple of 1024 too: the last
    step's copies zero-filled past K)."""
    a, s, b = _raw(m, k, n, seed=m + n, fmt=fmt)
    torch.testing.assert_close(engine_twin(a, s, b, tiles, fmt), _exact(a, s, b, fmt), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("tiles", [1, 2])
@pytest.mark.parametrize("m, k", [(256, 2048), (200, 2048), (200, 2880), (136, 1088)])
def test_swizzled_scale_slots_hold_the_linear_slots_bytes(fmt, tiles, m, k):
    """The swizzled scales' path (the copy's box, the 32-row group kept, the 16-bit pairs' joins; MXFP4: warp w's
    atoms as one int64) gives every row tile and step what the linear scales' copy gives; past K (K % 1024 != 0)
    zero, the layout's padding bytes (0xFF here, NaN as e8m0) included."""
    block = 16 if fmt == "nvfp4" else 32
    g = torch.Generator().manual_seed(m + tiles)
    cols = k // block
    linear = torch.randint(0, 256, (m, cols), dtype=torch.uint8, generator=g)
    poisoned_pad = torch.full((m, cols + (-cols) % 4), 0xFF, dtype=torch.uint8)
    poisoned_pad[:, :cols] = linear
    swizzled = swizzle_scales(poisoned_pad)
    rows = 16 * tiles
    steps = -(-k // STEP_K)
    padded = torch.nn.functional.pad(linear, (0, steps * STEP_K // block - cols, 0, -(-m // rows) * rows - m))
    for tile in range(-(-m // rows)):
        for step in range(steps):
            got = swizzled_scales_twin(swizzled, m, k, tile, step, tiles, fmt)
            rows_ = padded[tile * rows:(tile + 1) * rows, step * (STEP_K // block):(step + 1) * (STEP_K // block)]
            if fmt == "nvfp4":  # [WARPS, R, 16]: warp w's 16 columns of each row, element j the pair j // 2
                b = rows_.reshape(rows, 4, 8, 2).permute(1, 0, 2, 3).to(torch.int64)
                want = (b[..., 0] | b[..., 1] << 8).repeat_interleave(2, dim=-1)
            else:  # [WARPS, R] int64: warp w's 8 bytes of each row, block J in byte J
                b = rows_.reshape(rows, 4, 8).permute(1, 0, 2).to(torch.int64)
                want = (b << (8 * torch.arange(8))).sum(-1)
            assert torch.equal(got, want), (tile, step)


@pytest.mark.parametrize("fmt,name,key,wrong", [
    ("nvfp4", "X_ORDER", 16, (0, 3, 4, 2, 1, 5, 6, 7)),  # two chunk bits swapped
    ("mxfp4", "X_ORDER_K32", 16, (0, 3, 4, 1, 6, 7, 5, 2, 8)),  # half and u swapped
    ("mxfp4", "X_ORDER_K32", "few", (0, 3, 2, 6, 5, 4, 1, 7)),  # the lane bits c0, c1 swapped
    ("mxfp4", "W_ORDER_K32", None, (1, 3, 0, 2)),  # the words' b and half swapped
])
def test_twin_fails_with_a_wrong_permutation(monkeypatch, fmt, name, key, wrong):
    """The twin checks the maps: a permutation with two bits swapped gives a wrong result."""
    n = 16 if key == 16 else 8
    a, s, b = _raw(32, 1024, n, seed=1, fmt=fmt)
    if key is not None:
        wrong = {**getattr(engine, name), key: wrong}
    monkeypatch.setattr(engine, name, wrong)
    assert not torch.allclose(engine_twin(a, s, b, 2, fmt), _exact(a, s, b, fmt), rtol=1e-6)


def test_k32_step_emits_one_scale_fma_per_fragment_and_block():
    """The k32 step's PTX (MXFP4): 2 mma per block and tile into a zeroed partial, 4 fp32 fma each, and the scales
    two at a time in bf16x2 (one max and one fma per pair)."""
    asm, constraints = engine.step_asm(2, 1, "mxfp4")
    assert asm.count("mma.sync") == 8 * 2 * 2
    assert asm.count("fma.rn.f32") == 8 * 2 * 4
    assert asm.count("max.bf16x2") == asm.count("fma.rn.bf16x2") == 2 * 2 * 4
    kinds = constraints.split(",")
    # s, x0 .. x3 (int64); wl, wh and the MULTIPLIERS (32-bit)
    assert kinds.count("l") == 16 * 5 and kinds.count("r") == 16 * (2 + len(_mma_step.MULTIPLIERS))


def test_fold_step_takes_16_bit_scale_pairs_from_a_register_each():
    """The NVFP4 step with 16-bit scale operands (the linear slot's block pairs, one load each) reads each element
    (u, h, t)'s pair from a register of its own, the low half (one cvt, no shift); with bytes, two pairs share a
    register (a shift picks the half)."""
    import re
    for bits, registers in ((8, 4), (16, 8)):
        asm, constraints = engine.step_asm(2, 1, "nvfp4", "native", bits)
        sources = re.findall(r"cvt\.u16\.u32 \w+, (\$?\w+);", asm)
        assert len(sources) == len(set(sources)) == 8, (bits, sources)  # 2 tiles x 2 chunks x 2 row halves
        shifted = re.findall(r"shr\.u32 \w+, (\$\d+), (\d+);", asm)
        if bits == 16:
            assert all(r.startswith("$") for r in sources) and not shifted
        else:  # each register twice: halves 0 and 16
            assert sorted(sh for _, sh in shifted) == ["0"] * 4 + ["16"] * 4
            assert len({r for r, _ in shifted}) == registers
        kinds = constraints.split(",")
        assert kinds.count("r") - 16 * len(_mma_step.MULTIPLIERS) == registers, (bits, kinds.count("r"))


def _case(m=4096, k=4096, n=16, layout="linear", fmt="nvfp4", dtype=torch.bfloat16, batch=None):
    shape = (m, k) if batch is None else (batch, m, k)
    a = O.random_fp4(shape, fmt, layout, seed=1, device="cpu")
    b = O.random_activation((n, k), dtype, seed=2, device="cpu")
    return gemv_operands(a, b, torch.empty((batch or 1, m, n), dtype=torch.bfloat16)).case


def _odd_batch_stride_case(m=256, k=2048, n=4):
    """Two matrices whose weights' batch stride (16 bytes past M rows) is no whole number of rows."""
    a = O.random_fp4((2, m, k), "nvfp4", "linear", seed=1, device="cpu")
    stride = m * k // 2 + 16
    data = torch.zeros(2 * stride, dtype=torch.uint8).as_strided((2, m, k // 2), (stride, k // 2, 1))
    data.copy_(a.data)
    odd = FP4Tensor(data, a.scales, "nvfp4", "linear")
    b = O.random_activation((2, n, k), torch.bfloat16, seed=2, device="cpu")
    return gemv_operands(odd, b, torch.empty((2, m, n), dtype=torch.bfloat16)).case


@pytest.mark.parametrize("case, target, words", [
    (_case(dtype=torch.float32), SM90, "fp16 or bf16 activations"),
    (_odd_batch_stride_case(), SM90, "batch stride a whole number of rows (L = 2)"),
    (_case(k=3072 + 32), SM90, "K a multiple of 64"),
    (_case(k=2880), SM90, "multiple of 256 with linear NVFP4 scales"),
    (_case(n=17), SM90, "N <= 16"),
    (_case(), Target("cpu", None, 0, "triton"), "sm_90 or newer"),
    (_case(), Target("cuda", (8, 9), 84, "ptx"), "sm_90 or newer"),
    (_case(), Target("cuda", (9, 0), 132, "triton"), "PTX mode"),
], ids=["fp32", "batch", "k", "k-linear-nvfp4", "n", "cpu", "sm89", "triton-mode"])
def test_refusals_name_the_reason(case, target, words):
    assert words in Engine().why_not(case, target)


def test_dispatch_on_sm90_from_four_rows_where_one_wave_holds_the_programs():
    for n, expected in ((1, "weight_only"), (3, "weight_only"), (4, "engine"), (8, "engine"), (9, "engine"),
                        (16, "engine")):
        assert choose_kernel(_case(n=n), SM90).name == expected, n
    assert choose_kernel(_case(layout="swizzled"), SM90).name == "engine"
    for layout in ("linear", "swizzled"):
        assert choose_kernel(_case(fmt="mxfp4", layout=layout), SM90).name == "engine", layout
        assert choose_kernel(_case(fmt="mxfp4", layout=layout, n=2), SM90).name == "weight_only", layout
        assert choose_kernel(_case(fmt="mxfp4", layout=layout, n=8), SM90).name == "engine", layout
    # 32-row programs beyond one wave of three an SM (132 SMs: 396 programs, 12672 rows) stay on weight_only to N = 8
    # where K < 7168 (fewer than seven steps a program), and run on the engine from K = 7168, a batch's tiles counted
    for m, k, n, expected in ((12672, 1024, 8, "engine"), (12704, 1024, 8, "weight_only"), (12704, 1024, 9, "engine"),
                              (14336, 4096, 8, "weight_only"), (16384, 6144, 8, "weight_only"),
                              (18432, 7168, 4, "engine"), (28672, 8192, 4, "engine"),
                              (28672, 8192, 8, "engine"), (28672, 8192, 3, "weight_only")):
        assert choose_kernel(_case(m=m, k=k, n=n), SM90).name == expected, (m, k, n)
    for m, k, batch, expected in ((4096, 7168, 8, "engine"), (7168, 2048, 4, "weight_only")):  # the task's batches
        assert choose_kernel(_case(m=m, k=k, n=8, batch=batch), SM90).name == expected, (m, k, batch)
    assert choose_kernel(_case(n=8), Target("cuda", (9, 0), 0, "ptx")).name == "weight_only"  # SMs unknown
    # K past a multiple of 1024 (gpt-oss's 2880) runs here; K < 1024 (one step mostly past K) is left to the others
    # (hmma's PTX path runs on Triton 3.6 only, hmma_gemv.PTX_LAYOUT_VERIFIED; weight_only takes its cases elsewhere)
    other = "hmma" if hmma_gemv.PTX_LAYOUT_VERIFIED else "weight_only"
    for k, n, expected in ((2880, 16, "engine"), (2880, 4, "engine"), (768, 16, "stream"), (960, 16, other)):
        assert choose_kernel(_case(m=1024, k=k, n=n, layout="swizzled"), SM90).name == expected, (k, n)


def test_default_config_and_bad_configs():
    assert engine_config(_case(n=16)) == EngineConfig(2, 2, 128)
    assert engine_config(_case(n=8)) == engine_config(_case(n=1), 132) == EngineConfig(2, 2, 80)
    # one tile a program where the 32-row tiles leave multiprocessors idle (round 25)
    for m, n, tiles in ((4096, 16, 1), (4096, 13, 1), (4096, 12, 2), (4096, 9, 2), (4224, 16, 1), (4256, 16, 2),
                        (2048, 9, 1), (2112, 9, 1), (2144, 9, 2), (7168, 16, 2), (2048, 9, 1)):
        assert engine_config(_case(m=m, k=1024, n=n), 132).tiles == tiles, (m, n)
    assert Engine().default_config(_case(n=16), SM90) == EngineConfig(1, 2, 128)
    assert engine_config(_case(n=16), 0) == EngineConfig(2, 2, 128)  # multiprocessors unknown
    spec = Engine()
    for bad, words in ((EngineConfig(3, 2, 128), "tiles"), (EngineConfig(2, 0, 128), "stages"),
                       (EngineConfig(2, 2, 100), "maxnreg"), (EngineConfig(2, 2, 128, 5), "per_sm"),
                       (EngineConfig(2, 2, 96, 0, 4), "groups 1, 2 or 4"), (EngineConfig(4, 2, 96, 0, 3), "groups")):
        with pytest.raises(ValueError, match=words):
            spec.check_config(bad)
    spec.check_config(EngineConfig(2, 2, 80, 0, 2), _case(n=9))
    with pytest.raises(ValueError, match="N > 8"):  # a warp group a tile reads the 16-row activation slice
        spec.check_config(EngineConfig(2, 2, 80, 0, 2), _case(n=8))


@pytest.mark.parametrize("tiles, steps, programs", [(128, 4, 264), (224, 16, 264), (7, 3, 5), (5, 1, 5),
                                                   (3, 8, 24), (896, 8, 396), (1, 16, 3)])
def test_persistent_ranges_cover_every_unit_once_and_the_fixup_finds_each_tiles_contributors(tiles, steps, programs):
    """The persistent grid's arithmetic (the kernel computes the same): the programs' ranges cover the (tile, step)
    units once, in order; each tile's contributors are the programs whose ranges meet it, at most
    ``max_contributors`` (the finisher's unrolled loads); a split tile's finisher (its first contributor) meets it
    at the end of its range, every other contributor at the start of its own, so that a program has at most one
    role of each kind and its two partial slots (contributor, finisher) never hold two tiles."""
    units = tiles * steps
    ranges = persistent_ranges(units, programs)
    assert [v for start, end in ranges for v in range(start, end)] == list(range(units))
    roles = {p: [] for p in range(programs)}
    for tile in range(tiles):
        first, last = tile_contributors(tile, steps, units, programs)
        meets = [p for p, (start, end) in enumerate(ranges)
                 if start < end and start < (tile + 1) * steps and end > tile * steps]
        assert meets == list(range(first, last + 1)), tile
        assert last - first + 1 <= max_contributors(steps, units, programs), tile
        if last > first:  # split
            start, end = ranges[first]
            assert start <= tile * steps < end < (tile + 1) * steps, tile  # its first steps, its range's end
            roles[first].append(("finisher", tile))
            for p in range(first + 1, last + 1):
                start, end = ranges[p]
                assert tile * steps < start < (tile + 1) * steps, (tile, p)  # its range begins inside the tile
                roles[p].append(("contributor", tile))
    for p, met in roles.items():
        kinds = [kind for kind, _ in met]
        assert kinds.count("finisher") <= 1 and kinds.count("contributor") <= 1, (p, met)


@pytest.mark.parametrize("fmt, layout", [("nvfp4", "linear"), ("nvfp4", "swizzled"), ("mxfp4", "linear")])
def test_kept_launch_descriptors_encode_as_the_jit_calls(monkeypatch, fmt, layout):
    """What Triton 3.6's launcher encodes for each bulk-copy argument of a kept launch (``spec.AddressDescriptor``
    at the operand's address) is what it encodes for the JIT call's Gluon descriptor: the same address, shape and
    strides reach the tensor-map encoder (recorded here in place of the driver's)."""
    import triton
    from fp4gemv.kernels.spec import DIRECT_LAUNCH, AddressDescriptor, DescSrc, fill_sources
    if not DIRECT_LAUNCH:
        pytest.skip("kept launches call the compiled kernel directly only under Triton 3.6")
    from triton.backends.nvidia import driver as nvidia
    encoded = []
    fake = type("Driver", (), {})()
    fake.active = type("Active", (), {})()
    record = staticmethod(lambda *a: encoded.append(a) or len(encoded))
    fake.active.utils = type("Utils", (), {"fill_tma_descriptor": record})()
    monkeypatch.setattr(triton.runtime, "driver", fake)
    a = O.random_fp4((520, 2048), fmt, layout, seed=1, device="cpu")
    b = O.random_activation((12, 2048), torch.bfloat16, seed=2, device="cpu")
    ops = gemv_operands(a, b, torch.empty((1, 520, 12), dtype=torch.float16))
    _, args, _, _ = engine.engine_arguments(ops.case, engine_config(ops.case))
    filled = fill_sources(args, ops)
    meta = {"swizzle": 0, "elem_size": 1, "elem_type": 0, "block_size": [1], "fp4_padded": False}
    sources = [(name, v) for name, v in args.items() if isinstance(v, DescSrc)]
    assert [name for name, _ in sources] == ["w_desc", "s_desc", "x_desc"]
    for name, src in sources:
        real = nvidia.make_tensordesc_arg(filled[name], meta)
        kept = nvidia.make_tensordesc_arg(AddressDescriptor(getattr(ops, src.name).data_ptr(), src), meta)
        assert real[1:] == kept[1:] and encoded[-2] == encoded[-1], name
        assert encoded[-1][0] == getattr(ops, src.name).data_ptr() and list(encoded[-1][5]) == list(src.shape)


@pytest.mark.parametrize("layout", ["linear", "swizzled"])
def test_kept_descriptors_expand_as_the_launcher_wrapper_and_encode_once_per_address(monkeypatch, layout):
    """``ops.EncodedDescriptors`` hands the C launch what Triton 3.6's descriptor wrapper would for the same call
    (each descriptor expanded at the call's address), and encodes a descriptor again only when its address
    changes (the encoder recorded here in place of the driver's)."""
    import types
    import triton
    from fp4gemv.kernels.spec import DIRECT_LAUNCH, AddressDescriptor, DescSrc, Src, bound_arguments
    if not DIRECT_LAUNCH:
        pytest.skip("kept launches call the compiled kernel directly only under Triton 3.6")
    from triton.backends.nvidia import driver as nvidia
    from fp4gemv.ops import EncodedDescriptors, _raw_launch
    encoded = []
    fake = types.SimpleNamespace(active=types.SimpleNamespace(utils=types.SimpleNamespace(
        fill_tma_descriptor=lambda *a: encoded.append(a) or ("map", repr(a)))))
    monkeypatch.setattr(triton.runtime, "driver", fake)
    a = O.random_fp4((520, 2048), "nvfp4", layout, seed=1, device="cpu")
    b = O.random_activation((12, 2048), torch.bfloat16, seed=2, device="cpu")
    ops = gemv_operands(a, b, torch.empty((1, 520, 12), dtype=torch.float16))
    _, args, options, _ = engine.engine_arguments(ops.case, engine_config(ops.case))
    argv = bound_arguments(engine.engine_gemv_kernel, (), {**args, **options})
    names = sorted({v.name for v in argv if isinstance(v, (Src, DescSrc))})
    fields = {name: k for k, name in enumerate(names)}
    slots = tuple((i, fields[v.name]) for i, v in enumerate(argv) if isinstance(v, Src))
    descs = tuple((i, fields[v.name], v) for i, v in enumerate(argv) if isinstance(v, DescSrc))
    metas = [{"swizzle": 0, "elem_size": 1, "elem_type": 0, "block_size": list(v.block), "fp4_padded": False}
             for _, _, v in descs]
    calls = []
    raw = lambda *args: calls.append(args)  # noqa: E731 -- the C launch
    signature = {i: "tensordesc<u8[1]>" if isinstance(v, DescSrc) else "i32" for i, v in enumerate(argv)}
    wrapper = nvidia.wrap_handle_tensordesc(raw, signature, metas)
    assert _raw_launch(wrapper) is raw and _raw_launch(raw) is None
    launcher = types.SimpleNamespace(launch=wrapper, launch_cooperative_grid=False, launch_pdl=False)
    compiled = types.SimpleNamespace(function=7, packed_metadata="packed")
    kept = EncodedDescriptors(raw, launcher, argv, slots, descs, metas)
    addresses = [4096 * (k + 1) for k in range(len(names))]
    for change, encodes in ((None, len(descs)), (None, 0), ("b_data", 1), ("a_data", 1 if layout == "linear" else 2)):
        if change:
            addresses[fields[change]] += 512
        before = len(encoded)
        kept.launch((9, 1, 1), 5, compiled, tuple(addresses))
        assert len(encoded) - before == encodes, change
        wrapped = list(argv)
        for i, j in slots:
            wrapped[i] = addresses[j]
        for i, j, src in descs:
            wrapped[i] = AddressDescriptor(addresses[j], src)
        wrapper(9, 1, 1, 5, 7, False, False, None, None, "packed", None, None, None, *wrapped)
        assert calls[-2] == calls[-1], change


def _batched_operands(fmt, layout, m, k, n, batch, pad_rows=0, broadcast=None):
    """Operands of ``batch`` matrices: the weights ``[L, m, k]`` (``pad_rows`` rows of another tensor between
    batches: a slice of ``[L, m + pad_rows, k]``), ``broadcast`` "a" or "b": that operand one matrix for all."""
    full = O.random_fp4((batch, m + pad_rows, k), fmt, "linear", seed=m + n, device="cpu")
    a = FP4Tensor(full.data[:, :m], full.scales[:, :m], fmt, "linear").with_scale_layout(layout)
    if broadcast == "a":
        a = O.random_fp4((m, k), fmt, layout, seed=m, device="cpu")
    b = O.random_activation((n, k) if broadcast == "b" else (batch, n, k), torch.bfloat16, seed=k, device="cpu")
    return a, b, gemv_operands(a, b, torch.empty((batch, m, n), dtype=torch.bfloat16))


def _descriptor_view(ops, src):
    """What a bulk-copy descriptor ``src`` addresses: its shape and strides over the operand's memory."""
    t = getattr(ops, src.name).view(src.dtype)
    return torch.as_strided(t, src.shape, src.strides, t.storage_offset())


@pytest.mark.parametrize("fmt, layout, m, k, n, pad_rows, broadcast", [
    ("nvfp4", "linear", 200, 2048, 9, 0, None), ("nvfp4", "linear", 200, 2048, 16, 32, None),
    ("mxfp4", "linear", 96, 3072, 4, 16, None), ("nvfp4", "swizzled", 200, 2048, 13, 0, None),
    ("mxfp4", "swizzled", 72, 2048, 8, 0, None), ("nvfp4", "swizzled", 200, 2880, 5, 0, None),
    ("nvfp4", "swizzled", 160, 2048, 16, 0, "a"), ("mxfp4", "linear", 160, 2048, 3, 0, "b")])
def test_batches_address_each_matrix(fmt, layout, m, k, n, pad_rows, broadcast):
    """L > 1 (CPU, the host's arguments and the kernel's index arithmetic replayed): program tile g is batch g // TB,
    tile g % TB; its weight rows start at row batch * WB + tile * 16 tiles of the weights' descriptor, its linear
    scale rows at batch * SB + ..., its activation rows at batch * XB, its swizzled scale words at batch * SPB,
    its output at batch * out_stride_l -- and those rows are that batch's (padded batches, broadcast operands,
    both formats and layouts, K past a multiple of 1024 with four weight copies)."""
    L = 3
    a, b, ops = _batched_operands(fmt, layout, m, k, n, L, pad_rows, broadcast)
    config = engine_config(ops.case, 132)
    assert Engine().why_not(ops.case, SM90) is None
    grid, args, _, split = engine.engine_arguments(ops.case, config, 132)
    rows = 16 * config.tiles
    assert not split and grid[0] == L * args["TB"] == L * -(-m // rows)
    weights, x = _descriptor_view(ops, args["w_desc"]), _descriptor_view(ops, args["x_desc"])
    assert args["out_stride_l"] == ops.out.stride(0)
    checked = 0
    for g in range(grid[0]):
        batch, tile = g // args["TB"], g % args["TB"]
        for i in range(rows):
            r = tile * rows + i
            if r >= m:
                continue
            row = batch * args["WB"] + r
            if weights.dim() == 5:  # octet rows (``w_slot_bases``): [K/256, octet, row bit 0, row bits 1-2, 128]
                got = weights[:, row // 8, row % 2, (row // 2) % 4].reshape(-1)
            else:
                got = weights[row] if weights.dim() == 2 else weights[:, row].reshape(-1)
            assert torch.equal(got, ops.a_data[batch, r]), (g, i)
            if layout == "linear":
                scales = _descriptor_view(ops, args["s_desc"])
                srow = batch * args["SB"] + r
                got = scales[srow] if scales.dim() == 2 else scales[:, srow].reshape(-1)
                assert torch.equal(got[:ops.a_scales.shape[-1]], ops.a_scales[batch, r]), (g, i)
            checked += 1
        for i in range(n):
            assert torch.equal(x[:, batch * args["XB"] + i].reshape(-1), ops.b_data[batch, i]), (g, i)
        if layout == "swizzled":
            words = ops.a_scales.view(torch.int32)
            start = batch * args["SPB"]
            flat = torch.as_strided(words, (start + words.shape[-1],), (1,), words.storage_offset())
            assert torch.equal(flat[start:], words[batch]), g
    assert checked == L * m
    assert (args["WB"] == 0) == (broadcast == "a") and (args["XB"] == 0) == (broadcast == "b")


def test_batches_refuse_a_split_grid():
    _, _, ops = _batched_operands("nvfp4", "linear", 200, 2048, 9, 2)
    with pytest.raises(ValueError, match="per_sm > 0.*L = 2"):
        Engine().check_config(EngineConfig(2, 2, 128, 2), ops.case)
def _slot_offsets(bases):
    """{logical (j, row, column): int64 offset} of a shared layout given as offset bases (XOR of the set bits')."""
    offsets = {}
    for off in range(1 << len(bases)):
        c = (0, 0, 0)
        for i, b in enumerate(bases):
            if off >> i & 1:
                c = tuple(x ^ y for x, y in zip(c, b))
        offsets[c] = off
    return offsets


def _copy_offsets(rows, paired):
    """{(j, row, column): int64 offset} where the activation's bulk copy puts them under the 128-byte swizzle (16-byte
    unit u of line l at unit u ^ (l % 8)): one 64-element chunk a line (``[16, rows, 64]`` box), or a 128-element
    chunk's halves on adjacent lines (``[8, rows, 2, 64]`` box)."""
    offsets = {}
    for j, r, c in itertools.product(range(16), range(rows), range(16)):
        line = 2 * (rows * (j // 2) + r) + j % 2 if paired else rows * j + r
        offsets[(j, r, c)] = 16 * line + 2 * ((c >> 1) ^ (line % 8)) + (c & 1)
    return offsets


def _wavefronts(layout, offsets):
    """Shared-memory wavefronts of the 16-byte loads a warp makes of the activation slice in register layout
    ``layout`` (register bit 0: the int64 pair of one load), 8 lanes a wavefront, a bank group a 16-byte unit."""
    def coord(reg, lane):
        c = (0, 0, 0)
        for bits, bases in ((reg, layout.reg_bases), (lane, layout.lane_bases)):
            for i, b in enumerate(bases):
                if bits >> i & 1:
                    c = tuple(x ^ y for x, y in zip(c, b))
        return c
    total = 0
    for reg in range(0, 1 << len(layout.reg_bases), 2):
        for phase in range(4):
            groups = {}
            for lane in range(8 * phase, 8 * phase + 8):
                unit = offsets[coord(reg, lane)] // 2
                groups.setdefault(unit % 8, set()).add(unit)
            total += max(len(v) for v in groups.values())
    return total


@pytest.mark.parametrize("rows", [2, 4, 8, 16])
def test_paired_lines_slot_is_where_the_copy_puts_the_activation(rows):
    """``x_slot_bases`` (the consumer's view of the slot) places every element of the ``[16, rows, 16]`` int64 slice
    where the ``[8, rows, 2, 64]`` copy under the 128-byte swizzle writes it, one to one."""
    got = _slot_offsets(engine.x_slot_bases(rows))
    assert len(got) == 16 * rows * 16 and got == _copy_offsets(rows, paired=True)


def test_paired_lines_make_the_activation_loads_conflict_free():
    """The consumer's activation loads (``_layouts``' activation layout): 2-way bank conflicts in every wavefront
    with one chunk a line (round 31, item 5: ncu counted 1.38 M conflicts of 2.81 M wavefronts), none with a
    128-element chunk's halves on adjacent lines -- 4 wavefronts a 16-byte load."""
    for rows in (4, 8, 16):
        layout = engine._layouts(2, rows)[1]
        loads = 1 << (len(layout.reg_bases) - 1)
        assert _wavefronts(layout, _copy_offsets(rows, paired=False)) == 8 * loads, rows
        assert _wavefronts(layout, _copy_offsets(rows, paired=True)) == 4 * loads, rows
    assert engine.paired_lines(4096, 16) and engine.paired_lines(1024 + 128, 2)
    assert not engine.paired_lines(2880, 16) and not engine.paired_lines(4096, 1)


def _weight_copy_offsets(tiles, octets):
    """{(quarter, row, column): int64 offset} where the weights' copy puts them under the 128-byte swizzle: one row a
    line in row order, or each octet's rows in the order 0, 2, 4, 6, 1, 3, 5, 7 (``w_slot_bases``)."""
    rows, offsets = 16 * tiles, {}
    for q, r, c in itertools.product(range(4), range(rows), range(16)):
        line = q * rows + (8 * (r // 8) + 4 * (r % 2) + (r // 2) % 4 if octets else r)
        offsets[(q, r, c)] = 16 * line + 2 * ((c >> 1) ^ (line % 8)) + (c & 1)
    return offsets


class _Bases(NamedTuple):
    reg_bases: list
    lane_bases: list


@pytest.mark.parametrize("tiles", [1, 2, 4])
def test_octet_rows_slot_is_where_the_copy_puts_the_weights(tiles):
    got = _slot_offsets(engine.w_slot_bases(tiles))
    assert len(got) == 4 * 16 * tiles * 16 and got == _weight_copy_offsets(tiles, octets=True)


def test_octet_rows_make_the_weight_loads_conflict_free():
    """The fold step's weight loads (``_layouts``' weight layout: the BlockedLayout ``[1, 1, 2]`` a thread, lanes 4
    along the columns and 8 along the rows, as bases; and the warp-group one): 8 wavefronts a 16-byte load with one
    row a line, 4 with the octet order."""
    lanes = [[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
    blocked = _Bases([[0, 0, 1], [0, 0, 8], [0, 8, 0], [0, 16, 0]], lanes)  # tiles 2, one warp's registers
    grouped = engine._layouts(2, 16, False, 2)[0]
    assert grouped.lane_bases == lanes
    for tiles, layout in ((2, blocked), (2, _Bases(grouped.reg_bases, grouped.lane_bases))):
        loads = 1 << (len(layout.reg_bases) - 1)
        assert _wavefronts(layout, _weight_copy_offsets(tiles, octets=False)) == 8 * loads
        assert _wavefronts(layout, _weight_copy_offsets(tiles, octets=True)) == 4 * loads
    assert engine.octet_rows(_case(m=4096, k=4096)) and not engine.octet_rows(_case(m=4100, k=4096))
    assert not engine.octet_rows(_case(k=2880, layout="swizzled")) and not engine.octet_rows(_case(fmt="mxfp4"))


def test_grid_size_one_program_per_tile_or_per_sm_programs():
    assert grid_size(128, 4, EngineConfig(2, 3, 128, 0), 132) == (128, False)
    assert grid_size(128, 4, EngineConfig(2, 3, 128, 2), 132) == (264, True)
    assert grid_size(264, 4, EngineConfig(2, 3, 128, 2), 132) == (264, False)  # one tile a program
    assert grid_size(3, 2, EngineConfig(2, 3, 128, 2), 132) == (6, True)  # at most one program a unit


_COMPILE = textwrap.dedent("""
    import collections, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from aot import jit_specialization, sass_listing, registers, local_memory, mma_loop
    import operands as O
    from fp4gemv.ops import gemv_operands
    from fp4gemv.kernels.engine import EngineConfig, engine_launch, engine_config
    for fmt, n, layout, tiles in (("nvfp4", 1, "linear", 2), ("nvfp4", 3, "linear", 2), ("nvfp4", 8, "linear", 2),
                                  ("nvfp4", 16, "linear", 2), ("mxfp4", 1, "linear", 2), ("mxfp4", 16, "linear", 2),
                                  ("nvfp4", 16, "swizzled", 2), ("mxfp4", 16, "swizzled", 2),
                                  ("nvfp4", 16, "swizzled", 1), ("mxfp4", 16, "swizzled", 1),
                                  ("nvfp4", 8, "linear", "2,2,80"), ("mxfp4", 8, "swizzled", "2,2,80"),
                                  ("nvfp4", 16, "swizzled", 2880), ("mxfp4", 4, "swizzled", 2880),
                                  ("mxfp4", 16, "swizzled", "2,2,80,0,2"), ("mxfp4", 16, "linear", "2,2,80,0,2"),
                                  ("nvfp4", 16, "linear", "4,3,168,0,2"), ("nvfp4", 16, "linear", "2,2,128,2")):
        k = tiles if isinstance(tiles, int) and tiles > 4 else 4096  # K past a multiple of 1024 (and of 256)
        tiles = 2 if k != 4096 else tiles
        a = O.random_fp4((4096, k), fmt, layout, seed=1, device="cpu")
        b = O.random_activation((n, k), torch.bfloat16, seed=2, device="cpu")
        ops = gemv_operands(a, b, torch.empty((1, 4096, n), dtype=torch.bfloat16))
        if isinstance(tiles, str):  # a whole configuration: tiles, stages, launch registers[, per_sm, groups]
            config = EngineConfig(*(int(v) for v in tiles.split(",")))
        else:
            config = engine_config(ops.case)._replace(tiles=tiles)
        kernel, grid, args, options = engine_launch(ops, config)
        kw = {k: v for k, v in options.items() if k not in ("num_warps", "maxnreg")}
        sig, const, attrs, _ = jit_specialization(kernel, args, kw)
        c = triton.compile(GluonASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=options["num_warps"], maxnreg=options["maxnreg"]))
        listing = sass_listing(c)
        ops_ = collections.Counter(op.split(".")[0] for _, op, _ in listing)
        bars = sum(op.startswith("BAR") for _, op, _ in mma_loop(listing))
        print(fmt, layout, n, config.tiles, config.stages, config.maxnreg, config.groups, registers(c),
              ops_["UTMALDG"], ops_["HMMA"], ops_["SYNCS"], c.metadata.shared, bars, k, local_memory(c))
""")


def test_compiles_for_sm90_with_bulk_copies_mbarriers_and_no_local_memory(compile_for_sm90):
    lines = compile_for_sm90(_COMPILE).strip().splitlines()
    assert len(lines) == 18
    for line in lines:
        fmt, layout, n, tiles, stages, maxnreg, groups, regs, tma, mma, syncs, shared, bars, k, local = \
            line.split(" ", 14)
        assert int(regs) <= int(maxnreg), line
        # weights, scales and activation through the copy engine (swizzled scales: loaded by the consumer); K % 256
        # != 0: the weights in four copies of 128 columns
        weights = 1 if int(k) % 256 == 0 else 4
        assert int(tma) == weights + (1 if layout == "swizzled" else 2), line
        # a warp's tiles x 2 chunks x 4 words x 2 k16 (x 2 n-tiles)
        assert int(mma) == 16 * int(tiles) // int(groups) * (2 if int(n) > 8 else 1), line
        assert int(syncs) > 0, line  # mbarrier waits and arrivals
        # two programs an SM (228 KB, 1 KB reserved a program): at 122916 bytes one fit, 1.5x slower (round 24);
        # 64-row programs of two warp groups: one, with three ring slots
        programs = 1 if int(tiles) == 4 and int(groups) > 1 else 2
        assert int(shared) <= 233472 // programs - 1024, line
        if int(groups) > 1:  # 4 groups consumer warps and the producer's warp group
            assert programs * 32 * (4 * int(groups) + 4) * int(maxnreg) <= 65536, line
        elif int(stages) == 2 and int(maxnreg) == 80:
            # three programs an SM at N <= 8: the warps' partials summed through the ring (no 8 KB scratch)
            assert int(shared) <= 233472 // 3 - 1024 and 3 * 256 * int(maxnreg) <= 65536, line
        # one barrier a step at most: the swizzled scale words reach the step's layout without crossing warps
        # (round 24: their conversion through shared memory added a barrier a step, 1.04-1.36x the time)
        assert int(bars) <= 1, line
        assert local == "[]", line


_COMPILE_BATCHES = textwrap.dedent("""
    import torch
    from aot import compile_gluon_sm90, sass_listing, registers, local_memory, mma_loop
    import operands as O
    from fp4gemv.ops import gemv_operands
    from fp4gemv.kernels.engine import EngineConfig, engine_launch
    for fmt, layout in (("nvfp4", "swizzled"), ("mxfp4", "linear")):
        for L in (1, 3):
            a = O.random_fp4((L, 4096, 4096), fmt, layout, seed=1, device="cpu").with_code_order("paired")
            b = O.random_activation((L, 16, 4096), torch.bfloat16, seed=2, device="cpu")
            ops = gemv_operands(a, b, torch.empty((L, 4096, 16), dtype=torch.bfloat16))
            kernel, grid, args, options = engine_launch(ops, EngineConfig(2, 2, 128))
            c = compile_gluon_sm90(kernel, args, options)
            loop = mma_loop(sass_listing(c))
            print(fmt, L, grid[0], len(loop), registers(c), c.metadata.shared, local_memory(c))
""")


def test_batches_compile_to_the_same_step(compile_for_sm90):
    """sm_90: a batch of three is the same step loop as one matrix (the batch arithmetic is per tile, outside it),
    three times the programs, within the launch's registers, no local memory."""
    rows = [line.split(" ", 6) for line in compile_for_sm90(_COMPILE_BATCHES).strip().splitlines()]
    got = {(fmt, int(L)): (int(grid), int(loop), int(regs), int(shared), local)
           for fmt, L, grid, loop, regs, shared, local in rows}
    for fmt in ("nvfp4", "mxfp4"):
        one, three = got[fmt, 1], got[fmt, 3]
        assert three[0] == 3 * one[0] and abs(three[1] - one[1]) <= 4, (fmt, one, three)
        assert three[2] <= 128 and three[4] == "[]" and three[3] <= 233472 // 2 - 1024, (fmt, three)


_COMPILE_ORDERS = textwrap.dedent("""
    import collections, torch
    from aot import compile_gluon_sm90, sass_listing, registers, local_memory, mma_loop
    import operands as O
    from fp4gemv.ops import gemv_operands
    from fp4gemv.kernels.engine import EngineConfig, engine_launch
    for fmt, layout, dtype in (("nvfp4", "linear", torch.bfloat16), ("mxfp4", "swizzled", torch.bfloat16),
                               ("nvfp4", "linear", torch.float16), ("mxfp4", "swizzled", torch.float16)):
        for order in ("native", "paired"):
            a = O.random_fp4((4096, 4096), fmt, layout, seed=1, device="cpu").with_code_order(order)
            b = O.random_activation((16, 4096), dtype, seed=2, device="cpu")
            ops = gemv_operands(a, b, torch.empty((1, 4096, 16), dtype=dtype))
            kernel, grid, args, options = engine_launch(ops, EngineConfig(2, 2, 128))
            c = compile_gluon_sm90(kernel, args, options)
            loop = mma_loop(sass_listing(c))
            mix = collections.Counter(op.split(".")[0] for _, op, _ in loop)
            print(fmt + str(dtype).split(".")[1], order, len(loop), mix["PRMT"], mix["HMMA"], registers(c), local_memory(c))
""")


def test_the_paired_order_drops_the_activations_pairing_from_the_step(compile_for_sm90):
    """sm_90, N = 16, (2, 2, 128): on paired weights the step takes the activation's registers as loaded, so its
    loop loses the pairing ``PRMT``s (64 a warp-step: docs/performance.md, round 28, item 8) and nothing else
    changes -- the same tensor-core instructions, registers within the launch's, no local memory; bf16 and fp16
    activations alike."""
    rows = [line.split(" ", 6) for line in compile_for_sm90(_COMPILE_ORDERS).strip().splitlines()]
    assert len(rows) == 8
    got = {(fmt, order): (int(n), int(prmt), int(mma), int(regs), local)
           for fmt, order, n, prmt, mma, regs, local in rows}
    for fmt in ("nvfp4bfloat16", "mxfp4bfloat16", "nvfp4float16", "mxfp4float16"):
        native, paired = got[fmt, "native"], got[fmt, "paired"]
        # what PRMTs stay: the scales' (fp16: each e4m3 pair's two halves duplicated, 16 a warp-step)
        assert paired[1] <= (24 if fmt == "nvfp4float16" else 8) and native[1] - paired[1] == 64, (fmt, native, paired)
        assert native[0] - paired[0] >= 56 and paired[2] == native[2] == 64, (fmt, native, paired)
        assert paired[3] <= 128 and paired[4] == "[]", (fmt, paired)


# --- GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", O.OUT_DTYPES)
@pytest.mark.parametrize("m, k, n", [(4096, 4096, 16), (1000, 2048, 9), (7168 + 48, 1024, 13), (96, 1024, 1),
                                     (4144, 2048, 8), (520, 1024, 3)])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
def test_ptx_exact(layout, out_dtype, m, k, n):
    a = O.random_fp4((m, k), "nvfp4", layout, seed=m + n, global_scale=0.375 if n % 2 else None, device="cuda")
    b = O.random_activation((n, k), torch.bfloat16, seed=k, device="cuda")
    default = Engine().default_config(gemv_operands(a, b, torch.empty(O.result_shape(a, b), device="cuda")).case,
                                      device_target(a.data.device))
    configs = [default, EngineConfig(1, 4, 128), default._replace(per_sm=1), EngineConfig(1, 3, 128, 3),
               EngineConfig(2, 2, 80)]
    if layout == "linear":  # 64-row programs: linear scales only
        configs += [EngineConfig(4, 2, 168), EngineConfig(4, 2, 168, 2)]
    if n > 8:  # a warp group a tile (four consumer warps a 16-row tile)
        configs += [EngineConfig(2, 2, 80, 0, 2), EngineConfig(2, 2, 80, 1, 2)]
        if layout == "linear":  # 64-row programs: four groups of one tile, two of two (one program an SM)
            configs += [EngineConfig(4, 2, 96, 0, 4), EngineConfig(4, 3, 168, 0, 2), EngineConfig(4, 3, 168, 1, 2)]
    for config in configs:
        out = O.poisoned((m, n), out_dtype, device="cuda")
        gemv(a, b, out=out, out_dtype=out_dtype, backend="triton-ptx", kernel="engine", config=config)
        O.assert_matches_exact(out, a, b, out_dtype, tensor_cores=True, fold=engine.FOLD_EXPONENT)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, layout, m, k, n, pad_rows, broadcast", [
    ("nvfp4", "linear", 200, 2048, 9, 0, None), ("nvfp4", "linear", 1000, 4096, 16, 32, None),
    ("mxfp4", "linear", 96, 3072, 4, 16, None), ("nvfp4", "swizzled", 200, 2048, 13, 0, None),
    ("mxfp4", "swizzled", 520, 2048, 8, 0, None), ("nvfp4", "swizzled", 200, 2880, 5, 0, None),
    ("nvfp4", "swizzled", 160, 2048, 16, 0, "a"), ("mxfp4", "linear", 160, 2048, 3, 0, "b"),
    ("nvfp4", "swizzled", 4096, 7168, 16, 0, None)])
def test_batches_exact(fmt, layout, m, k, n, pad_rows, broadcast):
    """L = 3 in one launch (``batch_rows``; the CPU test above checks the addresses): exact within the tensor-core
    bound in the default configuration and three programs an SM, with padded batches, broadcast operands and an
    output whose batches are not contiguous (the task's [M, N, L] order)."""
    a, b, _ = _batched_operands(fmt, layout, m, k, n, 3, pad_rows, broadcast)
    a = FP4Tensor(a.data.cuda(), a.scales.cuda(), fmt, layout)
    b = b.cuda()
    default = Engine().default_config(gemv_operands(a, b, torch.empty(O.result_shape(a, b), device="cuda")).case,
                                      device_target(a.data.device))
    assert select_kernel(a, b).name == ("engine" if n >= engine.MIN_N_OVER_WEIGHT_ONLY else "weight_only")
    for config in (default, EngineConfig(2, 2, 80)):
        for out in (O.poisoned((3, m, n), torch.float32, device="cuda"),
                    O.poisoned((m, n, 3), torch.float32, device="cuda").permute(2, 0, 1)):
            gemv(a, b, out=out, out_dtype=torch.float32, backend="triton-ptx", kernel="engine", config=config)
            O.assert_matches_exact(out, a, b, torch.float32, tensor_cores=True,
                                   fold=engine.step_fold_exponent(fmt))


@pytest.mark.gpu
@pytest.mark.parametrize("m, k", [(4096, 4096), (200, 3072), (7168, 16384)])
def test_persistent_grid_same_bits_every_launch_and_in_a_graph(m, k):
    """The split-K fix-up is deterministic and leaves its counters zero: ten eager launches and two replays of a
    CUDA graph of three launches give the first launch's bits (programs that split tiles at many places)."""
    a = O.random_fp4((m, k), "nvfp4", "linear", seed=3, device="cuda")
    b = O.random_activation((4, k), torch.bfloat16, seed=4, device="cuda")
    config = EngineConfig(1, 3, 128, 3)
    first = gemv(a, b, out_dtype=torch.float32, kernel="engine", config=config)
    O.assert_matches_exact(first, a, b, torch.float32, tensor_cores=True, fold=engine.FOLD_EXPONENT)
    for _ in range(10):
        assert torch.equal(gemv(a, b, out_dtype=torch.float32, kernel="engine", config=config), first)
    outs = [torch.full((m, 4), float("nan"), device="cuda") for _ in range(3)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gemv(a, b, out=outs[0], out_dtype=torch.float32, kernel="engine", config=config)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for out in outs:
            gemv(a, b, out=out, out_dtype=torch.float32, kernel="engine", config=config)
    for _ in range(2):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for out in outs:
            assert torch.equal(out, first)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", O.OUT_DTYPES)
@pytest.mark.parametrize("m, k, n", [(4096, 4096, 16), (1000, 2048, 9), (96, 1024, 1), (520, 1024, 3)])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
def test_ptx_exact_mxfp4(layout, out_dtype, m, k, n):
    """MXFP4 weights (e8m0 scales in either layout) on the engine's k32 step."""
    a = O.random_fp4((m, k), "mxfp4", layout, seed=m + n, device="cuda")
    b = O.random_activation((n, k), torch.bfloat16, seed=k, device="cuda")
    default = Engine().default_config(gemv_operands(a, b, torch.empty(O.result_shape(a, b), device="cuda")).case,
                                      device_target(a.data.device))
    configs = [default, EngineConfig(1, 4, 128), default._replace(per_sm=2), EngineConfig(2, 2, 80)]
    if layout == "linear":  # 64-row programs: linear scales only
        configs.append(EngineConfig(4, 2, 168))
    if n > 8:  # a warp group a tile, or two tiles
        configs += [EngineConfig(2, 2, 80, 0, 2), EngineConfig(2, 2, 80, 2, 2)]
        if layout == "linear":
            configs.append(EngineConfig(4, 3, 168, 0, 2))
    for config in configs:
        out = O.poisoned((m, n), out_dtype, device="cuda")
        gemv(a, b, out=out, out_dtype=out_dtype, backend="triton-ptx", kernel="engine", config=config)
        O.assert_matches_exact(out, a, b, out_dtype, tensor_cores=True, fold=engine.step_fold_exponent("mxfp4"))


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["checkpoint", "paired"])
@pytest.mark.parametrize("m, k, n", [(4096, 4096, 16), (1000, 2048 + 1024 + 512, 9), (520, 1024, 3), (96, 1024, 1)])
@pytest.mark.parametrize("fmt, layout", [("nvfp4", "linear"), ("nvfp4", "swizzled"), ("mxfp4", "linear"),
                                         ("mxfp4", "swizzled")])
def test_fp16_activations_exact(fmt, layout, m, k, n, order):
    """fp16 activations (``engine.step_act``: the fp16 decode, unbiased scales and activation) spread over 2^-10 ..
    2^10 times a normal sample (fp32 results; times 2^-8 for fp16 results, whose exact values would otherwise pass
    fp16's largest finite value), exact within the tensor-core bound in the default and a persistent split
    configuration, three programs an SM, the 64-row programs (linear scales, N > 8), K past a multiple of 1024."""
    g = torch.Generator().manual_seed(m + k + n)
    a = O.random_fp4((m, k), fmt, layout, seed=m + n, global_scale=0.375 if fmt == "nvfp4" and n % 2 else None,
                     device="cuda").with_code_order(order)
    spread = torch.exp2(torch.randint(-10, 11, (n, k), generator=g).float())
    b = (torch.randn(n, k, generator=g) * spread).to(torch.float16).cuda()
    default = Engine().default_config(gemv_operands(a, b, torch.empty(O.result_shape(a, b), device="cuda")).case,
                                      device_target(a.data.device))
    configs = [default, default._replace(per_sm=2), EngineConfig(2, 2, 80)]
    if n > 8 and layout == "linear":
        configs.append(EngineConfig(4, 3, 168, 0, 2))
    for out_dtype, x in ((torch.float32, b), (torch.float16, (b.float() * 2.0 ** -8).to(torch.float16))):
        for config in configs:
            out = O.poisoned((m, n), out_dtype, device="cuda")
            gemv(a, x, out=out, out_dtype=out_dtype, backend="triton-ptx", kernel="engine", config=config)
            O.assert_matches_exact(out, a, x, out_dtype, tensor_cores=True,
                                   fold=engine.step_fold_exponent(fmt, "f16"))


def _with_poisoned_padding(a):
    """``a`` with its swizzled scales' padding columns (past K's last block, in the last atom) set to 0xFF: NaN as
    e8m0 and as e4m3, so a kernel that reads them with the zero-filled weights past K gives NaN."""
    if a.scale_layout != "swizzled":
        return a
    m, cols = a.shape[0], a.shape[1] // a.fmt.block_size
    scales = a.scales.clone()
    rows = torch.arange(m, device=scales.device)[:, None]
    pad = torch.arange(cols, cols + (-cols) % 4, device=scales.device)[None, :]
    scales.view(-1)[swizzled_offset(rows, pad, cols).reshape(-1)] = 0xFF
    return FP4Tensor(a.data, scales, a.fmt, "swizzled", a.global_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, layout, m, k, n", [
    ("nvfp4", "swizzled", 5760, 2880, 16), ("nvfp4", "swizzled", 300, 1088, 5), ("nvfp4", "linear", 300, 1280, 9),
    ("mxfp4", "swizzled", 5760, 2880, 16), ("mxfp4", "swizzled", 136, 1088, 4), ("mxfp4", "linear", 200, 2880, 12),
    ("mxfp4", "swizzled", 200, 2880, 1)])
def test_k_past_a_multiple_of_1024(fmt, layout, m, k, n):
    """The last step's copies past K are zero-filled and the swizzled scales past K read as zero (their padding
    bytes 0xFF here): exact results in every configuration, K % 256 != 0 (the weights' four 2-D copies a step) and
    K % 256 = 0 (the 3-D copy past K)."""
    a = _with_poisoned_padding(O.random_fp4((m, k), fmt, layout, seed=m + k, device="cuda"))
    if layout == "linear" and fmt == "mxfp4":  # gpt-oss's 90 scale bytes a row, stored 96 apart (16-byte rows)
        a = FP4Tensor(a.data, aligned_scale_rows(a.scales)[:, :k // 32], fmt, "linear")
    b = O.random_activation((n, k), torch.bfloat16, seed=k, device="cuda")
    fold = engine.step_fold_exponent(fmt)
    if n >= 4:
        assert select_kernel(a, b).name == "engine"
    configs = [None, EngineConfig(1, 2, 128), EngineConfig(2, 2, 80), EngineConfig(2, 3, 128, 2)]
    if n > 8:
        configs.append(EngineConfig(2, 2, 80, 0, 2))
    for config in configs:
        out = O.poisoned((m, n), torch.float32, device="cuda")
        gemv(a, b, out=out, out_dtype=torch.float32, backend="triton-ptx", kernel="engine", config=config)
        O.assert_matches_exact(out, a, b, torch.float32, tensor_cores=True, fold=fold)


@pytest.mark.gpu
def test_nan_scales_give_nan_rows():
    a = O.random_fp4((256, 2048), "nvfp4", "linear", seed=5, device="cuda")
    scales = a.scales.clone()
    scales[5, 1], scales[255, 127] = 0x7F, 0xFF
    a = FP4Tensor(a.data, scales, "nvfp4", "linear")
    b = O.random_activation((12, 2048), torch.bfloat16, seed=6, device="cuda")
    out = torch.full((256, 12), -7777.0, device="cuda")
    gemv(a, b, out=out, out_dtype=torch.float32, backend="triton-ptx", kernel="engine")
    out, a, b = O.on_oracle_device(out, a, b)
    exact = quantized_gemv_reference(a, b, torch.float64)
    assert torch.equal(out.isnan(), exact.isnan()) and exact.isnan().any()
    ok = O.within_bound(out, a, b, torch.float32, tensor_cores=True, fold=engine.FOLD_EXPONENT) | exact.isnan()
    assert ok.all()


@pytest.mark.gpu
def test_chosen_on_the_gpu_from_four_rows_with_linear_scales():
    a = O.random_fp4((4096, 4096), "nvfp4", "linear", seed=1, device="cuda")
    assert select_kernel(a, torch.empty(4, 4096, dtype=torch.bfloat16, device="cuda")).name == "engine"
    assert select_kernel(a, torch.empty(3, 4096, dtype=torch.bfloat16, device="cuda")).name == "weight_only"
    assert STEP_K == 1024


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, layout, global_scale", [("nvfp4", "linear", 0.375), ("nvfp4", "swizzled", None),
                                                       ("mxfp4", "linear", None), ("mxfp4", "swizzled", None)])
def test_kept_launch_on_new_operands_each_call(fmt, layout, global_scale):
    """After the first call the engine launches by address (``ops.KeptLaunch``: descriptors re-encoded at each
    call's addresses): three operand sets of one metadata, each called after the others, eagerly and in a CUDA
    graph, every result exact for its own operands."""
    m, k, n = 520, 2048, 12
    sets = [(O.random_fp4((m, k), fmt, layout, seed=s, global_scale=global_scale, device="cuda"),
             O.random_activation((n, k), torch.bfloat16, seed=10 + s, device="cuda")) for s in range(3)]
    assert select_kernel(*sets[0], out=torch.empty((m, n), dtype=torch.float16, device="cuda")).name == "engine"
    fold = engine.step_fold_exponent(fmt)
    for _ in range(2):
        for a, b in sets:
            out = O.poisoned((m, n), torch.float32, device="cuda")
            gemv(a, b, out=out, out_dtype=torch.float32)
            O.assert_matches_exact(out, a, b, torch.float32, tensor_cores=True, fold=fold)
    outs = [O.poisoned((m, n), torch.float32, device="cuda") for _ in sets]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for (a, b), out in zip(sets, outs):
            gemv(a, b, out=out, out_dtype=torch.float32)
    for out in outs:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for (a, b), out in zip(sets, outs):
        O.assert_matches_exact(out, a, b, torch.float32, tensor_cores=True, fold=fold)
