"""Device script: the shipped W4A4 configuration per shape against a few variants of it (sweep 8).

PYTHONPATH=src python benchmarks/sweep_w4a4_variants.py   -> prints one line per shape; sweep_variants.json in $OUT.
Variants: 16 warps along K, 8 rows per thread, 8 warps.  (Sweep 8 also timed the weight loads with the ".cg"
cache operator, L2 only: within 0.3% of the default on every shape, so the option was removed again.)
"""

import json
import os

import torch

from fp4gemv import ops, task
from fp4gemv.kernels.configs import w4a4_config

from sweep_w4a4 import SHAPES, make_inputs, measure  # noqa: E402  (benchmarks/ is on sys.path when run)


def variants(m, k, l):
    base = w4a4_config(m, k, l)
    yield "shipped", base
    if base.blocks == 16:
        yield "w16 ks16", base._replace(num_warps=16, ksplit=16)
        yield "rows 32", base._replace(rows=32)
    else:
        yield "w8", base._replace(num_warps=8)


def main():
    data = task.generate_full_range_input(7168, 2048, 4, seed=3, device="cuda")
    for name, cfg in variants(7168, 2048, 4):
        c = data[6].fill_(float("nan"))
        ops.task_gemv(data[0], data[1], data[4], data[5], c, config=cfg)
        ok, msg = task.check_implementation(data, c)
        print(f"check {name}: {ok} {msg}", flush=True)
    results = []
    for (m, k, l) in SHAPES:
        inputs = make_inputs(m, k, l)
        line = []
        for name, cfg in variants(m, k, l):
            us = measure(m, k, l, cfg, inputs)
            results.append({"shape": (m, k, l), "variant": name, "cfg": cfg._asdict(), "us": us})
            line.append(f"{name} {us:.2f}")
        print(f"{(m, k, l)}: " + " | ".join(line), flush=True)
        inputs.clear()
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "sweep_variants.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
