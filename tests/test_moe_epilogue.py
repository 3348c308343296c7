"""moe_gemv's epilogue against the exact oracle: the gated activations (gpt-oss's clamped SwiGLU on interleaved
gate/up rows, SiLU on halves), the routing weight per pair, per-expert global scales of gate and up ``[E, 2]``,
on every MoE spec; its validation; and FP4Experts built from separate gate and up projections.

The bound.  The pre-activation value y of each row has the bound of the spec's error model (as in
test_moe.py: the accumulation on the magnitudes |W_e| |x_t| times the row's global scale, plus one fp32 rounding
for the bias); the activation h(g, u) moves by at most |dh/dg| dg + |dh/du| du, with |dh/dg| <= 1.1 (|u| + du +
1) (sigmoid(z) (1 + z (1 - sigmoid(z))) stays below 1.1) and |dh/du| <= |g| + dg (sigmoid <= 1); its fp32
evaluation (exp, a division, three products) adds 2^-18 of the result; the routing weight one fp32 product; the
output one rounding (half an ulp)."""

import pytest
import torch

import fp4gemv
from fp4gemv import moe
from fp4gemv.nn import FP4Experts
from fp4gemv.nn.moe import ExpertWeights
from fp4gemv.reference import (MOE_ACTIVATIONS, gate_up_halves, moe_activation, routed_epilogue,
                               routed_gemv_reference)
from fp4gemv.target import resolve_target
from operands import (DEVICE, accumulation_bound, half_ulp, oracle_bound, random_activation, random_fp4)

ALPHA, LIMIT = 1.702, 7.0


def constants(activation):
    return (ALPHA, LIMIT) if activation == "gpt-oss" else (0.0, 0.0)


def row_scales(global_scales, rows, activation, experts):
    """[E, M] float64: each row's global scale ([E] or [E, 2] as the activation arranges gate and up)."""
    if global_scales is None:
        return torch.ones(experts, rows, dtype=torch.float64)
    gs = global_scales.to(torch.float64)
    if gs.dim() == 1:
        return gs[:, None].expand(experts, rows)
    half = torch.arange(rows, device=gs.device)
    half = half % 2 if MOE_ACTIVATIONS[activation] == "interleaved" else half // (rows // 2)
    return gs[:, half]


def exact_and_bound(w, x, ids, out_dtype, got, *, bias=None, global_scales=None, activation=None,
                    pair_weights=None, kernel=None, backend="triton"):
    """(exact float64 result, the largest |got - exact| the spec moe_gemv runs may give on ``backend``), module
    docstring; both on w's device (float64 is as exact on the GPU)."""
    alpha, limit = constants(activation)
    reference = kernel == "moe_reference"
    target = resolve_target("reference" if reference else backend, w.device)
    plan = moe.plan_moe(w, x, ids, bias, global_scales, None, out_dtype, target, None if reference else kernel,
                        activation=activation, alpha=alpha, limit=limit, pair_weights=pair_weights)
    model = plan.spec.error_model(plan.case, plan.config)
    experts, m, k = w.shape
    tokens, top_k = ids.shape
    flat = ids.reshape(-1).long()
    valid = ((flat >= 0) & (flat < experts)).reshape(tokens, top_k, 1)
    e = flat.clamp(0, experts - 1)
    t = torch.arange(tokens * top_k, device=flat.device) // top_k
    f64 = lambda v: None if v is None else v.to(torch.float64)  # noqa: E731
    exact = routed_gemv_reference(w.data, w.scales, w.fmt, w.scale_layout, w.global_scale, x, ids, bias,
                                  global_scales, torch.float64, activation, alpha, limit, pair_weights)
    scales = row_scales(global_scales, m, activation, experts).to(w.data.device)  # [E, M]
    values = fp4gemv.dequantize(w, torch.float64)  # [E, M, K], w's global scale included
    pre = torch.einsum("emk,tk->etm", values, f64(x))[e, t] * scales[e]  # [P, M]
    magnitude = torch.einsum("emk,tk->etm", values.abs(), f64(x).abs())[e, t] * scales.abs()[e]
    del values
    bias_abs = torch.zeros_like(magnitude)
    if bias is not None:
        pre, bias_abs = pre + f64(bias)[e], f64(bias)[e].abs()
    pre = torch.where(valid, pre.reshape(tokens, top_k, m), 0.0)
    tensor_scale = 1.0 if w.global_scale is None else abs(float(w.global_scale))
    delta = (accumulation_bound(magnitude, k, model.tensor_cores, model.fold, tensor_scale * scales.abs()[e])
             + oracle_bound(magnitude, k) + 1.01 * 2.0**-24 * (magnitude + bias_abs)).reshape(tokens, top_k, m)
    if activation is not None:
        (g, u), (dg, du) = gate_up_halves(pre, activation), gate_up_halves(delta, activation)
        h = moe_activation(g, u, activation, alpha, limit)
        ones = 1.0 if activation == "gpt-oss" else 0.0
        delta = 1.1 * (u.abs() + du + ones) * dg + (g.abs() + dg) * du
        delta = delta + 2.0**-18 * (h.abs() + delta) + 2.0**-126
    if pair_weights is not None:
        pw = f64(pair_weights).abs()[..., None]
        delta = pw * delta + 2.0**-24 * (exact.abs() + pw * delta)
    bound = torch.where(valid, delta + half_ulp(got, out_dtype).to(delta.device), 0.0)
    return exact, bound


