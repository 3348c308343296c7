"""Device script (sweep 11): L2 prefetch ahead of the loads, and a larger prefetch before the PDL wait.

PYTHONPATH=src python benchmarks/sweep_prefetch.py   -> check lines, one timing line per shape and kernel;
sweep_prefetch.json in $OUT.

Question: are the kernels short of bytes in flight (Little's law: ~34 KB per SM at 4.53 TB/s and ~1 us DRAM
latency), and does the stream read itself gain from prefetching its data while the previous launch drains?
Variants: ``ahead`` steps of weights kept prefetched into L2 (bulk prefetch, one per row and step) for the
w4a4 and tensor-core kernels; the w4a4 PDL prefetch before the wait widened to the whole row; the stream read
with PDL and its chunk prefetched before the wait.  A prefetch changes no arithmetic, so every variant's
output must equal the shipped configuration's bit for bit.
"""

import json
import os

import torch

from fp4gemv import bench, ops, task
from fp4gemv.bench import Shape, case_bytes, device_time_us, floor_us, input_count, random_gemv_operands, summarize
from fp4gemv.gemv import gemv
from fp4gemv.kernels.configs import HmmaConfig, hmma_config, w4a4_config
from fp4gemv.kernels.stream import stream_read_kernel
from fp4gemv.reference import quantized_gemv_reference

SHAPES = [Shape(7168, 16384, 1), Shape(4096, 7168, 8), Shape(7168, 2048, 4), Shape(4096, 4096, 1),
          Shape(14336, 4096, 1), Shape(4096, 14336, 1), Shape(28672, 8192, 1)]
RESULTS = []


