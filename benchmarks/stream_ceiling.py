"""Device script: every read (the Triton reads of ``fp4gemv.bench.stream`` and the CUDA C++ reads of
``cuda_reads.py``) on the GEMV cases' byte counts, timed exactly as ``fp4gemv bench`` times the kernels
(CUDA-graph replay, one launch per distinct input, L2 flushed per replay).

    PYTHONPATH=src python benchmarks/stream_ceiling.py [task|decode|model|all|every]   -> stream_ceiling.json in $OUT

Why: no GEMV can beat a kernel that only reads the same bytes; ``fp4gemv bench`` reports each kernel against
the faster Triton read, which this table shows to be within a few percent of the fastest read of all.
"""

import json
import os
import sys

import torch
from cuda_reads import CUDA_READS

from fp4gemv.bench import SHAPE_SETS, case_bytes
from fp4gemv.bench.stream import TRITON_READS, read_times_us


def main(shape_set: str = "all"):
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    results = []
    for s in SHAPE_SETS[shape_set]:
        nbytes = case_bytes(s)
        times = read_times_us(nbytes, {**TRITON_READS, **CUDA_READS})
        best = min(times, key=times.get)
        results.append({"shape": s.label(), "bytes": nbytes, "us": times, "best": best})
        print(f"{s.label()} {nbytes / 1e6:.1f} MB: " + " | ".join(f"{k} {v:.2f}" for k, v in times.items())
              + f" || best {best} {times[best]:.2f}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "stream_ceiling.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
