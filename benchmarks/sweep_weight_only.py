"""Device script: the weight-only tensor-core kernel (kernels/weight_only.py) on the H200 in one run of ~5 minutes.

PYTHONPATH=src python benchmarks/sweep_weight_only.py [--budget-s 280] [--no-check]
    -> one line per check and per timed case, then a table; $OUT/sweep_weight_only.json

1. Correctness of every configuration the timing below uses (the same compiled kernels: the check shape
   2448 x 2880 x 2 has the timed shapes' divisibility and the output is fp16 as there), on full-range operands
   (all 16 codes, every e4m3 mantissa with exponents 2^-9 .. 2^2, subnormals and 10% negative scales, e8m0 over
   2^-24 .. 2^2, activations spread over 2^-12 .. 2^0: wide, and small enough for fp16 outputs), tails (2448
   rows: not a multiple of 32 or 64; K = 2880: partial last steps, 90 MXFP4 scale columns), outputs poisoned with
   NaN, against the float64 oracle (fp4gemv.reference) with the kernel's error bound
   (tests/test_kernels_weight_only.py).  Swizzled scales and no global scales, as timed (other layouts and global
   scales are other compiles; tests/test_kernels_weight_only.py covers them).
2. Device time (fp4gemv.bench.device_time_us: CUDA-graph replay of >= 20 distinct inputs, L2 flushed) of the
   weight-only kernel's default configuration and an alternative per shape, of the tensor-core kernel it may
   replace (NVFP4), and of the Triton stream read (with PDL) of the same bytes.
Case by case in priority order (its configurations checked, then timed), stopping at the budget.  Each
configuration is a compile (~1 s offline); the plan has 92 (and 12 of the tensor-core kernel).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

import torch

from fp4gemv import FP4Tensor, bench, formats
from fp4gemv.bench import Shape, case_bytes, device_time_us, input_count, random_gemv_operands
from fp4gemv.kernels import _mma_step, weight_only
from fp4gemv.kernels._common import GemvOperands
from fp4gemv.kernels.configs import hmma_config
from fp4gemv.kernels.weight_only import WeightOnlyConfig
from fp4gemv.reference import quantized_gemv_reference

gemv_module = importlib.import_module("fp4gemv.gemv")
SMS = 132
NVFP4_SHAPES = [Shape(7168, 16384), Shape(4096, 7168, 8), Shape(4096, 4096), Shape(14336, 4096), Shape(28672, 8192),
                Shape(1024, 4096), Shape(4096, 14336)]
MXFP4_SHAPES = NVFP4_SHAPES + [Shape(5760, 2880), Shape(2880, 2880)]  # + gpt-oss-20b's experts
# An alternative to the default per shape (tiles, warps, chunks): the other side of the trade-off the default
# makes (docs/performance.md): fewer tiles and more warps, or more tiles and fewer warps, or two chunks.
ALTERNATIVE = {(7168, 16384, 1): (1, 4, 1), (4096, 7168, 8): (2, 4, 1), (4096, 4096, 1): (1, 8, 2),
               (14336, 4096, 1): (2, 8, 1), (28672, 8192, 1): (2, 4, 1), (1024, 4096, 1): (1, 8, 2),
               (4096, 14336, 1): (1, 8, 1), (5760, 2880, 1): (1, 8, 1), (2880, 2880, 1): (1, 16, 1)}
# N = 4 in split mode (two n-tiles) as well as fold / k32 on these.
SPLIT_N4 = {(7168, 16384, 1), (28672, 8192, 1)}
# (fmt, act, N, shapes) in priority order.
CASES = [("nvfp4", "bf16", 1, NVFP4_SHAPES), ("mxfp4", "bf16", 1, MXFP4_SHAPES),
         ("nvfp4", "bf16", 8, NVFP4_SHAPES), ("mxfp4", "bf16", 8, MXFP4_SHAPES),
         ("nvfp4", "fp4", 8, NVFP4_SHAPES), ("nvfp4", "f16", 1, NVFP4_SHAPES), ("mxfp4", "f16", 1, MXFP4_SHAPES),
         ("nvfp4", "bf16", 16, NVFP4_SHAPES), ("mxfp4", "bf16", 16, MXFP4_SHAPES),
         ("nvfp4", "bf16", 4, NVFP4_SHAPES), ("mxfp4", "bf16", 4, MXFP4_SHAPES),
         ("nvfp4", "fp4", 4, NVFP4_SHAPES), ("mxfp4", "fp4", 8, MXFP4_SHAPES), ("nvfp4", "fp4", 16, NVFP4_SHAPES)]
# Extra variants on two cases: ptxas -O3 (loads sunk towards their use) and no PDL.
EXTRA = {("nvfp4", "bf16", 1, (7168, 16384, 1)), ("mxfp4", "bf16", 8, (28672, 8192, 1))}
CHECK_SHAPE = (2448, 2880, 2)
DEVICE = "cuda"
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "fp4": None}


def operands(a: FP4Tensor, b, out: torch.Tensor) -> GemvOperands:
    """``GemvOperands`` as ``fp4gemv.gemv`` builds them (``gemv._launch``): byte views with a batch dimension."""
    batch = gemv_module._batch(a) or gemv_module._batch(b) or 1
    sfa, sfa_addressing = gemv_module._scale_operand(a, batch)
    if isinstance(b, FP4Tensor):
        sfb, sfb_addressing = gemv_module._scale_operand(b, batch)
        b_data, gsb = gemv_module._batched(b.data, batch, 3), b.global_scale
    else:
        b_data = gemv_module._batched(b, batch, 3).contiguous().view(torch.uint8)
        sfb = sfb_addressing = gsb = None
    c = out if out.dim() == 3 else out.unsqueeze(0)
    return GemvOperands(gemv_module._batched(a.data, batch, 3), sfa, sfa_addressing, b_data, sfb, sfb_addressing, c,
                        a.global_scale, gsb)


def launch_wo(ops: GemvOperands, fmt: str, act: str, k: int, config: WeightOnlyConfig):
    return weight_only.launch(ops, scale_block=16 if fmt == "nvfp4" else 32, k=k, activation_dtype=DTYPES[act],
                              config=config, use_ptx=True)


def launch_hmma(x, k: int, act: str) -> None:
    a, b, out = x
    gemv_module._launch(a, b, out, "hmma", hmma_config(a.rows, k, out.shape[0]), use_ptx=True)


def variants(fmt: str, act: str, n: int, shape: Shape) -> dict[str, WeightOnlyConfig]:
    """The weight-only configurations timed for one case: the default, the per-shape alternative for bf16 with
    N = 1 and 8 and NVFP4 x NVFP4 with N = 8, split for N = 4 on two shapes, and the extras."""
    default = weight_only.default_config(shape.m, shape.k, shape.l, n, fmt, act, SMS)
    out = {"wo": default}
    if n == 4 and (shape.m, shape.k, shape.l) in SPLIT_N4:
        out["wo-split"] = default._replace(split=True)
    elif n in (1, 8) and act == "bf16" or (fmt, act, n) == ("nvfp4", "fp4", 8):
        # (each configuration is a compile of ~1 s: alternatives where they inform most)
        tiles, warps, chunks = ALTERNATIVE[(shape.m, shape.k, shape.l)]
        alt = default._replace(tiles=tiles, warps=warps, chunks=chunks)
        if alt != default:
            out["wo-alt"] = alt
    if (fmt, act, n, (shape.m, shape.k, shape.l)) in EXTRA:
        out["wo-O3"] = default._replace(loads_first=False)
        out["wo-noPDL"] = default._replace(pdl=False)
    return out


# --- correctness ---------------------------------------------------------------------------------------------


def full_range_fp4(shape, fmt: str, layout: str, seed: int, global_scale=None) -> FP4Tensor:
    """All 16 codes; NVFP4 scales: e4m3 exponent fields 0..9 (subnormals, 2^-9 .. 2^2), every mantissa, 10%
    negative; MXFP4: e8m0 2^-24 .. 2^2."""
    g = torch.Generator().manual_seed(seed)
    *batch, rows, k = shape
    data = torch.randint(0, 256, (*batch, rows, k // 2), dtype=torch.uint8, generator=g)
    block = formats.FORMATS[fmt].block_size
    cols = (*batch, rows, k // block)
    if fmt == "nvfp4":
        raw = torch.randint(0, 0x50, cols, dtype=torch.int32, generator=g)  # exponent fields 0..9
        sign = (torch.rand(cols, generator=g) < 0.1).to(torch.int32) << 7
        scales = (raw | sign).to(torch.uint8)
    else:
        scales = torch.randint(127 - 24, 127 + 3, cols, generator=g).to(torch.uint8)
    t = FP4Tensor(data, scales, fmt, "linear").with_scale_layout(layout)
    gs = None if global_scale is None else torch.tensor(global_scale, device=DEVICE)
    return FP4Tensor(t.data.to(DEVICE), t.scales.to(DEVICE), fmt, layout, gs)


def check_operands(fmt: str, act: str, n: int, seed: int):
    m, k, L = CHECK_SHAPE
    a = full_range_fp4((L, m, k), fmt, "swizzled", seed)
    if act == "fp4":
        b = full_range_fp4((L, n, k), fmt, "swizzled", seed + 1)
    else:
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(L, n, k, generator=g) * torch.exp2(torch.randint(-12, 1, (L, n, k), generator=g).float())
        b = x.to(DTYPES[act]).to(DEVICE)
    return a, b


class Checks:
    """Operands, the exact result and the bound's magnitude per (format, activation, N), shared by the configs."""

    def __init__(self):
        self.cache: dict = {}

    def reference(self, fmt: str, act: str, n: int):
        if (fmt, act, n) not in self.cache:
            a, b = check_operands(fmt, act, n, seed=1)
            ac, bc = a.to("cpu"), b.to("cpu")
            exact = quantized_gemv_reference(ac, bc, torch.float64)
            assert exact.abs().max() < 60000, "check operands must keep the results within fp16"
            av = ac.dequantize(torch.float64).abs()
            bv = (bc.dequantize(torch.float64) if act == "fp4" else bc.double()).abs()
            self.cache[fmt, act, n] = a, b, exact, av @ bv.transpose(-1, -2)
        return self.cache[fmt, act, n]

    def __call__(self, fmt: str, act: str, n: int, config: WeightOnlyConfig) -> dict:
        """The PTX result against the exact oracle: max |err| / bound over the outputs, unwritten outputs."""
        a, b, exact, magnitude = self.reference(fmt, act, n)
        m, k, L = CHECK_SHAPE
        out = torch.full((L, m, n), float("nan"), dtype=torch.float16, device=DEVICE)
        ops = operands(a, b, out)
        kw = dict(scale_block=a.fmt.block_size, k=k, activation_dtype=DTYPES[act])
        assert weight_only.supports(ops, **kw, split=config.split)
        weight_only.launch(ops, **kw, config=config, use_ptx=DEVICE == "cuda")
        got = out.cpu().double()
        fold = _mma_step.fold_exponent(fmt, act, weight_only.mode(a.fmt.block_size, config))
        _, exponent = torch.frexp(got.abs())
        half_ulp = torch.where(got == 0, 0.0, torch.exp2((exponent - 12).double())).clamp(min=2.0**-25)  # fp16
        bound = (1.01 * (k + 24) * 2.0**-23 * magnitude + (k + 24) * 2.0**-149 * max(1.0, 2.0**fold)
                 + (k + 3) * 2.0**-53 * magnitude + half_ulp)
        unwritten = int(torch.isnan(got).sum())
        ratio = (got - exact).abs() / bound
        worst = float(ratio.max()) if unwritten == 0 else float("nan")
        ok = unwritten == 0 and worst <= 1.0
        return {"fmt": fmt, "act": act, "n": n, "config": config._asdict(), "unwritten": unwritten,
                "worst_err_over_bound": worst, "ok": ok}


