"""fp4gemv.moe_gemv against the exact oracle: routing (shared experts, one expert for all, a token naming one
expert twice, E = 4 / 32 / 128, top-1 / 2 / 4, T = 1..16), K = 2880, tails, both formats, layouts and id dtypes,
bad ids, global scales per tensor and per expert, bias, validation, the kernel table, torch.compile, sm_90.

The bound is the one of the chosen spec's error model (tests/operands.py: block sums or one tensor-core
accumulation with its fold) per pair, on the magnitudes |W_e| |x_t| times the global scale, plus one fp32
rounding for the bias addition."""

import pytest
import torch

import fp4gemv
from fp4gemv import FP4Tensor, moe, ops
from fp4gemv.kernels import moe_weight_only
from fp4gemv.kernels.weight_only import WeightOnlyConfig
from fp4gemv.reference import routed_gemv_reference
from fp4gemv.target import resolve_target
from operands import (DEVICE, accumulation_bound, half_ulp, oracle_bound, poisoned, random_activation,
                      random_fp4)


def plan_of(w, x, expert_ids, out_dtype, bias=None, global_scales=None, backend="triton", kernel=None, config=None):
    """What moe_gemv(..., backend=backend, kernel=kernel, config=config) runs."""
    return moe.plan_moe(w, x, expert_ids, bias, global_scales, None, out_dtype, resolve_target(backend, w.device),
                        kernel, config)


def exact_and_bound(w, x, expert_ids, out_dtype, got, bias=None, global_scales=None, kernel=None, config=None,
                    backend="triton"):
    """(exact float64 result [T, k, M], the largest |got - exact| the spec moe_gemv runs may give) per pair."""
    plan = plan_of(w, x, expert_ids, out_dtype, bias, global_scales, backend=backend, kernel=kernel, config=config)
    model = plan.spec.error_model(plan.case, plan.config)
    experts, m, k = w.shape
    tokens, top_k = expert_ids.shape
    ids = expert_ids.reshape(-1).long().cpu()
    clamped = ids.clamp(0, experts - 1)
    exact = routed_gemv_reference(w.data.cpu(), w.scales.cpu(), w.fmt, w.scale_layout,
                                  None if w.global_scale is None else w.global_scale.cpu(), x.cpu(),
                                  expert_ids.cpu(), None if bias is None else bias.cpu(),
                                  None if global_scales is None else global_scales.cpu(), torch.float64)
    values = fp4gemv.dequantize(w, torch.float64).cpu().abs()  # [E, M, K], w's global scale included
    gs = torch.full((experts,), 1.0 if w.global_scale is None else abs(float(w.global_scale)), dtype=torch.float64)
    if global_scales is not None:
        per_expert = global_scales.cpu().to(torch.float64).abs()
        values, gs = values * per_expert[:, None, None], per_expert
    token = torch.arange(tokens * top_k) // top_k
    magnitude = torch.einsum("pmk,pk->pm", values[clamped], x.cpu().to(torch.float64).abs()[token])
    bias_abs = torch.zeros_like(magnitude) if bias is None else bias.cpu().to(torch.float64)[clamped].abs()
    bound = (accumulation_bound(magnitude, k, model.tensor_cores, model.fold, gs[clamped][:, None])
             + oracle_bound(magnitude, k) + 1.01 * 2.0**-24 * (magnitude + bias_abs))  # the bias addition
    g = got.cpu().reshape(tokens * top_k, m)
    valid = ((ids >= 0) & (ids < experts))[:, None]
    bound = torch.where(valid, bound + half_ulp(g, out_dtype), 0.0)
    return exact, bound.reshape(tokens, top_k, m)


