"""The MoE benchmark's CPU-checkable parts: the bytes it counts, its routings, the random expert layers it builds,
its bf16 torch baselines' math, its table and the command line that runs it (the timing itself needs a GPU)."""

import json

import pytest
import torch
import torch.nn.functional as F

from fp4gemv import dequantize
from fp4gemv.bench import moe as bench_moe
from fp4gemv.bench.moe import (MOE_MODELS, OLD_KERNEL, TRITON_KERNELS_US, MoeModel, _bf16_layer, expert_bytes, format_moe_table,
                               fused_route, model_route, random_experts, route, route_softmax_topk, router_logits)
from fp4gemv.formats import decode_e4m3
from fp4gemv.nn.moe import FP4Experts


def test_expert_bytes_match_the_issue_table():
    """The issue's MB column is distinct experts x (packed data + e8m0 scales of gate_up and down)."""
    for (name, _), (distinct, mbytes, _) in TRITON_KERNELS_US.items():
        assert distinct * expert_bytes(MOE_MODELS[name]) / 1e6 == pytest.approx(mbytes, abs=0.06)


def test_expert_bytes_per_format():
    """MXFP4: K/2 data + K/32 e8m0 bytes per row (no global scale); NVFP4: K/2 + K/16 e4m3 bytes per row and one
    fp32 global scale per projection (gate, up, down) per expert."""
    gpt_oss = 2 * 2880 * (1440 + 90) + 2880 * (1440 + 90)
    assert expert_bytes(MOE_MODELS["gpt-oss-20b"]) == expert_bytes(MOE_MODELS["gpt-oss-120b"]) == gpt_oss
    qwen3 = 2 * 768 * (1024 + 128) + 2048 * (384 + 48) + 3 * 4
    assert expert_bytes(MOE_MODELS["qwen3-30b-a3b"]) == qwen3 == 2_654_220


def test_models_are_described_in_one_place():
    q = MOE_MODELS["qwen3-30b-a3b"]
    assert (q.hidden, q.intermediate, q.experts, q.top_k, q.layers) == (2048, 768, 128, 8, 48)
    assert (q.fmt, q.activation, q.routing, q.separate_gate_up, q.bias) == ("nvfp4", "silu", "softmax-topk-norm",
                                                                           True, False)
    for name in ("gpt-oss-20b", "gpt-oss-120b"):
        m = MOE_MODELS[name]
        assert (m.hidden, m.intermediate, m.top_k) == (2880, 2880, 4)
        assert (m.fmt, m.activation, m.routing, m.separate_gate_up, m.bias) == ("mxfp4", "gpt-oss", "topk-softmax",
                                                                               False, True)
    with pytest.raises(ValueError, match="routing"):
        MoeModel("x", layers=1, experts=4, routing="sigmoid")


def test_qwen3_routing_is_softmax_top8_renormalised():
    """softmax of all 128 logits, the 8 largest probabilities, renormalised: against float64 (ids up to ties,
    which have equal probabilities; weights within the final bf16 rounding)."""
    model = MOE_MODELS["qwen3-30b-a3b"]
    logits = router_logits(model, 16, seed=3, device="cpu")
    ids, weights = model_route(model, logits)
    assert ids.shape == weights.shape == (16, 8) and weights.dtype == torch.bfloat16
    assert torch.equal(ids, route_softmax_topk(logits, 8)[0])
    probs = torch.softmax(logits.double(), dim=-1)
    top = probs.topk(8, dim=-1).values
    assert torch.equal(probs.gather(1, ids), top)  # the 8 most probable experts, in descending order
    want = top / top.sum(dim=-1, keepdim=True)
    assert ((weights.double() - want).abs() <= 2.0**-8 * want).all()
    assert ((weights.double().sum(-1) - 1).abs() <= 8 * 2.0**-8).all()


def test_gpt_oss_routing_is_unchanged():
    """top-4 of the logits, softmax over the 4, in fp32 (benchmarks/moe_sweep.py calls ``route`` too)."""
    model = MOE_MODELS["gpt-oss-20b"]
    logits = router_logits(model, 8, seed=5, device="cpu")
    ids, weights = model_route(model, logits)
    top = logits.double().gather(1, ids)
    assert torch.equal(top, logits.double().topk(4, dim=-1).values)
    assert weights.dtype == torch.float32 and torch.allclose(weights.double(), torch.softmax(top, -1), atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip((ids, weights), route(logits, 4)))


