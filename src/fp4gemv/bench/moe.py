"""``fp4gemv bench --model gpt-oss-20b | gpt-oss-120b | qwen3-30b-a3b``: the MoE layers of one decode step (GPU).

Each model is one :class:`MoeModel` (``MOE_MODELS``): its shapes, expert format, activation and routing.

* gpt-oss-20b / gpt-oss-120b (openai/gpt-oss configs): hidden 2880, intermediate 2880, top-4 of 32 / 128,
  MXFP4 experts (random bytes, e8m0 scales 2^-9 .. 2^-5) with bf16 biases, gate and up interleaved in one
  gate_up projection, clamped SwiGLU; routing: top-4 of the logits, softmax over the 4 (``route``).
* qwen3-30b-a3b (Qwen/Qwen3-30B-A3B config): hidden 2048, expert intermediate 768, top-8 of 128, 48 layers,
  NVFP4 experts as ``nn.moe.nvfp4_experts`` builds them: gate and up two projections, per-expert fp32 global
  scales (random powers of two 2^-8 .. 2^-4), random e2m1 bytes, e4m3 block-scale bytes 0x28 .. 0x47 (normal
  positive values 0.25 .. 3.75, never the NaN bytes 0x7F / 0xFF), no bias; ``silu(gate) * up``; routing:
  softmax of all 128 logits in fp32, top-8, renormalised over the 8 (norm_topk_prob), rounded to the logits'
  dtype (transformers 5.17 ``Qwen3MoeTopKRouter``; ``route_softmax_topk``).

For T = 1, 8, 16 tokens with routing from seeded random bf16 router logits, on ``COPIES`` distinct layer copies,
each measurement one CUDA graph of one launch sequence per copy, replayed with L2 flushed
(``timing.device_time_us``; median of 15, per layer):

* routed GEMVs: the layer's two ``fp4gemv.moe_gemv`` launches, gate_up with its activation (qwen3's gate and up
  stacked into one projection by FP4Experts) and down times the routing weights (on a fixed activation), against the best read (``bench.stream.best_read``) of the distinct experts' bytes
  (``expert_bytes``: packed data and block scales, NVFP4's 4-byte global scales; not the biases, as the issue's
  table counts them); beside it, at T = 1 only (``OLD_KERNEL_TOKENS``: at T = 8, 16 it takes milliseconds per
  layer), the CUDA-core ``moe_general`` that the tensor-core kernel replaced (``OLD_KERNEL``);
* the layer's parts, each in its own graph: routing (logits to ids and weights in one launch, ``fused_route``:
  ``fp4gemv.moe_route``), gate_up with the activation
  (``FP4Experts.activated``), down times the routing weights (``FP4Experts.weighted_down``, on each copy's
  activation) and the combine (``FP4Experts.combine``, on each copy's weighted outputs);
* the whole layer: ``fused_route`` and ``FP4Experts.forward``;
* the same routed math with bf16 experts in plain torch (torch routing, ``model_route``; ``_bf16_layer``: gather the pairs' expert weights,
  ``bmm``, the model's activation, combine), on as many copies as fit in 60 GB;
* the issue's ``triton_kernels`` figures (Triton 3.6.0 ``matmul_ogs``, fused SwiGLU, H200) beside: gpt-oss only.

Host time (``timing.host_time_us``, the same process, T = 1): one eager ``moe_gemv`` of gate_up's shape (as
``FP4Experts`` calls it: fp32 out, ids unchecked) and one eager ``FP4Experts.forward``, each as a ratio to
``x.add_(1)`` (measured before and after, averaged).

A decode step is ``layers`` times the per-layer time (the layers are identical in shape).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..library import moe_gemv, moe_route
from ..nn.moe import ExpertWeights, FP4Experts
from ..tensor import FP4Tensor
from .stream import best_read
from .timing import device_time_us, host_time_us

__all__ = ["MOE_MODELS", "MoeModel", "TRITON_KERNELS_US", "ROUTINGS", "moe_benchmark", "format_moe_table",
           "expert_bytes", "projection_bytes", "random_projection", "random_experts", "router_logits", "route",
           "route_softmax_topk", "model_route", "fused_route", "moe_host_costs"]

COPIES = 8
# The routed kernel timed beside the default one: the CUDA-core path moe_gemv ran before the tensor-core step;
# only at these T (it took 4.6 and 10.1 ms per gpt-oss-20b layer at T = 8 and 16).
OLD_KERNEL = "moe_general"
OLD_KERNEL_TOKENS = (1,)
# Block-scale bytes per element: one e4m3 per 16 (NVFP4), one e8m0 per 32 (MXFP4).
SCALE_BLOCK = {"nvfp4": 16, "mxfp4": 32}
# Random NVFP4 block-scale bytes, [low, high): e4m3 exponent fields 5 .. 8, normal positive 0.25 .. 3.75.
NVFP4_SCALE_BYTES = (0x28, 0x48)
# Random per-expert global scales 2^-e for e in [low, high): 2^-8 .. 2^-4.
GLOBAL_SCALE_EXPONENTS = (4, 9)


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss: (ids ``[T, k]``, fp32 weights ``[T, k]``): the top-k logits, softmax over the k."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    return ids, torch.softmax(top.float(), dim=-1)


def route_softmax_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE (``norm_topk_prob=True``): (ids ``[T, k]``, weights ``[T, k]`` in the logits' dtype): softmax of
    all E logits in fp32, the top k probabilities renormalised to sum to 1, rounded once to the logits' dtype."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, top_k, dim=-1)
    return ids, (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype)


ROUTINGS = {"topk-softmax": route, "softmax-topk-norm": route_softmax_topk}


@dataclass(frozen=True)
class MoeModel:
    """The MoE layers of one model: shapes, the experts' format (``"mxfp4"`` / ``"nvfp4"``; NVFP4 with per-expert
    global scales), the ``FP4Experts`` activation (``"gpt-oss"``: gate and up interleaved in one gate_up with
    biases; ``"silu"``), whether gate and up are two projections, biases, and the routing (a ``ROUTINGS`` key).
    The defaults are gpt-oss's."""

    name: str
    layers: int
    experts: int
    top_k: int = 4
    hidden: int = 2880
    intermediate: int = 2880
    fmt: str = "mxfp4"
    activation: str = "gpt-oss"
    routing: str = "topk-softmax"
    separate_gate_up: bool = False
    bias: bool = True

    def __post_init__(self) -> None:
        if self.fmt not in SCALE_BLOCK:
            raise ValueError(f"fmt: expected one of {sorted(SCALE_BLOCK)}, got {self.fmt!r}")
        if self.activation not in ("gpt-oss", "silu"):
            raise ValueError(f"activation: expected 'gpt-oss' or 'silu', got {self.activation!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing: expected one of {sorted(ROUTINGS)}, got {self.routing!r}")
        if self.activation == "gpt-oss" and self.separate_gate_up:
            raise ValueError("separate_gate_up: gpt-oss's gate and up are interleaved in one projection")


