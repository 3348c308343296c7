"""The decode engine (issue 27): NVFP4 or MXFP4 weights times fp16 or bf16 activations, N = 1..16, on Hopper.

The program.  ``16 * tiles`` weight rows of one matrix over all of K; a batch of L matrices (the task's ``[M, K, L]``,
any operand broadcast) is one grid of every matrix's row tiles, batch-major, each batch found at its batch stride
in rows (``batch_rows``).  Warp-specialized (Gluon, ``_gluon``):

* a producer warp streams, per step of ``STEP_K`` = 1024 elements of K, the rows' packed weights, their e4m3
  scales and the activation's slice with bulk tensor copies (TMA) into a ring of ``stages`` shared-memory slots,
  each guarded by a "ready" mbarrier (the copies' bytes) and an "empty" one (every consumer thread's arrival);
* ``WARPS`` consumer warps each take 256 elements of the step (warp w: K elements 256 w .. 256 w + 255 of it),
  load their slice from shared memory (16-byte loads of 128-byte-swizzled rows) and run the weight-only kernel's
  fold step on registers (``_mma_step``: the e2m1 codes decoded straight into ``mma.sync.m16n8k16`` A fragments,
  the e4m3 scale folded into them, an mma of the activation's type) -- no barrier between the consumer warps
  per step;
* at the end the warps' fp32 accumulators are summed (once; where a program has one tile, through the ring's
  first weight slot rather than a scratch buffer) and the result rounded once into ``out``.

Operand layout.  A consumer thread (lane 4 g + c of warp w) holds, as the asm's 8 * tiles elements
e = b + 2 u + 4 h + 8 t (``register``), block ``8 u + 2 c + b`` (16 elements, one int64 of packed codes) of row
``16 t + 8 h + g`` of its step slice and that block's scale byte: exactly the weight-only kernel's fold ownership
(thread c owns 32 consecutive elements of each 128-element chunk u).  Its activation operands are four int64 per
element (``x0 .. x3``: elements 4 z .. 4 z + 3 of the same block) of activation row ``g + 8 h``, which is where
the mma's B fragments of n-tile h come from (N <= 8: h = 0 only).  ``_x_operands`` builds them from the copied
activation slice by reshapes and permutations (register renames, no data movement); ``engine_twin`` replays the
same index maps in torch (CPU), and ``tests/test_kernels_engine.py`` checks it against the exact oracle.

MXFP4 (``_RegisterK32``, shared with the routed engine; linear scales: a row tile's 32 e8m0 bytes of a step
copied as one box and read as ``SCALE_ROWS`` / ``k32_scale_layout``; swizzled: ``_swizzled_scales_k32``): the
weight-only kernel's k32
ownership on registers -- thread c owns word c of each 32-element block of its rows (the slot viewed as int32 words
and split into two operands by register renames, ``k32_weight_layouts``: Triton loads them with ``ldmatrix``),
each block's two mma go into a zeroed fp32 partial that the block's e8m0 scale multiplies into the accumulators,
the activation biased by 2^64 (``_mma_step.BF16_ACTIVATION_BIAS``; its window 2^-70 <= |x| < 2^64); its maps are
``W_SPLIT_K32`` / ``W_ORDER_K32`` and ``X_SPLIT_K32`` / ``X_ORDER_K32``, which ``engine_twin(fmt="mxfp4")`` replays.

The grid.  One program per row tile by default.  ``EngineConfig.per_sm`` > 0 makes it persistent: ``per_sm``
programs per multiprocessor share the (row tile, step) units evenly, tile-major (``persistent_ranges``), the ring
never drained between a program's tiles.  A tile split over programs (``tile_contributors``) is finished by the
program holding its first steps, at the end of its range; the others (for each, the first tile of its range)
store their fp32 partial (two slots a program: one a contributor's, one a finisher's) and arrive on the tile's
counter as soon as their segment is done.  The finisher, where all have arrived, adds their partials to its own in
program order; else it stores its own and arrives, and the last to arrive sums them (the same bits either way),
rounds once and resets the counter (``fixup_counters``: kept zero per device and stream).  2-3 µs faster than
round 23's fix-up (every arrival at the range's end), yet slower than one program per tile on 7168 x 16384 and
4096 x 4096, faster on 28672 x 8192 and where the tiles are fewer than the SMs (docs/performance.md, round 28,
H100): an option, not the default.

Scales: linear (``[K/1024, M, 16]`` copies of the rows' 64 bytes a step) or swizzled (the 128 x 4 atoms, 16 bytes
a row r % 32 -- four 32-row groups of 4 bytes: the consumer loads its group's 4-byte words of the step's atoms
itself, one step ahead of their use, each warp its own atoms in the linear pairs' register layout,
``_swizzled_words``; tiles 1 or 2 only).  Copying the atoms' 16-byte lines through the ring instead moved 4x the
scale bytes and, at N = 16, grew the ring past two programs an SM; words loaded with warps on other warps' atoms
cost a barrier a step to rearrange (docs/performance.md, round 24).

Code orders: the checkpoint's and the native one pair a word's codes i and i + 4 (the decode's bf16x2 registers), so
the activation's registers are paired to match (``float_pairs``, a ``PRMT`` a pair: 64 of the step's 791 SASS at N =
16); in the paired order (``formats.PAIRED_SLOTS``) the decode's pair i is K elements 2i and 2i + 1 and the
activation's registers are taken as loaded (docs/performance.md, round 28, item 8).

Exactness: as the weight-only kernel's fold mode (``kernels/weight_only.py``): every product exact in fp32, one
fp32 accumulation per warp over its K, the warps' sums added in fp32 (and a split tile's partials in fp32, in
program order), one rounding to the output dtype.

fp16 activations (``step_act``): the fp16 decode (``sign << 15 | code << 9``, the value times 2^-14) and the e4m3
scales as fp16 pairs with no bias (``_Step.scale_pairs_e4m3``), the MXFP4 activation unbiased: the weight-only
kernel's fp16 numerics (``_mma_step.fold_exponent``).

What it does not run (``why_not``): FP4 activations, a batch (L > 1), K not a multiple of 64 (with linear
NVFP4 scales: of 256), N > 16, targets without TMA (before sm_90) and the CPU.  K past a multiple of 1024 takes one
more step whose copies the copy engine zero-fills past K (``K_ALIGN``).  Its measured place (docs/performance.md,
rounds 14 and 24-26): N >= 9, both formats and scale layouts (at N = 16 swizzled scales within 3% of the linear
ones' time since round 25; NVFP4 swizzled 1.16-1.46x faster than the streaming kernel on an H100, MXFP4 1.24-1.8x
faster than weight_only), and N = 4-8 where its programs fit one wave at three an SM (round 26, ``engine_deferred``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..formats import CODE_ORDERS, decode_e2m1, decode_e4m3, decode_e8m0, unpack_e2m1
from ..target import Target
from ._gluon import async_copy, gl, gluon, mbarrier, ring_barriers, shared_view, thread_barrier, tma_load
from ._mma_step import MULTIPLIERS, StepSpec, _Step, fold_exponent, multipliers
from ._ptx import AsmOperands, PtxBlock
from .spec import (DescSrc, ErrorModel, GemvCase, GemvOperands, Src, TritonKernelSpec, TritonLaunch, fill_sources,
                   global_scale_sources)

__all__ = ["EngineConfig", "Engine", "engine_config", "engine_deferred", "step_asm", "engine_twin",
           "swizzled_scales_twin", "WARPS", "STEP_K", "register", "activation_rows", "copy_layout"]

WARPS = 4  # consumer warps; each takes WARP_K elements of a step
WARP_K = 256  # a warp's elements of a step: one 128-byte chunk of each weight row
STEP_K = WARP_K * WARPS
# K: a multiple of 64 (the activation's copies view its rows as 64-element chunks); the last step's copies past K
# are zero-filled by the copy engine, and the swizzled scales past K read as zero (``_swizzled_words``' TAIL).
K_ALIGN = 64
MAX_N = 16


class EngineConfig(NamedTuple):
    """``tiles``: m16 tiles per program (16 * tiles rows); ``stages``: ring slots of one step each; ``maxnreg``:
    the registers per thread the launch allows (the producer warp's group keeps ``PRODUCER_REGS`` and leaves the
    rest to the consumer warps); ``per_sm``: 0 for one program per row tile, else a persistent grid of ``per_sm``
    programs per multiprocessor sharing the (row tile, step) units evenly (``persistent_ranges``), tiles split
    over programs summed by the split-K fix-up; ``groups``: the consumer's warp groups along the program's rows
    -- 1 (four consumer warps, each over all of the program's rows and a quarter of the step's K), 2 or 4 (four
    warps a group, group q over the tiles t = q (mod groups): ``4 * groups`` consumer warps sharing the step's
    activation slot; N > 8)."""

    tiles: int = 2
    stages: int = 2
    maxnreg: int = 128
    per_sm: int = 0
    groups: int = 1


TILES = (1, 2, 4)
PRODUCER_REGS = 40


# One tile a program (16 rows) where N > 8 and the 32-row tiles are few (docs/performance.md, round 25, H100): at
# most half the multiprocessors (2048 x 8192, 64 tiles: 9.4-10.5 against 11.5-12.0 µs at N = 9 and 16, both
# formats and scale layouts), or at most one a multiprocessor from N = ONE_TILE_N (4096 x 4096 and 4096 x 14336,
# 128 tiles: faster from N = 14 by 3-18%, mixed at 12, slower at 9-10 by 1-21%).  At 224 tiles (7168 x 16384) 2
# tiles are 19-42% faster at N = 9 and 16.
ONE_TILE_N = 13


# N <= 8 (round 26, H100): 2 ring slots at 80 registers, three programs an SM (the ring sum leaves no scratch: 69812
# bytes at N = 8) -- 1-8% faster than the better of (2, 3, 128) and (2, 3, 80) on five shapes at N = 1, 2, 4 and 8
# (19 of 20 cases; 4096 x 14336 N = 8 0.3% slower).
SMALL_N_CONFIG = EngineConfig(2, 2, 80)
SMALL_N_PER_SM = 3  # programs an SM that SMALL_N_CONFIG's shared memory and registers allow (sm_90 compile test)

# Where the engine takes N <= 8 from weight_only (``engine_deferred``; round 26, H100, both formats, swizzled
# scales): from N = 4 (7168 x 16384 27.7 against 32.0 µs, 4096 x 14336 17.4 / 20.4, 4096^2 7.8 / 8.5; at N = 1-2 it
# was 1-20% slower on the four shapes other than 7168 x 16384) where its 32-row programs run in one wave at
# SMALL_N_PER_SM an SM (14336 x 4096, 448 programs, 10-16% slower at N = 4-8; 28672 x 8192, 896, 0-4% slower).
MIN_N_OVER_WEIGHT_ONLY = 4

# Past one wave the engine still takes N = 4-8 where K has at least MULTI_WAVE_MIN_K / 1024 steps a program, so
# that each program's ring fill and epilogue are spread over more steps (docs/performance.md, round 31; swizzled,
# paired, µs engine / weight_only): 28672 x 8192 N = 8 on the H200 43.68 / 51.34 (NVFP4); on the H100 NVFP4 56.13 /
# 55.37 at N = 8 and 55.90 / 53.69 at N = 4, MXFP4 53.16 / 57.54 and 53.06 / 55.96.  At K = 4096 (14336 x 4096) it
# stays deferred: NVFP4 16.54 / 16.22 on the H200 at N = 8, 19.18 / 17.20 and 18.97 / 16.31 on the H100 at N = 8 / 4.
# Round 32 (H100, N = 8 / 4): K = 7168 pays in both formats -- 18432 x 7168 NVFP4 34.16 / 37.52 and 34.34 / 36.19,
# MXFP4 32.90 / 39.04 and 32.87 / 38.11; the batch 4096 x 7168 x 8 NVFP4 52.08 / 56.93, MXFP4 50.02 / 75.44 -- and
# K = 6144 does not for NVFP4 (16384 x 6144: 29.06 / 25.60 and 29.12 / 24.45; MXFP4 28.09 / 30.24, 28.05 / 28.59).
MULTI_WAVE_MIN_K = 7168


def engine_config(case: GemvCase, sm_count: int = 0) -> EngineConfig:
    """N <= 8: ``SMALL_N_CONFIG``.  N > 8: 2 ring slots (the 16-row activation slice makes a slot 50 KB), 2 tiles
    (H200, round 14 of docs/performance.md: 2 tiles at 128 registers were the best or within 3% of it at N = 16), or
    1 where the row tiles leave multiprocessors idle (``ONE_TILE_N``; ``sm_count`` 0: unknown, 2 tiles); one
    program per row tile (round 23: the persistent grid, 1 or 2 programs per SM, was slower on 4 of 5 shapes)."""
    if case.n <= 8:
        return SMALL_N_CONFIG
    row_tiles = case.batch * -(-case.m // 32)
    few = sm_count > 0 and (2 * row_tiles <= sm_count or (row_tiles <= sm_count and case.n >= ONE_TILE_N))
    return EngineConfig(1 if few else 2, 2, 128)


def engine_deferred(case: GemvCase, sm_count: int) -> bool:
    """Whether the engine leaves an N <= 8 case to weight_only by default (``kernels.DEFERRALS``): below
    ``MIN_N_OVER_WEIGHT_ONLY``, or where ``SMALL_N_CONFIG``'s programs would take more than one wave (``sm_count``
    0, unknown: deferred) and K is under ``MULTI_WAVE_MIN_K``."""
    if case.n > 8:
        return False
    tiles = case.batch * -(-case.m // (16 * SMALL_N_CONFIG.tiles))
    return case.n < MIN_N_OVER_WEIGHT_ONLY or (tiles > SMALL_N_PER_SM * sm_count and case.k < MULTI_WAVE_MIN_K)


def register(b: int, u: int, h: int, t: int) -> int:
    """The asm element of block b of chunk u, row half h, tile t (the layouts below list their registers in this
    order)."""
    return b + 2 * u + 4 * h + 8 * t


def activation_rows(n: int) -> int:
    """Rows of the activation slice a step copies: N rounded up to a power of two (16 above 8)."""
    return 16 if n > 8 else 1 << (n - 1).bit_length()


# --- the step: the fold step of kernels/_mma_step.py on registers -------------------------------------------------


class _RegisterFold(_Step):
    """One consumer step: ``8 * tiles`` elements per thread (``register``), operands in asm order: the fp32
    accumulators (outputs, tied), the weights (int64), the scale bytes (packed four per register), ``x0 .. x3``
    (int64) and the ``MULTIPLIERS``.  Accumulator element ``8 t + 4 nt + r`` is register r of tile t's C fragment
    for n-tile nt."""

    FMT, MODE = "nvfp4", "fold"

    def __init__(self, tiles: int, n_tiles: int, order: str = "checkpoint", scale_bits: int = 8, act: str = "bf16"):
        PtxBlock.__init__(self)
        self.mma_type = act
        self.spec = StepSpec(self.FMT, act, self.MODE, tiles, 2, n_tiles, 4, 4, False, order)
        pack = 8 * tiles
        # The scales: bytes packed four a register (scale_bits 8), or 16-bit elements two a register, blocks b = 0,
        # 1 of an element (u, h, t) in each half (scale_bits 16: the pair is one 16-bit load, none repacked).
        names = [("w", "l"), ("s", "r", pack * scale_bits // 32)] + [(f"x{z}", "l") for z in range(4)]
        op = AsmOperands(1, pack, names + [(m, "r") for m in MULTIPLIERS])
        self.constraints = op.constraint_string()
        self.mul = {m: op(m) for m in MULTIPLIERS}
        b_pairs = {}
        for u in range(2):
            for nt in range(n_tiles):  # n-tile nt: the h = nt elements of x (activation rows g + 8 nt); tile 0's
                raw = []
                for b in range(2):
                    for z in range(4):
                        lo, hi = self.reg("b32", f"y{nt}_{u}_{b}_{z}l"), self.reg("b32", f"y{nt}_{u}_{b}_{z}h")
                        self.emit(f"mov.b64 {{{lo}, {hi}}}, {op(f'x{z}', register(b, u, nt, 0))};")
                        raw += [lo, hi]
                b_pairs[u, nt] = self.matched_pairs(raw, f"b{nt}_{u}_")
        for t in range(tiles):
            for u in range(2):
                words, scales = {}, []
                for h in range(2):
                    words[h] = []
                    for b in range(2):
                        lo, hi = self.reg("b32", f"w{t}_{u}_{h}_{b}l"), self.reg("b32", f"w{t}_{u}_{h}_{b}h")
                        self.emit(f"mov.b64 {{{lo}, {hi}}}, {op('w', register(b, u, h, t))};")
                        words[h] += [lo, hi]
                    e = register(0, u, h, t)  # bytes e, e + 1: blocks b = 0, 1
                    wide, raw = self.reg("b32", f"st{t}_{u}_{h}"), self.reg("b16", f"sr{t}_{u}_{h}")
                    if scale_bits == 16:  # element e's 16 bits, the register's low half
                        self.emit(f"cvt.u16.u32 {raw}, {op('s', e // 2)};")
                    else:
                        self.emit(f"shr.u32 {wide}, {op('s', e // 4)}, {8 * (e % 4)};",
                                  f"cvt.u16.u32 {raw}, {wide};")
                    scales.append(self.scale_pairs_e4m3(raw, f"sc{t}_{u}_{h}", bias=act == "bf16"))
                for q in range(4):  # word q: half q % 2 of block q // 2
                    a = [self.decode(words[h][q], f"a{t}_{u}_{h}_{q}") for h in range(2)]
                    for h in range(2):
                        for p in a[h]:
                            self.emit(f"mul.rn.{act}x2 {p}, {p}, {scales[h][q // 2]};")
                    for nt in range(n_tiles):
                        d = [f"${8 * t + 4 * nt + r}" for r in range(4)]
                        for mm in range(2):
                            frag = [a[0][2 * mm], a[1][2 * mm], a[0][2 * mm + 1], a[1][2 * mm + 1]]
                            self.mma(d, frag, [b_pairs[u, nt][4 * q + 2 * mm], b_pairs[u, nt][4 * q + 2 * mm + 1]], d)


class _RegisterK32(_Step):
    """One consumer step of MXFP4 weights (``_mma_step``'s k32 ownership on registers): thread c owns word c (8
    codes) of every 32-element block of its rows, so each mma sums one block, whose two mma go into a zeroed fp32
    partial that the block's e8m0 scale multiplies into the accumulators (``fma``); the activation is biased by
    2^64 as in ``_mma_step``'s k32 (``BF16_ACTIVATION_BIAS``).  Operands, ``8 * tiles`` elements each (``register``):
    the fp32 accumulators (tied), ``wl`` / ``wh`` (int32: word c of blocks ``k32_block(0, u, b)`` /
    ``k32_block(1, u, b)`` of element (b, u, h, t)'s row), ``s`` (int64: the row's 8 scale bytes, block J in byte
    J; elements (0, 0, h, t) are read), ``x0 .. x3`` (int64: ``x[2 half + z]`` holds elements 8 c + 4 z .. 8 c + 4 z
    + 3 of block ``k32_block(half, u, b)`` of activation row g + 8 h, read at (b, u, h, 0)) and the
    ``MULTIPLIERS``.

    The scales two at a time in bf16x2 (e8m0 byte s -> bf16 bits s << 7, 2^(s - 127)): byte 0 made 2^-127 (max with
    bf16's subnormal 0x0040), byte 255 (infinity so far) made NaN (inf * 0 + inf), then each half widened to fp32
    (a shift or a mask): 3 instructions per scale where one at a time takes 4 or 5."""

    FMT, MODE = "mxfp4", "k32"

    def __init__(self, tiles: int, n_tiles: int, order: str = "checkpoint", act: str = "bf16"):
        PtxBlock.__init__(self)
        self.mma_type = act
        self.spec = StepSpec(self.FMT, act, self.MODE, tiles, 2, n_tiles, 4, 4, False, order)
        names = [("wl", "r"), ("wh", "r"), ("s", "l")] + [(f"x{z}", "l") for z in range(4)]
        op = AsmOperands(1, 8 * tiles, names + [(m, "r") for m in MULTIPLIERS])
        self.constraints = op.constraint_string()
        self.mul = {m: op(m) for m in MULTIPLIERS}
        zero, floor = self.reg("b32", "zero2"), self.reg("b32", "floor2")
        self.emit(f"mov.b32 {zero}, 0;", f"mov.b32 {floor}, 0x00400040;")  # (0, 0), (2^-127, 2^-127) in bf16
        fz = self.zero()
        scale = {}
        for t in range(tiles):
            for h in range(2):
                words = self.reg("b32", f"s{t}_{h}_lo"), self.reg("b32", f"s{t}_{h}_hi")
                self.emit(f"mov.b64 {{{words[0]}, {words[1]}}}, {op('s', register(0, 0, h, t))};")
                for i, word in enumerate(words):
                    even, odd = self.reg("b32", f"se{t}_{h}_{i}"), self.reg("b32", f"so{t}_{h}_{i}")
                    # bytes 0, 2 -> bf16 halves (<< 7); bytes 1, 3 (>> 1)
                    self.emit(f"shl.b32 {even}, {word}, 7;", f"and.b32 {even}, {even}, 0x7F807F80;",
                              f"shr.b32 {odd}, {word}, 1;", f"and.b32 {odd}, {odd}, 0x7F807F80;")
                    for j, pair in ((0, even), (1, odd)):
                        self.emit(f"max.bf16x2 {pair}, {pair}, {floor};",
                                  f"fma.rn.bf16x2 {pair}, {pair}, {zero}, {pair};")
                        for high in range(2):  # block 4 i + j + 2 high
                            name = f"{t}_{h}_{i}_{j}_{high}"
                            bits, f = self.reg("b32", f"sb{name}"), self.reg("f32", f"sf{name}")
                            widen = f"and.b32 {bits}, {pair}, 0xFFFF0000;" if high else f"shl.b32 {bits}, {pair}, 16;"
                            self.emit(widen, f"mov.b32 {f}, {bits};")
                            scale[t, h, 4 * i + j + 2 * high] = f
        for half in range(2):
            for u in range(2):
                for b in range(2):
                    block = k32_block(half, u, b)
                    pairs = {}
                    for nt in range(n_tiles):
                        raw = [self.reg("b32", f"y{nt}_{block}_{q}") for q in range(4)]
                        for z in range(2):
                            self.emit(f"mov.b64 {{{raw[2 * z]}, {raw[2 * z + 1]}}}, "
                                      f"{op(f'x{2 * half + z}', register(b, u, nt, 0))};")
                        pairs[nt] = self.matched_pairs(raw, f"b{nt}_{block}_")
                        if act == "bf16":
                            self.bias_bf16(pairs[nt])
                    for t in range(tiles):
                        word = "wh" if half else "wl"
                        a = [self.decode(op(word, register(b, u, h, t)), f"a{t}_{h}_{block}") for h in range(2)]
                        for nt in range(n_tiles):
                            part = [self.reg("f32", f"pp{t}_{nt}_{block}_{r}") for r in range(4)]
                            for mm in range(2):
                                frag = [a[0][2 * mm], a[1][2 * mm], a[0][2 * mm + 1], a[1][2 * mm + 1]]
                                self.mma(part, frag, [pairs[nt][2 * mm], pairs[nt][2 * mm + 1]],
                                         part if mm else [fz] * 4)
                            for r in range(4):
                                d = f"${8 * t + 4 * nt + r}"
                                self.emit(f"fma.rn.f32 {d}, {part[r]}, {scale[t, r // 2, block]}, {d};")


def k32_block(half: int, u: int, b: int) -> int:
    """The 32-element block (0 .. 7 of a consumer warp's 256 elements of the step) of the k32 step's operand
    ``wl`` (half 0) or ``wh`` (half 1) at element (b, u): its word c is byte offset ``16 block + 4 c`` of the row."""
    return 4 * half + 2 * u + b


# The consumer step of each weight format, and the exponent its accumulators carry (its ``_mma_step`` mode's).
STEPS = {step.FMT: step for step in (_RegisterFold, _RegisterK32)}


def step_fold_exponent(fmt: str, act: str = "bf16") -> int:
    """f such that the ``fmt`` step's accumulators hold the result times 2^-f for ``act`` activations ("bf16",
    "f16"; ``_mma_step.fold_exponent``)."""
    return fold_exponent(fmt, act, STEPS[fmt].MODE)


def step_act(dtype: torch.dtype) -> str:
    """The step's activation code (``_mma_step.StepSpec.act``) of an activation dtype the engine takes."""
    return {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]


FOLD_EXPONENT = step_fold_exponent("nvfp4")


@functools.lru_cache(maxsize=None)
def step_asm(tiles: int, n_tiles: int, fmt: str = "nvfp4", order: str = "checkpoint",
             scale_bits: int = 8, act: str = "bf16") -> tuple[str, str]:
    """(asm, constraints) of one consumer step of ``fmt`` weights in code order ``order`` times ``act`` ("bf16",
    "f16") activations (``STEPS``); NVFP4's scale operand as bytes (``scale_bits`` 8) or 16-bit pairs (16,
    ``_RegisterFold``)."""
    if fmt == "nvfp4":
        step = _RegisterFold(tiles, n_tiles, order, scale_bits, act)
    else:
        step = STEPS[fmt](tiles, n_tiles, order, act)
    return step.text(), step.constraints


# --- layouts and index maps (shared by the kernel and engine_twin) -----------------------------------------------

# The activation slice of a step, viewed as int64 [4 WARPS (w, u, c1), rows, 16 (c0, b, z)], is reshaped to bits
# and permuted into [w, rows, (u, c1, c0, b), z]: X_SPLIT[rows] the shape after the reshape, X_ORDER the
# permutation (16 rows: rows = (h, g); fewer: n only).  The k32 step's (MXFP4) slice is [4 WARPS (w, half, u), rows,
# 16 (b, c1, c0, z)], permuted into [w, rows, (u, c1, c0, b), (half, z)]: X_SPLIT_K32, X_ORDER_K32.
X_SPLIT = {16: (WARPS, 2, 2, 2, 8, 2, 2, 4), "few": (WARPS, 2, 2, "n", 2, 2, 4)}
X_ORDER = {16: (0, 3, 4, 1, 2, 5, 6, 7), "few": (0, 3, 1, 2, 4, 5, 6)}
X_SPLIT_K32 = {16: (WARPS, 2, 2, 2, 8, 2, 2, 2, 2), "few": (WARPS, 2, 2, "n", 2, 2, 2, 2)}
X_ORDER_K32 = {16: (0, 3, 4, 2, 6, 7, 5, 1, 8), "few": (0, 3, 2, 5, 6, 4, 1, 7)}
# The k32 step's weights: a row's 32 words of a warp's step (word 16 half + 8 u + 4 b + c) as [half, u, b, c],
# permuted into [(u, c, b), half] (so that each half is the fold's [16] order 8 u + 2 c + b).
W_SPLIT_K32 = (2, 2, 2, 4)
W_ORDER_K32 = (1, 3, 2, 0)


def _x_split(rows: int, k32: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    split, order = (X_SPLIT_K32, X_ORDER_K32) if k32 else (X_SPLIT, X_ORDER)
    if rows == 16:
        return split[16], order[16]
    return tuple(rows if v == "n" else v for v in split["few"]), order["few"]


def _tile_bases(tiles: int, groups: int, dim: int = 1, rank: int = 3) -> tuple[list, list]:
    """(register bases, warp bases) of the tile index t (rows 16 t ..., dimension ``dim`` of a rank-``rank``
    layout) where ``groups`` warp groups share a program's ``tiles``: t's low bits on the warp index's low bits
    (below the four K quarters, as the blocked layouts of ``_x_operands`` place them), the rest on the registers --
    group q takes the tiles t = q (mod groups)."""
    def basis(i):
        return [16 << i if d == dim else 0 for d in range(rank)]
    low = groups.bit_length() - 1
    return [basis(i) for i in range(low, tiles.bit_length() - 1)], [basis(i) for i in range(low)]


@functools.lru_cache(maxsize=None)
def _layouts(tiles: int, rows: int, k32: bool = False, groups: int = 1):
    """(weights/scales/accumulators [WARPS, 16 tiles, 16], activation slice [4 WARPS, rows, 16], the int64 views of
    the weight and activation slots) layouts; made once per (tiles, rows, step, groups): every launch passes them.
    The activation layout keeps, per thread, the int64 the step pairs in registers (fold: z; k32: z and half) and
    puts c on the lanes, so that ``_x_operands``' permutations are register renames.  With ``groups`` > 1
    (``EngineConfig``) the tile index's low bits move from the registers to the warps (``_tile_bases``): each warp
    holds its group's tiles (the step's asm for ``tiles // groups`` tiles), and every group holds the whole
    activation slice."""
    if groups == 1:
        weights = gl.BlockedLayout([1, 1, 2], [1, 8, 4], [WARPS, 1, 1], [2, 1, 0])  # registers b, u, h, t
    else:  # registers b, u, h (and t's high bits); lanes c, g; warps t's low bits, then the K quarter
        reg_tiles, warp_tiles = _tile_bases(tiles, groups)
        weights = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 8], [0, 8, 0]] + reg_tiles,
            lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
            warp_bases=warp_tiles + [[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[WARPS, 16 * tiles, 16])
    if k32:  # registers z, half, b, u (h); lanes c0, c1
        bases = [[0, 0, 1], [2, 0, 0], [0, 0, 8], [1, 0, 0]]
        c_lanes = [[0, 0, 2], [0, 0, 4]]
    else:  # registers z0, z1, b, u (h); lanes c0, c1
        bases = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [2, 0, 0]]
        c_lanes = [[0, 0, 8], [1, 0, 0]]
    bases += [[0, 8, 0]] if rows == 16 else []
    g_lanes = [[0, 1 << i, 0] if (1 << i) < rows else [0, 0, 0] for i in range(3)]
    activation = gl.DistributedLinearLayout(reg_bases=bases, lane_bases=c_lanes + g_lanes,
                                            warp_bases=[[0, 0, 0]] * (groups.bit_length() - 1) + [[4, 0, 0], [8, 0, 0]],
                                            block_bases=[], shape=[4 * WARPS, rows, 16])
    return (weights, activation, gl.NVMMASharedLayout(128, 64, rank=3),
            gl.NVMMASharedLayout(_x_swizzle(rows), 64, rank=3))


