"""Device script: check the W4A4 kernel on full-range data, then sweep launch configurations.

Run on the GPU machine from the repo root:  PYTHONPATH=src python benchmarks/sweep_w4a4.py [--quick]
Writes sweep_w4a4.json to $OUT (or the current directory) and prints the best configuration per shape last.
"""

import itertools
import json
import os
import sys
import time

import torch

from fp4gemv import bench, ops, task
from fp4gemv.kernels.configs import GemvConfig, w4a4_config

SHAPES = [(7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4),
          (4096, 4096, 1), (14336, 4096, 1), (4096, 14336, 1), (28672, 8192, 1)]


def check(backends=("triton-ptx", "triton")):
    bad = 0
    for (m, k, l) in list(task.TEST_SHAPES) + [(128, 192, 3), (384, 64, 2), (7168, 2048, 4)]:
        data = task.generate_full_range_input(m, k, l, seed=m + k + l, device="cuda")
        outs = {}
        for be in backends:
            c = data[6]
            c.fill_(float("nan"))
            ops.task_gemv(data[0], data[1], data[4], data[5], c, backend=be)
            ok, msg = task.check_implementation(data, c)
            outs[be] = c.clone()
            if not ok:
                bad += 1
                print(f"FAIL {be} {(m, k, l)}: {msg}")
        same = torch.equal(outs[backends[0]].view(torch.int16), outs[backends[1]].view(torch.int16))
        print(f"check {(m, k, l)}: ptx==triton bitwise {same}")
        bad += not same
    return bad


def make_inputs(m, k, l):
    return [bench.random_task_operands(m, k, l, seed=i) for i in range(bench.input_count(bench.task_bytes(m, k, l)))]


def measure(m, k, l, cfg, inputs, backend="triton-ptx"):
    launch = lambda x: ops.task_gemv(*x, backend=backend, config=cfg)
    med = bench.summarize(bench.device_time_us(launch, inputs))["median_us"]
    return med, bench.task_bytes(m, k, l) / med / 1e6


def main():
    quick = "--quick" in sys.argv
    out_dir = os.environ.get("OUT", ".")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    bad = check()
    results = {"check_failures": bad, "stream": {}, "sweep": []}
    # Streaming read of exactly the GEMV's bytes: the achievable ceiling.
    for (m, k, l) in SHAPES:
        nbytes = bench.task_bytes(m, k, l)
        t = bench.summarize(bench.stream_read_time_us(nbytes))["median_us"]
        results["stream"][str((m, k, l))] = t
        print(f"stream {(m, k, l)}: {t:.2f} us  {nbytes / t / 1e6:.2f} TB/s", flush=True)
    # Fixed cost of one launch inside a graph (a kernel that reads 64 KiB), and the asymptotic read rate.
    tiny = [torch.randint(0, 255, (1 << 16,), dtype=torch.uint8, device="cuda") for _ in range(20)]
    out = torch.empty(bench.stream_read_programs(1 << 16), dtype=torch.int64, device="cuda")
    results["launch_us"] = bench.summarize(bench.device_time_us(lambda x: bench.stream_read(x, out), tiny))["median_us"]
    big = [torch.randint(0, 255, (2 << 30,), dtype=torch.uint8, device="cuda") for _ in range(2)]
    out = torch.empty(bench.stream_read_programs(2 << 30), dtype=torch.int64, device="cuda")
    t = bench.summarize(bench.device_time_us(lambda x: bench.stream_read(x, out), big))["median_us"]
    results["stream_2GiB_tbps"] = (2 << 30) / t / 1e6
    print(f"launch in graph: {results['launch_us']:.2f} us; stream 2 GiB: {results['stream_2GiB_tbps']:.2f} TB/s", flush=True)
    del big
    rows_l = [8, 16] if not quick else [8]
    blocks_l = [64, 128]
    warps_l = [4]
    stages_l = [1]
    t0 = time.time()
    for (m, k, l) in SHAPES:
        inputs = make_inputs(m, k, l)
        for rows, blocks, nw, ns in itertools.product(rows_l, blocks_l, warps_l, stages_l):
            if blocks > k // 16 or not 2 <= rows * blocks // (32 * nw) <= 32:
                continue
            cfg = GemvConfig(rows, blocks, nw, ns)
            try:
                us, tbps = measure(m, k, l, cfg, inputs)
            except Exception as e:  # a config that does not compile is a result too
                print(f"{(m, k, l)} {cfg}: ERROR {type(e).__name__}: {str(e)[:200]}")
                continue
            results["sweep"].append({"shape": (m, k, l), "cfg": cfg._asdict(), "us": us, "tbps": tbps})
            print(f"{(m, k, l)} {tuple(cfg)}: {us:.2f} us {tbps:.2f} TB/s", flush=True)
        us, tbps = measure(m, k, l, w4a4_config(m, k, l), inputs, backend="triton")
        del inputs
        results["sweep"].append({"shape": (m, k, l), "cfg": "pure-triton default", "us": us, "tbps": tbps})
        print(f"{(m, k, l)} pure-triton default: {us:.2f} us {tbps:.2f} TB/s   [{time.time() - t0:.0f}s]", flush=True)
    with open(os.path.join(out_dir, "sweep_w4a4.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\nbest per shape (floor at 4.53 TB/s):")
    for (m, k, l) in SHAPES:
        rs = [r for r in results["sweep"] if tuple(r["shape"]) == (m, k, l) and isinstance(r["cfg"], dict)]
        if not rs:
            continue
        best = min(rs, key=lambda r: r["us"])
        floor = bench.floor_us(bench.task_bytes(m, k, l))
        print(f"{(m, k, l)}: {best['us']:.2f} us ({floor / best['us'] * 100:.0f}% of floor {floor:.2f}) cfg {best['cfg']} "
              f"stream {results['stream'][str((m, k, l))]:.2f} us")
    print("check failures:", bad)


if __name__ == "__main__":
    main()
