"""Device script (round 15 of docs/performance.md): the routed decode engine (``moe_gemv(kernel="moe_engine")``)
against ``moe_weight_only`` on NVFP4 experts of gpt-oss-20b, gpt-oss-120b and Qwen3-30B-A3B shapes, T = 1, 8, 16.

    PYTHONPATH=src python benchmarks/moe_engine_models.py [sweep]   -> moe_engine_time.json in $OUT (or .)
    PYTHONPATH=src python benchmarks/moe_engine_models.py padded    (round 16: scale rows padded to 16 bytes, T = 1-16)
    PYTHONPATH=src python benchmarks/moe_engine_models.py padded mxfp4    (round 17: gpt-oss's MXFP4 experts)
    PYTHONPATH=src python benchmarks/moe_engine_models.py orders [mxfp4|nvfp4 [MODEL ...]]   (round 19: each layer
        in both code orders, ``FP4Tensor.with_code_order``: the checkpoint's and the native one, T = 1, 8, 16)

First ``split_times``: gpt-oss-20b's gate_up (NVFP4, bias, the gpt-oss activation) with the chunk launch alone, the
engine launch alone and both.  Then per model and T: the routed GEMVs of one layer (gate_up with its activation,
then down times the routing weights into fp32, as ``bench.moe`` times them; NVFP4 experts from
``bench.moe.random_projection`` with per-expert global scales, Qwen3's gate and up in halves with ``[E, 2]``
scales), each kernel, against the best read of the distinct experts' bytes; ``sweep`` adds engine configurations on
gpt-oss-20b.  Timing: ``bench.timing.device_time_us`` (one CUDA graph over 8 copies, L2 flushed, median of 15).
"""
import json
import os
import statistics
import sys
import time

import torch

import fp4gemv
from fp4gemv.bench.moe import random_projection, router_logits, route, route_softmax_topk, projection_bytes
from fp4gemv.bench.stream import best_read
from fp4gemv.bench.timing import device_time_us
from fp4gemv.kernels.moe_engine import MoeEngineConfig
from fp4gemv.layouts import aligned_scale_rows
from fp4gemv.tensor import FP4Tensor

OUT = os.environ.get("OUT", ".")
MODELS = {  # experts, hidden, intermediate, top_k, activation, bias, stacked silu
    "gpt-oss-20b": (32, 2880, 2880, 4, "gpt-oss", True),
    "gpt-oss-120b": (128, 2880, 2880, 4, "gpt-oss", True),
    "qwen3-30b-a3b": (128, 2048, 768, 8, "silu", False),
}
COPIES = 8
rows_out = []


def med(t):
    return statistics.median(t)


def padded_scale_rows(p):
    """``p`` (ExpertWeights) with its linear scale rows 16 bytes apart in memory (``layouts.aligned_scale_rows``,
    as ``FP4Experts`` stores them), so that the engine copies them (``moe_engine.scale_copy_reason``); K = 2880 has
    rows of 180 (NVFP4) or 90 (MXFP4) bytes."""
    cols = p.weight.scales.shape[-1]
    return p._replace(weight=FP4Tensor(p.weight.data, aligned_scale_rows(p.weight.scales)[..., :cols],
                                       p.weight.fmt.name, "linear", p.weight.global_scale))


def in_order(p, order):
    """``p`` (ExpertWeights) with its codes in ``order`` (a copy where it differs)."""
    return p._replace(weight=p.weight.with_code_order(order))