@functools.lru_cache(maxsize=None)
def k32_weight_layouts(tiles: int, groups: int = 1):
    """The k32 step's weights: (the slot's int32 view ``[WARPS, 16 tiles, 32]`` with the copies' 128-byte swizzle,
    its register layout).  Thread (g, c) loads word c of each block of its rows (registers half, b, u, then the
    rows' h, t; t on the warps where ``groups`` > 1), so that ``_k32_words``' reshape, permutation and split are
    register renames into ``_layouts``' weight layout."""
    reg_tiles, warp_tiles = _tile_bases(tiles, groups)
    rows = [[0, 8, 0]] + reg_tiles
    layout = gl.DistributedLinearLayout(reg_bases=[[0, 0, 16], [0, 0, 4], [0, 0, 8]] + rows,
                                        lane_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                        warp_bases=warp_tiles + [[1, 0, 0], [2, 0, 0]],
                                        block_bases=[],
                                        shape=[WARPS, 16 * tiles, 32])
    return gl.NVMMASharedLayout(128, 32, rank=3), layout


# The MXFP4 scale slot (a row tile's 32 e8m0 bytes of a step, rows 32 bytes apart) viewed as int64 ``[16 tiles, 2,
# 2]``: warp w's 8 bytes at ``[row, w // 2, w % 2]``.
SCALE_ROWS = gl.constexpr(gl.NVMMASharedLayout(0, 64, rank=3))


