"""fp4gemv.moe_route against the float64 oracle (``reference.route_reference``): T = 1, 3, 16, 40 tokens, E = 32,
128, 256 (and 60, 1024) experts, top-1 / 4 / 8, both weight modes, both id dtypes, every weight dtype, ties,
negative, large and infinite logits, NaN, strided logits, validation, the kernel table, torch.compile, sm_90, and
on a GPU the kernel and a CUDA graph without a sync.

The kernel's ids must equal the oracle's; its weights lie within the bound of ``kernels/moe_route.py``'s error
model: ``(6 d + n + 9) 2^-24`` relative (d the largest |x - m| of an exp that does not underflow, n the terms
summed), 2^-126 absolute, and half an ulp of the weights' dtype."""

import pytest
import torch

import fp4gemv
from fp4gemv import route
from fp4gemv.kernels import ROUTE_KERNELS, choose_kernel
from fp4gemv.reference import route_reference
from fp4gemv.target import resolve_target
from operands import DEVICE, half_ulp

MODES = ("softmax_selected", "softmax_all")
# NumPy (Triton's interpreter) warns of the IEEE results some tests are about: inf - inf, exp overflow.
IEEE_NOTICES = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def routed(logits, top_k, **kw):
    """The kernel (on a CPU, in Triton's interpreter)."""
    return fp4gemv.moe_route(logits, top_k, backend="triton", **kw)


def random_logits(tokens, experts, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, experts, generator=g) * scale).to(dtype).to(DEVICE)


def weight_bound(x, ids, mode):
    """The error model's relative bound per token ``[T, 1]`` (module docstring), x float64 logits."""
    largest = x.gather(-1, ids[:, :1])
    terms = x if mode == "softmax_all" else x.gather(-1, ids)
    distance = largest - terms
    d = torch.where(distance <= 104, distance, 0.0).nan_to_num(0.0).amax(-1, keepdim=True)
    return (6 * d + terms.shape[1] + 9) * 2.0**-24


def assert_routes(logits, top_k, ids, weights, mode="softmax_selected", ids_dtype=torch.int32,
                  out_dtype=torch.float32):
    """ids equal to the oracle's (dtype and shape as asked), weights within the error model's bound of the exact
    ones (NaN exactly where the exact weight is NaN)."""
    assert ids.dtype == ids_dtype and weights.dtype == out_dtype
    assert ids.shape == weights.shape == (logits.shape[0], top_k)
    assert ids.device == weights.device == logits.device
    x = logits.cpu().to(torch.float64)
    exact_ids, exact = route_reference(x, top_k, mode, torch.float64)
    got_ids = ids.cpu().long()
    assert torch.equal(got_ids, exact_ids), (got_ids, exact_ids)
    got = weights.cpu().to(torch.float64)
    bound = weight_bound(x, exact_ids, mode) * exact.abs() + 2.0**-126 + half_ulp(got, out_dtype)
    ok = ((got - exact).abs() <= bound) | (got.isnan() & exact.isnan())
    if not ok.all():
        bad = (~ok).nonzero()[:5].tolist()
        raise AssertionError(f"{int((~ok).sum())} of {got.numel()} weights off the exact ones; first: "
                             f"{[(i, got[tuple(i)].item(), exact[tuple(i)].item()) for i in bad]}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("experts", [32, 128, 256])
def test_matches_the_oracle(experts, mode):
    """Every T in 1, 3, 16, 40 with every k in 1, 4, 8; logits dtypes, id dtypes and weight dtypes in turn
    (bf16 and fp16 logits bring ties of their own)."""
    logit_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    out_dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float32)
    for i, (tokens, top_k) in enumerate((t, k) for t in (1, 3, 16, 40) for k in (1, 4, 8)):
        logits = random_logits(tokens, experts, logit_dtypes[i % 3], seed=experts + i)
        ids_dtype, out_dtype = (torch.int32, torch.int64)[i % 2], out_dtypes[i % 4]
        ids, weights = routed(logits, top_k, weights=mode, ids_dtype=ids_dtype, out_dtype=out_dtype)
        assert_routes(logits, top_k, ids, weights, mode, ids_dtype, out_dtype)


