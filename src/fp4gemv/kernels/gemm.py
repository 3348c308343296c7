"""FP4 weights times many activation rows (prefill): a W4A16 GEMM on the tensor cores, NVFP4 or MXFP4 weights
times fp16/bf16 activations, any N (the GEMV kernels keep every row's accumulator in registers; this one tiles N).

The program.  One ``BLOCK_M x BLOCK_N`` output tile of one batch (weight rows x activation rows), walking K in
steps of ``BLOCK_K``.  Both operands stream through tensor descriptors (``tl.make_tensor_descriptor``: TMA on
sm_90, pipelined ``num_stages`` deep into shared memory by ``tl.range``): the packed weights
``[BLOCK_M, BLOCK_K / 2]`` bytes and the activation ``[BLOCK_N, BLOCK_K]``; out-of-range rows and K are
zero-filled by the copy.  The weight tile is decoded in registers to the activation's 16-bit type with its block
scale folded in and multiplied with ``tl.dot`` (wgmma on sm_90), fp32 accumulation.  The block scales
``[BLOCK_M, BLOCK_K / block]`` are read with plain loads through the one scale-addressing formula
(``spec.ScaleAddressing``), so both scale layouts share the kernel.

The decode.  An e2m1 code c placed into bf16 bits as ``(c & 7) << 6 | (c & 8) << 12`` reads as v * 2^-126
(code 1 becomes bf16's subnormal 2^-127); into fp16 bits as ``(c & 7) << 9 | (c & 8) << 12``, v * 2^-14.  The
scale multiply carries the correction: the weight becomes ``v * s * 2^-FOLD`` with the factor
``s * 2^(bias - FOLD)`` (bias 126 or 14) in the 16-bit type, one multiplication per weight.  The epilogue
multiplies the fp32 accumulator by ``2^FOLD`` and the global scale, and rounds once to the output dtype.

Exactness (``FOLD``: 7 for NVFP4, 8 for MXFP4).
* NVFP4: s is e4m3 (3 significand bits, |s| in [2^-9, 448]); the factor ``s * 2^(bias - 7)`` is exact in both
  types (bf16: at most 448 * 2^119 < 2^128; fp16: at most 448 * 2^7 = 57344) and the weight ``v * s * 2^-7`` has
  at most 6 significant bits, is a multiple of 2^-17 and at most 21: exact in bf16 and fp16.  No restriction.
* MXFP4: s = 2^(e - 127) (e8m0 byte e); the weight ``v * 2^(e - 135)`` and its factor ``2^(e - 135 + bias)`` are
  exact for e8m0 bytes 3..136 with bf16 activations (scales 2^-124 .. 2^9) and 112..136 with fp16 ones (scales
  2^-15 .. 2^9).  Above 136 the factor overflows to infinity (the outputs of those rows become inf or NaN);
  below the lower bound the smallest weights fall under the 16-bit type's subnormals and are rounded.
* The tensor cores multiply 16-bit operands exactly into fp32 and accumulate in fp32; the bound is the
  tensor-core kernels' (``tests/operands.py``, ``tensor_cores=True`` with ``fold=FOLD``).

``gemm_config`` holds the tile shapes per N range.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..target import Target
from ._common import apply_global_scales, decode_scale, scale_row_offset, store_rounded
from .spec import GemvCase, Src, TritonKernelSpec, TritonLaunch, check_powers_of_two, global_scale_sources

__all__ = ["GemmConfig", "Gemm", "gemm_config", "gemm_kernel", "FOLD", "MIN_N", "SHIPPED_CONFIGS"]

# Activation rows below this go to the GEMV kernels (their register accumulators are faster there).
MIN_N = 17
# 2^-FOLD per weight after the scale multiply (module docstring, exactness).
FOLD = {"nvfp4": 7, "mxfp4": 8}
# Bits of the decode's bias: code << shift reads as v * 2^-bias.
_DECODE_BIAS = {torch.bfloat16: 126, torch.float16: 14}
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


# Every configuration gemm_config can return: the CPU tests run each of them against the exact oracle.
SHIPPED_CONFIGS: tuple[GemmConfig, ...] = (
    GemmConfig(64, 32, 256, 4, 4),
    GemmConfig(64, 64, 256, 4, 4),
    GemmConfig(128, 128, 128, 8, 4),
    GemmConfig(128, 256, 64, 8, 4),
)


def gemm_config(case: GemvCase) -> GemmConfig:
    """The tile shape for ``case`` by its activation rows N (one of ``SHIPPED_CONFIGS``).

    Up to 64 rows the product is bound by the weight bytes: small weight tiles (64 rows) so that even
    4096 x 4096 makes 64 programs per N tile, deep K steps (256) to keep the TMA busy.  Beyond, the tensor
    cores bound it: large tiles (128 x 128, 128 x 256 from 256 rows) reuse each decoded weight tile over more
    activation rows.  Untuned: benchmarks/gemm_sweep.py times the candidates on the H200.
    """
    n = case.n
    if n <= 32:
        return SHIPPED_CONFIGS[0]
    if n <= 64:
        return SHIPPED_CONFIGS[1]
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
    contiguous along K.  MXFP4 scales must stay in 2^-124 .. 2^9 (bf16) or 2^-15 .. 2^9 (fp16) for exact
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
        """ValueError naming ``config`` unless the kernel compiles it: powers of two, block_m >= 16, block_n
        >= 16, block_k >= 32 (16-byte weight rows), stages >= 1, buffers within shared memory."""
        check_powers_of_two(config, ("block_m", "block_n", "block_k", "num_warps", "num_stages"))
        if config.block_m < 16 or config.block_n < 16 or config.block_k < 32:
            raise ValueError(f"config: expected block_m >= 16, block_n >= 16, block_k >= 32, got {config}")
        if shared_bytes(config) > _SHARED_BYTES:
            raise ValueError(f"config: expected at most {_SHARED_BYTES} bytes of pipeline buffers, got "
                             f"{shared_bytes(config)} for {config}")

    def triton_launch(self, case: GemvCase, config: GemmConfig, target: Target) -> TritonLaunch:
        """a and its scales as bytes, b in its dtype (strides in elements), out in its dtype."""
        a, b = case.a, case.b
        gsa_ptr, _ = global_scale_sources(case)
        fold = FOLD[case.fmt.name]
        args = dict(
            a_ptr=Src("a_data", torch.uint8), sfa_ptr=Src("a_scales", torch.uint8), b_ptr=Src("b_data", b.dtype),
            gsa_ptr=gsa_ptr, c_ptr=Src("out", case.out_dtype),
            M=case.m, N=case.n, K=case.k,
            a_stride_l=a.batch_stride, a_stride_m=a.row_stride,
            sfa_stride_l=a.scales.batch, sfa_stride_row_tile=a.scales.row_tile, sfa_stride_r32=a.scales.r32,
            sfa_stride_r4=a.scales.r4,
            b_stride_l=b.strides[0], b_stride_n=b.strides[1],
            c_stride_l=case.out_strides[0], c_stride_m=case.out_strides[1], c_stride_n=case.out_strides[2],
            MX=case.fmt.name == "mxfp4", BF16=b.dtype == torch.bfloat16, SFA_COL_TILE=a.scales.col_tile,
            SCALE_BIAS=2.0 ** (_DECODE_BIAS[b.dtype] - fold), UNFOLD=2.0 ** fold, HAS_GSA=a.has_global_scale,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, NUM_STAGES=config.num_stages,
        )
        grid = (triton.cdiv(case.m, config.block_m), triton.cdiv(case.n, config.block_n), case.batch)
        return TritonLaunch(gemm_kernel, grid, args, dict(num_warps=config.num_warps))


# --- the kernel ---------------------------------------------------------------------------------------------


@triton.jit
def decode_e2m1_triton(packed, BF16: tl.constexpr):
    """Packed bytes ``[R, C]`` (element 2j in byte j's low nibble) to 16-bit values ``[R, 2 C]`` scaled by
    2^-126 (bf16) or 2^-14 (fp16): the code's magnitude bits shifted under the exponent, its sign on bit 15."""
    p = packed.to(tl.int16)
    if BF16:
        lo = ((p & 7) << 6) | ((p & 8) << 12)
        hi = ((p & 0x70) << 2) | ((p & 0x80) << 8)
        dtype: tl.constexpr = tl.bfloat16
    else:
        lo = ((p & 7) << 9) | ((p & 8) << 12)
        hi = ((p & 0x70) << 5) | ((p & 0x80) << 8)
        dtype: tl.constexpr = tl.float16
    w = tl.join(lo, hi)
    return tl.reshape(w, [w.shape[0], 2 * w.shape[1]]).to(dtype, bitcast=True)


@triton.jit
def gemm_kernel(
    a_ptr, sfa_ptr, b_ptr, gsa_ptr, c_ptr,
    M, N, K,
    a_stride_l, a_stride_m,
    sfa_stride_l, sfa_stride_row_tile, sfa_stride_r32, sfa_stride_r4,
    b_stride_l, b_stride_n,
    c_stride_l, c_stride_m, c_stride_n,
    MX: tl.constexpr,
    BF16: tl.constexpr,
    SFA_COL_TILE: tl.constexpr,
    SCALE_BIAS: tl.constexpr,
    UNFOLD: tl.constexpr,
    HAS_GSA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
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
        w = decode_e2m1_triton(packed, BF16)
        factor = (s * SCALE_BIAS).to(w.dtype)
        w = tl.reshape(tl.reshape(w, [BLOCK_M, SCALES, SF_BLOCK]) * factor[:, :, None], [BLOCK_M, BLOCK_K])
        acc = tl.dot(w, tl.trans(x), acc)
    out = apply_global_scales(acc * UNFOLD, gsa_ptr, gsa_ptr, HAS_GSA, False)
    n = off_n + tl.arange(0, BLOCK_N)
    ptrs = (c_ptr + pid_l * c_stride_l + rows.to(tl.int64)[:, None] * c_stride_m
            + n.to(tl.int64)[None, :] * c_stride_n)
    store_rounded(ptrs, out, (rows < M)[:, None] & (n < N)[None, :])
