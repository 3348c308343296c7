"""moe_gemv's kept launch (fp4gemv.moe's docstring): the first call of a metadata validates and plans, later calls
with new tensors of that metadata reuse the plan (and on CUDA with Triton 3.6 the compiled kernel's launcher, also
inside a CUDA graph) and give the bits of a fresh call; other metadata gets another plan; bad input is refused
as before, with the same messages, before anything is written; ``ops.clear_cache`` forgets the plans."""

import pytest
import torch

import fp4gemv
from fp4gemv import moe, ops
from fp4gemv.kernels.weight_only import WeightOnlyConfig
from operands import DEVICE, poisoned, random_activation, random_fp4


@pytest.fixture(autouse=True)
def fresh_cache():
    ops.clear_cache()
    yield
    ops.clear_cache()


def operands(seed, fmt="nvfp4", layout="linear", experts=4, rows=16, k=64, tokens=2, top_k=2, act=torch.bfloat16,
             w_scale=False, bias=False, scales=None, pair_weights=False, out=None, strided_x=False, **settings):
    """New tensors of one metadata (values from ``seed``): (w, x, ids, moe_gemv's keyword arguments).  scales:
    None, "expert" ([E]) or "halves" ([E, 2]); out: None or its dtype (also out_dtype); strided_x: x every other
    column (the Triton kernels read a contiguous copy); settings: moe_gemv's other keyword arguments."""
    g = torch.Generator().manual_seed(seed)
    w = random_fp4((experts, rows, k), fmt, layout, seed=seed, global_scale=0.5 if w_scale else None)
    x = random_activation((tokens, 2 * k if strided_x else k), act, seed=seed + 1)
    if strided_x:
        x = x[:, ::2]
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    kw = dict(dict(backend="triton"), **settings)
    if bias:
        kw["bias"] = random_activation((experts, rows), torch.bfloat16, seed=seed + 2)
    if scales is not None:
        kw["global_scales"] = (torch.rand((experts, 2) if scales == "halves" else (experts,), generator=g)
                               + 0.5).to(DEVICE)
    if pair_weights:
        kw["pair_weights"] = torch.rand(tokens, top_k, generator=g).to(DEVICE)
    if out is not None:
        width = rows // 2 if settings.get("activation") else rows
        kw["out"], kw["out_dtype"] = poisoned((tokens, top_k, width), out), out
    return w, x, ids.to(DEVICE), kw


CASES = {
    "nvfp4 w scale, out": dict(w_scale=True, out=torch.bfloat16),
    "mxfp4 swizzled, bias, gpt-oss": dict(fmt="mxfp4", layout="swizzled", bias=True, activation="gpt-oss"),
    "nvfp4 [E] scales, pair weights": dict(scales="expert", pair_weights=True, out=torch.float32),
    "nvfp4 [E, 2] scales, silu, weights": dict(scales="halves", activation="silu", pair_weights=True,
                                               out_dtype=torch.float32),
    "x copied, alpha, limit": dict(fmt="mxfp4", strided_x=True, bias=True, activation="gpt-oss", alpha=1.5,
                                   limit=3.0, out=torch.float16),
    "fp32 x (moe_general)": dict(act=torch.float32, bias=True, tokens=3),
    "moe_general's two steps": dict(kernel="moe_general", activation="silu", scales="halves", out=torch.bfloat16),
    "reference": dict(backend="reference", bias=True, activation="gpt-oss", pair_weights=True),
}


def _refuse_planning(monkeypatch):
    """Make every step of validation and planning raise: a kept call must not need them."""
    def planned(*args, **kwargs):
        raise AssertionError("planned again")

    for name in ("check_moe_arguments", "epilogue_constants", "plan_moe", "moe_case", "choose_kernel",
                 "resolve_target"):
        monkeypatch.setattr(moe, name, planned)


@pytest.mark.parametrize("case", CASES)
def test_a_kept_call_gives_a_fresh_calls_bits(case, monkeypatch):
    spec = dict(CASES[case])
    w, x, ids, kw = operands(1, **spec)
    first = fp4gemv.moe_gemv(w, x, ids, **kw)
    kept = moe.prepare_moe(w, x, ids, **{n: v for n, v in kw.items() if n not in ("check_ids", "check_values")})
    assert not kept.launches_by_address or DEVICE == "cuda"  # the interpreter compiles nothing
    assert kept.copy_x == (spec.get("strided_x", False) and kw["backend"] != "reference")
    w2, x2, ids2, kw2 = operands(2, **spec)
    with monkeypatch.context() as m:
        _refuse_planning(m)
        assert moe.prepare_moe(w2, x2, ids2, **kw2) is kept
        got = fp4gemv.moe_gemv(w2, x2, ids2, **kw2)
    assert "out" not in kw2 or got is kw2["out"]
    ops.clear_cache()
    assert moe.prepare_moe(w2, x2, ids2, **kw2) is not kept
    fresh = fp4gemv.moe_gemv(w2, x2, ids2, **dict(kw2, out=None if "out" not in kw2 else torch.empty_like(got)))
    assert torch.equal(got, fresh) and not torch.equal(got, first)