MOE_MODELS = {
    "gpt-oss-20b": MoeModel("gpt-oss-20b", layers=24, experts=32),
    "gpt-oss-120b": MoeModel("gpt-oss-120b", layers=36, experts=128),
    "qwen3-30b-a3b": MoeModel("qwen3-30b-a3b", layers=48, experts=128, top_k=8, hidden=2048, intermediate=768,
                              fmt="nvfp4", activation="silu", routing="softmax-topk-norm", separate_gate_up=True,
                              bias=False),
}

# Issue 21's table: (distinct experts, their MB, triton_kernels us per layer: routing + gate_up + down).
TRITON_KERNELS_US = {
    ("gpt-oss-20b", 1): (4, 52.9, 78.8), ("gpt-oss-20b", 8): (19, 251.2, 143.1),
    ("gpt-oss-20b", 16): (26, 343.7, 170.4), ("gpt-oss-120b", 1): (4, 52.9, 80.1),
    ("gpt-oss-120b", 8): (29, 383.4, 187.1), ("gpt-oss-120b", 16): (53, 700.6, 295.0),
}


def projection_bytes(rows: int, k: int, fmt: str, global_scale: bool = False) -> int:
    """One expert's ``[rows, K]`` projection: packed e2m1 data, one block-scale byte per 16 (NVFP4) or 32 (MXFP4)
    elements, and the 4-byte fp32 global scale where it has one."""
    return rows * (k // 2 + k // SCALE_BLOCK[fmt]) + (4 if global_scale else 0)


def _projection_shapes(model: MoeModel) -> list[tuple[int, int]]:
    h, i = model.hidden, model.intermediate
    gate_up = [(i, h), (i, h)] if model.separate_gate_up else [(2 * i, h)]
    return [*gate_up, (h, i)]


def expert_bytes(model: MoeModel) -> int:
    """The bytes of one expert that the routed GEMVs read: gate_up ``[2I, H]`` (or gate and up ``[I, H]``) and
    down ``[H, I]`` (``projection_bytes``; NVFP4 with each projection's per-expert global scale).  Biases are
    left out, as the issue's table counts them (gpt-oss: 2I + H bf16, 0.13% of an expert)."""
    nvfp4 = model.fmt == "nvfp4"
    return sum(projection_bytes(rows, k, model.fmt, nvfp4) for rows, k in _projection_shapes(model))


def random_projection(experts: int, rows: int, k: int, g: torch.Generator, fmt: str = "mxfp4",
                      bias: bool = True) -> ExpertWeights:
    """Random expert bytes ``[E, rows, K]`` with linear scales on ``g``'s device: MXFP4 with e8m0 scales
    2^-9 .. 2^-5; NVFP4 with e4m3 scale bytes ``NVFP4_SCALE_BYTES`` and per-expert fp32 global scales
    2^-8 .. 2^-4; bf16 biases ``[E, rows]`` if ``bias``."""
    device = g.device
    data = torch.randint(0, 256, (experts, rows, k // 2), dtype=torch.uint8, device=device, generator=g)
    global_scales = None
    if fmt == "mxfp4":
        scales = torch.randint(127 - 9, 127 - 4, (experts, rows, k // 32), dtype=torch.uint8, device=device,
                               generator=g)
    elif fmt == "nvfp4":
        scales = torch.randint(*NVFP4_SCALE_BYTES, (experts, rows, k // 16), dtype=torch.uint8, device=device,
                               generator=g)
        exponents = torch.randint(*GLOBAL_SCALE_EXPONENTS, (experts,), device=device, generator=g)
        global_scales = torch.exp2(-exponents.to(torch.float32))
    else:
        raise ValueError(f"fmt: expected 'mxfp4' or 'nvfp4', got {fmt!r}")
    b = torch.randn(experts, rows, device=device, generator=g).to(torch.bfloat16) if bias else None
    return ExpertWeights(FP4Tensor(data, scales, fmt, "linear"), b, global_scales)


def random_experts(model: MoeModel, g: torch.Generator, backend: str = "auto") -> FP4Experts:
    """One layer's FP4Experts of ``model`` with random bytes (``random_projection``) on ``g``'s device: gate_up
    (or gate and up, as ``nn.moe.nvfp4_experts`` builds them), then down."""
    e, h, i = model.experts, model.hidden, model.intermediate

    def projection(rows: int, k: int) -> ExpertWeights:
        return random_projection(e, rows, k, g, model.fmt, model.bias)

    gate_up = (projection(i, h), projection(i, h)) if model.separate_gate_up else projection(2 * i, h)
    return FP4Experts(gate_up, projection(h, i), activation=model.activation, backend=backend)


def router_logits(model: MoeModel, tokens: int, seed: int, device="cuda") -> torch.Tensor:
    """Seeded random router logits ``[T, E]`` (bf16): the same routing for the same seed on any device."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, model.experts, generator=g).to(torch.bfloat16).to(device)


def model_route(model: MoeModel, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s routing of ``logits`` ``[T, E]`` in plain torch, as transformers does it: (ids, weights)."""
    return ROUTINGS[model.routing](logits, model.top_k)


def fused_route(model: MoeModel, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same routing in one launch (``fp4gemv.moe_route``: softmax over the k selected logits, which is
    Qwen3's renormalised top-k too), the weights in ``model_route``'s dtype: what the FP4 layer is timed with."""
    dtype = logits.dtype if model.routing == "softmax-topk-norm" else torch.float32  # as ROUTINGS' functions
    return moe_route(logits, model.top_k, weights="softmax_selected", out_dtype=dtype)


def _gpt_oss_activation(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up[..., ::2].clamp(max=7.0), gate_up[..., 1::2].clamp(min=-7.0, max=7.0)
    return gate * torch.sigmoid(gate * 1.702) * (up + 1)


def _bf16_layer(w_gu, b_gu, w_d, b_d, x, ids, weights, activation: str = "gpt-oss") -> torch.Tensor:
    """The routed layer with bf16 experts in plain torch: gather each pair's weights, bmm.  gate_up ``[E, 2I, H]``
    (gpt-oss: interleaved rows; "silu": gate the first half, as transformers' ``Qwen3MoeExperts``), down
    ``[E, H, I]``; biases ``[E, 2I]``, ``[E, H]`` or None."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    xs = x.repeat_interleave(top_k, dim=0)[:, :, None]  # [P, H, 1]
    gate_up = torch.bmm(w_gu[flat], xs)[..., 0]  # [P, 2I]
    if b_gu is not None:
        gate_up = gate_up + b_gu[flat]
    if activation == "gpt-oss":
        h = _gpt_oss_activation(gate_up.float())
    else:
        gate, up = gate_up.float().chunk(2, dim=-1)
        h = F.silu(gate) * up
    y = torch.bmm(w_d[flat], h.to(torch.bfloat16)[:, :, None])[..., 0]  # [P, H]
    if b_d is not None:
        y = y + b_d[flat]
    return (y.float().reshape(tokens, top_k, -1) * weights.float()[..., None]).sum(1).to(torch.bfloat16)


def _median(times) -> float:
    return statistics.median(times)


def moe_host_costs(model: MoeModel, layer: FP4Experts) -> dict:
    """Host microseconds per eager call at T = 1 (``timing.host_time_us``): ``x.add_(1)`` (before and after,
    averaged), one ``moe_gemv`` of gate_up's shape as FP4Experts calls it, one ``FP4Experts.forward``; ratios."""
    device = layer.projection("down").weight.device
    small = torch.zeros(16, device=device)
    add_before = host_time_us(lambda: small.add_(1))
    x = torch.randn(1, model.hidden, device=device).to(torch.bfloat16)
    ids, weights = fused_route(model, router_logits(model, 1, seed=0, device=device))
    gu = layer.projection("gate_up")
    gemv_us = host_time_us(lambda: moe_gemv(gu.weight, x, ids, bias=gu.bias, global_scales=gu.global_scales,
                                            check_ids=False, **layer.activation_arguments()))
    forward_us = host_time_us(lambda: layer(x, ids, weights))
    add_us = (add_before + host_time_us(lambda: small.add_(1))) / 2
    return dict(host_add_us=add_us, host_moe_gemv_us=gemv_us, host_moe_gemv_vs_add=gemv_us / add_us,
                host_forward_us=forward_us, host_forward_vs_add=forward_us / add_us)


def moe_benchmark(name: str, tokens_list=(1, 8, 16), copies: int = COPIES,
                  old_kernel_tokens=OLD_KERNEL_TOKENS, device="cuda") -> list[dict]:
    """One row per T: the timings of the module docstring (microseconds per layer), the step totals and the
    model's host costs (the same in every row).  ``device``: CUDA (timing needs it; a CPU runs it only with the
    timing stubbed, as the tests do)."""
    model = MOE_MODELS[name]
    e, h, i, top_k = model.experts, model.hidden, model.intermediate, model.top_k
    g = torch.Generator(device=device).manual_seed(0)
    layers = [random_experts(model, g) for _ in range(copies)]
    host = moe_host_costs(model, layers[0])
    rows = []
    for tokens in tokens_list:
        logits = [router_logits(model, tokens, seed=1000 * tokens + c, device=device) for c in range(copies)]
        routes = [fused_route(model, lg) for lg in logits]
        distinct = [int(torch.unique(ids).numel()) for ids, _ in routes]
        x = torch.randn(tokens, h, device=device, generator=g).to(torch.bfloat16)
        h_in = torch.randn(tokens * top_k, i, device=device, generator=g).to(torch.bfloat16)
        gu_out = torch.empty(tokens, top_k, i, device=device, dtype=torch.bfloat16)
        d_out = torch.empty(tokens * top_k, 1, h, device=device, dtype=torch.float32)

        def routed_gemvs(c, kernel=None):
            layer, (ids, _) = layers[c], routes[c]
            gu, dn = layer.projection("gate_up"), layer.projection("down")
            moe_gemv(gu.weight, x, ids, bias=gu.bias, global_scales=gu.global_scales, out=gu_out, check_ids=False,
                     kernel=kernel, **layer.activation_arguments())
            moe_gemv(dn.weight, h_in, ids.reshape(-1, 1), bias=dn.bias, global_scales=dn.global_scales, out=d_out,
                     out_dtype=torch.float32, check_ids=False, kernel=kernel,
                     pair_weights=routes[c][1].reshape(-1, 1))

        # Each part's inputs per copy, made once outside the graphs (the previous part's results).
        activations = [layers[c].activated(x, routes[c][0]) for c in range(copies)]
        weighted = [layers[c].weighted_down(activations[c], *routes[c]) for c in range(copies)]

        def whole_layer(c):
            ids, weights = fused_route(model, logits[c])
            return layers[c](x, ids, weights)

        parts = {
            "routing_us": lambda c: fused_route(model, logits[c]),
            "gate_up_act_us": lambda c: layers[c].activated(x, routes[c][0]),
            "down_us": lambda c: layers[c].weighted_down(activations[c], *routes[c]),
            "combine_us": lambda c: layers[c].combine(weighted[c], x.dtype),
            "layer_us": whole_layer,
        }
        gemv_us = _median(device_time_us(routed_gemvs, range(copies)))
        timed = {key: _median(device_time_us(launch, range(copies))) for key, launch in parts.items()}
        old_us = (_median(device_time_us(lambda c: routed_gemvs(c, OLD_KERNEL), range(copies)))
                  if tokens in old_kernel_tokens else None)
        nbytes = int(statistics.mean(distinct) * expert_bytes(model))
        read_name, read_us = best_read(nbytes)
        rows.append(dict(model=name, fmt=model.fmt, tokens=tokens, distinct_experts=statistics.mean(distinct),
                         mbytes=nbytes / 1e6, best_read=read_name, best_read_us=read_us, routed_gemv_us=gemv_us,
                         fraction_of_read=read_us / gemv_us, old_routed_gemv_us=old_us,
                         old_fraction_of_read=None if old_us is None else read_us / old_us, **timed,
                         step_ms=timed["layer_us"] * model.layers / 1e3, **host))
        del activations, weighted
    del layers
    torch.cuda.empty_cache()

    # bf16 experts: fewer copies where 8 would not fit next to the rest (gpt-oss-120b: 51 GB for 8).
    bf16_copies = min(copies, max(2, int(60e9 // (e * (2 * i * h + h * i) * 2))))

    def bf16_bias(rows_: int):
        return torch.randn(e, rows_, device=device, dtype=torch.bfloat16) if model.bias else None

    bf16 = [(torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16), bf16_bias(2 * i),
             torch.randn(e, h, i, device=device, dtype=torch.bfloat16), bf16_bias(h)) for _ in range(bf16_copies)]
    for row in rows:
        tokens = row["tokens"]
        logits = [router_logits(model, tokens, seed=1000 * tokens + c, device=device) for c in range(bf16_copies)]
        x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)

        def bf16_layer(c):
            ids, weights = model_route(model, logits[c])
            return _bf16_layer(*bf16[c], x, ids, weights, activation=model.activation)

        row["bf16_torch_us"] = _median(device_time_us(bf16_layer, range(bf16_copies)))
        row["bf16_copies"] = bf16_copies
        row["speedup_vs_bf16"] = row["bf16_torch_us"] / row["layer_us"]
        reference = TRITON_KERNELS_US.get((name, tokens))
        row["triton_kernels_us"] = reference[2] if reference else None
        row["speedup_vs_triton_kernels"] = reference[2] / row["layer_us"] if reference else None
    del bf16
    torch.cuda.empty_cache()
    return rows


def _cell(value, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_moe_table(rows: list[dict]) -> str:
    """The rows as a markdown table (microseconds per layer; "-" where not measured or no figure exists), then
    each model's host costs per eager call."""
    head = ("| model | T | experts | MB | best read us | routed GEMVs us (x read) | "
            f"{OLD_KERNEL} GEMVs us (x read) | routing us | gate_up+act us | down us | combine us | layer us | "
            "step ms | triton_kernels us | layer vs triton_kernels | bf16 torch us | layer vs bf16 |")
    lines = [head, "|" + "---|" * 17]
    for r in rows:
        old = "-" if r["old_routed_gemv_us"] is None else \
            f"{r['old_routed_gemv_us']:.1f} ({r['old_fraction_of_read']:.2f})"
        lines.append(
            f"| {r['model']} | {r['tokens']} | {r['distinct_experts']:.1f} | {r['mbytes']:.1f} | "
            f"{r['best_read_us']:.1f} | {r['routed_gemv_us']:.1f} ({r['fraction_of_read']:.2f}) | {old} | "
            f"{r['routing_us']:.1f} | {r['gate_up_act_us']:.1f} | {r['down_us']:.1f} | {r['combine_us']:.1f} | "
            f"{r['layer_us']:.1f} | {r['step_ms']:.2f} | {_cell(r['triton_kernels_us'])} | "
            f"{_cell(r['speedup_vs_triton_kernels'], '.2f', 'x')} | {_cell(r.get('bf16_torch_us'))} | "
            f"{_cell(r.get('speedup_vs_bf16'), '.2f', 'x')} |")
    lines.append("")
    seen = set()
    for r in rows:
        if r["model"] in seen:
            continue
        seen.add(r["model"])
        lines.append(f"host per eager call, T = 1, {r['model']}: x.add_(1) {r['host_add_us']:.2f} us; moe_gemv "
                     f"(gate_up) {r['host_moe_gemv_us']:.2f} us = {r['host_moe_gemv_vs_add']:.2f}x x.add_(1); "
                     f"FP4Experts.forward {r['host_forward_us']:.2f} us = {r['host_forward_vs_add']:.2f}x x.add_(1)")
    return "\n".join(lines)
