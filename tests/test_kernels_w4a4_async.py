"""The W4A4 kernel's memory-system variants (``kernels/w4a4_async.py``) against the exact reference.

On a CPU-only machine the pure-Triton decode runs in Triton's interpreter, which exercises the tile, the scale
addressing one step ahead, masking, the persistent tile walk and the activation tile; the pipelining itself
(``cp.async``) is a compile-time transformation the interpreter does not perform, so the sm_90 compile tests
check it: copies present, 16-byte weights, 16-bit scales, no local memory, no shared-memory layout conversion
in the loop.  ``gpu`` tests run the PTX decode.
"""

import importlib.util
import os

import pytest
import torch

from fp4gemv import FP4Tensor, gemv, ops, task
from fp4gemv.kernels.configs import GemvConfig
from fp4gemv.kernels.w4a4_async import check_async_config, tile_shape
from fp4gemv.reference import quantized_gemv_reference

from test_kernels_gemv import assert_matches_exact, poisoned, random_fp4
from test_kernels_w4a4 import _as_lm, _operands

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "m, k, L, cfg",
    [
        (128, 4096, 1, GemvConfig(16, 16, 8, ksplit=8, stages=3)),  # the 16-row tile, two K steps
        (200, 192, 2, GemvConfig(16, 8, 4, ksplit=2, stages=2)),  # tail rows, a masked partial step
        (384, 1024, 1, GemvConfig(32, 16, 4, ksplit=2, stages=1)),  # scales ahead only; 2 warps side by side over rows
        (256, 1024, 2, GemvConfig(64, 32, 4, stages=4, pdl=True, prefetch=32)),  # 8 rows per thread (PDL off here)
        (96, 192, 1, GemvConfig(32, 2, 1, stages=2)),  # 2-block steps: the scale columns computed every step
        (136, 320, 3, GemvConfig(16, 8, 4, ksplit=2, stages=3, persistent=2)),  # 2 programs walk 27 tiles, 3 batches
        (256, 2048, 1, GemvConfig(32, 16, 8, ksplit=8, stages=3, persistent=3)),  # persistent, every step full
    ],
)
def test_async_kernel_matches_reference(m, k, L, cfg):
    args, expected = _operands(m, k, L, seed=m + k + L, device=DEVICE)
    got = _as_lm(ops.task_gemv(*args, backend="triton", config=cfg))
    assert not torch.isnan(got).any(), "some outputs were not written"
    torch.testing.assert_close(got, expected.float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("cfg", [GemvConfig(16, 16, 8, ksplit=8, stages=3),
                                 GemvConfig(16, 8, 4, ksplit=2, stages=2, persistent=2)])
def test_async_kernel_passes_task_check(cfg):
    data = task.generate_full_range_input(128, 1536, 2, seed=7, device=DEVICE)
    c = data[6].fill_(float("nan"))
    ops.task_gemv(data[0], data[1], data[4], data[5], c, backend="triton", config=cfg)
    ok, msg = task.check_implementation(data, c)
    assert ok, msg


@pytest.mark.parametrize("shipped, stages, persistent", [
    (GemvConfig(16, 16, 8, ksplit=8), 3, 0),
    (GemvConfig(64, 32, 4), 1, 0),
    (GemvConfig(8, 32, 4, ksplit=8), 2, 2),
])
def test_async_kernel_equals_the_shipped_kernel_on_the_same_tile(shipped, stages, persistent):
    """Same tile, same block sums, same accumulation order: the results are bit for bit the shipped kernel's."""
    args, _ = _operands(128, 2048, 2, seed=5, device=DEVICE)
    base = ops.task_gemv(*args, backend="triton", config=shipped).clone()
    args[4].fill_(float("nan"))
    got = ops.task_gemv(*args, backend="triton", config=shipped._replace(stages=stages, persistent=persistent))
    assert torch.equal(got.view(torch.int16), base.view(torch.int16))


# --- MXFP4 through fp4gemv.gemv -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "m, k, L, cfg, layouts_ab",
    [
        (200, 192, 2, GemvConfig(16, 8, 4, ksplit=2, stages=3), ("swizzled", "linear")),  # tails, 6 columns
        (130, 96, 1, GemvConfig(64, 4, 4, stages=2), ("linear", "linear")),  # 3 columns (odd), 4-block steps
        (72, 160, 2, GemvConfig(16, 8, 4, ksplit=2, stages=3), ("linear", "swizzled")),  # 5 columns (odd)
        (256, 1024, 1, GemvConfig(64, 32, 4, stages=3, pdl=True, prefetch=32), ("swizzled", "swizzled")),
        (136, 256, 2, GemvConfig(16, 8, 4, ksplit=2, stages=3, persistent=3), ("swizzled", "linear")),
        (128, 512, 1, GemvConfig(32, 16, 4, ksplit=2, stages=1), ("linear", "swizzled")),
    ],
)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_async_kernel_mxfp4_matches_exact_result(m, k, L, cfg, layouts_ab, out_dtype):
    a = random_fp4((L, m, k), "mxfp4", layouts_ab[0], m + k, global_scale=0.75, device=DEVICE)
    b = random_fp4((L, 1, k), "mxfp4", layouts_ab[1], m + k + 1, global_scale=-1.5, device=DEVICE)
    got = gemv(a, b, out=poisoned((L, m, 1), out_dtype, device=DEVICE), out_dtype=out_dtype, backend="triton",
               config=cfg)
    assert not torch.isnan(got).any(), "some outputs were not written"
    assert_matches_exact(got.cpu(), a.to("cpu"), b.to("cpu"), out_dtype)


