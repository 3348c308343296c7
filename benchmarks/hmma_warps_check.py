"""GPU diagnosis of the hmma kernel with 16 warps, which ``Hmma.check_config`` refuses (wrong results on the
H200 in an earlier run): launches the kernel directly with 4, 8 and 16 warps, PTX and pure-Triton twin, and
reports which outputs leave the error bound of the exact result.

    PYTHONPATH=src python benchmarks/hmma_warps_check.py        (an sm_90 GPU)

Offline (sm_90 compile, no GPU) the 16-warp PTX variant has the fragment layout the asm relies on
(``warpsPerCTA = [1, 16, 1, 1]``), no local memory, 88 registers, and a cross-warp reduction through 16 KB
of shared memory with a barrier before and after; this run says whether the defect is still there and where:
per case the share of outputs outside the bound, and for those the rows mod 16 and columns hit.  K = 8192 has
no partial step at 16 warps (a step is 2048 elements), K = 4608 has one.
"""

import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from aot import Sm90Launch  # noqa: E402
from operands import build_case, within_bound  # noqa: E402

from fp4gemv.kernels.hmma_gemv import HmmaConfig  # noqa: E402
from fp4gemv.ops import result_shape  # noqa: E402
from fp4gemv.target import SM90  # noqa: E402

CASES = ((torch.float16, 1), (torch.float16, 16), (torch.bfloat16, 5), ("fp4", 3), ("fp4", 16))
SHAPES = ((2432, 4608, 2), (256, 8192, 1))


def run_once(a, b, warps: int, mode: str) -> torch.Tensor:
    """The hmma kernel's result for ``warps`` (bypassing the configuration check), ``mode`` 'ptx' or 'triton'."""
    out = torch.full(result_shape(a, b), float("nan"), dtype=torch.float32, device="cuda")
    launch = Sm90Launch(a, b, out, kernel="hmma", config=HmmaConfig(warps), target=replace(SM90, mode=mode))
    launch.kernel[launch.grid](**launch.args, **launch.options)
    torch.cuda.synchronize()
    return out


def main() -> None:
    rows = []
    for shape in SHAPES:
        for activation, n in CASES:
            a, b = build_case("nvfp4", activation, n, "swizzled", shape, True, seed=n)
            for warps in (4, 8, 16):
                for mode in ("ptx", "triton"):
                    try:
                        got = run_once(a, b, warps, mode)
                    except Exception as error:  # a compile or launch failure is a result here
                        rows.append((shape, activation, n, warps, mode, f"error: {str(error)[:60]}", "", ""))
                        continue
                    ok = within_bound(got.cpu(), a.to("cpu"), b.to("cpu"), torch.float32, tensor_cores=True)
                    bad = (~ok).nonzero()
                    share = f"{100.0 * bad.shape[0] / ok.numel():.2f}%"
                    rows_hit = sorted({int(i) % 16 for i in bad[:, -2].tolist()})[:16] if len(bad) else ""
                    cols_hit = sorted({int(i) for i in bad[:, -1].tolist()})[:16] if len(bad) else ""
                    rows.append((shape, activation, n, warps, mode, share, rows_hit, cols_hit))
                    print(*rows[-1], flush=True)
    print("\nshape            act        n  warps mode    outside bound  rows%16 hit / columns hit")
    for shape, act, n, warps, mode, share, rh, ch in rows:
        name = act if isinstance(act, str) else str(act).split(".")[-1]
        print(f"{'x'.join(map(str, shape)):16s} {name:9s} {n:3d} {warps:5d}  {mode:7s} {share:>13s}  {rh} / {ch}")


if __name__ == "__main__":
    main()