def assert_routed_exact(got, w, x, expert_ids, out_dtype, bias=None, global_scales=None, kernel=None, config=None,
                        backend="triton"):
    exact, bound = exact_and_bound(w, x, expert_ids, out_dtype, got, bias, global_scales, kernel, config, backend)
    g = got.cpu().to(torch.float64)
    ok = torch.isfinite(g) & ((g - exact).abs() <= bound)
    if not ok.all():
        bad = (~ok).nonzero()[:5].tolist()
        detail = [(i, g[tuple(i)].item(), exact[tuple(i)].item()) for i in bad]
        raise AssertionError(f"{int((~ok).sum())} of {g.numel()} outputs off the exact result; first: {detail}")


def routed(w, x, expert_ids, **kw):
    return fp4gemv.moe_gemv(w, x, expert_ids, backend="triton", **kw)


def random_ids(tokens, top_k, experts, seed, dtype=torch.int32):
    """Top-k-like ids: distinct experts per token."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(dtype).to(DEVICE)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("act,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                           (torch.float32, torch.float16)])
def test_matches_exact(fmt, layout, act, out_dtype):
    """M = 20 (a row tail of 8-row tiles), K = 96 (6 blocks: a K tail), shared and duplicate experts, bias."""
    w = random_fp4((6, 20, 96), fmt, layout, seed=3, global_scale=0.75 if fmt == "nvfp4" else None)
    x = random_activation((5, 96), act, seed=4)
    ids = torch.tensor([[1, 3], [3, 1], [1, 5], [0, 3], [3, 3]], dtype=torch.int32, device=DEVICE)
    bias = random_activation((6, 20), torch.bfloat16, seed=5)
    got = routed(w, x, ids, bias=bias, out_dtype=out_dtype)
    assert got.shape == (5, 2, 20) and got.dtype == out_dtype
    assert_routed_exact(got, w, x, ids, out_dtype, bias=bias)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("act", [torch.float16, torch.bfloat16])
def test_tensor_core_step_matches_exact(fmt, layout, act):
    """The tensor-core step (moe_weight_only) for both formats, layouts and activations: M = 24 (a row tail of a
    16-row tile), K = 96 (a partial step), 3 tokens on 4 of 32 experts with shared ones and a token naming one
    expert twice, bias, w's global scale (NVFP4)."""
    w = random_fp4((32, 24, 96), fmt, layout, seed=40, global_scale=0.75 if fmt == "nvfp4" else None)
    x = random_activation((3, 96), act, seed=41)
    ids = torch.tensor([[7, 31, 0, 7], [31, 5, 0, 12], [12, 0, 31, 5]], dtype=torch.int32, device=DEVICE)
    bias = random_activation((32, 24), torch.float32, seed=42)
    assert plan_of(w, x, ids, torch.bfloat16, bias).spec.name == "moe_weight_only"
    got = routed(w, x, ids, bias=bias, out_dtype=torch.bfloat16)
    assert_routed_exact(got, w, x, ids, torch.bfloat16, bias=bias)


@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("top_k", [1, 4])
@pytest.mark.parametrize("experts", [4, 32])
def test_tensor_core_step_routing(tokens, top_k, experts):
    """T = 1, 3, 16 tokens, top-1 and top-4 of 4 and 32 experts (random distinct ids per token, one expert shared
    by the first and last token): every group size from 1 to 16, several passes of 8 columns.  MXFP4 linear for
    32 experts, NVFP4 swizzled for 4; fp16 activations at T = 3, bf16 otherwise."""
    fmt, layout = ("mxfp4", "linear") if experts == 32 else ("nvfp4", "swizzled")
    act = torch.float16 if tokens == 3 else torch.bfloat16
    w = random_fp4((experts, 16, 64), fmt, layout, seed=43 + experts)
    x = random_activation((tokens, 64), act, seed=44 + tokens)
    ids = random_ids(tokens, top_k, experts, seed=45 + 10 * tokens + top_k)
    ids[-1, 0] = ids[0, top_k - 1]
    assert plan_of(w, x, ids, torch.float32).spec.name == "moe_weight_only"
    got = routed(w, x, ids, out_dtype=torch.float32)
    assert_routed_exact(got, w, x, ids, torch.float32)