@functools.lru_cache(maxsize=None)
def k32_scale_layout(tiles: int, groups: int = 1):
    """The MXFP4 scale slot's int64 ``[2, 2, 16 tiles]`` (warp w's at ``[w // 2, w % 2]``) in registers as the k32
    step reads them, so that its reshape to ``[4, 16 tiles]`` is the weights' layout without the block dimension:
    warps on the first two (and t where ``groups`` > 1), lanes g and the registers h, t on the rows, lanes c
    replicated."""
    reg_tiles, warp_tiles = _tile_bases(tiles, groups, dim=2)
    rows = [[0, 0, 8]] + reg_tiles
    return gl.DistributedLinearLayout(reg_bases=rows, lane_bases=[[0, 0, 0], [0, 0, 0], [0, 0, 1], [0, 0, 2],
                                                                  [0, 0, 4]],
                                      warp_bases=warp_tiles + [[0, 1, 0], [1, 0, 0]],
                                      block_bases=[], shape=[2, 2, 16 * tiles])


def _x_swizzle(rows: int) -> int:
    """The activation slot's swizzle: 128 bytes where the slice has 8 or more 128-byte lines (it spreads the 8 row
    groups' 16-byte loads over the banks); N = 1 reads one line, which every lane shares."""
    return 128 if rows >= 2 else 0


def paired_lines(k: int, rows: int) -> bool:
    """Whether the activation's copy puts each 128-element chunk's two 64-element halves on adjacent lines of the
    slot (``x_slot_bases``): where K is a multiple of 128 (the copy's half dimension never passes K) and the slice
    has two or more rows (one row: every lane reads the same line)."""
    return k % 128 == 0 and rows >= 2