@pytest.mark.parametrize("k, column", [(128, 0), (128, 1), (128, 2), (128, 3), (96, 2)])
def test_async_kernel_reads_each_mxfp4_scale_for_its_two_blocks(k, column):
    """Doubling one 32-element block's e8m0 scale changes the result by exactly that block (both halves):
    each lane picks its own column out of the pair it loads one step ahead."""
    cfg = GemvConfig(16, 4, 2, ksplit=2, stages=2)
    a = random_fp4((1, 128, k), "mxfp4", "linear", 3)
    b = random_fp4((1, 1, k), "mxfp4", "linear", 4)
    a, b = a.to(DEVICE), b.to(DEVICE)
    base = gemv(a, b, out_dtype=torch.float32, backend="triton", config=cfg)
    scales = a.scales.clone()
    scales[:, :, column] += 1
    bumped = FP4Tensor(a.data, scales, "mxfp4", "linear")
    got = gemv(bumped, b, out_dtype=torch.float32, backend="triton", config=cfg)
    expected = quantized_gemv_reference(bumped.to("cpu"), b.to("cpu"), torch.float64)
    assert not torch.allclose(base.cpu(), got.cpu())
    torch.testing.assert_close(got.cpu().double(), expected, rtol=1e-6, atol=1e-6)


# --- configurations ---------------------------------------------------------------------------------------


def test_tile_puts_warps_along_k_first():
    assert tile_shape(GemvConfig(16, 16, 8, ksplit=8, stages=3)) == (4, 8, 1, 4, 16)
    assert tile_shape(GemvConfig(64, 32, 4, stages=3)) == (2, 1, 4, 8, 32)
    assert tile_shape(GemvConfig(8, 32, 4, ksplit=8, stages=3)) == (2, 8, 1, 4, 32)


@pytest.mark.parametrize("cfg", [GemvConfig(8, 4, 4, stages=3),  # 16 rows side by side in a warp, 8 asked
                                 GemvConfig(8, 32, 8, stages=3),  # 8 warps over rows of 2 lanes: 16 rows, 8 asked
                                 GemvConfig(16, 128, 4, stages=2),  # a lane's 16-byte load: blocks <= 64
                                 GemvConfig(64, 1, 1, stages=2)])  # ... and >= 2
