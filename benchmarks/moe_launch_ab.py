"""Device script (round 20 of docs/performance.md): two launch-level choices of the MoE layer, each against its
alternative in one process, alternating.

    PYTHONPATH=src python benchmarks/moe_launch_ab.py grouping   -> grouping_ab.json in $OUT (or .)
    PYTHONPATH=src python benchmarks/moe_launch_ab.py pdl        -> pdl_ab.json

``grouping``: moe_weight_only's grouping of the pairs by a histogram over the experts (``PAIRWISE_PAIRS = 0``)
against pair against pair (``PAIRWISE_PAIRS = 256``), per part (gate_up with its activation, down with the routing
weights into fp32) of the three models' layers (``bench.moe``'s random experts and seeded routing, 8 copies) at
T = 1, 2, 4, 8 where moe_weight_only runs the part, the outputs compared bit for bit; then the layer table
(``bench.moe.moe_benchmark``) at T = 1, 2 with each.
``pdl``: the layer table at T = 1, 8, 16 with ``moe_route``'s and ``moe_combine``'s programmatic dependent launch
off and on.  Timing: ``bench.timing.device_time_us`` (one CUDA graph over the copies, L2 flushed, median of 15).
"""
import json
import os
import statistics
import sys
import time

import torch

from fp4gemv import moe, ops
from fp4gemv.bench import moe as bench_moe
from fp4gemv.bench.moe import MOE_MODELS, fused_route, random_experts, router_logits
from fp4gemv.bench.timing import device_time_us
from fp4gemv.kernels import moe_weight_only
from fp4gemv.kernels.moe_combine import MoeCombine
from fp4gemv.kernels.moe_route import MoeRoute

OUT = os.environ.get("OUT", ".")
MODELS = ("gpt-oss-20b", "gpt-oss-120b", "qwen3-30b-a3b")
COPIES = 8
GROUPING_TOKENS = (1, 2, 4, 8)
DEVICE, BACKEND = "cuda", "auto"  # tests/test_moe_launch_ab.py runs the script on the CPU's interpreter
GROUPINGS = {"histogram": 0, "pairwise": 256}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _save(name: str, rows: list) -> None:
    with open(os.path.join(OUT, name), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, rows=rows), f, indent=1)


def _layer_rows(name: str, tokens, variant: str, rows: list, out: str) -> None:
    for r in bench_moe.moe_benchmark(name, tokens_list=tokens):
        rows.append(dict(r, variant=variant))
        print(json.dumps({k: rows[-1].get(k) for k in ("model", "variant", "tokens", "routed_gemv_us", "routing_us",
                                                        "gate_up_act_us", "down_us", "combine_us", "layer_us")}),
              flush=True)
        _save(out, rows)


def grouping() -> None:
    rows, default = [], moe_weight_only.PAIRWISE_PAIRS
    for name in MODELS:
        model = MOE_MODELS[name]
        g = torch.Generator(device=DEVICE).manual_seed(0)
        layers = [random_experts(model, g) for _ in range(COPIES)]
        for tokens in GROUPING_TOKENS:
            routes = [fused_route(model, router_logits(model, tokens, seed=1000 * tokens + c, device=DEVICE))
                      for c in range(COPIES)]
            x = torch.randn(tokens, model.hidden, device=DEVICE, generator=g).to(torch.bfloat16)
            h = torch.randn(tokens * model.top_k, model.intermediate, device=DEVICE, generator=g).to(torch.bfloat16)

            def gate_up(c):
                p = layers[c].projection("gate_up")
                return moe.moe_gemv(p.weight, x, routes[c][0], bias=p.bias, global_scales=p.global_scales,
                                    check_ids=False, backend=BACKEND, **layers[c].activation_arguments())

            def down(c):
                p = layers[c].projection("down")
                return moe.moe_gemv(p.weight, h, routes[c][0].reshape(-1, 1), bias=p.bias,
                                    global_scales=p.global_scales, out_dtype=torch.float32, check_ids=False,
                                    pair_weights=routes[c][1].reshape(-1, 1), backend=BACKEND)

            for part, call in (("gate_up", gate_up), ("down", down)):
                p = layers[0].projection(part)
                if part == "gate_up":
                    plan = moe.prepare_moe(p.weight, x, routes[0][0], bias=p.bias, global_scales=p.global_scales,
                                           backend=BACKEND, **layers[0].activation_arguments()).plan
                else:
                    plan = moe.prepare_moe(p.weight, h, routes[0][0].reshape(-1, 1), bias=p.bias,
                                           global_scales=p.global_scales, out_dtype=torch.float32,
                                           pair_weights=routes[0][1].reshape(-1, 1), backend=BACKEND).plan
                row = dict(model=name, tokens=tokens, part=part, kernel=plan.spec.name)
                if plan.spec.name == "moe_weight_only":
                    outs = {}
                    for _ in range(2):
                        for variant, limit in GROUPINGS.items():
                            moe_weight_only.PAIRWISE_PAIRS = limit
                            ops.clear_cache()
                            if variant not in outs:
                                outs[variant] = [call(c).clone() for c in range(COPIES)]
                            row.setdefault(variant + "_us", []).append(
                                statistics.median(device_time_us(call, range(COPIES))))
                    row["bit_equal"] = all(torch.equal(_bits(a), _bits(b))
                                           for a, b in zip(outs["histogram"], outs["pairwise"]))
                rows.append(row)
                print(json.dumps(row), flush=True)
                _save("grouping_ab.json", rows)
        del layers
    for name in MODELS:
        for variant, limit in GROUPINGS.items():
            moe_weight_only.PAIRWISE_PAIRS = limit
            ops.clear_cache()
            _layer_rows(name, (1, 2), variant, rows, "grouping_ab.json")
    moe_weight_only.PAIRWISE_PAIRS = default


def pdl() -> None:
    rows = []
    route_default, combine_default = MoeRoute.default_config, MoeCombine.default_config
    for _ in range(2):
        for name in MODELS:
            for variant in ("off", "on"):
                MoeRoute.default_config = lambda self, case, target, on=variant == "on": route_default(
                    self, case, target)._replace(pdl=on)
                MoeCombine.default_config = lambda self, case, target, on=variant == "on": combine_default(
                    self, case, target)._replace(pdl=on)
                ops.clear_cache()
                _layer_rows(name, (1, 8, 16), variant, rows, "pdl_ab.json")
    MoeRoute.default_config, MoeCombine.default_config = route_default, combine_default


if __name__ == "__main__":
    start = time.time()
    {"grouping": grouping, "pdl": pdl}[sys.argv[1] if len(sys.argv) > 1 else "grouping"]()
    print("done", time.time() - start)