@functools.lru_cache(maxsize=None)
def x_slot_bases(rows: int) -> tuple:
    """The activation slot, as the paired-line copy writes it, viewed as int64 ``[16, rows, 16]`` (64-element chunk
    j, row, int64 column c -- the logical slice ``_x_operands`` takes): for each bit of an int64's offset in the
    slot, the coordinates it moves (a ``SharedLinearLayout``'s bases).

    The copy's box is ``[8, rows, 2, 64]`` (128-element chunk j // 2, row, half j % 2, element) under the 128-byte
    swizzle, so line ``l = 2 (rows (j // 2) + row) + j % 2`` holds chunk j of the row, and 16-byte unit u of line l
    sits at unit ``u ^ (l % 8)``.  Offset bits 0-3 are the int64 within the line (bit 0 the int64's half of a 16-byte
    unit, bits 1-3 the unit); bits 4 and up the line -- its bit 0 the half (j + 1), the next log2(rows) the row,
    then the 128-element chunk (j + 2, + 4, + 8).  A line bit below 3 also flips unit bit i (the swizzle), so its
    basis carries column 2^(i + 1) too.  Why (docs/performance.md, round 31, item 5): a consumer lane's c1 reads the
    next 64-element chunk, which in the one-chunk-a-line copy sits 16 lines on -- the swizzle's period twice, the
    same banks as c1 = 0 -- while here it is the adjacent line, whose swizzle moves it to other banks."""
    bases = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8]]
    line = [[1, 0, 0]] + [[0, 1 << i, 0] for i in range(rows.bit_length() - 1)] + [[2, 0, 0], [4, 0, 0], [8, 0, 0]]
    for i, (j, r, c) in enumerate(line):
        bases.append([j, r, c ^ (2 << i) if i < 3 else c])
    return tuple(tuple(b) for b in bases)


def octet_rows(case: GemvCase) -> bool:
    """Whether the weights' copy puts each 8-row octet's rows in the order 0, 2, 4, 6, 1, 3, 5, 7 (``w_slot_bases``):
    NVFP4 (the fold step's 16-byte loads; MXFP4's k32 step reads its slot by ``ldmatrix``) in one 3-D copy a step
    (K a multiple of ``WARP_K``) with whole octets (M and a batch's rows multiples of 8: the copy's row view never
    passes the last row)."""
    return (case.fmt.name == "nvfp4" and not _four_copies(case.k) and case.m % 8 == 0
            and (case.batch == 1 or batch_rows(case).weights % 8 == 0))


@functools.lru_cache(maxsize=None)
def w_slot_bases(tiles: int) -> tuple:
    """The weight slot, as the octet copy writes it, viewed as int64 ``[4, 16 tiles, 16]`` (K quarter, row, int64
    column): each int64 offset bit's coordinates (``x_slot_bases``' scheme).  The copy's box is ``[4, 2 tiles, 2, 4,
    128 bytes]`` over the rows viewed as (octet, row bit 0, row bits 1-2), so row r's line is ``8 (r // 8) + 4 (r %
    2) + (r // 2) % 4`` (plus 16 tiles a quarter): a lane's g0 (the next row) moves four lines, which the 128-byte
    swizzle turns into unit bit 2 -- a bit the lanes c (units 0-3 of a 16-byte load) never set, so the eight lanes
    of a wavefront hit eight bank groups (with one row a line, g0 flips unit bit 0 and collides with c0)."""
    bases = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8]]
    line = [[0, 2, 0], [0, 4, 0], [0, 1, 0]] + [[0, 8 << i, 0] for i in range(tiles.bit_length())] + [[1, 0, 0],
                                                                                                     [2, 0, 0]]
    for i, (q, r, c) in enumerate(line):
        bases.append([q, r, c ^ (2 << i) if i < 3 else c])
    return tuple(tuple(b) for b in bases)


@functools.lru_cache(maxsize=None)
def w_slot_layout(tiles: int):
    """The weight slot's int64 view where ``octet_rows`` (``w_slot_bases``)."""
    return gl.SharedLinearLayout([list(b) for b in w_slot_bases(tiles)])


@functools.lru_cache(maxsize=None)
def x_slot_layout(rows: int):
    """The activation slot's int64 view for ``_as_int64`` where ``paired_lines`` (``x_slot_bases``)."""
    return gl.SharedLinearLayout([list(b) for b in x_slot_bases(rows)])


# --- the kernel --------------------------------------------------------------------------------------------------


@gluon.jit
def _producer(w_desc, s_desc, x_desc, wbuf, sbuf, xbuf, ready, empty, start, end, n_steps, TB, WB, SB, XB,
              STAGES: gl.constexpr, TILE_ROWS: gl.constexpr, SWIZZLED: gl.constexpr, MX: gl.constexpr,
              W2D: gl.constexpr, X_PAIRED: gl.constexpr, W_OCTETS: gl.constexpr):
    # Work unit v of the program's range: step v % n_steps of row tile v // n_steps (``persistent_ranges``), the
    # tiles batch-major, TB a batch (``batch_rows``).  Copies past K (the last step where K % 1024 != 0) are
    # zero-filled by the copy engine.
    W_BYTES: gl.constexpr = w_desc.block_type.nbytes * (4 if W2D else 1)
    for v in range(start, end):
        i = v - start
        slot = i % STAGES
        tile = v // n_steps
        step = v - tile * n_steps
        batch = tile // TB
        row = batch * WB + (tile - batch * TB) * TILE_ROWS  # the tile's first row in the weights' descriptor
        srow = batch * SB + (tile - batch * TB) * TILE_ROWS  # ... in the linear scales'
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        if SWIZZLED:  # the consumer loads its scale words itself (``_swizzled_words``)
            mbarrier.expect(ready.index(slot), W_BYTES + x_desc.block_type.nbytes)
        else:
            mbarrier.expect(ready.index(slot), W_BYTES + s_desc.block_type.nbytes + x_desc.block_type.nbytes)
        if W2D:  # K % 256 != 0: the rows' bytes [M, K/2] in four copies of 128 columns (the last ones zero-filled)
            W2: gl.constexpr = gl.NVMMASharedLayout(128, 8, rank=2)  # the 2-D copy's (``_sources``)
            chunks = shared_view(wbuf.index(slot), gl.uint8, [4, TILE_ROWS, 128], W2)
            for c in gl.static_range(4):
                tma_load(w_desc, [row, (step * 4 + c) * 128], ready.index(slot), chunks.index(c))
        elif W_OCTETS:  # [4 quarters, octets, row bit 0, row bits 1-2, 128] (``w_slot_bases``)
            tma_load(w_desc, [step * 4, row // 8, 0, 0, 0], ready.index(slot), wbuf.index(slot))
        else:
            tma_load(w_desc, [step * 4, row, 0], ready.index(slot), wbuf.index(slot))
        if not SWIZZLED:
            if MX:  # [16 TILES rows, the step's 32 e8m0 bytes]
                tma_load(s_desc, [srow, 32 * step], ready.index(slot), sbuf.index(slot))
            else:
                tma_load(s_desc, [step * 4, srow, 0], ready.index(slot), sbuf.index(slot))
        if X_PAIRED:  # [8 chunks of 128, rows, 2 halves, 64] (``x_slot_bases``)
            tma_load(x_desc, [8 * step, batch * XB, 0, 0], ready.index(slot), xbuf.index(slot))
        else:
            tma_load(x_desc, [16 * step, batch * XB, 0], ready.index(slot), xbuf.index(slot))


@gluon.jit
def _as_int64(buf, SHAPE0: gl.constexpr, SHAPE1: gl.constexpr, LAYOUT: gl.constexpr):
    """The copied bytes of a ring slot ``buf`` viewed as int64 ``[SHAPE0, SHAPE1, 16]`` (same bytes, same swizzle)."""
    return shared_view(buf, gl.int64, [SHAPE0, SHAPE1, 16], LAYOUT)


@gluon.jit
def _x_operands(xt, TILES: gl.constexpr, ROWS: gl.constexpr, LW: gl.constexpr, K32: gl.constexpr = False,
                GROUPS: gl.constexpr = 1):
    """x0 .. x3 ``[WARPS, 16 TILES, 16]`` in ``LW`` from the activation slice (module docstring): the reshape and
    permutation are ``X_SPLIT`` / ``X_ORDER`` (``X_SPLIT_K32`` / ``X_ORDER_K32`` for the k32 step; written out:
    Gluon takes shapes as literals)."""
    G: gl.constexpr = min(ROWS, 8)
    # GROUPS > 1 (ROWS 16): the warp index's low bits on the tile dimension (B5's, of size 1: replicated)
    B5: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2, 4], [1, 8 // G, G, 4, 1], [4, GROUPS, 1, 1, 1], [4, 3, 2, 1, 0])
    B4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2], [1, 8 // G, G, 4], [4, GROUPS, 1, 1], [3, 2, 1, 0])
    if K32:
        if ROWS == 16:
            x = gl.permute(gl.reshape(xt, [4, 2, 2, 2, 8, 2, 2, 2, 2]), [0, 3, 4, 2, 6, 7, 5, 1, 8])
        else:
            x = gl.permute(gl.reshape(xt, [4, 2, 2, ROWS, 2, 2, 2, 2]), [0, 3, 2, 5, 6, 4, 1, 7])
    elif ROWS == 16:
        x = gl.permute(gl.reshape(xt, [4, 2, 2, 2, 8, 2, 2, 4]), [0, 3, 4, 1, 2, 5, 6, 7])
    else:
        x = gl.permute(gl.reshape(xt, [4, 2, 2, ROWS, 2, 2, 4]), [0, 3, 1, 2, 4, 5, 6])
    x = gl.convert_layout(gl.reshape(x, [4, 1, ROWS, 16, 4]), B5)
    low, high = gl.split(gl.reshape(x, [4, 1, ROWS, 16, 2, 2]))  # z % 2 = 0, 1
    x0, x2 = gl.split(low)
    x1, x3 = gl.split(high)
    R: gl.constexpr = 16 * TILES // ROWS
    x0 = gl.convert_layout(gl.reshape(gl.convert_layout(x0, B4).broadcast_to(4, R, ROWS, 16), [4, 16 * TILES, 16]), LW)
    x1 = gl.convert_layout(gl.reshape(gl.convert_layout(x1, B4).broadcast_to(4, R, ROWS, 16), [4, 16 * TILES, 16]), LW)
    x2 = gl.convert_layout(gl.reshape(gl.convert_layout(x2, B4).broadcast_to(4, R, ROWS, 16), [4, 16 * TILES, 16]), LW)
    x3 = gl.convert_layout(gl.reshape(gl.convert_layout(x3, B4).broadcast_to(4, R, ROWS, 16), [4, 16 * TILES, 16]), LW)
    return x0, x1, x2, x3


@gluon.jit
def _k32_words(w32, TILES: gl.constexpr, LW: gl.constexpr):
    """(wl, wh) ``[WARPS, 16 TILES, 16]`` int32 in ``LW`` from the k32 step's weight words ``[WARPS, 16 TILES,
    32]`` (``k32_weight_layouts``): the reshape and permutation are ``W_SPLIT_K32`` / ``W_ORDER_K32``."""
    w = gl.permute(gl.reshape(w32, [4, 16 * TILES, 2, 2, 2, 4]), [0, 1, 3, 5, 4, 2])
    wl, wh = gl.split(gl.reshape(w, [4, 16 * TILES, 16, 2]))
    return gl.convert_layout(wl, LW), gl.convert_layout(wh, LW)


@gluon.jit
def k32_scales(slot, TILES: gl.constexpr, S3: gl.constexpr, LS: gl.constexpr, LW: gl.constexpr):
    """The k32 step's scales ``[WARPS, 16 TILES]`` int64 in ``SliceLayout(2, LW)`` (warp w's 8 e8m0 bytes of each
    row, block J in byte J) from a slot of linear scale rows (``SCALE_ROWS``, ``k32_scale_layout``)."""
    s8 = shared_view(slot, gl.int64, [16 * TILES, 2, 2], S3).permute([1, 2, 0]).load(LS)
    return gl.convert_layout(gl.reshape(s8, [4, 16 * TILES]), gl.SliceLayout(2, LW))


@gluon.jit
def k32_step(acc, wslot, s8, x0, x1, x2, x3, zero, mp0, mp1, m24, m29, TILES: gl.constexpr, ASM: gl.constexpr,
             CONSTRAINTS: gl.constexpr, LW: gl.constexpr, W32: gl.constexpr, L32: gl.constexpr,
             GROUPS: gl.constexpr = 1):
    """One k32 step (MXFP4) on ``acc``: the weight slot's words split (``_k32_words``), the scales ``s8``
    (``k32_scales``) given to every element of their row, the activation operands ``x0 .. x3``."""
    s8 = gl.expand_dims(s8, 2).broadcast_to([4, 16 * TILES, 16])
    wl, wh = _k32_words(shared_view(wslot, gl.int32, [4, 16 * TILES, 32], W32).load(L32), TILES, LW)
    return gl.inline_asm_elementwise(ASM, CONSTRAINTS, [acc, wl, wh, s8, x0, x1, x2, x3, zero + mp0, zero + mp1,
                                                        zero + m24, zero + m29],
                                     dtype=gl.float32, is_pure=True, pack=8 * TILES // GROUPS)


# The consumer's swizzled scale words in registers: NVFP4 ``[WARPS, 16 TILES, 8]`` as the linear slot's 16-bit pairs
# (``SCALE_PAIRS``: lanes c hold pairs c and c + 4 of their warp), MXFP4 ``[WARPS, 16 TILES, 2]`` (both atoms of a row
# in one thread's registers, the lanes c replicated): each warp loads only its own atoms' words, so reaching the
# step's layout moves no data between warps.
SCALE_PAIRS = gl.constexpr(gl.BlockedLayout([1, 1, 1], [1, 8, 4], [4, 1, 1], [2, 1, 0]))
K32_WORDS = gl.constexpr(gl.BlockedLayout([1, 1, 2], [1, 8, 4], [4, 1, 1], [2, 1, 0]))


@functools.lru_cache(maxsize=None)
def scale_word_layout(tiles: int, groups: int, mx: bool = False):
    """The consumer's scale words in registers: NVFP4's 16-bit pairs ``[WARPS, 16 tiles, 8]`` (``SCALE_PAIRS``) or
    MXFP4's atom words ``[WARPS, 16 tiles, 2]`` (``K32_WORDS``) where ``groups`` is 1; else the same lanes and
    registers with the tile index on the warps, as ``_layouts``' weights."""
    if groups == 1:
        return K32_WORDS if mx else SCALE_PAIRS
    lanes = [[0, 0, 0], [0, 0, 0]] if mx else [[0, 0, 1], [0, 0, 2]]
    reg_tiles, warp_tiles = _tile_bases(tiles, groups)
    return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1] if mx else [0, 0, 4], [0, 8, 0]] + reg_tiles,
                                      lane_bases=lanes + [[0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                      warp_bases=warp_tiles + [[1, 0, 0], [2, 0, 0]],
                                      block_bases=[], shape=[WARPS, 16 * tiles, 2 if mx else 8])


@functools.lru_cache(maxsize=None)
def ring_sum_layout(groups: int):
    """The ring sum's register layout of the fp32 ``[WARPS, 16 tiles, 16]`` partials: the four K quarters' partials
    of an element in one thread's registers, over ``WARPS * groups`` warps."""
    return gl.BlockedLayout([4, 1, 4 // groups], [1, 8, 4], [1, 4, groups], [2, 1, 0])


@gluon.jit
def _swizzled_words(sp_ptr, tile, step, K, TILES: gl.constexpr, MX: gl.constexpr, TAIL: gl.constexpr,
                    L: gl.constexpr):
    """The program's scale words of step ``step`` from the swizzled scale bytes (128 x 4 atoms of 512 bytes, 16
    bytes a row r % 32, four 32-row groups q of 4 bytes: word (atom, r) the 4 bytes of group q = (row % 128) // 32),
    loaded by the consumer (not copied through the ring, so that only the group's bytes move).  Warp w's blocks
    are atoms 4 w .. 4 w + 3 (NVFP4: 4 blocks an atom) or 2 w, 2 w + 1 (MXFP4): NVFP4 ``[WARPS, 16 TILES, 8]``
    int32, element (w, r, p) the word holding pair p (atom 4 w + p // 2, half p % 2); MXFP4 ``[WARPS, 16 TILES,
    2]``, element (w, r, a) the word of atom 2 w + a.  ``TAIL`` (K % 1024 != 0): scale columns at or past K's
    (atoms past the row's, and the padding bytes of its last) read as zero, so that the zero-filled weights past K
    meet finite scales.  ``L``: their layout (``scale_word_layout``)."""
    R: gl.constexpr = 16 * TILES
    ATOMS: gl.constexpr = 8 if MX else 16
    BLOCK: gl.constexpr = 32 if MX else 16
    row0 = tile * R
    cols = K // BLOCK
    atoms = (cols + 3) // 4  # a 128-row group's atoms
    # int32 words: an atom is 128, a row r % 32 four, a group one
    base = (row0 // 128) * (atoms * 128) + step * (ATOMS * 128) + (row0 % 32) * 4 + (row0 // 32) % 4
    E: gl.constexpr = 2 if MX else 8
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))[:, None, None]
    r = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))[None, :, None]
    e = gl.arange(0, E, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))[None, None, :]
    atom = 2 * w + e if MX else 4 * w + e // 2
    if TAIL:
        valid = gl.minimum(gl.maximum(cols - 4 * (step * ATOMS + atom), 0), 4)  # the atom's columns before K's end
        words = gl.load(sp_ptr + base + atom * 128 + r * 4, mask=(valid > 0) & (r >= 0), other=0)
        return words & gl.where(valid >= 4, -1, (1 << (8 * gl.minimum(valid, 3))) - 1)
    return gl.load(sp_ptr + base + atom * 128 + r * 4)