def w4a4_variants(m, k, l):
    base = w4a4_config(m, k, l)
    yield "shipped", base
    for ahead in (1, 2, 4, 8):
        yield f"ahead{ahead}", base._replace(ahead=ahead)
    yield "pdl+row", base._replace(pdl=True, prefetch=k // 16)
    yield "pdl+ahead4", base._replace(pdl=True, ahead=4)


def hmma_variants(m, k, l):
    base = hmma_config(m, k, l)
    yield "shipped", base
    for warps in sorted({base.warps, 8}):
        for ahead in (2, 4, 8):
            yield f"w{warps} ahead{ahead}", HmmaConfig(warps, ahead)
        yield f"w{warps} ahead4 pdl", HmmaConfig(warps, 4, True)


def check():
    bad = 0
    for (m, k, l) in [(128, 256, 1), (2432, 4608, 2), (7168, 2048, 4), (256, 192, 3), (4096, 14336, 1)]:
        data = task.generate_full_range_input(m, k, l, seed=m + k, device="cuda")
        ref = {}  # backend -> the shipped configuration's output
        for name, cfg in w4a4_variants(m, k, l):
            for be in ("triton-ptx", "triton"):
                c = data[6].fill_(float("nan"))
                ops.task_gemv(data[0], data[1], data[4], data[5], c, backend=be, config=cfg)
                ok, msg = task.check_implementation(data, c)
                same = be not in ref or torch.equal(c.view(torch.int16), ref[be].view(torch.int16))
                ref.setdefault(be, c.clone())
                if not (ok and same):
                    bad += 1
                    print(f"FAIL w4a4 {(m, k, l)} {name} {be}: {msg} same={same}", flush=True)
    for act, n in (("fp16", 1), ("bf16", 3), ("fp4", 2), ("fp16", 16)):
        for s in (Shape(2432, 4608, 2, n), Shape(208, 320, 3, n), Shape(7168, 2048, 4, n)):
            a, b, _ = random_gemv_operands(s, "nvfp4", act, seed=5)
            exact = quantized_gemv_reference(a, b, torch.float64)
            bv = b.dequantize(torch.float64) if act == "fp4" else b.double()
            magnitude = a.dequantize(torch.float64).abs() @ bv.abs().transpose(-1, -2)
            ref = None
            for name, cfg in hmma_variants(s.m, s.k, s.l):
                c = torch.full((s.l, s.m, n), float("nan"), device="cuda")
                gemv(a, b, out=c, out_dtype=torch.float32, config=cfg)
                err = ((c.double() - exact).abs() / magnitude.clamp(min=1e-30)).max().item()
                same = ref is None or torch.equal(c, ref)
                ref = c if ref is None else ref
                if torch.isnan(c).any() or err > (s.k + 24) * 2.0**-23 or not same:
                    bad += 1
                    print(f"FAIL hmma {act} N={n} {s} {name}: err {err:.2e} same={same}", flush=True)
    print(f"check: {bad} failures", flush=True)
    return bad


def stream_variants():
    yield "plain", dict(STEPS=4, PDL=False, PREFETCH=False)
    yield "pdl", dict(STEPS=4, PDL=True, PREFETCH=False)
    yield "pdl+pf", dict(STEPS=4, PDL=True, PREFETCH=True)
    yield "pdl+pf s16", dict(STEPS=16, PDL=True, PREFETCH=True)
    yield "pdl s16", dict(STEPS=16, PDL=True, PREFETCH=False)


def time_stream(s):
    nbytes = bench.task_bytes(s.m, s.k, s.l)
    bufs = [torch.empty(nbytes // 8 * 8, dtype=torch.uint8, device="cuda").random_(0, 255)
            for _ in range(input_count(nbytes))]
    out = torch.empty(nbytes // 8 // 1024 + 1, dtype=torch.int64, device="cuda")
    line = []
    for name, kw in stream_variants():
        def launch(x, kw=kw):
            words = x.view(torch.int64)
            grid = (-(-words.numel() // (1024 * kw["STEPS"])),)
            stream_read_kernel[grid](words, out, words.numel(), WORDS=1024, num_warps=4, launch_pdl=kw["PDL"], **kw)
        us = summarize(device_time_us(launch, bufs))["median_us"]
        RESULTS.append(dict(kind="stream", shape=s.__dict__, variant=name, us=us, floor_us=floor_us(nbytes)))
        line.append(f"{name} {us:.2f}")
    print(f"stream {s.m}x{s.k}x{s.l} floor {floor_us(nbytes):.2f}: " + " | ".join(line), flush=True)


def time_w4a4(s):
    nbytes = bench.task_bytes(s.m, s.k, s.l)
    inputs = [bench.random_task_operands(s.m, s.k, s.l, seed=i) for i in range(input_count(nbytes))]
    line = []
    for name, cfg in w4a4_variants(s.m, s.k, s.l):
        us = summarize(device_time_us(lambda x, cfg=cfg: ops.task_gemv(*x, config=cfg), inputs))["median_us"]
        RESULTS.append(dict(kind="w4a4", shape=s.__dict__, variant=name, cfg=cfg._asdict(), us=us, floor_us=floor_us(nbytes)))
        line.append(f"{name} {us:.2f}")
    print(f"w4a4 {s.m}x{s.k}x{s.l} floor {floor_us(nbytes):.2f}: " + " | ".join(line), flush=True)


def time_hmma(s, act):
    nbytes = case_bytes(s, "nvfp4", act)
    inputs = [random_gemv_operands(s, "nvfp4", act, seed=i) for i in range(input_count(nbytes))]
    line = []
    for name, cfg in hmma_variants(s.m, s.k, s.l):
        us = summarize(device_time_us(lambda x, cfg=cfg: gemv(x[0], x[1], out=x[2], config=cfg), inputs))["median_us"]
        RESULTS.append(dict(kind="hmma", act=act, shape=s.__dict__, variant=name, cfg=cfg._asdict(), us=us,
                            floor_us=floor_us(nbytes)))
        line.append(f"{name} {us:.2f}")
    print(f"hmma {act} N={s.n} {s.m}x{s.k}x{s.l} floor {floor_us(nbytes):.2f}: " + " | ".join(line), flush=True)


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if check():
        print("check failed: timings follow anyway, but do not ship a failing variant", flush=True)
    for s in SHAPES:
        time_stream(s)
        time_w4a4(s)
        time_hmma(s, "fp16")
        torch.cuda.empty_cache()
    for s in SHAPES[:3]:
        time_hmma(Shape(s.m, s.k, s.l, 2), "fp4")
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "sweep_prefetch.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