def _per_pair_reference(bf, x, ids, weights, activation):
    """The routed layer in float64 one (token, expert) pair at a time, activation rounded to bf16 like the layer."""
    w_gu, b_gu, w_d, b_d = bf
    tokens, top_k = ids.shape
    want = torch.zeros(tokens, w_d.shape[1], dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            k = int(ids[t, j])
            gu = w_gu[k].double() @ x[t].double() + (0 if b_gu is None else b_gu[k].double())
            if activation == "gpt-oss":
                gate, up = gu[::2].clamp(max=7.0), gu[1::2].clamp(-7.0, 7.0)
                act = gate * torch.sigmoid(1.702 * gate) * (up + 1)
            else:
                gate, up = gu.chunk(2)
                act = F.silu(gate) * up
            want[t] += weights[t, j].double() * (w_d[k].double() @ act + (0 if b_d is None else b_d[k].double()))
    return want


def test_bf16_baseline_is_the_routed_gpt_oss_layer():
    """gather + bmm against a per-pair float64 loop of the same layer (bf16 roundings: 2^-6 of the scale)."""
    g = torch.Generator().manual_seed(0)
    e, h, i, tokens, top_k = 6, 32, 16, 3, 2
    w_gu, b_gu = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, 2 * i, generator=g)
    w_d, b_d = torch.randn(e, h, i, generator=g) / 4, torch.randn(e, h, generator=g)
    x = (torch.randn(tokens, h, generator=g) / 4).to(torch.bfloat16)
    ids = torch.tensor([[0, 5], [5, 2], [1, 0]])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    bf = [t.to(torch.bfloat16) for t in (w_gu, b_gu, w_d, b_d)]
    got = _bf16_layer(*bf, x, ids, weights)
    want = _per_pair_reference(bf, x, ids, weights, "gpt-oss")
    err = (got.double() - want).abs().max().item()
    assert err <= 2.0**-6 * want.abs().max().item(), err


def test_bf16_baseline_is_the_routed_silu_layer():
    """The qwen3 baseline (no bias, gate the first half of gate_up, silu(gate) * up, bf16 routing weights)
    against the per-pair float64 loop."""
    g = torch.Generator().manual_seed(1)
    e, h, i, tokens, top_k = 8, 32, 16, 4, 3
    w_gu, w_d = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g) / 4
    x = (torch.randn(tokens, h, generator=g) / 4).to(torch.bfloat16)
    ids, weights = route_softmax_topk(torch.randn(tokens, e, generator=g).to(torch.bfloat16), top_k)
    bf = [w_gu.to(torch.bfloat16), None, w_d.to(torch.bfloat16), None]
    got = _bf16_layer(*bf, x, ids, weights, activation="silu")
    want = _per_pair_reference(bf, x, ids, weights, "silu")
    err = (got.double() - want).abs().max().item()
    assert err <= 2.0**-6 * want.abs().max().item(), err
    # Not the gpt-oss activation by accident: the two differ on the same weights.
    other = _bf16_layer(bf[0], torch.zeros(e, 2 * i, dtype=torch.bfloat16), bf[2], None, x, ids, weights)
    assert (other.double() - want).abs().max().item() > 0.1 * want.abs().max().item()


TINY_QWEN3 = MoeModel("tiny-qwen3", layers=1, experts=6, top_k=2, hidden=64, intermediate=32, fmt="nvfp4",
                      activation="silu", routing="softmax-topk-norm", separate_gate_up=True, bias=False)