@gluon.jit
def _swizzled_scales(words, TILES: gl.constexpr, LW: gl.constexpr, LP: gl.constexpr):
    """The step's scales as 16-bit block pairs ``[WARPS, 16 TILES, 16]`` in ``LW`` (element j: the pair of blocks
    2 (j // 2), 2 (j // 2) + 1) from ``_swizzled_words`` (in ``LP``, ``scale_word_layout``): each pair's half of its
    word, then as the linear slot's pairs are given to both of their elements."""
    p = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LP)))[None, None, :]
    s16 = ((words >> (16 * (p % 2))) & 0xFFFF).to(gl.int16)
    return gl.convert_layout(gl.reshape(gl.join(s16, s16), [4, 16 * TILES, 16]), LW)


@gluon.jit
def _swizzled_scales_k32(words, TILES: gl.constexpr, LW: gl.constexpr):
    """The k32 step's scales ``[WARPS, 16 TILES]`` int64 (warp w's 8 e8m0 bytes of each row, block J in byte J) in
    ``SliceLayout(2, LW)`` from ``_swizzled_words``: atom 2 w's word in bytes 0-3, atom 2 w + 1's in bytes 4-7."""
    lo, hi = gl.split(words)
    s8 = (lo.to(gl.int64) & 0xFFFFFFFF) | (hi.to(gl.int64) << 32)
    return gl.convert_layout(s8, gl.SliceLayout(2, LW))


# The ring sum's view of the first weight slot (fp32 [WARPS, 16 TILES, 16], unswizzled) and the layout it is read
# in: the four warps' partials of an element in one thread's registers.
RED = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))


