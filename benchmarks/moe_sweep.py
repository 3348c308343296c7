"""Device script: time ``moe_weight_only`` configurations on a MoE model's two routed products.

    PYTHONPATH=src python benchmarks/moe_sweep.py [--model gpt-oss-20b] [--tokens 1,8,16]
        [--products gate_up,down] [--budget-s 150] [--workers 12]
                                                        -> moe_sweep.json in $OUT (or the working directory)

The products as ``nn.FP4Experts`` calls them in a layer of ``--model`` (a ``bench.moe.MOE_MODELS`` key, its
experts' format with linear scales as ``fp4gemv bench --model`` and the checkpoints have them, NVFP4 with
per-expert global scales, bf16 activations, bf16 bias where the model has one, fp32 out): gate_up
``[E, 2I, H]`` on x ``[T, H]`` with ids ``[T, k]`` (gpt-oss-20b: ``[32, 5760, 2880]``, top-4); down ``[E, H, I]``
on ``[k T, I]`` with ids ``[k T, 1]``.  The routing is ``bench.moe``'s (seeded router logits, the same seeds,
the model's routing), so the default row repeats that benchmark's figures.  Each configuration (``candidates``:
the default first) runs through ``fp4gemv.moe_gemv(..., kernel="moe_weight_only", config=...)``, timed as
``bench.moe`` times the routed GEMVs:
one launch per distinct weight copy (8) in a CUDA graph, L2 flushed before each replay, median of 15 replays;
reported against the best read (``bench.stream.best_read``) of the distinct experts' bytes.  At the end, the
default and the fastest configuration of each case also run on swizzled scales.

Compile time: worker processes compile every configuration first (``--workers``; Triton's on-disk cache then
serves the timing process); a configuration that fails is reported, not fatal.  Rows run in rounds (every case's
first candidate, then every case's second, ...) and none starts after ``--budget-s`` seconds, so a slow machine
loses the last candidates of every case rather than whole cases.  The JSON is rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time

import torch

import fp4gemv
from fp4gemv import moe
from fp4gemv.bench.moe import MOE_MODELS, model_route, projection_bytes, random_projection, router_logits
from fp4gemv.bench.stream import best_read
from fp4gemv.bench.timing import device_time_us
from fp4gemv.kernels.moe_weight_only import moe_weight_only_kernel
from fp4gemv.kernels.weight_only import WeightOnlyConfig as C
from fp4gemv.target import resolve_target

MODEL = MOE_MODELS["gpt-oss-20b"]  # use_model sets it and PRODUCTS
KERNEL = "moe_weight_only"
COPIES = 8
DEVICE = "cuda"
BACKEND = "auto"
TOKENS = (1, 8, 16)


def model_products(model) -> dict[str, tuple[int, int, int]]:
    """``model``'s two products, (rows M, K, ids per activation row): gate_up reads x[t] for each of its k slots;
    down reads one activation row per (token, slot), as FP4Experts calls them."""
    return {"gate_up": (2 * model.intermediate, model.hidden, model.top_k),
            "down": (model.hidden, model.intermediate, 1)}


PRODUCTS = model_products(MODEL)


def use_model(name: str) -> None:
    """Sweep ``name``'s products (``bench.moe.MOE_MODELS``): sets ``MODEL`` and ``PRODUCTS``."""
    global MODEL, PRODUCTS
    MODEL = MOE_MODELS[name]
    PRODUCTS = model_products(MODEL)


# T = 1, gate_up (1440 programs of 16 rows, one wave; split, 2 columns): 2 tiles or 2 chunks per warp, more warps.
T1_GATE_UP = (C(1, 4, 1, True), C(2, 2, 1, True), C(2, 4, 1, True), C(4, 2, 1, True), C(4, 4, 1, True),
              C(2, 2, 2, True), C(1, 2, 2, True), C(1, 4, 2, True), C(2, 1, 2, True), C(1, 2, 1, False),
              C(1, 2, 1, True, pdl=True), C(1, 2, 1, True, loads_first=False))