def test_the_kept_launch_keys_everything_the_plan_reads():
    w, x, ids, kw = operands(3, bias=True, out=torch.bfloat16, activation="gpt-oss")
    kept = moe.prepare_moe(w, x, ids, **kw)
    bias = kw["bias"]
    buffer = torch.empty(2 * 64 + 1, dtype=torch.bfloat16, device=DEVICE)
    changes = {
        "x dtype": dict(x=x.half()),
        "x strides": dict(x=torch.empty(2, 128, dtype=x.dtype, device=DEVICE)[:, :64]),
        "x alignment": dict(x=buffer[1:].view(2, 64)),
        "ids dtype": dict(expert_ids=ids.long()),
        "ids strides": dict(expert_ids=ids.t().contiguous().t()),
        "tokens": dict(x=x[:1], expert_ids=ids[:1], out=kw["out"][:1]),
        "no bias": dict(bias=None),
        "bias dtype": dict(bias=bias.float()),
        "global scales": dict(global_scales=torch.ones(4, device=DEVICE)),
        "pair weights": dict(pair_weights=torch.ones(2, 2, device=DEVICE)),
        "no out": dict(out=None),
        "out strides": dict(out=torch.empty(2, 8, 2, dtype=torch.bfloat16, device=DEVICE).transpose(1, 2)),
        "out_dtype": dict(out=None, out_dtype=torch.float32),
        "activation": dict(activation="silu"),
        "alpha": dict(alpha=1.0),
        "limit": dict(limit=3.0),
        "kernel": dict(kernel="moe_general"),
        "config": dict(config=WeightOnlyConfig(1, split=False)),
        "backend": dict(backend="reference"),
        "w format": dict(w=random_fp4((4, 16, 64), "mxfp4", "linear", seed=3)),
        "w layout": dict(w=random_fp4((4, 16, 64), "nvfp4", "swizzled", seed=3)),
        "w scale": dict(w=random_fp4((4, 16, 64), "nvfp4", "linear", seed=3, global_scale=2.0)),
    }
    kw_alpha = dict(kw, alpha=2.0)
    assert moe.prepare_moe(w, x, ids, **kw_alpha) is not moe.prepare_moe(w, x, ids, **dict(kw, alpha=2))
    for name, change in changes.items():
        args = dict(dict(w=w, x=x, expert_ids=ids, **kw), **change)
        other = moe.prepare_moe(args.pop("w"), args.pop("x"), args.pop("expert_ids"), **args)
        assert other is not kept, name
    assert moe.prepare_moe(w, x.clone(), ids.clone(), **dict(kw, out=torch.empty_like(kw["out"]))) is kept


def test_bad_input_after_a_kept_call_is_refused_with_the_same_messages():
    w, x, ids, kw = operands(4, bias=True, scales="expert", out=torch.bfloat16)
    out = kw["out"]
    fp4gemv.moe_gemv(w, x, ids, **kw)  # kept
    out.fill_(float("nan"))
    # ids and global scales are read per call when asked (check_ids, check_values), before anything is written.
    for bad in (4, -1):
        bad_ids = ids.clone()
        bad_ids[0, 1] = bad
        with pytest.raises(ValueError, match=rf"expert_ids: expected ids in \[0, 4\), got {bad} at \(0, 1\)"):
            fp4gemv.moe_gemv(w, x, bad_ids, **kw)
    scales = kw["global_scales"].clone()
    scales[2] = -1.0
    with pytest.raises(ValueError, match="global_scales: expected a positive normal float32"):
        fp4gemv.moe_gemv(w, x, ids, **dict(kw, global_scales=scales), check_values=True)
    assert torch.isnan(out).all()
    # An out sharing memory with an input of the same metadata as the kept call's.
    buf = random_activation((2, 64), torch.bfloat16, seed=5)
    before = buf.clone()
    with pytest.raises(ValueError, match="out: expected memory apart from every input .* shares memory with x"):
        fp4gemv.moe_gemv(w, buf, ids, **dict(kw, out=buf.view(-1)[:64].view(2, 2, 16)))
    bias_buf = kw["bias"].clone()
    with pytest.raises(ValueError, match="out: expected memory apart from every input .* shares memory with bias"):
        fp4gemv.moe_gemv(w, x, ids, **dict(kw, bias=bias_buf, out=bias_buf.view(-1)[:64].view(2, 2, 16)))
    assert torch.equal(buf, before)
    # Other metadata: validated in full.
    cases = [
        (dict(x=x[:, :32]), ValueError, r"x: expected \[T, K\] with K = 64"),
        (dict(x=x.to(torch.int32)), TypeError, "x: expected dtype float16, bfloat16, float32"),
        (dict(expert_ids=ids[:1]), ValueError, r"expert_ids: expected \[T, k\] with T = 2"),
        (dict(bias=torch.zeros(4, 9, device=DEVICE)), ValueError, r"bias: expected shape \[E, M\] = \(4, 16\)"),
        (dict(out=poisoned((2, 2, 9), torch.bfloat16)), ValueError, r"out: expected shape \[T, k, M\]"),
        (dict(out=poisoned((2, 2, 16), torch.float16)), TypeError, "out: expected dtype torch.bfloat16"),
        (dict(global_scales=torch.ones(3, device=DEVICE)), ValueError, r"global_scales: expected one per expert"),
        (dict(alpha=True, activation="gpt-oss", out=None), ValueError, "alpha: expected a positive finite number"),
        (dict(config=tuple(WeightOnlyConfig(1))), TypeError, "config: expected a WeightOnlyConfig"),
        (dict(backend="fast"), ValueError, "backend: expected one of"),
    ]
    fp4gemv.moe_gemv(w, x, ids, **dict(kw, activation="gpt-oss", alpha=1, out=None))  # kept: alpha=1 is fine
    fp4gemv.moe_gemv(w, x, ids, **dict(kw, config=WeightOnlyConfig(1), out=torch.empty_like(out)))  # kept
    for change, error, message in cases:
        args = dict(dict(x=x, expert_ids=ids, **kw), **change)
        with pytest.raises(error, match=message):
            fp4gemv.moe_gemv(w, args.pop("x"), args.pop("expert_ids"), **args)
    assert torch.isnan(out).all()