@gluon.jit
def _store_rows(out_ptr, gsa_ptr, total, tile, M, N, out_stride_m, out_stride_n, TILES: gl.constexpr,
                HAS_GSA: gl.constexpr, LO: gl.constexpr):
    """``total`` ([16 TILES, 16] fp32 in ``LO``, the tile's result before global scales) times the global scale,
    rounded once into ``out``'s rows of row tile ``tile``."""
    if HAS_GSA:
        total = total * gl.load(gsa_ptr)
    r = gl.arange(0, 16 * TILES, layout=gl.SliceLayout(1, LO))[:, None]  # 16 t + 8 h + g
    j = gl.arange(0, 16, layout=gl.SliceLayout(0, LO))[None, :]  # 8 u + 2 c + b
    # Element (t, h, u, b) of lane (g, c) is C[row 8 u + g of tile t][column 8 h + 2 c + b] (_RegisterFold).
    rows = tile * (16 * TILES) + 16 * (r // 16) + 8 * (j // 8) + r % 8
    n = 8 * ((r // 8) % 2) + 2 * ((j // 2) % 4) + j % 2
    gl.store(out_ptr + rows.to(gl.int64) * out_stride_m + n * out_stride_n, total.to(out_ptr.dtype.element_ty),
             mask=(rows < M) & (n < N))


@gluon.jit
def _consumer(wbuf, sbuf, xbuf, ready, empty, out_ptr, gsa_ptr, ws_ptr, count_ptr, sp_ptr, start, end, units,
              programs, M, N, K, n_steps, out_stride_m, out_stride_n, TB, SPB, out_stride_l, mp0, mp1, m24, m29,
              TILES: gl.constexpr,
              STAGES: gl.constexpr, ROWS: gl.constexpr, HAS_GSA: gl.constexpr, FOLD: gl.constexpr,
              ASM: gl.constexpr, CONSTRAINTS: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr, W64: gl.constexpr,
              X64: gl.constexpr, SPLIT: gl.constexpr, SWIZZLED: gl.constexpr, MX: gl.constexpr, S3: gl.constexpr,
              LS: gl.constexpr, W32: gl.constexpr, L32: gl.constexpr, RING_SUM: gl.constexpr, TAIL: gl.constexpr,
              GROUPS: gl.constexpr, LP: gl.constexpr, LR: gl.constexpr, MAXC: gl.constexpr):
    zero = gl.zeros([4, 16 * TILES, 16], gl.int32, LW)
    LO: gl.constexpr = gl.SliceLayout(0, LW)
    r = gl.arange(0, 16 * TILES, layout=gl.SliceLayout(1, LO))[:, None]
    j = gl.arange(0, 16, layout=gl.SliceLayout(0, LO))[None, :]
    part = r * 16 + j  # a partial's elements, [16 TILES, 16] fp32 in LO's order
    first_tile = start // n_steps
    last_tile = (end - 1) // n_steps
    for tile in range(first_tile, last_tile + 1):
        seg0 = gl.maximum(start, tile * n_steps)
        seg1 = gl.minimum(end, tile * n_steps + n_steps)
        # Batch-major tiles (L > 1: one program a tile, no split): the batch's scales and output rows, the tile
        # within it (L = 1: batch 0, bt = tile).
        batch = tile // TB
        bt = tile - batch * TB
        sp_b = sp_ptr + batch.to(gl.int64) * SPB
        out_b = out_ptr + batch.to(gl.int64) * out_stride_l
        acc = gl.zeros([4, 16 * TILES, 16], gl.float32, LW)
        if SWIZZLED:  # the scale words one step ahead of their use: their load's latency under a step
            words_next = _swizzled_words(sp_b, bt, seg0 - tile * n_steps, K, TILES, MX, TAIL, LP)
        for v in range(seg0, seg1):
            i = v - start
            slot = i % STAGES
            if SWIZZLED:
                words = words_next
                ahead = gl.minimum(v + 1, seg1 - 1) - tile * n_steps  # the last step loads its own again
                words_next = _swizzled_words(sp_b, bt, ahead, K, TILES, MX, TAIL, LP)
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            x0, x1, x2, x3 = _x_operands(_as_int64(xbuf.index(slot), 16, ROWS, X64).load(LX), TILES, ROWS, LW, MX,
                                         GROUPS)
            if MX:
                if SWIZZLED:
                    s8 = _swizzled_scales_k32(words, TILES, LW)
                else:
                    s8 = k32_scales(sbuf.index(slot), TILES, S3, LS, LW)
                acc = k32_step(acc, wbuf.index(slot), s8, x0, x1, x2, x3, zero, mp0, mp1, m24, m29, TILES, ASM,
                               CONSTRAINTS, LW, W32, L32, GROUPS)
            else:
                w = _as_int64(wbuf.index(slot), 4, 16 * TILES, W64).load(LW)
                if SWIZZLED:
                    s = _swizzled_scales(words, TILES, LW, LP)
                else:  # each block pair (b = 0, 1) as one 16-bit load, given to both of its elements
                    s16 = shared_view(sbuf.index(slot), gl.int16, [4, 16 * TILES, 8],
                                      gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])).load(LP)
                    s = gl.convert_layout(gl.reshape(gl.join(s16, s16), [4, 16 * TILES, 16]), LW)
                acc = gl.inline_asm_elementwise(ASM, CONSTRAINTS, [acc, w, s, x0, x1, x2, x3, zero + mp0,
                                                                   zero + mp1, zero + m24, zero + m29],
                                                dtype=gl.float32, is_pure=True, pack=8 * TILES // GROUPS)
            # Each thread arrives once its loads are consumed (the asm above used them): no barrier between warps.
            async_copy.mbarrier_arrive(empty.index(slot), increment_count=False)
        if RING_SUM:
            # One tile a program: every copy has landed and the ring is idle, so the warps' partials are summed
            # through its first weight slot (a barrier before the store and one before the load, placed by
            # Triton) and each thread adds its elements' four partials itself -- no scratch buffer, which at N <= 8
            # is what keeps a third program off an SM (docs/performance.md, round 25).
            red = shared_view(wbuf.index(0), gl.float32, [4, 16 * TILES, 16], RED)
            red.store(acc)
            total = gl.sum(red.load(LR), axis=0) * FOLD
            _store_rows(out_b, gsa_ptr, total, bt, M, N, out_stride_m, out_stride_n, TILES, HAS_GSA,
                        gl.SliceLayout(0, LR))
        elif SPLIT and (seg1 - seg0) != n_steps:  # L = 1 only (``Engine.check_config``)
            total = gl.sum(acc, axis=0) * FOLD
            if seg0 == tile * n_steps:
                # The tile's first steps: this program finishes it, its range ending here (``_finish``).
                _finish(out_ptr, gsa_ptr, ws_ptr, count_ptr, total, tile, units, programs, M, N, n_steps,
                        out_stride_m, out_stride_n, part, TILES, HAS_GSA, LO, MAXC)
            else:
                # A contributor (its range began inside this tile, so it is the range's first): its partial and
                # its arrival now, not at the range's end, so that the finisher seldom waits or arrives itself.
                gl.store(ws_ptr + 2 * gl.program_id(0) * (256 * TILES) + part, total)
                thread_barrier()
                arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
                p_first, p_last = _contributors(tile, units, programs, n_steps)
                if arrived == p_last - p_first:  # the finisher arrived before it, and every other contributor
                    _sum_partials(out_ptr, gsa_ptr, ws_ptr, count_ptr, gl.zeros_like(total), tile, p_first,
                                  p_first, p_last, M, N, out_stride_m, out_stride_n, part, TILES, HAS_GSA, LO, MAXC)
        else:
            total = gl.sum(acc, axis=0) * FOLD
            _store_rows(out_b, gsa_ptr, total, bt, M, N, out_stride_m, out_stride_n, TILES, HAS_GSA, LO)


@gluon.jit
def _contributors(tile, units, programs, n_steps):
    """(first, last) program holding units of row tile ``tile`` (``tile_contributors``)."""
    p_first = ((tile * n_steps + 1) * programs + units - 1) // units - 1
    p_last = ((tile * n_steps + n_steps) * programs + units - 1) // units - 1
    return p_first, p_last


@gluon.jit
def _sum_partials(out_ptr, gsa_ptr, ws_ptr, count_ptr, total, tile, q_from, p_first, p_last, M, N, out_stride_m,
                  out_stride_n, part, TILES: gl.constexpr, HAS_GSA: gl.constexpr, LO: gl.constexpr,
                  MAXC: gl.constexpr):
    """``total`` plus the partials of programs ``q_from .. p_last`` of ``tile`` in program order (``q_from`` the
    finisher ``p_first`` with ``total`` zero, or the one after it with ``total`` the finisher's own), their rows
    stored, the tile's counter reset.  Slots: a contributor's partial is its first (2 p), the finisher's its second
    (2 p + 1: a program can contribute to its range's first tile and finish its last).  The loads are unrolled
    over ``MAXC`` (``max_contributors``, masked past ``p_last``) so that their latencies overlap."""
    for c in gl.static_range(MAXC):
        q = q_from + c
        slot = 2 * q + (q == p_first).to(gl.int32)
        total += gl.load(ws_ptr + slot * (256 * TILES) + part, mask=(q <= p_last) & (part >= 0), other=0.0,
                         cache_modifier=".cg")
    _store_rows(out_ptr, gsa_ptr, total, tile, M, N, out_stride_m, out_stride_n, TILES, HAS_GSA, LO)
    gl.store(count_ptr + tile, 0)


@gluon.jit
def _finish(out_ptr, gsa_ptr, ws_ptr, count_ptr, total, tile, units, programs, M, N, n_steps, out_stride_m,
            out_stride_n, part, TILES: gl.constexpr, HAS_GSA: gl.constexpr, LO: gl.constexpr, MAXC: gl.constexpr):
    """The split-K fix-up's finisher: the program holding ``tile``'s first steps, at its range's end, with its own
    partial ``total``.  Where every other contributor has arrived (their arrivals come after their first segment,
    so usually), it adds their partials to its own in program order (the same bits as any other order of arrival
    gives: ``_sum_partials``) -- one acquiring read and one round of loads, no store and no atomic of its own.
    Else it stores its partial and arrives; the last contributor to arrive sums."""
    p_first, p_last = _contributors(tile, units, programs, n_steps)
    others = p_last - p_first
    if gl.atomic_add(count_ptr + tile, 0, sem="acquire", scope="gpu") == others:
        # 0 + its own partial: the bits the other path's sum from zero gives (a -0.0 partial included)
        _sum_partials(out_ptr, gsa_ptr, ws_ptr, count_ptr, gl.zeros_like(total) + total, tile, p_first + 1,
                      p_first, p_last, M, N, out_stride_m, out_stride_n, part, TILES, HAS_GSA, LO, MAXC)
    else:
        gl.store(ws_ptr + (2 * gl.program_id(0) + 1) * (256 * TILES) + part, total)
        thread_barrier()
        if gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == others:
            _sum_partials(out_ptr, gsa_ptr, ws_ptr, count_ptr, gl.zeros_like(total), tile, p_first, p_first,
                          p_last, M, N, out_stride_m, out_stride_n, part, TILES, HAS_GSA, LO, MAXC)


@gluon.jit
def engine_gemv_kernel(w_desc, s_desc, x_desc, out_ptr, gsa_ptr, ws_ptr, count_ptr, sp_ptr, M, N, K, units,
                       out_stride_m, out_stride_n, TB, WB, SB, XB, SPB, out_stride_l, mp0, mp1, m24, m29,
                       TILES: gl.constexpr, STAGES: gl.constexpr,
                       ROWS: gl.constexpr, HAS_GSA: gl.constexpr, FOLD: gl.constexpr, ASM: gl.constexpr,
                       CONSTRAINTS: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr, W64: gl.constexpr,
                       X64: gl.constexpr, PRODUCER_REGS: gl.constexpr, SPLIT: gl.constexpr,
                       SWIZZLED: gl.constexpr, MX: gl.constexpr, S3: gl.constexpr, LS: gl.constexpr,
                       W32: gl.constexpr, L32: gl.constexpr, RING_SUM: gl.constexpr, W2D: gl.constexpr,
                       TAIL: gl.constexpr, GROUPS: gl.constexpr, LP: gl.constexpr, LR: gl.constexpr,
                       MAXC: gl.constexpr, X_PAIRED: gl.constexpr, W_OCTETS: gl.constexpr):
    # Program p runs work units [p units / P, (p + 1) units / P) of the (row tile, step) space, tile-major
    # (``persistent_ranges``); without SPLIT, P is the tile count and each program one tile.
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    n_steps = (K + 1023) // 1024  # the last step's copies past K zero-filled (``TAIL``)
    start = pid * units // programs
    end = (pid + 1) * units // programs
    if W2D:  # a slot holds the four copies of a step [4, rows, 128], as the 3-D copy lays them out
        W3: gl.constexpr = gl.NVMMASharedLayout(128, 8, rank=3)
        wbuf = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 4] + w_desc.block_type.shape, W3)
    else:
        wbuf = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    if SWIZZLED:  # no scale slots: the consumer loads its group's words (``_swizzled_words``)
        sbuf = wbuf
    else:
        sbuf = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)
    xbuf = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    ready, empty = ring_barriers(STAGES, 1, 128 * GROUPS)  # empty: every consumer thread
    gl.warp_specialize([
        (_consumer, (wbuf, sbuf, xbuf, ready, empty, out_ptr, gsa_ptr, ws_ptr, count_ptr, sp_ptr, start, end, units,
                     programs, M, N, K, n_steps, out_stride_m, out_stride_n, TB, SPB, out_stride_l, mp0, mp1, m24,
                     m29, TILES, STAGES,
                     ROWS, HAS_GSA, FOLD, ASM, CONSTRAINTS, LW, LX, W64, X64, SPLIT, SWIZZLED, MX, S3, LS, W32, L32,
                     RING_SUM, TAIL, GROUPS, LP, LR, MAXC)),
        (_producer, (w_desc, s_desc, x_desc, wbuf, sbuf, xbuf, ready, empty, start, end, n_steps, TB, WB, SB, XB,
                     STAGES, 16 * TILES, SWIZZLED, MX, W2D, X_PAIRED, W_OCTETS)),
    ], [1], [PRODUCER_REGS])


# --- the spec ----------------------------------------------------------------------------------------------------


def target_reason(target: Target) -> str | None:
    """Why ``target`` cannot run an engine kernel (bulk tensor copies, warp specialization, inline PTX), or None."""
    if target.mode != "ptx" or target.device_type != "cuda" or target.capability is None \
            or target.capability < (9, 0):
        return f"needs bulk tensor copies and warp specialization (sm_90 or newer, PTX mode; this is " \
               f"{target.describe()})"
    return None


def check_ring_config(config) -> None:
    """ValueError naming ``config`` unless its tiles is 1, 2 or 4, stages from 1 to 8 and maxnreg a multiple of 8
    from 64 to 255 (what ``setmaxnreg`` allocates): the fields every engine configuration has."""
    if config.tiles not in TILES:
        raise ValueError(f"config: expected tiles 1, 2 or 4, got {config}")
    if not isinstance(config.stages, int) or not 1 <= config.stages <= 8:
        raise ValueError(f"config: expected stages from 1 to 8, got {config}")
    if not isinstance(config.maxnreg, int) or not 64 <= config.maxnreg <= 255 or config.maxnreg % 8:
        raise ValueError(f"config: expected maxnreg a multiple of 8 from 64 to 255, got {config}")