# T = 1, down (4 activation rows of one pair each, 720 programs of 16 rows): k32 (8 columns) and split (4).
T1_DOWN = (C(1, 8, 1), C(2, 4, 1), C(2, 2, 2), C(2, 4, 2), C(4, 4, 1), C(1, 4, 1, True), C(1, 8, 1, True),
           C(2, 4, 1, True), C(2, 2, 2, True), C(4, 4, 1, True), C(1, 4, 1, pdl=True),
           C(1, 4, 1, loads_first=False))
# T = 8, 16 (default: 1-warp programs, 1 tile, k32 with 8 columns for groups of ~1.5-2.2 pairs): more warps,
# 2 and 4 tiles, 2 chunks; split (4 columns: 16-byte weight loads; groups of 5+ pairs loop).
# Short K (Qwen3's down, K = 768: one step or less per warp): 4 tiles on one warp, more rows per program's grouping.
ROUTED = (C(1, 2, 1), C(1, 4, 1), C(2, 1, 1), C(2, 2, 1), C(2, 4, 1), C(1, 2, 2), C(1, 4, 2), C(4, 1, 1),
          C(4, 2, 1), C(4, 4, 1), C(2, 2, 2), C(1, 4, 1, True), C(2, 2, 1, True), C(2, 4, 1, True),
          C(1, 2, 2, True))


def candidates(product: str, tokens: int, default: C) -> list[C]:
    """The configurations timed on ``product`` at ``tokens``: ``default`` first, no repeats."""
    extra = ROUTED if tokens > 1 else T1_GATE_UP if product == "gate_up" else T1_DOWN
    return list(dict.fromkeys((default, *extra)))


def weights(product: str, copies: int, layout: str = "linear") -> list:
    """``copies`` random expert projections (``bench.moe.random_projection``) of ``product``."""
    m, k, _ = PRODUCTS[product]
    g = torch.Generator(device=DEVICE).manual_seed(0 if product == "gate_up" else 1)
    out = []
    for _ in range(copies):
        p = random_projection(MODEL.experts, m, k, g, MODEL.fmt, MODEL.bias)
        out.append((p.weight if layout == "linear" else p.weight.with_scale_layout(layout), p.bias, p.global_scales))
    return out