def test_a_kept_call_in_grad_mode_has_no_backward():
    w, x, ids, kw = operands(6, bias=True)
    fp4gemv.moe_gemv(w, x, ids, **kw)
    y = fp4gemv.moe_gemv(w, x.clone().requires_grad_(), ids, **kw)
    with pytest.raises(RuntimeError, match=r"moe_gemv has no backward \(inference only\)"):
        y.sum().backward()


def test_clear_cache_forgets_gemv_and_moe_plans():
    w, x, ids, kw = operands(7)
    kept = moe.prepare_moe(w, x, ids, **kw)
    a = random_fp4((16, 64), "nvfp4", "linear", seed=8)
    dense = ops.prepare_gemv(a, x)
    assert moe.prepare_moe(w, x, ids, **kw) is kept and ops.prepare_gemv(a, x) is dense
    ops.clear_cache()
    assert moe.prepare_moe(w, x, ids, **kw) is not kept and ops.prepare_gemv(a, x) is not dense


def test_direct_launch_follows_the_installed_triton_as_gemvs():
    import triton

    assert moe.PreparedMoe.__init__.__defaults__ == (ops.direct_launch_supported(triton.__version__),)
    assert issubclass(moe.PreparedMoe, ops.KeptLaunch) and issubclass(ops.PreparedGemv, ops.KeptLaunch)


def test_gemv_refuses_a_plain_tuple_config_after_a_kept_one():
    a, x = random_fp4((16, 64), "nvfp4", "linear", seed=9), random_activation((2, 64), torch.float16, seed=10)
    ops.gemv(a, x, backend="triton", config=WeightOnlyConfig(1))
    with pytest.raises(TypeError, match="config: expected a WeightOnlyConfig"):
        ops.gemv(a, x, backend="triton", config=tuple(WeightOnlyConfig(1)))


# --- GPU: the direct launch, in a CUDA graph ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("strided_x", [False, True])
def test_cuda_kept_launch_is_direct_and_captured(strided_x, monkeypatch):
    """gpt-oss-like gate_up (MXFP4 swizzled, bias, the activation, pair weights) at T = 2: after the first call the
    kept call launches the compiled kernel on addresses (Triton 3.6), gives a fresh call's bits, and inside
    torch.cuda.graph is captured on the capture stream (replayed on new values in place)."""
    import triton

    spec = dict(fmt="mxfp4", layout="swizzled", experts=8, rows=256, k=512, bias=True, activation="gpt-oss",
                pair_weights=True, out=torch.bfloat16, strided_x=strided_x, check_ids=False)
    w, x, ids, kw = operands(11, **spec)
    fp4gemv.moe_gemv(w, x, ids, **kw)  # compiles
    kept = moe.prepare_moe(w, x, ids, **{n: v for n, v in kw.items() if n != "check_ids"})
    assert kept.plan.spec.name == "moe_weight_only"
    assert kept.launches_by_address == ops.direct_launch_supported(triton.__version__)
    if kept.launches_by_address:
        def jit(*args):
            raise AssertionError("the JIT launched a kept call")
        monkeypatch.setattr(moe.PreparedMoe, "_launch_jit", jit)
    w2, x2, ids2, kw2 = operands(12, **spec)
    got = fp4gemv.moe_gemv(w2, x2, ids2, **kw2)
    graph_out = poisoned(got.shape, got.dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp4gemv.moe_gemv(w2, x, ids, **dict(kw2, out=graph_out))
    x.copy_(x2)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.undo()
    ops.clear_cache()
    fresh = fp4gemv.moe_gemv(w2, x2, ids2, **dict(kw2, out=torch.empty_like(got)))
    assert torch.equal(got, fresh) and torch.equal(graph_out, fresh)