class Engine(TritonKernelSpec):
    """NVFP4 or MXFP4 weights (either scale layout), one matrix or a batch, times fp16 or bf16 activations,
    N = 1..16, K a multiple of 64, on sm_90 and newer: the warp-specialized TMA engine (module docstring)."""

    name = "engine"
    config_type = EngineConfig
    code_orders = CODE_ORDERS

    def why_not(self, case: GemvCase, target: Target) -> str | None:
        if target_reason(target) is not None:
            return target_reason(target)
        if case.fp4_activation or case.b.dtype not in (torch.bfloat16, torch.float16):
            return "needs fp16 or bf16 activations"
        if isinstance(batch_rows(case), str):
            return batch_rows(case)
        if case.n > MAX_N:
            return f"needs N <= {MAX_N}, got N = {case.n}"
        if case.k % K_ALIGN:
            return f"needs K a multiple of {K_ALIGN}, got K = {case.k}"
        if case.a.scale_layout == "linear" and case.fmt.name == "nvfp4" and _four_copies(case.k):
            return f"needs K a multiple of {WARP_K} with linear NVFP4 scales (their copy's view), got K = {case.k}"
        # Linear scale rows are copied at every row (scale_align); swizzled atoms are read from 128-row tiles.
        linear_rows_unaligned = case.a.scale_layout == "linear" and case.a.scale_align < 16
        if case.a.align < 16 or case.a.scale_tile_align < 16 or linear_rows_unaligned:
            return "needs the weights' and scales' rows at 16-byte aligned addresses (bulk copies)"
        if case.b.align < 16:
            return "b: needs rows contiguous along K at 16-byte aligned addresses (bulk copies)"
        return None

    def error_model(self, case: GemvCase, config: EngineConfig) -> ErrorModel:
        return ErrorModel(tensor_cores=True, fold=step_fold_exponent(case.fmt.name, step_act(case.b.dtype)))

    def default_config(self, case: GemvCase, target: Target) -> EngineConfig:
        return engine_config(case, target.sm_count)

    def check_config(self, config: EngineConfig, case: GemvCase | None = None) -> None:
        check_ring_config(config)
        if case is not None and case.a.scale_layout == "swizzled" and config.tiles > 2:
            raise ValueError(f"config: swizzled scales take tiles 1 or 2 (a program's rows in one 32-row group of "
                             f"the 128-row atoms), got {config}")
        if not isinstance(config.per_sm, int) or not 0 <= config.per_sm <= 4:
            raise ValueError(f"config: expected per_sm from 0 to 4, got {config}")
        if config.groups not in (1, 2, 4) or config.groups > config.tiles:
            raise ValueError(f"config: expected groups 1, 2 or 4, at most tiles, got {config}")
        if config.per_sm and case is not None and case.batch > 1:
            raise ValueError(f"config: a persistent grid (per_sm > 0) takes one matrix, got {config} at L = "
                             f"{case.batch}")
        if config.groups > 1 and case is not None and case.n <= 8:
            raise ValueError(f"config: groups > 1 takes N > 8 (the 16-row activation slice), got {config} at "
                             f"N = {case.n}")

    def triton_launch(self, case: GemvCase, config: EngineConfig, target: Target) -> TritonLaunch | None:
        """The launch with operand placeholders (descriptors too: ``spec.DescSrc``), kept and launched on addresses
        by ``ops.KeptLaunch``; None on a persistent grid that splits tiles (the fix-up's partials are allocated
        each call: :meth:`launch`)."""
        grid, args, options, split = engine_arguments(case, config, target.sm_count or 132)
        return None if split else TritonLaunch(engine_gemv_kernel, grid, args, options)

    def launch(self, ops: GemvOperands, config: EngineConfig, target: Target) -> None:
        """A persistent grid that splits tiles, through Triton's JIT every call (an option, not the default)."""
        kernel, grid, args, options = engine_launch(ops, config, target.sm_count or 132)
        kernel[grid](*args, **options)