def test_a_config_without_a_tile_is_rejected_before_anything_is_written(cfg):
    with pytest.raises(ValueError, match="config: expected blocks from 2 to 64 and rows a multiple of"):
        check_async_config(cfg)
    args, _ = _operands(128, 256, 1, seed=1, device=DEVICE)
    with pytest.raises(ValueError, match="config"):
        ops.task_gemv(*args, backend="triton", config=cfg)
    assert torch.isnan(args[4]).all()


def _benchmark_module(name):
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_benchmarked_variant_has_a_tile():
    """benchmarks/sweep_task_kernel.py runs these on the GPU in one call: none may fail on its configuration."""
    module = _benchmark_module("task_kernel_variants")
    for shape in module.SHAPES:
        for fmt in ("nvfp4", "mxfp4"):
            names = [name for name, _ in module.variants(*shape, fmt=fmt)]
            assert names[0] == "shipped" and len(set(names)) == len(names), names
            for name, cfg in module.variants(*shape, fmt=fmt):
                if cfg.stages:
                    check_async_config(cfg)
                assert cfg.blocks * cfg.ksplit <= shape[1] // 16, (shape, name, cfg)


def test_sweep_checks_tell_a_wrong_variant_from_a_right_one():
    """The correctness phase of benchmarks/sweep_task_kernel.py (run once on the GPU before any timing), here on the
    interpreter: right variants pass, a rejected configuration and a wrong result are reported as failures."""
    sweep = _benchmark_module("sweep_task_kernel")
    named = [("shipped", GemvConfig(16, 16, 8, ksplit=8)), ("async3", GemvConfig(16, 16, 8, ksplit=8, stages=3)),
             ("persist3", GemvConfig(16, 8, 4, ksplit=2, stages=3, persistent=2)),
             ("no tile", GemvConfig(8, 4, 4, stages=3))]
    for check in (sweep.check_nvfp4, sweep.check_mxfp4):
        result = check((128, 1024, 2), named, device=DEVICE, backend="triton")
        assert [ok for ok, _ in result.values()] == [True, True, True, False], result
        assert "ValueError: config" in result["no tile"][1]


def test_sweep_checks_reject_a_wrong_result(monkeypatch):
    """With the block sums scaled by 1 + 2^-8 (a plausible decode slip), both checks fail the variant."""
    sweep = _benchmark_module("sweep_task_kernel")
    from fp4gemv.kernels import w4a4_async

    real = w4a4_async.launch_w4a4_async

    def off_by_a_bit(*args, global_scale_a=None, **kw):
        c = args[6]
        real(*args, global_scale_a=global_scale_a, **kw)
        c.mul_(1 + 2.0**-8)

    monkeypatch.setattr(w4a4_async, "launch_w4a4_async", off_by_a_bit)
    named = [("async3", GemvConfig(16, 16, 8, ksplit=8, stages=3))]
    for check in (sweep.check_nvfp4, sweep.check_mxfp4):
        (ok, message), = check((128, 1024, 1), named, device=DEVICE, backend="triton").values()
        assert not ok, message


# --- sm_90 machine code of the launches gemv and ops.task_gemv make --------------------------------------