def inputs(product: str, tokens: int, copies: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """(activations, ids per copy, out) of ``product`` at ``tokens``: ``bench.moe``'s routing seeds."""
    m, k, per_row = PRODUCTS[product]
    ids = [model_route(MODEL, router_logits(MODEL, tokens, seed=1000 * tokens + c, device=DEVICE))[0]
           for c in range(copies)]
    if per_row == 1:
        ids = [i.reshape(-1, 1) for i in ids]
    rows = ids[0].shape[0]
    g = torch.Generator(device=DEVICE).manual_seed(tokens)
    x = torch.randn(rows, k, device=DEVICE, generator=g).to(torch.bfloat16)
    out = torch.empty(rows, ids[0].shape[1], m, device=DEVICE, dtype=torch.float32)
    return x, ids, out


def call(w, bias, gs, x, ids, out, config) -> torch.Tensor:
    return fp4gemv.moe_gemv(w, x, ids, bias=bias, global_scales=gs, out=out, out_dtype=torch.float32,
                            backend=BACKEND, check_ids=False, kernel=KERNEL, config=config)


def default_config(w, bias, gs, x, ids, out) -> C:
    target = resolve_target(BACKEND, w.device)
    return moe.plan_moe(w, x, ids, bias, gs, out, torch.float32, target, KERNEL).config


def _compile_jobs(jobs: list[tuple[str, int, str, tuple]]) -> list[str]:
    """Worker: run each (product, tokens, layout, config) once on one weight copy (Triton caches the kernel)."""
    errors, cached = [], {}
    for product, tokens, layout, config in jobs:
        try:
            if (product, layout) not in cached:
                cached[(product, layout)] = weights(product, 1, layout)[0]
            x, ids, out = inputs(product, tokens, 1)
            call(*cached[(product, layout)], x, ids[0], out, C(*config))
            torch.cuda.synchronize()
        except Exception as ex:  # reported again, with its row, when the timing process meets it
            errors.append(f"{product} T={tokens} {layout} {config}: {type(ex).__name__}: {str(ex)[:200]}")
    return errors


def precompile(jobs: list[tuple[str, int, str, tuple]], workers: int, timeout_s: float) -> list[str]:
    """Compile ``jobs`` in ``workers`` spawned processes (interleaved, so each gets every product), giving up
    after ``timeout_s`` (a worker that dies loses its share: the pool would wait for it forever)."""
    if workers <= 0 or not jobs:
        return []
    shares = [jobs[i::workers] for i in range(workers) if jobs[i::workers]]
    try:
        with multiprocessing.get_context("spawn").Pool(len(shares)) as pool:
            results = pool.map_async(_compile_jobs, shares).get(timeout=timeout_s)
            return [e for errs in results for e in errs]
    except Exception as ex:  # the timing process compiles what is missing
        return [f"precompile: {type(ex).__name__}: {ex}"]


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _kernels() -> dict:
    """The compiled variants of the routed kernel in this process (Triton's per-device caches; {} elsewhere)."""
    try:
        return {id(k): k for cache in moe_weight_only_kernel.device_caches.values() for k in cache[0].values()}
    except Exception:
        return {}


def time_config(case: dict, config: C, layout: str) -> dict:
    """One row: median us of ``config`` over the case's copies, its fraction of the read, registers."""
    row = dict(config=config._asdict(), layout=layout)
    copies = case["weights"][layout]
    x, ids, out = case["x"], case["ids"], case["out"]
    try:
        before = _kernels()
        for c, weight in enumerate(copies):
            call(*weight, x, ids[c], out, config)
        _sync()
        new = [k for key, k in _kernels().items() if key not in before]
        if len(new) == 1:
            row.update(regs=getattr(new[0], "n_regs", None), spills=getattr(new[0], "n_spills", None))
        times = device_time_us(lambda c: call(*copies[c], x, ids[c], out, config), range(len(copies)))
    except Exception as ex:
        row["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
        return row
    us = statistics.median(times)
    row.update(us=us, min_us=min(times), fraction_of_read=case["best_read_us"] / us)
    return row


def _label(config: dict) -> str:
    flags = "split" if config["split"] else "k32"
    flags += " pdl" if config["pdl"] else ""
    flags += "" if config["loads_first"] else " -O3"
    return f"tiles {config['tiles']} warps {config['warps']:>2} chunks {config['chunks']} {flags}"


def _print_row(case: dict, row: dict) -> None:
    head = f"{case['product']:>7} T={case['tokens']:>2} {row['layout']:>8} {_label(row['config']):<40}"
    if "error" in row:
        print(f"{head} ERROR {row['error']}", flush=True)
        return
    regs = "" if row.get("regs") is None else f" regs {row['regs']} spills {row['spills']}"
    print(f"{head} {row['us']:8.1f} us  {row['fraction_of_read']:.2f} of read{regs}", flush=True)


def _summary(cases: list[dict]) -> list[str]:
    lines = ["| product | T | experts | MB | read us | default us | best us | best/read | x default | best config |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for case in cases:
        timed = [r for r in case["rows"] if "us" in r and r["layout"] == "linear"]
        if not timed:
            continue
        best = min(timed, key=lambda r: r["us"])
        default = timed[0]["us"] if timed[0]["config"] == case["default"] else None
        default_us, gain = ("-", "-") if default is None else (f"{default:.1f}", f"{default / best['us']:.2f}")
        lines.append(f"| {case['product']} | {case['tokens']} | {case['distinct_experts']:.1f} | "
                     f"{case['mbytes']:.1f} | {case['best_read_us']:.1f} | {default_us} | {best['us']:.1f} | "
                     f"{best['fraction_of_read']:.2f} | {gain} | {_label(best['config'])} |")
    for tokens in sorted({case["tokens"] for case in cases}):
        both = [case for case in cases if case["tokens"] == tokens]
        timed = [[r for r in case["rows"] if "us" in r and r["layout"] == "linear"] for case in both]
        if len(both) == 2 and all(timed) and all(t[0]["config"] == c["default"] for t, c in zip(timed, both)):
            default = sum(t[0]["us"] for t in timed)
            best = sum(min(r["us"] for r in t) for t in timed)
            read = sum(case["best_read_us"] for case in both)
            lines.append(f"T = {tokens}: gate_up + down {default:.1f} us by default, {best:.1f} us with each "
                         f"product's best ({read / default:.2f} -> {read / best:.2f} of the read)")
    return lines


def _public(result: dict) -> dict:
    """``result`` without the cases' tensors, configurations as dicts."""
    hidden = ("weights", "x", "ids", "out", "candidates")
    return dict(result, cases=[dict({k: v for k, v in case.items() if k not in hidden},
                                    candidates=[c._asdict() for c in case["candidates"]])
                               for case in result["cases"]])


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(_public(result), f, indent=1)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, choices=sorted(MOE_MODELS), help="default: gpt-oss-20b")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--products", default=",".join(PRODUCTS))
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--workers", type=int, default=min(12, max(0, (os.cpu_count() or 2) - 2)))
    args = parser.parse_args(argv)
    if args.model is not None:
        use_model(args.model)
    start = time.perf_counter()
    path = os.path.join(os.environ.get("OUT", "."), "moe_sweep.json")
    tokens_list = [int(t) for t in args.tokens.split(",")]
    products = args.products.split(",")

    linear = {p: weights(p, COPIES) for p in products}
    cases = []
    for product in products:
        m, k, per_row = PRODUCTS[product]
        expert_bytes = projection_bytes(m, k, MODEL.fmt)
        for tokens in tokens_list:
            x, ids, out = inputs(product, tokens, COPIES)
            default = default_config(*linear[product][0], x, ids[0], out)
            distinct = statistics.mean(int(torch.unique(i).numel()) for i in ids)
            nbytes = int(distinct * expert_bytes)
            cases.append(dict(product=product, tokens=tokens, distinct_experts=distinct, mbytes=nbytes / 1e6,
                              default=default._asdict(), candidates=candidates(product, tokens, default),
                              weights={"linear": linear[product]}, x=x, ids=ids, out=out, rows=[]))
    jobs = [(c["product"], c["tokens"], "linear", tuple(cfg)) for c in cases for cfg in c["candidates"]]
    jobs += [(c["product"], c["tokens"], "swizzled", tuple(c["candidates"][0])) for c in cases]
    errors = precompile(jobs, args.workers, timeout_s=args.budget_s / 2)
    compile_s = time.perf_counter() - start
    for line in errors:
        print("compile:", line, flush=True)
    for case in cases:
        case["best_read"], case["best_read_us"] = best_read(int(case["mbytes"] * 1e6))
    result = dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, torch=torch.__version__,
                  triton=__import__("triton").__version__, model=MODEL.name, copies=COPIES, budget_s=args.budget_s,
                  precompile_s=compile_s, precompile_errors=errors, cases=cases, skipped=[])
    print(f"precompiled {len(jobs)} launches with {args.workers} workers in {compile_s:.1f} s", flush=True)

    rounds = max(len(c["candidates"]) for c in cases)
    work = [(case, case["candidates"][r], "linear") for r in range(rounds) for case in cases
            if r < len(case["candidates"])]
    work.append(None)  # then the swizzled rows: the default and the fastest linear configuration of each case
    while work:
        item = work.pop(0)
        if item is None:
            swizzled = {p: [(w.with_scale_layout("swizzled"), b, gs) for w, b, gs in linear[p]] for p in products}
            for case in cases:
                case["weights"]["swizzled"] = swizzled[case["product"]]
                timed = [r for r in case["rows"] if "us" in r]
                best = C(**min(timed, key=lambda r: r["us"])["config"]) if timed else None
                work += [(case, cfg, "swizzled") for cfg in dict.fromkeys((case["candidates"][0], best)) if cfg]
            continue
        case, config, layout = item
        if time.perf_counter() - start > args.budget_s:
            result["skipped"].append(dict(product=case["product"], tokens=case["tokens"], layout=layout,
                                          config=config._asdict()))
            continue
        row = time_config(case, config, layout)
        case["rows"].append(row)
        _print_row(case, row)
        result["elapsed_s"] = time.perf_counter() - start
        _write(path, result)
    print("\n".join(_summary(cases)))
    if result["skipped"]:
        print(f"skipped after the {args.budget_s:.0f} s budget: {len(result['skipped'])} rows")
    result["elapsed_s"] = time.perf_counter() - start
    _write(path, result)
    print(f"{result['elapsed_s']:.1f} s; wrote {path}")
    return _public(result)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