def test_defaults_are_gpt_oss_routing():
    """Distinct logits: the ids of torch.topk and the weights of gpt-oss's torch.softmax(top.float()) (and, for
    softmax_all, torch.softmax over all E at the selected ids); int32 ids, float32 weights."""
    logits = random_logits(16, 32, torch.float32, seed=1)
    assert all(len(set(row.tolist())) == 32 for row in logits)
    top, want_ids = torch.topk(logits, 4, dim=-1)
    ids, weights = routed(logits, 4)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, torch.softmax(top.float(), dim=-1), rtol=2e-6, atol=0)
    _, all_weights = routed(logits, 4, weights="softmax_all")
    torch.testing.assert_close(all_weights, torch.softmax(logits, dim=-1).gather(-1, want_ids), rtol=2e-6, atol=0)


@IEEE_NOTICES
@pytest.mark.parametrize("mode", MODES)
def test_ties_go_to_the_lower_index(mode):
    """Equal logits (-0.0 and +0.0 too) by lower expert index first, across the k boundary as well."""
    nan = float("nan")
    rows = [
        [1.0] * 8,                                       # all equal: 0, 1, 2, 3
        [0.0, 2.0, 5.0, 2.0, 5.0, 2.0, 1.0, 2.0],        # 2, 4, then the 2.0s from the lowest: 1, 3
        [-0.0, 0.0, -1.0, -0.0, 0.0, -3.0, -0.0, -2.0],  # the zeros in index order
        [3.0, nan, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0],        # NaN first, then 3.0 from the lowest index
    ]
    logits = torch.tensor(rows, device=DEVICE)
    ids, weights = routed(logits, 4, weights=mode)
    want = [[0, 1, 2, 3], [2, 4, 1, 3], [0, 1, 3, 4], [1, 0, 2, 3]]
    assert ids.tolist() == want
    assert_routes(logits, 4, ids, weights, mode)
    expected_first = 0.25 if mode == "softmax_selected" else 0.125
    assert weights[0].tolist() == [expected_first] * 4
    for dtype in (torch.bfloat16, torch.float16):
        ids, weights = routed(logits.to(dtype), 4, weights=mode)
        assert ids.tolist() == want


@IEEE_NOTICES
@pytest.mark.parametrize("mode", MODES)
def test_negative_large_tiny_and_infinite_logits(mode):
    """All-negative rows, magnitudes near float32's and float16's largest, subnormals around zero, -inf among
    finite logits (weight 0), +inf (NaN weights, as torch.softmax), an all -inf row (NaN weights); E = 60 (padding
    lanes)."""
    inf = float("inf")
    logits = random_logits(8, 60, torch.float32, seed=5)
    logits[0] = logits[0] - 1e4                         # all negative
    logits[1, :3] = torch.tensor([3e38, -3e38, 2.9e38])
    logits[2, :4] = torch.tensor([1e-45, -1e-45, 0.0, -0.0])
    logits[2, 4:] = -1.0
    logits[3, ::2] = -inf                                # half -inf: weight 0 where selected after the rest
    logits[4, 7] = inf
    logits[5] = -inf
    logits[6] = logits[6] * 1e3                          # weights that underflow
    logits[7, :5] = -1e30
    for dtype in (torch.float32, torch.float16):  # in fp16 the large ones overflow, the subnormals flush
        x = logits.to(dtype)
        for top_k in (8, 31, 60):
            ids, weights = routed(x, top_k, weights=mode)
            assert_routes(x, top_k, ids, weights, mode)
    ids, weights = routed(logits, 60, weights=mode)
    assert ids[2, :4].tolist() == [0, 2, 3, 1]           # 1e-45 > 0.0 == -0.0 > -1e-45
    assert ids[4, 0] == 7 and weights[4].isnan().all()
    assert weights[5].isnan().all() and ids[5].tolist() == list(range(60))
    assert (weights[3, 30:] == 0).all() and not weights[3].isnan().any()


