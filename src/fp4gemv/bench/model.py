"""``fp4gemv bench --model llama3-8b | llama3-70b``: one decode token through a model's linear layers.

Every linear layer of the model's decoder (q, k, v, o, gate, up, down per layer; no attention, norms or
embeddings) as ``fp4gemv.nn.FP4Linear`` (NVFP4 weight-only, random weights: every byte value, e4m3 scales
2^-4 .. 2^3) and as bf16 ``nn.Linear`` (cuBLAS), for N = 1 and N = 8 tokens, timed two ways:

* in one CUDA graph (all layers of a token captured back to back, replayed with L2 flushed before each
  replay; median of the replays);
* eagerly (a Python loop over the modules, wall clock per token, synchronized at the end of each token).

Where the bf16 weights of every layer would not fit on one GPU (Llama-3-70B: 137 GB), a stated subset of the
layers is timed for both and the per-token figures are scaled to the whole model (the layers are identical,
so a token costs layers x the per-layer time).  Reported: microseconds and tokens/s per token of the linear
layers, the weight bytes each moves per token, and the FP4/bf16 ratios.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from ..nn import FP4Linear
from .timing import device_time_us

__all__ = ["MODELS", "ModelShape", "decode_benchmark", "format_decode_table"]


@dataclass(frozen=True)
class ModelShape:
    """The linear layers of a Llama-style decoder: ``layers`` blocks of q, k, v, o, gate, up, down."""

    name: str
    layers: int
    hidden: int
    kv: int
    intermediate: int
    timed_layers: int  # how many of them are built and timed (the rest scaled)

    def linear_shapes(self) -> list[tuple[str, int, int]]:
        """(name, out_features, in_features) of one block's linear layers."""
        h, kv, i = self.hidden, self.kv, self.intermediate
        return [("q", h, h), ("k", kv, h), ("v", kv, h), ("o", h, h), ("gate", i, h), ("up", i, h), ("down", h, i)]


MODELS = {
    "llama3-8b": ModelShape("llama3-8b", 32, 4096, 1024, 14336, timed_layers=32),
    # bf16 weights of all 80 layers are 137 GB: 20 layers (34 GB) are timed, scaled by 80 / 20.
    "llama3-70b": ModelShape("llama3-70b", 80, 8192, 1024, 28672, timed_layers=20),
}


def _fp4_layers(model: ModelShape, device) -> list:
    g = torch.Generator(device=device).manual_seed(0)
    layers = []
    for _ in range(model.timed_layers):
        for _, out_f, in_f in model.linear_shapes():
            m = FP4Linear(in_f, out_f, bias=False, fmt="nvfp4", scale_layout="swizzled", device=device)
            m.weight.copy_(torch.randint(0, 256, m.weight.shape, dtype=torch.uint8, device=device, generator=g))
            # e4m3 bytes 0x18..0x57: 2^-4 .. 2^3, every mantissa
            raw = torch.randint(0x18, 0x58, m.weight_scale.shape, dtype=torch.uint8, device=device, generator=g)
            m.weight_scale.copy_(raw.view(m.weight_scale.dtype))
            layers.append(m.to(torch.bfloat16))
    return layers


def _bf16_layers(model: ModelShape, device) -> list:
    layers = []
    for _ in range(model.timed_layers):
        for _, out_f, in_f in model.linear_shapes():
            layers.append(nn.Linear(in_f, out_f, bias=False, device=device, dtype=torch.bfloat16))
    return layers


def _inputs(model: ModelShape, n: int, device) -> dict[int, torch.Tensor]:
    return {in_f: torch.randn(n, in_f, device=device, dtype=torch.bfloat16) for _, _, in_f in model.linear_shapes()}


def _token(layers, inputs) -> None:
    for layer in layers:
        layer(inputs[layer.in_features])


def _graph_us(layers, inputs, replays: int = 10) -> float:
    """Median device time of one token (all layers) in a CUDA graph, L2 flushed before each replay."""
    return statistics.median(device_time_us(lambda _: _token(layers, inputs), [None], replays=replays))


def _eager_us(layers, inputs, tokens: int = 10) -> float:
    """Median wall-clock time of one eager token (a Python loop over the layers, synchronized per token)."""
    _token(layers, inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        _token(layers, inputs)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _weight_bytes(model: ModelShape, fp4: bool) -> int:
    per_block = 0
    for _, out_f, in_f in model.linear_shapes():
        per_block += out_f * in_f * (0.5 + 1 / 16) if fp4 else out_f * in_f * 2
    return int(per_block * model.layers)


def decode_benchmark(name: str, ns=(1, 8)) -> list[dict]:
    """Rows (model, N, kind, graph/eager us and tokens/s per token of all layers, bytes per token)."""
    model = MODELS[name]
    scale = model.layers / model.timed_layers
    rows = []
    for kind, build in (("fp4", _fp4_layers), ("bf16", _bf16_layers)):
        layers = build(model, "cuda")
        for n in ns:
            inputs = _inputs(model, n, "cuda")
            graph = _graph_us(layers, inputs) * scale
            eager = _eager_us(layers, inputs) * scale
            rows.append({"model": name, "n": n, "kind": kind, "layers": model.layers,
                         "timed_layers": model.timed_layers, "graph_us": graph, "eager_us": eager,
                         "graph_tokens_per_s": 1e6 / graph, "eager_tokens_per_s": 1e6 / eager,
                         "weight_bytes_per_token": _weight_bytes(model, kind == "fp4")})
        del layers
        torch.cuda.empty_cache()
    return rows


def format_decode_table(rows: list[dict]) -> str:
    lines = [f"{'model':<11} {'N':>2} {'kind':>4} {'GB/token':>8} {'graph us':>9} {'tok/s':>7} {'eager us':>9} "
             f"{'tok/s':>7} {'graph x':>7} {'eager x':>7}"]
    base = {(r["model"], r["n"]): r for r in rows if r["kind"] == "bf16"}
    for r in rows:
        b = base.get((r["model"], r["n"]))
        gx = b["graph_us"] / r["graph_us"] if b else float("nan")
        ex = b["eager_us"] / r["eager_us"] if b else float("nan")
        lines.append(f"{r['model']:<11} {r['n']:>2} {r['kind']:>4} {r['weight_bytes_per_token'] / 1e9:>8.2f} "
                     f"{r['graph_us']:>9.0f} {r['graph_tokens_per_s']:>7.1f} {r['eager_us']:>9.0f} "
                     f"{r['eager_tokens_per_s']:>7.1f} {gx:>7.2f} {ex:>7.2f}")
    if any(r["timed_layers"] != r["layers"] for r in rows):
        lines.append("(models with timed_layers < layers: that many layers timed, scaled to all)")
    return "\n".join(lines)