def persistent_ranges(units: int, programs: int) -> list[tuple[int, int]]:
    """The work units ``[start, end)`` of each program of a grid of ``programs`` over ``units`` (row tile, step)
    units, tile-major (unit v: step v % steps of tile v // steps): the kernel's own arithmetic."""
    return [(p * units // programs, (p + 1) * units // programs) for p in range(programs)]


def tile_contributors(tile: int, steps: int, units: int, programs: int) -> tuple[int, int]:
    """(first, last) program whose range holds units of row tile ``tile``: the kernel's fix-up sums their partials
    in this order (program p holds unit v when p units // P <= v < (p + 1) units // P)."""
    first = ((tile * steps + 1) * programs + units - 1) // units - 1
    last = ((tile * steps + steps) * programs + units - 1) // units - 1
    return first, last


def max_contributors(steps: int, units: int, programs: int) -> int:
    """A bound on the programs holding units of one row tile (``tile_contributors``): a tile's ``steps`` units
    span at most ``steps // (units // programs)`` whole ranges and two partial ones.  The finisher's loads are
    unrolled to it (``_sum_partials``)."""
    return steps // max(1, units // programs) + 2


class BatchRows(NamedTuple):
    """Where batch l starts in the descriptors' row dimension (the weights' rows ``l * weights``, linear scales'
    ``l * scales``, the activation's ``l * activation``) and in the swizzled scales' int32 words (``l *
    swizzled_words``): each operand's batch stride in its own rows (0 where broadcast).  L > 1 runs every batch's
    row tiles in one grid, batch-major; a tile's rows past M read the next batch's (or the copy's zeros), which
    no output row takes."""

    weights: int
    scales: int
    activation: int
    swizzled_words: int


def batch_rows(case: GemvCase) -> BatchRows | str:
    """The case's :class:`BatchRows`, or why the engine cannot address its batches (a batch stride that is not a
    whole number of the operand's rows)."""
    if case.batch == 1:
        return BatchRows(case.m, case.m, case.n, 0)
    a, b, scales = case.a, case.b, case.a.scales
    if a.batch_stride % a.row_stride:
        return (f"needs the weights' batch stride a whole number of rows (L = {case.batch}), got "
                f"{a.batch_stride} bytes with rows {a.row_stride} apart")
    if b.strides[0] % b.strides[1]:
        return (f"b: needs its batch stride a whole number of rows (L = {case.batch}), got {b.strides[0]} "
                f"elements with rows {b.strides[1]} apart")
    swizzled = a.scale_layout == "swizzled"
    if (scales.batch % 4) if swizzled else (scales.batch % scales.r32):
        return (f"needs the scales' batch stride a whole number of {'int32 words' if swizzled else 'rows'} (L = "
                f"{case.batch}), got {scales.batch} bytes")
    return BatchRows(a.batch_stride // a.row_stride, 0 if swizzled else scales.batch // scales.r32,
                     b.strides[0] // b.strides[1], scales.batch // 4 if swizzled else 0)


def grid_size(tiles: int, steps: int, config: EngineConfig, sm_count: int) -> tuple[int, bool]:
    """(programs, split): one program per row tile where ``config.per_sm`` is 0, else ``per_sm`` per multiprocessor
    (at most one per unit); ``split`` where a program's range can end inside a tile (the fix-up compiled in)."""
    if config.per_sm == 0:
        return tiles, False
    programs = max(1, min(tiles * steps, config.per_sm * sm_count))
    return programs, tiles % programs != 0


_COUNTERS: dict = {}


def fixup_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counters (one per row tile) for the split-K fix-up, kept per device and stream: each
    launch leaves them zero (the last contributor to a tile resets its counter), so launches ordered on a stream
    share them.  Launches of one device running at the same time on different streams take separate buffers
    (keyed by the stream current at launch, or at capture for a CUDA graph).  A buffer too small for ``tiles`` is
    replaced by a larger one; the old one stays allocated for graphs that captured it."""
    if device.type != "cuda":  # arguments for a compile that runs nothing (the sm_90 compile tests)
        return torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream)
    kept = _COUNTERS.setdefault(key, [])
    if not kept or kept[-1].numel() < tiles:
        kept.append(torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device))
    return kept[-1]


@functools.lru_cache(maxsize=None)
def copy_layout(swizzle: int, bits: int, rank: int):
    """A copy's shared-memory layout, made once (each construction validates itself: host time every call)."""
    return gl.NVMMASharedLayout(swizzle, bits, rank=rank)


def _four_copies(k: int) -> bool:
    """Whether a step's weights come in four 2-D copies of 128 columns: where K % ``WARP_K`` != 0 the rows'
    128-byte chunks (the 3-D view ``[K / WARP_K, M, 128]`` one copy takes) do not tile a row."""
    return k % WARP_K != 0


def _sources(case: GemvCase, config: EngineConfig) -> dict:
    """The launch's tensor arguments as operand placeholders (``spec.Src`` / ``spec.DescSrc``): the weights', scales'
    and activation's bulk-copy descriptors (weights int64 [K/1024, M, 16], linear scales [K/1024, M, 16] bytes or
    MXFP4's [M, K/32]; swizzled scales are loaded by the consumer, their descriptor the weights'), out, the global
    scale (a's scales where none: not read), the fix-up's partials and counters (out where no tile is split: not
    read) and the scale bytes (int32 words where swizzled)."""
    k, n = case.k, case.n
    tiles = config.tiles
    # Rows of each descriptor: every batch's, batch l from l * its batch rows (``batch_rows``; L = 1: M and N).
    rows_of = batch_rows(case)
    m = (case.batch - 1) * rows_of.weights + case.m
    m_s = (case.batch - 1) * rows_of.scales + case.m
    n_x = (case.batch - 1) * rows_of.activation + n
    # Descriptors of 8- and 16-bit elements (Triton 3.9 takes no wider ones); the kernel views the bytes as int64.
    if _four_copies(k):  # [M, K/2] bytes, four copies of [16 tiles rows, 128] a step
        w = DescSrc("a_data", torch.uint8, (m, k // 2), (case.a.row_stride, 1), (16 * tiles, 128),
                    copy_layout(128, 8, 2))
    elif octet_rows(case):  # rows in octets, row bit 0 above bits 1-2 (``w_slot_bases``)
        rs = case.a.row_stride
        w = DescSrc("a_data", torch.uint8, (k // WARP_K, m // 8, 2, 4, 128), (128, 8 * rs, rs, 2 * rs, 1),
                    (WARPS, 2 * tiles, 2, 4, 128), copy_layout(128, 8, 5))
    else:
        w = DescSrc("a_data", torch.uint8, (k // WARP_K, m, 128), (128, case.a.row_stride, 1),
                    (WARPS, 16 * tiles, 128), copy_layout(128, 8, 3))
    swizzled = case.a.scale_layout == "swizzled"
    if swizzled:
        s = w  # not copied
    elif case.fmt.name == "mxfp4":  # [M, K/32] e8m0 bytes, a copy of 16 tiles rows and the step's 32 bytes
        s = DescSrc("a_scales", torch.uint8, (m_s, k // 32), (case.a.scales.r32, 1), (16 * tiles, 32),
                    copy_layout(0, 8, 2))
    else:
        s = DescSrc("a_scales", torch.uint8, (k // WARP_K, m_s, 16), (16, case.a.scales.r32, 1),
                    (WARPS, 16 * tiles, 16), copy_layout(0, 8, 3))
    rows = activation_rows(n)
    if paired_lines(k, rows):  # a 128-element chunk's halves on adjacent lines (``x_slot_bases``)
        x = DescSrc("b_data", case.b.dtype, (k // 128, n_x, 2, 64), (128, case.b.strides[1], 64, 1),
                    (2 * WARPS, rows, 2, 64), copy_layout(128, 16, 4))
    else:
        x = DescSrc("b_data", case.b.dtype, (k // 64, n_x, 64), (64, case.b.strides[1], 1), (4 * WARPS, rows, 64),
                    copy_layout(_x_swizzle(rows), 16, 3))
    out = Src("out", case.out_dtype)
    gsa, _ = global_scale_sources(case)
    return dict(w_desc=w, s_desc=s, x_desc=x, out_ptr=out, gsa_ptr=gsa, ws_ptr=out, count_ptr=out,
                sp_ptr=Src("a_scales", torch.int32 if swizzled else torch.uint8))


def engine_arguments(case: GemvCase, config: EngineConfig, sm_count: int = 132) -> tuple[tuple, dict, dict, bool]:
    """(grid, arguments by name with operand placeholders, options, split) of the engine's launch for ``case``:
    ``split`` where a persistent grid splits tiles (then the call's fix-up partials and counters replace the
    placeholders, ``engine_launch``)."""
    m, k, n = case.m, case.k, case.n
    rows = activation_rows(n)
    mx = case.fmt.name == "mxfp4"
    order = case.a.code_order
    scale_bits = 8 if mx else 16  # NVFP4's scales reach the step as 16-bit block pairs
    act = step_act(case.b.dtype)
    asm, constraints = step_asm(config.tiles // config.groups, 2 if n > 8 else 1, case.fmt.name, order, scale_bits, act)
    lw, lx, w64, x64 = _layouts(config.tiles, rows, mx, config.groups)
    w32, l32 = k32_weight_layouts(config.tiles, config.groups)
    per_batch, steps = -(-m // (16 * config.tiles)), -(-k // STEP_K)
    tiles = case.batch * per_batch  # batch-major
    programs, split = grid_size(tiles, steps, config, sm_count)
    rows_of = batch_rows(case)
    args = dict(_sources(case, config), M=m, N=n, K=k, units=tiles * steps,
                out_stride_m=case.out_strides[1], out_stride_n=case.out_strides[2], TB=per_batch,
                WB=rows_of.weights, SB=rows_of.scales, XB=rows_of.activation, SPB=rows_of.swizzled_words,
                out_stride_l=case.out_strides[0], **multipliers(act, order))
    options = dict(TILES=config.tiles, STAGES=config.stages, ROWS=rows, HAS_GSA=case.a.has_global_scale,
                   FOLD=2.0 ** step_fold_exponent(case.fmt.name, act), ASM=asm, CONSTRAINTS=constraints, LW=lw, LX=lx,
                   W64=w_slot_layout(config.tiles) if octet_rows(case) else w64,
                   X64=x_slot_layout(rows) if paired_lines(k, rows) else x64, PRODUCER_REGS=PRODUCER_REGS,
                   SPLIT=split, X_PAIRED=paired_lines(k, rows), W_OCTETS=octet_rows(case),
                   SWIZZLED=case.a.scale_layout == "swizzled", MX=mx, S3=SCALE_ROWS,
                   LS=k32_scale_layout(config.tiles, config.groups), W32=w32, L32=l32, RING_SUM=programs == tiles,
                   W2D=_four_copies(k), TAIL=k % STEP_K != 0, GROUPS=config.groups,
                   LP=scale_word_layout(config.tiles, config.groups, mx), LR=ring_sum_layout(config.groups),
                   MAXC=max_contributors(steps, tiles * steps, programs) if split else 1,
                   num_warps=WARPS * config.groups, maxnreg=config.maxnreg)
    return (programs,), args, options, split


def engine_launch(ops: GemvOperands, config: EngineConfig, sm_count: int = 132):
    """(kernel, grid, positional arguments, keyword arguments) of one call on ``ops``: the placeholders filled from
    its tensors, and on a persistent grid that splits tiles the fix-up's partials (fp32, two slots a program) and
    counters."""
    grid, args, options, split = engine_arguments(ops.case, config, sm_count)
    args = fill_sources(args, ops)
    if split:
        tiles = -(-ops.case.m // (16 * config.tiles))  # L = 1 (``Engine.check_config``)
        args["ws_ptr"] = torch.empty(grid[0] * 2 * 256 * config.tiles, dtype=torch.float32, device=ops.out.device)
        args["count_ptr"] = fixup_counters(ops.out.device, tiles)
    return engine_gemv_kernel, grid, tuple(args.values()), options


# --- the twin: the kernel's index maps replayed in torch -----------------------------------------------------------


def swizzled_scales_twin(swizzled: torch.Tensor, m: int, k: int, tile: int, step: int, tiles: int,
                         fmt: str = "nvfp4") -> torch.Tensor:
    """What ``_swizzled_scales`` (NVFP4: the 16-bit block pairs ``[WARPS, 16 tiles, 16]``, element j holding blocks
    2 (j // 2) and 2 (j // 2) + 1 of warp w's 16, as int64) or ``_swizzled_scales_k32`` (MXFP4: int64 ``[WARPS, 16
    tiles]``) hold for row tile ``tile`` and step ``step``, from the swizzled scale bytes ``[R_p * C_p]``: the
    consumer's word addresses (``_swizzled_words``' arithmetic on the bytes as int32), then its rearrangement,
    replayed in torch (the joins and the int64 assembly included), the columns at or past K's zero (``TAIL``).
    Equal to what the linear slot gives when the maps are right (``tests/test_kernels_engine.py``)."""
    rows, mx = 16 * tiles, fmt == "mxfp4"
    per_step = 8 if mx else 16
    cols = k // (32 if mx else 16)
    atoms = -(-cols // 4)
    flat = swizzled.contiguous().view(torch.uint8).reshape(-1, 4).to(torch.int64)
    words32 = (flat << (8 * torch.arange(4))).sum(-1)  # the bytes as little-endian int32 words (unsigned, in int64)
    row0 = tile * rows
    base = (row0 // 128) * (atoms * 128) + step * (per_step * 128) + (row0 % 32) * 4 + (row0 // 32) % 4
    w = torch.arange(4)[:, None, None]
    r = torch.arange(rows)[None, :, None]
    e = torch.arange(2 if mx else 8)[None, None, :]
    atom = 2 * w + e if mx else 4 * w + e // 2
    valid = (cols - 4 * (step * per_step + atom)).clamp(0, 4)
    index = torch.where(valid > 0, base + atom * 128 + r * 4, 0)  # the masked loads read nothing
    keep = torch.where(valid >= 4, 0xFFFFFFFF, (1 << (8 * valid.clamp(max=3))) - 1)
    words = torch.where(valid > 0, words32[index], 0) & keep  # _swizzled_words: [4, R, 2] (MXFP4) or [4, R, 8]
    if mx:
        return (words[..., 0] & 0xFFFFFFFF) | (words[..., 1] << 32)
    s16 = (words >> (16 * (e % 2))) & 0xFFFF  # pair p: half p % 2 of its word
    return torch.stack([s16, s16], -1).reshape(4, rows, 16)  # each pair given to both of its elements


def engine_twin(a_data: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, tiles: int = 2,
                fmt: str = "nvfp4") -> torch.Tensor:
    """The engine's result ``[M, N]`` in float64 (before global scales), computed through its operand maps.

    ``a_data`` uint8 ``[M, K/2]``, ``a_scales`` the scale bytes ``[M, K/block]`` (linear: e4m3 for ``fmt``
    "nvfp4", e8m0 for "mxfp4"), ``b`` bf16 ``[N, K]``.  Per step: the weight slice ``[WARPS, 16 tiles, 16]`` (warp,
    row, block) and the activation slice, reshaped and permuted with the kernel's ``X_SPLIT`` / ``X_ORDER`` into the
    per-element x0 .. x3; each mma C element is then the sum, over the four lanes c and the asm's elements, of the
    products the kernel pairs: A from the element's own row and block, B from the lane whose g is the C column's
    (its activation row g + 8 h, n-tile h).  MXFP4 (the k32 step): the row's words through ``W_SPLIT_K32`` /
    ``W_ORDER_K32``, the activation through ``X_SPLIT_K32`` / ``X_ORDER_K32``, each word times the scale of block
    ``k32_block``.  A wrong index map gives a wrong result (the test checks it against the exact oracle).  K past
    its last multiple of 1024: the last step's weights and activation past K are zero, as the copies fill them."""
    m, k = a_data.shape[0], 2 * a_data.shape[1]
    k_p = -(-k // STEP_K) * STEP_K
    n = b.shape[0]
    k32 = fmt == "mxfp4"
    rows = activation_rows(n)
    split, order = _x_split(rows, k32)
    rows_p = -(-m // (16 * tiles)) * 16 * tiles
    w = decode_e2m1(unpack_e2m1(a_data)).double()
    if not k32:
        w = w * decode_e4m3(a_scales).double().repeat_interleave(16, 1)
    w = torch.nn.functional.pad(w, (0, k_p - k, 0, rows_p - m))
    sc = torch.nn.functional.pad(decode_e8m0(a_scales).double(), (0, (k_p - k) // 32, 0, rows_p - m)) if k32 else None
    x = torch.nn.functional.pad(b.double(), (0, k_p - k, 0, rows - n))
    out = torch.zeros(rows_p, 16, dtype=torch.float64)
    # k32: element j = 8 u + 2 c + b of a row's operands holds block k32_block(half, u, b)
    j = torch.arange(16)
    blocks = torch.stack([k32_block(h, j // 8, j % 2) for h in range(2)], dim=1)  # [j, half]
    for step in range(k_p // STEP_K):
        ks = slice(step * STEP_K, (step + 1) * STEP_K)
        # Activation slice as the copy lays it out: [4 WARPS, rows, 16 int64] of 4 elements each -> [..., 4 elements]
        xt = x[:, ks].reshape(rows, 4 * WARPS, 16, 4).permute(1, 0, 2, 3)
        xo = xt.reshape(*split, 4).permute(*order, len(order)).reshape(WARPS, rows, 16, 4, 4)  # [w, row, j, z, e]
        xo = xo.reshape(WARPS, rows, 16, 16)  # fold: element 4 z + e of block j; k32: (half, 8 codes) of j
        for p in range(rows_p // (16 * tiles)):
            rs = slice(p * 16 * tiles, (p + 1) * 16 * tiles)
            if k32:
                # a row's 32 words [half, u, b, c] of 8 codes, permuted into [(u, c, b), half]
                wd = w[rs, ks].reshape(16 * tiles, WARPS, *W_SPLIT_K32, 8)
                ws = wd.permute(1, 0, *[2 + o for o in W_ORDER_K32], 6).reshape(WARPS, 16 * tiles, 16, 2, 8)
                block_scales = sc[rs, step * 32:(step + 1) * 32].reshape(16 * tiles, WARPS, 8).permute(1, 0, 2)
                ws = ws * block_scales[:, :, blocks][..., None]  # [w, r, j, half, code]
                ws = ws.reshape(WARPS, 16 * tiles, 16, 16)
            else:
                ws = w[rs, ks].reshape(16 * tiles, WARPS, 16, 16).permute(1, 0, 2, 3)
            # A[w, r, j, e] times B from lane g = column % 8 of n-tile column // 8 (row g + 8 h of the slice)
            for col in range(n):
                src = (col % 8) % rows + (8 * (col // 8) if rows == 16 else 0)
                out[rs, col] += (ws * xo[:, src][:, None]).sum(dim=(0, 2, 3))
    return out[:m, :n]
