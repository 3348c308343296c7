"""The W4A4 N = 1 kernel (``kernels/w4a4.py``) restructured around the memory system (issue 12).

Same decode and numerics as ``w4a4_gemv_kernel``; what changes is how the bytes reach the decode.  In the
shipped kernel a step's weights and scales are loaded into registers; ptxas issues the scale loads late in the
loop body (after most of the decode), so each step waits on two DRAM round trips one after the other, and the
bytes in flight per SM are bounded by the registers of the resident warps.  Here:

* ``STAGES >= 2``: the weights and the activation are copied into shared memory by ``cp.async`` up to
  ``STAGES - 1`` steps ahead (Triton's software pipeliner, asked for through ``tl.range(num_stages=...)``;
  without that attribute it only stages loads that feed a ``dot``).  Bytes in flight cost no registers.
* The weight and activation scales (16-bit loads, too narrow for ``cp.async``) are loaded one step ahead into
  registers, so their latency overlaps a whole step.  ``STAGES = 1`` keeps only this change.
* ``PERSISTENT``: a grid of a few programs per SM, each walking tiles ``pid, pid + grid, ...``; the tile loop and
  the K loop are flattened into one pipelined loop (``tl.range(flatten=True)``), so the copies of a program's
  next tile are in flight while it reduces and stores the current one.

The tile is ``[LANE_ROWS, KSPLIT, WARP_ROWS, ROWS_PER_THREAD, BLOCKS]``: Triton lays BLOCKS over lanes (two blocks,
one 16-byte load, per lane), then LANE_ROWS (64 / BLOCKS rows side by side in a warp), warps over KSPLIT (side
by side along K) and then WARP_ROWS, and keeps ROWS_PER_THREAD rows in each thread.  The activation is the tile
without the ROWS_PER_THREAD dimension: the same layout, so one copy and one decode per thread serve all its rows
by a register broadcast (a tile of a different layout would be converted through shared memory every step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backends import interpreting
from ._common import ScaleAddressing, decode_scale, scale_row_offset, store_rounded
from ._decode import MAG_TABLE, activation_bytes, block_dot_ptx, block_dot_triton, doubled_e2m1, unpack_block
from .configs import GemvConfig
from .w4a4 import _prefetch_blocks, l2_prefetch, scale_rows_even


@triton.jit
def _scale_col(j, stride_col_tile, SCALE_BLOCK: tl.constexpr):
    """``w4a4._scale_col`` for this kernel's 5-d tiles: the byte offsets of the scale columns a lane loads, two
    contiguous bytes (NVFP4: its two blocks; MXFP4: the aligned column pair holding their one scale)."""
    if SCALE_BLOCK == 16:
        col = j
    else:
        col = (j // 4) * 2 + j % 2
    offset = (col // 4) * stride_col_tile + col % 4
    return tl.max_contiguous(tl.multiple_of(offset, [1, 1, 1, 1, 2]), [1, 1, 1, 1, 2])


@triton.jit
def _scale_step(j0, stride_col_tile, SCALE_BLOCK: tl.constexpr):
    """The scalar part of ``_scale_col(j0 + cols)`` for a step starting at block ``j0`` (a multiple of 4 blocks
    for NVFP4, 8 for MXFP4): ``_scale_col(j0 + cols) = _scale_col(cols) + _scale_step(j0)``.  Column tiles are 4
    bytes or 512 apart, so the stride is written as a multiple of 4: the sum keeps the 2-byte alignment the
    16-bit loads need."""
    return (j0 // (4 * (SCALE_BLOCK // 16))) * ((stride_col_tile // 4) * 4)


@triton.jit
def _scale_mask(j, NB, SCALE_BLOCK: tl.constexpr):
    """Blocks ``j`` whose scale column exists (MXFP4: a lane's column pair can reach past the row's last)."""
    ok = j < NB
    if SCALE_BLOCK == 32:
        ok = ok & ((j // 4) * 2 + j % 2 < NB // 2)
    return ok


@triton.jit
def _load_scales(j0, cols, NB, sfa_cols, sfb_cols, sfa_stride_col_tile, sfb_stride_col_tile,
                 EVEN_K: tl.constexpr, SCALE_BLOCK: tl.constexpr, STEP: tl.constexpr):
    """Weight scales (full tile) and activation scales (activation tile) of the step at block ``j0``: one
    16-bit load per lane and row.  ``sfa_cols``, ``sfb_cols``: the scale pointers of the first step."""
    if STEP % (4 * (SCALE_BLOCK // 16)) == 0:
        sfa_ptrs = sfa_cols + _scale_step(j0, sfa_stride_col_tile, SCALE_BLOCK)
        sfb_ptrs = sfb_cols + _scale_step(j0, sfb_stride_col_tile, SCALE_BLOCK)
    else:  # steps of 2 blocks (MXFP4: 2 or 4): the whole column formula every step
        sfa_ptrs = sfa_cols + (_scale_col(j0 + cols, sfa_stride_col_tile, SCALE_BLOCK)
                               - _scale_col(cols, sfa_stride_col_tile, SCALE_BLOCK))
        sfb_ptrs = sfb_cols + (_scale_col(j0 + cols, sfb_stride_col_tile, SCALE_BLOCK)
                               - _scale_col(cols, sfb_stride_col_tile, SCALE_BLOCK))
    if EVEN_K:
        return tl.load(sfa_ptrs), tl.load(sfb_ptrs)
    ok = _scale_mask(j0 + cols, NB, SCALE_BLOCK)
    return tl.load(sfa_ptrs, mask=ok, other=0), tl.load(sfb_ptrs, mask=ok, other=0)


@triton.jit
def _mx_scale_pairs(sfa, sfb, j):
    """MXFP4: each block's decoded sfa * sfb from the column pairs ``_load_scales`` loads (a lane holds columns
    2p, 2p + 1 and needs column j // 2 of its blocks), decoded once per lane."""
    pairs: tl.constexpr = [sfa.shape[0], sfa.shape[1], sfa.shape[2], sfa.shape[3], sfa.shape[4] // 2, 2]
    a0, a1 = tl.split(tl.reshape(sfa, pairs))
    b0, b1 = tl.split(tl.reshape(tl.broadcast_to(sfb, sfa.shape), pairs))
    j_even, _ = tl.split(tl.reshape(tl.broadcast_to(j, sfa.shape), pairs))
    odd = (j_even // 2) % 2 == 1
    scale = decode_scale(tl.where(odd, a1, a0), 32) * decode_scale(tl.where(odd, b1, b0), 32)
    return tl.reshape(tl.join(scale, scale), sfa.shape)


@triton.jit
def _step_sums(a, sfa, b, sfb, j, tab_lo, tab_hi, USE_PTX: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """4 * (block dot product) * sfa * sfb of every block of the step; ``b`` and ``sfb`` are activation tiles,
    decoded once and broadcast over the rows of each thread."""
    if SCALE_BLOCK == 16:
        scale = decode_scale(sfa, 16) * decode_scale(tl.broadcast_to(sfb, sfa.shape), 16)
    else:
        scale = _mx_scale_pairs(sfa, sfb, j)
    if USE_PTX:
        b_lo, b_hi = activation_bytes(b, tab_lo, tab_hi)
        block = block_dot_ptx(a, tl.broadcast_to(b_lo, a.shape), tl.broadcast_to(b_hi, a.shape), tab_lo, tab_hi)
    else:
        b_dbl = doubled_e2m1(unpack_block(b)).to(tl.int32)  # [..., 16]
        b_full: tl.constexpr = [a.shape[0], a.shape[1], a.shape[2], a.shape[3], a.shape[4], 16]
        block = block_dot_triton(a, tl.broadcast_to(b_dbl, b_full))
    return block * scale


@triton.jit
def _tile(tile, cols, M, NB, n_row_tiles,
          a_ptr, b_ptr, sfa_ptr, sfb_ptr, gsa_ptr, gsb_ptr, c_ptr,
          a_stride_l, a_stride_m, b_stride_l,
          sfa_stride_l, sfa_stride_row_tile, sfa_stride_r32, sfa_stride_r4, sfa_stride_col_tile,
          sfb_stride_l, sfb_stride_col_tile, c_stride_l, c_stride_m, tab_lo, tab_hi,
          LANE_ROWS: tl.constexpr, KSPLIT: tl.constexpr, WARP_ROWS: tl.constexpr, ROWS_PER_THREAD: tl.constexpr,
          BLOCKS: tl.constexpr, EVEN_K: tl.constexpr, USE_PTX: tl.constexpr, HAS_GSA: tl.constexpr,
          HAS_GSB: tl.constexpr, K_STAGES: tl.constexpr, SCALE_BLOCK: tl.constexpr, SCALE_ROWS_EVEN: tl.constexpr):
    """Compute and store the outputs of tile ``tile`` (row tiles of batch 0 first, then of batch 1, ...)."""
    STEP: tl.constexpr = KSPLIT * BLOCKS
    ROWS: tl.constexpr = LANE_ROWS * WARP_ROWS * ROWS_PER_THREAD
    pid_m = tile % n_row_tiles
    pid_l = (tile // n_row_tiles).to(tl.int64)
    rows3 = (pid_m * ROWS + tl.arange(0, LANE_ROWS)[:, None, None]
             + (tl.arange(0, WARP_ROWS) * LANE_ROWS)[None, :, None]
             + (tl.arange(0, ROWS_PER_THREAD) * (LANE_ROWS * WARP_ROWS))[None, None, :])
    rows = rows3[:, None, :, :, None]
    rows_in = tl.minimum(rows, M - 1)  # tail rows re-read row M - 1; only the store is masked
    a_rows = a_ptr + pid_l * a_stride_l + rows_in.to(tl.int64) * a_stride_m
    sfa_row_offset = scale_row_offset(rows_in, sfa_stride_row_tile, sfa_stride_r32, sfa_stride_r4)
    if SCALE_ROWS_EVEN:  # 16-bit scale loads: an alignment fact Triton's analysis follows (see w4a4.py)
        sfa_row_offset = (sfa_row_offset // 2) * 2
    sfa_cols = sfa_ptr + pid_l * sfa_stride_l + sfa_row_offset + _scale_col(cols, sfa_stride_col_tile, SCALE_BLOCK)
    act_zero = tl.zeros([LANE_ROWS, 1, WARP_ROWS, 1, 1], dtype=tl.int32)
    b_rows = b_ptr + pid_l * b_stride_l + act_zero
    sfb_cols = sfb_ptr + pid_l * sfb_stride_l + act_zero + _scale_col(cols, sfb_stride_col_tile, SCALE_BLOCK)

    acc = tl.zeros([LANE_ROWS, KSPLIT, WARP_ROWS, ROWS_PER_THREAD, BLOCKS], dtype=tl.float32)
    sfa_next, sfb_next = _load_scales(0, cols, NB, sfa_cols, sfb_cols, sfa_stride_col_tile, sfb_stride_col_tile,
                                      EVEN_K, SCALE_BLOCK, STEP)
    for j0 in tl.range(0, NB, STEP, num_stages=K_STAGES):
        j = j0 + cols
        if EVEN_K:
            a = tl.load(a_rows + j)
            b = tl.load(b_rows + j)
        else:
            a = tl.load(a_rows + j, mask=j < NB, other=0)
            b = tl.load(b_rows + j, mask=j < NB, other=0)
        sfa, sfb = sfa_next, sfb_next
        # The next step's scales now, so that their latency overlaps this step.  After the last step they
        # re-read the last step (EVEN_K: no mask needed) or are masked off.
        j_next = j0 + STEP
        if EVEN_K:
            j_next = tl.minimum(j_next, NB - STEP)
        sfa_next, sfb_next = _load_scales(j_next, cols, NB, sfa_cols, sfb_cols, sfa_stride_col_tile,
                                          sfb_stride_col_tile, EVEN_K, SCALE_BLOCK, STEP)
        acc += _step_sums(a, sfa, b, sfb, j, tab_lo, tab_hi, USE_PTX, SCALE_BLOCK)
    # Block sums carry a factor 4 from the doubled operands; global scales (fp32) apply to the sum.
    out = tl.sum(tl.sum(acc, axis=4), axis=1) * 0.25  # [LANE_ROWS, WARP_ROWS, ROWS_PER_THREAD], like rows3
    if HAS_GSA:
        out = out * tl.load(gsa_ptr)
    if HAS_GSB:
        out = out * tl.load(gsb_ptr)
    store_rounded(c_ptr + pid_l * c_stride_l + rows3 * c_stride_m, out, rows3 < M)


@triton.jit
def w4a4_async_kernel(
    a_ptr, b_ptr, sfa_ptr, sfb_ptr, gsa_ptr, gsb_ptr, c_ptr,
    M, NB, n_row_tiles, n_tiles,
    a_stride_l, a_stride_m,
    b_stride_l,
    sfa_stride_l, sfa_stride_row_tile, sfa_stride_r32, sfa_stride_r4, sfa_stride_col_tile,
    sfb_stride_l, sfb_stride_col_tile,
    c_stride_l, c_stride_m,
    mag_lo, mag_hi,
    LANE_ROWS: tl.constexpr,
    KSPLIT: tl.constexpr,
    WARP_ROWS: tl.constexpr,
    ROWS_PER_THREAD: tl.constexpr,
    BLOCKS: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PTX: tl.constexpr,
    HAS_GSA: tl.constexpr = False,
    HAS_GSB: tl.constexpr = False,
    STAGES: tl.constexpr = 3,
    PERSISTENT: tl.constexpr = False,
    PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,
    SCALE_BLOCK: tl.constexpr = 16,
    SCALE_ROWS_EVEN: tl.constexpr = False,
):
    cols = (tl.arange(0, KSPLIT) * BLOCKS)[None, :, None, None, None] + tl.arange(0, BLOCKS)[None, None, None, None, :]
    # The prmt table in per-thread registers (see w4a4_gemv_kernel: a uniform table costs a copy per prmt).
    tab_lo = tl.where(cols < NB, mag_lo, 0)
    tab_hi = tl.where(cols < NB, mag_hi, 0)
    # STAGES < 2: plain loads (no attribute: the pipeliner leaves the loop alone).
    K_STAGES: tl.constexpr = STAGES if STAGES >= 2 and not PERSISTENT else None
    if PDL:
        # As in w4a4_gemv_kernel: let the next kernel start, prefetch the first weights of this program's first
        # tile into L2 (no registers filled: nothing the previous kernel writes can be read stale), then wait.
        tl.extra.cuda.gdc_launch_dependents()
        if PREFETCH > 0:
            ROWS: tl.constexpr = LANE_ROWS * WARP_ROWS * ROWS_PER_THREAD
            tile = tl.program_id(0)
            first = ((tile % n_row_tiles) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
            first_rows = a_ptr + (tile // n_row_tiles).to(tl.int64) * a_stride_l + tl.minimum(first, M - 1) * a_stride_m
            l2_prefetch(first_rows[:, None] + (tl.arange(0, PREFETCH // 16) * 16)[None, :])
        tl.extra.cuda.gdc_wait()
    if PERSISTENT:
        P_STAGES: tl.constexpr = STAGES if STAGES >= 2 else None
        for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=True, num_stages=P_STAGES):
            _tile(tile, cols, M, NB, n_row_tiles, a_ptr, b_ptr, sfa_ptr, sfb_ptr, gsa_ptr, gsb_ptr, c_ptr,
                  a_stride_l, a_stride_m, b_stride_l, sfa_stride_l, sfa_stride_row_tile, sfa_stride_r32,
                  sfa_stride_r4, sfa_stride_col_tile, sfb_stride_l, sfb_stride_col_tile, c_stride_l, c_stride_m,
                  tab_lo, tab_hi, LANE_ROWS, KSPLIT, WARP_ROWS, ROWS_PER_THREAD, BLOCKS, EVEN_K, USE_PTX, HAS_GSA,
                  HAS_GSB, None, SCALE_BLOCK, SCALE_ROWS_EVEN)
    else:
        _tile(tl.program_id(0), cols, M, NB, n_row_tiles, a_ptr, b_ptr, sfa_ptr, sfb_ptr, gsa_ptr, gsb_ptr, c_ptr,
              a_stride_l, a_stride_m, b_stride_l, sfa_stride_l, sfa_stride_row_tile, sfa_stride_r32,
              sfa_stride_r4, sfa_stride_col_tile, sfb_stride_l, sfb_stride_col_tile, c_stride_l, c_stride_m,
              tab_lo, tab_hi, LANE_ROWS, KSPLIT, WARP_ROWS, ROWS_PER_THREAD, BLOCKS, EVEN_K, USE_PTX, HAS_GSA,
              HAS_GSB, K_STAGES, SCALE_BLOCK, SCALE_ROWS_EVEN)


def tile_shape(config: GemvConfig) -> tuple[int, int, int, int, int]:
    """(LANE_ROWS, KSPLIT, WARP_ROWS, ROWS_PER_THREAD, BLOCKS) of ``config``: warps go along K first (up to
    ``ksplit``), the rest side by side over rows."""
    lane_rows = min(max(1, 64 // config.blocks), config.rows)
    warp_rows = max(1, config.num_warps // config.ksplit)
    rows_per_thread = config.rows // (lane_rows * warp_rows)
    return lane_rows, config.ksplit, warp_rows, rows_per_thread, config.blocks


def check_async_config(config: GemvConfig) -> None:
    """Raise ValueError when ``config`` has no tile for ``w4a4_async_kernel``: a warp spans 64 / blocks whole rows
    (a 16-byte load of two blocks per lane), and the warps beyond ``ksplit`` sit side by side over rows."""
    warp_rows = max(1, config.num_warps // config.ksplit)
    rows_per_step = (64 // config.blocks) * warp_rows if 2 <= config.blocks <= 64 else 0
    if not rows_per_step or config.rows % rows_per_step:
        raise ValueError(f"config: expected blocks from 2 to 64 and rows a multiple of (64 / blocks) * "
                         f"max(1, num_warps / ksplit) = {rows_per_step or '?'}, got {config}")


def launch_w4a4_async(
    a_blocks: torch.Tensor,
    sfa: torch.Tensor,
    sfa_addressing: ScaleAddressing,
    b_blocks: torch.Tensor,
    sfb: torch.Tensor,
    sfb_addressing: ScaleAddressing,
    c: torch.Tensor,
    *,
    config: GemvConfig,
    use_ptx: bool,
    global_scale_a: torch.Tensor | None = None,
    global_scale_b: torch.Tensor | None = None,
    scale_block: int = 16,
) -> None:
    """Launch :func:`w4a4_async_kernel` on the operands of ``w4a4.launch_w4a4`` (same views, same contract);
    ``config.stages`` and ``config.persistent`` choose the variant (``kernels.configs.GemvConfig``)."""
    check_async_config(config)
    batch, m, nb = a_blocks.shape
    lane_rows, ksplit, warp_rows, rows_per_thread, blocks = tile_shape(config)
    n_row_tiles = triton.cdiv(m, config.rows)
    n_tiles = n_row_tiles * batch
    pdl = config.pdl and not interpreting()
    args = (
        a_blocks, b_blocks, sfa, sfb,
        sfa if global_scale_a is None else global_scale_a,
        sfa if global_scale_b is None else global_scale_b,
        c,
        m, nb, n_row_tiles, n_tiles,
        a_blocks.stride(0), a_blocks.stride(1),
        b_blocks.stride(0),
        *sfa_addressing,
        sfb_addressing.batch, sfb_addressing.col_tile,
        c.stride(0), c.stride(1),
        *MAG_TABLE,
    )
    kwargs = dict(
        LANE_ROWS=lane_rows, KSPLIT=ksplit, WARP_ROWS=warp_rows, ROWS_PER_THREAD=rows_per_thread, BLOCKS=blocks,
        EVEN_K=nb % (blocks * ksplit) == 0, USE_PTX=use_ptx,
        HAS_GSA=global_scale_a is not None, HAS_GSB=global_scale_b is not None,
        STAGES=config.stages, PERSISTENT=bool(config.persistent), PDL=pdl,
        PREFETCH=_prefetch_blocks(config, nb) if pdl else 0,
        SCALE_BLOCK=scale_block, SCALE_ROWS_EVEN=scale_rows_even(sfa, sfa_addressing),
        num_warps=config.num_warps, num_stages=1, launch_pdl=pdl,
    )
    if config.maxnreg:
        kwargs["maxnreg"] = config.maxnreg
    grid = n_tiles
    if config.persistent:
        # Under the interpreter, one stand-in SM: a few programs walk many tiles, as on the GPU.
        per_sm = config.persistent if interpreting() else min(config.persistent, _resident_programs(args, kwargs))
        sms = 1 if interpreting() else torch.cuda.get_device_properties(a_blocks.device).multi_processor_count
        grid = min(n_tiles, sms * per_sm)
    w4a4_async_kernel[(grid,)](*args, **kwargs)


_RESIDENT: dict = {}


def _resident_programs(args: tuple, kwargs: dict) -> int:
    """How many programs of this compiled kernel fit on one SM at once (registers, shared memory, threads):
    a persistent grid must not exceed it, or its last programs start only when others have finished."""
    compiled = w4a4_async_kernel.warmup(*args, grid=(1,), **kwargs)
    if hasattr(compiled, "result"):  # Triton's asynchronous compilation hands out a future
        compiled = compiled.result()
    key = (id(compiled), args[0].device.index)
    if key not in _RESIDENT:
        compiled._init_handles()
        props = torch.cuda.get_device_properties(args[0].device)
        warps = kwargs["num_warps"]
        # Registers are allocated per warp in units of 256 of the SM's 64 K.  Shared memory: an SM has 1 KB more
        # than a program may opt in to, and reserves 1 KB per program.
        regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256
        by_regs = (65536 // regs_per_warp) // warps
        optin = triton.runtime.driver.active.utils.get_device_properties(args[0].device.index)["max_shared_mem"]
        by_smem = (optin + 1024) // (compiled.metadata.shared + 1024)
        by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
        _RESIDENT[key] = max(1, min(by_regs, by_smem, by_threads, 32))
    return _RESIDENT[key]