@IEEE_NOTICES
@pytest.mark.parametrize("mode", MODES)
def test_nan_counts_as_largest(mode):
    """A NaN is selected before any number, as torch.topk does (several NaNs by lower index), and makes its
    token's weights NaN; the other tokens are untouched."""
    nan = float("nan")
    logits = random_logits(5, 32, torch.float32, seed=9)
    logits[1, 20] = nan
    logits[2, [3, 17, 30]] = nan
    logits[3] = nan
    logits[4, 31] = nan                                  # selected only with top_k = 1: still NaN weights
    for top_k in (1, 4, 32):
        ids, weights = routed(logits, top_k, weights=mode)
        assert_routes(logits, top_k, ids, weights, mode)
        assert ids[1, 0] == 20 and ids[2, :3].tolist() == [3, 17, 30][:top_k]
        assert ids[3].tolist() == list(range(top_k))
        assert weights[1:].isnan().all() and not weights[0].isnan().any()
        _, torch_ids = torch.topk(logits, top_k, dim=-1)
        for t in range(5):  # NaNs first, as torch.topk (which NaNs, of more than k, is its own tie order)
            nans = min(top_k, int(logits[t].isnan().sum()))
            assert logits[t, ids[t, :nans].long()].isnan().all() and logits[t, torch_ids[t, :nans]].isnan().all()


def test_strided_logits_and_the_extremes_of_e():
    """Logits read through their strides (a column slice, a transposed view); E = 1 and E = 1024 (the most)."""
    base = random_logits(64, 40, torch.bfloat16, seed=11)
    for logits in (base[:, ::2], base[3:6], base.t().contiguous().t(), base[:16].t()):
        ids, weights = routed(logits, 4)
        assert_routes(logits, 4, ids, weights)
    one = random_logits(3, 1, torch.float32, seed=12)
    ids, weights = routed(one, 1, weights="softmax_all")
    assert ids.tolist() == [[0]] * 3 and weights.tolist() == [[1.0]] * 3
    most = random_logits(2, route.MAX_EXPERTS, torch.float32, seed=13)
    for mode in MODES:
        ids, weights = routed(most, 8, weights=mode)
        assert_routes(most, 8, ids, weights, mode)


def test_kernel_table_and_the_cpu_path():
    """The kernel where Triton runs, the oracle otherwise; backend='auto' on CPU tensors is the float64 oracle
    rounded once (bit for bit), with the same dtypes and shapes as the kernel's."""
    logits = random_logits(3, 32, torch.float32, seed=14).cpu()
    case = route.route_case(logits, 4, "softmax_all", torch.int32, torch.bfloat16)
    assert choose_kernel(case, resolve_target("reference", logits.device), None, ROUTE_KERNELS).name == \
        "route_reference"
    assert choose_kernel(case, resolve_target("auto", logits.device), None, ROUTE_KERNELS).name == "route_reference"
    if DEVICE == "cpu":
        assert choose_kernel(case, resolve_target("triton", logits.device), None, ROUTE_KERNELS).name == "moe_route"
    for mode in MODES:
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            ids, weights = fp4gemv.moe_route(logits, 4, weights=mode, out_dtype=out_dtype, ids_dtype=torch.int64)
            want_ids, want = route_reference(logits, 4, mode, out_dtype)
            assert ids.dtype == torch.int64 and torch.equal(ids, want_ids)
            assert weights.dtype == out_dtype and torch.equal(weights, want)
            ids, _ = fp4gemv.moe_route(logits, 4, weights=mode, backend="reference")
            assert ids.dtype == torch.int32


