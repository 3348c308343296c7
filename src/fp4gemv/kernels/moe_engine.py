"""The routed expert GEMV on the decode engine (issues 26 and 27): ``out[t, j] = W[ids[t, j]] @ x[t]`` with every
product through the engine's consumer step (``kernels/engine.py``: the same PTX and operand layouts).

Two launches per call:

* **Chunks** (``moe_chunks_kernel``, one Triton program): the ``T * k`` pairs sorted by expert (a bitonic sort of
  ``expert * P_PAD + pair``) and cut into *chunks* of at most ``rows`` pairs of one expert (an expert with more pairs
  gets several chunks, which re-read its rows from L2); ids outside ``[0, E)`` share one chunk list of their own
  (expert ``E``).  It writes a small int32 *plan* (``plan_layout``): the chunk count, each chunk's expert, first
  sorted position and pair count, and the sorted pairs.
* **The engine** (``moe_engine_kernel``, Gluon, warp-specialized, persistent): work items are (chunk, row tile),
  chunk-major, so CTAs side by side share an expert and its activation rows.  Each CTA takes items ``pid, pid +
  nprog, ...``; its producer warp streams each item's K steps by bulk tensor copies into the mbarrier ring: the
  expert's ``16 * tiles`` weight rows (one copy of ``[4, 16 tiles, 128 B]`` where the tile's rows are contiguous and
  K a multiple of 256, else 8 copies of ``[8 tiles, 128 B]``: one per warp chunk and row half; K tails and rows past
  the last expert read as zeros), their scale bytes (two copies of ``[8 tiles, 64 B]`` where the scales are linear
  with rows at 16-byte aligned addresses: ``scale_copy_reason``) and the chunk's activation rows, gathered one copy
  of ``[16, 64]`` elements per row (pair ``p`` reads ``x[p // k]``; rows past the chunk's count are not copied --
  one plain arrival each on the slot's barrier -- and their columns, whatever the slot held, are never stored).
  The four consumer warps run the engine's step (NVFP4: ``engine._RegisterFold``, the e4m3 scale folded into the
  weight fragments; MXFP4: ``engine._RegisterK32``, each 32-element block's two mma into an fp32 partial that its
  e8m0 scale multiplies) -- NVFP4 scale bytes that cannot be copied are loaded from global memory two steps ahead
  (any layout, any alignment, ``spec.ScaleAddressing``; MXFP4's come only by copy, ``[16 tiles, 32 B]`` a step) --
  and at each item's end exchange their accumulators through shared memory once (``_warp_sums``: each thread
  then sums the four warps' values of its own outputs), apply the global scale, the bias, the activation and the
  pair weight in fp32, and round once into ``out[t, j]``.

Activation rows: the slot holds ``[rows, 16, 64]`` elements (row-major, one copy per row); the consumer permutes it
into the engine's ``[16, rows, 64]`` order (``engine._layouts``' activation layout with its first two coordinates
swapped, so the permutation moves no data).

Gate and up (``activation``): a tile's two row halves are its weight copies' two halves -- the ``8 tiles`` rows
from ``16 tiles * tile`` and the next ``8 tiles`` (gpt-oss: gate and up interleaved, pair i in rows 2i, 2i + 1), or
rows ``8 tiles * tile`` of the gate half and the same rows of the up half (silu: halves ``M / 2`` apart) -- so each
tile yields ``8 tiles`` activated rows.

Exactness: the engine's (exact products, one fp32 accumulation per warp, the warps' sums in fp32), then the
epilogue in fp32 and one rounding.  An id outside ``[0, E)`` (unchecked: CUDA graphs, ``torch.compile``) reads no
weights (rows past the last expert are zeros) and writes zeros.

Measured (docs/performance.md, rounds 15-17): with the scale copies and the one-trip epilogue, 1.15-1.3x faster
than ``moe_weight_only`` from T = 4 rows of x where K takes more than one step (gpt-oss and Qwen3 gate_up, gpt-oss
down; NVFP4 and gpt-oss's MXFP4 alike, 0.47-0.50 of the read), slower at T = 1-2 and K <= 1024
(``moe_engine_deferred``, the default's rule in ``kernels.DEFERRALS``).
Host: the first call of a (case, configuration) goes through Triton's JIT; later ones launch the kept compiled
kernels (``MoeEngine.launch``), 127 us per eager call on the H200's host against moe_weight_only's 49.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..target import SM90, Target
from ._gluon import TensorDescriptor, async_copy, gl, gluon, mbarrier, ring_barriers, shared_view, tma_load
from ._mma_step import multipliers
from .engine import (SCALE_ROWS as _SCALE_ROWS, STEP_K, STEPS, WARPS, _as_int64, _layouts, _x_operands,
                     check_ring_config, copy_layout, k32_scale_layout as _k32_scale_layout, k32_scales, k32_step,
                     k32_weight_layouts, step_asm, step_fold_exponent, target_reason)
from .moe_weight_only import ACTIVATION_CODES
from .spec import (DIRECT_LAUNCH, NATIVE_FIELD_ORDERS, ErrorModel, MoeCase, MoeOperands, Src, TritonKernelSpec,
                   TritonLaunch, bound_arguments, fill_sources, run_compiled)

__all__ = ["MoeEngine", "MoeEngineConfig", "MIN_TOKENS", "MXFP4_MIN_PAIRS", "scale_copy_reason", "one_box_reason",
           "moe_engine_deferred", "moe_engine_config", "plan_layout", "moe_chunks_kernel",
           "moe_engine_kernel", "chunk_plan", "MAX_PAIRS", "MAX_EXPERTS"]

# The default runs it from T = 4 rows of x, where K takes more than one step (``moe_engine_deferred``,
# ``kernels.DEFERRALS``; docs/performance.md, round 16), and MXFP4 experts from 16 pairs: gpt-oss's down (one pair
# per row of x) took 16.2 us against moe_weight_only's 14.0 at 4 pairs (T = 1), about level at 8, 31.7 against 38.1
# at 16 (round 17).
MIN_TOKENS = 4
NVFP4_FOUR_TILES = 8  # NVFP4 experts run 4 tiles from this many tokens (moe_engine_config)
MXFP4_MIN_PAIRS = 16
# Pairs per call: the chunk launch sorts them in one program.
MAX_PAIRS = 256
# Experts per call: a histogram bin each, plus one for ids outside [0, E).
MAX_EXPERTS = 1023
# The producer warp's registers: it keeps a chunk's activation row indices (up to 16) through the item's steps;
# at 56 with 8 rows Triton 3.9's allocation spills (48 under 3.6) (sm_90 compile, tests/test_kernels_moe_engine.py).
PRODUCER_REGS = 64
# The scale slot ([16 TILES rows, 64 bytes], unswizzled) viewed as [rows, 4 warp chunks, 16 bytes]; MXFP4's ([16
# TILES rows, 32 bytes]) as [rows, 2, 2] int64 (warp w's 8 blocks at [w // 2, w % 2]).  Views of unswizzled slots
# keep 16-byte last dimensions: an unswizzled NVMMA layout with wider rows is not row-major (it tiles 16-byte
# columns), while the bulk copy writes the box row-major.
_SCALE_VIEW = gl.constexpr(gl.NVMMASharedLayout(0, 8, rank=3))
# The epilogue's loads of the four warps' accumulators (each thread holds all four of its outputs): [warp, row,
# column] for plain products, [warp, pair row, column, gate or up] with an activation; and the outputs' layouts.
_SUM_ROWS = gl.BlockedLayout([4, 1, 1], [1, 8, 4], [1, 4, 1], [0, 2, 1])
_SUM_PAIRS = gl.BlockedLayout([4, 1, 1, 2], [1, 4, 8, 1], [1, 4, 1, 1], [3, 0, 2, 1])
_PAIR_OUT = gl.SliceLayout(2, gl.SliceLayout(0, _SUM_PAIRS))


class MoeEngineConfig(NamedTuple):
    """``tiles``: m16 tiles per item (16 * tiles weight rows); ``stages``: ring slots; ``rows``: activation rows per
    chunk (a power of two up to 16: pairs of one expert per pass); ``ctas_per_sm``: the persistent grid's CTAs per
    SM (0: one item per CTA, a grid of every possible item); ``maxnreg``: registers per thread; ``scale_copy``: the
    scale bytes through the ring by bulk copy where the scales allow it (``scale_copy_reason``), else loaded from
    global memory; ``one_box``: a step's weights as one bulk copy where the tile's rows are contiguous (no SiLU
    halves), else eight."""

    tiles: int = 2
    stages: int = 3
    rows: int = 8
    ctas_per_sm: int = 2
    maxnreg: int = 128
    scale_copy: bool = True
    one_box: bool = True


def moe_engine_config(case: MoeCase, target: Target) -> MoeEngineConfig:
    """2 tiles, 2 CTAs per SM, 3 ring slots; rows: the tokens (x's rows) as a power of two, at most 8 (one n-tile;
    rows past a chunk's pairs are not copied, so the spare ones cost shared memory only, and an expert with more
    than 8 pairs -- more than 8 tokens on one expert -- takes a second pass); 128 registers: a CTA is 8 warps (the
    four consumers, the producer and three idle), so 2 CTAs fit an SM's 64K registers at 128, 1 at 168 (ncu, H200);
    the consumers get 192 of them (``setmaxnreg``: the idle warps drop to 24).

    MXFP4 from ``MIN_TOKENS``: 4 tiles, 2 slots and chunks of at most 4 pairs, measured on gpt-oss-20b's routed
    GEMVs 124.3 / 162.2 us at T = 8 / 16 against 133.7 / 173.3 for the above, the best of 15 configurations
    (docs/performance.md, round 17; a chunk's activation rows are copied and permuted every step, so fewer rows
    per chunk cost less than the second pass of an expert with more than 4 pairs).  NVFP4 the same from
    ``NVFP4_FOUR_TILES`` tokens: Qwen3-30B-A3B's routed GEMVs 74.1 / 110.6 us at T = 8 / 16 against 78.6 / 119.7,
    gpt-oss-20b's shapes in NVFP4 131.5 / 170.4 against 138.9 / 179.9; at T = 4 level (51.6 against 51.9, 90.1
    against 88.1; round 18)."""
    tokens = 1 << (max(case.tokens, 1) - 1).bit_length()
    if case.tokens >= (MIN_TOKENS if case.dense.fmt.name == "mxfp4" else NVFP4_FOUR_TILES):
        return MoeEngineConfig(4, 2, min(4, tokens), 2, 128)
    return MoeEngineConfig(2, 3, min(8, tokens), 2, 128)


def plan_layout(pairs: int, experts: int) -> dict[str, int]:
    """Offsets (int32 elements) of the plan's parts and its size: ``count`` (chunks), ``expert``, ``start``,
    ``pairs_in`` (per chunk, ``pad`` each), ``sorted`` (the pairs by expert), and the chunk launch's scratch."""
    pad = max(16, triton.next_power_of_2(pairs))
    bins = triton.next_power_of_2(experts + 1)
    offsets = dict(count=0, expert=1, start=1 + pad, pairs_in=1 + 2 * pad, sorted=1 + 3 * pad, mark=1 + 4 * pad,
                   bin_start=1 + 5 * pad, bin_count=1 + 5 * pad + bins, bin_first=1 + 5 * pad + 2 * bins)
    offsets["size"] = 1 + 5 * pad + 3 * bins
    offsets["pad"], offsets["bins"] = pad, bins
    return offsets