def test_split_above_four_tokens_loops_its_groups():
    """A split configuration at T = 8 and 16 (4 columns per pass: groups of up to 16 pairs loop, as k32's 8
    columns do above T = 8) is accepted and exact, through fp4gemv.moe_gemv's config; more than 4 columns in one
    split pass stay refused where the spec's check names them."""
    w = random_fp4((4, 48, 288), "mxfp4", "linear", seed=60)
    bias = random_activation((4, 48), torch.bfloat16, seed=61)
    split = WeightOnlyConfig(2, 2, 1, split=True)
    for tokens in (8, 16):
        x = random_activation((tokens, 288), torch.bfloat16, seed=62 + tokens)
        ids = random_ids(tokens, 4, 4, seed=63 + tokens)
        plan = plan_of(w, x, ids, torch.float32, bias, kernel="moe_weight_only", config=split)
        assert plan.config == split
        got = fp4gemv.moe_gemv(w, x, ids, bias=bias, out_dtype=torch.float32, backend="triton",
                               kernel="moe_weight_only", config=split)
        assert_routed_exact(got, w, x, ids, torch.float32, bias=bias, kernel="moe_weight_only", config=split)
    with pytest.raises(ValueError, match="config: expected tiles 1, 2 or 4"):
        fp4gemv.moe_gemv(w, x, ids, backend="triton", kernel="moe_weight_only", config=WeightOnlyConfig(3))


def test_config_under_torch_compile():
    """fp4gemv.moe_gemv's config reaches the kernel under torch.compile(fullgraph=True) (the custom op carries
    it): the same result as eagerly; a config without its kernel is refused while tracing."""
    w = random_fp4((4, 32, 128), "mxfp4", "linear", seed=64)
    x = random_activation((8, 128), torch.bfloat16, seed=65)
    ids = random_ids(8, 2, 4, seed=66)
    config = WeightOnlyConfig(2, 1, 1, split=True)

    def step(x, ids):
        return fp4gemv.moe_gemv(w, x, ids, backend="triton", kernel="moe_weight_only", config=config)

    got = torch.compile(step, fullgraph=True)(x, ids)
    assert torch.equal(got, step(x, ids))
    assert_routed_exact(got, w, x, ids, torch.bfloat16, kernel="moe_weight_only", config=config)
    with pytest.raises(Exception, match="config: under torch.compile a config needs the kernel"):
        torch.compile(lambda x, ids: fp4gemv.moe_gemv(w, x, ids, backend="triton", config=config),
                      fullgraph=True)(x, ids)


def test_kernel_table_names_why_a_kernel_cannot_run():
    """fp16/bf16 activations run the tensor-core step, fp32 ones and more than 256 pairs the CUDA-core kernel,
    backend='reference' the float64 oracle; a named kernel that cannot run the case is a ValueError naming
    ``kernel`` and the reason; the CUDA-core kernel, asked for, is exact too."""
    w = random_fp4((4, 16, 64), "mxfp4", "swizzled", seed=46)
    x = random_activation((2, 64), torch.bfloat16, seed=47)
    ids = torch.tensor([[0, 3], [3, 1]], dtype=torch.int64, device=DEVICE)
    assert plan_of(w, x, ids, torch.bfloat16).spec.name == "moe_weight_only"
    assert plan_of(w, x.float(), ids, torch.bfloat16).spec.name == "moe_general"
    assert plan_of(w, x, ids, torch.bfloat16, backend="reference").spec.name == "moe_reference"
    many = torch.zeros((257, 1), dtype=torch.int32, device=DEVICE)
    assert plan_of(w, random_activation((257, 64), torch.bfloat16, seed=48), many,
                   torch.bfloat16).spec.name == "moe_general"
    with pytest.raises(ValueError, match="kernel: 'moe_weight_only' cannot run .*needs fp16 or bf16 activations"):
        routed(w, x.float(), ids, kernel="moe_weight_only")
    with pytest.raises(ValueError, match="kernel: expected one of 'moe_engine', 'moe_weight_only', 'moe_general'"):
        routed(w, x, ids, kernel="weight_only")
    got = routed(w, x, ids, kernel="moe_general")
    assert_routed_exact(got, w, x, ids, torch.bfloat16, kernel="moe_general")