def run(name, tokens_list=(1, 8, 16), kernels=("moe_engine", "moe_weight_only"), configs=None, padded=False,
        fmt="nvfp4", orders=("checkpoint",)):
    e, h, i, k, act, bias = MODELS[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    pad = padded_scale_rows if padded else (lambda p: p)
    layers = [(pad(random_projection(e, 2 * i, h, g, fmt, bias)),
               pad(random_projection(e, h, i, g, fmt, bias))) for _ in range(COPIES)]
    if act == "silu" and fmt == "nvfp4":  # [E, 2] scales: gate's and up's (the same here)
        layers = [(gu._replace(global_scales=torch.stack([gu.global_scales, gu.global_scales], 1)), dn)
                  for gu, dn in layers]
    by_order = {order: layers if order == "checkpoint" else [(in_order(gu, order), in_order(dn, order))
                                                              for gu, dn in layers] for order in orders}
    for tokens in tokens_list:
        logits = [router_logits(type("M", (), {"experts": e})(), tokens, seed=1000 * tokens + c) for c in range(COPIES)]
        routes = [route(lg, k) if act == "gpt-oss" else route_softmax_topk(lg, k) for lg in logits]
        distinct = [int(torch.unique(ids).numel()) for ids, _ in routes]
        nbytes = int(statistics.mean(distinct) * (projection_bytes(2 * i, h, fmt, fmt == "nvfp4")
                                                   + projection_bytes(h, i, fmt, fmt == "nvfp4")))
        read_name, read_us = best_read(nbytes)
        x = torch.randn(tokens, h, device="cuda", generator=g).to(torch.bfloat16)
        h_in = torch.randn(tokens * k, i, device="cuda", generator=g).to(torch.bfloat16)
        gu_out = torch.empty(tokens, k, i, device="cuda", dtype=torch.bfloat16)
        d_out = torch.empty(tokens * k, 1, h, device="cuda", dtype=torch.float32)
        alpha, limit = (1.702, 7.0) if act == "gpt-oss" else (None, None)

        def make_part(which, kernel, config, layers):
            def launch(c):
                (gu, dn), (ids, w) = layers[c], routes[c]
                if which in ("both", "gate_up"):
                    fp4gemv.moe_gemv(gu.weight, x, ids, bias=gu.bias, global_scales=gu.global_scales, out=gu_out,
                                     check_ids=False, kernel=kernel, config=config, activation=act, alpha=alpha,
                                     limit=limit)
                if which in ("both", "down"):
                    fp4gemv.moe_gemv(dn.weight, h_in, ids.reshape(-1, 1), bias=dn.bias,
                                     global_scales=dn.global_scales, out=d_out, out_dtype=torch.float32,
                                     check_ids=False, kernel=kernel, config=config if which == "down" else
                                     (config if config is None else config), pair_weights=w.reshape(-1, 1))
            return launch

        for order in orders:
            for kernel in kernels:
                for config in ([None] if kernel != "moe_engine" or configs is None else [None] + configs):
                    def part(which, kernel, config, order=order):
                        return make_part(which, kernel, config, by_order[order])
                    try:
                        both = med(device_time_us(part("both", kernel, config), range(COPIES)))
                        gate = med(device_time_us(part("gate_up", kernel, config), range(COPIES)))
                        down = med(device_time_us(part("down", kernel, config), range(COPIES)))
                    except Exception as exc:  # noqa: BLE001
                        print(name, tokens, order, kernel, config, "FAILED", repr(exc)[:300], flush=True)
                        continue
                    row = dict(model=name, fmt=fmt, tokens=tokens, kernel=kernel, code_order=order,
                               config=None if config is None else list(config), distinct=statistics.mean(distinct),
                               mbytes=nbytes / 1e6, read=read_name, read_us=read_us, routed_us=both, gate_up_us=gate,
                               down_us=down, fraction=read_us / both)
                    rows_out.append(row)
                    print(f"{name:14s} {fmt} {order:10s} T={tokens:2d} {str(kernel):16s} {str(config):40s} routed "
                          f"{both:7.1f} us (gate_up {gate:6.1f}, down {down:6.1f}) read {read_us:6.1f} -> "
                          f"{read_us / both:.2f}", flush=True)
                    with open(os.path.join(OUT, "moe_engine_time.json"), "w") as f:
                        json.dump(rows_out, f, indent=1)
    del layers, by_order
    torch.cuda.empty_cache()


def split_times():
    """gpt-oss-20b gate_up (NVFP4, act) T = 1, 8: the chunk launch alone, the engine launch alone, both."""
    from fp4gemv import moe
    from fp4gemv.target import resolve_target
    from fp4gemv.kernels.moe_engine import moe_engine_launches
    e, h, i, k, act, bias = MODELS["gpt-oss-20b"]
    g = torch.Generator(device="cuda").manual_seed(0)
    gus = [random_projection(e, 2 * i, h, g, "nvfp4", bias) for _ in range(COPIES)]
    for tokens in (1, 8, 16):
        logits = [router_logits(type("M", (), {"experts": e})(), tokens, seed=1000 * tokens + c) for c in range(COPIES)]
        routes = [route(lg, k) for lg in logits]
        x = torch.randn(tokens, h, device="cuda", generator=g).to(torch.bfloat16)
        out = torch.empty(tokens, k, i, device="cuda", dtype=torch.bfloat16)
        target = resolve_target("auto", x.device)
        launches = []
        for c in range(COPIES):
            gu, ids = gus[c], routes[c][0]
            plan = moe.plan_moe(gu.weight, x, ids, gu.bias, gu.global_scales, out, torch.bfloat16, target,
                                "moe_engine", None, activation="gpt-oss", alpha=1.702, limit=7.0)
            ops = moe.moe_operands(plan, gu.weight, x, ids, gu.bias, gu.global_scales, out)
            launches.append(moe_engine_launches(ops, plan.config, target))

        def only(which):
            def launch(c):
                for j, (kern, grid, args, opts) in enumerate(launches[c]):
                    if which == "both" or which == j:
                        kern[grid](*args, **opts)
            return launch
        res = {w: med(device_time_us(only(w), range(COPIES))) for w in (0, 1, "both")}
        print(f"split gpt-oss-20b gate_up T={tokens}: chunk {res[0]:.1f} us, engine {res[1]:.1f} us, both {res['both']:.1f} us", flush=True)
        rows_out.append(dict(split=True, tokens=tokens, chunk_us=res[0], engine_us=res[1], both_us=res["both"]))


if __name__ == "__main__":
    t0 = time.time()
    sweep = len(sys.argv) > 1 and sys.argv[1] == "sweep"
    if len(sys.argv) > 1 and sys.argv[1] == "padded":
        fmt = sys.argv[2] if len(sys.argv) > 2 else "nvfp4"
        for name in MODELS:
            if fmt == "nvfp4" or name.startswith("gpt-oss"):
                run(name, tokens_list=(1, 2, 4, 8, 16), padded=True, fmt=fmt)
        print("total", time.time() - t0)
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "orders":
        fmt = sys.argv[2] if len(sys.argv) > 2 else "mxfp4"
        for name in sys.argv[3:] or MODELS:
            if fmt == "nvfp4" or name.startswith("gpt-oss"):
                run(name, padded=True, fmt=fmt, orders=("checkpoint", "native"), kernels=(None,))  # the default
        print("total", time.time() - t0)
        sys.exit(0)
    C = MoeEngineConfig
    configs = [C(2, 3, 8, 1, 168), C(4, 2, 8, 1, 168), C(4, 3, 8, 1, 200), C(2, 4, 8, 2, 128), C(2, 2, 8, 2, 128),
               C(1, 6, 8, 2, 128), C(2, 3, 4, 2, 128)] if sweep else None
    split_times()
    for name in MODELS:
        run(name, configs=configs if name == "gpt-oss-20b" else None)
    print("total", time.time() - t0)
