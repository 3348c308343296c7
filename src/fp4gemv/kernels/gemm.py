"""FP4 weights times many activation rows (prefill): a W4A16 GEMM on the tensor cores, NVFP4 or MXFP4 weights
times fp16/bf16 activations, any N >= ``MIN_N`` (the GEMV kernels keep every row's accumulator in registers; this
one tiles N).

The program.  One output tile of ``BLOCK_M`` weight rows x ``BLOCK_N`` activation rows of one batch, computed
transposed (``acc[n, m] = x[n, :] . w[m, :]``, so the activation is the MMA's first operand and the weight
rows its N side), walking K in steps of ``BLOCK_K``.  Both operands stream through tensor descriptors
(``tl.make_tensor_descriptor``: TMA on sm_90, pipelined ``num_stages`` deep into shared memory by ``tl.range``;
out-of-range rows and K are zero-filled by the copy): the packed weights ``[BLOCK_M, BLOCK_K / 2]`` bytes and the
activation ``[BLOCK_N, BLOCK_K]``.  The weight tile is read from shared memory in 16-byte rows, decoded in
registers to the activation's 16-bit type with its block scale multiplied in, and written back once as the
MMA's second operand; ``tl.dot`` runs wgmma with both operands in shared memory, fp32 accumulation.  The block
scales ``[BLOCK_M, BLOCK_K / block]`` are read with plain loads through the one scale-addressing formula
(``spec.ScaleAddressing``), so both scale layouts share the kernel.  In-kernel descriptors need Triton's
global scratch memory (128 bytes per descriptor and program): ``Gemm.triton_launch`` installs a torch-backed
allocator for the calling thread when none is set.

The decode (``_decode_asm``, with the pure-Triton twin ``scaled_weights_triton``, equal bit for bit).  Each
32-bit word of 8 codes becomes four words of two 16-bit values: the magnitudes through prmt byte tables of the
exact e2m1 values, the signs from a prmt in sign-replicate mode, then one ``mul.rn`` of each pair by its
block scale: 16 (bf16) / 14 (fp16) instructions per 8 weights.

Exactness.  The decoded e2m1 value v is exact; v times the 16-bit scale factor s is exact where it is
representable, and the tensor cores multiply 16-bit operands exactly into fp32 and accumulate in fp32 (the bound
of the tensor-core kernels: ``tests/operands.py``, ``tensor_cores=True``, ``fold=0``).
* NVFP4: s is e4m3 (3 significand bits, |s| in [2^-9, 448]), exact in both types, and v * s has at most 6
  significant bits in [2^-10, 2688]: exact in bf16 and in fp16.  No restriction.
* MXFP4, bf16 activations: s = 2^(e - 127) (e8m0 byte e) is exact in bf16 for every byte but 255 (NaN, which
  stays NaN), and v * s is exact and normal for bytes 2..252; from byte 253 (scales 2^126, 2^127) the largest
  codes overflow to infinity, and for bytes 0 and 1 the smallest weights are subnormal (below 2^-126), which
  the fp32 arithmetic may flush.
* MXFP4, fp16 activations: the factor is the scale rounded to fp16, exact for bytes 103..142 (scales 2^-24 ..
  2^15), and v * s is exact for bytes 104..140 (scales 2^-23 .. 2^13).  Above, weights overflow to infinity
  (the outputs they touch become inf or NaN); below, the smallest weights round to fp16's subnormals or to zero.

``gemm_config`` holds the tile shapes per N range.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..target import Target
from ._common import apply_global_scales, decode_scale, scale_row_offset, store_rounded
from ._decode import doubled_e2m1
from ._ptx import E2M1_BYTE_TABLES, E2M1_LOOKUP_REGISTERS, e2m1_pair, e2m1_table_lookup
from ._scratch import install_scratch_allocator
from .spec import GemvCase, Src, TritonKernelSpec, TritonLaunch, check_powers_of_two, global_scale_sources

__all__ = ["GemmConfig", "Gemm", "gemm_config", "gemm_kernel", "MIN_N", "SHIPPED_CONFIGS", "scaled_weights_ptx",
           "scaled_weights_triton"]

# Activation rows below this go to the GEMV kernels (their register accumulators are faster there).
MIN_N = 17
# Shared memory per SM on sm_90 that a program may take (227 KB less a margin for the epilogue's scratch).
_SHARED_BYTES = 200 * 1024


class GemmConfig(NamedTuple):
    """One launch: an output tile of ``block_m`` weight rows x ``block_n`` activation rows, K in steps of
    ``block_k``, ``num_warps`` warps, ``num_stages`` steps of both operands in flight (shared memory)."""

    block_m: int = 128
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4


# Every configuration gemm_config can return: the CPU tests run each of them against the exact oracle.  None
# spills or uses local memory on sm_90; their main loops take 3.7 to 5.3 SASS instructions per weight under
# Triton 3.6 (3.8 to 5.6 under 3.9, whose wgmma descriptors add uniform moves), 1.9 to 2.3 of them on the ALU
# pipe (benchmarks/gemm_sass.py; tests/test_kernels_gemm.py bounds them).
SHIPPED_CONFIGS: tuple[GemmConfig, ...] = (
    GemmConfig(64, 64, 256, 4, 4),
    GemmConfig(128, 64, 128, 4, 4),
    GemmConfig(128, 128, 128, 8, 4),
    GemmConfig(256, 128, 64, 8, 4),
)
# Programs below this many leave SMs idle (132 on the H200): the smaller weight tile is taken instead.
_FULL_GRID = 132


def gemm_config(case: GemvCase) -> GemmConfig:
    """The tile shape for ``case`` by its activation rows N (one of ``SHIPPED_CONFIGS``).

    Up to 64 rows the product is bound by the weight bytes: one 64-row MMA tile of activation rows (wgmma's M;
    fewer rows are zero-filled) and 128 weight rows, or 64 with deeper K steps where 128 would leave SMs idle.
    Beyond, the tensor cores bound it: 128 x 128 tiles, then 256 weight rows x 128 activation rows from 192
    rows on, reusing each decoded weight tile over more activation rows.  Not yet measured: benchmarks/
    gemm_sweep.py times these and their neighbours on the H200.
    """
    n, rows = case.n, case.m
    if n <= 64:
        programs = -(-rows // 128) * case.batch
        return SHIPPED_CONFIGS[0] if programs < _FULL_GRID else SHIPPED_CONFIGS[1]
    if n <= 192:
        return SHIPPED_CONFIGS[2]
    return SHIPPED_CONFIGS[3]


def shared_bytes(config: GemmConfig, act_bytes: int = 2) -> int:
    """Shared memory of the pipeline's buffers: ``num_stages`` weight and activation tiles."""
    per_stage = config.block_m * config.block_k // 2 + config.block_n * config.block_k * act_bytes
    return config.num_stages * per_stage