def test_every_token_on_one_expert():
    """16 tokens on one expert (one 16-column group), then both slots of every token on it (32 pairs: two
    column chunks)."""
    w = random_fp4((4, 8, 64), "mxfp4", "linear", seed=6)
    x = random_activation((16, 64), torch.bfloat16, seed=7)
    for ids in (torch.full((16, 1), 2, dtype=torch.int64), torch.full((16, 2), 2, dtype=torch.int64)):
        ids = ids.to(DEVICE)
        got = routed(w, x, ids, out_dtype=torch.float32)
        assert_routed_exact(got, w, x, ids, torch.float32)


def test_128_experts_top4_every_token_count():
    w = random_fp4((128, 8, 64), "nvfp4", "swizzled", seed=8)
    x = random_activation((16, 64), torch.bfloat16, seed=9)
    for tokens in range(1, 17):
        ids = random_ids(tokens, 4, 128, seed=tokens, dtype=torch.int64 if tokens % 2 else torch.int32)
        ids[tokens // 2, 0] = ids[0, 1]  # at least one expert shared by two tokens (when tokens > 1)
        got = routed(w, x[:tokens], ids)
        assert_routed_exact(got, w, x[:tokens], ids, torch.bfloat16)


def test_gpt_oss_k_2880():
    """K = 2880: 90 MXFP4 scale columns (not a multiple of 4: swizzle padding), a K tail of the loop."""
    w = random_fp4((4, 8, 2880), "mxfp4", "swizzled", seed=10)
    x = random_activation((3, 2880), torch.bfloat16, seed=11)
    ids = torch.tensor([[0, 2], [2, 3], [1, 2]], dtype=torch.int32, device=DEVICE)
    bias = random_activation((4, 8), torch.float32, seed=12)
    got = routed(w, x, ids, bias=bias)
    assert_routed_exact(got, w, x, ids, torch.bfloat16, bias=bias)


def test_strided_operands_and_out():
    """ids and x as transposed views, out a strided view: all read and written through their strides."""
    w = random_fp4((5, 12, 64), "nvfp4", "linear", seed=13)
    x = random_activation((64, 3), torch.float16, seed=14).T
    ids = torch.tensor([[4, 0, 4], [1, 1, 2]], dtype=torch.int64, device=DEVICE).T
    base = poisoned((12, 2, 3), torch.float32)
    out = base.permute(2, 1, 0)
    got = routed(w, x, ids, out=out, out_dtype=torch.float32)
    assert got is out
    assert_routed_exact(out, w, x, ids, torch.float32)


def test_per_expert_global_scales():
    w = random_fp4((4, 8, 64), "nvfp4", "linear", seed=15)
    scales = torch.tensor([0.5, 3.0, 2.0**-7, 1.375], dtype=torch.float32, device=DEVICE)
    x = random_activation((2, 64), torch.bfloat16, seed=16)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    got = routed(w, x, ids, global_scales=scales, out_dtype=torch.float32)
    assert_routed_exact(got, w, x, ids, torch.float32, global_scales=scales)
    with_global = random_fp4((4, 8, 64), "nvfp4", "linear", seed=15, global_scale=2.0)
    with pytest.raises(ValueError, match="global_scales: expected None when w has a global scale"):
        routed(with_global, x, ids, global_scales=scales)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("value", [float("nan"), 0.0, -0.5, float("inf"), 2.0**-127])
def test_bad_global_scales_are_refused_when_values_are_checked(backend, value):
    """The check FP4Tensor and quantize make of a global scale, on each of moe_gemv's per-expert scales; like
    theirs for a tensor, it reads the values (a sync) only when asked."""
    w = random_fp4((4, 8, 64), "nvfp4", "linear", seed=15)
    x = random_activation((2, 64), torch.bfloat16, seed=16)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    scales = torch.tensor([0.5, 3.0, value, 1.0], dtype=torch.float32, device=DEVICE)
    out = poisoned((2, 2, 8), torch.bfloat16)
    with pytest.raises(ValueError, match=r"global_scales: expected a positive normal float32 \(2\^-126 or more, "
                                         rf"finite\), got {value} at \(2,\)"):
        fp4gemv.moe_gemv(w, x, ids, global_scales=scales, out=out, backend=backend, check_values=True)
    assert torch.isnan(out).all()  # nothing written
    with pytest.raises(ValueError, match=r"global_scale: expected a positive normal float32 \(2\^-126 or more, "
                                         rf"finite\), got {value}"):
        FP4Tensor(w.data[2], w.scales[2], "nvfp4", "linear", scales[2], check_values=True)


def test_global_scales_are_checked_when_asked_under_torch_compile():
    w = random_fp4((4, 8, 64), "nvfp4", "linear", seed=15)
    x = random_activation((2, 64), torch.bfloat16, seed=16)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)

    def step(x, scales):
        return fp4gemv.moe_gemv(w, x, ids, global_scales=scales, check_values=True)

    compiled = torch.compile(step, fullgraph=True)
    good = torch.tensor([0.5, 3.0, 2.0, 1.0], device=DEVICE)
    assert torch.equal(compiled(x, good), step(x, good))
    with pytest.raises(ValueError, match="global_scales: expected a positive normal float32"):
        compiled(x, torch.tensor([0.5, -3.0, 2.0, 1.0], device=DEVICE))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_bad_ids(backend):
    w = random_fp4((4, 8, 64), "mxfp4", "linear", seed=17)
    x = random_activation((2, 64), torch.bfloat16, seed=18)
    out = poisoned((2, 2, 8), torch.bfloat16)
    for bad in (4, -1):
        ids = torch.tensor([[0, bad], [1, 2]], dtype=torch.int32, device=DEVICE)
        with pytest.raises(ValueError, match=rf"expert_ids: expected ids in \[0, 4\), got {bad} at \(0, 1\)"):
            fp4gemv.moe_gemv(w, x, ids, out=out, backend=backend)
        assert torch.isnan(out).all()  # nothing written
        # Unchecked (what CUDA graphs and torch.compile get): zeros for the bad pair, the others exact.
        got = fp4gemv.moe_gemv(w, x, ids, backend=backend, check_ids=False)
        assert (got[0, 1] == 0).all()
        assert_routed_exact(got, w, x, ids, torch.bfloat16)