_AOT_SCRIPT = r"""
import importlib, os, re, subprocess, tempfile, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import fp4gemv, fp4gemv.ops
from fp4gemv import bench, layouts, ops
from fp4gemv.kernels import w4a4_async

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
calls = []
class Recorder:
    def __getitem__(self, grid):
        return lambda *args, **kw: calls.append((args, kw))
kernel, w4a4_async.w4a4_async_kernel = w4a4_async.w4a4_async_kernel, Recorder()
w4a4_async.interpreting = lambda: False
w4a4_async._resident_programs = lambda args, kw: 2
torch.cuda.get_device_properties = lambda device: type("Props", (), {"multi_processor_count": 132})
fp4gemv.ops.resolve_backend = lambda backend, device: "triton-ptx"
for (m, k, l), cfg in CASES:
    ops.task_gemv(*bench.random_task_operands(m, k, l, seed=0, device="cpu"), config=cfg)
def fp4(l, rows, k, fmt, layout):
    cols = k // (16 if fmt == "nvfp4" else 32)
    if layout == "linear":
        scales = torch.zeros(l, rows, cols, dtype=torch.uint8)
    else:
        rp, cp = layouts.padded_scale_shape(rows, cols)
        scales = torch.zeros(l, rp * cp, dtype=torch.uint8)
    return fp4gemv.FP4Tensor(torch.zeros(l, rows, k // 2, dtype=torch.uint8), scales, fmt, layout)
gemv_module = importlib.import_module("fp4gemv.gemv")
gemv_module.resolve_backend = lambda backend, device: "triton-ptx"
for (m, k, l), fmt, layout, cfg in GEMV_CASES:
    gemv_module.gemv(fp4(l, m, k, fmt, layout), fp4(l, 1, k, fmt, layout), out_dtype=torch.bfloat16, config=cfg)

def sass_and_usage(cubin):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    run = lambda *a: subprocess.run([CUOBJDUMP, *a, f.name], capture_output=True, text=True, check=True).stdout
    try:
        return run("-sass"), run("-res-usage")
    finally:
        os.remove(f.name)

def main_loop(sass):
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass)]
    best = (0, -1)
    for addr, text in ins:
        target = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr and addr - int(target.group(1), 16) > best[1] - best[0]:
            best = (int(target.group(1), 16), addr)
    return [t for a, t in ins if best[0] <= a <= best[1]]

for args, kw in calls:
    sig, const, attrs, _ = jit_specialization(kernel, args, kw)
    options = dict(num_warps=kw["num_warps"], num_stages=kw["num_stages"], launch_pdl=kw["launch_pdl"])
    if "maxnreg" in kw:
        options["maxnreg"] = kw["maxnreg"]
    compiled = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    sass, usage = sass_and_usage(compiled.asm["cubin"])
    label = "%s/%s stages=%d persistent=%s even_k=%s rows_even=%s" % (
        const["BLOCKS"], const["SCALE_BLOCK"], const["STAGES"], const["PERSISTENT"], const["EVEN_K"],
        const["SCALE_ROWS_EVEN"])
    bad = []
    if not ("dp4a" in ptx and "prmt" in ptx):
        bad.append("no dp4a/prmt decode")
    if ("griddepcontrol.wait" in ptx) != kw["launch_pdl"]:
        bad.append("PDL wait does not match launch_pdl")
    copies = {int(size, 0) for size in
              re.findall(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)? \[[^]]*\], \[[^]]*\], (\w+)", ptx)}
    if const["STAGES"] >= 2:
        # weights and activation by cp.async, 16 bytes each (8 where a masked tail splits them)
        if not copies or (const["EVEN_K"] and copies != {16}):
            bad.append("cp.async copies %s" % sorted(set(copies)))
    else:
        if copies:
            bad.append("cp.async in a variant without stages")
        if const["EVEN_K"] and not re.search(r"ld\.global(\.nc)?\.v2\.b64", ptx):
            bad.append("no 16-byte weight loads")
    wide = len(re.findall(r"ld\.global(?:\.nc)?\.b16", ptx))
    narrow = len(re.findall(r"ld\.global(?:\.nc)?\.[bu]8", ptx))
    if const["EVEN_K"] and const["SCALE_ROWS_EVEN"] and (narrow or not wide):
        bad.append("scale loads: %d byte, %d 16-bit" % (narrow, wide))
    for key in ("LOCAL", "STACK"):
        value = re.search(key + r":(\d+)", usage)
        if value is None or int(value.group(1)):
            bad.append("%s %s" % (key, value.group(1) if value else "?"))
    if "ld.local" in ptx or "st.local" in ptx:
        bad.append("local memory in the PTX")
    loop = main_loop(sass)
    barriers = sum(t.startswith("BAR.SYNC") for t in loop)
    if not const["PERSISTENT"] and const["EVEN_K"]:
        # the pipeliner's two barriers per step (copies landed; buffer free) and nothing else: a layout
        # conversion through shared memory in the loop would add its own
        expected = 2 if const["STAGES"] >= 2 else 0
        if barriers != expected:
            bad.append("%d barriers in the loop, expected %d" % (barriers, expected))
    print("compiled", label, "regs", re.search(r"REG:(\d+)", usage).group(1), "loop", len(loop), "bar", barriers,
          "u16", wide, "u8", narrow)
    for b in bad:
        print("FAIL", label, b)
print("compiled", len(calls))
"""

