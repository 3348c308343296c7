"""Quantize and dequantize on the GPU: bit-for-bit checks against the CPU path, then speed against a copy.

Run from the repository root on the GPU machine (a few minutes, most of it the CPU reference on the large
check; ``--quick`` skips that check and the tile sweep):

    PYTHONPATH=src python benchmarks/quantize_speed.py

1. Checks: ``fp4gemv.quantize`` on CUDA against ``backend="reference"`` on the CPU, bytes equal, on the
   hostile fuzz of tests/quantize_fuzz.py (both formats, fp32 / fp16 / bf16, with and without global scales,
   both layouts, odd rows, batches), and on a real-sized 7168 x 16384 bf16 weight; ``dequantize`` to every
   float likewise, bits equal.  Any mismatch stops the script.
2. Speed: device time per call by CUDA-graph replay over distinct inputs with L2 flushed
   (``fp4gemv.bench.device_time_us``), as GB/s of the bytes the kernel reads and writes, and as a fraction
   of a ``torch`` copy moving as many bytes (half read, half written), timed the same way here.  The
   kernels' tile is swept; the default tile's lines are marked ``*``.  Host time per eager call is printed
   for an activation-sized call (what W4A4 pays per layer).

Writes ``quantize_speed.json`` under $OUT (or the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from quantize_fuzz import fuzz_input  # noqa: E402

from fp4gemv import bench  # noqa: E402
from fp4gemv.kernels.quantize import QuantizeConfig, quantize_config  # noqa: E402
from fp4gemv.quantize import dequantize, nvfp4_global_scale, quantize  # noqa: E402

DEVICE = "cuda"
BIG = (7168, 16384)  # the timed weight, and the real-sized check
FUZZ_SHAPES = (("swizzled", (515, 2048)), ("linear", (3, 301, 1024)))
DISTINCT_BYTES = 1_500_000_000  # distinct inputs per graph replay: far beyond the 50 MB L2
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _same_bytes(name, got, want):
    got, want = got.cpu(), want.cpu()
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        raise SystemExit(f"MISMATCH {name}: {len(bad)} bytes differ, first at {bad[0].tolist()}")


def _same_floats(name, got, want):
    got, want = got.cpu(), want.cpu()
    nan = torch.isnan(want)
    differ = (got.view(_INT[got.dtype]) != want.view(_INT[want.dtype])) & ~nan
    if not torch.equal(torch.isnan(got), nan) or differ.any():
        raise SystemExit(f"MISMATCH {name}: dequantized values differ")


def check(x, fmt, layout, gs, label, dequant_dtypes=(torch.float32, torch.float16, torch.bfloat16)):
    """GPU == CPU for quantize (bytes) and dequantize (bits); returns the CPU reference's seconds."""
    unchecked = fmt == "mxfp4" and gs is not None  # x / g overflows on the fuzz's largest values: NaN blocks
    t0 = time.perf_counter()
    want = quantize(x, fmt, layout, gs, backend="reference", check_values=not unchecked)
    cpu_s = time.perf_counter() - t0
    got = quantize(x.to(DEVICE), fmt, layout, gs, backend="triton", check_values=not unchecked)
    _same_bytes(f"{label} data", got.data, want.data)
    _same_bytes(f"{label} scales", got.scales, want.scales)
    for dt in dequant_dtypes:
        _same_floats(f"{label} dequantize {DTYPE_NAMES[dt]}", dequantize(got, dt, backend="triton"),
                     dequantize(want, dt))
    return cpu_s