@pytest.mark.parametrize("tokens, top_k, experts", [(1, 4, 32), (4, 8, 128), (16, 8, 6)])
def test_pairwise_and_histogram_grouping_agree(monkeypatch, tokens, top_k, experts):
    """moe_weight_only groups a call of up to ``PAIRWISE_PAIRS`` pairs pair against pair and a larger one by a
    histogram over the experts: both give the same groups, so the same outputs bit for bit, with an expert named
    twice by one token, ids out of range (zeros) and, at E = 6, most experts taking several tokens."""
    w = random_fp4((experts, 48, 256), "nvfp4", "linear", seed=70 + experts)
    x = random_activation((tokens, 256), torch.bfloat16, seed=71)
    ids = random_ids(tokens, top_k, experts, seed=72)
    ids[0, -1] = ids[0, 0]
    ids[-1, 1] = experts + 3
    ids[0, 1] = -1
    outs = []
    for pairwise in (0, 1024):  # no call, every call
        monkeypatch.setattr(moe_weight_only, "PAIRWISE_PAIRS", pairwise)
        ops.clear_cache()
        outs.append(fp4gemv.moe_gemv(w, x, ids, backend="triton", kernel="moe_weight_only", check_ids=False))
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert (outs[1][-1, 1] == 0).all() and (outs[1][0, 1] == 0).all()
    assert_routed_exact(outs[1], w, x, ids, torch.bfloat16, kernel="moe_weight_only")