# --- timing --------------------------------------------------------------------------------------------------


def median_us(launch, inputs) -> float:
    return statistics.median(device_time_us(launch, inputs))


class StreamReads:
    """The Triton stream read with PDL of a byte count, timed once per count (within 0.5%)."""

    def __init__(self):
        self.us: dict[int, float] = {}

    def __call__(self, nbytes: int) -> float:
        for known, us in self.us.items():
            if abs(known - nbytes) <= 0.005 * nbytes:
                return us
        self.us[nbytes] = statistics.median(bench.stream_read_time_us(nbytes, pdl=True))
        return self.us[nbytes]


def time_case(fmt: str, act: str, n: int, shape: Shape, reads: StreamReads) -> dict:
    s = Shape(shape.m, shape.k, shape.l, n)
    bench_act = {"f16": "fp16", "bf16": "bf16", "fp4": "fp4"}[act]  # fp4gemv.bench's names
    nbytes = case_bytes(s, fmt, bench_act)
    inputs = [random_gemv_operands(s, fmt, bench_act, seed=i) for i in range(input_count(nbytes))]
    row = {"fmt": fmt, "act": act, "n": n, "m": s.m, "k": s.k, "l": s.l, "bytes": nbytes, "us": {}, "configs": {}}
    row["registers"] = {}
    for name, config in variants(fmt, act, n, s).items():
        ops = [operands(a, b, out) for a, b, out in inputs]
        kernel = launch_wo(ops[0], fmt, act, s.k, config)
        row["registers"][name] = [getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None)]
        row["us"][name] = median_us(lambda x, c=config: launch_wo(x, fmt, act, s.k, c), ops)
        row["configs"][name] = config._asdict()
    if fmt == "nvfp4" and (act != "fp4" or n > 1):
        row["us"]["hmma"] = median_us(lambda x: launch_hmma(x, s.k, act), inputs)
    row["read_us"] = reads(nbytes)
    del inputs
    torch.cuda.empty_cache()
    return row


