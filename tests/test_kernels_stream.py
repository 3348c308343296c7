"""The streaming kernel (kernels/stream.py): its pure-Triton twin against the exact oracle for every shipped
configuration (CPU, interpreter), its PTX decode for every byte, dispatch, its refusals, and its sm_90 machine code
(TMA copies, tensor cores, no local memory) compiled offline."""

import textwrap

import pytest
import torch

import operands as O
from fp4gemv import gemv, select_kernel
from fp4gemv.kernels.stream import SHIPPED_CONFIGS, Stream, StreamConfig, decode_asm, stream_config
from fp4gemv.kernels import choose_kernel, stream
from fp4gemv.ops import gemv_operands
from fp4gemv.target import SM90, Target
from ptx_emulator import emulate_ptx



def _case(m, k, n, batch=1, dtype=torch.bfloat16, layout="swizzled"):
    a = O.random_fp4((batch, m, k), "nvfp4", layout, seed=1, device="cpu")
    b = O.random_activation((n, k), dtype, seed=2, device="cpu")
    return gemv_operands(a, b, torch.empty((batch, m, n), dtype=torch.float16)).case


@pytest.mark.parametrize("config", SHIPPED_CONFIGS, ids=lambda c: f"ksplit{c.ksplit}-stages{c.num_stages}")
@pytest.mark.parametrize("layout", ["swizzled", "linear"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_twin_matches_exact_result(config, layout, dtype):
    # Rows not a multiple of 64 (a partial tile), N < 16, a batch, a global scale, K of 2048 (8 steps).
    a = O.random_fp4((2, 100, 2048), "nvfp4", layout, seed=3, global_scale=0.375, device="cpu")
    b = O.random_activation((2, 5, 2048), dtype, seed=4, device="cpu")
    out = O.poisoned((2, 100, 5), torch.float32, device="cpu")
    gemv(a, b, out=out, out_dtype=torch.float32, backend="triton", kernel="stream", config=config)
    O.assert_matches_exact(out, a, b, torch.float32, tensor_cores=True, fold=0)


@pytest.mark.parametrize("k_width", [8, 4])
def test_twin_matches_exact_result_in_either_k_order(monkeypatch, k_width):
    """Both K orders the kernel compiles (``MMA_K_WIDTH``: 8 before Triton 3.8; 4 from 3.8 on, which regroups K in
    both operands) give the exact result; a split K, whose launch is not kept, reads the constant anew."""
    monkeypatch.setattr(stream, "MMA_K_WIDTH", k_width)
    a = O.random_fp4((70, 1024), "nvfp4", "swizzled", seed=9, device="cpu")
    b = O.random_activation((11, 1024), torch.bfloat16, seed=10, device="cpu")
    out = O.poisoned((70, 11), torch.float32, device="cpu")
    gemv(a, b, out=out, out_dtype=torch.float32, backend="triton", kernel="stream",
         config=StreamConfig(64, 256, 2, 2, 2))
    O.assert_matches_exact(out, a, b, torch.float32, tensor_cores=True, fold=0)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_sixteen_rows_rounded_once(out_dtype):
    a = O.random_fp4((192, 512), "nvfp4", "swizzled", seed=5, device="cpu")
    b = O.random_activation((16, 512), torch.bfloat16, seed=6, device="cpu")
    got = gemv(a, b, out_dtype=out_dtype, backend="triton", kernel="stream", config=StreamConfig(64, 256, 2, 2, 2))
    O.assert_matches_exact(got, a, b, out_dtype, tensor_cores=True, fold=0)


def test_bound_rejects_a_wrong_scale():
    """The check can fail: the same product with one block scale doubled is off the bound."""
    a = O.random_fp4((64, 512), "nvfp4", "linear", seed=7, device="cpu")
    b = O.random_activation((3, 512), torch.bfloat16, seed=8, device="cpu")
    got = gemv(a, b, out_dtype=torch.float32, backend="triton", kernel="stream", config=StreamConfig(64, 256, 1, 2, 2))
    scales = a.scales.clone()
    scales[5, 3] = (scales[5, 3] + 8) % 0x7F  # one more exponent step: twice the scale
    wrong = type(a)(a.data, scales, "nvfp4", "linear")
    assert not O.within_bound(got, wrong, b, torch.float32, tensor_cores=True, fold=0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_ptx_gives_every_bytes_two_values(dtype):
    lines = [line.strip() for line in decode_asm(dtype).splitlines() if line.strip() not in ("{", "}")]
    lines = [line for line in lines if not line.startswith(".reg")]
    values = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=dtype)
    bits = values.view(torch.int16).to(torch.int32) & 0xFFFF
    for b0 in range(256):
        rest = [(b0 * 7 + 3) % 256, (b0 * 13 + 5) % 256, 255 - b0]
        word = [b0] + rest
        regs = emulate_ptx(lines, {"$4": word[0] * 0x0101 | word[1] * 0x01010000,
                                   "$5": word[2] * 0x0101 | word[3] * 0x01010000})
        for j, byte in enumerate(word):
            assert regs[f"${j}"] == int(bits[byte & 15]) | int(bits[byte >> 4]) << 16, (b0, j)


def test_dispatch_from_nine_rows_on_sm90_where_the_engine_does_not_run():
    a = O.random_fp4((256, 768), "nvfp4", "swizzled", seed=9, device="cpu")  # K < 1024: the engine defers
    for n, expected in ((8, "weight_only"), (9, "stream"), (16, "stream")):
        case = gemv_operands(a, torch.empty(n, 768, dtype=torch.bfloat16), torch.empty(256, n)).case
        assert choose_kernel(case, SM90).name == expected, n


def test_refusals_name_the_reason():
    spec = Stream()
    assert "NVFP4" in spec.why_not(_case_mx(), SM90)
    assert "K a multiple of 256" in spec.why_not(_case(128, 2880 // 32 * 32, 4), SM90)
    assert "N <= 16" in spec.why_not(_case(128, 512, 17), SM90)
    assert "sm_90" in spec.why_not(_case(128, 512, 4), Target("cuda", (8, 9), 128, "ptx"))


def _case_mx():
    a = O.random_fp4((128, 512), "mxfp4", "swizzled", seed=1, device="cpu")
    return gemv_operands(a, torch.empty(4, 512, dtype=torch.bfloat16), torch.empty(128, 4)).case


def test_default_config_splits_k_to_fill_the_gpu():
    assert stream_config(_case(7168, 16384, 16), 132).ksplit == 4
    assert stream_config(_case(28672, 8192, 16), 132).ksplit == 1
    assert stream_config(_case(4096, 4096, 16), 132).ksplit == 8
    assert stream_config(_case(4096, 512, 16), 132).ksplit == 2  # K / 256 = 2 steps: ksplit divides it


def test_bad_config_is_a_value_error_before_writing():
    a = O.random_fp4((64, 512), "nvfp4", "swizzled", seed=1, device="cpu")
    b = O.random_activation((3, 512), torch.bfloat16, seed=2, device="cpu")
    out = O.poisoned((64, 3), torch.float32, device="cpu")
    with pytest.raises(ValueError, match="ksplit to divide"):
        gemv(a, b, out=out, out_dtype=torch.float32, backend="triton", kernel="stream", config=StreamConfig(64, 256, 4))
    assert torch.isnan(out).all()


def test_selected_on_cpu_only_by_name():
    a = O.random_fp4((64, 512), "nvfp4", "swizzled", seed=1, device="cpu")
    b = O.random_activation((12, 512), torch.bfloat16, seed=2, device="cpu")
    assert select_kernel(a, b).name == "reference"


_COMPILE = textwrap.dedent("""
    import collections, sys, torch, triton
    sys.path.insert(0, "tests")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from aot import local_memory, sass_listing
    from fp4gemv.kernels import stream as S
    for swizzled in (False, True):
        sig = {n: "i32" for n in S.stream_gemv_kernel.arg_names}
        sig.update(a_ptr="*u8", sfa_ptr="*u8", b_ptr="*bf16", gsa_ptr="*u8", c_ptr="*fp32")
        const = dict(DECODE=S._DECODE_ASM[torch.bfloat16], CONSTRAINTS=S._CONSTRAINTS, BF16=True, SWIZZLED=swizzled,
                     HAS_GSA=False, USE_PTX=True, SPLIT=True, K_WIDTH=S.MMA_K_WIDTH, BLOCK_M=64, BLOCK_K=256,
                     KSPLIT=4, NUM_STAGES=4)
        sig.update({k: "constexpr" for k in const})
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
        c = triton.compile(ASTSource(S.stream_gemv_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=2))
        ops = collections.Counter(op.split(".")[0] for _, op, _ in sass_listing(c))
        print(swizzled, ops["UTMALDG"], ops["HMMA"], local_memory(c))
""")


def test_compiles_for_sm90_with_bulk_copies_and_no_local_memory(compile_for_sm90):
    lines = compile_for_sm90(_COMPILE).strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        swizzled, tma, mma, local = line.split(" ", 3)
        assert int(tma) >= 2, line  # weights and scales through the copy engine
        assert int(mma) > 0, line
        assert local == "[]", line


# --- GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["swizzled", "linear"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, k, n, batch", [(4096, 4096, 16, 1), (1000, 2048, 9, 2), (7168, 1024, 13, 1)])
def test_ptx_path_exact_and_equal_to_its_twin(layout, dtype, m, k, n, batch):
    a = O.random_fp4((batch, m, k), "nvfp4", layout, seed=m, global_scale=0.375 if batch > 1 else None, device="cuda")
    b = O.random_activation((n, k), dtype, seed=k, device="cuda")
    for config in SHIPPED_CONFIGS:
        if (k // 256) % config.ksplit:
            continue
        out = O.poisoned((batch, m, n), torch.bfloat16, device="cuda")
        gemv(a, b, out=out, out_dtype=torch.bfloat16, backend="triton-ptx", kernel="stream", config=config)
        O.assert_matches_exact(out, a, b, torch.bfloat16, tensor_cores=True, fold=0)
        # The compiled twin at one shape per layout and dtype (each twin is a compile of its own): the interpreter
        # checks its indexing at every config (test_twin_matches_exact_result); what the GPU adds is that its
        # pure-Triton code compiles and runs right, which this shape shows with tail rows, a batch, a global
        # scale and all four K splits (K = 2048).
        if batch > 1:
            twin = gemv(a, b, out_dtype=torch.bfloat16, backend="triton", kernel="stream", config=config)
            O.assert_matches_exact(twin, a, b, torch.bfloat16, tensor_cores=True, fold=0)


@pytest.mark.gpu
def test_chosen_on_the_gpu_from_nine_rows_where_the_engine_does_not_run():
    a = O.random_fp4((4096, 768), "nvfp4", "swizzled", seed=1, device="cuda")  # K < 1024: the engine defers
    assert select_kernel(a, torch.empty(9, 768, dtype=torch.bfloat16, device="cuda")).name == "stream"
    assert select_kernel(a, torch.empty(8, 768, dtype=torch.bfloat16, device="cuda")).name == "weight_only"


def test_an_unsplit_k_is_one_launch_the_op_layer_keeps():
    case = _case(256, 1024, 12)
    spec = Stream()
    kept = spec.triton_launch(case, StreamConfig(64, 256, 1, 2, 4), SM90)
    assert kept is not None and kept.grid == (4, 1, 1) and kept.options == dict(num_warps=2)
    assert spec.triton_launch(case, StreamConfig(64, 256, 4, 2, 4), SM90) is None  # two kernels: launch() each call


_UNSPLIT_COMPILE = textwrap.dedent("""
    import torch
    from aot import Sm90Launch, local_memory
    from fp4gemv import FP4Tensor
    a = FP4Tensor(torch.zeros(28672, 4096, dtype=torch.uint8), torch.full((28672, 512), 0x38, dtype=torch.uint8),
                  "nvfp4", "linear").with_scale_layout("swizzled")
    launch = Sm90Launch(a, torch.zeros(16, 8192, dtype=torch.bfloat16), out_dtype=torch.bfloat16, kernel="stream")
    print(launch.spec.name, launch.config.ksplit, local_memory(launch.compile()))
""")


def test_the_kept_launch_compiles_as_the_jit_specializes_it(compile_for_sm90):
    assert compile_for_sm90(_UNSPLIT_COMPILE).split() == ["stream", "1", "[]"]