def test_validation_names_the_argument():
    w = random_fp4((4, 8, 64), "nvfp4", "linear", seed=19)
    x = random_activation((2, 64), torch.bfloat16, seed=20)
    ids = torch.zeros((2, 2), dtype=torch.int32, device=DEVICE)
    cases = [
        (dict(w=FP4Tensor(w.data[0], w.scales[0], "nvfp4")), ValueError, r"w: expected an FP4Tensor \[E, M, K\]"),
        (dict(x=x[:, :32]), ValueError, r"x: expected \[T, K\] with K = 64"),
        (dict(x=x.to(torch.int32)), TypeError, "x: expected dtype float16, bfloat16, float32"),
        (dict(expert_ids=ids[:1]), ValueError, r"expert_ids: expected \[T, k\] with T = 2"),
        (dict(expert_ids=ids.to(torch.int16)), TypeError, "expert_ids: expected dtype int32, int64"),
        (dict(bias=torch.zeros(4, 9)), ValueError, r"bias: expected shape \[E, M\] = \(4, 8\), got \(4, 9\)"),
        (dict(out=torch.empty(2, 2, 9, dtype=torch.bfloat16)), ValueError, r"out: expected shape \[T, k, M\]"),
        (dict(out=torch.empty(2, 2, 8, dtype=torch.float16)), TypeError, "out: expected dtype torch.bfloat16"),
        (dict(global_scales=torch.ones(3)), ValueError, r"global_scales: expected one per expert, \[E\] = \[4\]"),
    ]
    for change, error, message in cases:
        args = dict(w=w, x=x, expert_ids=ids)
        args.update(change)
        a, b, c = args.pop("w"), args.pop("x"), args.pop("expert_ids")
        with pytest.raises(error, match=message):
            routed(a, b, c, **args)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_out_sharing_memory_is_refused(backend):
    w = random_fp4((4, 8, 64), "nvfp4", "linear", seed=19)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    buf = random_activation((2, 64), torch.bfloat16, seed=20)
    x, out = buf, buf.view(-1)[:32].view(2, 2, 8)  # out is the first half of x's first row
    before = buf.clone()
    with pytest.raises(ValueError, match="out: expected memory apart from every input .* shares memory with x"):
        fp4gemv.moe_gemv(w, x, ids, out=out, backend=backend)
    stride0 = torch.zeros(2, 2, 1, dtype=torch.bfloat16, device=DEVICE).expand(2, 2, 8)
    with pytest.raises(ValueError, match=r"out: expected a tensor whose elements do not share memory, got strides "
                                         r"\(2, 1, 0\)"):
        fp4gemv.moe_gemv(w, x, ids, out=stride0, backend=backend)
    assert torch.equal(buf, before) and (stride0 == 0).all()


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_no_backward_on_any_backend_says_so(backend):
    """moe_gemv has no backward: in grad mode the result is computed (a transformers model's hidden states require
    grad outside torch.no_grad()) and a backward through it says so, the same way on every backend (the float64
    reference used to record a graph and the kernel none)."""
    w = random_fp4((4, 8, 64), "nvfp4", "linear", seed=19)
    x = random_activation((2, 64), torch.bfloat16, seed=20)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    bias = torch.zeros(4, 8, device=DEVICE, requires_grad=True)
    for kw in ({"x": x.clone().requires_grad_()}, {"x": x, "bias": bias}):
        y = fp4gemv.moe_gemv(w, kw["x"], ids, bias=kw.get("bias"), backend=backend)
        assert_routed_exact(y.detach(), w, x, ids, torch.bfloat16, bias=None if "bias" not in kw else bias.detach())
        with pytest.raises(RuntimeError, match=r"moe_gemv has no backward \(inference only\).*torch.no_grad\(\)"):
            y.float().sum().backward()
    with torch.no_grad():
        y = fp4gemv.moe_gemv(w, x.clone().requires_grad_(), ids, bias=bias, backend=backend)
    assert not y.requires_grad
    assert_routed_exact(y, w, x, ids, torch.bfloat16, bias=bias.detach())


