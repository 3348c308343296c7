"""FP4 weights on the tensor cores: NVFP4 or MXFP4 weights times fp16/bf16 activations (N = 1..16) or
times activations of the same FP4 format (N = 2..16), one pass over the weights, ``mma.sync.m16n8k16``.

The program.  ``16 * tiles`` output rows of one batch for all N; its ``warps`` warps sit side by side along K,
each on ``128 * chunks`` elements per step, and every warp covers all the program's rows (``tiles`` m16 tiles),
so a step's activation fragments serve ``tiles`` mma tiles.  A thread (lane 4 g + c) holds rows
16 t + 8 h + g of every tile t; its per-thread values (pointers, accumulators) are the ``[2 tiles, 32 warps]``
tensors of the kernel, element e = 2 t + h in registers (``tests/test_kernels_weight_only.py`` checks the
compiled layout).

The step (``_mma_step``, inline PTX).  All of a step's loads come first (16-byte weight loads: 2 tiles x chunks
per thread; 4-byte ones in mode k32), then the e2m1 codes are decoded in registers into the mma's A fragments
and multiplied on the tensor cores.  Each thread adds the step's offsets to per-thread pointers computed once
here; the last, partial step masks its loads by K.  The twin ``_step_triton`` computes the same accumulator
elements from the same weight pointers in plain Triton (for Triton's interpreter and as the GPU reference),
summing in another order.  The modes (``_mma_step``'s docstring): ``fold`` (NVFP4, scales folded into the
16-bit weights), ``k32`` (MXFP4, a thread owns word c of every block, scales on fp32 partials) and ``split``
(either, N <= 4: C columns split by K owner, scales on fp32 partials).

Exactness.  Every product enters an fp32 accumulator exactly; the result is rounded once.
* An e2m1 value v placed into fp16 bits as ``sign << 15 | code << 9`` reads as v * 2^-14 (code 1 is fp16's
  subnormal 2^-15); into bf16 as ``code << 6``, v * 2^-126.
* fold: times an e4m3 scale s the fp16 product v * s * 2^-14 is exact (a multiple of 2^-24 with at most 6
  significant bits, < 0.17); bf16: v * 2^-126 times s * 2^119 is a normal bf16 with at most 6 significant bits.
* k32, split: the weights stay unscaled; the tensor cores' products with an fp16 activation (v * 2^-14 * x), or
  a bf16 one times 2^64 (v * 2^-126 * x * 2^64), or a decoded FP4 activation are exact in fp32; a block's
  partial sum is multiplied by its scale (e4m3 or 2^(e - 127), exact unless it leaves fp32's range) with
  ``fma``.  MXFP4 activations: the partial times the fp32 product of the two e8m0 scales (as in ``w4a4.py``).
The fold (2^-f per ``_mma_step.fold_exponent``) is undone in the epilogue with the global scales.

Range restriction (bf16 activations in k32 and split: MXFP4 weights, and NVFP4 weights with ``split``, the
default for N <= 2).  The activation is multiplied by 2^64 in bf16 (``_mma_step.BF16_ACTIVATION_BIAS``), which
keeps products exact only for 2^-70 <= |x| < 2^64 (measured on the H200, ``_mma_step.BF16_ACTIVATION_BIAS``):
a value of 2^64 or more becomes infinity (the result is inf or NaN), and a nonzero value below 2^-70 may lose
its product's low bits (a subnormal product in fp32, which the tensor cores do not keep exactly).  fp16 and FP4 activations, and NVFP4 x bf16
in ``fold``, have no such restriction.  On the pure-Triton path (``backend="triton"``) there is no bias.

``default_config`` and the dispatch range (``MAX_FLOAT_N_OVER_HMMA``, a rule of ``kernels/__init__.py``'s
``DEFERRALS``) follow the H200 measurements of docs/performance.md (the weight-only kernel's sections).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..formats import CODE_ORDERS
from ..target import SM90, Target
from ._common import apply_global_scales, decode_scale, pow2_at_most, scale_row_offset, store_rounded
from ._decode import code_order_index, e2m1_word_values
from ._mma_step import StepSpec, fold_exponent, multipliers, step_asm
from .spec import (ErrorModel, FP4Meta, GemvCase, ScaleAddressing, Src, TritonKernelSpec,
                   TritonLaunch, global_scale_sources, too_many_rows)

__all__ = ["WeightOnlyConfig", "WeightOnly", "weight_only_config", "mode", "step_spec", "weight_only_gemv_kernel",
           "MAX_SPLIT_N", "MAX_WARPS", "MAX_FLOAT_N_OVER_HMMA", "PTXAS_LOADS_FIRST", "ACT_CODES", "MODE_CODES",
           "program_lanes", "tile_rows", "weight_pointers", "fragment_rows", "twin_column_row", "k_loop",
           "column_result"]

MAX_WARPS = 16
# split gives each n-tile 2 activation rows (4 K owners x 2 columns): N <= 4 with two n-tiles.
MAX_SPLIT_N = 4
# NVFP4 cases with more activation rows than this are left to the hmma kernel by default (kernels/__init__.py's
# DEFERRALS; docs/performance.md, the weight-only kernel's dispatch: at N = 16 hmma was as fast or faster on most
# shapes with FP4 activations).
MAX_FLOAT_N_OVER_HMMA = 8
# ptxas options of ``WeightOnlyConfig.loads_first``.
PTXAS_LOADS_FIRST = "-O1"
# Elements of K per iteration of the pure-Triton twin's loop over a warp chunk (``_step_triton``).
TWIN_PIECE = tl.constexpr(8)
# The kernels' ACT and MODE constexprs.
ACT_CODES = {"f16": 0, "bf16": 1, "fp4": 2}
MODE_CODES = {"fold": 0, "k32": 1, "split": 2}


class WeightOnlyConfig(NamedTuple):
    """One launch: ``tiles`` m16 tiles per warp (16 * tiles rows per program), ``warps`` warps along K,
    ``chunks`` 128-element K chunks per warp and step (a thread has 2 * tiles * chunks 16-byte weight loads in
    flight), ``split``: the split mode (N <= 4) instead of fold (NVFP4) / k32 (MXFP4), ``pdl``: programmatic
    dependent launch (where the target has it), ``loads_first``: compile with ``ptxas -O1``, which keeps every
    load of a step at its top (``-O3`` sinks them towards their first use: in the SASS of 7168 x 16384, split,
    2 tiles, 5 of the step's 12 loads, 2 of its 4 weight loads, were issued before its first mma;
    docs/performance.md, the weight-only kernel's section)."""

    tiles: int = 1
    warps: int = 4
    chunks: int = 1
    split: bool = False
    pdl: bool = False
    loads_first: bool = True


def mode(fmt: str, config: WeightOnlyConfig) -> str:
    """The step mode a configuration runs: 'split', else 'fold' (NVFP4) or 'k32' (MXFP4)."""
    return "split" if config.split else "fold" if fmt == "nvfp4" else "k32"


def _split_aligned(case: GemvCase) -> bool:
    """split (and fold) read 16-byte rows of the weights and of an FP4 activation."""
    return case.a.align >= 16 and (not case.fp4_activation or case.b.align >= 16)


def weight_only_config(case: GemvCase, sm_count: int) -> WeightOnlyConfig:
    """The configuration for ``case`` on a GPU of ``sm_count`` SMs, from the H200 sweeps (docs/performance.md,
    the weight-only kernel's section).

    fp16/bf16 activations (bf16 measured at N = 1 and 8 over tiles x warps; fp16 shares the loads and grid, and
    was not swept on this rule itself): split for N <= 2; 4 tiles of 16 rows per warp with about 16 resident
    warps per SM where N <= 2 and the rows (M x L) reach 24K (4096 x 7168 x 8 and 28672 x 8192: the 4 tiles'
    shared activation fragments pay), else 1 tile and about 32 warp-chunks per SM (programs x warps x chunks
    over the SMs: 27-31 in every measured best but the grid-limited 1024 x 4096), spent as two chunks on half the
    warps where K then takes at most two steps (4096 x 4096: 1 tile, 8 warps, 2 chunks, 1.4x faster than 16
    warps at N = 8), else as warps.  At most 16 warp-chunks for N > 2 (two chunks of 16 warps spilled above
    N = 2 at 2 tiles).  No PDL: 5 us slower on 7168 x 16384 in the same run, never faster in one.

    FP4 activations (timed only with this rule, N = 4 and 8): split for N <= 2; tiles grow with the rows (4 from
    24K rows, 2 from 30 per SM); warps for about 16 resident per SM; two chunks where K leaves a warp 2 to 4
    steps.
    """
    rows = case.m * case.batch
    k, n = case.k, case.n
    split = n <= 2 and (case.fmt.name == "nvfp4" or _split_aligned(case))
    k_warps = pow2_at_most(max(k, 128) // 128)  # no warp wholly past K
    if case.fp4_activation:
        tiles = 4 if rows >= 24 * 1024 else 2 if rows >= 30 * sm_count else 1
        programs = -(-rows // (16 * tiles))
        warps = max(1, min(pow2_at_most(16 * sm_count // programs), MAX_WARPS, k_warps))
        chunks = 2 if 256 * warps <= k <= 512 * warps and tiles <= 2 and n <= (2 if warps > 8 else 8) else 1
        return WeightOnlyConfig(tiles, warps, chunks, split)
    if n <= 2 and rows >= 24 * 1024:
        programs = -(-rows // 64)
        return WeightOnlyConfig(4, max(1, min(pow2_at_most(16 * sm_count // programs), k_warps)), 1, split)
    programs = -(-rows // 16)
    warp_chunks = max(1, min(pow2_at_most(32 * sm_count // programs), 2 * MAX_WARPS if n <= 2 else MAX_WARPS))
    warps, chunks = warp_chunks, 1
    if warp_chunks >= 2 and k <= 256 * warp_chunks:
        warps, chunks = warp_chunks // 2, 2
    warps = min(warps, MAX_WARPS, k_warps)
    if chunks == 2 and k < 256 * warps:
        chunks = 1
    return WeightOnlyConfig(1, warps, chunks, split)


def _row_strides(addressing: ScaleAddressing) -> tuple[int, int, int, int]:
    """The batch and row parts of a scale addressing (the column tile is a compile-time constant: 4 or 512)."""
    return addressing.batch, addressing.row_tile, addressing.r32, addressing.r4


def _activation_code(case: GemvCase) -> str:
    return "fp4" if case.fp4_activation else {torch.float16: "f16", torch.bfloat16: "bf16"}[case.b.dtype]


def step_spec(case: GemvCase, config: WeightOnlyConfig, tail: bool = False) -> StepSpec:
    """The ``_mma_step.StepSpec`` a launch compiles."""
    step_mode = mode(case.fmt.name, config)
    n_tiles = (1 if case.n <= 2 else 2) if step_mode == "split" else (1 if case.n <= 8 else 2)
    return StepSpec(case.fmt.name, _activation_code(case), step_mode, config.tiles, config.chunks, n_tiles,
                    case.a.scales.col_tile, case.b.scales.col_tile if case.fp4_activation else 4, tail,
                    case.a.code_order)


class WeightOnly(TritonKernelSpec):
    """NVFP4 or MXFP4 weights times fp16/bf16 activations (N = 1..16) or times activations of the same format
    (N = 2..16; N = 1 is w4a4's) on the tensor cores, K a multiple of 32.  Every row it loads aligned to its load
    width: packed rows of weights and FP4 activations 16 bytes (MXFP4 outside split: 4), NVFP4 scale rows 2
    bytes (two blocks' scales per load), float activation rows 16 bytes and contiguous along K.  bf16 activations
    in k32 and split must lie in 2^-70 <= |x| < 2^64 (module docstring)."""

    name = "weight_only"
    config_type = WeightOnlyConfig
    code_orders = CODE_ORDERS

    def why_not(self, case: GemvCase, target: Target) -> str | None:
        if not target.runs_triton:
            return "runs Triton kernels only"
        if case.a.code_order == "paired" and case.fp4_activation:
            return ("a: paired-order weights need fp16 or bf16 activations (an FP4 activation's decode pairs its "
                    "codes i and i + 4, the checkpoint order's pairing)")
        if too_many_rows(case) is not None:
            return too_many_rows(case)
        if case.k % 32:
            return f"needs K a multiple of 32, got K = {case.k}"
        nvfp4 = case.fmt.name == "nvfp4"
        if nvfp4 and not target.e4m3x2_cvt:
            return f"needs cvt.rn.f16x2.e4m3x2 for NVFP4 (sm_89 or newer; this is {target.describe()})"
        row_bytes = 16 if nvfp4 else 4
        reason = _fp4_rows_reason("a", case.a, row_bytes, nvfp4)
        if reason is not None:
            return reason
        if case.fp4_activation:
            if case.n == 1:
                return "FP4 activations with N = 1 go to w4a4"
            return _fp4_rows_reason("b", case.b, row_bytes, nvfp4)
        if case.b.dtype not in (torch.float16, torch.bfloat16):
            return f"needs fp16 or bf16 activations, got {case.b.dtype}"
        if case.b.dtype == torch.bfloat16 and not target.bf16x2_mul:
            return f"needs mul.rn.bf16x2 for bf16 activations (sm_90 or newer; this is {target.describe()})"
        if case.b.align < 16:
            return "b: needs rows contiguous along K at 16-byte aligned addresses"
        return None

    def error_model(self, case: GemvCase, config: WeightOnlyConfig) -> ErrorModel:
        """Every product in one fp32 accumulation, with the step mode's fold (``_mma_step.fold_exponent``)."""
        spec = step_spec(case, config)
        return ErrorModel(tensor_cores=True, fold=fold_exponent(spec.fmt, spec.act, spec.mode))

    def default_config(self, case: GemvCase, target: Target) -> WeightOnlyConfig:
        # The interpreter has no SMs: the H200's count, where the configurations were measured.
        return weight_only_config(case, target.sm_count or SM90.sm_count)

    def check_config(self, config: WeightOnlyConfig, case: GemvCase | None = None) -> None:
        """ValueError naming ``config`` unless the kernel compiles it: tiles 1, 2 or 4, warps a power of two up
        to ``MAX_WARPS``, chunks 1 or 2; for ``case``: split only for N <= ``MAX_SPLIT_N`` and 16-byte rows."""
        if config.tiles not in (1, 2, 4) or config.chunks not in (1, 2):
            raise ValueError(f"config: expected tiles 1, 2 or 4 and chunks 1 or 2, got {config}")
        if not isinstance(config.warps, int) or not 1 <= config.warps <= MAX_WARPS or config.warps & (config.warps - 1):
            raise ValueError(f"config: expected warps a power of two from 1 to {MAX_WARPS}, got {config}")
        if case is not None and config.split:
            if case.n > MAX_SPLIT_N:
                raise ValueError(f"config: split takes N <= {MAX_SPLIT_N} activation rows, got N = {case.n}")
            if not _split_aligned(case):
                raise ValueError("config: split reads 16-byte rows; a (or the FP4 b) has rows 4-byte aligned only")

    def triton_launch(self, case: GemvCase, config: WeightOnlyConfig, target: Target) -> TritonLaunch:
        """Byte pointers throughout: a and the scales uint8, b the FP4 bytes or the fp16/bf16 activation read as
        bytes (strides times 2); strides in bytes."""
        a, b = case.a, case.b
        fp4 = case.fp4_activation
        spec = step_spec(case, config)
        asm_full, constraints_full = step_asm(spec)
        asm_tail, constraints_tail = step_asm(spec._replace(tail=True))
        if fp4:
            b_strides, sfb = (b.batch_stride, b.row_stride), _row_strides(b.scales)
        else:
            b_strides, sfb = (2 * b.strides[0], 2 * b.strides[1]), (0, 0, 0, 0)
        gsa, gsb = a.has_global_scale, fp4 and b.has_global_scale
        pdl = config.pdl and target.pdl
        gsa_ptr, gsb_ptr = global_scale_sources(case)
        args = dict(
            a_ptr=Src("a_data", torch.uint8), sfa_ptr=Src("a_scales", torch.uint8), b_ptr=Src("b_data", torch.uint8),
            sfb_ptr=Src("b_scales" if fp4 else "a_scales", torch.uint8),
            gsa_ptr=gsa_ptr, gsb_ptr=gsb_ptr,
            c_ptr=Src("out", case.out_dtype),
            M=case.m, N=case.n, K=case.k,
            a_stride_l=a.batch_stride, a_stride_m=a.row_stride,
            **dict(zip(("sfa_stride_l", "sfa_stride_row_tile", "sfa_stride_r32", "sfa_stride_r4"),
                       _row_strides(a.scales))),
            b_stride_l=b_strides[0], b_stride_n=b_strides[1],
            **dict(zip(("sfb_stride_l", "sfb_stride_row_tile", "sfb_stride_r32", "sfb_stride_r4"), sfb)),
            c_stride_l=case.out_strides[0], c_stride_m=case.out_strides[1], c_stride_n=case.out_strides[2],
            **multipliers(spec.act, spec.order),
            MODE=MODE_CODES[spec.mode], MX=case.fmt.name == "mxfp4", ACT=ACT_CODES[spec.act], TILES=config.tiles,
            WARPS=config.warps, CHUNKS=config.chunks, N_TILES=spec.n_tiles, SFA_COL_TILE=spec.sfa_col_tile,
            SFB_COL_TILE=spec.sfb_col_tile, HAS_GSA=gsa, HAS_GSB=gsb,
            FOLD=2.0 ** fold_exponent(spec.fmt, spec.act, spec.mode), USE_PTX=target.mode == "ptx", PDL=pdl,
            ASM_FULL=asm_full, CONSTRAINTS_FULL=constraints_full, ASM_TAIL=asm_tail,
            CONSTRAINTS_TAIL=constraints_tail, ORDER=code_order_index(spec.order),
        )
        options = dict(num_warps=config.warps, num_stages=1, launch_pdl=pdl)
        if config.loads_first:
            options["ptx_options"] = PTXAS_LOADS_FIRST
        return TritonLaunch(weight_only_gemv_kernel, (triton.cdiv(case.m, 16 * config.tiles), case.batch), args,
                            options)


def _fp4_rows_reason(name: str, meta: FP4Meta, row_bytes: int, nvfp4: bool) -> str | None:
    if meta.align < row_bytes:
        return f"{name}: needs data rows at multiples of {row_bytes} bytes, got {meta.align}-byte alignment"
    if nvfp4 and meta.scale_align < 2:
        return f"{name}: needs 2-byte aligned scale rows (two blocks' scales per load)"
    return None


# --- the kernel ---------------------------------------------------------------------------------------------


@triton.jit
def _col_offset(col, COL_TILE: tl.constexpr):
    """Byte offset of scale column ``col`` (runs of 4 contiguous columns, ``COL_TILE`` apart)."""
    return (col // 4) * COL_TILE + col % 4


@triton.jit
def _scale_ptr(sf_ptr, pid_l, rows, N, stride_l, stride_row_tile, stride_r32, stride_r4, col,
               COL_TILE: tl.constexpr):
    """The scale of row ``rows`` (clamped to N - 1) and column ``col`` of matrix ``pid_l``."""
    rows = tl.minimum(rows, N - 1)
    return (sf_ptr + pid_l * stride_l + scale_row_offset(rows, stride_row_tile, stride_r32, stride_r4)
            + _col_offset(col, COL_TILE))


@triton.jit
def _activation_ptr(b_ptr, pid_l, n, N, b_stride_l, b_stride_n, k_elem, ACT: tl.constexpr):
    """Activation row n (clamped to N - 1: padded columns are computed and never stored) at element k_elem."""
    rows = tl.minimum(n, N - 1).to(tl.int64)
    if ACT == 2:
        return b_ptr + pid_l * b_stride_l + rows * b_stride_n + k_elem // 2
    else:
        return b_ptr + pid_l * b_stride_l + rows * b_stride_n + 2 * k_elem


@triton.jit
def twin_column_row(O: tl.constexpr, c, MODE: tl.constexpr):
    """The activation row of output ``O``'s C column for thread c: column 8 (O // 2) + 2 c + O % 2, in split
    activation row O (``_mma_step``'s accumulator layout)."""
    if MODE == 2:
        row = O + 0 * c
    else:
        row = 8 * (O // 2) + 2 * c + O % 2
    return row


@triton.jit
def _step(a0, a1, a2, a3, k0, K, pa, ps, px, pxs, pxs0, pxs1, xon, muls, col_ptrs, col_scale_ptrs, k_first, c,
          zero, MODE: tl.constexpr, MX: tl.constexpr, ACT: tl.constexpr, CHUNKS: tl.constexpr,
          N_TILES: tl.constexpr, SFA_COL_TILE: tl.constexpr, SFB_COL_TILE: tl.constexpr, USE_PTX: tl.constexpr,
          TAIL: tl.constexpr, P: tl.constexpr, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr,
          ORDER: tl.constexpr):
    """The step at element k0 of every warp's chunks: its byte offsets (the same for every thread), then the
    PTX step or its twin."""
    BLOCK: tl.constexpr = 32 if MX else 16
    k0 = tl.cast(k0, tl.int64)
    ka = k0 // 2
    ks = (k0 // (4 * BLOCK)) * SFA_COL_TILE
    if ACT == 2:
        kx = k0 // 2
    else:
        kx = 2 * k0
    kxs = (k0 // (4 * BLOCK)) * SFB_COL_TILE
    kleft = (K - k0).to(tl.int32) - k_first  # [1, T]: elements of K left from the thread's first chunk
    if USE_PTX:
        a0, a1, a2, a3 = _step_ptx(a0, a1, a2, a3, pa, ps, px, pxs, pxs0, pxs1, ka.to(tl.int32) + zero,
                                   ks.to(tl.int32) + zero, kx.to(tl.int32) + zero, kxs.to(tl.int32) + zero, xon, muls,
                                   kleft + zero, ASM, CONSTRAINTS, MX, ACT, N_TILES, TAIL, P)
    else:
        a0, a1, a2, a3 = _step_triton(a0, a1, a2, a3, pa, ps, col_ptrs, col_scale_ptrs, ka, ks, kx, kxs, kleft, c,
                                      MODE, MX, ACT, CHUNKS, N_TILES, SFA_COL_TILE, SFB_COL_TILE, TWIN_PIECE, ORDER)
    return a0, a1, a2, a3


@triton.jit
def _step_ptx(a0, a1, a2, a3, pa, ps, px, pxs, pxs0, pxs1, ka, ks, kx, kxs, xon, muls, kleft, ASM: tl.constexpr,
              CONSTRAINTS: tl.constexpr, MX: tl.constexpr, ACT: tl.constexpr, N_TILES: tl.constexpr,
              TAIL: tl.constexpr, P: tl.constexpr):
    """One step of ``_mma_step.step_asm``; the operands in the order of its ``input_names``."""
    # Pointers as integers: the asm's operands are broadcast together, which Triton refuses for pointers.
    ins = (pa.to(tl.int64), ps.to(tl.int64), px.to(tl.int64))
    if ACT == 2:
        if MX:
            ins = ins + (pxs0.to(tl.int64), pxs1.to(tl.int64))
        else:
            ins = ins + (pxs.to(tl.int64),)
        ins = ins + (ka, ks, kx, kxs)
    else:
        ins = ins + (ka, ks, kx)
    ins = ins + (xon,) + muls
    if TAIL:
        ins = ins + (kleft,)
    if N_TILES == 1:
        a0, a1 = tl.inline_asm_elementwise(ASM, CONSTRAINTS, (a0, a1) + ins, dtype=(tl.float32, tl.float32),
                                           is_pure=True, pack=P)
    else:
        a0, a1, a2, a3 = tl.inline_asm_elementwise(ASM, CONSTRAINTS, (a0, a1, a2, a3) + ins,
                                                   dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                                   is_pure=True, pack=P)
    return a0, a1, a2, a3


@triton.jit
def _piece_scales(sf_ptr, piece, in_k, MX: tl.constexpr, COL_TILE: tl.constexpr, PIECE: tl.constexpr):
    """Decoded scales of the ``PIECE`` elements ``piece`` from column pointers ``sf_ptr`` ``[A, B]`` (a warp
    chunk's first column, a multiple of 4), zero where not ``in_k``: MXFP4 its block's ``[A, B]``, NVFP4 its
    blocks' ``[A, B, max(PIECE // 16, 1)]``."""
    if MX:
        j = (PIECE * piece) // 32
        raw = tl.load(sf_ptr + (j // 4) * COL_TILE + j % 4, mask=in_k, other=0)
        scales = decode_scale(raw, "mxfp4")
    else:
        j = (PIECE * piece) // 16 + tl.arange(0, max(PIECE // 16, 1))
        raw = tl.load(sf_ptr[:, :, None] + (j // 4) * COL_TILE + j % 4, mask=in_k[:, :, None], other=0)
        scales = decode_scale(raw, "nvfp4")
    return scales


@triton.jit
def _piece_values(byte_ptr, piece, in_k, PIECE: tl.constexpr, ORDER: tl.constexpr = 0):
    """The e2m1 values of the ``PIECE`` elements ``piece`` from byte pointers ``byte_ptr`` ``[A, B]`` (codes in
    code order ``ORDER``, ``_decode.ordered_codes``), zero where not ``in_k``: float32 ``[A, B, PIECE]``."""
    words = tl.load((byte_ptr + (PIECE // 2) * piece).to(tl.pointer_type(tl.int32))[:, :, None]
                    + tl.arange(0, PIECE // 8), mask=in_k[:, :, None], other=0)
    v = e2m1_word_values(words, ORDER)
    return tl.reshape(v, [v.shape[0], v.shape[1], PIECE])


@triton.jit
def _scaled_nvfp4(v, scales, PIECE: tl.constexpr):
    """NVFP4 values ``[A, B, PIECE]`` times their blocks' scales ``[A, B, max(PIECE // 16, 1)]``."""
    NB: tl.constexpr = max(PIECE // 16, 1)
    return tl.reshape(tl.reshape(v, [v.shape[0], v.shape[1], NB, PIECE // NB]) * scales[:, :, :, None],
                      [v.shape[0], v.shape[1], PIECE])


@triton.jit
def _piece_column_sum(w, sw, x_ptr, sx_ptr, piece, in_k, MX: tl.constexpr, ACT: tl.constexpr,
                      SFB_COL_TILE: tl.constexpr, PIECE: tl.constexpr):
    """Each element's weights ``w`` ``[P, T, PIECE]`` (NVFP4: scaled; MXFP4: unscaled, ``sw`` their block's
    scale) times the same elements of the activation column at byte pointers ``x_ptr`` ``[1, T]`` (scales
    ``sx_ptr``), summed: ``[P, T]`` (MXFP4: the partial times the scales)."""
    if ACT == 2:
        x = _piece_values(x_ptr, piece, in_k, PIECE)
        sx = _piece_scales(sx_ptr, piece, in_k, MX, SFB_COL_TILE, PIECE)
        if MX:
            part = tl.sum(w * x, axis=2) * (sw * sx)
        else:
            part = tl.sum(w * _scaled_nvfp4(x, sx, PIECE), axis=2)
    else:
        ptrs = x_ptr[:, :, None] + 2 * (PIECE * piece + tl.arange(0, PIECE))
        if ACT == 1:
            x = tl.load(ptrs.to(tl.pointer_type(tl.bfloat16)), mask=in_k[:, :, None], other=0).to(tl.float32)
        else:
            x = tl.load(ptrs.to(tl.pointer_type(tl.float16)), mask=in_k[:, :, None], other=0).to(tl.float32)
        part = tl.sum(w * x, axis=2)
        if MX:
            part = part * sw
    return part


@triton.jit
def _step_triton(a0, a1, a2, a3, pa, ps, col_ptrs, col_scale_ptrs, ka, ks, kx, kxs, kleft, lane_c,
                 MODE: tl.constexpr, MX: tl.constexpr, ACT: tl.constexpr, CHUNKS: tl.constexpr,
                 N_TILES: tl.constexpr, SFA_COL_TILE: tl.constexpr, SFB_COL_TILE: tl.constexpr,
                 PIECE: tl.constexpr, ORDER: tl.constexpr):
    """``_step_ptx`` in plain Triton: the same accumulator elements from the same weight pointers.

    Each element e of thread (g, c) is its row against the activation row of its C column (``col_ptrs[o]``,
    at the warp chunk) over the warp's chunk: all of it (fold, k32) or thread c's K slots (split: the
    32-element groups j with j % 4 == c).  A loop over pieces of ``PIECE`` elements keeps each tensor at
    ``PIECE`` elements per row and column: the whole chunk at once (``[P, T, 128 * CHUNKS]`` per column)
    took minutes to compile (docs/performance.md, "Compile time").  Products are exact in fp32 and summed in
    another order than the tensor cores'."""
    if MODE == 1:  # k32: the thread's pointers are its word c of the warp chunk's first block
        first = 0
        wa = pa - 4 * lane_c + ka
        wsf = ps + ks
    else:  # fold, split: its 32 elements of the chunk at 32 c, blocks 2 c, 2 c + 1 (MXFP4: block c)
        first = 32 * lane_c
        wa = pa - 16 * lane_c + ka
        if MX:
            wsf = ps - lane_c + ks
        else:
            wsf = ps - ((lane_c // 2) * SFA_COL_TILE + 2 * (lane_c % 2)) + ks
    k_ok = kleft + first  # elements of the warp chunk in K
    x0, x1, x2, x3 = col_ptrs
    s0, s1, s2, s3 = col_scale_ptrs
    for piece in range((128 // PIECE) * CHUNKS):
        in_k = PIECE * piece < k_ok  # K is a multiple of 32: a piece is wholly in K or wholly past it
        if MODE == 2:
            in_k = in_k & ((PIECE * piece // 32) % 4 == lane_c)
        w = _piece_values(wa, piece, in_k, PIECE, ORDER)  # [P, T, PIECE]
        sw = _piece_scales(wsf, piece, in_k, MX, SFA_COL_TILE, PIECE)
        if not MX:
            w = _scaled_nvfp4(w, sw, PIECE)
        a0 = a0 + _piece_column_sum(w, sw, x0 + kx, s0 + kxs, piece, in_k, MX, ACT, SFB_COL_TILE, PIECE)
        a1 = a1 + _piece_column_sum(w, sw, x1 + kx, s1 + kxs, piece, in_k, MX, ACT, SFB_COL_TILE, PIECE)
        if N_TILES == 2:
            a2 = a2 + _piece_column_sum(w, sw, x2 + kx, s2 + kxs, piece, in_k, MX, ACT, SFB_COL_TILE, PIECE)
            a3 = a3 + _piece_column_sum(w, sw, x3 + kx, s3 + kxs, piece, in_k, MX, ACT, SFB_COL_TILE, PIECE)
    return a0, a1, a2, a3


@triton.jit
def program_lanes(TILES: tl.constexpr, WARPS: tl.constexpr):
    """A program's thread layout: (e ``[P, 1]`` the element index 2 t + h, warp, g, c ``[1, 32 warps]``, zero
    ``[P, 32 warps]`` int32)."""
    e = tl.arange(0, 2 * TILES)[:, None]
    tid = tl.arange(0, 32 * WARPS)[None, :]
    warp = tid // 32
    g = (tid % 32) // 4
    c = tid % 4
    zero = tl.zeros([2 * TILES, 32 * WARPS], dtype=tl.int32)
    return e, warp, g, c, zero


@triton.jit
def weight_pointers(a_ptr, sfa_ptr, pid_l, rows, M, a_stride_l, a_stride_m, sfa_stride_l, sfa_stride_row_tile,
                    sfa_stride_r32, sfa_stride_r4, warp, c, MODE: tl.constexpr, MX: tl.constexpr,
                    CHUNKS: tl.constexpr, SFA_COL_TILE: tl.constexpr):
    """The thread's weight and weight-scale pointers ``[P, T]`` at its first chunk of matrix ``pid_l`` (a batch
    index, or an expert), its first element of K and its first activation element:
    (pa, ps, k_first, k_x, k_warp)."""
    KC: tl.constexpr = 128 * CHUNKS  # elements of K per warp and step
    BLOCK: tl.constexpr = 32 if MX else 16
    k_warp = warp * KC
    if MODE == 1:  # k32: word c of every block
        k_first = k_warp
        pa = a_ptr + pid_l * a_stride_l + rows.to(tl.int64) * a_stride_m + k_warp // 2 + 4 * c
        k_x = k_warp + 8 * c
    else:  # 32 consecutive elements per chunk
        k_first = k_warp + 32 * c
        pa = a_ptr + pid_l * a_stride_l + rows.to(tl.int64) * a_stride_m + k_first // 2
        k_x = k_first
    ps = _scale_ptr(sfa_ptr, pid_l, rows, M, sfa_stride_l, sfa_stride_row_tile, sfa_stride_r32, sfa_stride_r4,
                    k_first // BLOCK, SFA_COL_TILE)
    return pa, ps, k_first, k_x, k_warp


@triton.jit
def fragment_rows(e, g, MODE: tl.constexpr):
    """The activation row of the thread's B fragment for n-tile e: g + 8 e, or in split 2 e + g % 2 (threads with
    g // 2 == c only)."""
    if MODE == 2:
        x_rows = 2 * e + g % 2
    else:
        x_rows = g + 8 * e
    return x_rows


@triton.jit
def k_loop(pa, ps, px, pxs, pxs0, pxs1, xon, muls, col_ptrs, col_scale_ptrs, k_first, c, zero, K,
           MODE: tl.constexpr, MX: tl.constexpr, ACT: tl.constexpr, TILES: tl.constexpr, WARPS: tl.constexpr,
           CHUNKS: tl.constexpr, N_TILES: tl.constexpr, SFA_COL_TILE: tl.constexpr, SFB_COL_TILE: tl.constexpr,
           USE_PTX: tl.constexpr, PDL: tl.constexpr, ASM_FULL: tl.constexpr, CONSTRAINTS_FULL: tl.constexpr,
           ASM_TAIL: tl.constexpr, CONSTRAINTS_TAIL: tl.constexpr, ORDER: tl.constexpr):
    """Every step over K from zeroed accumulators: the four accumulators ``[P, T]`` (``_mma_step``'s layout);
    ``ORDER``: the weights' code order (``_decode.code_order_index``; the PTX's decode is the asm's, the twin's
    follows this)."""
    P: tl.constexpr = 2 * TILES
    STEP: tl.constexpr = WARPS * 128 * CHUNKS
    a0 = tl.zeros([P, 32 * WARPS], dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # The PTX masks only in the last, partial step (its own asm); the twin masks every step, so one loop.
    n_full = K // STEP if USE_PTX else tl.cdiv(K, STEP)
    for s in range(0, n_full):
        a0, a1, a2, a3 = _step(a0, a1, a2, a3, s * STEP, K, pa, ps, px, pxs, pxs0, pxs1, xon, muls, col_ptrs,
                               col_scale_ptrs, k_first, c, zero, MODE, MX, ACT, CHUNKS, N_TILES, SFA_COL_TILE,
                               SFB_COL_TILE, USE_PTX, False, P, ASM_FULL, CONSTRAINTS_FULL, ORDER)
    if USE_PTX:
        if n_full * STEP < K:
            a0, a1, a2, a3 = _step(a0, a1, a2, a3, n_full * STEP, K, pa, ps, px, pxs, pxs0, pxs1, xon, muls,
                                   col_ptrs, col_scale_ptrs, k_first, c, zero, MODE, MX, ACT, CHUNKS, N_TILES,
                                   SFA_COL_TILE, SFB_COL_TILE, USE_PTX, True, P, ASM_TAIL, CONSTRAINTS_TAIL,
                                   ORDER)
    return a0, a1, a2, a3


@triton.jit
def column_result(acc, O: tl.constexpr, MODE: tl.constexpr, TILES: tl.constexpr, WARPS: tl.constexpr,
                  FOLD: tl.constexpr, USE_PTX: tl.constexpr):
    """Output ``O`` summed over the warps (and in split over the 4 K owners c) with the fold undone: (values,
    e, g, their activation rows n), broadcast together (``tile_rows(pid_m, e, g)``: their rows)."""
    P: tl.constexpr = 2 * TILES
    if MODE == 2:
        out = tl.sum(tl.sum(tl.reshape(acc, [P, WARPS, 8, 4]), axis=3), axis=1)  # [e, g]
        e = tl.arange(0, P)[:, None]
        g = tl.arange(0, 8)[None, :]
        n = O + 0 * g
    else:
        out = tl.sum(tl.reshape(acc, [P, WARPS, 32]), axis=1)  # [e, lane]
        e = tl.arange(0, P)[:, None]
        lane = tl.arange(0, 32)[None, :]
        g = lane // 4
        n = 8 * (O // 2) + 2 * (lane % 4) + O % 2
    if USE_PTX:
        out = out * FOLD
    return out, e, g, n


@triton.jit
def tile_rows(pid_m, e, g, TILES: tl.constexpr):
    """The output rows of program row tile ``pid_m`` that element e of lane group g holds."""
    return pid_m * (16 * TILES) + 16 * (e // 2) + 8 * (e % 2) + g


@triton.jit
def _store_column(acc, O: tl.constexpr, pid_m, pid_l, gsa_ptr, gsb_ptr, c_ptr, M, N, c_stride_l, c_stride_m,
                  c_stride_n, MODE: tl.constexpr, TILES: tl.constexpr, WARPS: tl.constexpr, FOLD: tl.constexpr,
                  USE_PTX: tl.constexpr, HAS_GSA: tl.constexpr, HAS_GSB: tl.constexpr):
    """Apply the global scales to output ``O``, round once, store."""
    out, e, g, n = column_result(acc, O, MODE, TILES, WARPS, FOLD, USE_PTX)
    out = apply_global_scales(out, gsa_ptr, gsb_ptr, HAS_GSA, HAS_GSB)
    rows = tile_rows(pid_m, e, g, TILES)
    ptrs = c_ptr + pid_l * c_stride_l + rows.to(tl.int64) * c_stride_m + n * c_stride_n
    store_rounded(ptrs, out, (rows < M) & (n < N))


@triton.jit
def weight_only_gemv_kernel(
    a_ptr, sfa_ptr, b_ptr, sfb_ptr, gsa_ptr, gsb_ptr, c_ptr,
    M, N, K,
    a_stride_l, a_stride_m,
    sfa_stride_l, sfa_stride_row_tile, sfa_stride_r32, sfa_stride_r4,
    b_stride_l, b_stride_n,
    sfb_stride_l, sfb_stride_row_tile, sfb_stride_r32, sfb_stride_r4,
    c_stride_l, c_stride_m, c_stride_n,
    mp0, mp1, m24, m29,
    MODE: tl.constexpr,
    MX: tl.constexpr,
    ACT: tl.constexpr,
    TILES: tl.constexpr,
    WARPS: tl.constexpr,
    CHUNKS: tl.constexpr,
    N_TILES: tl.constexpr,
    SFA_COL_TILE: tl.constexpr,
    SFB_COL_TILE: tl.constexpr,
    HAS_GSA: tl.constexpr,
    HAS_GSB: tl.constexpr,
    FOLD: tl.constexpr,
    USE_PTX: tl.constexpr,
    PDL: tl.constexpr,
    ASM_FULL: tl.constexpr,
    CONSTRAINTS_FULL: tl.constexpr,
    ASM_TAIL: tl.constexpr,
    CONSTRAINTS_TAIL: tl.constexpr,
    ORDER: tl.constexpr,
):
    # Byte pointers throughout (a, b, scales: uint8); strides in bytes.  mp0 .. m29: _mma_step.multipliers.
    pid_m = tl.program_id(0)
    pid_l = tl.program_id(1).to(tl.int64)
    e, warp, g, c, zero = program_lanes(TILES, WARPS)
    # Tail rows re-read row M - 1; only the store is masked.
    rows = tl.minimum(tile_rows(pid_m, e, g, TILES), M - 1)  # [P, T]
    pa, ps, k_first, k_x, k_warp = weight_pointers(a_ptr, sfa_ptr, pid_l, rows, M, a_stride_l, a_stride_m,
                                                   sfa_stride_l, sfa_stride_row_tile, sfa_stride_r32, sfa_stride_r4,
                                                   warp, c, MODE, MX, CHUNKS, SFA_COL_TILE)
    x_rows = fragment_rows(e, g, MODE)
    px = _activation_ptr(b_ptr, pid_l, x_rows, N, b_stride_l, b_stride_n, k_x, ACT)
    xon = ((g // 2) == c).to(tl.int32) + zero
    pxs = px
    pxs0 = px
    pxs1 = px
    if ACT == 2:
        if MX:  # the activation scales of this thread's C columns' rows
            if MODE == 2:
                c_rows = 2 * e + zero
            else:
                c_rows = 8 * e + 2 * c + zero
            pxs0 = _scale_ptr(sfb_ptr, pid_l, c_rows, N, sfb_stride_l, sfb_stride_row_tile, sfb_stride_r32,
                              sfb_stride_r4, k_first // 32, SFB_COL_TILE)
            pxs1 = _scale_ptr(sfb_ptr, pid_l, c_rows + 1, N, sfb_stride_l, sfb_stride_row_tile, sfb_stride_r32,
                              sfb_stride_r4, k_first // 32, SFB_COL_TILE)
        else:
            pxs = _scale_ptr(sfb_ptr, pid_l, x_rows + zero, N, sfb_stride_l, sfb_stride_row_tile, sfb_stride_r32,
                             sfb_stride_r4, k_first // 16, SFB_COL_TILE)
    muls = (mp0 + zero, mp1 + zero, m24 + zero, m29 + zero)
    # The twin reads each C column's activation row at the warp chunk (``twin_column_row``).
    BLOCK: tl.constexpr = 32 if MX else 16
    col_ptrs = ()
    col_scale_ptrs = ()
    for o in tl.static_range(4):
        row = twin_column_row(o, c, MODE)
        col_ptrs = col_ptrs + (_activation_ptr(b_ptr, pid_l, row, N, b_stride_l, b_stride_n, k_warp, ACT),)
        col_scale_ptrs = col_scale_ptrs + (
            _scale_ptr(sfb_ptr, pid_l, row, N, sfb_stride_l, sfb_stride_row_tile, sfb_stride_r32, sfb_stride_r4,
                       k_warp // BLOCK, SFB_COL_TILE),)
    a0, a1, a2, a3 = k_loop(pa, ps, px, pxs, pxs0, pxs1, xon, muls, col_ptrs, col_scale_ptrs, k_first, c, zero, K,
                            MODE, MX, ACT, TILES, WARPS, CHUNKS, N_TILES, SFA_COL_TILE, SFB_COL_TILE, USE_PTX, PDL,
                            ASM_FULL, CONSTRAINTS_FULL, ASM_TAIL, CONSTRAINTS_TAIL, ORDER)
    accumulators = (a0, a1, a2, a3)
    for o in tl.static_range(2 * N_TILES):
        _store_column(accumulators[o], o, pid_m, pid_l, gsa_ptr, gsb_ptr, c_ptr, M, N, c_stride_l, c_stride_m,
                      c_stride_n, MODE, TILES, WARPS, FOLD, USE_PTX, HAS_GSA, HAS_GSB)
