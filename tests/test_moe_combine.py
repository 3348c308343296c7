"""fp4gemv.moe_combine against its definition (``reference.combine_reference``: the k slots summed in IEEE fp32
in slot order, rounded once), bit for bit: k = 1 .. 8, H with tails and over one program's block, every output
dtype, strided y, NaN and infinities, values whose sum depends on the order, T = 0, validation, the kernel
table, torch.compile, sm_90, and on a GPU the kernel and a CUDA graph without a sync."""

import pytest
import torch

import fp4gemv
from fp4gemv import combine
from fp4gemv.kernels import COMBINE_KERNELS, choose_kernel
from fp4gemv.kernels.moe_combine import COMBINE_BLOCK, MAX_BLOCK, CombineConfig, MoeCombine, combine_config
from fp4gemv.reference import combine_reference
from fp4gemv.target import resolve_target
from operands import DEVICE

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# NumPy (Triton's interpreter) warns of the IEEE results some tests are about: inf - inf.
IEEE_NOTICES = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def random_y(tokens, top_k, hidden, seed, scale=4.0):
    """Weighted expert outputs: normal values over a wide range of magnitudes (2^-20 .. 2^20 times scale)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(tokens, top_k, hidden, generator=g) * scale
    y = y * torch.exp2(torch.randint(-20, 21, (tokens, top_k, hidden), generator=g).float())
    return y.to(DEVICE)


def assert_combined(y, out, out_dtype):
    assert out.dtype == out_dtype and out.shape == (y.shape[0], y.shape[2]) and out.is_contiguous()
    want = combine_reference(y.cpu(), out_dtype)
    got = out.cpu()
    same = (got == want) | (got.isnan() & want.isnan())
    assert same.all(), (int((~same).sum()), got[~same][:5], want[~same][:5])


@IEEE_NOTICES
@pytest.mark.parametrize("top_k", (1, 2, 4, 8))
@pytest.mark.parametrize("hidden", (1, 100, 2880, MAX_BLOCK + 3))
def test_matches_the_definition(top_k, hidden):
    for i, out_dtype in enumerate(DTYPES):
        y = random_y(3, top_k, hidden, seed=100 * top_k + hidden + i)
        assert_combined(y, fp4gemv.moe_combine(y, out_dtype=out_dtype, backend="triton"), out_dtype)


def test_the_order_is_the_slots_order():
    """1 + 2^-24 + 2^-24 depends on the order: in slot order each 2^-24 rounds away (ties to even), so the sum is
    1; summed the other way, 1 + 2^-23.  The kernel gives the slot order's, and so does the CPU path."""
    y = torch.tensor([[[1.0], [2.0**-24], [2.0**-24]], [[2.0**-24], [2.0**-24], [1.0]]], device=DEVICE)
    for backend in ("triton", "auto"):
        out = fp4gemv.moe_combine(y, out_dtype=torch.float32, backend=backend)
        assert out.cpu().tolist() == [[1.0], [1.0 + 2.0**-23]]


@IEEE_NOTICES
def test_nan_and_infinities_propagate():
    y = random_y(4, 4, 64, seed=1)
    y[0, 1, 3] = float("nan")
    y[1, 0, 5] = float("inf")
    y[1, 2, 5] = float("-inf")  # inf + -inf: NaN
    y[2, 3, 7] = float("inf")
    y[3, 0, 0] = 3.0e38  # overflows fp32 with the next slot
    y[3, 1, 0] = 3.0e38
    for out_dtype in DTYPES:
        out = fp4gemv.moe_combine(y, out_dtype=out_dtype, backend="triton")
        assert_combined(y, out, out_dtype)
        got = out.cpu().float()
        assert got[0, 3].isnan() and got[1, 5].isnan() and got[2, 7] == float("inf") and got[3, 0] == float("inf")


def test_strided_y():
    """Any strides: a slice of a wider tensor, slots and tokens transposed."""
    base = random_y(5, 6, 300, seed=2)
    for y in (base[:, 1:5, :250], base.transpose(0, 1)[:4], base[::2, ::2, ::3]):
        assert not y.is_contiguous()
        assert_combined(y, fp4gemv.moe_combine(y, backend="triton"), torch.bfloat16)


def test_no_tokens():
    y = torch.zeros(0, 4, 32, device=DEVICE)
    for backend in ("triton", "reference"):
        out = fp4gemv.moe_combine(y, backend=backend)
        assert out.shape == (0, 32) and out.dtype == torch.bfloat16


def test_kernel_table_the_cpu_path_and_the_config():
    """The kernel where Triton runs, the reference otherwise; backend='auto' on CPU tensors is the reference, bit for
    bit the kernel's result; one warp and COMBINE_BLOCK columns a program (fewer where H is smaller)."""
    y = random_y(2, 4, 40, seed=3).cpu()
    case = combine.combine_case(y, torch.bfloat16)
    assert choose_kernel(case, resolve_target("auto", y.device), None, COMBINE_KERNELS).name == "combine_reference"
    assert choose_kernel(case, resolve_target("reference", y.device), None, COMBINE_KERNELS).name == \
        "combine_reference"
    if DEVICE == "cpu":
        assert choose_kernel(case, resolve_target("triton", y.device), None, COMBINE_KERNELS).name == "moe_combine"
    for out_dtype in DTYPES:
        assert torch.equal(fp4gemv.moe_combine(y, out_dtype=out_dtype), combine_reference(y, out_dtype))
    assert combine_config(2880) == CombineConfig(COMBINE_BLOCK, 1) == combine_config(2048)
    assert COMBINE_BLOCK <= MAX_BLOCK
    assert combine_config(100) == CombineConfig(128, 1) and combine_config(1) == CombineConfig(1, 1)
    with pytest.raises(ValueError, match="config.block: expected at most"):
        MoeCombine().check_config(CombineConfig(2 * MAX_BLOCK, 1))