def test_meta_tensors_are_refused_naming_w():
    w = random_fp4((4, 8, 64), "nvfp4", "linear", seed=19, device="cpu").to("meta")
    x = torch.ones(2, 64, dtype=torch.bfloat16, device="meta")
    ids = torch.zeros(2, 2, dtype=torch.int32, device="meta")
    for check_ids in (True, False):
        with pytest.raises(ValueError, match="w: expected a tensor with values, on cpu or cuda, got device meta"):
            fp4gemv.moe_gemv(w, x, ids, check_ids=check_ids)


def test_torch_compile_fullgraph():
    w = random_fp4((6, 8, 64), "mxfp4", "swizzled", seed=21)
    x = random_activation((3, 64), torch.bfloat16, seed=22)
    ids = torch.tensor([[5, 0], [0, 2], [2, 5]], dtype=torch.int64, device=DEVICE)
    bias = random_activation((6, 8), torch.bfloat16, seed=23)

    def step(x, ids):
        return fp4gemv.moe_gemv(w, x * 2, ids, bias=bias, backend="triton") + 1

    compiled = torch.compile(step, fullgraph=True)
    got = compiled(x, ids)
    eager = step(x, ids)
    assert torch.equal(got, eager)
    direct = routed(w, x * 2, ids, bias=bias)
    assert_routed_exact(direct, w, x * 2, ids, torch.bfloat16, bias=bias)


_SM90_SCRIPT = r"""
import torch
from aot import Sm90Launch, local_memory, sass_instructions, CUOBJDUMP
from fp4gemv import FP4Tensor
import os

# gpt-oss-20b's gate_up (MXFP4, 5760 x 2880, bias) at T = 1 (split), 8 (k32); NVFP4 with per-expert global
# scales at T = 2 (split) and 16 (fold); the CUDA-core fallback at T = 8; the epilogue (gpt-oss's activation at
# T = 8, SiLU with gate's and up's scales at T = 2).
for fmt, layout, tokens, top_k, bias, per_expert, kernel, activation in [
        ("mxfp4", "swizzled", 1, 4, True, False, None, None), ("mxfp4", "linear", 8, 4, True, False, None, None),
        ("nvfp4", "swizzled", 2, 8, False, True, None, None), ("nvfp4", "linear", 16, 8, False, True, None, None),
        ("mxfp4", "swizzled", 8, 4, True, False, "moe_general", None),
        ("mxfp4", "linear", 8, 4, True, False, None, "gpt-oss"), ("nvfp4", "swizzled", 2, 8, False, True, None, "silu")]:
    e, m, k = 32, 5760, 2880
    bs = 16 if fmt == "nvfp4" else 32
    w = FP4Tensor(torch.zeros(e, m, k // 2, dtype=torch.uint8), torch.zeros(e, m, k // bs, dtype=torch.uint8),
                  fmt).with_scale_layout(layout)
    launch = Sm90Launch.moe(w, torch.zeros(tokens, k, dtype=torch.bfloat16),
                            torch.zeros(tokens, top_k, dtype=torch.int32),
                            bias=torch.zeros(e, m, dtype=torch.bfloat16) if bias else None,
                            global_scales=(torch.ones(e, 2) if activation else torch.ones(e)) if per_expert else None,
                            kernel=kernel, activation=activation,
                            pair_weights=torch.ones(tokens, top_k) if activation else None)
    compiled = launch.compile()
    hmma = sum("HMMA" in i for i in sass_instructions(compiled)) if os.path.exists(CUOBJDUMP) else -1
    print(launch.spec.name, fmt, layout, tokens, top_k, "local:", local_memory(compiled), "hmma:", hmma)
"""