class Gemm(TritonKernelSpec):
    """NVFP4 or MXFP4 weights times fp16/bf16 activations with N >= ``MIN_N`` rows on the tensor cores.  TMA
    needs 16-byte aligned rows and bases: K a multiple of 32, weight and activation rows 16-byte aligned and
    contiguous along K.  MXFP4 scales must stay in 2^-125 .. 2^125 (bf16) or 2^-23 .. 2^13 (fp16) for exact
    results (module docstring)."""

    name = "gemm"
    config_type = GemmConfig

    def why_not(self, case: GemvCase, target: Target) -> str | None:
        if not target.runs_triton:
            return "runs Triton kernels only"
        if target.device_type == "cuda" and not target._at_least(9, 0):
            return f"needs TMA and wgmma (sm_90 or newer; this is {target.describe()})"
        if case.fp4_activation:
            return "takes fp16 or bf16 activations, got an FP4 activation"
        if case.b.dtype not in (torch.float16, torch.bfloat16):
            return f"needs fp16 or bf16 activations, got {case.b.dtype}"
        if case.n < MIN_N:
            return f"takes N >= {MIN_N} activation rows (fewer go to the GEMV kernels), got N = {case.n}"
        if case.k % 32:
            return f"needs K a multiple of 32 (16-byte weight rows for TMA), got K = {case.k}"
        if case.a.align < 16:
            return f"a: needs data rows at multiples of 16 bytes (TMA), got {case.a.align}-byte alignment"
        if case.b.align < 16:
            return "b: needs rows contiguous along K at 16-byte aligned addresses (TMA)"
        return None

    def default_config(self, case: GemvCase, target: Target) -> GemmConfig:
        return gemm_config(case)

    def check_config(self, config: GemmConfig, case: GemvCase | None = None) -> None:
        """ValueError naming ``config`` unless the kernel compiles it: block sizes and warps powers of two,
        block_m and block_n in 16..256, block_k in 32..256 (16-byte weight rows; TMA boxes of at most 256 per
        side), stages >= 1, buffers within shared memory."""
        check_powers_of_two(config, ("block_m", "block_n", "block_k", "num_warps"))
        if not isinstance(config.num_stages, int) or config.num_stages < 1:
            raise ValueError(f"config: expected num_stages an integer >= 1, got {config}")
        if not (16 <= config.block_m <= 256 and 16 <= config.block_n <= 256 and 32 <= config.block_k <= 256):
            raise ValueError(f"config: expected block_m and block_n in 16..256 and block_k in 32..256 (a TMA box "
                             f"has at most 256 elements per side), got {config}")
        if shared_bytes(config) > _SHARED_BYTES:
            raise ValueError(f"config: expected at most {_SHARED_BYTES} bytes of pipeline buffers, got "
                             f"{shared_bytes(config)} for {config}")

    def triton_launch(self, case: GemvCase, config: GemmConfig, target: Target) -> TritonLaunch:
        """a and its scales as bytes, b in its dtype (strides in elements), out in its dtype."""
        if target.device_type == "cuda":
            install_scratch_allocator()
        a, b = case.a, case.b
        gsa_ptr, _ = global_scale_sources(case)
        args = dict(
            a_ptr=Src("a_data", torch.uint8), sfa_ptr=Src("a_scales", torch.uint8), b_ptr=Src("b_data", b.dtype),
            gsa_ptr=gsa_ptr, c_ptr=Src("out", case.out_dtype),
            M=case.m, N=case.n, K=case.k,
            a_stride_l=a.batch_stride, a_stride_m=a.row_stride,
            sfa_stride_l=a.scales.batch, sfa_stride_row_tile=a.scales.row_tile, sfa_stride_r32=a.scales.r32,
            sfa_stride_r4=a.scales.r4,
            b_stride_l=b.strides[0], b_stride_n=b.strides[1],
            c_stride_l=case.out_strides[0], c_stride_m=case.out_strides[1], c_stride_n=case.out_strides[2],
            table_high=DECODE_TABLE_WORDS[b.dtype][0], table_low=DECODE_TABLE_WORDS[b.dtype][1],
            MX=case.fmt.name == "mxfp4", BF16=b.dtype == torch.bfloat16, SFA_COL_TILE=a.scales.col_tile,
            HAS_GSA=a.has_global_scale, USE_PTX=target.mode == "ptx",
            BF16_IN_F32=b.dtype == torch.bfloat16 and not target.bf16_arithmetic,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, NUM_STAGES=config.num_stages,
        )
        grid = (triton.cdiv(case.m, config.block_m), triton.cdiv(case.n, config.block_n), case.batch)
        return TritonLaunch(gemm_kernel, grid, args, dict(num_warps=config.num_warps))