def assert_epilogue_exact(got, w, x, ids, out_dtype, **kw):
    exact, bound = exact_and_bound(w, x, ids, out_dtype, got, **kw)
    g = got.to(torch.float64)
    ok = torch.isfinite(g) & ((g - exact).abs() <= bound)
    if not ok.all():
        bad = (~ok).nonzero()[:5].tolist()
        detail = [(i, g[tuple(i)].item(), exact[tuple(i)].item(), bound[tuple(i)].item()) for i in bad]
        raise AssertionError(f"{int((~ok).sum())} of {g.numel()} outputs off the exact result; first: {detail}")


def assert_epilogue_tight(got, want, out_dtype):
    """got within the fp32 evaluation of the activation (2^-18 relative, 2^-40 of the largest) and one rounding
    of ``want``, the same products through ``reference.routed_epilogue`` in fp32."""
    got, want = got.to(torch.float64), want.to(torch.float64)
    bound = 2.0**-18 * want.abs() + 2.0**-40 * want.abs().max() + half_ulp(got, out_dtype)
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max().item()


def gate_up_activation(tokens=5, experts=8, rows=40, k=96, seed=50, fmt="mxfp4", layout="linear"):
    """Operands with a tail (M / 2 = 20 pairs: 8-pair tiles), gate/up values past the clamp (|y| up to ~30)."""
    w = random_fp4((experts, rows, k), fmt, layout, seed=seed)
    x = random_activation((tokens, k), torch.bfloat16, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    ids = torch.stack([torch.randperm(experts, generator=g)[:3] for _ in range(tokens)]).to(torch.int32).to(DEVICE)
    ids[-1, 0] = ids[0, 1]  # an expert shared by the first and last tokens
    bias = random_activation((experts, rows), torch.bfloat16, seed=seed + 3)
    pw = torch.softmax(torch.randn(tokens, 3, generator=g), dim=-1).to(DEVICE)
    return w, x, ids, bias, pw


@pytest.mark.parametrize("kernel", ["moe_weight_only", "moe_general", "moe_reference"])
@pytest.mark.parametrize("activation", ["gpt-oss", "silu"])
@pytest.mark.parametrize("fmt,layout", [("mxfp4", "linear"), ("nvfp4", "swizzled")])
def test_activation_and_pair_weights_match_exact(kernel, activation, fmt, layout):
    """Every spec: gate_up's activation with bias, then the routing weight, out in bf16 and fp32; NVFP4 with
    gate's and up's own global scales [E, 2]."""
    w, x, ids, bias, pw = gate_up_activation(fmt=fmt, layout=layout)
    gs = (torch.rand(8, 2, generator=torch.Generator().manual_seed(7)) + 0.5).to(DEVICE) if fmt == "nvfp4" else None
    backend = "reference" if kernel == "moe_reference" else "triton"
    for out_dtype, weights in ((torch.bfloat16, None), (torch.float32, pw)):
        got = fp4gemv.moe_gemv(w, x, ids, bias=bias, global_scales=gs, activation=activation, pair_weights=weights,
                               out_dtype=out_dtype, backend=backend, kernel=None if backend == "reference" else kernel)
        assert got.shape == (5, 3, 20) and got.dtype == out_dtype
        assert_epilogue_exact(got, w, x, ids, out_dtype, bias=bias, global_scales=gs, activation=activation,
                              pair_weights=weights, kernel=kernel)


@pytest.mark.parametrize("kernel", ["moe_weight_only", "moe_general"])
@pytest.mark.parametrize("activation,fmt", [("gpt-oss", "mxfp4"), ("silu", "nvfp4")])
def test_epilogue_equals_the_kernels_own_products_through_the_oracle_epilogue(kernel, activation, fmt):
    """A tight check of the epilogue alone (the bound above is the products', loose where the tensor cores'
    fold leaves room): the fused result against the same kernel's bare fp32 products put through
    ``reference.routed_epilogue`` in fp32 (gate's and up's scales, bias, activation, weights), within the fp32
    evaluation of the activation (2^-18 relative) and half an ulp."""
    w, x, ids, bias, pw = gate_up_activation(fmt=fmt, layout="swizzled" if fmt == "nvfp4" else "linear", seed=120)
    gs = (torch.rand(8, 2, generator=torch.Generator().manual_seed(121)) + 0.5).to(DEVICE) if fmt == "nvfp4" else None
    alpha, limit = constants(activation)
    got = fp4gemv.moe_gemv(w, x, ids, bias=bias, global_scales=gs, activation=activation, pair_weights=pw,
                           out_dtype=torch.float32, backend="triton", kernel=kernel)
    bare = fp4gemv.moe_gemv(w, x, ids, out_dtype=torch.float32, backend="triton", kernel=kernel)
    want = routed_epilogue(bare, ids, 8, half_scales=gs, bias=bias, activation=activation, alpha=alpha, limit=limit,
                           pair_weights=pw)
    assert_epilogue_tight(got, want, torch.float32)


@pytest.mark.parametrize("config", [dict(tiles=1, warps=2, split=True), dict(tiles=2, warps=1, split=False)])
def test_tensor_core_epilogue_per_configuration(config):
    """Both step modes and two tiles per warp (elements 2 t + h of a thread: two pairs), bad ids (zeros),
    per-expert global scales [E], pair weights."""
    from fp4gemv.kernels.weight_only import WeightOnlyConfig
    w, x, ids, bias, pw = gate_up_activation(tokens=3, rows=72, seed=60, fmt="nvfp4", layout="linear")
    ids[1, 2] = 99  # outside [0, E): zeros
    gs = torch.linspace(0.5, 2.0, 8).to(DEVICE)
    got = fp4gemv.moe_gemv(w, x, ids, bias=bias, global_scales=gs, activation="gpt-oss", pair_weights=pw,
                           out_dtype=torch.float32, backend="triton", kernel="moe_weight_only",
                           config=WeightOnlyConfig(**config), check_ids=False)
    assert torch.equal(got[1, 2].cpu(), torch.zeros(36))
    assert_epilogue_exact(got, w, x, ids, torch.float32, bias=bias, global_scales=gs, activation="gpt-oss",
                          pair_weights=pw, kernel="moe_weight_only")


def test_pair_weights_without_activation():
    """down's epilogue: the product plus bias times each pair's weight ([T * k, 1] ids as FP4Experts passes)."""
    w = random_fp4((6, 24, 64), "mxfp4", "swizzled", seed=70)
    h = random_activation((8, 64), torch.bfloat16, seed=71)
    ids = torch.tensor([[1], [4], [4], [0], [5], [1], [2], [4]], dtype=torch.int64, device=DEVICE)
    bias = random_activation((6, 24), torch.float32, seed=72)
    pw = random_activation((8, 1), torch.bfloat16, seed=73)
    for kernel in ("moe_weight_only", "moe_general"):
        got = fp4gemv.moe_gemv(w, h, ids, bias=bias, pair_weights=pw, out_dtype=torch.float32, backend="triton",
                               kernel=kernel)
        assert_epilogue_exact(got, w, h, ids, torch.float32, bias=bias, pair_weights=pw, kernel=kernel)


def test_alpha_and_limit_reach_the_kernel():
    """Other alpha and limit than gpt-oss's give the oracle's result with them (and differ from the defaults)."""
    w, x, ids, bias, _ = gate_up_activation(seed=80)
    got = fp4gemv.moe_gemv(w, x, ids, bias=bias, activation="gpt-oss", alpha=1.0, limit=2.0, out_dtype=torch.float32,
                           backend="triton", kernel="moe_weight_only")
    default = fp4gemv.moe_gemv(w, x, ids, bias=bias, activation="gpt-oss", out_dtype=torch.float32, backend="triton")
    assert not torch.equal(got, default)
    want = routed_gemv_reference(w.data.cpu(), w.scales.cpu(), w.fmt, w.scale_layout, None, x.cpu(), ids.cpu(),
                                 bias.cpu(), None, torch.float64, "gpt-oss", 1.0, 2.0)
    assert (got.cpu().double() - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_epilogue_under_torch_compile():
    w, x, ids, bias, pw = gate_up_activation(seed=90)

    def step(x, ids, pw):
        return fp4gemv.moe_gemv(w, x, ids, bias=bias, activation="silu", pair_weights=pw, backend="triton") * 2

    got = torch.compile(step, fullgraph=True)(x, ids, pw)
    assert got.shape == (5, 3, 20)
    assert torch.equal(got, step(x, ids, pw))


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(activation="gelu"), ValueError, r"activation: expected None or one of \['gpt-oss', 'silu'\], got 'gelu'"),
    (dict(alpha=1.0), ValueError, r"alpha: expected None \(only the 'gpt-oss' activation takes it\), got 1.0"),
    (dict(activation="silu", limit=3.0), ValueError, r"limit: expected None \(only the 'gpt-oss'"),
    (dict(activation="gpt-oss", limit=-1.0), ValueError, r"limit: expected a positive finite number, got -1.0"),
    (dict(activation="gpt-oss", alpha=float("nan")), ValueError, r"alpha: expected a positive finite number"),
    (dict(pair_weights="w"), TypeError, r"pair_weights: expected a torch.Tensor, got str"),
    (dict(pair_weights=torch.ones(5, 2)), ValueError, r"pair_weights: expected \[T, k\] = \(5, 3\) like expert_ids"),
    (dict(pair_weights=torch.ones(5, 3, dtype=torch.int32)), TypeError, r"pair_weights: expected dtype"),
    (dict(global_scales=torch.ones(8, 2)), ValueError,
     r"global_scales: expected one per expert, \[E\] = \[8\] \(\[E, 2\] only with an activation\), got \(8, 2\)"),
    (dict(activation="silu", global_scales=torch.ones(8, 3)), ValueError,
     r"global_scales: expected one per expert, \[E\] = \[8\] or \[E, 2\] = \[8, 2\] \(gate's, up's\), got \(8, 3\)"),
    (dict(activation="silu", out=torch.empty(5, 3, 40)), ValueError, r"out: expected shape \[T, k, M / 2\] = \(5, 3, 20\)"),
])
def test_epilogue_validation_names_the_argument(kwargs, exc, message):
    w, x, ids, bias, _ = gate_up_activation()
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    if "out" in kwargs:
        kwargs["out"] = kwargs["out"].to(torch.bfloat16)
    with pytest.raises(exc, match=message):
        fp4gemv.moe_gemv(w, x, ids, backend="triton", **kwargs)