def run_checks(quick):
    cases = [(fmt, dtype, gs, layout, shape)
             for fmt in ("nvfp4", "mxfp4")
             for dtype in (torch.bfloat16, torch.float16, torch.float32)
             for gs in ((None, "auto", 0.37) if fmt == "nvfp4" else (None, 0.37))
             for layout, shape in FUZZ_SHAPES]
    for i, (fmt, dtype, gs, layout, shape) in enumerate(cases):
        check(fuzz_input(fmt, dtype, shape, seed=100 + i), fmt, layout, gs,
              f"fuzz {fmt} {DTYPE_NAMES[dtype]} {gs} {layout}")
    print(f"fuzz: {len(cases)} cases, GPU == CPU bit for bit (quantize bytes, dequantize to fp32/fp16/bf16)")
    if quick:
        return {}
    w = (torch.randn(BIG, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    seconds = {}
    for fmt, gs in (("nvfp4", "auto"), ("mxfp4", None)):
        label = f"{BIG[0]} x {BIG[1]} bf16 {fmt}"
        seconds[fmt] = check(w, fmt, "swizzled", gs, label, dequant_dtypes=(torch.bfloat16,))
        print(f"{label}: GPU == CPU bit for bit (CPU reference quantize {seconds[fmt]:.1f} s)")
    return seconds


def copy_us(nbytes, count):
    """A torch copy moving ``nbytes`` (half read, half written), over ``count`` distinct sources."""
    half = nbytes // 2 // 16 * 16
    srcs = [torch.empty(half, dtype=torch.uint8, device=DEVICE).random_(0, 255) for _ in range(count)]
    dst = torch.empty(half, dtype=torch.uint8, device=DEVICE)
    return statistics.median(bench.device_time_us(lambda s: dst.copy_(s), srcs))


def _count(nbytes):
    return max(3, -(-DISTINCT_BYTES // nbytes))


def _randn(shape, seed, dtype):
    return (torch.randn(shape, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(seed))
            * 0.02).to(dtype)


def time_quantize(dtype, fmt, layout, gs, config):
    """(us, bytes read + written, inputs); ``gs="tensor"``: a precomputed global scale tensor."""
    count = _count(2 * torch.Size(BIG).numel())
    inputs = [_randn(BIG, seed, dtype) for seed in range(count)]
    global_scale = nvfp4_global_scale(inputs[0]) if gs == "tensor" else gs
    out = quantize(inputs[0], fmt, layout, global_scale, check_values=False, config=config)
    nbytes = inputs[0].numel() * inputs[0].element_size() + out.data.numel() + out.scales.numel()
    us = statistics.median(bench.device_time_us(
        lambda x: quantize(x, fmt, layout, global_scale, check_values=False, config=config), inputs))
    return us, nbytes, count


def time_dequantize(fmt, layout, with_global, out_dtype, config):
    out_bytes = torch.Size(BIG).numel() * torch.empty((), dtype=out_dtype).element_size()
    count = _count(out_bytes)
    tensors = [quantize(_randn(BIG, 1000 + seed, torch.bfloat16), fmt, layout, "auto" if with_global else None,
                        check_values=False) for seed in range(count)]
    nbytes = tensors[0].data.numel() + tensors[0].scales.numel() + out_bytes
    us = statistics.median(bench.device_time_us(lambda t: dequantize(t, out_dtype, config=config), tensors))
    return us, nbytes, count


def sweep_configs(block_size, quick, divisions=False):
    """The default tile first, then others of 16 to 64 elements per thread (``divisions``: and the default
    tile dividing by ``tl.div_rn`` instead of the float64 reciprocal)."""
    default = quantize_config(block_size)
    if quick:
        return [default]
    configs = {QuantizeConfig(rows, k_elems // block_size, warps)
               for rows in (4, 8, 16, 32) for k_elems in (256, 512, 1024) for warps in (4, 8)
               if 16 <= rows * k_elems // (32 * warps) <= 64}
    if divisions:
        configs.add(default._replace(float64_reciprocal=False))
    return [default] + sorted(configs - {default})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the fuzz check only, and the default tiles only")
    args = parser.parse_args(argv)
    if DEVICE == "cuda":
        assert torch.cuda.is_available(), "needs a CUDA GPU"
        device_name = torch.cuda.get_device_name()
    else:
        device_name = DEVICE
    print(device_name, "torch", torch.__version__)
    results = {"device": device_name, "checks": {}, "quantize": [], "dequantize": []}
    results["checks"]["cpu_reference_seconds"] = run_checks(args.quick)
    copies = {}

    def report(kind, label, timed, config, default):
        us, nbytes, count = timed
        if nbytes not in copies:
            copies[nbytes] = copy_us(nbytes, count)
        gbps, copy_gbps = nbytes / us / 1e3, nbytes / copies[nbytes] / 1e3
        row = dict(case=label, config=list(config), default=default, us=us, bytes=nbytes, gbps=gbps,
                   copy_us=copies[nbytes], copy_gbps=copy_gbps, fraction_of_copy=copies[nbytes] / us)
        results[kind].append(row)
        print(f"{'*' if default else ' '} {kind:10s} {label:48s} {str(tuple(config)):26s} {us:9.1f} us "
              f"{gbps:6.0f} GB/s (copy {copy_gbps:5.0f} GB/s) {row['fraction_of_copy']:6.1%}")

    shape = f"{BIG[0]}x{BIG[1]}"
    print("\nop, case, tile (rows, blocks, warps, float64 reciprocal): device time, GB/s of the bytes read + "
          "written, fraction of a copy moving as many bytes (* the default tile)")
    for fmt, dtype, gs, layout in (("nvfp4", torch.bfloat16, "tensor", "swizzled"),
                                   ("nvfp4", torch.bfloat16, "tensor", "linear"),
                                   ("nvfp4", torch.bfloat16, None, "swizzled"),
                                   ("nvfp4", torch.float16, "tensor", "swizzled"),
                                   ("nvfp4", torch.float32, "tensor", "swizzled"),
                                   ("mxfp4", torch.bfloat16, None, "swizzled")):
        block_size = 16 if fmt == "nvfp4" else 32
        default = quantize_config(block_size)
        sweep = (dtype, layout) == (torch.bfloat16, "swizzled")
        for config in sweep_configs(block_size, args.quick, divisions=fmt == "nvfp4") if sweep else [default]:
            report("quantize", f"{fmt} {DTYPE_NAMES[dtype]} {shape} {layout} global={gs}",
                   time_quantize(dtype, fmt, layout, gs, config), config, config == default)
    report("quantize", f"nvfp4 bf16 {shape} swizzled global='auto' (+ amax)",
           time_quantize(torch.bfloat16, "nvfp4", "swizzled", "auto", None), quantize_config(16), True)
    for fmt, with_global, out_dtype in (("nvfp4", True, torch.bfloat16), ("nvfp4", True, torch.float16),
                                        ("nvfp4", True, torch.float32), ("nvfp4", False, torch.bfloat16),
                                        ("mxfp4", False, torch.bfloat16)):
        block_size = 16 if fmt == "nvfp4" else 32
        default = quantize_config(block_size)
        sweep = out_dtype == torch.bfloat16 and with_global
        for config in sweep_configs(block_size, args.quick) if sweep else [default]:
            report("dequantize", f"{fmt} {shape} -> {DTYPE_NAMES[out_dtype]} global={with_global}",
                   time_dequantize(fmt, "swizzled", with_global, out_dtype, config), config, config == default)

    act = _randn((16, 4096), 7, torch.bfloat16)
    g = nvfp4_global_scale(act)
    host = bench.host_time_us(lambda: quantize(act, "nvfp4", "swizzled", g, check_values=False))
    host_checked = bench.host_time_us(lambda: quantize(act, "nvfp4", "swizzled", "auto"))
    results["host_us"] = {"16x4096 tensor global, unchecked": host, "16x4096 auto, checked": host_checked}
    print(f"\nhost time per eager call, 16 x 4096 bf16: {host:.1f} us (tensor global scale, unchecked), "
          f"{host_checked:.1f} us ('auto', checked: an amax pass and one synchronisation)")
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "quantize_speed.json").write_text(json.dumps(results, indent=1))
    print("wrote", out_dir / "quantize_speed.json")
    return results


if __name__ == "__main__":
    main()