# --- the chunk launch ---------------------------------------------------------------------------------------


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def moe_chunks_kernel(ids_ptr, plan_ptr, P, TOP_K, E, ids_stride_t, ids_stride_j, ROWS: tl.constexpr,
                      P_PAD: tl.constexpr, BINS: tl.constexpr, EXPERT: tl.constexpr, START: tl.constexpr,
                      PAIRS_IN: tl.constexpr, SORTED: tl.constexpr, MARK: tl.constexpr, BIN_START: tl.constexpr,
                      BIN_COUNT: tl.constexpr, BIN_FIRST: tl.constexpr):
    pairs = tl.arange(0, P_PAD)
    ok = pairs < P
    ids = tl.load(ids_ptr + (pairs // TOP_K) * ids_stride_t + (pairs % TOP_K) * ids_stride_j, mask=ok, other=0)
    key = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)  # bad ids share bin E
    counts = tl.histogram(key, BINS, mask=ok)
    bins = tl.arange(0, BINS)
    chunks = (counts + ROWS - 1) // ROWS
    first = tl.cumsum(chunks, axis=0) - chunks
    # The pairs in expert order, by pair index within an expert (each sort key is unique).
    order = tl.sort(tl.where(ok, key, BINS) * P_PAD + pairs)
    tl.store(plan_ptr + SORTED + pairs, order % P_PAD, mask=ok)
    # Chunk c belongs to the last bin whose first chunk is at or before c: marks, then a running maximum.
    tl.store(plan_ptr + MARK + pairs, -1)
    tl.store(plan_ptr + BIN_START + bins, tl.cumsum(counts, axis=0) - counts)
    tl.store(plan_ptr + BIN_COUNT + bins, counts)
    tl.store(plan_ptr + BIN_FIRST + bins, first)
    tl.debug_barrier()
    tl.store(plan_ptr + MARK + first, bins, mask=chunks > 0)
    tl.debug_barrier()
    owner = tl.associative_scan(tl.load(plan_ptr + MARK + pairs), 0, _max_combine)
    n_chunks = tl.sum(chunks, axis=0)
    live = pairs < n_chunks
    owner = tl.where(live, owner, 0)
    q = pairs - tl.load(plan_ptr + BIN_FIRST + owner)
    tl.store(plan_ptr + EXPERT + pairs, owner, mask=live)
    tl.store(plan_ptr + START + pairs, tl.load(plan_ptr + BIN_START + owner) + q * ROWS, mask=live)
    tl.store(plan_ptr + PAIRS_IN + pairs, tl.minimum(tl.load(plan_ptr + BIN_COUNT + owner) - q * ROWS, ROWS),
             mask=live)
    tl.store(plan_ptr, n_chunks)


def chunk_launch(case: MoeCase, rows: int) -> TritonLaunch:
    """The chunk launch of ``case`` (its plan's layout ``plan_layout``) for ``rows`` pairs per chunk."""
    lay = plan_layout(case.pairs, case.experts)
    args = dict(ids_ptr=Src("expert_ids", case.ids_dtype), plan_ptr=None, P=case.pairs, TOP_K=case.top_k,
                E=case.experts, ids_stride_t=case.ids_strides[0], ids_stride_j=case.ids_strides[1], ROWS=rows,
                P_PAD=lay["pad"], BINS=lay["bins"], EXPERT=lay["expert"], START=lay["start"],
                PAIRS_IN=lay["pairs_in"], SORTED=lay["sorted"], MARK=lay["mark"], BIN_START=lay["bin_start"],
                BIN_COUNT=lay["bin_count"], BIN_FIRST=lay["bin_first"])
    return TritonLaunch(moe_chunks_kernel, (1,), args, dict(num_warps=4))


def chunk_plan(expert_ids: torch.Tensor, experts: int, rows: int) -> torch.Tensor:
    """The plan (int32, ``plan_layout``) of ``expert_ids`` ``[T, k]``, in torch: what the chunk launch writes, for
    the tests (scratch parts left zero)."""
    tokens, top_k = expert_ids.shape
    pairs = tokens * top_k
    lay = plan_layout(pairs, experts)
    plan = torch.zeros(lay["size"], dtype=torch.int32)
    ids = expert_ids.reshape(-1).long().cpu()
    key = torch.where((ids >= 0) & (ids < experts), ids, experts)
    order = torch.argsort(key * lay["pad"] + torch.arange(pairs))
    plan[lay["sorted"]:lay["sorted"] + pairs] = order.int()
    c, pos = 0, 0
    for e in range(experts + 1):
        n = int((key == e).sum())
        for q in range(-(-n // rows)):
            plan[lay["expert"] + c], plan[lay["start"] + c] = e, pos + q * rows
            plan[lay["pairs_in"] + c] = min(rows, n - q * rows)
            c += 1
        pos += n
    plan[0] = c
    return plan


# --- the engine ---------------------------------------------------------------------------------------------------


@gluon.jit
def _chunk(plan_ptr, item, ROW_TILES: gl.constexpr, EXPERT: gl.constexpr, START: gl.constexpr, PAIRS_IN: gl.constexpr):
    """(row tile, expert, first sorted position, pairs) of work item ``item``."""
    c = item // ROW_TILES
    return (item - c * ROW_TILES, gl.load(plan_ptr + EXPERT + c), gl.load(plan_ptr + START + c),
            gl.load(plan_ptr + PAIRS_IN + c))


@gluon.jit
def _row_bases(tile, HALF, TILES: gl.constexpr, SILU: gl.constexpr):
    """The first weight rows (within the expert) of the tile's two row halves."""
    if SILU:
        base0 = tile * (8 * TILES)
        base1 = base0 + HALF
    else:
        base0 = tile * (16 * TILES)
        base1 = base0 + 8 * TILES
    return base0, base1


@gluon.jit
def _producer(w_desc, s_desc, x_desc, plan_ptr, wbuf, sbuf, xbuf, ready, empty, M, HALF, E, n_steps,
              ROW_TILES: gl.constexpr, TOP_K: gl.constexpr, TILES: gl.constexpr, STAGES: gl.constexpr,
              ROWS: gl.constexpr, SILU: gl.constexpr, SCALE_COPY: gl.constexpr, ONE_BOX: gl.constexpr,
              SCALE_STEP: gl.constexpr, EXPERT: gl.constexpr, START: gl.constexpr, PAIRS_IN: gl.constexpr,
              SORTED: gl.constexpr):
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_items = gl.load(plan_ptr) * ROW_TILES
    W_BYTES: gl.constexpr = 64 * TILES * 128
    S_BYTES: gl.constexpr = 16 * TILES * SCALE_STEP if SCALE_COPY else 0
    f = 0
    for item in range(pid, n_items, nprog):
        tile, expert, start, count = _chunk(plan_ptr, item, ROW_TILES, EXPERT, START, PAIRS_IN)
        base0, base1 = _row_bases(tile, HALF, TILES, SILU)
        first_row = gl.minimum(expert, E) * M  # expert E (bad ids): rows past the last expert, read as zeros
        xrows = ()
        for r in gl.static_range(ROWS):
            xrows = xrows + (gl.load(plan_ptr + SORTED + start + gl.minimum(count - 1, r)) // TOP_K,)
        for i in range(n_steps):
            slot = f % STAGES
            bar = ready.index(slot)
            mbarrier.wait(empty.index(slot), ((f // STAGES) & 1) ^ 1)
            mbarrier.expect(bar, W_BYTES + S_BYTES)
            wslot = wbuf.index(slot)
            if ONE_BOX:  # [4 warp chunks, 16 TILES rows, 128 B]
                tma_load(w_desc, [4 * i, first_row + base0, 0], bar, wslot)
            else:
                for q in gl.static_range(4):
                    tma_load(w_desc, [first_row + base0, (4 * i + q) * 128], bar,
                             wslot.slice(2 * q * (8 * TILES), 8 * TILES))
                    tma_load(w_desc, [first_row + base1, (4 * i + q) * 128], bar,
                             wslot.slice((2 * q + 1) * (8 * TILES), 8 * TILES))
            if SCALE_COPY:  # [16 TILES rows, SCALE_STEP bytes]: the two row halves
                sslot = sbuf.index(slot)
                tma_load(s_desc, [first_row + base0, SCALE_STEP * i], bar, sslot.slice(0, 8 * TILES))
                tma_load(s_desc, [first_row + base1, SCALE_STEP * i], bar, sslot.slice(8 * TILES, 8 * TILES))
            # One arrival per activation row (the barrier counts 1 + ROWS): rows past the chunk's pairs are not
            # copied (their columns are never stored).
            xslot = xbuf.index(slot)
            for r in gl.static_range(ROWS):
                mbarrier.expect(bar, x_desc.block_type.nbytes, pred=r < count)
                tma_load(x_desc, [xrows[r], 16 * i, 0], bar, xslot.slice(r, 1), pred=r < count)
                mbarrier.arrive(bar, pred=r >= count)
            f += 1


@gluon.jit
def _scale_bytes(sf_ptr, plan_ptr, f, n_steps, n_items, ROW_TILES: gl.constexpr, M, HALF, E, K, sf_e, sf_row_tile,
                 sf_r32, sf_r4, sf_col_tile, TILES: gl.constexpr, SILU: gl.constexpr, LW: gl.constexpr,
                 EXPERT: gl.constexpr, START: gl.constexpr, PAIRS_IN: gl.constexpr):
    """The e4m3 scale bytes of this CTA's flat step ``f`` (item ``pid + (f // n_steps) nprog``, its step
    ``f % n_steps``) in the weights' register layout ``LW`` ([warp, weight row of the slot, block]); zeros past K
    and for an item past the last."""
    item = gl.program_id(0) + (f // n_steps) * gl.num_programs(0)
    i = f % n_steps
    live = item < n_items
    tile, expert, start, count = _chunk(plan_ptr, gl.where(live, item, 0), ROW_TILES, EXPERT, START, PAIRS_IN)
    base0, base1 = _row_bases(tile, HALF, TILES, SILU)
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, LW)))[:, None, None]
    r = gl.arange(0, 16 * TILES, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))[None, :, None]
    j = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))[None, None, :]
    row = gl.minimum(gl.where(r < 8 * TILES, base0 + r, base1 + r - 8 * TILES), M - 1)
    col = 64 * i + 16 * w + j
    e = gl.where(expert < E, expert, 0).to(gl.int64)
    off = e * sf_e + (row // 128) * sf_row_tile + (row % 32) * sf_r32 + ((row % 128) // 32) * sf_r4 \
        + (col // 4) * sf_col_tile + col % 4
    return gl.load(sf_ptr + off, mask=(col < K // 16) & live, other=0)


@gluon.jit
def _sigmoid(x):
    return 1.0 / (1.0 + gl.exp(-x))


@gluon.jit
def _epilogue_inputs(plan_ptr, gs_ptr, bias_ptr, pw_ptr, tile, expert, start, count, M, HALF, E, TOP_K: gl.constexpr,
                     gs_e, gs_h, bias_e, bias_m, out_t, out_j, pw_t, pw_j, TILES: gl.constexpr,
                     ACTIVATION: gl.constexpr, HAS_GS: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_PW: gl.constexpr,
                     SORTED: gl.constexpr, LO: gl.constexpr):
    """What the item's epilogue reads from memory, loaded when the item starts and kept in their own dtypes until
    the epilogue (a conversion here would wait for the loads): each column's pair and pair weight, the global
    scales, the bias of gate (or of the row) and of up, and whether the expert is valid."""
    n = gl.arange(0, 16, layout=gl.SliceLayout(0, LO))[None, :]
    col_ok = n < count
    pair = gl.load(plan_ptr + SORTED + start + n, mask=col_ok, other=0)
    pw = gl.full([1, 16], 1.0, gl.float32, LO)
    if HAS_PW:
        pw = gl.load(pw_ptr + (pair // TOP_K).to(gl.int64) * pw_t + (pair % TOP_K) * pw_j, mask=col_ok, other=0)
    valid = expert < E
    e = gl.where(valid, expert, 0).to(gl.int64)
    gs0 = 1.0
    gs1 = 1.0
    if HAS_GS:
        gs0 = gl.load(gs_ptr + e * gs_e)
        gs1 = gl.load(gs_ptr + e * gs_e + gs_h)
    R: gl.constexpr = 16 * TILES if ACTIVATION == 0 else 8 * TILES
    rows = gl.arange(0, R, layout=gl.SliceLayout(1, LO))[:, None]
    b0 = gl.zeros([R, 1], gl.float32, LO)
    b1 = gl.zeros([R, 1], gl.float32, LO)
    if HAS_BIAS:
        if ACTIVATION == 0:
            b0 = gl.load(bias_ptr + e * bias_e + gl.minimum(tile * R + rows, M - 1) * bias_m)
        else:
            pair_row = gl.minimum(tile * R + rows, HALF - 1)
            if ACTIVATION == 1:
                gate_row = 2 * pair_row
                up_row = gate_row + 1
            else:
                gate_row = pair_row
                up_row = pair_row + HALF
            b0 = gl.load(bias_ptr + e * bias_e + gate_row * bias_m)
            b1 = gl.load(bias_ptr + e * bias_e + up_row * bias_m)
    return pair, col_ok, pw, valid, gs0, gs1, b0, b1


@gluon.jit
def _warp_sums(acc, ebuf, TILES: gl.constexpr, ACTIVATION: gl.constexpr, LSUM: gl.constexpr, LO: gl.constexpr):
    """The four warps' accumulators summed, in (row, column) order (plain) or as (gate, up) of each pair row: one
    trip through shared memory.  Each thread stores its C fragments at their (warp, row, column) places -- C[row
    8 u + g of tile t][column 8 h + 2 c + b] is accumulator element (16 t + 8 h + g, 8 u + 2 c + b) -- and loads
    every warp's value of its outputs (``LSUM``: the warps in its registers), so the sum is thread-local."""
    rc = gl.reshape(gl.permute(gl.reshape(acc, [4, TILES, 2, 8, 2, 4, 2]), [0, 1, 4, 3, 2, 5, 6]),
                    [4, 16 * TILES, 16])
    ebuf.store(rc)
    if ACTIVATION == 0:
        total = gl.convert_layout(gl.sum(ebuf.load(LSUM), axis=0), LO)
        gate = total
        up = total
    else:
        if ACTIVATION == 1:  # rows 2 i, 2 i + 1 of the tile
            view = ebuf.reshape([4, 8 * TILES, 2, 16]).permute([0, 1, 3, 2])
        else:  # the tile's two halves
            view = ebuf.reshape([4, 2, 8 * TILES, 16]).permute([0, 2, 3, 1])
        gate, up = gl.split(gl.sum(view.load(LSUM), axis=0))
        gate = gl.convert_layout(gate, LO)
        up = gl.convert_layout(up, LO)
    return gate, up


@gluon.jit
def _epilogue(acc, ebuf, out_ptr, tile, M, HALF, TOP_K: gl.constexpr, out_t, out_j, out_m, alpha, limit, pair, col_ok,
              pw, valid, gs0, gs1, b0, b1, TILES: gl.constexpr, ACTIVATION: gl.constexpr, FOLD: gl.constexpr,
              LSUM: gl.constexpr, LO: gl.constexpr):
    """The item's result: the warps' sums in fp32 (``_warp_sums``), then global scale, bias, activation and pair
    weight, rounded once into out."""
    gate, up = _warp_sums(acc, ebuf, TILES, ACTIVATION, LSUM, LO)
    if ACTIVATION == 0:
        out = gate * FOLD * gs0 + b0.to(gl.float32)
        rows = tile * (16 * TILES) + gl.arange(0, 16 * TILES, layout=gl.SliceLayout(1, LO))[:, None]
        row_ok = rows < M
    else:
        gate = gate * FOLD * gs0 + b0.to(gl.float32)
        up = up * FOLD * gs1 + b1.to(gl.float32)
        if ACTIVATION == 1:
            gate = gl.where(gate > limit, limit, gate)
            up = gl.where(up > limit, limit, gl.where(up < -limit, -limit, up))
            out = gate * _sigmoid(gate * alpha) * (up + 1.0)
        else:
            out = gate * _sigmoid(gate) * up
        rows = tile * (8 * TILES) + gl.arange(0, 8 * TILES, layout=gl.SliceLayout(1, LO))[:, None]
        row_ok = rows < HALF
    out = gl.where(valid, out * pw.to(gl.float32), 0.0)
    offsets = (pair // TOP_K).to(gl.int64) * out_t + (pair % TOP_K).to(gl.int64) * out_j
    gl.store(out_ptr + offsets + rows.to(gl.int64) * out_m, out.to(out_ptr.dtype.element_ty), mask=row_ok & col_ok)


@gluon.jit
def _consumer(wbuf, sbuf, xbuf, ebuf, ready, empty, plan_ptr, sf_ptr, gs_ptr, bias_ptr, pw_ptr, out_ptr, M, HALF, E, K,
              n_steps, ROW_TILES: gl.constexpr, TOP_K: gl.constexpr, sf_e, sf_row_tile, sf_r32, sf_r4, sf_col_tile,
              gs_e, gs_h, bias_e, bias_m, out_t, out_j, out_m, pw_t, pw_j, alpha, limit, mp0, mp1, m24, m29,
              TILES: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr, SILU: gl.constexpr,
              ACTIVATION: gl.constexpr, HAS_GS: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_PW: gl.constexpr,
              SCALE_COPY: gl.constexpr, MX: gl.constexpr, FOLD: gl.constexpr, ASM: gl.constexpr,
              CONSTRAINTS: gl.constexpr, S3: gl.constexpr, LW: gl.constexpr, LXR: gl.constexpr, W64: gl.constexpr,
              X64: gl.constexpr, W32: gl.constexpr, L32: gl.constexpr, LS: gl.constexpr, LSUM: gl.constexpr,
              LO: gl.constexpr, EXPERT: gl.constexpr, START: gl.constexpr, PAIRS_IN: gl.constexpr,
              SORTED: gl.constexpr):
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_items = gl.load(plan_ptr) * ROW_TILES
    zero = gl.zeros([4, 16 * TILES, 16], gl.int32, LW)
    # Without the scales' copies, their bytes are loaded two steps ahead; one step ahead measured level with it
    # (docs/performance.md, round 15).
    s_next = zero.to(gl.uint8)
    s_after = zero.to(gl.uint8)
    if not SCALE_COPY:
        s_next = _scale_bytes(sf_ptr, plan_ptr, 0, n_steps, n_items, ROW_TILES, M, HALF, E, K, sf_e, sf_row_tile,
                              sf_r32, sf_r4, sf_col_tile, TILES, SILU, LW, EXPERT, START, PAIRS_IN)
        s_after = _scale_bytes(sf_ptr, plan_ptr, 1, n_steps, n_items, ROW_TILES, M, HALF, E, K, sf_e, sf_row_tile,
                               sf_r32, sf_r4, sf_col_tile, TILES, SILU, LW, EXPERT, START, PAIRS_IN)
    f = 0
    for item in range(pid, n_items, nprog):
        tile, expert, start, count = _chunk(plan_ptr, item, ROW_TILES, EXPERT, START, PAIRS_IN)
        acc = gl.zeros([4, 16 * TILES, 16], gl.float32, LW)
        pair, col_ok, pw, valid, gs0, gs1, b0, b1 = _epilogue_inputs(
            plan_ptr, gs_ptr, bias_ptr, pw_ptr, tile, expert, start, count, M, HALF, E, TOP_K, gs_e, gs_h, bias_e,
            bias_m, out_t, out_j, pw_t, pw_j, TILES, ACTIVATION, HAS_GS, HAS_BIAS, HAS_PW, SORTED, LO)
        for i in range(n_steps):
            slot = f % STAGES
            if not SCALE_COPY:
                s = s_next
                s_next = s_after
                s_after = _scale_bytes(sf_ptr, plan_ptr, f + 2, n_steps, n_items, ROW_TILES, M, HALF, E, K, sf_e,
                                       sf_row_tile, sf_r32, sf_r4, sf_col_tile, TILES, SILU, LW, EXPERT, START,
                                       PAIRS_IN)
            mbarrier.wait(ready.index(slot), (f // STAGES) & 1)
            xt = _as_int64(xbuf.index(slot), ROWS, 16, X64).load(LXR)
            x0, x1, x2, x3 = _x_operands(gl.permute(xt, [1, 0, 2]), TILES, ROWS, LW, MX)
            if MX:  # the k32 step: each row's 8 scale bytes of the warp's blocks (one int64), its words split
                acc = k32_step(acc, wbuf.index(slot), k32_scales(sbuf.index(slot), TILES, S3, LS, LW), x0, x1, x2,
                               x3, zero, mp0, mp1, m24, m29, TILES, ASM, CONSTRAINTS, LW, W32, L32)
            else:
                if SCALE_COPY:
                    s = shared_view(sbuf.index(slot), gl.uint8, [16 * TILES, 4, 16], S3).permute([1, 0, 2]).load(LW)
                w = _as_int64(wbuf.index(slot), 4, 16 * TILES, W64).load(LW)
                acc = gl.inline_asm_elementwise(ASM, CONSTRAINTS, [acc, w, s, x0, x1, x2, x3, zero + mp0, zero + mp1,
                                                                   zero + m24, zero + m29],
                                                dtype=gl.float32, is_pure=True, pack=8 * TILES)
            async_copy.mbarrier_arrive(empty.index(slot), increment_count=False)
            f += 1
        _epilogue(acc, ebuf, out_ptr, tile, M, HALF, TOP_K, out_t, out_j, out_m, alpha, limit, pair, col_ok, pw,
                  valid, gs0, gs1, b0, b1, TILES, ACTIVATION, FOLD, LSUM, LO)


@gluon.jit
def moe_engine_kernel(w_desc, s_desc, x_desc, plan_ptr, sf_ptr, gs_ptr, bias_ptr, pw_ptr, out_ptr, M, HALF, E, K,
                      sf_e, sf_row_tile, sf_r32, sf_r4, sf_col_tile, gs_e, gs_h, bias_e, bias_m, out_t, out_j, out_m,
                      pw_t, pw_j, alpha, limit, mp0, mp1, m24, m29, ROW_TILES: gl.constexpr, TOP_K: gl.constexpr,
                      TILES: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr, ACTIVATION: gl.constexpr,
                      HAS_GS: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_PW: gl.constexpr, SCALE_COPY: gl.constexpr,
                      ONE_BOX: gl.constexpr, MX: gl.constexpr, FOLD: gl.constexpr, ASM: gl.constexpr,
                      CONSTRAINTS: gl.constexpr, S3: gl.constexpr, LW: gl.constexpr, LXR: gl.constexpr,
                      W64: gl.constexpr, X64: gl.constexpr, W32: gl.constexpr, L32: gl.constexpr, LS: gl.constexpr,
                      LSUM: gl.constexpr, LO: gl.constexpr, EXPERT: gl.constexpr, START: gl.constexpr,
                      PAIRS_IN: gl.constexpr, SORTED: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    n_steps = (K + 1023) // 1024
    SILU: gl.constexpr = ACTIVATION == 2
    SCALE_STEP: gl.constexpr = 32 if MX else 64  # scale bytes of a row per step
    # A slot: [4 warp chunks x 2 row halves x 8 TILES rows, 128 B] of weights (rank 3 from one copy, rank 2 from
    # eight: the same bytes); [16 TILES, SCALE_STEP] scale bytes; [ROWS, 16, 64] activation elements.
    if ONE_BOX:
        wbuf = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 4, 16 * TILES, 128], w_desc.layout)
    else:
        wbuf = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 64 * TILES, 128], w_desc.layout)
    xbuf = gl.allocate_shared_memory(x_desc.dtype, [STAGES, ROWS, 16, 64], x_desc.layout)
    if SCALE_COPY:
        sbuf = gl.allocate_shared_memory(s_desc.dtype, [STAGES, 16 * TILES, SCALE_STEP], s_desc.layout)
    else:
        sbuf = xbuf  # unused
    # The consumers' per-item exchange of accumulators ([warp, row, column] fp32).
    ebuf = gl.allocate_shared_memory(gl.float32, [4, 16 * TILES, 16], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    # ready: the weights' copies and one arrival per activation row; empty: every consumer thread
    ready, empty = ring_barriers(STAGES, 1 + ROWS, 128)
    gl.warp_specialize([
        (_consumer, (wbuf, sbuf, xbuf, ebuf, ready, empty, plan_ptr, sf_ptr, gs_ptr, bias_ptr, pw_ptr, out_ptr, M, HALF,
                     E, K, n_steps, ROW_TILES, TOP_K, sf_e, sf_row_tile, sf_r32, sf_r4, sf_col_tile, gs_e, gs_h,
                     bias_e, bias_m, out_t, out_j, out_m, pw_t, pw_j, alpha, limit, mp0, mp1, m24, m29, TILES,
                     STAGES, ROWS, SILU, ACTIVATION, HAS_GS, HAS_BIAS, HAS_PW, SCALE_COPY, MX, FOLD, ASM,
                     CONSTRAINTS, S3, LW, LXR, W64, X64, W32, L32, LS, LSUM, LO, EXPERT, START, PAIRS_IN,
                     SORTED)),
        (_producer, (w_desc, s_desc, x_desc, plan_ptr, wbuf, sbuf, xbuf, ready, empty, M, HALF, E, n_steps,
                     ROW_TILES, TOP_K, TILES, STAGES, ROWS, SILU, SCALE_COPY, ONE_BOX, SCALE_STEP, EXPERT, START,
                     PAIRS_IN, SORTED)),
    ], [1], [PRODUCER_REGS])


@functools.lru_cache(maxsize=None)
def _row_major(tiles: int, rows: int, k32: bool = False):
    """The activation slot's register layout for ``[rows, 16, 16]`` int64 (row-major copies): the engine's
    ``[16, rows, 16]`` layout (of the fold or the k32 step) with its first two coordinates swapped, so permuting it
    back moves no data."""
    lx = _layouts(tiles, rows, k32)[1]
    swap = lambda bases: [[b[1], b[0], b[2]] for b in bases]  # noqa: E731
    return gl.DistributedLinearLayout(reg_bases=swap(lx.reg_bases), lane_bases=swap(lx.lane_bases),
                                      warp_bases=swap(lx.warp_bases), block_bases=[], shape=[rows, 16, 16])


# --- the spec ------------------------------------------------------------------------------------------------------


class MoeEngine(TritonKernelSpec):
    """NVFP4 experts (either scale layout) or MXFP4 experts (scale bytes that can be copied: ``scale_copy_reason``),
    K a multiple of 64, times bf16 x, on sm_90 and newer: the routed decode engine (module docstring)."""

    name = "moe_engine"
    config_type = MoeEngineConfig
    code_orders = NATIVE_FIELD_ORDERS

    def why_not(self, case: MoeCase, target: Target) -> str | None:
        d = case.dense
        if target_reason(target) is not None:
            return target_reason(target)
        if d.fmt.name not in STEPS:
            return f"w: needs NVFP4 or MXFP4 experts, got {d.fmt.name}"
        if d.fmt.name == "mxfp4" and scale_copy_reason(case) is not None:
            return f"w: MXFP4 scale bytes come only by bulk copy, and {scale_copy_reason(case)}"
        if d.fp4_activation or d.b.dtype != torch.bfloat16:
            return "x: needs bfloat16"
        if case.pairs > MAX_PAIRS:
            return f"takes T * k <= {MAX_PAIRS} pairs (sorted in one program), got {case.pairs}"
        if case.experts > MAX_EXPERTS:
            return f"takes E <= {MAX_EXPERTS} experts, got {case.experts}"
        if d.k % 64:
            return f"needs K a multiple of 64 (the activation's copies), got K = {d.k}"
        a = d.a
        if a.align < 16 or a.batch_stride != d.m * a.row_stride:
            return "w: needs the experts' rows back to back at 16-byte aligned addresses (bulk copies)"
        if d.b.align < 16:
            return "x: needs rows contiguous along K at 16-byte aligned addresses (bulk copies)"
        return None

    def error_model(self, case: MoeCase, config: MoeEngineConfig) -> ErrorModel:
        return ErrorModel(tensor_cores=True, fold=step_fold_exponent(case.dense.fmt.name))

    def default_config(self, case: MoeCase, target: Target) -> MoeEngineConfig:
        return moe_engine_config(case, target)

    def check_config(self, config: MoeEngineConfig, case: MoeCase | None = None) -> None:
        """ValueError naming ``config`` unless ``engine.check_ring_config`` accepts it, rows is a power of two up to
        16 and ctas_per_sm 0 (one item per CTA) to 4."""
        check_ring_config(config)
        if config.rows not in (1, 2, 4, 8, 16):
            raise ValueError(f"config: expected rows 1, 2, 4, 8 or 16, got {config}")
        if not isinstance(config.ctas_per_sm, int) or not 0 <= config.ctas_per_sm <= 4:
            raise ValueError(f"config: expected ctas_per_sm from 0 to 4, got {config}")
        if not isinstance(config.scale_copy, bool) or not isinstance(config.one_box, bool):
            raise ValueError(f"config: expected scale_copy and one_box True or False, got {config}")
        if case is not None and case.dense.fmt.name == "mxfp4" and not config.scale_copy:
            raise ValueError(f"config: MXFP4 experts need scale_copy=True (their scale bytes come only by bulk "
                             f"copy), got {config}")

    def triton_launch(self, case: MoeCase, config: MoeEngineConfig, target: Target) -> TritonLaunch | None:
        return None  # two launches, the descriptors built from each call's tensors: launch() runs every call

    def __init__(self):
        # (case, config, device, which tensor arguments are 16-byte aligned) -> the two compiled kernels: the JIT
        # specializes on those alignments, the rest of what it specializes on is the case's.
        self._kept: dict[tuple, list] = {}

    def launch(self, ops: MoeOperands, config: MoeEngineConfig, target: Target) -> None:
        """The two launches: through Triton's JIT the first time for this key, then (CUDA, Triton 3.6) the kept
        compiled kernels called directly (``spec.run_compiled``: no JIT dispatch) on their kept argument lists with
        this call's tensors put in: the ids and a new plan for the chunk launch, ``_call_arguments`` for the
        engine."""
        device = ops.w_data.device
        key = (ops.case, config, device, tuple(t.data_ptr() % 16 == 0 for t in ops if isinstance(t, torch.Tensor)))
        kept = self._kept.get(key)
        if kept is None:
            launches = moe_engine_launches(ops, config, target)
            compiled = [kernel[grid](*args, **options) for kernel, grid, args, options in launches]
            if DIRECT_LAUNCH and device.type == "cuda" and all(hasattr(c, "packed_metadata") for c in compiled):
                argvs = [bound_arguments(kernel, args, options) for kernel, _, args, options in launches]
                plan_size = argvs[0][1].numel()
                argvs[0][:2] = [None, None]  # the kept lists hold no tensor of this call
                argvs[1][:CALL_ARGUMENTS] = [None] * CALL_ARGUMENTS
                self._kept[key] = (plan_size, [(c, launch[1], argv) for launch, c, argv in
                                               zip(launches, compiled, argvs)])
            return
        plan_size, ((chunks, chunk_grid, chunk_argv), (engine, grid, argv)) = kept
        plan = torch.empty(plan_size, dtype=torch.int32, device=device)
        chunk_argv = chunk_argv.copy()
        chunk_argv[0], chunk_argv[1] = ops.expert_ids, plan  # moe_chunks_kernel's ids_ptr, plan_ptr
        run_compiled(chunks, chunk_grid, chunk_argv, device.index)
        argv = argv.copy()
        argv[:CALL_ARGUMENTS] = _call_arguments(ops, config, plan)
        run_compiled(engine, grid, argv, device.index)


def scale_copy_reason(case: MoeCase) -> str | None:
    """Why the experts' scale bytes cannot come through the ring by bulk copy (``MoeEngineConfig.scale_copy``), or
    None: a copy takes linear scales whose rows (and experts) start at 16-byte aligned addresses, back to back."""
    a = case.dense.a
    if a.scale_layout != "linear":
        return "the scales are swizzled (a 32-row tile is a quarter of a 128-row atom's lines)"
    if a.scale_tile_align < 16 or a.scales.batch != case.dense.m * a.scales.r32:
        return "the scale rows are not back to back at 16-byte aligned addresses"
    return None


def one_box_reason(case: MoeCase) -> str | None:
    """Why a step's weights cannot be one bulk copy (``MoeEngineConfig.one_box``), or None: the tile's rows must be
    contiguous (no SiLU halves) and K a multiple of 256 (the copy's 128-byte lines tile the rows exactly)."""
    if case.activation == "silu":
        return "the SiLU halves are M / 2 rows apart"
    if case.dense.k % 256:
        return f"K = {case.dense.k} is not a multiple of 256"
    return None


def moe_engine_deferred(case: MoeCase) -> bool:
    """Whether the default leaves ``case`` to ``moe_weight_only`` (measured faster there, docs/performance.md, rounds
    16-17): fewer than ``MIN_TOKENS`` rows of x (at T = 1-2 the persistent grid has few items), MXFP4 experts with
    fewer than ``MXFP4_MIN_PAIRS`` pairs (moe_weight_only's k32 step is the faster one there), K within one step
    (an item's epilogue then costs as much as its step), or scale bytes loaded rather than copied."""
    few_pairs = case.dense.fmt.name == "mxfp4" and case.pairs < MXFP4_MIN_PAIRS
    return case.tokens < MIN_TOKENS or few_pairs or case.dense.k <= STEP_K or scale_copy_reason(case) is not None


@functools.lru_cache(maxsize=None)
def _copy_paths(case: MoeCase, config: MoeEngineConfig) -> tuple[bool, bool]:
    """(one weight copy per step, scale bytes copied) for ``case`` under ``config``: what the descriptors
    (``_call_arguments``) and the kernel's ``ONE_BOX`` / ``SCALE_COPY`` both follow."""
    return (config.one_box and one_box_reason(case) is None,
            config.scale_copy and scale_copy_reason(case) is None)


@functools.lru_cache(maxsize=None)
def _copy_layouts():
    """The shared-memory layouts of the copies (``engine.copy_layout``'s, made once)."""
    return dict(w2=copy_layout(128, 8, 2), w3=copy_layout(128, 8, 3), s2=copy_layout(0, 8, 2),
                x3=copy_layout(128, 16, 3), x64=copy_layout(128, 64, 3))


# The engine launch's first positional arguments that come from each call's tensors (``_call_arguments``).
CALL_ARGUMENTS = 9


def _call_arguments(ops: MoeOperands, config: MoeEngineConfig, plan: torch.Tensor) -> tuple:
    """The engine launch's arguments made from this call's tensors: the weights', scales' and activation's bulk
    copy descriptors, the plan, the scale bytes, global scales, bias, pair weights (w's scales where absent: never
    read) and out."""
    case = ops.case
    d = case.dense
    e, m, k, tiles = case.experts, d.m, d.k, config.tiles
    one_box, scale_copy = _copy_paths(case, config)
    lay = _copy_layouts()
    data = ops.w_data.view(torch.uint8)
    weights = data.as_strided((e * m, k // 2), (data.stride(1), 1))
    if one_box:
        w_desc = TensorDescriptor(weights, [k // 256, e * m, 128], [128, weights.stride(0), 1], [4, 16 * tiles, 128],
                                  lay["w3"])
    else:
        w_desc = TensorDescriptor(weights, [e * m, k // 2], [weights.stride(0), 1], [8 * tiles, 128], lay["w2"])
    sf = ops.w_scales.view(torch.uint8)
    s_desc = w_desc  # unused without the scales' copies
    if scale_copy:
        cols, step = k // d.fmt.block_size, STEP_K // d.fmt.block_size
        s_desc = TensorDescriptor(sf.as_strided((e * m, cols), (d.a.scales.r32, 1)), [e * m, cols],
                                  [d.a.scales.r32, 1], [8 * tiles, step], lay["s2"])
    x = ops.x
    x_desc = TensorDescriptor(x, [x.shape[0], k // 64, 64], [x.stride(0), 64, 1], [1, 16, 64], lay["x3"])
    gs = ops.global_scales if ops.global_scales is not None else sf
    bias = ops.bias if ops.bias is not None else sf
    pw = ops.pair_weights if ops.pair_weights is not None else sf
    return w_desc, s_desc, x_desc, plan, sf, gs, bias, pw, ops.out


def moe_engine_launches(ops: MoeOperands, config: MoeEngineConfig, target: Target = SM90):
    """The call's two launches, each (kernel, grid, positional arguments, keyword arguments)."""
    case = ops.case
    d = case.dense
    e, m, k = case.experts, d.m, d.k
    lay = plan_layout(case.pairs, e)
    plan = torch.empty(lay["size"], dtype=torch.int32, device=ops.w_data.device)
    chunks = chunk_launch(case, config.rows)
    chunk_args = fill_sources(chunks.args, ops)
    chunk_args["plan_ptr"] = plan
    first = (moe_chunks_kernel, chunks.grid, (), {**chunk_args, **chunks.options})

    tiles, rows = config.tiles, config.rows
    one_box, scale_copy = _copy_paths(case, config)
    activation = ACTIVATION_CODES[case.activation]
    half = m // 2 if activation else m
    row_tiles = -(-(half if activation else m) // ((8 if activation else 16) * tiles))
    mx = d.fmt.name == "mxfp4"
    lw, _, w64, _ = _layouts(tiles, rows, mx)
    lxr = _row_major(tiles, rows, mx)
    x64 = _copy_layouts()["x64"]
    w32, l32 = k32_weight_layouts(tiles)
    asm, constraints = step_asm(tiles, 2 if rows > 8 else 1, d.fmt.name, d.a.code_order)
    sc = d.a.scales
    sms = target.sm_count or SM90.sm_count
    items = case.pairs * row_tiles  # chunks <= pairs
    grid = (max(1, min(items, config.ctas_per_sm * sms) if config.ctas_per_sm else items),)
    args = (*_call_arguments(ops, config, plan), m, half, e, k,
            sc.batch, sc.row_tile, sc.r32, sc.r4, sc.col_tile, case.global_scales_stride,
            case.global_scales_half_stride, *case.bias_strides, *case.out_strides, *case.pair_weights_strides,
            case.alpha, case.limit, *multipliers("bf16", d.a.code_order).values())
    # The row tiles and k as constants: the item's division by them and the pairs' by k are a few integer
    # instructions (a division by a runtime value is a reciprocal and a correction).
    options = dict(ROW_TILES=row_tiles, TOP_K=case.top_k, TILES=tiles, STAGES=config.stages, ROWS=rows,
                   ACTIVATION=activation, HAS_GS=case.global_scales is not None, HAS_BIAS=case.bias_dtype is not None,
                   HAS_PW=case.pair_weights_dtype is not None, SCALE_COPY=scale_copy, ONE_BOX=one_box, MX=mx,
                   FOLD=2.0 ** step_fold_exponent(d.fmt.name), ASM=asm, CONSTRAINTS=constraints,
                   S3=_SCALE_ROWS if mx else _SCALE_VIEW, LW=lw, LSUM=_SUM_ROWS if activation == 0 else _SUM_PAIRS,
                   LO=gl.SliceLayout(0, _SUM_ROWS) if activation == 0 else _PAIR_OUT, LXR=lxr, W64=w64, X64=x64,
                   W32=w32, L32=l32, LS=_k32_scale_layout(tiles),
                   EXPERT=lay["expert"], START=lay["start"], PAIRS_IN=lay["pairs_in"], SORTED=lay["sorted"],
                   PRODUCER_REGS=PRODUCER_REGS, num_warps=WARPS, maxnreg=config.maxnreg)
    return [first, (moe_engine_kernel, grid, args, options)]