def test_odd_rows_refused_with_an_activation():
    w = random_fp4((4, 22, 64), "mxfp4", "linear", seed=95)
    w = fp4gemv.FP4Tensor(w.data[:, :21], w.scales[:, :21], "mxfp4", "linear")
    x = random_activation((2, 64), torch.bfloat16, seed=96)
    ids = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"w: expected an even number of rows M \(gate and up\)"):
        fp4gemv.moe_gemv(w, x, ids, activation="silu", backend="triton")


def test_experts_from_separate_gate_and_up_run_as_one_product():
    """FP4Experts((gate, up), down) stacks gate and up into halves with their own global scales (one a
    per-expert [E], one its tensor's scale): the module's result equals per-pair float64 math on each
    projection, within the module's bf16 roundings."""
    experts, hidden, inter, tokens, top_k = 4, 64, 32, 3, 2
    gate = random_fp4((experts, inter, hidden), "nvfp4", "swizzled", seed=100)
    up = random_fp4((experts, inter, hidden), "nvfp4", "swizzled", seed=101, global_scale=0.5)
    down = random_fp4((experts, hidden, inter), "nvfp4", "swizzled", seed=102)
    gate_gs = torch.tensor([0.25, 1.0, 2.0, 0.5], device=DEVICE)
    module = FP4Experts((ExpertWeights(gate, None, gate_gs), ExpertWeights(up)), ExpertWeights(down),
                        activation="silu", backend="triton")
    stacked = module.projection("gate_up")
    assert stacked.weight.shape == (experts, 2 * inter, hidden) and stacked.weight.scale_layout == "swizzled"
    assert torch.equal(stacked.global_scales.cpu(), torch.stack([gate_gs.cpu(), torch.full((4,), 0.5)], dim=1))
    x = random_activation((tokens, hidden), torch.bfloat16, seed=103)
    ids = torch.tensor([[0, 3], [2, 0], [1, 2]], device=DEVICE)
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.9, 0.1]], device=DEVICE)
    got = module(x, ids, weights)
    gv = fp4gemv.dequantize(gate, torch.float64).cpu() * gate_gs.cpu().double()[:, None, None]
    uv, dv = fp4gemv.dequantize(up, torch.float64).cpu(), fp4gemv.dequantize(down, torch.float64).cpu()
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        x64 = x[t].cpu().double()
        for j in range(top_k):
            e = int(ids[t, j])
            h = moe_activation(gv[e] @ x64, uv[e] @ x64, "silu", 0.0, 0.0).to(torch.bfloat16).double()
            want[t] += float(weights[t, j]) * (dv[e] @ h)
    err = (got.cpu().double() - want).abs().max().item()
    assert err <= 2.0**-6 * want.abs().max().item(), err