def test_validation_names_the_argument():
    logits = random_logits(2, 8, torch.float32, seed=15)
    cases = [
        (dict(logits=logits.tolist()), TypeError, r"logits: expected a torch.Tensor \[T, E\], got list"),
        (dict(logits=logits.to(torch.int32)), TypeError, "logits: expected dtype float16, bfloat16, float32, got "
                                                         "torch.int32"),
        (dict(logits=logits.double()), TypeError, "logits: expected dtype .* got torch.float64"),
        (dict(logits=logits[0]), ValueError, r"logits: expected 2 dims \[T, E\], got shape \(8,\)"),
        (dict(logits=logits[None]), ValueError, r"logits: expected 2 dims \[T, E\], got shape \(1, 2, 8\)"),
        (dict(logits=logits[:0]), ValueError, r"logits: expected \[T, E\] with T >= 1 .* got shape \(0, 8\)"),
        (dict(logits=torch.zeros(1, 1025, device=DEVICE)), ValueError,
         r"logits: expected \[T, E\] with T >= 1 and 1 <= E <= 1024, got shape \(1, 1025\)"),
        (dict(logits=torch.zeros(2, 8, device="meta")), ValueError,
         "logits: expected a tensor with values, on cpu or cuda, got device meta"),
        (dict(top_k=2.0), TypeError, "top_k: expected an int, got float"),
        (dict(top_k=True), TypeError, "top_k: expected an int, got bool"),
        (dict(top_k=0), ValueError, "top_k: expected 1 <= top_k <= E = 8, got 0"),
        (dict(top_k=9), ValueError, "top_k: expected 1 <= top_k <= E = 8, got 9"),
        (dict(weights="softmax"), ValueError, "weights: expected one of 'softmax_selected', 'softmax_all', got "
                                              "'softmax'"),
        (dict(ids_dtype=torch.int16), TypeError, "ids_dtype: expected int32, int64, got torch.int16"),
        (dict(out_dtype=torch.float64), TypeError, "out_dtype: expected float32, bfloat16, float16, got "
                                                   "torch.float64"),
        (dict(out_dtype="float32"), TypeError, "out_dtype: expected float32, bfloat16, float16, got 'float32'"),
        (dict(backend="cuda"), ValueError, "backend: expected one of 'auto', 'triton-ptx', 'triton', 'reference'"),
    ]
    for change, error, message in cases:
        args = dict(logits=logits, top_k=2)
        args.update(change)
        with pytest.raises(error, match=message):
            fp4gemv.moe_route(args.pop("logits"), args.pop("top_k"), **args)


def test_no_backward_says_so():
    """Inference only: in grad mode the weights are computed and a backward through them raises the message;
    under torch.compile such logits are refused up front."""
    logits = random_logits(2, 8, torch.float32, seed=16).requires_grad_()
    for backend in ("triton", "reference"):
        ids, weights = fp4gemv.moe_route(logits, 2, backend=backend)
        assert_routes(logits.detach(), 2, ids, weights.detach())
        with pytest.raises(RuntimeError, match=r"moe_route has no backward \(inference only\)"):
            weights.sum().backward()
    with pytest.raises(Exception, match="logits: expected a tensor that does not require grad under torch.compile"):
        torch.compile(lambda x: fp4gemv.moe_route(x, 2)[1], fullgraph=True)(logits)


def test_torch_compile_fullgraph():
    """Traced as the custom op torch.ops.fp4gemv.moe_route between other ops: the eager results, bit for bit;
    argument errors raise while tracing."""
    logits = random_logits(3, 32, torch.bfloat16, seed=17)

    def step(x):
        ids, weights = fp4gemv.moe_route(x * 2, 4, weights="softmax_all", ids_dtype=torch.int64, backend="triton")
        return ids + 1, weights * 2

    got = torch.compile(step, fullgraph=True)(logits)
    want = step(logits)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ids, weights = routed(logits * 2, 4, weights="softmax_all", ids_dtype=torch.int64)
    assert_routes(logits * 2, 4, ids, weights, "softmax_all", torch.int64)
    with pytest.raises(Exception, match="top_k: expected 1 <= top_k <= E = 32, got 33"):
        torch.compile(lambda x: fp4gemv.moe_route(x, 33), fullgraph=True)(logits)