def test_random_nvfp4_experts_are_a_valid_layer():
    """random_experts for an NVFP4 SiLU model on the CPU (tiny sizes): gate and up as two projections like
    nn.moe.nvfp4_experts, e4m3 scale bytes normal and positive, per-expert global scales powers of two in
    2^-8 .. 2^-4, no bias; activated and forward (the float64 reference backend) against float64 math on the
    dequantized weights times their global scales."""
    layer = random_experts(TINY_QWEN3, torch.Generator().manual_seed(0))
    assert isinstance(layer, FP4Experts) and layer.activation == "silu"
    assert (layer.num_experts, layer.hidden_size, layer.intermediate_size) == (6, 64, 32)
    # gate and up arrive as two projections and FP4Experts stacks them into halves, with [E, 2] global scales.
    shapes = {"gate_up": (6, 64, 64), "down": (6, 64, 32)}
    w = {}
    for name, shape in shapes.items():
        p = layer.projection(name)
        assert p.weight.fmt.name == "nvfp4" and p.weight.scale_layout == "linear" and p.bias is None
        assert tuple(p.weight.shape) == shape and p.weight.global_scale is None
        scales = decode_e4m3(p.weight.scales)
        assert ((scales >= 0.25) & (scales <= 3.75)).all()  # normal, positive, no NaN
        gs = p.global_scales
        assert gs.dtype == torch.float32 and gs.shape == ((6, 2) if name == "gate_up" else (6,))
        assert ((gs >= 2.0**-8) & (gs <= 2.0**-4)).all() and torch.equal(torch.exp2(torch.log2(gs).round()), gs)
        per_row = gs.double()[:, None] if gs.dim() == 1 else gs.double().repeat_interleave(shape[1] // 2, dim=1)
        w[name] = dequantize(p.weight, torch.float64) * per_row[..., None]
    assert len({float(v) for p in shapes for v in layer.projection(p).global_scales.flatten()}) > 1
    w["gate_up0"], w["gate_up1"] = w["gate_up"].chunk(2, dim=1)

    g = torch.Generator().manual_seed(1)
    x = (4 * torch.randn(3, 64, generator=g)).to(torch.bfloat16)
    ids, weights = model_route(TINY_QWEN3, router_logits(TINY_QWEN3, 3, seed=2, device="cpu"))
    xs = x.double()[:, None, :, None]
    gate = (w["gate_up0"][ids] @ xs)[..., 0]  # [T, k, I]
    up = (w["gate_up1"][ids] @ xs)[..., 0]
    act = F.silu(gate) * up
    got = layer.activated(x, ids)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all() and act.abs().max() > 0
    assert (got.double() - act).abs().max() <= 2.0**-7 * act.abs().max()
    y = ((w["down"][ids] @ got.double()[..., None])[..., 0] * weights.double()[..., None]).sum(1)
    out = layer(x, ids, weights)
    assert out.dtype == torch.bfloat16 and (out.double() - y).abs().max() <= 2.0**-7 * y.abs().max()


def test_random_mxfp4_experts_keep_the_gpt_oss_layout():
    tiny = MoeModel("tiny-gpt-oss", layers=1, experts=4, hidden=64, intermediate=32)
    layer = random_experts(tiny, torch.Generator().manual_seed(0))
    gate_up, down = layer.projection("gate_up"), layer.projection("down")
    assert layer.activation == "gpt-oss"
    assert gate_up.weight.fmt.name == down.weight.fmt.name == "mxfp4" and gate_up.global_scales is None
    assert tuple(gate_up.weight.shape) == (4, 64, 64) and tuple(gate_up.bias.shape) == (4, 64)
    ids, weights = model_route(tiny, router_logits(tiny, 2, seed=0, device="cpu"))
    assert torch.isfinite(layer(torch.randn(2, 64).to(torch.bfloat16), ids, weights)).all()


@pytest.mark.parametrize("model", [TINY_QWEN3, MoeModel("tiny-gpt-oss", layers=2, experts=4, hidden=64,
                                                          intermediate=32)], ids=lambda m: m.name)
def test_moe_benchmark_runs_end_to_end_on_cpu(monkeypatch, model):
    """moe_benchmark on a tiny model on the CPU with the timing, the read and the host clock stubbed: every
    graph's launch runs on every copy, each measurement lands in its field, the old kernel only at T = 1."""
    launches, kernels = [], []

    def device_time_us(launch, inputs, replays=15):
        results = [launch(c) for c in inputs]
        launches.append(len(results))
        return [float(len(launches))]

    real_moe_gemv = bench_moe.moe_gemv

    def moe_gemv(*args, kernel=None, **kwargs):  # moe_general runs Triton only: the reference stands in
        kernels.append(kernel)
        return real_moe_gemv(*args, **kwargs)

    monkeypatch.setitem(MOE_MODELS, model.name, model)
    monkeypatch.setattr(bench_moe, "device_time_us", device_time_us)
    monkeypatch.setattr(bench_moe, "host_time_us", lambda call: (call(), 2.0)[1])
    monkeypatch.setattr(bench_moe, "best_read", lambda nbytes: ("stub", 1.0))
    monkeypatch.setattr(bench_moe, "moe_gemv", moe_gemv)
    rows = bench_moe.moe_benchmark(model.name, (1, 2), copies=2, device="cpu")
    assert [r["tokens"] for r in rows] == [1, 2] and all(n == 2 for n in launches)
    # per T: routed GEMVs, 5 parts, the old kernel at T = 1; then the bf16 layer per T
    assert len(launches) == 7 + 6 + 2
    assert OLD_KERNEL in kernels and kernels.count(OLD_KERNEL) == 2 * 2  # gate_up and down, on 2 copies
    first, second = rows
    assert (first["routed_gemv_us"], first["routing_us"], first["layer_us"], first["old_routed_gemv_us"]) == \
        (1.0, 2.0, 6.0, 7.0)
    assert second["old_routed_gemv_us"] is None and second["routed_gemv_us"] == 8.0
    assert (first["bf16_torch_us"], second["bf16_torch_us"]) == (14.0, 15.0)
    for r in rows:
        assert r["mbytes"] == pytest.approx(r["distinct_experts"] * expert_bytes(model) / 1e6, abs=1e-6)
        assert r["step_ms"] == r["layer_us"] * model.layers / 1e3 and r["triton_kernels_us"] is None
        assert r["host_add_us"] == 2.0 and r["host_forward_vs_add"] == 1.0
    format_moe_table(rows)


def _fake_row(**changes):
    row = dict(model="qwen3-30b-a3b", fmt="nvfp4", tokens=8, distinct_experts=51.25, mbytes=136.0,
               best_read="triton", best_read_us=40.0, routed_gemv_us=80.0, fraction_of_read=0.5,
               old_routed_gemv_us=None, old_fraction_of_read=None, routing_us=6.5, gate_up_act_us=55.0,
               down_us=30.25, combine_us=3.0, layer_us=100.0, step_ms=4.8, host_add_us=4.0, host_moe_gemv_us=30.0,
               host_moe_gemv_vs_add=7.5, host_forward_us=120.0, host_forward_vs_add=30.0, bf16_torch_us=250.0,
               bf16_copies=8, speedup_vs_bf16=2.5, triton_kernels_us=None, speedup_vs_triton_kernels=None)
    row.update(changes)
    return row


def test_format_moe_table_renders_every_field():
    rows = [_fake_row(), _fake_row(model="gpt-oss-20b", fmt="mxfp4", tokens=1, old_routed_gemv_us=200.0,
                                   old_fraction_of_read=0.2, triton_kernels_us=78.8, speedup_vs_triton_kernels=0.788)]
    lines = format_moe_table(rows).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["model", "T", "experts", "MB", "best read us", "routed GEMVs us (x read)",
                    "moe_general GEMVs us (x read)", "routing us", "gate_up+act us", "down us", "combine us",
                    "layer us", "step ms", "triton_kernels us", "layer vs triton_kernels", "bf16 torch us",
                    "layer vs bf16"]
    assert lines[1] == "|" + "---|" * len(head)
    qwen = [c.strip() for c in lines[2].strip("|").split("|")]
    assert qwen == ["qwen3-30b-a3b", "8", "51.2", "136.0", "40.0", "80.0 (0.50)", "-", "6.5", "55.0", "30.2",
                    "3.0", "100.0", "4.80", "-", "-", "250.0", "2.50x"]
    oss = [c.strip() for c in lines[3].strip("|").split("|")]
    assert oss[:2] == ["gpt-oss-20b", "1"] and oss[6] == "200.0 (0.20)" and oss[13:15] == ["78.8", "0.79x"]
    assert lines[4] == ""
    host = lines[5:]
    assert len(host) == 2 and "qwen3-30b-a3b" in host[0] and "gpt-oss-20b" in host[1]
    assert "x.add_(1) 4.00 us" in host[0] and "moe_gemv (gate_up) 30.00 us = 7.50x" in host[0]
    assert "FP4Experts.forward 120.00 us = 30.00x" in host[0]


def test_cli_runs_the_qwen3_moe_benchmark(monkeypatch, tmp_path, capsys):
    """``fp4gemv bench --model qwen3-30b-a3b``: T = 1, 8, 16 by default, rows to moe-MODEL.json, the table on
    stdout (the benchmark stubbed: it needs a GPU)."""
    from fp4gemv import cli

    calls = []

    def fake_benchmark(name, tokens):
        calls.append((name, list(tokens)))
        return [_fake_row(model=name, tokens=t) for t in tokens]

    monkeypatch.setattr(cli, "moe_benchmark", fake_benchmark)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.main(["bench", "--model", "qwen3-30b-a3b", "--out", str(tmp_path)]) == 0
    assert calls == [("qwen3-30b-a3b", [1, 8, 16])]
    rows = json.loads((tmp_path / "moe-qwen3-30b-a3b.json").read_text())
    assert [r["tokens"] for r in rows] == [1, 8, 16]
    out = capsys.readouterr().out
    assert out.count("| qwen3-30b-a3b |") == 3 and "FP4Experts.forward" in out
    assert set(MOE_MODELS) == {"gpt-oss-20b", "gpt-oss-120b", "qwen3-30b-a3b"}
    assert bench_moe.OLD_KERNEL_TOKENS == (1,)


@pytest.mark.parametrize("name", ["gpt-oss-20b", "qwen3-30b-a3b"])
def test_fused_route_is_the_models_routing(name):
    """The FP4 layer's routing (fp4gemv.moe_route, one launch) picks the plain-torch routing's experts (up to
    the order of equal logits, which torch.topk leaves open) and weights (the same dtype, within its rounding)."""
    model = MOE_MODELS[name]
    logits = router_logits(model, 16, seed=7, device="cpu")
    ids, weights = fused_route(model, logits)
    want_ids, want = model_route(model, logits)
    assert torch.equal(logits.gather(1, ids.long()), logits.gather(1, want_ids.long())) and weights.dtype == want.dtype
    weights, want = weights.double().sort(1).values, want.double().sort(1).values
    assert ((weights - want).abs() <= 2.0**-7 * want.abs()).all()