def test_validation_names_the_argument():
    y = random_y(2, 4, 8, seed=4)
    cases = [
        (dict(y=y.tolist()), TypeError, r"y: expected a torch.Tensor \[T, k, H\], got list"),
        (dict(y=y.bfloat16()), TypeError, "y: expected dtype float32, got torch.bfloat16"),
        (dict(y=y[0]), ValueError, r"y: expected 3 dims \[T, k, H\] with k >= 1 and H >= 1, got shape \(4, 8\)"),
        (dict(y=y[:, :0]), ValueError, r"y: expected 3 dims .* got shape \(2, 0, 8\)"),
        (dict(y=torch.zeros(2, 4, 8, device="meta")), ValueError,
         "y: expected a tensor with values, on cpu or cuda, got device meta"),
        (dict(out_dtype=torch.float64), TypeError, "out_dtype: expected bfloat16, float16, float32, got torch.float64"),
        (dict(out_dtype="bfloat16"), TypeError, "out_dtype: expected bfloat16, float16, float32, got 'bfloat16'"),
        (dict(backend="cuda"), ValueError, "backend: expected one of 'auto', 'triton-ptx', 'triton', 'reference'"),
    ]
    for change, error, message in cases:
        args = dict(y=y)
        args.update(change)
        with pytest.raises(error, match=message):
            fp4gemv.moe_combine(args.pop("y"), **args)


def test_no_backward_says_so():
    """Inference only: in grad mode the sum is computed and a backward through it raises the message; under
    torch.compile such a y is refused up front."""
    y = random_y(2, 4, 8, seed=5).requires_grad_()
    for backend in ("triton", "reference"):
        out = fp4gemv.moe_combine(y, backend=backend)
        assert_combined(y.detach(), out.detach(), torch.bfloat16)
        with pytest.raises(RuntimeError, match=r"moe_combine has no backward \(inference only\)"):
            out.float().sum().backward()
    with pytest.raises(Exception, match="y: expected a tensor that does not require grad under torch.compile"):
        torch.compile(lambda t: fp4gemv.moe_combine(t), fullgraph=True)(y)


@IEEE_NOTICES
def test_torch_compile_fullgraph():
    """Traced as the custom op torch.ops.fp4gemv.moe_combine between other ops: the eager results, bit for bit;
    argument errors raise while tracing."""
    y = random_y(3, 4, 96, seed=6)

    def step(t):
        return fp4gemv.moe_combine(t * 2, out_dtype=torch.float16, backend="triton") + 1

    assert torch.equal(torch.compile(step, fullgraph=True)(y), step(y))
    with pytest.raises(Exception, match="out_dtype: expected bfloat16, float16, float32, got torch.int8"):
        torch.compile(lambda t: fp4gemv.moe_combine(t, out_dtype=torch.int8), fullgraph=True)(y)


def test_custom_op_passes_opcheck():
    from torch.library import opcheck

    y = random_y(3, 4, 16, seed=7)
    for args in ((y, torch.bfloat16, "triton"), (y[:, :2], torch.float32, "auto")):
        result = opcheck(torch.ops.fp4gemv.moe_combine.default, args)
        assert set(result.values()) == {"SUCCESS"}, result


_SM90_SCRIPT = r"""
import torch
from aot import Sm90Launch, local_memory

for tokens, top_k, hidden, out_dtype in [(1, 4, 2880, torch.bfloat16), (16, 8, 2048, torch.float16),
                                         (3, 1, 100, torch.float32)]:
    launch = Sm90Launch.combine(torch.zeros(tokens, top_k, hidden), out_dtype)
    compiled = launch.compile()
    print(launch.spec.name, tokens, top_k, hidden, "local:", local_memory(compiled))
"""


def test_compiles_for_sm90_without_local_memory(compile_for_sm90):
    lines = compile_for_sm90(_SM90_SCRIPT).strip().splitlines()
    assert len(lines) == 3, lines
    for line in lines:
        assert line.startswith("moe_combine ") and "local: []" in line, line


@pytest.mark.gpu
@IEEE_NOTICES
def test_kernel_on_gpu():
    """The compiled kernel against the definition: gpt-oss (k = 4, H = 2880) and Qwen3 (k = 8, H = 2048) shapes,
    T = 1 and 16, every output dtype, with NaN and infinities."""
    for tokens, top_k, hidden in ((1, 4, 2880), (16, 4, 2880), (16, 8, 2048), (5, 3, 1000)):
        y = random_y(tokens, top_k, hidden, seed=tokens + top_k + hidden)
        y[0, 0, 1] = float("nan")
        y[-1, -1, 2] = float("inf")
        for out_dtype in DTYPES:
            assert_combined(y, fp4gemv.moe_combine(y, out_dtype=out_dtype), out_dtype)


@pytest.mark.gpu
def test_cuda_graph_without_a_sync():
    """An eager call syncs nothing (sync debug mode "error"); captured in a CUDA graph and replayed on new y, the
    result is the new y's sum."""
    y = random_y(8, 4, 2880, seed=8)
    fp4gemv.moe_combine(y)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fp4gemv.moe_combine(y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_combined(y, out, torch.bfloat16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp4gemv.moe_combine(y)
    y.copy_(random_y(8, 4, 2880, seed=9))
    graph.replay()
    torch.cuda.synchronize()
    assert_combined(y, out, torch.bfloat16)
