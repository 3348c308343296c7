"""Device script, one GPU call (about 3-5 minutes on the H200): issue 12's variants of the task kernel, checked and
timed next to a read of the same bytes.

    PYTHONPATH=src python benchmarks/sweep_task_kernel.py [--fmt nvfp4,mxfp4] [--shapes 0,1,...] [--variants a,b]
                                                          [--no-check] [--replays 15] [--cuda-read]

Variants and shapes: ``benchmarks/task_kernel_variants.py`` (7 shapes; NVFP4: 6 or 7 variants, MXFP4: 3).
For each shape and format, in this order:

1. Correctness of every variant on the GPU: NVFP4 on ``task.generate_full_range_input`` (all 16 codes, scales over
   e4m3's whole range) through ``ops.task_gemv`` into a NaN-poisoned ``c``, compared with the exact reference as
   ``task.check_implementation`` does (rtol = atol = 1e-3); MXFP4 through ``fp4gemv.gemv`` on ``FP4Tensor``s (all
   codes, e8m0 scales 2^-9 .. 2^2, swizzled), fp32 output poisoned, within the fp32-accumulation bound of the exact
   float64 result.  A variant that fails is reported and not timed.
2. Device time (``bench.device_time_us``: CUDA-graph replay over >= 20 distinct inputs and >= 300 MB, L2 flushed
   before each replay) of each variant, and of ``bench.stream_read_time_us`` on the same number of bytes, without
   and with PDL, in the same run (``--cuda-read``: also the two best CUDA C++ reads of ``stream_ceiling.py``).
   Registers, spills and shared memory of each compiled variant are recorded.

Prints one line per measurement as it goes, a table at the end, and writes ``sweep_task_kernel.json`` to ``$OUT``
(rewritten after every shape, so a run cut short keeps what it measured).  Each distinct variant x shape is one
Triton compile (~1-3 s); the checks run on the timed shapes, so they compile nothing extra.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from fp4gemv import FP4Tensor, bench, gemv, ops, task
from fp4gemv.bench import Shape, case_bytes, device_time_us, floor_us, input_count, summarize
from fp4gemv.kernels import w4a4, w4a4_async
from fp4gemv.reference import quantized_gemv_reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from task_kernel_variants import SHAPES, variants  # noqa: E402


def compiled_kernel(launch):
    """The CompiledKernel a launch ran (registers, spills, shared memory)."""
    seen = []
    kernels = (w4a4.w4a4_gemv_kernel, w4a4_async.w4a4_async_kernel)
    saved = [k.run for k in kernels]
    for k, run in zip(kernels, saved):
        k.run = lambda *a, _run=run, **kw: seen.append(_run(*a, **kw)) or seen[-1]
    try:
        launch()
    finally:
        for k, run in zip(kernels, saved):
            k.run = run
    compiled = seen[-1]
    compiled._init_handles()
    return {"regs": compiled.n_regs, "spills": compiled.n_spills, "smem": compiled.metadata.shared}


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def check_nvfp4(shape, named, seed=1, device="cuda", backend="auto"):
    """{variant: (ok, message)} on full-range task inputs against the exact reference."""
    data = task.generate_full_range_input(*shape, seed=seed, device=device)
    expected = task.reference_output(data)
    c = data[6]
    out = {}
    for name, cfg in named:
        c.fill_(float("nan"))
        try:
            ops.task_gemv(data[0], data[1], data[4], data[5], c, config=cfg, backend=backend)
            _sync(device)
            comparison = task.compare_to_reference(c, expected)
            out[name] = (comparison.ok, comparison.message)
        except Exception as e:  # a variant that does not compile or launch is a result too
            out[name] = (False, f"{type(e).__name__}: {str(e)[:300]}")
    return out


def mxfp4_operands(shape, seed, device="cuda"):
    """MXFP4 weights [L, M, K] and activation [L, 1, K]: uniform bytes (all codes), e8m0 2^-9 .. 2^2, swizzled."""
    m, k, l = shape
    g = torch.Generator(device=device).manual_seed(seed)

    def fp4(rows):
        data = torch.randint(0, 256, (l, rows, k // 2), dtype=torch.uint8, device=device, generator=g)
        scales = torch.randint(127 - 9, 127 + 3, (l, rows, k // 32), dtype=torch.uint8, device=device, generator=g)
        return FP4Tensor(data, scales, "mxfp4", "linear").with_scale_layout("swizzled")

    return fp4(m), fp4(1)


def check_mxfp4(shape, named, seed=1, device="cuda", backend="auto"):
    """{variant: (ok, message)}: fp32 outputs within the bound of fp32 accumulation of exact block sums
    (tests/test_kernels_gemv.py's error_bound: (K/16 + 22) units of 2^-24 of sum |a b|, plus the oracle's and
    half an ulp of the result)."""
    a, b = mxfp4_operands(shape, seed, device)
    exact = quantized_gemv_reference(a, b, torch.float64)
    magnitude = torch.matmul(a.dequantize(torch.float64).abs(), b.dequantize(torch.float64).abs().transpose(-1, -2))
    k = shape[1]
    bound = 1.01 * (k // 16 + 22) * 2.0**-24 * magnitude + (k + 3) * 2.0**-53 * magnitude + 2.0**-140
    del magnitude
    out = {}
    for name, cfg in named:
        got = torch.full(exact.shape, float("nan"), dtype=torch.float32, device=device)
        try:
            gemv(a, b, out=got, out_dtype=torch.float32, config=cfg, backend=backend)
            _sync(device)
            # plus half an fp32 ulp of the result, as the tests' bound has
            error = (got.double() - exact).abs() - got.double().abs() * 2.0**-24
            bad = ~(torch.isfinite(got) & (error <= bound))
            count = int(bad.sum())
            out[name] = (count == 0, f"all {got.numel()} within the bound" if count == 0 else
                         f"{count} of {got.numel()} outside the bound (max error {error.max().item():.3g})")
        except Exception as e:
            out[name] = (False, f"{type(e).__name__}: {str(e)[:300]}")
    return out


def time_variants(shape, fmt, named, replays):
    """{variant: {"us": median, "min_us", "max_us", regs, spills, smem}} over distinct inputs, L2 flushed."""
    m, k, l = shape
    nbytes = case_bytes(Shape(m, k, l), fmt)
    if fmt == "nvfp4":
        inputs = [bench.random_task_operands(m, k, l, seed=i) for i in range(input_count(nbytes))]
        make = lambda cfg: (lambda x: ops.task_gemv(*x, config=cfg))  # noqa: E731
    else:
        inputs = [bench.random_gemv_operands(Shape(m, k, l), "mxfp4", "fp4", seed=i)
                  for i in range(input_count(nbytes))]
        make = lambda cfg: (lambda x: gemv(x[0], x[1], out=x[2], config=cfg))  # noqa: E731
    out = {}
    for name, cfg in named:
        launch = make(cfg)
        try:
            times = summarize(device_time_us(launch, inputs, replays=replays))
            out[name] = {"us": times["median_us"], "min_us": times["min_us"], "max_us": times["max_us"],
                         **compiled_kernel(lambda: launch(inputs[0]))}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        torch.cuda.synchronize()
    inputs.clear()
    torch.cuda.empty_cache()
    return out


def cuda_reads(ext, nbytes, replays):
    """Device times of the two CUDA C++ reads of ``benchmarks/stream_ceiling.py`` that were best on these shapes
    (32 KB chunks and a persistent grid, both with PDL), on ``input_count`` distinct buffers of ``nbytes``."""
    bufs = [torch.empty(nbytes // 16 * 16, dtype=torch.uint8, device="cuda").random_(0, 255)
            for _ in range(input_count(nbytes))]
    out = torch.zeros(1 << 20, dtype=torch.int64, device="cuda")
    n16, sms = nbytes // 16, torch.cuda.get_device_properties(0).multi_processor_count
    launches = {"cuda chunk32K pdl": lambda x: ext.stream_read_cuda(x, out, -(-n16 // 2048), 256, 2048, 8, False, True),
                "cuda persist pdl": lambda x: ext.stream_read_cuda(x, out, sms * 4, 512, 0, 4, False, True)}
    times = {name: summarize(device_time_us(launch, bufs, replays=replays))["median_us"]
             for name, launch in launches.items()}
    del bufs
    torch.cuda.empty_cache()
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fmt", default="nvfp4,mxfp4")
    parser.add_argument("--shapes", default=None, help="indices into the shape list (default: all 7)")
    parser.add_argument("--variants", default=None, help="variant names (default: all)")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness phase")
    parser.add_argument("--replays", type=int, default=15)
    parser.add_argument("--cuda-read", action="store_true",
                        help="also time the best CUDA C++ reads of stream_ceiling.py (an nvcc build, ~1 minute)")
    opts = parser.parse_args()
    ext = None
    if opts.cuda_read:
        from stream_ceiling import CUDA, DECLARATION
        from torch.utils.cpp_extension import load_inline

        ext = load_inline("fp4gemv_stream_ceiling", cpp_sources=DECLARATION, cuda_sources=CUDA,
                          functions=["stream_read_cuda"],
                          extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"], verbose=False)
    out_dir = os.environ.get("OUT", ".")
    shapes = SHAPES if opts.shapes is None else [SHAPES[int(i)] for i in opts.shapes.split(",")]
    wanted = None if opts.variants is None else set(opts.variants.split(","))
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    t0 = time.time()
    results = []
    for fmt in opts.fmt.split(","):
        for shape in shapes:
            named = [(n, c) for n, c in variants(*shape, fmt=fmt) if wanted is None or n in wanted or n == "shipped"]
            label = f"{fmt} {'x'.join(map(str, shape))}"
            checks = {}
            if not opts.no_check:
                checks = (check_nvfp4 if fmt == "nvfp4" else check_mxfp4)(shape, named)
                for name, (ok, message) in checks.items():
                    print(f"[{time.time() - t0:4.0f}s] check {label} {name}: {'ok' if ok else 'FAIL'} {message}",
                          flush=True)
                torch.cuda.empty_cache()
            timed = time_variants(shape, fmt, [(n, c) for n, c in named if checks.get(n, (True,))[0]],
                                  opts.replays)
            nbytes = case_bytes(Shape(*shape), fmt)
            read = summarize(bench.stream_read_time_us(nbytes))["median_us"]
            read_pdl = summarize(bench.stream_read_time_us(nbytes, pdl=True))["median_us"]
            torch.cuda.empty_cache()
            row = {"fmt": fmt, "shape": shape, "bytes": nbytes, "floor_us": floor_us(nbytes), "read_us": read,
                   "read_pdl_us": read_pdl, "variants": {}}
            if ext is not None:
                row["cuda_read_us"] = cuda_reads(ext, nbytes, opts.replays)
            for name, cfg in named:
                entry = {"config": cfg._asdict(), "check": checks.get(name), **timed.get(name, {})}
                row["variants"][name] = entry
            results.append(row)
            best_read = min(read, read_pdl, *row.get("cuda_read_us", {}).values())
            line = " | ".join(
                f"{n} {v['us']:.2f} ({best_read / v['us']:.2f}x) r{v['regs']}" if "us" in v else f"{n} -"
                for n, v in row["variants"].items())
            cuda = "".join(f" / {n} {t:.2f}" for n, t in row.get("cuda_read_us", {}).items())
            print(f"[{time.time() - t0:4.0f}s] {label}: read {read:.2f} / pdl {read_pdl:.2f}{cuda} || {line}",
                  flush=True)
            with open(os.path.join(out_dir, "sweep_task_kernel.json"), "w") as f:
                json.dump(results, f, indent=1)
    print_table(results)


def print_table(results):
    """Kernel / best read of the same bytes measured in this run (Triton, and CUDA C++ with ``--cuda-read``), per
    variant and shape: higher is better; the bar is 0.95 for NVFP4 and 0.90 for MXFP4 against the best read of
    any kind (docs/performance.md)."""
    names = []
    for row in results:
        names += [n for n in row["variants"] if n not in names]
    print("\n| fmt | M x K x L | read us | read PDL us | best read us | " + " | ".join(names) + " |")
    print("|---|---|---|---|---|" + "---|" * len(names))
    for row in results:
        best_read = min(row["read_us"], row["read_pdl_us"], *row.get("cuda_read_us", {}).values())
        cells = []
        for n in names:
            v = row["variants"].get(n, {})
            if "us" in v:
                cells.append(f"{v['us']:.2f} ({best_read / v['us']:.2f})")
            elif v.get("check") and not v["check"][0]:
                cells.append("FAIL")
            else:
                cells.append("-" if not v else "error")
        print(f"| {row['fmt']} | {'x'.join(map(str, row['shape']))} | {row['read_us']:.2f} | "
              f"{row['read_pdl_us']:.2f} | {best_read:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
