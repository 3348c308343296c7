"""Offline (no GPU): the sm_90 compile time of every gemv kernel variant the GPU tests launch, PTX and
pure-Triton twin, each in a fresh process with an empty Triton cache, to find variants that compile for minutes.

    PYTHONPATH=src python benchmarks/compile_times.py [--timeout S] [--only SUBSTRING] [--json OUT.json]

(TRITON_INTERPRET is removed for the child processes.)  A variant that runs past ``--timeout`` seconds is
reported as ``>S``.  Prints one line per variant as it finishes and a table sorted by time at the end.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from aot import Sm90Launch  # noqa: E402
from operands import build_case  # noqa: E402

from fp4gemv.kernels.hmma_gemv import HmmaConfig  # noqa: E402
from fp4gemv.kernels.weight_only import WeightOnlyConfig  # noqa: E402
from fp4gemv.target import SM90  # noqa: E402

FORMATS = ("nvfp4", "mxfp4")
ACTIVATIONS = (torch.float16, torch.bfloat16, "fp4")
# (n, WeightOnlyConfig fields or None) of tests/test_kernels_weight_only.py::test_weight_only_ptx_and_twin_within_bound
WEIGHT_ONLY_CONFIGS = (("n1", None), (4, (4, 4, 2, True)), (3, (1, 8, 1, False)), (16, (2, 4, 1, False)),
                       (9, (4, 2, 2, False)), (5, None))
WEIGHT_ONLY_SPLIT_N1 = (2, 4, 1, True)
HMMA_WARPS = (None, 1, 2, 4, 8)
HMMA_CASES = ((torch.float16, 16), (torch.float16, 1), (torch.bfloat16, 5), ("fp4", 3), ("fp4", 16))


def _act_name(act):
    return act if isinstance(act, str) else str(act).split(".")[-1]


def variants() -> list[str]:
    """Labels ``kernel/fmt/activation/n/config/mode``; ``variant_launch`` builds each."""
    out = []
    for mode in ("ptx", "triton"):
        for fmt in FORMATS:
            for act in ACTIVATIONS:
                for n, cfg in WEIGHT_ONLY_CONFIGS:
                    if n == "n1":
                        n, cfg = (2 if act == "fp4" else 1), WEIGHT_ONLY_SPLIT_N1
                    cfg_name = "default" if cfg is None else "-".join(str(int(v)) for v in cfg)
                    out.append(f"weight_only/{fmt}/{_act_name(act)}/{n}/{cfg_name}/{mode}")
        for act, n in HMMA_CASES:
            for warps in HMMA_WARPS:
                out.append(f"hmma/nvfp4/{_act_name(act)}/{n}/{'default' if warps is None else warps}/{mode}")
        for fmt in FORMATS:
            out.append(f"w4a4/{fmt}/fp4/1/default/{mode}")
            for n in (1, 3, 16):
                out.append(f"general/{fmt}/float32/{n}/default/{mode}")
    return out


def variant_launch(label: str):
    """The ``aot.Sm90Launch`` of a label from ``variants``."""
    kernel, fmt, act, n, cfg, mode = label.split("/")
    activation = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(act, act)
    target = replace(SM90, mode=mode)
    config = None
    if kernel == "weight_only" and cfg != "default":
        t, w, c, s = (int(v) for v in cfg.split("-"))
        config = WeightOnlyConfig(t, w, c, split=bool(s))
    elif kernel == "hmma" and cfg != "default":
        config = HmmaConfig(int(cfg))
    # The GPU tests' main shape: 16-byte aligned rows, K = 4608 with a partial last step for most configs.
    a, b = build_case(fmt, activation, int(n), "swizzled", (2432, 4608, 2), True, seed=1)
    return Sm90Launch(a, b, out_dtype=torch.float32, kernel=kernel, config=config, target=target)


def _child(label: str) -> None:
    launch = variant_launch(label)
    start = time.perf_counter()
    launch.compile()
    print(json.dumps(dict(seconds=time.perf_counter() - start, config=str(launch.config))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a variant's compile is stopped")
    parser.add_argument("--only", default="", help="compile only the variants whose label contains this")
    parser.add_argument("--json", default=None, help="also write {label: seconds or null} to this file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    rows = []
    for label in (v for v in variants() if args.only in v):
        with tempfile.TemporaryDirectory() as cache:
            env["TRITON_CACHE_DIR"] = cache
            try:
                done = subprocess.run([sys.executable, __file__, "--child", label], env=env, capture_output=True,
                                      text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                seconds, note = None, f">{args.timeout:.0f}"
            else:
                if done.returncode:
                    seconds, note = None, "error: " + done.stderr.strip().splitlines()[-1][:100]
                else:
                    seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
                    note = f"{seconds:.1f}"
        rows.append((label, seconds, note))
        print(f"{label:50s} {note}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({label: seconds for label, seconds, _ in rows}, f, indent=1)
    print("\nslowest first:")
    for label, seconds, note in sorted(rows, key=lambda r: -(r[1] if r[1] is not None else 1e9)):
        print(f"{label:50s} {note:>8s}")
    finished = [s for _, s, _ in rows if s is not None]
    print(f"{len(rows)} variants, {len(rows) - len(finished)} unfinished, total {sum(finished):.0f} s compiled")


if __name__ == "__main__":
    main()