# --- the kernel ---------------------------------------------------------------------------------------------

def _decode_asm(bf16: bool) -> str:
    """PTX for four packed bytes ($4, byte j = elements 2j, 2j+1) to four words of two 16-bit values times their
    scale factor ($0..$3: byte j's elements in the low and high halves, times $5+j = {f_j, f_j}); the first table
    words arrive as registers ($9, and for bf16 $13) so that prmt need not copy them: 16 (bf16) or 14 (fp16)
    instructions for 8 weights.  The lookup is ``_ptx.e2m1_table_lookup``; one 16-bit pair multiply applies the
    scale (exact: module docstring)."""
    mul = "mul.rn.bf16x2" if bf16 else "mul.rn.f16x2"
    lines = ["{", f".reg .b32 {E2M1_LOOKUP_REGISTERS}, p;",
             *e2m1_table_lookup("$4", "$9", "$13" if bf16 else None, "bf16" if bf16 else "fp16")]
    for j in range(4):
        lines += [e2m1_pair(j, "p"), f"{mul} ${j}, p, ${5 + j};"]
    lines.append("}")
    return "\n".join(lines)


DECODE_BF16_ASM = tl.constexpr(_decode_asm(True))
DECODE_FP16_ASM = tl.constexpr(_decode_asm(False))
# The first words of the byte tables, passed to the kernel as arguments (registers for prmt).
DECODE_TABLE_WORDS = {torch.bfloat16: (E2M1_BYTE_TABLES["bf16"][0][0], E2M1_BYTE_TABLES["bf16"][1][0]),
                      torch.float16: (E2M1_BYTE_TABLES["fp16"][0][0], 0)}