@pytest.mark.gpu
@pytest.mark.parametrize("activation,fmt", [("gpt-oss", "mxfp4"), ("silu", "nvfp4")])
def test_epilogue_on_gpu_in_a_cuda_graph_without_sync(activation, fmt):
    """gpt-oss-20b's gate_up (5760 x 2880) and a Qwen3-30B-A3B-shaped one (1536 x 2048, [E, 2] global scales) at
    T = 16 on the GPU's PTX step, captured in a CUDA graph with sync debugging set to error."""
    experts, rows, k, top_k = (32, 5760, 2880, 4) if fmt == "mxfp4" else (128, 1536, 2048, 8)
    w = random_fp4((experts, rows, k), fmt, "swizzled", seed=110)
    x = random_activation((16, k), torch.bfloat16, seed=111)
    g = torch.Generator().manual_seed(112)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(16)]).to(torch.int32).cuda()
    bias = random_activation((experts, rows), torch.bfloat16, seed=113) if fmt == "mxfp4" else None
    gs = (torch.rand(experts, 2, generator=g) + 0.5).cuda() if fmt == "nvfp4" else None
    pw = torch.rand(16, top_k, generator=g).cuda()
    out = torch.full((16, top_k, rows // 2), float("nan"), dtype=torch.bfloat16, device="cuda")

    def call():
        fp4gemv.moe_gemv(w, x, ids, bias=bias, global_scales=gs, activation=activation, pair_weights=pw, out=out,
                         check_ids=False)

    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    out.fill_(float("nan"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            call()
        graph.replay()
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_epilogue_exact(out, w, x, ids, torch.bfloat16, bias=bias, global_scales=gs, activation=activation,
                          pair_weights=pw, kernel="moe_weight_only")
    bare = fp4gemv.moe_gemv(w, x, ids, out_dtype=torch.float32)  # the same PTX step without the epilogue
    alpha, limit = constants(activation)
    assert_epilogue_tight(out, routed_epilogue(bare, ids, experts, half_scales=gs, bias=bias, activation=activation,
                                               alpha=alpha, limit=limit, pair_weights=pw), torch.bfloat16)
