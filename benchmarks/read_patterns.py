"""Device script (round 20 of docs/performance.md): does the weight-only step's access pattern (a warp's step reads
16 rows x 64 bytes, rows 1440 bytes apart, and the next 64 bytes of each row one step later) read DRAM slower than
the same bytes in contiguous 1 KB pieces per warp-step, at gpt-oss gate_up's T = 1 grid (1440 programs of 2 warps,
one wave, 11 steps)?  Loads only (the words xor-ed), one step's loads at a time or all in flight, 8 copies in one
CUDA graph, L2 flushed (``bench.timing.device_time_us``), beside the best read of the same bytes.

    PYTHONPATH=src python benchmarks/read_patterns.py    -> locality.json in $OUT (or .)
"""
import json
import os
import statistics

import torch
import triton
import triton.language as tl
from fp4gemv.bench.timing import device_time_us
from fp4gemv.bench.stream import best_read

OUT = os.environ.get("OUT", ".")


@triton.jit
def reads(w_ptr, out_ptr, n_steps, ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, CONTIGUOUS: tl.constexpr,
          AHEAD: tl.constexpr):
    p = tl.program_id(0)
    r = tl.arange(0, 128)[:, None]
    e = r // 64
    t = r % 64
    q = tl.arange(0, 4)[None, :]
    w = t // 32
    lane = t % 32
    g = lane // 4
    c = lane % 4
    # word offsets (w_ptr: int32)
    if CONTIGUOUS:
        base = ((p * 2 + w) * STEPS) * 256 + e * 128 + lane * 4 + q
        stride = 256
    else:
        base = (16 * p + 8 * e + g) * (ROW_BYTES // 4) + w * 16 + 4 * c + q
        stride = 32
    base = tl.max_contiguous(tl.multiple_of(base, [1, 4]), [1, 4])
    acc = tl.zeros([128, 4], dtype=tl.int32)
    if AHEAD:  # every step's loads in flight at once (unrolled, no dependence)
        for s in tl.static_range(STEPS):
            acc = acc ^ tl.load(w_ptr + base + s * stride)
    else:  # one step's loads at a time (a runtime loop, each load's use before the next)
        for s in range(n_steps):
            acc = (acc ^ tl.load(w_ptr + base + s * stride)) * 3
    tl.store(out_ptr + p * 512 + r * 4 + q, acc)


def main():
    rows, k = 23040, 2880  # 4 experts x 5760 rows of gpt-oss gate_up, MXFP4 bytes per row 1440
    row_bytes = k // 2
    steps = 11
    copies = 8
    bufs = [torch.randint(0, 2**30, (rows * row_bytes // 4,), dtype=torch.int32, device="cuda") for _ in range(copies)]
    out = torch.empty(rows // 16 * 512, dtype=torch.int32, device="cuda")
    nbytes = rows // 16 * 2 * steps * 1024
    res = dict(device=torch.cuda.get_device_name(), mbytes=nbytes / 1e6, read=best_read(nbytes))
    for contiguous in (False, True):
        for ahead in (False, True):
            def fn(c):
                reads[(rows // 16,)](bufs[c], out, steps, row_bytes, steps, contiguous, ahead, num_warps=2,
                                     num_stages=1)
            us = statistics.median(device_time_us(fn, range(copies)))
            res[f"contiguous={contiguous} ahead={ahead}"] = us
            print(contiguous, ahead, us, flush=True)
    with open(os.path.join(OUT, "locality.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