def table(rows: list[dict]) -> str:
    names = ["wo", "wo-alt", "wo-split", "wo-O3", "wo-noPDL", "hmma"]
    lines = []
    for key in dict.fromkeys((r["fmt"], r["act"], r["n"]) for r in rows):
        lines.append(f"\n{key[0]} x {key[1]}, N = {key[2]}   (us, fraction of the PDL stream read of the same bytes)")
        lines.append(f"{'shape':<18}{'MB':>7}{'read':>8}" + "".join(f"{n:>17}" for n in names))
        for r in rows:
            if (r["fmt"], r["act"], r["n"]) != key:
                continue
            cells = "".join(f"{r['us'][n]:>9.2f} ({r['read_us'] / r['us'][n]:.2f})" if n in r["us"] else f"{'':>17}"
                            for n in names)
            lines.append(f"{r['m']}x{r['k']}x{r['l']:<6}"[:18].ljust(18) + f"{r['bytes'] / 1e6:>7.1f}"
                         f"{r['read_us']:>8.2f}" + cells)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=280.0, help="stop timing new cases after this long")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    start = time.time()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    plan = [(fmt, act, n, s) for fmt, act, n, shapes in CASES for s in shapes]
    result = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__}, "checks": [], "rows": []}
    checks, checked, reads = Checks(), set(), StreamReads()
    for fmt, act, n, s in plan:  # in priority order: each case's configurations checked, then timed
        if time.time() - start > args.budget_s:
            print(f"budget reached: {len(plan) - len(result['rows'])} cases not timed", flush=True)
            break
        for config in variants(fmt, act, n, s).values():
            # the check's N: the same specialization and n-tiles as the timed N (N = 1 is a constant to the JIT)
            n_check = n if n in (1, 16) else (3 if config.split else 5)
            if args.no_check or (fmt, act, n_check, config) in checked:
                continue
            checked.add((fmt, act, n_check, config))
            r = checks(fmt, act, n_check, config)
            result["checks"].append(r)
            print(f"check {fmt} {act} N={n_check} {tuple(config)}: unwritten {r['unwritten']}, worst err/bound "
                  f"{r['worst_err_over_bound']:.3f} {'OK' if r['ok'] else 'FAIL'}  [{time.time() - start:.0f} s]",
                  flush=True)
        row = time_case(fmt, act, n, s, reads)
        result["rows"].append(row)
        spills = {k: v[1] for k, v in row["registers"].items() if v[1]}
        print(f"time {fmt} {act} N={n} {s.m}x{s.k}x{s.l}: read {row['read_us']:.2f} | "
              + " | ".join(f"{k} {v:.2f}" for k, v in row["us"].items()) + f"  [{time.time() - start:.0f} s]"
              + (f"  SPILLS {spills}" if spills else ""), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "sweep_weight_only.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(table(result["rows"]))
    failed = [c for c in result["checks"] if not c["ok"]]
    print(f"\n{len(result['checks']) - len(failed)} of {len(result['checks'])} checks OK; "
          f"{len(result['rows'])} of {len(plan)} cases timed in {time.time() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