_CASES = [
    ((7168, 16384, 1), GemvConfig(16, 16, 8, ksplit=8, pdl=True, prefetch=32, stages=3)),
    ((4096, 7168, 8), GemvConfig(64, 32, 4, pdl=True, prefetch=32, stages=4)),
    ((4096, 14336, 1), GemvConfig(4, 32, 4, ksplit=4, stages=3)),
    ((14336, 4096, 1), GemvConfig(16, 16, 8, ksplit=8, pdl=True, prefetch=32, stages=1)),
    ((7168, 2048, 4), GemvConfig(64, 32, 4, pdl=True, prefetch=32, stages=3, persistent=8)),
    ((7168, 16384, 1), GemvConfig(16, 16, 8, ksplit=8, pdl=True, prefetch=32, stages=3, maxnreg=64)),
]
_GEMV_CASES = [
    ((7168, 2048, 1), "mxfp4", "swizzled", GemvConfig(16, 16, 8, ksplit=8, pdl=True, prefetch=32, stages=3)),
    ((256, 4096, 1), "mxfp4", "linear", GemvConfig(64, 32, 4, stages=2)),
    ((256, 192, 2), "mxfp4", "linear", GemvConfig(16, 8, 4, ksplit=2, stages=3)),  # masked tail, 6 columns
]


def test_async_variants_compile_for_sm90_with_their_copies_and_load_widths(compile_for_sm90):
    """The variants as the JIT specializes gemv's and ops.task_gemv's launches: cp.async copies of 16 bytes
    (stages >= 2) or 16-byte loads (stages = 1), 16-bit scale loads, no local memory, and no barrier in the loop
    besides the pipeliner's (a shared-memory layout conversion per step would add its own)."""
    out = compile_for_sm90("from fp4gemv.kernels.configs import GemvConfig\n"
                           f"CASES = {_CASES!r}\nGEMV_CASES = {_GEMV_CASES!r}\n" + _AOT_SCRIPT)
    assert "FAIL" not in out, out
    assert f"compiled {len(_CASES) + len(_GEMV_CASES)}" in out, out


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, L", [(2432, 4608, 2), (7168, 2048, 4), (200, 192, 3)])
@pytest.mark.parametrize("cfg", [GemvConfig(16, 16, 8, ksplit=8, pdl=True, prefetch=32, stages=3),
                                 GemvConfig(64, 32, 4, pdl=True, prefetch=32, stages=4),
                                 GemvConfig(16, 16, 8, ksplit=8, stages=3, persistent=8)])
def test_async_ptx_and_triton_agree_bitwise(m, k, L, cfg):
    args, expected = _operands(m, k, L, seed=3, device="cuda")
    ptx = ops.task_gemv(*args, backend="triton-ptx", config=cfg).clone()
    args[4].fill_(float("nan"))
    pure = ops.task_gemv(*args, backend="triton", config=cfg)
    assert torch.equal(ptx.view(torch.int16), pure.view(torch.int16))
    torch.testing.assert_close(_as_lm(ptx), expected.float(), rtol=1e-3, atol=1e-3)
