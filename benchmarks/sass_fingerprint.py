"""Offline (no GPU): what each case launches on sm_90 through the public op, compiled as the JIT would, and a
hash of its SASS, to show that a refactor left the shipped machine code unchanged.

    python benchmarks/sass_fingerprint.py OUT.json [CASES.json]     (TRITON_INTERPRET unset)

CASES.json: a list of [label, M, K, L, format, activation ("task", "fp4", "fp16", "bf16", "fp32"), N,
scale layout, global scale?]; the default is docs/sass-cases.json.  Compare two outputs with ``diff``.
"""

import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from aot import Sm90Launch, sass_instructions  # noqa: E402

from fp4gemv import FP4Tensor, ops  # noqa: E402
from fp4gemv.bench import random_task_input  # noqa: E402


def _fp4(batch, rows, k, fmt, layout, global_scale=None):
    bs = 16 if fmt == "nvfp4" else 32
    data = torch.zeros((*batch, rows, k // 2), dtype=torch.uint8)
    scales = torch.full((*batch, rows, k // bs), 0x38, dtype=torch.uint8)
    return FP4Tensor(data, scales, fmt, "linear", global_scale).with_scale_layout(layout)


def launch_of(label, m, k, L, fmt, act, n, layout, gs):
    batch = (L,) if L > 1 else ()
    if act == "task":
        a, b, _, _, sfa_p, sfb_p, c = random_task_input(m, k, L, seed=0, device="cpu")
        return Sm90Launch(FP4Tensor.from_task(a, sfa_p), FP4Tensor.from_task(b, sfb_p).first_rows(1),
                          c.permute(2, 0, 1))
    a = _fp4(batch, m, k, fmt, layout, 0.5 if gs else None)
    if act == "fp4":
        b = _fp4(batch, n, k, fmt, "linear")
    else:
        b = torch.zeros((*batch, n, k), dtype=dict(fp16=torch.float16, bf16=torch.bfloat16, fp32=torch.float32)[act])
    out = torch.empty(ops.result_shape(a, b), dtype=torch.bfloat16 if act == "bf16" else torch.float16)
    return Sm90Launch(a, b, out)


def main(out_path, cases_path=os.path.join(os.path.dirname(__file__), "..", "docs", "sass-cases.json")):
    result = {}
    for case in json.load(open(cases_path)):
        try:
            launch = launch_of(*case)
        except TypeError as e:  # a kernel with its own launch (two kernels): nothing single to hash
            result[case[0]] = dict(kernel=str(e).split("'")[1], sass=None)
            print(case[0], result[case[0]], flush=True)
            continue
        instructions = sass_instructions(launch.compile())
        result[case[0]] = dict(kernel=launch.spec.name, config=list(launch.config), grid=list(launch.grid),
                               options=launch.options, instructions=len(instructions),
                               sass=hashlib.sha1("\n".join(instructions).encode()).hexdigest()[:12])
        print(case[0], result[case[0]], flush=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