@triton.jit
def scaled_weights_triton(packed, factor, BF16: tl.constexpr, SF_BLOCK: tl.constexpr, F32: tl.constexpr):
    """Packed bytes ``[R, C]`` (element 2j in byte j's low nibble) times their scale factors ``factor``
    ``[R, 2 C / SF_BLOCK]`` (16-bit, one per block): ``[R, 2 C]`` in bf16 (``BF16``) or fp16, exact (module
    docstring); the pure-Triton twin of ``scaled_weights_ptx``, bit for bit.  ``F32``: the same values in
    float32 (bf16 factors; fp32 and bf16 share their exponent range, so a product that overflows bf16 overflows
    fp32 too)."""
    codes = tl.join(packed & 15, packed >> 4)
    codes = tl.reshape(codes, [codes.shape[0], 2 * codes.shape[1]])
    v = doubled_e2m1(codes.to(tl.int32)).to(tl.float32) * 0.5  # exact in both 16-bit types
    if F32:
        w = v
        factor = factor.to(tl.float32)
    elif BF16:
        w = v.to(tl.bfloat16)
    else:
        w = v.to(tl.float16)
    w = tl.reshape(w, [w.shape[0], factor.shape[1], SF_BLOCK]) * factor[:, :, None]
    return tl.reshape(w, [w.shape[0], factor.shape[1] * SF_BLOCK])


