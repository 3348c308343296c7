"""``fp4gemv bench --model gpt-oss-20b | gpt-oss-120b``: the MoE layers of one decode step (GPU).

For T = 1, 8, 16 tokens with routing from seeded random router logits (top-4, softmax over the 4), on
``COPIES`` distinct layer copies (random MXFP4 expert bytes, e8m0 scales 2^-9 .. 2^-5, bf16 biases), each
timed in one CUDA graph replayed with L2 flushed (``timing.device_time_us``; median of 15, per layer):

* routed GEMVs: gate_up and down through ``fp4gemv.moe_gemv`` (down on a fixed activation), against the best
  read (``bench.stream.best_read``) of the distinct experts' bytes (packed data and scales, as the issue's
  table counts them); the default kernel (``kernels.MOE_KERNELS``' first that runs the case) and, beside it,
  the CUDA-core ``moe_general`` it replaced (``OLD_KERNEL``);
* the whole layer: top-k and softmax of the logits, ``nn.FP4Experts`` (gate_up, clamped SwiGLU, down,
  weighted combine);
* the same routed math with bf16 experts in plain torch: gather the pairs' expert weights, ``bmm``, the same
  activation and combine;
* the issue's ``triton_kernels`` figures (Triton 3.6.0 ``matmul_ogs``, fused SwiGLU, H200) beside.

A decode step is ``layers`` times the per-layer time (the layers are identical in shape).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from ..nn.moe import ExpertWeights, FP4Experts
from ..library import moe_gemv
from ..tensor import FP4Tensor
from .stream import best_read
from .timing import device_time_us

__all__ = ["MOE_MODELS", "MoeModel", "TRITON_KERNELS_US", "moe_benchmark", "format_moe_table", "expert_bytes",
           "random_projection", "router_logits", "route"]

COPIES = 8
# The routed kernel timed beside the default one: the CUDA-core path moe_gemv ran before the tensor-core step.
OLD_KERNEL = "moe_general"


@dataclass(frozen=True)
class MoeModel:
    """The MoE layers of a gpt-oss model (openai/gpt-oss configs: hidden 2880, intermediate 2880, top-4)."""

    name: str
    layers: int
    experts: int
    top_k: int = 4
    hidden: int = 2880
    intermediate: int = 2880


MOE_MODELS = {
    "gpt-oss-20b": MoeModel("gpt-oss-20b", layers=24, experts=32),
    "gpt-oss-120b": MoeModel("gpt-oss-120b", layers=36, experts=128),
}

# Issue 21's table: (distinct experts, their MB, triton_kernels us per layer: routing + gate_up + down).
TRITON_KERNELS_US = {
    ("gpt-oss-20b", 1): (4, 52.9, 78.8), ("gpt-oss-20b", 8): (19, 251.2, 143.1),
    ("gpt-oss-20b", 16): (26, 343.7, 170.4), ("gpt-oss-120b", 1): (4, 52.9, 80.1),
    ("gpt-oss-120b", 8): (29, 383.4, 187.1), ("gpt-oss-120b", 16): (53, 700.6, 295.0),
}


def expert_bytes(model: MoeModel) -> int:
    """Packed MXFP4 data and e8m0 scales of one expert's gate_up ``[2I, H]`` and down ``[H, I]``."""
    h, i = model.hidden, model.intermediate
    return 2 * i * (h // 2 + h // 32) + h * (i // 2 + i // 32)


def random_projection(experts: int, rows: int, k: int, g: torch.Generator) -> ExpertWeights:
    """Random MXFP4 expert bytes ``[E, rows, K]`` (linear scales 2^-9 .. 2^-5) and bf16 biases on ``g``'s device."""
    device = g.device
    data = torch.randint(0, 256, (experts, rows, k // 2), dtype=torch.uint8, device=device, generator=g)
    scales = torch.randint(127 - 9, 127 - 4, (experts, rows, k // 32), dtype=torch.uint8, device=device, generator=g)
    bias = torch.randn(experts, rows, device=device, generator=g).to(torch.bfloat16)
    return ExpertWeights(FP4Tensor(data, scales, "mxfp4", "linear"), bias)


def router_logits(model: MoeModel, tokens: int, seed: int, device="cuda") -> torch.Tensor:
    """Seeded random router logits ``[T, E]`` (bf16): the same routing for the same seed on any device."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, model.experts, generator=g).to(torch.bfloat16).to(device)


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids ``[T, k]``, weights ``[T, k]``): the top-k logits, softmax over the k."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    return ids, torch.softmax(top.float(), dim=-1)


def _gpt_oss_activation(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up[..., ::2].clamp(max=7.0), gate_up[..., 1::2].clamp(min=-7.0, max=7.0)
    return gate * torch.sigmoid(gate * 1.702) * (up + 1)


def _bf16_layer(w_gu, b_gu, w_d, b_d, x, ids, weights) -> torch.Tensor:
    """The routed layer with bf16 experts in plain torch: gather each pair's weights, bmm."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    xs = x.repeat_interleave(top_k, dim=0)[:, :, None]  # [P, H, 1]
    gate_up = torch.bmm(w_gu[flat], xs)[..., 0] + b_gu[flat]  # [P, 2I]
    h = _gpt_oss_activation(gate_up.float()).to(torch.bfloat16)
    y = torch.bmm(w_d[flat], h[:, :, None])[..., 0] + b_d[flat]  # [P, H]
    return (y.float().reshape(tokens, top_k, -1) * weights[..., None]).sum(1).to(torch.bfloat16)


def _median(times) -> float:
    return statistics.median(times)


def moe_benchmark(name: str, tokens_list=(1, 8, 16), copies: int = COPIES) -> list[dict]:
    """One row per T: the timings of the module docstring (microseconds per layer) and the step totals."""
    model = MOE_MODELS[name]
    e, h, i = model.experts, model.hidden, model.intermediate
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [FP4Experts(random_projection(e, 2 * i, h, g), random_projection(e, h, i, g), activation="gpt-oss")
              for _ in range(copies)]
    rows = []
    for tokens in tokens_list:
        logits = [router_logits(model, tokens, seed=1000 * tokens + c) for c in range(copies)]
        routes = [route(lg, model.top_k) for lg in logits]
        distinct = [int(torch.unique(ids).numel()) for ids, _ in routes]
        x = torch.randn(tokens, h, device="cuda", generator=g).to(torch.bfloat16)
        h_in = torch.randn(tokens * model.top_k, i, device="cuda", generator=g).to(torch.bfloat16)
        gu_out = torch.empty(tokens, model.top_k, 2 * i, device="cuda", dtype=torch.float32)
        d_out = torch.empty(tokens * model.top_k, 1, h, device="cuda", dtype=torch.float32)

        def routed_gemvs(c, kernel=None):
            layer, (ids, _) = layers[c], routes[c]
            gu, dn = layer.projection("gate_up"), layer.projection("down")
            moe_gemv(gu.weight, x, ids, bias=gu.bias, out=gu_out, out_dtype=torch.float32, check_ids=False,
                     kernel=kernel)
            moe_gemv(dn.weight, h_in, ids.reshape(-1, 1), bias=dn.bias, out=d_out, out_dtype=torch.float32,
                     check_ids=False, kernel=kernel)

        def whole_layer(c):
            ids, weights = route(logits[c], model.top_k)
            return layers[c](x, ids, weights)

        gemv_us = _median(device_time_us(routed_gemvs, range(copies)))
        old_us = _median(device_time_us(lambda c: routed_gemvs(c, OLD_KERNEL), range(copies)))
        layer_us = _median(device_time_us(whole_layer, range(copies)))
        nbytes = int(statistics.mean(distinct) * expert_bytes(model))
        read_name, read_us = best_read(nbytes)
        rows.append(dict(model=name, tokens=tokens, distinct_experts=statistics.mean(distinct), mbytes=nbytes / 1e6,
                         routed_gemv_us=gemv_us, best_read_us=read_us, best_read=read_name,
                         fraction_of_read=read_us / gemv_us, old_routed_gemv_us=old_us,
                         old_fraction_of_read=read_us / old_us, layer_us=layer_us, step_ms=layer_us * model.layers / 1e3))
    del layers
    torch.cuda.empty_cache()

    # bf16 experts: fewer copies where 8 would not fit next to the rest (gpt-oss-120b: 51 GB for 8).
    bf16_copies = min(copies, max(2, int(60e9 // (e * (2 * i * h + h * i) * 2))))
    bf16 = [(torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16),
             torch.randn(e, 2 * i, device="cuda", dtype=torch.bfloat16),
             torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16),
             torch.randn(e, h, device="cuda", dtype=torch.bfloat16)) for _ in range(bf16_copies)]
    for row in rows:
        tokens = row["tokens"]
        logits = [router_logits(model, tokens, seed=1000 * tokens + c) for c in range(bf16_copies)]
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)

        def bf16_layer(c):
            ids, weights = route(logits[c], model.top_k)
            return _bf16_layer(*bf16[c], x, ids, weights)

        row["bf16_torch_us"] = _median(device_time_us(bf16_layer, range(bf16_copies)))
        reference = TRITON_KERNELS_US.get((name, tokens))
        row["triton_kernels_us"] = reference[2] if reference else None
        row["speedup_vs_triton_kernels"] = reference[2] / row["layer_us"] if reference else None
    del bf16
    torch.cuda.empty_cache()
    return rows


def format_moe_table(rows: list[dict]) -> str:
    head = ("| model | T | experts | MB | routed GEMVs us | best read us | read/GEMVs | "
            f"{OLD_KERNEL} GEMVs us | read/{OLD_KERNEL} | layer us | step ms | bf16 torch us | triton_kernels us | "
            "vs triton_kernels |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        tk = "-" if r["triton_kernels_us"] is None else f"{r['triton_kernels_us']:.1f}"
        speed = "-" if r["speedup_vs_triton_kernels"] is None else f"{r['speedup_vs_triton_kernels']:.2f}x"
        lines.append(f"| {r['model']} | {r['tokens']} | {r['distinct_experts']:.1f} | {r['mbytes']:.1f} | "
                     f"{r['routed_gemv_us']:.1f} | {r['best_read_us']:.1f} | {r['fraction_of_read']:.2f} | "
                     f"{r['old_routed_gemv_us']:.1f} | {r['old_fraction_of_read']:.2f} | {r['layer_us']:.1f} | {r['step_ms']:.2f} | {r['bf16_torch_us']:.1f} | {tk} | {speed} |")
    return "\n".join(lines)
