"""The GEMM kernel (kernels/gemm.py): every shipped tile configuration against the exact oracle under the
interpreter (tails in M, N and K, both formats and scale layouts, global scales, bf16 and fp16), the MXFP4 range
edges its docstring states, the dispatch at N = 16 / 17, the PTX decode emulated against its twin for every byte
and scale, and the sm_90 compile (TMA, wgmma, no local memory, the shared-memory traffic of the main loop)."""

import json

import pytest
import torch

from fp4gemv import FP4Tensor, formats, gemv, ops, select_kernel
from fp4gemv.kernels import gemm
from fp4gemv.kernels.gemm import SHIPPED_CONFIGS, GemmConfig, gemm_config
from fp4gemv.kernels.spec import GEMV_MAX_N
from fp4gemv.target import TRITON_VERSION
from operands import DEVICE, assert_matches_exact, poisoned, random_activation, random_fp4, within_bound


DTYPES = (torch.bfloat16, torch.float16)


def _shape_for(config: GemmConfig) -> tuple[int, int, int]:
    """M, N, K with a partial last tile in each: two weight tiles (the second partial), two activation tiles
    (the second partial, N > 16), two K steps and a half (K a multiple of 32)."""
    m = config.block_m + 40
    n = max(gemm.MIN_N, config.block_n + 23)
    k = 2 * config.block_k + max(32, config.block_k // 2)
    return m, n, k


@pytest.mark.parametrize("config", SHIPPED_CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shipped_configs_match_the_exact_result(config, fmt, dtype):
    m, n, k = _shape_for(config)
    # Layout, global scale and output dtype vary with the parameters so that every one is covered per config.
    layout = "swizzled" if (fmt == "nvfp4") == (dtype == torch.bfloat16) else "linear"
    global_scale = 0.75 if dtype == torch.float16 else None
    out_dtype = torch.float32 if fmt == "mxfp4" and dtype == torch.bfloat16 else dtype
    a = random_fp4((m, k), fmt, layout, seed=11, global_scale=global_scale)
    b = random_activation((n, k), dtype, seed=12)
    assert select_kernel(a, b, backend="triton").name == "gemm"
    out = poisoned((m, n), out_dtype)
    gemv(a, b, out=out, out_dtype=out_dtype, backend="triton", config=config)
    assert_matches_exact(out, a, b, out_dtype, tensor_cores=True, fold=0)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_batched_transposed_output_and_default_config(fmt):
    """A batch of weights against a batch of activations, written into a transposed view (FP4Linear's y.t())."""
    a = random_fp4((2, 72, 160), fmt, "swizzled", seed=3, global_scale=1.5)
    b = random_activation((2, 40, 160), torch.bfloat16, seed=4)
    y = poisoned((2, 40, 72), torch.bfloat16)
    gemv(a, b, out=y.transpose(1, 2), out_dtype=torch.bfloat16, backend="triton")
    assert_matches_exact(y.transpose(1, 2), a, b, torch.bfloat16, tensor_cores=True, fold=0)


def test_the_bound_rejects_a_wrong_scale():
    """The check can fail: one block scale changed after the product is off the bound."""
    config = SHIPPED_CONFIGS[0]
    a = random_fp4((64, 256), "nvfp4", "linear", seed=5)
    b = random_activation((20, 256), torch.float16, seed=6)
    out = gemv(a, b, backend="triton", config=config)
    scales = a.scales.clone()
    scales[3, 2] = formats.encode_e4m3(torch.tensor([2.0 * float(formats.decode_e4m3(scales[3, 2:3])[0])]))[0]
    wrong = FP4Tensor(a.data, scales, "nvfp4", "linear")
    assert within_bound(out, a, b, torch.float16, tensor_cores=True, fold=0).all()
    assert not within_bound(out, wrong, b, torch.float16, tensor_cores=True, fold=0)[3].all()


def _mxfp4_with_scale_bytes(scale_bytes, k=64, seed=7):
    """MXFP4 weights whose rows have the given e8m0 bytes (every block of row r: scale_bytes[r]) and all codes."""
    g = torch.Generator().manual_seed(seed)
    rows = len(scale_bytes)
    data = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=g)
    data[:, 0] = 0x77  # codes 7 (6.0) in every row: the largest magnitude meets each scale
    scales = torch.tensor(scale_bytes, dtype=torch.uint8)[:, None].expand(rows, k // 32).contiguous()
    return FP4Tensor(data.to(DEVICE), scales.to(DEVICE), "mxfp4", "linear")


@pytest.mark.parametrize("dtype, exact, overflow", [
    (torch.bfloat16, (2, 3, 100, 127, 200, 252), (254,)),
    (torch.float16, (104, 112, 127, 136, 140), (143, 160)),
])
def test_mxfp4_scale_range(dtype, exact, overflow):
    """Exact for the e8m0 bytes the module docstring names; beyond, the rows overflow to inf/NaN, never to a
    finite wrong value."""
    a = _mxfp4_with_scale_bytes(list(exact) + list(overflow))
    x = torch.zeros(24, 64, dtype=dtype)
    x[:, 0] = 1.0  # element 0 is code 7: a row's output is 6 * its scale
    x = x.to(DEVICE)
    out = gemv(a, x, out_dtype=torch.float32, backend="triton", config=SHIPPED_CONFIGS[0])
    exact_rows = len(exact)
    assert_matches_exact(out[:exact_rows], FP4Tensor(a.data[:exact_rows], a.scales[:exact_rows], "mxfp4", "linear"),
                         x, torch.float32, tensor_cores=True, fold=0)
    assert not torch.isfinite(out[exact_rows:]).any()


def test_dispatch_at_16_and_17_rows():
    a = random_fp4((128, 256), "nvfp4", "swizzled", seed=8)
    for n in (1, 8, 16, 17, 64, 2048):
        b = torch.zeros(n, 256, dtype=torch.bfloat16, device=DEVICE)
        assert (select_kernel(a, b, backend="triton").name == "gemm") == (n > GEMV_MAX_N), n
    b17 = torch.zeros(17, 256, dtype=torch.float16, device=DEVICE)
    for name in ("weight_only", "hmma", "general"):
        with pytest.raises(ValueError, match=f"takes N <= {GEMV_MAX_N} activation rows"):
            select_kernel(a, b17, backend="triton", kernel=name)
    with pytest.raises(ValueError, match="'gemm' cannot run .* takes N >= 17"):
        select_kernel(a, torch.zeros(16, 256, dtype=torch.float16, device=DEVICE), backend="triton", kernel="gemm")
    # fp32 activations beyond 16 rows: no Triton kernel; the error names every kernel's reason.
    with pytest.raises(ValueError, match="gemm: needs fp16 or bf16 activations"):
        select_kernel(a, torch.zeros(17, 256, device=DEVICE), backend="triton")
    # The reference takes any N.
    out = gemv(a, b17.float(), backend="reference")
    assert out.shape == (128, 17)


def test_default_config_per_n():
    a = random_fp4((4096, 256), "nvfp4", "swizzled", seed=9, device="cpu")
    for n, expected in ((17, SHIPPED_CONFIGS[0]), (64, SHIPPED_CONFIGS[0]), (128, SHIPPED_CONFIGS[2]),
                        (2048, SHIPPED_CONFIGS[3])):
        case = ops.plan_for(a, torch.zeros(n, 256, dtype=torch.bfloat16), backend="reference").case
        assert gemm_config(case) == expected
    big = random_fp4((28672, 256), "nvfp4", "swizzled", seed=9, device="cpu")
    case = ops.plan_for(big, torch.zeros(32, 256, dtype=torch.bfloat16), backend="reference").case
    assert gemm_config(case) == SHIPPED_CONFIGS[1]  # 224 programs of 128 rows fill the SMs


@pytest.mark.parametrize("config, message", [
    (GemmConfig(96, 64, 128, 4, 4), "power of two"),
    (GemmConfig(128, 64, 16, 4, 4), "block_k in 32..256"),
    (GemmConfig(128, 64, 512, 4, 1), "block_k in 32..256"),
    (GemmConfig(256, 256, 256, 8, 4), "bytes of pipeline buffers"),
])
def test_check_config_names_the_problem(config, message):
    a = random_fp4((64, 256), "nvfp4", "linear", seed=10)
    b = random_activation((32, 256), torch.bfloat16, seed=10)
    with pytest.raises(ValueError, match=message):
        gemv(a, b, backend="triton", config=config)


# --- the PTX decode, emulated --------------------------------------------------------------------------------


def _emulate(asm: str, regs: dict[str, int]) -> dict[str, int]:
    """Run the decode's PTX (and, shr, shl, prmt with sign mode, lop3 0xF8, mov, mul.rn of 16-bit pairs)."""
    def value(x):
        return regs[x] if x in regs else int(x, 0)

    def pair_mul(a: int, b: int, dtype) -> int:
        def halves(v):
            return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16).view(dtype)
        prod = (halves(a).float() * halves(b).float()).to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
        return int(prod[0]) | int(prod[1]) << 16

    for line in asm.split("\n"):
        line = line.strip()
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.rstrip(";").split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        v = [value(a) for a in src]
        if op == "and.b32":
            regs[dst] = v[0] & v[1]
        elif op == "shr.u32":
            regs[dst] = v[0] >> v[1]
        elif op == "shl.b32":
            regs[dst] = (v[0] << v[1]) & 0xFFFFFFFF
        elif op == "mov.b32":
            regs[dst] = v[0]
        elif op == "lop3.b32":
            assert v[3] == 0xF8  # a | (b & c)
            regs[dst] = v[0] | (v[1] & v[2])
        elif op == "prmt.b32":
            pool = (v[1] << 32 | v[0]).to_bytes(8, "little")
            out = 0
            for i in range(4):
                sel = (v[2] >> (4 * i)) & 15
                byte = pool[sel & 7]
                if sel & 8:
                    byte = 0xFF if byte & 0x80 else 0
                out |= byte << (8 * i)
            regs[dst] = out
        elif op in ("mul.rn.bf16x2", "mul.rn.f16x2"):
            regs[dst] = pair_mul(v[0], v[1], torch.bfloat16 if "bf16" in op else torch.float16)
        else:
            raise AssertionError(op)
    return regs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ptx_decode_equals_the_twin_for_every_byte(dtype):
    """Every byte value in every position of a word, times scale factors of both signs and wide range, against
    the twin's arithmetic (exact values, one rounded 16-bit product)."""
    asm = gemm.DECODE_BF16_ASM.value if dtype == torch.bfloat16 else gemm.DECODE_FP16_ASM.value
    table_high, table_low = gemm.DECODE_TABLE_WORDS[dtype]
    values = torch.tensor(formats.E2M1_VALUES, dtype=torch.float64)
    for factor in (1.0, -0.375, 448.0, 2.0**-9, 2.0**-20):
        f_bits = int(torch.tensor([factor]).to(dtype).view(torch.int16).to(torch.int32)[0]) & 0xFFFF
        for start in range(0, 256, 4):
            word = int.from_bytes(bytes((start + i) % 256 for i in range(4)), "little")
            regs = {"$4": word, "$9": table_high, "$13": table_low}
            for j in range(4):
                regs[f"${5 + j}"] = f_bits | f_bits << 16
            _emulate(asm, regs)
            for j in range(4):
                byte = (start + j) % 256
                expected = (values[[byte & 15, byte >> 4]] * torch.tensor([factor]).to(dtype).double()).to(dtype)
                got = torch.tensor([regs[f"${j}"] & 0xFFFF, regs[f"${j}"] >> 16], dtype=torch.int32)
                got = got.to(torch.int16).view(dtype)
                assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), (factor, byte, got, expected)