@triton.jit
def scaled_weights_ptx(packed, factor, table_high, table_low, BF16: tl.constexpr, SF_BLOCK: tl.constexpr):
    """``scaled_weights_triton`` in inline PTX (``_decode_asm``): each packed byte becomes one 32-bit word of its
    two scaled values, split into halves that the compiler keeps in the same register."""
    R: tl.constexpr = packed.shape[0]
    C: tl.constexpr = packed.shape[1]
    f = factor.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    f = f | (f << 16)  # {f, f}: the factor for both values of a byte
    f = tl.reshape(tl.broadcast_to(f[:, :, None], [R, factor.shape[1], SF_BLOCK // 2]), [R, C])
    th = tl.full([R, C], 0, tl.int32) + table_high
    tlo = tl.full([R, C], 0, tl.int32) + table_low
    if BF16:
        pairs = tl.inline_asm_elementwise(DECODE_BF16_ASM, "=r,=r,=r,=r,r" + ",r" * 12, [packed, f, th, tlo],
                                          dtype=tl.int32, is_pure=True, pack=4)
    else:
        pairs = tl.inline_asm_elementwise(DECODE_FP16_ASM, "=r,=r,=r,=r,r" + ",r" * 12, [packed, f, th, tlo],
                                          dtype=tl.int32, is_pure=True, pack=4)
    halves = tl.join(pairs.to(tl.int16), (pairs >> 16).to(tl.int16))
    bits = tl.reshape(halves, [R, 2 * C])
    if BF16:
        return bits.to(tl.bfloat16, bitcast=True)
    else:
        return bits.to(tl.float16, bitcast=True)


@triton.jit
def gemm_kernel(
    a_ptr, sfa_ptr, b_ptr, gsa_ptr, c_ptr,
    M, N, K,
    a_stride_l, a_stride_m,
    sfa_stride_l, sfa_stride_row_tile, sfa_stride_r32, sfa_stride_r4,
    b_stride_l, b_stride_n,
    c_stride_l, c_stride_m, c_stride_n,
    table_high, table_low,
    MX: tl.constexpr,
    BF16: tl.constexpr,
    SFA_COL_TILE: tl.constexpr,
    HAS_GSA: tl.constexpr,
    USE_PTX: tl.constexpr,
    BF16_IN_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # The tile is computed transposed, acc[n, m] = x[n, :] . w[m, :]: the activation is the MMA's A operand
    # (straight from the TMA's shared memory), the decoded weights its B operand (written once to shared memory).
    SF_BLOCK: tl.constexpr = 32 if MX else 16
    SCALES: tl.constexpr = BLOCK_K // SF_BLOCK  # scale columns per step
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_l = tl.program_id(2).to(tl.int64)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    a_desc = tl.make_tensor_descriptor(a_ptr + pid_l * a_stride_l, shape=[M, K // 2], strides=[a_stride_m, 1],
                                       block_shape=[BLOCK_M, BLOCK_K // 2])
    b_desc = tl.make_tensor_descriptor(b_ptr + pid_l * b_stride_l, shape=[N, K], strides=[b_stride_n, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    rows = off_m + tl.arange(0, BLOCK_M)
    # Rows past M read row M - 1's scales (their products are never stored); scale columns past K are masked.
    sf_rows = sfa_ptr + pid_l * sfa_stride_l + scale_row_offset(tl.minimum(rows, M - 1), sfa_stride_row_tile,
                                                                 sfa_stride_r32, sfa_stride_r4)
    j = tl.arange(0, SCALES)
    cols_in_k = K // SF_BLOCK
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for step in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
        packed = a_desc.load([off_m, step * (BLOCK_K // 2)])
        x = b_desc.load([off_n, step * BLOCK_K])
        col = step * SCALES + j
        raw = tl.load(sf_rows[:, None] + ((col // 4) * SFA_COL_TILE + col % 4)[None, :],
                      mask=(col < cols_in_k)[None, :], other=0)
        if MX:
            s = decode_scale(raw, "mxfp4")
        else:
            s = decode_scale(raw, "nvfp4")
        if BF16:
            factor = s.to(tl.bfloat16)
        else:
            factor = s.to(tl.float16)
        if USE_PTX:
            w = scaled_weights_ptx(packed, factor, table_high, table_low, BF16, SF_BLOCK)
        else:
            w = scaled_weights_triton(packed, factor, BF16, SF_BLOCK, BF16_IN_F32)
        if BF16_IN_F32:  # Target.bf16_arithmetic: every product is exact in fp32, as on the tensor cores
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    out = apply_global_scales(acc, gsa_ptr, gsa_ptr, HAS_GSA, False)
    n = off_n + tl.arange(0, BLOCK_N)
    ptrs = (c_ptr + pid_l * c_stride_l + n.to(tl.int64)[:, None] * c_stride_n
            + rows.to(tl.int64)[None, :] * c_stride_m)
    store_rounded(ptrs, out, (n < N)[:, None] & (rows < M)[None, :])