def test_custom_op_passes_opcheck():
    from torch.library import opcheck

    logits = random_logits(3, 16, torch.float32, seed=18)
    for args in ((logits, 4, "softmax_selected", torch.int32, torch.float32, "triton"),
                 (logits.bfloat16(), 2, "softmax_all", torch.int64, torch.bfloat16, "auto")):
        result = opcheck(torch.ops.fp4gemv.moe_route.default, args)
        assert set(result.values()) == {"SUCCESS"}, result


_SM90_SCRIPT = r"""
import re
import torch
from aot import Sm90Launch, local_memory

for tokens, experts, top_k, mode, dtype, out_dtype in [
        (1, 32, 4, "softmax_selected", torch.bfloat16, torch.float32), (16, 128, 8, "softmax_all", torch.float32,
        torch.bfloat16), (40, 256, 8, "softmax_selected", torch.float16, torch.float16),
        (3, 1024, 8, "softmax_all", torch.bfloat16, torch.float32)]:
    launch = Sm90Launch.route(torch.zeros(tokens, experts, dtype=dtype), top_k, weights=mode, out_dtype=out_dtype)
    compiled = launch.compile()
    bad = [op for op in ("div.full", "div.approx", "rcp.approx", ".ftz") if op in compiled.asm["ptx"]]
    print(launch.spec.name, tokens, experts, "local:", local_memory(compiled), "bad:", bad)
"""


def test_compiles_for_sm90_without_local_memory(compile_for_sm90):
    """The routing kernel compiles for sm_90 as the JIT would: no local memory, the division rounded to nearest,
    no flush to zero."""
    lines = compile_for_sm90(_SM90_SCRIPT).strip().splitlines()
    assert len(lines) == 4, lines
    for line in lines:
        assert line.startswith("moe_route ") and "local: []" in line and "bad: []" in line, line


@pytest.mark.gpu
def test_kernel_on_gpu():
    """The compiled kernel against the oracle: gpt-oss (32 experts top-4, 128 top-4), Qwen3-MoE (128 top-8, both
    modes), DeepSeek (256 top-8), the largest E; with ties, NaN and infinities."""
    for tokens, experts, top_k in ((1, 32, 4), (16, 128, 4), (40, 128, 8), (7, 256, 8), (3, 1024, 16)):
        for i, dtype in enumerate((torch.bfloat16, torch.float32, torch.float16)):
            logits = random_logits(tokens, experts, dtype, seed=20 + experts + i)
            logits[0, 1] = logits[0, 0]
            if tokens > 2:
                logits[1, 5] = float("nan")
                logits[2, 3] = float("-inf")
            for mode in MODES:
                out_dtype = (torch.float32, torch.bfloat16, torch.float16)[i]
                ids, weights = fp4gemv.moe_route(logits, top_k, weights=mode, out_dtype=out_dtype)
                assert_routes(logits, top_k, ids, weights, mode, out_dtype=out_dtype)


@pytest.mark.gpu
def test_cuda_graph_without_a_sync():
    """An eager call syncs nothing (sync debug mode "error"); captured in a CUDA graph and replayed on new logits,
    the results are the new logits' routing."""
    logits = random_logits(8, 128, torch.bfloat16, seed=40)
    fp4gemv.moe_route(logits, 8, weights="softmax_all", ids_dtype=torch.int64)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids, weights = fp4gemv.moe_route(logits, 8, weights="softmax_all", ids_dtype=torch.int64)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_routes(logits, 8, ids, weights, "softmax_all", torch.int64)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = fp4gemv.moe_route(logits, 8, weights="softmax_all", ids_dtype=torch.int64)
    logits.copy_(random_logits(8, 128, torch.bfloat16, seed=41))
    graph.replay()
    torch.cuda.synchronize()
    assert_routes(logits, 8, ids, weights, "softmax_all", torch.int64)