def test_compiles_for_sm90_without_local_memory(compile_for_sm90):
    """The routed kernels compile for sm_90 as the JIT would compile them: no local memory; the tensor-core one
    with its mma (HMMA) in the SASS, where cuobjdump is bundled."""
    lines = compile_for_sm90(_SM90_SCRIPT).strip().splitlines()
    assert len(lines) == 7, lines
    for line in lines:
        assert "local: []" in line, line
        if line.startswith("moe_weight_only"):
            assert "hmma: 0" not in line, line
    assert [line.split()[0] for line in lines] == ["moe_weight_only"] * 4 + ["moe_general"] + ["moe_weight_only"] * 2


@pytest.mark.gpu
def test_gpt_oss_shapes_on_gpu():
    """gpt-oss-20b's gate_up (5760 x 2880) and down (2880 x 2880) at T = 16, k = 4 with 32 experts."""
    for m in (5760, 2880):
        w = random_fp4((32, m, 2880), "mxfp4", "swizzled", seed=30 + m)
        x = random_activation((16, 2880), torch.bfloat16, seed=31)
        ids = random_ids(16, 4, 32, seed=32)
        bias = random_activation((32, m), torch.bfloat16, seed=33)
        got = fp4gemv.moe_gemv(w, x, ids, bias=bias)
        assert_routed_exact(got, w, x, ids, torch.bfloat16, bias=bias)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
def test_tensor_core_step_ptx_on_gpu(fmt, layout):
    """The PTX step against the oracle at K = 2880 (a partial last step), M = 272 (a row tail): T = 1 and 2
    (split), 8 and 16 (k32 / fold, top-4 of 32: groups up to 16, two passes), bf16 and fp16, bias, per-expert
    global scales for NVFP4."""
    w = random_fp4((32, 272, 2880), fmt, layout, seed=50)
    bias = random_activation((32, 272), torch.bfloat16, seed=51)
    scales = (torch.rand(32, generator=torch.Generator().manual_seed(52)) + 0.5).cuda() if fmt == "nvfp4" else None
    for tokens, act in ((1, torch.bfloat16), (2, torch.float16), (8, torch.bfloat16), (16, torch.float16)):
        x = random_activation((tokens, 2880), act, seed=53 + tokens)
        ids = random_ids(tokens, 4, 32, seed=54 + tokens)
        ids[-1, 0] = ids[0, 3]
        assert plan_of(w, x, ids, act, bias, scales, backend="auto").spec.name == "moe_weight_only"
        got = fp4gemv.moe_gemv(w, x, ids, bias=bias, global_scales=scales)
        assert_routed_exact(got, w, x, ids, act, bias=bias, global_scales=scales)


@pytest.mark.gpu
def test_cuda_graph_with_bad_ids_stays_in_bounds():
    """Under capture the ids are not checked: replayed with ids outside [0, E) the kernel writes zeros for those
    pairs, the exact result for the others, and touches nothing else (the sync after replay would raise an
    illegal address)."""
    w = random_fp4((8, 64, 256), "nvfp4", "linear", seed=34, global_scale=0.5)
    x = random_activation((4, 256), torch.bfloat16, seed=35)
    ids = random_ids(4, 2, 8, seed=36)
    out = torch.empty(4, 2, 64, dtype=torch.bfloat16, device="cuda")
    fp4gemv.moe_gemv(w, x, ids, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp4gemv.moe_gemv(w, x, ids, out=out)
    ids.copy_(torch.tensor([[0, 1 << 30], [-5, 3], [7, 8], [2, 2]], dtype=ids.dtype))
    graph.replay()
    torch.cuda.synchronize()
    for t, j in ((0, 1), (1, 0), (2, 1)):
        assert (out[t, j] == 0).all()
    assert_routed_exact(out, w, x, ids, torch.bfloat16)
    with pytest.raises(ValueError, match="expert_ids: expected ids in"):
        fp4gemv.moe_gemv(w, x, ids, out=out)