# --- sm_90 compile ---------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = r"""
import collections, json
import torch
from aot import Sm90Launch, local_memory, mma_loop, registers, sass_listing
from fp4gemv import FP4Tensor
from fp4gemv.kernels.gemm import SHIPPED_CONFIGS

rows = []
for config in SHIPPED_CONFIGS:
    for fmt, act in (("nvfp4", torch.bfloat16), ("mxfp4", torch.float16)):
        block = 16 if fmt == "nvfp4" else 32
        a = FP4Tensor(torch.zeros(4096, 2048, dtype=torch.uint8), torch.full((4096, 4096 // block), 0x38,
                      dtype=torch.uint8), fmt, "linear").with_scale_layout("swizzled")
        launch = Sm90Launch(a, torch.zeros(512, 4096, dtype=act), config=config)
        compiled = launch.compile()
        ins = sass_listing(compiled)
        body = mma_loop(ins)
        ops = collections.Counter(op.split(".")[0] + ("." + op.split(".")[1] if op.startswith(("LDS", "STS")) and
                                                        "." in op else "") for _, op, _ in body)
        rows.append(dict(config=list(config), fmt=fmt, local=local_memory(compiled), regs=registers(compiled),
                         tma_sass=sum(op.startswith("UTMALDG") for _, op, _ in ins),
                         tma_ptx="cp.async.bulk.tensor" in compiled.asm["ptx"], loop=len(body),
                         ops=dict(ops)))
print(json.dumps(rows))
"""


# Triton 3.9 forms each wgmma descriptor anew (its 32-bit shared address zero-extended and OR-ed with the constant
# high word), and ptxas then moves three of the HGMMA's four uniform descriptor registers before every HGMMA
# (3 UMOV beside the address add), where 3.6 to 3.8 step one descriptor with one 64-bit add per HGMMA.  The
# descriptors come from Triton's MMA lowering, not from the kernel's source.  Measured main loops, 3.6 -> 3.9:
# 128x128x128 NVFP4 341 -> 356 instructions (8 HGMMA, 3 -> 25 UMOV), the other shipped configurations 4 to 14
# more (benchmarks/gemm_sass.py).  So under 3.9 the bound allows these 3 moves per HGMMA on top of the decode's.
WGMMA_DESCRIPTOR_MOVES = 3 if TRITON_VERSION >= (3, 9) else 0


def test_sm90_compile_of_every_shipped_config(compile_for_sm90):
    """No local memory; TMA in the PTX and SASS; wgmma in the main loop; the loop's shared-memory stores are the
    decoded weights (16-byte stores, 2 bytes per weight) plus at most 4 for the scale tile's exchange, its loads
    the packed weights (16-byte loads) plus at most 4 for the scales; at most 5.5 instructions per weight
    (plus, under Triton 3.9, ``WGMMA_DESCRIPTOR_MOVES`` per HGMMA)."""
    rows = json.loads(compile_for_sm90(_COMPILE_SCRIPT).strip().splitlines()[-1])
    assert len(rows) == 2 * len(SHIPPED_CONFIGS)
    for row in rows:
        bm, bn, bk, warps, _ = row["config"]
        weights_per_thread = bm * bk // (32 * warps)
        ops = row["ops"]
        assert row["local"] == [], row
        assert row["tma_ptx"] and row["tma_sass"] >= 2, row
        assert ops.get("HGMMA", 0) >= bk // 16, row
        assert ops.get("STS.128", 0) == weights_per_thread * 2 // 16, row
        assert sum(v for k, v in ops.items() if k.startswith("STS")) - ops["STS.128"] <= 4, row
        assert ops.get("LDS.128", 0) == weights_per_thread // 2 // 16, row
        assert sum(v for k, v in ops.items() if k.startswith("LDS")) - ops["LDS.128"] <= 4, row
        assert row["loop"] <= 5.5 * weights_per_thread + WGMMA_DESCRIPTOR_MOVES * ops["HGMMA"], row


@pytest.mark.gpu
@pytest.mark.parametrize("config", SHIPPED_CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_ptx_path_matches_the_exact_result_and_its_twin_bit_for_bit(config, fmt, dtype):
    """On the GPU: the PTX decode against the oracle, and equal to the pure-Triton twin to the bit (both decode
    exactly and run the same tl.dot)."""
    m, n, k = 2 * config.block_m + 40, 3 * config.block_n + 5, 4 * config.block_k + 32
    a = random_fp4((m, k), fmt, "swizzled", seed=21, global_scale=0.5)
    b = random_activation((n, k), dtype, seed=22)
    ptx = gemv(a, b, out_dtype=torch.float32, backend="triton-ptx", config=config)
    twin = gemv(a, b, out_dtype=torch.float32, backend="triton", config=config)
    assert_matches_exact(ptx, a, b, torch.float32, tensor_cores=True, fold=0)
    assert torch.equal(ptx, twin)
