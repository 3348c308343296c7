"""Device script: check the W4A4 kernel on full-range data, then sweep launch configurations.

Run on the GPU machine from the repo root:  PYTHONPATH=src python benchmarks/sweep_w4a4.py [--quick]
Phases: (1) correctness: task test shapes on full-range data for both decodes and several configurations,
PTX vs pure-Triton bit for bit; (2) calibration: stream read of each shape's bytes with and without
programmatic dependent launch (PDL); (3) sweep of (rows, blocks, warps, unroll) without PDL; (4) the best
configurations per shape again with PDL and L2 prefetch.  Writes sweep_w4a4.json to $OUT (or .) and prints
the best configuration per shape last.
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
CHECK_CONFIGS = [None, GemvConfig(16, 16, 4, ksplit=4, unroll=2), GemvConfig(32, 16, 8, ksplit=8, pdl=True, prefetch=64),
                 GemvConfig(8, 32, 4, ksplit=8, unroll=2, pdl=True, prefetch=16), GemvConfig(8, 128, 4)]


def check():
    bad = 0
    for (m, k, l) in list(task.TEST_SHAPES) + [(128, 192, 3), (384, 64, 2), (7168, 2048, 4)]:
        data = task.generate_full_range_input(m, k, l, seed=m + k + l, device="cuda")
        for cfg in CHECK_CONFIGS:
            outs = {}
            for be in ("triton-ptx", "triton"):
                c = data[6]
                c.fill_(float("nan"))
                ops.task_gemv(data[0], data[1], data[4], data[5], c, backend=be, config=cfg)
                ok, msg = task.check_implementation(data, c)
                outs[be] = c.clone()
                if not ok:
                    bad += 1
                    print(f"FAIL {be} {(m, k, l)} {cfg}: {msg}")
            same = torch.equal(outs["triton-ptx"].view(torch.int16), outs["triton"].view(torch.int16))
            bad += not same
            if not same:
                print(f"FAIL bitwise {(m, k, l)} {cfg}")
    print(f"check: {bad} failures over {len(task.TEST_SHAPES) + 3} shapes x {len(CHECK_CONFIGS)} configs", flush=True)
    return bad


def make_inputs(m, k, l):
    return [bench.random_task_operands(m, k, l, seed=i) for i in range(bench.input_count(bench.task_bytes(m, k, l)))]


def measure(m, k, l, cfg, inputs, backend="triton-ptx"):
    launch = lambda x: ops.task_gemv(*x, backend=backend, config=cfg)
    return bench.summarize(bench.device_time_us(launch, inputs))["median_us"]


def candidates(m, k, l, quick):
    """Tiles [lane_rows, ksplit, rows_per_thread, blocks] (kernels/w4a4.py): lanes along K and rows, warps along K."""
    for blocks, rpt, nw, kmul, un in itertools.product([16, 32], [1, 2, 4, 8], [4, 8], [1, 2], [1, 2]):
        lane_rows = 64 // blocks
        ksplit = nw * kmul
        if blocks * ksplit > k // 16 or (quick and (nw, un, kmul) != (4, 1, 1)):
            continue
        yield GemvConfig(lane_rows * rpt, blocks, nw, ksplit=ksplit, unroll=un)
    for rows in (8, 16):  # the v1 shape: one row across a warp's lanes
        yield GemvConfig(rows, 128, 4)


def _short(c):
    return f"(r{c.rows} b{c.blocks} w{c.num_warps} ks{c.ksplit} u{c.unroll}{' pdl' + str(c.prefetch) if c.pdl else ''})"


def main():
    quick = "--quick" in sys.argv
    out_dir = os.environ.get("OUT", ".")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    t0 = time.time()
    bad = check()
    results = {"check_failures": bad, "stream": {}, "stream_pdl": {}, "sweep": []}
    for (m, k, l) in SHAPES:
        nbytes = bench.task_bytes(m, k, l)
        t = bench.summarize(bench.stream_read_time_us(nbytes))["median_us"]
        tp = bench.summarize(bench.stream_read_time_us(nbytes, pdl=True))["median_us"]
        results["stream"][str((m, k, l))] = t
        results["stream_pdl"][str((m, k, l))] = tp
        print(f"stream {(m, k, l)}: {t:.2f} us, with PDL {tp:.2f} us (floor {bench.floor_us(nbytes):.2f})", flush=True)
    print(f"[{time.time() - t0:.0f}s]", flush=True)
    for (m, k, l) in SHAPES:
        inputs = make_inputs(m, k, l)
        rows = []
        for cfg in list(candidates(m, k, l, quick)) + [w4a4_config(m, k, l)]:
            try:
                us = measure(m, k, l, cfg, inputs)
            except Exception as e:  # a config that does not compile is a result too
                print(f"{(m, k, l)} {tuple(cfg)}: ERROR {type(e).__name__}: {str(e)[:200]}")
                continue
            rows.append((us, cfg))
            results["sweep"].append({"shape": (m, k, l), "cfg": cfg._asdict(), "us": us})
        rows.sort(key=lambda r: r[0])
        print(f"{(m, k, l)} top5: " + "  ".join(f"{us:.2f}{_short(c)}" for us, c in rows[:5]), flush=True)
        for us, cfg in rows[:3]:
            for pf in (0, 32, 128):
                pcfg = cfg._replace(pdl=True, prefetch=pf)
                us2 = measure(m, k, l, pcfg, inputs)
                results["sweep"].append({"shape": (m, k, l), "cfg": pcfg._asdict(), "us": us2})
                print(f"   {_short(pcfg)}: {us2:.2f} us", flush=True)
        del inputs
        print(f"[{time.time() - t0:.0f}s]", flush=True)
    with open(os.path.join(out_dir, "sweep_w4a4.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\nbest per shape (floor at 4.53 TB/s):")
    for (m, k, l) in SHAPES:
        floor = bench.floor_us(bench.task_bytes(m, k, l))
        rs = [r for r in results["sweep"] if tuple(r["shape"]) == (m, k, l)]
        for pdl in (False, True):
            sel = [r for r in rs if r["cfg"]["pdl"] == pdl]
            if sel:
                best = min(sel, key=lambda r: r["us"])
                c = best["cfg"]
                print(f"{(m, k, l)} pdl={pdl:d}: {best['us']:.2f} us ({floor / best['us'] * 100:.0f}% of {floor:.2f}) "
                      f"cfg {_short(GemvConfig(**c))}  "
                      f"stream {results['stream' if not pdl else 'stream_pdl'][str((m, k, l))]:.2f}")
    print("check failures:", bad)


if __name__ == "__main__":
    main()
