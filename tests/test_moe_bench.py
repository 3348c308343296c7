"""The MoE benchmark's CPU-checkable parts: the bytes it counts and its bf16 torch baseline's math."""

import pytest
import torch

from fp4gemv.bench.moe import MOE_MODELS, TRITON_KERNELS_US, _bf16_layer, expert_bytes


def test_expert_bytes_match_the_issue_table():
    """The issue's MB column is distinct experts x (packed data + e8m0 scales of gate_up and down)."""
    for (name, _), (distinct, mbytes, _) in TRITON_KERNELS_US.items():
        assert distinct * expert_bytes(MOE_MODELS[name]) / 1e6 == pytest.approx(mbytes, abs=0.06)


def test_bf16_baseline_is_the_routed_gpt_oss_layer():
    """gather + bmm against a per-pair float64 loop of the same layer (bf16 roundings: 2^-6 of the scale)."""
    g = torch.Generator().manual_seed(0)
    e, h, i, tokens, top_k = 6, 32, 16, 3, 2
    w_gu, b_gu = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, 2 * i, generator=g)
    w_d, b_d = torch.randn(e, h, i, generator=g) / 4, torch.randn(e, h, generator=g)
    x = torch.randn(tokens, h, generator=g) / 4
    ids = torch.tensor([[0, 5], [5, 2], [1, 0]])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    bf = [t.to(torch.bfloat16) for t in (w_gu, b_gu, w_d, b_d)]
    got = _bf16_layer(*bf, x.to(torch.bfloat16), ids, weights)
    want = torch.zeros(tokens, h, dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            k = int(ids[t, j])
            gu = bf[0][k].double() @ x[t].to(torch.bfloat16).double() + bf[1][k].double()
            gate, up = gu[::2].clamp(max=7.0), gu[1::2].clamp(-7.0, 7.0)
            act = gate * torch.sigmoid(1.702 * gate) * (up + 1)
            want[t] += weights[t, j].double() * (bf[2][k].double() @ act + bf[3][k].double())
    err = (got.double() - want).abs().max().item()
    assert err <= 2.0**-6 * want.abs().max().item(), err
